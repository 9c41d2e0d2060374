"""GET /kernels, GET /kernels/{id}, POST /kernels/{id}/suspend|resume|migrate|transplant|back."""

from __future__ import annotations

from datetime import datetime

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..engine.errors import MigrateError
from .base import OWN_KERNEL, READ, BaseHandler, kernel_credential

#: Each action's request body, a definition of the API's schema
#: (jupyter_gpumigrate_client/contract/api.schema.json).
ACTION_BODIES = {"suspend": "SuspendRequest", "resume": "ResumeRequest", "migrate": "MigrateRequest",
                 "transplant": "TransplantRequest", "back": "BackRequest"}


class KernelListHandler(BaseHandler):
    @kernel_credential(READ)
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json(self.views.list_kernels())


class KernelHandler(BaseHandler):
    @kernel_credential(READ)
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        try:
            self.send_json(self.views.kernel_view(kernel_id))
        except MigrateError as exc:
            self.send_migrate_error(exc)


class KernelActionHandler(BaseHandler):
    @kernel_credential(OWN_KERNEL)
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        # The schema checks the fields (and that a migrate names to_gpu or to_host); how a move to another
        # GPU may use the fast path (engine/stash.py): "auto" (the server invites an idle kernel), "off" (the
        # driver moves everything), "caller" (the kernel's own %migrate serves it: its credential only).
        body = self.json_body(ACTION_BODIES[action])
        if body is None:
            return
        fast_path = body.get("fast_path", "auto")
        if fast_path == "caller" and self.kernel_identity != kernel_id:
            self.send_error_message(
                400, "'fast_path' is one of auto, off (got 'caller'); 'caller' is for a kernel's own %migrate."
            )
            return
        if action == "transplant" and body.get("dry_run"):
            try:
                self.send_json(await self.operations.survey(kernel_id, body.get("to_gpu"), body.get("to_host")))
            except MigrateError as exc:
                self.send_migrate_error(exc)
            return
        idle_since = None
        if body.get("idle_since") is not None:
            try:
                idle_since = datetime.fromisoformat(body["idle_since"])
            except ValueError:
                self.send_error_message(400, f"'idle_since' is a time in ISO 8601, as a kernel's last_activity "
                                             f"(got {body['idle_since']!r}).")
                return
        try:
            op = self.operations.start(kernel_id, action, to_gpu=body.get("to_gpu"), to_host=body.get("to_host"),
                                       fast_path=fast_path, images=body.get("images"),
                                       accept_left=body.get("accept_left"), to_gpus=body.get("to_gpus"),
                                       idle_since=idle_since)
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return
        self.set_header("Location", f"{self.base_url}api/gpumigrate/operations/{op.id}")
        reply = op.to_dict()
        if op.stager is not None:  # only to the kernel that serves it: where to connect
            reply["stager"] = op.stager
        self.send_json(reply, status=202)
