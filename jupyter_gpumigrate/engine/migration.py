"""The story of a migration, told as plans of phases, each with its undo.

    suspend:          prepare -> [lock -> checkpoint] -> dump
    resume:           prepare -> restore -> [remap -> unlock] -> adopt
    move to a GPU:    prepare -> [stash] -> lock -> checkpoint -> remap -> unlock -> [unstash] -> verify
    move to a host:   prepare -> [lock -> checkpoint] -> dump -> transfer -> restore (there) -> adopt
    come back home:   prepare -> dump (there) -> transfer -> restore -> [remap -> unlock] -> adopt

A kernel is a process tree. To suspend it we write the tree to an image directory with CRIU, which
kills it; to resume it CRIU recreates the tree from the images with the same PIDs, and the kernel
manager adopts the new root. The bracketed GPU phases join the plan when the kernel holds a GPU:
CUDA's checkpoint API locks the process's CUDA calls (after the GPU work in flight), moves its GPU
memory into its host memory and frees the GPU; later it puts the memory back on a GPU of our choice
(the remap) and unlocks. A live move to another GPU is those GPU phases alone, on the running process:
the cell that runs goes on, on the new GPU, and torch still calls it cuda:0. The driver copies at a
few GB/s, so when the kernel can (an idle PyTorch kernel, or one that runs %migrate) its large tensors
first go into a stash on the target GPU over the GPUs' peer link, and come back from there once the
kernel is on it (stash.py): the driver then moves only the rest.

A move to another host is a suspend whose images travel: the other host (a :class:`HostLink`) checks
first that it can take the tree, receives the images, restores them (onto one of its GPUs), and this
host keeps the kernel's ports and relays them there, so its clients never notice. This host keeps its
copy of the images until the kernel answers from there: any failure before that brings the kernel
back here, from that copy. Coming back is the same with the roles swapped.

If any phase fails, the phases already done are undone in reverse order, and the kernel is left as it
was before: running if it was running (a dump that fails leaves the tree running; a failure after
the dump restores it from the images), suspended with its images kept if it was suspended.
Nothing in this file knows about Jupyter: the kernel is anything that fits :class:`KernelProcess`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from pathlib import Path

from . import gpus as gpus_mod
from . import hostfit, netstate, placement, proctree
from .criu import Criu
from .cudackpt import CudaProcess, gpu_mapping
from .errors import CriuFailed, GpuError, ImageError, InvalidState, MigrateError, PidConflict
from .gpus import GpuInfo
from .images import ImageStore, Manifest
from .placement import Move
from .stash import MIN_STASH, Stash
from .plan import Phase, Plan, PlanResult, ProgressCallback

log = logging.getLogger(__name__)

RUNNING, MIGRATING, SUSPENDED, STOPPED = "running", "migrating", "suspended", "stopped"
#: runs on another host; this host relays its channels there
REMOTE = "remote"


@contextmanager
def migrating(kernel: KernelProcess, otherwise: str) -> Iterator[None]:
    """Mark the kernel as migrating; if what follows fails, it is ``otherwise`` again (a prepare phase that
    fails is not undone by its plan, so it must leave the kernel as it found it)."""
    kernel.state = MIGRATING
    try:
        yield
    except BaseException:
        kernel.state = otherwise
        raise


class KernelProcess(Protocol):
    """What a migration needs of the kernel it moves (the provisioner implements it)."""

    kernel_id: str
    state: str

    @property
    def kernel_name(self) -> str: ...

    @property
    def kernel_pid(self) -> int | None: ...

    @property
    def kernel_connection_info(self) -> dict: ...

    def release(self) -> None:
        """The tree was dumped and killed: collect the dead root and forget it."""

    def adopt(self, pid: int) -> None:
        """A restored tree rooted at ``pid`` is the kernel from now on."""

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the restored kernel serves its clients again; False if it did not in time."""

    def release_gpu_cache(self) -> None:
        """If the kernel is idle and can, free the GPU memory it caches but does not use (best effort)."""

    def invite_stager(self, path: str, token: str) -> str | None:
        """If the kernel is idle and can, have it connect to the fast path's socket at ``path`` (see
        stash.py) and serve it; None if invited, else why not."""

    def adopt_remote(self, link: HostLink, placed: dict) -> None:
        """The kernel runs on ``link``'s host now (``placed``: what that host said of it, its GPU)."""


class HostLink(Protocol):
    """Another host, as a move of one kernel needs it (the server extension implements it over HTTPS).

    Each method raises a :class:`MigrateError` whose message says what went wrong there.
    """

    host: str

    def check(self, requirements: hostfit.Requirements, gpu: dict | None, to_gpu: int | None) -> None:
        """Refuse, with every reason, if that host cannot restore the tree (PIDs, ports, files, GPU)."""

    def send_images(self, images: Path) -> int:
        """Copy the image folder there; the bytes sent."""

    def restore(self, to_gpu: int | None) -> dict:
        """Restore the kernel there from the images sent (and onto its GPU); what it says of it."""

    def discard(self) -> None:
        """Kill the kernel there if it runs, and delete its images there."""

    def attach(self, clients: dict | None = None) -> None:
        """Bind the kernel's ports here and relay them to the kernel there; then wait (briefly) until
        ``clients`` (port -> how many) are connected to them again."""

    def detach(self) -> None:
        """Stop relaying and free the kernel's ports here."""

    def requirements(self) -> hostfit.Requirements:
        """What the tree running there needs of a host."""

    def dump(self) -> None:
        """Suspend the kernel there; its images stay there."""

    def resume(self) -> None:
        """Undo of :meth:`dump`: bring the kernel back to life there."""

    def fetch_images(self, images: Path) -> int:
        """Copy the kernel's images from there into ``images``; the bytes received."""


@dataclass
class Outcome:
    """What a finished plan did: phase timings, bytes written, read or moved, and where it went."""

    result: PlanResult
    bytes: int = 0
    manifest: Manifest | None = None
    extra: dict = field(default_factory=dict)


class GpuState:
    """The CUDA side of a kernel during one plan: its CUDA processes and where their memory is.

    Each step has its undo next to it; the plans below pair them into phases.
    """

    def __init__(self, pids: list[int], lock_timeout: float, inventory: Callable[[], list[GpuInfo]]) -> None:
        self.pids = pids
        self.lock_timeout = lock_timeout
        self.inventory = inventory
        self.home: str | None = None  # UUID of the GPU the kernel must be on if all is undone
        self.needed = 0  # bytes of GPU memory it holds
        self._at: dict[int, str] = {}  # per process: UUID of the GPU its checkpointed memory belongs to
        self._at_all: str | None = None

    @property
    def at(self) -> str | None:
        """Where the checkpointed memory belongs (set once for all processes; tracked per process after)."""
        return self._at_all

    @at.setter
    def at(self, uuid: str | None) -> None:
        self._at_all = uuid
        self._at = {pid: uuid for pid in self.pids} if uuid else {}

    def holds_gpu(self) -> bool:
        return bool(self.pids)

    def runs(self) -> bool:
        """Whether every CUDA process of the kernel runs (neither locked nor checkpointed), as the driver says."""
        try:
            return all(CudaProcess(pid).state == "running" for pid in self.pids)
        except MigrateError:
            return False

    def _each(self, step: Callable[[CudaProcess], None], back: Callable[[CudaProcess], None] | None = None) -> None:
        """``step`` on every CUDA process of the tree, all or none: if one fails, ``back`` undoes it on
        those already done, so that the plan's undo finds all of them in the same state."""
        done: list[CudaProcess] = []
        try:
            for pid in self.pids:
                process = CudaProcess(pid)
                step(process)
                done.append(process)
        except BaseException:
            for process in reversed(done if back else []):
                try:
                    back(process)  # type: ignore[misc]
                except Exception:  # the step's own error is the one to report
                    log.exception("could not undo a CUDA step on process %s", process.pid)
            raise

    def lock(self) -> None:
        self._each(lambda p: p.lock(self.lock_timeout), back=lambda p: p.unlock())

    def unlock(self) -> None:
        self._each(lambda p: p.unlock(), back=lambda p: p.lock(self.lock_timeout))

    def checkpoint(self) -> None:
        # A process just checkpointed goes back where it was with no mapping.
        self._each(lambda p: p.checkpoint(), back=lambda p: p.restore(None))

    def _mapping(self, source: str, target: str) -> dict[str, str] | None:
        # Every GPU the driver sees; one NVML cannot name is left out rather than named wrongly.
        known = [g.uuid for g in self.inventory() if not g.uuid.startswith("unknown-")]
        return None if source == target else gpu_mapping(known, source, target)

    def restore_to(self, target: str) -> None:
        """Put the checkpointed memory on ``target``: a remap if it was checkpointed elsewhere.

        If one process fails, those already restored are checkpointed again; their memory now
        belongs to ``target``, which is recorded per process, so that the undo maps each from the
        right GPU."""
        assert self._at_all is not None

        def restore(process: CudaProcess) -> None:
            process.restore(self._mapping(self._at.get(process.pid, self._at_all), target))  # type: ignore[arg-type]
            self._at[process.pid] = target

        self._each(restore, back=lambda p: p.checkpoint())
        self._at_all = target

    def restore_home(self) -> None:
        """Undo of a checkpoint: back onto the GPU the kernel came from; if that fails (it filled up
        meanwhile), onto another GPU of the same model with room, so that the kernel runs again."""
        assert self.home is not None
        try:
            self.restore_to(self.home)
            return
        except MigrateError as home_error:
            inventory = self.inventory()
            home = next((g for g in inventory if g.uuid == self.home), None)
            # A restore that runs out of GPU memory can leave a process stuck: only GPUs with room.
            others = [g for g in inventory if home is not None and g.uuid != home.uuid and g.name == home.name
                      and not g.mig_enabled and not g.error
                      and g.memory_total - g.memory_used >= self.needed + placement.HEADROOM]
            for other in sorted(others, key=lambda g: g.memory_used - g.memory_total):
                try:
                    self.restore_to(other.uuid)
                except MigrateError:
                    continue
                log.warning("kernel processes %s could not go back to GPU %s (%s); they run on GPU %s",
                            self.pids, home.index if home else "?", home_error, other.index)
                return
            raise

    def checkpoint_again(self) -> None:
        """Undo of a remap: take the memory off the target again, so it can go home."""
        self.checkpoint()


class LocalRestore:
    """Bringing a tree back here from its images: restore, [remap, unlock], adopt. A resume and a
    kernel coming home from another host end the same way; each says first where the images are."""

    def __init__(self, migration: Migration, images: Path, gpu: GpuState) -> None:
        self.migration = migration
        self.images = images
        self.gpu = gpu
        self.manifest: Manifest | None = None
        self.move: Move | None = None
        self.pid: int | None = None

    def place(self, manifest: Manifest, to_gpu: int | None, no_gpu: str) -> None:
        """Take ``manifest`` and choose its GPU (``to_gpu``, else where it was, else the roomiest);
        ``no_gpu`` is the sentence for a ``to_gpu`` asked of a kernel that holds none."""
        m = self.migration
        self.manifest = manifest
        if manifest.gpus:
            self.move = placement.plan_resume(m.inventory(), manifest.gpus[0], to_gpu, m.driver_major())
            self.gpu.pids, self.gpu.at = manifest.cuda_pids, manifest.gpus[0]["uuid"]
        elif to_gpu is not None:
            raise GpuError(no_gpu)

    def restore(self) -> None:
        assert self.manifest is not None and self.migration.criu is not None
        self.pid = self.migration.criu.restore(self.images, self.manifest.ids)

    def kill(self) -> None:
        # The images are intact: killing the half-restored tree leaves them as they were.
        if self.pid is not None:
            proctree.kill_tree(self.pid)
            proctree.wait_gone(self.pid, timeout=10)

    def remap(self) -> None:
        assert self.move is not None
        self.gpu.restore_to(self.move.target.uuid)

    def adopt(self) -> None:
        assert self.pid is not None and self.manifest is not None
        self.migration._adopt(self.pid, self.manifest)

    def phases(self, restore: Callable[[], None] | None = None, kill: Callable[[], None] | None = None) -> list[Phase]:
        on_gpu = self.gpu.holds_gpu
        return [
            Phase("restore", restore or self.restore, kill or self.kill),
            Phase("remap", self.remap, when=on_gpu),
            Phase("unlock", self.gpu.unlock, self.gpu.lock, when=on_gpu),
            Phase("adopt", self.adopt),
        ]

    @property
    def extra(self) -> dict:
        return {"to_gpu": self.move.target.index} if self.move else {}


class Migration:
    """Suspends, resumes and moves one kernel. Each method runs one plan and returns its :class:`Outcome`."""

    def __init__(
        self,
        kernel: KernelProcess,
        store: ImageStore,
        criu: Criu | None,
        progress: ProgressCallback | None = None,
        reconnect_timeout: float = 3.0,
        lock_timeout: float = 60.0,
        inventory: Callable[[], list[GpuInfo]] = gpus_mod.snapshot,
        driver_major: Callable[[], int | None] = gpus_mod.driver_major,
    ) -> None:
        self.kernel = kernel
        self.store = store
        self.criu = criu
        self.progress = progress
        self.reconnect_timeout = reconnect_timeout
        self.lock_timeout = lock_timeout
        self.inventory = inventory
        self.driver_major = driver_major

    def _gpu_use(self, pid: int) -> tuple[list[int], list[dict], list[GpuInfo]]:
        """The tree's processes that hold a GPU, what they hold (index, uuid, name, bytes), and the GPUs."""
        tree = proctree.descendants(pid)
        gpus = self.inventory()
        cuda_pids = sorted({p for g in gpus for p in g.processes if p in tree})
        held = gpus_mod.held_by(tree, gpus)
        for h in held:
            h["name"] = gpus[h["index"]].name
        return cuda_pids, held, gpus

    def _running_pid(self, verb: str) -> int:
        """The running kernel's PID; :class:`InvalidState` saying why it cannot be ``verb`` otherwise.
        Checked in each plan's prepare, not only by the caller: another request may have come meanwhile."""
        kernel = self.kernel
        if kernel.state != RUNNING:
            raise InvalidState(f"The kernel is {kernel.state}, not running: it cannot be {verb}.")
        pid = kernel.kernel_pid
        if pid is None or not proctree.is_alive(pid):
            raise InvalidState("The kernel process is not running: restart the kernel instead.")
        return pid

    def _release_cache(self, pid: int) -> None:
        # Freed-but-cached blocks of PyTorch's allocator would be moved too (8 GB live + 24 GB cached:
        # 29.2 s; after empty_cache: 7.2 s, FACTS.md). Ask the kernel to drop them, if it is idle.
        release = getattr(self.kernel, "release_gpu_cache", None)
        if release is not None:
            release()

    def _new_images(self, pid: int, gpu: GpuState) -> Manifest:
        """An empty image folder for the kernel, and the manifest of the tree under ``pid`` (which
        :class:`GpuState` ``gpu`` now knows the CUDA side of)."""
        kernel, criu = self.kernel, self.criu
        assert criu is not None
        if self._gpu_use(pid)[0]:
            self._release_cache(pid)
        gpu.pids, held, _ = self._gpu_use(pid)
        if len(held) > 1:
            placement.source_gpu(self.inventory(), held)  # raises: a single GPU only
        self.store.create(kernel.kernel_id)
        gpu.home = gpu.at = held[0]["uuid"] if held else None
        gpu.needed = int(held[0]["memory_used"]) if held else 0
        return Manifest(
            kernel_id=kernel.kernel_id,
            kernel_name=kernel.kernel_name,
            pid=pid,
            # Every PID and TID must be free again at restore: remember them to name a conflict.
            ids=proctree.tree_ids(pid),
            criu_version=criu.binary.version_string,
            gpus=held,
            cuda_pids=gpu.pids,
            connection_info=_public(kernel.kernel_connection_info),
            clients=netstate.client_counts(proctree.descendants(pid)),
        )

    def _dump(self, manifest: Manifest, images: Path, restore_from_images: Callable[[], None]) -> None:
        """Dump the tree and collect it; if what follows the dump fails, bring it back from the images."""
        assert self.criu is not None
        kernel = self.kernel
        # If CRIU fails, it resumes the tree: the kernel goes on running, untouched. Its log is
        # kept outside the images, which the rollback deletes.
        try:
            self.criu.dump(manifest.pid, images, log_path=self.store.log_path(kernel.kernel_id, "dump"))
        except CriuFailed as exc:
            raise CriuFailed(
                f"{exc} The kernel runs on, unchanged. If the log names a file, socket or device the kernel "
                "holds, close it in the notebook and try again.", exc.log_path, exc.log_tail) from exc
        try:
            kernel.release()
            proctree.reap_dumped(manifest.ids)
            self.store.write_manifest(images, manifest)
        except BaseException:
            # The tree is dead and its images complete (CRIU succeeded): bring it back from them.
            restore_from_images()
            raise

    # -- suspend -------------------------------------------------------------------------------------

    def suspend(self) -> Outcome:
        kernel, store, criu = self.kernel, self.store, self.criu
        assert criu is not None
        images = store.path_for(kernel.kernel_id)
        manifest: Manifest | None = None
        gpu = GpuState([], self.lock_timeout, self.inventory)

        def prepare() -> None:
            # Checked again here, not only by the caller: another request may have started meanwhile.
            pid = self._running_pid("suspended")
            with migrating(kernel, otherwise=RUNNING):
                prepare_images(pid)

        def prepare_images(pid: int) -> None:
            nonlocal manifest
            manifest = self._new_images(pid, gpu)

        def forget_images() -> None:
            store.remove(kernel.kernel_id, keep_logs=True)  # a failed dump's log says why
            kernel.state = RUNNING

        def dump() -> None:
            assert manifest is not None
            self._dump(manifest, images, restore_from_images)
            kernel.state = SUSPENDED

        def restore_from_images() -> None:
            # A later phase failed after the kernel was dumped and killed: bring it back as it was.
            assert manifest is not None
            kernel.state = MIGRATING
            self._adopt(criu.restore(images, manifest.ids), manifest)

        on_gpu = gpu.holds_gpu
        phases = [
            Phase("prepare", prepare, forget_images),
            Phase("lock", gpu.lock, gpu.unlock, when=on_gpu),
            Phase("checkpoint", gpu.checkpoint, gpu.restore_home, when=on_gpu),
            Phase("dump", dump, restore_from_images),
        ]
        result = Plan(phases, self.progress).run()
        assert manifest is not None
        return Outcome(result, bytes=manifest.image_bytes, manifest=manifest)

    # -- resume --------------------------------------------------------------------------------------

    def resume(self, to_gpu: int | None = None) -> Outcome:
        kernel, store, criu = self.kernel, self.store, self.criu
        assert criu is not None
        images = store.path_for(kernel.kernel_id)
        here = LocalRestore(self, images, GpuState([], self.lock_timeout, self.inventory))

        def prepare() -> None:
            if kernel.state != SUSPENDED:
                raise InvalidState(f"The kernel is {kernel.state}, not suspended: there is nothing to resume.")
            manifest = store.read_manifest(kernel.kernel_id)
            if manifest.kernel_id != kernel.kernel_id:
                raise ImageError(
                    f"The images in {images} belong to kernel {manifest.kernel_id}, not {kernel.kernel_id}."
                )
            here.place(manifest, to_gpu, f"The kernel held no GPU when it was suspended, so it cannot be resumed "
                                         f"onto GPU {to_gpu}: resume it without to_gpu.")
            # CRIU gives every process and thread its old number back. Keep new processes off those
            # numbers, and say who holds one, if any, before CRIU starts (it would say "File exists").
            proctree.steer_pid_allocation(manifest.ids)
            holder = proctree.first_holder(manifest.ids)
            if holder is not None:
                raise PidConflict(
                    f"Cannot resume yet: PID {holder.pid}, which the kernel used, is now taken by "
                    f"{holder.describe()}. Stop that process (or wait until it exits), then resume "
                    f"again; the kernel's images are kept.",
                    holder.pid,
                    holder.describe(),
                )
            kernel.state = MIGRATING

        def back_to_suspended() -> None:
            kernel.state = SUSPENDED

        phases = [Phase("prepare", prepare, back_to_suspended), *here.phases()]
        result = Plan(phases, self.progress).run()
        assert here.manifest is not None
        # The kernel runs again: its images are stale now, and they hold its memory. Remove them.
        store.remove(kernel.kernel_id)
        return Outcome(result, bytes=here.manifest.image_bytes, manifest=here.manifest, extra=here.extra)

    # -- move to another GPU -------------------------------------------------------------------------

    def move_to_gpu(self, to_gpu: int, verify_timeout: float = 10.0, stash: Stash | None = None,
                    invite: bool = True) -> Outcome:
        """Move the running kernel onto GPU ``to_gpu``. With ``stash`` (listening), its large tensors take
        the fast path: the kernel is invited to connect to it (``invite``), or the caller, the kernel's
        own %migrate, connects itself."""
        kernel = self.kernel
        gpu = GpuState([], self.lock_timeout, self.inventory)
        move: Move | None = None

        def prepare() -> None:
            nonlocal move
            pid = self._running_pid("moved")
            # Refuse what cannot work before anything is touched; then drop cached blocks, and check
            # again with what the kernel really holds.
            _, held, gpus = self._gpu_use(pid)
            placement.plan_move(gpus, held, to_gpu, self.driver_major())
            with migrating(kernel, otherwise=RUNNING):
                if invite:
                    self._release_cache(pid)
                gpu.pids, held, gpus = self._gpu_use(pid)
                move = placement.plan_move(gpus, held, to_gpu, self.driver_major())
                gpu.home = gpu.at = move.source.uuid
                gpu.needed = move.needed

        def back_to_running() -> None:
            kernel.state = RUNNING

        def stash_tensors() -> None:
            # The fast path, when the kernel can take it: what fits on the target beside the move goes
            # into a stash there, over the peer link. Where it steps aside, the driver moves it all.
            assert move is not None and stash is not None
            if invite and move.needed < MIN_STASH:
                # NVML's count bounds the tensors: too little for the fast path to pay; the kernel is not
                # even asked (a session with it costs a lock that waits on its stager).
                stash.reason = (f"the kernel holds {move.needed / 1e9:.1f} GB of GPU memory: under "
                                f"{MIN_STASH / 1e9:.0f} GB the driver alone is as fast")
                return
            try:
                if invite:
                    stash.reason = getattr(kernel, "invite_stager", lambda path, token: "not a Python kernel")(
                        stash.path, stash.token)
                    if stash.reason:
                        return
                offer = stash.accept(timeout=10.0 if invite else 30.0)
                if offer is None or offer.aside:
                    return
                target = next(g for g in self.inventory() if g.uuid == move.target.uuid)
                stash.stash(move.target.uuid, target.memory_total - target.memory_used - move.needed)
            except Exception as exc:
                if stash.held or stash.unsure:
                    raise  # tensors may be in the stash: undo (the kernel takes them back), not the driver
                stash.reason = str(exc) or type(exc).__name__  # nothing left the kernel: the driver moves it all

        def remap() -> None:
            assert move is not None
            gpu.restore_to(move.target.uuid)

        def verify() -> None:
            # NVML, read here in the server, must show the kernel's memory on the target and none left
            # on the source.
            assert move is not None
            deadline = time.monotonic() + verify_timeout
            while True:
                gpus = self.inventory()
                on = {g.uuid for g in gpus for p in gpu.pids if p in g.processes}
                if on == {move.target.uuid}:
                    break
                if time.monotonic() >= deadline:
                    where = ", ".join(str(g.index) for g in gpus if g.uuid in on) or "no GPU"
                    raise GpuError(
                        f"After the move NVML shows the kernel on {where}, not on GPU {move.target.index} "
                        "alone; it was moved back."
                    )
                time.sleep(0.1)
            kernel.state = RUNNING

        def stashed() -> bool:
            return stash is not None and stash.held > 0

        def take_back() -> None:
            # Undo of the stash: the tensors come back onto the GPU the kernel is on again. A kernel that
            # a failed rollback left locked cannot take them: they stay in the stash (kept) until it can.
            assert stash is not None
            if stash.held and not gpu.runs():
                raise GpuError("The kernel is left locked, so its tensors stay in the stash on the target GPU; "
                               "it takes them back by itself once unlocked. Restart the kernel if it stays stuck.")
            stash.unstash()

        phases = [
            Phase("prepare", prepare, back_to_running),
            Phase("stash", stash_tensors, take_back, when=lambda: stash is not None),
            Phase("lock", gpu.lock, gpu.unlock),
            Phase("checkpoint", gpu.checkpoint, gpu.restore_home),
            Phase("remap", remap, gpu.checkpoint_again),
            Phase("unlock", gpu.unlock, gpu.lock),
            Phase("unstash", lambda: stash.unstash() if stash else None, when=stashed),
            Phase("verify", verify),
        ]
        try:
            result = Plan(phases, self.progress).run()
        finally:
            if stash is not None:
                stash.close(kernel_runs=not stash.held or gpu.runs())
        assert move is not None
        extra: dict = {"from_gpu": move.source.index, "to_gpu": move.target.index}
        if stash is not None:
            extra["fast_path"] = {"stashed": stash.stashed, "reason": stash.reason,
                                  "seconds": {k: round(v, 4) for k, v in stash.seconds.items()}}
        return Outcome(result, bytes=move.needed, extra=extra)

    # -- move to another host -----------------------------------------------------------------------

    def move_to_host(self, link: HostLink, to_gpu: int | None = None) -> Outcome:
        """Move the running kernel to ``link``'s host (onto its GPU ``to_gpu``, or where it has room)."""
        kernel, store = self.kernel, self.store
        images = store.path_for(kernel.kernel_id)
        manifest: Manifest | None = None
        gpu = GpuState([], self.lock_timeout, self.inventory)
        sent = 0
        placed: dict = {}

        def prepare() -> None:
            nonlocal manifest
            pid = self._running_pid("moved")
            # The other host says everything it lacks before anything here is touched.
            _, held, _ = self._gpu_use(pid)
            link.check(hostfit.requirements_of(pid, kernel_listens(kernel.kernel_connection_info)),
                       held[0] if held else None, to_gpu)
            with migrating(kernel, otherwise=RUNNING):
                manifest = self._new_images(pid, gpu)

        def forget_images() -> None:
            store.remove(kernel.kernel_id, keep_logs=True)
            kernel.state = RUNNING

        def dump() -> None:
            assert manifest is not None
            self._dump(manifest, images, restore_here)

        def restore_here() -> None:
            # Anything after the dump failed: the kernel comes back here, from this host's copy.
            assert manifest is not None
            kernel.state = MIGRATING
            self._adopt(self.criu.restore(images, manifest.ids), manifest)  # type: ignore[union-attr]

        def transfer() -> None:
            nonlocal sent
            sent = link.send_images(images)

        def restore_there() -> None:
            nonlocal placed
            placed = link.restore(to_gpu)

        def adopt() -> None:
            # This host keeps the kernel's ports and relays them: its clients re-dial, as after a
            # resume, and reach the kernel there. It must answer through the relay, or all is undone.
            assert manifest is not None
            link.attach(manifest.clients)
            try:
                kernel.adopt_remote(link, placed)
                if not kernel.wait_ready(max(self.reconnect_timeout, 10.0)):
                    raise InvalidState(f"The kernel was restored on {link.host} but does not answer through "
                                       "the relay; it was brought back here.")
            except BaseException:
                link.detach()
                kernel.state = MIGRATING
                raise

        on_gpu = gpu.holds_gpu
        phases = [
            Phase("prepare", prepare, forget_images),
            Phase("lock", gpu.lock, gpu.unlock, when=on_gpu),
            Phase("checkpoint", gpu.checkpoint, gpu.restore_home, when=on_gpu),
            Phase("dump", dump, restore_here),
            Phase("transfer", transfer, link.discard),
            Phase("restore", restore_there, link.discard),
            Phase("adopt", adopt),
        ]
        result = Plan(phases, self.progress).run()
        assert manifest is not None
        # The kernel answers from there: this host's copy of its memory is stale now.
        store.remove(kernel.kernel_id)
        extra = {"to_host": link.host, "to_gpu": placed.get("gpu"), "transferred": sent}
        if manifest.gpus:
            extra["from_gpu"] = manifest.gpus[0]["index"]
        return Outcome(result, bytes=manifest.image_bytes, manifest=manifest, extra=extra)

    def return_home(self, link: HostLink, to_gpu: int | None = None) -> Outcome:
        """Bring the kernel that runs on ``link``'s host back to this one (onto GPU ``to_gpu``)."""
        kernel, store, criu = self.kernel, self.store, self.criu
        assert criu is not None
        images = store.path_for(kernel.kernel_id)
        here = LocalRestore(self, images, GpuState([], self.lock_timeout, self.inventory))
        received = 0

        def prepare() -> None:
            if kernel.state != REMOTE:
                raise InvalidState(f"The kernel is {kernel.state} here, not on another host: it is home already.")
            needs = link.requirements()
            needs.listens = []  # its ports are held here by the relay, which lets go of them before the restore
            problems = hostfit.problems(needs)
            if problems:
                raise InvalidState(f"The kernel cannot come back here: {'; '.join(problems)}. It runs on "
                                   f"{link.host} as before.")
            with migrating(kernel, otherwise=REMOTE):
                store.create(kernel.kernel_id)

        def forget_images() -> None:
            store.remove(kernel.kernel_id, keep_logs=True)
            kernel.state = REMOTE

        def fetch() -> None:
            nonlocal received
            received = link.fetch_images(images)
            manifest = store.read_manifest(kernel.kernel_id)
            if manifest.kernel_id != kernel.kernel_id:
                raise ImageError(f"{link.host} sent the images of kernel {manifest.kernel_id}, not {kernel.kernel_id}.")
            here.place(manifest, to_gpu, f"The kernel holds no GPU on {link.host}, so it cannot come back onto "
                                         f"GPU {to_gpu}.")

        def restore() -> None:
            assert here.manifest is not None
            # The clients to wait for after the restore are those of the relay here, not those the
            # kernel had there (the relay's own).
            ports = {port for _, port in kernel_listens(kernel.kernel_connection_info)}
            here.manifest.clients = {p: n for p, n in netstate.client_counts([os.getpid()]).items() if p in ports}
            link.detach()  # the kernel's ports, held by the relay, are the kernel's own again
            try:
                here.restore()
            except BaseException:
                link.attach()
                raise

        def kill_restored() -> None:
            here.kill()
            link.attach()

        phases = [
            Phase("prepare", prepare, forget_images),
            Phase("dump", link.dump, link.resume),
            Phase("transfer", fetch),
            *here.phases(restore, kill_restored),
        ]
        result = Plan(phases, self.progress).run()
        assert here.manifest is not None
        store.remove(kernel.kernel_id)
        try:
            link.discard()  # its images there hold the kernel's memory: delete them
        except Exception:
            log.warning("kernel %s is back, but %s could not delete its images there", kernel.kernel_id, link.host)
        extra = {"to_host": "", "from_host": link.host, "transferred": received, **here.extra}
        return Outcome(result, bytes=here.manifest.image_bytes, manifest=here.manifest, extra=extra)

    def _adopt(self, pid: int, manifest: Manifest) -> None:
        """The restored tree is the kernel again, once its clients are back.

        Its clients re-dial by themselves; a SUB socket that is not subscribed yet loses what the
        kernel publishes. So wait (briefly, bounded) until every port has its clients back, then
        until the kernel itself serves a new client on shell and IOPub.
        """
        expected = {int(port): n for port, n in manifest.clients.items()}
        missing = netstate.wait_for_clients(proctree.descendants(pid), expected, self.reconnect_timeout)
        if missing:
            log.info("kernel %s: %s client(s) did not reconnect within %.1f s (gone meanwhile?)",
                     manifest.kernel_id, sum(missing.values()), self.reconnect_timeout)
        self.kernel.adopt(pid)
        if not self.kernel.wait_ready(self.reconnect_timeout):
            log.warning("kernel %s: restored, but it did not answer within %.1f s",
                        manifest.kernel_id, self.reconnect_timeout)
        self.kernel.state = RUNNING


def kernel_listens(connection_info: dict) -> list[tuple[str, int]]:
    """The (address, port) of each channel a kernel listens on, from its connection info."""
    if connection_info.get("transport", "tcp") != "tcp":
        return []
    ip = str(connection_info.get("ip", "127.0.0.1"))
    return [(ip, int(connection_info[k])) for k in
            ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port") if connection_info.get(k)]


def _public(connection_info: dict) -> dict:
    """Connection info without the HMAC key (the manifest is not the place for secrets)."""
    return {
        k: (v.decode() if isinstance(v, bytes) else v)
        for k, v in connection_info.items()
        if k not in ("key",)
    }
