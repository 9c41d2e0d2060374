"""The node helper: a small privileged service that runs CRIU for the ordinary users of a shared machine,
each on their own kernels only.

CRIU needs capabilities that an ordinary user lacks (CAP_CHECKPOINT_RESTORE; CAP_SETPCAP to restore
where the bounding set is not full, as in containers and VMs). The helper runs as root, listens on a
Unix socket, learns who calls from the socket itself (SO_PEERCRED: the kernel's word, not the
caller's), and for each request runs CRIU *as the caller*, with only those capabilities lent
(``setpriv``). So the kernel itself enforces what the checks below refuse first, with a sentence:

- a dump reads only a tree whose every process and thread belongs to the caller (all four user IDs)
  and holds no capability; CRIU, running as the caller without CAP_SYS_PTRACE, could not read
  another user's process anyway;
- images live in ``ROOT/UID/...`` (ROOT root-owned 0711, ``UID`` 0700 and owned by that user): every
  folder on the way is opened without following links and must belong to the caller and be closed
  to others; CRIU writes as the caller, so images are the caller's and readable by nobody else;
- a restore runs as the caller, so it cannot make a process of anyone else, whatever the images say
  (images are the caller's files: they may be forged). The tree is restored stopped, checked (the
  caller's IDs, no capability left over from those lent), and only then let go; else it is killed.

The CUDA checkpoint API needs no helper: the driver lets a user lock, checkpoint and restore only
their own processes (measured, docs/users.md), so the user's server calls it directly.

Protocol (version 1), over a SOCK_STREAM Unix socket (default ``/run/jupyter-gpumigrate/helper.sock``,
mode 0666: anyone may ask, the helper decides). One request per connection: one JSON object on one
line (at most 64 KiB, within 10 s), answered by one JSON object on one line, then the helper closes.

    {"op": "hello"}                        -> {"ok": true, "version": 1, "uid": U, "images": "ROOT/U",
                                               "criu": "4.2.1", "criu_path": "/usr/local/sbin/criu"}
                                              (makes the caller's images folder if it is missing)
    {"op": "check"}                        -> {"ok": bool, "output": "criu check's last words"}
    {"op": "dump", "pid": P, "images": REL}
                                           -> {"ok": true, "seconds": s}   CRIU dumps the tree under P
                                              into ROOT/U/REL and kills it; on failure it runs on
    {"op": "restore", "images": REL, "ids": [PID or TID, ...]}
                                           -> {"ok": true, "pid": P, "seconds": s}   the new root
    any failure                            -> {"ok": false, "code": C, "error": "a sentence"}
        C: "bad-request" (malformed), "refused" (not yours, forged, unsafe), "criu-failed" (then
        "log": the CRIU log's name in the image folder, for the caller to read), "busy", "internal"

REL is a path relative to the caller's images folder: 1 to 4 names of ``[A-Za-z0-9_][A-Za-z0-9._-]*``.
``ids`` (optional) are the tree's PIDs and TIDs, kept free for the restore. Every request is logged:
who, what, and how it ended.

Run it as root: ``jupyter-gpumigrate-helper`` (or ``python -m jupyter_gpumigrate.engine.nodehelper``);
examples/jupyter-gpumigrate-helper.service is a systemd unit for it. It imports nothing from Jupyter.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pwd
import re
import signal
import socket
import socketserver
import stat
import struct
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import criu as criu_mod
from . import proctree
from .errors import CriuFailed, HelperError

log = logging.getLogger("jupyter_gpumigrate.helper")

PROTOCOL_VERSION = 1
DEFAULT_SOCKET = "/run/jupyter-gpumigrate/helper.sock"
DEFAULT_IMAGES = "/var/lib/jupyter-gpumigrate/images"
MAX_REQUEST = 64 * 1024
REQUEST_TIMEOUT = 10.0
MAX_CLIENTS = 32
MAX_IDS = 1 << 16
MAX_DEPTH = 4
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
#: lent to CRIU, as setpriv names them (capabilities(7))
DUMP_CAPS = ("checkpoint_restore",)
RESTORE_CAPS = ("checkpoint_restore", "setpcap")
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class Refused(Exception):
    """The request is not the caller's to make: wrong owner, forged or unsafe paths."""

    code = "refused"


class BadRequest(Exception):
    code = "bad-request"


class RequestTooLarge(BadRequest):
    pass


@dataclass(frozen=True)
class Caller:
    """Who is at the other end of the socket, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        try:
            name = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            name = "?"
        return f"uid={self.uid}({name}) pid={self.pid}"


def peer_credentials(sock: socket.socket) -> Caller:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Caller(pid, uid, gid)


def _status(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


def foreign(pid: int, uid: int) -> str | None:
    """Why the process ``pid`` (each of its threads) is not wholly ``uid``'s to checkpoint, or None."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return f"process {pid} does not exist"
    for tid in tids:
        try:
            fields = _status(f"/proc/{pid}/task/{tid}/status")
        except OSError:
            continue  # a thread that just exited
        uids = {int(u) for u in fields.get("Uid", "").split()}
        if uids != {uid}:
            return f"process {pid} runs as user {sorted(uids)}, not as you ({uid})"
        if uid != 0 and any(int(fields.get(k, "0"), 16) for k in ("CapPrm", "CapEff", "CapAmb", "CapInh")):
            return f"process {pid} holds capabilities"
    return None


def _setpriv(caller: Caller, caps: tuple[str, ...]) -> list[str]:
    """The command prefix that runs the rest as ``caller`` with only ``caps`` (util-linux's setpriv:
    the well-kept tool for exactly this; Python has no capset)."""
    try:
        pwd.getpwuid(caller.uid)
        groups = "--init-groups"
    except KeyError:
        groups = "--clear-groups"
    lent = ",".join(f"+{c}" for c in caps)
    return ["setpriv", f"--reuid={caller.uid}", f"--regid={caller.gid}", groups,
            f"--inh-caps=-all,{lent}", f"--ambient-caps=-all,{lent}", "--"]


class Helper:
    """What the service does, one request at a time per call of :meth:`handle` (threads may overlap)."""

    def __init__(self, images_root: str | os.PathLike[str], criu_path: str | None = None,
                 criu_timeout: float = 3600.0) -> None:
        self.criu = criu_mod.find(criu_path)
        self.criu_timeout = criu_timeout
        self.root = Path(images_root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o711)
        st = os.lstat(self.root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise SystemExit(f"{self.root} must be a folder owned by uid {os.geteuid()} that no one else can "
                             "write (chmod 711): it holds every user's images folder.")
        os.chmod(self.root, 0o711)
        self._spawn = threading.Lock()  # taken to start a child, and by the reaper: see _reap
        self._ours: set[int] = set()

    # -- requests ------------------------------------------------------------------------------------

    def handle(self, caller: Caller, request: Any) -> dict:
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise BadRequest('a request is a JSON object with "op"')
        op = request["op"]
        handler = {"hello": self.hello, "check": self.check, "dump": self.dump, "restore": self.restore}.get(op)
        if handler is None:
            raise BadRequest(f"unknown op {op!r}: hello, check, dump or restore")
        return handler(caller, request)

    def hello(self, caller: Caller, request: dict) -> dict:
        os.close(self._user_dir(caller))
        return {"ok": True, "version": PROTOCOL_VERSION, "uid": caller.uid, "images": str(self.root / str(caller.uid)),
                "criu": self.criu.version_string, "criu_path": self.criu.path}

    def check(self, caller: Caller, request: dict) -> dict:
        passed, output = criu_mod.Criu(self.criu.path, unprivileged=False).check()
        return {"ok": passed, "output": output.splitlines()[-1] if output else ""}

    def dump(self, caller: Caller, request: dict) -> dict:
        pid = request.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise BadRequest('"pid" must be a process ID (an integer above 1)')
        if pid == os.getpid():
            raise Refused("that is the helper itself")
        tree = proctree.descendants(pid)
        if not tree:
            raise Refused(f"process {pid} does not exist")
        for p in tree:
            why = foreign(p, caller.uid)
            if why:
                raise Refused(f"{why}: you may only suspend your own processes")
        ids = proctree.tree_ids(pid)
        fd = self._open_images(caller, request.get("images"))
        try:
            start = time.monotonic()
            proc = self._criu(caller, DUMP_CAPS, fd, ["dump", "--tree", str(pid), *criu_mod.COMMON_OPTIONS],
                              criu_mod.DUMP_LOG)
            if proc.returncode != 0:
                return {"ok": False, "code": "criu-failed", "log": criu_mod.DUMP_LOG,
                        "error": f"CRIU could not dump process {pid}"}
            # The tree's processes that were ours (kernels we restored) are zombies now: collect them,
            # or their PIDs stay taken and the next restore fails.
            proctree.reap_dumped([i for i in ids if i in set(tree)], timeout=10)
            return {"ok": True, "seconds": round(time.monotonic() - start, 3)}
        finally:
            os.close(fd)

    def restore(self, caller: Caller, request: dict) -> dict:
        ids = request.get("ids") or []
        if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 < i < 1 << 22 for i in ids):
            raise BadRequest(f'"ids" must be a list of at most {MAX_IDS} process IDs')
        fd = self._open_images(caller, request.get("images"))
        try:
            try:
                os.unlink(criu_mod.RESTORE_PIDFILE, dir_fd=fd)
            except FileNotFoundError:
                pass
            proctree.steer_pid_allocation(ids)
            start = time.monotonic()
            proc = self._criu(caller, RESTORE_CAPS, fd, [
                "restore", "--restore-detached", "--leave-stopped", "--pidfile", criu_mod.RESTORE_PIDFILE,
                *criu_mod.COMMON_OPTIONS], criu_mod.RESTORE_LOG)
            if proc.returncode != 0:
                if ids:  # as Criu.restore: let CRIU's dying tasks go, collect those that came to us
                    proctree.wait_ids_released(ids, name="criu", timeout=10)
                    proctree.reap_dumped(ids, timeout=0.5)
                return {"ok": False, "code": "criu-failed", "log": criu_mod.RESTORE_LOG,
                        "error": "CRIU could not restore the process"}
            pid = self._restored_pid(fd, caller)
            self._let_go(pid, caller)
            return {"ok": True, "pid": pid, "seconds": round(time.monotonic() - start, 3)}
        finally:
            os.close(fd)

    # -- what keeps users apart ----------------------------------------------------------------------

    def _user_dir(self, caller: Caller) -> int:
        """An open descriptor of ``ROOT/UID``, made (0700, the caller's) if missing."""
        name = str(caller.uid)
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=root)
                os.chown(name, caller.uid, caller.gid, dir_fd=root, follow_symlinks=False)
            except FileExistsError:
                pass
            return self._enter(root, name, caller, str(self.root / name))
        finally:
            os.close(root)

    @staticmethod
    def _enter(parent: int, name: str, caller: Caller, shown: str) -> int:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if os.path.islink(f"/proc/self/fd/{parent}/{name}"):
                raise Refused(f"{shown} is a symbolic link; image folders must be real folders") from exc
            raise Refused(f"{shown} cannot be opened as a folder ({exc.strerror})") from exc
        st = os.fstat(fd)
        why = None
        if st.st_uid != caller.uid:
            why = f"{shown} belongs to uid {st.st_uid}, not to you ({caller.uid})"
        elif st.st_mode & 0o077:
            why = f"{shown} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it"
        if why:
            os.close(fd)
            raise Refused(why)
        return fd

    def _open_images(self, caller: Caller, rel: Any) -> int:
        """An open descriptor of the caller's image folder ``rel``, each step checked."""
        if not isinstance(rel, str) or not rel:
            raise BadRequest('"images" must name a folder inside your images folder')
        parts = rel.split("/")
        if rel.startswith("/") or len(parts) > MAX_DEPTH or not all(NAME.fullmatch(p) for p in parts):
            raise Refused(f"{rel!r} is not a folder inside your images folder {self.root / str(caller.uid)} "
                          f"(1 to {MAX_DEPTH} plain names, no '..', no absolute path)")
        fd = self._user_dir(caller)
        shown = self.root / str(caller.uid)
        for part in parts:
            shown = shown / part
            try:
                nxt = self._enter(fd, part, caller, str(shown))
            finally:
                os.close(fd)
            fd = nxt
        return fd

    def _restored_pid(self, fd: int, caller: Caller) -> int:
        try:
            pf = os.open(criu_mod.RESTORE_PIDFILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            raise Refused(f"CRIU left no readable {criu_mod.RESTORE_PIDFILE} ({exc.strerror})") from exc
        try:
            st = os.fstat(pf)
            text = os.read(pf, 32) if stat.S_ISREG(st.st_mode) and st.st_uid == caller.uid else b""
        finally:
            os.close(pf)
        if not text.strip().isdigit():
            raise Refused(f"{criu_mod.RESTORE_PIDFILE} is not what CRIU wrote")
        return int(text)

    def _let_go(self, pid: int, caller: Caller) -> None:
        """The tree CRIU restored (stopped) under ``pid``: resume it if it is all the caller's and holds
        no capability, else kill it (the images asked for more than they may)."""
        tree = proctree.descendants(pid)
        why = None if tree else f"the restored process {pid} is gone"
        for p in tree:
            why = why or foreign(p, caller.uid)
        if why:
            for p in reversed(tree):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise Refused(f"the restored tree was killed: {why}; these images cannot be restored")
        for p in tree:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass

    # -- CRIU, as the caller -------------------------------------------------------------------------

    def _criu(self, caller: Caller, caps: tuple[str, ...], fd: int, args: list[str],
              log_name: str) -> subprocess.CompletedProcess:
        # The child's working folder is the image folder already opened and checked (/proc/self/fd/N
        # is resolved by the child, which holds N), so nothing can swap it for another on the way.
        cmd = [*_setpriv(caller, caps), self.criu.path, *args, "--unprivileged", "--images-dir", ".",
               "--log-file", log_name, "-v4"]
        env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8"}
        if os.environ.get("LD_LIBRARY_PATH"):  # a CRIU bundle with its own libraries
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        with self._spawn:
            proc = subprocess.Popen(cmd, cwd=f"/proc/self/fd/{fd}", pass_fds=(fd,), env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self._ours.add(proc.pid)
        try:
            out, _ = proc.communicate(timeout=self.criu_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        finally:
            with self._spawn:
                self._ours.discard(proc.pid)
        return subprocess.CompletedProcess(cmd, proc.returncode, out)

    def reap(self) -> list[int]:
        """Collect our zombie children but those a Popen of ours waits for. Restored trees are re-parented
        to us (we are a subreaper): when one dies, or is dumped again, its PIDs must be freed."""
        me, reaped = os.getpid(), []
        with self._spawn:  # no Popen is between fork and registration meanwhile
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self._ours:
                    continue
                info = proctree.info(int(name))
                if info is not None and info.ppid == me and info.state in ("Z", "X"):
                    if proctree.reap(int(name)) is not None:
                        reaped.append(int(name))
        return reaped


# -- the service -----------------------------------------------------------------------------------


def read_request(sock: socket.socket) -> bytes | None:
    """One line, at most MAX_REQUEST bytes; None if the caller left before its end."""
    data = b""
    while b"\n" not in data:
        if len(data) > MAX_REQUEST:
            raise RequestTooLarge(f"requests are at most {MAX_REQUEST} bytes")
        chunk = sock.recv(MAX_REQUEST + 1 - len(data) if len(data) <= MAX_REQUEST else 1)
        if not chunk:
            return None
        data += chunk
    line = data.split(b"\n", 1)[0]
    if len(line) > MAX_REQUEST:
        raise RequestTooLarge(f"requests are at most {MAX_REQUEST} bytes")
    return line


def _summary(request: Any) -> str:
    if not isinstance(request, dict):
        return "?"
    parts = [str(request.get("op"))]
    for key in ("pid", "images"):
        if key in request:
            value = request[key]
            parts.append(f"{key}={value[:200]!r}" if isinstance(value, str) else f"{key}={str(value)[:200]}")
    if isinstance(request.get("ids"), list):
        parts.append(f"ids=[{len(request['ids'])}]")
    return " ".join(parts)


class _Connection(socketserver.BaseRequestHandler):
    server: Service

    def handle(self) -> None:
        sock: socket.socket = self.request
        caller = peer_credentials(sock)
        if not self.server.slots.acquire(blocking=False):
            log.warning("%s: refused, %d requests already in progress", caller, MAX_CLIENTS)
            self._reply(caller, {"ok": False, "code": "busy", "error": "the helper is busy: try again"})
            return
        try:
            self._serve(sock, caller)
        finally:
            self.server.slots.release()

    def _serve(self, sock: socket.socket, caller: Caller) -> None:
        start = time.monotonic()
        sock.settimeout(REQUEST_TIMEOUT)
        request: Any = None
        try:
            line = read_request(sock)
            if line is None:
                log.warning("%s: left before the end of its request", caller)
                return
            try:
                request = json.loads(line)
            except ValueError as exc:
                raise BadRequest(f"not JSON ({exc})") from exc
            sock.settimeout(None)
            reply = self.server.helper.handle(caller, request)
        except (socket.timeout, ConnectionError) as exc:
            log.warning("%s: %s: the request did not arrive (%s)", caller, _summary(request), exc)
            return
        except (BadRequest, Refused) as exc:
            reply = {"ok": False, "code": exc.code, "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the service must outlive any one request
            log.exception("%s: %s: failed", caller, _summary(request))
            reply = {"ok": False, "code": "internal", "error": f"the helper failed: {exc}"}
        outcome = "ok" if reply.get("ok") else f"{reply.get('code')}: {reply.get('error')}"
        level = logging.WARNING if reply.get("code") == "refused" else logging.INFO
        log.log(level, "%s: %s: %s (%.3f s)", caller, _summary(request), outcome, time.monotonic() - start)
        self._reply(caller, reply)
        if reply.get("ok") and isinstance(request, dict) and request.get("op") == "dump":
            self.server.helper.reap()

    def _reply(self, caller: Caller, reply: dict) -> None:
        try:
            self.request.sendall(json.dumps(reply).encode() + b"\n")
        except OSError as exc:
            log.warning("%s: went away before its answer (%s)", caller, exc)


class Service(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, helper: Helper) -> None:
        self.helper = helper
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, mode=0o755, exist_ok=True)
        if os.path.exists(path) or os.path.islink(path):
            os.unlink(path)
        super().__init__(path, _Connection)
        os.chmod(path, 0o666)  # anyone may ask; SO_PEERCRED says who asks


def _reaper(helper: Helper, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            helper.reap()
        except Exception:  # noqa: BLE001
            log.exception("reaping failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jupyter-gpumigrate-helper", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the Unix socket to listen on ({DEFAULT_SOCKET})")
    parser.add_argument("--images-root", default=DEFAULT_IMAGES,
                        help=f"where users' images folders are made ({DEFAULT_IMAGES}); on a disk with room")
    parser.add_argument("--criu", default=None, help="the CRIU binary (default: /usr/local/sbin/criu, else PATH)")
    parser.add_argument("--log-file", default=None, help="also log every request to this file")
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_file:
        handlers.append(logging.FileHandler(args.log_file))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s jupyter-gpumigrate-helper %(levelname)s %(message)s")
    if os.geteuid() != 0:
        parser.error("the helper runs as root (it lends CRIU's capabilities to each caller, as that caller)")
    os.umask(0o077)  # CRIU, run as each caller, writes images only that caller can read
    try:
        helper = Helper(args.images_root, args.criu)
    except Exception as exc:  # CriuNotFound says what to install
        log.error("%s", exc)
        return 1
    if not proctree.become_subreaper():
        log.warning("could not become a subreaper: restored kernels will be re-parented to PID 1")
    service = Service(args.socket, helper)
    stop = threading.Event()
    threading.Thread(target=_reaper, args=(helper, stop), daemon=True, name="reaper").start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=service.shutdown).start())
    log.info("listening on %s; images in %s; CRIU %s (%s)", args.socket, helper.root,
             helper.criu.version_string, helper.criu.path)
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        service.server_close()
        try:
            os.unlink(args.socket)
        except OSError:
            pass
    log.info("stopped")
    return 0


# -- the client (the user's Jupyter server) --------------------------------------------------------


class HelperClient:
    """Talks to the node helper at ``path``. Each call raises :class:`HelperError` saying what to do."""

    def __init__(self, path: str = DEFAULT_SOCKET) -> None:
        self.path = path

    def request(self, payload: dict, timeout: float = 30.0) -> dict:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(self.path)
                sock.sendall(json.dumps(payload).encode() + b"\n")
                data = b""
                while not data.endswith(b"\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise HelperError(
                f"The node helper at {self.path} does not answer ({exc}): ask an administrator to start it "
                "(systemctl start jupyter-gpumigrate-helper; docs/users.md)."
            ) from exc
        try:
            reply = json.loads(data)
        except ValueError as exc:
            raise HelperError(f"The node helper at {self.path} answered nothing readable: see its log.") from exc
        if not isinstance(reply, dict):
            raise HelperError(f"The node helper at {self.path} answered nothing readable: see its log.")
        return reply


class HelperCriu:
    """CRIU through the node helper: what :class:`~.criu.Criu` does, for a server run by an ordinary user.

    Image folders must lie in the folder the helper made for this user (``images_root``)."""

    def __init__(self, path: str = DEFAULT_SOCKET, timeout: float = 3600.0) -> None:
        self.client = HelperClient(path)
        self.timeout = timeout
        hello = self.client.request({"op": "hello"}, timeout=10)
        if not hello.get("ok"):
            raise HelperError(f"The node helper at {path} refused: {hello.get('error')}")
        self.images_root = Path(hello["images"])
        version = criu_mod.parse_version(f"Version: {hello.get('criu', '0.0')}") or (0, 0)
        self.binary = criu_mod.CriuBinary(f"{hello.get('criu_path')} (through the node helper at {path})", version)

    def _relative(self, images_dir: Path) -> str:
        try:
            return str(Path(images_dir).relative_to(self.images_root))
        except ValueError as exc:
            raise HelperError(f"{images_dir} is outside {self.images_root}, the only images folder the node "
                              "helper writes for you.") from exc

    def _failed(self, reply: dict, log_path: Path, what: str) -> CriuFailed | HelperError:
        if reply.get("code") == "criu-failed":
            return criu_mod.failure(log_path, "", what)
        return HelperError(f"The node helper refused to {what}: {reply.get('error')}.")

    def dump(self, pid: int, images_dir: Path, *, log_path: Path | None = None) -> None:
        reply = self.client.request({"op": "dump", "pid": pid, "images": self._relative(images_dir)}, self.timeout)
        if not reply.get("ok"):
            written = Path(images_dir) / criu_mod.DUMP_LOG
            if log_path is not None and written.exists():
                os.replace(written, log_path)  # the rollback deletes the images, not the log
            raise self._failed(reply, log_path or written, f"dump process {pid}")

    def restore(self, images_dir: Path, ids: list[int] | None = None) -> int:
        reply = self.client.request({"op": "restore", "images": self._relative(images_dir), "ids": ids or []},
                                    self.timeout)
        if reply.get("ok"):
            return int(reply["pid"])
        error = self._failed(reply, Path(images_dir) / criu_mod.RESTORE_LOG, "restore the process")
        if isinstance(error, CriuFailed):
            raise criu_mod.Criu.explain_restore_failure(error, ids or []) from None
        raise error

    def check(self) -> tuple[bool, str]:
        reply = self.client.request({"op": "check"}, timeout=90)
        return bool(reply.get("ok")), str(reply.get("output") or reply.get("error") or "")


if __name__ == "__main__":
    raise SystemExit(main())
