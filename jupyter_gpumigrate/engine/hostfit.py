"""Can this host take a process tree that runs elsewhere? Asked before anything is dumped.

CRIU restores a tree as it was: every PID and TID with its old number, every listening socket on its
old address and port, every open file at its old path with its old size. On another host any of these
may be missing or taken. The host that would restore the tree checks them all and names each problem,
so that a move that cannot work is refused while the kernel still runs where it is.

The tree's own processes may be what holds its numbers, when both "hosts" share one PID namespace
(two network namespaces on one machine): a holder whose process has the same start time as one of the
tree's is the tree itself, and is gone once it is dumped.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass, field

from . import proctree


@dataclass
class Requirements:
    """What a tree needs of the host that restores it."""

    #: every PID and TID of the tree
    ids: list[int]
    #: process (not thread) -> its start time, to recognise the tree itself on a shared PID namespace
    processes: dict[int, int] = field(default_factory=dict)
    #: (address, port) of every socket that listens
    listens: list[tuple[str, int]] = field(default_factory=list)
    #: path -> size of every regular file it holds open, its executables and its working directories
    files: dict[str, int | None] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Requirements:
        return cls(
            ids=[int(i) for i in data.get("ids", [])],
            processes={int(k): int(v) for k, v in (data.get("processes") or {}).items()},
            listens=[(str(a), int(p)) for a, p in data.get("listens", [])],
            files={str(k): (None if v is None else int(v)) for k, v in (data.get("files") or {}).items()},
        )


def requirements_of(root: int, listens: list[tuple[str, int]]) -> Requirements:
    """The requirements of the live tree under ``root``, which listens on ``listens``."""
    processes = {pid: start for pid in proctree.descendants(root) if (start := proctree.start_time(pid))}
    files: dict[str, int | None] = {}
    for pid in processes:
        for link in ("exe", "cwd"):
            try:
                target = os.readlink(f"/proc/{pid}/{link}")
            except OSError:
                continue
            files[target] = None  # must exist; its size is not what CRIU checks
        for path in _open_regular_files(pid):
            try:
                files[path] = os.stat(path).st_size
            except OSError:
                continue  # deleted while open: CRIU carries such files in the images
    return Requirements(ids=proctree.tree_ids(root), processes=processes, listens=listens, files=files)


def _open_regular_files(pid: int) -> list[str]:
    found = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.endswith(" (deleted)") and not target.startswith("/dev/"):
            try:
                if os.path.isfile(target):
                    found.append(target)
            except OSError:
                continue
    return found


def problems(req: Requirements) -> list[str]:
    """Each reason why this host cannot restore the tree, as a sentence; empty if it can."""
    found: list[str] = []
    for pid in req.ids:
        holder = proctree.info(pid)
        if holder is None or holder.state in ("Z", "X"):
            continue
        if req.processes.get(holder.tgid) == proctree.start_time(holder.tgid):
            continue  # the tree itself, on a PID namespace shared with its host
        found.append(f"PID {pid}, which the kernel uses, is taken here by {holder.describe()}")
        break  # one is enough to refuse; the rest would repeat it
    for address, port in req.listens:
        reason = _cannot_listen(address, port)
        if reason:
            found.append(f"the kernel's port {address}:{port} is not free here ({reason})")
    for path, size in sorted(req.files.items()):
        try:
            st = os.stat(path)
        except OSError:
            found.append(f"{path} does not exist here")
            continue
        if size is not None and st.st_size != size:
            found.append(f"{path} is {st.st_size} bytes here, not {size}")
    return found


def _cannot_listen(address: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
