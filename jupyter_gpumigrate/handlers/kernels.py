"""GET /kernels, GET /kernels/{id}, POST /kernels/{id}/suspend|resume|migrate."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..engine.errors import MigrateError
from .base import OWN_KERNEL, READ, BaseHandler, kernel_credential

#: Fields each action's body may hold, and those it must hold.
ACTION_FIELDS: dict[str, dict[str, type]] = {
    "suspend": {}, "resume": {"to_gpu": int}, "migrate": {"to_gpu": int, "to_host": str, "fast_path": str},
}
#: How a move to another GPU may use the fast path (engine/stash.py): ``auto`` (the server invites an
#: idle kernel), ``off`` (the driver moves everything), ``caller`` (the kernel's own %migrate serves it).
FAST_PATH = ("auto", "off", "caller")


class KernelListHandler(BaseHandler):
    @kernel_credential(READ)
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json(self.operations.list_kernels())


class KernelHandler(BaseHandler):
    @kernel_credential(READ)
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        try:
            self.send_json(self.operations.kernel_view(kernel_id))
        except MigrateError as exc:
            self.send_migrate_error(exc)


class KernelActionHandler(BaseHandler):
    @kernel_credential(OWN_KERNEL)
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        body = self.json_body(ACTION_FIELDS[action])
        if body is None:
            return
        if action == "migrate" and body.get("to_gpu") is None and body.get("to_host") is None:
            self.send_error_message(
                400, "'migrate' needs to_gpu or to_host in the body, e.g. {\"to_gpu\": 1} or {\"to_host\": \"b\"}."
            )
            return
        fast_path = body.get("fast_path", "auto")
        if fast_path not in FAST_PATH or (fast_path == "caller" and self.kernel_identity != kernel_id):
            self.send_error_message(
                400, f"'fast_path' is one of auto, off (got {fast_path!r}); 'caller' is for a kernel's own %migrate."
            )
            return
        try:
            op = self.operations.start(kernel_id, action, to_gpu=body.get("to_gpu"), to_host=body.get("to_host"),
                                       fast_path=fast_path)
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return
        self.set_header("Location", f"{self.base_url}api/gpumigrate/operations/{op.id}")
        reply = op.to_dict()
        if op.stager is not None:  # only to the kernel that serves it: where to connect
            reply["stager"] = op.stager
        self.send_json(reply, status=202)
