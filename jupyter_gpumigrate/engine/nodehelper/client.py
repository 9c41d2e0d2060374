"""The node helper's client, used by the user's Jupyter server: :class:`HelperCriu` does what
:class:`~jupyter_gpumigrate.engine.criu.Criu` does, through the helper (protocol.py says what goes over
its socket)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import time
from pathlib import Path

from .. import cgroups, proctree
from .. import criu as criu_mod
from ..errors import CriuFailed, HelperError, HelperGone, for_full
from .protocol import BUSY, CGROUP_PREFIX, CRIU_FAILED, DEFAULT_SOCKET, NO_ROOM, encode, is_dump_run

log = logging.getLogger(__name__)


class HelperClient:
    """Talks to the node helper at ``path``. Each call raises :class:`HelperError` saying what to do."""

    #: no answer of the helper's is near this long
    MAX_REPLY = 1 << 20

    def __init__(self, path: str = DEFAULT_SOCKET) -> None:
        self.path = path

    def request(self, payload: dict, timeout: float = 30.0) -> dict:
        """Send one request; the helper's answer (``ok`` may be false). ``timeout`` bounds each wait. Raises
        :class:`HelperGone` where the helper took the request and went before it answered."""
        data = b""
        sent = False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(self.path)
                sock.sendall(encode(payload))
                sent = True
                while not data.endswith(b"\n") and len(data) < self.MAX_REPLY:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except (ConnectionResetError, BrokenPipeError) as exc:
            if sent:
                raise HelperGone(f"The node helper at {self.path} went before it answered ({exc}; did it restart?): "
                                 "try again; its log says more.") from exc
            raise HelperError(f"The node helper at {self.path} does not answer ({exc}): ask an administrator to "
                              "start it (systemctl start jupyter-gpumigrate-helper; docs/users.md).") from exc
        except OSError as exc:
            raise HelperError(
                f"The node helper at {self.path} does not answer ({exc}): ask an administrator to start it "
                "(systemctl start jupyter-gpumigrate-helper; docs/users.md)."
            ) from exc
        if not data:
            raise HelperGone(f"The node helper at {self.path} closed the connection without an answer (did it "
                             "restart?): try again; its log says more.")
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise HelperError(f"The node helper at {self.path} answered nothing readable: see its log.")
        return reply


def dumping(pid: int) -> list[int]:
    """The processes (of this user: /proc shows their command lines) whose arguments dump the tree of ``pid``:
    a CRIU the helper started (``dump --tree PID``), or the shell that becomes it."""
    wanted = f"dump\0--tree\0{pid}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if wanted in f.read() + b"\0":
                    found.append(int(entry))
        except OSError:
            continue
    return found


#: seconds without a CRIU seen on the tree after which a CRIU whose helper went is taken to have ended
QUIET = 2.0


def traced(pid: int) -> bool:
    """Whether process ``pid`` is seized by a tracer now (a CRIU dumping it)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            return any(line.startswith("TracerPid:") and line.split()[1] != "0" for line in f)
    except (OSError, IndexError):
        return False


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is seen stopped (state T): a CRIU stopped holds the tree only where it seized it,
    which :func:`traced` says. Not where /proc hides it."""
    found = proctree.info(pid)
    return found is not None and found.state == "T"


def _is_criu(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip() == "criu"
    except OSError:
        return False


def _kill(pids: list[int], why: str) -> None:
    """SIGKILL ``pids`` (this user's own CRIU runs), saying so in the server's log."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            log.warning("killed process %d: %s", pid, why)
        except OSError:
            pass


class HelperCriu:
    """CRIU through the node helper: what :class:`~jupyter_gpumigrate.engine.criu.Criu` does, for a server
    run by an ordinary user.

    Image folders must lie in the folder the helper made for this user (``images_root``)."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 3600.0, hello_timeout: float = 10.0) -> None:
        self.client = HelperClient(path)
        self.timeout = timeout
        hello = self.client.request({"op": "hello"}, timeout=hello_timeout)
        if not hello.get("ok"):
            raise HelperError(f"The node helper at {path} refused: {hello.get('error')}")
        self.images_root = Path(hello["images"])
        #: the folder the helper made for this user in memory (a tmpfs), or None: it writes only to disk
        self.memory_root = Path(hello["memory"]) if hello.get("memory") else None
        version = criu_mod.parse_version(f"Version: {hello.get('criu', '0.0')}") or (0, 0)
        self.binary = criu_mod.CriuBinary(f"{hello.get('criu_path')} (through the node helper at {path})", version)
        #: why this server is not in the helper's namespaces (its dumps and restores are refused), "" where it
        #: is, None where the helper does not say (an older one)
        self.elsewhere: str | None = hello.get("elsewhere")
        #: the folder of the helper's cgroups, one per CRIU run (None: an older helper, which does not say)
        self.runs = Path(hello["runs"]) if isinstance(hello.get("runs"), str) else None
        #: whether the helper names each dump's cgroup by the PID of the tree it dumps (older ones do not)
        self.runs_by_pid = hello.get("runs_by_pid") is True
        #: this user, as the helper knows them (its cgroups are named by it)
        self.uid = hello["uid"] if isinstance(hello.get("uid"), int) else os.getuid()

    def _relative(self, images_dir: Path) -> dict:
        """Where ``images_dir`` is, as a request says it: its path under one of this user's images folders
        (``images``), and which (``place``)."""
        for root, place in ((self.images_root, {}), (self.memory_root, {"place": "memory"})):  # disk: as before
            if root is not None and Path(images_dir).is_relative_to(root):
                return {"images": str(Path(images_dir).relative_to(root)), **place}
        roots = " or ".join(str(r) for r in (self.images_root, self.memory_root) if r is not None)
        raise HelperError(f"{images_dir} is outside {roots}, the only images folders the node helper writes for you.")

    def _failed(self, reply: dict, log_path: Path, what: str) -> CriuFailed | HelperError:
        if reply.get("code") == CRIU_FAILED:
            return criu_mod.failure(log_path, reply.get("detail", ""), what)  # detail: where the log says nothing
        if reply.get("code") == BUSY:
            return HelperError(f"The node helper could not {what} now: {reply.get('error')}.")
        return HelperError(f"The node helper refused to {what}: {reply.get('error')}.")

    def dump(self, pid: int, images_dir: Path, *, log_path: Path | None = None) -> None:
        written = Path(images_dir) / criu_mod.DUMP_LOG
        try:
            reply = self.client.request({"op": "dump", "pid": pid, **self._relative(images_dir)}, self.timeout)
        except HelperGone as exc:
            # The helper went (restarted, killed) while its CRIU dumped: that CRIU runs on without it, and
            # kills the tree once its images are written. What it does decides, not the helper's going.
            reply = self._outlived_helper(pid, written, exc)
        if not reply.get("ok"):
            if log_path is not None and written.exists():
                shutil.move(written, log_path)  # the rollback deletes the images, not the log (images in memory:
                # another file system)
            failed = self._failed(reply, log_path or written, f"dump process {pid}")
            if reply.get("code") == NO_ROOM:  # no room in memory: said as a full memory (errors.no_room)
                for_full(failed, Path(images_dir).parent)
            raise failed

    def _outlived_helper(self, pid: int, log_file: Path, gone: HelperGone) -> dict:
        """The answer the helper that went would have given about the dump of ``pid``, from what its CRIU does
        without it: wait while that CRIU runs, then read its log ``log_file``.

        What runs: the processes in this user's dump cgroups of the helper's (:meth:`dump_runs`: whatever /proc
        hides), or, from an older helper that does not say where those are, the processes whose arguments
        name the dump; and the kernel's tracer (a CRIU holding the tree seized). A process seen stopped (state
        T) is not waited for: as it starts, a CRIU forks a child that stops itself until CRIU has looked at
        it, and CRIU gone, that child waits stopped for good. One whose state /proc hides (hidepid: CRIU runs
        with capabilities its user lacks) is waited for. Once quiet, the stopped CRIUs left are killed (the
        user's own processes: theirs to signal); at this client's timeout, every process of that dump in the
        helper's cgroups (the tree then runs on, as when the helper kills a run at its own timeout)."""
        deadline = time.monotonic() + self.timeout
        quiet_since = None
        while time.monotonic() < deadline:
            if self.busy(pid):
                quiet_since = None
            elif quiet_since is None:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > QUIET:  # a CRIU about to seize the tree has had its time
                break
            time.sleep(0.1)
        else:  # by the PIDs in the helper's cgroups, which no user can put a process in (/proc may hide them)
            runs = self.dump_runs(pid) if self.runs is not None else [r for r in dumping(pid) if _is_criu(r)]
            _kill(runs, "its CRIU timeout passed while it dumped")
        _kill([run for run in self.dump_runs(pid) if _stopped(run) and _is_criu(run)],
              "a CRIU stopped, its helper gone")
        give_up = time.monotonic() + 10
        while self.busy(pid) and time.monotonic() < give_up:
            time.sleep(0.1)
        if not log_file.exists():
            raise HelperGone(f"{gone} No log of its CRIU was found: the kernel runs on, unchanged.") from gone
        if criu_mod.dump_finished(log_file) and not proctree.is_alive(pid):  # images written, the tree killed
            return {"ok": True}
        # Ended unfinished: CRIU resumes the tree, as on any failed dump (common.dump says whether it lives).
        return {"ok": False, "code": CRIU_FAILED, "detail": f"the node helper went during the dump ({gone})"}

    def dump_runs(self, pid: int) -> list[int]:
        """The processes of the helper's dump of ``pid`` for this user (in its cgroup named by the tree's PID,
        the caller's uid and the op, which no user can move a process into); from an older helper, which does
        not name the tree, those of all this user's dumps (another server's of the same user's too), and so
        for the cgroups such a helper left (upgraded mid-dump); where it does not say where its cgroups are,
        the processes whose arguments name the dump of ``pid``."""
        if self.runs is None:
            return dumping(pid)
        found: list[int] = []
        for run in self.runs.glob(f"{CGROUP_PREFIX}*"):
            if is_dump_run(run.name, self.uid, pid if self.runs_by_pid else None):
                found += cgroups.Cgroup(run).procs()
        return found

    def busy(self, pid: int) -> list[int]:
        """What still runs of a dump of ``pid`` by the helper: its CRIU's processes but those seen stopped (see
        :meth:`_outlived_helper`), and ``pid`` itself while a tracer holds it seized."""
        return [run for run in self.dump_runs(pid) if not _stopped(run)] + ([pid] if traced(pid) else [])

    def restore(self, images_dir: Path, ids: list[int] | None = None) -> int:
        reply = self.client.request({"op": "restore", **self._relative(images_dir), "ids": ids or []}, self.timeout)
        if reply.get("ok"):
            return int(reply["pid"])
        error = self._failed(reply, Path(images_dir) / criu_mod.RESTORE_LOG, "restore the process")
        if isinstance(error, CriuFailed):
            raise criu_mod.Criu.explain_restore_failure(error, ids or []) from None
        raise error

    def check(self) -> tuple[bool, str]:
        reply = self.client.request({"op": "check"}, timeout=90)
        return bool(reply.get("ok")), str(reply.get("output") or reply.get("error") or "")

