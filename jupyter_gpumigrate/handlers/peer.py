"""/api/gpumigrate/peer/...: what a peer server calls to move a kernel here and back (peers.py).

Every route needs ``Authorization: gpumigrate-peer <token>`` with this server's
``c.GPUMigrateApp.peer_token``; with none configured, the server takes no kernels from peers.
These routes stand for a peer server, never for a user: the server's own users cannot call them
with their tokens, and a peer cannot call any other route with its token.
"""

from __future__ import annotations

import asyncio
import copy
import errno
import ipaddress
import json
import os
from typing import Any
from urllib.parse import unquote

from tornado import web
from tornado.ioloop import PeriodicCallback
from tornado.http1connection import HTTP1Connection
from tornado.iostream import IOStream
from tornado.websocket import WebSocketHandler

from ..engine import hostfit
from ..engine.errors import MigrateError
from .. import bulk
from ..peers import BLOCK, CHECKSUM, DETACH_MIN, FileSink, GuestHost, credential_ok, drop_mark, follows
from ..engine.migration import RUNNING
from ..relay import ENDED, RelayServerEnd
from .base import BaseHandler


def peer_allowed(settings: dict, authorization: str) -> tuple[bool, str]:
    """(allowed, why not) for an Authorization header on a peer route."""
    return credential_ok(settings.get("gpumigrate_peer_token") or "", authorization)


class PeerHandler(BaseHandler):
    """A route for peers only. The peer token replaces the server's user authentication here."""

    # A peer's bodies name a kernel's processes, threads, open files and sockets: a large tree has thousands.
    max_body = 64 << 20
    max_values = 4_000_000

    @property
    def guests(self) -> GuestHost:
        return self.settings["gpumigrate_guests"]

    async def prepare(self) -> None:  # type: ignore[override]
        if not self.check_host():
            raise web.HTTPError(403)
        allowed, why = peer_allowed(self.settings, self.request.headers.get("Authorization", ""))
        if not allowed:
            self.log.warning("gpumigrate: refused a peer request from %s: %s", self.request.remote_ip, why)
            raise web.HTTPError(403, why)
        self.current_user = self._jupyter_current_user = None

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = exc.log_message if isinstance(exc, web.HTTPError) and exc.log_message else self._reason
        self.finish(json.dumps({"message": message, "reason": self._reason_for(status_code)}))

    async def run(self, work: Any, *args: Any) -> Any:
        """Blocking engine work in a thread; a MigrateError becomes its HTTP status and sentence."""
        try:
            return await asyncio.to_thread(work, *args)
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return None


class NoPeerRouteHandler(PeerHandler):
    """A path under the peer routes that none takes, asked with a valid peer credential: a JSON 404 that says so
    (the user API's catch-all would ask for a user, and the peer would read the 403 as its token refused)."""

    def _no_route(self, *args: Any, **kwargs: Any) -> None:
        self.send_error_message(404, f"No peer route of jupyter-gpumigrate's API is {self.request.path}: the two "
                                     "hosts may run different versions of jupyter-gpumigrate (`jupyter gpumigrate "
                                     "--version` on each).")

    get = post = put = patch = delete = head = _no_route


class CheckHandler(PeerHandler):
    async def post(self) -> None:
        body = self.json_body("PeerCheckRequest")
        if body is None:
            return
        needs = hostfit.Requirements.from_dict(body["requirements"])
        problems = await asyncio.to_thread(self.guests.check, needs, body.get("gpu"), body.get("to_gpu"),
                                           self.request.remote_ip or "")
        self.log.info("gpumigrate: peer %s asks to move kernel %s here: %s", self.request.remote_ip,
                      body.get("kernel_id"), "; ".join(problems) or "fine")
        # "stash": this host has a kernel write and read back its large buffers when its owner sends the key;
        # "checksum": the image files' checksum it takes and gives (an older peer says none: it is refused)
        # "growing": it takes an image file sent in chunks as a dump writes it
        # "bulk_port", "bulk_tls": the port of its bulk listener (bulkd.py), None while it has none
        # "prefetch": it begins a GPU kernel's prefetch as its images arrive (POST images/{id}/prefetch)
        self.send_json({"problems": problems, "stash": True, "checksum": CHECKSUM, "growing": True,
                        "bulk_port": self.guests.bulk_port, "bulk_tls": self.guests.bulk_tls, "prefetch": True})


class TransplantCheckHandler(PeerHandler):
    async def post(self) -> None:
        body = self.json_body("PeerTransplantCheckRequest")
        if body is None:
            return
        problems = await asyncio.to_thread(self.guests.check_transplant, body["kernel_id"], body["kernel_name"],
                                           body["listens"], body["bytes"], body["gpu_bytes"], body["to_gpu"],
                                           self.request.remote_ip or "")
        self.log.info("gpumigrate: peer %s asks to take kernel %s's objects here: %s", self.request.remote_ip,
                      body["kernel_id"], "; ".join(problems) or "fine")
        self.send_json({"problems": problems, "checksum": CHECKSUM})


class ImagesHandler(PeerHandler):
    """POST: start receiving a kernel's images (replacing any old ones); GET: list them with checksums
    (``?checksums=false``: names and sizes only, at once)."""

    async def post(self, kernel_id: str) -> None:
        body = self.json_body("PeerImagesRequest")
        if body is None:
            return
        try:
            self.guests.begin(kernel_id, int(body.get("bytes", 0)))
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return
        self.send_json({"kernel_id": kernel_id}, status=201)

    async def get(self, kernel_id: str) -> None:
        growing, checksums = _flag(self, "growing", False), _flag(self, "checksums", True)
        if growing is None or checksums is None:
            return
        if growing:  # the pages its dump has begun, while it runs
            answer = await self.run(self.guests.growing, kernel_id)
            if answer is not None:
                self.send_json(answer)
            return
        files = await self.run(self.guests.listing, kernel_id, checksums)
        if files is not None:
            self.send_json({"files": files})


def _flag(handler: PeerHandler, name: str, default: bool) -> bool | None:
    """A true/false query argument; None once a 400 said that it is neither."""
    value = handler.get_query_argument(name, "true" if default else "false").lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    handler.send_error_message(400, f"?{name}= takes true or false, not {value[:40]!r}.")
    return None


class CompleteHandler(PeerHandler):
    async def post(self, kernel_id: str) -> None:
        body = self.json_body("PeerCompleteRequest")
        if body is None:
            return
        try:
            self.guests.complete(kernel_id, body["files"], self.request.remote_ip or "")
        except (MigrateError, KeyError, ValueError, TypeError) as exc:
            self.guests.store.remove(kernel_id)
            self.send_error_message(400, str(exc))
            return
        self.send_json({"kernel_id": kernel_id})


class PrefetchHandler(PeerHandler):
    """POST: while a GPU kernel's images arrive, begin its restore's prefetch here (GuestHost.begin_prefetch)."""

    async def post(self, kernel_id: str) -> None:
        body = self.json_body("PeerPrefetchRequest")
        if body is None:
            return
        answer = await self.run(self.guests.begin_prefetch, kernel_id, body["index"], [body["gpu"]],
                                body.get("to_gpu"))
        if answer is not None:
            self.send_json(answer)


class _WholeReads:
    """A connection's stream that reads its body in whole chunks.

    tornado reads a streamed body with partial reads, and each returns as soon as anything arrived: over
    TLS one record, 16 KiB, and a trip through the event loop (a future, a coroutine, ``data_received``)
    for each. At 16 KiB a time the receiving server's loop took 0.5-0.65 GB/s of a 1.4 GB/s TLS link
    (bench/results/2026-11-26-host-move.md). Whole reads of :data:`~..peers.BLOCK` gather the records in
    tornado's own read loop and wake the handler once a MiB.
    """

    def __init__(self, stream: IOStream) -> None:
        self._stream = stream

    def read_bytes(self, num_bytes: int, partial: bool = False) -> Any:
        return self._stream.read_bytes(num_bytes, partial=False)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def read_body_whole(connection: Any) -> None:
    """Have this request's body read in chunks of :data:`~..peers.BLOCK` (see :class:`_WholeReads`); a
    connection that is not tornado's HTTP/1 one is left as it is."""
    if isinstance(connection, HTTP1Connection) and isinstance(getattr(connection, "stream", None), IOStream):
        params = copy.copy(connection.params)  # this request's own: the server's are shared by every connection
        params.chunk_size = BLOCK
        connection.params = params
        connection.stream = _WholeReads(connection.stream)  # type: ignore[assignment]


@web.stream_request_body
class ImageFileHandler(PeerHandler):
    """PUT one image file, streamed to disk (0600) as it arrives and checksummed: checked against the XXH3-64
    in its X-Content-XXH3 header (16 hex digits), or, without one, against the sender's list when the images
    are complete (the sender checksums as it sends: one read of each file); GET it back, for the return trip."""

    _file: FileSink | None = None
    #: the error of a write that failed mid-file (a full disk)
    _failed: OSError | None = None

    async def prepare(self) -> None:  # type: ignore[override]
        await super().prepare()
        if self.request.method != "PUT":
            return
        kernel_id, name = (unquote(self.path_kwargs[k]) for k in ("kernel_id", "name"))
        try:
            self._path = self.guests.image_path(kernel_id, name)
        except MigrateError as exc:
            raise web.HTTPError(exc.http_status, str(exc)) from exc
        if self.request.headers.get("Expect", "").lower() == "100-continue":
            self._in_thread(kernel_id, name)
            return
        self.request.connection.set_max_body_size(bulk.MAX_IMAGE_FILE)  # type: ignore[union-attr]
        read_body_whole(self.request.connection)
        drop_mark(self._path)
        fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        self._file = FileSink(fd)

    async def data_received(self, chunk: bytes) -> None:
        if self._file is None:
            return  # a write failed: the rest of the body is read and dropped, and put() says why
        try:
            await self._file.put(chunk)
        except OSError as exc:
            self._failed = exc
            sink, self._file = self._file, None
            sink.abort()
            self._path.unlink(missing_ok=True)

    def _in_thread(self, kernel_id: str, name: str) -> None:
        """The body goes into the file in a thread of its own, off the event loop (bulk.py)."""
        try:
            length = bulk.body_length(self.request.headers)
        except ValueError as exc:
            raise web.HTTPError(411, str(exc)) from None
        path = self._path
        sock, leftover = bulk.detach(self)
        bulk.in_thread(lambda: bulk.receive(sock, leftover, length, path,
                                            lambda digest: self._verdict(kernel_id, name, digest)), name)

    def _verdict(self, kernel_id: str, name: str, digest: str) -> tuple[int, dict]:
        """(status, answer) for ``name``, arrived whole with this checksum (peers.Checksum)."""
        return bulk.verdict(name, digest, self.request.headers.get("X-Content-XXH3"),
                            lambda checksum: self.guests.received_file(kernel_id, name, checksum))

    async def put(self, kernel_id: str, name: str) -> None:
        failed, digest = self._failed, ""
        if failed is None and self._file is not None:
            sink, self._file = self._file, None
            try:
                digest = await sink.close()
            except OSError as exc:
                failed = exc
        if failed is not None:
            self._path.unlink(missing_ok=True)
            full = failed.errno == errno.ENOSPC
            why = failed.strerror or str(failed)
            then = ": free space here and send the images again" if full else ""
            self.send_error_message(507 if full else 500, f"{name} could not be written here ({why}){then}.")
            return
        status, answer = self._verdict(unquote(kernel_id), unquote(name), digest)
        if status >= 400:
            self._path.unlink(missing_ok=True)
        self.send_json(answer, status=status)

    def on_connection_close(self) -> None:
        # The sender went away mid-file: drop the partial file, never restore from it.
        if self._file is not None:
            sink, self._file = self._file, None
            sink.abort()
            self._path.unlink(missing_ok=True)

    async def get(self, kernel_id: str, name: str) -> None:
        try:
            path = self.guests.image_path(kernel_id, name)
        except MigrateError as exc:
            self.send_migrate_error(exc)
            return
        if not path.is_file() or path.is_symlink():
            self.send_error_message(404, f"Kernel {kernel_id} has no image file {name} here.")
            return
        growing = _flag(self, "growing", False)
        if growing is None:
            return
        run = self.guests.dumping.get(unquote(kernel_id)) if self.guests.serve_growing else None
        if growing and run is not None and follows(name):
            # its dump (or the stash before it) still writes it: sent in chunks, as it grows, until it is whole
            # (bulk.py; one sender at a time, here or in the bulk listener)
            sock, _ = bulk.detach(self)
            bulk.in_thread(lambda: bulk.send_growing(sock, path, run), name)
            return
        size = path.stat().st_size
        if size >= DETACH_MIN:  # sent by a thread of its own, off the event loop (bulk.py)
            sock, _ = bulk.detach(self)
            bulk.in_thread(lambda: bulk.send(sock, path, size), name)
            return
        self.set_header("Content-Type", "application/octet-stream")
        self.set_header("Content-Length", str(size))
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                self.write(block)
                await self.flush()
        self.finish()


class GuestHandler(PeerHandler):
    async def get(self, kernel_id: str) -> None:
        info = await self.run(self.guests.describe, kernel_id)
        if info is not None:
            self.send_json(info)

    async def delete(self, kernel_id: str) -> None:
        self.guests.stop_relay(kernel_id)
        async with self.guests.lock(kernel_id):
            await asyncio.to_thread(self.guests.discard, kernel_id)
        self.log.info("gpumigrate: kernel %s, hosted for a peer, discarded", kernel_id)
        self.set_status(204)
        self.finish()


class GuestActionHandler(PeerHandler):
    #: each action's request body, a definition of the API's schema
    #: (jupyter_gpumigrate_client/contract/api.schema.json)
    BODIES = {"restore": "PeerRestoreRequest", "dump": "PeerDumpRequest", "resume": "PeerResumeRequest",
              "signal": "PeerSignalRequest", "transplant": "PeerTransplantRequest", "switch": "PeerSwitchRequest"}

    async def post(self, kernel_id: str, action: str) -> None:
        body = self.json_body(self.BODIES[action])
        if body is None:
            return
        if action == "signal":
            try:
                self.guests.signal(kernel_id, body["signum"])
            except (MigrateError, ValueError, ProcessLookupError) as exc:
                self.send_error_message(409, f"Cannot signal kernel {kernel_id} here: {exc}")
                return
            self.send_json({})
            return
        async with self.guests.lock(kernel_id):
            if action == "transplant":
                result = await self.run(self.guests.load_transplant, kernel_id, body["files"], body["kernel_name"],
                                        body["connection_info"], body["to_gpu"], float(body["wait"]),
                                        self.request.remote_ip or "")
            elif action == "switch":
                result = await self.run(self.guests.switch_transplant, kernel_id)
            elif action == "restore":
                result = await self.run(self.guests.restore, kernel_id, body.get("to_gpu"), body.get("key"), True)
            elif action == "dump":
                self.guests.stop_relay(kernel_id)
                result = await self.run(self.guests.dump, kernel_id, body.get("key"), body.get("stash_min"))
            elif body.get("stash_left"):  # a guest taken back without its large buffers: those, and no more
                result = await self.run(self.guests.give_back_left, kernel_id, body.get("key"))
            else:  # resume: the undo of a dump
                result = await self.run(self.guests.restore, kernel_id, None, body.get("key"))
        if result is not None:
            timings = result.get("timings") if isinstance(result, dict) else None
            self.log.info("gpumigrate: kernel %s hosted for a peer: %s done%s", kernel_id, action,
                          f" ({', '.join(f'{k} {v:.2f} s' for k, v in timings.items())})" if timings else "")
            self.send_json(result)


#: How often the relay's far end looks whether its kernel's process still runs (milliseconds).
WATCH_MS = 1000


class ChannelsHandler(WebSocketHandler):
    """The relay's far end: ZMQ frames to and from the kernel that runs here (relay.py)."""

    end: RelayServerEnd | None = None
    #: looks every WATCH_MS whether the kernel's process still runs
    _watch: PeriodicCallback | None = None

    @property
    def max_message_size(self) -> int:  # type: ignore[override]
        return 1 << 30  # one ZMQ message (a large output, a widget's buffer), not a stream

    @property
    def guests(self) -> GuestHost:
        return self.settings["gpumigrate_guests"]

    async def get(self, *args: Any, **kwargs: Any) -> None:
        allowed, why = peer_allowed(self.settings, self.request.headers.get("Authorization", ""))
        if not allowed:
            self.set_status(403)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": why, "reason": "Forbidden"}))
            return
        if args and args[0] not in self.guests.guests:
            # Before the handshake: the peer's dial fails, and its relay keeps what it holds for the next one
            # (503 while this server is taking its guests back still).
            back = self.guests.back.is_set()
            self.set_status(404 if back else 503)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": f"This server hosts no kernel {args[0]} for a peer." if back else
                                    "This server is taking back the kernels it hosts for peers: dial again.",
                                    "reason": "Not Found" if back else "Service Unavailable"}))
            return
        await super().get(*args, **kwargs)

    async def open(self, kernel_id: str) -> None:  # type: ignore[override]
        try:
            guest = self.guests.guest(kernel_id)
            api = json.loads(self.get_argument("api", "null") or "null")
            api_listen = (str(api[0]), int(api[1])) if api else None
            if api_listen is not None and not (ipaddress.ip_address(api_listen[0]).is_loopback
                                               and 0 < api_listen[1] < 65536):
                # The kernels' server listens on a loopback port (app.py): a listener here on any other
                # address would open the peer's server to this host's network.
                raise ValueError(f"the kernel's server must be on a loopback port, not {api_listen[0]}:"
                                 f"{api_listen[1]}")
            guest.api_listen = api_listen
        except (MigrateError, ValueError, TypeError, IndexError, RecursionError) as exc:
            self.close(4004, str(exc)[:120])
            return
        if self._ended(guest):
            return
        if not self.guests.claim(guest):  # its peer has it: never discarded as unclaimed from now on
            self.close(4004, "This kernel is being discarded here: no relay claimed it in time.")
            return
        self.guests.stop_relay(kernel_id)
        self.end = RelayServerEnd(guest.kernel_connection_info, self._send)
        self.end.pid = guest.pid
        self.end.start()
        self.guests.relays[kernel_id] = self
        self._watch = PeriodicCallback(lambda: self._ended(guest), WATCH_MS)
        self._watch.start()
        if guest.api_listen is not None:
            await self.guests.api_listeners.join(self.end, guest.api_listen, guest.peer)

    def _ended(self, guest: Any) -> bool:
        """Whether the kernel's process ended here while it ran (killed, or it exited): then the relay is closed
        saying so (relay.ENDED), and the peer's restarter starts the kernel again there. Not while a move or a
        dump has it, nor where its images are kept (suspended, broken)."""
        if guest.state != RUNNING or guest.runs():
            return False
        self.close(ENDED, "The kernel's process ended here.")
        return True

    async def _send(self, data: bytes) -> None:
        await self.write_message(data, binary=True)

    async def on_message(self, message: str | bytes) -> None:
        if self.end is not None:
            await self.end.deliver(message if isinstance(message, bytes) else message.encode())

    def on_close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        if self.end is not None:
            self.guests.api_listeners.leave(self.end)
            self.end.stop()
            self.end = None

    def stop(self) -> None:
        self.on_close()
        self.close()
