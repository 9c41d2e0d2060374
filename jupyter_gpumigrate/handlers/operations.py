"""GET /operations and GET /operations/{id} (with ?after=N: wait until the operation changes)."""

from __future__ import annotations

from jupyter_server.auth.decorator import authorized
from tornado import web

from ..engine.errors import MigrateError
from .base import OWN_OPERATION, BaseHandler, kernel_credential

#: The longest a GET with ?after= waits for a change before it answers with the operation as it is.
LONG_POLL_S = 25.0


class OperationListHandler(BaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.send_json([op.to_dict() for op in self.operations.operations.values()])


class OperationHandler(BaseHandler):
    @kernel_credential(OWN_OPERATION)
    @web.authenticated
    @authorized
    async def get(self, op_id: str) -> None:
        after = self.get_query_argument("after", None)
        try:
            op = self.operations.get(op_id)
            if after is not None:
                if not (after.isascii() and after.isdigit() and len(after) <= 18):
                    self.send_error_message(400, f"'after' must be a version number (got {after!r}).")
                    return
                # Answer as soon as the operation has moved past the version the caller has seen.
                await self.operations.wait_change(op, int(after), LONG_POLL_S)
            self.send_json(op.to_dict())
        except MigrateError as exc:
            self.send_migrate_error(exc)
