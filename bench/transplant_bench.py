"""Transplants through a real server: a kernel holding N GB of PyTorch tensors carried into a new process.

For each size, a `jupyter server` with the extension starts an IPython kernel that fills ``--device``
(cpu, or cuda: GPU 0) with ``--sizes`` GB of tensors from seeds, transplants it (``--to cpu`` or
``--to N``, a GPU's index) through the REST API, and checks in the new process that every tensor's SHA-256
equals the one taken before, on the device it landed on.

Floors, measured in the same run just before each transplant: one thread, one file, on the tmpfs (the
export and load use up to 16 threads and files, so they may pass it): a fresh Python process writing as
many bytes of its own memory to /dev/shm and reading them into new memory; with a GPU, pinned host <->
GPU copies. Writes
``<out-dir>/<date>-<tag>-transplant.json``; the table comes last.

    python3 bench/transplant_bench.py [--sizes 1,4] [--device cpu] [--to cpu] [--tag dev]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import Server  # noqa: E402
from report import text_table  # noqa: E402
from suspend_bench import pinned_floors  # noqa: E402

GB = 10**9

BUILD = """
import hashlib, torch
PART = 10**9
def part(i, n, device):
    g = torch.Generator(device=device).manual_seed(i)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, device=device, generator=g)
sizes = []
left = int({size} * 1e9)
while left > 0:
    sizes.append(min(PART, left)); left -= sizes[-1]
tensors = [part(i, n, {device!r}) for i, n in enumerate(sizes)]
def digest(t):  # of a copy: numpy() makes a storage fixed in size, which the host stash then leaves
    return hashlib.sha256(memoryview(t.to("cpu", copy=True).numpy())).hexdigest()
digests = [digest(t) for t in tensors]  # carried too: a GPU's and the CPU's generators draw different bytes
print(sum(t.numel() for t in tensors))
"""
CHECK = """
where = tensors[0].device.type
print([digest(t) for t in tensors] == digests, where)
"""


FLOOR = """
import os, sys, time
n, path = int(sys.argv[1]), sys.argv[2]
data = bytearray(n)
data[:] = os.urandom(1 << 20) * (n >> 20) + bytes(n % (1 << 20))  # every page touched, as a kernel's tensors
def each(f, view, step=256 << 20):
    done = 0
    while done < n:
        done += step if f is None else (f.write(view[done:done + step]) if mode == "w" else f.readinto(view[done:done + step]))
mode = "w"
t = time.perf_counter()
with open(path, "wb", buffering=0) as f:
    each(f, memoryview(data))
w = n / (time.perf_counter() - t) / 1e9
del data
mode = "r"
fresh = bytearray(n)
t = time.perf_counter()
with open(path, "rb", buffering=0) as f:
    each(f, memoryview(fresh))
print(w, n / (time.perf_counter() - t) / 1e9)
os.unlink(path)
"""


def floors(size: float) -> dict:
    """A fresh Python process writing ``size`` GB of its own memory to a new file on /dev/shm, then reading
    it into newly allocated memory, one thread, 256 MiB per call: what the export and the load do, less
    the pickling; measured just before each transplant (a virtual machine's first touch of its memory
    can be slower than the copy). With a GPU, pinned host <-> GPU copies."""
    out: dict = {}
    path = f"/dev/shm/gpumigrate-floor-{os.getpid()}"
    done = subprocess.run([sys.executable, "-c", FLOOR, str(int(size * GB)), path], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the floor could not be measured: {done.stderr.strip()}")
    out["tmpfs_write"], out["tmpfs_read"] = map(float, done.stdout.split())
    out.update(pinned_floors(2 << 30))
    return {k: round(v, 2) for k, v in out.items()}


def transplant(server: Server, kernel_id: str, body: dict) -> dict:
    op = server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", body)
    while op["status"] not in ("succeeded", "failed"):
        op = server.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return server.succeeded(op, "transplant")


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        floor = r["floors"]
        t = r["op"]["timings"]
        gb = r["op"]["bytes"] / GB
        export, load = t.get("export", 0.0), t.get("load", 0.0)
        lines.append([f"{r['device']} -> {r['to']}", f"{r['size_gb']:g}", f"{r['op']['total']:.2f}",
                      ", ".join(f"{k} {v:.2f}" for k, v in t.items()),
                      f"{gb / export:.2f} ({gb / export / floor['tmpfs_write']:.2f})" if export else "-",
                      f"{gb / load:.2f} ({gb / load / floor['tmpfs_read']:.2f})" if load else "-",
                      f"{floor['tmpfs_write']} / {floor['tmpfs_read']}"])
    head = ["from -> to", "GB", "total s", "phases (s)", "export GB/s (of floor)", "load GB/s (of floor)",
            "floor write / read GB/s"]
    return text_table(head, lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4", help="GB of tensors the kernel holds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the tensors are")
    parser.add_argument("--to", default="cpu", help="cpu, or a GPU's index")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--tag", default="dev")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    body = {"to_cpu": True} if args.to == "cpu" else {"to_gpu": int(args.to)}
    rows: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="gpumigrate-transplant-bench-", dir="/tmp"))
    server = Server(root, {"MigratableProvisioner": {"suspend_to": "memory"}})
    try:
        for size in sizes:
            kernel_id = server.api("POST", "api/kernels", {"name": "python3"})["id"]
            server.run(kernel_id, BUILD.format(size=size, device=args.device))
            floor = floors(size)
            print(json.dumps({"floors": floor}), flush=True)
            op = transplant(server, kernel_id, body)
            check = server.run(kernel_id, CHECK).split()
            if check[0] != "True":
                raise RuntimeError(f"{size} GB: the tensors changed: {check}")
            rows.append({"device": args.device, "to": args.to, "landed_on": check[1], "size_gb": size, "op": op,
                         "floors": floor})
            print(json.dumps({"size_gb": size, "bytes": op["bytes"], "timings": op["timings"]}), flush=True)
            server.api("DELETE", f"api/kernels/{kernel_id}")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": socket.gethostname(),
            "cpus": os.cpu_count()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y-%m-%d')}-{args.tag}-transplant.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n# {meta['date']}, {meta['cpus']} CPUs; the objects' folder and the images in /dev/shm")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
