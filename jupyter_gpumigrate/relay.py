"""The relay: a kernel that runs on another host keeps its ports on this one.

After a move, the kernel listens on its old ports on the other host (B). This host (A) binds the same
ports again and carries every ZMQ message, as it is, over one WebSocket to B's server, authenticated
with B's peer credential (TLS between hosts). B's end hands the messages to the kernel. A's kernel
manager, its WebSocket bridge and the open notebook tab keep their connection info: their sockets
re-dial by themselves, as after a local resume. The kernel's HMAC signatures are end to end: the
relay neither reads nor signs anything.

    channel                on A (bound to the old port)     on B (connected to the kernel)
    shell, control, stdin  ROUTER                           a DEALER per client, with its routing id
    hb                     ROUTER                           a DEALER per client (the kernel echoes)
    iopub                  XPUB (subscriptions forwarded)   XSUB

The same WebSocket carries the kernel's own calls to its server (``%migrate`` inside the kernel): B
listens on the loopback port the kernel knows its server by (one listener for all the kernels of one
peer, :class:`ApiListeners`), and each connection to it is a stream that A opens to its own server.

Wire format, one binary WebSocket message each: a kind byte, then
- ZMQ (kinds 0-4, the channels above): the frames, each as a 4-byte big-endian length and its bytes;
- a stream (kinds 8 open, 9 data, 10 close): a 4-byte stream id, then the data.

pyzmq and tornado's WebSocket are both here already (jupyter_server's); a ZMQ proxy would not do,
as one end of each pair is a WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from .engine import netstate, proctree

log = logging.getLogger(__name__)

CHANNELS = ("shell", "control", "stdin", "hb", "iopub")
OPEN, DATA, CLOSE = 8, 9, 10
#: the socket type at each end, per channel
A_SIDE = {"shell": zmq.ROUTER, "control": zmq.ROUTER, "stdin": zmq.ROUTER, "hb": zmq.ROUTER, "iopub": zmq.XPUB}
B_SIDE = {"shell": zmq.DEALER, "control": zmq.DEALER, "stdin": zmq.DEALER, "hb": zmq.DEALER, "iopub": zmq.XSUB}
CHUNK = 256 * 1024

Send = Callable[[bytes], Awaitable[Any]]


def pack_frames(kind: int, frames: list[bytes]) -> bytes:
    return bytes([kind]) + b"".join(struct.pack(">I", len(f)) + f for f in frames)


def unpack_frames(data: bytes) -> list[bytes]:
    frames, at = [], 1
    while at < len(data):
        (n,) = struct.unpack_from(">I", data, at)
        frames.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return frames


def pack_stream(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return bytes([kind]) + struct.pack(">I", stream) + payload


def _addr(info: dict, channel: str) -> str:
    return f"{info.get('transport', 'tcp')}://{info.get('ip', '127.0.0.1')}:{info[channel + '_port']}"


class ZmqEnd:
    """One end's sockets: A binds a ROUTER or XPUB per channel where the kernel's ports were; B connects
    to the kernel. Messages from them go to ``send``.

    On B, each client that A's ROUTER sees gets a DEALER of its own, with the client's routing id: the
    kernel then addresses a client exactly as when the client is connected to it directly, so the
    reply to a cell that ran while the kernel moved finds its client on either side.
    """

    MAX_CLIENTS = 64  # per channel, on B; the least recently used DEALER goes first

    def __init__(self, connection_info: dict, kinds: dict[str, int], send: Send) -> None:
        self.info = connection_info
        self.kinds = kinds
        self.send = send
        self.context = zmq.asyncio.Context.instance()
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.clients: dict[str, dict[bytes, tuple[zmq.asyncio.Socket, asyncio.Task]]] = {}
        self.tasks: list[asyncio.Task] = []

    def open(self, bind: bool) -> None:
        if not bind:
            # B: XSUB for IOPub now; a DEALER per client as clients appear.
            sock = self.context.socket(zmq.XSUB)
            sock.linger = 0
            sock.connect(_addr(self.info, "iopub"))
            self.sockets["iopub"] = sock
            self.clients = {c: {} for c in CHANNELS if c != "iopub"}
            self.tasks = [asyncio.ensure_future(self._pump(CHANNELS.index("iopub"), sock))]
            return
        try:
            for channel in CHANNELS:
                sock = self.context.socket(self.kinds[channel])
                sock.linger = 0
                if self.kinds[channel] == zmq.XPUB:
                    sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription reaches the kernel's welcome
                self.sockets[channel] = sock
                sock.bind(_addr(self.info, channel))
        except zmq.ZMQError:
            self.close()
            raise
        self.tasks = [asyncio.ensure_future(self._pump(i, self.sockets[c])) for i, c in enumerate(CHANNELS)]

    async def _pump(self, kind: int, sock: zmq.asyncio.Socket, routing_id: bytes | None = None) -> None:
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                if routing_id is not None:
                    frames = [routing_id, *frames]
                await self.send(pack_frames(kind, frames))
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        except Exception:  # the WebSocket went away: the owner notices and decides
            log.debug("relay: channel %s pump stopped", CHANNELS[kind], exc_info=True)

    def _client(self, kind: int, routing_id: bytes) -> zmq.asyncio.Socket:
        channel = CHANNELS[kind]
        clients = self.clients[channel]
        if routing_id in clients:
            clients[routing_id] = clients.pop(routing_id)  # most recently used last
            return clients[routing_id][0]
        if len(clients) >= self.MAX_CLIENTS:
            old_sock, old_task = clients.pop(next(iter(clients)))
            old_task.cancel()
            old_sock.close(linger=0)
        sock = self.context.socket(zmq.DEALER)
        sock.linger = 0
        # ZMQ reserves ids that start with a zero byte (those it makes up itself): such a client
        # gets another id here; its replies still come back to it through this DEALER.
        sock.setsockopt(zmq.ROUTING_ID, routing_id if routing_id[:1] != b"\0" else b"gm" + routing_id)
        sock.connect(_addr(self.info, channel))
        clients[routing_id] = (sock, asyncio.ensure_future(self._pump(kind, sock, routing_id)))
        return sock

    async def deliver(self, data: bytes) -> None:
        kind = data[0]
        channel = CHANNELS[kind]
        frames = unpack_frames(data)
        if channel in self.clients:  # B, a client's message: on that client's own DEALER
            if not frames or not frames[0]:
                return
            sock = self._client(kind, frames[0])
            if len(frames) == 2 and frames[1] == b"":
                return  # a hello (RelayClient.introduce): the client's DEALER is ready now
            await sock.send_multipart(frames[1:])
            return
        sock = self.sockets.get(channel)
        if sock is not None:
            if self.kinds.get(channel) == zmq.ROUTER and len(frames) < 2:
                return
            await sock.send_multipart(frames)

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        for clients in self.clients.values():
            for sock, task in clients.values():
                task.cancel()
                sock.close(linger=0)
        self.sockets.clear()
        self.clients = {}
        self.tasks = []


class Streams:
    """TCP connections carried over the WebSocket, each with an id; ``dial`` opens the far side's."""

    def __init__(self, send: Send, dial: Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]
                 | None = None) -> None:
        self.send = send
        self.dial = dial
        self.writers: dict[int, asyncio.StreamWriter] = {}
        self.tasks: dict[int, asyncio.Task] = {}
        self.next_id = 1

    def adopt(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, stream: int | None = None) -> int:
        if stream is None:
            stream, self.next_id = self.next_id, self.next_id + 1
        self.writers[stream] = writer
        self.tasks[stream] = asyncio.ensure_future(self._pump(stream, reader))
        return stream

    async def _pump(self, stream: int, reader: asyncio.StreamReader) -> None:
        try:
            while data := await reader.read(CHUNK):
                await self.send(pack_stream(DATA, stream, data))
        except (asyncio.CancelledError, ConnectionError):
            pass
        except Exception:
            log.debug("relay: stream %s stopped", stream, exc_info=True)
        finally:
            with contextlib.suppress(Exception):
                await self.send(pack_stream(CLOSE, stream))
            self._forget(stream)

    async def deliver(self, data: bytes) -> None:
        kind, (stream,) = data[0], struct.unpack_from(">I", data, 1)
        if kind == OPEN and self.dial is not None:
            try:
                reader, writer = await self.dial()
            except OSError:
                await self.send(pack_stream(CLOSE, stream))
                return
            self.adopt(reader, writer, stream)
        elif kind == DATA and stream in self.writers:
            self.writers[stream].write(data[5:])
            with contextlib.suppress(ConnectionError):
                await self.writers[stream].drain()
        elif kind == CLOSE:
            task = self.tasks.get(stream)
            if task is not None:
                task.cancel()
            self._forget(stream)

    def _forget(self, stream: int) -> None:
        writer = self.writers.pop(stream, None)
        self.tasks.pop(stream, None)
        if writer is not None:
            writer.close()

    def close(self) -> None:
        for stream in list(self.tasks):
            self.tasks[stream].cancel()
            self._forget(stream)


async def route(data: bytes, zmq_end: ZmqEnd, streams: Streams) -> None:
    """Hand one WebSocket message to the ZMQ sockets or to a stream."""
    if not data:
        return
    if data[0] < len(CHANNELS):
        await zmq_end.deliver(data)
    elif data[0] in (OPEN, DATA, CLOSE):
        await streams.deliver(data)


#: A WebSocket that the other end closes sooner than this after it opened did not bring the relay back: the
#: dials go on from where they were (a second apart), within the same patience.
QUICK_CLOSE = 5.0
#: What A's clients send while the WebSocket is down and A dials again, held (in bytes) and sent once it
#: is back: a cell run meanwhile runs then, instead of waiting for a reply that never comes. From the first
#: message beyond this on, every later one is dropped until it is back (RelayClient._hold).
HELD_MAX = 64 << 20
#: The WebSocket close code with which B's end says that the kernel's process ended there (killed, or it exited
#: by itself): A's relay counts the kernel as lost at once (its restarter then starts it again, here).
ENDED = 4010


class RelayClient:
    """A's end: binds the kernel's ports here and relays them over a WebSocket that ``connect`` opens.

    If the WebSocket drops, it dials again for ``patience`` seconds: what the kernel sends meanwhile is
    lost, as on a network blip; what the clients send is held (up to :data:`HELD_MAX` bytes) and sent once
    it is back. After that the kernel counts as lost (:attr:`lost`).
    """

    def __init__(self, connection_info: dict, connect: Callable[[], Awaitable[Any]],
                 api_target: tuple[str, int] | None, patience: float = 30.0,
                 on_back: Callable[[], Awaitable[Any]] | None = None) -> None:
        """``on_back``: awaited each time the WebSocket is back after a drop, before the messages held
        meanwhile go (the kernel may need something of its owner first)."""
        self.info = connection_info
        self.connect = connect
        self.on_back = on_back
        self.api_target = api_target
        self.patience = patience
        self.ws: Any = None
        self.lost = False
        self._closing = False
        self._reader: asyncio.Task | None = None
        #: when the WebSocket last opened, and since when it has been down (kept across dials that the other
        #: end closes at once: a guest gone there answers each with 4004)
        self._opened: float | None = None
        self._down_since: float | None = None
        self.zmq = ZmqEnd(connection_info, A_SIDE, self._send)
        self.streams = Streams(self._send, dial=self._dial)
        #: the clients' messages while the WebSocket is down (between a drop and :meth:`_redial`'s success)
        self._held: deque[bytes] = deque()
        self._held_bytes = 0
        self._dropping = False

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.api_target is None:
            raise OSError("no server address for the kernel's own calls")
        return await asyncio.open_connection(*self.api_target)

    async def start(self) -> None:
        self.ws = await self.connect()
        self._opened = asyncio.get_running_loop().time()
        try:
            self.zmq.open(bind=True)
        except zmq.ZMQError:
            self.ws.close()
            raise
        self._reader = asyncio.ensure_future(self._read())

    async def introduce(self, clients: list[tuple[str, bytes]]) -> None:
        """Have B make the DEALERs of clients known by their routing ids, before they speak: a reply
        the kernel sends to one of them (a cell that ran during the move) then finds it."""
        for channel, routing_id in clients:
            if channel in CHANNELS and channel != "iopub" and routing_id:
                await self._send(pack_frames(CHANNELS.index(channel), [routing_id, b""]))

    async def _send(self, data: bytes) -> None:
        ws = self.ws
        if ws is None:
            self._hold(data)
            return
        try:
            await ws.write_message(data, binary=True)
        except Exception:  # closed: held until _read has dialled again
            self._hold(data)

    def _hold(self, data: bytes) -> None:
        if self._closing or self.lost or not data or data[0] >= len(CHANNELS):
            return  # a stream's frames are not held: its connections end with the WebSocket (_redial)
        if self._dropping or self._held_bytes + len(data) > HELD_MAX:
            # Those held stay, in order; from the first dropped on, every later one goes too (a cell never
            # runs after one before it was lost), until the relay is back.
            if not self._dropping:
                log.warning("relay: the other host is away and %d bytes are held already: its clients' messages "
                            "are dropped until it is back", self._held_bytes)
            self._dropping = True
            return
        self._held.append(data)
        self._held_bytes += len(data)

    async def _read(self) -> None:
        try:
            await self._read_on()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("relay: the reader stopped")
            raise

    async def _read_on(self) -> None:
        while not self._closing:
            msg = await self.ws.read_message()
            if msg is None:
                if not self._closing and getattr(self.ws, "close_code", None) == ENDED:
                    log.warning("relay: the kernel's process ended on the other host (%s)",
                                getattr(self.ws, "close_reason", None) or "no reason given")
                    self.lost = True
                    self.ws = None
                    return
                if self._closing or not await self._redial():
                    return
                continue
            try:
                await route(msg if isinstance(msg, bytes) else msg.encode(), self.zmq, self.streams)
            except zmq.ZMQError:
                log.debug("relay: could not deliver a message", exc_info=True)

    async def _redial(self) -> bool:
        self.ws = None
        self.streams.close()
        loop = asyncio.get_running_loop()
        if self._down_since is not None and self._opened is not None and loop.time() - self._opened < QUICK_CLOSE:
            await asyncio.sleep(1.0)  # the last dial's WebSocket closed as soon as it opened: still down
        else:
            self._down_since = loop.time()
        deadline = self._down_since + self.patience
        while not self._closing and loop.time() < deadline:
            ws = None
            try:
                ws = await self.connect()
                self._opened = loop.time()
                # The other end is new: its IOPub socket holds none of the subscriptions that this end's
                # clients sent when they connected, and the kernel would publish nothing to it. Jupyter's
                # clients take every topic: subscribe to all on their behalf.
                await ws.write_message(pack_frames(CHANNELS.index("iopub"), [b"\x01"]), binary=True)
                if self.on_back is not None:
                    await self.on_back()
                sent = 0
                while self._held:  # in order, after the subscription; what comes meanwhile is held behind them
                    await ws.write_message(self._held[0], binary=True)
                    self._held_bytes -= len(self._held.popleft())
                    sent += 1
                self.ws, self._dropping = ws, False
                log.info("relay: reconnected%s", f"; sent {sent} message(s) held meanwhile" if sent else "")
                return True
            except Exception as exc:
                if ws is not None:
                    ws.close()
                log.warning("relay: the other host does not answer (%s); trying again", exc)
                await asyncio.sleep(1.0)
            except BaseException:  # cancelled (stop): the new WebSocket goes with it
                if ws is not None:
                    ws.close()
                raise
        self.lost = not self._closing
        self._held.clear()
        self._held_bytes = 0
        return False

    async def stop(self) -> None:
        self._closing = True
        self._held.clear()
        self._held_bytes = 0
        if self._reader is not None:
            self._reader.cancel()
        self.zmq.close()
        self.streams.close()
        if self.ws is not None:
            self.ws.close()
            self.ws = None


class RelayServerEnd:
    """B's end, behind the peer WebSocket: connects to the kernel's ports here, and carries the kernel's calls
    to its server that :class:`ApiListeners` hands it."""

    def __init__(self, connection_info: dict, send: Send) -> None:
        self.send = send
        self.zmq = ZmqEnd(connection_info, B_SIDE, send)
        self.streams = Streams(send)
        #: stopped (its WebSocket closed): :class:`ApiListeners` hands it no call
        self.stopped = False
        #: the kernel's process here: its own calls to its server go over this relay
        self.pid: int | None = None

    def start(self) -> None:
        self.zmq.open(bind=False)

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Carry a call to the kernels' server, made here, to A's end (which opens it there)."""
        stream, self.streams.next_id = self.streams.next_id, self.streams.next_id + 1
        await self.send(pack_stream(OPEN, stream))
        self.streams.adopt(reader, writer, stream)

    async def deliver(self, data: bytes) -> None:
        await route(data, self.zmq, self.streams)

    def stop(self) -> None:
        self.stopped = True
        self.zmq.close()
        self.streams.close()


class ApiListeners:
    """B's listening sockets for its guests' calls to their own server (``%migrate`` inside the kernel).

    A kernel calls its server on the loopback address that server listens on for its kernels, and every
    kernel of one peer knows the same one. So the relays of one peer's kernels here share one listener
    on it. A call goes over the calling kernel's own relay (its process holds the call's client end), else
    over the oldest relay still open: each reaches that same server, which knows the calling kernel by its
    credential. The listener closes with the last relay that shares it. A peer is known by its address,
    as the guests' records know it. Another peer's kernel whose server listens on the same address at home
    cannot be served here: GuestHost.check says so before it comes (:meth:`holder`).
    """

    def __init__(self) -> None:
        #: address -> (the peer, its listening server, the relays that share it, oldest first)
        self._held: dict[tuple[str, int], tuple[str, asyncio.base_events.Server, list[RelayServerEnd]]] = {}
        self._lock = asyncio.Lock()

    def holder(self, address: tuple[str, int]) -> str | None:
        """The peer whose kernels' calls are listened for on ``address`` here, if any."""
        held = self._held.get(address)
        return held[0] if held is not None else None

    async def join(self, end: RelayServerEnd, address: tuple[str, int], peer: str) -> None:
        """Carry the calls made on ``address`` over ``end`` too (listening on it from the first relay)."""
        async with self._lock:  # two relays that open at once make one listener
            held = self._held.get(address)
            if held is None:
                try:
                    server = await asyncio.start_server(functools.partial(self._accept, address), *address)
                except OSError as exc:
                    log.warning("relay: cannot listen on %s:%s for the kernel's calls to its server (%s); "
                                "%%migrate inside the kernel will not reach it", *address, exc)
                    return
                held = self._held[address] = (peer, server, [])
            elif held[0] != peer:
                log.warning("relay: %s:%s is where the kernels of %s call their server here; those of %s cannot "
                            "(%%migrate inside the kernel will not reach it)", *address, held[0], peer)
                return
            held[2].append(end)
            if end.stopped:  # its WebSocket closed while this waited: it left before it came
                self.leave(end)

    def leave(self, end: RelayServerEnd) -> None:
        """``end`` carries no more calls; the last to leave a listener closes it."""
        for address, (_, server, ends) in list(self._held.items()):
            if end in ends:
                ends.remove(end)
                if not ends:
                    server.close()
                    del self._held[address]

    async def _accept(self, address: tuple[str, int], reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        held = self._held.get(address)
        ends = [end for end in held[2] if not end.stopped] if held is not None else []
        caller = await asyncio.to_thread(_caller, ends, writer.get_extra_info("peername"), address[1])
        for end in [caller, *(end for end in ends if end is not caller)] if caller is not None else ends:
            try:
                await end.accept(reader, writer)
                return
            except Exception:  # noqa: BLE001  its WebSocket closed, and it has not left yet: the next one
                log.debug("relay: a call to the kernels' server could not go over one relay", exc_info=True)
        writer.close()


def _caller(ends: list[RelayServerEnd], peername: Any, port: int) -> RelayServerEnd | None:
    """The relay of the kernel that made a call (from ``peername``, to ``port``), if one of ``ends`` is its."""
    if not isinstance(peername, tuple) or len(peername) < 2:
        return None
    for end in ends:
        if end.pid is not None and netstate.holds_client_end(proctree.descendants(end.pid), int(peername[1]),
                                                             port):
            return end
    return None
