"""Process-tree helpers over /proc (Linux only).

A restored kernel is not a child of the server (CRIU restores it detached), so ``Popen.poll`` no longer
applies: liveness, descendants and PID holders are read from /proc. psutil would do this too, but it is
not a dependency of Jupyter and a few /proc reads are all that is needed here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    tgid: int
    name: str
    state: str
    ppid: int

    def describe(self) -> str:
        owner = f" (a thread of process {self.tgid})" if self.tgid != self.pid else ""
        if self.state in ("Z", "X"):
            parent = info(self.ppid) if self.ppid else None
            by = f"process {self.ppid} '{parent.name}'" if parent else f"process {self.ppid}"
            return (f"process {self.pid} '{self.name}', which has exited but was not collected by its parent, "
                    f"{by} (where PID 1 collects no exited processes, as in a container started without an "
                    "init, run it with one: docker run --init)")
        return f"process {self.pid} '{self.name}'{owner}"


def info(pid: int) -> ProcessInfo | None:
    """What /proc says of a PID or TID, or None if nothing holds it."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return ProcessInfo(
        pid=pid,
        tgid=int(fields.get("Tgid", pid)),
        name=fields.get("Name", "?").strip(),
        state=fields.get("State", "?").strip()[:1],
        ppid=int(fields.get("PPid", 0)),
    )


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22), or None if it is gone.

    A PID and its start time name one process: a PID reused by another process has another start time.
    """
    # The name (field 2) may hold spaces and parentheses: _stat_fields splits after its last ')'.
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def is_alive(pid: int) -> bool:
    """True if ``pid`` is a process that has not exited (zombies count as exited)."""
    found = info(pid)
    return found is not None and found.state not in ("Z", "X")


def main_thread_running(pid: int, looks: int = 4, apart: float = 0.005) -> bool:
    """Whether the main thread of process ``pid`` is running (state R) at each of ``looks`` looks ``apart``
    seconds apart: busy with work of its own, not waiting for any. One look that finds it waiting (or gone)
    says False at once, so an idle process costs one read of /proc. An idle kernel's main thread waits in its
    event loop (state S)."""
    for look in range(looks):
        found = info(pid)
        if found is None or found.state != "R":
            return False
        if look < looks - 1:
            time.sleep(apart)
    return True


def on_this_network(pid: int) -> bool:
    """Whether process ``pid`` shares this process's network namespace (True where either cannot be read). A
    kernel's process lives in its server's: one of the same PID in another is a peer's copy of the kernel, on
    the same machine (hosts made of network namespaces, as the tests' and the bench's are)."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/ns/net"), os.stat("/proc/self/ns/net")
    except OSError:
        return True
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def memory(pid: int) -> int:
    """Resident bytes of the tree under ``pid`` (0 for what cannot be read)."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for process in descendants(pid):
        try:
            with open(f"/proc/{process}/statm", encoding="ascii") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
    return total


def threads(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except FileNotFoundError:
        return []


def children(pid: int) -> list[int]:
    kids: set[int] = set()
    for tid in threads(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                kids.update(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return sorted(kids)


def descendants(root: int) -> list[int]:
    """``root`` and every process below it, parents before children."""
    order, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        if pid in order or not is_alive(pid):
            continue
        order.append(pid)
        todo.extend(children(pid))
    return order


def tree_ids(root: int) -> list[int]:
    """Every PID and TID of the tree under ``root``: the numbers CRIU will need again on restore."""
    ids: list[int] = []
    for pid in descendants(root):
        ids.extend(threads(pid) or [pid])
    return sorted(set(ids))


def first_holder(ids: list[int], settle: float = 0.0) -> ProcessInfo | None:
    """The first live process or thread that holds one of ``ids``, or None if all are free.

    ``settle``: wait up to that long for holders that are exiting (killed, or zombies) to let go.
    """
    deadline = time.monotonic() + settle
    while True:
        found = [h for pid in ids if (h := info(pid)) is not None]
        live = [h for h in found if h.state not in ("Z", "X")]
        if not settle or len(live) == len(found) or time.monotonic() >= deadline:
            return live[0] if live else (found[0] if found else None)
        for h in found:
            if h.state in ("Z", "X"):
                reap(h.pid)
        time.sleep(0.05)


NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"
#: the kernel hands out PIDs below this only at boot; after pid_max it starts again here
RESERVED_PIDS = 300


def steer_pid_allocation(ids: list[int], margin: int = 64) -> bool:
    """Move the kernel's PID cursor past ``ids`` if the next PIDs handed out would fall among them.

    CRIU restores each process and thread with its old number, so those numbers must stay free until
    it has run; but CRIU itself, its helpers and any thread the server starts meanwhile take the next
    free PIDs. When the next ``margin`` numbers after the cursor hold some of a suspended tree's
    numbers, the cursor moves to the last of them, again until none is ahead. Numbers wrap around
    from pid_max to 300, as the kernel's do: a tree whose threads were born after a wrap-around has
    its numbers on both sides of it. Moving the cursor forward only skips numbers. Needs root, which
    CRIU needs here anyway; True if it moved the cursor.
    """
    if not ids:
        return False
    try:
        with open(NS_LAST_PID, encoding="ascii") as f:
            last = int(f.read())
        with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
            pid_max = int(f.read())
    except (OSError, ValueError):
        return False
    taken = set(ids)

    def ahead(start: int) -> list[int]:
        found, n = [], start
        for _ in range(margin):
            n = n + 1 if n + 1 < pid_max else RESERVED_PIDS
            if n in taken:
                found.append(n)
        return found

    cursor = last
    for _ in range(len(taken) + 1):
        hits = ahead(cursor)
        if not hits:
            break
        cursor = hits[-1]
    if cursor == last:
        return False
    try:
        with open(NS_LAST_PID, "w", encoding="ascii") as f:
            f.write(str(cursor))
    except OSError:
        return False
    return True


def wait_ids_released(ids: list[int], name: str | None = None, timeout: float = 10.0) -> bool:
    """Wait until no process or thread (named ``name``, if given) holds one of ``ids``, not even one that exited
    and waits to be collected (ours are reaped); True if none does in time."""
    deadline = time.monotonic() + timeout
    while True:
        held = [i for i in ids if (found := info(i)) is not None and name in (None, found.name)]
        if not held:
            return True
        if time.monotonic() >= deadline:
            return False
        for i in held:
            reap(i)
        time.sleep(0.02)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (prctl PR_SET_CHILD_SUBREAPER).

    A kernel restored by CRIU is detached from CRIU, and would become a child of PID 1. A later
    suspend of that kernel leaves it a zombie until PID 1 reaps it. PID 1 may be slow, or may be
    this very server in a container, and the zombie keeps its PID taken, so the next resume fails.
    As a subreaper, the server inherits restored kernels and reaps them itself. True if it worked.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def reap_orphans(sessions: set[int], skip: set[int]) -> list[int]:
    """Reap our zombie children that belong to one of ``sessions`` (kernels' sessions) and are not in
    ``skip`` (processes someone else waits for, such as a Popen). Returns the PIDs reaped."""
    me, reaped = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        fields = _stat_fields(int(name))
        # fields: [0] state, [1] ppid, [2] pgrp, [3] session
        if fields and fields[0] == "Z" and int(fields[1]) == me and int(fields[3]) in sessions:
            if reap(int(name)) is not None:
                reaped.append(int(name))
    return reaped


def reap_dumped(ids: list[int], timeout: float = 10.0) -> None:
    """After a dump killed a tree: reap those of its processes that became our children (orphans of the
    tree come to us, the subreaper), so that none of its PIDs stays taken by a zombie. Waits up to
    ``timeout`` for them to die (a live child of ours that holds one of ``ids`` keeps it waiting)."""
    me = os.getpid()
    deadline = time.monotonic() + timeout
    while True:
        ours = [pid for pid in ids if (f := _stat_fields(pid)) and int(f[1]) == me]
        for pid in ours:
            reap(pid)
        if not ours or time.monotonic() >= deadline:
            return
        time.sleep(0.02)


def tick_boundary() -> int:
    """Now, in the unit of :func:`start_time` (clock ticks since boot), once a tick has passed: a process
    started before this call has a start time at most the value returned, one started after it, more."""
    hz = os.sysconf("SC_CLK_TCK")
    now = int(time.clock_gettime(time.CLOCK_BOOTTIME) * hz)
    time.sleep(1.1 / hz)
    return now


def kill_half_restored(ids: list[int], since: int) -> list[int]:
    """After a restore that failed (CRIU killed, say): kill what it had made of the tree and reap it.

    The processes CRIU had forked with the tree's PIDs live on, stuck in its restorer, once CRIU is
    gone; they come to us, the subreaper. They are the processes that hold one of ``ids``, are our
    children, and started after ``since`` (:func:`tick_boundary` before CRIU ran): a process of ours that
    held such a PID before is left alone. Returns the PIDs killed."""
    me = os.getpid()
    roots = [pid for pid in ids if (f := _stat_fields(pid)) and int(f[1]) == me and f[0] not in ("Z", "X")
             and int(f[19]) > since]
    for root in roots:
        kill_tree(root)
    for root in roots:
        wait_gone(root, timeout=10)
    reap_dumped(ids, timeout=0.5)
    return roots


def reap(pid: int) -> int | None:
    """Collect the exit status of a child that has exited; None if it is not our child or still runs."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait until ``pid`` has exited (reaping it if it is our child); True if it did within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        reap(pid)
        found = info(pid)
        # Our own zombie still holds its PID (a restore would find it taken): reap it on the next turn.
        if found is None or (found.state in ("Z", "X") and found.ppid != os.getpid()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def kill_tree(root: int, sig: int = signal.SIGKILL, started: int | None = None) -> bool:
    """Send ``sig`` to every process of the tree, children first. Each is signalled through a pidfd opened
    once its start time was read, and read again then: a PID another process took meanwhile (the one listed
    ended, and was reaped) is never signalled. ``started``: the root's start time when it was adopted; a root
    that is not that process any more is not signalled, nor anything under it. Whether the root was."""
    tree = [(pid, start_time(pid)) for pid in descendants(root)]
    if not tree or (started is not None and tree[0][1] != started):
        return False
    hit = False
    for pid, born in reversed(tree):
        sent = _signal(pid, born, sig)
        if pid == root:
            hit = sent
    return hit


def _signal(pid: int, born: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``born``; whether it was sent."""
    if born is None:
        return False  # gone as it was listed
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfd (Linux before 5.3): the PID and its start time, checked just before
        if start_time(pid) != born:
            return False
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        return True
    try:
        if start_time(pid) != born:  # the fd names whatever held the PID as it was opened: that one, or not
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)

