"""Back: the kernel goes back to the process that its last transplant replaced (plans/transplant.py keeps
that source's images for a while). What the kernel did since the transplant is lost: the caller was told.

    prepare     the kept source is there and in time, its PIDs free;  undo: remove the folder (logs kept)
                the cells sent before have run (else refused); a
                folder for the current process's images
    stash       the current process writes its large buffers there   undo: it reads them back
                (the suspend's host stash, when it pays)
    lock        its CUDA calls wait (GPU only)                        undo: unlock
    checkpoint  its GPU memory into its host memory (GPU only)        undo: back onto its GPU
    dump        CRIU writes the current process and kills it: the     undo: restore it from its images
                kernel's ports are free
    restore     the current images marked "going back"; CRIU          undo: kill it (its images stay),
                recreates the source from its kept images; its GPU    remove the mark
                chosen (where it was, else the roomiest)
    remap       the source's GPU memory onto that GPU (GPU only)      (undone with the restore)
    unlock      its CUDA calls go on (GPU only)                       undo: lock (tidiness)
    unstash     it reads back the buffers it stashed as it left       (undone with the restore)
    adopt       its record, the mark made complete; the source is     (last)
                the kernel again, same kernel id
    on success  the current process's images and the kept source's folder are removed

Until the source answers, the current process's images are kept: any failure brings it back from them,
as it was.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import proctree
from ..errors import ImageError, InvalidState, PidConflict
from ..gpustate import GpuState
from ..images import MANIFEST, Manifest, write_durably
from ..kernelproc import KernelProcess
from ..saga import ON_SUCCESS, ProgressCallback, Saga, Step
from . import resume, suspend
from .transplant import SWITCHED
from .common import (KernelContext, Outcome, Tools, adopt_restored, checkpoint, dump, free_pids, lock, new_images,
                     place, remap_restored, restore_tree, running_pid, unlock_restored)


def saga() -> Saga[BackContext]:
    return Saga(
        "back",
        [
            Step("prepare", prepare),
            Step("stash", suspend.stash, when=suspend.worth_asking),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump),
            Step("restore", restore_source),
            Step("remap", remap_restored, when=KernelContext.on_gpu),
            Step("unlock", unlock_restored, when=KernelContext.on_gpu),
            Step("unstash", unstash, when=lambda ctx: bool(ctx.manifest and ctx.manifest.stash)),
            Step("adopt", adopt),
            Step("forget", forget, kind=ON_SUCCESS),
        ],
        start_from=("running",),
        success="running",
        refuse=lambda state: f"The kernel is {state}, not running: only a running kernel can go back to the "
                             "process its transplant replaced.",
        called="way back",
    )


class BackContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools) -> None:
        super().__init__(kernel, tools)
        #: the kept source's folder and manifest, read in prepare
        self.kept: Path | None = None
        self.source: Manifest | None = None
        #: the current process and its image folder (the dump's), where the marker goes
        self.current_pid: int | None = None
        self.current: Path | None = None
        #: what the source read back of its stash (the current process's own stash stays in ``stash``)
        self.unstashed: dict = {}


def kept_source(ctx: KernelContext) -> tuple[Path, Manifest]:
    """The kept source's folder and manifest; :class:`InvalidState` if there is none to go back to."""
    kernel_id = ctx.kernel.kernel_id
    kept = ctx.tools.store.kept(kernel_id)
    if kept is None:
        raise InvalidState(f"Kernel {kernel_id} has no earlier process to go back to: none was kept after a "
                           "transplant (or it was discarded). It runs on, unchanged.")
    folder, until = kept
    if until <= time.time():
        ctx.tools.store.drop_kept(kernel_id)
        raise InvalidState(f"Kernel {kernel_id}'s earlier process was kept until "
                           f"{time.strftime('%H:%M:%S', time.localtime(until))}, and that time is up: its images "
                           "are removed. It runs on, unchanged.")
    manifest = ctx.tools.store.read_manifest_at(folder)
    if manifest.kernel_id != kernel_id:
        raise ImageError(f"The images kept in {folder} belong to kernel {manifest.kernel_id}, not {kernel_id}.")
    return folder, manifest


#: How long a back waits for the cells the kernel was sent before it (the one with ``%migrate --back``, say).
CELLS_WAIT = 10.0


def prepare(ctx: BackContext) -> None:
    pid = ctx.current_pid = running_pid(ctx)
    ctx.kept, ctx.source = kept_source(ctx)  # its time is checked here only: a back that starts in time ends
    # The current process goes for good: a cell it runs would never answer. The one that asked ends first.
    if not ctx.kernel.finish_cells(CELLS_WAIT):
        raise InvalidState(f"The kernel is running a cell (still after {CELLS_WAIT:.0f} s): going back now would lose "
                           "it, and its notebook would wait for it for ever. Wait until it ends, or interrupt it, then "
                           "go back. It runs on, unchanged.")
    # Its PIDs must be free, now or once the current process is gone (which may hold some, taken since).
    current = set(proctree.tree_ids(pid))
    holder = proctree.first_holder([i for i in ctx.source.ids if i not in current])
    if holder is not None:
        raise InvalidState(f"Cannot go back yet: PID {holder.pid}, which the earlier process used, is now taken by "
                           f"{holder.describe()}. Stop that process (or wait until it exits), then try again; the "
                           "kernel runs on, unchanged.")
    new_images(ctx, pid, ctx.tools.images)


def restore_source(ctx: BackContext) -> None:
    """From here on the context is the source's: its folder, manifest and GPU (the current process's dump
    keeps its own for its undo).

    Before CRIU starts, the current process's images say that a back is under way (SWITCHED, incomplete,
    with the source's PIDs and the time): should this server die before the source is whole and adopted,
    the next one kills what was restored of it and takes the current process back from its images
    (revive.py). :func:`adopt` marks it complete."""
    assert ctx.kept is not None and ctx.source is not None
    if not (ctx.kept / MANIFEST).is_file():
        raise ImageError(f"The earlier process's images in {ctx.kept} are gone (deleted meanwhile?): the kernel runs "
                         "on in the process it was in.")
    ctx.current = ctx.images
    ctx.images, ctx.gpu, ctx.pid, ctx.move = ctx.kept, GpuState(ctx.tools.lock_timeout, ctx.tools.inventory), None, None
    place(ctx, ctx.source, None, "")
    try:
        free_pids(ctx.source)
    except PidConflict as exc:
        raise InvalidState(f"Cannot go back now: PID {exc.pid}, which the earlier process used, was taken meanwhile "
                           f"by {exc.holder}. The kernel runs on in the process it was in; try again once that "
                           "process is gone.") from exc
    marker = ctx.current / SWITCHED
    ctx.undo(lambda: marker.unlink(missing_ok=True))
    write_durably(marker, json.dumps({"pid": ctx.source.pid, "ids": ctx.source.ids,
                                      "since": proctree.tick_boundary(), "complete": False}))
    restore_tree(ctx)


def unstash(ctx: BackContext) -> None:
    current, ctx.stash = ctx.stash, {}
    try:
        resume.unstash(ctx)
    except ImageError as exc:
        raise ImageError(f"The earlier process could not read its large buffers back ({exc.__cause__ or exc}): the "
                         "kernel runs on in the process it was in, unchanged; its earlier process stays kept. Try "
                         "again.") from exc
    finally:
        # The current process's stash stays what its undo looks at.
        ctx.unstashed, ctx.stash = ctx.stash, current


def adopt(ctx: BackContext) -> None:
    """The source is whole: its record, then the marker says the back is complete (a server that dies now
    is followed by one that adopts it if it answers), then it is the kernel once its clients are back."""
    assert ctx.pid is not None and ctx.current is not None and ctx.current_pid is not None
    ctx.kernel.carry_over(ctx.current_pid)  # what the notebook sent meanwhile runs in the source
    ctx.kernel.adopt(ctx.pid)
    write_durably(ctx.current / SWITCHED, json.dumps({"pid": ctx.pid, "started": proctree.start_time(ctx.pid)}))
    adopt_restored(ctx)


def forget(ctx: BackContext) -> None:
    """The current process's images hold memory of a process that is gone for good; the kept folder is spent."""
    store, kernel_id = ctx.tools.store, ctx.kernel.kernel_id
    store.remove(kernel_id)
    store.drop_kept(kernel_id)


def run(kernel: KernelProcess, tools: Tools, progress: ProgressCallback | None = None) -> Outcome:
    """The running kernel goes back to the process its last transplant replaced."""
    ctx = BackContext(kernel, tools)
    result = saga().run(ctx, progress)
    assert ctx.manifest is not None
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest,
                   to_gpu=ctx.move.target.index if ctx.move else None, stash=ctx.unstashed or None)
