"""The CUDA checkpoint driver: pause a process's CUDA work, move its GPU memory into host memory, and put
it back on a GPU of our choice, through cuda-core's ``cuda.core.checkpoint.Process``.

States of a process, as the driver reports them: ``running`` -> lock -> ``locked`` -> checkpoint ->
``checkpointed`` -> restore(mapping) -> ``locked`` -> unlock -> ``running``. A checkpointed process holds
no GPU memory and no /dev/nvidia* files, so CRIU can dump it like any other.

This runs in the server, on another process's PID: never inside the kernel. cuda-core is an optional
dependency (the ``gpu`` extra); without it, or without a driver that has the checkpoint API, every
entry point raises :class:`CudaUnavailable` saying what to install.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterable
from typing import Any

from .errors import CudaCheckpointFailed, CudaUnavailable

RUNNING, LOCKED, CHECKPOINTED, FAILED = "running", "locked", "checkpointed", "failed"
#: Driver branch from which a restore may remap onto other GPUs (docs/internals.md, "Moving to another GPU").
MIN_DRIVER_FOR_REMAP = 580

_init_lock = threading.Lock()
_module: Any = None


def _checkpoint_module() -> Any:
    """``cuda.core.checkpoint``, with the driver initialised in this process (restore needs cuInit)."""
    global _module
    with _init_lock:
        if _module is None:
            try:
                module = importlib.import_module("cuda.core.checkpoint")
                driver = importlib.import_module("cuda.bindings.driver")
            except ImportError as exc:
                raise CudaUnavailable(
                    f"cuda.core.checkpoint cannot be imported ({exc}): install cuda-core >= 1.2 in the "
                    "Jupyter server's environment (pip install 'jupyter-gpumigrate[gpu]')."
                ) from exc
            (err,) = driver.cuInit(0)
            if int(err) != 0:
                raise CudaUnavailable(
                    f"The CUDA driver does not initialise in the server process (cuInit: {err!r}): check the "
                    "NVIDIA driver with nvidia-smi."
                )
            _module = module
    return _module


def ensure_available() -> None:
    """Raise :class:`CudaUnavailable`, saying what to install, unless the checkpoint API can be used here."""
    _checkpoint_module()


def cuda_uuid(nvml_uuid: str) -> str:
    """The UUID as CUDA takes it: NVML's ``GPU-xxxxxxxx-...`` without its prefix."""
    return nvml_uuid.removeprefix("GPU-")


def gpu_mapping(all_uuids: Iterable[str], moves: dict[str, str]) -> dict[str, str]:
    """The restore mapping that sends each GPU of ``moves`` (source -> target) to its target.

    The driver wants a pair for every GPU it sees (a single pair is refused), each GPU used once as a
    destination: so every other GPU maps to itself where it can, and the GPUs left without a source
    (sources that are no one's target) take the targets left, in order. A single move swaps source and
    target; GPUs 0 and 1 swapped is ``{0: 1, 1: 0}`` and nothing else moves.
    """
    uuids = [cuda_uuid(u) for u in all_uuids]
    wanted = {cuda_uuid(s): cuda_uuid(t) for s, t in moves.items()}
    missing = (set(wanted) | set(wanted.values())) - set(uuids)
    if missing:
        raise ValueError(f"GPU {', '.join(sorted(missing))} is not among the GPUs the driver sees")
    if len(set(wanted.values())) != len(wanted):
        raise ValueError("two GPUs cannot be moved onto the same GPU")
    mapping = dict(wanted)
    left = [u for u in uuids if u not in set(wanted.values())]  # destinations no one takes yet
    rest = [u for u in uuids if u not in mapping]
    for uuid in rest:
        if uuid in left:
            mapping[uuid] = uuid
            left.remove(uuid)
    for uuid in rest:
        if uuid not in mapping:
            mapping[uuid] = left.pop(0)
    return mapping


class CudaProcess:
    """One process's CUDA checkpoint state. Each call raises :class:`CudaCheckpointFailed` with a
    sentence that says which step failed on which process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._process = _checkpoint_module().Process(pid)

    def _call(self, what: str, fn: Any, *args: Any, remedy: str = "") -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # cuda-core raises CUDAError, RuntimeError, ValueError
            raise CudaCheckpointFailed(f"CUDA could not {what} process {self.pid}: {exc}."
                                       + (f" {remedy}" if remedy else ""), self.pid) from exc

    @property
    def state(self) -> str:
        """``running``, ``locked``, ``checkpointed`` or ``failed``, whether cuda-core says it as a string or
        as an enum member (``CU_PROCESS_STATE_RUNNING``)."""
        raw = self._call("read the checkpoint state of", lambda: self._process.state)
        name = str(getattr(raw, "name", None) or raw).lower().rsplit(".", 1)[-1]
        return name.removeprefix("cu_process_state_")

    def lock(self, timeout: float) -> None:
        """Block the process's CUDA calls, once the GPU work in flight has finished (at most ``timeout`` s)."""
        self._call(f"lock (within {timeout:.0f} s)", self._process.lock, max(1, int(timeout * 1000)),
                   remedy="Its GPU work in flight did not finish in time: retry when the running cell is done, "
                   "or raise c.MigratableProvisioner.gpu_lock_timeout.")

    def checkpoint(self) -> None:
        """Copy the locked process's GPU memory into its host memory and release the GPU."""
        self._call("checkpoint", self._process.checkpoint,
                   remedy="The kernel's host memory must grow by what it holds on the GPU: check free RAM "
                   "(free -g) and that the kernel uses nothing the driver cannot checkpoint (MPS, CUDA IPC "
                   "memory shared with another process, NVML handles opened by the kernel's own code).")

    def restore(self, mapping: dict[str, str] | None = None) -> None:
        """Put the checkpointed process back on the GPUs, moved as ``mapping`` says (None: where it was)."""
        self._call("restore", self._process.restore, mapping,
                   remedy="Check the target GPU with nvidia-smi (free memory, persistence mode on).")

    def unlock(self) -> None:
        self._call("unlock", self._process.unlock)


def is_cuda_process(pid: int) -> bool:
    """True if the driver knows ``pid`` as a CUDA process (running, locked or checkpointed)."""
    try:
        return CudaProcess(pid).state in (RUNNING, LOCKED, CHECKPOINTED)
    except (CudaCheckpointFailed, CudaUnavailable):
        return False
