"""TCP connections into a process's listening sockets, read from /proc.

Why: CRIU restores a kernel's established connections closed (``--tcp-close``); its clients re-dial by
themselves within ZMQ's reconnect interval. Until a client's SUB socket is subscribed again, whatever
the kernel publishes on IOPub is dropped. A resume therefore waits until as many clients are connected
to each listening port as before the dump, so that the first cell after a resume loses no output.
"""

from __future__ import annotations

import os
import time

_LISTEN, _ESTABLISHED = "0A", "01"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _tcp_rows(pid: int) -> list[tuple[str, str, str, str]]:
    """(local address, remote address, state, inode) of every TCP socket in the process's network namespace;
    addresses as /proc writes them (``0100007F:A10D``)."""
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10:
                continue
            rows.append((fields[1], fields[2], fields[3], fields[9]))
    return rows


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def client_counts(pids: list[int], skip_own: bool = False) -> dict[int, int]:
    """For each port the processes listen on: how many established connections it has. With ``skip_own``,
    a connection whose client is one of the processes too is not counted: an ipykernel connects to its own
    shell port, and after a restore it dials itself again, wherever it runs, not through a relay here."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    if not pids:
        return {}
    rows = _tcp_rows(pids[0])
    listening = {_port(local) for local, _, state, inode in rows if state == _LISTEN and inode in inodes}
    own = {(local, remote) for local, remote, state, inode in rows if state == _ESTABLISHED and inode in inodes}
    counts = dict.fromkeys(listening, 0)
    for local, remote, state, inode in rows:
        if state == _ESTABLISHED and _port(local) in listening and inode in inodes:
            if not (skip_own and (remote, local) in own):
                counts[_port(local)] += 1
    return counts


def holds_client_end(pids: list[int], client_port: int, server_port: int) -> bool:
    """Whether one of the processes holds the client end of the established TCP connection from its local
    port ``client_port`` to ``server_port`` (in this process's network namespace)."""
    inodes: set[str] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    return any(state == _ESTABLISHED and inode in inodes and _port(local) == client_port
               and _port(remote) == server_port for local, remote, state, inode in _tcp_rows(os.getpid()))


#: A client that still lives re-dials within this many seconds of the ports being back: ZMQ retries every
#: 0.1 s (its default reconnect interval, which jupyter_client keeps). Counts unchanged for this long mean
#: that the connections still missing were closed meanwhile (a notebook tab closed just before), and will
#: not come: no use waiting for them until the timeout.
SETTLE = 1.0
#: The least of that wait where the ports have listened again for longer already (engine/plans/common.py's
#: adopt_tree): a few reconnect intervals, for a client whose last try was just before.
SETTLE_AFTER = 0.3


def wait_for_clients(pids: list[int], expected: dict[int, int], timeout: float,
                     settle: float = SETTLE, skip_own: bool = False) -> dict[int, int]:
    """Wait until each port has at least its ``expected`` connections again (counted as
    :func:`client_counts` does), or until the counts have not changed for ``settle`` seconds (within
    ``timeout`` in all); return what is missing."""
    started = time.monotonic()
    deadline, last, changed = started + timeout, None, started
    while True:
        counts = client_counts(pids, skip_own)
        now = time.monotonic()
        if counts != last:
            last, changed = counts, now
        missing = {
            port: want - counts.get(port, 0) for port, want in expected.items() if counts.get(port, 0) < want
        }
        if not missing or now >= deadline or now - changed >= settle:
            return missing
        time.sleep(0.01)
