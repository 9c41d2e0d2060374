"""Kernels outlive their server: at start, take back the kernels an earlier server left suspended.

A suspended kernel is a folder of images whose manifest, written last and durably (images.py), holds
everything needed to bring it back under its own id: its kernelspec, its ports (its key, in the
private secrets file beside it), the notebook sessions that pointed at it, its owner. At start the
extension reads every folder of its state folder:

- a folder with no manifest is a dump that never finished (the server died during it): removed;
- a manifest that is not this user's, not for this folder, or not readable is refused: logged with
  the reason and left on disk, never deleted silently;
- a kernel whose process still runs (the server died during its resume, after CRIU restored it) is
  adopted as running, and its images, now stale, removed;
- any other kernel is registered in the kernel manager under its own id, suspended (nothing is
  launched), with its sessions: JupyterLab and `/api/kernels` see it, and a cell run in its notebook
  resumes it (autoresume.py).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .credentials import ENV_KERNEL_ID
from .engine import proctree
from .engine.errors import MigrateError
from .engine.images import ImageStore, Manifest
from .provisioner import MigratableProvisioner

log = logging.getLogger(__name__)


@dataclass
class Found:
    """What one folder of the state folder turned out to be."""

    kernel_id: str
    #: "suspended", "running" (adopted), "removed" (an unfinished dump), "refused"
    outcome: str
    reason: str = ""


def _running_kernel(manifest: Manifest) -> int | None:
    """The kernel's process, if it runs (restored by a resume its server did not live to finish)."""
    pid = manifest.pid
    if not proctree.is_alive(pid):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if f"{ENV_KERNEL_ID}={manifest.kernel_id}".encode() in environ else None


def check(store: ImageStore, name: str) -> Manifest:
    """The manifest of folder ``name`` if this server may take the kernel back; else MigrateError saying why."""
    folder = store.path_for(name)
    manifest = store.read_manifest(name)  # ImageError: no manifest, or damaged
    owner = os.stat(folder / "manifest.json").st_uid
    if owner != os.geteuid() or manifest.owner != os.geteuid():
        raise MigrateError(f"its manifest belongs to uid {manifest.owner} (file owned by {owner}), not to this "
                           f"server's user ({os.geteuid()})")
    if manifest.kernel_id != name:
        raise MigrateError(f"its manifest names kernel {manifest.kernel_id}, not {name}")
    return manifest


async def revive_all(serverapp: Any) -> list[Found]:
    """Take back every kernel of this server's state folder (see the module's story)."""
    km = serverapp.kernel_manager
    store = MigratableProvisioner(config=serverapp.config).images
    found: list[Found] = []
    for name in store.names():
        if name in km:
            continue
        try:
            manifest = check(store, name)
        except MigrateError as exc:
            if not (store.path_for(name) / "manifest.json").exists() and "no manifest" in str(exc):
                shutil.rmtree(store.path_for(name), ignore_errors=True)
                log.warning("gpumigrate: removed %s: a dump that never finished (its server stopped during it)",
                            store.path_for(name))
                found.append(Found(name, "removed", "a dump that never finished"))
            else:
                log.error("gpumigrate: not taking back the kernel in %s: %s. It is left there.",
                          store.path_for(name), exc)
                found.append(Found(name, "refused", str(exc)))
            continue
        running = _running_kernel(manifest)
        MigratableProvisioner.reviving[name] = manifest
        MigratableProvisioner.adopting[name] = running
        try:
            await km.start_kernel(kernel_id=name, kernel_name=manifest.kernel_name)
        except Exception as exc:  # noqa: BLE001  a kernelspec gone, say: the images stay
            MigratableProvisioner.reviving.pop(name, None)
            MigratableProvisioner.adopting.pop(name, None)
            log.error("gpumigrate: could not take back kernel %s (%s): %s. Its images are left in %s.",
                      name, manifest.kernel_name, exc, store.path_for(name))
            found.append(Found(name, "refused", str(exc)))
            continue
        await _restore_sessions(serverapp, manifest)
        outcome = "running" if running else "suspended"
        log.info("gpumigrate: took back kernel %s (%s), %s", name, manifest.kernel_name, outcome)
        found.append(Found(name, outcome))
    return found


async def _restore_sessions(serverapp: Any, manifest: Manifest) -> None:
    sessions = getattr(serverapp, "session_manager", None)
    if sessions is None:
        return
    for entry in manifest.sessions:
        session_id = str(entry.get("id") or "")
        if not session_id:
            continue
        try:
            if await sessions.session_exists(entry.get("path")):
                continue
            await sessions.save_session(session_id, path=entry.get("path"), name=entry.get("name"),
                                        type=entry.get("type"), kernel_id=manifest.kernel_id)
        except Exception as exc:  # noqa: BLE001  the kernel is back; its tab can still pick it
            log.warning("gpumigrate: kernel %s is back, but its session for %s was not: %s",
                        manifest.kernel_id, entry.get("path"), exc)
