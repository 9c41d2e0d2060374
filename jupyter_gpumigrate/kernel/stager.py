"""Inside the kernel: the kernel's side of the fast path of a GPU move (engine/stash.py tells the story).

:func:`run` is called in the kernel's main thread, by a silent request of the server while the kernel
is idle, at the safe point of a busy cell (kernel/safepoint.py: the cell waits until the move is over),
or by ``%migrate`` in its own cell: never beside user code. It connects to the server's
socket, offers the kernel's large PyTorch storages, copies those the server takes into the stash on
the target GPU and frees them, and later copies them back. A storage keeps its identity (its size goes
to 0 and back, ``Storage.resize_``), so every tensor, view, parameter, gradient and optimizer state
that shares it sees the same values after the move; only the address changes.

It steps aside, changing nothing (the driver then moves everything), when:
- torch is not imported, or has not initialised CUDA;
- a CUDA graph is alive (``torch.cuda.CUDAGraph``, also under ``torch.compile(mode="reduce-overhead")``):
  graphs replay fixed addresses;
- a CUDA library that holds memory by address outside torch is loaded (cupy, jax, numba.cuda,
  tensorflow, pycuda): it may share a storage through DLPack;
- a thread runs that could touch a tensor while its storage is away (:func:`threads` says which run on:
  Jupyter's, progress bars, TensorBoard's writers; a DataLoader's pin-memory thread, a multiprocessing
  queue's feeder and a logging QueueListener, whose tensors at hand stay);
- the GPUs have no peer access between them (opening the stash fails before anything is copied).
A storage that cannot be resized (memory shared by CUDA IPC, ``from_blob``) or is smaller than
:data:`MIN_BYTES` simply stays and goes with the driver.

The CUDA driver library through ctypes, by necessity: torch has no public call to open another
process's CUDA IPC handle, nor to copy between raw device addresses without making a context on the
other GPU, and a kernel's environment need not have cuda-python.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import socket
import sys
import threading
import time
import types
from typing import Any

#: Storages smaller than this stay where they are (the driver moves them with the context).
MIN_BYTES = 1 << 20
#: Modules that hold CUDA memory by address, outside torch's sight.
FOREIGN_CUDA = ("cupy", "jax", "numba.cuda", "tensorflow", "pycuda")
#: Threads whose code comes from these modules touch no tensor: Jupyter's own, progress bars, TensorBoard's
#: event writers (they get protocol buffers, made in the main thread).
#: By the module of the thread's class, or of its target: an event loop's thread (asyncio, tornado, anyio)
#: runs whatever is scheduled on it, so it is not quiet, whoever started it.
QUIET_THREADS = ("ipykernel", "IPython", "zmq", "jupyter_client", "jupyter_core", "comm", "ipywidgets", "debugpy",
                 "traitlets", "tqdm", "jupyter_gpumigrate", "tensorboard", "tensorboardX", "torch.utils.tensorboard")
#: ... except these, which run the notebook's code: ipykernel's subshells run cells.
BUSY_THREADS = ("ipykernel.subshell",)
#: Threads whose code comes from these modules touch only what they are handed: a DataLoader's batch to pin,
#: an object a multiprocessing queue sends, a log record a QueueListener writes. They run on; what their
#: frames reach (:func:`reach`) stays where it is.
HANDED_THREADS = ("torch.utils.data._utils.pin_memory", "multiprocessing.queues", "logging.handlers")
#: A notebook marks a thread of its own with this attribute: ``"quiet"`` (it touches no tensor) or
#: ``"handed"`` (it touches only what its frames reach, which then stays where it is).
MARK = "gpumigrate"
#: How many objects :func:`reach` looks at before it gives up (the buffers then stay: it steps aside).
REACH_LIMIT = 200_000
#: Jupyter's own objects, which :func:`reach` does not go through: they hand a thread no tensor, yet lead
#: to every one (a thread keeps ``sys.stderr`` as it was when it started, in a kernel ipykernel's stream,
#: whose session leads to the kernel, its shell and the notebook's namespace).
JUPYTER = ("ipykernel", "IPython", "zmq", "jupyter_client", "jupyter_core", "comm", "ipywidgets", "debugpy",
           "traitlets", "jupyter_gpumigrate")
#: How often :func:`reach` reads a container again that a running thread changed under it.
REREAD = 5
_LAZY_ENABLE_PEER_ACCESS = 1


class StepAside(Exception):
    """The fast path (or the host stash of a suspend) does not apply; nothing was changed."""


def _thread_module(thread: threading.Thread) -> str:
    if type(thread) is not threading.Thread:
        return type(thread).__module__
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) or "?"


def _from(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def threads() -> tuple[str | None, list[threading.Thread]]:
    """The rule for the other threads of this process while buffers are away: (why they may not be taken
    away, or None; the threads whose reach must stay). Jupyter's threads and the others of
    :data:`QUIET_THREADS` touch no tensor; those of :data:`HANDED_THREADS` only what they are handed; a
    pool worker waiting for work runs nothing; a thread the notebook marked (``thread.gpumigrate = "quiet"``
    or ``"handed"``) is taken at its word. Any other thread that runs (a user's, a library's we do not
    know) could touch any tensor: the fast path and the host stash step aside, naming it."""
    me, handed = threading.current_thread(), []
    for thread in threading.enumerate():
        if thread is me or thread is threading.main_thread() or not thread.is_alive():
            continue
        declared = getattr(thread, MARK, None)  # the notebook's own word for its thread
        if declared == "quiet":
            continue
        if declared == "handed":
            handed.append(thread)
            continue
        module = _thread_module(thread)
        if (_from(module, QUIET_THREADS) and not _from(module, BUSY_THREADS)) or _parked(thread):
            continue
        if _from(module, HANDED_THREADS):
            handed.append(thread)
            continue
        return (f"thread {thread.name!r} ({module}) is running and could touch a tensor (if it touches none, or "
                f"only what its own variables hold, say so: thread.{MARK} = 'quiet' or 'handed')"), []
    return None, handed


def reach(handed: list[threading.Thread], torch: Any, limit: int = REACH_LIMIT) -> set[tuple[str, int]]:
    """``("storage", data_ptr)`` of every storage of a tensor, and ``("bytearray", id)`` of every bytearray,
    that the frames of ``handed`` threads reach through their
    local variables, containers and objects' attributes (not through functions, modules or classes: what
    these threads run touches only what it was handed; nor through Jupyter's objects, :data:`JUPYTER`).
    Raises :class:`StepAside` past ``limit`` objects, or if a container keeps changing as it is read."""
    frames = sys._current_frames()
    todo: list[Any] = []
    for thread in handed:
        frame = frames.get(thread.ident or -1)
        while frame is not None:
            todo.extend(frame.f_locals.values())
            frame = frame.f_back
    seen: set[int] = set()
    found: set[tuple[str, int]] = set()
    containers = (dict, list, tuple, set, frozenset, collections.deque)
    skip = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType, types.FrameType)
    tensor = torch.Tensor if torch is not None else ()
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, skip) or isinstance(obj, (str, bytes, int, float, memoryview)):
            continue
        seen.add(id(obj))
        if len(seen) > limit:
            names = ", ".join(repr(t.name) for t in handed)
            raise StepAside(f"thread {names} reaches more than {limit} objects: what it may touch cannot be told")
        if isinstance(obj, bytearray):
            found.add(("bytearray", id(obj)))
            continue
        if tensor and isinstance(obj, tensor):
            try:
                found.add(("storage", obj.untyped_storage().data_ptr()))
            except (RuntimeError, NotImplementedError, TypeError):
                pass
            continue
        if isinstance(obj, dict):
            todo.extend(_read(obj.values, handed))
        elif isinstance(obj, containers):
            todo.extend(_read(obj.__iter__, handed))
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif not _from(_module_of(obj), JUPYTER):
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                todo.extend(_read(attributes.values, handed))
    return found


def _module_of(obj: Any) -> str:
    module = getattr(type(obj), "__module__", None)  # a class body may set it to anything
    return module if isinstance(module, str) else ""


def _read(items: Any, handed: list[threading.Thread]) -> list[Any]:
    """``list(items())``, read again if a thread that runs on changed the container meanwhile (a queue's
    buffer that its feeder thread empties)."""
    for _ in range(REREAD):
        try:
            return list(items())
        except RuntimeError:  # "deque mutated during iteration", "dictionary changed size during iteration"
            continue
    names = ", ".join(repr(t.name) for t in handed)
    raise StepAside(f"what thread {names} holds keeps changing: what it may touch cannot be told")


class Live:
    """What one pass over the collector's objects found: the live tensors, and whether a CUDA graph is
    alive. One pass, each type asked once (a kernel holds some 200,000 objects: :func:`why_not` and
    :func:`large_storages` looking for themselves took twice as long)."""

    def __init__(self, torch: Any) -> None:
        tensor = torch.Tensor
        graph = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
        #: by id(): a metaclass may define __eq__ and no __hash__ (the types live as long as the objects' list)
        kinds: dict[int, int] = {}
        self.tensors: list[Any] = []
        self.graph = False
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance asks odd objects for __class__, and some modules warn then.
            kind = type(obj)
            found = kinds.get(id(kind))
            if found is None:
                found = kinds[id(kind)] = _kind(kind, tensor, graph)
            if found == 1:
                self.tensors.append(obj)
            elif found == 2:
                self.graph = True


def _kind(kind: type, tensor: type, graph: type | None) -> int:
    """1: a tensor's type, 2: a CUDA graph's, 0: neither (or a type that cannot say)."""
    try:
        return 1 if issubclass(kind, tensor) else 2 if graph is not None and issubclass(kind, graph) else 0
    except Exception:  # noqa: BLE001  a metaclass's own __subclasscheck__ that fails: not torch's
        return 0


def why_not(torch: Any, live: Live | None = None) -> str | None:
    """Why the fast path must step aside in this process, or None."""
    if torch is None or not torch.cuda.is_initialized():
        return "the kernel does not use CUDA through PyTorch"
    return unsafe(torch, live)


def unsafe(torch: Any, live: Live | None = None) -> str | None:
    """Why this process's buffers may not be taken away between two cells or at a safe point (by the fast
    path, or the host stash of a suspend, kernel/hoststash.py), or None: a library that holds CUDA memory
    by address, a live CUDA graph, or a thread that could touch them (:func:`threads`). ``live``: a pass
    over the objects already made (else one is made here)."""
    loaded = [name for name in FOREIGN_CUDA if name in sys.modules]
    if loaded:
        return f"{', '.join(loaded)} is loaded and may hold GPU memory by address"
    if torch is not None and (live or Live(torch)).graph:
        return "a CUDA graph is alive (graphs replay fixed addresses)"
    return threads()[0]


def _parked(thread: threading.Thread) -> bool:
    """A pool worker (concurrent.futures) that waits for work now, with none queued: it runs no user code.
    Its frames, from the top: only the queue's and threading's own, then the pool's ``_worker`` loop (a
    task of the notebook's that waits, on an event say, has its own frame between)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None and os.path.basename(frame.f_code.co_filename) in ("threading.py", "queue.py"):
        frame = frame.f_back
    if frame is None or (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) != ("thread.py", "_worker"):
        return False
    work = frame.f_locals.get("work_queue")
    return work is None or not hasattr(work, "empty") or work.empty()


def large_storages(torch: Any, min_bytes: int = MIN_BYTES, report: dict | None = None,
                   live: Live | None = None) -> list[Any]:
    """Every distinct CUDA storage of a live tensor that can be resized, of ``min_bytes`` or more, largest
    first, less those a handed thread reaches (:func:`threads`). Raises :class:`StepAside` if a storage
    that cannot be resized aliases one of them. ``report`` gets ``spared``: the bytes of large storages
    left for the handed threads."""
    spared = reach(threads()[1], torch)
    found: dict[int, Any] = {}
    left: dict[int, int] = {}
    fixed: dict[int, int] = {}
    for obj in (live or Live(torch)).tensors:
        try:
            if not obj.is_cuda or obj.layout != torch.strided:
                continue
            storage = obj.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError, TypeError):
            continue  # sparse, nested, wrapper subclasses: they stay
        if not pointer:
            continue
        if not storage.resizable():
            fixed[pointer] = size  # memory someone else owns (IPC, DLPack, from_blob): it stays
        elif size >= min_bytes:
            if ("storage", pointer) in spared:
                left[pointer] = size
            else:
                found[pointer] = storage
    taken = sorted((p, p + s.nbytes()) for p, s in found.items())
    for pointer, size in fixed.items():
        if any(start < pointer + size and pointer < end for start, end in taken):
            raise StepAside("a tensor shares GPU memory with another without sharing its storage (DLPack, "
                            "__cuda_array_interface__): it would keep the old address")
    if report is not None:
        report["spared"] = sum(left.values())
    return sorted(found.values(), key=lambda s: s.nbytes(), reverse=True)


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class Driver:
    """The few CUDA driver calls the stash needs, on the context torch made current."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _Handle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        lib.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        self.lib = lib

    def current(self) -> int:
        """This thread's current CUDA context (0: none)."""
        context = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(context)), "reading the current context")
        return context.value or 0

    def use(self, context: int) -> None:
        """Make ``context`` current in this thread (a thread of the kernel's own has none until then: torch sets
        a device only where it differs from the one it believes current)."""
        self._check(self.lib.cuCtxSetCurrent(context), "making the context current")

    @staticmethod
    def _check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed (CUresult {result})")

    def open(self, handle: str) -> int:
        pointer = ctypes.c_uint64()
        raw = _Handle.from_buffer_copy(bytes.fromhex(handle))
        self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), raw, _LAZY_ENABLE_PEER_ACCESS),
                    "opening the stash")
        return pointer.value

    def close(self, pointer: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(pointer), "closing the stash")

    def copy(self, dst: int, src: int, size: int, stream: int) -> None:
        self._check(self.lib.cuMemcpyDtoDAsync_v2(dst, src, size, stream), "a copy")


class Stager:
    """The storages of one session and where they are (here, or in the stash)."""

    def __init__(self, torch: Any, live: Live | None = None) -> None:
        self.torch = torch
        #: what the search saw beside the storages it offers (said to the server: what stays, and why)
        self.seen: dict[str, int] = {}
        self.storages = large_storages(torch, report=self.seen, live=live)
        devices = {s.device.index for s in self.storages} | {torch.cuda.current_device()}
        self.seen["allocated"] = sum(int(torch.cuda.memory_allocated(d)) for d in devices if d is not None)
        self.driver = Driver()
        self.handle: str | None = None
        self.away: list[tuple[Any, int, int]] = []  # (storage, size, offset in the stash)
        #: seconds by part of the last stash and unstash (said to the server with them)
        self.parts: dict[str, float] = {}

    def _stream(self) -> int:
        return int(self.torch.cuda.current_stream().cuda_stream)

    def stash(self, handle: str, take: list[int], offsets: list[int]) -> int:
        torch, clock = self.torch, _Clock(self.parts, "stash")
        torch.cuda.synchronize()  # every kernel launched so far has finished with these storages
        clock("sync")
        try:
            base = self.driver.open(handle)
        except RuntimeError as exc:
            raise StepAside(f"the stash on the target GPU cannot be reached from here ({exc}; no peer access?)")
        clock("open")
        chosen = [(self.storages[i], self.storages[i].nbytes(), off) for i, off in zip(take, offsets)]
        try:
            stream = self._stream()
            for storage, size, offset in chosen:
                self.driver.copy(base + offset, storage.data_ptr(), size, stream)
            torch.cuda.synchronize()
            clock("copy")
        except RuntimeError as exc:
            raise StepAside(f"copying into the stash failed ({exc}); nothing was changed")
        finally:
            self.driver.close(base)  # no mapping of another process's memory may stay for the checkpoint
        clock("close")
        self.handle = handle
        for storage, size, offset in chosen:
            storage.resize_(0)
            self.away.append((storage, size, offset))
        torch.cuda.empty_cache()  # give the freed blocks back, or the driver would move them anyway
        torch.cuda.synchronize()
        clock("free")
        return sum(size for _, size, _ in chosen)

    def unstash(self) -> int:
        """Copy every storage back from the stash: all are allocated again, then all copied, then one wait.
        If any of it fails (no memory, a copy), every storage still away is emptied again (size 0: a tensor
        never holds what was not copied) and the error raised; a second call does the whole job."""
        torch, clock = self.torch, _Clock(self.parts, "unstash")
        assert self.handle is not None
        base = self.driver.open(self.handle)
        clock("open")
        try:
            for storage, size, _ in self.away:
                if storage.nbytes() != size:
                    storage.resize_(size)
            clock("alloc")
            stream = self._stream()
            for storage, size, offset in self.away:
                self.driver.copy(storage.data_ptr(), base + offset, size, stream)
            torch.cuda.synchronize()
            clock("copy")
            total = sum(size for _, size, _ in self.away)
            self.away.clear()
        except BaseException:
            try:
                torch.cuda.synchronize()  # no copy still reads the stash once it is closed below
            except RuntimeError:
                pass
            for storage, _, _ in self.away:
                storage.resize_(0)
            raise
        finally:
            self.driver.close(base)
        clock("close")
        return total


class _Clock:
    """Seconds since the last call, by part, into ``parts`` (``{prefix}_{part}``): where a stash's time goes."""

    def __init__(self, parts: dict[str, float], prefix: str) -> None:
        self.parts, self.prefix, self.last = parts, prefix, time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[f"{self.prefix}_{part}"] = now - self.last
        self.last = now


def _send(out: Any, message: dict) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def run(path: str, token: str, safe_point: bool = False) -> dict:
    """The kernel's side of one fast-path session with the server at ``path`` (see engine/stash.py);
    ``safe_point``: served at the safe point of a busy cell (kernel/safepoint.py), which waits meanwhile.
    Never raises: what happened is said to the server, and returned."""
    torch = sys.modules.get("torch")
    result: dict = {}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30)
        conn.connect(path)
    except OSError as exc:
        return {"aside": f"the server's socket is gone ({exc})"}
    with conn, conn.makefile("rwb") as io:
        stager: Stager | None = None
        gathering = time.perf_counter()
        try:
            live = Live(torch) if torch is not None and torch.cuda.is_initialized() else None
            aside = why_not(torch, live)
            if aside is None:
                stager = Stager(torch, live)
                stager.parts["gather"] = time.perf_counter() - gathering
        except OSError as exc:
            aside = f"the CUDA driver library cannot be loaded ({exc})"
        except StepAside as exc:
            aside = str(exc)
        except Exception as exc:  # noqa: BLE001  an object the search cannot read: the driver moves it all
            aside = f"the kernel's search for its tensors failed ({type(exc).__name__}: {exc})"
        live = None  # every tensor it listed, garbage included, would live as long as the session
        sizes = [s.nbytes() for s in stager.storages] if stager else []
        result = {"aside": aside} if aside else {}
        try:
            _send(io, {"token": token, "pid": os.getpid(), "storages": sizes, "aside": aside, "safe_point": safe_point,
                       **(stager.seen if stager else {})})
            conn.settimeout(None)  # the move in between may take as long as the driver needs
            for line in io:
                message = json.loads(line)
                op = message.get("op")
                started = time.perf_counter()
                if op == "stash" and stager is not None:
                    try:
                        moved = stager.stash(message["handle"], message["take"], message["offsets"])
                        result = {"stashed": moved, "seconds": time.perf_counter() - started,
                                  "parts": dict(stager.parts)}
                    except StepAside as exc:
                        result = {"aside": str(exc)}
                elif op == "unstash" and stager is not None:
                    result = _unstash(stager, started)
                elif op == "bye":
                    break
                _send(io, result)
        except (OSError, ValueError) as exc:  # the server went away, or said something unreadable
            result = {"aside": f"the session with the server broke off ({exc})"}
        finally:
            # Whatever ended the session (bye, the server gone, an interrupt): tensors still in the
            # stash come back now, while the helper keeps it (it waits for the server, or a minute).
            if stager is not None and stager.away:
                result = _unstash(stager, time.perf_counter())
    return result


def _unstash(stager: Stager, started: float) -> dict:
    try:
        moved = stager.unstash()
    except Exception as exc:  # said to the server, which rolls back and asks again
        return {"error": f"{exc}"}
    return {"unstashed": moved, "seconds": time.perf_counter() - started, "parts": dict(stager.parts)}
