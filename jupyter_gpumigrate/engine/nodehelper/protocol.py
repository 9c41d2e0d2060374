"""The node helper's wire protocol: what a request and an answer look like, and the limits on both. The
daemon (daemon.py) and the client (client.py) both follow it; this module holds nothing else.

Protocol (version 1), over a SOCK_STREAM Unix socket (default ``/run/jupyter-gpumigrate/helper.sock``,
mode 0666: anyone may ask, the helper decides). One request per connection: one JSON object on one
line (at most 64 KiB, all of it within 10 s), answered by one JSON object on one line, then the
helper closes. At most 32 requests run at once, 2 per user (the daemon's limits).

    {"op": "hello"}                        -> {"ok": true, "version": 1, "uid": U, "images": "ROOT/U",
                                               "memory": "MEMORY/U" or null,
                                               "criu": "4.2.1", "criu_path": "/usr/local/sbin/criu",
                                               "elsewhere": "", "runs": "/sys/fs/cgroup/...",
                                               "runs_by_pid": true}
                                              (makes the caller's images folders if they are missing;
                                              "memory" only from a helper run with --memory-root;
                                              "elsewhere": "" where the caller shares the helper's
                                              mount, network and PID namespaces, else why not, which
                                              refuses its dumps and restores (a dump, also of a tree
                                              outside them; a caller whose namespaces cannot be read
                                              is refused too); absent from older helpers; "runs":
                                              the folder of the helper's cgroups, one per CRIU run,
                                              named gpumigrate-HELPERPID-N-U-OP (OP: check, restore) and
                                              gpumigrate-HELPERPID-N-P-U-dump for a dump of the tree
                                              under P ("runs_by_pid": true; older helpers named dumps
                                              as the others, and said no "runs_by_pid"), which a
                                              caller whose helper went mid-dump reads to wait for its
                                              CRIU; absent from older helpers)
    {"op": "check"}                        -> {"ok": bool, "output": "criu check's last words"}
                                              (criu check --unprivileged, as the caller, lent what a
                                              restore is lent)
    {"op": "dump", "pid": P, "images": REL, "place": "disk" or "memory"}
                                           -> {"ok": true, "seconds": s}   CRIU dumps the tree under P
                                              into ROOT/U/REL (MEMORY/U/REL for "memory", refused
                                              where that tmpfs or the machine has no room for what the
                                              tree holds; "disk" when absent) and kills it; on
                                              failure it runs on
    {"op": "restore", "images": REL, "place": ..., "ids": [PID or TID, ...]}
                                           -> {"ok": true, "pid": P, "seconds": s}   the new root
    any failure                            -> {"ok": false, "code": C, "error": "a sentence"}
        C: "bad-request" (malformed), "refused" (not yours, forged, unsafe), "no-room" (a dump into
        memory that has no room for it: the caller may dump to disk instead; older helpers said
        "refused"), "criu-failed" (then "log": the CRIU log's name in the image folder, for the
        caller to read), "busy", "internal"

REL is a path relative to the caller's images folder: 1 to 4 names of ``[A-Za-z0-9_][A-Za-z0-9._-]*``.
``ids`` (optional) are the tree's PIDs and TIDs, kept free for the restore.
"""

from __future__ import annotations

import json
import re
import socket
import time
from typing import Any

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/jupyter-gpumigrate/helper.sock"
#: a request's line, in bytes, and the seconds all of it may take to arrive
MAX_REQUEST = 64 * 1024
REQUEST_TIMEOUT = 10.0
#: the most PIDs and TIDs a restore's ``ids`` may list
MAX_IDS = 1 << 16
#: REL: at most this many names, each matching NAME
MAX_DEPTH = 4
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")

#: how the helper names a CRIU run's cgroup (:func:`run_name`): CGROUP_PREFIX, its PID and run number, for a dump
#: the PID of the tree's root, the caller's uid, and one of these ops (older helpers' names end with the uid)
CGROUP_PREFIX = "gpumigrate-"
CHECK_RUN, DUMP_RUN, RESTORE_RUN = "check", "dump", "restore"


def run_name(helper: int, run: int, uid: int, op: str, pid: int | None = None) -> str:
    """The name of the cgroup of the helper ``helper``'s CRIU run number ``run`` for ``uid``: ``op``, of the
    tree under ``pid`` for a dump."""
    of = f"{pid}-" if pid is not None else ""
    return f"{CGROUP_PREFIX}{helper}-{run}-{of}{uid}-{op}"


def is_dump_run(name: str, uid: int, pid: int | None = None) -> bool:
    """Whether ``name`` is the cgroup of a dump run for ``uid`` (:func:`run_name`): of the tree under ``pid``, or,
    None, of any tree. A name without the tree's PID (an older helper's, one that ran before this helper was
    upgraded, say) may be any tree's: it counts."""
    parts = name[len(CGROUP_PREFIX):].split("-") if name.startswith(CGROUP_PREFIX) else []
    if len(parts) not in (4, 5) or parts[-2:] != [str(uid), DUMP_RUN]:
        return False
    return pid is None or len(parts) == 4 or parts[-3] == str(pid)


#: the ``code`` of a failed answer
BAD_REQUEST = "bad-request"
REFUSED = "refused"
NO_ROOM = "no-room"
CRIU_FAILED = "criu-failed"
BUSY = "busy"
INTERNAL = "internal"


class Refused(Exception):
    """The request is not the caller's to make: wrong owner, forged or unsafe paths."""

    code = REFUSED


class NoRoom(Refused):
    """A dump into memory that the memory root has no room for."""

    code = NO_ROOM


class BadRequest(Exception):
    """The request is malformed."""

    code = BAD_REQUEST


class RequestTooLarge(BadRequest):
    pass


def encode(message: dict) -> bytes:
    """A request or an answer as it goes on the wire: one line of JSON."""
    return json.dumps(message).encode() + b"\n"


def failure(code: str, error: str, **more: Any) -> dict:
    """A failed answer: ``code`` (one of those above) and a sentence that says what to do."""
    return {"ok": False, "code": code, "error": error, **more}


def read_request(sock: socket.socket, timeout: float = REQUEST_TIMEOUT) -> bytes | None:
    """One line, at most MAX_REQUEST bytes, all of it within ``timeout`` s (else :class:`TimeoutError`);
    None if the caller left before its end."""
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        if len(data) > MAX_REQUEST:
            raise RequestTooLarge(f"requests are at most {MAX_REQUEST} bytes")
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request took more than {timeout:.0f} s to arrive")
        sock.settimeout(left)
        chunk = sock.recv(MAX_REQUEST + 1 - len(data) if len(data) <= MAX_REQUEST else 1)
        if not chunk:
            return None
        data += chunk
    line = data.split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST:
        raise RequestTooLarge(f"requests are at most {MAX_REQUEST} bytes")
    return line
