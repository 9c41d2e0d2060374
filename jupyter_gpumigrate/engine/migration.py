"""The story of a migration, told as plans of phases, each with its undo.

    suspend:  prepare -> [lock -> checkpoint] -> dump
    resume:   prepare -> restore -> [remap -> unlock] -> adopt

A kernel is a process tree. To suspend it we write the tree to an image directory with CRIU, which
kills it; to resume it CRIU recreates the tree from the images with the same PIDs, and the kernel
manager adopts the new root. The bracketed GPU phases (CUDA checkpoint: lock the process's CUDA
calls, move its GPU memory into host memory, and later put it back on a GPU of our choice) join the
plan when the kernel holds a GPU.

If any phase fails, the phases already done are undone in reverse order, and the kernel is left as it
was before: running if it was running (a dump that fails leaves the tree running; a failure after
the dump restores it from the images), suspended with its images kept if it was suspended.
Nothing in this file knows about Jupyter: the kernel is anything that fits :class:`KernelProcess`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from . import netstate, proctree
from .criu import Criu
from .errors import ImageError, InvalidState, PidConflict
from .images import ImageStore, Manifest
from .plan import Phase, Plan, PlanResult, ProgressCallback

log = logging.getLogger(__name__)

RUNNING, MIGRATING, SUSPENDED, STOPPED = "running", "migrating", "suspended", "stopped"


class KernelProcess(Protocol):
    """What a migration needs of the kernel it moves (the provisioner implements it)."""

    kernel_id: str
    state: str

    @property
    def kernel_name(self) -> str: ...

    @property
    def kernel_pid(self) -> int | None: ...

    @property
    def kernel_connection_info(self) -> dict: ...

    def release(self) -> None:
        """The tree was dumped and killed: collect the dead root and forget it."""

    def adopt(self, pid: int) -> None:
        """A restored tree rooted at ``pid`` is the kernel from now on."""

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the restored kernel serves its clients again; False if it did not in time."""


@dataclass
class Outcome:
    """What a finished plan did: phase timings and bytes written or read."""

    result: PlanResult
    bytes: int = 0
    manifest: Manifest | None = None
    extra: dict = field(default_factory=dict)


class Migration:
    """Suspends and resumes one kernel. Each method runs one plan and returns its :class:`Outcome`."""

    def __init__(
        self,
        kernel: KernelProcess,
        store: ImageStore,
        criu: Criu,
        progress: ProgressCallback | None = None,
        reconnect_timeout: float = 3.0,
    ) -> None:
        self.kernel = kernel
        self.store = store
        self.criu = criu
        self.progress = progress
        self.reconnect_timeout = reconnect_timeout

    # -- suspend -------------------------------------------------------------------------------------

    def suspend(self) -> Outcome:
        kernel, store, criu = self.kernel, self.store, self.criu
        images = store.path_for(kernel.kernel_id)
        manifest: Manifest | None = None

        def prepare() -> None:
            nonlocal manifest
            # Checked again here, not only by the caller: another request may have started meanwhile.
            if kernel.state != RUNNING:
                raise InvalidState(f"The kernel is {kernel.state}, not running: it cannot be suspended.")
            pid = kernel.kernel_pid
            if pid is None or not proctree.is_alive(pid):
                raise InvalidState("The kernel process is not running: restart the kernel instead.")
            kernel.state = MIGRATING
            store.create(kernel.kernel_id)
            manifest = Manifest(
                kernel_id=kernel.kernel_id,
                kernel_name=kernel.kernel_name,
                pid=pid,
                # Every PID and TID must be free again at restore: remember them to name a conflict.
                ids=proctree.tree_ids(pid),
                criu_version=criu.binary.version_string,
                connection_info=_public(kernel.kernel_connection_info),
                clients=netstate.client_counts(proctree.descendants(pid)),
            )

        def forget_images() -> None:
            store.remove(kernel.kernel_id)
            kernel.state = RUNNING

        def dump() -> None:
            assert manifest is not None
            # On failure CRIU resumes the tree: the kernel goes on running, untouched.
            criu.dump(manifest.pid, images)
            kernel.release()
            store.write_manifest(images, manifest)
            kernel.state = SUSPENDED

        def restore_from_images() -> None:
            # A later phase failed after the kernel was dumped and killed: bring it back as it was.
            assert manifest is not None
            kernel.state = MIGRATING
            self._adopt(criu.restore(images, manifest.ids), manifest)

        plan = Plan([Phase("prepare", prepare, forget_images), Phase("dump", dump, restore_from_images)],
                    self.progress)
        result = plan.run()
        assert manifest is not None
        return Outcome(result, bytes=manifest.image_bytes, manifest=manifest)

    # -- resume --------------------------------------------------------------------------------------

    def resume(self) -> Outcome:
        kernel, store, criu = self.kernel, self.store, self.criu
        images = store.path_for(kernel.kernel_id)
        manifest: Manifest | None = None
        restored_pid: int | None = None

        def prepare() -> None:
            nonlocal manifest
            if kernel.state != SUSPENDED:
                raise InvalidState(f"The kernel is {kernel.state}, not suspended: there is nothing to resume.")
            manifest = store.read_manifest(kernel.kernel_id)
            if manifest.kernel_id != kernel.kernel_id:
                raise ImageError(
                    f"The images in {images} belong to kernel {manifest.kernel_id}, not {kernel.kernel_id}."
                )
            # CRIU gives every process and thread its old number back. Keep new processes off those
            # numbers, and say who holds one, if any, before CRIU starts (it would say "File exists").
            proctree.steer_pid_allocation(manifest.ids)
            holder = proctree.first_holder(manifest.ids)
            if holder is not None:
                raise PidConflict(
                    f"Cannot resume yet: PID {holder.pid}, which the kernel used, is now taken by "
                    f"{holder.describe()}. Stop that process (or wait until it exits), then resume "
                    f"again; the kernel's images are kept.",
                    holder.pid,
                    holder.describe(),
                )
            kernel.state = MIGRATING

        def back_to_suspended() -> None:
            kernel.state = SUSPENDED

        def restore() -> None:
            nonlocal restored_pid
            assert manifest is not None
            restored_pid = criu.restore(images, manifest.ids)

        def kill_restored() -> None:
            if restored_pid is not None:
                proctree.kill_tree(restored_pid)
                proctree.wait_gone(restored_pid, timeout=10)

        def adopt() -> None:
            assert restored_pid is not None and manifest is not None
            self._adopt(restored_pid, manifest)

        plan = Plan(
            [
                Phase("prepare", prepare, back_to_suspended),
                Phase("restore", restore, kill_restored),
                Phase("adopt", adopt),
            ],
            self.progress,
        )
        result = plan.run()
        assert manifest is not None
        # The kernel runs again: its images are stale now, and they hold its memory. Remove them.
        store.remove(kernel.kernel_id)
        return Outcome(result, bytes=manifest.image_bytes, manifest=manifest)


    def _adopt(self, pid: int, manifest: Manifest) -> None:
        """The restored tree is the kernel again, once its clients are back.

        Its clients re-dial by themselves; a SUB socket that is not subscribed yet loses what the
        kernel publishes. So wait (briefly, bounded) until every port has its clients back, then
        until the kernel itself serves a new client on shell and IOPub.
        """
        expected = {int(port): n for port, n in manifest.clients.items()}
        missing = netstate.wait_for_clients(proctree.descendants(pid), expected, self.reconnect_timeout)
        if missing:
            log.info("kernel %s: %s client(s) did not reconnect within %.1f s (gone meanwhile?)",
                     manifest.kernel_id, sum(missing.values()), self.reconnect_timeout)
        self.kernel.adopt(pid)
        if not self.kernel.wait_ready(self.reconnect_timeout):
            log.warning("kernel %s: restored, but it did not answer within %.1f s",
                        manifest.kernel_id, self.reconnect_timeout)
        self.kernel.state = RUNNING


def _public(connection_info: dict) -> dict:
    """Connection info without the HMAC key (the manifest is not the place for secrets)."""
    return {
        k: (v.decode() if isinstance(v, bytes) else v)
        for k, v in connection_info.items()
        if k not in ("key",)
    }
