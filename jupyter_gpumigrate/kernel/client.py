"""The kernel's client of its server's /api/gpumigrate, with the credential the provisioner gave it.

Standard library HTTP (urllib): a handful of JSON calls from inside a user's kernel should add no
dependency to the user's environment.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from ..credentials import ENV_KERNEL_ID, ENV_TOKEN, ENV_URL, SCHEME

API = "api/gpumigrate"


class NotManaged(Exception):
    """This kernel was not started by a server with jupyter-gpumigrate, so it cannot be moved."""


class ApiError(Exception):
    """The server refused or failed a request; the message is the server's sentence."""


class Unreachable(ApiError):
    """The server did not answer at all (this kernel may be on its way to another host)."""


class ServerClient:
    def __init__(self, url: str, kernel_id: str, token: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.kernel_id = kernel_id
        self.token = token

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerClient:
        env = os.environ if environ is None else environ
        missing = [name for name in (ENV_URL, ENV_KERNEL_ID, ENV_TOKEN) if not env.get(name)]
        if missing:
            raise NotManaged(
                "This kernel was not started by a Jupyter server with jupyter-gpumigrate, so it cannot be "
                "moved: start it from JupyterLab with the extension enabled (see jupyter gpumigrate doctor)."
            )
        return cls(env[ENV_URL], env[ENV_KERNEL_ID], env[ENV_TOKEN])

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + API + "/" + path, data=data, method=method)
        req.add_header("Authorization", f"{SCHEME} {self.token}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                body = resp.read()
            try:
                return json.loads(body or b"null")
            except ValueError:
                raise ApiError(f"The server at {self.url} answered something that is not JSON: is it a "
                               "Jupyter server with jupyter-gpumigrate?") from None
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("message") or exc.reason
            except ValueError:
                message = exc.reason
            raise ApiError(str(message)) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            # HTTPException: a connection cut mid-answer (CRIU restores this kernel's sockets closed).
            raise Unreachable(f"The Jupyter server at {self.url} does not answer ({exc}).") from None

    def gpus(self) -> dict:
        return self.request("GET", "gpus")

    def kernels(self) -> list[dict]:
        return self.request("GET", "kernels")

    def me(self) -> dict:
        return self.request("GET", f"kernels/{self.kernel_id}")

    def migrate(self, to_gpu: int | None, to_host: str | None = None, fast_path: str | None = None) -> dict:
        body: dict = {"to_gpu": to_gpu}
        if to_host:
            body["to_host"] = to_host
        if fast_path:
            body["fast_path"] = fast_path
        return self.request("POST", f"kernels/{self.kernel_id}/migrate", body)

    def suspend(self) -> dict:
        return self.request("POST", f"kernels/{self.kernel_id}/suspend", {})

    def operation(self, op_id: str) -> dict:
        return self.request("GET", f"operations/{op_id}")

    def follow(self, op: dict, on_change: Callable[[dict], None] | None = None, patience: float = 120.0) -> dict:
        """Wait for the operation to end, calling ``on_change`` at each change (the server holds each
        request until something changes, so this does not poll).

        While this kernel itself is being moved, its connection to the server breaks, and until the
        relay is up it has none: it keeps asking for up to ``patience`` seconds.
        """
        lost_since: float | None = None
        while op["status"] not in ("succeeded", "failed"):
            try:
                op = self.request("GET", f"operations/{op['id']}?after={op['version']}", timeout=60)
            except Unreachable:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > patience:
                    raise
                time.sleep(0.2)
                continue
            lost_since = None
            if on_change is not None:
                on_change(op)
        return op
