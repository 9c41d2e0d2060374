"""GPU suspend and resume through a real server, with and without the host stash, images in memory or on disk.

For each way, a `jupyter server` with the extension is started, an IPython kernel fills GPU 0 with
``--sizes`` GB of PyTorch tensors (from seeds), and is suspended and resumed through the REST API; after
the resume every tensor is compared, on the GPU, with one rebuilt from its seed (torch.equal: exact).

Ways, ``<how>-<where>``:
  stash-*   the host stash (kernel/hoststash.py): the kernel writes its tensors itself, then the driver
            and CRIU carry the rest; at resume the stash helper reads them onto the GPU while CRIU
            restores (engine/prefetch.py), and the kernel copies them from there
  files-*   the same, the prefetch off (c.MigratableProvisioner.resume_prefetch = False): the kernel reads
            its files itself once restored
  criu-*    the stash off (c.MigratableProvisioner.host_stash_min = None): the CUDA driver and CRIU alone
  busy-*    the host stash, the kernel busy in a cell (a loop of 10 ms sleeps) all along: served at the
            cell's safe point (kernel/safepoint.py), where the cell waits until its tensors are back
  *-memory  images in memory (c.MigratableProvisioner.suspend_to = "memory": a folder on /dev/shm)
  *-disk    images on disk (suspend_to = "disk": the state folder, on ``--disk-dir``)

Floors, measured in the same run: the disk's sequential write and read (dd, O_DIRECT, 8 GiB), tmpfs
written and read by 16 threads (one file each), and pinned host <-> GPU copies. Writes
``<out-dir>/<date>-<tag>-suspend.json``; the table comes last.

    python3 bench/suspend_bench.py [--sizes 8,32] [--ways stash-memory,criu-memory] [--disk-dir DIR] [--rounds 1]
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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import Server  # noqa: E402
from report import text_table  # noqa: E402

GB = 10**9
GIB = 1 << 30

BUILD = """
import torch
PART = 2 * 10**9
def part(i, n):
    g = torch.Generator(device="cuda").manual_seed(i)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g)
sizes = []
left = int({size} * 1e9)
while left > 0:
    sizes.append(min(PART, left)); left -= sizes[-1]
tensors = [part(i, n) for i, n in enumerate(sizes)]
torch.cuda.synchronize()
print(sum(t.numel() for t in tensors))
"""
BUSY = """
import os, time
while not os.path.exists({flag!r}):
    time.sleep(0.01)
print("done")
"""
CHECK = """
ok = all(torch.equal(t, part(i, t.numel())) for i, t in enumerate(tensors))
torch.cuda.empty_cache()
print(ok, torch.cuda.current_device())
"""


def floors(disk_dir: Path) -> dict:
    """What the machine can do, measured now: disk (dd, O_DIRECT), tmpfs with 16 threads, pinned copies."""
    out: dict = {}
    probe = disk_dir / "gpumigrate-floor.bin"
    try:
        for what, args in (("disk_write", ["if=/dev/zero", f"of={probe}", "oflag=direct"]),
                           ("disk_read", [f"if={probe}", "of=/dev/null", "iflag=direct"])):
            t0 = time.perf_counter()
            subprocess.run(["dd", *args, "bs=16M", "count=512", "status=none"], check=True)
            out[what] = 8 * GIB / (time.perf_counter() - t0) / GB
    finally:
        probe.unlink(missing_ok=True)
    out.update(tmpfs_floors(32 * GIB))
    out.update(pinned_floors(4 << 30))
    return {k: round(v, 2) for k, v in out.items()}


def tmpfs_floors(nbytes: int, threads: int = 16, rounds: int = 1) -> dict:
    """tmpfs (/dev/shm) written then read by ``threads`` threads with a file each, ``nbytes`` in all, GB/s;
    with ``rounds`` 2, a first round into memory this machine may never have touched (a fresh virtual
    machine's first touch of a page costs the host's allocation of it), then a second into the same memory
    (``tmpfs_write_first``, then ``tmpfs_write`` and ``tmpfs_read``)."""
    block = os.urandom(1 << 20) * 64
    per = max(len(block), nbytes // threads // len(block) * len(block))
    out: dict = {}

    def write(folder: Path, i: int) -> None:
        with open(folder / f"{i}", "wb", buffering=0) as f:
            for _ in range(per // len(block)):
                f.write(block)

    def read(folder: Path, i: int) -> None:
        buf = bytearray(len(block))
        with open(folder / f"{i}", "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    for round_ in range(rounds):
        folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="gpumigrate-floor-"))
        try:
            for what, fn in (("tmpfs_write", write), ("tmpfs_read", read)):
                if round_ < rounds - 1 and what == "tmpfs_read":
                    continue
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(fn, [folder] * threads, range(threads)))
                key = what if round_ == rounds - 1 else f"{what}_first"
                out[key] = threads * per / (time.perf_counter() - t0) / GB
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return out


def pinned_floors(nbytes: int) -> dict:
    """Pinned host <-> GPU 0 copies of ``nbytes``, GB/s (the second of two rounds); empty without a GPU."""
    code = (f"import torch,time\nn={nbytes}\nd=torch.empty(n,dtype=torch.uint8,device='cuda');h=torch.empty(n,"
            "dtype=torch.uint8,pin_memory=True)\nfor w in (0,1):\n t=time.perf_counter();h.copy_(d);"
            "torch.cuda.synchronize();a=time.perf_counter()-t\n t=time.perf_counter();d.copy_(h);"
            "torch.cuda.synchronize();b=time.perf_counter()-t\nprint(n/a/1e9,n/b/1e9)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return {}
    d2h, h2d = map(float, done.stdout.split())
    return {"pinned_d2h": d2h, "pinned_h2d": h2d}


def one_way(way: str, sizes: list[float], disk_dir: Path, rows: list[dict], rounds: int = 1) -> None:
    how, where = way.split("-")
    root = Path(tempfile.mkdtemp(prefix="gpumigrate-suspend-bench-", dir="/tmp"))
    state = Path(tempfile.mkdtemp(prefix="gpumigrate-state-", dir=disk_dir))
    config = {"MigratableProvisioner": {"state_dir": str(state), "suspend_to": where,
                                        "host_stash_min": None if how == "criu" else 10**9,
                                        "resume_prefetch": how != "files"}}
    if how == "busy":
        config["MigratableProvisioner"]["safe_point_timeout"] = 10.0
    server = Server(root, config)
    try:
        for size in sizes:
            kernel_id = server.api("POST", "api/kernels", {"name": "python3"})["id"]
            server.run(kernel_id, BUILD.format(size=size))
            server.run(kernel_id, "torch.cuda.empty_cache()")
            cell = None
            if how == "busy":  # a cell that runs until the flag exists, through its own websocket
                flag = root / f"go-{size}"
                cell = threading.Thread(target=server.run, args=(kernel_id, BUSY.format(flag=str(flag))))
                cell.start()
                while server.api("GET", f"api/kernels/{kernel_id}")["execution_state"] != "busy":
                    time.sleep(0.05)
                time.sleep(0.5)
            # the first into fresh memory, the next into memory used before; a busy cell is released after one
            for turn in range(1 if how == "busy" else rounds):
                suspended = server.operate(kernel_id, "suspend")
                if suspended.get("images") != where:
                    raise RuntimeError(f"{way}: the images went to {suspended.get('images')}, not {where}")
                resumed = server.operate(kernel_id, "resume")
                if cell is not None:
                    if not (suspended.get("stash") or {}).get("safe_point"):
                        raise RuntimeError(f"{way}: the stash was not served at the cell's safe point: {suspended['stash']}")
                    flag.touch()
                    cell.join(120)
                check = server.run(kernel_id, CHECK).split()
                if check[0] != "True":
                    raise RuntimeError(f"{way}, {size} GB: the tensors changed: {check}")
                row = {"way": way, "size_gb": size, "image_bytes": suspended["bytes"], "suspend": suspended,
                       "resume": resumed, "round": turn + 1}
                rows.append(row)
                print(json.dumps({"way": way, "size_gb": size, "image_bytes": suspended["bytes"],
                                  "suspend": suspended["timings"], "resume": resumed["timings"],
                                  "resume_stash": resumed.get("stash")}), flush=True)
            server.api("DELETE", f"api/kernels/{kernel_id}")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def table(rows: list[dict], floor: dict) -> str:
    head = ["way", "GB", "suspend s", "resume s", "suspend phases", "resume phases", "prefetch", "GB/s out",
            "GB/s back"]
    body = []
    for r in rows:
        s, m = r["suspend"], r["resume"]
        phases = lambda t: " ".join(f"{k} {v:.2f}" for k, v in t.items() if v >= 0.05)  # noqa: E731
        fetched = ((m.get("stash") or {}).get("prefetch") or {})
        secs = fetched.get("seconds") or {}
        prefetch = (f"{fetched['bytes'] / GB:.1f} GB: read {secs.get('read', 0):.2f}, waited {secs.get('waited', 0):.2f}"
                    if fetched.get("bytes") else (fetched.get("reason") or "-")[:40])
        body.append([r["way"], f"{r['size_gb']:g}", f"{s['total']:.2f}", f"{m['total']:.2f}", phases(s["timings"]),
                     phases(m["timings"]), prefetch, f"{r['size_gb'] / s['total']:.1f}",
                     f"{r['size_gb'] / m['total']:.1f}"])
    floors_line = ", ".join(f"{k} {v} GB/s" for k, v in floor.items())
    return text_table(head, body) + f"\nfloors (same run): {floors_line}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32", help="GB of tensors the kernel holds on GPU 0")
    parser.add_argument("--ways", default="stash-memory,stash-disk,criu-memory,criu-disk")
    parser.add_argument("--disk-dir", default=str(Path.home()), help="a folder on the local disk")
    parser.add_argument("--rounds", type=int, default=1, help="suspends and resumes of each way's kernel, one after "
                        "the other (the busy way: one)")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--tag", default="gpu")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    disk_dir = Path(args.disk_dir)
    floor = floors(disk_dir)
    print(json.dumps({"floors": floor}), flush=True)
    rows: list[dict] = []
    for way in args.ways.split(","):
        try:
            one_way(way, sizes, disk_dir, rows, args.rounds)
        except Exception as exc:  # noqa: BLE001  one way's failure is reported, the others still run
            print(f"{way}: FAILED: {exc}", flush=True)
            rows_failed = {"way": way, "error": str(exc)}
            print(json.dumps(rows_failed), flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "disk_dir": str(disk_dir), "gpus": _gpus(),
            "command": " ".join(["bench/suspend_bench.py", *sys.argv[1:]])}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{time.strftime('%Y-%m-%d')}-{args.tag}-suspend.json"
    path.write_text(json.dumps({"meta": meta, "floors": floor, "rows": rows}, indent=1))
    print(f"\n# {meta['date']}, {meta['gpus']}, {meta['cpus']} CPUs; images on /dev/shm or {disk_dir}")
    print(table(rows, floor))
    return 0


def _gpus() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True)
    return "; ".join(done.stdout.strip().splitlines()) or "no GPU"


if __name__ == "__main__":
    sys.exit(main())
