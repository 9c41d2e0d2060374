"""``%migrate``: move this kernel to another GPU or host, suspend it, list GPUs and kernels, or pick a GPU
in a widget."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ..opformat import describe, describe_suspension, failure, gb
from .client import ApiError, MigrateFailed, NotManaged, ServerClient, release_torch_cache


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
            held.append(f"{k['id'][:8]}{'*' if k['id'] == me else ''} ({gb(k['memory_used'])} GB)")
        util = "-" if g["utilization"] is None else f"{g['utilization']}%"
        lines.append(f"GPU {g['index']}  {g['name']}  {gb(g['memory_used'])}/{gb(g['memory_total'])} GB"
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


def _gpu_indices(text: str | None) -> list[int] | None:
    """``--to-gpu``: one GPU index, or several separated by commas (a kernel on several GPUs)."""
    if text is None:
        return None
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"%migrate: --to-gpu takes a GPU index, or one per GPU the kernel holds separated by "
                         f"commas (1,0); got {text!r}.") from None
    if any(i < 0 for i in indices):
        raise UsageError(f"%migrate: --to-gpu takes GPU indices, 0 or more (got {text}).")
    return indices


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
    @argument("--to-gpu", metavar="N", help="move this kernel to GPU N (NVML's index) now; a kernel on several "
              "GPUs names one per GPU it holds, in the order of their indices (1,0 swaps GPUs 0 and 1)")
    @argument("--to-host", metavar="NAME", help="move this kernel to the peer server NAME (with --to-gpu: onto "
              "its GPU N); the name of this kernel's home server brings it back")
    @argument("--suspend", action="store_true", help="write this kernel to memory or disk (--images) and free its GPU, now; the cell "
              "finishes once the kernel is resumed (panel, CLI, or by running a cell)")
    @argument("--images", choices=("auto", "memory", "disk"), help="with --suspend: where the images go (memory: "
              "fast, holds host memory; disk; auto: memory where there is room); default: the server's")
    @argument("--to-cpu", action="store_true", help="transplant this kernel's objects into a new kernel without "
              "a GPU (says first what would not carry, and asks)")
    @argument("--transplant", action="store_true", help="with --to-gpu: carry the objects into a new process on "
              "that GPU, of any model, instead of moving the process (says first what would not carry, and asks)")
    @argument("--back", action="store_true", help="after a transplant: go back to the process it replaced (kept "
              "for a while), losing what this kernel did since (asks first)")
    @argument("--yes", action="store_true", help="with a transplant or --back: do not ask")
    @argument("--list", action="store_true", help="print the GPUs, their memory and kernels")
    @argument("--help", action="store_true", help="show this help")
    @line_magic
    def migrate(self, line: str) -> None:
        """Move this kernel to another GPU while it runs, with everything in its memory.

        %migrate              a picker: each GPU, its memory and kernels, and a Migrate button
        %migrate --to-gpu N   move this kernel to GPU N; prints from, to, bytes, time, slowest phase
        %migrate --to-gpu 1,0 a kernel on several GPUs: one target per GPU it holds, in the order of
                              their indices (here GPUs 0 and 1 swap); the driver moves them together
        %migrate --to-host B  move this kernel to the peer server B (add --to-gpu N for its GPU N);
                              the notebook stays where it is; --to-host with the home server's name
                              brings the kernel back
        %migrate --to-cpu     where the driver cannot go: this kernel's objects are carried into a new
        %migrate --to-gpu N --transplant   kernel process on the CPU, or on GPU N of another model
                              (with --to-host B: of the peer B); what would not carry (generators,
                              threads, sockets, open files...)
                              is listed first, and you are asked (--yes: not asked). It starts
                              once this cell ends; cells run meanwhile wait and then run there
        %migrate --back       after a transplant: go back to the process it replaced, as it was then
                              (kept an hour by default); what this kernel did since is lost, so it
                              asks (--yes: not asked). It starts once this cell ends
        %migrate --list       the GPUs and the kernels on them (this one marked *), and the hosts
        %migrate --suspend    write this kernel to memory or disk and free its GPU (on disk, its
                              memory too); the cell waits, and once the kernel is resumed (panel, jupyter gpumigrate resume,
                              or running a cell) prints for how long, where it runs and the image size;
                              --images memory|disk|auto says where its images go

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
        gpus = _gpu_indices(args.to_gpu)
        args.to_gpu = gpus[0] if gpus is not None and len(gpus) == 1 else gpus
        target = args.to_gpu is not None or to_host is not None or args.to_cpu
        if (sum((args.list, args.suspend, args.back, target)) > 1
                or (args.to_cpu and args.to_gpu is not None)):
            raise UsageError("%migrate: give one of --list, --suspend, --back or a target (--to-gpu N, --to-host NAME, "
                             "--to-cpu).")
        if args.transplant and args.to_gpu is None:
            raise UsageError("%migrate: --transplant goes with --to-gpu N (--to-cpu is always a transplant).")
        if isinstance(args.to_gpu, list) and (args.transplant or to_host):
            raise UsageError("%migrate: several GPUs (--to-gpu N,M) go with a move on this host only: a transplant "
                             "or a move to another host takes one GPU.")
        if args.images and not args.suspend:
            raise UsageError("%migrate: --images goes with --suspend (where the suspended kernel's images go).")
        client = self._client()
        try:
            if args.list:
                print(gpu_table(client.gpus(), client.kernels(), client.kernel_id))
            elif args.suspend:
                print(self._suspend(client, args.images))
            elif args.to_cpu or args.transplant:
                self._transplant(client, args.to_gpu, args.yes, to_host)
            elif args.back:
                self._back(client, args.yes)
            elif target:
                release_torch_cache()
                op = client.migrate(args.to_gpu, to_host, fast_path=None if to_host else "caller")
                if op.get("stager"):
                    # This cell is the only code running: serve the move's fast path from here.
                    from .stager import run

                    run(op["stager"]["path"], op["stager"]["token"])
                op = client.follow(op)
                if op["status"] != "succeeded":
                    raise MigrateFailed(failure(op))
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
    def _transplant(client: ServerClient, to_gpu: int | None, yes: bool, to_host: str | None = None) -> None:
        """Say what would carry (this cell is the kernel's only code running: the survey runs here), ask, and
        start the transplant; it goes on once this cell ends (the server's requests wait behind it)."""
        import json

        from ..opformat import survey_report
        from .transplant import survey

        said = {**json.loads(survey()), "to": "cpu" if to_gpu is None else "gpu", "to_gpu": to_gpu, "to_host": to_host}
        print(survey_report(said, client.kernel_id))
        if not said["carries"]:
            raise MigrateFailed("Nothing of this kernel's would carry: restart it on the target instead.")
        if not yes and input("Transplant it? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing was done.")
            return
        op = client.transplant(to_gpu, [r["name"] for r in said["left"]], to_host)
        where = ("the CPU" if to_gpu is None else f"GPU {to_gpu}") + (f" of host {to_host}" if to_host else "")
        print(f"The transplant to {where} starts as this cell ends (operation {op['id'][:8]}): the kernel goes on "
              "in a new process, its id unchanged. Cells run meanwhile wait, then run there; should it fail, they "
              "run here, as before.")

    @staticmethod
    def _back(client: ServerClient, yes: bool) -> None:
        """Say what is lost, ask, and start going back; it goes on once this cell ends (the server waits for it)."""
        until = client.me().get("back_until")
        if not until:
            raise MigrateFailed("This kernel has no earlier process to go back to: none is kept from a transplant "
                                "(c.MigratableProvisioner.keep_transplant_source says for how long one is).")
        print(f"This kernel goes back to the process its last transplant replaced (kept until {until}): what it "
              "did since the transplant is lost, variables and all.")
        if not yes and input("Go back? [y/N] ").strip().lower() not in ("y", "yes"):
            print("Nothing was done.")
            return
        op = client.back()
        print(f"Going back as this cell ends (operation {op['id'][:8]}): the next cell runs in the earlier process, "
              "the kernel's id unchanged; should it fail, this process runs on.")

    @staticmethod
    def _suspend(client: ServerClient, images: str | None = None) -> str:
        """Ask the server to suspend this very process, and say how it went once it runs again.

        The server dumps the kernel while this cell waits on the operation: the process stops here and
        goes on from here when it is restored. CRIU restores its TCP connections closed (--tcp-close),
        so the request in flight fails and :meth:`ServerClient.follow` dials again.
        """
        release_torch_cache()
        op = client.follow(client.suspend(images))
        if op["status"] != "succeeded":
            raise MigrateFailed(failure(op))
        # Running again: restored by a resume, which may still be adopting this process.
        view = client.me()
        resumed = None
        if view.get("operation"):
            resumed = client.follow(client.operation(view["operation"]))
            view = client.me()
            if resumed.get("action") != "resume":
                resumed = None
        return describe_suspension(op, resumed, view)
