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
from .engine.migration import REMOTE, RUNNING, SUSPENDED

log = logging.getLogger(__name__)

V1 = "v1.kernel.websocket.jupyter.org"
#: After the kernel runs again, a moment for the tab's ZMQ sockets to re-dial before its messages go.
SETTLE = 0.2


def header_of(message: str | bytes, subprotocol: str | None) -> tuple[str, dict] | None:
    """The channel and header of a WebSocket message from a notebook, or None if it cannot be read."""
    try:
        if subprotocol == V1:
            channel, parts = deserialize_msg_from_ws_v1(message)
            header = json.loads(parts[0]) if parts else {}
        else:
            msg = deserialize_binary_message(message) if isinstance(message, bytes) else json.loads(message)
            channel, header = msg.get("channel") or "shell", msg.get("header") or {}
    except Exception:  # noqa: BLE001  malformed (struct, JSON, UTF-8...): jupyter_server reports it itself
        return None
    return (channel, header) if isinstance(header, dict) else None


def shell_msg_type(message: str | bytes, subprotocol: str | None) -> str | None:
    """The ``msg_type`` of a WebSocket message bound for the shell channel, else None."""
    found = header_of(message, subprotocol)
    return found[1].get("msg_type") if found and found[0] == "shell" else None


def resuming(base: type[ZMQChannelsWebsocketConnection], operations: Any,
             resume_on_execute: bool = True) -> type[ZMQChannelsWebsocketConnection]:
    """``base``, holding messages for a suspended kernel and resuming it on a cell (see above)."""

    class ResumingConnection(base):  # type: ignore[valid-type,misc]
        _held: list[str | bytes] | None = None
        _releaser: asyncio.Task | None = None
        _cell: dict | None = None  # header of the latest held execute_request not yet answered by a resume
        _last_cell: dict | None = None  # header of the latest held execute_request
        _kernel_pid: int | None = None  # the process the held messages are for

        def _provisioner(self) -> Any:
            try:
                return operations.provisioner(self.kernel_id)
            except MigrateError:
                return None  # not one of ours, or gone

        def _pid(self, provisioner: Any) -> int | None:
            """The kernel's process: running, or the one its images will bring back (same PID)."""
            if provisioner.pid:
                return provisioner.pid
            manifest = provisioner.manifest()
            return manifest.pid if manifest is not None else None

        def _away(self) -> bool:
            """Whether the kernel is suspended, or being suspended or resumed (so it cannot answer)."""
            provisioner = self._provisioner()
            if provisioner is None:
                return False
            if provisioner.state == SUSPENDED:
                return True
            op = operations.active.get(self.kernel_id)
            # A transplant or a back too: what is sent meanwhile goes to whichever process is the kernel at
            # its end.
            return op is not None and op.action in ("suspend", "resume", "transplant", "back")

        async def prepare(self) -> None:
            if self._away():  # no kernel-info reply can come: do not wait a minute for it
                await self._register_session()
                self.session.key = self.kernel_manager.session.key
                known = getattr(self.kernel_manager, "_kernel_info_future", None)
                if known is not None and known.done():  # protocol adaptation, as jupyter_server does
                    self._finish_kernel_info(known.result())
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
            if not self._held:
                self._held = []
                provisioner = self._provisioner()
                self._kernel_pid = self._pid(provisioner) if provisioner is not None else None
            self._held.append(incoming_msg)
            found = header_of(incoming_msg, self.subprotocol)
            if found and found[0] == "shell" and found[1].get("msg_type") == "execute_request":
                self._cell = self._last_cell = found[1]  # a new cell: asks for a resume (again, if one failed)
            if self._releaser is None or self._releaser.done():
                self._releaser = asyncio.ensure_future(self._release_when_back())
                self._releaser.add_done_callback(self._released)

        def _released(self, task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                log.error("gpumigrate: held messages of kernel %s were dropped", self.kernel_id,
                          exc_info=task.exception())
                self._held = []

        def _tell(self, text: str, parent: dict | None) -> None:
            """A line on the tab's stderr, under the cell that asked (best effort)."""
            try:
                self.write_stderr(text, parent or {})
            except Exception:  # noqa: BLE001  the tab may be gone
                log.debug("gpumigrate: could not write to the tab of kernel %s", self.kernel_id)

        async def _release_when_back(self) -> None:
            while self._held and self.channels:
                provisioner = self._provisioner()
                if provisioner is None:  # shut down meanwhile: nothing to deliver to
                    self._held = []
                    return
                active = operations.active.get(self.kernel_id)
                if active is None and provisioner.state in (RUNNING, REMOTE):  # here, or relayed to another host
                    await asyncio.sleep(SETTLE)  # the tab's ZMQ sockets re-dial
                    if self._away():
                        continue
                    self._deliver(provisioner)
                    return
                # Otherwise suspended, or in between (an operation, a restart, a move of its images to disk,
                # which refuses a resume for its few seconds: asked once it is over): wait.
                if active is None and self._cell is not None and resume_on_execute and \
                        self.kernel_id not in operations.moving_images:
                    cell, self._cell = self._cell, None
                    op = operations.resume_for_cell(self.kernel_id)
                    if op.done and op.error:
                        self._tell(op.error, cell)
                    else:
                        asyncio.ensure_future(self._report(op, cell))
                await operations.wait_any_change(1.0)

        async def _report(self, op: Any, cell: dict) -> None:
            while not op.done:
                await operations.wait_change(op, op.version, 30)
            if op.error:
                self._tell(f"{op.error} The cell runs once the kernel is resumed.", cell)

        def _deliver(self, provisioner: Any) -> None:
            held, self._held, self._cell = self._held or [], [], None
            cell, self._last_cell = self._last_cell, None
            moved_on = self._kernel_pid in getattr(provisioner, "lineage", ())  # a transplant's or a back's
            if self._kernel_pid is not None and self._pid(provisioner) != self._kernel_pid and not moved_on:
                # Restarted (or shut down and started afresh) meanwhile: what was sent to the old
                # kernel must not run in the new one, as with any restart.
                log.info("gpumigrate: kernel %s was restarted while suspended: %d held messages dropped",
                         self.kernel_id, len(held))
                self._tell("The kernel was restarted while it was suspended: this cell did not run.", cell)
                return
            for message in held:
                try:
                    super().handle_incoming_message(message)
                except Exception:  # noqa: BLE001  a malformed message drops itself only, as on a running kernel
                    log.warning("gpumigrate: kernel %s: a held message could not be read and was dropped",
                                self.kernel_id, exc_info=True)

        def disconnect(self) -> None:
            if self._releaser is not None and not self._releaser.done():
                self._releaser.cancel()  # the tab is gone: what it sent goes with it
            self._held = []
            super().disconnect()

    ResumingConnection.__name__ = ResumingConnection.__qualname__ = f"Resuming{base.__name__}"
    return ResumingConnection
