"""Inside the kernel: its safe point, where the server has the main thread run a call while a cell is busy
(engine/safepoint.py tells the protocol and when Python runs the handler).

:func:`install` runs as the extension loads (``--ext=jupyter_gpumigrate``, in the main thread), where the
server gave the kernel a safe-point folder. The calls (:data:`CALLS`) are the two that otherwise wait for
the kernel to be idle: the fast path of a GPU move (kernel/stager.py, which keeps the cell here until the
move is over, as it does between cells) and the host stash of a suspend (kernel/hoststash.py: the cell
then waits here, across the dump and the restore, until its buffers are read back, since it would touch
them). Both finish the GPU work already queued before they touch a buffer. An interrupt that comes while
the cell's buffers are away (SIGINT, or another handler's exception: a time limit's alarm) is held and
raised in the cell once they are back.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread as futures_thread
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


def _host_stash(folder: str, min_total: int, at: dict | None = None, gpu_only: bool = False) -> tuple[dict, bool]:
    said = json.loads(hoststash.stash(folder, int(min_total), safe_point=at, gpu_only=bool(gpu_only)))
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
    root = Path(folder)
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        me = os.getpid()
        for stale in ("request", "claimed", "waiting", "release"):  # an earlier process that had this PID
            (root / f"{stale}-{me}.json").unlink(missing_ok=True)
        if signal.getsignal(SIGNAL) not in (signal.SIG_DFL, None, _handler):
            return False
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


#: Locks that the calls take (to list and to start threads, to submit to a pool) and that are not reentrant
#: (an RLock held by the stopped code is taken again without harm): the main thread may hold one where the
#: signal stops it.
_THREADING_LOCKS = tuple(lock for lock in (getattr(threading, "_active_limbo_lock", None),
                                           getattr(threading, "_shutdown_locks_lock", None),
                                           getattr(futures_thread, "_global_shutdown_lock", None))
                         if lock is not None and callable(getattr(lock, "locked", None)))


def _handler(signum: int, frame: Any) -> None:
    """Claim the request for this process, if one is there, and serve it. Raises nothing into the notebook's
    cell but an interrupt (or another handler's exception) that came while it served, and only once no
    buffer of the cell is away."""
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
        deferred = _serve(root, me, request)
    finally:
        _serving = False
    if deferred is not None:
        raise deferred  # the buffers are back: the cell gets its interrupt now


def _serve(root: Path, me: int, request: dict) -> BaseException | None:
    """Serve one request; an interrupt (KeyboardInterrupt, another handler's exception) that came meanwhile
    is returned, to be raised once the cell can take it."""
    rid = str(request.get("id", ""))
    name = str(request.get("call", ""))
    call, replies, may_hold = CALLS.get(name, (None, True, False))
    waiting = root / f"waiting-{me}.json"
    deferred: BaseException | None = None
    try:
        if call is None:
            raise LookupError(f"no call {name!r} at the safe point (another version of jupyter-gpumigrate?)")
        if may_hold:  # said before anything is freed: whatever happens next, the server asks for them back
            write_whole(waiting, {"id": rid, "call": name})
            args = {**(request.get("args") or {}), "at": {"folder": str(root), "pid": me, "id": rid}}
        else:
            args = request.get("args") or {}
        answer, _ = call(**args)
    except BaseException as exc:  # said to the server; an interrupt is held until the buffers are back
        answer = {"error": f"{type(exc).__name__}: {exc}"}
        if not isinstance(exc, Exception):
            deferred = exc
    # However the call ended: while any buffer is away, the cell cannot go on.
    hold = may_hold and hoststash.away() > 0
    try:
        if not hold:
            waiting.unlink(missing_ok=True)
        if replies:
            write_whole(root / f"reply-{rid}.json", answer)
    except BaseException as exc:  # the answer could not be written (a full disk), or an interrupt came
        if not isinstance(exc, Exception):
            deferred = deferred or exc
    if hold:
        deferred = _wait_for_release(root, me, rid) or deferred
        waiting.unlink(missing_ok=True)
    return deferred


def _wait_for_release(root: Path, me: int, rid: str) -> BaseException | None:
    """Wait here (the cell stays where it is) until the server says to take the buffers back (a release for
    this wait, ``rid``: one left from an earlier wait is dropped), and they are. Nothing ends the wait
    before: an interrupt that comes (SIGINT reaches Python's handler even blocked in this thread, if another
    thread took it) is returned, for the cell once the buffers are back."""
    release = root / f"release-{me}.json"
    deferred: BaseException | None = None
    while True:
        try:
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
                    except BaseException as exc:  # said to the server; it asks again or kills this process
                        answer = {"error": f"{type(exc).__name__}: {exc}"}
                        if not isinstance(exc, Exception):
                            deferred = deferred or exc
                    try:
                        write_whole(root / f"reply-{order.get('id', '')}.json", answer)
                    except OSError:
                        pass  # the server sees no answer; if the buffers are back, the cell goes on all the same
                    if not hoststash.away():
                        return deferred
        except BaseException as exc:  # noqa: BLE001  held for the cell; the buffers come first
            deferred = deferred or exc
            if not hoststash.away():
                return deferred
