"""A transplant: the notebook's objects, carried into a new kernel process where the driver cannot go.

The CUDA driver restores a process only onto a GPU of the model it was checkpointed on; to another model
or to the CPU, what can go is the notebook's objects, not its process. This module is both ends of that:

In the source kernel, evaluated between cells by the server (kernelwire.evaluate_silently):

    survey()        the dry run: which names carry, and which do not (name, type, why), as JSON
    export(folder)  writes what carries into ``folder``: ``objects.pkl`` (cloudpickle, protocol 5),
                    ``storage-NN.bin``, the raw bytes of every PyTorch storage, written by up to 16 threads (CUDA
                    ones through pinned host buffers, as the suspend's host stash writes them, each chunk
                    with its checksum), and ``data.bin``, those of every out-of-band buffer (NumPy arrays'
                    among them), so that no tensor is pickled by value; with the history, execution
                    count, RNG states, working folder, environment and sys.path. ``folder`` must exist: an export that runs after its transplant was given
                    up (it waited behind a long cell) writes nothing.

In the target process, ``python -m jupyter_gpumigrate.kernel.transplant FOLDER <ipykernel arguments>``,
started while the source writes: it imports what it needs and sets up CUDA meanwhile, then reads the
objects (the storages by as many threads, each chunk checked: CUDA ones onto its GPU, the only one it sees,
through pinned buffers, or into host memory when it has none), writes ``ready.json`` (or ``failed.json``, and exits), then waits for SIGUSR1: the server's
word that the source kernel has let go of the kernel's ports. Then it starts the IPython kernel on those
ports, with the objects as its namespace, and sets its history, execution count and RNG states last.
While it waits, it exits if the server that started it goes: the source is then what the next server finds.

What carries: anything cloudpickle can carry (functions and classes defined in the notebook by value,
modules by name), tensors, modules, optimizers, AMP scalers, NumPy and pandas objects. What does not:
generators, threads, locks, sockets, open files, CUDA streams and events, and anything holding one; the
survey names each with the reason. Gradients (``.grad``) do not carry, as with ``torch.save``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any

OBJECTS, DATA, READY, FAILED, PRELUDE = "objects.pkl", "data.bin", "ready.json", "failed.json", "prelude.json"
#: Written by the new process once its kernel is set up on the kernel's ports: how long that took.
STARTED = "started.json"
#: The storages' bytes, one file per writer thread (tmpfs serialises the writes to one file).
STORAGE = "storage-{:02d}.bin"

#: In a kernel a transplant made on the CPU: the storages that were on a GPU in its source.
_FROM_GPU: weakref.WeakSet = weakref.WeakSet()

#: IPython's own names, rebuilt in the target from the carried history rather than carried as names.
_CACHE_NAME = re.compile(r"^(_i\d*|_ii|_iii|_\d+|_|__|___)$")
#: The exit code of a target that could not load the objects (failed.json says why).
LOAD_FAILED = 3


# -- the source ---------------------------------------------------------------------------------------


def _shell() -> Any:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        raise RuntimeError("not in an IPython kernel")
    return shell


def _user_names(shell: Any) -> dict[str, Any]:
    """The notebook's own names: not IPython's, not its caches (rebuilt from the history)."""
    hidden, absent = shell.user_ns_hidden, object()
    # As %who: a name IPython set is the notebook's once it holds another object.
    return {name: value for name, value in shell.user_ns.items()
            if value is not hidden.get(name, absent) and not _CACHE_NAME.match(name)
            and not (name.startswith("__") and name.endswith("__"))}


class _Sink:
    """Where the raw bytes go, and the table to find them again: out-of-band buffers into ``data.bin`` as
    they are pickled; PyTorch storages listed as they are pickled, then written all at once, in parallel,
    into ``storage-NN.bin`` (:meth:`write_storages`). For the survey (no file): counted, not copied."""

    def __init__(self, file: Any | None) -> None:
        self.file = file
        self.offset = 0
        #: one row per out-of-band buffer: (offset in data.bin, bytes)
        self.buffers: list[tuple[int, int]] = []
        #: one per storage: the storage itself, and where it goes ("cuda": onto the target's GPU, if it has one)
        self.storages: list[tuple[Any, str]] = []
        self._storages: dict[int, int] = {}  # untyped storage (its C address) -> its index in storages
        #: raw bytes of storages by where they go
        self.by_device: dict[str, int] = {}
        #: how the storages' bytes lie in their files (hoststash.plan_chunks's chunks, as dicts), once written
        self.chunks: list[dict] = []
        self.parts = 0

    def storage(self, untyped: Any) -> int:
        key = untyped._cdata
        if key not in self._storages:
            if untyped.device.type not in ("cpu", "cuda"):
                raise TypeError(f"a tensor on the {untyped.device.type} device: its data cannot be carried "
                                "(move it to the CPU or a GPU first)")
            # A storage that a transplant brought from a GPU onto the CPU goes back onto a GPU, if the next
            # target has one: a kernel can go to the CPU and back.
            device = "cuda" if untyped.device.type == "cuda" or untyped in _FROM_GPU else "cpu"
            self.by_device[device] = self.by_device.get(device, 0) + untyped.nbytes()
            self._storages[key] = len(self.storages)
            self.storages.append((untyped, device))  # kept: its address stays valid until the export ends
        return self._storages[key]

    def buffer(self, buffer: pickle.PickleBuffer) -> bool:
        """Protocol 5's out-of-band buffers (NumPy arrays...): their bytes go to the data file, not the pickle."""
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: pickled in band
            return True
        if self.file is not None:
            _write_all(self.file, raw.cast("B") if raw.format != "B" else raw)
        self.buffers.append((self.offset, raw.nbytes))
        self.offset += raw.nbytes
        return False

    def write_storages(self, folder: Path) -> None:
        """Every storage's bytes into ``storage-NN.bin`` in ``folder``, one file per thread: CUDA ones through
        pinned host buffers, a chunk copied from the GPU while the one before is written (the suspend's
        host stash does the same: kernel/hoststash.py)."""
        from . import hoststash

        torch = sys.modules.get("torch")
        if not self.storages or torch is None:
            return
        # The copies run on the context of one GPU; a storage on another (a transplant takes a kernel on
        # one GPU, so hardly ever) goes through host memory first, as PyTorch copies it.
        gpus = [u.device.index for u, _ in self.storages if u.device.type == "cuda"]
        regions = [u if u.device.type == "cpu" or u.device.index == gpus[0] else u.cpu() for u, _ in self.storages]
        on_gpu = [u.device.type == "cuda" for u in regions]
        cuda = None
        if any(on_gpu):
            with torch.cuda.device(gpus[0]):
                torch.cuda.synchronize(gpus[0])  # every kernel launched so far has finished with these storages
                cuda = hoststash.Cuda()
        sizes = [u.nbytes() for u in regions]
        # As many threads as chunks, up to 16: each holds two pinned buffers of a chunk's size.
        chunks = hoststash.plan_chunks(sizes, min(hoststash.THREADS, -(-sum(sizes) // hoststash.CHUNK)))
        self.parts = 1 + max((c.part for c in chunks), default=-1)
        addresses = [u.data_ptr() for u in regions]
        fds: list[int] = []
        try:
            for part in range(self.parts):
                fds.append(os.open(folder / STORAGE.format(part), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                   0o600))
            # Never synced: the folder is scratch, read at once and then removed (on a disk, the new process
            # reads it from the page cache).
            if self.parts:
                hoststash.run_parts(lambda part: hoststash.write_part(fds[part], chunks, part, addresses, on_gpu,
                                                                      cuda, False), self.parts)
        finally:
            for fd in fds:
                os.close(fd)
        self.chunks = [c.__dict__ for c in chunks]

    def table(self) -> dict:
        """What the target needs to find every byte again (written after the pickle)."""
        return {"buffers": self.buffers, "storages": [[u.nbytes(), device] for u, device in self.storages],
                "chunks": self.chunks, "parts": self.parts}

    @property
    def nbytes(self) -> int:
        return self.offset + sum(u.nbytes() for u, _ in self.storages)


#: The most one system call moves (Linux moves at most about 2 GiB per read or write).
_SLICE = 256 << 20


def _write_all(file: Any, view: memoryview) -> None:
    """Write all of ``view`` to an unbuffered file (a buffered one copies large writes slowly)."""
    done = 0
    while done < view.nbytes:
        done += file.write(view[done:done + _SLICE])


def _read_all(file: Any, view: memoryview) -> None:
    """Fill ``view`` from an unbuffered file; EOFError if it ends first."""
    done = 0
    while done < view.nbytes:
        got = file.readinto(view[done:done + _SLICE])
        if not got:
            raise EOFError(f"{DATA} is shorter than its table says")
        done += got


def _pickler_class() -> type:
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        """cloudpickle, with PyTorch storages and the notebook's namespace carried by reference."""

        def __init__(self, file: Any, sink: _Sink, shell: Any) -> None:
            super().__init__(file, protocol=5, buffer_callback=sink.buffer)
            self.sink = sink
            self.shell = shell
            self.user_ns = shell.user_ns
            self.torch = sys.modules.get("torch")
            # IPython's objects (get_ipython, exit, In...): what refers to them gets the target's own.
            # IPython's own objects (get_ipython, exit, In...): what refers to them gets the target's. Modules
            # and plain values go as themselves (by name, or by value).
            self.hidden = {id(v): k for k, v in shell.user_ns_hidden.items()
                           if not isinstance(v, (str, bytes, int, float, bool, tuple, type(None), types.ModuleType))}

        def persistent_id(self, obj: Any) -> Any:  # noqa: C901  one branch per kind of reference
            if obj is self.shell:
                return ("hidden", _SHELL)
            torch = self.torch
            if torch is not None:
                if isinstance(obj, torch.storage.TypedStorage):
                    return ("storage", self.sink.storage(obj._untyped_storage), obj.dtype)
                if isinstance(obj, torch.UntypedStorage):
                    return ("storage", self.sink.storage(obj), None)
            if type(obj) is dict and obj is self.globals_ref.get(id(self.user_ns)):
                return ("user_ns",)  # the globals of the notebook's functions: the target's namespace
            name = self.hidden.get(id(obj))
            if name is not None:
                return ("hidden", name)
            return None

        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, io.IOBase) and not isinstance(obj, (io.BytesIO, io.StringIO)):
                # cloudpickle would carry a file open for reading as a copy of what is left to read
                raise TypeError(f"an open file ({getattr(obj, 'name', type(obj).__name__)}): open it again after "
                                "the transplant")
            torch = self.torch
            if torch is not None and isinstance(obj, torch.Generator):
                return _rebuild_generator, (obj.device.type, obj.get_state())
            return super().reducer_override(obj)

    return Pickler


def _rebuild_generator(device: str, state: Any) -> Any:
    import torch

    where = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    generator = torch.Generator(where)
    if where == device:
        generator.set_state(state)
    return generator


class _Null(io.RawIOBase):
    """Where the survey's pickles go: nowhere, counted."""

    written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.written += n
        return n


def _why(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def _try(shell: Any, value: Any, sink: _Sink | None = None) -> tuple[int, str | None]:
    """Whether ``value`` carries on its own: (its bytes, raw and pickled, None), or (0, why not). With
    ``sink``, its raw bytes are counted there too (a storage shared by two names, once)."""
    own = _Sink(None)
    null = _Null()
    try:
        _pickler_class()(null, own, shell).dump(value)
        if sink is not None:
            _pickler_class()(_Null(), sink, shell).dump(value)
    except Exception as exc:  # noqa: BLE001  whatever the pickler says is the reason
        return 0, _why(exc)
    return own.nbytes + null.written, None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__name__ if kind.__module__ in ("builtins", "__main__") else f"{kind.__module__}.{kind.__qualname__}"


def _notes(names: dict[str, Any]) -> list[dict[str, str]]:
    """What carries but may not work as before on the target: names of a CUDA device, say, and the
    notebook's own threads, which do not go on there."""
    from .stager import QUIET_THREADS, _parked, _thread_module

    torch = sys.modules.get("torch")
    notes = []
    for thread in threading.enumerate():
        module = _thread_module(thread)
        if (thread is threading.main_thread() or not thread.is_alive() or _parked(thread)
                or any(module == q or module.startswith(q + ".") for q in QUIET_THREADS)):
            continue
        notes.append({"name": f"thread {thread.name!r}", "note": "runs in the kernel now: it does not go on in the "
                      "new process, and what it changes during the transplant may be carried half done"})
    if torch is not None:
        for name, value in names.items():
            if isinstance(value, torch.device) and value.type == "cuda":
                notes.append({"name": name, "note": f"is {value}: on the CPU, code that uses it fails; on "
                              "another GPU it names that GPU (the only one the kernel sees)"})
            elif isinstance(value, torch.Generator) and value.device.type == "cuda":
                notes.append({"name": name, "note": "is a CUDA random generator: on the CPU it becomes a new CPU "
                              "generator, its stream not carried"})
    return notes


def survey() -> str:
    """The dry run: JSON of ``carries`` (name, type, bytes), ``left`` (name, type, reason), ``notes``,
    ``outputs`` (how many of Out carry, of how many) and ``bytes`` (the raw bytes to write)."""
    shell = _shell()
    carries, left = [], []
    together = _Sink(None)  # every raw byte once, whichever names share it
    for name, value in _user_names(shell).items():
        nbytes, why = _try(shell, value, together)
        row = {"name": name, "type": _type_name(value)}
        if why is None:
            carries.append({**row, "bytes": nbytes})
        else:
            left.append({**row, "reason": why})
    outputs = shell.history_manager.output_hist
    carried_out = sum(1 for v in outputs.values() if _try(shell, v)[1] is None)
    pickled = sum(r["bytes"] for r in carries) - sum(together.by_device.values())
    return json.dumps({"carries": carries, "left": left, "notes": _notes(_user_names(shell)),
                       "outputs": {"carried": carried_out, "of": len(outputs)},
                       "bytes": together.nbytes + max(0, pickled),
                       "gpu_bytes": together.by_device.get("cuda", 0), "execution_count": shell.execution_count})


def _rng_states() -> dict[str, Any]:
    import random

    states: dict[str, Any] = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.get_rng_state()
        if torch.cuda.is_initialized():  # never asked first: that would set CUDA up in a kernel on the CPU
            states["torch_cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def _torch_settings() -> dict[str, Any]:
    """PyTorch's process-wide settings that change results: carried, as the RNG states are."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {"deterministic": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "default_dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
            "matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_benchmark": torch.backends.cudnn.benchmark, "cudnn_deterministic": torch.backends.cudnn.deterministic}


def _set_torch(settings: dict[str, Any]) -> None:
    if not settings:
        return
    import torch

    _set_deterministic(torch, settings["deterministic"], settings["deterministic_warn_only"])
    torch.set_default_dtype(settings["default_dtype"])
    torch.set_grad_enabled(settings["grad"])
    torch.set_float32_matmul_precision(settings["matmul_precision"])
    torch.backends.cudnn.benchmark = settings["cudnn_benchmark"]
    torch.backends.cudnn.deterministic = settings["cudnn_deterministic"]


def _set_deterministic(torch: Any, mode: bool, warn_only: bool) -> None:
    """torch.use_deterministic_algorithms, only where it changes something: it imports torch._inductor's
    config, some 800 modules (0.8 s on the development machine)."""
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != (
            mode, warn_only):
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)


def export(folder: str, carries: list[str] | None = None) -> str:
    """Write what carries into ``folder`` (which must exist): the names ``carries`` (the survey's, just
    before) or, if None, those that carry now; JSON of what was written."""
    shell = _shell()
    where = Path(folder)
    if not where.is_dir():
        raise FileNotFoundError(f"{folder} is gone: the transplant was given up")
    started = time.perf_counter()
    names, outputs = {}, {}
    for name, value in _user_names(shell).items():
        if (name in carries) if carries is not None else _try(shell, value)[1] is None:
            names[name] = value
    for number, value in shell.history_manager.output_hist.items():
        if _try(shell, value)[1] is None:
            outputs[number] = value
    hm = shell.history_manager
    payload = {
        "names": names,
        "outputs": outputs,
        "last": {k: shell.user_ns[k] for k in ("_", "__", "___") if k in shell.user_ns
                 and _try(shell, shell.user_ns[k])[1] is None},
        "input_parsed": list(hm.input_hist_parsed),
        "input_raw": list(hm.input_hist_raw),
        "execution_count": shell.execution_count,
        "rng": _rng_states(),
        "torch": _torch_settings(),
        "cwd": os.getcwd(),
        "environ": dict(os.environ),
        "sys_path": list(sys.path),
    }
    # What the new process needs before it reads anything: where to import from, and the environment
    # (read by libraries as they import, PyTorch's CUDA allocator among them).
    # With PyTorch's deterministic mode, which the new process sets while the objects are written.
    _write_json(where / PRELUDE, {**{k: payload[k] for k in ("cwd", "environ", "sys_path")},
                                  "deterministic": [payload["torch"].get("deterministic", False),
                                                    payload["torch"].get("deterministic_warn_only", False)]})
    with open(where / DATA, "xb", buffering=0) as data, open(where / (OBJECTS + ".part"), "xb") as out:
        sink = _Sink(data)
        _pickler_class()(out, sink, shell).dump(payload)
        sink.write_storages(where)
        table = json.dumps(sink.table()).encode()
        out.write(table)
        out.write(len(table).to_bytes(8, "little"))
        data.flush()
        os.fsync(data.fileno())
        out.flush()
        os.fsync(out.fileno())
    os.rename(where / (OBJECTS + ".part"), where / OBJECTS)
    return json.dumps({"names": len(names), "bytes": sink.nbytes, "outputs": len(outputs),
                       "seconds": round(time.perf_counter() - started, 4)})


# -- the target ---------------------------------------------------------------------------------------


#: How the IPython shell itself is referred to (get_ipython() is the shell; get_ipython the method).
_SHELL = "<the shell>"


class _Later:
    """An IPython object of the source (get_ipython, exit...), until the target's own replaces it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name} of the kernel this one was transplanted from>"


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, buffers: Any, storages: list, namespace: dict) -> None:
        super().__init__(file, buffers=buffers)
        self.storages = storages
        self.namespace = namespace

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "user_ns":
            return self.namespace
        if kind == "hidden":
            return _Later(pid[1])
        if kind == "storage":
            import torch

            untyped = self.storages[pid[1]]
            if pid[2] is None:
                return untyped
            return torch.storage.TypedStorage(wrap_storage=untyped, dtype=pid[2], _internal=True)
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")


def load(folder: Path, namespace: dict) -> dict:
    """Read the objects in ``folder`` into ``namespace``; the rest of the payload (history, RNG...)."""
    with open(folder / OBJECTS, "rb") as out, open(folder / DATA, "rb", buffering=0) as data:
        out.seek(-8, os.SEEK_END)
        end = out.tell()
        size = int.from_bytes(out.read(8), "little")
        out.seek(end - size)
        table = json.loads(out.read(size))
        buffers = []
        for offset, nbytes in table["buffers"]:
            data.seek(offset)
            chunk = bytearray(nbytes)
            _read_all(data, memoryview(chunk))
            buffers.append(chunk)
        storages = _read_storages(folder, table)
        out.seek(0)
        payload = _Unpickler(io.BytesIO(out.read(end - size)), buffers, storages, namespace).load()
    payload["carried"] = dict(payload["names"])
    namespace.update(payload.pop("names"))
    return payload


def _read_storages(folder: Path, table: dict) -> list:
    """Every storage, allocated where it goes (this process's GPU, or host memory where it has none) and
    filled from ``storage-NN.bin`` in parallel, each chunk checked against its checksum."""
    if not table["storages"]:
        return []
    import torch

    from . import hoststash

    gpu = _has_cuda()
    storages = []
    for nbytes, device in table["storages"]:
        if device == "cuda" and gpu:
            storages.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda").untyped_storage())
        else:
            storages.append(torch.UntypedStorage(nbytes))
            if device == "cuda":
                _FROM_GPU.add(storages[-1])
    on_gpu = [s.device.type == "cuda" for s in storages]
    chunks = [hoststash.Chunk(**c) for c in table["chunks"]]
    parts = int(table["parts"])
    wrong_chunk = hoststash.out_of_bounds(chunks, [s.nbytes() for s in storages], parts)
    if wrong_chunk is not None:
        raise OSError(f"the objects' table is damaged: a chunk out of bounds ({wrong_chunk})")
    cuda = None
    if any(on_gpu):
        with torch.cuda.device(0):  # the one GPU this process sees
            torch.cuda.synchronize()  # the allocations are done, and the context is current in this thread
            cuda = hoststash.Cuda()
    addresses = [s.data_ptr() for s in storages]
    wrong: list[str] = []
    if parts:
        hoststash.run_parts(lambda part: wrong.append(hoststash.read_part(folder / STORAGE.format(part), chunks,
                                                                          part, addresses, on_gpu, cuda) or ""), parts)
    wrong = [w for w in wrong if w]
    if wrong:
        raise OSError(f"the objects' files are damaged: {hoststash.damage(wrong)}")
    if cuda is not None:
        torch.cuda.synchronize()
    return storages


def _has_cuda() -> bool:
    """Whether this process sees a GPU through PyTorch (imported for it, if installed)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _set_rng(states: dict[str, Any]) -> None:
    import random

    random.setstate(states["random"])
    if "numpy" in states:
        import numpy

        numpy.random.set_state(states["numpy"])
    if "torch" in states:
        import torch

        torch.set_rng_state(states["torch"])
        if "torch_cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["torch_cuda"])


def _settle(shell: Any, payload: dict, carried: dict[str, Any]) -> None:
    """The notebook's names over IPython's, then the history, execution count, caches and settings."""
    for name, value in carried.items():
        # IPython hides what its namespace held as it started (hide_initial_ns), and sets its own names
        # (exit, In...) over it: a notebook's name of the same kind is the notebook's.
        shell.user_ns_hidden.pop(name, None)
        shell.user_ns[name] = value
    hm = shell.history_manager
    hm.input_hist_parsed[:] = payload["input_parsed"]
    hm.input_hist_raw[:] = payload["input_raw"]
    hm.output_hist.update(payload["outputs"])
    ns = shell.user_ns
    for number, text in enumerate(payload["input_parsed"]):
        if number:
            ns[f"_i{number}"] = text
    for key, value in zip(("_i", "_ii", "_iii"), reversed(payload["input_parsed"][-3:])):
        ns[key] = value
    for number, value in payload["outputs"].items():
        ns[f"_{number}"] = value
    ns.update(payload["last"])
    shell.execution_count = payload["execution_count"]
    _set_torch(payload.get("torch", {}))
    # What referred to the source's IPython objects (get_ipython, In...) gets this kernel's, by name.
    for name, value in list(ns.items()):
        if isinstance(value, _Later):
            ns[name] = shell if value.name == _SHELL else shell.user_ns_hidden.get(value.name, value)


def _rng_at_first_cell(kernel: Any, states: dict[str, Any]) -> None:
    """Set the RNG states as the first execute request comes, not before: the kernel's own start draws
    from Python's (pyzmq binds its internal sockets to random ports)."""
    handlers = kernel.shell_handlers
    execute = handlers["execute_request"]

    async def first(*args: Any, **kwargs: Any) -> Any:
        handlers["execute_request"] = execute
        _set_rng(states)
        return await execute(*args, **kwargs)

    handlers["execute_request"] = first


def _write_json(path: Path, data: dict) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data))
    os.rename(part, path)


def _wait_for(path: Path, folder: Path, parent: int) -> bool:
    while not path.exists():
        if not folder.is_dir() or os.getppid() != parent:
            return False
        time.sleep(0.005)
    return True


def _prepare_while_exporting(folder: Path, parent: int) -> bool:
    """Start as the source writes its objects: take its working folder, environment and sys.path (its
    prelude, written first), import what the kernel and the objects need, set up CUDA if a GPU is
    visible, then wait for the objects (written last, by rename). False if the folder went (the
    transplant was given up) or the server did."""
    if not _wait_for(folder / PRELUDE, folder, parent):
        return False
    prelude = json.loads((folder / PRELUDE).read_text())
    _take_prelude(prelude)
    if _has_cuda():
        import torch

        torch.cuda.init()
    if "torch" in sys.modules and any(prelude.get("deterministic") or ()):
        _set_deterministic(sys.modules["torch"], *prelude["deterministic"])  # its imports, now rather than after
    import ipykernel.kernelapp  # noqa: F401  imported now rather than after the switch

    return _wait_for(folder / OBJECTS, folder, parent)


def _take_prelude(prelude: dict) -> None:
    """The source's environment (but the GPU this process sees), sys.path and working folder."""
    keep = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "JPY_PARENT_PID") if k in os.environ}
    os.environ.clear()
    os.environ.update(prelude["environ"])
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(keep)
    # The source's import path, where its folders exist here (another host may lay them out otherwise); then
    # this process's own, so that its Python's packages still import.
    here = list(sys.path)
    sys.path[:] = [p for p in prelude["sys_path"] if p == "" or os.path.exists(p)]
    sys.path.extend(p for p in here if p not in sys.path)
    try:
        os.chdir(prelude["cwd"])
    except OSError:
        pass  # the folder is gone: the kernel stays where it started


def _wait_for_go(parent: int) -> bool:
    """Wait for SIGUSR1 (True); False if the server that started us went first."""
    while True:
        if signal.sigtimedwait([signal.SIGUSR1], 1.0) is not None:
            return True
        if os.getppid() != parent:
            return False


#: Set by a peer that starts this process for another host's kernel: once told to go, its output goes to
#: /dev/null, not to the log file it had until then (a process that comes home by CRIU must hold no file of
#: the host it leaves).
DETACH_OUTPUT = "JUPYTER_GPUMIGRATE_DETACH_OUTPUT"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    folder, kernel_args = Path(args[0]), args[1:]
    parent = os.getppid()
    detach = os.environ.get(DETACH_OUTPUT) == "1"  # read now: the source's environment replaces ours
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    namespace: dict = {}
    try:
        if not _prepare_while_exporting(folder, parent):
            return LOAD_FAILED
        started = time.perf_counter()
        payload = load(folder, namespace)
    except BaseException as exc:  # noqa: BLE001  every failure is said, then the process ends
        import traceback

        traceback.print_exc()
        _write_json(folder / FAILED, {"error": f"{type(exc).__name__}: {_why(exc)}"})
        return LOAD_FAILED
    carried = payload.pop("carried")
    _write_json(folder / READY, {"names": len(carried), "seconds": round(time.perf_counter() - started, 4),
                                 "device": "cuda" if _has_cuda() else "cpu", "off_gpu": len(_FROM_GPU)})
    if not _wait_for_go(parent):
        print("jupyter-gpumigrate: the server that started this transplant is gone; exiting", file=sys.stderr)
        return LOAD_FAILED
    go = time.perf_counter()
    if detach:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})

    from ipykernel.kernelapp import IPKernelApp

    app = IPKernelApp.instance(user_ns=namespace)
    # Its history in memory (the carried one is set below): the source, kept to go back to, holds IPython's
    # history file open, and CRIU restores it only if that file has not grown meanwhile.
    # (given once: twice, traitlets makes the setting a list, and the kernel does not start)
    app.initialize([*(a for a in kernel_args if not a.startswith("--HistoryManager.hist_file")),
                    "--HistoryManager.hist_file=:memory:"])
    _settle(app.shell, payload, carried)
    _rng_at_first_cell(app.kernel, payload["rng"])
    _go_on_idle(app.kernel)
    try:  # for the operation's record: the switch, less this, is the server's wait for the first answer
        _write_json(folder / STARTED, {"seconds": round(time.perf_counter() - go, 4)})
    except OSError:
        pass
    app.start()
    return 0


def _go_on_idle(kernel: Any) -> None:
    """The notebook's kernel goes on in this process, idle: its status says so, never "starting". A
    frontend that hears "starting" (JupyterLab does, when its IOPub is back in time) waits for the "idle" of
    a first request that nobody sends: it shows "Starting" until the next cell, and a client that waits for
    idle before it sends one waits for ever. Every "starting" is said as "idle", not only the first status:
    the server's nudge (a kernel_info_request on a control channel) may be answered, with its own busy and
    idle, before ipykernel publishes "starting" (seen on the dev machine, 2026-11-26: Galata's runCell then
    waited for ever). (ipykernel's own method, wrapped: absent, nothing done.)"""
    publish = getattr(kernel, "_publish_status", None)
    if publish is None:
        return

    def go_on(status: str, channel: str, parent: Any = None) -> None:
        publish("idle" if status == "starting" else status, channel, parent)

    kernel._publish_status = go_on


if __name__ == "__main__":
    # Run as the package's module, not as __main__: its state (_FROM_GPU) and the functions the objects
    # refer to must be the ones a later export imports; and in a kernel, __main__ is the notebook's namespace.
    from jupyter_gpumigrate.kernel import transplant

    sys.exit(transplant.main())
