"""Inside the kernel: the host stash of a suspend. Large buffers go to files, in parallel, before the dump.

(Its parallel writer and reader, :func:`plan_chunks`, :func:`write_part` and :func:`read_part`, also carry
a transplant's storages: kernel/transplant.py, with a table of its own instead of the index, unsynced.)

CRIU writes and reads a process's memory at about 2 GB/s whatever the medium, and the CUDA driver copies
a checkpoint out at about 1.5 GB/s (docs/internals.md): a kernel holding 32 GB took 33 s to suspend and
26 s to resume. So, before the driver and CRIU run, the kernel itself writes its large buffers into files
of the image folder with many threads (CUDA memory through pinned host buffers), and frees them; the
driver then checkpoints only the CUDA context and CRIU dumps only what is left. At resume, once the tree
is restored (and remapped), the buffers are allocated again and read back, each chunk checked against
its checksum (a suspend's). A buffer keeps its identity (``Storage.resize_`` to 0 and back; a ``bytearray`` resized
in place), so every tensor, view, parameter, gradient and optimizer state sharing it sees the same values.

What it takes: PyTorch storages (CUDA or CPU) that can be resized, and ``bytearray`` objects held by a
namespace, an object's attributes or a list (no view of them held), each of :data:`MIN_BYTES` or more. It steps aside, changing nothing, when a thread runs that could touch a buffer while
it is away (kernel/stager.py's ``threads`` says which run on, and the buffers those reach stay), when a CUDA graph is alive or a library that holds CUDA memory by
address is loaded (kernel/stager.py: the same rules as the fast path of a GPU move), and when there is
too little to gain (``min_total``).

The files, in the image folder:
    stash-NN.bin       one per writer thread; chunks of buffers, each at an offset
    stash-index.json   written last: the session, and per chunk its buffer, place and checksum
Each chunk's checksum is XXH3-64 (the ``xxhash`` library): zlib's CRC-32 ran at 2-4 GB/s a core and cost a
32 GB suspend 1.4 s of its write and 0.8 s of its read, with 16 threads (docs/internals.md).
A move between GPUs without peer access (``gpu_only``) into memory (tmpfs) computes no checksum: the process
that wrote its files reads them back (after the move, or once a restarted server asks), from memory, so a
checksum would check memory against memory, and it costs the move about a second at 32 GB
(docs/internals.md). A suspend's are computed and checked, as are a move's on disk: images that wait may
be copied, or moved to disk. Whether a stash is checked is the kernel's own record, not the index's.
A folder with parts but no index is a stash that did not finish: nothing was freed yet (buffers are
freed only once every part is written and synced), so the server removes it.

Everything runs in the kernel's main thread, called by the server through a silent request while the
kernel is idle, or at the safe point of a busy cell (kernel/safepoint.py), which waits there until the
buffers are back. The writer threads end before it returns.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import os
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from .stager import Live, StepAside, reach as _reach, threads as _threads, unsafe as _unsafe

FORMAT = 1
INDEX = "stash-index.json"
PART = "stash-{:02d}.bin"
#: Buffers smaller than this stay: CRIU and the driver carry them with the rest.
MIN_BYTES = 16 << 20
#: Each chunk is copied to or from the GPU as one piece; each thread has two pinned buffers of this size.
CHUNK = 32 << 20
#: Each chunk is written or read this much at a time, and hashed piece by piece while the piece is in the
#: CPU's cache (XXH3's streaming digest equals the one-shot one): hashing a whole 32 MiB chunk after its copy
#: read it from memory a second time, 0.45 s of a 32 GB resume's 2.0 s on 2 x H100 (bench/unstash_probe.py).
PIECE = 1 << 20
#: Writer and reader threads: one file each (tmpfs serialises writes to one file on its inode).
THREADS = 16
_TMPFS_MAGIC = "tmpfs"


class StashDamaged(Exception):
    """The stash files do not hold what was written: the buffers cannot be brought back whole."""


# -- the buffers -----------------------------------------------------------------------------------------


@dataclass
class Buffer:
    """One stashable buffer: a PyTorch storage (``cuda`` or ``cpu``) or a ``bytearray``."""

    kind: str
    obj: Any
    size: int
    #: freed, its bytes in the stash files (False: it stayed, whole, in memory)
    away: bool = False

    def address(self) -> int:
        if self.kind == "bytearray":
            return ctypes.addressof(ctypes.c_char.from_buffer(self.obj)) if self.size else 0
        return int(self.obj.data_ptr())

    def release(self) -> None:
        if self.kind == "bytearray":
            del self.obj[:]
        else:
            self.obj.resize_(0)

    def reallocate(self) -> None:
        if self.kind == "bytearray":
            _resize_bytearray(self.obj, self.size)
        else:
            self.obj.resize_(self.size)


def _resize_bytearray(obj: bytearray, size: int) -> None:
    resize = ctypes.pythonapi.PyByteArray_Resize
    resize.argtypes = [ctypes.py_object, ctypes.c_ssize_t]
    resize.restype = ctypes.c_int
    if resize(obj, size) != 0:
        raise MemoryError(f"cannot give a bytearray its {size} bytes back")


def collect(torch: Any, min_bytes: int = MIN_BYTES, gpu_only: bool = False, live: Live | None = None) -> list[Buffer]:
    """Every distinct buffer of ``min_bytes`` or more that can be freed and given back in place, largest
    first: resizable PyTorch storages of live tensors (CUDA or CPU), and bytearrays nobody holds a view of
    (``gpu_only``: CUDA storages alone); none that a thread which runs on reaches (kernel/stager.py's
    ``threads`` and ``reach``). ``live``: the tensors, if a pass over the objects found them already."""
    found: dict[tuple[str, int], Buffer] = {}
    spared = _reach(_threads()[1], torch)  # what a thread that runs on may touch stays
    # bytearrays hold no references, so the collector does not track them: look in what holds them.
    holders = [] if gpu_only else [o for o in gc.get_objects() if type(o) in (dict, list)]
    for obj in gc.get_referents(*holders):
        if type(obj) is bytearray and len(obj) >= min_bytes and ("bytearray", id(obj)) not in found \
                and ("bytearray", id(obj)) not in spared and _exports(obj) == 0:
            found[("bytearray", id(obj))] = Buffer("bytearray", obj, len(obj))
    del holders
    # is_pinned() would start CUDA in a kernel that never used it; without CUDA nothing is pinned.
    cuda_on = torch is not None and torch.cuda.is_initialized()
    #: (device, start, end) of storages that stay: one that overlaps a taken one would keep a freed address
    fixed: list[tuple[str, int, int]] = []
    for obj in (live or Live(torch)).tensors if torch is not None else ():
        try:
            if obj.layout != torch.strided or obj.device.type not in ("cuda", "cpu"):
                continue
            storage = obj.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
            if not pointer:
                continue
            if not storage.resizable():
                fixed.append((obj.device.type, pointer, pointer + size))  # IPC, DLPack, from_blob, numpy: stays
                continue
            if size < min_bytes or ("storage", pointer) in spared:
                continue
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # sparse, nested, wrapper subclasses: they stay
        device = obj.device.type
        if device == "cpu" and gpu_only:
            continue
        if device == "cpu" and cuda_on and obj.is_pinned():
            continue  # pinned host memory: freeing and taking it again costs more than CRIU's copy
        found.setdefault((device, pointer), Buffer(device, storage, size))
    taken = [(b.kind, b.address(), b.address() + b.size) for b in found.values() if b.kind != "bytearray"]
    for device, start, end in fixed:
        if any(kind == device and a < end and start < b for kind, a, b in taken):
            raise StepAside("a tensor shares memory with another without sharing its storage (DLPack, from_blob): "
                            "it would keep the old address")
    return sorted(found.values(), key=lambda b: b.size, reverse=True)


def _exports(obj: bytearray) -> int:
    """1 if a buffer view (memoryview, numpy, ctypes) holds ``obj`` now, so that it cannot be resized (or it
    cannot grow by a byte); else 0. Growing it by one byte asks exactly that: CPython checks for views
    before it resizes, whether or not the bytearray has room to grow into."""
    try:
        obj.append(0)
    except (BufferError, MemoryError):
        return 1
    del obj[-1]
    return 0


def why_not(torch: Any, live: Live | None = None) -> str | None:
    """Why the host stash must step aside in this process, or None. The fast path's rules (threads, CUDA
    graphs, libraries that hold CUDA memory by address), less its need for CUDA: CPU buffers go too."""
    return _unsafe(torch, live)


# -- the CUDA driver, for CUDA buffers -------------------------------------------------------------------


class Cuda:
    """The driver calls the stash needs, on the kernel's CUDA context: each worker thread gets a :class:`_Lane`."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        u64, size_t, vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(vp), size_t, ctypes.c_uint]
        lib.cuMemFreeHost.argtypes = [vp]
        lib.cuStreamCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cuStreamDestroy_v2.argtypes = [vp]
        lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cuEventDestroy_v2.argtypes = [vp]
        lib.cuEventRecord.argtypes = [vp, vp]
        lib.cuEventSynchronize.argtypes = [vp]
        lib.cuMemcpyDtoHAsync_v2.argtypes = [vp, u64, size_t, vp]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [u64, vp, size_t, vp]
        self.lib = lib
        context = vp()
        _check(lib.cuCtxGetCurrent(ctypes.byref(context)), "finding the CUDA context")
        if not context.value:
            raise OSError("no CUDA context is current in this thread (CUDA was not used here yet)")
        self.context = context

    def lane(self) -> _Lane:
        """In a worker thread: the kernel's context made current, and a lane of its own."""
        _check(self.lib.cuCtxSetCurrent(self.context), "making the CUDA context current")
        return _Lane(self.lib)


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(f"{what} failed (CUresult {result})")


class _Lane:
    """One worker's two pinned buffers, its stream and an event per buffer: while the thread checksums and
    writes (or reads) one buffer, the GPU copies into (or out of) the other."""

    def __init__(self, lib: Any) -> None:
        vp = ctypes.c_void_p
        self.lib = lib
        self.buffers: list[int] = []
        self.events: list[Any] = []
        self.stream = vp()
        try:
            _check(lib.cuStreamCreate(ctypes.byref(self.stream), 1), "creating a stream")
            for _ in range(2):
                host, event = vp(), vp()
                _check(lib.cuMemHostAlloc(ctypes.byref(host), CHUNK, 0), "allocating a pinned buffer")
                self.buffers.append(int(host.value))
                _check(lib.cuEventCreate(ctypes.byref(event), 2), "creating an event")  # no timing
                self.events.append(event)
        except OSError:
            self.close()
            raise

    def view(self, k: int, size: int) -> memoryview:
        return _view(self.buffers[k], size)

    def out(self, k: int, device: int, size: int) -> None:
        """Start copying ``size`` bytes at ``device`` into buffer ``k``."""
        _check(self.lib.cuMemcpyDtoHAsync_v2(self.buffers[k], device, size, self.stream), "a copy from the GPU")
        _check(self.lib.cuEventRecord(self.events[k], self.stream), "a copy from the GPU")

    def into(self, k: int, device: int, size: int) -> None:
        """Start copying buffer ``k`` to ``device``."""
        _check(self.lib.cuMemcpyHtoDAsync_v2(device, self.buffers[k], size, self.stream), "a copy to the GPU")
        _check(self.lib.cuEventRecord(self.events[k], self.stream), "a copy to the GPU")

    def wait(self, k: int) -> None:
        """Until the last copy into or out of buffer ``k`` is done."""
        _check(self.lib.cuEventSynchronize(self.events[k]), "waiting for a copy")

    def close(self) -> None:
        for event in self.events:
            self.lib.cuEventSynchronize(event)
            self.lib.cuEventDestroy_v2(event)
        for host in self.buffers:
            self.lib.cuMemFreeHost(ctypes.c_void_p(host))
        if self.stream.value:
            self.lib.cuStreamDestroy_v2(self.stream)


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


# -- the plan of the files -------------------------------------------------------------------------------


@dataclass
class Chunk:
    buffer: int
    at: int
    size: int
    part: int
    offset: int
    #: its XXH3-64 (:func:`checksum`); None: not computed (a move's stash in memory, see the module's docstring)
    xxh3: int | None = 0


def checksum(view: memoryview) -> int:
    """A chunk's checksum: XXH3-64 (it lets go of the GIL, so the writer threads compute theirs at once)."""
    return xxhash.xxh3_64_intdigest(view)


def plan_chunks(sizes: list[int], threads: int, chunk: int = CHUNK) -> list[Chunk]:
    """Cut each buffer into chunks and deal them round-robin over ``threads`` files (one per thread)."""
    chunks: list[Chunk] = []
    ends = [0] * max(1, threads)
    for i, size in enumerate(sizes):
        for at in range(0, size, chunk):
            part = len(chunks) % len(ends)
            n = min(chunk, size - at)
            chunks.append(Chunk(i, at, n, part, ends[part]))
            ends[part] += n
    return chunks


def _fs_type(folder: Path) -> str:
    """The type of the file system ``folder`` is on (from /proc/self/mounts; '' if unknown)."""
    best, kind = "", ""
    target = os.path.realpath(folder)
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) >= 3:
                    point = fields[1].replace("\\040", " ")
                    if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                        best, kind = point, fields[2]
    except OSError:
        pass
    return kind


# -- in the kernel's memory: what is away ---------------------------------------------------------------

#: The buffers now in files, in the order of the index, and the session that wrote them.
#: The buffers of the stash now in files, in the order of the index; its chunks, checksums included (what a
#: resume checks the files against: the kernel's own memory, which CRIU carries, not the index on disk);
#: and the session id written into the index; and whether the chunks carry checksums to check.
_away: list[Buffer] = []
_chunks: list[Chunk] = []
_session: str | None = None
_checked = True


def _io_all(fn: Any, fd: int, view: memoryview, offset: int) -> None:
    """pwrite/preadv until ``view`` is done (both may do less than asked)."""
    done = 0
    while done < len(view):
        n = fn(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(f"the stash file ended {len(view) - done} bytes short")
        done += n


def _pread(fd: int, view: memoryview, offset: int) -> int:
    return os.preadv(fd, [view], offset)


def _write_hashed(fd: int, view: memoryview, offset: int, check: bool) -> int | None:
    """Write ``view`` at ``offset`` a :data:`PIECE` at a time, hashing each piece just before it is written,
    while it is in the CPU's cache: the chunk's XXH3-64 (the same as :func:`checksum` of the whole), or None
    unless ``check``. One pass over memory instead of two (docs/internals.md, "The host stash")."""
    hasher = xxhash.xxh3_64() if check else None
    for start in range(0, len(view), PIECE):
        piece = view[start:start + PIECE]
        if hasher is not None:
            hasher.update(piece)
        _io_all(os.pwrite, fd, piece, offset + start)
    return hasher.intdigest() if hasher is not None else None


def _read_hashed(fd: int, view: memoryview, offset: int, check: bool) -> int | None:
    """Read ``view`` from ``offset`` a :data:`PIECE` at a time, hashing each piece as it arrives (in cache):
    its XXH3-64, or None unless ``check``."""
    hasher = xxhash.xxh3_64() if check else None
    for start in range(0, len(view), PIECE):
        piece = view[start:start + PIECE]
        _io_all(_pread, fd, piece, offset + start)
        if hasher is not None:
            hasher.update(piece)
    return hasher.intdigest() if hasher is not None else None


def write_part(fd: int, chunks: list[Chunk], part: int, addresses: list[int], on_gpu: list[bool],
               cuda: Cuda | None, durable: bool, check: bool = True) -> None:
    """Write the chunks of file ``part`` to ``fd``, each from its buffer (``addresses``; those ``on_gpu``
    through the two pinned buffers of a lane of ``cuda``), setting each chunk's checksum (None unless
    ``check``)."""
    mine = [c for c in chunks if c.part == part]
    gpu = [on_gpu[c.buffer] for c in mine]
    if cuda is None and any(gpu):
        raise ValueError("CUDA buffers to write, and no CUDA context given")
    lane = cuda.lane() if cuda is not None and any(gpu) else None
    try:
        def fetch(i: int) -> None:  # the GPU copies chunk i into buffer i % 2 meanwhile
            if i < len(mine) and gpu[i]:
                lane.out(i % 2, addresses[mine[i].buffer] + mine[i].at, mine[i].size)  # type: ignore[union-attr]

        fetch(0)
        for i, c in enumerate(mine):
            fetch(i + 1)  # its buffer's last chunk (i - 1) is written already
            if gpu[i]:
                lane.wait(i % 2)  # type: ignore[union-attr]
                view = lane.view(i % 2, c.size)  # type: ignore[union-attr]
            else:
                view = _view(addresses[c.buffer] + c.at, c.size)
            c.xxh3 = _write_hashed(fd, view, c.offset, check)
        if durable:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # written: leave the page cache to others
    finally:
        if lane is not None:
            lane.close()


class Follow:
    """How :func:`read_part` reads files that are still arriving (a move to another host: its receiving side's
    prefetch, engine/prefetch.py), one for all the parts of a stash: each chunk once its file holds it. While
    a file is too short, its size is looked at every :data:`FOLLOW_POLL` seconds at first, then less often
    (up to :data:`FOLLOW_POLL_MAX`) until it grows. It gives up where no part has grown for ``stall`` seconds
    (parts begin to arrive one after another: a part not there yet waits while the others grow), a file was
    removed or replaced (another copy is on its way, or none will come), ``gone()`` says why (the reader's
    caller is gone), or another part's reading failed (:meth:`give_up`)."""

    def __init__(self, stall: float = 30.0, gone: Callable[[], str | None] = lambda: None) -> None:
        self.stall = stall
        self.gone = gone
        #: when any part last grew or was read from (the monotonic clock)
        self.moved = time.monotonic()
        self._given_up: str | None = None

    def give_up(self, why: str) -> None:
        """End every part's reading (one failed: the others' bytes would be of no use)."""
        self._given_up = self._given_up or why

    def check(self, what: str) -> None:
        """OSError if the reading should end now; ``what``: how far this part got, for the stall's sentence."""
        if self._given_up:
            raise OSError(errno.ECANCELED, f"another part failed ({self._given_up})")
        if time.monotonic() - self.moved > self.stall:
            raise OSError(errno.ETIMEDOUT, f"nothing of the stash arrived for {self.stall:.0f} s ({what})")
        why = self.gone()
        if why:
            raise OSError(errno.ECANCELED, why)


#: How often a followed file's size is looked at while it is shorter than the next chunk needs: at first, and
#: at most (the wait doubles while it does not grow).
FOLLOW_POLL = 0.002
FOLLOW_POLL_MAX = 0.05


def _open_following(path: Path, follow: Follow) -> int:
    """Open ``path`` once it exists (it is created as its first bytes arrive)."""
    pause = FOLLOW_POLL
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            follow.check("this part has not begun to arrive")
        time.sleep(pause)
        pause = min(pause * 2, FOLLOW_POLL_MAX)


def _wait_until_holds(fd: int, path: Path, end: int, follow: Follow) -> None:
    """Return once the file open as ``fd`` holds ``end`` bytes (its writer appends in order: what is below its
    size is written); OSError where it is removed or replaced, or :meth:`Follow.check` says to end."""
    last, pause = -1, FOLLOW_POLL
    while True:
        st = os.fstat(fd)
        if st.st_size >= end:
            follow.moved = time.monotonic()
            return
        if st.st_size != last:
            last, pause = st.st_size, FOLLOW_POLL
            follow.moved = time.monotonic()
        try:
            there = os.stat(path, follow_symlinks=False)
            same = (there.st_ino, there.st_dev) == (st.st_ino, st.st_dev)
        except FileNotFoundError:
            same = False
        if not same:
            raise OSError(errno.ESTALE, f"it was removed or replaced while it arrived ({st.st_size} of {end} bytes "
                                        "read so far)")
        follow.check(f"this part at {st.st_size} of the {end} bytes its next chunk needs")
        time.sleep(pause)
        pause = min(pause * 2, FOLLOW_POLL_MAX)


def read_part(path: Path, chunks: list[Chunk], part: int, addresses: list[int], on_gpu: list[bool],
              cuda: Cuda | None, check: bool = True, follow: Follow | None = None) -> str | None:
    """Read the chunks of file ``part`` (at ``path``) into their buffers, checking each checksum (unless
    ``check`` is False: the caller's own record says none was computed); what is wrong with the file, or
    None. A chunk that does not match, or has no checksum to check, ends the reading of that file. With
    ``follow``, the file may still be arriving: each chunk is read once it is there (:class:`Follow`)."""
    mine = [c for c in chunks if c.part == part]
    if not mine:
        return None
    if cuda is None and any(on_gpu[c.buffer] for c in mine):
        raise ValueError("CUDA buffers to fill, and no CUDA context given")
    try:
        fd = _open_following(path, follow) if follow is not None else os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return _gave_up(follow, f"{path.name}: {exc.strerror or exc}")
    lane = None
    try:
        lane = cuda.lane() if cuda is not None and any(on_gpu[c.buffer] for c in mine) else None
        for i, c in enumerate(mine):
            target = addresses[c.buffer] + c.at
            gpu = on_gpu[c.buffer]
            if gpu:
                lane.wait(i % 2)  # type: ignore[union-attr]  # chunk i - 2's copy is done; i - 1's goes on
            view = lane.view(i % 2, c.size) if gpu else _view(target, c.size)  # type: ignore[union-attr]
            if check and c.xxh3 is None:
                return f"{path.name} at byte {c.offset}: its checksum is missing"
            try:
                if follow is not None:
                    _wait_until_holds(fd, path, c.offset + c.size, follow)
                found = _read_hashed(fd, view, c.offset, check)
            except OSError as exc:
                return _gave_up(follow, f"{path.name}: {exc.strerror if follow is not None and exc.strerror else exc}")
            if check and found != c.xxh3:
                return _gave_up(follow, f"{path.name} at byte {c.offset}: its checksum does not match")
            if gpu:
                lane.into(i % 2, target, c.size)  # type: ignore[union-attr]
    finally:
        os.close(fd)
        if lane is not None:
            lane.close()  # waits for the last copies
    return None


def _gave_up(follow: Follow | None, why: str) -> str:
    """``why`` a part's reading failed; the other parts' followed readings end too."""
    if follow is not None:
        follow.give_up(why)
    return why


def damage(found: list[str]) -> str:
    """What :func:`read_part` found wrong, in one sentence: the first three, and how many more."""
    return "; ".join(sorted(found)[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")


def run_parts(work: Any, parts: int) -> None:
    """Run ``work(part)`` for each part on its own thread; the first error is raised after all ended."""
    with ThreadPoolExecutor(max_workers=parts, thread_name_prefix="gpumigrate-hoststash") as pool:
        futures = [pool.submit(work, p) for p in range(parts)]
    for future in futures:
        future.result()


def stash(folder: str, min_total: int = 0, threads: int = THREADS, min_bytes: int = MIN_BYTES,
          safe_point: dict | None = None, gpu_only: bool = False) -> str:
    """Write the kernel's large buffers (``gpu_only``: its CUDA storages alone, for a move between GPUs
    without peer access, with no checksum where ``folder`` is in memory) into ``folder`` and free them. Returns JSON: ``{"stashed": bytes,
    "buffers": n, "seconds": s, "files": n}``, or ``{"aside": reason}`` when it steps aside (nothing
    changed). Raises OSError (a full disk, say) with nothing freed and the files it wrote removed. With
    ``safe_point`` (kernel/safepoint.py: the cell waits at it), the index says where."""
    global _session, _checked
    if _away:
        return json.dumps({"aside": "buffers of an earlier stash are still away"})
    torch = sys.modules.get("torch")
    started = time.perf_counter()
    try:
        live = Live(torch) if torch is not None else None  # one pass over the objects, for both
        reason = why_not(torch, live)
        if reason:
            return json.dumps({"aside": reason})
        buffers = collect(torch, min_bytes, gpu_only, live)
    except StepAside as exc:
        return json.dumps({"aside": str(exc)})
    except (TypeError, AttributeError, ValueError) as exc:  # an object the search cannot read: nothing changed
        return json.dumps({"aside": f"the kernel's search for its buffers failed ({type(exc).__name__}: {exc})"})
    del live
    found = time.perf_counter()
    total = sum(b.size for b in buffers)
    if not buffers or total < max(min_total, 1):
        return json.dumps({"aside": f"the kernel holds {total / 1e9:.1f} GB of large buffers: under "
                                    f"{max(min_total, min_bytes) / 1e9:.1f} GB CRIU and the driver alone are as fast"})
    cuda, device = None, None
    devices = {b.obj.device.index for b in buffers if b.kind == "cuda"}
    if len(devices) > 1:
        return json.dumps({"aside": "the kernel's tensors are on several GPUs"})
    if devices:
        device = devices.pop()
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # every kernel launched so far has finished with these buffers
            cuda = Cuda()  # the context of the buffers' GPU
    root = Path(folder)
    chunks = plan_chunks([b.size for b in buffers], threads)
    parts = 1 + max(c.part for c in chunks)
    durable = _fs_type(root) != _TMPFS_MAGIC
    addresses = [b.address() for b in buffers]
    # Opened here and kept open until the buffers are freed: a file removed meanwhile (a server that
    # thought the stash abandoned) is seen, and nothing is freed then.
    fds: list[int] = []
    try:
        for part in range(parts):
            fds.append(os.open(root / PART.format(part), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))

        on_gpu = [b.kind == "cuda" for b in buffers]
        copying = time.perf_counter()
        check = not gpu_only or durable  # a move's files in memory are read back from memory (the docstring)
        run_parts(lambda part: write_part(fds[part], chunks, part, addresses, on_gpu, cuda, durable, check), parts)
        written = time.perf_counter()
        session = secrets.token_hex(8)
        index = {"format": FORMAT, "session": session, "pid": os.getpid(),
                 "buffers": [{"kind": b.kind, "size": b.size} for b in buffers],
                 "chunks": [c.__dict__ for c in chunks], "parts": parts}
        if safe_point:  # where the cell waits for its buffers (kernel/safepoint.py): {"folder", "pid", "id"}
            index["safe_point"] = safe_point
        _write_index(root, index, durable)
        if any(os.fstat(fd).st_nlink == 0 for fd in fds) or not (root / INDEX).exists():
            raise OSError(f"the stash files in {root} were removed while they were written: nothing was freed")
        # Every byte is in the files: only now are the buffers freed, with what is away recorded first, and
        # no interrupt (SIGINT) between one buffer freed and the next.
        _away[:] = buffers
        _chunks[:] = chunks
        _session, _checked = session, check
        with no_interrupt():
            for b in buffers:
                try:
                    b.release()
                except BufferError:  # a view was made meanwhile: it stays, whole
                    continue
                b.away = True
        if not any(b.away for b in buffers):  # every one got a view meanwhile: nothing is away
            _away.clear()
            _chunks.clear()
            _session = None
        if cuda is not None:
            with torch.cuda.device(device):
                torch.cuda.empty_cache()  # give the freed blocks back, or the driver would checkpoint them anyway
                torch.cuda.synchronize(device)
    except BaseException:
        if not _away:  # nothing was freed: the parts written so far are of no use, and take the room (a full
            for part in range(len(fds)):  # disk) that the answer needs
                (root / PART.format(part)).unlink(missing_ok=True)
            (root / INDEX).unlink(missing_ok=True)
        raise
    finally:
        for fd in fds:
            os.close(fd)
    done = time.perf_counter()
    moved = sum(b.size for b in buffers if b.away)
    return json.dumps({"stashed": moved, "buffers": sum(b.away for b in buffers), "files": parts,
                       "seconds": round(done - started, 4),
                       "split": {"find": round(found - started, 4), "write": round(written - copying, 4),
                                 "free": round(done - written, 4)}})


class no_interrupt:
    """SIGINT held back (delivered after) in this thread, so that an interrupt cannot stop a loop halfway."""

    def __enter__(self) -> None:
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def __exit__(self, *exc: object) -> None:
        if self.main:
            signal.pthread_sigmask(signal.SIG_SETMASK, self.old)


def _write_index(root: Path, index: dict, durable: bool) -> None:
    tmp = root / f".{INDEX}.tmp"
    with open(tmp, "w", encoding="utf-8", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW, 0o600)) as out:
        json.dump(index, out)
        out.flush()
        if durable:
            os.fsync(out.fileno())
    os.replace(tmp, root / INDEX)


def read_index(folder: str | os.PathLike[str]) -> dict:
    """The stash index of ``folder``, checked for shape; StashDamaged if it is not one."""
    path = Path(folder) / INDEX
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise StashDamaged(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise StashDamaged(f"{path} is damaged ({exc})") from exc
    return index_of(raw, str(path))


def index_of(raw: Any, where: str) -> dict:
    """A stash index as its file holds it (parsed JSON), checked for shape, its chunks as :class:`Chunk`
    (a copy: ``raw`` is left as it is); StashDamaged, naming ``where``, if it is not one."""
    try:
        index = dict(raw)
        if index.get("format") != FORMAT:
            raise ValueError(f"format {index.get('format')!r}, not {FORMAT}")
        sizes = [int(b["size"]) for b in index["buffers"]]
        chunks = [Chunk(**c) for c in index["chunks"]]
        wrong = out_of_bounds(chunks, sizes, int(index.get("parts", 0)))
    except (ValueError, KeyError, TypeError) as exc:
        raise StashDamaged(f"{where} is damaged ({exc})") from exc
    if wrong is not None:
        raise StashDamaged(f"{where} is damaged (a chunk out of bounds: {wrong})")
    index["chunks"] = chunks
    return index


def out_of_bounds(chunks: list[Chunk], sizes: list[int], parts: int) -> Chunk | None:
    """The first chunk that does not lie within its buffer (of ``sizes``) and its files (``parts``), or None:
    a table read from a file is checked so before any byte is copied where it says."""
    for c in chunks:
        if not (0 <= c.buffer < len(sizes) and 0 <= c.at and c.size > 0 and c.at + c.size <= sizes[c.buffer]
                and 0 <= c.part < parts and c.offset >= 0):
            return c
    return None


def take_back(folder: str, threads: int = THREADS, gpu: dict | None = None) -> str:
    """Bring every buffer back from the stash in ``folder``, checking each chunk against the checksum (if any) this
    kernel kept in its own memory. Returns JSON: ``{"unstashed": bytes, "seconds": s}``. Raises
    :class:`StashDamaged` (the index not this stash's, a file missing, short or not matching): the buffers
    that could not be filled are left as they are, and the server kills this process and keeps the images.

    ``gpu``: a prefetch (engine/prefetch.py) holds the CUDA buffers on this kernel's GPU already, read from
    these files and checked against the index's checksums: ``handle`` (CUDA IPC), ``bases`` (each buffer's
    offset there), ``size``, ``session``. If the index's table is this kernel's own (checksums included), they
    are copied from there; otherwise, or if that fails, they are read from the files (``from_gpu`` is then 0
    and ``prefetch_refused`` says why)."""
    global _session
    started = time.perf_counter()
    if not _away:
        return json.dumps({"unstashed": 0, "seconds": 0.0})
    index = read_index(folder)  # only to be sure it is this stash: the chunks and their CRCs are ours
    if index.get("session") != _session:
        raise StashDamaged(f"the stash in {folder} is not the one this kernel wrote")
    root = Path(folder)
    buffers = list(_away)
    chunks = [c for c in _chunks if buffers[c.buffer].away]
    parts = 1 + max((c.part for c in _chunks), default=0)
    torch = sys.modules.get("torch")
    with no_interrupt():
        for b in buffers:
            if b.away:
                b.reallocate()
    allocated = time.perf_counter()
    cuda, device = None, None
    devices = {b.obj.device.index for b in buffers if b.kind == "cuda" and b.away}
    if devices and torch is not None:
        device = devices.pop()
        with torch.cuda.device(device):
            cuda = Cuda()
    addresses = [b.address() for b in buffers]
    lock = threading.Lock()
    damaged: list[str] = []

    on_gpu = [b.kind == "cuda" for b in buffers]
    from_gpu, refused = 0, None
    opened = _claim_opening(OPEN_WAIT)  # the prefetch's memory, mapped while the helper read (if it was)
    late = None  # why a mapping begun ahead was of no use
    try:
        if gpu and cuda is not None:
            ahead = None
            if opened is not None and opened.handle == gpu.get("handle") and opened.device == device:
                ahead, opened.pointer = opened.pointer, None  # _copy_prefetched closes it
                if opened.error:
                    late = f"the kernel's mapping of it failed ({opened.error})"
            elif opened is not None:
                late = "the kernel had mapped other memory"
            try:
                from_gpu = _copy_prefetched(gpu, index, buffers, addresses, torch, device, ahead)
            except (RuntimeError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                refused = f"{type(exc).__name__}: {exc}"
    finally:
        _close_opening(opened)  # one not used
    if from_gpu:
        chunks = [c for c in chunks if not on_gpu[c.buffer]]  # the rest, in host memory, from the files
    copied = time.perf_counter()

    def read(part: int) -> None:
        wrong = read_part(root / PART.format(part), chunks, part, addresses, on_gpu, cuda, _checked)
        if wrong:
            with lock:
                damaged.append(wrong)

    run_parts(read, parts)
    if damaged:
        raise StashDamaged(damage(damaged))
    if cuda is not None and torch is not None:
        torch.cuda.synchronize(device)
    total = sum(b.size for b in buffers if b.away)
    for b in buffers:
        b.away = False
    _away.clear()
    _chunks.clear()
    _session = None
    done = time.perf_counter()
    said = {"unstashed": total, "seconds": round(done - started, 4),
            "split": {"allocate": round(allocated - started, 4), "read": round(done - copied, 4)}}
    if gpu:
        said["from_gpu"] = from_gpu
        said["split"]["from_gpu"] = round(copied - allocated, 4)
        if refused:
            said["prefetch_refused"] = refused
        if late:
            said["mapped_late"] = late
    return json.dumps(said)


@dataclass
class _Opening:
    """A prefetch's memory being mapped into this kernel ahead of :func:`take_back` (:func:`open_prefetch`)."""

    handle: str
    device: int
    thread: threading.Thread
    pointer: int | None = None
    error: str | None = None
    #: take_back did not wait for it: the thread closes what it opened
    abandoned: bool = False


_opening: _Opening | None = None
_opening_lock = threading.Lock()
#: How long take_back waits for a mapping begun by open_prefetch (0.2 s for 32 GB on an H200).
OPEN_WAIT = 30.0


def open_prefetch(handle: str, session: str) -> str:
    """Begin mapping a prefetch's memory (engine/prefetch.py; its CUDA IPC ``handle``) into this kernel, in a
    thread, while the stash helper still reads the files: the driver took 0.17-0.20 s to open 32 GB on an
    H200 (bench/ipc_probe.py), which :func:`take_back` then need not wait for. Returns at once, JSON:
    ``{"opening": true}`` or ``{"opening": false, "reason": ...}`` (nothing begun). Nothing else changes:
    take_back uses the mapping if it is given the same handle, and closes it whatever happens."""
    global _opening
    torch = sys.modules.get("torch")
    if session != _session or not _away:
        return json.dumps({"opening": False, "reason": "it is not this kernel's stash"})
    devices = {b.obj.device.index for b in _away if b.kind == "cuda" and b.away}
    if torch is None or len(devices) != 1:
        return json.dumps({"opening": False, "reason": "its CUDA buffers are not on one GPU"})
    _close_opening(_claim_opening(0.0))  # one begun before (a resume asked again): closed
    from .stager import Driver

    device = devices.pop()
    opening = _Opening(handle, device, threading.Thread(target=lambda: None))
    try:
        with torch.cuda.device(device):
            context = Driver().current()  # the thread makes it its own: a new thread has no current context
    except Exception as exc:  # noqa: BLE001 - nothing begun: take_back opens it itself
        return json.dumps({"opening": False, "reason": f"its CUDA context cannot be read ({exc})"})
    if not context:
        return json.dumps({"opening": False, "reason": "it has no CUDA context"})

    def work() -> None:
        try:
            driver = Driver()
            driver.use(context)
            pointer = driver.open(handle)
        except Exception as exc:  # noqa: BLE001 - take_back opens it itself, or reads the files
            opening.error = f"{type(exc).__name__}: {exc}"
            return
        with _opening_lock:
            opening.pointer = pointer
            late = opening.abandoned
        if late:
            _close_opening(opening)

    opening.thread = threading.Thread(target=work, daemon=True, name="gpumigrate-open-prefetch")
    _opening = opening
    opening.thread.start()
    return json.dumps({"opening": True})


def _claim_opening(wait: float) -> _Opening | None:
    """The mapping open_prefetch began, once its thread is done (None if none was begun, or if it is not done
    within ``wait`` seconds: its thread then closes it)."""
    global _opening
    opening, _opening = _opening, None
    if opening is None:
        return None
    opening.thread.join(wait)
    with _opening_lock:
        if opening.thread.is_alive() and opening.pointer is None:
            opening.abandoned = True
            return None
    return opening


def _close_opening(opening: _Opening | None) -> None:
    if opening is None or opening.pointer is None:
        return
    from .stager import Driver

    pointer, opening.pointer = opening.pointer, None
    torch = sys.modules["torch"]
    try:
        with torch.cuda.device(opening.device):
            Driver().close(pointer)
    except Exception:  # noqa: BLE001 - the process's end unmaps it in any case
        pass


def _copy_prefetched(gpu: dict, index: dict, buffers: list[Buffer], addresses: list[int], torch: Any,
                     device: int | None, opened: int | None = None) -> int:
    """Copy this kernel's CUDA buffers that are away from a prefetch's memory on its GPU (:func:`take_back`);
    the bytes copied. Raises ValueError where the prefetch cannot be trusted to hold what this kernel wrote:
    a stash without checksums, another session, an index whose table (checksums included) is not this
    kernel's own, an offset out of the prefetch's bounds. ``opened``: that memory, mapped already
    (:func:`open_prefetch`); closed here whatever happens, as is a mapping made here."""
    from .stager import Driver

    pointer = opened
    try:
        if not _checked:
            raise ValueError("this stash carries no checksums")
        if gpu.get("session") != _session or index.get("session") != _session:
            raise ValueError("the prefetch read another stash")

        def row(c: Chunk) -> tuple:
            return c.buffer, c.at, c.size, c.part, c.offset, c.xxh3

        ours = [row(c) for c in _chunks if buffers[c.buffer].kind == "cuda"]
        theirs = [row(c) for c in index["chunks"] if c.buffer < len(buffers) and buffers[c.buffer].kind == "cuda"]
        listed = [(b.get("kind"), int(b.get("size", -1))) for b in index["buffers"]]
        if ours != theirs or listed != [(b.kind, b.size) for b in buffers]:
            raise ValueError("the stash's index on disk is not this kernel's own table")
        bases, size = list(gpu["bases"]), int(gpu["size"])
        wanted = [(i, int(bases[i])) for i, b in enumerate(buffers) if b.kind == "cuda" and b.away]
        if any(base < 0 or base + buffers[i].size > size for i, base in wanted):
            raise ValueError("the prefetch's memory does not hold every buffer")
        driver = Driver()  # no CUDA call before here: a refusal above changes nothing
        with torch.cuda.device(device):
            if pointer is None:
                pointer = driver.open(str(gpu["handle"]))
            try:
                stream = int(torch.cuda.current_stream(device).cuda_stream)
                for i, base in wanted:
                    driver.copy(addresses[i], pointer + base, buffers[i].size, stream)
            finally:
                torch.cuda.synchronize(device)  # no copy queued reads the mapping once it is closed
        return sum(buffers[i].size for i, _ in wanted)
    finally:
        if pointer is not None:
            with torch.cuda.device(device):
                Driver().close(pointer)  # no mapping of another process's memory is kept


def away() -> int:
    """Bytes of this kernel's buffers that are in a stash now (0: none)."""
    return sum(b.size for b in _away if b.away)
