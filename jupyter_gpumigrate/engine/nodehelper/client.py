"""The node helper's client, used by the user's Jupyter server: :class:`HelperCriu` does what
:class:`~jupyter_gpumigrate.engine.criu.Criu` does, through the helper (protocol.py says what goes over
its socket)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from .. import criu as criu_mod
from ..errors import CriuFailed, HelperError
from .protocol import BUSY, CRIU_FAILED, DEFAULT_SOCKET, encode


class HelperClient:
    """Talks to the node helper at ``path``. Each call raises :class:`HelperError` saying what to do."""

    #: no answer of the helper's is near this long
    MAX_REPLY = 1 << 20

    def __init__(self, path: str = DEFAULT_SOCKET) -> None:
        self.path = path

    def request(self, payload: dict, timeout: float = 30.0) -> dict:
        """Send one request; the helper's answer (``ok`` may be false). ``timeout`` bounds each wait."""
        data = b""
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(self.path)
                sock.sendall(encode(payload))
                while not data.endswith(b"\n") and len(data) < self.MAX_REPLY:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    data += chunk
        except OSError as exc:
            raise HelperError(
                f"The node helper at {self.path} does not answer ({exc}): ask an administrator to start it "
                "(systemctl start jupyter-gpumigrate-helper; docs/users.md)."
            ) from exc
        if not data:
            raise HelperError(f"The node helper at {self.path} closed the connection without an answer (did it "
                              "restart?): try again; its log says more.")
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            raise HelperError(f"The node helper at {self.path} answered nothing readable: see its log.")
        return reply


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
            return criu_mod.failure(log_path, "", what)
        if reply.get("code") == BUSY:
            return HelperError(f"The node helper could not {what} now: {reply.get('error')}.")
        return HelperError(f"The node helper refused to {what}: {reply.get('error')}.")

    def dump(self, pid: int, images_dir: Path, *, log_path: Path | None = None) -> None:
        reply = self.client.request({"op": "dump", "pid": pid, **self._relative(images_dir)}, self.timeout)
        if not reply.get("ok"):
            written = Path(images_dir) / criu_mod.DUMP_LOG
            if log_path is not None and written.exists():
                os.replace(written, log_path)  # the rollback deletes the images, not the log
            raise self._failed(reply, log_path or written, f"dump process {pid}")

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

