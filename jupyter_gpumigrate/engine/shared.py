"""A folder of suspended kernels shared by several hosts (a node pool's shared storage).

Each host keeps its kernels' images in a folder of its own, and says it runs with a heartbeat beside it:

    <shared>/hosts/<host>/images/<kernel id>/   the images and manifest of a kernel that <host> keeps
    <shared>/hosts/<host>.alive                 <host>'s heartbeat: its time and interval, rewritten each interval

A host keeps its kernels while its heartbeat is fresh. A heartbeat is judged by what this host sees, on
its own clock: one that has not changed for :data:`STALE_BEATS` of the host's intervals (at least of this
host's own), watched from here all that time, is stale (its server stopped, was killed, or its node is
gone); one that cannot be read is not (a storage hiccup says nothing). A server beats from a thread of its
own, from before it takes anything back until it has finished stopping, so a busy event loop or a long
resume never makes it look stopped. Then any other host may take its suspended kernels: it claims a kernel by renaming its folder into its own, one atomic rename within the
shared folder. Of two hosts that claim one kernel at once, exactly one rename succeeds; the other finds the
folder gone and is told which host has it (:class:`ClaimLost`). Nothing is ever copied or deleted here: a
claim that the new host cannot use after all is given back, by the same rename the other way.

Only folders with a manifest are claimed: one without is a dump in progress, or one its host's next server
finishes or removes, never another host's business. Images in memory (a tmpfs) are local by nature: they
are never in the shared folder, and only their own host takes them back.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import MigrateError
from .images import MANIFEST, write_durably

HOSTS = "hosts"
IMAGES = "images"
ALIVE = ".alive"
#: A host whose heartbeat is older than this many of its intervals does not run: its kernels may be taken.
STALE_BEATS = 3


class ClaimLost(MigrateError):
    """Another host claimed the kernel first (or its folder is gone): nothing was changed here."""

    http_status = 409


@dataclass
class Candidate:
    """A suspended kernel of another host, in the shared folder."""

    host: str
    kernel_id: str
    folder: Path


def valid_name(name: str, what: str) -> str:
    if not name or "/" in name or name.startswith(".") or "\0" in name:
        raise MigrateError(f"'{name}' cannot be a {what} in a shared folder: give it a name without '/' that does "
                           "not start with '.' (c.GPUMigrateApp.host_name).")
    return name


class SharedFolder:
    """The shared folder ``root``, as host ``host`` sees it."""

    def __init__(self, root: str | os.PathLike[str], host: str, interval: float = 10.0) -> None:
        self.root = Path(root)
        self.host = valid_name(host, "host name")
        #: this host's own heartbeat interval: no other host is judged stale in less than STALE_BEATS of it
        self.interval = interval
        #: host -> (what its heartbeat file said, when this host first saw it say that: monotonic)
        self._seen: dict[str, tuple[str, float]] = {}

    def images_root(self, host: str | None = None) -> Path:
        """The folder of ``host``'s images (this host's by default)."""
        return self.root / HOSTS / valid_name(host or self.host, "host name") / IMAGES

    def heartbeat_path(self, host: str | None = None) -> Path:
        return self.root / HOSTS / f"{valid_name(host or self.host, 'host name')}{ALIVE}"

    def beat(self, interval: float) -> None:
        """Say that this host runs, for the next ``interval`` seconds (times :data:`STALE_BEATS`)."""
        path = self.heartbeat_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_durably(path, json.dumps({"host": self.host, "time": time.time(), "interval": float(interval)}))

    def runs(self, host: str, now: float | None = None) -> bool:
        """Whether ``host``'s server may run: True unless its heartbeat file has said the same thing (or been
        missing) for STALE_BEATS of its interval (and of ours), as watched from here, on this host's clock.
        A file that cannot be read counts as a beat: it says nothing of the host."""
        now = time.monotonic() if now is None else now
        path = self.heartbeat_path(host)
        try:
            said = path.read_text()
        except FileNotFoundError:
            said = ""
        except OSError:
            return True
        try:
            interval = float(json.loads(said)["interval"]) if said else self.interval
        except (ValueError, KeyError, TypeError):
            interval = self.interval
        seen = self._seen.get(host)
        if seen is None or seen[0] != said:
            self._seen[host] = (said, now)
            return True
        return now - seen[1] <= STALE_BEATS * max(interval, self.interval)

    def _moved(self, host: str) -> bool:
        """Whether ``host``'s heartbeat changed since this host last looked (False if it never looked)."""
        seen = self._seen.get(host)
        if seen is None:
            return False
        try:
            said = self.heartbeat_path(host).read_text()
        except FileNotFoundError:
            said = ""
        except OSError:
            return True
        return said != seen[0]

    def _private_dir(self, path: Path) -> bool:
        """A real folder (no link) of this user's: only such folders are looked into, or taken from."""
        try:
            info = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()

    def hosts(self) -> list[str]:
        """Every host with a folder here, this one aside."""
        folder = self.root / HOSTS
        if not self._private_dir(folder):
            return []
        return sorted(p.name for p in folder.iterdir()
                      if not p.name.startswith(".") and p.name != self.host and self._private_dir(p))

    def candidates(self, on_error: Any = None) -> list[Candidate]:
        """The suspended kernels (complete images) of hosts whose server does not run. A host whose folder
        cannot be read is passed over (``on_error(host, exc)`` is told), never the others."""
        found = []
        for host in self.hosts():
            try:
                if self.runs(host):
                    continue
                images = self.images_root(host)
                if not self._private_dir(images.parent) or not self._private_dir(images):
                    continue  # a link planted as a host's images would hand out another host's kernels
                for folder in sorted(images.iterdir()):
                    if (not folder.name.startswith(".") and self._private_dir(folder)
                            and (folder / MANIFEST).is_file()):
                        found.append(Candidate(host, folder.name, folder))
            except OSError as exc:
                if on_error is not None:
                    on_error(host, exc)
        return found

    def where(self, kernel_id: str) -> str | None:
        """The host whose folder holds ``kernel_id``'s images now (None: none here)."""
        for host in [self.host, *self.hosts()]:
            if (self.images_root(host) / kernel_id).is_dir():
                return host
        return None

    def claim(self, host: str, kernel_id: str) -> Path:
        """Take ``kernel_id``'s images from ``host``'s folder into this host's, atomically; their new folder.
        :class:`ClaimLost` if another host took them first (nothing changed here)."""
        source = self.images_root(host) / valid_name(kernel_id, "kernel id")
        target = self.images_root() / kernel_id
        if self._moved(host):  # asked again at the last moment: a host that beat meanwhile keeps its kernels
            raise ClaimLost(f"Kernel {kernel_id}: host {host} runs again (its heartbeat moved): nothing was taken.")
        if not all(self._private_dir(p) or not os.path.lexists(p) for p in (source.parent.parent, source.parent,
                                                                              source)):
            raise ClaimLost(f"Kernel {kernel_id} of host {host}: {source} is not a plain folder of this user's (a "
                            "link?): nothing was taken.")
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if target.exists() or target.is_symlink():
            raise ClaimLost(f"Kernel {kernel_id}: this host ({self.host}) already has a folder {target}: nothing "
                            f"was taken from {host}. Look at both and remove the one that is not needed.")
        try:
            # rename(2) within one file system: atomic, and of two claims of one folder exactly one succeeds.
            os.rename(source, target)
        except FileNotFoundError:
            winner = self.where(kernel_id)
            said = f"host {winner} took it first" if winner else "its images are gone from the shared folder"
            raise ClaimLost(f"Kernel {kernel_id} of host {host}: {said}; nothing was changed here.") from None
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise ClaimLost(f"Kernel {kernel_id}: {target} appeared meanwhile: nothing was taken from {host}.") \
                    from None
            raise MigrateError(f"Could not take kernel {kernel_id} from {source} ({exc.strerror or exc}): check that "
                               f"{self.root} is one file system this server can write.") from exc
        _fsync_dir(source.parent)
        _fsync_dir(target.parent)
        return target

    def give_back(self, host: str, kernel_id: str) -> Path:
        """Undo :meth:`claim`: ``kernel_id``'s images go back to ``host``'s folder; their folder there."""
        source = self.images_root() / valid_name(kernel_id, "kernel id")
        target = self.images_root(host) / kernel_id
        os.rename(source, target)
        _fsync_dir(source.parent)
        _fsync_dir(target.parent)
        return target


class Beating(threading.Thread):
    """Beats for ``shared`` every ``interval`` seconds from a thread of its own, until :meth:`stop`: the
    server's event loop may be busy (a long resume, a slow start), its heartbeat goes on."""

    def __init__(self, shared: SharedFolder, interval: float, on_error: Any = None) -> None:
        super().__init__(name="gpumigrate-heartbeat", daemon=True)
        self.shared, self.interval, self.on_error = shared, interval, on_error
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.shared.beat(self.interval)
            except OSError as exc:
                if self.on_error is not None:
                    self.on_error(exc)
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
