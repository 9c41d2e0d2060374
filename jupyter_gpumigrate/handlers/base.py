"""What every handler of the API shares: authentication, authorization, errors as JSON, request bodies
checked against the API's schema (jupyter_gpumigrate_client.contract)."""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

from jupyter_server.base.call_context import CallContext
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from jupyter_gpumigrate_client import contract
from ..credentials import KernelCredentials
from ..engine.errors import MigrateError
from ..operations import OperationManager
from ..views import Views

#: The largest JSON body this API reads from a user (its largest, a transplant's accept_left, holds names of
#: objects), and the most values (strings, numbers, lists, objects...) in one: checked before the schema, so
#: that no body keeps the server's event loop busy. A peer's (handlers/peer.py: a kernel's processes, files
#: and sockets) may be larger.
MAX_BODY = 1 << 20
MAX_VALUES = 50_000


def _values(data: Any, most: int) -> int:
    """How many values ``data`` holds, itself included (counting stops past ``most``)."""
    count, stack = 0, [data]
    while stack and count <= most:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return count

#: What a kernel's own credential may do on a route (credentials.py explains the credential).
READ, OWN_KERNEL, OWN_OPERATION = "read", "own kernel", "own operation"


def kernel_credential(scope: str) -> Callable:
    """Let a kernel's credential call this method within ``scope``; everyone else goes through the
    method's own ``@web.authenticated`` and ``@authorized`` (the server's users and authorizer)."""

    def decorate(method: Callable) -> Callable:
        bare = inspect.unwrap(method)

        @functools.wraps(method)
        async def wrapper(self: BaseHandler, *args: Any, **kwargs: Any) -> Any:
            if self.kernel_identity is None:
                return await method(self, *args, **kwargs)
            self.check_kernel_scope(scope, kwargs)
            return await bare(self, *args, **kwargs)

        return wrapper

    return decorate


class BaseHandler(ExtensionHandlerMixin, APIHandler):
    # Moving a kernel reads and writes kernels: the server's authorizer decides with the "kernels"
    # resource, like jupyter_server's own kernel API (GET -> read, POST -> write).
    auth_resource = "kernels"
    #: what json_body reads at most (MAX_BODY, MAX_VALUES)
    max_body = MAX_BODY
    max_values = MAX_VALUES

    kernel_identity: str | None = None

    @property
    def operations(self) -> OperationManager:
        return self.settings["gpumigrate_operations"]

    @property
    def views(self) -> Views:
        return self.operations.views

    @property
    def credentials(self) -> KernelCredentials:
        return self.settings["gpumigrate_credentials"]

    async def prepare(self) -> None:  # type: ignore[override]
        header = self.request.headers.get("Authorization", "")
        if not self.credentials.is_kernel_credential(header):
            await super().prepare()
            return
        # A kernel's credential, in an Authorization header (which no other site can make a browser
        # send, so no XSRF check): it stands for that kernel alone, never for a user of the server.
        CallContext.set(CallContext.JUPYTER_HANDLER, self)
        if not self.check_host():
            raise web.HTTPError(403)
        kernel_id = self.credentials.resolve(header)
        if kernel_id is None:
            raise web.HTTPError(403, "This kernel credential is not valid (any more): was the kernel restarted "
                                     "by another server? Restart the kernel to get a new one.")
        self.kernel_identity = kernel_id
        # No user: a route that does not opt in with @kernel_credential refuses it (@web.authenticated).
        self.current_user = self._jupyter_current_user = None

    def check_kernel_scope(self, scope: str, path_kwargs: dict[str, Any]) -> None:
        kernel_id = self.kernel_identity
        if scope == OWN_KERNEL:
            wanted = path_kwargs.get("kernel_id")
        elif scope == OWN_OPERATION:
            try:
                wanted = self.operations.get(path_kwargs["op_id"]).kernel_id
            except MigrateError as exc:
                raise web.HTTPError(exc.http_status, str(exc)) from exc
        else:
            return
        if wanted != kernel_id:
            raise web.HTTPError(
                403, f"Kernel {kernel_id}'s credential lets it act on itself only, not on {wanted or 'other kernels'}."
            )

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors as jupyter_server's API writes them, with a sentence where tornado has only its reason phrase:
        a method the route does not take, a kernel's credential on a route that is not for kernels."""
        error = (kwargs.get("exc_info") or (None, None, None))[1]
        bare = isinstance(error, web.HTTPError) and not error.log_message
        if bare and status_code == 405 and (self.current_user or self.kernel_identity):  # strangers learn nothing
            taken = [m for m in self.SUPPORTED_METHODS if m != "OPTIONS" and
                     getattr(type(self), m.lower()) is not getattr(web.RequestHandler, m.lower())]
            self.set_header("Allow", ", ".join(taken))
            self.send_error_message(405, f"{self.request.method} is not a method of {self.request.path}: it takes "
                                         f"{', '.join(taken) or 'none'}.")
            return
        if bare and status_code == 403 and self.kernel_identity is not None:
            self.send_error_message(403, f"A kernel's credential (kernel {self.kernel_identity}'s) may read the "
                                         "kernels and the GPUs, and act on its own kernel and follow its operations; "
                                         f"not {self.request.method} {self.request.path}: use a token of the "
                                         "server's.")
            return
        super().write_error(status_code, **kwargs)

    def send_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def send_error_message(self, status: int, message: str) -> None:
        """An error as jupyter_server's API writes them: {"message": ..., "reason": ...}."""
        self.send_json({"message": message, "reason": self._reason_for(status)}, status)

    def send_migrate_error(self, error: MigrateError) -> None:
        self.send_error_message(error.http_status, str(error))

    @staticmethod
    def _reason_for(status: int) -> str:
        return HTTPStatus(status).phrase

    def json_body(self, name: str) -> dict[str, Any] | None:
        """The request's JSON body checked against definition ``name`` of the API's schema
        (jupyter_gpumigrate_client/contract/api.schema.json); an empty body is ``{}``. None after a 400 was
        sent."""
        raw = self.request.body.strip()
        body: Any = {}
        if len(raw) > self.max_body:
            self.send_error_message(413, f"The request body is {len(raw)} bytes; this API's bodies are at most "
                                         f"{self.max_body} bytes.")
            return None
        if raw:
            try:
                body = json.loads(raw)
            except RecursionError:
                self.send_error_message(400, "The request body nests objects and lists too deeply; none of this "
                                             "API's bodies nests more than a few levels.")
                return None
            except ValueError as exc:
                self.send_error_message(400, f"The request body is not JSON: {exc}.")
                return None
        if _values(body, self.max_values) > self.max_values:
            self.send_error_message(400, f"The request body holds more than {self.max_values} values; none of this "
                                         "API's bodies needs as many.")
            return None
        try:
            contract.validate(name, body)
        except contract.ContractError as exc:
            self.send_migrate_error(exc)
            return None
        return body


class NoRouteHandler(BaseHandler):
    """Any path under the API that no route takes: a JSON 404 that says so (jupyter_server's own 404 is a
    page of HTML), whatever the method."""

    @web.authenticated  # as every route: a stranger learns nothing of the API, not even what it lacks
    def _no_route(self, *args: Any, **kwargs: Any) -> None:
        self.send_error_message(404, f"No route of jupyter-gpumigrate's API is {unquote(self.request.path)}: kernel and "
                                     "operation ids hold letters, digits and '-' only, and GPUs are named by their "
                                     "index (README, 'REST API', lists the routes).")

    get = post = put = patch = delete = head = _no_route
