"""What the driver's part of an idle move costs, and why a copy back after a move can be slow: a probe on a
machine with two GPUs, no server.

An idle move of 32 GB by the fast path spends 0.6-0.8 s in the driver's checkpoint and remap of what the
stash leaves (the CUDA context and small blocks; bench/results/*-move.*), and its copy back from the stash
took 0.057 s after a move 0 -> 1 but 0.015 s after 1 -> 0. This measures, side by side:

- the driver's lock, checkpoint, remap and unlock of a PyTorch process holding: a context alone (``bare``);
  one that ran a matmul and drew random numbers (``used``: cuBLAS's handle and workspace, curand's kernels);
  the same after 8 GB were allocated, freed and given back (``freed``); ``used`` with cuBLAS's workspaces
  cleared (``cleared``); each three round trips 0 -> 1 -> 0, with NVML's count of its memory before each;
- a copy of 8 GB out of another process's memory (a CUDA IPC handle, as the stash's helper holds it) into the
  kernel's own, before and after the move, on the GPU the process came from and the one it went to, by the
  copy engine (``cuMemcpyDtoDAsync``, as kernel/stager.py copies) and by a PyTorch kernel (``copy_``), and a
  copy of the process's own 8 GB (``clone``); and the same by a process started on GPU 1.

Usage (on the GPU machine): python bench/context_probe.py [--trips 3] [--gb 8] [--out-dir DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpumigrate.engine import gpus  # noqa: E402
from jupyter_gpumigrate.engine.cudackpt import CudaProcess, gpu_mapping  # noqa: E402
from jupyter_gpumigrate.engine.stash import Helper  # noqa: E402

CHILD = r"""
import json, sys, time, torch
from jupyter_gpumigrate.kernel.stager import Driver
variant, size = sys.argv[1], int(sys.argv[2])
torch.ones(1, device="cuda")
if variant != "bare":
    a = torch.randn(4096, 4096, device="cuda"); (a @ a).sum().item(); del a
if variant == "freed":
    b = torch.empty(8 << 30, dtype=torch.uint8, device="cuda"); b.fill_(1); del b
if variant == "cleared":
    torch._C._cuda_clearCublasWorkspaces()
torch.cuda.empty_cache(); torch.cuda.synchronize()
dst = torch.empty(size, dtype=torch.uint8, device="cuda") if variant == "ipc" else None
driver = Driver()

class Wrapped:
    def __init__(self, pointer):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (pointer, False), "version": 3}

def say(**what):
    print(json.dumps(what), flush=True)

say(ready=True)
for line in sys.stdin:
    verb, _, arg = line.strip().partition(" ")
    if verb == "ping":
        say(value=float((torch.ones(1, device="cuda") + 1).item()))
    elif verb == "copy":
        t0 = time.perf_counter(); base = driver.open(arg); t1 = time.perf_counter()
        stream = int(torch.cuda.current_stream().cuda_stream)
        driver.copy(dst.data_ptr(), base, size, stream); torch.cuda.synchronize(); t2 = time.perf_counter()
        try:
            dst.copy_(torch.as_tensor(Wrapped(base), device="cuda")); torch.cuda.synchronize()
            by_kernel = time.perf_counter() - t2
        except Exception as exc:
            by_kernel = repr(exc)
        driver.close(base)
        t4 = time.perf_counter(); own = dst.clone(); torch.cuda.synchronize(); t5 = time.perf_counter(); del own
        say(open=t1 - t0, engine=t2 - t1, kernel=by_kernel, own=t5 - t4)
    elif verb == "bye":
        break
"""


def held(pid: int) -> int:
    return sum(int(h["memory_used"]) for h in gpus.held_by([pid], gpus.snapshot()))


def move(pid: int, uuids: list[str], to: int, at: int) -> dict:
    process = CudaProcess(pid)
    said = {"held": held(pid)}
    t0 = time.perf_counter()
    process.lock(10)
    t1 = time.perf_counter()
    process.checkpoint()
    t2 = time.perf_counter()
    process.restore(gpu_mapping(uuids, {uuids[at]: uuids[to]}) if to != at else None)
    t3 = time.perf_counter()
    process.unlock()
    t4 = time.perf_counter()
    return {**said, "lock": t1 - t0, "checkpoint": t2 - t1, "remap": t3 - t2, "unlock": t4 - t3, "total": t4 - t0}


class Child:
    def __init__(self, variant: str, size: int, on: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if on is not None:
            env["CUDA_VISIBLE_DEVICES"] = on
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, variant, str(size)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert self.ask(None).get("ready")

    def ask(self, line: str | None) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def end(self) -> None:
        try:
            self.ask("bye")
        except (OSError, ValueError):
            pass
        self.proc.wait(30)


def contexts(uuids: list[str], trips: int) -> dict:
    out: dict = {}
    for variant in ("bare", "used", "cleared", "freed"):
        child = Child(variant, 0)
        rows, at = [], 0
        try:
            for _ in range(trips):
                for to in (1, 0):
                    row = move(child.proc.pid, uuids, to, at)
                    at = to
                    row["works"] = child.ask("ping").get("value") == 2.0
                    rows.append(row)
            rows.append({"same GPU": move(child.proc.pid, uuids, 0, 0)})
        finally:
            child.end()
        out[variant] = rows
        print(variant, json.dumps(rows), flush=True)
    return out


def copies(uuids: list[str], size: int) -> list[dict]:
    child, rows, at = Child("ipc", size), [], 0
    try:
        for to in (1, 0):
            helper = Helper(uuids[to], size)
            try:
                handle = helper.allocate(size)
                before = child.ask(f"copy {handle}")
                moved = move(child.proc.pid, uuids, to, at)
                at = to
                after = child.ask(f"copy {handle}")
            finally:
                helper.stop()
            row = {"move": f"GPU {1 - to} -> {to}", "GB": size / 1e9, "before (peer)": before, "after (local)": after,
                   "driver": moved}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        child.end()
    # the same copy by a process started on GPU 1, its home: is GPU 1 slower, or a process away from home?
    child = Child("ipc", size, on=uuids[1])
    helper = Helper(uuids[1], size)
    try:
        row = {"move": "none: started on GPU 1", "GB": size / 1e9, "local": child.ask(f"copy {helper.allocate(size)}")}
    finally:
        helper.stop()
        child.end()
    rows.append(row)
    print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=3)
    parser.add_argument("--gb", type=float, default=8)
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "/tmp"))
    parser.add_argument("--tag", default="gpu")
    parser.add_argument("--copies-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out_dir) / f"{time.strftime('%Y-%m-%d')}-{args.tag}-context-probe.json"
    found = gpus.snapshot()
    if len(found) < 2:
        sys.exit("context_probe: two GPUs are needed")
    uuids = [g.uuid for g in found]
    result = {"gpus": [g.name for g in found], "contexts": {} if args.copies_only else contexts(uuids, args.trips),
              "copies": copies(uuids, int(args.gb * 1e9) // (1 << 20) * (1 << 20))}
    out.write_text(json.dumps(result, indent=1))
    print(f"context_probe: written {out}")


if __name__ == "__main__":
    main()
