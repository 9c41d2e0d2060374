"""The Hub-managed service: a page for admins (HubOAuth) and a REST API (Hub tokens), under its prefix.

    GET  {prefix}                                  the page: every user's kernels and GPUs, per node
    GET  {prefix}api/kernels                       the same as JSON, one entry per running user server (with
                                                   its suspended kernels' count and image bytes)
    POST {prefix}api/users/{user}/kernels/{id}/{suspend|resume|migrate}[?server=NAME]   body as the server's API
    GET  {prefix}api/users/{user}/operations/{id}[?server=NAME&after=N]                 follow an operation
    POST {prefix}api/gpus/{index or uuid}/drain[?host=NODE]   drain that GPU on every server that has it
    GET  {prefix}api/policy                        the idle policy and its last decisions

Who gets in is the Hub's decision, read from the scopes of the caller's token (or page login):
``admin-ui``, which the Hub gives its admins (its built-in ``admin`` role) and no one else by default,
or ``custom:gpumigrate:admin``, which a role gives to operators (for example to a group) without making
them Hub admins. Anyone else, and any request without valid credentials, gets 403 and learns nothing;
the page alone sends a visitor who is not logged in to the Hub's login.
"""

from __future__ import annotations

import argparse
import asyncio
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
from ..apiclient import kernel_path
from .servers import ServerError, Servers

#: The custom scope for operators (define it in c.JupyterHub.custom_scopes, grant it with a role).
SCOPE = "custom:gpumigrate:admin"
#: The scope that only the Hub's admin role holds by default: Hub admins get in without a role of ours.
ADMIN_SCOPE = "admin-ui"
log = logging.getLogger("jupyter_gpumigrate_client.hub")

NOT_ALLOWED = (f"This needs a Hub admin or a user with the {SCOPE} scope: log in to the Hub as one, or send "
               f"a token of one (Authorization: token ...).")


class Base(HubOAuthenticated, web.RequestHandler):
    #: any one of these lets the caller in (HubAuth.check_scopes)
    hub_scopes = {SCOPE, ADMIN_SCOPE}

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
        if status_code == 403 and "xsrf" not in str(message).lower():
            message = NOT_ALLOWED  # the same words whoever asks: nothing about who or what is there
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


class ApiHandler(Base):
    def get_login_url(self) -> str:
        # An API call without (valid) credentials gets 403 JSON, never a redirect to a login page.
        raise web.HTTPError(403)


class PageHandler(Base):
    @web.authenticated
    async def get(self) -> None:
        page = resources.files(__package__).joinpath("page.html").read_text()
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.finish(page.replace("{{prefix}}", self.settings["prefix"]))


class KernelsHandler(ApiHandler):
    @web.authenticated
    async def get(self) -> None:
        self.send(await self.servers.views(await self.relay(self.servers.running())))


class ActionHandler(ApiHandler):
    @web.authenticated
    async def post(self, user: str, kernel_id: str, action: str) -> None:
        name = self.get_query_argument("server", "")
        server = await self.relay(self.servers.find(user, name))
        op = await self.relay(self.servers.call(server, kernel_path(kernel_id, action), "POST", self.body()))
        if not isinstance(op, dict) or not isinstance(op.get("id"), str):
            raise web.HTTPError(502, f"{server.label} did not answer with an operation: check the "
                                     "jupyter-gpumigrate version installed there.")
        log.info("%s: %s of %s's kernel %s%s (operation %s)", self.current_user["name"], action, server.user,
                 kernel_id, server.where, op["id"])
        self.send(dict(op, user=user, server=name), 202)


class OperationHandler(ApiHandler):
    @web.authenticated
    async def get(self, user: str, op_id: str) -> None:
        name = self.get_query_argument("server", "")
        server = await self.relay(self.servers.find(user, name))
        after = self.get_query_argument("after", None)
        if after is not None and not (after.isascii() and after.isdigit() and len(after) <= 18):
            raise web.HTTPError(400, f"'after' must be a version number (got {after[:40]!r}).")
        path = f"operations/{op_id}" + (f"?after={int(after)}" if after else "")
        op = await self.relay(self.servers.call(server, path, timeout=60))
        if not isinstance(op, dict):
            raise web.HTTPError(502, f"{server.label} did not answer with an operation.")
        self.send(dict(op, user=user, server=name))


class DrainHandler(ApiHandler):
    @web.authenticated
    async def post(self, gpu: str) -> None:
        """Drain a GPU on every server that has kernels on it. ``gpu`` is an index (each node numbers
        its GPUs from 0: add ?host= to pick one node) or a GPU's uuid (one GPU of one node, whichever
        index each server gives it)."""
        host = self.get_query_argument("host", None)
        body = self.body()
        by_uuid = not (gpu.isascii() and gpu.isdigit())
        if not by_uuid and len(gpu) > 6:
            raise web.HTTPError(400, f"GPU index {gpu[:20]}... has more than 6 digits: give an index or a uuid.")
        listed = await self.relay(self.servers.running())
        views = await self.servers.views(listed)
        targets, errors, seen = [], [], False
        for server, view in zip(listed, views):
            if view["error"]:
                errors.append({"user": server.user, "server": server.name, "error": view["error"]})
                continue
            if host and view["host"] != host:
                continue
            match = [g for g in view["gpus"] if (g["uuid"] == gpu if by_uuid else g["index"] == int(gpu))]
            seen = seen or bool(match)
            if match and match[0]["kernels"]:
                targets.append((server, match[0]["index"]))
        if by_uuid and not seen and not errors:
            raise web.HTTPError(404, f"No user's server sees a GPU with uuid {gpu}: GET api/kernels lists "
                                     "each server's GPUs with their uuid.")

        async def drain(server: Any, index: int) -> None:
            # One server refusing must not hide the drains started on the others.
            try:
                op = await self.servers.call(server, f"gpus/{index}/drain", "POST", body)
                started.append(dict(op, user=server.user, server=server.name, index=index))
            except ServerError as exc:
                errors.append({"user": server.user, "server": server.name, "error": str(exc)})

        started: list[dict] = []
        await asyncio.gather(*(drain(s, i) for s, i in targets))
        log.info("%s: drain of GPU %s%s: %d server(s) started, %d refused or unread", self.current_user["name"],
                 gpu, f" on {host}" if host else "", len(started), len(errors))
        self.send({"gpu": gpu if by_uuid else int(gpu), "host": host, "operations": started, "errors": errors}, 202)


class PolicyHandler(ApiHandler):
    @web.authenticated
    async def get(self) -> None:
        policy: IdlePolicy | None = self.settings["policy"]
        self.send({
            "idle_suspend_minutes": policy.minutes if policy else None,
            "gpu_only": policy.gpu_only if policy else None,
            "grace_minutes": policy.grace if policy else None,
            "images": policy.images if policy else None,
            "to_cpu": policy.to_cpu if policy else None,
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
            (prefix + r"api/gpus/([\w-]+)/drain", DrainHandler),
            (prefix + "api/policy", PolicyHandler),
        ],
        servers=servers, prefix=prefix, policy=policy, decisions=[], cookie_secret=cookie_secret,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jupyter_gpumigrate_client.hub", description=__doc__.splitlines()[0])
    parser.add_argument("--proxy-url", default=os.environ.get("JUPYTERHUB_PUBLIC_URL") or "http://127.0.0.1:8000",
                        help="where users' servers are reached (the Hub's public URL, through its proxy)")
    parser.add_argument("--idle-suspend-minutes", type=float, default=0,
                        help="suspend kernels idle for longer than this (0: never)")
    parser.add_argument("--idle-include-cpu", action="store_true",
                        help="the idle policy suspends kernels that hold no GPU too")
    parser.add_argument("--idle-grace-minutes", type=float, default=None,
                        help="leave a kernel alone this long after its last operation, a resume for example "
                             "(default: as long as --idle-suspend-minutes)")
    parser.add_argument("--idle-check-seconds", type=float, default=60, help="how often the policy looks")
    parser.add_argument("--idle-images", choices=("disk", "memory", "auto"), default="disk",
                        help="where the policy's suspends put the images: disk (the default: the node's memory is "
                             "freed too), memory (faster to resume, but it holds the node's memory), or auto")
    parser.add_argument("--idle-to-cpu", action="store_true",
                        help="transplant an idle GPU kernel to the CPU instead of suspending it, where its dry run "
                             "names nothing that would not carry: its GPU is freed and the notebook goes on, on the "
                             "CPU (the others are suspended)")
    parser.add_argument("--server-timeout", type=float, default=10,
                        help="how long one user's server may take to list its kernels and GPUs before it is "
                             "reported as not answering")
    parser.add_argument("--parallel", type=int, default=16, help="how many users' servers are asked at once")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s %(name)s] %(message)s")
    missing = [v for v in ("JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "JUPYTERHUB_SERVICE_URL") if v not in os.environ]
    if missing:
        sys.exit(f"{parser.prog}: {', '.join(missing)} unset: this runs as a service that JupyterHub starts "
                 "(see examples/jupyterhub_config.py).")
    if args.parallel < 1 or args.server_timeout <= 0 or args.idle_check_seconds <= 0:
        sys.exit(f"{parser.prog}: --parallel, --server-timeout and --idle-check-seconds must be positive.")
    servers = Servers(os.environ["JUPYTERHUB_API_URL"], args.proxy_url, os.environ["JUPYTERHUB_API_TOKEN"],
                      view_timeout=args.server_timeout, parallel=args.parallel)
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpumigrate/")
    policy = (IdlePolicy(args.idle_suspend_minutes, gpu_only=not args.idle_include_cpu,
                         grace_minutes=args.idle_grace_minutes, images=args.idle_images, to_cpu=args.idle_to_cpu)
              if args.idle_suspend_minutes else None)
    app = make_app(servers, prefix, policy, os.urandom(32))
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app.listen(url.port or 80, url.hostname or "127.0.0.1")
    log.info("gpumigrate service at %s%s%s", url.geturl().rstrip("/"), prefix,
             f"; idle policy: suspend {'' if policy.gpu_only else 'CPU and '}GPU kernels after "
             f"{policy.minutes:g} min idle, {policy.grace:g} min after their last operation"
             f"{' (GPU kernels whose objects all carry: transplanted to the CPU)' if policy.to_cpu else ''}"
             if policy else "")
    if policy is not None:
        async def tick() -> None:  # PeriodicCallback awaits it: rounds never overlap
            try:
                app.settings["decisions"] = await policy.run_once(servers)
            except ServerError as exc:
                log.warning("idle policy: could not list users' servers: %s", exc)

        ioloop.PeriodicCallback(tick, args.idle_check_seconds * 1000).start()
    ioloop.IOLoop.current().start()
