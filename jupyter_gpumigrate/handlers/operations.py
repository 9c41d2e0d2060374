"""GET /operations and GET /operations/{id}."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..engine.errors import MigrateError
from .base import BaseHandler


class OperationListHandler(BaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json([op.to_dict() for op in self.operations.operations.values()])


class OperationHandler(BaseHandler):
    @web.authenticated
    @authorized
    async def get(self, op_id: str) -> None:
        try:
            self.send_json(self.operations.get(op_id).to_dict())
        except MigrateError as exc:
            self.send_migrate_error(exc)
