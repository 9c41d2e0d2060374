"""Retention: suspended kernels older than ``c.GPUMigrateApp.retention`` are discarded; the processes that
transplants replaced are deleted once ``c.MigratableProvisioner.keep_transplant_source`` is up.

A suspended kernel's age is that of its images (the manifest's ``created``: when it was suspended). A
discard is what `jupyter gpumigrate discard KERNEL` does, through the same door: the kernel manager
shuts the suspended kernel down, and its provisioner deletes its images (provisioner.py). It is checked
once as the server starts, after the kernels of an earlier server are taken back (revive.py), then every
``retention_interval`` seconds while the server runs. Each discard is logged with the kernel's id, age
and bytes, and listed in the server's operations as a finished ``discard`` (which puts it on the event
bus like any operation).

Kernels are never discarded while an operation runs on them, and none starts on a kernel being
discarded (OperationManager.discarding).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from .engine.images import ImageStore
from .engine.kernelproc import SUSPENDED
from .operations import OperationManager
from .opformat import size
from .provisioner import MigratableProvisioner

log = logging.getLogger(__name__)

DAY = 86400.0


@dataclass
class Discarded:
    """A suspended kernel discarded because it was older than the retention."""

    kernel_id: str
    #: seconds since it was suspended
    age: float
    #: its images' bytes, now free
    image_bytes: int


def describe_age(seconds: float) -> str:
    """An age in the largest unit that keeps it readable: '3.2 days', '5.0 h', '42 s'."""
    if seconds >= DAY:
        return f"{seconds / DAY:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.0f} s"


def expired(kernel_manager: Any, retention: float, now: float | None = None) -> list[tuple[str, float, int]]:
    """The suspended kernels older than ``retention`` seconds: (kernel id, age, image bytes)."""
    now = time.time() if now is None else now
    found = []
    for kernel_id in kernel_manager.list_kernel_ids():
        provisioner = getattr(kernel_manager.get_kernel(kernel_id), "provisioner", None)
        if not isinstance(provisioner, MigratableProvisioner) or provisioner.state != SUSPENDED:
            continue
        manifest = provisioner.manifest()
        if manifest is None or not isinstance(manifest.created, (int, float)):
            continue
        age = now - manifest.created
        if age > retention:
            found.append((kernel_id, age, manifest.image_bytes))
    return found


async def discard_expired(kernel_manager: Any, operations: OperationManager, retention: float) -> list[Discarded]:
    """Discard every suspended kernel older than ``retention`` seconds (0: none); what was discarded."""
    if retention <= 0:
        return []
    done: list[Discarded] = []
    for kernel_id, age, image_bytes in expired(kernel_manager, retention):
        if kernel_id in operations.active or kernel_id in operations.moving_images:
            continue  # a resume (or another operation, a move to disk) under way: the next pass looks again
        operations.discarding.add(kernel_id)
        try:
            await kernel_manager.shutdown_kernel(kernel_id)  # what DELETE /api/kernels/{id} does: discard
        except Exception:  # noqa: BLE001  one kernel never stops the others
            log.exception("gpumigrate: kernel %s is older than the retention, but could not be discarded",
                          kernel_id)
            continue
        finally:
            operations.discarding.discard(kernel_id)
        log.warning("gpumigrate: discarded kernel %s: suspended %s ago, longer than the retention (%s); %s of "
                    "images deleted", kernel_id, describe_age(age), describe_age(retention), size(image_bytes))
        operations.record_discard(kernel_id, image_bytes, trigger="retention")
        done.append(Discarded(kernel_id, age, image_bytes))
    return done


async def keep_discarding(kernel_manager: Any, operations: OperationManager, retention: float,
                          interval: float) -> None:
    """Every ``interval`` seconds, :func:`discard_expired`, until cancelled (the server stops)."""
    while True:
        await asyncio.sleep(interval)
        try:
            await asyncio.wait_for(discard_expired(kernel_manager, operations, retention), timeout=max(interval, 60))
        except asyncio.TimeoutError:
            log.warning("gpumigrate: the retention pass took more than %.0f s; the next one goes on",
                        max(interval, 60))
        except Exception:  # noqa: BLE001  the server runs on; the next pass tries again
            log.exception("gpumigrate: the retention pass failed")


#: How often the running server deletes the transplants' sources whose time is up, in seconds.
SOURCES_INTERVAL = 60.0


async def expire_sources(store: ImageStore, operations: OperationManager) -> list[str]:
    """Delete the kept sources of transplants whose time is up (engine/images.py), but not one that a kernel
    is going back to right now; the kernels' ids."""
    gone = await asyncio.to_thread(store.expire_kept, None, set(operations.active))
    for kernel_id in gone:
        log.info("gpumigrate: kernel %s can no longer go back to the process its transplant replaced: its time is "
                 "up, and its images are deleted", kernel_id)
    return gone


async def keep_expiring_sources(store: Callable[[], ImageStore], operations: OperationManager,
                                interval: float = SOURCES_INTERVAL) -> None:
    """:func:`expire_sources` now, then every ``interval`` seconds, until cancelled (the server stops)."""
    while True:
        try:
            await expire_sources(store(), operations)
        except Exception:  # noqa: BLE001  the server runs on; the next pass tries again
            log.exception("gpumigrate: deleting the transplants' sources whose time is up failed")
        await asyncio.sleep(interval)
