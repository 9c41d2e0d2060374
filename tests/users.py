"""Ordinary Unix users for the tests, each with a jupyter_server of their own, and the node helper as root.

Made by the tests (useradd) and removed after them. The users must reach this checkout and its Python:
where a folder on the way lets no one else pass (a checkout under /root), the tests let others pass
through it (o+x only, nothing listed) while they run, then put its mode back.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import rest, wait_answering

from jupyter_gpumigrate.engine import criuimages

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_user(user: str) -> list[str]:
    """The command prefix that runs the rest as ``user``, without any capability (util-linux)."""
    return ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--inh-caps=-all", "--"]


def user_env(user: str, **extra: str) -> dict[str, str]:
    home = pwd.getpwnam(user).pw_dir
    env = {"HOME": home, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8",
           "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", **extra}
    if os.environ.get("PYTHONPATH"):  # the GPU machine's packages (scripts/gpu-suite.sh)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


class Users:
    """Creates ``names`` (if missing) and makes this checkout reachable for them; ``close`` undoes both."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.created: list[str] = []
        self.opened: dict[Path, int] = {}
        for name in names:
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
                self.created.append(name)
        for target in (Path(sys.executable).resolve(), Path(sys.prefix).resolve(), REPO):
            for folder in [*reversed(target.parents), target] if target.is_dir() else reversed(target.parents):
                mode = folder.stat().st_mode
                if not mode & stat.S_IXOTH and folder not in self.opened:
                    self.opened[folder] = stat.S_IMODE(mode)
                    os.chmod(folder, stat.S_IMODE(mode) | stat.S_IXOTH)

    def uid(self, name: str) -> int:
        return pwd.getpwnam(name).pw_uid

    def run(self, name: str, *cmd: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user(name), *cmd], env=user_env(name), capture_output=True, text=True,
                              timeout=timeout, cwd="/", **kwargs)

    def close(self) -> None:
        for name in self.names:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        time.sleep(0.2)
        for name in self.created:
            subprocess.run(["userdel", "--remove", name], capture_output=True)
        for folder, mode in self.opened.items():
            os.chmod(folder, mode)


class NodeHelper:
    """The node helper, as root, on a socket and an images root of its own; in network namespace ``ns`` (a host
    of tests/hosts.py: what CRIU restores there takes that host's network) where given."""

    def __init__(self, base: Path, ns: str | None = None, memory: Path | None = None, memory_size: str = "4g",
                 wait: bool = True, enter: tuple[str, ...] = ()) -> None:
        # Folders that do not exist yet, as on a fresh machine: the helper must make them reachable.
        self.socket = base / "run" / "helper.sock"
        self.images = base / "lib" / "images"
        self.memory = memory  # --memory-root: users' images in memory too, on a tmpfs the helper mounts there
        self.log_path = base / "helper.log"
        self.out = open(base / "helper.out", "ab")  # noqa: SIM115 (open while the helper runs)
        self.proc = subprocess.Popen(
            # nsenter, not ip netns exec: that one mounts a /sys of its own, without the cgroup v2 the helper needs
            [*([shutil.which("nsenter") or "nsenter", f"--net=/run/netns/{ns}"] if ns else []), *enter, sys.executable, "-m",
             "jupyter_gpumigrate.engine.nodehelper", "--socket", str(self.socket), "--images-root", str(self.images),
             "--log-file", str(self.log_path), *(["--memory-root", str(memory), "--memory-size", memory_size] if memory else [])],
            stdin=subprocess.DEVNULL, stdout=self.out, stderr=self.out, start_new_session=True)
        deadline = time.monotonic() + 30
        while wait and not self.socket.exists():
            assert self.proc.poll() is None, (base / "helper.out").read_text()
            assert time.monotonic() < deadline, "the helper did not listen within 30 s"
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, raw: bytes, timeout: float = 15) -> dict | None:
        """Send ``raw`` as it is, as root; the helper's answer, or None if it closed without one."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.socket))
            try:
                sock.sendall(raw)
            except BrokenPipeError:
                pass
            data = b""
            while not data.endswith(b"\n"):
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                data += chunk
        return json.loads(data) if data.strip() else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.out.close()
        if self.memory is not None:  # the helper leaves its tmpfs mounted, as it should: the test does not
            subprocess.run(["umount", "--lazy", str(self.memory)], capture_output=True)
            shutil.rmtree(self.memory, ignore_errors=True)


@dataclass
class UserServer:
    """A jupyter_server run by an ordinary user, with the extension, on a loopback port."""

    user: str
    root: Path
    config: dict = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    enter: tuple[str, ...] = ()  # a command that runs the server in other namespaces (nsenter ...), then execs it

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> UserServer:
        pw = pwd.getpwnam(self.user)
        for sub in ("config", "data", "runtime", "work", "state"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "config" / "jupyter_server_config.json").write_text(json.dumps({
            "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}, "ip": "127.0.0.1",
                          "port": self.port, "port_retries": 0, "open_browser": False,
                          "root_dir": str(self.root / "work")},
            "IdentityProvider": {"token": self.token},
            "MigratableProvisioner": {"state_dir": str(self.root / "state"), "suspend_to": "disk", **self.config},
        }))
        for path in [self.root, *self.root.rglob("*")]:
            os.chown(path, pw.pw_uid, pw.pw_gid)
        os.chmod(self.root, 0o700)
        env = user_env(self.user, JUPYTER_CONFIG_DIR=str(self.root / "config"),
                       JUPYTER_DATA_DIR=str(self.root / "data"), JUPYTER_RUNTIME_DIR=str(self.root / "runtime"),
                       JUPYTER_PLATFORM_DIRS="1")
        self.log = open(self.root.parent / f"{self.root.name}-server.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen([*self.enter, *as_user(self.user), sys.executable, "-m", "jupyter_server"], env=env,
                                     cwd=str(self.root / "work"), stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log, start_new_session=True)
        wait_answering(self)
        return self

    def server_log(self) -> str:
        return (self.root.parent / f"{self.root.name}-server.log").read_text(errors="replace")[-6000:]

    def api(self, method: str, path: str, body: Any = None, expect: int | None = None) -> Any:
        return rest(self.url, self.token, method, path, body, expect)

    def operate(self, kernel_id: str, action: str, body: dict | None = None, timeout: float = 120) -> dict:
        op = self.api("POST", f"api/gpumigrate/kernels/{kernel_id}/{action}", body or {}, expect=202)
        deadline = time.monotonic() + timeout
        while op["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, op
            time.sleep(0.1)
            op = self.api("GET", f"api/gpumigrate/operations/{op['id']}")
        return op

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if getattr(self, "log", None):
            self.log.close()


def root_only_folder(prefix: str) -> Path:
    """A new folder (0755) whose way is root's and closed to others, sticky folders such as /tmp excluded: where
    the node helper accepts a memory root (in /run, a tmpfs cleared at boot, else /var/lib)."""
    for parent in ("/run", "/var/lib"):
        st = os.stat(parent)
        if st.st_uid == 0 and not st.st_mode & 0o022:
            folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            os.chmod(folder, 0o755)
            return folder
    raise RuntimeError("neither /run nor /var/lib is root's alone to write")


@contextlib.contextmanager
def proc_hiding_others() -> Iterator[tuple[str, ...]]:
    """A mount namespace of its own whose /proc hides from each user the processes they may not trace
    (hidepid=2: another user's, and their own run with capabilities they lack, such as a CRIU the node helper
    lends some): the nsenter command that runs a program in it. Unmounted after."""
    folder = root_only_folder("gm-users-mnt-")
    ns = folder / "ns"
    try:
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        subprocess.run(["mount", "--make-private", str(folder)], check=True)
        ns.touch()
        subprocess.run(["unshare", f"--mount={ns}", "--propagation", "private", "true"], check=True)
        enter = (shutil.which("nsenter") or "nsenter", f"--mount={ns}")
        subprocess.run([*enter, "mount", "-t", "proc", "-o", "hidepid=2", "proc", "/proc"], check=True)
        yield enter
    finally:
        subprocess.run(["umount", str(ns)], capture_output=True)
        subprocess.run(["umount", str(folder)], capture_output=True)
        remove(folder)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- forging images, as a user could (they are the user's files) -------------------------------------


def _put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(data: bytes) -> list[list]:
    return [list(f) for f in criuimages.fields(data)]


def _encode(fields: list[list]) -> bytes:
    out = bytearray()
    for number, kind, value in fields:
        out += _put_varint(number << 3 | kind)
        out += _put_varint(value) if kind == 0 else (_put_varint(len(value)) + value if kind == 2 else value)
    return bytes(out)


def forge_capabilities(core_image: Path, capabilities: list[int], securebits: int = 0) -> None:
    """Edit a CRIU ``core-PID.img`` so that its task asks for ``capabilities`` (bit numbers) in its
    inheritable, permitted, effective and ambient sets, and for ``securebits``: what a user who owns
    their images could do. ``securebits`` -1 writes the sets packed; -2 adds a second creds message
    (asking for securebits 0x3), which protobuf would merge into the first.

    CRIU's image: 8 bytes of magic, then entries (u32 size + a protobuf message). The first entry is a
    CoreEntry; its field 5 is the ThreadCoreEntry, whose field 10 is the CredsEntry, where fields 9,
    10, 11 and 19 are those sets, as repeated 32-bit words (images/core.proto, images/creds.proto).
    """
    raw = core_image.read_bytes()
    head, entries = raw[:8], criuimages.entries(raw)
    core = _fields(entries[0])
    for entry in core:
        if entry[0] != 5:
            continue
        thread = _fields(entry[2])
        for sub in thread:
            if sub[0] != 10:
                continue
            creds = _fields(sub[2])
            words: dict[int, int] = {}
            for cred in creds:
                if cred[0] in (9, 10, 11, 19) and cred[1] == 0:
                    word = words.get(cred[0], 0)
                    words[cred[0]] = word + 1
                    cred[2] |= sum(1 << (c - 32 * word) for c in capabilities if c // 32 == word)
            for number in (9, 10, 11, 19):
                for word in range(words.get(number, 0), 2):
                    creds.append([number, 0, sum(1 << (c - 32 * word) for c in capabilities if c // 32 == word)])
            if securebits > 0:
                creds = [c for c in creds if c[0] != 13] + [[13, 0, securebits]]
            if securebits == -1:  # the same sets as packed lists, which protobuf also accepts
                packed = {n: b"".join(_put_varint(v) for k, kind, v in creds if k == n and kind == 0)
                          for n in (9, 10, 11, 19)}
                creds = [c for c in creds if c[0] not in packed] + [[n, 2, v] for n, v in packed.items()]
            sub[2] = _encode(creds)
            if securebits == -2:  # a second creds message, which protobuf merges into the first
                extra = [10, 2, _encode([c for c in creds if c[0] != 13] + [[13, 0, 0x3]])]
        if securebits == -2:
            thread.append(extra)
        entry[2] = _encode(thread)
    entries[0] = _encode(core)
    core_image.write_bytes(head + b"".join(struct.pack("<I", len(e)) + e for e in entries))
