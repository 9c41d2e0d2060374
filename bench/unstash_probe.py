"""Where a resume's unstash time goes, and what could be faster: a probe on the GPU machine, no server.

A resume of a kernel that stashed 32 GB spends about 2 s reading its files back (docs/performance.md), on
top of CRIU's restore and the driver's remap (about 1 s). This measures, on one set of files in /dev/shm
(16 parts of 2 GB, the host stash's layout: kernel/hoststash.py's ``plan_chunks``), side by side:

- ``read_part`` as the kernel runs it (preadv into two pinned 32 MiB buffers per thread, XXH3 per chunk,
  copy to the GPU), with 16 and 32 threads (32 needs files cut for 32 parts: written again);
- the same without the checksum, and the bare tmpfs read (preadv into plain memory) with 16 and 32 threads;
- the files mapped and registered with the driver (``cuMemHostRegister``), XXH3 over the mapping, and
  copied straight from it to the GPU: the register's own time is reported apart;
- a copy of 32 GB within one GPU (what a helper that read the files during the restore would leave);
- the driver's start in a fresh process: ``cuInit`` and the primary context apart (the stash helper's 0.13 s).

Usage (on the GPU machine): python bench/unstash_probe.py [--gb 32] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpumigrate.kernel import hoststash  # noqa: E402

#: CU_MEMHOSTREGISTER_READ_ONLY: the mapping is PROT_READ
READ_ONLY = 0x08

DRIVER_START = r"""
import time, json
t0 = time.monotonic()
from cuda.bindings import driver
t1 = time.monotonic()
driver.cuInit(0)
t2 = time.monotonic()
err, dev = driver.cuDeviceGet(1 if driver.cuDeviceGetCount()[1] > 1 else 0)
err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
driver.cuCtxSetCurrent(ctx)
t3 = time.monotonic()
err, p = driver.cuMemAlloc(1 << 30)
t4 = time.monotonic()
print(json.dumps({"import": t1 - t0, "cuInit": t2 - t1, "context": t3 - t2, "alloc_1g": t4 - t3}))
"""


def write_files(folder: Path, chunks: list[hoststash.Chunk], parts: int, block: bytes, xxh: int) -> None:
    def work(part: int) -> None:
        fd = os.open(folder / hoststash.PART.format(part), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for c in chunks:
                if c.part == part:
                    os.pwrite(fd, block[:c.size], c.offset)
        finally:
            os.close(fd)
    for c in chunks:
        c.xxh3 = xxh if c.size == len(block) else hoststash.checksum(memoryview(block[:c.size]))
    hoststash.run_parts(work, parts)


def _address(m: mmap.mmap) -> int:
    """The address of a read-only mapping (ctypes' from_buffer wants a writable one; numpy does not)."""
    import numpy

    return int(numpy.frombuffer(m, dtype=numpy.uint8).ctypes.data)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return round(time.perf_counter() - started, 4)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=32)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import torch

    out: dict = {"cpus": os.cpu_count(), "gpu": torch.cuda.get_device_name(0)}
    starts = []
    for _ in range(3):
        line = subprocess.run([sys.executable, "-c", DRIVER_START], capture_output=True, text=True).stdout
        starts.append(json.loads(line.strip().splitlines()[-1]))
    out["driver_start"] = starts
    print(json.dumps({"driver_start": starts}), flush=True)

    nbytes = int(args.gb * 1e9) // hoststash.CHUNK * hoststash.CHUNK
    sizes = [nbytes // 16] * 16
    block = os.urandom(hoststash.CHUNK)
    xxh = hoststash.checksum(memoryview(block))
    gpu = [torch.empty(s, dtype=torch.uint8, device="cuda:0") for s in sizes]
    torch.cuda.synchronize()
    cuda = hoststash.Cuda()
    addresses = [t.data_ptr() for t in gpu]
    on_gpu = [True] * len(sizes)
    folder = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="unstash-probe-"))
    rows: dict[str, float] = {}
    try:
        for threads in (16, 32):
            for f in folder.iterdir():
                f.unlink()
            chunks = hoststash.plan_chunks(sizes, threads)
            parts = 1 + max(c.part for c in chunks)
            rows[f"write_files_{threads}"] = timed(lambda: write_files(folder, chunks, parts, block, xxh))
            for check in (True, False):
                def read(part: int, check: bool = check) -> None:
                    wrong = hoststash.read_part(folder / hoststash.PART.format(part), chunks, part, addresses,
                                                on_gpu, cuda, check)
                    assert wrong is None, wrong
                for rnd in (1, 2):
                    name = f"read_part_{threads}t_check{int(check)}_r{rnd}"
                    rows[name] = timed(lambda: hoststash.run_parts(read, parts))
                    torch.cuda.synchronize()
            head = torch.frombuffer(bytearray(block[:16]), dtype=torch.uint8)
            ok = all(torch.equal(t[:16].cpu(), head) for t in gpu)
            rows[f"values_ok_{threads}"] = float(ok)

            plain = [bytearray(hoststash.CHUNK) for _ in range(parts)]

            def bare(part: int) -> None:
                fd = os.open(folder / hoststash.PART.format(part), os.O_RDONLY)
                try:
                    view = memoryview(plain[part])
                    for c in chunks:
                        if c.part == part:
                            os.preadv(fd, [view[:c.size]], c.offset)
                finally:
                    os.close(fd)
            rows[f"bare_read_{threads}t"] = timed(lambda: hoststash.run_parts(bare, parts))

            lib = cuda.lib
            lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
            registers: list[float] = [0.0] * parts
            sums: list[float] = [0.0] * parts

            def mapped(part: int) -> None:
                path = folder / hoststash.PART.format(part)
                size = path.stat().st_size
                fd = os.open(path, os.O_RDONLY)
                try:
                    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                finally:
                    os.close(fd)
                base = _address(m)
                lane = cuda.lane()
                try:
                    t0 = time.perf_counter()
                    hoststash._check(lib.cuMemHostRegister_v2(ctypes.c_void_p(base), size, READ_ONLY), "register")
                    registers[part] = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    for c in chunks:
                        if c.part == part:
                            view = hoststash._view(base + c.offset, c.size)
                            assert hoststash.checksum(view) == c.xxh3
                            hoststash._check(lib.cuMemcpyHtoDAsync_v2(addresses[c.buffer] + c.at, base + c.offset,
                                                                      c.size, lane.stream), "copy")
                    sums[part] = time.perf_counter() - t1
                    lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
                    hoststash._check(lib.cuStreamSynchronize(lane.stream), "sync")
                    lib.cuMemHostUnregister(ctypes.c_void_p(base))
                finally:
                    lane.close()
                    try:
                        m.close()
                    except BufferError:  # numpy's view lives on until collected
                        pass
            try:
                rows[f"mapped_registered_{threads}t"] = timed(lambda: hoststash.run_parts(mapped, parts))
                rows[f"mapped_register_max_{threads}t"] = round(max(registers), 4)
                rows[f"mapped_checksum_copy_max_{threads}t"] = round(max(sums), 4)
            except Exception as exc:  # noqa: BLE001
                out[f"mapped_error_{threads}"] = repr(exc)
            torch.cuda.synchronize()
            print(json.dumps(rows), flush=True)

        other = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        at = 0
        for t in gpu:
            other[at:at + t.numel()].copy_(t)
            at += t.numel()
        torch.cuda.synchronize()
        rows["d2d_same_gpu"] = round(time.perf_counter() - t0, 4)
    finally:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    out["gb"] = nbytes / 1e9
    out["rows"] = rows
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
