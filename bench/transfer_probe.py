"""Where a move's transfer to another host is bound: the real sender against the real receiver, with the
files' streams as threads of one process (as the servers run them) or as processes of their own.

The sender is :meth:`jupyter_gpumigrate.peers.PeerClient.put_file` (one file per stream, checksummed as it
is read); the receiver is :func:`jupyter_gpumigrate.bulk.receive` (what a server's detached upload runs:
read, checksum, write into a file), behind a plain TLS accept on 127.0.0.1, one connection per file. Each
side runs its streams as threads of one process (``t``) or one process each (``p``); the files are read from
and written to /dev/shm. On the GPU machine (16 CPUs, 2026-11-29) four files went at 1.10 GB/s with both
sides as threads and at 4.09-4.22 GB/s wherever the receiver's streams were processes, whatever the sender
was: the receiving process is the bound (bench/results/2026-11-29-h200x1-transfer-probe.md).

    python3 bench/transfer_probe.py FILES TOTAL_GB SENDER(t|p) RECEIVER(t|p) [growing]
    e.g. for m in "4 8 t t" "4 8 t p" "4 8 p t" "4 8 p p"; do python3 bench/transfer_probe.py $m; done

Needs the package importable (the repository, or the kit's /tmp/site on the GPU machine) and openssl.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jupyter_gpumigrate import bulk  # noqa: E402
from jupyter_gpumigrate.peers import Peer, PeerClient  # noqa: E402

SHM = Path(os.environ.get("TRANSFER_PROBE_DIR", "/dev/shm/gpumigrate-transfer-probe"))
BLOCK = 1 << 20


def certificate(folder: Path) -> tuple[str, str]:
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                    "/CN=transfer-probe", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                    str(cert)], check=True, capture_output=True)
    return str(cert), str(key)


def take_one(raw: socket.socket, cert: str, key: str) -> None:
    """One upload: the request's head read here, its body by bulk.receive, as a server's detached upload."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    conn = context.wrap_socket(raw, server_side=True)
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    head, _, leftover = head.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    name = lines[0].split()[1].rsplit("/", 1)[1]
    length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")),
                  None)  # None: chunked (a file sent as it grows)
    conn.settimeout(60)
    dest = SHM / f"received-{name}"
    bulk.receive(conn, leftover, length, dest, lambda digest: (201, {"name": name, "xxh3": digest}))
    dest.unlink(missing_ok=True)


def receiver(listener: socket.socket, files: int, processes: bool, cert: str, key: str) -> None:
    workers: list = []
    for _ in range(files):
        raw, _ = listener.accept()
        make = multiprocessing.Process if processes else threading.Thread
        worker = make(target=take_one, args=(raw, cert, key))
        worker.start()
        workers.append(worker)
        if processes:
            raw.close()  # the child has it
    for worker in workers:
        worker.join()


def sender(port: int, files: list[Path], cert: str, out: multiprocessing.Queue, growing: bool = False) -> None:
    client = PeerClient(Peer("b", f"https://127.0.0.1:{port}/", "token", ca_file=cert))
    spans: list[tuple[float, float]] = []
    whole = threading.Event()
    whole.set()

    def one(path: Path) -> None:
        began = time.time()
        if growing:  # as a file followed while it is written, once whole: chunks, read as it grows
            client.put_growing(f"images/probe/{path.name}", path, whole, threading.Event())
        else:
            client.put_file(f"images/probe/{path.name}", path, path.stat().st_size)
        spans.append((began, time.time()))

    threads = [threading.Thread(target=one, args=(p,)) for p in files]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(spans)


def main() -> int:
    files, total_gb, send_mode, receive_mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
    growing = sys.argv[5:6] == ["growing"]
    multiprocessing.set_start_method("fork")
    SHM.mkdir(parents=True, exist_ok=True)
    size = int(total_gb * 1e9 / files) // BLOCK * BLOCK
    block = os.urandom(BLOCK)
    sources = []
    for i in range(files):
        path = SHM / f"source-{i}-{size}"
        if not path.is_file() or path.stat().st_size != size:
            with open(path, "wb") as f:
                for _ in range(size // BLOCK):
                    f.write(block)
        sources.append(path)
    with tempfile.TemporaryDirectory() as folder:
        cert, key = certificate(Path(folder))
        listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        port = listener.getsockname()[1]
        serving = multiprocessing.Process(target=receiver, args=(listener, files, receive_mode == "p", cert, key))
        serving.start()
        out: multiprocessing.Queue = multiprocessing.Queue()
        groups = [sources] if send_mode == "t" else [[p] for p in sources]
        senders = [multiprocessing.Process(target=sender, args=(port, g, cert, out, growing)) for g in groups]
        for s in senders:
            s.start()
        spans = [span for _ in senders for span in out.get()]
        for s in senders:
            s.join()
        serving.join()
    wall = max(end for _, end in spans) - min(began for began, _ in spans)
    print(f"files={files} sender={send_mode} receiver={receive_mode} {'growing' if growing else 'whole'}: {files * size / 1e9:.2f} GB in {wall:.2f} s "
          f"= {files * size / 1e9 / wall:.2f} GB/s", flush=True)
    for path in sources:
        path.unlink(missing_ok=True)
    try:
        SHM.rmdir()
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
