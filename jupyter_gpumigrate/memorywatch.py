"""Images in memory go to disk when the host's memory runs short.

A suspend puts a kernel's images in memory (a tmpfs) only while the host has room for them (images.choose),
but memory can run short later, for the kernels that run on, and tmpfs pages are host memory. So, every
``c.GPUMigrateApp.memory_check_interval`` seconds, when the host's available memory falls under
``c.GPUMigrateApp.memory_low`` of its total, the server moves suspended kernels' images from memory to disk,
the largest first, until it is above again (images.ImageStore.to_disk: crash-safe). No operation starts on
a kernel whose images are being moved (OperationManager.moving_images); one under way is never touched.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .engine.images import MEMORY, host_memory
from .opformat import size
from .operations import OperationManager
from .provisioner import MigratableProvisioner

log = logging.getLogger(__name__)


def in_memory(kernel_manager: Any) -> list[tuple[str, MigratableProvisioner, int]]:
    """The kernels whose images are in memory and all there is of them (suspended, or broken with them whole),
    largest first: (id, provisioner, image bytes)."""
    found = []
    for kernel_id in kernel_manager.list_kernel_ids():
        provisioner = getattr(kernel_manager.get_kernel(kernel_id), "provisioner", None)
        if not isinstance(provisioner, MigratableProvisioner) or not provisioner.keeps_whole_images():
            continue
        if provisioner.images.where(kernel_id) == MEMORY:
            manifest = provisioner.manifest()
            found.append((kernel_id, provisioner, manifest.image_bytes if manifest else 0))
    return sorted(found, key=lambda item: item[2], reverse=True)


def short(low: float) -> tuple[bool, str]:
    """Whether the host's available memory is under ``low`` of its total, and the numbers, said."""
    total, available = host_memory()
    said = f"{available / 1e9:.1f} of {total / 1e9:.1f} GB available, under {low:.0%}"
    return total > 0 and available < low * total, said


async def relieve(kernel_manager: Any, operations: OperationManager, low: float) -> list[str]:
    """If memory runs short, move images from memory to disk until it no longer does; the kernels moved."""
    moved: list[str] = []
    for kernel_id, provisioner, image_bytes in in_memory(kernel_manager):
        running_short, said = short(low)
        if not running_short:
            break
        if kernel_id in operations.active or kernel_id in operations.discarding:
            continue
        operations.moving_images.add(kernel_id)
        move = asyncio.ensure_future(asyncio.to_thread(provisioner.images.to_disk, kernel_id))
        # Marked as moving until the copy itself ends, not this coroutine: the server's stop cancels it, and
        # must then wait for the copy (app.py), not start a second one on the same folder.
        move.add_done_callback(lambda done, kernel_id=kernel_id: _moved(operations, kernel_id, done))
        try:
            folder = await asyncio.shield(move)
        except OSError as exc:
            log.error("gpumigrate: memory runs short (%s), but kernel %s's images could not be moved to disk: %s",
                      said, kernel_id, exc)
            continue
        log.warning("gpumigrate: memory runs short (%s): kernel %s's images (%s) moved from memory to %s", said,
                    kernel_id, size(image_bytes), folder)
        moved.append(kernel_id)
    return moved


def _moved(operations: OperationManager, kernel_id: str, move: asyncio.Future) -> None:
    operations.moving_images.discard(kernel_id)
    if not move.cancelled() and move.exception() is not None:  # read: said here if no one waits for it any more
        log.debug("gpumigrate: the move of kernel %s's images to disk failed: %s", kernel_id, move.exception())


async def keep_relieving(kernel_manager: Any, operations: OperationManager, low: float, interval: float) -> None:
    """Every ``interval`` seconds, :func:`relieve`, until cancelled (the server stops)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await relieve(kernel_manager, operations, low)
        except Exception:  # noqa: BLE001  the server runs on; the next pass tries again
            log.exception("gpumigrate: moving images out of memory failed")
