"""Which GPU a kernel may go to: the one pre-flight of every operation, decided before anything is locked.

The operations (operations.py) check a request with it before they start, the plans check again in
their prepare phase, the kernel views list each GPU's verdict (:func:`targets`), drains pick the
roomiest other GPU (:func:`drain_target`), or where the driver cannot take a kernel and the drain may
transplant it, the roomiest GPU of any model, else the CPU (:func:`transplant_target`), rollbacks the fallback GPU (:func:`same_model_with_room`),
and a peer host its own GPUs for a kernel coming there (peers.py).

Every refusal is a :class:`GpuError` whose sentence says what to do. The rules (docs/internals.md,
"What the CUDA driver can and cannot checkpoint"): the target must exist, differ from the source, be
the same chip model, have MIG off, and have room for what the kernel holds; remapping needs driver
>= 580. A kernel on several GPUs moves them together, each to the GPU named for it (:class:`Move`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from . import gpus as gpus_mod
from . import proctree
from .cudackpt import MIN_DRIVER_FOR_REMAP
from .errors import GpuError
from .gpus import GpuInfo

#: Room kept free on the target beyond what the kernel holds: a restore that runs out of GPU memory
#: can leave the process stuck (cuda-checkpoint issue 44), so we never plan one close to the edge.
HEADROOM = 512 * 1024**2
#: A transplant onto a GPU leaves this much of it free beside the objects (the new process's CUDA context
#: and allocator).
TRANSPLANT_HEADROOM = 2 * 10**9


@dataclass(frozen=True)
class Pair:
    """One GPU of a move: what the kernel holds on ``source`` (``needed`` bytes) goes to ``target``."""

    source: GpuInfo
    target: GpuInfo
    needed: int


@dataclass(frozen=True)
class Move:
    """A decided move of every GPU a kernel holds, in the order of the sources' indices: one pair for a
    kernel on one GPU, one per GPU for a kernel on several."""

    pairs: tuple[Pair, ...]

    @property
    def source(self) -> GpuInfo:
        """The first source (the only one of a kernel on one GPU)."""
        return self.pairs[0].source

    @property
    def target(self) -> GpuInfo:
        return self.pairs[0].target

    @property
    def needed(self) -> int:
        """Bytes of GPU memory the kernel holds, on all its GPUs."""
        return sum(p.needed for p in self.pairs)

    @property
    def several(self) -> bool:
        return len(self.pairs) > 1

    @property
    def from_gpus(self) -> list[int]:
        return [p.source.index for p in self.pairs]

    @property
    def to_gpus(self) -> list[int]:
        return [p.target.index for p in self.pairs]

    def assignment(self) -> dict[str, str]:
        """Source UUID -> target UUID, for every GPU the kernel holds."""
        return {p.source.uuid: p.target.uuid for p in self.pairs}

    def describe(self) -> str:
        return ", ".join(f"GPU {p.source.index} -> {p.target.index}" for p in self.pairs)


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


def _indices(indices: list[int]) -> str:
    words = [str(i) for i in indices]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def sources(gpus: list[GpuInfo], held: list[dict]) -> list[tuple[GpuInfo, int]]:
    """Each GPU a kernel holds (from :func:`gpus.held_by`) and the bytes it holds there, by index."""
    if not held:
        raise GpuError("The kernel holds no GPU memory, so there is nothing to move (CPU kernels stay put).")
    found = []
    for h in sorted(held, key=lambda h: int(h["index"])):
        gpu = _by_uuid(gpus, h["uuid"])
        if gpu is None:
            raise GpuError(f"GPU {h['uuid']} that the kernel holds is no longer listed by NVML.")
        found.append((gpu, int(h["memory_used"])))
    return found


def source_gpu(gpus: list[GpuInfo], held: list[dict]) -> tuple[GpuInfo, int]:
    """The one GPU a kernel holds and the bytes it holds there, for what takes a kernel on one GPU only
    (a transplant)."""
    found = sources(gpus, held)
    if len(found) > 1:
        where = _indices([g.index for g, _ in found])
        raise GpuError(
            f"The kernel holds memory on GPUs {where}; a transplant takes a kernel on a single GPU. Free the "
            "other GPUs in the kernel (delete their tensors, then torch.cuda.empty_cache()) and try again; "
            "between GPUs of its own model the driver moves every GPU at once (--to-gpu with a GPU for each)."
        )
    return found[0]


def wanted_gpus(to: int | Sequence[int], holds: list[int], gpus: list[GpuInfo]) -> list[GpuInfo]:
    """The target of each GPU the kernel holds (``holds``, by index): ``to`` names one GPU, or one per
    GPU held in that order. Refused when the count is wrong or a GPU is named twice."""
    named = [to] if isinstance(to, int) else list(to)
    targets = [gpu_by_index(gpus, i) for i in named]
    if len(named) != len(holds):
        where = _indices(holds)
        example = ",".join(str(i) for i in reversed(holds))
        if len(named) == 1:
            raise GpuError(f"The kernel holds GPUs {where}: name a GPU for each, in that order (to_gpus "
                           f"[{example.replace(',', ', ')}]; --to-gpu {example}), and the driver moves them together.")
        raise GpuError(f"{len(named)} GPUs were named, but the kernel holds {len(holds)} (GPU{'s' * (len(holds) > 1)} "
                       f"{where}): name one GPU for each, in that order.")
    twice = next((i for i in named if named.count(i) > 1), None)
    if twice is not None:
        raise GpuError(f"GPU {twice} is named twice: each GPU the kernel holds needs a GPU of its own.")
    return targets


def check_target(source: GpuInfo | None, target: GpuInfo, needed: int, driver_major: int | None,
                 freed: int = 0) -> None:
    """Refuse a target that cannot take a kernel of ``needed`` bytes coming from ``source``; ``freed``:
    bytes the kernel itself holds on the target now, which the move frees first (GPUs swapped)."""
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
    room = free(target) + freed
    if room < needed + HEADROOM:
        raise GpuError(
            f"GPU {target.index} has {gb(room)} free and the kernel needs {gb(needed)} (plus "
            f"{gb(HEADROOM)} of headroom): free memory there or pick another GPU (jupyter gpumigrate list)."
        )


def plan_move(gpus: list[GpuInfo], held: list[dict], to: int | Sequence[int], driver_major: int | None) -> Move:
    """Check a live move of a kernel holding ``held`` to GPU ``to``, or, for a kernel on several GPUs,
    to the GPUs ``to`` names, one for each GPU it holds, in the order of their indices."""
    if isinstance(to, int):
        gpu_by_index(gpus, to)
    found = sources(gpus, held)
    targets = wanted_gpus(to, [g.index for g, _ in found], gpus)
    if all(g.uuid == t.uuid for (g, _), t in zip(found, targets)):
        if len(found) == 1:
            raise GpuError(f"The kernel is already on GPU {targets[0].index}: pick another GPU to move it to.")
        raise GpuError(f"The kernel is already on GPUs {_indices([t.index for t in targets])}, in that order: name "
                       "them in another order, or other GPUs.")
    holds = {g.uuid: n for g, n in found}
    for (source, needed), target in zip(found, targets):
        if source.uuid != target.uuid:
            check_target(source, target, needed, driver_major, freed=holds.get(target.uuid, 0))
    return Move(tuple(Pair(g, t, n) for (g, n), t in zip(found, targets)))


def plan_resume(gpus: list[GpuInfo], suspended_on: list[dict] | dict, to: int | Sequence[int] | None,
                driver_major: int | None, avoid: Collection[int] = ()) -> Move:
    """Where a suspended GPU kernel comes back: onto ``to`` (a GPU, or one per GPU it held), else where it
    was, else onto the GPUs of its model with the most free memory; never, unless named, onto a GPU of
    ``avoid`` (indices: GPUs being drained). ``suspended_on`` is the manifest's record of its GPUs: index,
    uuid, name, memory_used each."""
    records = [suspended_on] if isinstance(suspended_on, dict) else sorted(suspended_on, key=lambda g: int(g["index"]))
    needed = [int(r.get("memory_used", 0)) for r in records]
    was = [_by_uuid(gpus, r["uuid"]) for r in records]
    if to is not None:
        targets = wanted_gpus(to, [int(r["index"]) for r in records], gpus)
    else:
        targets = _resume_targets(gpus, records, was, needed, avoid)
    pairs = []
    for record, old, target, n in zip(records, was, targets, needed):
        if old is not None and target.uuid == old.uuid:
            check_target(None, target, n, driver_major)
            pairs.append(Pair(target, target, n))
            continue
        # Coming back elsewhere is a remap: the same rules as a live move, from a GPU that is not ours now.
        source = old or GpuInfo(
            index=int(record.get("index", -1)), uuid=record["uuid"], name=record.get("name", ""),
            memory_total=0, memory_used=0, utilization=None, persistence_mode=None, mig_enabled=False,
        )
        check_target(source, target, n, driver_major)
        pairs.append(Pair(source, target, n))
    return Move(tuple(pairs))


def _resume_targets(gpus: list[GpuInfo], records: list[dict], was: list[GpuInfo | None],
                    needed: list[int], avoid: Collection[int] = ()) -> list[GpuInfo]:
    """Each GPU back where it was if that has room and is not in ``avoid``; the others onto the roomiest GPUs
    of their model not taken yet nor avoided (if none has room, the roomiest, and check_target says so)."""
    chosen: list[GpuInfo | None] = [g if g is not None and g.index not in avoid and free(g) >= n + HEADROOM
                                    else None for g, n in zip(was, needed)]
    for i, record in enumerate(records):
        if chosen[i] is not None:
            continue
        taken = {g.index for g in chosen if g is not None}
        model = str(record.get("name"))
        candidates = same_model(gpus, model, exclude=taken | set(avoid))
        if not candidates and same_model(gpus, model, exclude=taken):
            drained = ", ".join(str(i) for i in sorted(g.index for g in same_model(gpus, model, exclude=taken)))
            raise GpuError(f"The GPUs of the kernel's model ({model}) that could take it are being drained (GPU "
                           f"{drained}): no kernel is sent there until the drain is over. Try again then; the "
                           "kernel stays as it is.")
        if not candidates:
            if len(records) > 1 and any(g.name == model for g in gpus):
                raise GpuError(f"The kernel held {len(records)} GPUs ({model}); this machine has too few of that "
                               "model free of MIG to take them all: it can be resumed only on as many.")
            raise GpuError(
                f"No GPU here is an {record.get('name')}, the model the kernel was suspended on: it "
                "can be resumed only on a GPU of that model."
            )
        with_room = [g for g in candidates if free(g) >= needed[i] + HEADROOM]
        chosen[i] = (with_room or candidates)[0]
    return [g for g in chosen if g is not None]


def targets(gpus: list[GpuInfo], held: list[dict], suspended_on: list[dict], state: str,
            driver_major: int | None, draining: Collection[int] = ()) -> list[dict]:
    """Each GPU, and whether a kernel can go there now (a live move if it is ``running``, a resume if
    ``suspended``), with the refusal's sentence if not: the same rules the operation checks, ``draining``
    (indices: GPUs being drained, where the operation sends no kernel) among them."""
    listed = []
    for gpu in gpus:
        try:
            if state == "suspended":
                plan_resume(gpus, suspended_on, gpu.index, driver_major)
            elif state == "running":
                plan_move(gpus, held, gpu.index, driver_major)
            else:
                continue
            if gpu.index in draining:
                raise GpuError(f"GPU {gpu.index} is being drained: no kernel is sent there until it is over.")
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


def transplant_target(gpus: list[GpuInfo], index: int, needed: int, draining: Collection[int] = ()) -> int | None:
    """Where a drain of GPU ``index`` that may transplant sends a kernel the driver cannot move: the GPU of
    any model with the most room for ``needed`` bytes of tensors and the transplant's headroom, never the
    drained GPU nor one being drained, nor one split into MIG instances or not answering NVML; None: no GPU
    has room, so the CPU."""
    skip = {index, *draining}
    fits = [g for g in gpus if g.index not in skip and not g.mig_enabled and not g.error
            and free(g) >= needed + TRANSPLANT_HEADROOM]
    return max(fits, key=free).index if fits else None
