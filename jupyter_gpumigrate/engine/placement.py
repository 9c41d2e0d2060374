"""Which GPU a kernel may go to: the one pre-flight of every operation, decided before anything is locked.

The operations (operations.py) check a request with it before they start, the plans check again in
their prepare phase, the kernel views list each GPU's verdict (:func:`targets`), drains pick the
roomiest other GPU (:func:`drain_target`), rollbacks the fallback GPU (:func:`same_model_with_room`),
and a peer host its own GPUs for a kernel coming there (peers.py).

Every refusal is a :class:`GpuError` whose sentence says what to do. The rules (docs/internals.md,
"What the CUDA driver can and cannot checkpoint"): the target must exist, differ from the source, be
the same chip model, have MIG off, and have room for what the kernel holds; remapping needs driver
>= 580; a kernel must hold a single GPU.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from . import gpus as gpus_mod
from . import proctree
from .cudackpt import MIN_DRIVER_FOR_REMAP
from .errors import GpuError
from .gpus import GpuInfo

#: Room kept free on the target beyond what the kernel holds: a restore that runs out of GPU memory
#: can leave the process stuck (cuda-checkpoint issue 44), so we never plan one close to the edge.
HEADROOM = 512 * 1024**2


@dataclass(frozen=True)
class Move:
    """A decided move: from ``source`` to ``target``, ``needed`` bytes of GPU memory."""

    source: GpuInfo
    target: GpuInfo
    needed: int


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def free(gpu: GpuInfo) -> int:
    return gpu.memory_total - gpu.memory_used


def held_by_tree(pid: int | None, gpus: list[GpuInfo]) -> list[dict]:
    """What the process tree under ``pid`` holds on each GPU: index, uuid, name, memory_used."""
    if not pid:
        return []
    held = gpus_mod.held_by(proctree.descendants(pid), gpus)
    for h in held:
        h["name"] = gpus[h["index"]].name
    return held


def same_model(gpus: list[GpuInfo], model: GpuInfo | str | None, exclude: Collection[int] = ()) -> list[GpuInfo]:
    """GPUs of ``model`` (a GPU, or its name) that answer NVML and have MIG off, roomiest first; none
    listed in ``exclude`` (indices), nor ``model`` itself."""
    if model is None:
        return []
    name = model if isinstance(model, str) else model.name
    skip = set(exclude) | ({model.index} if isinstance(model, GpuInfo) else set())
    found = [g for g in gpus if g.name == name and g.index not in skip and not g.mig_enabled and not g.error]
    return sorted(found, key=free, reverse=True)


def same_model_with_room(gpus: list[GpuInfo], model: GpuInfo | str | None, needed: int,
                         exclude: Collection[int] = ()) -> list[GpuInfo]:
    """:func:`same_model`, with room for ``needed`` bytes plus the headroom."""
    return [g for g in same_model(gpus, model, exclude) if free(g) >= needed + HEADROOM]


def gpu_by_index(gpus: list[GpuInfo], index: int) -> GpuInfo:
    """GPU ``index``, or a :class:`GpuError` saying which GPUs there are."""
    if not gpus:
        raise GpuError(f"GPU {index} cannot be used: this machine has no NVIDIA GPU (NVML sees none).")
    if not 0 <= index < len(gpus):
        raise GpuError(f"GPU {index} does not exist: this machine has GPUs 0 to {len(gpus) - 1}.")
    return gpus[index]


def _by_uuid(gpus: list[GpuInfo], uuid: str) -> GpuInfo | None:
    return next((g for g in gpus if g.uuid == uuid), None)


def source_gpu(gpus: list[GpuInfo], held: list[dict]) -> tuple[GpuInfo, int]:
    """The one GPU a kernel holds (from :func:`gpus.held_by`) and the bytes it holds there."""
    if not held:
        raise GpuError("The kernel holds no GPU memory, so there is nothing to move (CPU kernels stay put).")
    if len(held) > 1:
        where = " and ".join(str(h["index"]) for h in held)
        raise GpuError(
            f"The kernel holds memory on GPUs {where}; only a kernel on a single GPU can be moved. Free the "
            "other GPUs in the kernel (delete their tensors, then torch.cuda.empty_cache()) and try again."
        )
    gpu = _by_uuid(gpus, held[0]["uuid"])
    if gpu is None:
        raise GpuError(f"GPU {held[0]['uuid']} that the kernel holds is no longer listed by NVML.")
    return gpu, int(held[0]["memory_used"])


def check_target(source: GpuInfo | None, target: GpuInfo, needed: int, driver_major: int | None) -> None:
    """Refuse a target that cannot take a kernel of ``needed`` bytes coming from ``source``."""
    if target.error:
        raise GpuError(f"GPU {target.index} does not answer NVML ({target.error}): check it with nvidia-smi, "
                       "or pick another GPU.")
    if source is not None and target.uuid == source.uuid:
        raise GpuError(f"The kernel is already on GPU {target.index}: pick another GPU to move it to.")
    if target.mig_enabled or (source is not None and source.mig_enabled):
        which = target if target.mig_enabled else source
        assert which is not None
        raise GpuError(
            f"MIG is enabled on GPU {which.index}: processes on MIG instances cannot be checkpointed. Pick "
            "GPUs with MIG off (nvidia-smi -mig 0)."
        )
    if source is not None and target.name != source.name:
        raise GpuError(
            f"GPU {target.index} is an {target.name}, the kernel's GPU {source.index} an {source.name}: CUDA "
            "moves a process only between GPUs of the same model. Pick a GPU of the same model, or transplant "
            "the kernel's objects there (%migrate --to-gpu N --transplant, jupyter gpumigrate transplant: it "
            "says first what would not carry)."
        )
    if source is not None and (driver_major is None or driver_major < MIN_DRIVER_FOR_REMAP):
        raise GpuError(
            f"The NVIDIA driver is {driver_major or 'unknown'}; moving a kernel to another GPU needs driver "
            f"{MIN_DRIVER_FOR_REMAP} or newer. Update the driver (suspend and resume on the same GPU work "
            "with this one)."
        )
    room = free(target)
    if room < needed + HEADROOM:
        raise GpuError(
            f"GPU {target.index} has {gb(room)} free and the kernel needs {gb(needed)} (plus "
            f"{gb(HEADROOM)} of headroom): free memory there or pick another GPU (jupyter gpumigrate list)."
        )


def plan_move(gpus: list[GpuInfo], held: list[dict], to_gpu: int, driver_major: int | None) -> Move:
    """Check a live move of a kernel holding ``held`` to GPU ``to_gpu``."""
    target = gpu_by_index(gpus, to_gpu)
    source, needed = source_gpu(gpus, held)
    check_target(source, target, needed, driver_major)
    return Move(source, target, needed)


def plan_resume(
    gpus: list[GpuInfo], suspended_on: dict, to_gpu: int | None, driver_major: int | None
) -> Move:
    """Where a suspended GPU kernel comes back: ``to_gpu``, else where it was, else the GPU with the most
    free memory. ``suspended_on`` is the manifest's record of its GPU: index, uuid, name, memory_used."""
    needed = int(suspended_on.get("memory_used", 0))
    was = _by_uuid(gpus, suspended_on["uuid"])
    if to_gpu is not None:
        target = gpu_by_index(gpus, to_gpu)
    elif was is not None and free(was) >= needed + HEADROOM:
        target = was
    else:
        same_model = [g for g in gpus if g.name == suspended_on.get("name") and not g.mig_enabled]
        if not same_model:
            raise GpuError(
                f"No GPU here is an {suspended_on.get('name')}, the model the kernel was suspended on: it "
                "can be resumed only on a GPU of that model."
            )
        # The roomiest; if none has room, check_target below says so for the roomiest.
        target = (same_model_with_room(gpus, str(suspended_on.get("name")), needed)
                  or sorted(same_model, key=free, reverse=True))[0]
    if target is was:
        check_target(None, target, needed, driver_major)
        return Move(target, target, needed)
    # Coming back elsewhere is a remap: the same rules as a live move, from a GPU that is not ours now.
    source = was or GpuInfo(
        index=int(suspended_on.get("index", -1)), uuid=suspended_on["uuid"], name=suspended_on.get("name", ""),
        memory_total=0, memory_used=0, utilization=None, persistence_mode=None, mig_enabled=False,
    )
    check_target(source, target, needed, driver_major)
    return Move(source, target, needed)


def targets(gpus: list[GpuInfo], held: list[dict], suspended_on: list[dict], state: str,
            driver_major: int | None) -> list[dict]:
    """Each GPU, and whether a kernel can go there now (a live move if it is ``running``, a resume if
    ``suspended``), with the refusal's sentence if not: the same rules the operation checks."""
    listed = []
    for gpu in gpus:
        try:
            if state == "suspended":
                plan_resume(gpus, suspended_on[0], gpu.index, driver_major)
            elif state == "running":
                plan_move(gpus, held, gpu.index, driver_major)
            else:
                continue
            listed.append({"index": gpu.index, "ok": True, "reason": None})
        except GpuError as exc:
            listed.append({"index": gpu.index, "ok": False, "reason": str(exc)})
    return listed


def drain_target(gpus: list[GpuInfo], index: int, kernel_id: str,
                 draining: Collection[int] = ()) -> int:
    """Where a drain of GPU ``index`` sends a kernel: the roomiest other GPU of the same model, never one
    being drained. The move itself checks the room."""
    others = same_model(gpus, gpu_by_index(gpus, index), exclude=draining)
    if not others:
        raise GpuError(f"There is no other GPU of the same model to move kernel {kernel_id} to.")
    return others[0].index
