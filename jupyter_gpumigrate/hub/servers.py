"""Users' servers, found through the Hub API, and their /api/gpumigrate, called with the service's token."""

from __future__ import annotations

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


#: Lifetime of the per-user tokens the service mints to call a user's server.
USER_TOKEN_SECONDS = 3600


class Servers:
    """The Hub's API, called with the service's own token, which never leaves the service: a user's
    server (which its user controls) only ever sees a short-lived token of that user, limited to
    ``access:servers!user=<name>``, that the service mints for it."""

    def __init__(self, api_url: str, proxy_url: str, token: str, timeout: float = 30) -> None:
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.http = AsyncHTTPClient()
        self._user_tokens: dict[str, tuple[str, float]] = {}  # user -> (token, expires at)

    async def _user_token(self, user: str) -> str:
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
        )
        try:
            response = await self.http.fetch(request)
        except HTTPClientError as exc:
            message = exc.message
            if exc.response is not None and exc.response.body:
                try:
                    message = json.loads(exc.response.body).get("message") or message
                except ValueError:
                    pass
            raise ServerError(str(message), exc.code if exc.code in (400, 404, 409, 503) else 502) from None
        except OSError as exc:
            raise ServerError(f"{url} does not answer ({exc}).") from None
        return json.loads(response.body) if response.body else None

    async def running(self) -> list[UserServer]:
        """Every ready server of every user (all pages of the Hub's answer)."""
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
        raise ServerError(f"{user} has no running server{' ' + server_name if server_name else ''}.", 404)

    async def call(self, server: UserServer, path: str, method: str = "GET", body: Any = None,
                   timeout: float | None = None) -> Any:
        token = await self._user_token(server.user)
        return await self._fetch(server.url + "api/gpumigrate/" + path, method, body, timeout, token=token)

    async def view(self, server: UserServer) -> dict[str, Any]:
        """What a server says of its kernels and GPUs. A server that fails, or answers nonsense (its user
        controls it), is reported as such and never breaks the view of the others."""
        try:
            kernels = await self.call(server, "kernels")
            gpus = await self.call(server, "gpus")
            if not isinstance(kernels, list) or not isinstance(gpus, dict) or not isinstance(gpus.get("gpus"), list):
                raise ServerError("its /api/gpumigrate answers are not what jupyter-gpumigrate answers")
        except ServerError as exc:
            return {"user": server.user, "server": server.name, "error": str(exc), "kernels": [], "gpus": [],
                    "host": None}
        return {"user": server.user, "server": server.name, "host": gpus.get("host"), "kernels": kernels,
                "gpus": gpus["gpus"], "error": None}


def kernel_path(kernel_id: str, action: str) -> str:
    return f"kernels/{quote(kernel_id, safe='')}/{action}"
