"""GET /gpus and POST /gpus/{index}/drain."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..engine.errors import MigrateError
from .base import READ, BaseHandler, kernel_credential


class GpuListHandler(BaseHandler):
    @kernel_credential(READ)
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json(self.views.gpus_view())


class DrainHandler(BaseHandler):
    # No kernel credential here: draining moves other kernels, which only a user of the server may do.
    @web.authenticated
    @authorized
    async def post(self, index: str) -> None:
        if len(index) > 6:  # no machine has a million GPUs: said as for any index that is not here, in JSON
            self.send_error_message(404, f"This host has no GPU {index[:12]}{'...' if len(index) > 12 else ''}: "
                                         "list them with GET api/gpumigrate/gpus.")
            return
        body = self.json_body("DrainRequest")
        if body is None:
            return
        try:
            op = self.operations.drain(int(index), to_gpu=body.get("to_gpu"), transplant=body.get("transplant", False))
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return
        self.set_header("Location", f"{self.base_url}api/gpumigrate/operations/{op.id}")
        self.send_json(op.to_dict(), status=202)
