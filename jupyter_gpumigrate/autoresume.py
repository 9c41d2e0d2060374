"""A cell run on a suspended kernel resumes it.

While a kernel is suspended, what its notebook sends waits in the server's ZMQ sockets (they reconnect
by themselves once the kernel is back, FACTS.md). So resuming on the first ``execute_request`` is all
that "run a cell to resume" needs: the request is passed on as usual and the restored kernel answers it.

jupyter_server builds each notebook WebSocket's connection from the class in the
``kernel_websocket_connection_class`` setting; this module subclasses the configured one and only
looks at what goes by. Other requests (kernel info, completion, ...) never resume a kernel: opening a
notebook or typing in it should not bring a kernel back onto a GPU.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jupyter_server.services.kernels.connection.base import deserialize_binary_message, deserialize_msg_from_ws_v1
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from .engine.errors import MigrateError
from .engine.migration import SUSPENDED

log = logging.getLogger(__name__)

V1 = "v1.kernel.websocket.jupyter.org"


def shell_msg_type(message: str | bytes, subprotocol: str | None) -> str | None:
    """The ``msg_type`` of a WebSocket message bound for the shell channel, else None."""
    try:
        if subprotocol == V1:
            channel, parts = deserialize_msg_from_ws_v1(message)
            header = json.loads(parts[0]) if parts else {}
        else:
            msg = deserialize_binary_message(message) if isinstance(message, bytes) else json.loads(message)
            channel, header = msg.get("channel") or "shell", msg.get("header") or {}
    except (ValueError, IndexError, TypeError, AttributeError):
        return None  # jupyter_server reports malformed messages itself
    return header.get("msg_type") if channel == "shell" and isinstance(header, dict) else None


def resuming(base: type[ZMQChannelsWebsocketConnection], operations: Any) -> type[ZMQChannelsWebsocketConnection]:
    """``base``, with an ``execute_request`` to a suspended kernel starting its resume first."""

    class ResumingConnection(base):  # type: ignore[valid-type,misc]
        def handle_incoming_message(self, incoming_msg: str) -> None:
            try:
                self._resume_if_suspended(incoming_msg)
            except Exception:  # never lose the message because of us
                log.exception("gpumigrate: could not check whether kernel %s must be resumed", self.kernel_id)
            super().handle_incoming_message(incoming_msg)

        def _resume_if_suspended(self, incoming_msg: str | bytes) -> None:
            try:
                provisioner = operations.provisioner(self.kernel_id)
            except MigrateError:
                return  # not one of ours
            if provisioner.state != SUSPENDED or self.kernel_id in operations.active:
                return
            if shell_msg_type(incoming_msg, self.subprotocol) != "execute_request":
                return
            operations.resume_for_cell(self.kernel_id)

    ResumingConnection.__name__ = ResumingConnection.__qualname__ = f"Resuming{base.__name__}"
    return ResumingConnection
