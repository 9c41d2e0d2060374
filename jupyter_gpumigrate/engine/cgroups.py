"""A cgroup (v2) around one CRIU run of the node helper: all that the run starts, and all that those start,
stays in it (only root may move a process out). So the helper knows exactly which processes a restore
made, whatever the images say and whatever the caller does meanwhile. It can freeze them to look at
them, and kill them all at once. No controller is enabled: the cgroup only groups processes.

Plain writes to cgroupfs: there is no well-kept Python library for these few files, and the kernel's
interface is stable (Documentation/admin-guide/cgroup-v2.rst).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def mount_point() -> Path | None:
    """Where the cgroup2 hierarchy is mounted (``/sys/fs/cgroup``, or ``.../unified`` on hybrid systems)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == "cgroup2":
                    return Path(fields[1])
    except OSError:
        pass
    return None


def of(pid: int | str = "self") -> str | None:
    """The cgroup2 path of process ``pid`` (``0::/path`` in /proc/PID/cgroup), or None."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


def base() -> Path | None:
    """This process's own cgroup2 folder, under which it may make cgroups of its own (a systemd unit
    needs ``Delegate=yes``), or None without cgroup v2."""
    mount, path = mount_point(), of()
    if mount is None or path is None:
        return None
    folder = mount / path.lstrip("/")
    return folder if (folder / "cgroup.procs").exists() else None


class Cgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, parent: Path, name: str) -> Cgroup:
        path = parent / name
        os.mkdir(path, 0o755)
        return cls(path)

    def procs(self) -> list[int]:
        try:
            return sorted(int(p) for p in (self.path / "cgroup.procs").read_text().split())
        except OSError:
            return []

    def populated(self) -> bool:
        try:
            return "populated 1" in (self.path / "cgroup.events").read_text()
        except OSError:
            return False

    def _wait(self, done: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if done in (self.path / "cgroup.events").read_text():
                    return True
            except OSError:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def freeze(self, timeout: float = 10.0) -> bool:
        """Stop every process in it from running (signals included) until it is thawed or moved out."""
        (self.path / "cgroup.freeze").write_text("1")
        return self._wait("frozen 1", timeout) if self.populated() else True

    def thaw(self) -> None:
        (self.path / "cgroup.freeze").write_text("0")

    def kill(self, timeout: float = 10.0) -> bool:
        """Kill every process in it, and wait until none is left; True if none is."""
        kill_file = self.path / "cgroup.kill"
        if kill_file.exists():  # Linux >= 5.14
            kill_file.write_text("1")
        else:
            for pid in self.procs():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return self._wait("populated 0", timeout)

    def move(self, pids: list[int], target: Path) -> list[int]:
        """Move ``pids`` into the cgroup folder ``target``; those moved."""
        moved = []
        for pid in pids:
            try:
                (target / "cgroup.procs").write_text(str(pid))
                moved.append(pid)
            except OSError:
                continue
        return moved

    def remove(self) -> bool:
        try:
            os.rmdir(self.path)
            return True
        except OSError:
            return False
