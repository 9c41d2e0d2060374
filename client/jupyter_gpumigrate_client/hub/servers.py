"""Users' servers, found through the Hub API, and their /api/gpumigrate, called with a token of each user.

HTTP goes through :mod:`jupyter_gpumigrate_client.apiclient` (blocking urllib), each call in a thread of the
service's own pool so that many servers are asked at once and the event loop never waits.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ..apiclient import ApiError, Client, Unreachable, quote
from ..contract import ContractError, validate

T = TypeVar("T")
#: the statuses of a user's server (or of the Hub) that the service answers as they are; others are 502
PASSED_ON = (400, 404, 409, 503)


class ServerError(Exception):
    """A user's server (or the Hub) refused or failed a request; ``status`` is what to answer with."""

    def __init__(self, message: str, status: int = 502, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = status
        #: it did not answer in time
        self.timed_out = timed_out


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


def check_answers(kernels: Any, gpus: Any) -> None:
    """Raise :class:`ContractError`, saying which field is wrong, unless GET kernels and GET gpus answered
    as the API's contract (jupyter_gpumigrate_client.contract) says: a user's server, which its user controls,
    is believed only then."""
    # Users' servers may run a newer version than the Hub's, answering with fields it does not know.
    validate("KernelList", kernels, strict=False)
    validate("GpuList", gpus, strict=False)


def suspended(kernels: list[dict] | None = None) -> dict[str, int]:
    """A server's suspended kernels: how many, the bytes of their images, and how many of those bytes are in
    its node's memory (tmpfs) rather than on its disk."""
    held = [k for k in kernels or [] if k.get("state") == "suspended"]
    return {"kernels": len(held), "image_bytes": sum(k.get("image_bytes") or 0 for k in held),
            "memory_bytes": sum(k.get("image_bytes") or 0 for k in held if k.get("images") == "memory")}


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
        # One thread per call under way: ``parallel`` servers viewed at once (two calls each), and room
        # for the long polls of operations followed through the service.
        self.pool = ThreadPoolExecutor(max_workers=max(10, 2 * parallel), thread_name_prefix="gpumigrate-hub")
        self.hub = Client.with_token(self.api_url, token, prefix="", timeout=timeout,
                                     headers={"Accept": "application/jupyterhub-pagination+json, application/json"})
        self._user_tokens: dict[str, tuple[str, float]] = {}  # user -> (token, expires at)
        self._token_locks: dict[str, asyncio.Lock] = {}

    async def _user_token(self, user: str) -> str:
        # One mint at a time per user: a user's several servers are viewed at once.
        async with self._token_locks.setdefault(user, asyncio.Lock()):
            token, expires = self._user_tokens.get(user, ("", 0.0))
            if time.time() > expires - 300:
                created = await self._run(
                    self.hub.post, f"users/{quote(user)}/tokens",
                    {"scopes": [f"access:servers!user={user}"], "expires_in": USER_TOKEN_SECONDS,
                     "note": "jupyter-gpumigrate service"},
                )
                token, expires = created["token"], time.time() + USER_TOKEN_SECONDS
                self._user_tokens[user] = (token, expires)
            return token

    async def _run(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)`` (a blocking Client call) in the pool; its errors as :class:`ServerError`."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(call, *args, **kwargs))
        except Unreachable as exc:
            raise ServerError(str(exc), timed_out=exc.timed_out) from None
        except ApiError as exc:
            raise ServerError(str(exc), exc.status if exc.status in PASSED_ON else 502) from None

    async def running(self) -> list[UserServer]:
        """Every ready server of every user, named servers included (all pages of the Hub's answer)."""
        users: list[dict] = []
        offset = 0
        while True:
            page = await self._run(self.hub.get, f"users?state=ready&offset={offset}&limit=200")
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
        which = f"running server named {server_name!r}" if server_name else "running default server"
        raise ServerError(f"{user} has no {which}: check the user and the ?server= argument "
                          "(GET api/kernels lists every running server).", 404)

    async def call(self, server: UserServer, path: str, method: str = "GET", body: Any = None,
                   timeout: float | None = None) -> Any:
        client = Client.with_token(server.url, await self._user_token(server.user), timeout=self.timeout)
        return await self._run(client.request, method, path, body, timeout)

    async def view(self, server: UserServer) -> dict[str, Any]:
        """What a server says of its kernels and GPUs. A server that fails, does not answer within
        ``view_timeout``, or answers nonsense (its user controls it) is an entry with ``error`` set and
        no kernels or GPUs: it never breaks the view of the others."""
        entry: dict[str, Any] = {"user": server.user, "server": server.name, "host": None, "kernels": [],
                                 "gpus": [], "suspended": suspended(), "error": None}
        try:
            kernels, gpus = await asyncio.wait_for(
                asyncio.gather(self.call(server, "kernels", timeout=self.view_timeout),
                               self.call(server, "gpus", timeout=self.view_timeout)),
                self.view_timeout,
            )
            check_answers(kernels, gpus)
        except (asyncio.TimeoutError, ServerError) as exc:
            # One sentence for a server too slow, whichever timer fired first (ours, or its socket's).
            if isinstance(exc, asyncio.TimeoutError) or exc.timed_out:
                entry["error"] = (f"{server.label} did not answer within {self.view_timeout:g} s; "
                                  "check that it is running (the Hub's admin page can stop it).")
            else:
                entry["error"] = f"{server.label} could not be read: {exc}"
        except ContractError as exc:
            entry["error"] = (f"{server.label} answers what jupyter-gpumigrate does not ({exc}); "
                              "check the jupyter-gpumigrate version installed in its environment.")
        else:
            entry.update(host=gpus.get("host"), kernels=kernels, gpus=gpus["gpus"], suspended=suspended(kernels))
        return entry

    async def views(self, servers: list[UserServer]) -> list[dict[str, Any]]:
        """:meth:`view` of each server, ``parallel`` at a time, in the order given."""
        gate = asyncio.Semaphore(self.parallel)

        async def one(server: UserServer) -> dict[str, Any]:
            async with gate:
                return await self.view(server)

        return list(await asyncio.gather(*(one(s) for s in servers)))

