"""Image directories of suspended process trees, and their manifests.

Images hold everything that was in the kernel's memory, secrets included: the root and every image
directory are created 0700 and the manifest 0600. A directory is ours only if it lies directly under
the root, is not a symbolic link, and holds a manifest.

Images go to disk (``root``, under the state folder) or to memory (``memory_root``, on a tmpfs such as
/dev/shm): memory is some ten times faster both ways (docs/performance.md) but holds host memory while
the kernel is suspended, and is lost with a reboot. :func:`choose` picks one for a suspend;
:meth:`ImageStore.to_disk` moves a kernel's memory images to disk (when its server stops), crash-safely.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import socket
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from .criu import DUMP_LOG, dump_finished
from .errors import ImageError

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
LOGS = ".logs"
#: the kernel's secrets (its connection key, its API credential's hash), 0600, beside the images; never
#: sent to another host
SECRETS = "secrets.json"
#: the manifest to be, written before CRIU runs: with CRIU's log, it completes images whose server died
#: between the end of the dump and the manifest (revive.py)
PENDING = "pending.json"
#: CRIU's own record of a dump, written once its images are (the last of them)
INVENTORY = "inventory.img"


@dataclass
class Manifest:
    """What a suspended kernel was, so it can be brought back (possibly by another server)."""

    kernel_id: str
    kernel_name: str
    pid: int
    ids: list[int]
    host: str = field(default_factory=socket.gethostname)
    criu_version: str = ""
    #: the GPU(s) it held: index, uuid, name, memory_used (bytes)
    gpus: list[dict] = field(default_factory=list)
    #: the processes of the tree that were CUDA-checkpointed before the dump
    cuda_pids: list[int] = field(default_factory=list)
    connection_info: dict = field(default_factory=dict)
    #: listening port -> clients connected at dump time, to wait for after a restore
    clients: dict = field(default_factory=dict)
    #: what pointed at the kernel in its server (notebook sessions: id, path, name, type), to point there again
    sessions: list[dict] = field(default_factory=list)
    #: the uid that wrote it: a server takes back only its own user's kernels
    owner: int = field(default_factory=os.geteuid)
    #: the process that wrote it (PID, start time): while that one lives, no other takes the kernel back
    server: list[int] = field(default_factory=lambda: this_process())
    image_bytes: int = 0
    #: the host stash (kernel/hoststash.py), if the kernel wrote its large buffers itself: bytes, buffers,
    #: files, seconds; {} if CRIU and the driver carried everything
    stash: dict = field(default_factory=dict)
    #: each image file's size in bytes, by name (the manifest itself aside)
    files: dict[str, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION

    def wrong_types(self) -> str:
        """What in a manifest read from disk is not of its type ('' if nothing)."""
        def whole(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        checks = {"kernel_id": isinstance(self.kernel_id, str), "kernel_name": isinstance(self.kernel_name, str),
                  "pid": whole(self.pid) and self.pid > 0, "owner": whole(self.owner),
                  "ids": isinstance(self.ids, list) and all(whole(i) and i > 0 for i in self.ids),
                  "cuda_pids": isinstance(self.cuda_pids, list) and all(whole(i) for i in self.cuda_pids),
                  "gpus": isinstance(self.gpus, list) and all(isinstance(g, dict) for g in self.gpus),
                  "sessions": isinstance(self.sessions, list) and all(isinstance(x, dict) for x in self.sessions),
                  "connection_info": isinstance(self.connection_info, dict),
                  "clients": isinstance(self.clients, dict), "image_bytes": whole(self.image_bytes),
                  "stash": isinstance(self.stash, dict),
                  "server": isinstance(self.server, list) and len(self.server) == 2 and all(map(whole, self.server))}
        bad = [name for name, ok in checks.items() if not ok]
        return f"wrong {', '.join(bad)}" if bad else ""

    @classmethod
    def from_dict(cls, data: dict) -> Manifest:
        known = {name for name in cls.__dataclass_fields__}
        # Read from disk, an owner is what it says, never the reader by default.
        return cls(**{"owner": -1, **{k: v for k, v in data.items() if k in known}})


def manifest_from(data: Any, where: str) -> Manifest:
    """The manifest whose JSON, parsed, is ``data`` (read from ``where``, which the error names); ImageError if it
    is not one."""
    try:
        manifest = Manifest.from_dict(data)
    except (TypeError, AttributeError, ValueError) as exc:
        raise ImageError(f"{where} is damaged (not a manifest: {exc}); the kernel cannot be resumed.") from exc
    wrong = manifest.wrong_types()
    if wrong:
        raise ImageError(f"{where} is damaged ({wrong}); the kernel cannot be resumed.")
    return manifest


def this_process() -> list[int]:
    """This process as [PID, start time]: a name that a later process with the same PID does not share."""
    try:
        with open(f"/proc/{os.getpid()}/stat", encoding="ascii", errors="replace") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        start = 0
    return [os.getpid(), start]


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: held only while in use (a kernel's lock goes once no one holds it: no lock kept per kernel ever seen)
_LOCKS: weakref.WeakValueDictionary[Path, Any] = weakref.WeakValueDictionary()
_LOCKS_LOCK = threading.Lock()


def _lock_of(path: Path) -> Any:
    """The lock (an RLock) of one kernel's images in this process: a move to disk and a removal, one after the
    other."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(path)
        if lock is None:
            lock = _LOCKS[path] = threading.RLock()
        return lock


def _written(path: Path, cached: bool = False) -> None:
    """``path``, an image file just written, on disk; then, unless ``cached`` (a file in memory: on a tmpfs its
    pages are the file), out of the page cache. Images are read once, at the resume: kept cached, a suspend to
    disk of 32 GB would push 32 GB of other processes' cached files out of memory (the host stash drops its
    own files' pages the same way, kernel/hoststash.py)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if not cached:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str, synced: bool = True) -> None:
    """``text`` into ``path``, 0600, all or nothing, on disk once this returns (a temporary file of its own,
    made exclusively: two writers never mix, and no link planted there is followed).

    ``synced`` False: all or nothing still, for every process at once, but left to the page cache, which a
    crash of this process does not lose; a crash of the host may (it leaves the last synced version, none, or an
    empty file). For what a host's crash makes moot: the record of a process on this host. Each of the two fsyncs cost
    0.3-0.4 s on the GPU machine's disk where a kernel came home from another host (bench/results, 2026-11-30)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            if synced:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if synced:
        _fsync_file(path.parent)


def directory_size(path: Path) -> int:
    return sum(entry.stat().st_size for entry in path.rglob("*") if entry.is_file() and not entry.is_symlink())


MEMORY, DISK, AUTO = "memory", "disk", "auto"
#: how a suspend's images_why begins where its images went to disk because memory filled as they were written
#: (plans/suspend.py)
FILLED = "memory filled as the images were written"
#: A folder being moved from memory to disk (to_disk), until it is complete there.
MOVING = ".moving-"
#: the prefix of a transplant's folder (:meth:`ImageStore.scratch`)
TRANSPLANT = ".transplant-"
#: the prefix of a folder of images being deleted by a thread of its own (:meth:`ImageStore.remove`, ``later``);
#: one that a server ended before it was gone is deleted by :meth:`ImageStore.drop_removing` at the next start
REMOVING = ".removing-"
#: the folder (in the disk root) of the transplants' sources, one per kernel id, kept so that the kernel can go
#: back to it (:meth:`ImageStore.keep`); a plain name, as the node helper takes only those
KEPT = "kept"
#: in a kept source's folder: until when it is kept (``{"until": seconds since the epoch}``)
KEPT_UNTIL = "kept.json"


class ImageStore:
    """The directory that holds one image directory per suspended kernel, on disk, and optionally a second
    one in memory (a tmpfs). A kernel's images are in one of them: :meth:`path_for` says which."""

    def __init__(self, root: str | os.PathLike[str], memory_root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root)
        self.memory_root = Path(memory_root) if memory_root else None

    def _ensure_root(self, root: Path | None = None) -> None:
        root = root or self.root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if root == self.memory_root and self.memory_refused():
            raise ImageError(f"{root} is not a private folder of this user's: images are not put there. Remove it, "
                             "or set c.MigratableProvisioner.memory_dir (or state_dir) to a folder of your own.")
        os.chmod(root, 0o700)

    def memory_refused(self) -> str:
        """Why the memory folder may not be used ('' if it may): it lies in a folder everyone can write
        (/dev/shm), so someone else could have made it, or a link there. Absent, it is fine (made 0700)."""
        if self.memory_root is None:
            return "no memory folder is set"
        try:
            info = os.lstat(self.memory_root)
        except FileNotFoundError:
            return ""
        except OSError as exc:
            return f"{self.memory_root} cannot be read ({exc.strerror or exc})"
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return f"{self.memory_root} is not a private folder of this user's"
        return ""

    def _memory(self) -> Path | None:
        """The memory folder, if it may be read from (see :meth:`memory_refused`)."""
        return self.memory_root if self.memory_root is not None and not self.memory_refused() else None

    def path_for(self, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ImageError(f"'{name}' is not a valid image name.")
        disk = self.root / name
        if self._memory() is not None and not (disk / MANIFEST).exists():
            memory = self.memory_root / name
            if memory.is_dir() and not memory.is_symlink():
                return memory
        return disk

    def where(self, name: str) -> str:
        """``memory`` or ``disk``: where ``name``'s images are (or would be read from)."""
        return MEMORY if self._memory() is not None and self.path_for(name).parent == self.memory_root else DISK

    def create(self, name: str, where: str = DISK) -> Path:
        """A new, empty, private directory for ``name``, in memory or on disk (``where``); old ones of the same
        name, wherever they are, are replaced."""
        self.path_for(name)  # a valid name
        base = self.memory_root if where == MEMORY and self.memory_root is not None else self.root
        path = base / name
        try:
            self._ensure_root(base)
            for old in self._both(name):
                _remove(old)
            _mkdir_in(path, lambda: self._ensure_root(base))
            os.chmod(path, 0o700)
        except OSError as exc:
            raise ImageError(
                f"Cannot make the images folder {path} ({exc.strerror or exc}): check that "
                f"{base} is a folder the server can write, on a disk with room "
                f"(c.MigratableProvisioner.state_dir)."
            ) from exc
        return path

    def places(self, name: str) -> list[Path]:
        """Where ``name``'s images may be: its folder on disk, and in memory where there is a memory folder."""
        return self._both(name)

    def _both(self, name: str) -> list[Path]:
        memory = self._memory()
        return [self.root / name] + ([memory / name] if memory is not None else [])

    def to_disk(self, name: str) -> Path:
        """Move ``name``'s memory images to disk; their disk folder. Crash-safe: the copy is made under a
        temporary name, synced, renamed (a disk folder with a manifest is complete, and wins over the memory
        one), and only then is the memory folder removed. A no-op for images already on disk. Two moves of one
        kernel at once (the memory watcher's and the stop's) go one after the other: the second finds the
        images on disk, instead of removing the first one's copy under it."""
        with _lock_of(self.root / name):
            return self._to_disk(name)

    def _to_disk(self, name: str) -> Path:
        source = self.path_for(name)
        if self.where(name) != MEMORY:
            return source
        self._ensure_root()
        temporary = self.root / f"{MOVING}{name}"
        _remove(temporary)
        try:
            temporary.mkdir(mode=0o700)
            for entry in sorted(source.iterdir()):
                if entry.is_file() and not entry.is_symlink():
                    shutil.copyfile(entry, temporary / entry.name, follow_symlinks=False)
                    os.chmod(temporary / entry.name, 0o600)
                    _written(temporary / entry.name)
            _fsync_file(temporary)
        except BaseException:
            _remove(temporary)  # a full disk, say: the memory images stay the kernel's, whole
            raise
        target = self.root / name
        _remove(target)
        os.rename(temporary, target)
        _fsync_file(self.root)
        _remove(source)
        self._drop_memory_root()  # the last kernel in memory gone to disk: no empty folder left in /dev/shm
        return target

    def scratch(self, name: str, nbytes: int, pid: int | None = None) -> Path:
        """A new private folder for ``name``'s transplant (its objects on their way to a new process), in
        memory where the tmpfs has room for ``nbytes`` and 10 % more, the host keeps a quarter of its
        memory available, and the memory cgroup of ``pid`` (who writes them, and is charged for them) has
        room; on disk otherwise. Its name is new each time. :meth:`tidy` removes what a server that stopped
        left. :class:`ImageError` if neither has room."""
        self.path_for(name)  # a valid name
        total, available = host_memory()
        left = cgroup_room(pid) if pid is not None else None
        for base in (self._memory(), self.root):
            if base is None:
                continue
            if base == self.memory_root and (memory_free(base) < nbytes * 1.1
                                             or available - nbytes < KEEP_AVAILABLE * total
                                             or (left is not None and left < nbytes * 1.1)):
                continue
            if memory_free(base) < nbytes * 1.1:
                raise ImageError(f"No room for the kernel's objects ({nbytes / 1e9:.1f} GB) in memory nor in "
                                 f"{base} ({memory_free(base) / 1e9:.1f} GB free): free space there, then try again. "
                                 "The kernel runs on, unchanged.")
            path = base / f"{TRANSPLANT}{name}-{os.urandom(4).hex()}"
            try:
                self._ensure_root(base)
                _mkdir_in(path, lambda: self._ensure_root(base))
            except OSError as exc:
                raise ImageError(f"Cannot create {path} for the kernel's objects: {exc}. The kernel runs on.") from exc
            return path
        raise ImageError("No folder for the kernel's objects")  # the root is always a candidate

    def keep(self, name: str, until: float, drop: tuple[str, ...] = ()) -> Path:
        """Keep ``name``'s images, a transplant's source, until ``until`` (seconds since the epoch), in a folder
        of their own (:data:`KEPT`), on disk (in memory they would hold host memory all that time); the files
        named in ``drop`` go, once they are there. Their folder. Replaces a source kept before.

        A server that dies meanwhile loses at most the way back: before the rename the images are the
        transplant's, with its marker (revive.py); after it, no server takes them for a kernel, and a folder
        without its time is deleted as expired."""
        self.to_disk(name)
        source, target = self.root / name, self.root / KEPT / name
        self._ensure_root(target.parent)
        _remove(target)
        os.rename(source, target)
        _fsync_file(self.root)
        for entry in drop:
            (target / entry).unlink(missing_ok=True)
        write_durably(target / KEPT_UNTIL, json.dumps({"until": until}))
        return target

    def kept(self, name: str) -> tuple[Path, float] | None:
        """The folder of ``name``'s kept source and until when it is kept, or None (none, or damaged)."""
        self.path_for(name)  # a valid name
        folder = self.root / KEPT / name
        try:
            until = json.loads((folder / KEPT_UNTIL).read_text())["until"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if folder.is_symlink() or not isinstance(until, (int, float)):
            return None
        try:
            self.read_manifest_at(folder)
        except ImageError:
            return None
        return folder, float(until)

    def drop_kept(self, name: str) -> None:
        """Delete ``name``'s kept source, if any."""
        self.path_for(name)
        _remove(self.root / KEPT / name)

    def expire_kept(self, now: float | None = None, skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Delete the kept sources whose time is up (and any that cannot be read), but those of the kernels
        in ``skip`` (one going back to it now); the kernels' names."""
        now = time.time() if now is None else now
        gone = []
        folder = self.root / KEPT
        for entry in folder.iterdir() if folder.is_dir() and not folder.is_symlink() else []:
            if entry.name in skip:
                continue
            kept = self.kept(entry.name) if not entry.name.startswith(".") else None
            if kept is None or kept[1] <= now:
                _remove(entry)
                gone.append(entry.name)
        return gone

    def tidy(self) -> list[str]:
        """At start: finish what a server stopped during :meth:`to_disk` left (a partial copy is removed; a
        memory folder whose disk copy is complete is removed), and remove the folders of transplants it left
        (:meth:`scratch`) and those it had begun to delete (:meth:`remove`, ``later``). The names it acted on."""
        done = []
        self.drop_removing()
        for root in (self.root, self._memory()):
            for folder in root.glob(f"{TRANSPLANT}*") if root is not None and root.is_dir() else []:
                _remove(folder)
        for partial in self.root.glob(f"{MOVING}*") if self.root.is_dir() else []:
            _remove(partial)
            done.append(partial.name[len(MOVING):])
        if self._memory() is not None and self.memory_root.is_dir():
            for memory in self.memory_root.iterdir():
                if memory.is_dir() and (self.root / memory.name / MANIFEST).exists():
                    _remove(memory)
                    done.append(memory.name)
        return done

    def log_path(self, name: str, what: str) -> Path:
        """Where CRIU's ``what`` log for ``name`` goes when it must outlive the images (a failed dump's)."""
        self._ensure_root()
        logs = self.root / LOGS
        logs.mkdir(mode=0o700, exist_ok=True)
        return logs / f"{self.path_for(name).name}-{what}.log"

    def write_manifest(self, path: Path, manifest: Manifest, secrets: dict | None = None) -> None:
        """Make the images a complete record, durably: every file private and on disk, the secrets, then
        the manifest, written last (a temporary name, fsync, rename, fsync of the folder). A folder
        without a manifest is an unfinished dump, never taken for a kernel, unless :meth:`finished_dump` says
        CRIU finished it (the manifest is then written from the pending one)."""
        in_memory = self.memory_root is not None and path.parent == self.memory_root
        for entry in path.iterdir():  # CRIU writes 0644 under a user's umask: make them private too
            # (not the marks beside the files, private already, whose temporary names come and go meanwhile)
            if entry.is_file() and not entry.is_symlink() and not entry.name.startswith("."):
                entry.chmod(0o600)
                _written(entry, cached=in_memory)
        if secrets is not None:
            write_durably(path / SECRETS, json.dumps(secrets))
        manifest.files = {entry.name: entry.stat().st_size for entry in sorted(path.iterdir())
                          if entry.is_file() and not entry.is_symlink() and not entry.name.startswith((MANIFEST, "."))
                          and entry.name not in (SECRETS, PENDING)}
        manifest.image_bytes = sum(manifest.files.values())
        write_durably(path / MANIFEST, json.dumps(asdict(manifest), indent=1))
        (path / PENDING).unlink(missing_ok=True)

    def write_pending(self, path: Path, manifest: Manifest, secrets: dict | None = None) -> None:
        """Before CRIU runs: the manifest to be and the secrets (see :data:`PENDING`)."""
        if secrets is not None:
            write_durably(path / SECRETS, json.dumps(secrets))
        write_durably(path / PENDING, json.dumps(asdict(manifest), indent=1))

    def read_pending(self, name: str) -> Manifest | None:
        """The manifest to be of ``name``'s images, if a dump began writing them (None otherwise)."""
        try:
            data = json.loads((self.path_for(name) / PENDING).read_text())
            manifest = Manifest.from_dict(data)
        except (OSError, ValueError, TypeError, AttributeError):
            return None
        return None if manifest.wrong_types() else manifest

    def finished_dump(self, name: str) -> Manifest | None:
        """The manifest to be of ``name``'s images where they are whole but lack their manifest: CRIU's dump
        finished (its log says so), and the manifest was not written after it (its server died right then,
        or the disk filled). None otherwise. :meth:`write_manifest` with it makes them a complete record."""
        folder = self.path_for(name)
        if (folder / MANIFEST).exists() or not (folder / INVENTORY).is_file():
            return None  # complete, or CRIU never finished writing here (its inventory comes last)
        pending = self.read_pending(name)
        if pending is None or pending.kernel_id != name:
            return None
        # That dump's log: beside the other logs where this server ran CRIU, in the folder itself where the
        # node helper did (its CRIU works there; the server moves the log out only on a failure). Not one an
        # earlier dump of the kernel left (dump() removes it before CRIU runs): written to no earlier than the
        # older of the manifest to be and CRIU's inventory (its last image).
        for log in (self.root / LOGS / f"{folder.name}-dump.log", folder / DUMP_LOG):
            try:
                if log.stat().st_mtime >= min((folder / PENDING).stat().st_mtime, (folder / INVENTORY).stat().st_mtime):
                    return pending if dump_finished(log) else None
            except OSError:
                continue
        return None

    def read_secrets(self, name: str) -> dict:
        """The secrets kept with ``name``'s images ({} if none were)."""
        try:
            data = json.loads((self.path_for(name) / SECRETS).read_text())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ImageError(f"{self.path_for(name) / SECRETS} is damaged ({exc}).") from exc
        return data if isinstance(data, dict) else {}

    def read_manifest(self, name: str) -> Manifest:
        path = self.path_for(name)
        if path.is_symlink() or not path.is_dir():
            raise ImageError(f"No images for {name} in {self.root}: the kernel cannot be resumed from disk.")
        return self.read_manifest_at(path)

    def read_manifest_at(self, path: Path) -> Manifest:
        """The manifest of the images in ``path`` (:class:`ImageError` if missing or damaged)."""
        try:
            data = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError as exc:
            raise ImageError(
                f"The images in {path} have no {MANIFEST}: the dump did not finish, so they cannot be "
                f"restored. Shut the kernel down to free them."
            ) from exc
        except ValueError as exc:
            raise ImageError(f"{path / MANIFEST} is damaged ({exc}); the kernel cannot be resumed.") from exc
        return manifest_from(data, str(path / MANIFEST))

    def remove_logs(self, name: str) -> None:
        """Delete the logs kept for ``name`` (a failed dump's)."""
        if (self.root / LOGS).is_dir():
            for log in (self.root / LOGS).glob(f"{self.path_for(name).name}-*.log"):
                log.unlink(missing_ok=True)

    def remove(self, name: str, keep_logs: bool = False, later: bool = False) -> None:
        """Delete ``name``'s images, in memory and on disk, and (unless ``keep_logs``) the logs kept beside them;
        once a move of them to disk under way (:meth:`to_disk`) is over. ``later``: each folder is renamed at once
        (the name is free for new images) and deleted by a thread of its own, which the server's exit waits for:
        freeing 32 GB of a tmpfs takes some 2 s, which a kernel that runs again need not wait for (the restore of
        a kernel moved here from another host answers its owner only after its images are forgotten)."""
        doomed: list[Path] = []
        with _lock_of(self.root / name):
            if not later:
                self._remove_images(name, keep_logs)
                return
            if not keep_logs:
                self.remove_logs(name)
            self.path_for(name)  # a valid name
            for path in self._both(name):
                away = path.with_name(f"{REMOVING}{os.urandom(8).hex()}")
                try:
                    if path.is_dir() and not path.is_symlink():
                        path.rename(away)
                        doomed.append(away)
                        continue
                except OSError:
                    pass  # deleted here, then
                _remove(path)
        if doomed:
            threading.Thread(target=self._remove_doomed, args=(doomed,), name="gpumigrate-remove-images").start()

    def _remove_doomed(self, doomed: list[Path]) -> None:
        for path in doomed:
            _remove(path)
        self._drop_memory_root()

    def _drop_memory_root(self) -> None:
        """No litter in /dev/shm once no kernel is there: the memory folder goes once empty."""
        if self.memory_root is not None:
            try:
                self.memory_root.rmdir()
            except OSError:
                pass

    def drop_removing(self) -> list[str]:
        """At start: delete the folders that an earlier server renamed to delete (:meth:`remove`, ``later``) and
        ended before it had; their names."""
        found = [p for root in (self.root, self._memory()) if root is not None and root.is_dir()
                 for p in root.glob(f"{REMOVING}*")]
        for path in found:
            _remove(path)
        return [p.name for p in found]

    def _remove_images(self, name: str, keep_logs: bool) -> None:
        if not keep_logs:
            self.remove_logs(name)
        self.path_for(name)  # a valid name
        for path in self._both(name):
            _remove(path)
        self._drop_memory_root()

    def names(self) -> list[str]:
        found: set[str] = set()
        for root in (self.root, self._memory()):
            if root is not None and root.is_dir():
                found.update(p.name for p in root.iterdir()
                             if p.is_dir() and not p.is_symlink() and not p.name.startswith(".") and p.name != KEPT)
        return sorted(found)


def _mkdir_in(path: Path, ensure_root: Callable[[], None]) -> None:
    """Make ``path`` (0700) in its root, which :meth:`ImageStore.remove` may have removed, once empty, just
    after ``ensure_root`` made it: then once more."""
    try:
        path.mkdir(mode=0o700)
    except FileNotFoundError:
        ensure_root()
        path.mkdir(mode=0o700)


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


def memory_free(folder: Path) -> int:
    """Bytes that can still be written to the file system of ``folder`` (or of its nearest existing parent)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        info = os.statvfs(folder)
    except OSError:
        return 0
    return info.f_bavail * info.f_frsize


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this host, in bytes (0, 0 if unknown)."""
    found = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemTotal", 0), found.get("MemAvailable", 0)


#: Memory images are chosen by ``auto`` only while the host keeps this share of its memory available after them.
KEEP_AVAILABLE = 0.25


def cgroup_room(pid: int) -> int | None:
    """Bytes the memory cgroup (v2) of ``pid`` may still take, or None where it has no limit (or none is known)."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            path = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
        if path is None:
            return None
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def choose(store: ImageStore, wanted: str, estimate: int, pid: int | None = None) -> tuple[str, str]:
    """Where a suspend of a kernel holding ``estimate`` bytes (host and GPU memory) puts its images, and why.

    ``disk`` and ``memory`` are taken as asked (memory refused, with :class:`ImageError`, where it has no
    room); ``auto`` takes memory when the tmpfs has room for the estimate and 10 % more, the host would
    keep a quarter of its memory available afterwards, and the memory cgroup of the kernel (``pid``), if it
    has a limit, has room for it too; disk otherwise (also when the memory folder is not the user's own)."""
    if wanted == DISK:
        return DISK, "asked for"
    if store.memory_root is None:
        if wanted == MEMORY:
            raise ImageError("Images cannot go to memory here: no memory folder is set (c.MigratableProvisioner."
                             "memory_dir; none by default with a shared_dir, whose images other hosts must be "
                             "able to read), or CRIU runs through a node helper that keeps no images in memory "
                             "(an administrator starts it with --memory-root). Suspend to disk.")
        return DISK, "no memory folder"
    refused = store.memory_refused()
    if refused:
        if wanted == MEMORY:
            raise ImageError(f"Images cannot go to memory: {refused}. Suspend to disk, or remove it (or set "
                             "c.MigratableProvisioner.memory_dir to a folder of your own). The kernel runs on.")
        return DISK, refused
    free = memory_free(store.memory_root)
    total, available = host_memory()
    room = free >= estimate * 1.1 and available - estimate >= KEEP_AVAILABLE * total
    # The stash's files are charged to the memory cgroup of the kernel, which writes them: within its limit.
    left = cgroup_room(pid) if pid is not None else None
    if left is not None and left < estimate * 1.1:
        room = False
        free = min(free, left)
    why = (f"{estimate / 1e9:.1f} GB to write; {free / 1e9:.1f} GB free in {store.memory_root}, "
           f"{available / 1e9:.1f} of {total / 1e9:.1f} GB of memory available")
    if wanted == MEMORY and not room:
        raise ImageError(f"No room for the kernel's images in memory ({why}): suspend it to disk, or free memory. "
                         "The kernel runs on, unchanged.")
    return (MEMORY, why) if room else (DISK, f"no room in memory ({why})")
