"""Two "hosts" on one machine: network namespaces joined by a bridge, each with its own jupyter_server.

    root namespace (the tests)   10.77.x.1 on bridge gmbr<x>
    host a                       10.77.x.2, namespace gma<x>, its own server, state and config dirs
    host b                       10.77.x.3, namespace gmb<x>

Each server serves HTTPS with one self-signed certificate valid for both addresses, the peers'
``ca_file``. The hosts share the filesystem and the PID namespace, as two machines with a shared home
and the same software would share paths; their loopbacks, addresses and ports are their own.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import operate_on, rest, wait_answering
from users import as_user, user_env

PORT = 8888


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Network:
    """The bridge and the namespaces; ``close`` removes them."""

    def __init__(self, tag: int) -> None:
        self.tag = tag
        self.bridge = f"gmbr{tag}"
        self.prefix = f"10.77.{tag}"
        self.namespaces: list[str] = []

    def up(self) -> Network:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        return self

    def add(self, name: str, last_octet: int) -> tuple[str, str]:
        ns, veth = f"gm{name}{self.tag}", f"gm{name}{self.tag}h"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "master", self.bridge, "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.prefix}.{last_octet}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        return ns, f"{self.prefix}.{last_octet}"

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


def host_pair(net: Network, root: Path) -> tuple[Host, Host]:
    """Hosts a and b on ``net`` (not started yet), with one certificate valid for both, under ``root``."""
    ns_a, ip_a = net.add("a", 2)
    ns_b, ip_b = net.add("b", 3)
    cert, key = make_certificate(root, [ip_a, ip_b])
    return Host("a", ns_a, ip_a, root / "a", cert, key), Host("b", ns_b, ip_b, root / "b", cert, key)


def make_certificate(folder: Path, addresses: list[str]) -> tuple[Path, Path]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    san = ",".join(f"IP:{a}" for a in addresses)
    sh("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=gpumigrate-test",
       "-addext", f"subjectAltName={san}", "-keyout", str(key), "-out", str(cert))
    os.chmod(key, 0o600)
    return cert, key


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    root: Path
    cert: Path
    key: Path
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    peer_token: str = field(default_factory=lambda: secrets.token_hex(16))
    proc: subprocess.Popen | None = None
    #: more configuration, by class ({"MigratableProvisioner": {"shared_dir": ...}}), merged into the defaults
    extra: dict = field(default_factory=dict)
    #: an ordinary Unix user (tests/users.py) who runs this host's server; root where None
    user: str | None = None

    @property
    def url(self) -> str:
        return f"https://{self.ip}:{PORT}/"

    @property
    def memory_root(self) -> Path:
        """The folder of this host's images in memory (the provisioner's default memory_dir: one per user and state
        folder)."""
        state = (self.extra.get("MigratableProvisioner") or {}).get("state_dir") or self.root / "state"
        uid = pwd.getpwnam(self.user).pw_uid if self.user is not None else os.geteuid()
        return Path(f"/dev/shm/jupyter-gpumigrate-{uid}-"
                    f"{hashlib.sha256(os.path.realpath(state).encode()).hexdigest()[:12]}")

    def images_glob(self, pattern: str) -> list[Path]:
        """What matches ``pattern`` (``**/<kernel id>/...``) among this host's images: in its state folder, and in
        its memory folder (a move's or a way home's images in memory where there is room)."""
        return [*(self.root / "state").glob(pattern), *self.memory_root.glob(pattern)]

    def peer_entry(self, token: str | None = None) -> dict:
        return {"url": self.url, "token": token or self.peer_token, "ca_file": str(self.cert)}

    def start(self, peers: dict[str, dict]) -> None:
        for sub in ("config", "data", "runtime", "work", "state"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        config = self.root / "config" / "jupyter_server_config.json"
        settings = {
            "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}, "ip": self.ip, "port": PORT,
                          "port_retries": 0, "certfile": str(self.cert), "keyfile": str(self.key),
                          "allow_root": True, "open_browser": False, "root_dir": str(self.root / "work")},
            "IdentityProvider": {"token": self.token},
            "MigratableProvisioner": {"state_dir": str(self.root / "state"), "suspend_to": "disk"},
            "GPUMigrateApp": {"host_name": self.name, "peers": peers, "peer_token": self.peer_token},
        }
        for section, values in self.extra.items():
            settings.setdefault(section, {}).update(values)
        config.write_text(json.dumps(settings))
        dirs = {"JUPYTER_CONFIG_DIR": str(self.root / "config"), "JUPYTER_DATA_DIR": str(self.root / "data"),
                "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"), "JUPYTER_PLATFORM_DIRS": "1"}
        env, enter = {**os.environ, **dirs}, ["ip", "netns", "exec", self.ns]
        if self.user is not None:  # its folders its own and closed to others, as a user's home would be
            pw = pwd.getpwnam(self.user)
            for path in [self.root, *self.root.rglob("*")]:
                os.chown(path, pw.pw_uid, pw.pw_gid)
            os.chmod(self.root, 0o700)
            # Into the network namespace only: its kernels share the mount namespace of the node helper, which
            # dumps and restores them (ip netns exec gives each command a mount namespace of its own).
            env, enter = user_env(self.user, **dirs), [shutil.which("nsenter") or "nsenter",
                                                        f"--net=/run/netns/{self.ns}", *as_user(self.user)]
        self.log = open(self.root / "server.log", "ab")  # noqa: SIM115 (open while the server runs)
        self.proc = subprocess.Popen(
            [*enter, sys.executable, "-m", "jupyter_server"],
            env=env, cwd=str(self.root / "work"), stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
            start_new_session=True,
        )
        wait_answering(self)

    def server_log(self, tail: int | None = 6000) -> str:
        """The server's log: its last ``tail`` characters (for an assertion's message), or all of it (None)."""
        text = (self.root / "server.log").read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))

    def api(self, method: str, path: str, body: Any = None, expect: int | None = None,
            headers: dict[str, str] | None = None) -> Any:
        return rest(self.url, self.token, method, path, body, expect, headers, self.context())

    def operate(self, kernel_id: str, action: str, body: dict | None = None, timeout: float = 180) -> dict:
        op = operate_on(self, kernel_id, action, body, timeout)
        if op["status"] == "failed":  # said in the test's captured output, where an assertion on it fails
            print(f"{self.name}: {action} of kernel {kernel_id} failed in phase {op.get('failed_phase')}: "
                  f"{op.get('error')}\n{self.server_log()[-3000:]}")
        return op

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
