"""Users' servers, found through the Hub API, and their /api/gpumigrate, called with a token of each user."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest


class ServerError(Exception):
    """A user's server (or the Hub) refused or failed a request; ``status`` is what to answer with."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class UserServer:
    user: str
    name: str  # "" for the default server
    url: str  # the server's base URL through the proxy, ending in "/"

    @property
    def label(self) -> str:
        """How logs and errors name it: ``alice's server`` or ``alice's server 'gpu2'``."""
        return f"{self.user}'s server {self.name!r}" if self.name else f"{self.user}'s server"

    @property
    def where(self) -> str:
        """What follows a kernel's name in logs: nothing for the default server, `` on server 'gpu2'``."""
        return f" on server {self.name!r}" if self.name else ""


#: Lifetime of the per-user tokens the service mints to call a user's server.
USER_TOKEN_SECONDS = 3600


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_gpu_refs(refs: Any, where: str) -> None:
    if not isinstance(refs, list):
        raise ValueError(f"{where} is not a list")
    for ref in refs:
        if not isinstance(ref, dict) or not _is_int(ref.get("index")):
            raise ValueError(f"{where} holds an entry without an integer index")
        if "memory_used" in ref and ref["memory_used"] is not None and not _is_number(ref["memory_used"]):
            raise ValueError(f"{where} holds an entry whose memory_used is not a number")
        if "uuid" in ref and ref["uuid"] is not None and not isinstance(ref["uuid"], str):
            raise ValueError(f"{where} holds an entry whose uuid is not text")


def check_kernel(kernel: Any) -> None:
    """Raise ValueError, saying what is wrong, unless ``kernel`` is a kernel entry as jupyter-gpumigrate
    answers it (what the page and the idle policy read of it)."""
    if not isinstance(kernel, dict):
        raise ValueError("a kernel entry is not an object")
    for key in ("id", "state"):
        if not isinstance(kernel.get(key), str) or not kernel[key]:
            raise ValueError(f"a kernel entry has no {key}")
    kid = kernel["id"]
    for key in ("name", "execution_state", "last_activity", "operation"):
        if kernel.get(key) is not None and not isinstance(kernel[key], str):
            raise ValueError(f"kernel {kid}'s {key} is not text")
    if not isinstance(kernel.get("migratable", True), bool):
        raise ValueError(f"kernel {kid}'s migratable is not true or false")
    if kernel.get("image_bytes") is not None and not _is_number(kernel["image_bytes"]):
        raise ValueError(f"kernel {kid}'s image_bytes is not a number")
    _check_gpu_refs(kernel.get("gpus"), f"kernel {kid}'s gpus")
    _check_gpu_refs(kernel.get("suspended_on") or [], f"kernel {kid}'s suspended_on")
    targets = kernel.get("targets") or []
    if not isinstance(targets, list) or not all(
        isinstance(t, dict) and _is_int(t.get("index")) and isinstance(t.get("ok"), bool)
        and (t.get("reason") is None or isinstance(t["reason"], str)) for t in targets
    ):
        raise ValueError(f"kernel {kid}'s targets are not a list of {{index, ok, reason}}")


def check_gpu(gpu: Any) -> None:
    """Raise ValueError, saying what is wrong, unless ``gpu`` is a GPU entry as jupyter-gpumigrate answers it."""
    if not isinstance(gpu, dict) or not _is_int(gpu.get("index")):
        raise ValueError("a GPU entry has no integer index")
    index = gpu["index"]
    for key in ("uuid", "name"):
        if not isinstance(gpu.get(key), str):
            raise ValueError(f"GPU {index}'s {key} is not text")
    for key in ("memory_total", "memory_used"):
        if not _is_number(gpu.get(key)) or gpu[key] < 0:
            raise ValueError(f"GPU {index}'s {key} is not a number")
    if gpu.get("utilization") is not None and not _is_number(gpu["utilization"]):
        raise ValueError(f"GPU {index}'s utilization is not a number")
    kernels = gpu.get("kernels")
    if not isinstance(kernels, list) or not all(isinstance(k, dict) and isinstance(k.get("id"), str) for k in kernels):
        raise ValueError(f"GPU {index}'s kernels are not a list of kernels")


def check_answers(kernels: Any, gpus: Any) -> None:
    """Raise ValueError unless GET kernels and GET gpus answered as jupyter-gpumigrate does."""
    if not isinstance(kernels, list):
        raise ValueError("its kernel list is not a list")
    if not isinstance(gpus, dict) or not isinstance(gpus.get("gpus"), list):
        raise ValueError("its GPU list is not an object with a list of GPUs")
    if gpus.get("host") is not None and not isinstance(gpus["host"], str):
        raise ValueError("its host name is not text")
    for kernel in kernels:
        check_kernel(kernel)
    for gpu in gpus["gpus"]:
        check_gpu(gpu)


class Servers:
    """The Hub's API, called with the service's own token, which never leaves the service: a user's
    server (which its user controls) only ever sees a short-lived token of that user, limited to
    ``access:servers!user=<name>``, that the service mints for it.

    ``view_timeout`` bounds how long one server may take to describe its kernels and GPUs, and
    ``parallel`` how many servers are asked at once: one slow or stopped server never holds up the rest.
    """

    def __init__(self, api_url: str, proxy_url: str, token: str, timeout: float = 30, view_timeout: float = 10,
                 parallel: int = 16) -> None:
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.view_timeout = view_timeout
        self.parallel = parallel
        self.http = AsyncHTTPClient(force_instance=True, max_clients=max(10, 2 * parallel))
        self._user_tokens: dict[str, tuple[str, float]] = {}  # user -> (token, expires at)
        self._token_locks: dict[str, asyncio.Lock] = {}

    async def _user_token(self, user: str) -> str:
        # One mint at a time per user: a user's several servers are viewed at once.
        async with self._token_locks.setdefault(user, asyncio.Lock()):
            token, expires = self._user_tokens.get(user, ("", 0.0))
            if time.time() > expires - 300:
                created = await self._fetch(
                    f"{self.api_url}/users/{quote(user, safe='')}/tokens",
                    "POST",
                    {"scopes": [f"access:servers!user={user}"], "expires_in": USER_TOKEN_SECONDS,
                     "note": "jupyter-gpumigrate service"},
                )
                token, expires = created["token"], time.time() + USER_TOKEN_SECONDS
                self._user_tokens[user] = (token, expires)
            return token

    async def _fetch(self, url: str, method: str = "GET", body: Any = None, timeout: float | None = None,
                     token: str | None = None) -> Any:
        request = HTTPRequest(
            url, method=method,
            headers={"Authorization": f"token {token or self.token}", "Content-Type": "application/json",
                     "Accept": "application/jupyterhub-pagination+json, application/json"},
            body=None if method == "GET" else json.dumps(body or {}), request_timeout=timeout or self.timeout,
            follow_redirects=False,
        )
        try:
            response = await self.http.fetch(request)
        except HTTPClientError as exc:
            message = exc.message
            if exc.response is not None and exc.response.body:
                try:
                    message = json.loads(exc.response.body).get("message") or message
                except (ValueError, AttributeError):
                    pass
            if exc.code == 599:
                message = f"{url} did not answer in time ({message})"
            raise ServerError(str(message), exc.code if exc.code in (400, 404, 409, 503) else 502) from None
        except OSError as exc:
            raise ServerError(f"{url} does not answer ({exc}).") from None
        try:
            return json.loads(response.body) if response.body else None
        except ValueError:
            raise ServerError(f"{url} answered something that is not JSON.") from None

    async def running(self) -> list[UserServer]:
        """Every ready server of every user, named servers included (all pages of the Hub's answer)."""
        users: list[dict] = []
        offset = 0
        while True:
            page = await self._fetch(f"{self.api_url}/users?state=ready&offset={offset}&limit=200")
            if isinstance(page, list):  # a Hub that does not page
                users = page
                break
            users += page["items"]
            following = (page.get("_pagination") or {}).get("next")
            if not following:
                break
            offset = following["offset"]
        found = []
        for user in users:
            for name, server in (user.get("servers") or {}).items():
                if server.get("ready"):
                    found.append(UserServer(user["name"], name, self.proxy_url + server["url"]))
        return sorted(found, key=lambda s: (s.user, s.name))

    async def find(self, user: str, server_name: str = "") -> UserServer:
        for server in await self.running():
            if server.user == user and server.name == server_name:
                return server
        which = f"a running server named {server_name!r}" if server_name else "a running default server"
        raise ServerError(f"{user} has no {which}: check the user and the ?server= argument "
                          "(GET api/kernels lists every running server).", 404)

    async def call(self, server: UserServer, path: str, method: str = "GET", body: Any = None,
                   timeout: float | None = None) -> Any:
        token = await self._user_token(server.user)
        return await self._fetch(server.url + "api/gpumigrate/" + path, method, body, timeout, token=token)

    async def view(self, server: UserServer) -> dict[str, Any]:
        """What a server says of its kernels and GPUs. A server that fails, does not answer within
        ``view_timeout``, or answers nonsense (its user controls it) is an entry with ``error`` set and
        no kernels or GPUs: it never breaks the view of the others."""
        entry: dict[str, Any] = {"user": server.user, "server": server.name, "host": None, "kernels": [],
                                 "gpus": [], "error": None}
        try:
            kernels, gpus = await asyncio.wait_for(
                asyncio.gather(self.call(server, "kernels", timeout=self.view_timeout),
                               self.call(server, "gpus", timeout=self.view_timeout)),
                self.view_timeout,
            )
            check_answers(kernels, gpus)
        except asyncio.TimeoutError:
            entry["error"] = (f"{server.label} did not answer within {self.view_timeout:g} s; "
                              "check that it is running (the Hub's admin page can stop it).")
        except ServerError as exc:
            entry["error"] = f"{server.label} could not be read: {exc}"
        except ValueError as exc:
            entry["error"] = (f"{server.label} answers what jupyter-gpumigrate does not ({exc}); "
                              "check the jupyter-gpumigrate version installed in its environment.")
        else:
            entry.update(host=gpus.get("host"), kernels=kernels, gpus=gpus["gpus"])
        return entry

    async def views(self, servers: list[UserServer]) -> list[dict[str, Any]]:
        """:meth:`view` of each server, ``parallel`` at a time, in the order given."""
        gate = asyncio.Semaphore(self.parallel)

        async def one(server: UserServer) -> dict[str, Any]:
            async with gate:
                return await self.view(server)

        return list(await asyncio.gather(*(one(s) for s in servers)))


def kernel_path(kernel_id: str, action: str) -> str:
    return f"kernels/{quote(kernel_id, safe='')}/{action}"
