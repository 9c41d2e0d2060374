"""Probe: where the host stash's seconds go, by thread count, chunk size and checksum (one GPU).

kernel/hoststash.py's ``stash`` and ``take_back`` themselves, in one process, on ``--gib`` GiB of CUDA
tensors (16 of them), into a folder of ``--dir`` (/dev/shm: a move's or a suspend-to-memory's files) and
back; each tensor checked by its sum after each round trip. A first round, not reported, writes into fresh
memory once (the machine's first write into tmpfs pages is slower: 5.0 s against 2.2 s at 32 GB on an
H100 machine, bench/results/2026-11-26-gpu-move.md); then every combination of ``--threads``, ``--chunks``
(MiB) and checksum (with: a suspend's stash; without: a move's), ``--rounds`` times each, interleaved.

    python3 bench/hoststash_probe.py [--gib 32] [--threads 16,32] [--chunks 4,32] [--rounds 2] [--dir /dev/shm]

Prints one JSON line per round trip, then the median of each combination. Needs torch with CUDA and this
repository on sys.path (run from its root), nothing else.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=32)
    ap.add_argument("--threads", default="16,32")
    ap.add_argument("--chunks", default="4,32", help="MiB per chunk (each thread has two pinned buffers of it)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm")
    args = ap.parse_args()
    import torch

    from jupyter_gpumigrate.kernel import hoststash

    n = 16
    per = int(args.gib * (1 << 30) / n) // 8
    tensors = [torch.randint(-2**62, 2**62, (per,), dtype=torch.int64, device="cuda") for _ in range(n)]
    sums = [int(t.sum()) for t in tensors]
    torch.cuda.synchronize()

    def trip(threads: int, chunk_mib: int, check: bool) -> dict:
        # The chunk size is a module constant (the lanes' pinned buffers) and plan_chunks' default: both.
        hoststash.CHUNK = chunk_mib << 20
        hoststash.plan_chunks.__defaults__ = (hoststash.CHUNK,)
        folder = tempfile.mkdtemp(prefix="hoststash-probe-", dir=args.dir)
        try:
            # gpu_only computes no CRC-32 on tmpfs (a move); otherwise a suspend's, with them.
            out = json.loads(hoststash.stash(folder, gpu_only=not check, threads=threads))
            back = json.loads(hoststash.take_back(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if "stashed" not in out:
            raise SystemExit(f"the stash stepped aside: {out}")
        return {"threads": threads, "chunk_mib": chunk_mib, "crc": check, "ok": [int(t.sum()) for t in tensors] == sums,
                "write_s": out["split"]["write"], "read_s": back["split"]["read"], "gb": out["stashed"] / 1e9}

    trip(16, 32, True)  # fresh memory, once
    combos = list(itertools.product([int(x) for x in args.threads.split(",")], [int(x) for x in args.chunks.split(",")],
                                    (True, False)))
    rows = []
    for _ in range(args.rounds):
        for combo in combos:
            row = trip(*combo)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for threads, chunk, check in combos:
        mine = [r for r in rows if (r["threads"], r["chunk_mib"], r["crc"]) == (threads, chunk, check)]
        print(json.dumps({"median": True, "threads": threads, "chunk_mib": chunk, "crc": check,
                          "ok": all(r["ok"] for r in mine), "write_s": statistics.median(r["write_s"] for r in mine),
                          "read_s": statistics.median(r["read_s"] for r in mine), "when": time.strftime("%H:%M:%S")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
