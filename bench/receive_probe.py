"""What receiving a file over TLS costs in CPU, part by part: one TLS stream on 127.0.0.1 from a plain sender,
received by a process that does more at each step, each step's CPU time (user, system) and wall time printed.

Steps: ``floor`` (TLS into one reused buffer: what bench/host_bench.py's floors do), ``fresh`` (a new buffer
each MiB, as bulk.receive reads), ``hash`` (and the checksum, peers.Checksum), ``inline`` (and the write into
a file in /dev/shm, in the receiving thread), ``sink`` (the checksum and the write through peers.FileSink's
thread, as bulk.receive does).

    python3 bench/receive_probe.py [--gb 2] [--steps floor,fresh,hash,inline,sink]

Needs openssl (a throwaway certificate) and the package importable (the repository).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jupyter_gpumigrate.peers import Checksum, FileSink  # noqa: E402

BLOCK = 1 << 20


def receive(listener: socket.socket, step: str, nbytes: int, cert: str, key: str, target: str) -> None:
    raw, _ = listener.accept()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    conn = context.wrap_socket(raw, server_side=True)
    before, began = os.times(), time.perf_counter()
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    sink = FileSink(fd) if step == "sink" else None
    file = os.fdopen(fd, "wb") if sink is None else None
    checksum, reused, got = Checksum(), bytearray(BLOCK), 0
    while got < nbytes:
        block = reused if step == "floor" else bytearray(BLOCK)
        view, filled = memoryview(block), 0
        while filled < BLOCK:
            filled += conn.recv_into(view[filled:])
        got += filled
        if sink is not None:
            sink.put_blocking(block)
        elif step == "inline":
            checksum.update(block)
            file.write(block)
        elif step == "hash":
            checksum.update(block)
    if sink is not None:
        sink.close_blocking()
    else:
        file.close()
    after = os.times()
    print(f"{step:7s} receiver: user {after.user - before.user:.2f} s, system {after.system - before.system:.2f} s, "
          f"wall {time.perf_counter() - began:.2f} s", flush=True)
    conn.sendall(b"ok")
    os.unlink(target)


def one(step: str, nbytes: int, cert: str, key: str) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    target = f"/dev/shm/gpumigrate-receive-probe-{os.getpid()}"
    receiver = multiprocessing.Process(target=receive, args=(listener, step, nbytes, cert, key, target))
    receiver.start()
    conn = socket.create_connection(listener.getsockname())
    conn = ssl.create_default_context(cafile=cert).wrap_socket(conn, server_hostname="127.0.0.1")
    block, sent, began = os.urandom(BLOCK), 0, time.perf_counter()
    while sent < nbytes:
        conn.sendall(block)
        sent += BLOCK
    assert conn.recv(2) == b"ok"
    print(f"{step:7s} {nbytes / 1e9 / (time.perf_counter() - began):.2f} GB/s", flush=True)
    conn.close()
    receiver.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--steps", default="floor,fresh,hash,inline,sink")
    args = parser.parse_args()
    multiprocessing.set_start_method("fork")
    nbytes = int(args.gb * 1e9) // BLOCK * BLOCK
    with tempfile.TemporaryDirectory() as folder:
        cert, key = f"{folder}/cert.pem", f"{folder}/key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=receive-probe", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out",
                        cert], check=True, capture_output=True)
        for step in args.steps.split(","):
            one(step, nbytes, cert, key)
    return 0


if __name__ == "__main__":
    sys.exit(main())
