"""Resume: a suspended kernel comes back from its images, onto a GPU of its model.

    prepare     read the manifest, choose the GPUs, free the PIDs (nothing to undo)
    restore     CRIU recreates the tree                           undo: kill it (the images stay)
    remap       GPU memory onto the chosen GPUs (GPU only)        (undone with the restore)
    unlock      CUDA calls go on (GPU only)                       undo: lock (tidiness: the tree is killed)
    unstash     the kernel reads back the buffers it stashed,     (undone with the restore)
                checking each chunk's checksum (if it did)
    adopt       the tree is the kernel, its clients are back      (last)
    on success  the images are stale: removed

A stash file that does not hold what was written fails the resume: the tree is killed, the images are
kept, and the error says which file.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ImageError
from ..kernelproc import KernelProcess
from ..saga import ON_SUCCESS, ProgressCallback, Saga, Step
from .common import (KernelContext, Outcome, Tools, adopt_restored, forget_images, free_pids, place, remap_restored,
                     restore_tree, unlock_restored)
from .suspend import STASH_RATE, STASH_WAIT


def saga() -> Saga[ResumeContext]:
    return Saga(
        "resume",
        [
            Step("prepare", prepare),
            Step("restore", restore_tree),
            Step("remap", remap_restored, when=KernelContext.on_gpu),
            Step("unlock", unlock_restored, when=KernelContext.on_gpu),
            Step("unstash", unstash, when=lambda ctx: bool(ctx.manifest and ctx.manifest.stash)),
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


def prepare(ctx: ResumeContext) -> None:
    kernel_id = ctx.kernel.kernel_id
    manifest = ctx.tools.store.read_manifest(kernel_id)
    if manifest.kernel_id != kernel_id:
        raise ImageError(f"The images in {ctx.images} belong to kernel {manifest.kernel_id}, not {kernel_id}.")
    place(ctx, manifest, ctx.to_gpu, f"The kernel held no GPU when it was suspended, so it cannot be resumed "
                                     f"onto GPU {ctx.to_gpu}: resume it without to_gpu.")
    free_pids(manifest)


def unstash(ctx: ResumeContext) -> None:
    """The restored kernel reads its buffers back from the stash files. A file that does not hold what was
    written fails the resume: the restore's undo kills the tree, and the images are kept as they are."""
    assert ctx.manifest is not None
    timeout = STASH_WAIT + int(ctx.manifest.stash.get("stashed", 0)) / STASH_RATE
    try:
        ctx.stash = ctx.kernel.host_take_back(str(ctx.images), timeout, ctx.pid)
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
