"""What the plans share: their tools, their context, their outcome, and the steps two plans take alike.

The steps here register their undos on the context right after each side effect (saga.py); none of
them writes the kernel's state, which the runner owns.
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .. import gpus as gpus_mod
from .. import netstate, placement, proctree
from ..criu import Criu, dump_finished, error_lines, never_seized
from ..errors import DEAD, CriuFailed, GpuError, ImageError, InvalidState, PidConflict, for_full
from ..gpus import GpuInfo
from ..gpustate import GpuState
from ..images import DISK, ImageStore, Manifest, choose
from ..kernelproc import KernelProcess, public_connection_info
from ..placement import Move
from ..prefetch import Prefetch
from ..saga import Context, Result

log = logging.getLogger(__name__)


@dataclass
class Tools:
    """What the plans act with on this host: the image store, CRIU, the GPU inventory, and timeouts."""

    store: ImageStore
    criu: Criu | None
    inventory: Callable[[], list[GpuInfo]] = gpus_mod.snapshot
    driver_major: Callable[[], int | None] = gpus_mod.driver_major
    #: how long a restored kernel's clients get to re-dial, and the kernel to answer
    reconnect_timeout: float = 3.0
    #: how long a CUDA lock waits for the GPU work in flight
    lock_timeout: float = 60.0
    #: the host stash of a suspend (kernel/hoststash.py) is used from this many bytes of large buffers;
    #: None: never
    host_stash_min: int | None = 10**9
    #: where a suspend's images go: memory, disk, or auto (images.choose)
    images: str = DISK
    #: how long a transplant's source is kept, so that the kernel can go back to it (seconds; 0: not kept)
    keep_source: float = 0.0
    #: whether two GPUs reach each other's memory (the fast path's peer link); None: cannot tell
    peer_access: Callable[[GpuInfo, GpuInfo], bool | None] = gpus_mod.peer_access
    #: whether a resume of a GPU kernel that stashed has the stash helper read its CUDA buffers onto its GPU
    #: while CRIU restores it (engine/prefetch.py)
    prefetch: bool = True
    #: a prefetch begun before the restore, as the images in the folder given arrived (peers.py: the host a
    #: kernel moves to begins one once its owner sends the stash's index), handed to the restore of those
    #: images (taken: asked once); None: none
    early_prefetch: Callable[[Path], Prefetch | None] = lambda folder: None
    #: GPUs (indices) no kernel is sent to unless it names them: those being drained now
    avoid: Callable[[], Collection[int]] = tuple


@dataclass
class FastPath:
    """What the fast path of a GPU move did: bytes stashed, or why it stepped aside, its seconds, and its
    way (``peer``: a stash on the target GPU; ``host``: files in memory; None: the driver moved it all)."""

    stashed: int
    reason: str | None
    seconds: dict[str, float]
    via: str | None = "peer"
    #: of what the kernel's torch held, what the fast path left to the driver and why, or None
    left: str | None = None

    def to_dict(self) -> dict:
        return {"stashed": self.stashed, "reason": self.reason, "via": self.via, "left": self.left,
                "seconds": {k: round(v, 4) for k, v in self.seconds.items()}}


@dataclass
class Outcome:
    """What a finished plan did."""

    result: Result
    #: bytes written, read or moved (images, or GPU memory for a live move)
    bytes: int = 0
    manifest: Manifest | None = None
    from_gpu: int | None = None
    to_gpu: int | None = None
    #: a kernel on several GPUs: each GPU it held and where that went, in the same order
    from_gpus: list[int] | None = None
    to_gpus: list[int] | None = None
    #: a move between hosts: the host it went to ("" when it came home) and the one it left
    to_host: str | None = None
    from_host: str | None = None
    #: bytes sent to or received from the other host
    transferred: int | None = None
    fast_path: FastPath | None = None
    #: where a suspend put its images (memory or disk), and why (images.choose)
    images: str | None = None
    images_why: str = ""
    #: the host stash of a suspend or resume: what the kernel wrote or read ({"stashed": bytes, "seconds"...},
    #: {"unstashed": ...}), or why it stepped aside ({"aside": reason}); None where it does not apply
    stash: dict | None = None
    #: a transplant: where to ("gpu" or "cpu"), the names carried, those left (name, type, reason), notes
    transplant: dict | None = None


class KernelContext(Context):
    """What a plan's steps read and write about one kernel."""

    kernel: KernelProcess

    def __init__(self, kernel: KernelProcess, tools: Tools) -> None:
        super().__init__(kernel)
        self.tools = tools
        self.gpu = GpuState(tools.lock_timeout, tools.inventory)
        self.images: Path = tools.store.path_for(kernel.kernel_id)
        self.manifest: Manifest | None = None
        #: the kernel's root process (running, or restored from the images)
        self.pid: int | None = None
        #: where its GPU memory goes, once decided
        self.move: Move | None = None
        #: the images hold a kernel that could not be brought back: never removed by an undo
        self.keep_images = False
        #: the host stash: what the kernel wrote ({} if nothing), or why it stepped aside
        self.stash: dict = {}
        #: where new images went (memory or disk), and why
        self.images_where = DISK
        self.images_why = ""
        #: the bytes the images were judged to take when they were made (the tree's memory and GPU memory)
        self.estimate = 0
        #: when the tree was restored (time.monotonic()): its ports listen again from then on
        self.restored_at: float | None = None
        #: a restore's prefetch (engine/prefetch.py: the stash helper reads the kernel's CUDA buffers onto its
        #: GPU while CRIU restores it), and why none was made where the plan asked for one
        self.prefetch: Prefetch | None = None
        self.no_prefetch: str | None = None

    def on_gpu(self) -> bool:
        return self.gpu.holds_gpu()

    @property
    def criu(self) -> Criu:
        if self.tools.criu is None:
            raise InvalidState("No CRIU was given to this migration, so it cannot dump or restore the kernel.")
        return self.tools.criu


# -- reading the kernel -------------------------------------------------------------------------------


def running_pid(ctx: KernelContext) -> int:
    """The running kernel's PID (the runner checked its state); :class:`InvalidState` if it is gone."""
    pid = ctx.kernel.kernel_pid
    if pid is None or not proctree.is_alive(pid):
        raise InvalidState("The kernel process is not running: restart the kernel instead.")
    ctx.pid = pid
    return pid


def gpu_use(ctx: KernelContext, pid: int) -> tuple[list[int], list[dict], list[GpuInfo]]:
    """The tree's processes that hold a GPU, what they hold (index, uuid, name, bytes), and the GPUs."""
    tree = proctree.descendants(pid)
    gpus = ctx.tools.inventory()
    cuda_pids = sorted({p for g in gpus for p in g.processes if p in tree})
    return cuda_pids, placement.held_by_tree(pid, gpus), gpus


def release_cache(ctx: KernelContext) -> None:
    # Freed-but-cached blocks of PyTorch's allocator would be moved too (8 GB live + 24 GB cached:
    # 29.2 s; after empty_cache: 7.2 s; docs/internals.md). Ask the kernel to drop them, if it is idle.
    ctx.kernel.release_gpu_cache()


# -- images -------------------------------------------------------------------------------------------


def new_images(ctx: KernelContext, pid: int, images: str = DISK) -> None:
    """An empty image folder for the kernel (undone: removed, its logs kept), in memory or on disk as
    ``images`` asks (``auto``: :func:`~..images.choose`), the manifest of the tree under ``pid``, and its
    CUDA processes in ``ctx.gpu``."""
    kernel, store = ctx.kernel, ctx.tools.store
    if gpu_use(ctx, pid)[0]:
        release_cache(ctx)
    cuda_pids, held, gpus = gpu_use(ctx, pid)
    ctx.estimate = estimate = proctree.memory(pid) + sum(int(h["memory_used"]) for h in held)
    ctx.images_where, ctx.images_why = choose(store, images, estimate, pid)
    ctx.images = store.create(kernel.kernel_id, ctx.images_where)
    ctx.undo(lambda: forget_new_images(ctx), cleanup=True)
    held = sorted(held, key=lambda h: int(h["index"]))
    ctx.gpu.track(cuda_pids, [h["uuid"] for h in held], sum(int(h["memory_used"]) for h in held))
    ctx.manifest = manifest_of(ctx.kernel, pid, held, cuda_pids, ctx.criu.binary.version_string)


def manifest_of(kernel: KernelProcess, pid: int, held: list[dict], cuda_pids: list[int],
                criu_version: str) -> Manifest:
    """The manifest of ``kernel``'s tree under ``pid``, which holds ``held`` (index, uuid, name, bytes of
    each GPU) through its CUDA processes ``cuda_pids``."""
    return Manifest(
        kernel_id=kernel.kernel_id,
        kernel_name=kernel.kernel_name,
        pid=pid,
        # Every PID and TID must be free again at restore: remember them to name a conflict.
        ids=proctree.tree_ids(pid),
        criu_version=criu_version,
        gpus=held,
        cuda_pids=cuda_pids,
        connection_info=public_connection_info(kernel.kernel_connection_info),
        clients=netstate.client_counts(proctree.descendants(pid), skip_own=True),  # those a relay gets too
        sessions=list(kernel.sessions),
    )


def dump(ctx: KernelContext) -> None:
    """CRIU dumps the tree and kills it; from then on, the undo brings it back from the images."""
    assert ctx.manifest is not None
    kernel, store = ctx.kernel, ctx.tools.store
    # If CRIU fails, it resumes the tree: the kernel goes on running, untouched. Its log is kept
    # outside the images, which the rollback deletes. The manifest to be goes first: should this server
    # die once CRIU has killed the tree, the next one completes the images from it (revive.py).
    log_path = store.log_path(kernel.kernel_id, "dump")
    log_path.unlink(missing_ok=True)  # an earlier dump's: only this one's may say it finished (finished_dump)
    images, manifest = ctx.images, ctx.manifest  # the undo's, whatever the context holds by then (back.py)
    with disk_full_said(ctx, "runs on, unchanged."):
        store.write_pending(ctx.images, ctx.manifest, kernel.secrets())
    try:
        ctx.criu.dump(ctx.manifest.pid, ctx.images, log_path=log_path)
    except CriuFailed as exc:
        if not proctree.is_alive(ctx.manifest.pid) and dump_finished(log_path):
            log.warning("kernel %s: CRIU was stopped after it finished its dump: the images are complete",
                        kernel.kernel_id)
        else:
            _dump_failed(ctx, exc)
    ctx.undo(lambda: restore_from_images(ctx, images, manifest))  # the tree is dead and its images complete
    kernel.release()
    proctree.reap_dumped(ctx.manifest.ids)
    with disk_full_said(ctx, "is brought back from its images and runs on."):
        store.write_manifest(ctx.images, ctx.manifest)  # its secrets are there already (write_pending)


@contextmanager
def disk_full_said(ctx: KernelContext, then: str) -> Iterator[None]:
    """A full disk while writing the manifest is said as such (``then``: what becomes of the kernel)."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise for_full(ImageError(full_disk(ctx.images.parent, "the kernel's manifest could not be written",
                                                ctx.tools.store) + f" The kernel {then}"), ctx.images.parent) from exc
        raise


#: How long a failed dump whose CRIU saw a process of the tree killed waits for the kernel's own to be gone,
#: before it says the kernel runs on (seconds).
DIED_WAIT = 5.0


def _killed(said: str) -> bool:
    """Whether CRIU saw a process of the tree killed as it dumped it (its SIGCHLD handler's line: si_code 2,
    CLD_KILLED, or 3, CLD_DUMPED); one that exited (a shell command's child ending) is not."""
    return re.search(r"si_code=[23]\b", said) is not None


def _ends(pid: int) -> bool:
    """Whether ``pid`` ends within :data:`DIED_WAIT`: a kernel killed as CRIU dumped it may still be exiting
    (freeing a large memory takes a while). Not reaped here (its launcher's Popen keeps its exit status)."""
    deadline = time.monotonic() + DIED_WAIT
    while proctree.is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _dump_failed(ctx: KernelContext, exc: CriuFailed) -> None:
    """A dump that failed: CRIU resumed the tree, which runs on, untouched. Say so, and why; or, where the
    kernel's process itself is gone (killed meanwhile: CRIU's failure is then its death), say that instead, and
    whether it was gone before CRIU took hold of it (nothing dumped)."""
    assert ctx.manifest is not None
    pid = ctx.manifest.pid
    if exc.log_path and not proctree.is_alive(pid) and never_seized(Path(exc.log_path), pid):
        raise CriuFailed(
            f"The kernel's process {pid} ended before CRIU began to dump it, so nothing was dumped and {DEAD}",
            exc.log_path, exc.log_tail) from exc
    if not proctree.is_alive(ctx.manifest.pid) or (_killed(f"{exc}\n{exc.log_tail}") and _ends(ctx.manifest.pid)):
        raise CriuFailed(
            f"The kernel's process {ctx.manifest.pid} ended while CRIU dumped it, so {DEAD} CRIU said: {exc}",
            exc.log_path, exc.log_tail) from exc
    # CRIU's own log may be cut short by the full disk it writes to ("page-xfer: Una"): the disk's room says it.
    if _disk_full(f"{exc}\n{exc.log_tail}") or _no_room(ctx.images.parent):
        raise for_full(CriuFailed(full_disk(ctx.images.parent, "CRIU could not write the kernel's images",
                                            ctx.tools.store) + f" The kernel runs on, unchanged. Full log: "
                                  f"{exc.log_path}", exc.log_path, exc.log_tail), ctx.images.parent) from exc
    raise CriuFailed(
        f"{exc} The kernel runs on, unchanged. If the log names a file, socket or device the kernel "
        "holds, close it in the notebook and try again.", exc.log_path, exc.log_tail) from exc


def _disk_full(text: str) -> bool:
    return "No space left on device" in text or "ENOSPC" in text


def _no_room(folder: Path) -> bool:
    """Whether the disk of ``folder`` is (all but) full: under 1 MiB free."""
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def _in_memory(folder: Path, store: ImageStore | None) -> bool:
    return store is not None and store.memory_root is not None and folder == store.memory_root


def _full(folder: Path, store: ImageStore | None) -> str:
    return f"The memory folder {folder} (a tmpfs)" if _in_memory(folder, store) else f"The disk of {folder}"


def full_disk(folder: Path, what: str, store: ImageStore | None = None) -> str:
    """The sentence for a full ``folder``; one of ``store``'s memory folder is said to be memory, with its own
    way out (a state_dir elsewhere would not help it)."""
    if _in_memory(folder, store):
        return (f"{_full(folder, store)} is full: {what} there. Suspend to disk instead (--images disk; REST "
                '{"images": "disk"}; or c.MigratableProvisioner.suspend_to = "disk"), or free memory there, then '
                "try again.")
    return (f"{_full(folder, store)} is full: {what} there. Free space on it (or set "
            "c.MigratableProvisioner.state_dir to a folder on a disk with room), then try again.")


def restore_from_images(ctx: KernelContext, images: Path, manifest: Manifest) -> None:
    """Undo of a dump: the kernel comes back as it was, from the images just written. If it cannot, the
    images are all that is left of it: they are kept (the kernel is then broken, its images named)."""
    ctx.images, ctx.manifest = images, manifest
    try:
        pid = criu_restore(ctx)
        ctx.restored_at = time.monotonic()  # this restore's, not an earlier one's of the same plan (back.py)
        adopt_tree(ctx, pid)
    except BaseException:
        ctx.keep_images = True
        raise


def forget_new_images(ctx: KernelContext) -> None:
    """Undo of a new image folder: removed, its logs kept (a failed dump's log says why); kept instead if
    they hold a kernel that could not be brought back."""
    if ctx.keep_images:
        log.error("kernel %s could not be brought back from its images: they are kept in %s",
                  ctx.kernel.kernel_id, ctx.images)
        return
    ctx.tools.store.remove(ctx.kernel.kernel_id, keep_logs=True)


#: An adopt that takes this long (seconds) says where its time went.
ADOPT_SAID = 0.25


def adopt_tree(ctx: KernelContext, pid: int) -> None:
    """The restored tree is the kernel again, once its clients are back.

    Its clients re-dial by themselves; a SUB socket that is not subscribed yet loses what the
    kernel publishes. So wait (briefly, bounded) until every port has its clients back, then
    until the kernel itself serves a new client on shell and IOPub.
    """
    assert ctx.manifest is not None
    timeout = ctx.tools.reconnect_timeout
    expected = {int(port): n for port, n in ctx.manifest.clients.items()}
    waited = time.monotonic()
    # A live client re-dials every 0.1 s from when the ports listen again (the restore): where steps ran since
    # (the remap, the kernel reading its stash back), it had that long already. One counted before the restore
    # and closed meanwhile (a short-lived client of the server's) never comes, and the wait for it ends that
    # much sooner (it cost the way home of a stashed kernel 1 s in 1 of 4 trips).
    since = waited - ctx.restored_at if ctx.restored_at is not None else 0.0
    settle = max(netstate.SETTLE - since, netstate.SETTLE_AFTER)
    missing = netstate.wait_for_clients(proctree.descendants(pid), expected, timeout, settle=settle, skip_own=True)
    if missing and timeout > 0:  # none waited for (a peer's restore: its relay dials after this): nothing to say
        info = ctx.kernel.kernel_connection_info
        ports = {key: str(info.get(f"{key}_port", "")) for key in ("shell", "iopub", "stdin", "control", "hb")}
        names = {int(port): key for key, port in ports.items() if port.isdigit()}  # a log line never fails adopt
        log.info("gpumigrate: kernel %s: %s client(s) did not reconnect in %.2f s (gone meanwhile?): %s, of %s "
                 "expected", ctx.manifest.kernel_id, sum(missing.values()), time.monotonic() - waited,
                 ", ".join(f"{n} on {names.get(port, port)}" for port, n in sorted(missing.items())),
                 ", ".join(f"{n} on {names.get(port, port)}" for port, n in sorted(expected.items())))
    clients = time.monotonic()
    ctx.kernel.adopt(pid)
    if not ctx.kernel.wait_ready(timeout):
        log.warning("kernel %s: restored, but it did not answer within %.1f s", ctx.manifest.kernel_id, timeout)
    if time.monotonic() - waited >= ADOPT_SAID:  # where a slow adopt's time goes
        answered = getattr(ctx.kernel, "answered", None) or {}
        # a reply before the status: the kernel served, and the new subscription reached it late
        how = (f" ({answered['asked']} asked; " + (f"its reply on control after {answered['reply']:.2f} s, before "
               "its status" if "reply" in answered else "its status came first") + ")") if "asked" in answered else ""
        log.info("gpumigrate: kernel %s adopted in %.2f s: its clients waited for %.2f s, its answer %.2f s after%s",
                 ctx.manifest.kernel_id, time.monotonic() - waited, clients - waited, time.monotonic() - clients, how)


# -- bringing a tree back here from its images: restore, [remap, unlock], adopt ----------------------


def place(ctx: KernelContext, manifest: Manifest, to_gpu: int | Sequence[int] | None, no_gpu: str) -> None:
    """Take ``manifest`` and choose its GPUs (``to_gpu``: a GPU, or one per GPU it held; else where it
    was, else the roomiest); ``no_gpu`` is the sentence for a ``to_gpu`` asked of a kernel that holds none."""
    ctx.manifest = manifest
    if manifest.gpus:
        move = ctx.move = placement.plan_resume(ctx.tools.inventory(), manifest.gpus, to_gpu, ctx.tools.driver_major(),
                                                ctx.tools.avoid())
        ctx.gpu.track(manifest.cuda_pids, [p.source.uuid for p in move.pairs], move.needed)
    elif to_gpu is not None:
        raise GpuError(no_gpu)


#: How long a resume waits for exited processes that hold the kernel's PIDs to be collected (seconds): the
#: kernel's own tree, dumped a moment ago, is a zombie until its parent collects it, and a kernel adopted from an
#: earlier server has PID 1 for its parent, which may take a few seconds (an attack resumed at once, and was
#: refused in 2 of 4 tries).
PID_SETTLE = 10.0


def free_pids(manifest: Manifest) -> None:
    """CRIU gives every process and thread its old number back. Keep new processes off those numbers,
    and say who holds one, if any, before CRIU starts (it would say "File exists")."""
    proctree.steer_pid_allocation(manifest.ids)
    holder = proctree.first_holder(manifest.ids, settle=PID_SETTLE)
    if holder is not None:
        then = ("Resume again once its parent has collected it" if holder.state in ("Z", "X") else
                "Stop that process (or wait until it exits), then resume again")
        raise PidConflict(
            f"Cannot resume yet: PID {holder.pid}, which the kernel used, is now taken by {holder.describe()}. "
            f"{then}; the kernel's images are kept.",
            holder.pid, holder.describe(),
        )


def restore_tree(ctx: KernelContext) -> None:
    """CRIU recreates the tree from the images; undone by killing it (the images stay as they were). The undo
    is registered first: a restore that fails after CRIU made the tree (its pidfile gone with a folder taken
    meanwhile, say) must not leave it running. The tree comes back under its old PID, which was free before."""
    assert ctx.manifest is not None
    root = ctx.manifest.pid
    there_before = proctree.is_alive(root)
    ctx.undo(lambda: kill_tree(ctx.pid if ctx.pid is not None else (None if there_before else root)))
    ctx.pid = criu_restore(ctx)
    ctx.restored_at = time.monotonic()


def criu_restore(ctx: KernelContext) -> int:
    """CRIU's restore of ``ctx.images``; the PID of the tree's root."""
    assert ctx.manifest is not None
    try:
        return ctx.criu.restore(ctx.images, ctx.manifest.ids)
    except CriuFailed as exc:
        # CRIU writes its log and the restored tree's PID file beside the images: on a disk filled since they
        # were written it fails with no word of its own ("no error logged"). The disk's room says it.
        # Only where CRIU said nothing else (a log it could not write) or said ENOSPC: a cause it logged stands.
        logged = error_lines(Path(exc.log_path)) if exc.log_path else []
        if _disk_full(f"{exc}\n{exc.log_tail}") or (not logged and _no_room(ctx.images)):
            raise for_full(CriuFailed(
                f"{_full(ctx.images.parent, ctx.tools.store)} is full: CRIU could not write its log there, so it "
                "could not restore the kernel. Free room there, then resume again; the images are kept.",
                exc.log_path, exc.log_tail), ctx.images.parent) from exc
        raise


def kill_tree(pid: int | None) -> None:
    if pid is not None:
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)


def remap_restored(ctx: KernelContext) -> None:
    """The GPU memory of a tree just restored from images onto its chosen GPU. Nothing to undo: killing
    the tree (the restore's undo) undoes it."""
    assert ctx.move is not None
    ctx.gpu.restore_to(ctx, ctx.move.assignment(), undoable=False)


def unlock(ctx: KernelContext) -> None:
    ctx.gpu.unlock(ctx)


def unlock_restored(ctx: KernelContext) -> None:
    """Unlock a tree just restored from images: if a later step fails, the tree is killed anyway, so its
    lock again is only tidiness (the images are intact)."""
    ctx.gpu.unlock(ctx, cleanup=True)


def lock(ctx: KernelContext) -> None:
    ctx.gpu.lock(ctx)


def checkpoint(ctx: KernelContext) -> None:
    ctx.gpu.checkpoint(ctx)


def adopt_restored(ctx: KernelContext) -> None:
    assert ctx.pid is not None
    adopt_tree(ctx, ctx.pid)


def forget_images(ctx: KernelContext) -> None:
    """The kernel runs again (here or elsewhere): its images are stale, and they hold its memory (freed by a
    thread of its own: the kernel runs meanwhile)."""
    ctx.tools.store.remove(ctx.kernel.kernel_id, later=True)

