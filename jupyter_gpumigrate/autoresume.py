"""What a notebook sends to a suspended kernel waits here; a cell run on it resumes it.

While a kernel is suspended (or being suspended or resumed), what its notebook's WebSocket sends is
held by the server, in order, instead of going into ZMQ sockets with no kernel behind them. Once the
kernel runs again and its clients are back, the held messages go on in order: the first cell's output
is never lost to an IOPub subscription that is not yet re-established. An ``execute_request`` among
them resumes the kernel (``c.GPUMigrateApp.resume_on_execute``); other requests (kernel info,
completion, ...) never do: opening or typing in a notebook does not bring a kernel back onto a GPU.

A tab opened on a suspended kernel connects at once: jupyter_server would otherwise wait for a
kernel-info reply (and nudge) for up to a minute before reading anything the tab sends.

jupyter_server builds each notebook WebSocket's connection from the class in the
``kernel_websocket_connection_class`` setting; this module subclasses the configured one.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from jupyter_server.services.kernels.connection.base import deserialize_binary_message, deserialize_msg_from_ws_v1
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection

from .engine.errors import MigrateError
from .engine.migration import RUNNING, SUSPENDED

log = logging.getLogger(__name__)

V1 = "v1.kernel.websocket.jupyter.org"
#: After the kernel runs again, a moment for the tab's ZMQ sockets to re-dial before its messages go.
SETTLE = 0.2


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


def resuming(base: type[ZMQChannelsWebsocketConnection], operations: Any,
             resume_on_execute: bool = True) -> type[ZMQChannelsWebsocketConnection]:
    """``base``, holding messages for a suspended kernel and resuming it on a cell (see above)."""

    class ResumingConnection(base):  # type: ignore[valid-type,misc]
        _held: list[str | bytes] | None = None
        _releaser: asyncio.Task | None = None
        _wants_resume = False

        def _away(self) -> bool:
            """Whether the kernel is suspended, or being suspended or resumed (so it cannot answer)."""
            try:
                provisioner = operations.provisioner(self.kernel_id)
            except MigrateError:
                return False  # not one of ours
            if provisioner.state == SUSPENDED:
                return True
            op = operations.active.get(self.kernel_id)
            return op is not None and op.action in ("suspend", "resume")

        async def prepare(self) -> None:
            if self._away():  # no kernel-info reply can come: do not wait a minute for it
                await self._register_session()
                self.session.key = self.kernel_manager.session.key
                return
            await super().prepare()

        def nudge(self) -> asyncio.Future:
            if self._away():  # the channels re-dial by themselves once the kernel is back
                done: asyncio.Future = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done
            return super().nudge()

        def handle_incoming_message(self, incoming_msg: str) -> None:
            try:
                if self._held or self._away():
                    self._hold(incoming_msg)
                    return
            except Exception:  # never lose the message because of us
                log.exception("gpumigrate: could not check whether kernel %s is suspended", self.kernel_id)
            super().handle_incoming_message(incoming_msg)

        def _hold(self, incoming_msg: str | bytes) -> None:
            if self._held is None:
                self._held = []
            self._held.append(incoming_msg)
            if shell_msg_type(incoming_msg, self.subprotocol) == "execute_request":
                self._wants_resume = True
            if self._releaser is None or self._releaser.done():
                self._releaser = asyncio.ensure_future(self._release_when_back())

        async def _release_when_back(self) -> None:
            asked = False
            while self._held and self.channels:
                try:
                    provisioner = operations.provisioner(self.kernel_id)
                except MigrateError:  # shut down meanwhile: nothing to deliver to
                    self._held = []
                    return
                active = operations.active.get(self.kernel_id)
                if active is None and provisioner.state != SUSPENDED:
                    # Running again (resumed, restarted) or in a state jupyter_server handles itself.
                    if provisioner.state == RUNNING:
                        await asyncio.sleep(SETTLE)
                    held, self._held, self._wants_resume = self._held, [], False
                    for message in held:
                        super().handle_incoming_message(message)
                    return
                if active is None and self._wants_resume and resume_on_execute and not asked:
                    operations.resume_for_cell(self.kernel_id)
                    asked = True  # once: a resume that could not start is reported, not retried in a loop
                await operations.wait_any_change(1.0)

    ResumingConnection.__name__ = ResumingConnection.__qualname__ = f"Resuming{base.__name__}"
    return ResumingConnection
