"""What every handler of the API shares: authentication, authorization, errors as JSON."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin

from ..engine.errors import MigrateError
from ..operations import OperationManager


class BaseHandler(ExtensionHandlerMixin, APIHandler):
    # Moving a kernel reads and writes kernels: the server's authorizer decides with the "kernels"
    # resource, like jupyter_server's own kernel API (GET -> read, POST -> write).
    auth_resource = "kernels"

    @property
    def operations(self) -> OperationManager:
        return self.settings["gpumigrate_operations"]

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

    def json_body(self, allowed: dict[str, type]) -> dict[str, Any] | None:
        """The request's JSON object, checked against ``allowed`` field types; None after a 400 was sent."""
        raw = self.request.body.strip()
        if not raw:
            return {}
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self.send_error_message(400, f"The request body is not JSON: {exc}.")
            return None
        if not isinstance(body, dict):
            self.send_error_message(400, "The request body must be a JSON object.")
            return None
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            names = ", ".join(sorted(allowed)) or "none"
            self.send_error_message(400, f"Unknown field(s) {', '.join(unknown)}; allowed fields: {names}.")
            return None
        for key, kind in allowed.items():
            value = body.get(key)
            if value is None:
                continue
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                self.send_error_message(400, f"'{key}' must be a GPU index, a whole number >= 0 (got {value!r}).")
                return None
        return body
