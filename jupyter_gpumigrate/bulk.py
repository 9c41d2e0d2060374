"""A large image file between hosts, off the server's event loop.

A tornado server decrypts and encrypts every connection in its one event-loop thread. A move's images,
gigabytes, went through it at 0.5-0.65 GB/s where one TLS stream between two plain threads ran at 1.4 GB/s,
and four streams into one loop moved no more than one (2 x H200, bench/results/2026-11-26-host-move.md).
So a large image file's request leaves tornado: its handler detaches the connection (as a websocket
handshake does, tornado's ``RequestHandler.detach``), and a thread of its own reads the body into the file
or writes the file out on the blocking socket, then answers the request itself and closes the connection.
Each transfer thus has a core of its own, on both hosts, and several files can go at once.

For a body to arrive here, the peer's client (``PeerClient.put_file``) asks with ``Expect: 100-continue``
and sends the body only once this side said ``100 Continue``: tornado has then read no byte of it. A client
that does not wait (curl waits a second, then sends) is served too: what tornado read already is taken from
its buffer first.

A CRIU pages file sent while the dump writes it (``PeerClient.put_growing``) comes as a chunked body
(``Transfer-Encoding: chunked``): its size is known only at its end. Its chunks are parsed here, at most a
block each; it may go quiet while CRIU dumps other processes, so its socket waits longer, with TCP
keepalive; a write that fails is answered at once (the sender looks for an early answer before each
block), and any error answer lets the sender's last bytes drain before the connection closes, so that it
reads the answer rather than a reset.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path
from typing import Any

from tornado.ioloop import IOLoop

from .peers import (BLOCK, Checksum, DumpRun, FileSink, GrowingFile, MarkedRun, Written, chunk_head, drop_mark,
                    mark_sent)

log = logging.getLogger(__name__)

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Seconds a transfer thread waits on the socket before it gives up on the peer.
TIMEOUT = 60.0
#: The same for a file sent as a dump writes it: it may go quiet for as long as CRIU dumps the tree's other
#: processes; the sender closes the connection when the move is undone, and TCP keepalive finds a dead host.
GROWING_TIMEOUT = 1800.0


def detach(handler: Any) -> tuple[socket.socket, bytes]:
    """Take ``handler``'s connection from tornado (call it in ``prepare``, or in a ``get``): its socket,
    blocking, no longer watched by the event loop, and the bytes tornado had read past the headers."""
    stream = handler.detach()
    # tornado keeps what it read past the request's head in its stream's buffer; no public call returns it
    # without reading on. It is empty when the client waited for 100 Continue.
    buffered = int(getattr(stream, "_read_buffer_size", 0) or 0)
    leftover = bytes(stream._read_buffer[:buffered]) if buffered else b""
    sock = stream.socket
    IOLoop.current().remove_handler(sock.fileno())
    sock.setblocking(True)
    sock.settimeout(TIMEOUT)
    return sock, leftover


def in_thread(work: Callable[[], None], name: str) -> None:
    """Run ``work`` (:func:`receive` or :func:`send`, which answer and close the socket whatever happens) in a
    thread of its own."""
    threading.Thread(target=work, name=f"gpumigrate-bulk-{name}", daemon=True).start()


def respond(sock: socket.socket, status: int, payload: dict | None = None) -> None:
    """Answer a detached request with a JSON body (jupyter_server's error shape where ``status`` >= 400),
    and close the connection."""
    try:
        body = json.dumps(payload or {}).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        sock.sendall(head.encode() + body)
        if status >= 400:  # what the peer still sends is read a moment, so that it reads the answer, not a reset
            _drain(sock)
    except OSError:
        pass  # the peer went away: it sees a closed connection
    finally:
        sock.close()


def _drain(sock: socket.socket, seconds: float = 2.0, most: int = 64 * BLOCK) -> None:
    sock.settimeout(seconds)
    got = 0
    while got < most and (data := sock.recv(BLOCK)):
        got += len(data)


def error(status: int, message: str) -> dict:
    return {"message": message, "reason": HTTPStatus(status).phrase}


#: The largest image file a peer may send (a CRIU pages file is one process's memory).
MAX_IMAGE_FILE = 1 << 40


def body_length(headers: Any) -> int | None:
    """An image file PUT's body length from its headers (a mapping): None for a chunked body (a file sent as
    it grows; its end says its size). ValueError, saying what to send, for anything else."""
    if headers.get("Transfer-Encoding", "").lower() == "chunked":
        return None
    try:
        length = int(headers.get("Content-Length", ""))
    except ValueError:
        length = -1
    if not 0 <= length <= MAX_IMAGE_FILE:
        raise ValueError("An image file's PUT says its Content-Length, or comes in chunks.")
    return length


def verdict(name: str, digest: str, said: str | None, record: Callable[[str], None]) -> tuple[int, dict]:
    """(status, answer) for image file ``name``, arrived whole with checksum ``digest`` (peers.Checksum): checked
    against ``said`` (its X-Content-XXH3 header) or, without one, handed to ``record``, for the check once all
    the images arrived (the sender checksums as it sends, and lists them at the end)."""
    if said is None:
        record(digest)
    elif not hmac.compare_digest(digest.encode(), said.strip().encode("utf-8", "replace")):
        return 400, error(400, f"{name} arrived damaged (its checksum differs); send it again.")
    return 201, {"name": name}


def receive(sock: socket.socket, leftover: bytes, length: int | None, path: Path,
            done: Callable[[str], tuple[int, dict]]) -> None:
    """Read a ``length``-byte body (None: a chunked one, at most :data:`MAX_CHUNKED` bytes: a file sent as it
    grows) into ``path`` (0600, replaced), checksumming it; then answer with what
    ``done(checksum)`` says (status, JSON). A file that cannot be opened is refused before ``100 Continue``; a
    write that fails (a full disk) drops the file and reads the rest of the body, to answer 507 or 500; a
    peer that goes away mid-file leaves no file; anything else that goes wrong here is a 500, and no file."""
    try:
        _receive(sock, leftover, length, path, done)
    except Exception as exc:  # never a peer left waiting, nor a file kept unchecked
        log.exception("gpumigrate: receiving %s failed", path.name)
        _abort(None, path)
        respond(sock, 500, error(500, f"{path.name} could not be taken here ({type(exc).__name__}: {exc}); "
                                      "send the images again."))


def _receive(sock: socket.socket, leftover: bytes, length: int | None, path: Path,
             done: Callable[[str], tuple[int, dict]]) -> None:
    failed: OSError | None = None
    sink: FileSink | None = None
    drop_mark(path)
    try:
        sink = FileSink(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600))
    except OSError as exc:
        respond(sock, *_write_error(path, exc))  # before 100 Continue: the sender sends no body
        return
    if length is None:
        sock.settimeout(GROWING_TIMEOUT)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    try:
        sock.sendall(CONTINUE)
        for block in _body(sock, leftover, length) if length is not None else _chunks(sock, leftover):
            if sink is not None:
                try:
                    sink.put_blocking(block)
                except OSError as exc:
                    failed, sink = exc, _abort(sink, path)
            if failed is not None and length is None:
                break  # a file that grows may go on for long: say it at once (the sender stops)
        digest = ""
        if sink is not None:
            try:
                digest = sink.close_blocking()
            except OSError as exc:
                failed = exc
            sink = None
    except (OSError, ConnectionError):  # the peer went away, or stalled: no half file stays
        _abort(sink, path)
        sock.close()
        return
    except ValueError as exc:  # a chunked body that is not one
        _abort(sink, path)
        respond(sock, 400, error(400, f"{path.name} did not arrive as a chunked body ({exc}); nothing of it is "
                                      "kept."))
        return
    try:  # done() records the checksum beside the file (the bulk listener's): that write may fail too
        status, payload = done(digest) if failed is None else _write_error(path, failed)
    except OSError as exc:
        status, payload = _write_error(path, exc)
    if status >= 400:
        _abort(None, path)
    respond(sock, status, payload)


def _write_error(path: Path, failed: OSError) -> tuple[int, dict]:
    full = failed.errno == errno.ENOSPC
    status = 507 if full else 500
    then = ": free space here and send the images again" if full else ""
    return status, error(status, f"{path.name} could not be written here ({failed.strerror or failed}){then}.")


def _body(sock: socket.socket, leftover: bytes, length: int) -> Iterator[bytes | bytearray]:
    """The body's blocks: what tornado read already, then a MiB at a time (each a buffer of its own, handed
    on as it is)."""
    got = 0
    if leftover:
        got = len(leftover := leftover[:length])
        yield leftover
    while got < length:
        block = bytearray(min(BLOCK, length - got))
        view, filled = memoryview(block), 0
        while filled < len(block):
            n = sock.recv_into(view[filled:])
            if not n:
                raise ConnectionError("the peer closed the connection mid-file")
            filled += n
        got += filled
        yield block


#: The most a chunked body may bring (a file sent as it grows): a CRIU pages file, one process's memory.
MAX_CHUNKED = 1 << 40
#: The largest chunk taken (the sender's are a block at most): each is read into a buffer of its own.
MAX_CHUNK = BLOCK
#: The most trailer lines taken after the last chunk (the sender sends none).
MAX_TRAILERS = 16
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")


class _Reader:
    """Buffered reads off a blocking socket, what tornado had read first."""

    def __init__(self, sock: socket.socket, leftover: bytes) -> None:
        self.sock, self.buffer = sock, bytearray(leftover)

    def _fill(self) -> None:
        data = self.sock.recv(BLOCK)
        if not data:
            raise ConnectionError("the peer closed the connection mid-file")
        self.buffer += data

    def line(self, limit: int = 1024) -> bytes:
        while (end := self.buffer.find(b"\r\n", 0, limit + 2)) < 0:
            if len(self.buffer) > limit:
                raise ValueError("a chunk's size line or a trailer is too long")
            self._fill()
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 2]
        return line

    def exactly(self, n: int) -> bytearray:
        """``n`` bytes, in one buffer of their own."""
        if len(self.buffer) >= n:
            block = self.buffer[:n]
            del self.buffer[:n]
            return block
        block, filled = bytearray(n), len(self.buffer)
        block[:filled] = self.buffer
        self.buffer = bytearray()
        view = memoryview(block)
        while filled < n:
            got = self.sock.recv_into(view[filled:])
            if not got:
                raise ConnectionError("the peer closed the connection mid-file")
            filled += got
        return block


def _chunks(sock: socket.socket, leftover: bytes) -> Iterator[bytes | bytearray]:
    """A chunked body's blocks (RFC 9112 7.1): each chunk's data as a buffer of its own; extensions and
    trailers are read and dropped. ValueError for what is not a chunked body, or one over MAX_CHUNKED."""
    reader, got = _Reader(sock, leftover), 0
    while True:
        said = reader.line().split(b";", 1)[0].strip()
        if not _CHUNK_SIZE.fullmatch(said):
            raise ValueError(f"a chunk's size is not a hex number of at most 8 digits: {said[:40]!r}")
        size = int(said, 16)
        if size > MAX_CHUNK or got + size > MAX_CHUNKED:
            raise ValueError(f"a chunk of {size} bytes, over {MAX_CHUNK}, or a body over {MAX_CHUNKED}")
        if size == 0:
            for _ in range(MAX_TRAILERS + 1):  # trailers, up to the empty line
                if not reader.line(8192):
                    return
            raise ValueError(f"more than {MAX_TRAILERS} trailer lines")
        yield reader.exactly(size)
        got += size
        if reader.line() != b"":
            raise ValueError("a chunk does not end where its size says")


def _abort(sink: FileSink | None, path: Path) -> None:
    """Stop writing ``path`` and remove it."""
    if sink is not None:
        sink.abort()
    try:
        path.unlink()
    except OSError:
        pass


def send(sock: socket.socket, path: Path, size: int) -> None:
    """Answer a detached GET with the file at ``path`` (``size`` bytes, as said before), then close."""
    try:  # an error mid-file: the peer sees fewer bytes than said, and refuses the file
        with open(path, "rb") as f:
            sock.sendall((f"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {size}\r\n"
                          "Connection: close\r\n\r\n").encode())
            left = size
            while left > 0 and (block := f.read(min(BLOCK, left))):
                sock.sendall(block)
                left -= len(block)
    except Exception:
        log.exception("gpumigrate: sending %s failed", path.name)
    finally:
        sock.close()


def send_growing(sock: socket.socket, path: Path, run: DumpRun | MarkedRun, done: Callable[[], None] | None = None
                 ) -> int | None:
    """Answer a detached GET with a file that a dump still writes (a CRIU pages file, or a part of the stash
    before it), in chunks as it grows, until it is whole (:class:`~.peers.Written`: the dump is over, ``run``,
    or the stash's index is there) and all of it went; then close, and call ``done``: the bytes sent whole,
    else None. A dump that failed gets no last chunk (nor a part of a stash that did not finish): the peer sees
    a cut answer, never a whole file. The peer checks what it got against the final listing. One file is sent
    so by one sender at a time, of this process or another (a lock on the file): another asks in vain (409)."""
    stop = threading.Event()
    sock.settimeout(GROWING_TIMEOUT)
    sent = None
    try:
        with open(path, "rb") as f:
            try:  # released with the file, or with its process
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                respond(sock, 409, error(409, f"{path.name} is being sent as it grows already."))
                return None
            except OSError as exc:  # a file system without locks: sent all the same (one sender is a's rule too)
                log.warning("gpumigrate: %s cannot be locked (%s): sent as it grows without the lock", path.name, exc)
            sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n"
                         b"Connection: close\r\n\r\n")
            written = Written(path, run.over)
            growing = GrowingFile(f, written, stop)
            checksum = Checksum()
            first = True
            while block := growing.read(BLOCK):
                sock.sendall(chunk_head(len(block), first))
                sock.sendall(block)
                checksum.update(block)
                first = False
            if run.ok or written.ended_whole:
                # before the end: the listing that comes after it finds it
                mark_sent(path, f.fileno(), growing.offset, checksum.hexdigest())
                sock.sendall(chunk_head(0, first))
                sent = growing.offset
    except OSError:
        pass  # the peer went away or called it off: it fetches the file again after the dump, or not at all
    except Exception:
        log.exception("gpumigrate: sending %s as it grows failed", path.name)
    finally:
        sock.close()
        if done is not None:
            done()
    return sent
