"""Timings of GPU moves and GPU suspend/resume through the engine, on the GPU machine.

Each case starts a plain PyTorch process holding a given amount of live tensors (and, for one case,
freed-but-cached allocator blocks) on GPU 0, then runs the engine's real plans on it: a live move to
GPU 1 and back, or a suspend (CUDA checkpoint + CRIU dump) and a resume onto GPU 1. Phase timings come
from the plans themselves. The last thing printed is a short table; --out writes all as JSON.

    python3 bench/gpu_bench.py [--sizes 1,8,32] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jupyter_gpumigrate.engine import gpus as gpus_mod
from jupyter_gpumigrate.engine import proctree
from jupyter_gpumigrate.engine.criu import Criu
from jupyter_gpumigrate.engine.images import ImageStore
from jupyter_gpumigrate.engine.migration import RUNNING, Migration
from report import text_table

GB = 10**9

WORKER = r"""
import sys, time, torch
live, cached, empty = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
keep = torch.empty(int(live * 1e9), dtype=torch.uint8, device="cuda").random_()
if cached:
    gone = torch.empty(int(cached * 1e9), dtype=torch.uint8, device="cuda").random_()
    del gone                       # freed, but PyTorch's allocator keeps the blocks
if empty:
    torch.cuda.empty_cache()
torch.cuda.synchronize()
print("ready", int(keep[:1000].sum()), flush=True)
while True:
    time.sleep(0.05)
"""


class Worker:
    """A plain process as the engine's KernelProcess: what a provisioner does for a kernel, minus Jupyter."""

    def __init__(self, live: float, cached: float = 0.0, empty_cache: bool = False) -> None:
        self.kernel_id = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        self.state = RUNNING
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(live), str(cached), "1" if empty_cache else "0"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, start_new_session=True,
        )
        self.pid: int | None = self.proc.pid
        deadline = time.monotonic() + 300
        while "ready" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.1)

    kernel_name = "bench"
    kernel_connection_info: dict = {}

    @property
    def kernel_pid(self) -> int | None:
        return self.pid

    def release(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=30)
        self.proc, self.pid = None, None

    def adopt(self, pid: int) -> None:
        self.pid = pid

    def wait_ready(self, timeout: float) -> bool:
        return self.pid is not None and proctree.is_alive(self.pid)

    def stop(self) -> None:
        if self.pid is not None:
            proctree.kill_tree(self.pid)
            proctree.wait_gone(self.pid, 30)
        self.log.close()


def run_case(name: str, live: float, cached: float = 0.0, empty_cache: bool = False,
             suspend: bool = False, store: ImageStore | None = None, criu: Criu | None = None) -> list[dict]:
    worker = Worker(live, cached, empty_cache)
    rows = []
    try:
        held = gpus_mod.held_by([worker.pid], gpus_mod.snapshot())
        gpu_bytes = held[0]["memory_used"] if held else 0
        migration = Migration(worker, store or ImageStore(tempfile.mkdtemp()), criu)  # type: ignore[arg-type]
        if suspend:
            out = migration.suspend()
            rows.append(dict(case=name, step="suspend", live_gb=live, cached_gb=cached, gpu_bytes=gpu_bytes,
                             image_bytes=out.bytes, timings=out.result.timings, total=out.result.total))
            out = migration.resume(to_gpu=1)
            rows.append(dict(case=name, step="resume->1", live_gb=live, cached_gb=cached, gpu_bytes=gpu_bytes,
                             image_bytes=out.bytes, timings=out.result.timings, total=out.result.total))
        else:
            for dst in (1, 0):
                out = migration.move_to_gpu(dst)
                rows.append(dict(case=name, step=f"move->{dst}", live_gb=live, cached_gb=cached,
                                 gpu_bytes=out.bytes, timings=out.result.timings, total=out.result.total))
    finally:
        worker.stop()
    for row in rows:
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    phases = ["prepare", "lock", "checkpoint", "dump", "restore", "remap", "unlock", "verify", "adopt"]
    used = [p for p in phases if any(p in r["timings"] for r in rows)]
    head = ["case", "step", "GPU GB", *used, "total s"]
    body = [[r["case"], r["step"], f"{r['gpu_bytes'] / GB:.1f}",
             *[f"{r['timings'][p]:.2f}" if p in r["timings"] else "-" for p in used], f"{r['total']:.2f}"]
            for r in rows]
    return text_table(head, body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="live GB per move case")
    parser.add_argument("--suspend-gb", type=float, default=8.0, help="live GB for the suspend/resume case")
    parser.add_argument("--out", help="write every row as JSON here")
    args = parser.parse_args()
    gpus = gpus_mod.snapshot()
    if len(gpus) < 2:
        print("gpu_bench: needs two GPUs (NVML sees %d); nothing measured." % len(gpus))
        return 2
    rows: list[dict] = []
    for size in (float(s) for s in args.sizes.split(",")):
        rows += run_case(f"live {size:g} GB", size)
    # The caching allocator's freed blocks move too, unless released first (what prepare asks a kernel to do).
    rows += run_case("8 GB + 24 GB cached", 8, cached=24)
    rows += run_case("8 GB, cache emptied", 8, cached=24, empty_cache=True)
    with tempfile.TemporaryDirectory(prefix="gpumigrate-bench-") as tmp:
        rows += run_case(f"suspend {args.suspend_gb:g} GB", args.suspend_gb, suspend=True,
                         store=ImageStore(tmp), criu=Criu())
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "driver": gpus_mod.driver_version(),
        "gpus": [f"{g.index}: {g.name}, {g.memory_total / GB:.0f} GB" for g in gpus],
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    pair = ("8 GB + 24 GB cached", "8 GB, cache emptied")
    cached = {r["case"]: r["total"] for r in rows if r["step"] == "move->1" and r["case"] in pair}
    print()
    print(f"# {meta['date']}, driver {meta['driver']}, {'; '.join(meta['gpus'])}")
    print(table(rows))
    if len(cached) == 2:
        with_cache, emptied = cached[pair[0]], cached[pair[1]]
        print(f"cached blocks moved vs emptied first: {with_cache:.2f} s vs {emptied:.2f} s "
              f"({with_cache / emptied:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
