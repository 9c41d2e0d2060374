"""GPU inventory through NVML (nvidia-ml-py), read in the server process, never inside a kernel.

NVML handles held by a process block its CUDA checkpoint (NVIDIA's CRIU plugin notes), so kernels
never call this; the server does. With no driver or no GPU, every call answers "no GPUs", no error.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass, field

try:
    import pynvml
except ImportError:  # nvidia-ml-py is a dependency, but keep the server up without it
    pynvml = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


@dataclass
class GpuInfo:
    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    utilization: int | None
    persistence_mode: bool | None
    mig_enabled: bool
    #: PID -> bytes of GPU memory, for every compute process NVML sees on this GPU.
    processes: dict[int, int] = field(default_factory=dict)
    #: NVML's error when this GPU does not answer (lost, fallen off the bus): it is listed, never chosen.
    error: str | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["processes"] = [{"pid": pid, "memory_used": used} for pid, used in self.processes.items()]
        return data


_lock = threading.Lock()
_initialised = False


def _init() -> bool:
    """Initialise NVML once; False when there is no driver."""
    global _initialised
    if pynvml is None:
        return False
    with _lock:
        if not _initialised:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError:
                return False
            _initialised = True
    return True


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def driver_version() -> str | None:
    """The NVIDIA driver version, or None with no driver."""
    if not _init():
        return None
    return _text(pynvml.nvmlSystemGetDriverVersion())


def driver_major() -> int | None:
    version = driver_version()
    return int(version.split(".")[0]) if version else None


def _maybe(call, *args, default=None):
    try:
        return call(*args)
    except pynvml.NVMLError:
        return default


def one_context_only(uuid: str) -> bool:
    """Whether the GPU ``uuid`` takes one process's CUDA context at a time (NVML's compute mode
    exclusive-process, or prohibited): a helper's context there would keep the kernel's out. False when NVML
    cannot tell."""
    if not _init():
        return False
    try:
        mode = pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    except pynvml.NVMLError:
        return False
    return mode in (pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, pynvml.NVML_COMPUTEMODE_PROHIBITED)


def snapshot() -> list[GpuInfo]:
    """Every GPU the driver sees, in NVML index order; empty without a driver."""
    if not _init():
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError as exc:
        log.warning("NVML cannot count the GPUs (%s): listing none", exc)
        return []
    gpus = []
    for index in range(count):
        uuid = f"unknown-{index}"
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = _text(pynvml.nvmlDeviceGetName(handle))
        except pynvml.NVMLError as exc:
            # One failing GPU must not hide the others (every list and every move reads this).
            log.warning("NVML cannot read GPU %s: %s", index, exc)
            gpus.append(GpuInfo(index=index, uuid=uuid, name="unknown", memory_total=0, memory_used=0,
                                utilization=None, persistence_mode=None, mig_enabled=False, error=str(exc)))
            continue
        util = _maybe(pynvml.nvmlDeviceGetUtilizationRates, handle)
        mig = _maybe(pynvml.nvmlDeviceGetMigMode, handle, default=(0, 0))
        persistence = _maybe(pynvml.nvmlDeviceGetPersistenceMode, handle)
        procs = _maybe(pynvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[]) or []
        gpus.append(
            GpuInfo(
                index=index,
                uuid=uuid,
                name=name,
                memory_total=int(memory.total),
                memory_used=int(memory.used),
                utilization=int(util.gpu) if util is not None else None,
                persistence_mode=bool(persistence) if persistence is not None else None,
                mig_enabled=bool(mig[0]),
                processes={int(p.pid): int(p.usedGpuMemory or 0) for p in procs},
            )
        )
    return gpus


def peer_access(a: GpuInfo, b: GpuInfo) -> bool | None:
    """Whether GPUs ``a`` and ``b`` read each other's memory directly (NVLink, or PCIe peer-to-peer), as
    NVML says; None if it cannot tell."""
    if not _init():
        return None
    try:
        first = pynvml.nvmlDeviceGetHandleByUUID(a.uuid)
        second = pynvml.nvmlDeviceGetHandleByUUID(b.uuid)
        # nvidia-ml-py spells the index NVML_P2P_CAPS_INDEX_READ = 0, (a tuple): the C enum's value is 0.
        status = pynvml.nvmlDeviceGetP2PStatus(first, second, 0)
    except (pynvml.NVMLError, AttributeError) as exc:
        log.info("NVML cannot say whether GPUs %s and %s have peer access: %s", a.index, b.index, exc)
        return None
    return int(status) == pynvml.NVML_P2P_STATUS_OK


def held_by(pids: list[int], gpus: list[GpuInfo]) -> list[dict]:
    """The GPUs on which any of ``pids`` holds memory: index, uuid and bytes used."""
    held = []
    for gpu in gpus:
        used = sum(gpu.processes.get(pid, 0) for pid in pids)
        if any(pid in gpu.processes for pid in pids):
            held.append({"index": gpu.index, "uuid": gpu.uuid, "memory_used": used})
    return held
