"""Suspend: the running kernel goes into images on disk; its GPU and memory are freed.

    prepare     an image folder and the tree's manifest           undo: remove the folder (logs kept)
    lock        CUDA calls of each CUDA process wait (GPU only)   undo: unlock
    checkpoint  GPU memory into the process's host memory         undo: back onto its GPU
    dump        CRIU writes the tree and kills it                 undo: restore it from the images
"""

from __future__ import annotations

from ..kernelproc import KernelProcess
from ..saga import ProgressCallback, Saga, Step
from .common import KernelContext, Outcome, Tools, checkpoint, dump, lock, new_images, running_pid


def saga() -> Saga[KernelContext]:
    return Saga(
        "suspend",
        [
            Step("prepare", prepare),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump),
        ],
        start_from=("running",),
        success="suspended",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be suspended.",
    )


def prepare(ctx: KernelContext) -> None:
    new_images(ctx, running_pid(ctx))


def run(kernel: KernelProcess, tools: Tools, progress: ProgressCallback | None = None) -> Outcome:
    ctx = KernelContext(kernel, tools)
    result = saga().run(ctx, progress)
    assert ctx.manifest is not None
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest)
