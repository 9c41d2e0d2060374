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

Then the records of running kernels (``<state_dir>/kernels/<id>.json``, written by the provisioner while
a kernel runs): a kernel whose process still runs, the same process (PID and start time), is adopted as
running, with its sessions; any other record is stale and removed.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .credentials import ENV_KERNEL_ID
from .kernelwire import kernel_answers
from .engine import proctree
from .engine.errors import MigrateError
from .engine.images import ImageStore, Manifest
from .provisioner import RECORDS, MigratableProvisioner, Revival

log = logging.getLogger(__name__)


@dataclass
class Found:
    """What one folder of the state folder turned out to be."""

    kernel_id: str
    #: "suspended", "running" (adopted), "removed" (an unfinished dump), "refused"
    outcome: str
    reason: str = ""


LOCK = "server.lock"


def lock_state(state_dir: Path) -> tuple[int | None, str]:
    """Hold the state folder for this server's life: (the lock's descriptor, "") or, when another server of
    this user holds it, (None, that server's PID). Only the holder takes kernels back: two servers sharing
    one folder would otherwise take each other's kernels, and the second would remove the first's dumps in
    progress as unfinished."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(state_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, ""


def _running_kernel(manifest: Manifest) -> int | None:
    """The kernel's process, if it runs whole (restored by a resume its server did not live to finish).

    A tree stuck in CRIU's restorer (stopped), or whose CUDA processes are still locked or checkpointed,
    runs nothing: it is killed, and the kernel comes back from its images instead, which are intact."""
    pid = manifest.pid
    if not proctree.is_alive(pid):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if f"{ENV_KERNEL_ID}={manifest.kernel_id}".encode() not in environ:
        return None  # another process has its PID now: the resume will say who
    tree = proctree.descendants(pid)
    stopped = [p for p in tree if (found := proctree.info(p)) is not None and found.state in ("t", "T")]
    locked = [p for p in manifest.cuda_pids if p in tree and _cuda_state(p) not in (None, "running")]
    if stopped or locked:
        log.warning("gpumigrate: kernel %s was left half-restored by its server (%s): killed; it comes back from "
                    "its images", manifest.kernel_id, f"stopped: {stopped}" if stopped else f"CUDA locked: {locked}")
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)
        return None
    return pid


def _cuda_state(pid: int) -> str | None:
    """The CUDA checkpoint state of ``pid`` ('running', 'locked', 'checkpointed'...), None if unknown."""
    try:
        from .engine.cudackpt import CudaProcess

        return CudaProcess(pid).state
    except Exception:  # noqa: BLE001  no driver, no cuda-core here: no CUDA process can be locked
        return None


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


async def _take_back(serverapp: Any, kernel_id: str, kernel_name: str, revival: Revival) -> str | None:
    """Register the kernel under its id; None if done, else why not."""
    MigratableProvisioner.reviving[kernel_id] = revival
    try:
        await serverapp.kernel_manager.start_kernel(kernel_id=kernel_id, kernel_name=kernel_name)
    except Exception as exc:  # noqa: BLE001  a kernelspec gone, say
        return str(exc) or type(exc).__name__
    finally:
        MigratableProvisioner.reviving.pop(kernel_id, None)
    await _restore_sessions(serverapp, kernel_id, revival.sessions)
    return None


async def revive_all(serverapp: Any) -> list[Found]:
    """Take back every kernel of this server's state folder (see the module's story)."""
    km = serverapp.kernel_manager
    defaults = MigratableProvisioner(config=serverapp.config)
    store = defaults.images
    found: list[Found] = []
    for name in store.names():
        if name in km:
            continue
        try:
            found.append(await _take_back_images(serverapp, store, name))
        except Exception as exc:  # noqa: BLE001  one folder never stops the others
            log.exception("gpumigrate: not taking back the kernel in %s", store.path_for(name))
            found.append(Found(name, "refused", str(exc)))
    found += await _adopt_running(serverapp, Path(defaults.state_dir) / RECORDS)
    return found


async def _take_back_images(serverapp: Any, store: ImageStore, name: str) -> Found:
    """One folder of images: taken back, removed (an unfinished dump) or refused."""
    try:
        manifest = check(store, name)
    except MigrateError as exc:
        if not (store.path_for(name) / "manifest.json").exists() and "no manifest" in str(exc):
            shutil.rmtree(store.path_for(name), ignore_errors=True)
            log.warning("gpumigrate: removed %s: a dump that never finished (its server stopped during it)",
                        store.path_for(name))
            return Found(name, "removed", "a dump that never finished")
        log.error("gpumigrate: not taking back the kernel in %s: %s. It is left there.", store.path_for(name),
                  str(exc).rstrip("."))
        return Found(name, "refused", str(exc))
    running = _running_kernel(manifest)
    secrets = store.read_secrets(name)
    key = {k: v for k, v in secrets.items() if k != "credential"}
    revival = Revival({**manifest.connection_info, **key}, manifest.sessions,
                      secrets.get("credential"), running)
    why_not = await _take_back(serverapp, name, manifest.kernel_name, revival)
    if why_not:
        log.error("gpumigrate: could not take back kernel %s (%s): %s. Its images are left in %s.",
                  name, manifest.kernel_name, why_not, store.path_for(name))
        return Found(name, "refused", why_not)
    if running is not None:
        # Its images are stale once it answers; until then they are the copy to trust.
        provisioner = serverapp.kernel_manager.get_kernel(name).provisioner
        if await asyncio.to_thread(kernel_answers, provisioner.connection_info, 10.0):
            store.remove(name)
        else:
            log.warning("gpumigrate: kernel %s runs (PID %d) but does not answer: its images are kept in %s",
                        name, running, store.path_for(name))
    outcome = "running" if running else "suspended"
    log.info("gpumigrate: took back kernel %s (%s), %s", name, manifest.kernel_name, outcome)
    return Found(name, outcome)


async def _adopt_running(serverapp: Any, records: Path) -> list[Found]:
    """Adopt the kernels whose server died while they ran; remove stale records."""
    found: list[Found] = []
    km = serverapp.kernel_manager
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        kernel_id = path.stem
        if kernel_id in km:
            continue  # taken back from its images, or started meanwhile
        try:
            record = json.loads(path.read_text())
            pid, started = int(record["pid"]), int(record["started"])
            owner = os.stat(path).st_uid
            if owner != os.geteuid() or record.get("owner") != os.geteuid() or record.get("kernel_id") != kernel_id:
                raise ValueError(f"it is not this server's user's ({owner}), or not for kernel {kernel_id}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("gpumigrate: ignoring the record %s: %s", path, exc)
            found.append(Found(kernel_id, "refused", str(exc)))
            continue
        if not proctree.is_alive(pid) or proctree.start_time(pid) != started:
            path.unlink(missing_ok=True)  # it ended with its server, or was suspended since (its images tell)
            continue
        revival = Revival(dict(record.get("connection_info") or {}), list(record.get("sessions") or []),
                          record.get("credential"), pid)
        why_not = await _take_back(serverapp, kernel_id, str(record.get("kernel_name") or ""), revival)
        if why_not:
            log.error("gpumigrate: kernel %s runs (PID %d), left by an earlier server, but could not be adopted: "
                      "%s", kernel_id, pid, why_not)
            found.append(Found(kernel_id, "refused", why_not))
            continue
        log.info("gpumigrate: adopted kernel %s (PID %d), left running by an earlier server", kernel_id, pid)
        found.append(Found(kernel_id, "running"))
    return found


async def _restore_sessions(serverapp: Any, kernel_id: str, entries: list[dict]) -> None:
    sessions = getattr(serverapp, "session_manager", None)
    if sessions is None:
        return
    for entry in entries:
        session_id = str(entry.get("id") or "")
        if not session_id:
            continue
        try:
            if await sessions.session_exists(entry.get("path")):
                continue
            await sessions.save_session(session_id, path=entry.get("path"), name=entry.get("name"),
                                        type=entry.get("type"), kernel_id=kernel_id)
        except Exception as exc:  # noqa: BLE001  the kernel is back; its tab can still pick it
            log.warning("gpumigrate: kernel %s is back, but its session for %s was not: %s",
                        kernel_id, entry.get("path"), exc)
