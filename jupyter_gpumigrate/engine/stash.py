"""The fast path of a move to another GPU: a stash on the target GPU for the kernel's large tensors.

The CUDA checkpoint driver copies a process's GPU memory out and back at 2-7 GB/s (bench/results), so
a kernel with 32 GB of tensors takes some 20 s to change GPU, while the two GPUs' peer link (NVLink)
copies at about 400 GB/s. So, before the driver runs:

1. a short-lived helper process (``python -m jupyter_gpumigrate.engine.stash``, this module) allocates
   one buffer on the *target* GPU (what the kernel holds there, at most what the target has beyond the
   move) and exports it as a CUDA IPC handle, while the kernel gathers its storages. A spare helper, its
   Python and the driver's bindings loaded and the driver started but no context made, waits for each move
   (:func:`prestart`), which tells it its GPU as soon as the target is checked (gpu_move.prepare);
2. inside the kernel (kernel/stager.py), the large tensor storages are copied into that buffer over
   the peer link and freed: the driver then moves only what is left (the CUDA context, small blocks);
3. after the remap the kernel's context is on the target GPU, the buffer is local to it, and the
   storages are allocated again and copied back (``Storage.resize_``: every tensor, view, parameter
   and optimizer state keeps its storage; only addresses change); then the helper frees the buffer,
   while the move goes on.

Where the time goes (an idle kernel, 32 GB, 2 x H100, 0.84-0.96 s in all, bench/results/2026-11-26-gpu-move.md):
0.24-0.26 s until the tensors are in the stash, of which 0.08 s is the copy itself; then the driver's
checkpoint and remap of what is left (the CUDA context), 0.54-0.57 s; then 0.03-0.08 s to copy them back.
On 2 x H200 (bench/results/2026-11-29-h200x2-f76d483-move.json): 0.93-1.12 s, 0.19-0.23 s until the tensors
are in the stash, the driver 0.60-0.80 s (its floor for a bare context, bench/context_probe.py), the copy back
0.015 s, or 0.057 s after a move away from the GPU the kernel started on (the driver has such a process read
the helper's memory as over the peer link: docs/internals.md). The operation's ``fast_path.seconds`` has
each part.

The kernel's side runs in its main thread and never beside user code; it steps aside, changing
nothing, when it cannot be sure (kernel/stager.py lists when). The server's side here decides how
much goes into the stash: what the target GPU has free beyond what the move itself needs there.

Protocol, JSON lines over a Unix socket in a private (0700) folder; the kernel connects:
    kernel -> {"token", "pid", "storages": [bytes, ...] (largest first), "aside": reason | null,
               "safe_point": true if a busy cell waits for the session (kernel/safepoint.py)}
    server -> {"op": "stash", "handle": hex, "take": [i, ...], "offsets": [o, ...]}
              kernel -> {"stashed": bytes, "seconds": s, "parts": {...}}   or {"aside": reason}: nothing changed
    server -> {"op": "unstash"}
              kernel -> {"unstashed": bytes, "seconds": s, "parts": {...}} or {"error": sentence}: may be retried
    server -> {"op": "bye"} (or the socket closes): the kernel unstashes first if it has not yet.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import GpuError

#: Kept free on the target beyond the move and the stash: the helper's CUDA context and some slack.
HELPER_RESERVE = 1 << 30
#: Below this many bytes of large tensors the driver alone is as fast: starting the helper costs about
#: 0.2 s, the driver moves 1 GB in about 1.2 s (docs/performance.md).
MIN_STASH = 2 * 10**9
#: Each storage in the stash starts at a multiple of this (CUDA's allocation alignment).
ALIGN = 512
#: The helper keeps the buffer this long after the server went away, so that the kernel can still
#: take its tensors back (it does so as soon as its socket closes).
ORPHAN_GRACE = 60.0
#: The same for a resume's prefetch (engine/prefetch.py): the kernel's copy from it takes under a second.
FILL_GRACE = 5.0

log = logging.getLogger(__name__)
#: Stashes of kernels left locked by a failed rollback: each helper lives on, watched, until the kernel
#: runs again (it then takes its tensors back, and the helper frees after ORPHAN_GRACE) or is gone.
_KEPT: list[Helper] = []
KEPT_CHECK = 5.0


def _watch_kept(helper: Helper, pid: int) -> None:
    """Let the kept stash of kernel process ``pid`` go once the kernel runs again or has exited."""
    from .cudackpt import CudaProcess  # the server's gpu extra, there since the stash was made

    while helper.proc.poll() is None:
        time.sleep(KEPT_CHECK)
        try:
            gone = not os.path.exists(f"/proc/{pid}")
            runs = not gone and CudaProcess(pid).state == "running"
        except Exception:  # noqa: BLE001  the driver cannot say: keep it
            continue
        if gone:
            helper.stop()
        elif runs:
            helper.stop(orphan=True)  # the kernel copies back now; the helper frees after the grace
        else:
            continue
        break
    if helper in _KEPT:
        _KEPT.remove(helper)


@dataclass
class Offer:
    """What the kernel said when it came: its stashable storages, or why it steps aside."""

    pid: int
    storages: list[int] = field(default_factory=list)
    aside: str | None = None
    #: served at the safe point of a busy cell
    safe_point: bool = False
    #: bytes of GPU memory torch had allocated for it, and of large storages left to threads that run on
    allocated: int = 0
    spared: int = 0

    def unreached(self) -> str | None:
        """Why part of what the kernel's torch holds is not offered (it goes with the driver), or None."""
        said = []
        if self.spared >= MIN_STASH // 2:
            said.append(f"{self.spared / 1e9:.1f} GB that a thread running on may touch")
        rest = self.allocated - sum(self.storages) - self.spared
        if rest >= MIN_STASH // 2:
            said.append(f"{rest / 1e9:.1f} GB that its search did not reach or cannot offer (held only by C++, "
                        "such as autograd's saved tensors and the gradients of a backward pass under way, or in "
                        "tensors small, sparse or wrapped)")
        return ", ".join(said) or None


def pack(sizes: list[int], budget: int) -> tuple[list[int], list[int], int]:
    """Pick storages (largest first) that fit in ``budget`` bytes; their indices, offsets, and the size
    of the buffer that holds them."""
    take, offsets, end = [], [], 0
    for i, size in enumerate(sizes):
        start = -(-end // ALIGN) * ALIGN
        if start + size <= budget:
            take.append(i)
            offsets.append(start)
            end = start + size
    return take, offsets, end


class Helper:
    """The process that holds the stash buffer on the target GPU (see :func:`_hold`): the spare, if one
    waits (Python and the driver's bindings loaded, the driver started), else one started now. As soon as the
    target is known it makes its context there (0.11-0.14 s on H200) and, given ``size`` (or asked later,
    :meth:`ask`), allocates that much, all while the kernel gathers its storages; :meth:`allocate` then only
    reads its answer."""

    def __init__(self, gpu_uuid: str, size: int = 0) -> None:
        self.gpu_uuid = gpu_uuid
        # The spare has started the driver with every GPU visible and finds its GPU by UUID, which NVML
        # gives as "GPU-..." for a whole GPU; a MIG instance ("MIG-...") is visible only where named before
        # the driver starts: a helper of its own.
        spare = _take_spare() if _by_uuid(gpu_uuid) else None
        #: a spare that failed (its driver, or its GPU not found) is replaced once by a helper of its own
        self.spare = spare is not None
        self.proc = spare or _start()
        #: every line said to it: said again to a helper that replaces a failed spare
        self._lines: list[str] = []
        self.started = time.monotonic()
        #: when the helper had imported the driver's bindings, made its context, allocated (its clock)
        self.stamps: dict[str, float] = {}
        self._say(f"gpu {gpu_uuid}")
        threading.Thread(target=prestart, daemon=True, name="gpumigrate-stash-spare").start()  # the next move's
        self.handle: str | None = None
        #: a fill's first line (allocated)
        self._early: dict | None = None
        #: what was read of its output and not yet taken as a line
        self._pending = bytearray()
        #: bytes asked for (0: not yet)
        self.size = 0
        if size:
            self.ask(size)

    def _say(self, line: str) -> None:
        self._lines.append(line)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{line}\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it has exited already: its last line says why

    def ask(self, size: int) -> None:
        """Have the helper allocate ``size`` bytes as soon as its context is made (once; :meth:`allocate`
        reads its answer)."""
        self.size = size
        self._say(f"alloc {size}")

    def allocate(self, size: int, timeout: float = 60.0) -> str:
        """The CUDA IPC handle of ``size`` bytes the helper holds (asked now, unless asked for at the start, for
        at least as much), or a GpuError."""
        if self.handle is not None and size <= self.size:
            return self.handle
        if self.size and size > self.size:
            raise GpuError(f"The stash helper holds {self.size} bytes, not {size}.")
        if not self.size:
            self.ask(size)
        answer = self._answer(timeout, f"hold {self.size / 1e9:.1f} GB on GPU {self.gpu_uuid}")
        self.handle = str(answer["handle"])
        return self.handle

    def fill(self, folder: str) -> None:
        """Have the helper read the CUDA buffers of the host stash in ``folder`` (a suspended kernel's images)
        into memory of its own on its GPU, each chunk checked against the index's checksum (engine/prefetch.py);
        :meth:`filled` waits for it. Instead of :meth:`allocate`."""
        self._say(f"fill {folder}")

    def follow(self, folder: str, index: dict) -> None:
        """:meth:`fill`, for files still arriving in ``folder`` (the stash of a kernel moving to this host): the
        helper allocates as ``index`` (its stash's index, as the file holds it) says, at once, and reads each
        chunk as soon as its file holds it (kernel/hoststash.py's ``Follow``)."""
        self._say("follow " + json.dumps({"folder": folder, "index": index}, separators=(",", ":")))

    def allocated(self, timeout: float) -> dict:
        """After :meth:`fill`, once the helper has allocated its memory, before it reads the files: ``handle``
        and ``session`` (the stash's), for the kernel to map that memory while it waits (kernel/hoststash.py's
        ``open_prefetch``); or a GpuError (the helper is killed)."""
        if self._early is None:
            self._early = self._answer(timeout, f"hold the stash on GPU {self.gpu_uuid}", kill=True)
        return self._early

    def filled(self, timeout: float) -> dict:
        """The helper's answer to :meth:`fill`: ``handle``, ``bases`` (each buffer's offset in its memory, None
        for a buffer not on the GPU), ``size``, ``filled`` (bytes); or a GpuError (the helper is killed)."""
        started = time.monotonic()
        early = self.allocated(timeout)  # its first line, if not read yet
        answer = self._answer(max(timeout - (time.monotonic() - started), 0.1),
                              f"read the stash onto GPU {self.gpu_uuid}", kill=True)
        if answer.get("handle") != early.get("handle"):
            self.kill()
            raise GpuError("The stash helper answered for memory other than the one it held at first.")
        self.handle = str(answer["handle"])
        return answer

    def end_now(self) -> None:
        """Kill the helper and wait for its end: nothing it holds is needed."""
        if self.proc.poll() is None:
            self.proc.kill()
        _reap(self.proc)

    def kill(self) -> None:
        """End the helper at once (SIGKILL; its GPU memory goes with it): one still reading a stash's files
        (:meth:`fill`) reads nothing from the server until it is done."""
        if self.proc.poll() is None:
            self.proc.kill()
        threading.Thread(target=self._end, daemon=True, name="gpumigrate-stash-helper-end").start()

    def _answer(self, timeout: float, what: str, kill: bool = False) -> dict:
        """The helper's next line, with a handle in it; else it is stopped (``kill``: killed) and a GpuError
        says why."""
        try:
            line = _readline(self.proc.stdout, self._pending, timeout)
            answer = json.loads(line) if line.startswith("{") else {}
        except (OSError, ValueError) as exc:
            answer = {"error": str(exc)}
        if not isinstance(answer, dict) or "handle" not in answer:
            answer = answer if isinstance(answer, dict) else {}
            if self.spare and answer.get("error"):  # it said why: a helper of its own, told the same, once
                log.warning("gpumigrate: the spare stash helper failed (%s); one is started for GPU %s",
                            answer["error"], self.gpu_uuid)
                self._replace()
                return self._answer(timeout, what, kill)
            if answer.get("error") is None and self.proc.poll() is not None and self.proc.stderr is not None:
                answer["error"] = self.proc.stderr.read()[-500:] or f"it exited with {self.proc.returncode}"
            if kill:
                self.kill()
            else:
                self.stop()
            raise GpuError(f"The stash helper could not {what}: {answer.get('error') or 'no answer in time'}")
        self.stamps = {k: float(v) for k, v in answer.get("stamps", {}).items() if isinstance(v, (int, float))}
        return answer

    def _replace(self) -> None:
        """End the failed spare and start a helper of its own (which sets CUDA_VISIBLE_DEVICES before the
        driver starts), told every line the spare was."""
        failed, self.proc, self.spare = self.proc, _start(), False
        if failed.poll() is None:
            failed.kill()
        threading.Thread(target=_reap, args=(failed,), daemon=True, name="gpumigrate-stash-helper-end").start()
        self._pending = bytearray()
        lines, self._lines = self._lines, []
        for line in lines:
            self._say(line)

    def seconds(self) -> dict[str, float]:
        """Where the helper's time went before it held the stash: the driver's bindings imported (0 where
        it was a spare, started before), the context made, the memory allocated."""
        out, last = {}, self.started
        for part in ("imported", "driver", "context", "allocated"):
            if part in self.stamps:
                out[f"helper_{part}"] = max(self.stamps[part] - last, 0.0)
                last = max(self.stamps[part], last)
        return out

    def stop(self, orphan: bool = False, wait: bool = True) -> None:
        """Free the buffer and end the helper (at once, or killed after 10 s). With ``orphan`` (the kernel
        may still be taking its tensors back), only let go: the helper frees after :data:`ORPHAN_GRACE`.
        Without ``wait`` (the kernel has taken its tensors back), a thread waits for its end: the move
        goes on meanwhile."""
        if orphan:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            return
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write("free\n")
                self.proc.stdin.flush()
        except OSError:
            pass
        if wait:
            self._end()
        else:
            threading.Thread(target=self._end, daemon=True, name="gpumigrate-stash-helper-end").start()

    def _end(self) -> None:
        _reap(self.proc)


def _reap(proc: subprocess.Popen) -> None:
    """Wait for a helper's end (killed after 10 s), then close our ends of its pipes."""
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    _close(proc)


def _close(proc: subprocess.Popen) -> None:
    """Close our ends of a helper's pipes (what is left to write to one that has exited is dropped)."""
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


#: A helper started before it is needed, its Python and the driver's bindings loaded and the driver started,
#: no CUDA context yet (no GPU memory, nothing NVML shows): a move takes it and starts the next (about 0.15 s
#: saved a move).
_SPARE: subprocess.Popen | None = None
_SPARE_LOCK = threading.Lock()
#: the server stops: no spare is started any more
_ENDED = False


#: set in a spare's environment: it starts the CUDA driver, every GPU visible, before it knows its GPU
SPARE_ENV = "JUPYTER_GPUMIGRATE_STASH_SPARE"


def _by_uuid(gpu_uuid: str) -> bool:
    """A spare can make its context on ``gpu_uuid``: a whole GPU's UUID, found among every GPU's."""
    return gpu_uuid.upper().startswith("GPU-")


def _start(spare: bool = False) -> subprocess.Popen:
    env = None
    if spare:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        env[SPARE_ENV] = "1"
    return subprocess.Popen([sys.executable, "-m", "jupyter_gpumigrate.engine.stash"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def prestart() -> None:
    """Have a spare helper ready for the next move (one per server; it ends when the server does, with its
    stdin). None without the driver's bindings: a helper would only say that they are missing."""
    global _SPARE
    try:
        if _ENDED or importlib.util.find_spec("cuda") is None or importlib.util.find_spec("cuda.bindings") is None:
            return
    except (ImportError, ValueError):  # a "cuda" that is not a package
        return
    with _SPARE_LOCK:
        if _SPARE is None or _SPARE.poll() is not None:
            _SPARE = _start(spare=True)


def end_spare() -> None:
    """End the spare helper, if one waits (the server stops)."""
    global _ENDED
    _ENDED = True  # a move that ends after this starts no other
    spare = _take_spare()
    if spare is not None:
        _close(spare)  # its stdin's end: it exits
        try:
            spare.wait(5)
        except subprocess.TimeoutExpired:
            spare.kill()
            spare.wait(5)


def _take_spare() -> subprocess.Popen | None:
    global _SPARE
    with _SPARE_LOCK:
        spare, _SPARE = _SPARE, None
    return spare if spare is not None and spare.poll() is None else None


def _readline(stream, pending: bytearray, timeout: float) -> str:  # type: ignore[no-untyped-def]
    """The next line of a helper's ``stream`` (stripped; "" at its end or after ``timeout`` seconds), read from
    its descriptor through ``pending``, the bytes read but not yet returned: a buffered ``readline`` after a
    ``select`` would take two lines that came together and leave the second waiting for the timeout."""
    import selectors

    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    while b"\n" not in pending:
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            if not sel.select(max(deadline - time.monotonic(), 0.0)):
                return ""
        chunk = os.read(fd, 65536)
        if not chunk:
            return ""
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.decode(errors="replace").strip()


class Stash:
    """The server's end of one fast-path session: a listening socket the kernel connects to, the
    conversation with it, and the helper that holds the stash. Always :meth:`close` it."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="gpumigrate-stash-"))  # 0700
        self.path = str(self.folder / "s")
        self.token = secrets.token_hex(16)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(self.path)
            self._listener.listen(1)
        except OSError:
            self._listener.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            raise
        self._conn: socket.socket | None = None
        self._file = None
        self.helper: Helper | None = None
        self.offer: Offer | None = None
        #: bytes in the stash now, and in all; why the fast path stepped aside (None: it did not)
        self.held = 0
        self.stashed = 0
        #: a stash was asked for and no answer came: the kernel may hold tensors there or not
        self.unsure = False
        self.reason: str | None = None
        #: what the kernel stashed not, and why (it went with the driver), or None
        self.left: str | None = None
        self.seconds: dict[str, float] = {}

    def warm(self, gpu_uuid: str, size: int = 0) -> None:
        """Start the helper on GPU ``gpu_uuid`` now, allocating ``size`` bytes there (0: once asked), so that
        it is ready when the kernel has said what it has (stopped on :meth:`close` if the fast path steps
        aside). A stash then takes no more than ``size``."""
        if self.helper is not None and self.helper.gpu_uuid != gpu_uuid:
            assert not self.held and not self.unsure, "a stash that holds tensors is not moved to another GPU"
            self.stop_helper()
        if self.helper is None:
            self.helper = Helper(gpu_uuid, size)
        elif size and not self.helper.size:
            self.helper.ask(size)  # started earlier (gpu_move.prepare), its context made or being made

    # -- the conversation ---------------------------------------------------------------------------

    def _send(self, message: dict) -> None:
        assert self._file is not None
        self._file.write(json.dumps(message).encode() + b"\n")
        self._file.flush()

    def _receive(self, timeout: float) -> dict:
        assert self._conn is not None and self._file is not None
        self._conn.settimeout(timeout)
        try:
            line = self._file.readline()
        except OSError as exc:
            raise GpuError(f"The kernel's side of the fast path did not answer ({exc}).") from exc
        if not line:
            raise GpuError("The kernel's side of the fast path went away.")
        return json.loads(line)

    def accept(self, timeout: float) -> Offer | None:
        """Wait for the kernel's side to connect and say what it has; None if it did not come."""
        self._listener.settimeout(timeout)
        try:
            conn, _ = self._listener.accept()
        except OSError:
            self.reason = "the kernel did not start its side of the fast path in time"
            return None
        self._conn, self._file = conn, conn.makefile("rwb")
        hello = self._receive(30)
        if not secrets.compare_digest(str(hello.get("token", "")), self.token):
            self.reason = "the kernel's side of the fast path did not give the session's token"
            self._hang_up()
            return None
        self.offer = Offer(int(hello.get("pid", 0)), [int(n) for n in hello.get("storages", [])], hello.get("aside"),
                           bool(hello.get("safe_point")), int(hello.get("allocated") or 0), int(hello.get("spared") or 0))
        self.left = self.offer.unreached()
        if self.offer.aside:
            self.reason = self.offer.aside
        return self.offer

    def stash(self, gpu_uuid: str, budget: int) -> int:
        """Have the kernel put what fits in ``budget`` bytes into a stash on GPU ``gpu_uuid``; the bytes
        stashed (0, with :attr:`reason` set, if the fast path steps aside; the kernel is then as it was)."""
        if self.offer is None or self.offer.aside or self._conn is None:
            return 0
        if sum(self.offer.storages) < MIN_STASH:
            self.reason = (f"the kernel holds {sum(self.offer.storages) / 1e9:.1f} GB of large tensors: under "
                           f"{MIN_STASH / 1e9:.0f} GB the driver alone is as fast")
            return 0
        room = budget - HELPER_RESERVE
        if self.helper is not None and self.helper.gpu_uuid == gpu_uuid and self.helper.size:
            room = min(room, self.helper.size)  # what it allocated as it started
        take, offsets, size = pack(self.offer.storages, room)
        if 0 < len(take) < len(self.offer.storages):
            rest = sum(self.offer.storages) - sum(self.offer.storages[i] for i in take)
            self.left = ", ".join(filter(None, (f"{rest / 1e9:.1f} GB of tensors that did not fit in the stash "
                                                f"({max(room, 0) / 1e9:.1f} GB of room on the target)", self.left)))
        if not take:
            self.reason = (f"the target GPU has no room for a stash beside the kernel "
                           f"({max(budget, 0) / 1e9:.1f} GB free beyond the move)") if self.offer.storages else \
                "the kernel holds no large tensors"
            return 0
        started = time.perf_counter()
        if self.helper is None or self.helper.gpu_uuid != gpu_uuid:
            self._stop_helper()
            self.helper = Helper(gpu_uuid)
        handle = self.helper.allocate(size)
        self.seconds["helper"] = time.perf_counter() - started
        self.seconds.update(self.helper.seconds())
        self._send({"op": "stash", "handle": handle, "take": take, "offsets": offsets})
        self.unsure = True
        answer = self._receive(300)
        self.unsure = False
        if "stashed" not in answer:
            self.reason = answer.get("aside") or answer.get("error") or "the kernel did not stash"
            self._stop_helper()
            return 0
        self.held = self.stashed = int(answer["stashed"])
        self.seconds["stash"] = float(answer.get("seconds", 0))
        self._parts(answer)
        return self.held

    def _parts(self, answer: dict) -> None:
        """The kernel's seconds by part (kernel/stager.py): gather, stash_copy, unstash_alloc..."""
        parts = answer.get("parts")
        if isinstance(parts, dict):
            self.seconds.update({str(k): float(v) for k, v in parts.items() if isinstance(v, (int, float))})

    def unstash(self) -> None:
        """Have the kernel take its tensors back from the stash (on whatever GPU it is now); then free it."""
        if not self.held:
            return
        self._send({"op": "unstash"})
        answer = self._receive(300)
        if "unstashed" not in answer:
            raise GpuError(f"The kernel could not take its tensors back from the stash: "
                           f"{answer.get('error', answer)}. They are still in the stash; it is tried again.")
        self.held = 0
        self.seconds["unstash"] = float(answer.get("seconds", 0))
        self._parts(answer)
        if self.helper is not None:  # nothing of the kernel's is in it any more: it ends as the move goes on
            self.helper.stop(wait=False)
            self.helper = None

    # -- the end --------------------------------------------------------------------------------------

    def _hang_up(self) -> None:
        for thing in (self._file, self._conn):
            if thing is not None:
                try:
                    thing.close()
                except OSError:
                    pass
        self._file = self._conn = None

    def stop_helper(self) -> None:
        """End the helper, if one runs, holding nothing the kernel needs (the fast path stepped aside): killed,
        and waited for, so that its context has left the target before the driver remaps there (a helper still
        making its context would read ``free`` only once it has made it)."""
        if not self.held and not self.unsure and self.helper is not None:
            helper, self.helper = self.helper, None
            helper.end_now()

    def _stop_helper(self) -> None:
        if self.helper is not None:
            self.helper.stop()
            self.helper = None

    def close(self, kernel_runs: bool = True) -> None:
        """Say goodbye (a kernel that still has tensors in the stash takes them back first), free the
        stash, and remove the socket. If the kernel does not run (left locked by a failed rollback), it
        cannot take them back now: it is not waited for, and the stash is kept until the server exits."""
        gone = True
        if self._conn is not None:
            try:
                self._send({"op": "bye"})
                self._conn.settimeout((300 if self.held or self.unsure else 5) if kernel_runs else 2)
                while self._file.readline():  # type: ignore[union-attr]  # until the kernel closes: done
                    pass
            except (OSError, ValueError):
                gone = False
            self._hang_up()
        if self.helper is not None and not gone and (self.held or self.unsure) and not kernel_runs:
            log.warning("the stash of kernel %s is kept (%d bytes): the kernel is locked and takes its tensors "
                        "back once it runs", self.offer.pid if self.offer else "?", self.held)
            _KEPT.append(self.helper)
            if self.offer is not None:
                threading.Thread(target=_watch_kept, args=(self.helper, self.offer.pid), daemon=True,
                                 name="gpumigrate-kept-stash").start()
            self.helper = None
        elif self.helper is not None and not gone and (self.held or self.unsure):
            self.helper.stop(orphan=True)  # it may still be copying back: the helper frees later
            self.helper = None
        self._stop_helper()
        self._listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the helper process ----------------------------------------------------------------------------


def _hold() -> int:
    """Load the CUDA driver's bindings; on ``gpu UUID`` from stdin make a context on that GPU alone; on
    ``alloc N`` allocate N bytes there and print its IPC handle as JSON (with the monotonic clock's
    ``stamps`` of each step), or on ``fill FOLDER`` allocate room for the CUDA buffers of the host stash in
    FOLDER, read them into it (:func:`_fill`) and print the handle with where each buffer lies (``follow
    {"folder", "index"}``: the same as the files arrive, the index given); wait for
    ``free`` on stdin (or its end, then :data:`ORPHAN_GRACE`, or for a fill :data:`FILL_GRACE`, more
    seconds), free, exit. Stdin ending before ``alloc``: exit at once (a spare the server did not need).

    The CUDA driver API through cuda-bindings (the server's ``gpu`` extra): no torch in the server.
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        print(json.dumps({"error": f"cuda-bindings is not installed ({exc})"}), flush=True)
        return 1
    def ok(result: tuple) -> object:
        if int(result[0]) != 0:
            raise RuntimeError(f"{result[0]!r}")
        return result[1] if len(result) > 1 else None

    stamps = {"imported": time.monotonic()}
    # A spare starts the driver now, before its GPU is known (some 40-50 ms of a helper's 0.15-0.18 s), every
    # GPU visible (its environment has no CUDA_VISIBLE_DEVICES), and finds its GPU by UUID; a failure is said
    # once the server asks. A helper started for one GPU sees that one alone.
    spare, failed = os.environ.get(SPARE_ENV) == "1", None
    if spare:
        try:
            ok(driver.cuInit(0))
        except Exception as exc:
            failed = exc
        stamps["driver"] = time.monotonic()
    asked = sys.stdin.readline().split()
    if len(asked) != 2 or asked[0] != "gpu":
        return 0
    try:
        if failed is not None:
            raise failed
        if spare:
            device = _device(driver, ok, asked[1])
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = asked[1]  # read by cuInit: the one GPU it sees
            ok(driver.cuInit(0))
            stamps["driver"] = time.monotonic()
            device = ok(driver.cuDeviceGet(0))
        context = ok(driver.cuDevicePrimaryCtxRetain(device))
        ok(driver.cuCtxSetCurrent(context))
    except Exception as exc:  # said to the server once it asks, which steps aside
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    stamps["context"] = time.monotonic()
    verb, _, arg = sys.stdin.readline().rstrip("\n").partition(" ")
    said: dict = {}
    try:
        if verb == "alloc":
            pointer = ok(driver.cuMemAlloc(int(arg)))
        elif verb == "fill":
            pointer, said = _fill(driver, ok, arg, stamps)
        elif verb == "follow":
            asked = json.loads(arg)
            parent = os.getppid()
            pointer, said = _fill(driver, ok, str(asked["folder"]), stamps, index=asked["index"],
                                  gone=lambda: "the server that asked is gone" if os.getppid() != parent else None)
        else:
            return 0
        handle = ok(driver.cuIpcGetMemHandle(pointer))
    except Exception as exc:  # said to the server, which steps aside (a fill: the kernel reads the files itself)
        print(json.dumps({"error": str(exc)}), flush=True)
        return 1
    stamps.setdefault("allocated", time.monotonic())
    print(json.dumps({**said, "handle": bytes(handle.reserved).hex(), "stamps": stamps}), flush=True)  # type: ignore[attr-defined]
    if sys.stdin.readline() == "":
        time.sleep(FILL_GRACE if verb in ("fill", "follow") else ORPHAN_GRACE)
    driver.cuMemFree(pointer)
    return 0


def _device(driver: Any, ok: Any, gpu_uuid: str) -> Any:
    """The CUDA device whose UUID NVML gives as ``gpu_uuid`` ("GPU-" and 32 hex digits in 8-4-4-4-12 groups)."""
    for ordinal in range(int(ok(driver.cuDeviceGetCount()))):  # type: ignore[call-overload]
        device = ok(driver.cuDeviceGet(ordinal))
        raw = ok(driver.cuDeviceGetUuid(device)).bytes  # type: ignore[attr-defined]
        raw = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
        if len(raw) != 16:
            raise RuntimeError(f"the driver gave a UUID of {len(raw)} bytes for device {ordinal}, not 16")
        if uuid_text(raw) == gpu_uuid.lower():
            return device
    raise RuntimeError(f"no GPU with UUID {gpu_uuid} among the {ok(driver.cuDeviceGetCount())} the driver sees")


def uuid_text(raw: bytes) -> str:
    """A GPU's 16 UUID bytes as NVML writes them, lower-cased: ``gpu-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    h = raw.hex()
    return f"gpu-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def layout(buffers: list[dict]) -> tuple[list[int | None], int]:
    """Where each buffer of a host stash's index lies in a prefetch's memory on the GPU: its CUDA buffers one
    after the other, each at a multiple of :data:`ALIGN` (None for a buffer in host memory); and the size."""
    bases: list[int | None] = []
    end = 0
    for b in buffers:
        if b.get("kind") == "cuda":
            start = -(-end // ALIGN) * ALIGN
            bases.append(start)
            end = start + int(b["size"])
        else:
            bases.append(None)
    return bases, end


def _fill(driver: Any, ok: Any, folder: str, stamps: dict[str, float], index: dict | None = None,
          gone: Any = None) -> tuple[Any, dict]:
    """In the helper: allocate room on its GPU for the CUDA buffers of the host stash in ``folder`` and read
    them into it from the stash's files, by as many threads as there are files, each chunk checked against
    the checksum the index gives (the kernel then checks that the index's checksums are its own). A file that
    does not match: an error, and nothing is kept. With ``index`` (as its file holds it), the files may still
    be arriving: each chunk is read once there, until a file stalls or ``gone()`` says why to stop."""
    from ..kernel import hoststash  # the same reader as the kernel's (its Cuda uses this context)

    started = time.monotonic()
    follow = hoststash.Follow(gone=gone or (lambda: None)) if index is not None else None
    index = hoststash.read_index(folder) if index is None else hoststash.index_of(index, "the index sent")
    bases, size = layout(index["buffers"])
    if not size:
        raise ValueError(f"the stash in {folder} holds no CUDA buffer")
    pointer = ok(driver.cuMemAlloc(size))
    stamps["allocated"] = time.monotonic()
    try:
        # Said at once, before the files are read: the kernel maps this memory meanwhile (Helper.allocated).
        handle = ok(driver.cuIpcGetMemHandle(pointer))
        print(json.dumps({"early": True, "handle": bytes(handle.reserved).hex(),  # type: ignore[attr-defined]
                          "session": index.get("session")}), flush=True)
        addresses = [int(pointer) + (base or 0) for base in bases]  # type: ignore[call-overload]
        on_gpu = [base is not None for base in bases]
        chunks = [c for c in index["chunks"] if on_gpu[c.buffer]]
        cuda = hoststash.Cuda()
        damaged: list[str] = []
        lock = threading.Lock()

        def read(part: int) -> None:
            wrong = hoststash.read_part(Path(folder) / hoststash.PART.format(part), chunks, part, addresses, on_gpu,
                                        cuda, check=True, follow=follow)
            if wrong:
                with lock:
                    damaged.append(wrong)

        hoststash.run_parts(read, int(index["parts"]))
        if damaged:
            raise ValueError(hoststash.damage(damaged))
        ok(driver.cuCtxSynchronize())
    except BaseException:
        driver.cuMemFree(pointer)
        raise
    stamps["filled"] = time.monotonic()
    return pointer, {"bases": bases, "size": size, "filled": sum(c.size for c in chunks),
                     "session": index.get("session"), "seconds": round(stamps["filled"] - started, 4)}


if __name__ == "__main__":
    sys.exit(_hold())
