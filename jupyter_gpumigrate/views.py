"""What the REST API says of kernels and GPUs (GET /kernels, /kernels/{id}, /gpus).

Read-only: NVML in the server, the kernels' process trees, their manifests, and the operations in
flight. Which GPU can take a kernel is decided by the engine's placement module, the same rules the
operation checks before it starts.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection
from typing import Any

from traitlets import TraitError

from .engine import gpus as gpus_mod
from .engine import placement, proctree
from .engine.errors import MigrateError
from .engine.kernelproc import BROKEN, REMOTE, RUNNING, SUSPENDED
from .provisioner import MigratableProvisioner


class KernelNotFound(MigrateError):
    http_status = 404


class Views:
    def __init__(self, kernel_manager: Any, active: dict[str, Any], host_name: str | None = None,
                 peers: list[str] | None = None, draining: Callable[[], Collection[int]] = frozenset) -> None:
        self.kernel_manager = kernel_manager
        #: kernel id -> its operation in flight (operations.py keeps it)
        self.active = active
        #: the GPUs being drained now (operations.py), offered to no kernel
        self.draining = draining
        self.host_name = host_name or socket.gethostname()
        self.peers = peers or []

    def kernel(self, kernel_id: str) -> Any:
        if kernel_id not in self.kernel_manager:
            raise KernelNotFound(f"There is no kernel {kernel_id} on this server: list them with GET /kernels.")
        return self.kernel_manager.get_kernel(kernel_id)

    def kernel_view(self, kernel_id: str, gpus: list[gpus_mod.GpuInfo] | None = None,
                    driver_major: int | None = None) -> dict[str, Any]:
        kernel = self.kernel(kernel_id)
        provisioner = getattr(kernel, "provisioner", None)
        migratable = isinstance(provisioner, MigratableProvisioner)
        pid = getattr(provisioner, "pid", None)
        state = provisioner.state if migratable else RUNNING
        if gpus is None:
            gpus = gpus_mod.snapshot()
        image_bytes, suspended_on, images = None, [], None
        if migratable and (state == SUSPENDED or (state == BROKEN and provisioner.resumable_broken())):
            manifest = provisioner.manifest()
            if manifest is not None:
                image_bytes, suspended_on = manifest.image_bytes, manifest.gpus
                images = provisioner.images.where(kernel_id)
        active = self.active.get(kernel_id)
        remote = migratable and state == REMOTE
        held = placement.held_by_tree(pid, gpus)
        for h in held:
            h.pop("name", None)  # listed with the GPU, not with what the kernel holds
        if driver_major is None and gpus:
            driver_major = gpus_mod.driver_major()
        targets: list[dict[str, Any]] = []
        if migratable and state != BROKEN and not remote and active is None and gpus and (held or suspended_on):
            targets = placement.targets(gpus, held, suspended_on, state, driver_major, self.draining())
        return {
            "id": kernel_id,
            "name": kernel.kernel_name,
            "pid": pid,
            "host": provisioner.remote_host if remote else self.host_name,
            "home": self.host_name,
            "state": RUNNING if remote else state,
            "remote": remote,
            "broken_reason": provisioner.broken_reason if migratable and state == BROKEN else None,
            "execution_state": getattr(kernel, "execution_state", None),
            "last_activity": _last_activity(kernel),
            "gpus": provisioner.remote_gpus if remote else held,
            "image_bytes": image_bytes,
            "images": images,
            "suspended_on": suspended_on,
            "migratable": migratable,
            "operation": active.id if active else None,
            "back_until": provisioner.back_until() if migratable and state == RUNNING else None,
            "targets": targets,
        }

    def list_kernels(self) -> list[dict[str, Any]]:
        gpus = gpus_mod.snapshot()
        driver_major = gpus_mod.driver_major() if gpus else None
        return [self.kernel_view(kid, gpus, driver_major) for kid in self.kernel_manager.list_kernel_ids()]

    def kernel_trees(self) -> dict[str, list[int]]:
        """Each kernel's process tree (kernels with a process here)."""
        trees = {}
        for kernel_id in self.kernel_manager.list_kernel_ids():
            pid = getattr(getattr(self.kernel_manager.get_kernel(kernel_id), "provisioner", None), "pid", None)
            if pid:
                trees[kernel_id] = proctree.descendants(pid)
        return trees

    def gpus_view(self) -> dict[str, Any]:
        """Every GPU NVML sees, with the kernels of this server on it (id and bytes held)."""
        gpus = gpus_mod.snapshot()
        trees = self.kernel_trees()
        listed = []
        for gpu in gpus:
            data = gpu.to_dict()
            data["kernels"] = [
                {"id": kernel_id, "memory_used": sum(gpu.processes.get(p, 0) for p in tree)}
                for kernel_id, tree in trees.items()
                if any(p in gpu.processes for p in tree)
            ]
            listed.append(data)
        return {"driver_version": gpus_mod.driver_version(), "host": self.host_name, "gpus": listed,
                "peers": sorted(self.peers)}

    def kernels_on(self, index: int, gpus: list[gpus_mod.GpuInfo]) -> list[str]:
        """Ids of this server's kernels that hold memory on GPU ``index``."""
        return [kernel_id for kernel_id, tree in self.kernel_trees().items()
                if any(h["index"] == index for h in gpus_mod.held_by(tree, gpus))]


def _last_activity(kernel: Any) -> str | None:
    """When the kernel was last active, as ISO 8601; None while the server is still starting it (the trait
    has no value yet then, and reading it raises)."""
    try:
        value = getattr(kernel, "last_activity", None)
    except TraitError:
        return None
    return value.isoformat() if value is not None and hasattr(value, "isoformat") else None
