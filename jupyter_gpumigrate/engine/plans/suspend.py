"""Suspend: the running kernel goes into images, in memory or on disk; its GPU (and, on disk, its memory) are freed.

    prepare     an image folder (memory or disk, images.choose)   undo: remove the folder (logs kept)
                and the tree's manifest
    stash       the kernel writes its large buffers into the      undo: the kernel reads them back
                folder and frees them (when it can)
    lock        CUDA calls of each CUDA process wait (GPU only)   undo: unlock
    checkpoint  GPU memory into the process's host memory         undo: back onto its GPU
    dump        CRIU writes the tree and kills it                 undo: restore it from the images

With images "auto" put in memory (images.choose judged there was room), a memory that fills before CRIU
is done (another kernel's images, a user's files, what the tree holds that its resident size does not show:
the stash's ENOSPC, the pending manifest's, CRIU's own, or the node helper's room check, "no-room") fails
the plan, which rolls back: the kernel runs on, unchanged. The plan then runs once more with its images on
disk (:func:`run`): a suspend the idle policy asked for still frees the GPU. Not for a kernel being shut
down (a stopping server's late suspends), nor one whose rollback did not end with it running. Asked for
memory, it fails as it did. A memory that fills after CRIU is done (the final manifest) leaves the kernel
broken with its images whole, as on a full disk: freed memory, a resume brings it back.

The stash (kernel/hoststash.py) is what makes a large kernel fast to suspend: its own threads write the
big PyTorch storages (CUDA through pinned buffers) and bytearrays in parallel, so the driver checkpoints
only the CUDA context and CRIU dumps only the rest. A kernel busy with a cell serves it at the cell's safe
point (kernel/safepoint.py), where the cell waits until its buffers are back. Where it steps aside (a
non-IPython kernel, a cell that does not reach its safe point in time, a user's thread, too little to
gain), nothing changed and CRIU and the driver carry everything.
"""

from __future__ import annotations

import errno
import logging
import time
from dataclasses import replace
from pathlib import Path

from .. import proctree
from ..criu import given_up, never_seized
from ..errors import DEAD, ImageError, InvalidState, MigrateError, PhaseFailed, for_full, no_room, said
from ..images import AUTO, DISK, FILLED
from ..kernelproc import RUNNING, KernelProcess
from ..saga import ProgressCallback, Saga, Step
from .common import (KernelContext, Outcome, Tools, checkpoint, disk_full_said, dump, full_disk, lock, new_images,
                     running_pid)

log = logging.getLogger(__name__)

#: How long the kernel gets to write its buffers: this, plus a second per STASH_RATE bytes it may hold.
STASH_WAIT = 60.0
STASH_RATE = 2 * 10**8


def saga() -> Saga[KernelContext]:
    return Saga(
        "suspend",
        [
            Step("prepare", prepare),
            Step("stash", stash, when=worth_asking),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump),
        ],
        start_from=("running",),
        success="suspended",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be suspended.",
    )


def prepare(ctx: KernelContext) -> None:
    new_images(ctx, running_pid(ctx), ctx.tools.images)


def _held(ctx: KernelContext) -> int:
    """What the kernel's root process holds, in host and GPU memory: a bound on its buffers."""
    assert ctx.manifest is not None
    return sum(int(g.get("memory_used", 0)) for g in ctx.manifest.gpus) + proctree.memory(ctx.manifest.pid)


def worth_asking(ctx: KernelContext) -> bool:
    """Whether to ask the kernel for the stash: not when it holds too little for the stash to pay."""
    least = ctx.tools.host_stash_min
    return least is not None and _held(ctx) >= least


def stash(ctx: KernelContext, idle_only: bool = False) -> None:
    """The kernel writes its large buffers into the image folder and frees them (:func:`write_stash`); the
    manifest says so, for whoever restores the images."""
    assert ctx.manifest is not None and ctx.tools.host_stash_min is not None
    said = ctx.stash = write_stash(ctx, ctx.tools.host_stash_min, _held(ctx), idle_only=idle_only)
    if "stashed" in said:
        ctx.manifest.stash = {k: said[k] for k in ("stashed", "buffers", "files", "seconds", "split") if k in said}


def write_stash(ctx: KernelContext, least: int, bound: int, gpu_only: bool = False, idle_only: bool = False) -> dict:
    """The kernel writes its large buffers (``gpu_only``: its CUDA tensors alone) into ``ctx.images`` and
    frees them, if it holds ``least`` bytes of them or more: what it said (``stashed``..., or ``aside``).
    ``bound`` bounds what it may write (for the wait); ``idle_only``: not at a busy cell's safe point. The
    undo is registered first: a stash that outlives the wait is read back behind it (the kernel serves
    requests in order)."""
    assert ctx.manifest is not None
    timeout = STASH_WAIT + bound / STASH_RATE
    # The manifest to be first: should this server die while the kernel's buffers are in the stash, the
    # next one finds the kernel and has it read them back (revive.py).
    with disk_full_said(ctx, "runs on, unchanged."):
        ctx.tools.store.write_pending(ctx.images, ctx.manifest, ctx.kernel.secrets())
    said: dict = {}
    ctx.undo(lambda: take_back(ctx, said, timeout))
    try:
        said.update(ctx.kernel.host_stash(str(ctx.images), least, timeout, gpu_only=gpu_only, idle_only=idle_only))
    except TimeoutError as exc:
        raise MigrateError(f"The kernel did not finish writing its large buffers within {timeout:.0f} s (a slow "
                           "disk, or a cell that ran first): the operation is undone; the kernel reads back what it "
                           "wrote once it is done, and runs on.") from exc
    except RuntimeError as exc:
        if f"[Errno {errno.ENOSPC}]" in str(exc):
            raise for_full(ImageError(full_disk(ctx.images.parent, "the kernel could not write its large buffers",
                                                ctx.tools.store) + " The kernel runs on, unchanged."),
                           ctx.images.parent) from exc
        raise MigrateError(f"The kernel could not write its large buffers ({exc}); it runs on, unchanged.") from exc
    except OSError as exc:  # ConnectionError: the kernel ended, or its socket broke
        pid = ctx.pid or ctx.manifest.pid
        if not proctree.is_alive(pid):
            raise InvalidState(f"The kernel's process {pid} ended while it wrote its large buffers, so {DEAD}") \
                from exc
        raise InvalidState(f"The kernel stopped answering while it wrote its large buffers ({exc}): restart "
                           "it.") from exc
    return said


def take_back(ctx: KernelContext, said: dict, timeout: float) -> None:
    """Undo of the stash: the kernel reads its buffers back. Until it has, the files are all there is of
    them: kept, whatever else is undone. Its request waits behind the stash if that still runs (the kernel
    serves requests in order): it gets the stash's time again, and as long again to read. A stash that
    stepped aside (``said``) took nothing away, and one read back already (``taken_back``) holds nothing
    away: nothing to ask (a busy kernel would answer only after its cell)."""
    if "aside" in said or said.get("taken_back"):
        return
    keep, ctx.keep_images = ctx.keep_images, True
    try:
        ctx.kernel.host_take_back(str(ctx.images), 3 * timeout)
    except TimeoutError as exc:
        raise MigrateError(f"The kernel did not read its large buffers back within {3 * timeout:.0f} s; they are "
                           f"kept in {ctx.images}, and the kernel reads them back once it can: restart the server "
                           "to ask it again, or restart the kernel if it stays stuck.") from exc
    except OSError:  # ConnectionError: the kernel ended, or its socket broke
        pid = ctx.kernel.kernel_pid
        if pid is not None and proctree.is_alive(pid):
            raise
        keep = False  # the kernel ended: its buffers with it, and the files are of no use
    ctx.keep_images = keep


#: what the timings of a suspend that went to disk call the attempt in memory that was undone
MEMORY_UNDONE = "memory, undone"


def run(kernel: KernelProcess, tools: Tools, progress: ProgressCallback | None = None) -> Outcome:
    """Suspend ``kernel``; with images ``auto`` in memory that filled meanwhile, once more on disk (the
    module's docstring), its outcome's ``images_why`` saying so and its timings the first attempt's seconds,
    its rollback's included (:data:`MEMORY_UNDONE`); the first attempt's CRIU log, where its dump ran, is kept
    beside the second's (``dump-memory``) until the kernel's next suspend begins (as each dump drops the last
    one's log), its resume (which drops every log of the images it forgets) or its end."""
    began = time.perf_counter()
    if kernel.state == RUNNING:  # a suspend that failed both ways left it: it would pass for this one's
        try:
            tools.store.log_path(kernel.kernel_id, "dump-memory").unlink(missing_ok=True)
        except OSError as exc:  # a log is not worth the suspend
            log.warning("kernel %s: an earlier suspend's first CRIU log stays (%s)", kernel.kernel_id, exc)
    try:
        return _once(kernel, tools, progress)
    except PhaseFailed as failed:
        filled = memory_filled(failed, kernel, tools)
        if filled is None:
            raise
        kept = _keep_log(kernel, tools) if failed.phase == "dump" else None
        log.warning("kernel %s: %s (%s); suspending it to disk instead%s", kernel.kernel_id, filled,
                    said(failed.cause), f" (the first CRIU log: {kept})" if kept else "")
    undone = {MEMORY_UNDONE: time.perf_counter() - began}
    pid = kernel.kernel_pid  # alive: memory_filled saw it

    def after(phase: str, event: str, timings: dict[str, float]) -> None:
        if progress is not None:
            progress(phase, event, {**undone, **timings})

    try:
        outcome = _once(kernel, replace(tools, images=DISK), after)
    except PhaseFailed as failed:  # said with what came first: the user asked neither for memory nor for disk
        if pid is not None and not failed.ended and _ended_before_dump(failed, kernel, tools, pid):
            raise PhaseFailed(failed.phase, failed.cause, failed.rolled_back, failed.undo_errors, ended=(
                f"The {filled}, so the suspend went again, to disk; but the kernel's process {pid} ended before "
                f"that second attempt dumped it, so nothing was dumped and {DEAD}")) from failed
        raise PhaseFailed(failed.phase, failed.cause, failed.rolled_back, failed.undo_errors, ended=failed.ended,
                          before=f"The {filled}, so the suspend went to disk, where it failed too: ") from failed
    outcome.images_why = f"{filled}; written to disk instead"
    outcome.result.timings = {**undone, **outcome.result.timings}
    return outcome


def memory_filled(failed: PhaseFailed, kernel: KernelProcess, tools: Tools) -> str | None:
    """Why a suspend of images "auto" failed, where it failed because the memory folder filled and rolled
    back whole (the kernel runs, as it did, and is not being shut down): said in a few words. None otherwise."""
    folder = no_room(failed.cause)
    memory = tools.store.memory_root
    pid = kernel.kernel_pid
    if tools.images != AUTO or memory is None or folder is None or Path(folder) != memory:
        return None  # not "auto", or not its memory that filled
    if not failed.rolled_back or kernel.state != RUNNING or pid is None or not proctree.is_alive(pid):
        return None  # not given back whole (its buffers not read back, its process gone...)
    if failed.ended or getattr(kernel, "stop_requested", None) or \
            any(given_up(p) for p in tools.store.places(kernel.kernel_id)):
        return None  # being shut down (the saga read it before the state settled: whoever waits may forget it
        # since), or its server stopping gave it up
    return f"{FILLED} in {memory}"


def _ended_before_dump(failed: PhaseFailed, kernel: KernelProcess, tools: Tools, pid: int) -> bool:
    """Whether the attempt on disk failed because the kernel's process ``pid`` had ended before it was dumped:
    gone, and the attempt failed before its dump (the stash says its own), or in its dump before CRIU took hold
    of it."""
    if proctree.is_alive(pid) or failed.undo_errors or failed.phase == "stash":
        return False
    return failed.phase != "dump" or never_seized(tools.store.log_path(kernel.kernel_id, "dump"), pid)


def _keep_log(kernel: KernelProcess, tools: Tools) -> Path | None:
    """The failed attempt's CRIU log, renamed so that the next attempt's does not replace it; its new path."""
    log_path = tools.store.log_path(kernel.kernel_id, "dump")
    kept = tools.store.log_path(kernel.kernel_id, "dump-memory")
    try:
        log_path.replace(kept)
    except OSError:
        return None
    return kept


def _once(kernel: KernelProcess, tools: Tools, progress: ProgressCallback | None) -> Outcome:
    ctx = KernelContext(kernel, tools)
    result = saga().run(ctx, progress)
    assert ctx.manifest is not None
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest, stash=ctx.stash or None,
                   images=ctx.images_where, images_why=ctx.images_why)
