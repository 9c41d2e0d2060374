"""The Hub-managed service: a page for admins (HubOAuth) and a REST API (Hub tokens), under its prefix.

    GET  {prefix}                                  the page: every user's kernels and GPUs, per node
    GET  {prefix}api/kernels                       the same as JSON, one entry per user server
    POST {prefix}api/users/{user}/kernels/{id}/{suspend|resume|migrate}   body as the server's API
    GET  {prefix}api/users/{user}/operations/{id}  follow an operation
    POST {prefix}api/gpus/{index}/drain            drain GPU {index} on every server (?host= one node)
    GET  {prefix}api/policy                        the idle policy and its last decisions

Only users whose token carries ``custom:gpumigrate:admin`` get in (the Hub's admins, and any role an
operator is given); anyone else gets 403 and learns nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from importlib import resources
from typing import Any
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from tornado import ioloop, web

from .policy import IdlePolicy
from .servers import ServerError, Servers, kernel_path

SCOPE = "custom:gpumigrate:admin"
log = logging.getLogger("jupyter_gpumigrate.hub")


class Base(HubOAuthenticated, web.RequestHandler):
    hub_scopes = {SCOPE}

    def prepare(self) -> None:
        # The page's cookie authenticates POSTs too: demand JSON, which another site cannot make a browser
        # send without a CORS preflight (that this service never answers).
        if self.request.method == "POST" and not self.request.headers.get("Content-Type", "").startswith(
            "application/json"
        ):
            raise web.HTTPError(400, "POST bodies must be JSON (Content-Type: application/json).")

    @property
    def servers(self) -> Servers:
        return self.settings["servers"]

    def send(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        message = exc.log_message if isinstance(exc, web.HTTPError) and exc.log_message else self._reason
        self.send({"message": message}, status_code)

    def body(self) -> dict:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError as exc:
            raise web.HTTPError(400, f"The request body is not JSON: {exc}.") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "The request body must be a JSON object.")
        return data

    async def relay(self, call: Any) -> Any:
        try:
            return await call
        except ServerError as exc:
            raise web.HTTPError(exc.status, str(exc)) from None


class PageHandler(Base):
    @web.authenticated
    async def get(self) -> None:
        page = resources.files(__package__).joinpath("page.html").read_text()
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(page.replace("{{prefix}}", self.settings["prefix"]))


class KernelsHandler(Base):
    @web.authenticated
    async def get(self) -> None:
        views = [await self.servers.view(s) for s in await self.relay(self.servers.running())]
        self.send(views)


class ActionHandler(Base):
    @web.authenticated
    async def post(self, user: str, kernel_id: str, action: str) -> None:
        server = await self.relay(self.servers.find(user, self.get_query_argument("server", "")))
        op = await self.relay(self.servers.call(server, kernel_path(kernel_id, action), "POST", self.body()))
        if not isinstance(op, dict) or "id" not in op:
            raise web.HTTPError(502, f"{user}'s server did not answer with an operation.")
        log.info("%s: %s of %s's kernel %s (operation %s)", self.current_user["name"], action, user, kernel_id, op["id"])
        self.send(dict(op, user=user), 202)


class OperationHandler(Base):
    @web.authenticated
    async def get(self, user: str, op_id: str) -> None:
        server = await self.relay(self.servers.find(user, self.get_query_argument("server", "")))
        after = self.get_query_argument("after", None)
        path = f"operations/{op_id}" + (f"?after={int(after)}" if after and after.isdigit() else "")
        self.send(dict(await self.relay(self.servers.call(server, path, timeout=60)), user=user))


class DrainHandler(Base):
    @web.authenticated
    async def post(self, index: str) -> None:
        host = self.get_query_argument("host", None)
        body = self.body()
        started, errors = [], []
        for server in await self.relay(self.servers.running()):
            view = await self.servers.view(server)
            if host and view["host"] != host:
                continue
            on_it = any(g.get("index") == int(index) and g.get("kernels") for g in view["gpus"] if isinstance(g, dict))
            if not on_it:
                continue
            # One server refusing must not hide the drains already started on the others.
            try:
                op = await self.servers.call(server, f"gpus/{int(index)}/drain", "POST", body)
                started.append(dict(op, user=server.user))
            except ServerError as exc:
                errors.append({"user": server.user, "error": str(exc)})
        log.info("%s: drain of GPU %s%s: %d server(s) started, %d refused", self.current_user["name"], index,
                 f" on {host}" if host else "", len(started), len(errors))
        self.send({"gpu": int(index), "host": host, "operations": started, "errors": errors}, 202)


class PolicyHandler(Base):
    @web.authenticated
    async def get(self) -> None:
        policy: IdlePolicy | None = self.settings["policy"]
        self.send({
            "idle_suspend_minutes": policy.minutes if policy else None,
            "gpu_only": policy.gpu_only if policy else None,
            "last_decisions": self.settings["decisions"],
        })


def make_app(servers: Servers, prefix: str, policy: IdlePolicy | None, cookie_secret: bytes) -> web.Application:
    return web.Application(
        [
            (prefix, PageHandler),
            (prefix + "oauth_callback", HubOAuthCallbackHandler),
            (prefix + "api/kernels", KernelsHandler),
            (prefix + r"api/users/([^/]+)/kernels/([\w-]+)/(suspend|resume|migrate)", ActionHandler),
            (prefix + r"api/users/([^/]+)/operations/([\w-]+)", OperationHandler),
            (prefix + r"api/gpus/(\d+)/drain", DrainHandler),
            (prefix + "api/policy", PolicyHandler),
        ],
        servers=servers, prefix=prefix, policy=policy, decisions=[], cookie_secret=cookie_secret,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jupyter_gpumigrate.hub", description=__doc__.splitlines()[0])
    parser.add_argument("--proxy-url", default=os.environ.get("JUPYTERHUB_PUBLIC_URL") or "http://127.0.0.1:8000",
                        help="where users' servers are reached (the Hub's public URL, through its proxy)")
    parser.add_argument("--idle-suspend-minutes", type=float, default=0,
                        help="suspend kernels idle for longer than this (0: never)")
    parser.add_argument("--idle-include-cpu", action="store_true",
                        help="the idle policy suspends kernels that hold no GPU too")
    parser.add_argument("--idle-check-seconds", type=float, default=60, help="how often the policy looks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s %(name)s] %(message)s")
    missing = [v for v in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "JUPYTERHUB_SERVICE_URL") if v not in os.environ]
    if missing:
        sys.exit(f"{parser.prog}: {', '.join(missing)} unset: this runs as a service that JupyterHub starts "
                 "(see examples/jupyterhub_config.py).")
    servers = Servers(os.environ["JUPYTERHUB_API_URL"], args.proxy_url, os.environ["JUPYTERHUB_API_TOKEN"])
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpumigrate/")
    policy = IdlePolicy(args.idle_suspend_minutes, gpu_only=not args.idle_include_cpu) if args.idle_suspend_minutes else None
    app = make_app(servers, prefix, policy, os.urandom(32))
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app.listen(url.port or 80, url.hostname or "127.0.0.1")
    log.info("gpumigrate service at %s%s%s", url.geturl().rstrip("/"), prefix,
             f"; idle policy: suspend after {args.idle_suspend_minutes:g} min" if policy else "")
    if policy is not None:
        async def tick() -> None:
            try:
                app.settings["decisions"] = await policy.run_once(servers)
            except ServerError as exc:
                log.warning("idle policy: could not list users' servers: %s", exc)

        ioloop.PeriodicCallback(tick, args.idle_check_seconds * 1000).start()
    ioloop.IOLoop.current().start()
