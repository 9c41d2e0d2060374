"""Probe: can the host stash of a suspend to memory beat tmpfs's write and read throughput?

Today's stash (kernel/hoststash.py) copies GPU -> a pinned buffer -> write() into a tmpfs file, and back:
two copies, the second through the page cache, at about tmpfs's own speed. This probe measures, in one
process on GPU 0, against the same ``--gib`` GiB of tensors and the same 16 threads:

  files    hoststash.stash / take_back themselves (the code as it is)
  dma      each thread maps its tmpfs file (MAP_SHARED), registers the mapping with CUDA (cudaHostRegister:
           the pages are pinned in place), and the GPU copies straight into it and back; a CRC-32 per chunk
           as the stash computes it. Registration, copy, checksum and unregistration timed apart.

Prints one JSON line per way and the machine's transparent-hugepage setting for shmem.

    python3 bench/host_dma_probe.py [--gib 16] [--threads 16] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

CHUNK = 32 << 20


def _thp() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    except OSError:
        return "?"


def files_way(torch, tensors, folder: Path, threads: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from jupyter_gpumigrate.kernel import hoststash

    keep = {"tensors": tensors, "In": []}  # noqa: F841  a namespace holds them, as a kernel's does
    t0 = time.perf_counter()
    out = json.loads(hoststash.stash(str(folder), min_total=1, threads=threads))
    t1 = time.perf_counter()
    back = json.loads(hoststash.take_back(str(folder), threads=threads))
    t2 = time.perf_counter()
    for p in folder.iterdir():
        p.unlink()
    return {"way": "files", "out_s": round(t1 - t0, 3), "back_s": round(t2 - t1, 3), "stash": out, "take_back": back}


def dma_way(torch, tensors, folder: Path, threads: int) -> dict:
    cudart = torch.cuda.cudart()
    flat = [t.view(-1).view(torch.uint8) for t in tensors]
    total = sum(f.numel() for f in flat)
    per = -(-total // threads)
    per = -(-per // CHUNK) * CHUNK
    # each thread takes the byte range [i * per, (i + 1) * per) of the concatenation
    spans: list[list[tuple[int, int, int]]] = [[] for _ in range(threads)]  # (tensor, start, size)
    pos = 0
    for k, f in enumerate(flat):
        n, at = f.numel(), 0
        while at < n:
            part = pos // per
            room = (part + 1) * per - pos
            take = min(room, n - at)
            spans[part].append((k, at, take))
            at, pos = at + take, pos + take
    times: dict[str, list[float]] = {k: [0.0] * threads for k in ("map", "register", "copy", "crc", "unregister")}
    back_times: dict[str, list[float]] = {k: [0.0] * threads for k in ("map", "register", "copy", "crc", "unregister")}
    crcs: list[list[int]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def one(i: int, back: bool) -> None:
        try:
            size = sum(s for _, _, s in spans[i])
            if not size:
                return
            record = back_times if back else times
            t = time.perf_counter()
            path = folder / f"dma-{i:02d}.bin"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if not back:
                os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.close(fd)
            host = torch.frombuffer(mm, dtype=torch.uint8)
            record["map"][i] = time.perf_counter() - t
            t = time.perf_counter()
            err = cudart.cudaHostRegister(host.data_ptr(), size, 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister: {err}")
            record["register"][i] = time.perf_counter() - t
            t = time.perf_counter()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                at = 0
                for k, start, n in spans[i]:
                    if back:
                        flat[k][start:start + n].copy_(host[at:at + n], non_blocking=True)
                    else:
                        host[at:at + n].copy_(flat[k][start:start + n], non_blocking=True)
                    at += n
            stream.synchronize()
            record["copy"][i] = time.perf_counter() - t
            t = time.perf_counter()
            view = memoryview(mm)
            sums = [zlib.crc32(view[o:o + CHUNK]) for o in range(0, size, CHUNK)]
            view.release()
            if back and sums != crcs[i]:
                raise RuntimeError(f"thread {i}: checksums differ")
            crcs[i] = sums
            record["crc"][i] = time.perf_counter() - t
            t = time.perf_counter()
            cudart.cudaHostUnregister(host.data_ptr())
            del host
            mm.close()
            record["unregister"][i] = time.perf_counter() - t
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{i}: {exc}")

    def run(back: bool) -> float:
        workers = [threading.Thread(target=one, args=(i, back)) for i in range(threads)]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - t

    digest = [zlib.crc32(f[:1 << 20].cpu().numpy().tobytes()) for f in flat]
    out_s = run(False)
    for f in flat:
        f.zero_()
    torch.cuda.synchronize()
    back_s = run(True)
    torch.cuda.synchronize()
    same = digest == [zlib.crc32(f[:1 << 20].cpu().numpy().tobytes()) for f in flat]
    for p in folder.iterdir():
        p.unlink()
    top = lambda d: {k: round(max(v), 3) for k, v in d.items()}  # noqa: E731  the slowest thread's
    return {"way": "dma", "out_s": round(out_s, 3), "back_s": round(back_s, 3), "same": same, "errors": errors,
            "out_slowest": top(times), "back_slowest": top(back_times)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    import torch

    n = int(args.gib * (1 << 30))
    tensors = [torch.randint(0, 255, (min(2 << 30, n - i),), dtype=torch.uint8, device="cuda")
               for i in range(0, n, 2 << 30)]
    torch.cuda.synchronize()
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="gpumigrate-probe-"))
    print(json.dumps({"gib": args.gib, "threads": args.threads, "thp_shmem": _thp(), "cpus": os.cpu_count(),
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)
    try:
        for way in (dma_way, files_way, dma_way):
            print(json.dumps(way(torch, tensors, folder, args.threads)), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
