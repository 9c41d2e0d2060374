"""A CPU kernel moved to another host and back, against the link between the two hosts, in one run.

Two "hosts" on this machine, as the tests make them (tests/hosts.py: network namespaces joined by a bridge
through veth pairs, each with its own HTTPS jupyter_server and the extension; root and `ip` are needed).
For each size a kernel on host a fills that many GB of memory, moves to b (``to_host: "b"``) and comes back
(``to_host: "a"``) through a's REST API; a digest of its memory is checked after each trip. Phase timings
come from the operations themselves.

Floors, measured in the same run just before each size, with the same number of bytes as the kernel's
images: the link as a plain TCP stream from a's namespace to b's, and as a TLS stream (what the transfer
uses: HTTPS, less HTTP and the files). The last thing printed is a table; --out writes all as JSON.

Ways, each with both hosts started afresh for it, in the same run: ``stash``, the kernel writes its large
buffers into the images itself (the host stash, ``c.MigratableProvisioner.host_stash_min`` set to
``--stash-min``) and reads them back there; ``criu``, the stash off: CRIU carries every byte. A way
named with ``-stream`` (``criu-stream``, ``stash-stream``) has ``c.GPUMigrateApp.stream_dump`` on: CRIU's
pages files go as the dump writes them (phase ``stream``), either way; with ``-after``, off: once the dump is
over; without either, as 'auto' (the default) decides on this machine (on where the server can use 16 CPUs or
more: its affinity and its cgroups' CPU quota). Side by side in one run,
``criu-stream,criu-after`` says what the streaming gains here. With ``-files`` (``stash-after-files``) a GPU
kernel's restores make no prefetch (``c.MigratableProvisioner.resume_prefetch`` off on both hosts): the
kernel reads its stash's files itself once restored, as before 2026-11-29. With ``-onebulk``
(``stash-after-onebulk``) the hosts have no bulk listener (``c.GPUMigrateApp.bulk_port`` -1): the files
arrive through the server's port, received by its one process, as before 2026-11-29 (bulkd.py). With ``-s<N>``
(``stash-after-s4``) N files go at once (``c.GPUMigrateApp.transfer_streams``). With ``-nice<N>``
(``stash-stream-nice0``) both hosts' bulk listeners run at niceness N (``c.GPUMigrateApp.transfer_nice``;
without it, its default). With --device cuda the kernel goes
from a's GPU 0 to b's GPU 1, or to b's GPU 0 on a machine of one GPU.
The goal column is issue 18's bound on a move's downtime: bytes / the TLS floor x 1.3 + 2 s.

    .venv/bin/python bench/host_bench.py [--sizes 1,4] [--ways stash,criu] [--images auto|disk|memory]
        [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from hosts import Host, Network, host_pair  # noqa: E402
from report import text_table  # noqa: E402

GB = 10**9
MB = 1 << 20
FLOOR_PORT = 9999

FILL = """
import hashlib, os
blob = bytearray(os.urandom({mb})) * {count}  # {size} GB, every page touched
digest = hashlib.sha256(blob[::4093]).hexdigest()
print(len(blob))
"""
CHECK = "print(hashlib.sha256(blob[::4093]).hexdigest() == digest, len(blob))"
# --device cuda: the bytes in a tensor on GPU 0 (moved to b's GPU 1 and back), digested through a strided sample
FILL_CUDA = """
import hashlib, torch
g = torch.Generator(device='cuda').manual_seed(7)
blob = torch.randint(0, 256, ({nbytes},), dtype=torch.uint8, device='cuda', generator=g)  # {size} GB
digest = hashlib.sha256(blob[::4093].cpu().numpy().tobytes()).hexdigest()
print(blob.numel())
"""
CHECK_CUDA = "print(hashlib.sha256(blob[::4093].cpu().numpy().tobytes()).hexdigest() == digest, blob.numel())"

RECEIVE = """
import socket, ssl, sys
ip, port, cert, key, tls, nbytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5] == "1", int(sys.argv[6])
server = socket.create_server((ip, port))
print("ready", flush=True)
conn, _ = server.accept()
if tls:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    conn = ctx.wrap_socket(conn, server_side=True)
got, buf = 0, bytearray(1 << 20)
while got < nbytes and (n := conn.recv_into(buf)):
    got += n
conn.sendall(b"ok")  # all of it is here: the sender's clock stops
conn.close()
print(got, flush=True)
"""

SEND = """
import socket, ssl, sys, time
ip, port, cert, nbytes, tls = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
block = bytes(range(256)) * 4096
started = time.perf_counter()
conn = socket.create_connection((ip, port))
if tls:
    conn = ssl.create_default_context(cafile=cert).wrap_socket(conn, server_hostname=ip)
sent = 0
while sent < nbytes:
    conn.sendall(block[:min(len(block), nbytes - sent)])
    sent += min(len(block), nbytes - sent)
assert conn.recv(2) == b"ok"
print(time.perf_counter() - started)
conn.close()
"""


def link_floor(a: Host, b: Host, nbytes: int, tls: bool) -> float:
    """GB/s of one stream of ``nbytes`` from a's namespace to b's (TLS with the hosts' certificate, or TCP)."""
    flag = "1" if tls else "0"
    receiver = subprocess.Popen(["ip", "netns", "exec", b.ns, sys.executable, "-c", RECEIVE, b.ip, str(FLOOR_PORT),
                                 str(b.cert), str(b.key), flag, str(nbytes)], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        sender = subprocess.run(["ip", "netns", "exec", a.ns, sys.executable, "-c", SEND, b.ip, str(FLOOR_PORT),
                                 str(b.cert), str(nbytes), flag], capture_output=True, text=True, check=True)
        got = int(receiver.stdout.readline())
    finally:
        receiver.wait(timeout=60)
    assert got == nbytes, (got, nbytes)
    return nbytes / float(sender.stdout.strip()) / GB


def link_floor_parallel(a: Host, b: Host, nbytes: int, streams: int) -> float:
    """GB/s of ``streams`` TLS streams at once from a's namespace to b's, ``nbytes`` in all (what a transfer of
    several files at once could reach, against the one stream of :func:`link_floor`)."""
    share = nbytes // streams
    receivers = [subprocess.Popen(["ip", "netns", "exec", b.ns, sys.executable, "-c", RECEIVE, b.ip,
                                   str(FLOOR_PORT + 1 + i), str(b.cert), str(b.key), "1", str(share)],
                                  stdout=subprocess.PIPE, text=True) for i in range(streams)]
    try:
        for r in receivers:
            assert r.stdout is not None and r.stdout.readline().strip() == "ready"
        started = time.perf_counter()
        senders = [subprocess.Popen(["ip", "netns", "exec", a.ns, sys.executable, "-c", SEND, b.ip,
                                     str(FLOOR_PORT + 1 + i), str(b.cert), str(share), "1"],
                                    stdout=subprocess.PIPE, text=True) for i in range(streams)]
        for sender in senders:
            sender.communicate(timeout=1800)
            assert sender.returncode == 0
        seconds = time.perf_counter() - started
        got = sum(int(r.stdout.readline()) for r in receivers if r.stdout is not None)
    finally:
        for r in receivers:
            r.wait(timeout=60)
    assert got == share * streams, (got, share * streams)
    return share * streams / seconds / GB


def run_cell(host: Host, kernel_id: str, code: str, timeout: float = 600) -> str:
    """Run ``code`` in the kernel through the host's /api/kernels/{id}/channels; what it printed."""
    import asyncio

    from helpers import WebSocketTab
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    async def go() -> str:
        request = HTTPRequest(f"wss://{host.ip}:8888/api/kernels/{kernel_id}/channels",
                              headers={"Authorization": f"token {host.token}"}, ca_certs=str(host.cert))
        tab = WebSocketTab(await websocket_connect(request))
        try:
            return await tab.run(code, timeout=timeout)
        finally:
            tab.ws.close()

    return asyncio.run(go())


def one_size(a: Host, b: Host, size: float, way: str, device: str = "cpu", there: int | None = None,
             streams: tuple[int, ...] = ()) -> dict:
    kernel_id = a.api("POST", "api/kernels", {"name": "python3"})["id"]
    try:
        count = max(1, int(size * GB / MB))
        nbytes = count * MB
        if device == "cuda":
            fill, check, here = FILL_CUDA.format(nbytes=nbytes, size=size), CHECK_CUDA, 0
            there = 1 if there is None else there
        else:
            fill, check, there, here = FILL.format(mb=MB, count=count, size=size), CHECK, None, None
        run_cell(a, kernel_id, fill)
        floors = {"tcp": link_floor(a, b, nbytes, tls=False), "tls": link_floor(a, b, nbytes, tls=True)}
        for n in streams:
            floors[f"tls_x{n}"] = link_floor_parallel(a, b, nbytes, n)
        at = {"away": time.time()}  # when each trip began (to read beside bench/cpu_sample.py's samples)
        away = a.operate(kernel_id, "migrate", {"to_host": "b", "to_gpu": there}, timeout=1800)
        assert away["status"] == "succeeded", away
        assert run_cell(a, kernel_id, check).split() == ["True", str(nbytes)]
        at["home"] = time.time()
        home = a.operate(kernel_id, "migrate", {"to_host": "a", "to_gpu": here}, timeout=1800)
        assert home["status"] == "succeeded", home
        assert run_cell(a, kernel_id, check).split() == ["True", str(nbytes)]
    finally:
        a.api("DELETE", f"api/kernels/{kernel_id}")
    return {"way": way, "device": device, "size_gb": size, "kernel_bytes": nbytes, "floors_gbps": floors,
            "to_gpu": there,
            "away": {"total": away["total"], "bytes": away["bytes"], "timings": away["timings"],
                     "stash": away.get("stash"), "at": at["away"]},
            "home": {"total": home["total"], "bytes": home["bytes"], "timings": home["timings"],
                     "stash": home.get("stash"), "at": at["home"]},
            # what each server said of this kernel: the transfer's split, the other host's own phases
            "said": {h.name: said_of(h, kernel_id) for h in (a, b)}}


def said_of(host: Host, kernel_id: str) -> list[str]:
    """The server's log lines about ``kernel_id`` from the extension (their text after the level and time)."""
    try:
        text = (host.root / "server.log").read_text(errors="replace")
    except OSError:
        return []
    return [line.split("] ", 1)[-1] for line in text.splitlines() if kernel_id in line and "gpumigrate:" in line]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4", help="kernel sizes in GB, comma-separated")
    parser.add_argument("--images", choices=("auto", "disk", "memory"), default="auto",
                        help="the hosts' suspend_to, which a move's images follow (auto: memory where there is room)")
    parser.add_argument("--ways", default="stash,criu",
                        help="stash, criu or both, comma-separated; '-stream' (criu-stream, stash-stream) has "
                             "CRIU's pages carried as the dump writes them, '-after' once it is over, neither: as "
                             "c.GPUMigrateApp.stream_dump 'auto' decides on this machine")
    parser.add_argument("--stash-min", type=int, default=5 * 10**8,
                        help="the stash way's c.MigratableProvisioner.host_stash_min, in bytes")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the kernel's bytes are: its memory, or a tensor on GPU 0 (moved to b's GPU 1)")
    parser.add_argument("--streams", default="",
                        help="also measure the link with this many TLS streams at once, comma-separated (4,8): "
                             "the floors tls_x4, tls_x8 (what a transfer of several files at once could reach)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--out-dir", help="or into this folder, named by date and --tag (scripts/gpu-suite.sh)")
    parser.add_argument("--tag", default="dev", help="the machine's tag in the file name")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("host_bench: needs root (network namespaces)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="gpumigrate-host-bench-"))
    there = None
    if args.device == "cuda":
        from jupyter_gpumigrate.engine import gpus as gpus_mod

        # b's GPU: GPU 1 where there are two (the hosts share the machine's GPUs), else GPU 0, which the kernel
        # has left by the time b restores it
        there = 1 if len(gpus_mod.snapshot()) > 1 else 0
    net = Network(200 + os.getpid() % 50).up()
    a = b = None
    rows = []
    try:
        a, b = host_pair(net, root)
        for way in args.ways.split(","):
            for host in (a, b):
                host.stop()
                parts = way.split("-")
                host.extra = {"MigratableProvisioner": {"suspend_to": args.images, "host_stash_min":
                                                        args.stash_min if parts[0] == "stash" else None,
                                                        "resume_prefetch": "files" not in parts},
                              "GPUMigrateApp": {"stream_dump": "off" if "after" in parts else
                                                "on" if "stream" in parts else "auto",
                                                "bulk_port": -1 if "onebulk" in parts else 0,
                                                "transfer_streams": next((int(p[1:]) for p in parts
                                                                          if p[:1] == "s" and p[1:].isdigit()), 0),
                                                **{"transfer_nice": int(p[4:]) for p in parts
                                                   if p[:4] == "nice" and p[4:].isdigit()}}}
            a.start({"b": b.peer_entry()})
            b.start({"a": a.peer_entry()})
            for size in (float(s) for s in args.sizes.split(",")):
                rows.append(one_size(a, b, size, way, args.device, there,
                                     tuple(int(n) for n in args.streams.split(",") if n)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for host in (a, b):
            if host is not None:
                host.stop()
        net.close()
        if not os.environ.get("HOST_BENCH_KEEP"):
            subprocess.run(["rm", "-rf", str(root)], check=False)
        else:
            print("kept:", root)
    print(text_table(*table_of(rows)))
    out = args.out or (args.out_dir and str(Path(args.out_dir) / f"{time.strftime('%Y-%m-%d')}-{args.tag}-host.json"))
    if out:
        Path(out).write_text(json.dumps({"machine": platform.node(), "images": args.images, "device": args.device,
                                              "stash_min": args.stash_min,
                                              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                              "rows": rows}, indent=1))
    return 0


def prefetched(trip: dict) -> str:
    """GB the restored kernel copied from a prefetch on its GPU (engine/prefetch.py), or why none: '-'."""
    fetched = (trip.get("stash") or {}).get("prefetch") or {}
    return f"{fetched['bytes'] / GB:.2f}" if fetched.get("bytes") else "-"


def table_of(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The rows as a table: phases, the link's floors, and each trip against issue 18's goal. Going away, the
    kernel reads its stash back within the other host's restore; coming home, in its own phase (unstash)."""
    table = []
    for r in rows:
        tls = r["floors_gbps"]["tls"]
        for trip in ("away", "home"):
            t = r[trip]["timings"]
            floor = r[trip]["bytes"] / GB / tls
            goal = floor * 1.3 + 2
            table.append([r.get("way", "criu"), f"{r['size_gb']:g}", trip, f"{r[trip]['bytes'] / GB:.2f}",
                          f"{r[trip]['total']:.2f}", f"{t.get('stash', 0):.2f}", f"{t.get('dump', 0):.2f}",
                          f"{t.get('transfer', 0):.2f}", f"{t.get('restore', 0):.2f}", f"{t.get('adopt', 0):.2f}",
                          f"{t.get('unstash', 0):.2f}", prefetched(r[trip]), f"{r['floors_gbps']['tcp']:.2f}", f"{tls:.2f}",
                          f"{floor:.2f}", f"{t.get('transfer', 0) / floor:.2f}", f"{goal:.2f}",
                          f"{r[trip]['total'] / goal:.2f}"])
    return (["way", "GB", "trip", "sent GB", "total s", "stash s", "dump s", "transfer s", "restore s", "adopt s",
             "unstash s", "prefetch GB", "TCP GB/s", "TLS GB/s", "TLS floor s", "transfer / floor", "goal s", "total / goal"],
            table)


if __name__ == "__main__":
    sys.exit(main())
