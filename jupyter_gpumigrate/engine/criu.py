"""The CRIU driver: dump a process tree into an image directory and restore it from there.

We drive the ``criu`` binary rather than its RPC library (pycriu): the binary is what users install and
what ``criu check`` validates, its options are stable, and each run leaves a log next to the images.

Options, as measured (docs/internals.md, "The options we pass"):
- ``--tcp-close``: the kernel's ZMQ connections to the server are TCP; restoring them established
  needs CRIU's network lock (iptables), so they are restored closed and ZMQ re-dials by itself.
- ``--ext-unix-sk``: unix sockets whose peer is outside the tree (syslog, a desktop bus...).
- ``--file-locks``: kernels that hold flock/fcntl locks (sqlite, h5py...).
- dump with ``--skip-in-flight``: a client that dials one of the kernel's listening sockets while CRIU holds
  the tree frozen (a ZMQ client re-dialling, a browser at a server the notebook started) sits in that
  socket's accept queue, and without it CRIU refuses the whole dump ("In-flight connection"). With it the
  connection is left out: the client gets a reset once the dumped tree is gone, and dials again.
- restore with ``-d``: CRIU detaches, the tree is re-parented away from the caller.
- ``--unprivileged`` when the server is not root: CRIU then runs on the capabilities its binary was
  given (``setcap``, docs/users.md). A server that uses the node helper goes through
  :class:`~.nodehelper.HelperCriu` instead, which has the same methods.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from . import proctree
from .errors import CriuFailed, CriuNotFound, PidConflict

MIN_VERSION = (4, 2)
COMMON_OPTIONS = ("--tcp-close", "--ext-unix-sk", "--file-locks")
DUMP_OPTIONS = ("--skip-in-flight",)
DUMP_LOG = "dump.log"
RESTORE_LOG = "restore.log"
RESTORE_PIDFILE = "restore.pid"

#: Printed on every run on these machines and harmless (docs/internals.md, "Which version").
_HARMLESS = ("Can't setup RLIMIT_NOFILE",)
#: ``(00.123456) Error (file:line): text``; a task's lines add ``PID: `` before ``Error``, and the
#: restorer blob's (criu/pie/, where threads are created) add ``pie: TID: ``.
_ERROR_LINE = re.compile(r"^(?:\(\s*[\d.]+\)\s+)?(?:pie:\s+)?(?:\d+:\s+)?Error \(([^)]*)\):\s*(.*)$")
#: CRIU's closing words: true of every failure, so never the one to show first.
_GENERIC = ("Restoring FAILED", "Killing processes because of failure", "The Network was unlocked")

INSTALL_HINT = (
    "Install CRIU >= 4.2: run `sudo jupyter gpumigrate install-criu` (scripts/ensure-criu.sh of the source "
    "tree: it builds CRIU from Debian's source package), or point the provisioner at a binary with "
    "c.MigratableProvisioner.criu_path."
)


#: The capabilities CRIU needs as an ordinary user: to dump (the first) and to restore (both; SETPCAP
#: where the bounding set is not full, as in VMs and containers). Bit numbers of capabilities(7).
NEEDED_CAPS = {"cap_checkpoint_restore": 40, "cap_setpcap": 8}
SETCAP_HINT = "setcap cap_checkpoint_restore,cap_setpcap+eip {path}"


def file_capabilities(path: str) -> set[str]:
    """Which of :data:`NEEDED_CAPS` the file ``path`` is given as permitted and effective (its
    ``security.capability`` attribute; read here rather than through libcap, which is not a Python
    dependency, for two bits of a fixed layout)."""
    try:
        raw = os.getxattr(path, "security.capability")
    except OSError:
        return set()
    if len(raw) < 12:
        return set()
    magic, permitted_lo = struct.unpack_from("<II", raw)
    permitted_hi = struct.unpack_from("<I", raw, 12)[0] if len(raw) >= 16 else 0
    permitted = permitted_lo | permitted_hi << 32
    effective = magic & 1  # VFS_CAP_FLAGS_EFFECTIVE
    return {name for name, bit in NEEDED_CAPS.items() if effective and permitted >> bit & 1}


def failure(log_path: Path, output: str, what: str, returncode: int = 1) -> CriuFailed:
    """The error of a CRIU run that failed: its first telling ``Error`` line, and where the log is; a
    CRIU killed by a signal is said to be so (it logged no error of its own)."""
    if returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
        killed = f"CRIU was killed by {name} before it could {what}"
        return CriuFailed(f"{killed}. Full log: {log_path}", str(log_path), "\n".join(error_lines(log_path)[-10:]))
    errors = error_lines(log_path) or [output.strip() or "no error logged"]
    cause = next((e for e in errors if not e.startswith(_GENERIC)), errors[0])
    return CriuFailed(f"CRIU could not {what}: {cause}. Full log: {log_path}", str(log_path), "\n".join(errors[-10:]))


#: The CRIU runs of this process in flight, by their images folder: a server that must stop now stops the
#: runs of the operations it gives up on, and those alone (:func:`stop_runs`).
_RUNS: dict[str, subprocess.Popen] = {}
#: Images folders whose operations were given up: no CRIU run starts on them any more.
_CANCELLED: set[str] = set()
PR_SET_PDEATHSIG = 1
#: Looked up once, here: the child between fork and exec only calls it (no dlopen there, where another
#: thread of the server may have held the loader's lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_RUNS_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """In CRIU's process, before it starts: SIGKILL it if the server dies. A dump then stops and gives the
    kernel back, running (its record lets the next server adopt it), instead of killing it into images that
    no manifest completes; a restore stops half-way, and the next server kills what it made and takes the
    kernel back from its images (revive.py)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


#: What CRIU's dump logs once every image is written: its last line; and, before it, the line where it
#: turns to killing the tree (the final state TASK_DEAD, 2), chosen only for a dump that succeeded, after
#: its inventory and the flush of its images (criu/cr-dump.c, cr_dump_finish). A CRIU killed in between
#: (its server SIGKILLed: CRIU dies with it) logs the second alone, the tree dead or dying.
DUMP_DONE = (b"Dumping finished successfully", b"Unfreezing tasks into 2\n")


def dump_finished(log_path: Path) -> bool:
    """Whether the CRIU dump that logged to ``log_path`` wrote all its images (and so kills the tree), even
    if CRIU itself was killed just after. (Whether the tree is gone is for the caller to check: a CRIU
    killed as it began to kill the tree may have let some of it go.)"""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (256 << 10)))  # the unseizing of each task follows the second
            tail = f.read()
    except OSError:
        return False
    return any(line in tail for line in DUMP_DONE)


def never_seized(log_path: Path, pid: int) -> bool:
    """Whether the CRIU dump that logged to ``log_path`` could not take hold of ``pid`` (the tree's root) as it
    began, so that it dumped nothing of it: compel's "Unable to interrupt task: PID (No such process)", or
    "(Operation not permitted)" for a zombie (docs/internals.md)."""
    try:
        with open(log_path, "rb") as f:
            head = f.read(256 << 10)  # the seizing of the root comes early, before any image is written
    except OSError:
        return False
    return f"Unable to interrupt task: {pid} (".encode() in head


def given_up(images_dir: Path) -> bool:
    """Whether the operations on ``images_dir`` were given up (:func:`stop_runs`): a server stopping."""
    with _RUNS_LOCK:
        return str(Path(images_dir).resolve()) in _CANCELLED


def stop_runs(images_dirs: list[Path]) -> int:
    """SIGKILL the CRIU runs of this process that work on ``images_dirs``; how many there were. A dump
    stopped so gives its kernel back (CRIU releases the tree), and its plan rolls back."""
    wanted = {str(Path(d).resolve()) for d in images_dirs}
    with _RUNS_LOCK:
        _CANCELLED.update(wanted)  # and none starts there from now on
        runs = [proc for key, proc in _RUNS.items() if key in wanted]
    for proc in runs:
        proc.kill()
    return len(runs)


@dataclass(frozen=True)
class CriuBinary:
    path: str
    version: tuple[int, ...]

    @property
    def version_string(self) -> str:
        return ".".join(map(str, self.version))


def parse_version(text: str) -> tuple[int, ...] | None:
    match = re.search(r"Version:\s*(\d+(?:\.\d+)+)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else None


def locate(path: str | None = None) -> str | None:
    """The CRIU binary to use: ``path`` if given, else /usr/local/sbin/criu (where our build goes), else PATH."""
    if path:
        return path if os.path.isfile(path) and os.access(path, os.X_OK) else None
    if os.access("/usr/local/sbin/criu", os.X_OK):
        return "/usr/local/sbin/criu"
    return shutil.which("criu")


def find(path: str | None = None) -> CriuBinary:
    """A CRIU binary of version >= 4.2, or :class:`CriuNotFound` saying what to install."""
    found = locate(path)
    if found is None:
        where = f"at {path}" if path else "on PATH or in /usr/local/sbin"
        raise CriuNotFound(f"CRIU was not found {where}. {INSTALL_HINT}")
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CriuNotFound(f"CRIU at {found} does not run ({exc}). {INSTALL_HINT}") from exc
    version = parse_version(out.stdout + out.stderr)
    if version is None:
        raise CriuNotFound(f"CRIU at {found} did not report its version. {INSTALL_HINT}")
    if version[:2] < MIN_VERSION:
        raise CriuNotFound(
            f"CRIU at {found} is version {'.'.join(map(str, version))}; 4.2 or newer is needed "
            f"(older releases cannot dump TCP sockets on Linux >= 6.16). {INSTALL_HINT}"
        )
    return CriuBinary(found, version)


def error_lines(log_path: Path) -> list[str]:
    """The ``Error (...)`` lines of a CRIU log, without the harmless ones."""
    try:
        text = log_path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    lines = []
    for line in text.splitlines():
        match = _ERROR_LINE.match(line.strip())
        if match and not any(h in match.group(2) for h in _HARMLESS):
            lines.append(f"{match.group(2)} ({match.group(1)})")
    return lines


class Criu:
    """Runs CRIU commands. ``binary`` is a path, or None to look for one. ``unprivileged`` (default:
    unless root) runs CRIU in its ``--unprivileged`` mode, on its file capabilities."""

    def __init__(self, binary: str | None = None, timeout: float = 3600.0, unprivileged: bool | None = None) -> None:
        self.binary = find(binary)
        self.timeout = timeout
        self.unprivileged = os.geteuid() != 0 if unprivileged is None else unprivileged

    def _mode(self) -> list[str]:
        return ["--unprivileged"] if self.unprivileged else []

    def _run(self, args: list[str], images_dir: Path, log_path: Path, what: str, enter: list[str] | None = None
             ) -> None:
        # ``enter`` ends with the CRIU binary to run there, where given
        cmd = [*(enter or [self.binary.path]), *args, *self._mode(), "--images-dir", str(images_dir),
               "--log-file", str(log_path), "-v4"]
        key = str(Path(images_dir).resolve())
        # What CRIU prints goes to a file, not a pipe: a child it started (a plugin's helper) that outlives a
        # CRIU killed mid-run would hold a pipe open, and the move would wait for its end, not CRIU's.
        with tempfile.TemporaryFile(mode="w+", prefix="gpumigrate-criu-") as said:
            with _RUNS_LOCK:
                if key in _CANCELLED:
                    raise CriuFailed(f"CRIU did not {what}: the server is stopping, and gave this operation up.",
                                     str(log_path))
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=said, stderr=subprocess.STDOUT,
                                        text=True, preexec_fn=_die_with_parent)
                _RUNS[key] = proc
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired as exc:
                proc.kill()
                proc.wait()
                raise CriuFailed(
                    f"CRIU {what} did not finish within {self.timeout:.0f} s; see {log_path}.",
                    str(log_path),
                ) from exc
            finally:
                with _RUNS_LOCK:
                    if _RUNS.get(key) is proc:
                        del _RUNS[key]
            if proc.returncode != 0:
                said.seek(0)
                raise failure(log_path, said.read()[-20000:], what, proc.returncode)

    def check(self) -> tuple[bool, str]:
        """Run ``criu check``: (passed, what it printed)."""
        proc = subprocess.run(
            [self.binary.path, "check", *self._mode()], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
        )
        out = "\n".join(
            line for line in (proc.stdout + proc.stderr).splitlines() if not any(h in line for h in _HARMLESS)
        ).strip()
        return proc.returncode == 0, out

    def dump(self, pid: int, images_dir: Path, *, log_path: Path | None = None) -> None:
        """Dump the tree rooted at ``pid``; the tree is killed once dumped.

        On failure CRIU resumes the tree: it keeps running as before.
        """
        args = ["dump", "--tree", str(pid), *COMMON_OPTIONS, *DUMP_OPTIONS]
        log_path = log_path or images_dir / DUMP_LOG
        enter = self._mount_namespace_of(pid, [images_dir, log_path.parent, Path(self.binary.path)])
        if enter:  # there, CRIU starts at that namespace's root: the paths checked, whole
            images_dir, log_path = Path(images_dir).resolve(), Path(log_path).resolve()
            enter = [*enter, str(Path(self.binary.path).resolve())]
        self._run(args, images_dir, log_path, f"dump process {pid}", enter=enter)

    def _mount_namespace_of(self, pid: int, paths: list[Path]) -> list[str]:
        """Where the tree lives in another mount namespace than this process: the command that runs CRIU in
        the tree's (``nsenter``, as root only). A kernel that an earlier server restored, and that this server
        took back, lives in that server's mount namespace if the two started in different ones (``ip netns
        exec``, a service's private /tmp): CRIU run from here would dump that namespace's mounts too, and
        refuses one whose sharing it cannot follow. Run in it, CRIU must find there the same ``paths`` as here
        (the images' folder, the log's, CRIU itself): where one is another file there, or missing, or nsenter
        is, the dump is refused before CRIU runs, and the tree runs on."""
        if self.unprivileged:
            return []
        try:
            theirs, ours = os.stat(f"/proc/{pid}/ns/mnt"), os.stat("/proc/self/ns/mnt")
        except OSError:
            return []
        if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
            return []
        why = "nsenter, which runs CRIU in its namespace, is not installed here" if shutil.which("nsenter") is None \
            else ""
        for path in paths if not why else []:
            try:
                there, here = os.stat(f"/proc/{pid}/root{path.resolve()}"), os.stat(path)
            except OSError:
                why = f"{path} is not there"
                break
            if (there.st_dev, there.st_ino) != (here.st_dev, here.st_ino):
                why = f"{path} there is not this server's"
                break
        if why:
            raise CriuFailed(f"Process {pid} lives in another mount namespace than this server (an earlier server "
                             f"restored it, and ran in a namespace of its own), and {why}: CRIU cannot dump it "
                             "from here. It runs on, unchanged; start the server in the same mount namespace as "
                             "the one before it (the same service settings), or end the kernel.")
        return [str(shutil.which("nsenter")), f"--mount=/proc/{pid}/ns/mnt", "--"]

    def restore(self, images_dir: Path, ids: list[int] | None = None) -> int:
        """Restore the tree from ``images_dir``, detached; returns the PID of its root.

        ``ids``, the tree's PIDs and TIDs, keeps CRIU's own process from being born with one of them.
        """
        pidfile = images_dir / RESTORE_PIDFILE
        pidfile.unlink(missing_ok=True)
        if ids:
            proctree.steer_pid_allocation(ids)
        started = proctree.tick_boundary()
        try:
            self._run(
                ["restore", "--restore-detached", "--pidfile", RESTORE_PIDFILE, *COMMON_OPTIONS],
                images_dir,
                images_dir / RESTORE_LOG,
                "restore the process",
            )
        except CriuFailed as exc:
            if ids:
                # A CRIU killed halfway leaves the tasks it had forked alive, stuck in its restorer, and
                # ours (the subreaper): kill them, so that the retry finds the tree's PIDs free.
                proctree.kill_half_restored(ids, since=started)
                # The tasks CRIU had forked with the tree's PIDs are still dying: let them go, so
                # that a retry does not find its own PIDs taken by 'criu'.
                proctree.wait_ids_released(ids, name="criu", timeout=10)
                # Those it had made and then killed come to us, the subreaper: collect them, or their
                # zombies keep the tree's PIDs taken.
                proctree.reap_dumped(ids, timeout=0.5)
            raise self.explain_restore_failure(exc, ids or []) from exc
        return int(pidfile.read_text().strip())

    @staticmethod
    def explain_restore_failure(exc: CriuFailed, ids: list[int]) -> CriuFailed | PidConflict:
        text = exc.log_tail
        pid_match = re.search(r"Can't fork for (\d+)", text) or re.search(r"PID (\d+).*File exists", text)
        # A thread whose TID is taken: the restorer says only "Unable to create a thread: -17" (EEXIST).
        thread_taken = re.search(r"Unable to create a thread: -17\b", text)
        if pid_match or thread_taken or "File exists" in text and "fork" in text:
            pid = int(pid_match.group(1)) if pid_match else 0
            holder = proctree.info(pid) if pid else None
            if holder is None:
                # Name the holder ourselves, once the tasks CRIU had made and then killed are gone.
                holder = proctree.first_holder(ids, settle=1.0)
                pid = holder.pid if holder else pid
            if holder is None and not pid:
                return PidConflict(
                    "Cannot restore: a PID or thread ID that the kernel used was taken by a process that has "
                    "exited since. Resume again; the images are kept.", 0, "a process that has exited")
            who = holder.describe() if holder else "another process"
            return PidConflict(
                f"Cannot restore: PID {pid} that the kernel used is now taken by {who}. "
                f"Stop that process, then resume again; the images are kept.",
                pid,
                who,
            )
        missing = re.search(r"Can't open file (\S+) on restore", text) or re.search(
            r"Can't open (/\S+)", text
        )
        if missing:
            # CRIU logs paths relative to the root directory, without their leading slash.
            path = "/" + missing.group(1).rstrip(":").lstrip("/")
            return CriuFailed(
                f"Cannot restore: the kernel had the file {path} open and it can no "
                f"longer be opened. Put it back where it was, then resume again; the images are kept. "
                f"Full log: {exc.log_path}",
                exc.log_path,
                exc.log_tail,
            )
        size = re.search(r"File (\S+) has bad size", text)
        if size:
            path = "/" + size.group(1).lstrip("/")
            return CriuFailed(
                f"Cannot restore: the file {path} that the kernel had open changed size while it "
                f"was suspended. Restore its old content, then resume again; the images are kept. "
                f"Full log: {exc.log_path}",
                exc.log_path,
                exc.log_tail,
            )
        return CriuFailed(
            f"{exc} The images are kept; fix the cause, then resume again.", exc.log_path, exc.log_tail
        )
