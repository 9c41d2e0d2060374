"""A resume's prefetch: a GPU kernel's host stash read onto its GPU while CRIU restores the kernel.

A kernel suspended with the host stash (kernel/hoststash.py) has its large CUDA buffers in files of its
images. Read back by the kernel itself, they come only once CRIU has restored it and the driver has
remapped it: 32 GB took 2.0 s of a 3.0 s resume on 2 x H100, after 1.0 s of restore and remap
(docs/performance.md). So, as soon as the resume knows the GPU, the stash helper (engine/stash.py; the
spare, its Python and the driver's bindings loaded) makes its context there, allocates room for those
buffers and reads the files into it with 16 threads through pinned buffers, checking every chunk against
the index's checksum, while CRIU and the driver work. Once remapped, the kernel checks that the index's
checksums are those of its own memory (so the helper read what it wrote), copies each buffer from the
helper's memory (an IPC handle, the same GPU) and reads the rest (host memory) from the files as before;
then the helper frees. The helper says its handle as soon as it has allocated, and the restored kernel maps
that memory in a thread while the helper still reads (kernel/hoststash.py's ``open_prefetch``): the
driver's mapping of 32 GB took 0.17-0.20 s on an H200 and the copy itself 0.02 s (bench/ipc_probe.py), so
the kernel's part after the helper is done fell from 0.30 s to its copy and the mapping's close.

It steps aside, and the kernel reads every file itself as before, where the target GPU has no room for the
helper's copy beside all the kernel holds once its buffers are back, where that GPU takes one process's
context at a time, where the kernel comes back onto several GPUs, where the stash has no CUDA buffer or no
checksum, and when the helper fails or finds a chunk that does not match its checksum
(the kernel, reading the file itself, then fails the resume with its images kept, naming the file).
``c.MigratableProvisioner.resume_prefetch = False`` turns it off (the bench compares both in one run).
A move to another host makes one too: for the other host's restore of its guest (peers.py) and for the
restore at home (plans/host_move.py), each as its server's ``resume_prefetch`` says. Going away, the other
host begins it before the restore, as the files arrive (plans/host_move.py's "prefetch there"): told the
stash's index by the kernel's owner once the stash is written, the helper allocates at once and reads each
chunk as soon as its file holds it (kernel/hoststash.py's ``Follow``), so that 32 GB are on the GPU when the
transfer ends instead of 2.1-2.5 s after; its restore takes it where it reads the index that arrived onto
the GPU chosen and its helper lives (else it ends, and the restore makes its own). It gives up where
nothing of the stash arrives for 30 s, a part is removed or replaced, or another part fails, and when its
server is gone (its parent changed). Coming home, this host's does the same once the other host's dump is
over (plans/host_move.py's ``prefetch``), told the index by that host.

The helper reads no word from the server while it reads the files: an undo or a timeout kills it (its GPU
memory goes with it). Once it has answered, it frees when told, or :data:`~.stash.FILL_GRACE` seconds after
the server is gone (the kernel's copy takes a fraction of a second).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import GpuError
from .stash import HELPER_RESERVE, Helper, layout

log = logging.getLogger(__name__)


def cuda_bytes(index: dict) -> int:
    """Bytes the prefetch of the stash whose index is ``index`` (as the file holds it) would hold on the GPU."""
    return layout(index.get("buffers") or [])[1]


@dataclass
class Prefetch:
    """One resume's prefetch: the helper reading the stash in ``folder`` onto GPU ``gpu_uuid``. Always
    :meth:`stop` it."""

    folder: Path
    gpu_uuid: str
    #: bytes it reads onto the GPU
    nbytes: int
    helper: Helper | None = None
    #: the stash's index as its file holds it, where the files are still arriving (a move here from another
    #: host, begun before the transfer ends): the helper reads each chunk as it arrives; None: they are all here
    index: dict | None = None
    #: why it stepped aside (None: it did not, or not yet)
    reason: str | None = None
    #: why the kernel did not map its memory while it read (None: it did, or was not asked yet)
    mapped_late: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def start(self) -> None:
        self.helper = Helper(self.gpu_uuid)
        if self.index is not None:
            self.helper.follow(str(self.folder), self.index)
        else:
            self.helper.fill(str(self.folder))

    def alive(self) -> bool:
        """Whether its helper still reads or holds what it read (it has not failed nor been stopped)."""
        return self.helper is not None and self.helper.proc.poll() is None

    def reads(self, index: dict | None) -> bool:
        """Whether it reads by ``index`` (the stash's index, as its file holds it now; None: unread): one begun
        as the files arrived was given the sender's, which must be the one that arrived."""
        return self.index is None or (index is not None and self.index == index)

    def allocated(self, timeout: float) -> dict | None:
        """Once the helper holds its memory, before it has read the files: ``handle`` and ``session``, for the
        kernel to map that memory while the helper reads (kernel/hoststash.py's ``open_prefetch``: 0.17-0.20 s
        for 32 GB on an H200, bench/ipc_probe.py); None if it stepped aside (:attr:`reason` says why)."""
        early = self._ask(lambda helper: helper.allocated(timeout))
        return {"handle": early["handle"], "session": early.get("session")} if early is not None else None

    def result(self, timeout: float) -> dict | None:
        """Once the helper has read everything: what the kernel needs to copy from it (``handle``, ``bases``,
        ``size``, ``session``); None if it stepped aside (:attr:`reason` says why)."""
        waited = time.perf_counter()
        answer = self._ask(lambda helper: helper.filled(timeout))
        if answer is None or self.helper is None:
            return None
        now = time.perf_counter()
        self.seconds.update(read=float(answer.get("seconds") or 0.0), waited=round(now - waited, 4),
                            ready=round(now - self.started, 4))
        self.seconds.update(self.helper.seconds())
        return {k: answer[k] for k in ("handle", "bases", "size", "session")}

    def _ask(self, what: Callable[[Helper], dict]) -> dict | None:
        """The helper's answer; None if there is no helper or it failed (it is killed: :attr:`reason` says why)."""
        if self.helper is None:
            return None
        try:
            return what(self.helper)
        except GpuError as exc:
            self.reason = str(exc)
            self.helper = None  # killed by the helper's own call
            log.warning("the prefetch of %s stepped aside: %s", self.folder, exc)
            return None

    def stop(self, wait: bool = False) -> None:
        """Free the helper's memory and end it (idempotent): at once, killed, if it is still reading (it reads
        no word from the server meanwhile); else told to free, which it does as the resume goes on. With
        ``wait``, return once it has ended (its memory is free before a GPU's room is judged again)."""
        helper, self.helper = self.helper, None
        if helper is None:
            return
        if helper.handle is None:
            helper.end_now() if wait else helper.kill()
        else:
            helper.stop(wait=wait)

    def said(self, copied: int | None) -> dict:
        """Its record in the operation's ``stash`` (bytes copied from it by the kernel, seconds, or why not)."""
        out: dict = {"bytes": int(copied or 0), "seconds": self.seconds}
        if self.index is not None:
            out["followed"] = True  # begun as the files arrived, before the restore
        if self.reason:
            out["reason"] = self.reason
        if self.mapped_late and copied:
            out["mapped_late"] = self.mapped_late
        elif not copied and not self.reason:
            out["reason"] = "the kernel was not given it (it read its buffers back at its safe point) or took none"
        return out


def room_for(free: int, needed: int, nbytes: int) -> bool:
    """Whether a GPU with ``free`` bytes takes the kernel and the helper's copy of its buffers (``nbytes``)
    with the helper's context. ``needed`` is what the kernel held when it was suspended, its buffers included
    (the manifest is written before the stash), which is what it holds once it has them back."""
    return free >= max(needed, nbytes) + nbytes + HELPER_RESERVE
