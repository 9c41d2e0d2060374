"""A jupyter_server with the extension, run as a process of its own on loopback, so that tests can stop it
(SIGTERM, SIGKILL) and start it again on the same folders."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers import operate_on, rest, wait_answering

from jupyter_gpumigrate.engine import proctree


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    root: Path
    extra_config: dict = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = 0
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def state(self) -> Path:
        return self.root / "state"

    def start(self) -> LocalServer:
        """Start it (again: same folders, a new port) and wait until it answers."""
        for sub in ("config", "data", "runtime", "work", "state"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config = {
            "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}, "ip": "127.0.0.1",
                          "port": self.port, "port_retries": 0, "allow_root": True, "open_browser": False,
                          "root_dir": str(self.root / "work")},
            "IdentityProvider": {"token": self.token},
            "MigratableProvisioner": {"state_dir": str(self.state), "suspend_to": "disk"},  # where tests look
        }
        for section, values in self.extra_config.items():
            config.setdefault(section, {}).update(values)
        (self.root / "config" / "jupyter_server_config.json").write_text(json.dumps(config))
        env = {**os.environ, "JUPYTER_CONFIG_DIR": str(self.root / "config"),
               "JUPYTER_DATA_DIR": str(self.root / "data"), "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
               "JUPYTER_PLATFORM_DIRS": "1"}
        self.log = open(self.root / "server.log", "ab")  # noqa: SIM115 (open while the server runs)
        # SIGINT as a server normally has it: a test run in the background (CI) inherits it ignored.
        self.proc = subprocess.Popen([sys.executable, "-m", "jupyter_server"], env=env, stdin=subprocess.DEVNULL,
                                     stdout=self.log, stderr=self.log, start_new_session=True,
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        wait_answering(self)
        return self

    def server_log(self) -> str:
        return (self.root / "server.log").read_text(errors="replace")[-8000:]

    def api(self, method: str, path: str, body: Any = None, expect: int | None = None) -> Any:
        return rest(self.url, self.token, method, path, body, expect)

    def operate(self, kernel_id: str, action: str, body: dict | None = None, timeout: float = 180) -> dict:
        return operate_on(self, kernel_id, action, body, timeout)

    def ws_url(self, kernel_id: str) -> str:
        return f"ws://127.0.0.1:{self.port}/api/kernels/{kernel_id}/channels?token={self.token}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> None:
        """Send ``sig`` to the server alone (its kernels run in sessions of their own) and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                self.log.close()
                raise AssertionError(f"the server did not stop within {timeout} s of {signal.Signals(sig).name}; "
                                     f"killed:\n{self.server_log()}") from None
        self.log.close()

    def kernel_processes(self) -> dict[int, str]:
        """Every process of a kernel of this server's folders (its launcher's command line names them), running
        or left by a crash: PID -> its state letter (R, S, T...)."""
        found = {}
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                cmdline = (proc_dir / "cmdline").read_bytes()
            except OSError:
                continue
            process = proctree.info(int(proc_dir.name))
            kernel = b"ipykernel_launcher" in cmdline or b"jupyter_gpumigrate.kernel.transplant" in cmdline
            if process is not None and kernel and str(self.root).encode() in cmdline:
                found[int(proc_dir.name)] = process.state
        return found

    def kill_kernels(self) -> None:
        """The end of a test: no kernel of this server's folders outlives it (running, or left by a crash)."""
        for pid in self.kernel_processes():
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
