"""A safe point in a busy kernel: its main thread runs one of this package's calls between two bytecodes of
the running cell, and the cell then goes on where it left off.

The server writes a request into the kernel's safe-point folder and signals the kernel's main thread
(:data:`SIGNAL`, a real-time signal, sent with tgkill so that no other thread takes it). Python runs the
kernel's handler (kernel/safepoint.py) in the main thread at the next bytecode boundary of the cell, or
inside a blocking call that checks for signals (sleep, a lock, a socket or pipe wait), exactly where Ctrl-C
would raise KeyboardInterrupt. A long call into C (a CUDA synchronize, a big matmul on the CPU) delays it.

The handler lets a signal pass where the main thread may hold a lock that the call needs (the threading
module's own, taken to list or start threads): the server sends it again every :data:`RESEND` seconds.

Claim and withdrawal: the handler claims the request by renaming it; the server withdraws an unclaimed
request by removing it. Only one of the two can succeed, so a request is served or withdrawn, never both;
a signal that comes late finds nothing and the cell goes on untouched.

A call may keep the kernel at its safe point after it replied (the host stash: the cell cannot go on
until its buffers are back): the kernel then waits there for :meth:`SafePoint.release`, across a CRIU
dump and restore, and says so in a ``waiting`` file.

Files in the folder (0700, one per kernel id; a transplant's two processes share it, hence the PIDs),
each written whole (a temporary file, then a rename):
    armed-PID.json        {"signal"}: the process PID has its handler installed (written at start)
    request-PID.json      {"id", "call", "args"}: the server's request      claimed: renamed to claimed-PID.json
    reply-ID.json         the call's result, or {"error": sentence}         the kernel
    waiting-PID.json      {"id", "call"}: PID waits (or may: written        the kernel; removed when it goes on
                          before its call) at its safe point
    release-PID.json      {"id", "for", "args"}: go on (after what args      the server; the kernel replies in
                          say), for the wait "for" (its request's id)       reply-ID.json
    reserve-PID           RESERVE bytes, made (best effort) with each       the server
                          request; given up to make room for the
                          release and its reply
                          where the disk filled meanwhile

The reserve is there because the release matters most when the disk is full: a stash taken at the safe point,
then a CRIU dump that filled the disk, must still give the cell its buffers back.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: The environment variable that gives a kernel its safe-point folder.
FOLDER_ENV = "GPUMIGRATE_SAFE_POINT"
#: SIGRTMIN + 6 under glibc: a real-time signal (queued, never merged) that no library we know uses. The
#: kernel says which one it armed (``armed-PID.json``); this is what it arms.
SIGNAL = 40
#: The signal is sent again this often until the request is claimed: a handler that found a lock of the
#: threading module held (perhaps by the code it stopped) lets it pass.
RESEND = 0.1
#: The room kept in the folder for a release and its reply (a few hundred bytes each, a block or two each).
RESERVE = 64 << 10
#: tgkill(2)'s number, to signal the main thread itself (elsewhere the process: Linux prefers its main thread).
_TGKILL = {"x86_64": 234, "aarch64": 131}


def write_whole(path: Path, data: dict) -> None:
    """Write ``data`` as JSON at ``path`` whole: readers see the old file, no file, or all of the new one (a
    write that fails, on a full disk, say, leaves nothing of its own)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8", opener=lambda p, f: os.open(p, f, 0o600)) as out:
            json.dump(data, out)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _caught(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (else the signal's default would end it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def signal_main_thread(pid: int, signum: int) -> None:
    number = _TGKILL.get(platform.machine())
    if number is None:
        os.kill(pid, signum)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(number, pid, pid, signum) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


@dataclass
class Claim:
    """A request the kernel claimed: it is at its safe point, serving it."""

    point: SafePoint
    id: str
    #: seconds from the signal to the claim
    seconds: float
    #: the reply, once read
    answer: dict | None = None

    def reply(self, timeout: float) -> dict:
        """What the call returned (read once, then kept). Raises TimeoutError, ConnectionError (the process
        ended) or RuntimeError (the call raised: its sentence)."""
        if self.answer is None:
            self.answer = self.point.wait_for(self.point.folder / f"reply-{self.id}.json", timeout)
        answer = self.answer
        if "error" in answer:
            raise RuntimeError(str(answer["error"]))
        return answer


class SafePoint:
    """The server's side of the safe points of one kernel process ``pid``, through ``folder``."""

    def __init__(self, folder: str | os.PathLike[str], pid: int, alive: Callable[[], bool] | None = None) -> None:
        self.folder = Path(folder)
        self.pid = pid
        self.alive = alive or (lambda: os.path.exists(f"/proc/{pid}"))
        #: why the last :meth:`call` was not claimed
        self.reason: str | None = None

    def why_not(self) -> str | None:
        """Why this process cannot be asked for a safe point, or None."""
        armed = read(self.folder / f"armed-{self.pid}.json")
        if armed is None:
            return "the kernel has no safe point (started before this version, or not an IPython kernel)"
        if int(armed.get("signal", 0)) != SIGNAL or not _caught(self.pid, SIGNAL):
            return "the kernel's safe point is not armed (its signal handler was replaced)"
        return None

    def _reserve(self) -> None:
        """The reserve (:data:`RESERVE` bytes, real blocks) in the folder, if it is not there whole; those of
        processes that ended (a restart's, a transplant's source) go. Best effort: without it (a disk all but
        full already, a file system that cannot allocate ahead) the call is made all the same, as before there
        was one."""
        for other in self.folder.glob("reserve-*"):
            pid = other.name.removeprefix("reserve-")
            if pid.isdigit() and int(pid) != self.pid and not os.path.exists(f"/proc/{pid}"):
                other.unlink(missing_ok=True)
        path = self.folder / f"reserve-{self.pid}"
        try:
            found = os.lstat(path)
            if stat.S_ISREG(found.st_mode) and found.st_blocks * 512 >= RESERVE:
                return
            path.unlink()  # short, or not a plain file (a link, a pipe): made again
        except FileNotFoundError:
            pass
        except OSError:
            return
        try:
            write = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except OSError:
            return
        try:
            os.posix_fallocate(write, 0, RESERVE)
        except OSError:
            path.unlink(missing_ok=True)
        finally:
            os.close(write)

    def waiting(self) -> dict | None:
        """What this process waits for at its safe point (``{"id", "call"}``), or None."""
        return read(self.folder / f"waiting-{self.pid}.json")

    def call(self, name: str, args: dict, timeout: float) -> Claim | None:
        """Ask the process to run ``name`` (kernel/safepoint.py's CALLS) with ``args`` at its next safe point,
        waiting ``timeout`` seconds for it to get there. None if it did not (the request is withdrawn: it
        will not run), or cannot be asked; :attr:`reason` says why."""
        self.reason = self.why_not()
        if self.reason:
            return None
        request = self.folder / f"request-{self.pid}.json"
        rid = secrets.token_hex(8)
        (self.folder / f"reply-{rid}.json").unlink(missing_ok=True)
        self._reserve()
        try:
            write_whole(request, {"id": rid, "call": name, "args": args})
        except OSError as exc:
            self.reason = f"the request could not be written in {self.folder} ({exc.strerror or exc})"
            return None
        started = time.monotonic()
        try:
            signal_main_thread(self.pid, SIGNAL)
        except OSError as exc:
            request.unlink(missing_ok=True)
            self.reason = f"the kernel could not be signalled ({exc.strerror or exc})"
            return None
        signalled = started
        while time.monotonic() - started < timeout and self.alive():
            if not request.exists():
                return Claim(self, rid, time.monotonic() - started)
            if time.monotonic() - signalled >= RESEND:  # the handler may have let one pass (a lock held)
                signalled = time.monotonic()
                try:
                    signal_main_thread(self.pid, SIGNAL)
                except OSError:
                    pass
            time.sleep(0.005)
        try:
            request.unlink()
        except FileNotFoundError:  # claimed as the time ran out: it runs
            return Claim(self, rid, time.monotonic() - started)
        self.reason = (f"the kernel did not reach a safe point within {timeout:g} s (a long call into C, such as a "
                       "CUDA synchronize, or a blocked data loader)" if self.alive() else "the kernel's process ended")
        return None

    def release(self, args: dict, timeout: float, wait_id: str | None = None, went_on: bool = True) -> dict:
        """Let the process waiting at its safe point (the wait ``wait_id``, by default the one its waiting file
        names) go on, after what ``args`` ask; its reply (raises as :meth:`Claim.reply`). The kernel stays
        there if the reply is an error: ask again. With ``went_on``, a kernel whose call (still under way
        when asked) took nothing away, and so goes on, is not waited for."""
        if wait_id is None:
            wait_id = (self.waiting() or {}).get("id")
        rid = secrets.token_hex(8)
        release = self.folder / f"release-{self.pid}.json"
        try:
            write_whole(release, {"id": rid, "for": wait_id, "args": args})
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            (self.folder / f"reserve-{self.pid}").unlink(missing_ok=True)  # its room is for this
            write_whole(release, {"id": rid, "for": wait_id, "args": args})
        reply = self.folder / f"reply-{rid}.json"
        answer = self.wait_for(reply, timeout, went_on=(lambda: self.waiting() is None) if went_on else None)
        if "error" in answer:
            raise RuntimeError(str(answer["error"]))
        return answer

    def wait_for(self, path: Path, timeout: float, went_on: Callable[[], bool] | None = None) -> dict:
        """The JSON at ``path`` once written (then removed); ``{"unstashed": 0}`` if ``went_on()`` says the
        kernel goes on without writing it."""
        deadline = time.monotonic() + timeout
        while True:
            answer = read(path)
            if answer is not None:
                path.unlink(missing_ok=True)
                return answer
            if went_on is not None and went_on():
                answer = read(path)  # the kernel answers before it goes on: look once more
                path.unlink(missing_ok=True)
                return answer if answer is not None else {"unstashed": 0, "seconds": 0.0}
            if not self.alive():
                raise ConnectionError("the kernel's process ended")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s")
            time.sleep(0.01)
