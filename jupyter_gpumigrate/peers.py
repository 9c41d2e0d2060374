"""Peers: other Jupyter servers with the extension that a kernel can move to, and back.

Configuration, on host A (``jupyter_server_config.py``)::

    c.GPUMigrateApp.host_name = "a"
    c.GPUMigrateApp.peers = {"b": {"url": "https://b.example:8888/", "token": "<B's peer_token>",
                                   "ca_file": "/etc/ssl/our-ca.pem"}}
    c.GPUMigrateApp.peer_token = "<what peers must present to move kernels here>"

A is always the one that acts: it asks B whether it can take a kernel, sends the images, has B restore
them, relays the kernel's channels, and later has B dump it and fetches the images back. B only answers
requests that carry its peer token (``Authorization: gpumigrate-peer <token>``), under
``/api/gpumigrate/peer/``. Peers talk HTTPS: a peer URL in plain http is refused unless it is a loopback
address, since the images hold everything in the kernel's memory.

This module holds A's side (:class:`PeerLink`, one per move) and B's side (:class:`GuestHost`, the
kernels it hosts for its peers). The HTTP client is the standard library's http.client: the calls are
made from a migration's worker thread, and it streams files in large blocks without a new dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hmac
import http.client
import ipaddress
import json
import logging
import os
import re
import select
import shutil
import signal as signal_mod
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from .credentials import ENV_KERNEL_ID
from .engine import gpus as gpus_mod
from .engine import cpus, hostfit, netstate, placement, proctree
from .engine.criu import Criu
from .engine.errors import GpuError, ImageError, InvalidState, MigrateError
from .engine.images import (AUTO, MANIFEST, PENDING, SECRETS, ImageStore, Manifest, choose, host_memory,
                            write_durably)
from .engine.migration import BROKEN, MIGRATING, RUNNING, STOPPED, SUSPENDED, HostLink, Migration, kernel_listens
from .engine.prefetch import Prefetch, cuda_bytes, room_for
from .kernel import hoststash
from .kernel.hoststash import INDEX as STASH_INDEX, PART as STASH_PART
from .kernel.transplant import DETACH_OUTPUT
from .kernelwire import (HOST_OPEN_PREFETCH_CALL, HOST_STASH_CALL, HOST_TAKE_BACK_CALL, HOST_TAKE_BACK_GPU_CALL,
                         RELEASE_TORCH_CACHE, evaluate_silently, run_silently)
from . import __version__ as _VERSION
from .relay import ApiListeners, RelayClient

log = logging.getLogger(__name__)

SCHEME = "gpumigrate-peer"
PEER_API = "api/gpumigrate/peer"
BLOCK = 1 << 20
#: The image files' checksum between hosts (:class:`Checksum`), as each host says it in its answers to
#: ``peer/check``, ``peer/transplants/check`` and ``GET peer/kernels/{id}``: a peer that says another, or none
#: (a version before it), is refused before anything moves.
CHECKSUM = "xxh3"
#: Image files at least this large go between hosts through a thread of their own on the serving side, off
#: its event loop (bulk.py); smaller ones share a connection kept open (:class:`Kept`).
DETACH_MIN = 16 * BLOCK
#: Image files sent or fetched at once between hosts by default (c.GPUMigrateApp.transfer_streams), each over a
#: connection of its own, each sent by a thread and received by a process of its own (bulkd.py): TLS runs at
#: about 1.2-1.4 GB/s on one core of the GPU machines, and the link between the bench's two namespaces on
#: the H200 machine (16 CPUs) carried 1.2 GB/s with one TLS stream, 3.9-4.7 with four, 8.1-9.7 with eight
#: (bench/host_bench.py --streams 4,8). Each stream takes a core or so on both hosts: one on a small machine
#: (on 2 CPUs, four were slower than one). The CPUs counted are those this server can use (engine/cpus.py: a
#: pod's CPU limit, not its node's CPUs).
STREAMS = max(1, min(8, int(cpus.usable()) // 2))
#: How long a move waits to connect to its peer's bulk listener before it sends through the peer's server
#: port instead (seconds).
BULK_PROBE = 3.0
#: Files checksummed at once for a listing (the way home).
DIGESTS = 8
#: The image files that CRIU's dump appends to as it goes, and only appends to (criu/page-xfer.c splices
#: each process's pages onto the end of its pages file): sent while they grow, as the dump writes them.
GROWING = "pages-*.img"
#: In a guest's image folder while CRIU restores it (GuestHost.restore): when, in which boot, for which server.
RESTORING = "restoring.json"
#: The host stash's files (kernel/hoststash.py): each written front to back by one of the kernel's threads,
#: and whole once the stash's index is in their folder (it is written after every part): sent while they are
#: written too, both ways, ended by that index (:class:`Written`).
STASH_PARTS = STASH_PART.replace("{:02d}", "*")
#: The folder, in the state folder, of the records of guests that run here (GuestHost.take_back). A GuestHost
#: given none keeps it under the guests' images (no image folder's name is this).
RUNNING_GUESTS = "guests-running"
#: The folder, beside those records, of the marks of the dumps for a way home that run here (DumpRun.mark), which
#: the bulk listener's processes read (MarkedRun); a dot: no guest's images are ever taken for it.
DUMP_MARKS = ".dumps-running"
#: How long a guest taken back at start waits for its peer to relay its channels before it is discarded
#: (seconds): a peer that is up dials again within its relay's patience (30 s); one that gave up restarted
#: the kernel at home, and one whose server went takes back no kernel it had moved away.
UNCLAIMED = 600.0
#: Files followed at once as a dump writes them (:data:`GROWING`), each over a connection and a thread of its
#: own, apart from the :data:`STREAMS`: each waits on its file most of the time, and the dump ends them all at
#: once. Held to the STREAMS, a tree of more processes than STREAMS sent nothing of the later processes' pages
#: while the dump ran (a GPU kernel's tree on the GPU machine: 0.01 of 9 GB went during the dump, its largest
#: file waiting behind four small ones). A tree of more processes sends the rest as each of these ends. The
#: stash's parts (:data:`STASH_PARTS`, 16) are followed too, from the stash's start: they take these threads
#: first, and the pages files follow as they end (the link is busy with the stash meanwhile).
FOLLOWED = 16
#: How long a transplant's new process here waits for its peer's word to go before it is discarded (seconds):
#: the peer saves the source meanwhile (a large kernel's dump on a slow disk takes minutes).
TRANSPLANT_ORPHAN = 1800.0
#: How long images received for a move may wait here, never restored, before they go (c.GPUMigrateApp.
#: guest_images_expire): their peer keeps its own copy until the kernel answers from here.
RECEIVED_EXPIRE = 1800.0
#: A prefetch begun as a kernel's images arrive holds a copy of the kernel's buffers on a GPU: it ends once its
#: images have been complete this long and no restore took it (its peer asks the restore at once), or once
#: nothing more of them has arrived for PREFETCH_STALLED seconds (its peer died or gave up; its dump, which runs
#: meanwhile, writes at some 2 GB/s: 10 minutes is a 1 TB tree), not when the images expire (30 minutes).
PREFETCH_UNTAKEN = 120.0
PREFETCH_STALLED = 600.0
#: How often that is looked at (seconds).
PREFETCH_WATCH = 5.0
#: What a transplant's new process was given here, removed once it runs: the key, the source's environment.
_TRANSPLANT_FILES = ("connection.json", "prelude.json", "ready.json", "started.json", "failed.json",
                     "new-process.log")
#: image files that travel: CRIU's images and our manifest (never logs, pid files or temporaries)
_IMAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\Z")  # \Z: "$" lets a name end in a newline
_NOT_SENT = {"restore.pid", "dump.log", "restore.log", SECRETS, PENDING}


class PeerError(MigrateError):
    """The peer refused or failed a request, or cannot be reached."""

    http_status = 502
    #: the peer's answer's status where it answered (404: it has no such kernel); None where it could not be
    #: reached
    status: int | None = None


class UnknownPeer(MigrateError):
    http_status = 400


class GuestNotFound(MigrateError):
    http_status = 404


class NoRoomHere(MigrateError):
    """This host's disk (or memory folder) is full: what a peer sent cannot be kept here."""

    http_status = 507


class GuestsNotBack(MigrateError):
    """This server is still taking back the guests an earlier one left (GuestHost.take_back): a kernel it
    does not list yet may be among them."""

    http_status = 503


def credential_ok(expected: str, authorization: str) -> tuple[bool, str]:
    """(allowed, why not) for a request's Authorization header, against this server's peer token."""
    if not expected:
        return False, ("This server takes no kernels from peers: set c.GPUMigrateApp.peer_token on it, and give "
                       "that token to its peers.")
    scheme, _, secret = authorization.strip().partition(" ")
    if scheme != SCHEME or not hmac.compare_digest(secret.strip().encode(), expected.encode()):
        return False, "This peer credential is not valid here."
    return True, ""


def image_path(store: ImageStore, kernel_id: str, name: str) -> Path:
    """Where image file ``name`` of ``kernel_id``, sent by a peer, goes: ImageError for a name that is not an
    image file's, or a kernel whose images are not being received (POST images/{id} first)."""
    if not _IMAGE_NAME.match(name) or name in _NOT_SENT:
        raise ImageError(f"{name!r} is not the name of an image file.")
    folder = store.path_for(kernel_id)
    if folder.is_symlink() or not folder.is_dir():
        raise ImageError(f"No images are being received for kernel {kernel_id}: start with POST images/{kernel_id}.")
    return folder / name


#: How long a guest taken back without its large buffers gets to read them back from its stash (seconds).
STASH_LEFT_WAIT = 3600.0
#: How long this host waits for a peer's guest to read them back (seconds): longer than that host's own wait.
GIVE_BACK_WAIT = STASH_LEFT_WAIT + 60.0


#: A received image file's checksum, beside it in its folder, as the bulk listener's processes record it for
#: the server (bulkd.py); no image file's name begins with a dot.
RECEIVED_MARK = ".received-{}"


def mark_received(path: Path, checksum: str) -> None:
    """Record, beside ``path``, the checksum it arrived with (read by :meth:`GuestHost.complete`)."""
    mark = path.with_name(RECEIVED_MARK.format(path.name))
    temporary = mark.with_name(mark.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(checksum)
    os.replace(temporary, mark)


#: Beside an image file served whole as it grew (bulk.send_growing): the checksum of what went, with the file's
#: size, inode and modification time then; :meth:`GuestHost.listing` takes it instead of reading the file again
#: while they still hold (the file is written front to back only: another byte changes its size and its time;
#: not its change time, which the images' chmod moves).
SENT_MARK = ".sent-{}"
#: How long a listing waits for a file being sent as it grows, whose checksum then comes with it, before it
#: reads the file itself (seconds)
SENT_WAIT = 30.0


def mark_sent(path: Path, fd: int, size: int, checksum: str) -> None:
    """Record, beside ``path`` (open as ``fd``), the checksum of the ``size`` bytes sent of it, if that is all
    of it."""
    st = os.fstat(fd)
    if st.st_size != size:
        return
    mark = path.with_name(SENT_MARK.format(path.name))
    temporary = mark.with_name(f"{mark.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"size": st.st_size, "ino": st.st_ino, "mtime_ns": st.st_mtime_ns, "xxh3": checksum}))
        os.replace(temporary, mark)
    except OSError:  # the listing reads the file instead
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def sent_over(path: Path, timeout: float) -> bool:
    """Wait until no process sends ``path`` as it grows (bulk.send_growing holds a lock on it while it does),
    up to ``timeout`` seconds: whether none does now."""
    deadline = time.monotonic() + timeout
    with open(path, "rb") as f:
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.005)
            except OSError:  # a file system without locks (NFS with none, ENOLCK): the file is read instead
                return False


def sent_checksum(path: Path) -> tuple[int, str] | None:
    """The size and checksum :func:`mark_sent` recorded of ``path``, if the file is still as it was then; else
    None."""
    try:
        said = json.loads(path.with_name(SENT_MARK.format(path.name)).read_bytes())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or (said.get("size"), said.get("ino"), said.get("mtime_ns")) != \
            (st.st_size, st.st_ino, st.st_mtime_ns) or not isinstance(said.get("xxh3"), str):
        return None
    return st.st_size, said["xxh3"]


def drop_mark(path: Path) -> None:
    """A receipt of ``path`` begins: the checksum recorded of an earlier copy (:func:`mark_received`) goes."""
    with contextlib.suppress(OSError):
        path.with_name(RECEIVED_MARK.format(path.name)).unlink(missing_ok=True)


def received_marks(folder: Path) -> dict[str, str]:
    """The checksums recorded by :func:`mark_received` in ``folder``, by file name; the marks go."""
    prefix = RECEIVED_MARK.format("")
    marks = {}
    for mark in folder.glob(prefix + "*"):
        if mark.name.endswith(".tmp"):
            continue
        try:
            marks[mark.name[len(prefix):]] = mark.read_text().strip()
            mark.unlink()
        except OSError:
            pass  # gone meanwhile: the file's size and the sender's list still decide
    return marks


@dataclass(frozen=True)
class Peer:
    name: str
    url: str
    token: str
    ca_file: str | None = None

    @classmethod
    def from_config(cls, name: str, entry: dict) -> Peer:
        url = str(entry.get("url", "")).rstrip("/") + "/"
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"Peer {name!r}: url must be https://host:port/ (got {entry.get('url')!r}).")
        if parts.scheme == "http" and not _is_loopback(parts.hostname):
            raise ValueError(
                f"Peer {name!r}: {url} is plain http on a routable address; kernel images and channels "
                "would cross the network unencrypted. Serve that peer over https (jupyter server --certfile "
                "--keyfile) and give its CA here as ca_file."
            )
        if not entry.get("token"):
            raise ValueError(f"Peer {name!r}: token is missing (the peer's c.GPUMigrateApp.peer_token).")
        return cls(name, url, str(entry["token"]), entry.get("ca_file") or None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Checksum:
    """The XXH3-64 (the ``xxhash`` library, as the host stash's chunks) of what is fed to it, in hex: the
    image files' checksum between hosts.

    Not SHA-256: TLS already authenticates every byte on the wire, and a peer is trusted with the kernel
    anyway, so the checksum only has to catch an accident (a file that changed as it was read, a bug, a
    plain-HTTP loopback peer). SHA-256 ran at 0.29 GB/s on one core of the dev machine (no SHA
    instructions; 1.4 GB/s on the GPU machine) and bounded a transfer there at 0.15 GB/s against a TLS
    floor of 0.5-0.7; zlib's CRC-32 ran at 2.0-2.7 GB/s there, and the listing of the way home, which
    checksums every file before the first is fetched, took 1.03 s for 1 GB; XXH3 runs at 8.7 GB/s a dev
    core. Both let go of the GIL.
    """

    def __init__(self) -> None:
        self.state = xxhash.xxh3_64()

    def update(self, block: bytes | bytearray | memoryview) -> None:
        self.state.update(block)

    def hexdigest(self) -> str:
        return self.state.hexdigest()


def _listed_checksum(path: Path) -> tuple[int, str, bool]:
    """A file's size and checksum for a listing, and whether it is the one taken as it was sent while written
    (a followed file still being sent is waited for, up to :data:`SENT_WAIT`: its checksum then comes with it);
    else read now."""
    if follows(path.name) and sent_over(path, SENT_WAIT) and (said := sent_checksum(path)) is not None:
        return (*said, True)
    return (*digest_file(path), False)


def digest_file(path: Path) -> tuple[int, str]:
    h, size = Checksum(), 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


class FileSink:
    """Writes and checksums a file's chunks, in order, in a thread of its own: the thread that receives them
    only decrypts and hands them over (a server's event loop that also hashed and wrote received a third of
    the link's floor). At most :data:`AHEAD` bytes wait; the receiver then waits, and TCP slows the sender.
    ``put``/``close`` for the event loop, ``put_blocking``/``close_blocking`` for a thread (bulk.py)."""

    AHEAD = 16 * BLOCK

    def __init__(self, fd: int) -> None:
        self.file = os.fdopen(fd, "wb")
        self.hash = Checksum()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpumigrate-sink")
        self.pending: deque[Future] = deque()
        self.batch: list[bytes] = []
        self.batched = 0

    def _write(self, block: bytes | bytearray) -> None:
        self.hash.update(block)
        self.file.write(block)

    def _hand_over(self, chunk: bytes | bytearray, last: bool = False) -> None:
        if chunk:
            if not self.batch and len(chunk) >= BLOCK:  # a whole block: as it is, not copied
                self.pending.append(self.pool.submit(self._write, chunk))
                return
            self.batch.append(chunk)
            self.batched += len(chunk)
        if self.batch and (last or self.batched >= BLOCK):  # one hand-over per MiB, not per 64 KiB read
            self.pending.append(self.pool.submit(self._write, b"".join(self.batch)))
            self.batch, self.batched = [], 0

    def _waits(self, last: bool = False) -> list[Future]:
        """The writes to wait for now: the oldest while too much waits (all, at the end); each raises what its
        write raised (a full disk)."""
        done = []
        while self.pending and (last or self.pending[0].done() or len(self.pending) * BLOCK > self.AHEAD):
            done.append(self.pending.popleft())
        return done

    async def put(self, chunk: bytes) -> None:
        """Take ``chunk`` (raises what an earlier write raised: a full disk)."""
        self._hand_over(chunk)
        for waiting in self._waits():
            await asyncio.wrap_future(waiting)

    def put_blocking(self, chunk: bytes | bytearray) -> None:
        """:meth:`put`, from a thread; ``chunk`` must not change after."""
        self._hand_over(chunk)
        for waiting in self._waits():
            waiting.result()

    async def close(self) -> str:
        """Write what is left and close the file: its checksum (:class:`Checksum`)."""
        try:
            self._hand_over(b"", last=True)
            for waiting in self._waits(last=True):
                await asyncio.wrap_future(waiting)
        finally:
            self.abort()
        return self.hash.hexdigest()

    def close_blocking(self) -> str:
        """:meth:`close`, from a thread."""
        try:
            self._hand_over(b"", last=True)
            for waiting in self._waits(last=True):
                waiting.result()
        finally:
            self.abort()
        return self.hash.hexdigest()

    def abort(self) -> None:
        """Stop: what is queued is dropped; the file is closed (its writer ends before)."""
        for waiting in self.pending:
            waiting.cancel()
        self.pool.shutdown(wait=True)
        self.file.close()


class _Hashing:
    """A file for http.client to send from, checksummed as it is read: in a thread of its own, beside the
    sending thread's encryption (one after the other, a hash and TLS sent 0.65 GB/s on the GPU machine).
    xxhash lets go of the GIL for large blocks; at most :data:`AHEAD` bytes wait for it."""

    AHEAD = 16 * BLOCK

    def __init__(self, file: Any, size: int = 0, stop: threading.Event | None = None) -> None:
        self.file, self.hash, self.size = file, Checksum(), 0
        #: the size the request says (Content-Length; 0: sent in chunks, as the file grows), and the file's
        #: name, for what goes wrong
        self.size_said, self.name = size, Path(getattr(file, "name", "") or "").name
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpumigrate-hash")
        self.pending: deque[Future] = deque()
        #: set: the transfer is called off, the next read raises (the connection is then closed)
        self.stop = stop

    def read(self, n: int = -1) -> bytes:
        if self.stop is not None and self.stop.is_set():
            raise PeerError(f"Sending {self.name} was called off.")
        block = self.file.read(n)
        self.pending.append(self.pool.submit(self.hash.update, block))
        self.size += len(block)
        while self.pending and (self.pending[0].done() or len(self.pending) * BLOCK > self.AHEAD):
            self.pending.popleft().result()
        return block

    def hexdigest(self) -> str:
        """The checksum of all that was read (waits for the checksumming thread)."""
        self.close()
        return self.hash.hexdigest()

    def close(self) -> None:
        while self.pending:
            self.pending.popleft().result()
        self.pool.shutdown(wait=True)


class GrowingFile:
    """A file that a dump (or the stash before it) is still appending to, read as it grows: :meth:`read` waits
    for a whole block, or for ``final`` (:class:`Written`: the file has its last size), and returns b"" only at
    that end.

    Safe for files written front to back only (:data:`GROWING`, :data:`STASH_PARTS`): the kernel makes a
    write's bytes readable before it moves the file's size past them, and no byte read changes after."""

    WAIT = 0.005

    def __init__(self, file: Any, final: threading.Event | Written, stop: threading.Event,
                 progress: dict[str, int] | None = None) -> None:
        self.file, self.final, self.stop = file, final, stop
        self.name = file.name
        self.offset = 0
        self.progress = progress if progress is not None else {}

    def read(self, n: int = BLOCK) -> bytes:
        while True:
            final = self.final.is_set()  # before the size: once the dump is over, the size read is the last
            available = os.fstat(self.file.fileno()).st_size - self.offset
            if available >= n or (final and available > 0):
                block = self.file.read(min(n, available))
                self.offset += len(block)
                self.progress[Path(self.name).name] = self.offset
                return block
            if final:
                return b""
            if self.stop.is_set():
                raise PeerError(f"Sending {Path(self.name).name} was called off.")
            self.final.wait(self.WAIT)


def chunk_head(size: int, first: bool) -> bytes:
    """What goes before a chunk of ``size`` bytes of a chunked body (RFC 9112 7.1): its size line, after the
    end of the chunk before it unless ``first`` (``size`` 0: the last chunk, no trailers). The chunk's data is
    sent apart, as it was read: joining it with its framing copied each MiB, holding the GIL (0.5 ms a MiB by
    ``%``-formatting), and a sending thread went at a fifth of what one whose file was whole went, among 16
    (bench/transfer_probe.py ... growing)."""
    head = b"%x\r\n" % size if size else b"0\r\n\r\n"
    return head if first else b"\r\n" + head


def follows(name: str) -> bool:
    """Whether an image file travels while it is written (a dump's pages file, or a part of the stash)."""
    return Path(name).match(GROWING) or Path(name).match(STASH_PARTS)


class Written:
    """When a file sent as it is written has its last size (:class:`GrowingFile`'s ``final``): a pages file
    once the dump is over (``over``); a part of the stash once the stash's index is beside it (or the dump is
    over: a stash that failed raised, and what it wrote goes with the undo)."""

    def __init__(self, path: Path, over: threading.Event) -> None:
        self.over = over
        self.index = path.parent / STASH_INDEX if path.match(STASH_PARTS) else None
        #: a part of a stash seen finished (its index there) by a call of :meth:`is_set` that said so: what is
        #: read after that call is the whole part, whatever the dump after it does (sticky)
        self.ended_whole = False

    def is_set(self) -> bool:
        if self.index is not None and self.index.exists():
            self.ended_whole = True
            return True
        return self.over.is_set()

    def wait(self, timeout: float) -> bool:
        return self.over.wait(timeout) or self.is_set()


def image_files(images: Path) -> list[Path]:
    return sorted(p for p in images.iterdir()
                  if p.is_file() and not p.is_symlink() and _IMAGE_NAME.match(p.name) and p.name not in _NOT_SENT
                  and not p.name.endswith(".tmp"))


def _read_head(sock: Any) -> tuple[int, str, int]:
    """Read a response's head off ``sock`` (byte by byte: what follows stays for http.client): its status,
    reason and Content-Length (0 if it says none)."""
    head = bytearray()
    while not head.endswith(b"\r\n\r\n"):
        byte = sock.recv(1)
        if not byte or len(head) > 65536:
            raise http.client.BadStatusLine(head.decode("latin-1", "replace")[:200])
        head += byte
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise http.client.BadStatusLine(lines[0][:200])
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and value.strip().isdigit():
            length = int(value.strip())
    return int(parts[1]), parts[2] if len(parts) > 2 else "", length


def _answered(sock: Any) -> bool:
    """Whether the peer answered already (before it had the whole body: only a refusal can come so)."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending()) or bool(select.select([sock], [], [], 0)[0])


def _read_exactly(sock: Any, n: int) -> bytes:
    data = bytearray()
    while len(data) < n and (chunk := sock.recv(n - len(data))):
        data += chunk
    return bytes(data)


class Kept:
    """Connections to a peer kept open between the requests of one transfer: a new HTTPS connection costs
    a TLS handshake, and a CRIU dump is dozens of small files (0.65 s for 60 files of 4 KiB, one connection
    each, on the dev machine). Each is used by one thread at a time; :meth:`close` closes those given back."""

    def __init__(self) -> None:
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> http.client.HTTPConnection | None:
        with self._lock:
            return self._idle.pop() if self._idle else None

    def give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.append(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> Kept:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _done_with(conn: http.client.HTTPConnection, response: http.client.HTTPResponse, kept: Kept | None) -> None:
    """A request is over, its response read: keep its connection for the next one, where it may be."""
    if kept is not None and not response.will_close:
        kept.give(conn)
    else:
        conn.close()


class PeerClient:
    """Requests to one peer, from a worker thread."""

    def __init__(self, peer: Peer, timeout: float = 60.0, port: int | None = None) -> None:
        """``port``: another port of the peer's host than its URL's (its bulk listener's, bulkd.py)."""
        self.peer = peer
        self.timeout = timeout
        parts = urllib.parse.urlsplit(peer.url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "", port or parts.port or (443 if self.https else 80)
        self.base = parts.path.rstrip("/") + "/"
        self.context = ssl.create_default_context(cafile=peer.ca_file) if self.https else None

    def _connection(self, kept: Kept | None = None, timeout: float | None = None) -> http.client.HTTPConnection:
        if kept is not None and (conn := kept.take()) is not None:
            if conn.sock is not None:
                conn.sock.settimeout(timeout or self.timeout)
            return conn
        timeout = timeout or self.timeout
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.context,
                                               blocksize=BLOCK)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout, blocksize=BLOCK)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"{SCHEME} {self.peer.token}"}

    def url(self, path: str, websocket: bool = False) -> str:
        scheme = ("wss" if self.https else "ws") if websocket else ("https" if self.https else "http")
        return f"{scheme}://{self.host}:{self.port}{self.base}{PEER_API}/{path}"

    def _send(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
              kept: Kept | None = None, timeout: float | None = None
              ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection(kept, timeout)
        all_headers = {**self.headers(), **(headers or {})}
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            all_headers["Content-Type"] = "application/json"
        try:
            if isinstance(body, _Hashing) and (body.size_said >= DETACH_MIN or "Transfer-Encoding" in all_headers):
                self._send_after_continue(conn, method, path, body, all_headers)
            else:
                conn.request(method, f"{self.base}{PEER_API}/{path}", body=body, headers=all_headers)
            response = conn.getresponse()
        except PeerError:
            conn.close()
            raise
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            reason = (exc.reason or exc) if isinstance(exc, ssl.SSLError) else exc  # an EOF has no reason
            raise PeerError(f"Peer {self.peer.name} at {self.peer.url} cannot be reached ({reason}).") from None
        if response.status >= 400:
            text = response.read()
            conn.close()
            raise self._refused(response.status, text, response.reason)
        return conn, response

    def _refused(self, status: int, text: bytes, reason: str) -> PeerError:
        try:
            message = json.loads(text).get("message") or reason
        except (ValueError, AttributeError):
            message = reason
        if status in (401, 403):
            message = (f"peer {self.peer.name} refused our credential ({message}): check that its "
                       f"c.GPUMigrateApp.peer_token is the token configured for it here")
        error = PeerError(f"{self.peer.name}: {message}")
        error.status = status
        return error

    def _send_after_continue(self, conn: http.client.HTTPConnection, method: str, path: str, body: _Hashing,
                             headers: dict[str, str]) -> None:
        """Send a large file's request with ``Expect: 100-continue``, and its body once the peer said
        ``100 Continue``: the peer then reads it in a thread of its own (bulk.py). A final answer instead
        (a refusal) is raised as :class:`PeerError`. With ``Transfer-Encoding: chunked`` in ``headers`` (a file
        that grows as it is sent), each block goes as a chunk, and an empty chunk ends it."""
        conn.putrequest(method, f"{self.base}{PEER_API}/{path}", skip_accept_encoding=True)
        for name, value in {**headers, "Expect": "100-continue"}.items():
            conn.putheader(name, value)
        conn.endheaders()
        assert conn.sock is not None
        status, reason, length = _read_head(conn.sock)
        if status != 100:
            text = _read_exactly(conn.sock, length) if length else b""
            raise self._refused(status, text, reason) if status >= 400 else \
                PeerError(f"{self.peer.name} answered {status} {reason} before it took {body.name}.")
        chunked, first = headers.get("Transfer-Encoding") == "chunked", True
        while block := body.read(BLOCK):
            if _answered(conn.sock) and (refusal := self._early_answer(conn.sock, body.name)) is not None:
                raise refusal  # the peer refused mid-body (a full disk): its answer says why
            if chunked:
                conn.send(chunk_head(len(block), first))
                first = False
            conn.send(block)
        if chunked:
            conn.send(chunk_head(0, first))

    def _early_answer(self, sock: Any, name: str) -> PeerError | None:
        """The peer's answer that came before the whole body went, as the error to raise; None if what came was
        no answer (a TLS record of no data: the read times out, and the body goes on)."""
        saved = sock.gettimeout()
        sock.settimeout(1.0)
        try:
            status, reason, length = _read_head(sock)
            text = _read_exactly(sock, length) if length else b""
        except TimeoutError:
            return None
        except (OSError, http.client.HTTPException) as exc:
            return PeerError(f"{self.peer.name} closed the connection while it took {name} ({exc}).")
        finally:
            sock.settimeout(saved)
        return self._refused(status, text, reason) if status >= 400 else \
            PeerError(f"{self.peer.name} answered {status} {reason} before it had all of {name}.")

    def call(self, method: str, path: str, body: Any = None, timeout: float | None = None,
             kept: Kept | None = None) -> Any:
        """A JSON request; its answer. With ``kept``, over one of its connections, given back after."""
        conn, response = self._send(method, path, body, kept=kept, timeout=timeout)  # threads share this client
        try:
            data = response.read()
        except BaseException:
            conn.close()
            raise
        _done_with(conn, response, kept)
        return json.loads(data) if data else None

    def put_file(self, path: str, file: Path, size: int, kept: Kept | None = None,
                 stop: threading.Event | None = None) -> str:
        """Send ``file`` (``size`` bytes), checksumming it as it goes: one read of it, not two; its checksum,
        which the peer checks against its own when the images are complete (``complete``). With ``kept``,
        over one of its connections, given back after; ``stop``, once set, calls it off."""
        with open(file, "rb") as f:
            body = _Hashing(f, size, stop)
            try:
                conn, response = self._send("PUT", path, body=body, headers={
                    "Content-Length": str(size), "Content-Type": "application/octet-stream"}, kept=kept)
            finally:
                body.close()
        self._finish(conn, response, file.name, kept)
        if body.size != size:
            raise PeerError(f"{file.name} changed while it was sent ({body.size} bytes, not {size}).")
        return body.hexdigest()

    def put_growing(self, path: str, file: Path, final: threading.Event | Written, stop: threading.Event,
                    progress: dict[str, int] | None = None) -> tuple[int, str]:
        """Send ``file`` while a dump appends to it (:class:`GrowingFile`), in chunks, until ``final`` is set
        and all of it went: its size and checksum (checked as :meth:`put_file`'s). ``stop`` calls it off;
        ``progress[file.name]`` says how far it got."""
        with open(file, "rb") as f:
            body = _Hashing(GrowingFile(f, final, stop, progress), 0, stop)
            try:
                conn, response = self._send("PUT", path, body=body, headers={
                    "Transfer-Encoding": "chunked", "Content-Type": "application/octet-stream"})
            finally:
                body.close()
        self._finish(conn, response, file.name)
        return body.size, body.hexdigest()

    def _finish(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse, name: str,
                kept: Kept | None = None) -> None:
        """Read a PUT's answer, and keep or close its connection."""
        try:
            response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise PeerError(f"{self.peer.name} did not answer for {name} ({exc}).") from None
        _done_with(conn, response, kept)

    def get_growing(self, path: str, dest: Path, stop: threading.Event,
                    conns: set[http.client.HTTPConnection] | None = None) -> tuple[int, str]:
        """Receive a file that the peer's dump still writes (a chunked answer, until its dump is over) into
        ``dest`` (0600): its size and checksum. ``stop`` calls it off; its connection is in ``conns`` meanwhile
        (shut it down to end a wait)."""
        if stop.is_set():
            raise PeerError(f"Receiving {dest.name} was called off.")
        conn, response = self._send("GET", path)
        if conns is not None:
            conns.add(conn)
        got, sink = 0, None
        try:
            sink = FileSink(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            while block := response.read(BLOCK):
                if stop.is_set():
                    raise PeerError(f"Receiving {dest.name} was called off.")
                sink.put_blocking(block)
                got += len(block)
            sink, digest = None, sink.close_blocking()
        except (OSError, ValueError, http.client.HTTPException, PeerError) as exc:
            if sink is not None:
                sink.abort()
            dest.unlink(missing_ok=True)
            raise PeerError(f"Receiving {dest.name} from {self.peer.name} as it was written failed ({exc}).") \
                from None
        finally:
            conn.close()
            if conns is not None:
                conns.discard(conn)
        return got, digest

    def get_file(self, path: str, dest: Path, size: int, checksum: str | None, kept: Kept | None = None) -> str:
        """Receive a file into ``dest`` (0600), checking its size and, if given, its ``checksum``; its
        checksum."""
        conn, response = self._send("GET", path, kept=kept)
        got, sink = 0, None
        try:  # this thread decrypts; the sink's writes and checksums
            sink = FileSink(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            while block := response.read(BLOCK):
                got += len(block)
                if got > size:  # an answer longer than the file listed: not written on and on
                    raise OSError(f"more than the {size} bytes listed")
                sink.put_blocking(block)
            sink, digest = None, sink.close_blocking()
        except (OSError, http.client.HTTPException) as exc:
            if sink is not None:
                sink.abort()
            conn.close()
            raise PeerError(f"Receiving {dest.name} from {self.peer.name} failed ({exc}).") from None
        _done_with(conn, response, kept)
        if got != size or (checksum is not None and digest != checksum):
            raise PeerError(f"{dest.name} arrived from {self.peer.name} damaged ({got} of {size} bytes, or another "
                            "checksum); nothing was changed there.")
        return digest


def _sized(images: Path) -> list[tuple[Path, int]]:
    """The image files to send and their sizes, the largest first."""
    return sorted(((p, p.stat().st_size) for p in image_files(images)), key=lambda f: -f[1])


class _Sending:
    """Image files on their way to a peer, :data:`STREAMS` at a time, over connections kept for them; and,
    once :meth:`follow` was called, the files the stash and the dump append to (:func:`follows`) as they grow,
    each over a connection of its own (:data:`FOLLOWED` at a time, apart from the STREAMS), until each is
    whole (:class:`Written`)."""

    def __init__(self, client: PeerClient, kernel_id: str, bulk: PeerClient | None = None,
                 streams: int = STREAMS, sender: Any = None) -> None:
        """``bulk``: the client of the peer's bulk listener (bulkd.py), for the large files and those that grow;
        ``streams``: how many files go at once; ``sender``: what sends the large files whole (PeerLink.sender:
        processes of this host's bulk listener), ``bulk`` by default."""
        self.client, self.kernel_id = client, kernel_id
        self.bulk = bulk or client
        self.sender = sender or self.bulk
        self.kept = Kept()
        self.pool = ThreadPoolExecutor(max_workers=streams, thread_name_prefix="gpumigrate-send")
        self.followers = ThreadPoolExecutor(max_workers=FOLLOWED, thread_name_prefix="gpumigrate-grow")
        #: file name -> its send: {name, size, xxh3}
        self.sends: dict[str, Future] = {}
        self.began = time.monotonic()
        #: set once the dump is over (the files followed have their last size); set to call everything off
        self.final, self.stopped = threading.Event(), threading.Event()
        self.watcher: threading.Thread | None = None
        #: file followed -> the bytes of it read to be sent so far
        self.progress: dict[str, int] = {}
        #: the files followed as they were written (the others went whole)
        self.followed: set[str] = set()
        self._lock = threading.Lock()

    def send(self, files: list[tuple[Path, int]]) -> None:
        """Send those of ``files`` not sent yet, in this order."""
        with self._lock:
            for path, size in files:
                if path.name not in self.sends:
                    self.sends[path.name] = self.pool.submit(self._put, path, size)

    def _put(self, path: Path, size: int) -> dict:
        if size >= DETACH_MIN:  # over a connection of its own (the bulk listener's, where the peer has one)
            return {"name": path.name, "size": size, "xxh3": self.sender.put_file(
                f"images/{self.kernel_id}/{path.name}", path, size, None, self.stopped)}
        return {"name": path.name, "size": size, "xxh3": self.client.put_file(
            f"images/{self.kernel_id}/{path.name}", path, size, self.kept, self.stopped)}

    def follow(self, images: Path) -> None:
        """Send the files a dump into ``images`` appends to, from when each appears (looked for every 10 ms)."""
        self.watcher = threading.Thread(target=self._watch, args=(images,), name="gpumigrate-follow", daemon=True)
        self.watcher.start()

    def _watch(self, images: Path) -> None:
        while not self.final.is_set() and not self.stopped.is_set():
            with self._lock:
                for path in sorted([*images.glob(STASH_PARTS), *images.glob(GROWING)]):
                    if path.name not in self.sends:
                        self.sends[path.name] = self.followers.submit(self._put_growing, path)
                        self.followed.add(path.name)
            self.final.wait(0.01)

    def _put_growing(self, path: Path) -> dict:
        size, digest = self.sender.put_growing(f"images/{self.kernel_id}/{path.name}", path,
                                               Written(path, self.final), self.stopped, self.progress)
        return {"name": path.name, "size": size, "xxh3": digest}

    def dumped(self) -> tuple[int, int]:
        """The dump is over: the files followed end at their size now, and no other is looked for. How many
        were followed, and the bytes of them sent by then."""
        self.final.set()
        if self.watcher is not None:
            self.watcher.join()
            self.watcher = None
        with self._lock:
            return len(self.followed), sum(self.progress.values())

    def results(self) -> list[dict]:
        """What was sent, once all ended; at the first failure, the files not begun yet are not sent, and the
        failure is raised once those on their way ended."""
        done, _ = wait(self.sends.values(), return_when=FIRST_EXCEPTION)
        # the failure itself, not a file called off because of it (the files followed come first in the dict)
        first = next((f.exception() for f in done if not f.cancelled() and f.exception() is not None), None)
        if first is not None:
            self.stopped.set()  # those on their way end at their next block
            for future in self.sends.values():
                future.cancel()
            wait(self.sends.values())
            raise first
        return [future.result() for future in self.sends.values()]

    def failure(self) -> BaseException | None:
        """What the first send that failed so far raised, or None."""
        with self._lock:
            futures = list(self.sends.values())
        return next((f.exception() for f in futures if f.done() and not f.cancelled() and f.exception()), None)

    def stop(self) -> None:
        """Send nothing more: the files on their way are called off at their next block; return once they
        ended (their connections closed)."""
        self.stopped.set()
        if self.watcher is not None:
            self.watcher.join()
            self.watcher = None
        with self._lock:
            for future in self.sends.values():
                future.cancel()
        self.pool.shutdown(wait=True)
        self.followers.shutdown(wait=True)
        self.kept.close()


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _estimate(info: dict) -> int | None:
    """From a peer's ``GET peer/kernels/{id}``: the memory the way home's images in memory take here, with the
    process restored beside them (host memory twice, GPU memory once); None where it does not say, or says it
    wrong (a count that is not one)."""
    memory = _count(info.get("memory"))
    gpus = info.get("gpus") or []
    used = [_count(g.get("memory_used")) if isinstance(g, dict) else None
            for g in (gpus if isinstance(gpus, list) else [None])]
    if memory is None or None in used:
        return None
    return 2 * memory + sum(u for u in used if u is not None)


class _Fetching:
    """The pages files of the other host's dump, and its stash's parts, fetched as they are written: a watcher
    asks that host every
    50 ms which it has begun (``GET images/{id}?growing=true``), and each is fetched (``?growing=true``: a
    chunked answer that ends with the file: :class:`Written`), :data:`FOLLOWED` at a time. One that fails is fetched again
    after the dump, as the other files are.

    ``stash_only`` (that host does not serve files as they grow, but lists its stash's parts once its stash
    wrote them all): the watcher waits for that listing (``stash_whole``), and the parts are fetched whole,
    ``streams`` at a time, while that host's driver and CRIU run on."""

    def __init__(self, client: PeerClient, kernel_id: str, images: Path, fetcher: Any = None,
                 stash_only: bool = False, streams: int = STREAMS) -> None:
        """``fetcher``: what receives the files (PeerLink.fetcher); ``client`` by default."""
        self.client, self.kernel_id, self.images = client, kernel_id, images
        self.fetcher = fetcher or client
        self.stash_only = stash_only
        self.pool = ThreadPoolExecutor(max_workers=streams if stash_only else FOLLOWED,
                                       thread_name_prefix="gpumigrate-follow")
        self.gets: dict[str, Future] = {}
        self.final, self.stopped = threading.Event(), threading.Event()
        self.conns: set[http.client.HTTPConnection] = set()
        self.watcher = threading.Thread(target=self._watch, name="gpumigrate-follow", daemon=True)
        self.watcher.start()

    def _watch(self) -> None:
        seen_dumping = False
        with Kept() as kept:
            while not self.final.is_set() and not self.stopped.is_set():
                try:
                    answer = self.client.call("GET", f"images/{self.kernel_id}?growing=true", timeout=10, kept=kept)
                except (MigrateError, OSError, http.client.HTTPException, ValueError):
                    # that host is busy or gone, or its answer was cut: the dump's own call says which
                    self.final.wait(1.0)
                    continue
                if not isinstance(answer, dict) or not isinstance(answer.get("files", []), list):
                    self.final.wait(1.0)  # not a listing: what its dump wrote is fetched after it
                    continue
                dumping = bool(answer.get("dumping"))
                if seen_dumping and not dumping:
                    return  # its dump is over: what it wrote is fetched after it, if not yet
                seen_dumping = seen_dumping or dumping
                if self.stash_only:
                    if answer.get("stash_whole") is True:
                        self._fetch_whole(answer.get("files") or [])
                        return
                    self.final.wait(0.05)
                    continue
                for entry in answer.get("files") or []:
                    name = str(entry.get("name", "")) if isinstance(entry, dict) else ""
                    if _IMAGE_NAME.match(name) and follows(name) and name not in self.gets:
                        self.gets[name] = self.pool.submit(self.fetcher.get_growing,
                                                           f"images/{self.kernel_id}/{name}?growing=true",
                                                           self.images / name, self.stopped, self.conns)
                self.final.wait(0.05)

    def _fetch_whole(self, files: list) -> None:
        """Fetch the stash's parts listed, written whole (an answer of a known length, read to its end, as
        :meth:`PeerClient.get_growing` reads; its size is checked against the listing after the dump)."""
        for entry in files:
            name = str(entry.get("name", "")) if isinstance(entry, dict) else ""
            if _IMAGE_NAME.match(name) and Path(name).match(STASH_PARTS) and name not in self.gets:
                self.gets[name] = self.pool.submit(self.fetcher.get_growing, f"images/{self.kernel_id}/{name}",
                                                   self.images / name, self.stopped, self.conns)

    def begun(self) -> set[str]:
        """That host's dump is over: fetch nothing more than what began; the names of what began."""
        self.final.set()
        self.watcher.join()
        return set(self.gets)

    def dumped(self) -> dict[str, tuple[int, str]]:
        """That host's dump is over: what was fetched whole as it was written (name: size, checksum), once all
        that began ended."""
        self.begun()
        wait(self.gets.values())
        self.pool.shutdown(wait=True)
        return {name: future.result() for name, future in self.gets.items() if future.exception() is None}

    def stop(self) -> None:
        """Fetch nothing more; return once the fetches on their way ended (their files removed)."""
        self.stopped.set()
        self.watcher.join()
        for conn in list(self.conns):
            try:
                if conn.sock is not None:  # the plain socket's: its TLS layer is left to the reading thread
                    socket.socket.shutdown(conn.sock, socket.SHUT_RDWR)
            except OSError:
                pass
        self.pool.shutdown(wait=True, cancel_futures=True)


class PeerLink(HostLink):
    """A's view of one kernel moved to (or living on) a peer: the :class:`HostLink` a plan drives.

    Its HTTP calls run in the plan's worker thread; the relay lives on the server's event loop.
    """

    def __init__(self, peer: Peer, kernel_id: str, connection_info: dict, loop: asyncio.AbstractEventLoop,
                 api_address: tuple[str, int] | None, home: str,
                 clients: Callable[[], list[tuple[str, bytes]]] = list, idle: Callable[[], bool] = lambda: False,
                 stream: bool = True) -> None:
        self.peer = peer
        self.host = peer.name
        self.kernel_id = kernel_id
        self.info = {k: v for k, v in connection_info.items()}
        self.loop = loop
        self.api_address = api_address
        self.home = home
        self.client = PeerClient(peer)
        self.clients = clients
        #: whether the kernel can serve the host stash now (idle, and able to run this package's code there)
        self.idle = idle
        #: that host said it can have the kernel write and read its stash with its key (check, requirements)
        self.peer_stash = False
        #: that host takes a file sent as it grows (check), and this one sends them so (``stream``): a dump's
        #: pages go while it runs
        self.peer_growing, self.stream = False, stream
        #: coming home: that host lists its stash's parts once written, while its dump runs on (requirements)
        self.peer_lists_stash = False
        #: coming home: the bytes the kernel holds there, host and GPU memory (requirements; None: not said)
        self.peer_estimate: int | None = None
        #: going away: that host begins a GPU kernel's prefetch as its images arrive (check)
        self.peer_prefetch = False
        #: the last dump there was asked with the stash: its undo (resume) needs the key too
        self._dump_key = False
        self.relay: RelayClient | None = None
        #: image files on their way there since start_sending, not yet waited for by send_images
        self._sending: _Sending | None = None
        #: the pages of that host's dump, on their way here since start_fetching, until fetch_images
        self._fetching: _Fetching | None = None
        #: a transplant's object files, as sent (name, size, xxh3)
        self._sent: list[dict] = []
        #: the client of the peer's bulk listener, where :meth:`check` found one (bulkd.py): the way there
        #: sends the large files to it
        self.bulk: PeerClient | None = None
        #: the same where :meth:`requirements` found one (the way home fetches whole files from it)
        self.bulk_home: PeerClient | None = None
        #: whether it serves files as the dump writes them too (``bulk_growing``), as the server's port does
        self.bulk_home_growing = False
        #: what receives the files fetched from the peer (the way home): ``client``, or a bulkd.BulkTransfers,
        #: whose processes receive the large ones (same calls: get_growing, get_file)
        self.fetcher: Any = self.client
        #: what sends the large files to the peer whole (the way there): None (this process's threads, to
        #: ``bulk``), or that BulkTransfers, whose processes send them (put_file)
        self.sender: Any = None
        #: image files sent or fetched at once (c.GPUMigrateApp.transfer_streams)
        self.streams = STREAMS

    # -- moving there --------------------------------------------------------------------------------

    def check(self, requirements: hostfit.Requirements, gpu: dict | None, to_gpu: int | None) -> None:
        if self.api_address is not None:
            requirements.listens.append(self.api_address)
        answer = self.client.call("POST", "check", {
            "kernel_id": self.kernel_id, "requirements": requirements.to_dict(), "gpu": gpu, "to_gpu": to_gpu,
            "from": self.home})
        problems = answer.get("problems") or []
        if problems:
            raise InvalidState(f"{self.host} cannot take the kernel: {'; '.join(problems)}. It runs here as before.")
        self._same_checksum(answer, "It runs here as before.")
        self.peer_stash = bool(answer.get("stash"))
        self.peer_growing = bool(answer.get("growing"))
        self.peer_prefetch = answer.get("prefetch") is True
        self.bulk = self._bulk_client(answer, "its large files go to")

    def _bulk_client(self, answer: dict, what: str) -> PeerClient | None:
        """A client of the peer's bulk listener (bulkd.py), where its ``answer`` said it has one (``bulk_port``,
        ``bulk_tls`` as this link's scheme) and it can be reached from here; None (the files go through its
        server's port, sent or received by one process there) otherwise."""
        port = answer.get("bulk_port")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536 or port == self.client.port \
                or answer.get("bulk_tls") != self.client.https:
            return None
        try:
            socket.create_connection((self.client.host, port), timeout=BULK_PROBE).close()
        except OSError as exc:
            log.warning("gpumigrate: %s's bulk listener (port %d) cannot be reached from here (%s): the kernel's "
                        "files go through its server's port, taken or sent there by its one process (slower); open that "
                        "port between the hosts, or set c.GPUMigrateApp.bulk_port there", self.host, port, exc)
            return None
        log.info("gpumigrate: kernel %s: %s %s's bulk listener (port %d)", self.kernel_id, what, self.host, port)
        return PeerClient(self.peer, self.client.timeout, port)

    def _same_checksum(self, answer: dict, then: str) -> None:
        """Refuse a peer whose image files carry another checksum than this version's (an older one)."""
        said = answer.get("checksum")
        if said != CHECKSUM:
            raise InvalidState(f"{self.host} runs another version of jupyter-gpumigrate, whose image files carry "
                               f"{'no' if said is None else repr(said)} checksum where this one's carry {CHECKSUM!r}:"
                               f" install the same version on both hosts ({_VERSION} here). {then}")

    def takes_stash(self) -> bool:
        return self.peer_stash

    def takes_growing(self) -> bool:
        return self.peer_growing and self.stream

    def start_sending(self, images: Path, expect: int, follow: bool = False) -> None:
        self.stop_sending()
        self.client.call("POST", f"images/{self.kernel_id}", {"bytes": int(expect)})
        self._sending = _Sending(self.client, self.kernel_id, self.bulk, self.streams, self.sender)
        self._sending.send(_sized(images))
        if follow:
            self._sending.follow(images)

    def check_sending(self) -> None:
        failed = self._sending.failure() if self._sending is not None else None
        if failed is not None:
            raise failed

    def stop_sending(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.stop()

    def send_images(self, images: Path) -> int:
        files = _sized(images)
        total = sum(size for _, size in files)
        sending, self._sending = self._sending, None
        if sending is None:
            self.client.call("POST", f"images/{self.kernel_id}", {"bytes": total})
            sending = _Sending(self.client, self.kernel_id, self.bulk, self.streams, self.sender)
        try:
            followed, by_then = sending.dumped()
            early = len(sending.sends) - followed
            sending.send(files)  # what start_sending did not send yet
            sent = sending.results()
        finally:
            sending.stop()
        sizes = {path.name: size for path, size in files}
        for file in sent:  # a file sent as it grew ends where the dump left it, or it changed meanwhile
            if sizes.get(file["name"]) != file["size"]:
                raise PeerError(f"{file['name']} changed while it was sent ({file['size']} bytes sent, "
                                f"{sizes.get(file['name'])} there now): send the images again.")
        self.client.call("POST", f"images/{self.kernel_id}/complete", {"files": sent})
        # a file followed by a process of the bulk listener says no progress: only how many went so
        by = f"{by_then / 1e9:.2f} GB of those by its end" if sending.progress or not followed else \
            "each by a process of the bulk listener"
        log.info("gpumigrate: kernel %s: %d image files, %.2f GB, sent to %s in %.2f s since the first began "
                 "(%d of them before the dump ended; %d while it wrote them, %s)", self.kernel_id, len(sent),
                 total / 1e9, self.host, time.monotonic() - sending.began, early, followed, by)
        return total

    def _key(self) -> dict:
        """The kernel's connection key for that host, sent only with a call that has the kernel write or read
        its stash (an empty key: the kernel's messages are not signed)."""
        key = self.info.get("key") or b""
        return {"key": key.decode() if isinstance(key, bytes) else str(key)}

    def takes_prefetch(self) -> bool:
        return self.peer_prefetch

    def begin_prefetch(self, index: dict, gpu: dict, to_gpu: int | None) -> dict:
        held = {k: gpu[k] for k in ("index", "uuid", "memory_used", "name") if k in gpu}
        return self.client.call("POST", f"images/{self.kernel_id}/prefetch",
                                {"index": index, "gpu": held, "to_gpu": to_gpu})

    def restore(self, to_gpu: int | None, stashed: bool = False) -> dict:
        return self.client.call("POST", f"kernels/{self.kernel_id}/restore",
                                {"to_gpu": to_gpu, **(self._key() if stashed else {})}, timeout=600)

    def discard(self) -> None:
        self.client.call("DELETE", f"kernels/{self.kernel_id}")

    # -- a transplant there (engine/plans/host_transplant.py) --------------------------------------------

    def check_transplant(self, kernel_name: str, listens: list[tuple[str, int]], nbytes: int, gpu_bytes: int,
                         to_gpu: int | None) -> None:
        if self.api_address is not None:
            listens = [*listens, self.api_address]
        answer = self.client.call("POST", "transplants/check", {
            "kernel_id": self.kernel_id, "kernel_name": kernel_name, "listens": [list(a) for a in listens],
            "bytes": int(nbytes), "gpu_bytes": int(gpu_bytes), "to_gpu": to_gpu})
        problems = answer.get("problems") or []
        if problems:
            raise InvalidState(f"{self.host} cannot take the kernel's objects: {'; '.join(problems)}. It runs here "
                               "as before.")
        self._same_checksum(answer, "It runs here as before.")

    def send_objects(self, folder: Path) -> int:
        files = [(p, p.stat().st_size) for p in image_files(folder)]
        total = sum(size for _, size in files)
        self.client.call("POST", f"images/{self.kernel_id}", {"bytes": total})
        # The objects' pickle goes last: the rest is what it refers to.
        files.sort(key=lambda entry: entry[0].name == "objects.pkl")
        with Kept() as kept:
            self._sent = [{"name": p.name, "size": size,
                           "xxh3": self.client.put_file(f"images/{self.kernel_id}/{p.name}", p, size, kept)}
                          for p, size in files]
        return total

    def load_objects(self, kernel_name: str, connection_info: dict, to_gpu: int | None, wait: float) -> dict:
        return self.client.call("POST", f"kernels/{self.kernel_id}/transplant", {
            "files": self._sent, "kernel_name": kernel_name, "connection_info": connection_info, "to_gpu": to_gpu,
            "wait": wait}, timeout=wait + 60)

    def switch(self) -> dict:
        return self.client.call("POST", f"kernels/{self.kernel_id}/switch", {}, timeout=120)

    # -- the relay -----------------------------------------------------------------------------------

    def _on_loop(self, coro: Any, timeout: float = 60.0) -> Any:
        if _running_loop() is self.loop:
            raise RuntimeError("PeerLink's blocking calls must not run on the event loop's thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _connect(self) -> Any:
        api = list(self.api_address) if self.api_address else None
        query = urllib.parse.urlencode({"api": json.dumps(api)})
        request = HTTPRequest(self.client.url(f"kernels/{self.kernel_id}/channels?{query}", websocket=True),
                              headers=self.client.headers(), ca_certs=self.peer.ca_file, request_timeout=30)
        return await websocket_connect(request, max_message_size=1 << 30)

    async def attach_async(self) -> None:
        if self.relay is None:
            relay = RelayClient(self.info, self._connect, self.api_address, on_back=self._back)
            await relay.start()
            await relay.introduce(self.clients())
            self.relay = relay

    async def detach_async(self) -> None:
        relay, self.relay = self.relay, None
        if relay is not None:
            await relay.stop()

    def attach(self, clients: dict | None = None, timeout: float = 3.0) -> None:
        try:
            self._on_loop(self.attach_async())
        except MigrateError:
            raise
        except Exception as exc:
            raise PeerError(f"Cannot relay the kernel's channels to {self.host}: {exc}.") from exc
        if clients:
            # The relay's sockets live in this process: wait for the kernel's clients to be back on them.
            expected = {int(port): int(n) for port, n in clients.items()}
            missing = netstate.wait_for_clients([os.getpid()], expected, timeout)
            if missing:
                log.info("gpumigrate: kernel %s on %s: %s client connection(s) to the relay did not come back "
                         "(closed meanwhile?): expected %s, missing %s", self.kernel_id, self.host,
                         sum(missing.values()), expected, missing)

    def detach(self) -> None:
        self._on_loop(self.detach_async())

    @property
    def lost(self) -> bool:
        return self.relay is not None and self.relay.lost

    # -- living there, and coming back ---------------------------------------------------------------

    def requirements(self) -> hostfit.Requirements:
        info = self.client.call("GET", f"kernels/{self.kernel_id}")
        self._same_checksum(info, f"The kernel runs on {self.host} as before.")
        self.peer_stash = bool(info.get("stash"))
        self.peer_growing = bool(info.get("growing"))
        self.peer_lists_stash = info.get("stash_listed") is True
        self.peer_estimate = _estimate(info)
        if info.get("stash_left") is True and not self.give_back_left():
            raise InvalidState(f"The kernel runs on {self.host} without its large buffers (its server there died "
                               "during a way home, after the kernel wrote them into its stash there), and could not "
                               f"read them back: this server's log says why. It runs on {self.host} as before; try "
                               "again.")
        self.bulk_home = self._bulk_client(info, "its large files come from")
        self.bulk_home_growing = self.bulk_home is not None and info.get("bulk_growing") is True
        return hostfit.Requirements.from_dict(info["requirements"])

    def estimate(self) -> int | None:
        return self.peer_estimate

    def fetches_stash(self) -> bool:
        # as dump() asks the stash: of a kernel that can serve it (idle)
        return not self.takes_growing() and self.peer_stash and self.peer_lists_stash and self.idle()

    def start_fetching(self, images: Path, stash_only: bool = False) -> None:
        self.stop_fetching()
        self._fetching = _Fetching(self.client, self.kernel_id, images, self.fetcher, stash_only, self.streams)

    def stop_fetching(self) -> None:
        fetching, self._fetching = self._fetching, None
        if fetching is not None:
            fetching.stop()

    def dump(self, stash_min: int | None = None, timeout: float | None = None) -> dict:
        # The stash is asked of a kernel that can serve it only: a busy one would answer only once its cell
        # ends; one that cannot run this package's code would fail it. That host bounds its wait for the stash
        # (and for the stash's undo) by what the kernel holds: a large kernel's may outlast 600 s. ``timeout``:
        # wait no longer for its answer (that host's dump runs on to its end regardless).
        self._dump_key = stash_min is not None and self.peer_stash and self.idle()
        body = {**self._key(), "stash_min": int(stash_min or 0)} if self._dump_key else {}
        said = self.client.call("POST", f"kernels/{self.kernel_id}/dump", body,
                                timeout=timeout or (3600 if self._dump_key else 600))
        return said if isinstance(said, dict) else {}

    def read_json(self, name: str) -> dict:
        if not _IMAGE_NAME.match(name):
            raise PeerError(f"{name!r} is not an image file's name.")
        try:
            said = self.client.call("GET", f"images/{self.kernel_id}/{name}", timeout=30)
        except ValueError as exc:
            raise PeerError(f"{self.host}'s {name} is not JSON ({exc}).") from None
        if not isinstance(said, dict):
            raise PeerError(f"{self.host}'s {name} is not a JSON object.")
        return said

    def resume(self) -> None:
        self.client.call("POST", f"kernels/{self.kernel_id}/resume", self._key() if self._dump_key else {},
                         timeout=3600 if self._dump_key else 600)

    def resume_left(self) -> None:
        """Resume the kernel that host dumped for a way home that never ended (this server's predecessor died
        during it): with the kernel's key, in case its dump wrote the stash. The same where that host's server
        died during such a dump, after the kernel wrote its stash: it runs there without its large buffers
        (``stash_left``), and reads them back."""
        self.client.call("POST", f"kernels/{self.kernel_id}/resume", self._key(), timeout=3600)

    def give_back_left(self) -> bool:
        """Where that host's server died during a dump for the way home after the kernel wrote its stash, the
        kernel runs there without its large buffers (``stash_left``): have it read them back, with its key
        (``POST kernels/{id}/resume`` with ``stash_left``: that host does nothing more, never a resume from
        images). True once it has them (or none were away); False, logged, if it could not be asked or failed."""
        try:
            try:
                info = self.client.call("GET", f"kernels/{self.kernel_id}", timeout=30)
            except PeerError as exc:
                if exc.status == 404:
                    return True  # no such kernel there (discarded): nothing of it to read back
                raise
            if info.get("stash_left") is not True:
                return True
            log.warning("gpumigrate: kernel %s runs on %s without its large buffers (its server there died during a "
                        "dump for the way home, after the kernel wrote its stash): it reads them back", self.kernel_id,
                        self.host)
            self.client.call("POST", f"kernels/{self.kernel_id}/resume", {**self._key(), "stash_left": True},
                             timeout=GIVE_BACK_WAIT)
            return True
        except (MigrateError, OSError, ValueError, AttributeError, http.client.HTTPException) as exc:
            log.error("gpumigrate: kernel %s on %s could not read back its large buffers, which are in its stash "
                      "there (%s): asked again as the relay dials again, and before its way home", self.kernel_id,
                      self.host, exc)
            return False

    async def _back(self) -> None:
        """The relay found that host again (before the clients' messages held meanwhile go): the kernel has its
        large buffers first, or the dial counts as failed (and is made again, within the relay's patience)."""
        if not await asyncio.to_thread(self.give_back_left):
            raise PeerError(f"the kernel on {self.host} runs without its large buffers, and could not read them "
                            "back yet")

    def fetch_images(self, images: Path) -> int:
        """The files are fetched as soon as they are listed, by name and size; their checksums, which that
        host computes by reading them all (0.9 s a GB on the dev machine's two cores), come meanwhile, from a
        second listing, and each file is checked against its own once both are here."""
        try:
            return self._fetch_images(images)
        except BaseException:
            self.stop_fetching()  # before the undo of that host's dump (its resume) begins
            raise

    def _fetch_images(self, images: Path) -> int:
        began = time.monotonic()
        # kept until all of it came: a failure before then has the undo's stop_fetching call off what runs
        fetching = self._fetching
        early = fetching.begun() if fetching is not None else set()
        listing = self.client.call("GET", f"images/{self.kernel_id}?checksums=false")
        for entry in listing["files"]:
            if not _IMAGE_NAME.match(str(entry["name"])):
                raise PeerError(f"{self.host} listed an image file with an unsafe name: {entry['name']!r}.")
        entries = sorted(listing["files"], key=lambda e: -int(e["size"]))

        def get(entry: dict) -> tuple[str, str]:
            name = str(entry["name"])
            return name, self.fetcher.get_file(f"images/{self.kernel_id}/{name}", images / name, int(entry["size"]),
                                               None, kept)

        with Kept() as kept, ThreadPoolExecutor(max_workers=self.streams + 1, thread_name_prefix="gpumigrate-fetch") \
                as pool:
            said = pool.submit(lambda: PeerClient(self.peer).call("GET", f"images/{self.kernel_id}", timeout=600))
            # the rest while those begun during the dump end
            got = dict(pool.map(get, [e for e in entries if str(e["name"]) not in early]))
            streamed = fetching.dumped() if fetching is not None else {}
            # a file fetched during the dump is kept if it is as large as the dump left it (its checksum is
            # checked below, with the others'); one that is not, or failed, is fetched now
            whole = {str(e["name"]): streamed[str(e["name"])][1] for e in entries
                     if str(e["name"]) in streamed and streamed[str(e["name"])][0] == int(e["size"])}
            got.update(pool.map(get, [e for e in entries if str(e["name"]) in early and str(e["name"]) not in whole]))
            got.update(whole)
            fetched = time.monotonic()
            checksums = {str(e["name"]): str(e.get("xxh3", "")) for e in said.result()["files"]}
        self._fetching = None
        for name in set(streamed) - {str(e["name"]) for e in entries}:
            (images / name).unlink(missing_ok=True)  # fetched as it grew, but not among the images: not kept
        for entry in entries:
            name = str(entry["name"])
            said = checksums.get(name, "")
            if name in whole and not hmac.compare_digest(got[name].encode(), said.encode("utf-8", "replace")):
                log.warning("gpumigrate: kernel %s: %s, fetched as %s's dump wrote it, differs from the file there; "
                            "fetched again", self.kernel_id, name, self.host)
                got[name] = self.fetcher.get_file(f"images/{self.kernel_id}/{name}", images / name,
                                                  int(entry["size"]), None)
            if not hmac.compare_digest(got[name].encode(), said.encode("utf-8", "replace")):
                raise PeerError(f"{name} arrived from {self.host} damaged (its checksum is not the one {self.host} "
                                "lists); nothing was changed there.")
        total = sum(int(e["size"]) for e in entries)
        log.info("gpumigrate: kernel %s: %d image files, %.2f GB, fetched from %s in %.2f s after its dump (%d "
                 "of them, %.2f GB, while the dump ran; their checksums there: %.2f s after)", self.kernel_id,
                 len(entries), total / 1e9, self.host, fetched - began, len(whole),
                 sum(streamed[name][0] for name in whole) / 1e9, time.monotonic() - fetched)
        return total

    def signal(self, signum: int) -> None:
        self.client.call("POST", f"kernels/{self.kernel_id}/signal", {"signum": int(signum)})

    def describe(self) -> dict:
        return self.client.call("GET", f"kernels/{self.kernel_id}", timeout=10)


# -- B's side: the kernels this server hosts for its peers ---------------------------------------------


def _bytes_in(folder: Path) -> int:
    """The bytes of the files in ``folder`` now (0 if it cannot be read)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            with contextlib.suppress(OSError):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _said(log_path: Path, lines: int = 3) -> str:
    """The last lines of a new process's log, to end a sentence with ('' if it said nothing)."""
    try:
        tail = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-lines:]
    except OSError:
        return ""
    return f"; it said: {' | '.join(tail)}" if tail else ""


def _boot_id() -> str:
    """This boot of the host (a PID and a start time name a process within one boot only)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _kernel_of(pid: int) -> str | None:
    """The kernel id in the environment of process ``pid`` (its launcher set it where the kernel started), or
    None."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{ENV_KERNEL_ID}=".encode()
    return next((v[len(prefix):].decode(errors="replace") for v in environ if v.startswith(prefix)), None)


class Guest:
    """A kernel restored here for a peer: the :class:`KernelProcess` that B's plans drive."""

    def __init__(self, manifest: Manifest, peer: str) -> None:
        self.kernel_id = manifest.kernel_id
        self.manifest = manifest
        self.peer = peer
        self.state = SUSPENDED
        self.broken_reason: str | None = None
        self.sessions: list[dict] = []
        self.pid: int | None = None
        #: when that process started (proctree.start_time): with the PID, it names the kernel's process, which
        #: a PID reused by another process after the kernel's died does not
        self.started: int | None = None
        self.pgid: int | None = None
        self.api_listen: tuple[str, int] | None = None
        #: the kernel's connection key, while a call of its owner that needs it runs (never written here)
        self.key: str | None = None
        #: it ran here once: its images (a dump for its way home) may be its only copy
        self.ran = False
        #: its peer relayed its channels here (ChannelsHandler) since this server has it
        self.relayed = False
        #: being discarded as no relay claimed it (GuestHost.claim refuses a relay from then on)
        self.discarding = False
        #: taken back running by this server from an earlier one's record (GuestHost.take_back): its large buffers
        #: may be in a stash here, written for a way home that server did not end (GuestHost.stash_left)
        self.taken_back = False

    @property
    def kernel_name(self) -> str:
        return self.manifest.kernel_name

    @property
    def kernel_pid(self) -> int | None:
        return self.pid

    @property
    def kernel_connection_info(self) -> dict:
        return dict(self.manifest.connection_info)

    def release(self) -> None:
        if self.pid is not None:
            proctree.wait_gone(self.pid, timeout=30)
        self.pid = self.pgid = self.started = None

    def adopt(self, pid: int) -> None:
        self.pid = pid
        self.started = proctree.start_time(pid)
        self.pgid = os.getpgid(pid)

    def runs(self) -> bool:
        """Whether the kernel's process runs: its PID is alive and names the process adopted (the same start
        time), not another that took the PID after the kernel's ended. One whose start time could not be read
        as it was adopted (gone already) does not."""
        pid, started = self.pid, self.started
        return pid is not None and started is not None and proctree.is_alive(pid) and \
            proctree.start_time(pid) == started

    def wait_ready(self, timeout: float) -> bool:
        return True  # its owner checks, through the relay: it has the kernel's key, we need not

    def release_gpu_cache(self) -> None:
        # Only with the key, which its owner sends for an idle kernel (and the stash, which releases it too).
        if self.key is not None:
            run_silently(self._keyed(), RELEASE_TORCH_CACHE, timeout=5.0)

    def invite_stager(self, path: str, token: str) -> str | None:
        return "a kernel hosted for a peer is not moved between GPUs here"

    def _keyed(self) -> dict:
        return {**self.manifest.connection_info, "key": self.key}

    def _alive(self, pid: int | None = None) -> Callable[[], bool]:
        """Whether the kernel's process (``pid``, by default the one adopted) still runs."""
        root = pid if pid is not None else self.pid
        return lambda: root is not None and proctree.is_alive(root)

    def host_stash(self, folder: str, min_total: int, timeout: float, gpu_only: bool = False,
                   idle_only: bool = False) -> dict:
        """Have the kernel write its large buffers into ``folder``, as its owner asked (with the key, only when
        the kernel is idle there: plans/host_move.py); else step aside."""
        if self.key is None:
            return {"aside": "its owner did not ask for the stash (the kernel is busy or cannot run it, or the "
                             "owner's c.MigratableProvisioner.host_stash_min is None)"}
        return json.loads(evaluate_silently(self._keyed(), HOST_STASH_CALL.format(
            folder=folder, min_total=int(min_total), more=", gpu_only=True" if gpu_only else ""), timeout,
            alive=self._alive()))

    def host_take_back(self, folder: str, timeout: float, pid: int | None = None, gpu: dict | None = None) -> dict:
        """Have the kernel read its buffers back from ``folder`` (``gpu``: its CUDA buffers from the prefetch's
        memory, engine/prefetch.py), with the key its owner sent. A guest stashed between cells only (its
        owner asks an idle kernel): no safe point waits to be released."""
        if self.key is None:
            raise InvalidState("The kernel's large buffers are in its images here, but its owner sent no key to have "
                               "it read them back.")
        call = (HOST_TAKE_BACK_GPU_CALL.format(folder=folder, gpu=gpu) if gpu
                else HOST_TAKE_BACK_CALL.format(folder=folder))
        # During a resume, ``pid`` is the restored tree's root, not adopted yet.
        return json.loads(evaluate_silently(self._keyed(), call, timeout, alive=self._alive(pid)))

    def host_open_prefetch(self, folder: str, gpu: dict, timeout: float, pid: int | None = None) -> str | None:
        """Have the restored kernel begin mapping the prefetch's memory while the helper reads; None if it
        does, else why not (it then maps it when given the layout)."""
        if self.key is None:
            return "its owner sent no key"
        try:
            said = json.loads(evaluate_silently(self._keyed(), HOST_OPEN_PREFETCH_CALL.format(
                handle=str(gpu["handle"]), session=gpu.get("session")), timeout, alive=self._alive(pid)))
        except (OSError, RuntimeError, TimeoutError, ValueError, ConnectionError) as exc:
            return f"it was not asked ({exc})"
        return None if said.get("opening") else str(said.get("reason") or said)

    def secrets(self) -> dict:
        return {}  # its owner keeps them: a guest's images are never taken back by this host

    def record_moving(self, host: str | None) -> None:
        self.adopt_remote(None, {})

    def record_copy_left(self, host: str | None) -> None:
        self.adopt_remote(None, {})

    def adopt_remote(self, link: HostLink | None, where: dict) -> None:
        raise InvalidState("A kernel hosted for a peer does not move on from here; its owner brings it back first.")


@dataclass
class DumpRun:
    """A guest's dump for its way home, while it runs: ``over`` is set once it ended (:meth:`end`), ``ok`` if
    it succeeded. With a ``mark``, a file says how it stands to the bulk listener's processes, which serve its
    files as they grow (:class:`MarkedRun`): written when it begins, and again as it ends, before ``over``."""

    over: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    #: when it began (time.time()): a stash index older than that is an earlier dump's, not this one's
    began: float = field(default_factory=time.time)
    #: the mark's path (GuestHost.mark_of), or None
    mark: Path | None = None

    def __post_init__(self) -> None:
        self._say(over=False)

    def end(self, ok: bool) -> None:
        """The dump ended (``ok``: it succeeded): said in the mark, then to this process (``over``)."""
        self.ok = ok
        try:
            self._say(over=True)
        finally:
            self.over.set()

    def _say(self, over: bool) -> None:
        if self.mark is None:
            return
        try:  # replaced whole: a process reads the old mark or the new, never half of one
            self.mark.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            scratch = self.mark.with_name(f"{self.mark.name}.tmp")
            scratch.write_text(json.dumps({"over": over, "ok": self.ok, "began": self.began}))
            os.replace(scratch, self.mark)
        except OSError as exc:  # with no mark, the bulk listener refuses to follow its files (409): they come
            log.warning("gpumigrate: the mark of a dump could not be written at %s (%s): the bulk listener will not "
                        "serve its files as it writes them (this server's own port still does); they are fetched "
                        "whole after the dump otherwise", self.mark, exc)
            with contextlib.suppress(OSError):
                self.mark.unlink(missing_ok=True)


class MarkedRun:
    """A guest's dump for its way home, as a process other than its server's sees it (a bulk listener's, which
    serves its files as they grow: bulkd.py): its mark (:attr:`DumpRun.mark`), read again at each look until
    it says the dump is over. What :func:`bulk.send_growing` needs of a :class:`DumpRun`: ``over`` (``is_set``,
    ``wait``) and ``ok``. A mark gone (its guest discarded, its server restarted) reads as a dump that failed:
    no file is ever said whole from it."""

    #: how often a wait reads the mark (seconds): as often as GrowingFile looks at a file's size
    POLL = 0.005

    def __init__(self, mark: Path) -> None:
        self.mark = mark
        self.over = self
        self._last: dict | None = None  # once it said the dump is over
        self._began: object = None  # the dump's, from the first read: a mark of another dump says this one failed
        #: whether a mark was there at the first read
        self.marked = False

    def _said(self) -> dict:
        if self._last is not None:
            return self._last
        try:
            said = json.loads(self.mark.read_bytes())
        except (OSError, ValueError):
            said = None
        if isinstance(said, dict) and self._began is None:
            self._began, self.marked = said.get("began"), True
        if not isinstance(said, dict) or said.get("began") != self._began:
            said = {"over": True, "ok": False}
        if said.get("over") is not False:
            self._last = said
        return said

    @property
    def running(self) -> bool:
        """The dump runs (its files are followed as they grow); False once it is over, or with no mark."""
        return not self.is_set()

    def is_set(self) -> bool:
        return self._said().get("over") is not False

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self.POLL, left))
        return True

    @property
    def ok(self) -> bool:
        return self.is_set() and self._said().get("ok") is True


class GuestHost:
    """The kernels this server hosts for its peers, with their images under ``root`` (0700)."""

    def __init__(self, root: Path, criu: Callable[[], Criu], inventory: Callable[[], list] | None = None,
                 memory_root: Path | None = None, images: str = AUTO,
                 kernelspec: Callable[[str], tuple[list[str], dict]] | None = None,
                 received_expire: float = RECEIVED_EXPIRE, unclaimed: float = UNCLAIMED,
                 records: Path | None = None) -> None:
        #: the guests' images, on disk under ``root`` or in memory under ``memory_root`` (a tmpfs), where
        #: ``images`` (images.choose) puts them: they live only until the kernel runs, here or back home
        self.store = ImageStore(root, memory_root)
        self.store.drop_removing()  # what an earlier server had begun to delete
        self.images = images
        self.criu = criu
        self.inventory = inventory
        self.guests: dict[str, Guest] = {}
        self.locks: dict[str, asyncio.Lock] = {}
        self.relays: dict[str, Any] = {}
        #: where the relays listen for their kernels' calls to their servers, one listener for each peer's
        self.api_listeners = ApiListeners()
        #: kernel id -> image file name -> the checksum of what arrived (checked when the images are complete)
        self.received: dict[str, dict[str, str]] = {}
        #: kernels whose dump for their way home runs here (:meth:`growing`, bulk.py)
        self.dumping: dict[str, DumpRun] = {}
        #: whether this host serves its dumps' pages files as they are written (c.GPUMigrateApp.stream_dump)
        self.serve_growing = True
        #: whether the restore of a guest that stashed has the stash helper read its CUDA buffers onto its GPU
        #: while CRIU restores it (engine/prefetch.py; this server's c.MigratableProvisioner.resume_prefetch)
        self.prefetch = True
        #: a kernel type's (argv, env), by its name: a transplant's new process starts from it
        self.kernelspec = kernelspec
        #: the port of this server's bulk listener, once it listens, and whether it takes TLS (bulkd.py)
        self.bulk_port: int | None = None
        self.bulk_tls = False
        #: transplants' new processes started here, not yet switched to, by kernel id
        self._transplants: dict[str, subprocess.Popen] = {}
        self._transplant_lock = threading.Lock()
        #: the one pending check of each kernel's new process (its expiry, or its relay's start), or of images
        #: being received (their expiry)
        self._timers: dict[str, threading.Timer] = {}
        self.received_expire = received_expire
        #: how long a guest taken back at start waits for its peer's relay (take_back)
        self.unclaimed = unclaimed
        #: the records of the guests that run here (take_back): one folder per state folder (the images' root
        #: is one per user with the node helper, whatever the state folder)
        self.records = records if records is not None else root / RUNNING_GUESTS
        #: the marks of the dumps that run here (DumpRun.mark): those an earlier server left are of dumps that
        #: ended with it (its bulk listener, and the processes that served them, too): :meth:`drop_dump_marks`
        self.dump_marks = self.records.parent / DUMP_MARKS
        #: set once the guests an earlier server left are taken back (or none will be): until then a kernel
        #: not listed may be one of them, and a peer asking for it is told to ask again (503), not that it is
        #: gone (404), which would make it forget the kernel
        self.back = threading.Event()
        self.back.set()
        #: images being received for a move, not yet restored: kernel id -> the receipt its expiry checks
        self._receiving: dict[str, object] = {}
        #: prefetches begun as a kernel's stash arrives (:meth:`begin_prefetch`), until its restore takes one
        #: (kernel id -> it and its GPU's index) or the images go
        self._early: dict[str, tuple[Prefetch, int]] = {}
        #: when this server began: image folders made since are its own, never swept (:meth:`_sweep`)
        self._began = time.time()

    def stop_relay(self, kernel_id: str) -> None:
        relay = self.relays.pop(kernel_id, None)
        if relay is not None:
            relay.stop()

    # the guests that run here, on disk: a server killed or stopped leaves them running, and the next takes
    # them back (its peer's relay dials again meanwhile)

    def _remember(self, guest: Guest) -> None:
        """Write down a guest that now runs here: its manifest, its peer, its process (PID and start time)."""
        if guest.pid is None:
            return
        try:  # it runs here now, whatever this says: a failure costs its life after this server's only
            self.records.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_durably(self.records / f"{guest.kernel_id}.json", json.dumps({
                "manifest": asdict(guest.manifest), "peer": guest.peer, "pid": guest.pid,
                "started": proctree.start_time(guest.pid), "boot": _boot_id()}))
        except OSError as exc:
            log.warning("gpumigrate: kernel %s, hosted for peer %s, runs here, but its record could not be written "
                        "(%s): it will not outlive this server", guest.kernel_id, guest.peer, exc)

    def _forget(self, kernel_id: str) -> None:
        (self.records / f"{kernel_id}.json").unlink(missing_ok=True)

    def take_back(self) -> list[tuple[str, int]]:
        """At start, once this server holds its state folder: the guests an earlier server of it left (killed,
        or stopped). One whose process runs, the same process (PID, start time, and its kernel id in its
        environment), is taken back running; one whose process is gone but whose dump for its way home is here
        whole (its manifest) is taken back suspended: its images are its only copy, and its peer fetches them
        or has it resumed. Any other record is removed; one that cannot be read is left, and logged. What was
        taken back running: (kernel id, PID)."""
        try:
            taken = self._take_back_all()
            self._sweep()
            return taken
        finally:
            self.back.set()

    def _sweep(self) -> None:
        """Images here of no guest and no record: received for a move by a server killed before it restored
        them (their peer resumed its own copy), or left by one killed as it discarded them. In memory they
        would hold the host's memory until it restarts. A folder whose record could not be read stays, and
        so does one made or changed since this server began (a peer's move may begin before this runs)."""
        try:
            recorded = {p.stem for p in self.records.glob("*.json")}
        except OSError:
            return  # nothing is known of the records: nothing is swept
        for base in (self.store.root, self.store.memory_root):
            try:
                names = [p.name for p in base.iterdir() if p.is_dir() and not p.is_symlink()
                         and p.stat().st_mtime < self._began] if base else []
            except OSError:
                continue
            for name in names:
                if name.startswith(".") or name == RUNNING_GUESTS or not _IMAGE_NAME.match(name) or \
                        name in self.guests or name in recorded:
                    continue
                log.warning("gpumigrate: images of kernel %s, which an earlier server received or kept for a peer "
                            "and no guest or record here names, are removed from %s", name, base)
                try:
                    self._end_unrecorded(name)
                    self.store.remove(name)
                except (OSError, MigrateError) as exc:
                    log.error("gpumigrate: the images of kernel %s could not be removed from %s: %s", name, base,
                              exc)

    def _end_unrecorded(self, kernel_id: str) -> None:
        """What a restore for a peer left as this host's earlier server died during it (CRIU died with it): a
        tree stuck half restored in CRIU's restorer, which never runs again (every signal blocked, on a futex),
        holding its memory and the kernel's PIDs here for ever. Its peer undid the move and runs the kernel
        from its own images. Known by the mark :meth:`restore` leaves in the folder while CRIU runs: this
        server's state folder's (another server's, sharing the images' folder, is not ours to judge), and
        the process that holds the kernel's PID, started since in this boot, on this host's network, and is
        that kernel's (its environment, once CRIU restored its memory) or still CRIU's own fork."""
        folder = self.store.path_for(kernel_id)
        try:
            mark = json.loads((folder / RESTORING).read_text())
            since, owner, boot = int(mark["since"]), str(mark["owner"]), str(mark["boot"])
            pid = self.store.read_manifest(kernel_id).pid
        except (OSError, ValueError, KeyError, TypeError, MigrateError):
            return  # never restored here (or its mark unreadable: left alone)
        if owner != str(self.records) or boot != _boot_id():
            return
        started, found = proctree.start_time(pid), proctree.info(pid)
        if started is None or started <= since or found is None or found.tgid != pid \
                or not proctree.on_this_network(pid) or not (_kernel_of(pid) == kernel_id or found.name == "criu"):
            return
        log.warning("gpumigrate: kernel %s: its process %d, which an earlier server was restoring here for a peer "
                    "when it stopped, is stuck half restored: killed (the peer undid the move)", kernel_id, pid)
        proctree.kill_tree(pid)
        proctree.wait_gone(pid, timeout=10)

    def _take_back_all(self) -> list[tuple[str, int]]:
        taken: list[tuple[str, int]] = []
        try:
            info = os.lstat(self.records)
            if not os.path.isdir(self.records) or os.path.islink(self.records):
                raise OSError(f"{self.records} is not a folder")
            if info.st_uid != os.geteuid() or info.st_mode & 0o077:
                raise OSError(f"{self.records} is not a private folder of this user's")
            paths = sorted(self.records.glob("*.json"))
        except FileNotFoundError:
            return taken
        except OSError as exc:
            log.error("gpumigrate: the kernels hosted for peers by an earlier server are not taken back: %s", exc)
            return taken
        for path in paths:
            kernel_id = path.stem
            try:
                record = json.loads(path.read_text())
                manifest = Manifest.from_dict(record["manifest"])
                pid, started, peer = int(record["pid"]), record["started"], str(record["peer"])
                if manifest.kernel_id != kernel_id or manifest.wrong_types():
                    raise ValueError(f"it is not kernel {kernel_id}'s")
                if record.get("boot") != _boot_id():
                    pid = 0  # written before the host started again: its process is gone, whatever has its PID
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.error("gpumigrate: the record of kernel %s, hosted for a peer, cannot be read (%s): left in %s",
                          kernel_id, exc, path)
                continue
            try:
                kept = self._take_back_one(kernel_id, manifest, peer, pid, started)
                if kept == RUNNING:
                    taken.append((kernel_id, pid))
                elif not kept:
                    path.unlink(missing_ok=True)
            except (OSError, MigrateError) as exc:  # gone meanwhile, or unreadable: left for the next start
                log.error("gpumigrate: kernel %s, hosted for peer %s, could not be taken back (%s)", kernel_id,
                          peer, exc)
        return taken

    def _take_back_one(self, kernel_id: str, manifest: Manifest, peer: str, pid: int, started: Any) -> str:
        """Take one guest back (see :meth:`take_back`): its state, or "" if nothing of it is left here."""
        if pid > 0 and proctree.is_alive(pid) and proctree.start_time(pid) == started \
                and _kernel_of(pid) in (kernel_id, None):  # None: launched without the kernel's credential
            stopped = [p for p in proctree.descendants(pid)
                       if (found := proctree.info(p)) is not None and found.state in ("t", "T")]
            guest = Guest(manifest, peer)
            guest.adopt(pid)
            for process in stopped:  # a dump's CRIU killed with its server: a kernel never stops itself
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process, signal_mod.SIGCONT)
            guest.state, guest.ran, guest.taken_back = RUNNING, True, True
            self.guests[kernel_id] = guest
            if self.stash_left(guest):
                log.warning("gpumigrate: kernel %s, hosted for peer %s, runs without its large buffers: it wrote them "
                            "into its stash in %s for a way home that the server before this one did not end; it "
                            "reads them back once its peer sends its key (as that peer finds it again)", kernel_id,
                            peer, self.store.path_for(kernel_id))
            self._later(kernel_id, self.unclaimed, self._unclaimed, pid)
            log.info("gpumigrate: kernel %s, hosted for peer %s, taken back: its process %d runs on%s", kernel_id,
                     peer, pid, f" (it was stopped: {stopped}, continued)" if stopped else "")
            return RUNNING
        if (self.store.path_for(kernel_id) / MANIFEST).is_file():
            dumped = self.store.read_manifest(kernel_id)
            if dumped.kernel_id == kernel_id:
                guest = Guest(dumped, peer)
                guest.ran = True  # its images may be its only copy: never expired
                self.guests[kernel_id] = guest
                log.info("gpumigrate: kernel %s, hosted for peer %s, taken back suspended: its dump for its way "
                         "home is here whole", kernel_id, peer)
                return SUSPENDED
        log.warning("gpumigrate: kernel %s, hosted for peer %s, no longer runs here: its record goes", kernel_id,
                    peer)
        return ""

    def lock(self, kernel_id: str) -> asyncio.Lock:
        return self.locks.setdefault(kernel_id, asyncio.Lock())

    def guest(self, kernel_id: str) -> Guest:
        try:
            return self.guests[kernel_id]
        except KeyError:
            if not self.back.is_set():
                raise GuestsNotBack(f"This server is taking back the kernels it hosts for peers: ask for kernel "
                                    f"{kernel_id} again in a moment.") from None
            raise GuestNotFound(f"This server hosts no kernel {kernel_id} for a peer.") from None

    def _relays_listens(self, listens: list[tuple[str, int]], peer: str
                        ) -> tuple[list[tuple[str, int]], list[str]]:
        """``listens`` less those where the relays here listen for kernels' calls to their servers, and a sentence
        for each of those that ``peer``'s kernel cannot have. The one where they listen for ``peer``'s own kernels
        is no problem: a kernel of that peer shares it (all its kernels call the one server)."""
        left, found = [], []
        for address, port in listens:
            holder = self.api_listeners.holder((address, port))
            if holder is None:
                left.append((address, port))
            elif holder != peer:
                found.append(f"the port {address}:{port}, where the kernel calls its server, is where kernels that "
                             f"{holder} moved here call theirs (it is free once they left this host)")
        return left, found

    def check(self, requirements: hostfit.Requirements, gpu: dict | None, to_gpu: int | None,
              peer: str = "") -> list[str]:
        requirements.listens, found = self._relays_listens(requirements.listens, peer)
        found = hostfit.problems(requirements) + found
        try:
            self.criu()
        except MigrateError as exc:
            found.append(str(exc))
        if gpu is not None or to_gpu is not None:
            try:
                if gpu is None:
                    raise InvalidState(f"the kernel holds no GPU, so it cannot go onto GPU {to_gpu}")
                placement.plan_resume(gpus_mod.snapshot(), gpu, to_gpu, gpus_mod.driver_major())
            except MigrateError as exc:
                found.append(str(exc).rstrip("."))
        return found

    # receiving images

    def begin(self, kernel_id: str, size: int) -> Path:
        stale = self.guests.get(kernel_id)
        if stale is not None and stale.state == SUSPENDED and stale.pid is None and kernel_id not in self.dumping:
            # A dump kept for a way home that never ended (this server's predecessor died meanwhile): its peer,
            # which moves the kernel here again, has it at home.
            log.warning("gpumigrate: kernel %s comes here again from its peer: the dump kept of it goes", kernel_id)
            self.discard(kernel_id)
        if kernel_id in self.guests and self.guests[kernel_id].state != STOPPED:
            raise InvalidState(f"Kernel {kernel_id} already lives here.")
        with self._transplant_lock:  # images sent before are replaced: their receipt, and a prefetch begun for them
            self._receiving.pop(kernel_id, None)
            early = self._early.pop(kernel_id, None)
        if early is not None:
            early[0].stop()
        self.received[kernel_id] = {}
        path = self.store.create(kernel_id, choose(self.store, self.images, size)[0])
        free = shutil.disk_usage(path).free
        if size > free:
            self.store.remove(kernel_id)
            raise ImageError(f"The kernel's images need {size} bytes and {path.parent} has {free} free.")
        receipt = object()
        with self._transplant_lock:
            self._receiving[kernel_id] = receipt
        loop = _running_loop()  # the server's (begin is called by its handler): a timer, not a thread per receipt
        if loop is not None:
            loop.call_later(self.received_expire, lambda: loop.run_in_executor(
                None, self._expire_received, kernel_id, receipt))
        return path

    def _expire_received(self, kernel_id: str, receipt: object) -> None:
        """Images received for a move and never restored: their peer died or gave up, and kept its own copy."""
        with self._transplant_lock:
            if self._receiving.get(kernel_id) is not receipt:
                return  # restored, discarded, or received again since
            guest = self.guests.get(kernel_id)
            if guest is not None and (guest.ran or guest.state != SUSPENDED):
                return
            self._receiving.pop(kernel_id, None)
        log.warning("gpumigrate: kernel %s: the images its peer sent %.0f s ago were never restored here; deleted "
                    "(the peer keeps its own copy until the kernel answers from here)", kernel_id,
                    self.received_expire)
        self.discard(kernel_id)

    def image_path(self, kernel_id: str, name: str) -> Path:
        return image_path(self.store, kernel_id, name)

    def begin_prefetch(self, kernel_id: str, index: dict, gpus: list[dict], to_gpu: int | None) -> dict:
        """While a GPU kernel's images arrive for a move here, begin its restore's prefetch (engine/prefetch.py):
        on the GPU its restore will take (``gpus``: the manifest's record of the GPU it holds at home; ``to_gpu``
        as the restore will be asked), the stash helper allocates what ``index`` (its stash's index, as the file
        holds it) says and reads each chunk of its files as soon as it has arrived, instead of all of them once
        the restore begins. ``{"gpu": its index, "reason": None}``, or ``{"gpu": None, "reason": why not}``:
        the restore then makes its own, or the kernel reads its files itself. InvalidState if the kernel's images
        are not being received here."""
        with self._transplant_lock:
            receipt = self._receiving.get(kernel_id)
            if receipt is None:
                raise InvalidState(f"Kernel {kernel_id}'s images are not being received here: its prefetch begins "
                                   f"after POST /peer/images/{kernel_id}.")
        folder = self.store.path_for(kernel_id)

        def aside(why: str) -> dict:
            log.info("gpumigrate: kernel %s: no prefetch begins as its images arrive: %s", kernel_id, why)
            return {"gpu": None, "reason": why}

        if not self.prefetch:
            return aside("this host's c.MigratableProvisioner.resume_prefetch is off")
        if self.inventory is None:
            return aside("this host does not look at its GPUs")
        try:
            hoststash.index_of(index, "the stash's index sent")
            nbytes = cuda_bytes(index)
            move = placement.plan_resume(self.inventory(), gpus, to_gpu, gpus_mod.driver_major())
        except (hoststash.StashDamaged, MigrateError, ValueError, TypeError, KeyError, AttributeError) as exc:
            return aside(str(exc).rstrip("."))
        target = move.target
        if not nbytes:
            return aside("the stash holds no CUDA buffer")
        if move.several:
            return aside("the kernel comes onto several GPUs")
        if gpus_mod.one_context_only(target.uuid):
            return aside(f"GPU {target.index} takes one process's CUDA context at a time (its compute mode)")
        # the restore's own placement then finds the kernel's room (and its headroom) beside the helper's copy
        if not room_for(placement.free(target), move.needed + placement.HEADROOM, nbytes):
            return aside(f"GPU {target.index} has {placement.free(target) / 1e9:.1f} GB free: too little for the "
                         f"kernel and a second copy of its {nbytes / 1e9:.1f} GB of buffers")
        fetch = Prefetch(folder, target.uuid, nbytes, index=index)
        try:
            fetch.start()
        except OSError as exc:
            fetch.stop()
            return aside(f"the stash helper did not start ({exc})")
        registered = fetch
        with self._transplant_lock:
            old = self._early.pop(kernel_id, None)
            if self._receiving.get(kernel_id) is receipt:  # the same images still arrive
                self._early[kernel_id], fetch = (fetch, target.index), None
        if old is not None:
            old[0].stop()
        if fetch is not None:  # the images went meanwhile
            fetch.stop()
            raise InvalidState(f"Kernel {kernel_id}'s images were discarded here meanwhile.")
        threading.Thread(target=self._watch_prefetch, args=(kernel_id, registered), daemon=True,
                         name="gpumigrate-prefetch-watch").start()
        log.info("gpumigrate: kernel %s: its prefetch begins on GPU %d as its images arrive (%.1f GB)", kernel_id,
                 target.index, nbytes / 1e9)
        return {"gpu": target.index, "reason": None}

    def _watch_prefetch(self, kernel_id: str, fetch: Prefetch) -> None:
        """End the prefetch begun for ``kernel_id``'s images if no restore takes it :data:`PREFETCH_UNTAKEN`
        seconds after they are complete, or once nothing more of them has arrived for :data:`PREFETCH_STALLED`
        seconds; return once it is taken or ended."""
        last, since, complete = -1, time.monotonic(), None
        while True:
            time.sleep(PREFETCH_WATCH)
            with self._transplant_lock:
                if self._early.get(kernel_id, (None, 0))[0] is not fetch:
                    return
                if complete is None and kernel_id in self.guests:  # its images are complete (complete())
                    complete = time.monotonic()
            arrived, now = _bytes_in(fetch.folder), time.monotonic()
            if arrived != last:
                last, since = arrived, now
            why = (f"its images have been complete for {PREFETCH_UNTAKEN:.0f} s" if complete is not None and
                   now - complete >= PREFETCH_UNTAKEN else
                   f"nothing more of its images arrived for {PREFETCH_STALLED:.0f} s" if now - since >=
                   PREFETCH_STALLED else None)
            if why:
                log.warning("gpumigrate: kernel %s: %s, and no restore took its prefetch", kernel_id, why)
                self._drop_prefetch(kernel_id, fetch)
                return

    def _prefetched_gpu(self, kernel_id: str, guest: Guest, to_gpu: int | None) -> int | None:
        """The GPU the restore of ``guest`` goes to: ``to_gpu``, or, where none was asked and a prefetch began as
        its images arrived, that one's (placed as the restore would), if the kernel still has its room there
        beside the helper's copy; if it has not (another process took memory meanwhile), that prefetch ends,
        and the restore places the kernel itself."""
        with self._transplant_lock:
            early = self._early.get(kernel_id)
        if to_gpu is not None or early is None or self.inventory is None:
            return to_gpu
        needed = sum(int(g.get("memory_used", 0)) for g in guest.manifest.gpus)
        there = next((g for g in self.inventory() if g.index == early[1]), None)
        if there is not None and placement.free(there) >= needed + placement.HEADROOM:
            return early[1]
        log.warning("gpumigrate: kernel %s: GPU %d has no room left for it beside its prefetch: that ends, and the "
                    "restore places the kernel itself", kernel_id, early[1])
        self._drop_prefetch(kernel_id, wait=True)  # its memory free before the restore judges the GPUs' room
        return None

    def _take_prefetch(self, folder: Path) -> Prefetch | None:
        """The prefetch begun for the images in ``folder`` as they arrived, now the restore's (Tools.early_prefetch)."""
        with self._transplant_lock:
            for kernel_id, (fetch, _) in list(self._early.items()):
                if fetch.folder == folder:
                    del self._early[kernel_id]
                    return fetch
        return None

    def _drop_prefetch(self, kernel_id: str, which: Prefetch | None = None, wait: bool = False) -> None:
        """Stop the prefetch begun for the kernel's images as they arrived, if it was not taken (``which``: only
        if it is that one; ``wait``: until its helper has ended)."""
        with self._transplant_lock:
            early = self._early.get(kernel_id)
            if early is None or (which is not None and early[0] is not which):
                return
            del self._early[kernel_id]
        log.info("gpumigrate: kernel %s: the prefetch begun as its images arrived ends, not taken", kernel_id)
        early[0].stop(wait=wait)

    def received_file(self, kernel_id: str, name: str, checksum: str) -> None:
        """``name`` arrived, its checksum ``checksum``: checked against the sender's word in :meth:`complete`
        (the bulk listener's word of an earlier copy, beside it, goes: the last copy's checksum counts)."""
        self.received.setdefault(kernel_id, {})[name] = checksum
        with contextlib.suppress(ImageError):
            drop_mark(self.store.path_for(kernel_id) / name)

    def _check_received(self, kernel_id: str, files: list[dict]) -> None:
        """Every file the sender lists arrived whole, its checksum as the sender says; :class:`ImageError` if not."""
        received = {**self.received.get(kernel_id, {}), **received_marks(self.store.path_for(kernel_id))}
        for entry in files:
            path = self.image_path(kernel_id, str(entry["name"]))
            if not path.is_file() or path.stat().st_size != int(entry["size"]):
                raise ImageError(f"{path.name} did not arrive whole; send the images again.")
            got = received.get(path.name)
            if got is not None and not hmac.compare_digest(got, str(entry.get("xxh3", ""))):
                path.unlink(missing_ok=True)
                raise ImageError(f"{path.name} arrived damaged (its checksum is not the sender's); send the images "
                                 "again.")
        self.received.pop(kernel_id, None)

    def complete(self, kernel_id: str, files: list[dict], peer: str) -> Guest:
        folder = self.store.path_for(kernel_id)
        self._check_received(kernel_id, files)
        manifest = self.store.read_manifest(kernel_id)
        if manifest.kernel_id != kernel_id:
            raise ImageError(f"The images in {folder} belong to kernel {manifest.kernel_id}, not {kernel_id}.")
        guest = Guest(manifest, peer)
        self.guests[kernel_id] = guest
        return guest

    # a transplant's new process (engine/plans/host_transplant.py: its peer's side)

    def check_transplant(self, kernel_id: str, kernel_name: str, listens: list[tuple[str, int]], nbytes: int,
                         gpu_bytes: int, to_gpu: int | None, peer: str = "") -> list[str]:
        """Each reason why this host cannot start the new process of a transplant; empty if it can."""
        listens, found = self._relays_listens([(str(a), int(p)) for a, p in listens], peer)
        found = hostfit.problems(hostfit.Requirements(ids=[], listens=listens)) + found
        if kernel_id in self.guests and self.guests[kernel_id].state != STOPPED:
            found.append(f"kernel {kernel_id} already lives here")
        for check in (lambda: self._transplant_argv(kernel_name, ""), self.criu):  # CRIU: its way home
            try:
                check()
            except MigrateError as exc:
                found.append(str(exc).rstrip("."))
        if to_gpu is not None:
            try:
                target = placement.gpu_by_index(self.inventory() if self.inventory is not None else [], to_gpu)
                if target.mig_enabled:
                    raise InvalidState(f"GPU {target.index} is split into MIG instances: a transplant needs a whole GPU")
                room = placement.free(target)
                if room < gpu_bytes + placement.TRANSPLANT_HEADROOM:
                    raise InvalidState(f"GPU {target.index} has {room / 1e9:.1f} GB free here; the kernel's GPU tensors "
                                       f"need {gpu_bytes / 1e9:.1f} GB and {placement.TRANSPLANT_HEADROOM / 1e9:.0f} GB "
                                       "beside them")
            except MigrateError as exc:
                found.append(str(exc).rstrip("."))
        else:
            total, available = host_memory()
            if total and available < 2 * nbytes:  # the objects' files, and the new process's copy
                found.append(f"this host has {available / 1e9:.1f} GB of memory available, and the objects "
                             f"({nbytes / 1e9:.1f} GB) need twice that")
        return found

    def _transplant_argv(self, kernel_name: str, folder: str, connection_file: str = "") -> tuple[list[str], dict]:
        """The command line and environment of a transplant's new process for a kernel of type ``kernel_name``
        here: its kernel spec's, ``-m ipykernel_launcher`` made ``-m jupyter_gpumigrate.kernel.transplant``."""
        from .provisioner import transplant_argv

        if self.kernelspec is None:
            raise InvalidState("this server cannot start kernels for its peers (no kernel specs)")
        try:
            argv, env = self.kernelspec(kernel_name)
        except Exception as exc:  # jupyter_client's NoSuchKernel, or a broken spec
            raise InvalidState(f"there is no kernel type {kernel_name!r} here ({exc})") from exc
        argv = [a.replace("{connection_file}", connection_file) for a in argv]
        cmd = transplant_argv(argv, folder)
        if cmd is None:
            raise InvalidState(f"kernel type {kernel_name!r} here is not started with python -m ipykernel_launcher, "
                               "so it cannot take a transplant")
        return cmd, dict(env)

    def load_transplant(self, kernel_id: str, files: list[dict], kernel_name: str, connection_info: dict,
                        to_gpu: int | None, wait: float, peer: str) -> dict:
        """Start the new process of a transplant from the objects received, and wait until it holds them (it then
        waits for :meth:`switch_transplant`). Blocking: from a worker thread."""
        folder = self.store.path_for(kernel_id)
        if kernel_id in self.guests or kernel_id not in self.received:
            raise InvalidState(f"Kernel {kernel_id} has no transplant's objects being received here (or lives here "
                               f"already): send them first (POST images/{kernel_id}).")
        self._check_received(kernel_id, files)
        uuid = gpu_index = None
        if to_gpu is not None:
            target = placement.gpu_by_index(self.inventory() if self.inventory is not None else [], to_gpu)
            uuid, gpu_index = target.uuid, target.index
        # The connection file: the kernel's ports and key, for the new process alone (0600, in a 0700 folder).
        connection_file = folder / "connection.json"
        try:
            fd = os.open(connection_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({**connection_info, "kernel_name": kernel_name}, f)
        except OSError as exc:  # a full disk, say: said, not an internal error
            self.discard(kernel_id)
            raise (NoRoomHere if exc.errno in (errno.ENOSPC, errno.EDQUOT) else MigrateError)(f"The new kernel process's connection file could not be written here in {folder} "
                               f"({exc.strerror or exc}): free space there, then try again. The kernel runs on, "
                               "unchanged.") from exc
        cmd, env = self._transplant_argv(kernel_name, str(folder), str(connection_file))
        env = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": uuid or "", DETACH_OUTPUT: "1"}
        # Its output goes to a log here until it is told to go, then to /dev/null (the kernel's own output goes
        # to its notebook): a log file held open would have to exist on the kernel's home host for it to come
        # back there.
        log_path = folder / "new-process.log"
        try:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                        cwd=os.path.expanduser("~"), start_new_session=True)
        except OSError as exc:
            self.discard(kernel_id)
            raise MigrateError(f"The new kernel process could not start here ({exc}). The kernel runs on, "
                               "unchanged.") from exc
        manifest = Manifest(kernel_id=kernel_id, kernel_name=kernel_name, pid=proc.pid, ids=[proc.pid],
                            connection_info={k: v for k, v in connection_info.items() if k != "key"})
        guest = Guest(manifest, peer)
        guest.adopt(proc.pid)
        with self._transplant_lock:
            self.guests[kernel_id] = guest
            self._transplants[kernel_id] = proc
        try:
            return self._wait_loaded(kernel_id, proc, folder, log_path, wait, to_gpu, uuid, gpu_index)
        except BaseException:
            self.discard(kernel_id)
            raise

    def _wait_loaded(self, kernel_id: str, proc: subprocess.Popen, folder: Path, log_path: Path, wait: float,
                     to_gpu: int | None, uuid: str | None, gpu_index: int | None) -> dict:
        deadline = time.monotonic() + wait
        ready, failed = folder / "ready.json", folder / "failed.json"
        while not ready.exists():
            problem = None
            if failed.exists():
                problem = ("the new kernel process could not take the objects: "
                           f"{json.loads(failed.read_text()).get('error')}")
            elif proc.poll() is not None:
                problem = (f"the new kernel process ended (exit status {proc.returncode}) before it had read the "
                           f"objects{_said(log_path)}")
            elif time.monotonic() > deadline:
                problem = f"the new kernel process did not read the objects within {wait:.0f} s"
            if problem:
                raise MigrateError(f"{problem.capitalize()}. The kernel runs on, unchanged.")
            time.sleep(0.05)
        loaded = json.loads(ready.read_text())
        if to_gpu is not None and loaded.get("off_gpu"):
            raise GpuError(f"The new kernel process does not see GPU {to_gpu} through PyTorch here, so "
                           f"{loaded['off_gpu']} GPU tensors would land in host memory. The kernel runs on, unchanged.")
        for name in ("data.bin", "objects.pkl", *(p.name for p in folder.glob("storage-*.bin"))):
            (folder / name).unlink(missing_ok=True)  # held by the new process now
        gpus: list[dict] = []
        if uuid is not None and self.inventory is not None:
            gpus = gpus_mod.held_by(proctree.descendants(proc.pid), self.inventory())
        # A peer that never says go (it died, say) leaves no process here holding the objects for ever.
        self._later(kernel_id, max(wait, TRANSPLANT_ORPHAN), self._expire, proc)
        return {"pid": proc.pid, "gpu": gpu_index, "gpus": gpus, "loaded": loaded}

    def _expire(self, kernel_id: str, proc: subprocess.Popen) -> None:
        with self._transplant_lock:
            if self._transplants.get(kernel_id) is not proc:
                return
        log.warning("gpumigrate: kernel %s: its peer never switched to the transplant's new process here; "
                    "discarded", kernel_id)
        self.discard(kernel_id, proc)

    def _unrelayed(self, kernel_id: str, pid: int) -> None:
        self._discard_unrelayed(kernel_id, pid, self._unrelayed, "a transplant's new process told to go here by peer "
                                "{peer}, was not relayed by it within {seconds:.0f} s: its server died as it said go, "
                                "and the next one did not come (the peer keeps the source's images, and takes it "
                                "back from them)")

    def _unclaimed(self, kernel_id: str, pid: int) -> None:
        self._discard_unrelayed(kernel_id, pid, self._unclaimed, "taken back for peer {peer}, was not relayed by it "
                                "within {seconds:.0f} s: it counted the kernel lost (and restarted it there), or "
                                "its server went too")

    def _unadopted(self, kernel_id: str, pid: int) -> None:
        self._discard_unrelayed(kernel_id, pid, self._unadopted, "restored here for peer {peer}, was not relayed "
                                "by it within {seconds:.0f} s: its server died during the move, and the next one "
                                "did not come (the peer keeps its images until the kernel is relayed to, and "
                                "resumes it from them)")

    def claim(self, guest: Guest) -> bool:
        """The peer's relay takes ``guest``: never discarded as unclaimed from now on; False if it is being so."""
        with self._transplant_lock:
            if guest.discarding:
                return False
            guest.relayed = True
            return True

    def _discard_unrelayed(self, kernel_id: str, pid: int, again: Callable[[str, Any], None], why: str) -> None:
        guest = self.guests.get(kernel_id)
        if guest is None or guest.pid != pid or guest.relayed:
            return
        lock = self.locks.get(kernel_id)
        if kernel_id in self.dumping or (lock is not None and lock.locked()):  # a request for it runs: look again
            self._later(kernel_id, self.unclaimed, again, pid)
            return
        with self._transplant_lock:  # a relay that comes now is refused (claim): never a relayed kernel discarded
            if guest.relayed:
                return
            guest.discarding = True
        log.warning("gpumigrate: kernel %s, %s; discarded", kernel_id,
                    why.format(peer=guest.peer, seconds=self.unclaimed))
        self.discard(kernel_id)

    def _later(self, kernel_id: str, seconds: float, check: Callable[[str, Any], None], arg: Any) -> None:
        """``check(kernel_id, arg)`` in ``seconds``, unless the kernel is discarded here first."""
        timer = threading.Timer(seconds, check, (kernel_id, arg))
        timer.daemon = True
        timer.name = f"gpumigrate-guest-{kernel_id[:8]}"
        with self._transplant_lock:
            old = self._timers.pop(kernel_id, None)
            self._timers[kernel_id] = timer
        if old is not None:
            old.cancel()
        timer.start()

    def waiting_pids(self) -> set[int]:
        """The transplants' new processes started here and not yet switched to (their Popen reaps them)."""
        with self._transplant_lock:
            return {proc.pid for proc in self._transplants.values()}

    def switch_transplant(self, kernel_id: str, timeout: float = 60.0) -> dict:
        """The new process of a transplant takes the kernel's ports here: it is the guest from now on."""
        guest = self.guest(kernel_id)
        with self._transplant_lock:
            proc = self._transplants.pop(kernel_id, None)
            if proc is None or guest.pid != proc.pid:
                raise InvalidState(f"No transplant of kernel {kernel_id} waits here.")
            # Neither waiting nor the kernel yet: a peer's next server that asks now waits for the outcome
            # (revive.py). Said with the pop, so that no one reads it waiting no more and not yet migrating.
            guest.state = MIGRATING
        folder = self.store.path_for(kernel_id)
        # Written down before the word to go, as the kernel it is about to become (it outlives this server as a
        # restored guest does): this server killed from here on leaves its next one the process, which either
        # took the word (taken back running, and discarded if its peer does not relay to it within
        # guest_unclaimed_expire) or ends by itself with this server, as one never told does (its record then
        # goes). Never a process running on that no server knows.
        self._remember(guest)
        try:
            if proc.poll() is not None:
                raise ProcessLookupError(proc.pid)
            proc.send_signal(signal_mod.SIGUSR1)  # Popen's own: never a PID reused meanwhile
        except ProcessLookupError:
            self.discard(kernel_id, proc)
            raise MigrateError(f"The new kernel process ended here before it was told to go (exit status "
                               f"{proc.returncode}){_said(folder / 'new-process.log')}.") from None
        deadline = time.monotonic() + timeout
        started = folder / "started.json"
        while not started.exists():  # written once its kernel has taken the ports
            if proc.poll() is not None or time.monotonic() > deadline:
                self.discard(kernel_id, proc)
                raise MigrateError(f"The new kernel process did not take the kernel's ports here (exit status "
                                   f"{proc.poll()}).")
            time.sleep(0.02)
        guest.state = RUNNING
        try:
            seconds = json.loads(started.read_text()).get("seconds")
        except (OSError, ValueError, AttributeError):
            seconds = None
        # It runs: what it was given here goes (the key, the source's environment with its credential).
        for name in _TRANSPLANT_FILES:
            (folder / name).unlink(missing_ok=True)
        guest.ran = True
        self._later(kernel_id, self.unclaimed, self._unrelayed, proc.pid)
        return {"pid": proc.pid, "seconds": seconds}

    def listing(self, kernel_id: str, checksums: bool = True) -> list[dict]:
        """The kernel's image files: name, size and (``checksums``) XXH3-64, computed now by
        :data:`DIGESTS` threads."""
        folder = self.store.path_for(kernel_id)
        if not (folder / MANIFEST).is_file():
            raise ImageError(f"Kernel {kernel_id} has no images here: dump it first.")
        files = image_files(folder)
        if not checksums:
            return [{"name": p.name, "size": p.stat().st_size} for p in files]
        with ThreadPoolExecutor(max_workers=DIGESTS, thread_name_prefix="gpumigrate-digest") as pool:
            digests = list(pool.map(_listed_checksum, files))
        taken = sum(sent for _, _, sent in digests)
        if taken:
            log.info("gpumigrate: kernel %s: the checksums of %d of its %d image files listed are those taken as "
                     "they were sent while written (not read again)", kernel_id, taken, len(files))
        return [{"name": p.name, "size": size, "xxh3": h} for p, (size, h, _) in zip(files, digests)]

    # running them (blocking: call from a worker thread)

    def _migration(self, guest: Guest, stash_min: int | None = None) -> Migration:
        kwargs: dict[str, Any] = {"reconnect_timeout": 0.0, "images": self.images, "host_stash_min": stash_min,
                                  "prefetch": self.prefetch, "early_prefetch": self._take_prefetch}
        if self.inventory is not None:
            kwargs["inventory"] = self.inventory
        return Migration(guest, self.store, self.criu(), **kwargs)

    def restore(self, kernel_id: str, to_gpu: int | None, key: str | None = None, moved: bool = False) -> dict:
        """Restore the kernel from the images received (``key``: to have it read back its stash, if it wrote one).
        ``moved``: the restore of a move here, whose peer keeps its own images until it relays to the kernel: one
        it does not relay to within :attr:`unclaimed` (its server died during the move, and no next one came) is
        discarded, as the peer resumes its own copy."""
        guest = self.guest(kernel_id)
        if guest.state == BROKEN:  # a resume of broken whole images is its owner's call, on its own host
            raise InvalidState(f"Kernel {kernel_id} is broken here: {guest.broken_reason}")
        guest.key = key
        marker, marked = self.store.path_for(kernel_id) / RESTORING, False
        try:
            with self._transplant_lock:
                self._receiving.pop(kernel_id, None)  # restored (or tried): no longer litter to expire
            to_gpu = self._prefetched_gpu(kernel_id, guest, to_gpu)
            # Said in its folder while CRIU restores it: should this server die meanwhile (and CRIU with it), its
            # next one kills what CRIU had made of the tree, stuck in its restorer for ever (_end_unrecorded).
            try:
                write_durably(marker, json.dumps({"since": proctree.tick_boundary(), "boot": _boot_id(),
                                                  "owner": str(self.records)}))
            except OSError as exc:  # a full or read-only disk: nothing restored, the peer keeps its copy
                raise ImageError(f"Kernel {kernel_id} cannot be restored here: {marker.parent} cannot be written "
                                 f"({exc.strerror or exc}). Free space there, then move it again; it runs on at its "
                                 "peer.") from exc
            marked = True
            outcome = self._migration(guest).resume(to_gpu)
        finally:
            guest.key = None
            if marked:
                marker.unlink(missing_ok=True)  # gone with the folder once the kernel runs
            self._drop_prefetch(kernel_id)  # one its restore did not take (it failed before)
        guest.ran = True
        self._remember(guest)
        if moved and guest.pid is not None and not guest.relayed:
            self._later(kernel_id, self.unclaimed, self._unadopted, guest.pid)
        gpus: list[dict] = []
        if self.inventory is not None and guest.pid is not None:
            gpus = gpus_mod.held_by(proctree.descendants(guest.pid), self.inventory())
        return {"pid": guest.pid, "gpu": outcome.to_gpu, "gpus": gpus,
                "timings": outcome.result.timings, "stash": outcome.stash}

    def stash_left(self, guest: Guest) -> bool:
        """Whether a guest taken back running (:attr:`Guest.taken_back`) runs without its large buffers: its
        folder here holds a stash (its index, or parts: the kernel may still be writing them, asked by the server
        before this one) and no whole dump. Judged each time from the folder, as the kernel may begin to write
        them after this server took it back."""
        if not guest.taken_back or guest.state != RUNNING or not guest.runs():
            return False
        folder = self.store.path_for(guest.manifest.kernel_id)
        try:
            return not (folder / MANIFEST).is_file() and (
                (folder / STASH_INDEX).is_file() or any(folder.glob(STASH_PARTS)))
        except OSError:
            return False

    def give_back_left(self, kernel_id: str, key: str | None) -> dict:
        """``POST peer/kernels/{id}/resume`` with ``stash_left``: where the guest runs without its large buffers
        (:meth:`stash_left`), have it read them back with its owner's ``key``; else nothing (an answer of no
        bytes): never a resume from images."""
        guest = self.guest(kernel_id)
        if not self.stash_left(guest):
            return {"pid": guest.pid, "gpu": None, "gpus": [], "timings": {}, "stash": {"unstashed": 0}}
        return self._give_back_left(guest, key)

    def _give_back_left(self, guest: Guest, key: str | None) -> dict:
        """Have a guest taken back without its large buffers (:meth:`stash_left`) read them back from its stash
        here, with its owner's ``key``; then its stash goes. Its answer, as a restore's."""
        kernel_id = guest.manifest.kernel_id
        if key is None:  # (an empty key is a key: the kernel's messages are not signed)
            raise InvalidState(f"Kernel {kernel_id} runs here without its large buffers, which are in its stash "
                               "here (this host's server died during its way home): its peer reads them back as it "
                               "finds this host again, or as it asks for the way home, with a version of "
                               "jupyter-gpumigrate that sends the kernel's key for it. Nothing was changed here.")
        folder = self.store.path_for(kernel_id)
        guest.key = key
        began = time.monotonic()
        try:
            said = guest.host_take_back(str(folder), STASH_LEFT_WAIT)
        except (OSError, RuntimeError, TimeoutError, ValueError) as exc:
            raise ImageError(f"Kernel {kernel_id} could not read its large buffers back from its stash here "
                             f"({exc or 'no answer in time'}); they stay in {folder}: ask again.") from exc
        finally:
            guest.key = None
        self.store.remove(kernel_id)
        log.warning("gpumigrate: kernel %s, hosted for a peer, read back its large buffers from the stash the server "
                    "before this one left (%s bytes)", kernel_id, said.get("unstashed"))
        return {"pid": guest.pid, "gpu": None, "gpus": [], "timings": {"unstash": round(time.monotonic() - began, 4)},
                "stash": {"unstashed": int(said.get("unstashed") or 0)}}

    def dump(self, kernel_id: str, key: str | None = None, stash_min: int | None = None) -> dict:
        """Suspend the kernel for its way home; with ``key`` and ``stash_min`` (it is idle), its large buffers
        written into its images first."""
        guest = self.guest(kernel_id)
        if self.stash_left(guest):  # its buffers back first: the dump's folder replaces the stash's
            self._give_back_left(guest, key)
        guest.key = key
        # its pages are served as they are written till it is over, by this process and its bulk listener's
        run = self.dumping[kernel_id] = DumpRun(mark=self.mark_of(kernel_id) if self.serve_growing else None)
        ok = False
        try:
            outcome = self._migration(guest, stash_min if key else None).suspend()
            ok = True  # its record stays until it is discarded: its images here may be its only copy
            log.info("gpumigrate: kernel %s hosted for a peer: its images for its way home are in %s here (%s)%s",
                     kernel_id, outcome.images, outcome.images_why,
                     f"; its stash: {json.dumps(outcome.stash)}" if outcome.stash else "")
        finally:
            guest.key = None
            run.end(ok)
            if self.dumping.get(kernel_id) is run:
                del self.dumping[kernel_id]
        return {"bytes": outcome.bytes, "timings": outcome.result.timings}

    def drop_dump_marks(self) -> None:
        """Remove the marks an earlier server left (its dumps ended with it): call once the state folder is this
        server's (a second server started on it by mistake must not remove the first's)."""
        shutil.rmtree(self.dump_marks, ignore_errors=True)

    def mark_of(self, kernel_id: str) -> Path:
        """Where a dump of ``kernel_id`` for its way home says how it stands (:class:`DumpRun`)."""
        return self.dump_marks / f"{self.store.path_for(kernel_id).name}.json"

    def growing(self, kernel_id: str) -> dict:
        """While the kernel's dump for its way home runs here: the pages files it has begun (and the parts of
        the stash before it), by name and size so far (``dumping``: whether it still runs); where this host does
        not serve files as they grow, the stash's parts once the stash wrote them all (``stash_whole``: its
        index is there, written last), each then fetched whole while the driver and CRIU run on."""
        run = self.dumping.get(kernel_id)
        folder = self.store.path_for(kernel_id)
        try:  # this dump's stash's index: not one left of an earlier dump, until this one's folder replaces it
            stash_whole = run is not None and (folder / STASH_INDEX).stat().st_mtime >= run.began - 0.05  # a coarse clock
        except OSError:
            stash_whole = False
        paths: list[Path] = []
        if run is not None and folder.is_dir():
            if self.serve_growing:
                paths = sorted([*folder.glob(STASH_PARTS), *folder.glob(GROWING)])
            elif stash_whole:
                paths = sorted(folder.glob(STASH_PARTS))
        files = []
        for path in paths:
            try:
                if path.is_file() and not path.is_symlink():
                    files.append({"name": path.name, "size": path.stat().st_size})
            except OSError:
                continue  # removed meanwhile (a dump that failed)
        return {"files": files, "dumping": run is not None and not run.over.is_set(), "stash_whole": stash_whole}

    def discard(self, kernel_id: str, proc: subprocess.Popen | None = None) -> None:
        """Kill the kernel (or a transplant's new process, ``proc`` when known) and delete what it had here."""
        with self._transplant_lock:
            waiting = self._transplants.pop(kernel_id, None)
            timer = self._timers.pop(kernel_id, None)
            self._receiving.pop(kernel_id, None)
            proc = proc or waiting
        if timer is not None and timer is not threading.current_thread():
            timer.cancel()
        self._drop_prefetch(kernel_id)
        with self._transplant_lock:
            if proc is not None and self.guests.get(kernel_id) is not None and self.guests[kernel_id].pid == proc.pid:
                self.guests[kernel_id].pid = None  # killed here, through its Popen: no PID reused meanwhile
        if proc is not None and proc.poll() is None:  # a transplant's new process
            proc.kill()
            proc.wait(timeout=30)
        guest = self.guests.pop(kernel_id, None)
        if guest is not None and guest.pid is not None and guest.runs():
            # the process adopted alone, by its start time, through a pidfd: not one that took its PID since
            if proctree.kill_tree(guest.pid, started=guest.started):
                proctree.wait_gone(guest.pid, timeout=10)
        self._forget(kernel_id)
        self.store.remove(kernel_id)
        self.mark_of(kernel_id).unlink(missing_ok=True)
        lock = self.locks.get(kernel_id)
        if lock is not None and not lock.locked():  # one held (by the caller's handler) stays: a request that
            self.locks.pop(kernel_id, None)          # comes meanwhile must wait on it, not on a new one

    def signal(self, kernel_id: str, signum: int) -> None:
        guest = self.guest(kernel_id)
        if guest.pgid is None:
            raise InvalidState(f"Kernel {kernel_id} is not running here.")
        os.killpg(guest.pgid, signal_mod.Signals(signum))

    def describe(self, kernel_id: str) -> dict:
        guest = self.guest(kernel_id)
        with self._transplant_lock:  # the state and the waiting read together (switch_transplant)
            state = guest.state
            waiting = kernel_id in self._transplants  # a transplant's new process, not told to go: not the kernel
        alive = guest.runs()
        info: dict[str, Any] = {"id": kernel_id, "state": state if alive or state != RUNNING else STOPPED,
                                "pid": guest.pid, "peer": guest.peer, "requirements": None, "stash": True,
                                "checksum": CHECKSUM, "growing": self.serve_growing, "stash_listed": True,
                                "bulk_port": self.bulk_port, "bulk_tls": self.bulk_tls,
                                "bulk_growing": self.bulk_port is not None and self.serve_growing}
        if waiting:
            info["waiting"] = True
        if self.stash_left(guest):
            info["stash_left"] = True
        if alive and guest.pid is not None:
            listens = kernel_listens(guest.kernel_connection_info)
            if guest.api_listen:
                listens.append(guest.api_listen)
            info["requirements"] = hostfit.requirements_of(guest.pid, listens).to_dict()
            info["memory"] = proctree.memory(guest.pid)
            if self.inventory is not None:
                info["gpus"] = gpus_mod.held_by(proctree.descendants(guest.pid), self.inventory())
        return info
