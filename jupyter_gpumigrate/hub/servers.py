"""Users' servers, found through the Hub API, and their /api/gpumigrate, called with the service's token."""

from __future__ import annotations

import json
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


class Servers:
    def __init__(self, api_url: str, proxy_url: str, token: str, timeout: float = 30) -> None:
        self.api_url = api_url.rstrip("/")
        self.proxy_url = proxy_url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self.http = AsyncHTTPClient()

    async def _fetch(self, url: str, method: str = "GET", body: Any = None, timeout: float | None = None) -> Any:
        request = HTTPRequest(
            url, method=method, headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
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
        """Every ready server of every user."""
        users = await self._fetch(f"{self.api_url}/users?state=ready")
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
        return await self._fetch(server.url + "api/gpumigrate/" + path, method, body, timeout)

    async def view(self, server: UserServer) -> dict[str, Any]:
        """What a server says of its kernels and GPUs; an unreachable server is reported, not fatal."""
        try:
            kernels = await self.call(server, "kernels")
            gpus = await self.call(server, "gpus")
        except ServerError as exc:
            return {"user": server.user, "server": server.name, "error": str(exc), "kernels": [], "gpus": [],
                    "host": None}
        return {"user": server.user, "server": server.name, "host": gpus.get("host"), "kernels": kernels,
                "gpus": gpus["gpus"], "error": None}


def kernel_path(kernel_id: str, action: str) -> str:
    return f"kernels/{quote(kernel_id)}/{action}"
