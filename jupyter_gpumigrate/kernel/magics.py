"""``%migrate``: move this kernel to another GPU or host, suspend it, list GPUs and kernels, or pick a GPU
in a widget."""

from __future__ import annotations

import sys
import time

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .client import ApiError, NotManaged, ServerClient

GB = 1e9


class MigrateFailed(Exception):
    """Shown as its one sentence, never as a traceback (IPython calls ``_render_traceback_``)."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mmigrate: {self}\x1b[0m"]


def release_torch_cache() -> None:
    """Drop the GPU blocks PyTorch caches but does not use: they would be moved too. Only if this kernel
    already uses CUDA through torch (never initialise CUDA here).

    Raises :class:`MigrateFailed` when torch's CUDA context is broken (a device-side assert, an
    illegal access: CUDA errors stick to the context), before anything is asked of the server."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise MigrateFailed(
            f"PyTorch's CUDA context reports an error ({first}), so this kernel was not moved: such errors "
            "stick to the process; save what you need and restart the kernel."
        ) from None


def human(n: int | None) -> str:
    """Bytes for a person: MB below a GB, GB above (powers of 1000, like describe())."""
    n = n or 0
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def describe(op: dict) -> str:
    """One line for a finished move: from, to, bytes moved, total time and the slowest phase."""
    timings = op.get("timings") or {}
    slowest = max(timings, key=timings.get) if timings else None
    slow = f"; slowest phase {slowest} {timings[slowest]:.2f} s" if slowest else ""
    if op.get("to_host"):
        gpu = f", GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
        return (f"Moved from host {op.get('from_host')} to host {op['to_host']}{gpu}: {op.get('bytes', 0) / GB:.2f} GB "
                f"in {op.get('total', 0):.2f} s{slow}. This notebook reaches it through {op.get('from_host')} "
                f"if that is its home; everything in memory came along.")
    fast = op.get("fast_path") or {}
    if fast.get("stashed"):
        how = f" ({fast['stashed'] / GB:.1f} GB of tensors by the fast path)"
    elif fast.get("reason"):
        how = f" (by the driver alone: {fast['reason']})"
    else:
        how = ""
    return (f"Moved from GPU {op.get('from_gpu')} to GPU {op.get('to_gpu')}: {op.get('bytes', 0) / GB:.1f} GB "
            f"in {op.get('total', 0):.2f} s{how}{slow}. torch still calls it cuda:0.")


def gpu_table(gpus: dict, kernels: list[dict], me: str) -> str:
    """GPUs with memory, utilisation and their kernels (this one marked *), then kernels on no GPU."""
    lines = []
    on_gpu = set()
    if not gpus["gpus"]:
        lines.append("No NVIDIA GPU is visible to the Jupyter server.")
    for g in gpus["gpus"]:
        held = []
        for k in g["kernels"]:
            on_gpu.add(k["id"])
            held.append(f"{k['id'][:8]}{'*' if k['id'] == me else ''} ({k['memory_used'] / GB:.1f} GB)")
        util = "-" if g["utilization"] is None else f"{g['utilization']}%"
        lines.append(f"GPU {g['index']}  {g['name']}  {g['memory_used'] / GB:.1f}/{g['memory_total'] / GB:.1f} GB"
                     f"  util {util}  kernels: {', '.join(held) or '-'}")
    others = [f"{k['id'][:8]}{'*' if k['id'] == me else ''} ({k['state']})" for k in kernels if k["id"] not in on_gpu]
    if others:
        lines.append(f"No GPU: {', '.join(others)}")
    away = [f"{k['id'][:8]}{'*' if k['id'] == me else ''} on {k['host']}" for k in kernels if k.get("remote")]
    if away:
        lines.append(f"On other hosts: {', '.join(away)}")
    if gpus.get("peers"):
        lines.append(f"Host {gpus.get('host')}; peers: {', '.join(gpus['peers'])}")
    lines.append("* this kernel")
    return "\n".join(lines)


def describe_suspension(suspended: dict, resumed: dict | None, view: dict) -> str:
    """One line for a kernel that suspended itself and is back: for how long, where it runs now (NVML,
    through the server), the size of its images, and how long the resume took if known."""
    end = (resumed or {}).get("finished") or time.time()
    away = max(0.0, end - (suspended.get("finished") or end))
    on = [g["index"] for g in view.get("gpus") or []]
    where = ("GPU " + ", ".join(str(i) for i in on)) if on else "CPU (this kernel holds no GPU memory)"
    took = f" in {resumed['total']:.2f} s" if resumed and resumed.get("status") == "succeeded" else ""
    by = " (started by a cell)" if resumed and resumed.get("trigger") == "cell" else ""
    return (f"Suspended for {away:.1f} s ({human(suspended.get('bytes'))} of images); resumed on {where}"
            f"{took}{by}. Everything in memory is as it was.")


def _host_name(raw: str | None) -> str | None:
    """--to-host's value without the quotes IPython leaves around it; UsageError if empty."""
    if raw is None:
        return None
    name = raw.strip()
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "'\"":
        name = name[1:-1].strip()
    if not name:
        raise UsageError("%migrate: --to-host needs a server's name (got an empty one); %migrate --list shows "
                         "this server's name and its peers.")
    return name


@magics_class
class MigrateMagics(Magics):
    def _client(self) -> ServerClient:
        try:
            return ServerClient.from_env()
        except NotManaged as exc:
            raise MigrateFailed(str(exc)) from None

    @magic_arguments()
    @argument("--to-gpu", type=int, metavar="N", help="move this kernel to GPU N (NVML's index) now")
    @argument("--to-host", metavar="NAME", help="move this kernel to the peer server NAME (with --to-gpu: onto "
              "its GPU N); the name of this kernel's home server brings it back")
    @argument("--suspend", action="store_true", help="write this kernel to disk and free its memory, now; the cell "
              "finishes once the kernel is resumed (panel, CLI, or by running a cell)")
    @argument("--list", action="store_true", help="print the GPUs, their memory and kernels")
    @argument("--help", action="store_true", help="show this help")
    @line_magic
    def migrate(self, line: str) -> None:
        """Move this kernel to another GPU while it runs, with everything in its memory.

        %migrate              a picker: each GPU, its memory and kernels, and a Migrate button
        %migrate --to-gpu N   move this kernel to GPU N; prints from, to, bytes, time, slowest phase
        %migrate --to-host B  move this kernel to the peer server B (add --to-gpu N for its GPU N);
                              the notebook stays where it is; --to-host with the home server's name
                              brings the kernel back
        %migrate --list       the GPUs and the kernels on them (this one marked *), and the hosts
        %migrate --suspend    write this kernel to disk and free its memory (GPU memory too); the cell
                              waits, and once the kernel is resumed (panel, jupyter gpumigrate resume,
                              or running a cell) prints for how long, where it runs and the image size

        After a move PyTorch still calls the device cuda:0. The cell with %migrate goes on once the
        move is done; a failed move leaves the kernel where it was, running.
        """
        try:
            args = parse_argstring(self.migrate, line)
        except ValueError as exc:  # shlex: an unbalanced quote
            raise UsageError(f"%migrate: {exc} in {line.strip()!r}: close the quote or drop it.") from None
        if args.help:
            print(self.migrate.__doc__.lstrip().removeprefix("::").lstrip("\n"))
            return
        to_host = _host_name(args.to_host)
        target = args.to_gpu is not None or to_host is not None
        if sum((args.list, args.suspend, target)) > 1:
            raise UsageError("%migrate: give one of --list, --suspend or a target (--to-gpu N, --to-host NAME).")
        if args.to_gpu is not None and args.to_gpu < 0:
            raise UsageError(f"%migrate: --to-gpu takes a GPU index, 0 or more (got {args.to_gpu}).")
        client = self._client()
        try:
            if args.list:
                print(gpu_table(client.gpus(), client.kernels(), client.kernel_id))
            elif args.suspend:
                print(self._suspend(client))
            elif target:
                release_torch_cache()
                op = client.migrate(args.to_gpu, to_host, fast_path=None if to_host else "caller")
                if op.get("stager"):
                    # This cell is the only code running: serve the move's fast path from here.
                    from .stager import run

                    run(op["stager"]["path"], op["stager"]["token"])
                op = client.follow(op)
                if op["status"] != "succeeded":
                    raise MigrateFailed(f"{op['error']} (phase {op.get('failed_phase') or op.get('phase')})")
                print(describe(op))
            else:
                from .widget import MigrateWidget

                MigrateWidget(client).show()
        except ApiError as exc:
            raise MigrateFailed(str(exc)) from None
        except KeyboardInterrupt:
            # The server delivers an interrupt only once a move is over (a half-moved kernel is never
            # interrupted): only the waiting here was cut short.
            raise MigrateFailed("Interrupted while waiting; %migrate --list shows where the kernel is now.") from None

    @staticmethod
    def _suspend(client: ServerClient) -> str:
        """Ask the server to suspend this very process, and say how it went once it runs again.

        The server dumps the kernel while this cell waits on the operation: the process stops here and
        goes on from here when it is restored. CRIU restores its TCP connections closed (--tcp-close),
        so the request in flight fails and :meth:`ServerClient.follow` dials again.
        """
        release_torch_cache()
        op = client.follow(client.suspend())
        if op["status"] != "succeeded":
            raise MigrateFailed(f"{op['error']} (phase {op.get('failed_phase') or op.get('phase')})")
        # Running again: restored by a resume, which may still be adopting this process.
        view = client.me()
        resumed = None
        if view.get("operation"):
            resumed = client.follow(client.operation(view["operation"]))
            view = client.me()
            if resumed.get("action") != "resume":
                resumed = None
        return describe_suspension(op, resumed, view)
