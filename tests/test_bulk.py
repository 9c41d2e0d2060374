"""A large image file between hosts goes through a thread of its own, off the server's event loop (bulk.py).

A real jupyter_server with the extension is its own peer: its peer routes take image files from this test
as another host's server would send them (``PeerClient``, which waits for ``100 Continue``) and as other
clients might (all at once, a wrong checksum, a sender that goes away mid-file), and give them back.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

import pytest

from jupyter_gpumigrate.bulkd import BulkListener, BulkSettings
from jupyter_gpumigrate.peers import (BLOCK, DETACH_MIN, SCHEME, Kept, Peer, PeerClient, PeerError, PeerLink,
                                      received_marks)

from helpers import peer_server_config

PEER_TOKEN = "bulk-test-peer-token"
SIZE = DETACH_MIN + 12345  # over the threshold, and not a whole number of blocks


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict:
    config = peer_server_config(tmp_path, PEER_TOKEN)
    config["GPUMigrateApp"]["stream_dump"] = "on"  # it serves a dump's files as they grow (off by default under 16 CPUs)
    return config


def checksum_of(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def raw_put(port: int, base: str, path: str, head_extra: dict[str, str], body: bytes, send: int | None = None) -> str:
    """A PUT on a plain socket that sends its head and (the first ``send`` bytes of) its body at once, without
    waiting for 100 Continue; what the server answered (everything, up to its closing the connection)."""
    headers = {"Host": f"127.0.0.1:{port}", "Authorization": f"{SCHEME} {PEER_TOKEN}",
               "Content-Length": str(len(body)), "Content-Type": "application/octet-stream",
               "Expect": "100-continue", **head_extra}
    head = f"PUT {base}api/gpumigrate/peer/{path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + b"\r\n" + body[:send])
        if send is not None:
            return ""  # gone mid-file
        answer = bytearray()
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return answer.decode("latin-1")


async def bulk_port(serverapp) -> int:
    """The port of the server's bulk listener (bulkd.py), once it listens."""
    guests = serverapp.web_app.settings["gpumigrate_guests"]
    deadline = time.monotonic() + 60
    while guests.bulk_port is None:
        assert time.monotonic() < deadline, "the bulk listener did not start"
        await asyncio.sleep(0.05)
    return guests.bulk_port


@pytest.mark.parametrize("via", ["server", "bulk"])
async def test_a_large_image_file_is_received_and_sent_apart_from_the_event_loop(jp_serverapp, jp_http_port,
                                                                              jp_base_url, jp_fetch, tmp_path, via):
    # Through the server's port (a thread of its own there) and through its bulk listener's (a process of its
    # own, bulkd.py): the same answers, the same files.
    kid = str(uuid.uuid4())
    server = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    port = jp_http_port if via == "server" else await bulk_port(jp_serverapp)
    client = PeerClient(server.peer, port=port)
    await asyncio.to_thread(server.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    assert folder.is_dir()
    data = os.urandom(SIZE)
    source = tmp_path / "pages-1.img"
    source.write_bytes(data)

    # As a peer sends it: the head, then the body once the server said 100 Continue.
    with Kept() as kept:
        said = await asyncio.to_thread(client.put_file, f"images/{kid}/pages-1.img", source, SIZE, kept)
    assert said == checksum_of(data)
    assert (folder / "pages-1.img").read_bytes() == data
    assert oct((folder / "pages-1.img").stat().st_mode & 0o777) == "0o600"
    if via == "bulk":  # its checksum, beside it, for the server's check once the images are complete
        assert received_marks(folder) == {"pages-1.img": said}

    # A client that sends all at once: what tornado read past the head is not lost.
    answer = await asyncio.to_thread(raw_put, port, jp_base_url, f"images/{kid}/pages-2.img",
                                     {"X-Content-XXH3": checksum_of(data)}, data)
    assert answer.startswith("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created"), answer[:200]
    assert (folder / "pages-2.img").read_bytes() == data

    # A checksum that differs: refused, and the file is not kept.
    answer = await asyncio.to_thread(raw_put, port, jp_base_url, f"images/{kid}/pages-3.img",
                                     {"X-Content-XXH3": "0" * 16}, data)
    assert "HTTP/1.1 400 Bad Request" in answer and "arrived damaged (its checksum differs)" in answer, answer[:400]
    assert not (folder / "pages-3.img").exists()

    # A checksum header that is not even hex: refused, not a thread that dies and a peer left waiting.
    answer = await asyncio.to_thread(raw_put, port, jp_base_url, f"images/{kid}/pages-3.img",
                                     {"X-Content-XXH3": "\u00e9t\u00e9"}, data)
    assert "HTTP/1.1 400 Bad Request" in answer and "arrived damaged" in answer, answer[:400]
    assert not (folder / "pages-3.img").exists()

    # A file that cannot be made here is refused before 100 Continue: the sender sends no byte of it.
    (folder / "pages-6.img").mkdir()
    with pytest.raises(PeerError, match="pages-6.img could not be written here"):
        await asyncio.to_thread(client.put_file, f"images/{kid}/pages-6.img", source, SIZE)
    (folder / "pages-6.img").rmdir()

    # A sender gone mid-file leaves no half file.
    await asyncio.to_thread(raw_put, port, jp_base_url, f"images/{kid}/pages-4.img", {}, data, SIZE // 3)
    deadline = time.monotonic() + 30
    while (folder / "pages-4.img").exists():
        assert time.monotonic() < deadline, "the half file stayed"
        await asyncio.sleep(0.05)

    # A wrong credential is refused before the body: the client says so, having sent none of it.
    stranger = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", "wrong"), port=port)
    with pytest.raises(PeerError, match="refused our credential"):
        await asyncio.to_thread(stranger.put_file, f"images/{kid}/pages-5.img", source, SIZE)
    assert not (folder / "pages-5.img").exists()

    # And back, as the way home fetches it (a thread of its own there too, or a process of the bulk listener's),
    # checked against its checksum.
    back = tmp_path / "back.img"
    await asyncio.to_thread(client.get_file, f"images/{kid}/pages-1.img", back, SIZE, checksum_of(data))
    assert back.read_bytes() == data
    with pytest.raises(PeerError, match="damaged"):
        await asyncio.to_thread(client.get_file, f"images/{kid}/pages-1.img", back, SIZE, "0" * 16)
    with pytest.raises(PeerError, match="has no image file pages-9.img here"):
        await asyncio.to_thread(client.get_file, f"images/{kid}/pages-9.img", back, SIZE, None)
    with pytest.raises(PeerError, match="refused our credential"):
        await asyncio.to_thread(stranger.get_file, f"images/{kid}/pages-1.img", back, SIZE, None)

    # The server's loop went on serving meanwhile, and still does.
    response = await jp_fetch("api", "gpumigrate", "gpus", method="GET")
    assert response.code == 200


def holders(path: Path) -> list[int]:
    """The processes that have ``path`` open."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd")):
                found.append(int(pid))
        except OSError:
            continue
    return found


def raw_request(port: int, data: bytes) -> str:
    """Send ``data`` on a plain socket; what came back, up to the server's closing the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        answer = bytearray()
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except ConnectionResetError:
            pass
    return answer.decode("latin-1")


async def test_the_bulk_listener_receives_each_file_in_a_process_of_its_own_refuses_the_rest_and_ends_with_it(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):  # jp_fetch: the server listens
    kid = str(uuid.uuid4())
    server = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    port = await bulk_port(jp_serverapp)
    await asyncio.to_thread(server.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    listener = jp_serverapp.web_app.settings["gpumigrate_guests"]
    bulkd = next(ext for ext in jp_serverapp.extension_manager.extension_apps["jupyter_gpumigrate"])._bulk.process
    assert listener.bulk_tls is False  # as the server: plain HTTP here

    # A file on its way is held by a process of the listener's, not by the server (this process).
    head = (f"PUT {jp_base_url}api/gpumigrate/peer/images/{kid}/pages-1.img HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: {SCHEME} {PEER_TOKEN}\r\nContent-Length: {SIZE}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(head + os.urandom(SIZE // 2))
    deadline = time.monotonic() + 30
    while not (held := holders(folder / "pages-1.img")):
        assert time.monotonic() < deadline, "no process took the file"
        await asyncio.sleep(0.05)
    (child,) = held
    assert child != os.getpid()
    assert Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1] == str(bulkd.pid)  # its parent
    # Nicer than the server (c.GPUMigrateApp.transfer_nice, 10 by default): the kernels' CPUs come first.
    assert os.getpriority(os.PRIO_PROCESS, child) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    # and so is its session's group, where the kernel shares the CPU between sessions (autogroup)
    autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled")
    if autogroup.exists() and autogroup.read_text().strip() == "1":
        assert Path(f"/proc/{child}/autogroup").read_text().split()[-2:] == ["nice", "10"]

    # Garbage and what the port does not serve: each answered in one sentence, nothing written.
    answers = {
        "garbage": raw_request(port, b"\x16\x03\x01 not http at all\r\n\r\n"),
        "a head too long": raw_request(port, b"PUT / HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n"),
        "no credential": raw_request(port, f"PUT {jp_base_url}api/gpumigrate/peer/images/{kid}/pages-2.img "
                                           "HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc".encode()),
        "another route": raw_request(port, f"GET {jp_base_url}api/gpumigrate/peer/kernels/{kid} HTTP/1.1\r\n"
                                           f"Authorization: {SCHEME} {PEER_TOKEN}\r\n\r\n".encode()),
        "a query it does not take": raw_request(port, f"GET {jp_base_url}api/gpumigrate/peer/images/{kid}/"
                                                     f"pages-1.img?growing=maybe HTTP/1.1\r\nAuthorization: {SCHEME} "
                                                     f"{PEER_TOKEN}\r\n\r\n".encode()),
        "another method": raw_request(port, f"DELETE {jp_base_url}api/gpumigrate/peer/images/{kid}/pages-1.img "
                                            f"HTTP/1.1\r\nAuthorization: {SCHEME} {PEER_TOKEN}\r\n\r\n".encode()),
        "a file that is not there": raw_request(port, f"GET {jp_base_url}api/gpumigrate/peer/images/{kid}/"
                                                      f"pages-7.img HTTP/1.1\r\nAuthorization: {SCHEME} "
                                                      f"{PEER_TOKEN}\r\n\r\n".encode()),
        "no length": raw_request(port, f"PUT {jp_base_url}api/gpumigrate/peer/images/{kid}/pages-2.img HTTP/1.1"
                                       f"\r\nAuthorization: {SCHEME} {PEER_TOKEN}\r\n\r\n".encode()),
        "a name ending in a newline": raw_request(port, f"PUT {jp_base_url}api/gpumigrate/peer/images/{kid}/"
                                                        f"pages-2.img%0A HTTP/1.1\r\nAuthorization: {SCHEME} "
                                                        f"{PEER_TOKEN}\r\nContent-Length: 3\r\n\r\nabc".encode()),
        "a kernel not expected": raw_request(port, f"PUT {jp_base_url}api/gpumigrate/peer/images/{uuid.uuid4()}/"
                                                   f"pages-2.img HTTP/1.1\r\nAuthorization: {SCHEME} {PEER_TOKEN}"
                                                   "\r\nContent-Length: 3\r\n\r\nabc".encode()),
    }
    expected = {"garbage": "400 Bad Request", "a head too long": "431", "no credential": "403 Forbidden",
                "another route": "404 Not Found", "no length": "411", "a query it does not take": "or with ?growing=true",
                "another method": "405", "a file that is not there": "has no image file pages-7.img here", "a name ending in a newline": "409 Conflict",
                "a kernel not expected": "No images are being "
                "received for kernel"}
    for what, answer in answers.items():
        assert expected[what] in answer and '"message"' in answer, (what, answer[:300])
    assert sorted(p.name for p in folder.iterdir()) == ["pages-1.img"]
    # A file asked as it grows, of a kernel of which no dump was ever marked here: refused, never sent as whole
    # (test_the_bulk_listener_follows_a_pages_file_only_while_its_dump_is_marked_running has the rest).
    answer = raw_request(port, f"GET {jp_base_url}api/gpumigrate/peer/images/{kid}/pages-1.img?growing=true "
                               f"HTTP/1.1\r\nAuthorization: {SCHEME} {PEER_TOKEN}\r\n\r\n".encode())
    assert answer.startswith("HTTP/1.1 409") and "not followed as it is written here" in answer, answer[:300]

    # Whoever connects and says nothing has the handshake and head's 10 s (AUTH_TIMEOUT), then a 431; one
    # address gets 32 connections at once (MAX_PER_ADDRESS), a 33rd is closed at once.
    quiet = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(31)]  # with the file's: 32
    deadline = time.monotonic() + 30
    while len(children_of(bulkd.pid)) < 32:
        assert time.monotonic() < deadline, "the quiet connections were not taken"
        await asyncio.sleep(0.05)
    assert await asyncio.to_thread(raw_request, port, b"PUT / HTTP/1.1\r\n\r\n") == ""  # closed, no answer
    began = time.monotonic()
    said = await asyncio.to_thread(quiet[0].recv, 4096)
    assert b"431" in said and b"within 10 s" in said and time.monotonic() - began < 15, said
    for conn in quiet:
        conn.close()

    # The listener killed: the file on its way ends with it (its process dies too), and the server says
    # nothing more of a port that no longer listens.
    bulkd.kill()
    deadline = time.monotonic() + 30
    while state(child) != "gone":  # killed with it, and reaped by the server (its subreaper)
        assert time.monotonic() < deadline, f"the listener's process outlived it ({state(child)})"
        await asyncio.sleep(0.05)
    with pytest.raises(OSError):
        sock.sendall(os.urandom(SIZE // 2))
        sock.recv(1)  # a reset, or the end of the stream
        raise ConnectionResetError
    sock.close()


def state(pid: int) -> str:
    """The state letter of process ``pid``, or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def answer_once(listener: socket.socket, answer: bytes) -> None:
    """Take one connection on ``listener``, read its request's head, send ``answer``, and close."""
    conn, _ = listener.accept()
    with conn:
        head = b""
        while b"\r\n\r\n" not in head and (got := conn.recv(4096)):
            head += got
        try:
            conn.sendall(answer)
        except OSError:
            pass  # the fetch stopped reading: what it got was enough


def children_of(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def called_off(listener: BulkListener, order: Callable[[threading.Event], Any]) -> None:
    """Give the listener ``order(stop)`` (a fetch or a send that waits on a peer which never answers), set
    ``stop`` once a process of the listener's runs it: it raises 'called off' within 5 s, and its process ends."""
    stop = threading.Event()
    waiting = asyncio.ensure_future(asyncio.to_thread(order, stop))
    deadline = time.monotonic() + 30
    while not children_of(listener.process.pid):
        assert time.monotonic() < deadline, "no process runs the order"
        await asyncio.sleep(0.05)
    began = time.monotonic()
    stop.set()
    with pytest.raises(PeerError, match="called off"):
        await waiting
    assert time.monotonic() - began < 5
    deadline = time.monotonic() + 10
    while children_of(listener.process.pid):
        assert time.monotonic() < deadline, "the order's process outlived its call"
        await asyncio.sleep(0.05)


async def test_the_bulk_listener_fetches_and_sends_each_file_in_a_process_of_its_own_and_one_called_off_ends(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    # The way home's fetches (BulkListener.fetch, what a BulkTransfers asks): from this server, as its peer.
    kid = str(uuid.uuid4())
    peer = Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN)
    await asyncio.to_thread(PeerClient(peer).call, "POST", f"images/{kid}", {"bytes": SIZE})
    data = os.urandom(SIZE)
    (tmp_path / "pages-1.img").write_bytes(data)
    await asyncio.to_thread(PeerClient(peer).put_file, f"images/{kid}/pages-1.img", tmp_path / "pages-1.img", SIZE)
    listener = BulkListener(BulkSettings(token="", root=str(tmp_path / "unused"), memory_root=None, base_url="/",
                                         host="", port=-1))  # it fetches only, as a server that takes no kernels
    silent = socket.create_server(("127.0.0.1", 0))  # a peer that takes the connection and never answers
    try:
        assert await asyncio.to_thread(listener.start) is None
        dest = tmp_path / "fetched.img"
        size, digest = await asyncio.to_thread(listener.fetch, peer, f"images/{kid}/pages-1.img", dest,
                                               threading.Event(), SIZE, checksum_of(data))
        assert (size, digest) == (SIZE, checksum_of(data)) and dest.read_bytes() == data
        assert oct(dest.stat().st_mode & 0o777) == "0o600"
        with pytest.raises(PeerError, match="damaged"):  # not the checksum said: no file
            await asyncio.to_thread(listener.fetch, peer, f"images/{kid}/pages-1.img", dest, threading.Event(),
                                    SIZE, "0" * 16)
        assert not dest.exists()
        with pytest.raises(PeerError, match="Kernel .* has no image file"):  # the peer's own sentence
            await asyncio.to_thread(listener.fetch, peer, f"images/{kid}/pages-9.img", dest, threading.Event(),
                                    SIZE, None)

        # The way there's sends (BulkListener.send, what a BulkTransfers asks), each by a process of its own: to
        # the server's port, and to its bulk listener's; a file gone, or a credential refused, said.
        folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
        for port in (None, await bulk_port(jp_serverapp)):
            (folder / "pages-3.img").unlink(missing_ok=True)
            said = await asyncio.to_thread(listener.send, peer, f"images/{kid}/pages-3.img", tmp_path / "pages-1.img",
                                           SIZE, threading.Event(), port)
            assert said == checksum_of(data) and (folder / "pages-3.img").read_bytes() == data
        with pytest.raises(PeerError, match="Sending gone.img to self failed: gone.img could not be read here"):
            await asyncio.to_thread(listener.send, peer, f"images/{kid}/pages-4.img", tmp_path / "gone.img", SIZE,
                                    threading.Event())
        with pytest.raises(PeerError, match="refused our credential"):
            await asyncio.to_thread(listener.send, Peer("self", peer.url, "wrong"), f"images/{kid}/pages-4.img",
                                    tmp_path / "pages-1.img", SIZE, threading.Event())
        assert not (folder / "pages-4.img").exists()

        # Called off while its process waits on the peer: it ends at once, and so does its process; a send, the
        # same (the peer takes its head and never says 100 Continue).
        quiet = Peer("silent", f"http://127.0.0.1:{silent.getsockname()[1]}/", "t")
        await called_off(listener, lambda stop: listener.fetch(quiet, f"images/{kid}/pages-1.img", dest, stop, SIZE))
        await called_off(listener, lambda stop: listener.send(quiet, f"images/{kid}/pages-1.img",
                                                              tmp_path / "pages-1.img", SIZE, stop))

        # A peer whose refusal is long (5000 non-ASCII characters): its sentence comes back cut, not a fetch left
        # waiting on an answer that no longer parses; one that sends more than the file listed is cut off.
        for answer, said in ((b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                              b"Connection: close\r\n\r\n" + json.dumps({"message": "\u00e9" * 5000}).encode(),
                              "\u00e9" * 100),
                             (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"x" * (SIZE + BLOCK),
                              "more than the")):
            with socket.create_server(("127.0.0.1", 0)) as rude:
                serving = threading.Thread(target=answer_once, args=(rude, answer), daemon=True)
                serving.start()
                with pytest.raises(PeerError, match=said):
                    await asyncio.wait_for(asyncio.to_thread(
                        listener.fetch, Peer("rude", f"http://127.0.0.1:{rude.getsockname()[1]}/", "t"),
                        f"images/{kid}/pages-1.img", dest, threading.Event(), SIZE, None), 30)
                serving.join(30)
            assert not dest.exists()

        # The listener killed mid-fetch: the fetch fails, saying so; its process ends with it. The listener is
        # started again (a session of its own again, whose orphans the server reaps), and fetches again.
        waiting = asyncio.ensure_future(asyncio.to_thread(
            listener.fetch, Peer("silent", f"http://127.0.0.1:{silent.getsockname()[1]}/", "t"),
            f"images/{kid}/pages-1.img", dest, threading.Event(), SIZE, None))
        while not (fetching := children_of(listener.process.pid)):
            await asyncio.sleep(0.05)
        killed = listener.process.pid
        listener.process.kill()
        # (its order may come after the kill: a process seen was an earlier fetch's, still ending)
        with pytest.raises(PeerError, match="the bulk listener (ended|cannot be reached)"):
            await asyncio.wait_for(waiting, 30)
        deadline = time.monotonic() + 10
        while any(state(pid) not in ("gone", "Z") for pid in fetching):  # a zombie: the server's reaper's
            assert time.monotonic() < deadline, "the fetch's process outlived the listener"
            await asyncio.sleep(0.05)
        assert not dest.exists()
        deadline = time.monotonic() + 30
        while not (listener.running and listener.process is not None and listener.process.pid != killed):
            assert time.monotonic() < deadline, "the listener was not started again"
            await asyncio.sleep(0.1)
        assert state(killed) == "gone" and listener.sessions[-2:] == [killed, listener.process.pid]
        size, digest = await asyncio.to_thread(listener.fetch, peer, f"images/{kid}/pages-1.img", dest,
                                               threading.Event(), SIZE, checksum_of(data))
        assert (size, digest) == (SIZE, checksum_of(data)) and dest.read_bytes() == data
    finally:
        silent.close()
        listener.stop()


async def test_the_bulk_listener_sends_a_file_as_a_dump_writes_it_from_a_process_of_its_own(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    """A file followed as the dump writes it (BulkListener.send_growing, what a BulkTransfers asks where
    stream_dump is on) goes from a process of the listener's to the peer's bulk port while a thread here still
    appends to it, and ends once told the dump is over (SIGUSR1), whole, with the checksum of all of it; a part
    of the stash ends at its index without that word. One told at once, as its process begins, keeps the word;
    one called off mid-file leaves nothing there."""
    kid = str(uuid.uuid4())
    peer = Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN)
    await asyncio.to_thread(PeerClient(peer).call, "POST", f"images/{kid}", {"bytes": 8 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    port = await bulk_port(jp_serverapp)
    listener = BulkListener(BulkSettings(token="", root=str(tmp_path / "unused"), memory_root=None, base_url="/",
                                         host="", port=-1))
    data = os.urandom(3 * SIZE)
    try:
        assert await asyncio.to_thread(listener.start) is None
        for name in ("pages-1.img", "stash-0.bin"):
            source = tmp_path / name
            source.write_bytes(b"")
            over, stop = threading.Event(), threading.Event()
            sending = asyncio.ensure_future(asyncio.to_thread(
                listener.send_growing, peer, f"images/{kid}/{name}", source, over, stop, port))
            with open(source, "ab") as f:  # in pieces that are not whole blocks, as CRIU and the stash write
                for at in range(0, len(data), 3_000_017):
                    f.write(data[at:at + 3_000_017])
                    f.flush()
                    await asyncio.sleep(0.02)
            deadline = time.monotonic() + 30
            while not (folder / name).exists() or (folder / name).stat().st_size == 0:
                assert time.monotonic() < deadline, "nothing went while the file was written"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)
            assert not sending.done(), "it ended before it was told the file's end"
            if name == "pages-1.img":
                over.set()  # the dump is over
            else:
                (tmp_path / "stash-index.json").write_text("{}")  # the stash wrote its index: the part is whole
            assert await asyncio.wait_for(sending, 30) == (len(data), checksum_of(data))
            assert (folder / name).read_bytes() == data

        # Told at once: its process may not even run yet (SIGUSR1 is blocked in the listener and in its
        # processes, which wait for it in a thread of their own); every time, the whole file, then the end.
        (tmp_path / "pages-2.img").write_bytes(data[:SIZE])
        for _ in range(5):
            over = threading.Event()
            over.set()
            assert await asyncio.to_thread(listener.send_growing, peer, f"images/{kid}/pages-2.img",
                                           tmp_path / "pages-2.img", over, threading.Event(), port) == \
                (SIZE, checksum_of(data[:SIZE]))

        # Called off mid-file (the move undone), once the peer holds all the whole blocks written of it (the
        # last part of one waits for more, or for the end): its process is killed, and the peer keeps no half
        # file.
        stop = threading.Event()
        sending = asyncio.ensure_future(asyncio.to_thread(
            listener.send_growing, peer, f"images/{kid}/pages-3.img", tmp_path / "pages-2.img", threading.Event(),
            stop, port))
        deadline = time.monotonic() + 30
        while not (folder / "pages-3.img").exists() or (folder / "pages-3.img").stat().st_size < SIZE // BLOCK * BLOCK:
            assert time.monotonic() < deadline, "the file did not arrive as far as it was written"
            await asyncio.sleep(0.01)
        stop.set()
        with pytest.raises(PeerError, match="called off"):
            await asyncio.wait_for(sending, 10)
        deadline = time.monotonic() + 30
        while (folder / "pages-3.img").exists() or children_of(listener.process.pid):
            assert time.monotonic() < deadline, "the half file stayed, or the process"
            await asyncio.sleep(0.05)
    finally:
        listener.stop()


def test_a_bulk_port_that_cannot_be_reached_is_said_and_the_files_go_through_the_servers_port(caplog):
    """A peer announces a bulk port (POST peer/check) that this host cannot connect to (a firewall between the
    hosts, a listener killed and not yet started again): the link says so and sends through the peer's server
    port; one it can connect to is used."""
    loop = asyncio.new_event_loop()
    link = PeerLink(Peer("b", "https://127.0.0.1:8888/", "t"), "k", {}, loop, None, "a")
    loop.close()  # the link's relay's, which this test does not start
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with caplog.at_level("INFO", logger="jupyter_gpumigrate.peers"):
        assert link._bulk_client({"bulk_port": port, "bulk_tls": True}, "its large files go to") is None
        assert f"b's bulk listener (port {port}) cannot be reached from here" in caplog.text, caplog.text
        with socket.create_server(("127.0.0.1", 0)) as listening:
            said = {"bulk_port": listening.getsockname()[1], "bulk_tls": True}
            client = link._bulk_client(said, "its large files come from")
            assert client is not None and client.port == listening.getsockname()[1]
            assert f"kernel k: its large files come from b's bulk listener (port {said['bulk_port']})" in caplog.text
            # plain HTTP there, TLS here (or no word of it: a version before bulk_tls): not used
            assert link._bulk_client({**said, "bulk_tls": False}, "") is None
            assert link._bulk_client({"bulk_port": said["bulk_port"]}, "") is None
        for port in (None, "8888", True, 0, 65536, 8888):  # not a port, or the server's own
            assert link._bulk_client({"bulk_port": port, "bulk_tls": True}, "") is None


def raw_chunked(port: int, base: str, path: str, body: bytes) -> str:
    """A chunked PUT (``body`` framed by the caller) on a plain socket, sent at once; what the server answered."""
    head = (f"PUT {base}api/gpumigrate/peer/{path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Authorization: {SCHEME} {PEER_TOKEN}\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = bytearray()
        while chunk := sock.recv(1 << 16):
            answer += chunk
    return answer.decode("latin-1")


async def test_a_file_that_a_dump_still_writes_is_sent_as_it_grows_and_arrives_whole(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    """A CRIU pages file goes while the dump appends to it (``PeerClient.put_growing``, chunked): here a thread
    appends pieces of random sizes, pausing between them; the file arrives whole, with the checksum of all of
    it, once the writer is done. Called off mid-file, or sent as something that is not a chunked body, no file
    stays there."""
    import threading

    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    data = os.urandom(3 * SIZE)
    source = tmp_path / "pages-1.img"
    source.write_bytes(b"")
    final, stop = threading.Event(), threading.Event()
    sent_while_writing: list[int] = []
    progress: dict[str, int] = {}

    def dump() -> None:  # appends, as CRIU does, in pieces that are not whole blocks
        with open(source, "ab") as f:
            at = 0
            while at < len(data):
                piece = data[at:at + 3_000_017]
                f.write(piece)
                f.flush()
                at += len(piece)
                time.sleep(0.02)
        sent_while_writing.append(progress.get("pages-1.img", 0))
        final.set()

    writer = threading.Thread(target=dump)
    writer.start()
    size, said = await asyncio.to_thread(client.put_growing, f"images/{kid}/pages-1.img", source, final, stop,
                                         progress)
    writer.join()
    assert size == len(data) and said == checksum_of(data)
    assert (folder / "pages-1.img").read_bytes() == data
    assert sent_while_writing[0] > 0, "nothing went before the writer was done"

    # Called off mid-file (a move undone): the sender raises, and the server keeps no half file.
    source.write_bytes(data[:SIZE])
    final2, stop2 = threading.Event(), threading.Event()
    asyncio.get_running_loop().call_later(0.5, stop2.set)
    with pytest.raises(PeerError, match="called off"):
        await asyncio.to_thread(client.put_growing, f"images/{kid}/pages-2.img", source, final2, stop2)
    deadline = time.monotonic() + 30
    while (folder / "pages-2.img").exists():
        assert time.monotonic() < deadline, "the half file stayed"
        await asyncio.sleep(0.05)

    # What is not a chunked body is refused, and nothing of it is kept.
    for body, why in [(b"zz\r\nab\r\n0\r\n\r\n", "not a hex number"),
                      (b"-5\r\nab\r\n0\r\n\r\n", "not a hex number"),
                      (b"%x\r\n" % (1 << 30), "over"),
                      (b"2\r\nabc\r\n0\r\n\r\n", "does not end where its size says")]:
        answer = await asyncio.to_thread(raw_chunked, jp_http_port, jp_base_url, f"images/{kid}/pages-3.img", body)
        assert "HTTP/1.1 400 Bad Request" in answer and why in answer, (body, answer[:400])
        assert not (folder / "pages-3.img").exists()
    # The way home's listing of a dump's growing pages: none while no dump runs; a flag that is not one is a 400.
    assert await asyncio.to_thread(client.call, "GET", f"images/{kid}?growing=true") == {
        "files": [], "dumping": False, "stash_whole": False}
    with pytest.raises(PeerError, match="takes true or false"):
        await asyncio.to_thread(client.call, "GET", f"images/{kid}?growing=maybe")
    # A well-formed one from another client, with an extension and a trailer, is taken.
    answer = await asyncio.to_thread(raw_chunked, jp_http_port, jp_base_url, f"images/{kid}/pages-3.img",
                                     b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nX-Trailer: 1\r\n\r\n")
    assert "HTTP/1.1 201 Created" in answer, answer[:400]
    assert (folder / "pages-3.img").read_bytes() == b"abcde"


async def test_a_full_disk_under_a_growing_file_is_said_at_once_not_when_the_dump_ends(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    """The other host's disk fills while a file that grows is sent: it answers 507 at once, and the sender,
    which looks for an early answer before each block, raises it while the dump (here a writer thread that
    goes on until told) still writes; the half file is gone."""
    import threading

    from helpers import small_tmpfs

    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    source = tmp_path / "pages-1.img"
    source.write_bytes(b"")
    final, stop, done = threading.Event(), threading.Event(), threading.Event()

    def dump() -> None:  # appends until the test is over: the sender never sees the file end
        with open(source, "ab") as f:
            while not done.is_set() and f.tell() < 64 * SIZE:
                f.write(os.urandom(1 << 20))
                f.flush()
                time.sleep(0.01)

    writer = threading.Thread(target=dump)
    with small_tmpfs(folder, "8m"):
        writer.start()
        try:
            with pytest.raises(PeerError, match="pages-1.img could not be written here .*free space here"):
                await asyncio.to_thread(client.put_growing, f"images/{kid}/pages-1.img", source, final, stop)
            assert writer.is_alive() and not final.is_set(), "said before the writer was done"
            assert not (folder / "pages-1.img").exists()
        finally:
            done.set()
            writer.join()


async def test_the_pages_of_a_later_process_go_while_the_dump_writes_them(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    """A dump writes a pages file per process of the tree, in turn, and each is followed as soon as it appears
    (``_Sending.follow``), apart from the files sent the usual way. Here more files appear than there are
    STREAMS; the first ones stay empty, as a tree's small processes' may, and only the last grows: it goes
    while it is written. Held to the STREAMS, it waited behind the others until the dump was over (seen on
    the GPU machine: 0.01 of 9 GB went during the dump). Every file arrives whole."""
    from jupyter_gpumigrate.peers import STREAMS, _Sending

    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    images = tmp_path / "images"
    images.mkdir()
    names = [f"pages-{n}.img" for n in range(1, STREAMS + 3)]
    for name in names:
        (images / name).write_bytes(b"")
    last, data = images / names[-1], os.urandom(2 * SIZE)
    sending = _Sending(client, kid)
    sending.follow(images)
    try:
        with open(last, "ab") as f:
            f.write(data[:SIZE])
        deadline = time.monotonic() + 20
        while not sending.progress.get(last.name):
            assert time.monotonic() < deadline, f"{last.name} waited behind the {STREAMS} streams' files"
            await asyncio.sleep(0.05)
        with open(last, "ab") as f:
            f.write(data[SIZE:])
        followed, _ = await asyncio.to_thread(sending.dumped)
        sent = {entry["name"]: entry for entry in await asyncio.to_thread(sending.results)}
    finally:
        await asyncio.to_thread(sending.stop)
    assert followed == len(names)
    assert sent[last.name]["size"] == len(data) and sent[last.name]["xxh3"] == checksum_of(data)
    assert (folder / last.name).read_bytes() == data
    assert all((folder / name).read_bytes() == b"" for name in names[:-1])


@pytest.mark.parametrize("home_via", ["server", "bulk"])
async def test_the_stashs_parts_go_as_the_kernel_writes_them_and_each_ends_at_its_index_before_any_dump(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path, home_via):
    """The host stash's parts (kernel/hoststash.py: each written front to back by a thread of the kernel's, by
    its own writer here) travel as they are written, both ways, and each ends once the stash's index is beside
    it, with no dump begun: sent by ``_Sending.follow`` (the way there), and served by the other host while its
    dump for the way home runs (``GET ...?growing=true``, which the way home fetches), from its server's port
    (a thread) or its bulk listener's (a process of its own, which reads how the dump stands from its mark).
    Each arrives whole; a second GET of a part being sent is refused (409); a part whose stash never wrote its
    index is never served as whole."""
    import threading

    from jupyter_gpumigrate.kernel import hoststash
    from jupyter_gpumigrate.peers import DumpRun, _Sending, sent_checksum, sent_over

    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    buffers = [bytearray(os.urandom(5 << 20)), bytearray(os.urandom(3 << 20) + b"tail")]
    addresses = [hoststash.Buffer("bytearray", b, len(b)).address() for b in buffers]
    chunks = hoststash.plan_chunks([len(b) for b in buffers], 2, chunk=1 << 20)

    def write_stash(images: Path, first_part_written: threading.Event, go_on: threading.Event) -> dict[str, bytes]:
        """The stash's writer: part 0, then (once told) part 1, then the index; what each part holds."""
        for part in (0, 1):
            fd = os.open(images / hoststash.PART.format(part), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                hoststash.write_part(fd, chunks, part, addresses, [False, False], None, durable=False)
            finally:
                os.close(fd)
            if part == 0:
                first_part_written.set()
                assert go_on.wait(30)
        hoststash._write_index(images, {"format": hoststash.FORMAT, "chunks": [c.__dict__ for c in chunks]}, False)
        return {name: (images / name).read_bytes() for name in (hoststash.PART.format(0), hoststash.PART.format(1))}

    # The way there: followed from before the stash; part 0 goes before part 1 is written; both end at the index.
    images = tmp_path / "images"
    images.mkdir()
    sending = _Sending(client, kid)
    sending.follow(images)
    written, go_on = threading.Event(), threading.Event()
    try:
        writer = asyncio.create_task(asyncio.to_thread(write_stash, images, written, go_on))
        await asyncio.to_thread(written.wait, 30)
        size = (images / "stash-00.bin").stat().st_size
        deadline = time.monotonic() + 20
        while sending.progress.get("stash-00.bin", 0) < size - size % BLOCK:  # a last part block waits for its end
            assert time.monotonic() < deadline, f"stash-00.bin did not go as it was written: {sending.progress}"
            await asyncio.sleep(0.02)
        assert not (images / "stash-01.bin").exists()
        await asyncio.sleep(0.3)
        assert not sending.sends["stash-00.bin"].done(), "stash-00.bin ended before the stash's index was there"
        go_on.set()
        parts = await writer
        deadline = time.monotonic() + 20
        while not all(name in sending.sends and sending.sends[name].done() for name in parts):
            assert time.monotonic() < deadline, "a stash part did not end at its index"
            await asyncio.sleep(0.02)
        assert not sending.final.is_set()  # no dump is over (dumped() was not called): the index ended them
        sent = {entry["name"]: entry for entry in [sending.sends[name].result() for name in parts]}
    finally:
        go_on.set()
        await asyncio.to_thread(sending.stop)
    for name, data in parts.items():
        assert sent[name]["size"] == len(data) and sent[name]["xxh3"] == checksum_of(data)
        assert (folder / name).read_bytes() == data

    # The way home: that host serves the parts its dump's stash writes, as they grow; each ends at the index.
    guests = jp_serverapp.web_app.settings["gpumigrate_guests"]
    for name in parts:
        (folder / name).unlink()
    port = await bulk_port(jp_serverapp) if home_via == "bulk" else None
    fetcher = PeerClient(client.peer, port=port)  # its bulk port, or its server's
    run = guests.dumping[kid] = DumpRun(mark=guests.mark_of(kid))
    home = tmp_path / "fetched"
    home.mkdir()
    written, go_on = threading.Event(), threading.Event()
    stop = threading.Event()
    try:
        writer = asyncio.create_task(asyncio.to_thread(write_stash, folder, written, go_on))
        await asyncio.to_thread(written.wait, 30)
        listed = await asyncio.to_thread(client.call, "GET", f"images/{kid}?growing=true")
        assert listed["dumping"] and [f["name"] for f in listed["files"]] == ["stash-00.bin"], listed
        fetch = asyncio.create_task(asyncio.to_thread(fetcher.get_growing, f"images/{kid}/stash-00.bin?growing=true",
                                                      home / "stash-00.bin", stop))
        await asyncio.sleep(0.5)
        assert not fetch.done(), "stash-00.bin ended before its index was there"
        with pytest.raises(PeerError) as refused:  # one sender at a time, whichever port is asked
            other = PeerClient(client.peer, port=None if port else await bulk_port(jp_serverapp))
            await asyncio.to_thread(other.get_growing, f"images/{kid}/stash-00.bin?growing=true", home / "again.bin",
                                    stop)
        assert refused.value.status == 409 and "being sent as it grows already" in str(refused.value), refused.value
        assert not (home / "again.bin").exists()
        assert not sent_over(folder / "stash-00.bin", 0.2)  # a listing now waits for its sender
        go_on.set()
        parts = await writer
        size, digest = await asyncio.wait_for(fetch, 30)
        assert not run.over.is_set()
        assert size == len(parts["stash-00.bin"]) and digest == checksum_of(parts["stash-00.bin"])
        assert (home / "stash-00.bin").read_bytes() == parts["stash-00.bin"]
        # The checksum of what went is kept beside it, and listed instead of reading the file again while the
        # file is as it was; a byte more, and it is read again.
        assert sent_over(folder / "stash-00.bin", 5) and sent_checksum(folder / "stash-00.bin") == (size, digest)
        with open(folder / "stash-00.bin", "ab") as f:
            f.write(b"!")
        assert sent_checksum(folder / "stash-00.bin") is None

        # A part with no index beside it, whose dump then failed: never served whole.
        (folder / hoststash.INDEX).unlink()
        fetch = asyncio.create_task(asyncio.to_thread(client.get_growing, f"images/{kid}/stash-01.bin?growing=true",
                                                      home / "stash-01.bin", stop))
        await asyncio.sleep(0.5)
        assert not fetch.done()
        run.end(ok=False)  # the dump failed
        with pytest.raises(PeerError, match="stash-01.bin"):
            await asyncio.wait_for(fetch, 30)
        assert not (home / "stash-01.bin").exists() and sent_checksum(folder / "stash-01.bin") is None
    finally:
        go_on.set()
        stop.set()
        run.end(ok=False)
        guests.dumping.pop(kid, None)


async def test_the_bulk_listener_follows_a_pages_file_only_while_its_dump_is_marked_running(
        jp_serverapp, jp_http_port, jp_base_url, jp_fetch, tmp_path):
    """A dump's pages file asked ``?growing=true`` on the bulk port (the way home, stream_dump on) is followed by
    a process of the listener's while the dump's mark (written by the server's DumpRun) says it runs: it ends
    whole, with its last chunk, once the mark says the dump is over and succeeded, and the checksum of what went
    is kept beside it; a mark removed mid-file (the guest discarded), or replaced by another dump's, ends it
    cut, and a file asked so with no mark at all is refused (409): never a file still written sent as whole."""
    from jupyter_gpumigrate.peers import DumpRun, sent_checksum, sent_over

    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 8 * SIZE})
    folder = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "guests" / kid
    guests = jp_serverapp.web_app.settings["gpumigrate_guests"]
    bulk = PeerClient(client.peer, port=await bulk_port(jp_serverapp))
    data = os.urandom(3 * SIZE)
    home = tmp_path / "fetched"
    home.mkdir()
    stop = threading.Event()

    def follow(name: str) -> asyncio.Future:
        return asyncio.ensure_future(asyncio.to_thread(bulk.get_growing, f"images/{kid}/{name}?growing=true",
                                                       home / name, stop))

    (folder / "pages-1.img").write_bytes(data[:SIZE])
    with pytest.raises(PeerError) as refused:
        await follow("pages-1.img")
    assert refused.value.status == 409 and "not followed as it is written" in str(refused.value), refused.value
    assert not (home / "pages-1.img").exists()
    try:
        for ending in ("ok", "gone", "another"):
            run = DumpRun(mark=guests.mark_of(kid))
            name = f"pages-{ending}.img"
            (folder / name).write_bytes(b"")
            fetch = follow(name)
            with open(folder / name, "ab") as f:  # in pieces that are not whole blocks, as CRIU writes
                for at in range(0, len(data), 3_000_017):
                    f.write(data[at:at + 3_000_017])
                    f.flush()
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)
            assert not fetch.done(), f"{name} ended before its dump"
            if ending == "ok":
                run.end(ok=True)
                assert await asyncio.wait_for(fetch, 30) == (len(data), checksum_of(data))
                assert (home / name).read_bytes() == data
                assert sent_over(folder / name, 5) and sent_checksum(folder / name) == (len(data), checksum_of(data))
                continue
            if ending == "gone":
                guests.mark_of(kid).unlink()
            else:
                DumpRun(mark=guests.mark_of(kid))  # another dump of the kernel began (its mark, its start)
            with pytest.raises(PeerError, match=name):
                await asyncio.wait_for(fetch, 30)
            assert not (home / name).exists() and sent_checksum(folder / name) is None
    finally:
        stop.set()
        guests.mark_of(kid).unlink(missing_ok=True)


def test_a_peer_of_a_version_before_this_checksum_is_refused_before_anything_moves():
    """A peer that answers its check as versions before XXH3 did (no "checksum": they carry SHA-256) is refused
    with a sentence that says what to do, before any image is made or sent. The older peer is played by a
    plain HTTP server that answers as those versions' /peer/check did."""
    import http.server
    import json
    import threading

    from jupyter_gpumigrate.engine import hostfit
    from jupyter_gpumigrate.engine.errors import InvalidState
    from jupyter_gpumigrate.peers import PeerLink

    asked: list[str] = []

    class OlderPeer(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"problems": [], "stash": True}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), OlderPeer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    loop = None
    try:
        peer = Peer("old", f"http://127.0.0.1:{server.server_address[1]}/", PEER_TOKEN)
        loop = asyncio.new_event_loop()  # the relay's, never used here
        link = PeerLink(peer, str(uuid.uuid4()), {}, loop, None, "here")
        with pytest.raises(InvalidState, match="old runs another version of jupyter-gpumigrate, whose image files "
                                               "carry no checksum where this one's carry 'xxh3': install the same "
                                               "version on both hosts"):
            link.check(hostfit.Requirements(ids=[1]), None, None)
        assert asked == ["/api/gpumigrate/peer/check"]
    finally:
        if loop is not None:
            loop.close()
        server.shutdown()
        server.server_close()


def test_dump_marks_go_only_when_the_state_folders_holder_drops_them(tmp_path):
    """The marks of the dumps that run (DumpRun.mark) are not removed by a GuestHost being made on the same
    folders (a second server started there by mistake makes its own before it finds the state folder locked:
    the first's dumps go on being followed), only by drop_dump_marks, which the server that holds the state
    folder calls at its start (app.py): those an earlier server left are of dumps that ended with it."""
    from jupyter_gpumigrate.peers import DumpRun, GuestHost, MarkedRun

    def host() -> GuestHost:
        return GuestHost(tmp_path / "guests", criu=lambda: None, records=tmp_path / "state" / "guests-running")

    first = host()
    run = DumpRun(mark=first.mark_of("k1"))
    assert first.mark_of("k1").parent == tmp_path / "state" / ".dumps-running"
    host()  # the second server's
    assert MarkedRun(first.mark_of("k1")).running
    run.end(ok=True)
    done = MarkedRun(first.mark_of("k1"))
    assert not done.running and done.ok and done.marked
    first.drop_dump_marks()
    gone = MarkedRun(first.mark_of("k1"))
    assert not gone.running and not gone.ok and not gone.marked
