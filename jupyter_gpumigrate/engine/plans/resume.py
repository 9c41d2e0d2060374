"""Resume: a suspended kernel comes back from its images, onto a GPU of its model.

    prepare     read the manifest, choose the GPUs, free the PIDs (nothing to undo)
    prefetch    (GPU, stash) the stash helper reads the stashed     undo: the helper frees and ends
                CUDA buffers onto the chosen GPU, checking each
                chunk, while the next three phases run
                (engine/prefetch.py); the restore of a move to
                this host takes the one begun as its images
                arrived, where it reads them onto that GPU
    restore     CRIU recreates the tree                           undo: kill it (the images stay)
    remap       GPU memory onto the chosen GPUs (GPU only)        (undone with the restore)
    unlock      CUDA calls go on (GPU only)                       undo: lock (tidiness: the tree is killed)
    unstash     the kernel reads back the buffers it stashed,     (undone with the restore)
                checking each chunk's checksum (if it did): its
                CUDA buffers from the prefetch where it holds
                them; then the helper ends
    adopt       the tree is the kernel, its clients are back      (last)
    on success  the images are stale: removed

A stash file that does not hold what was written fails the resume: the tree is killed, the images are
kept, and the error says which file.
"""

from __future__ import annotations

from collections.abc import Sequence

import json
import logging

from .. import gpus as gpus_mod
from .. import placement
from ..errors import ImageError
from ..kernelproc import KernelProcess
from ..prefetch import Prefetch, cuda_bytes, room_for
from ..saga import ON_SUCCESS, ProgressCallback, Saga, Step
from .common import (KernelContext, Outcome, Tools, adopt_restored, disk_full_said, forget_images, free_pids, place,
                     remap_restored, restore_tree, unlock_restored)
from .suspend import STASH_RATE, STASH_WAIT

log = logging.getLogger(__name__)


def saga() -> Saga[ResumeContext]:
    return Saga(
        "resume",
        [
            Step("prepare", prepare),
            Step("prefetch", prefetch, when=prefetching),
            Step("restore", restore_tree),
            Step("remap", remap_restored, when=KernelContext.on_gpu),
            Step("unlock", unlock_restored, when=KernelContext.on_gpu),
            Step("unstash", unstash, when=stashed),
            Step("adopt", adopt_restored),
            Step("forget images", forget_images, kind=ON_SUCCESS),
        ],
        # broken: only one whose images are whole and no process of which runs (the server checks:
        # MigratableProvisioner.resumable_broken), left so by an undo that could not restore it
        start_from=("suspended", "broken"),
        success="running",
        refuse=lambda state: f"The kernel is {state}, not suspended: there is nothing to resume.",
    )


class ResumeContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, to_gpu: int | Sequence[int] | None) -> None:
        super().__init__(kernel, tools)
        self.to_gpu = to_gpu


def stashed(ctx: ResumeContext) -> bool:
    return bool(ctx.manifest and ctx.manifest.stash)


def prepare(ctx: ResumeContext) -> None:
    kernel_id = ctx.kernel.kernel_id
    store = ctx.tools.store
    finished = store.finished_dump(kernel_id)
    if finished is not None:  # a dump whose manifest could not be written after it (the disk was full)
        with disk_full_said(ctx, "stays as it is; its images are whole and kept."):
            store.write_manifest(store.path_for(kernel_id), finished)
    manifest = store.read_manifest(kernel_id)
    if manifest.kernel_id != kernel_id:
        raise ImageError(f"The images in {ctx.images} belong to kernel {manifest.kernel_id}, not {kernel_id}.")
    place(ctx, manifest, ctx.to_gpu, f"The kernel held no GPU when it was suspended, so it cannot be resumed "
                                     f"onto GPU {ctx.to_gpu}: resume it without to_gpu.")
    free_pids(manifest)


def prefetch(ctx: KernelContext, index: dict | None = None) -> None:
    """Where the kernel comes back onto one GPU with room for a second copy of its CUDA buffers, the stash
    helper starts reading them there (engine/prefetch.py). Never fails the restore: where it cannot, the
    kernel reads its files itself, and :attr:`KernelContext.no_prefetch` says why. A local resume's, a
    kernel's coming home from another host (plans/host_move.py), and that host's restore of it. With
    ``index`` (the stash's, as its file holds it), the files are still arriving: the helper reads each chunk
    as soon as its file holds it (the way home)."""
    early = ctx.tools.early_prefetch(ctx.images)  # begun as the images arrived (peers.py): ours from here on
    if early is None:
        _prefetch(ctx, None, index)
        return
    ctx.undo(early.stop, cleanup=True)  # after the restore's undo, as below
    try:
        _prefetch(ctx, early, index)
    finally:
        if ctx.prefetch is not early:  # not taken: its memory goes now
            early.stop()


def _prefetch(ctx: KernelContext, early: Prefetch | None, given: dict | None) -> None:
    """:func:`prefetch`, given the one begun as the images arrived, if any: taken (as :attr:`KernelContext.prefetch`)
    where it reads the stash that arrived onto the GPU chosen."""
    assert ctx.manifest is not None
    move = ctx.move
    if move is None or move.several:
        ctx.no_prefetch = "the kernel comes back onto several GPUs"
        return
    try:
        index = given if given is not None else json.loads((ctx.images / "stash-index.json").read_text())
        nbytes = cuda_bytes(index)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        ctx.no_prefetch = f"its stash's index cannot be read ({exc}): the kernel reads its files itself"
        return
    if early is not None:
        if early.gpu_uuid == move.target.uuid and early.reads(index) and early.alive():
            ctx.prefetch = early  # its GPU was checked for room as it began (which it now holds)
            return
        log.warning("kernel %s: the prefetch begun as its images arrived is dropped (%s)", ctx.kernel.kernel_id,
                    "the restore goes onto another GPU" if early.gpu_uuid != move.target.uuid else
                    "it read another stash's index" if not early.reads(index) else
                    f"its helper failed: {early.reason or 'it ended'}")
        early.stop(wait=True)  # its memory free before the room for another is judged
    if not nbytes:
        ctx.no_prefetch = "the stash holds no CUDA buffer"
        return
    target = next((g for g in ctx.tools.inventory() if g.uuid == move.target.uuid), move.target)
    if gpus_mod.one_context_only(target.uuid):
        ctx.no_prefetch = (f"GPU {target.index} takes one process's CUDA context at a time (its compute mode): a "
                           "helper's there would keep the kernel out")
        return
    if not room_for(placement.free(target), move.needed, nbytes):
        ctx.no_prefetch = (f"GPU {target.index} has {placement.free(target) / 1e9:.1f} GB free: too little for "
                           f"the kernel and a second copy of its {nbytes / 1e9:.1f} GB of buffers")
        return
    fetch = Prefetch(ctx.images, move.target.uuid, nbytes, index=given)
    ctx.undo(fetch.stop, cleanup=True)  # after the restore's undo (newest first): the tree is gone by then
    try:
        fetch.start()
    except OSError as exc:  # the helper could not start: the kernel reads the files itself
        fetch.stop()
        ctx.no_prefetch = f"the stash helper did not start ({exc})"
        return
    ctx.prefetch = fetch


def prefetching(ctx: KernelContext) -> bool:
    """Whether a restore should try a prefetch: a GPU kernel that stashed, where the setting lets it."""
    return bool(ctx.tools.prefetch and ctx.on_gpu() and ctx.manifest and ctx.manifest.stash)


#: How long a restore waits for the restored kernel to say that it begins mapping the prefetch's memory (it
#: answers at once, the mapping made in a thread).
OPEN_WAIT = 10.0


def take_back(ctx: KernelContext) -> dict:
    """The restored kernel reads back the buffers it stashed, each chunk checked: its CUDA buffers from the
    prefetch where one holds them (the kernel maps the helper's memory while the helper still reads, and
    copies once it is done), the rest from the files; then the helper frees. What the kernel said, with the
    prefetch's account under ``prefetch``. Raises as :meth:`KernelProcess.host_take_back` does (RuntimeError:
    the kernel's own refusal, a damaged file; OSError, TimeoutError: no answer): the caller says what it
    means for the kernel."""
    assert ctx.manifest is not None
    timeout = STASH_WAIT + int(ctx.manifest.stash.get("stashed", 0)) / STASH_RATE
    fetch = ctx.prefetch
    if fetch is not None and not fetch.reads(_arrived_index(ctx)):
        # begun as the files arrived, by the index sent first: the kernel is given only what was read by its own
        fetch.stop()
        fetch.reason = "it read the stash by an index other than the one that arrived: the kernel read its files"
    if fetch is not None:
        # The kernel maps the helper's memory while the helper reads (32 GB: 0.2 s no longer waited for).
        early = fetch.allocated(timeout)
        if early is not None:
            fetch.mapped_late = ctx.kernel.host_open_prefetch(str(ctx.images), early, OPEN_WAIT, ctx.pid)
    gpu = fetch.result(timeout) if fetch is not None else None
    try:
        said = ctx.kernel.host_take_back(str(ctx.images), timeout, ctx.pid, gpu=gpu)
    except RuntimeError as exc:
        if gpu is None or "unexpected keyword argument 'gpu'" not in str(exc):
            raise
        # A kernel suspended by an older version, waiting at a busy cell's safe point, whose take_back has no
        # ``gpu``: it said so having changed nothing, and waits there still.
        log.warning("kernel %s did not take the prefetch (%s): it reads its files itself", ctx.kernel.kernel_id, exc)
        fetch.reason = f"the kernel did not take it ({exc})"  # type: ignore[union-attr]
        said = ctx.kernel.host_take_back(str(ctx.images), timeout, ctx.pid)
    # The kernel holds its copy: the helper's memory goes while the restore goes on. (On a failure the undo
    # stops it, once the restore's undo has killed the tree: never while the kernel may still be copying.)
    if fetch is not None:
        fetch.stop()
    if fetch is not None or ctx.no_prefetch:
        account = fetch.said(said.get("from_gpu")) if fetch is not None else {"bytes": 0, "reason": ctx.no_prefetch}
        if said.get("prefetch_refused"):
            account["reason"] = f"the kernel refused it: {said.pop('prefetch_refused')}"
        if said.get("mapped_late"):
            account["mapped_late"] = said.pop("mapped_late")
        said["prefetch"] = account
    return said


def _arrived_index(ctx: KernelContext) -> dict | None:
    """The stash's index in the images, as its file holds it (None if it cannot be read)."""
    try:
        return json.loads((ctx.images / "stash-index.json").read_text())
    except (OSError, ValueError):
        return None


def unstash(ctx: KernelContext) -> None:
    """The restored kernel reads its buffers back (:func:`take_back`). A file that does not hold what was
    written fails the resume: the restore's undo kills the tree, and the images are kept as they are."""
    try:
        ctx.stash = take_back(ctx)
    except RuntimeError as exc:
        raise ImageError(f"The kernel could not read its large buffers back from {ctx.images} ({exc}). It is "
                         "left suspended and its images are kept; if a file there was damaged, the kernel cannot "
                         "come back whole: discard it (jupyter gpumigrate discard) once you have what you "
                         "need.") from exc
    except (OSError, TimeoutError) as exc:
        raise ImageError(f"The restored kernel did not read its large buffers back ({exc}); it is left "
                         "suspended, its images kept. Try again.") from exc


def run(kernel: KernelProcess, tools: Tools, to_gpu: int | Sequence[int] | None = None,
        progress: ProgressCallback | None = None) -> Outcome:
    ctx = ResumeContext(kernel, tools, to_gpu)
    result = saga().run(ctx, progress)
    assert ctx.manifest is not None
    several = ctx.move is not None and ctx.move.several
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest,
                   to_gpu=ctx.move.target.index if ctx.move else None, stash=ctx.stash or None,
                   to_gpus=ctx.move.to_gpus if several else None)
