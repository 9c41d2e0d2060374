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

A record of a kernel that runs on a peer (``remote``: moved there, and its server died or stopped under the
stop policy 'suspend'; or being moved or transplanted there, its process here dumped, when the server died)
is asked of that peer: running there, the kernel is registered as remote and its relay bound to its ports and
dialled again (the peer keeps it meanwhile: peers.GuestHost); suspended there (by the stop, for a way home that
never ended, or received by a move that never restored it), the peer resumes it first; a transplant's new
process there never told to go, the peer discards it; unknown there (or so discarded), the record goes (and
images here, a move's or a transplant's source that never ended there, are the kernel). A peer that cannot be reached, or is no
longer configured, leaves the record refused, on disk, for the next start.

A record of a kernel running here that names the peer it came home from (``copy_left``: the dump that peer
keeps of it was not deleted yet, as the server died or could not reach the peer) has that peer delete it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .credentials import ENV_KERNEL_ID
from .kernel.hoststash import INDEX as STASH_INDEX
from .kernelwire import kernel_answers
from .engine import proctree
from .engine.access import dump_watch
from .engine.errors import MigrateError
from .engine.images import MANIFEST, ImageStore, Manifest
from .engine.plans.transplant import SWITCHED
from .provisioner import RECORDS, SAFE_POINTS, MigratableProvisioner, Revival, give_back_stash

log = logging.getLogger(__name__)


@dataclass
class Found:
    """What one folder of the state folder turned out to be."""

    kernel_id: str
    #: "suspended", "running" (adopted), "remote" (relayed to its peer again), "removed" (an unfinished dump),
    #: "refused"
    outcome: str
    reason: str = ""
    #: a refused record: the folder (or running record) left on disk, and what its owner can do
    path: str = ""
    remedy: str = ""

    def to_dict(self) -> dict[str, str]:
        """A refused record as the API says it (contract: RefusedRecord)."""
        return {"kernel_id": self.kernel_id, "path": self.path, "reason": self.reason, "remedy": self.remedy}


class Refusal(MigrateError):
    """Why a record is not taken back, and what its owner can do about it."""

    def __init__(self, message: str, remedy: str) -> None:
        super().__init__(message)
        self.remedy = remedy


def refused(name: str, path: Path, reason: str, remedy: str = "") -> Found:
    """A refused record: left on disk, never deleted; ``remedy`` defaults to looking and removing it by hand."""
    return Found(name, "refused", reason, str(path), remedy or look_then_remove(path))


def look_then_remove(path: Path) -> str:
    return (f"Nothing was deleted. Look at {path}; if nothing there is to keep, remove it (rm -r {path}), "
            "else fix what the reason says and restart the server to take it back.")


LOCK = "server.lock"


def lock_state(state_dir: Path) -> tuple[int | None, str]:
    """Hold the state folder for this server's life: (the lock's descriptor, "") or, when another server of
    this user holds it or the folder is not private, (None, the sentence that says so). Only the holder takes kernels back: two servers sharing
    one folder would otherwise take each other's kernels, and the second would remove the first's dumps in
    progress as unfinished."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = os.stat(state_dir)
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        # Another user could plant records, images or links there: take nothing back from it.
        return None, (f"{state_dir} is not this user's private folder (owner {info.st_uid}, mode "
                      f"{oct(info.st_mode & 0o777)}): kernels are not taken back from it. Make it so (chmod go-w).")
    fd = os.open(state_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        return None, (f"another server (PID {holder}) uses {state_dir}: the kernels it keeps there are not taken "
                      "back by this one. Give each server a state folder of its own (c.MigratableProvisioner.state_dir).")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd, ""


def _running_kernel(manifest: Manifest, kill_stuck: bool = True) -> int | None:
    """The kernel's process, if it runs whole (restored by a resume its server did not live to finish).

    A tree stuck in CRIU's restorer (stopped), or whose CUDA processes are still locked or checkpointed,
    runs nothing: with ``kill_stuck`` it is killed, and the kernel comes back from its images instead, which
    are intact; without, it is left as it is (and counted as running)."""
    pid = manifest.pid
    if not proctree.is_alive(pid):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if f"{ENV_KERNEL_ID}={manifest.kernel_id}".encode() not in environ:
        return None  # another process has its PID now: the resume will say who
    if not proctree.on_this_network(pid):
        return None  # the copy a peer on this machine restored (the same PIDs): not this server's to adopt or stop
    tree = proctree.descendants(pid)
    stopped = [p for p in tree if (found := proctree.info(p)) is not None and found.state in ("t", "T")]
    locked = [p for p in manifest.cuda_pids if p in tree and _cuda_state(p) not in (None, "running")]
    if (stopped or locked) and kill_stuck:
        log.warning("gpumigrate: kernel %s was left half-restored by its server (%s): killed; it comes back from "
                    "its images", manifest.kernel_id, f"stopped: {stopped}" if stopped else f"CUDA locked: {locked}")
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)
        return None
    return pid


def let_cuda_run(kernel_id: str, pid: int) -> None:
    """A server killed during a GPU move or a GPU suspend's first phases leaves its kernel's CUDA processes
    locked, or checkpointed (their GPU memory in host memory): put each back on the GPU it was on, and let
    its CUDA calls go on. Best effort: a process that cannot be is named in the log."""
    stuck = [(p, state) for p in proctree.descendants(pid) if (state := _cuda_state(p)) in ("locked", "checkpointed")]
    if not stuck:
        return
    from .engine.cudackpt import CudaProcess

    for process_id, state in stuck:
        try:
            process = CudaProcess(process_id)
            if state == "checkpointed":
                process.restore(None)  # onto the GPU it was checkpointed from
            process.unlock()
        except MigrateError as exc:
            log.error("gpumigrate: kernel %s: its process %d was left %s by its server and could not run again: "
                      "%s", kernel_id, process_id, state, exc)
            continue
        log.warning("gpumigrate: kernel %s: its process %d was left %s by its server; it runs again",
                    kernel_id, process_id, state)


def _cuda_state(pid: int) -> str | None:
    """The CUDA checkpoint state of ``pid`` ('running', 'locked', 'checkpointed'...), None if unknown."""
    try:
        from .engine.cudackpt import CudaProcess

        return CudaProcess(pid).state
    except Exception:  # noqa: BLE001  no driver, no cuda-core here: no CUDA process can be locked
        return None


def _unfinished_dump(store: ImageStore, name: str, records: Path) -> Found | None:
    """A folder with no manifest: a dump its server did not live to finish. None once it is completed (its
    manifest written): the caller then takes the kernel back."""
    folder, pending = store.path_for(name), store.read_pending(name)
    busy = ("Nothing to do while that server runs: it finishes the dump and keeps the kernel. Give each server "
            "a state folder of its own (c.MigratableProvisioner.state_dir).")
    if pending is not None and kept_by_another_live_server(pending.server):
        return refused(name, folder, "a dump in progress, by another server that still runs", busy)
    if pending is None and time.time() - folder.stat().st_mtime < 600 and _another_server_runs(records):
        return refused(name, folder, "maybe a dump in progress, by another server that still runs", busy)
    if pending is None or _running_kernel(pending, kill_stuck=False) is not None:
        # CRIU never started, or stopped with its server and gave the kernel back (which runs, and is
        # adopted from its record): these images are of no use.
        shutil.rmtree(folder, ignore_errors=True)
        log.warning("gpumigrate: removed %s: a dump that never finished (its server stopped during it)", folder)
        return Found(name, "removed", "a dump that never finished")
    if pending.owner != os.geteuid() or pending.kernel_id != name:
        return None  # check() refuses it, saying why
    if store.finished_dump(name) is not None:
        # CRIU wrote every image and killed the kernel; its server died before the manifest: complete it.
        store.write_manifest(folder, pending)
        log.warning("gpumigrate: completed the images of kernel %s, whose server stopped right after its dump",
                    name)
        return None
    log.error("gpumigrate: %s holds a dump that did not finish, of a kernel that no longer runs: nothing can be "
              "taken back from it. It is left there; remove it once you have looked.", folder)
    return refused(name, folder, "a dump that did not finish, of a kernel that no longer runs",
                   f"Nothing can be taken back from it: remove it (rm -r {folder}) once you have looked.")


def _another_server_runs(records: Path) -> bool:
    """Whether a server other than this one holds records in ``records`` (a state folder shared by two of one
    user's servers)."""
    for path in records.glob("*.json") if records.is_dir() else []:
        try:
            if kept_by_another_live_server(json.loads(path.read_text()).get("server")):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def kept_by_another_live_server(server: object) -> bool:
    """Whether ``server`` ([PID, start time], as a record names its writer) is another process, alive."""
    if not (isinstance(server, list) and len(server) == 2 and all(isinstance(x, int) for x in server)):
        return False
    pid, started = server
    return pid != os.getpid() and proctree.is_alive(pid) and proctree.start_time(pid) == started


def check(store: ImageStore, name: str) -> Manifest:
    """The manifest of folder ``name`` if this server may take the kernel back; else MigrateError saying why
    (a :class:`Refusal` with its remedy where there is a better one than looking and removing it)."""
    folder = store.path_for(name)
    manifest = store.read_manifest(name)  # ImageError: no manifest, or damaged
    owner = os.stat(folder / "manifest.json").st_uid
    if owner != os.geteuid() or manifest.owner != os.geteuid():
        raise Refusal(f"its manifest belongs to uid {manifest.owner} (file owned by {owner}), not to this "
                      f"server's user ({os.geteuid()})",
                      f"Nothing was deleted. It is not this user's kernel: only its owner's server takes it back, "
                      f"from that user's own state folder. Move it there, or remove it (rm -r {folder}).")
    if manifest.kernel_id != name:
        raise Refusal(f"its manifest names kernel {manifest.kernel_id}, not {name}",
                      f"Nothing was deleted. The folder was renamed or copied: give it its kernel's name "
                      f"({store.path_for(manifest.kernel_id)}) if no such folder exists, or remove it "
                      f"(rm -r {folder}); then restart the server.")
    if kept_by_another_live_server(manifest.server):
        raise Refusal(f"the server that suspended it (PID {manifest.server[0]}) still runs and keeps it",
                      f"Resume it from that server (PID {manifest.server[0]}), or stop that server and restart "
                      "this one, which then takes it back.")
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
    if not revival.taken:
        # Its kernelspec names another provisioner now: a fresh kernel was launched under its id. Not that.
        await serverapp.kernel_manager.shutdown_kernel(kernel_id, now=True)
        return "its kernelspec no longer uses jupyter-gpumigrate's provisioner (gpumigrate-provisioner)"
    await _restore_sessions(serverapp, kernel_id, revival.sessions)
    if revival.pid is not None:
        # A kernel adopted running says nothing until a client talks to it: the server would take it for
        # 'starting', and a suspend or move then for busy (no stash: a 32 GB GPU kernel's suspend in 33 s, not
        # 3). Asked once, on control, it says 'idle' on IOPub, where the server hears it (also where a cell runs:
        # a move or suspend then finds its main thread busy all the same, proctree.main_thread_running).
        try:
            await asyncio.to_thread(kernel_answers, dict(revival.connection_info), HEARD_WAIT)
        except Exception as exc:  # noqa: BLE001 - it is taken back all the same; its state is heard later
            log.warning("gpumigrate: kernel %s, adopted running, could not be asked its state: %s", kernel_id, exc)
    return None


#: How long a kernel adopted running gets to answer, so that the server hears its state (seconds).
HEARD_WAIT = 5.0


#: What makes the link to a kernel that runs on a peer: (peer name, kernel id, connection info) -> a
#: peers.PeerLink (OperationManager.link_to); UnknownPeer if there is no such peer.
LinkTo = Callable[[str, str, dict], Any]


async def revive_all(serverapp: Any, link_to: LinkTo | None = None) -> list[Found]:
    """Take back every kernel of this server's state folder (see the module's story); ``link_to`` relays
    to those that run on a peer (without, their records are left for a server that can)."""
    km = serverapp.kernel_manager
    defaults = MigratableProvisioner(config=serverapp.config)
    store = defaults.images
    for name in store.tidy():
        log.warning("gpumigrate: kernel %s: finished moving its images from memory to disk, which its server had "
                    "begun as it stopped", name)
    found: list[Found] = []
    records = Path(defaults.state_dir) / RECORDS
    # A kernel whose record names a peer: the peer's copy is the kernel if it has one (its images here are
    # from before, or a way home that never ended), so they wait for what the peer says.
    remote = _remote_names(records)
    left = _copies_left(records)  # read before anything here writes those records again
    for name in store.names():
        if name in km or name in remote or _transplanted(store, name):
            continue
        found.append(await _take_back_images_safely(serverapp, store, name))
    found += await _adopt_running(serverapp, records, link_to)
    for name in remote & set(store.names()):
        if name in km:  # relayed to on the peer: what is here of it is stale, once the kernel answers from there
            await _remove_once_answering(serverapp, store, name)
        elif not (records / f"{name}.json").exists():  # the peer no longer has it: these images are the kernel
            found.append(await _take_back_images_safely(serverapp, store, name))
    await asyncio.gather(*(_discard_copy_left(serverapp, name, peer, link_to)
                           for name, peer in left.items() if name in km))
    return found


async def _remove_once_answering(serverapp: Any, store: ImageStore, name: str) -> None:
    """The images here of a kernel relayed to on its peer go once it answers through the relay; kept if it does
    not (the peer discarded it as the relay came, say): the next start asks the peer again."""
    provisioner = serverapp.kernel_manager.get_kernel(name).provisioner
    if await asyncio.to_thread(kernel_answers, dict(provisioner.connection_info), RELAYED_WAIT):
        store.remove(name)
        log.warning("gpumigrate: kernel %s runs on its peer: its images here, from before, are removed", name)
    else:
        log.error("gpumigrate: kernel %s is relayed to on its peer but does not answer: its images here are kept",
                  name)


#: How long a kernel relayed to again at start gets to answer before its images here are removed, in seconds.
RELAYED_WAIT = 30.0


def _copies_left(records: Path) -> dict[str, str]:
    """The peers that keep a dump of kernels that came home from them (``copy_left`` in their records)."""
    left: dict[str, str] = {}
    for path in records.glob("*.json") if records.is_dir() else []:
        try:
            copy_left = json.loads(path.read_text()).get("copy_left")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(copy_left, dict) and isinstance(copy_left.get("peer"), str):
            left[path.stem] = copy_left["peer"]
    return left


async def _take_back_images_safely(serverapp: Any, store: ImageStore, name: str) -> Found:
    try:
        return await take_back_images(serverapp, store, name)
    except Exception as exc:  # noqa: BLE001  one folder never stops the others
        log.exception("gpumigrate: not taking back the kernel in %s", store.path_for(name))
        return refused(name, store.path_for(name), str(exc) or type(exc).__name__)


def _remote_names(records: Path) -> set[str]:
    """The kernels whose running record names a peer (their images here wait for what the peer says)."""
    names = set()
    for path in records.glob("*.json") if records.is_dir() else []:
        try:
            if isinstance(json.loads(path.read_text()).get("remote"), dict):
                names.add(path.stem)
        except (OSError, ValueError, AttributeError):
            continue
    return names


def peer_notebooks(records: Path) -> set[str]:
    """The notebooks (their sessions' paths) of the kernels whose running record names a peer: those that may
    take a while to come back (the peer may resume them first)."""
    paths: set[str] = set()
    for path in records.glob("*.json") if records.is_dir() else []:
        try:
            record = json.loads(path.read_text())
            if isinstance(record.get("remote"), dict):
                paths.update(str(entry["path"]) for entry in record.get("sessions") or [] if entry.get("path"))
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            continue
    return paths


#: How long a transplant's new process, found running at start, gets to answer on the kernel's ports.
TAKEN_OVER_WAIT = 10.0


def _transplanted(store: ImageStore, name: str) -> bool:
    """The images are a transplant's source, whose new process was told to take over (engine/plans/
    transplant.py) before its server died: if that process runs, it is the kernel (adopted from its record),
    and the images go; if not, the marker goes, and the source is taken back from them."""
    marker = store.path_for(name) / SWITCHED
    try:
        said = json.loads(marker.read_text())
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        said = {}
    if said.get("complete") is False:  # a back (engine/plans/back.py) cut short: the images are the kernel
        since = said.get("since")
        for pid in said.get("ids") or []:
            started = proctree.start_time(pid) if isinstance(pid, int) else None
            if started is not None and isinstance(since, int) and started > since:  # what its CRIU restored
                proctree.kill_tree(pid)
                proctree.wait_gone(pid, timeout=10)
        marker.unlink(missing_ok=True)
        log.warning("gpumigrate: kernel %s was going back to the process its transplant replaced when its server "
                    "stopped: what was restored of that one is stopped, and the kernel is taken back from its "
                    "images as it was (that process stays kept, to go back to)", name)
        return False
    pid, started = said.get("pid"), said.get("started")
    if isinstance(pid, int) and proctree.is_alive(pid) and proctree.start_time(pid) == started:
        try:
            info = _connection(store, name, store.read_manifest(name))
        except MigrateError:
            info = None
        # It took over only if it answers on the kernel's ports; one still waiting for its server's word
        # never will: it is stopped, and the source comes back from its images.
        if info is not None and kernel_answers(info, TAKEN_OVER_WAIT):
            store.remove(name)
            log.warning("gpumigrate: kernel %s had been transplanted into process %s when its server stopped: "
                        "that process is the kernel; the source's images are removed", name, pid)
            return True
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)
    marker.unlink(missing_ok=True)
    log.warning("gpumigrate: kernel %s was being transplanted when its server stopped, and its new process is "
                "gone: the source is taken back from its images", name)
    return False


def _connection(store: ImageStore, name: str, manifest: Manifest) -> dict:
    """The kernel's connection info, its key from the secrets kept with its images."""
    secrets = store.read_secrets(name)
    if not secrets.get("key"):
        raise MigrateError("its secrets.json holds no connection key, so the kernel could not be spoken to")
    key = {k: v for k, v in secrets.items() if k not in ("credential", "api_url")}
    return {**manifest.connection_info, **key}


def _give_back_stash(connection_info: dict, folder: Path, pid: int, safe_points: Path) -> str | None:
    """Have the running kernel ``pid`` read back the buffers it wrote into ``folder``'s host stash
    (kernel/hoststash.py; nothing if it holds none away): None once it has, else why not. A kernel that
    stashed at a safe point of a busy cell waits there (``safe_points``, its safe-point folder)."""
    try:
        give_back_stash(str(folder), pid, safe_points, connection_info, STASH_WAIT_AT_START)
    except (OSError, RuntimeError, TimeoutError) as exc:
        return str(exc) or type(exc).__name__
    return None


#: How long a kernel found running at start gets to read its stash back, in seconds.
STASH_WAIT_AT_START = 600.0


async def _stash_left_in(store: ImageStore, name: str, safe_points: Path) -> Found | None:
    """A folder with no manifest but a host stash: its server died after the kernel wrote its large buffers
    there and before the dump. The kernel runs on without them: it reads them back before anything is
    removed (its CUDA processes, if its server left them locked, run again first). None when that is done
    or does not apply; a refusal, the folder kept, if the kernel could not."""
    folder, pending = store.path_for(name), store.read_pending(name)
    written = (folder / STASH_INDEX).exists() or any(folder.glob("stash-*.bin"))
    if pending is None or not written or kept_by_another_live_server(pending.server):
        return None
    # The kernel may still be writing them (its server died during the stash): its answer comes once it is
    # done, and only then is anything removed.
    pid = _running_kernel(pending, kill_stuck=False)
    if pid is None:
        return None  # the kernel is gone, its buffers with it: an unfinished dump
    await asyncio.to_thread(let_cuda_run, name, pid)
    error = await asyncio.to_thread(_give_back_stash, _connection(store, name, pending), folder, pid, safe_points)
    if error is None:
        log.warning("gpumigrate: kernel %s read back the buffers it had written to %s before its server "
                    "stopped", name, folder)
        return None
    log.error("gpumigrate: kernel %s (PID %d) runs without its large buffers, which are in %s, and could not read "
              "them back: %s", name, pid, folder, error)
    return refused(name, folder, f"the kernel runs without its large buffers, which are here, and could not read "
                                 f"them back ({error})",
                   "Nothing was deleted. Restart the server to try again; the kernel's buffers stay in this folder "
                   "until it has them back.")


#: How long the next server waits for the node helper's dump of a kernel, left running by the server that asked
#: for it, before it judges the images (seconds); past it they are refused until a restart.
HELPER_DUMP_WAIT = 600.0


async def _helper_dump_ends(serverapp: Any, store: ImageStore, name: str) -> Found | None:
    """A server that went mid-dump through the node helper left that dump running: its CRIU is the helper's,
    and goes on writing the folder, then kills the kernel. Wait until it has ended (what runs of it:
    access.dump_watch), so that the folder is judged whole or not, never removed under it; None then, or
    ``name`` refused where it still runs after :data:`HELPER_DUMP_WAIT`."""
    pending = store.read_pending(name)
    socket = MigratableProvisioner(config=serverapp.config).helper_socket or None
    if pending is None or socket is None:
        return None
    deadline = time.monotonic() + HELPER_DUMP_WAIT
    said = False
    busy = await asyncio.to_thread(dump_watch, socket)
    while running := await asyncio.to_thread(busy, pending.pid):
        if time.monotonic() > deadline:
            return refused(name, store.path_for(name), "a dump by the node helper that still runs",
                           "Restart the server once it has ended: the kernel is taken back then.")
        if not said:
            log.warning("gpumigrate: kernel %s is being dumped by the node helper (processes %s), as the server "
                        "that went asked: waiting for the dump to end", name, running)
            said = True
        await asyncio.sleep(0.2)
    return None


async def take_back_images(serverapp: Any, store: ImageStore, name: str) -> Found:
    """One folder of images: taken back, removed (an unfinished dump) or refused."""
    folder = store.path_for(name)
    state_dir = Path(MigratableProvisioner(config=serverapp.config).state_dir)
    records, safe_points = state_dir / RECORDS, state_dir / SAFE_POINTS / name
    if not (folder / MANIFEST).exists() and not folder.is_symlink():
        going = await _helper_dump_ends(serverapp, store, name)
        if going is not None:
            return going
        stash_left = await _stash_left_in(store, name, safe_points)
        if stash_left is not None:
            return stash_left
        unfinished = _unfinished_dump(store, name, records)
        if unfinished is not None:
            return unfinished
    try:
        manifest = check(store, name)
    except MigrateError as exc:
        log.error("gpumigrate: not taking back the kernel in %s: %s. It is left there.", store.path_for(name),
                  str(exc).rstrip("."))
        return refused(name, folder, str(exc), getattr(exc, "remedy", ""))
    secrets = store.read_secrets(name)
    connection_info = _connection(store, name, manifest)
    running = _running_kernel(manifest)
    if running is not None and not await asyncio.to_thread(kernel_answers, connection_info, 10.0):
        # Restored but not answering (stuck in CRIU's restorer): its images are the copy to trust.
        log.warning("gpumigrate: kernel %s runs (PID %d) but does not answer: killed; it comes back from its "
                    "images", name, running)
        proctree.kill_tree(running)
        proctree.wait_gone(running, timeout=10)
        running = None
    if running is not None and manifest.stash:
        # Its server died during the resume's unstash: the kernel finishes reading (or has); if it cannot,
        # its images, never changed, are the copy to trust.
        error = await asyncio.to_thread(_give_back_stash, connection_info, folder, running, safe_points)
        if error is not None:
            log.warning("gpumigrate: kernel %s runs (PID %d) but could not read its buffers back (%s): killed; it "
                        "comes back from its images", name, running, error)
            proctree.kill_tree(running)
            proctree.wait_gone(running, timeout=10)
            running = None
    revival = Revival(connection_info, manifest.sessions, secrets.get("credential"), secrets.get("api_url"), running)
    why_not = await _take_back(serverapp, name, manifest.kernel_name, revival)
    if why_not:
        log.error("gpumigrate: could not take back kernel %s (%s): %s. Its images are left in %s.",
                  name, manifest.kernel_name, why_not, store.path_for(name))
        return refused(name, folder, why_not,
                       f"Nothing was deleted. Make the kernelspec '{manifest.kernel_name}' available again, with "
                       f"jupyter-gpumigrate's provisioner, and restart the server; or remove the kernel's images "
                       f"(rm -r {folder}).")
    if running is not None:
        store.remove(name)  # it runs and answers: its images are stale
    outcome = "running" if running else "suspended"
    log.info("gpumigrate: took back kernel %s (%s), %s", name, manifest.kernel_name, outcome)
    return Found(name, outcome)


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False


async def _adopt_running(serverapp: Any, records: Path, link_to: LinkTo | None = None) -> list[Found]:
    """Adopt the kernels whose server died while they ran, here or on a peer; remove stale records."""
    found: list[Found] = []
    km = serverapp.kernel_manager
    elsewhere: list[tuple[Path, dict]] = []  # the kernels on peers: asked all at once, after those here
    for path in sorted(records.glob("*.json")) if records.is_dir() else []:
        kernel_id = path.stem
        if kernel_id in km:
            continue  # taken back from its images, or started meanwhile
        if _empty(path):
            # A running kernel's record is not synced (provisioner._write_record): a host that went down as one
            # was replaced may leave it empty. It named a process of that host's, which ended with it.
            log.warning("gpumigrate: the record %s is empty (written as the host went down): removed; the kernel "
                        "it named ended with the host", path)
            path.unlink(missing_ok=True)
            continue
        try:
            record = json.loads(path.read_text())
            owner = os.stat(path).st_uid
            if owner != os.geteuid() or record.get("owner") != os.geteuid() or record.get("kernel_id") != kernel_id:
                raise ValueError(f"it is not this server's user's ({owner}), or not for kernel {kernel_id}")
            remote = record.get("remote")
            if remote is not None and not (isinstance(remote, dict) and isinstance(remote.get("peer"), str)):
                raise ValueError(f"its peer is not said right ({str(remote)[:80]})")
            pid, started = (0, 0) if remote is not None else (int(record["pid"]), int(record["started"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.error("gpumigrate: ignoring the record %s: %s", path, exc)
            found.append(refused(kernel_id, path, f"its running record is not usable: {exc}",
                                 f"Nothing was deleted, and no process touched. Remove the record (rm {path}) once "
                                 "you have looked; a kernel it names that still runs is then yours to end."))
            continue
        if kept_by_another_live_server(record.get("server")):
            continue  # a kernel of another server that runs: not ours to adopt
        if remote is not None:
            elsewhere.append((path, record))
            continue
        if not proctree.is_alive(pid) or proctree.start_time(pid) != started:
            path.unlink(missing_ok=True)  # it ended with its server, or was suspended since (its images tell)
            continue
        await asyncio.to_thread(let_cuda_run, kernel_id, pid)
        revival = Revival(dict(record.get("connection_info") or {}), list(record.get("sessions") or []),
                          record.get("credential"), record.get("api_url"), pid)
        why_not = await _take_back(serverapp, kernel_id, str(record.get("kernel_name") or ""), revival)
        if why_not:
            log.error("gpumigrate: kernel %s runs (PID %d), left by an earlier server, but could not be adopted: "
                      "%s", kernel_id, pid, why_not)
            found.append(refused(kernel_id, path, f"it runs (PID {pid}) but could not be adopted: {why_not}",
                                 f"Nothing was deleted. End that kernel (kill {pid}) if its work is not needed, "
                                 f"or make its kernelspec available again and restart the server."))
            continue
        log.info("gpumigrate: adopted kernel %s (PID %d), left running by an earlier server", kernel_id, pid)
        found.append(Found(kernel_id, "running"))
    # A peer's answer may take a while (a resume there, a dump there to wait for): one slow peer, or kernel,
    # does not hold the others.
    outcomes = await asyncio.gather(*(_adopt_remote_safely(serverapp, path, record, link_to)
                                      for path, record in elsewhere))
    found += [outcome for outcome in outcomes if outcome is not None]
    return found


async def _discard_copy_left(serverapp: Any, kernel_id: str, peer: str, link_to: LinkTo | None) -> None:
    """The dump a peer keeps of a kernel that came home from it, which the kernel's last server did not live
    (or could not reach the peer) to have deleted: deleted now, if the peer has it suspended or ended, and the
    kernel is here (taken back running or suspended). Anything else there is left as it is, and the next start
    asks again."""
    try:
        provisioner = serverapp.kernel_manager.get_kernel(kernel_id).provisioner
        if provisioner.remote_link is not None:
            return
        provisioner.record_copy_left(peer)  # kept in its record (written again as it was taken back) until deleted
        provisioner.write_record()
        if link_to is None:
            raise MigrateError("this server relays to no peer")
        link = link_to(peer, kernel_id, dict(provisioner.connection_info))
        state = (await _ask(link)).get("state")
        if state not in ("suspended", "stopped"):
            log.error("gpumigrate: kernel %s came home from %s, which says it is %s there: what %s keeps of it is "
                      "left as it is (the next start asks again)", kernel_id, peer, state, peer)
            return
        await asyncio.to_thread(link.discard)
    except MigrateError as exc:
        if getattr(exc, "status", None) != 404:
            log.warning("gpumigrate: kernel %s came home from %s, whose dump of it could not be deleted (%s): the "
                        "next start asks again", kernel_id, peer, exc)
            return
    except Exception:  # noqa: BLE001  one peer's odd answer never stops a start
        log.exception("gpumigrate: kernel %s: the dump %s keeps of it could not be deleted", kernel_id, peer)
        return
    log.info("gpumigrate: kernel %s came home from %s before its last server stopped: the dump %s kept of it is "
             "deleted", kernel_id, peer, peer)
    await asyncio.to_thread(provisioner.record_copy_left, None)


#: How long a server starting waits for a peer still moving one of its kernels (its dump for a way home that
#: the last server asked for), in seconds.
PEER_BUSY_WAIT = 120.0


async def _adopt_remote_safely(serverapp: Any, path: Path, record: dict, link_to: LinkTo | None) -> Found | None:
    try:
        return await _adopt_remote(serverapp, path, record, link_to)
    except Exception as exc:  # noqa: BLE001  an answer not understood: one record never stops the others
        peer = record["remote"]["peer"]
        log.exception("gpumigrate: kernel %s, on peer %s, not taken back", path.stem, peer)
        return refused(path.stem, path, f"it runs on peer {peer}, whose answer was not understood "
                                        f"({type(exc).__name__}: {exc})")


async def _adopt_remote(serverapp: Any, path: Path, record: dict, link_to: LinkTo | None) -> Found | None:
    """A kernel that ran on a peer when its server died or stopped: relayed to again, as remote; None once its
    record is stale (the peer no longer has it) and removed."""
    kernel_id, peer = path.stem, str(record["remote"]["peer"])
    kept = (f"Nothing was deleted. Restart this server once {peer} answers (its server keeps the kernel: "
            f"c.GPUMigrateApp.guest_unclaimed_expire after it starts); or, if the kernel's work is not needed, "
            f"remove the record (rm {path}).")
    if MigratableProvisioner(config=serverapp.config).images.path_for(kernel_id).is_dir():
        # Being moved or transplanted there as the server died: its images here are the kernel as it left.
        kept = (f"Nothing was deleted. Restart this server once {peer} answers: it asks {peer} again. If {peer} "
                f"is gone for good, remove the record (rm {path}) and restart this server: the kernel comes back "
                f"from its images here, as it was when it left for {peer} (what it did there since is lost).")
    if link_to is None:
        return refused(kernel_id, path, f"it runs on peer {peer}, and this server relays to no peer", kept)
    try:
        link = link_to(peer, kernel_id, dict(record.get("connection_info") or {}))
    except MigrateError as exc:
        log.error("gpumigrate: kernel %s runs on peer %s, which this server does not know: %s", kernel_id, peer, exc)
        return refused(kernel_id, path, f"it runs on peer {peer}, which this server does not know ({exc})",
                       f"Nothing was deleted. Configure peer {peer} again (c.GPUMigrateApp.peers) and restart the "
                       f"server; or remove the record (rm {path}) if the kernel's work is not needed.")
    try:
        there = await _ask(link)
        if there.get("waiting"):  # a transplant's new process, not the kernel: the source's images here are
            await asyncio.to_thread(link.discard)
            path.unlink(missing_ok=True)
            log.warning("gpumigrate: kernel %s was being transplanted to %s when its server stopped, before its new "
                        "process there was told to go: that process is discarded, and the source is taken back from "
                        "its images here", kernel_id, peer)
            return None
        if there.get("state") in ("running", "suspended"):
            await asyncio.to_thread(_stop_local_copy, MigratableProvisioner(config=serverapp.config).images,
                                    kernel_id)
        if there.get("state") == "suspended":  # as its server stopped, or for a way home that server never ended
            log.warning("gpumigrate: kernel %s was left suspended at %s by its server (which stopped under the "
                        "stop policy 'suspend', or died on the kernel's way home, or as it moved the kernel there "
                        "before the restore): resumed there", kernel_id, peer)
            await asyncio.to_thread(link.resume_left)
            there = await _ask(link)
        elif there.get("stash_left"):  # its server there died too, during that dump, after the kernel's stash
            await asyncio.to_thread(link.give_back_left)  # else asked again as the relay dials, and before a way home
    except MigrateError as exc:
        if getattr(exc, "status", None) == 404:
            path.unlink(missing_ok=True)
            log.warning("gpumigrate: kernel %s ran on %s when its server stopped, and %s no longer has it (it "
                        "ended there, or was discarded as no one relayed it): forgotten", kernel_id, peer, peer)
            return None
        log.error("gpumigrate: kernel %s runs on %s, which does not answer: %s", kernel_id, peer, exc)
        return refused(kernel_id, path, f"it runs on peer {peer}, which could not be asked ({exc})", kept)
    state = there.get("state")
    if state == "stopped":  # it ended there: what is left of it there goes too
        path.unlink(missing_ok=True)
        with contextlib.suppress(MigrateError):
            await asyncio.to_thread(link.discard)
        log.warning("gpumigrate: kernel %s ran on %s when its server stopped, and ended there: forgotten",
                    kernel_id, peer)
        return None
    if state != "running":
        return refused(kernel_id, path, f"it is on peer {peer}, {state} there (after {PEER_BUSY_WAIT:.0f} s)", kept)
    try:
        await link.attach_async()  # its ports here are the relay's again, before the kernel manager connects
    except Exception as exc:  # noqa: BLE001  a port taken meanwhile, the peer gone since it answered
        log.error("gpumigrate: kernel %s runs on %s but cannot be relayed to: %s", kernel_id, peer, exc)
        return refused(kernel_id, path, f"it runs on peer {peer}, but could not be relayed to ({exc})", kept)
    revival = Revival(dict(record.get("connection_info") or {}), list(record.get("sessions") or []),
                      record.get("credential"), record.get("api_url"), None, remote=link, where=there)
    why_not = await _take_back(serverapp, kernel_id, str(record.get("kernel_name") or ""), revival)
    if why_not:
        await link.detach_async()
        log.error("gpumigrate: kernel %s runs on %s but could not be adopted: %s", kernel_id, peer, why_not)
        return refused(kernel_id, path, f"it runs on peer {peer} but could not be adopted: {why_not}",
                       f"Nothing was deleted. Make its kernelspec available again and restart the server; or remove "
                       f"the record (rm {path}) if the kernel's work is not needed.")
    log.info("gpumigrate: kernel %s runs on %s: relayed to again, as its server left it", kernel_id, peer)
    return Found(kernel_id, "remote")


async def _ask(link: Any) -> dict:
    """What the peer says of the kernel, once it is neither busy moving it (its dump for a way home this
    server's predecessor asked for) nor still taking back its own guests (503), within PEER_BUSY_WAIT."""
    deadline = time.monotonic() + PEER_BUSY_WAIT
    while True:
        try:
            there = await asyncio.to_thread(link.describe) or {}
        except MigrateError as exc:
            if getattr(exc, "status", None) != 503 or time.monotonic() > deadline:
                raise
            there = {"state": "migrating"}
        if there.get("state") != "migrating" or time.monotonic() > deadline:
            return there
        await asyncio.sleep(0.5)


def _stop_local_copy(store: ImageStore, kernel_id: str) -> None:
    """A process of the kernel that runs here (restored by a way home that never ended): the peer's copy is the
    kernel, whole (it keeps its dump until the kernel is adopted here), so this one goes."""
    if not store.path_for(kernel_id).is_dir():
        return
    try:
        manifest = store.read_manifest(kernel_id)
    except MigrateError:
        manifest = None
    if manifest is None or manifest.kernel_id != kernel_id:
        return
    pid = _running_kernel(manifest, kill_stuck=False)
    if pid is not None:
        log.warning("gpumigrate: kernel %s: its process %d here, restored by a way home its server did not live to "
                    "end, is stopped: the copy on its peer is the kernel", kernel_id, pid)
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)
        # Its PIDs free: on one machine (hosts of network namespaces) the peer's resume needs the very same.
        proctree.wait_ids_released(manifest.ids, timeout=10)


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
