"""A large image file between hosts goes through a thread of its own, off the server's event loop (bulk.py).

A real jupyter_server with the extension is its own peer: its peer routes take image files from this test
as another host's server would send them (``PeerClient``, which waits for ``100 Continue``) and as other
clients might (all at once, a wrong checksum, a sender that goes away mid-file), and give them back.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from pathlib import Path

import xxhash

import pytest

from jupyter_gpumigrate.peers import DETACH_MIN, SCHEME, Kept, Peer, PeerClient, PeerError

from helpers import peer_server_config

PEER_TOKEN = "bulk-test-peer-token"
SIZE = DETACH_MIN + 12345  # over the threshold, and not a whole number of blocks


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict:
    return peer_server_config(tmp_path, PEER_TOKEN)


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


async def test_a_large_image_file_is_received_and_sent_by_a_thread_of_its_own(jp_serverapp, jp_http_port,
                                                                              jp_base_url, jp_fetch, tmp_path):
    kid = str(uuid.uuid4())
    client = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", PEER_TOKEN))
    await asyncio.to_thread(client.call, "POST", f"images/{kid}", {"bytes": 4 * SIZE})
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

    # A client that sends all at once: what tornado read past the head is not lost.
    answer = await asyncio.to_thread(raw_put, jp_http_port, jp_base_url, f"images/{kid}/pages-2.img",
                                     {"X-Content-XXH3": checksum_of(data)}, data)
    assert answer.startswith("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created"), answer[:200]
    assert (folder / "pages-2.img").read_bytes() == data

    # A checksum that differs: refused, and the file is not kept.
    answer = await asyncio.to_thread(raw_put, jp_http_port, jp_base_url, f"images/{kid}/pages-3.img",
                                     {"X-Content-XXH3": "0" * 16}, data)
    assert "HTTP/1.1 400 Bad Request" in answer and "arrived damaged (its checksum differs)" in answer, answer[:400]
    assert not (folder / "pages-3.img").exists()

    # A sender gone mid-file leaves no half file.
    await asyncio.to_thread(raw_put, jp_http_port, jp_base_url, f"images/{kid}/pages-4.img", {}, data, SIZE // 3)
    deadline = time.monotonic() + 30
    while (folder / "pages-4.img").exists():
        assert time.monotonic() < deadline, "the half file stayed"
        await asyncio.sleep(0.05)

    # A wrong credential is refused before the body: the client says so, having sent none of it.
    stranger = PeerClient(Peer("self", f"http://127.0.0.1:{jp_http_port}{jp_base_url}", "wrong"))
    with pytest.raises(PeerError, match="refused our credential"):
        await asyncio.to_thread(stranger.put_file, f"images/{kid}/pages-5.img", source, SIZE)
    assert not (folder / "pages-5.img").exists()

    # And back, as the way home fetches it (a thread of its own there too), checked against its checksum.
    back = tmp_path / "back.img"
    await asyncio.to_thread(client.get_file, f"images/{kid}/pages-1.img", back, SIZE, checksum_of(data))
    assert back.read_bytes() == data
    with pytest.raises(PeerError, match="damaged"):
        await asyncio.to_thread(client.get_file, f"images/{kid}/pages-1.img", back, SIZE, "0" * 16)

    # The server's loop went on serving meanwhile, and still does.
    response = await jp_fetch("api", "gpumigrate", "gpus", method="GET")
    assert response.code == 200
