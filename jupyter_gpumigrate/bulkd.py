"""The bulk listener: the large image files of moves between hosts, each sent or received by a process of
its own: those peers send to this host or fetch from it, and those this host sends or fetches.

Why: a move's files reach the other host's server over TLS, and that server received them in threads of its
one process (bulk.py). On the GPU machine (16 CPUs) four files received so went at 1.10 GB/s in all, one at
1.11, where four receiving processes took 4.09-4.22 GB/s, whatever the sender (bench/transfer_probe.py,
bench/results/2026-11-29-h200x1-transfer-probe.md): Python's TLS socket gives back at most one TLS record
(16 KiB) a read, and each read takes the GIL back, 64 times a MiB, on every thread. Sending is bound less so,
but bound: eight files sent by threads of one process went at 2.67-2.96 GB/s into receiving processes, sixteen
at 3.4-3.5, where a process each sent at 4.2-4.5 (2026-11-29-h200x1-transfer-probe-growing.md). TLS state
cannot leave the process that made the handshake, so the files go through a port of their own, whose
connections are each taken by a process, and each file this host sends or fetches goes from a process.

How: where the server takes kernels from peers (c.GPUMigrateApp.peer_token) or has peers, it starts
``python -m jupyter_gpumigrate.bulkd`` (:class:`BulkListener`) and writes its :class:`BulkSettings` on its
stdin, which it keeps open: the listener ends once that closes (the server stopped, or died), and its
processes with it. The listener, one thread, forks a process for each piece of work (a fork of one thread:
the modules are loaded once, nothing is held):
- where the server takes kernels, it binds ``c.GPUMigrateApp.bulk_port`` (0: any free port) on the
  server's address, with the server's certificate, says the port on stdout, and takes each connection in a
  process, which takes one image file PUT as the server's own route does (the same token, names, checks and
  answers: bulk.receive), and records the file's checksum beside it (peers.mark_received), where the server
  reads it when the images are complete; or serves one image file of a guest by GET (a way home fetches
  it), as the server's route does: whole, or, asked ``?growing=true`` while the guest's dump for its way
  home runs, as the dump writes it (its mark says how the dump stands: peers.MarkedRun). Peers learn the
  port from ``POST peer/check`` and ``GET peer/kernels/{id}`` (``bulk_port``; the latter says
  ``bulk_growing`` too) and use it where they can connect to it; otherwise the files go through the server's
  port, as before.
- the server's further lines on its stdin are orders (:class:`BulkTransfers`): a fetch
  (:meth:`BulkListener.fetch`, for a way home: PeerClient.get_file or get_growing) or a send
  (:meth:`BulkListener.send`, for a way there: PeerClient.put_file; :meth:`BulkListener.send_growing`:
  put_growing, a file the dump still writes); a process runs each and answers a line on stdout; a cancel
  order kills it, and an "over" order tells a send_growing's process that the dump is over (SIGUSR1).

Hand-written rather than ``socketserver.ForkingTCPServer``: the listener must also end when its stdin
closes, and kill the processes it forked then.
"""

from __future__ import annotations

import ctypes
import http.client
import io
import itertools
import json
import logging
import os
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from . import bulk
from .engine.errors import MigrateError
from .engine.images import ImageStore
from .peers import (DETACH_MIN, PEER_API, MarkedRun, Peer, PeerClient, PeerError, Written, credential_ok, follows,
                    image_path, mark_received)

log = logging.getLogger(__name__)

#: The most a request's head may take (its line and headers).
MAX_HEAD = 64 * 1024
#: A GET's query, and whether it asks for a file as it grows (the server's route takes these words and a few
#: more; peers send these)
GROWING_QUERIES = {"": False, "growing=true": True, "growing=false": False}
#: The most connections taken at once (a process each): more wait in the listening socket's backlog. A move
#: sends 8 files at once and follows up to 16 as they grow; whoever can reach the port, with or without the
#: token, gets no more processes than this.
MAX_CONNECTIONS = 64
#: The most of those from one address: a move takes up to 24 at once (8 files, and 16 followed as they
#: grow); whoever else shares a slot's address cannot take them all.
MAX_PER_ADDRESS = 32
#: How long a connection has for its TLS handshake and its request's head, token included (seconds).
AUTH_TIMEOUT = 10.0
#: The longest error sentence a fetch's answer carries (characters): an answer is one line under PIPE_BUF.
MAX_SENTENCE = 800
#: How long a fetch called off waits for its process's end (seconds).
CANCEL_WAIT = 30.0
#: How long the server waits for the listener to say its port (seconds).
START_TIMEOUT = 30.0
#: A listener that ended unasked is started again after this many seconds, twice as long after each start that
#: failed (its port taken meanwhile...), up to RESTART_MAX.
RESTART_AFTER = 1.0
RESTART_MAX = 60.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class BulkSettings:
    """What the listener needs of its server."""

    #: the peer token the requests must carry
    token: str
    #: the guests' images, on disk and in memory (GuestHost.store)
    root: str
    memory_root: str | None
    #: the server's base URL (its routes' prefix)
    base_url: str
    #: the address and port to listen on ('' : every address; 0: any free port; -1: none, the listener only
    #: fetches, for a server that takes no kernels from peers)
    host: str
    port: int
    #: the server's certificate and key (None: plain HTTP, as the server)
    certfile: str | None = None
    keyfile: str | None = None
    #: where the server marks the dumps for a way home that run (GuestHost.dump_marks): their files are then
    #: served as they grow (``GET ...?growing=true``, as the server's route does); None: whole files only
    dumps: str | None = None
    #: the niceness of the listener and its processes (c.GPUMigrateApp.transfer_nice; 0: the server's own)
    nice: int = 0


class BulkListenerError(MigrateError):
    """The bulk listener could not start."""


class BulkListener:
    """The server's side: the listener's process (:func:`main`), started by :meth:`start`, ended by :meth:`stop`
    or with the server."""

    def __init__(self, settings: BulkSettings, on_start: Callable[[int | None], None] | None = None) -> None:
        """``on_start(port)``: called once it listens (and each time it is started again, whose port may differ
        where ``settings.port`` is 0); ``on_start(None)`` once it ended unasked (its port is no longer its own:
        not to be announced meanwhile)."""
        self.settings = settings
        self.on_start = on_start
        self.process: subprocess.Popen | None = None
        #: the sessions of the listeners started (the last few): the server reaps their processes' orphans
        self.sessions: list[int] = []
        #: the port it listens on, once started (None: it takes no files, it fetches only)
        self.port: int | None = None
        self._lock = threading.Lock()
        self._orders = itertools.count(1)
        #: order id -> its answer, once the listener gave it
        self._waiting: dict[int, Future] = {}
        self._reader: threading.Thread | None = None
        #: a listener started, until it said its port
        self._starting: subprocess.Popen | None = None
        self._stopped = False
        self._stopping = threading.Event()

    @property
    def tls(self) -> bool:
        return bool(self.settings.certfile)

    def start(self) -> int | None:
        """Start the listener; the port it listens on (None: it fetches only). BulkListenerError if it cannot (the port is taken...)."""
        # A session of its own: where the listener is killed, its processes end (their parent-death signal) and
        # come to the server, a subreaper, which reaps that session's orphans as it does a kernel's.
        with self._lock:  # a stop() that came first wins
            if self._stopped:
                raise BulkListenerError("The bulk listener was stopped before it started.")
            # not self.process until it said its port: no order goes before its settings
            process = self._starting = subprocess.Popen(
                [sys.executable, "-m", "jupyter_gpumigrate.bulkd"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                close_fds=True, start_new_session=True)
            self.sessions = [*self.sessions[-7:], process.pid]
        assert process.stdin is not None and process.stdout is not None
        try:
            process.stdin.write(json.dumps(asdict(self.settings)).encode() + b"\n")
            process.stdin.flush()
        except (OSError, ValueError):  # stopped meanwhile
            pass
        with selectors.DefaultSelector() as waiting:
            waiting.register(process.stdout, selectors.EVENT_READ)
            said = process.stdout.readline() if waiting.select(START_TIMEOUT) else b""
        try:
            answer = json.loads(said)
        except ValueError:
            answer = {}
        with self._lock:
            self._starting = None
            stopped = self._stopped
            if "port" in answer and not stopped:
                self.process, self.port = process, answer["port"]
        if self.process is not process:
            _end(process)
            if stopped:
                raise BulkListenerError("The bulk listener was stopped as it started.")
            why = answer.get("error") or "it said nothing (its log above says why)"
            raise BulkListenerError(f"The bulk listener did not start on {self.settings.host or '*'}:"
                                    f"{self.settings.port}: {why}. Set c.GPUMigrateApp.bulk_port to a free port "
                                    "(0: any), or to -1 to receive through the server's port.")
        self._reader = threading.Thread(target=self._read_answers, args=(process,),
                                        name="gpumigrate-bulkd-answers", daemon=True)
        self._reader.start()
        if self.on_start is not None:
            self.on_start(self.port)
        return self.port

    @property
    def own(self) -> set[int]:
        """The PIDs of its listener processes that it reaps itself (the one that runs, one starting)."""
        return {p.pid for p in (self.process, self._starting) if p is not None}

    @property
    def running(self) -> bool:
        """Started, and not ended."""
        process = self.process
        return process is not None and process.poll() is None

    def _read_answers(self, process: subprocess.Popen) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            try:
                answer = json.loads(line)
                future = self._waiting.pop(int(answer["id"]), None)
            except (ValueError, KeyError, TypeError):
                continue
            if future is not None:
                future.set_result(answer)
        for order in list(self._waiting):  # the listener ended: nothing more comes
            future = self._waiting.pop(order, None)
            if future is not None:
                future.set_result({"id": order, "error": "the bulk listener ended (the server stops, or it was "
                                                         "killed)"})
        with self._lock:
            if self._stopped or self.process is not process:
                return
            self.process = None
        _end(process)
        if self.on_start is not None:
            self.on_start(None)
        self._start_again(process.returncode)

    def _start_again(self, returncode: int | None) -> None:
        """The listener ended unasked (killed): start it again, after RESTART_AFTER s, and again, less often,
        while it cannot start, until :meth:`stop`. Meanwhile peers send through the server's port, and the
        server's ways home fetch in its own process."""
        delay = RESTART_AFTER
        log.warning("gpumigrate: the bulk listener ended (exit status %s); it is started again in %.0f s, and "
                    "meanwhile the image files go through the server's process", returncode, delay)
        while not self._stopping.wait(delay):
            try:
                port = self.start()
            except BulkListenerError as exc:
                if self._stopping.is_set():
                    return
                delay = min(delay * 2, RESTART_MAX)
                log.warning("gpumigrate: %s Tried again in %.0f s.", exc, delay)
                continue
            log.warning("gpumigrate: the bulk listener was started again%s",
                        f" on port {port}" if port is not None else " (it fetches only)")
            return

    def _order(self, order: dict) -> None:
        with self._lock:
            process = self.process
            if process is None or process.stdin is None:
                raise BrokenPipeError("no bulk listener")
            process.stdin.write(json.dumps(order).encode() + b"\n")
            process.stdin.flush()

    def _ask(self, order: dict, stop: threading.Event, over: threading.Event | None = None) -> dict:
        """Give the listener ``order`` (fetch or send), run by a process of its own; its answer (``error``:
        it failed). ``stop``, once set, calls it off (its process is killed). ``over`` (a file sent as a dump
        writes it), once set, is passed on: the dump is over, and the file has its last size."""
        ident = next(self._orders)
        future: Future = Future()
        self._waiting[ident] = future
        told = False
        try:
            self._order({"id": ident, **order})
            while True:
                try:
                    if over is not None and not told:  # woken by the dump's end, not by a poll
                        over.wait(0.1)
                    return future.result(timeout=0 if over is not None and not told else 0.1)
                except FutureTimeout:
                    if not self.running:  # its processes may hold the answers' pipe open: not waited for
                        return {"error": "the bulk listener ended (the server stops, or it was killed)"}
                    if over is not None and not told and over.is_set() and not stop.is_set():
                        self._order({"over": ident})
                        told = True
                    if stop.is_set():
                        self._order({"cancel": ident})
                        try:
                            return future.result(timeout=CANCEL_WAIT)
                        except FutureTimeout:
                            return {"error": "called off"}
        except (OSError, ValueError) as exc:  # ValueError: its stdin closed by stop()
            return {"error": f"the bulk listener cannot be reached ({exc})"}
        finally:
            self._waiting.pop(ident, None)

    @staticmethod
    def _failed(answer: dict, then: str) -> PeerError:
        error = PeerError(answer["error"] if answer.get("peer") else f"{then}: {answer['error']}.")
        error.status = answer.get("status")
        return error

    def fetch(self, peer: Peer, path: str, dest: Path, stop: threading.Event, size: int | None = None,
              checksum: str | None = None, port: int | None = None) -> tuple[int, str]:
        """Fetch ``path`` of ``peer``'s peer API into ``dest`` (0600) in a process of the listener's, as
        :meth:`PeerClient.get_file` does (``size``: that many bytes, and ``checksum`` if given) or, with ``size``
        None, :meth:`PeerClient.get_growing` (a file the peer's dump still writes): its size and checksum.
        ``port``: the peer's bulk listener's (whose processes send whole files), else its server's. ``stop``,
        once set, calls it off. PeerError, and no file, if it fails."""
        answer = self._ask({"fetch": {"peer": asdict(peer), "port": port, "path": path, "dest": str(dest),
                                      "size": size, "checksum": checksum}}, stop)
        if "error" in answer:
            dest.unlink(missing_ok=True)  # a process killed mid-file leaves what it had written
            raise self._failed(answer, f"Receiving {dest.name} from {peer.name} failed")
        return int(answer["size"]), str(answer["digest"])

    def send(self, peer: Peer, path: str, file: Path, size: int, stop: threading.Event,
             port: int | None = None) -> str:
        """Send ``file`` (``size`` bytes) to ``path`` of ``peer``'s peer API in a process of the listener's, as
        :meth:`PeerClient.put_file` does (to ``port``: the peer's bulk listener's, else its server's): its
        checksum. ``stop``, once set, calls it off. PeerError if it fails."""
        answer = self._ask({"send": {"peer": asdict(peer), "port": port, "path": path, "file": str(file),
                                     "size": size}}, stop)
        if "error" in answer:
            raise self._failed(answer, f"Sending {file.name} to {peer.name} failed")
        return str(answer["digest"])

    def send_growing(self, peer: Peer, path: str, file: Path, over: threading.Event, stop: threading.Event,
                     port: int | None = None) -> tuple[int, str]:
        """Send ``file`` while a dump (or the stash before it) appends to it, in a process of the listener's,
        as :meth:`PeerClient.put_growing` does: until it is whole (:class:`~.peers.Written`: ``over``, the
        dump is over, which the process is told (SIGUSR1) once it is set; or, for a part of the stash, its
        index is beside it) and all of it went: its size and checksum. ``stop``, once set, calls it off: the
        process is killed, and the peer, seeing no last chunk, keeps nothing of it. PeerError if it fails."""
        answer = self._ask({"send": {"peer": asdict(peer), "port": port, "path": path, "file": str(file),
                                     "size": None}}, stop, over)
        if "error" in answer:
            raise self._failed(answer, f"Sending {file.name} to {peer.name} as it was written failed")
        return int(answer["size"]), str(answer["digest"])

    def stop(self, timeout: float = 5.0) -> None:
        """End the listener and the files it receives (a move under way then fails, and its kernel stays where
        it ran)."""
        with self._lock:
            self._stopped = True
            self._stopping.set()
            process, self.process = self.process, None
            starting = self._starting  # its start() ends it, once it said its port (or nothing)
        if process is not None:
            _end(process, timeout)
        if starting is not None and starting.stdin is not None:
            try:
                starting.stdin.close()  # it ends: its start() reads no port
            except OSError:
                pass


def _end(process: subprocess.Popen, timeout: float = 5.0) -> None:
    """End a listener's process (its stdin closed: it ends, and its processes with it; killed after
    ``timeout``) and reap it."""
    try:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()
    finally:
        if process.stdout is not None:
            process.stdout.close()


class BulkTransfers:
    """The large files a move sends to one peer (the way there) or fetches from it (the way home), each by a
    process of the bulk listener's, to or from the peer's bulk listener where it has one (:class:`~.peers.
    PeerLink`'s ``bulk`` and ``bulk_home``), as a :class:`~.peers.PeerClient` would in this process: threads of
    one process sent at 2.7-3.0 GB/s where a process each sent at 4.2-4.5 (bench/transfer_probe.py). Small
    files go from this process, over the connections it keeps; all do once the listener ended (a link lives as
    long as its kernel is on the peer)."""

    def __init__(self, listener: BulkListener, link: Any) -> None:
        self.listener, self.link = listener, link

    @property
    def client(self) -> PeerClient:
        return self.link.client

    def get_growing(self, path: str, dest: Path, stop: threading.Event, conns: Any = None) -> tuple[int, str]:
        if not self.listener.running:
            return self.client.get_growing(path, dest, stop, conns)
        # a file still written comes from the peer's bulk listener where it serves such files too (a process
        # sends each there), else from its server
        home = self.link.bulk_home
        port = None if home is None or ("?" in path and not self.link.bulk_home_growing) else home.port
        return self.listener.fetch(self.client.peer, path, dest, stop, port=port)

    def get_file(self, path: str, dest: Path, size: int, checksum: str | None, kept: Any = None) -> str:
        if size < DETACH_MIN or not self.listener.running:
            return self.client.get_file(path, dest, size, checksum, kept)
        port = self.link.bulk_home.port if self.link.bulk_home is not None else None
        return self.listener.fetch(self.client.peer, path, dest, threading.Event(), size, checksum, port)[1]

    def put_file(self, path: str, file: Path, size: int, kept: Any = None, stop: threading.Event | None = None
                 ) -> str:
        there = self.link.bulk or self.client
        if size < DETACH_MIN or not self.listener.running:
            return there.put_file(path, file, size, kept, stop)
        return self.listener.send(self.client.peer, path, file, size, stop or threading.Event(),
                                  self.link.bulk.port if self.link.bulk is not None else None)

    def put_growing(self, path: str, file: Path, final: Written, stop: threading.Event,
                    progress: dict[str, int] | None = None) -> tuple[int, str]:
        """A file a dump still writes, sent by a process of the listener's (how far it got is not said in
        ``progress``, which only a sender in this process fills)."""
        if not self.listener.running:
            return (self.link.bulk or self.client).put_growing(path, file, final, stop, progress)
        return self.listener.send_growing(self.client.peer, path, file, final.over, stop,
                                          self.link.bulk.port if self.link.bulk is not None else None)


# -- the listener's process ----------------------------------------------------------------------------


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[gpumigrate bulkd %(process)d] %(message)s")
    settings = BulkSettings(**json.loads(sys.stdin.buffer.readline()))
    if settings.nice > 0:
        _be_nice(settings.nice)
    listener: socket.socket | None = None
    try:
        if settings.port >= 0:
            listener = _listen(settings.host, settings.port)
        context = _tls(settings)
    except (OSError, ssl.SSLError) as exc:
        _say({"error": str(exc)})
        return
    _say({"port": listener.getsockname()[1] if listener is not None else None})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A file sent as a dump writes it learns from SIGUSR1 that the dump is over (_send): blocked here, so
    # that every process forked inherits it blocked, and one told at once after its fork keeps the word.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    store = ImageStore(settings.root, settings.memory_root)
    children: dict[int, _Work] = {}
    pending = b""
    try:
        with selectors.DefaultSelector() as events:
            events.register(0, selectors.EVENT_READ)
            while True:
                if listener is not None:  # no more connections taken while MAX_CONNECTIONS are
                    busy = sum(work.order is None for work in children.values()) >= MAX_CONNECTIONS
                    if busy and listener in events.get_map():
                        events.unregister(listener)
                    elif not busy and listener not in events.get_map():
                        events.register(listener, selectors.EVENT_READ)
                for key, _ in events.select(1.0):
                    if key.fileobj == 0:
                        data = os.read(0, 65536)
                        if not data:
                            return  # the server closed it: stopped or died
                        *lines, pending = (pending + data).split(b"\n")
                        for line in lines:
                            _take_order(line, children, events, listener)
                        continue
                    assert listener is not None
                    _take_connection(listener, children, events, settings, context, store)
                _reap(children)
    finally:
        for pid, work in children.items():
            work.why = "the bulk listener ended (the server stops, or it was killed)"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(children, block=True)


@dataclass
class _Work:
    """What a process of the listener's does: an order (its id: a fetch or a send), or a connection (from that
    address)."""

    order: int | None = None
    address: str | None = None
    #: the server called it off (its process was killed for that)
    cancelled: bool = False
    #: why the listener itself killed it, if it did (it ends)
    why: str | None = None


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket: IPv6 for an IPv6 address, both families for every address ('') where the
    host has IPv6."""
    if host == "" and socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=128)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host.strip("[]"), port), family=family, backlog=128)


def _say(answer: dict) -> None:
    """A line to the server, in one write under PIPE_BUF (the processes share the pipe): an error's sentence
    is cut to fit, never the line."""
    if isinstance(answer.get("error"), str):
        answer = {**answer, "error": answer["error"][:MAX_SENTENCE]}
    os.write(1, json.dumps(answer, ensure_ascii=False).encode("utf-8", "replace") + b"\n")


def _be_nice(nice: int) -> None:
    """Run nicer by ``nice``, with every process forked for a file (they inherit it). Where the kernel groups
    sessions (autogroup: kernel.sched_autogroup_enabled, for tasks in the root CPU cgroup), the CPU is shared
    between sessions whatever their processes' nice; this listener leads a session of its own, so its group is
    made as nice too (sched(7), "The autogroup feature")."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w", encoding="ascii") as group:
            group.write(str(nice))
    except OSError:  # no autogroup (a kernel without it, or a task in a CPU cgroup of its own)
        pass


def _spawn(work: Callable[[], bool], events: selectors.BaseSelector, listener: socket.socket | None,
           answers: bool) -> int | None:
    """Fork a process that runs ``work`` (True: it ended as it should) and exits; its PID, or None if no
    process could be forked. The process holds nothing of the listener's (its socket, its selector, the
    server's orders; the answers' pipe where ``answers`` is False), and dies with it."""
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError as exc:
        log.warning("no process could be forked (%s)", exc)
        return None
    if pid:
        return pid
    code = 1
    try:
        events.close()
        if listener is not None:
            listener.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the listener died before the signal was set
            os._exit(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        if not answers:
            os.dup2(null, 1)
        os.close(null)
        code = 0 if work() else 1
    except BaseException:  # a handshake that failed, a peer gone: it sees a closed connection
        log.debug("a process of the bulk listener's ended early", exc_info=True)
    finally:
        os._exit(code)


def _take_connection(listener: socket.socket, children: dict[int, _Work], events: selectors.BaseSelector,
                     settings: BulkSettings, context: ssl.SSLContext | None, store: ImageStore) -> None:
    try:
        conn, address = listener.accept()
    except OSError:
        return
    host = str(address[0])
    if sum(work.address == host for work in children.values()) >= MAX_PER_ADDRESS:
        log.warning("refused a connection from %s: %d of its connections are being taken", host, MAX_PER_ADDRESS)
        conn.close()
        return

    def take() -> bool:
        _connection(conn, settings, context, store)
        return True

    pid = _spawn(take, events, listener, answers=False)
    conn.close()
    if pid is not None:
        children[pid] = _Work(address=host)


def _take_order(line: bytes, children: dict[int, _Work], events: selectors.BaseSelector,
                listener: socket.socket | None) -> None:
    try:
        order = json.loads(line)
        ident = int(order.get("id") or order.get("cancel") or order.get("over"))
    except (ValueError, TypeError, AttributeError):
        return
    if "cancel" in order or "over" in order:
        for pid, work in children.items():
            if work.order == ident and "cancel" in order:
                work.cancelled = True
                os.kill(pid, signal.SIGKILL)  # the reaper answers for it
            elif work.order == ident:
                os.kill(pid, signal.SIGUSR1)  # the dump is over: its file has its last size (_send)
        return

    def work() -> bool:
        _say({"id": ident, **(_fetch(order["fetch"]) if "fetch" in order else _send(order["send"]))})
        return True

    if not isinstance(order.get("fetch", order.get("send")), dict):
        _say({"id": ident, "error": "an order neither to fetch nor to send"})
        return
    pid = _spawn(work, events, listener, answers=True)
    if pid is None:
        _say({"id": ident, "error": "the bulk listener could not fork a process for it"})
    else:
        children[pid] = _Work(order=ident)


def _fetch(order: dict) -> dict:
    """Run one fetch order (BulkListener.fetch): its size and checksum, or its error."""
    client = PeerClient(Peer(**order["peer"]), port=order.get("port"))
    dest = Path(order["dest"])
    try:
        if order["size"] is None:
            size, digest = client.get_growing(order["path"], dest, threading.Event())
        else:
            size = int(order["size"])
            digest = client.get_file(order["path"], dest, size, order["checksum"])
    except PeerError as exc:
        return {"error": str(exc), "status": exc.status, "peer": True}
    except Exception as exc:  # a bug: said, and the move is undone
        log.exception("a fetch failed")
        return {"error": f"{type(exc).__name__}: {exc}"}
    log.info("%s fetched from %s by a process of its own (%d bytes)", order["path"], client.peer.name, size)
    return {"size": size, "digest": digest}


def _told_over() -> threading.Event:
    """Set once this process gets SIGUSR1 (the server's word that the dump is over), which is blocked in it
    (inherited from the listener): a thread waits for it, as a handler would run in the thread it interrupts."""
    over = threading.Event()

    def wait() -> None:
        signal.sigwait({signal.SIGUSR1})
        over.set()

    threading.Thread(target=wait, name="gpumigrate-over", daemon=True).start()
    return over


def _send(order: dict) -> dict:
    """Run one send order (BulkListener.send, or send_growing where its size is None): the file's size and
    checksum, or the error."""
    client = PeerClient(Peer(**order["peer"]), port=order.get("port"))
    file = Path(order["file"])
    try:
        if order["size"] is None:
            size, digest = client.put_growing(order["path"], file, Written(file, _told_over()), threading.Event())
        else:
            size = int(order["size"])
            digest = client.put_file(order["path"], file, size)
    except PeerError as exc:
        return {"error": str(exc), "status": exc.status, "peer": True}
    except OSError as exc:  # the file went (the move undone meanwhile)
        return {"error": f"{file.name} could not be read here ({exc.strerror or exc})"}
    except Exception as exc:  # a bug: said, and the move is undone
        log.exception("a send failed")
        return {"error": f"{type(exc).__name__}: {exc}"}
    log.info("%s sent to %s by a process of its own (%d bytes)", order["path"], client.peer.name, size)
    return {"size": size, "digest": digest}


def _tls(settings: BulkSettings) -> ssl.SSLContext | None:
    if not settings.certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(settings.certfile, settings.keyfile or None)
    return context


def _ended_early(work: _Work, status: int) -> str:
    """Why an order's process ended without its answer, from its wait status."""
    if work.cancelled:
        return "called off"
    if work.why is not None:
        return work.why
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return ("its process here was killed (SIGKILL), not by this server: the out-of-memory killer, or an "
                "administrator; see the host's kernel log (journalctl -k), and try again")
    if os.WIFSIGNALED(status):
        name = signal.Signals(os.WTERMSIG(status)).name if os.WTERMSIG(status) in signal.valid_signals() \
            else f"signal {os.WTERMSIG(status)}"
        return f"its process here died of {name}: see this server's log, and try again"
    return f"its process here failed (exit status {os.WEXITSTATUS(status)}): see this server's log"


def _reap(children: dict[int, _Work], block: bool = False) -> None:
    """Wait for the processes that ended; an order's that ended without its answer (killed: called off, or
    not by the server) is answered for (:func:`_ended_early`)."""
    for pid in list(children):
        status = 0
        try:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            work = children.pop(pid)
            if work.order is not None and status != 0:
                _say({"id": work.order, "error": _ended_early(work, status)})


def _connection(conn: socket.socket, settings: BulkSettings, context: ssl.SSLContext | None,
                store: ImageStore) -> None:
    """A connection's process: the TLS handshake and the request's head within :data:`AUTH_TIMEOUT` (no
    slot held long by whoever connects without a word, or a byte a minute), then the one request."""
    deadline = time.monotonic() + AUTH_TIMEOUT
    conn.settimeout(AUTH_TIMEOUT)
    if context is not None:
        conn = context.wrap_socket(conn, server_side=True)
    serve(conn, settings, store, deadline)


def serve(sock: socket.socket, settings: BulkSettings, store: ImageStore, deadline: float) -> None:
    """Take one image file PUT off ``sock`` (answered and closed whatever happens), its head by ``deadline``
    (time.monotonic)."""
    head, leftover = _head(sock, deadline)
    sock.settimeout(bulk.TIMEOUT)
    if head is None:
        bulk.respond(sock, 431, bulk.error(431, f"A request's head is over {MAX_HEAD} bytes, or did not come whole "
                                                f"within {AUTH_TIMEOUT:.0f} s."))
        return
    line, _, rest = head.partition(b"\r\n")
    try:
        method, target, _ = line.decode("latin-1").split(" ")
        headers = http.client.parse_headers(io.BytesIO(rest + b"\r\n\r\n"))
    except (ValueError, http.client.HTTPException):
        bulk.respond(sock, 400, bulk.error(400, "Not an HTTP/1.1 request."))
        return
    allowed, why = credential_ok(settings.token, headers.get("Authorization", ""))
    if not allowed:
        log.warning("refused a peer request: %s", why)
        bulk.respond(sock, 403, bulk.error(403, why))
        return
    prefix = f"{settings.base_url.rstrip('/')}/{PEER_API}/images/"
    parts = urlsplit(target)
    growing = GROWING_QUERIES.get(parts.query) if method == "GET" else None if parts.query else False
    where = parts.path[len(prefix):].split("/") if parts.path.startswith(prefix) and growing is not None else []
    if len(where) != 2 or not all(where):
        bulk.respond(sock, 404, bulk.error(404, f"This port takes and serves image files only (PUT {prefix}{{kernel}}"
                                                f"/{{name}}, no query; GET the same, or with ?growing=true); send the "
                                                "rest to the server's port."))
        return
    if method not in ("PUT", "GET"):
        bulk.respond(sock, 405, bulk.error(405, "This port takes image files only, by PUT, and serves them by GET."))
        return
    kernel_id, name = (unquote(part) for part in where)
    if method == "GET":
        _serve_file(sock, settings, store, kernel_id, name, growing)
        return
    try:
        path = image_path(store, kernel_id, name)
        length = bulk.body_length(headers)
    except MigrateError as exc:
        bulk.respond(sock, exc.http_status, bulk.error(exc.http_status, str(exc)))
        return
    except ValueError as exc:
        bulk.respond(sock, 411, bulk.error(411, str(exc)))
        return
    said = headers.get("X-Content-XXH3")

    def done(digest: str) -> tuple[int, dict]:
        status, answer = bulk.verdict(name, digest, said, lambda checksum: mark_received(path, checksum))
        log.info("kernel %s: %s received by a process of its own (%d)", kernel_id, name, status)
        return status, answer

    bulk.receive(sock, leftover, length, path, done)


def _serve_file(sock: socket.socket, settings: BulkSettings, store: ImageStore, kernel_id: str, name: str,
                growing: bool) -> None:
    """Answer a GET of one of a guest's image files (the way home fetches it) as the server's route does:
    ``growing`` (asked with ?growing=true), a dump's pages file or a part of its stash while the dump for its
    way home runs (its mark says so: peers.MarkedRun) in chunks as it grows, until it is whole; else the whole
    file."""
    try:
        path = image_path(store, kernel_id, name)
    except MigrateError as exc:  # as the server's route answers
        bulk.respond(sock, exc.http_status, bulk.error(exc.http_status, str(exc)))
        return
    try:
        if not path.is_file() or path.is_symlink():
            raise FileNotFoundError(path)
        size = path.stat().st_size
    except OSError:
        bulk.respond(sock, 404, bulk.error(404, f"Kernel {kernel_id} has no image file {name} here."))
        return
    run = MarkedRun(Path(settings.dumps) / f"{kernel_id}.json") if growing and settings.dumps and follows(name) \
        else None
    if run is not None and run.running:
        sent = bulk.send_growing(sock, path, run)
        log.info("kernel %s: %s sent as it was written by a process of its own (%s)", kernel_id, name,
                 f"{sent} bytes" if sent is not None else "not whole: called off, or its dump failed")
        return
    if run is not None and not run.marked:  # no word of its dump here: never a file still written sent as whole
        bulk.respond(sock, 409, bulk.error(409, f"{name} of kernel {kernel_id} is not followed as it is written "
                                                "here (no dump of it is marked as running): fetch it once the dump "
                                                "is over."))
        return
    bulk.send(sock, path, size)
    log.info("kernel %s: %s sent by a process of its own (%d bytes)", kernel_id, name, size)


def _head(sock: socket.socket, deadline: float) -> tuple[bytes | None, bytes]:
    """A request's head (its line and headers, without the blank line) and what came after it; None if it is
    over :data:`MAX_HEAD`, not whole by ``deadline``, or the peer closed first."""
    data = bytearray()
    while (end := data.find(b"\r\n\r\n")) < 0:
        left = deadline - time.monotonic()
        if len(data) > MAX_HEAD or left <= 0:
            return None, b""
        sock.settimeout(left)
        try:
            got = sock.recv(16384)
        except TimeoutError:
            return None, b""
        if not got:
            return None, b""
        data += got
    if end > MAX_HEAD:
        return None, b""
    return bytes(data[:end]), bytes(data[end + 4:])


if __name__ == "__main__":
    main()
