"""Inside the kernel: its safe point, where the server has the main thread run a call while a cell is busy
(engine/safepoint.py tells the protocol and when Python runs the handler).

:func:`install` runs as the extension loads (``--ext=jupyter_gpumigrate``, in the main thread), where the
server gave the kernel a safe-point folder. The calls (:data:`CALLS`) are the two that otherwise wait for
the kernel to be idle: the fast path of a GPU move (kernel/stager.py, which keeps the cell here until the
move is over, as it does between cells) and the host stash of a suspend (kernel/hoststash.py: the cell
then waits here, across the dump and the restore, until its buffers are read back, since it would touch
them). Both finish the GPU work already queued before they touch a buffer. An interrupt (SIGINT) that
comes meanwhile is held back and delivered once the cell goes on.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..engine.safepoint import FOLDER_ENV, SIGNAL, read, write_whole
from . import hoststash, stager

_folder: Path | None = None
_serving = False


def _stager(path: str, token: str) -> tuple[dict, bool]:
    return stager.run(path, token, safe_point=True), False


def _host_stash(folder: str, min_total: int) -> tuple[dict, bool]:
    said = json.loads(hoststash.stash(folder, int(min_total)))
    return said, hoststash.away() > 0


#: name -> (function of the request's args returning (reply, whether to wait for a release), whether the
#: server reads a reply (the stager's session is its own answer), whether it may take buffers away)
CALLS: dict[str, tuple[Callable[..., tuple[dict, bool]], bool, bool]] = {
    "stager": (_stager, False, False),
    "hoststash": (_host_stash, True, True),
}


def install(folder: str | None = None) -> bool:
    """Arm the safe point of this process (the main thread only): True if armed. A handler someone else
    set for the signal is left alone (the server then never asks)."""
    global _folder
    folder = folder or os.environ.get(FOLDER_ENV)
    if not folder or threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None, _handler):
        return False
    root = Path(folder)
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        me = os.getpid()
        for stale in ("request", "claimed", "waiting", "release"):  # an earlier process that had this PID
            (root / f"{stale}-{me}.json").unlink(missing_ok=True)
        signal.signal(SIGNAL, _handler)
        write_whole(root / f"armed-{me}.json", {"signal": SIGNAL})
    except OSError:
        return False
    _folder = root
    atexit.register(_disarm, root / f"armed-{me}.json", me)
    return True


def _disarm(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child
        path.unlink(missing_ok=True)


#: Locks of the threading module that the calls take (to list and to start threads) and that are not
#: reentrant (an RLock held by the stopped code is taken again without harm): the main thread may hold one
#: where the signal stops it.
_THREADING_LOCKS = tuple(lock for lock in (getattr(threading, name, None) for name in ("_active_limbo_lock",
                                                                                     "_shutdown_locks_lock"))
                         if lock is not None and callable(getattr(lock, "locked", None)))


def _handler(signum: int, frame: Any) -> None:
    """Claim the request for this process, if one is there, and serve it. Never raises: it runs inside the
    notebook's cell, which must go on as if nothing happened."""
    try:
        _handle()
    except Exception:  # noqa: BLE001  nothing may reach the cell; the server sees no reply and gives up
        pass


def _handle() -> None:
    global _serving
    root, me = _folder, os.getpid()
    if root is None or _serving:
        return  # a signal while serving: the server withdraws that request
    if any(lock.locked() for lock in _THREADING_LOCKS):
        return  # perhaps held by the code stopped here: wait for the server's next signal (it resends)
    claimed = root / f"claimed-{me}.json"
    try:
        os.rename(root / f"request-{me}.json", claimed)
    except OSError:
        return  # withdrawn (it came too late), or nothing asked
    request = read(claimed)
    claimed.unlink(missing_ok=True)
    if request is None:
        return
    _serving = True
    try:
        _serve(root, me, request)
    finally:
        _serving = False


def _serve(root: Path, me: int, request: dict) -> None:
    rid = str(request.get("id", ""))
    name = str(request.get("call", ""))
    call, replies, may_hold = CALLS.get(name, (None, True, False))
    waiting = root / f"waiting-{me}.json"
    hold = False
    try:
        if call is None:
            raise LookupError(f"no call {name!r} at the safe point (another version of jupyter-gpumigrate?)")
        if may_hold:  # said before anything is freed: whatever happens next, the server asks for them back
            write_whole(waiting, {"id": rid, "call": name})
        answer, hold = call(**(request.get("args") or {}))
    except Exception as exc:  # said to the server
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    try:
        if not hold:
            waiting.unlink(missing_ok=True)
        if replies:
            write_whole(root / f"reply-{rid}.json", answer)
    finally:
        if hold:  # even if the answer could not be written: the buffers are away, the cell cannot go on
            try:
                _wait_for_release(root, me, rid)
            finally:
                waiting.unlink(missing_ok=True)


def _wait_for_release(root: Path, me: int, rid: str) -> None:
    """Wait here (the cell stays where it is) until the server says to take the buffers back (a release for
    this wait, ``rid``: one left from an earlier wait is dropped), and they are."""
    release = root / f"release-{me}.json"
    with hoststash.no_interrupt():
        while True:
            order = read(release)
            if order is None:
                time.sleep(0.01)
                continue
            release.unlink(missing_ok=True)
            if order.get("for") != rid:
                continue
            try:
                answer = json.loads(hoststash.take_back(**(order.get("args") or {})))
            except Exception as exc:  # said to the server; it asks again or kills this process
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                write_whole(root / f"reply-{order.get('id', '')}.json", answer)
            except OSError:
                pass  # the server sees no answer; if the buffers are back, the cell goes on all the same
            if not hoststash.away():
                return
