"""Where a copy from the stash helper's memory goes: a probe on the GPU machine, no server.

A resume with the prefetch ends with the kernel copying its CUDA buffers from the helper's memory on the
same GPU: 32 GB took 0.30 s on an H200 (bench/results/2026-11-28-h200x1-*), where a copy of 32 GB within
one process took 0.02 s on an H100 (bench/unstash_probe.py). The idle move's peer stash opens a helper's
memory the same way. This times each step as the kernel takes them (kernel/stager.py's ``Driver``), the
helper being the real one (engine/stash.py's ``Helper``, ``alloc N``):

- ``open``: cuIpcOpenMemHandle of the helper's allocation (the whole of it, as the kernel does);
- ``copy``: cuMemcpyDtoDAsync of every byte into a tensor of this process, and a synchronize;
- ``close``: cuIpcCloseMemHandle;
- ``local``: the same copy between two tensors of this process (the floor);

for allocations of 1 GB and ``--gb`` GB, ``--rounds`` times each (a new helper each round).

Usage (on the GPU machine; torch, cuda-bindings and the repository): python bench/ipc_probe.py [--gb 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpumigrate.engine import gpus as gpus_mod  # noqa: E402
from jupyter_gpumigrate.engine.stash import Helper  # noqa: E402
from jupyter_gpumigrate.kernel.stager import Driver  # noqa: E402


def one(torch, driver: Driver, uuid: str, nbytes: int) -> dict[str, float]:
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    helper = Helper(uuid, nbytes)
    try:
        t0 = time.perf_counter()
        handle = helper.allocate(nbytes)
        t1 = time.perf_counter()
        pointer = driver.open(handle)
        t2 = time.perf_counter()
        stream = int(torch.cuda.current_stream().cuda_stream)
        driver.copy(dst.data_ptr(), pointer, nbytes, stream)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        driver.close(pointer)
        t4 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        t5 = time.perf_counter()
    finally:
        helper.stop()
    del dst, src
    torch.cuda.empty_cache()
    return {"helper_answer": round(t1 - t0, 4), "open": round(t2 - t1, 4), "copy": round(t3 - t2, 4),
            "close": round(t4 - t3, 4), "local": round(t5 - t4, 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=32.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    gpu = gpus_mod.snapshot()[0]
    torch.cuda.init()
    driver = Driver()
    rows: dict[str, list] = {}
    for gb in (1.0, args.gb):
        key = f"{gb:g}GB"
        rows[key] = [one(torch, driver, gpu.uuid, int(gb * 1e9)) for _ in range(args.rounds)]
        for r in rows[key]:
            print(key, json.dumps(r), flush=True)
    result = {"gpu": gpu.name, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
