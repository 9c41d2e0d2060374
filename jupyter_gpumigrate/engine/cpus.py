"""How many CPUs this process can use: its affinity, and the CPU quota of its cgroups.

A JupyterHub user's server in a Kubernetes pod with a CPU limit sees every CPU of its node: the limit is a
quota of CPU time (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), not an
affinity, and ``os.cpu_count()`` and ``os.sched_getaffinity`` count the node's. What decides how many files
a move sends at once (peers.STREAMS) and whether its dumps stream (c.GPUMigrateApp.stream_dump 'auto') is
what the server can run on: the fewest of its affinity and every quota from its cgroup up to the root.

Plain reads of /proc and cgroupfs: psutil and the standard library read the affinity only, and no
well-kept library reads the quotas (the files are the kernel's stable interface:
Documentation/admin-guide/cgroup-v2.rst, "cpu"; Documentation/scheduler/sched-bwc.rst for v1).
"""

from __future__ import annotations

import os
from pathlib import Path


def usable(pid: int | str = "self") -> float:
    """The CPUs process ``pid`` can keep busy: its affinity's count, or less where a cgroup's quota says so
    (a quota of 1.5 CPUs is 1.5). At least 1."""
    try:
        count = float(len(os.sched_getaffinity(0 if pid == "self" else int(pid))))
    except OSError:
        count = float(os.cpu_count() or 1)
    return max(1.0, min([count, *(quota for quota in _quotas(pid))]))


def _quotas(pid: int | str) -> list[float]:
    """The CPU quotas (in CPUs) of the cgroups of ``pid``, from its own up to its hierarchy's mount point, in
    each hierarchy that may have one (cgroup v2; v1's with the cpu controller). A container whose mount shows
    only its own cgroup (no cgroup namespace) reads its own quota at the mount point."""
    found = []
    for folder, v2 in _chains(pid):
        top = _mount_above(folder)
        for level in (folder, *folder.parents):
            quota = _v2_quota(level) if v2 else _v1_quota(level)
            if quota is not None:
                found.append(quota)
            if level == top:
                break
    return found


def _chains(pid: int | str) -> list[tuple[Path, bool]]:
    """(the folder of pid's cgroup, whether cgroup v2) for each hierarchy that may hold a CPU quota: v2's, and
    v1's with the cpu controller. A mount's root (/proc/self/mountinfo) may be a cgroup below the hierarchy's
    root (a container without a cgroup namespace sees its own cgroup there): the folder is the cgroup's path
    under it, or the mount point where the path is not under it."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8").splitlines()
        mounts = Path("/proc/self/mountinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return folders(lines, mounts)


def folders(lines: list[str], mounts: list[str]) -> list[tuple[Path, bool]]:
    """:func:`_chains` of a process whose /proc/PID/cgroup holds ``lines``, mounts as /proc/self/mountinfo's."""
    chains = []
    for line in lines:
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = hier == "0" and controllers == ""
        if not v2 and "cpu" not in controllers.split(","):
            continue
        for mount in mounts:
            before, _, after = mount.partition(" - ")
            fields, kind = before.split(), after.split()
            if len(fields) < 5 or len(kind) < 3:
                continue
            if not ((v2 and kind[0] == "cgroup2") or
                    (not v2 and kind[0] == "cgroup" and "cpu" in kind[2].split(","))):
                continue
            root, point = fields[3], Path(fields[4])
            if root == "/":
                below = path
            elif path == root or path.startswith(root + "/"):
                below = path[len(root):]
            else:  # not under what the mount shows: the mount point's own cgroup is the nearest
                below = ""
            chains.append((point / below.lstrip("/"), v2))
            break
    return chains


def _mount_above(folder: Path) -> Path:
    """The mount point at or above ``folder`` (where the walk up ends)."""
    for level in (folder, *folder.parents):
        if os.path.ismount(level):
            return level
    return Path("/")


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text(encoding="utf-8").split()
        return None if quota == "max" or int(quota) <= 0 else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text(encoding="utf-8"))
        period = int((folder / "cpu.cfs_period_us").read_text(encoding="utf-8"))
        return None if quota <= 0 else quota / period
    except (OSError, ValueError, ZeroDivisionError):
        return None
