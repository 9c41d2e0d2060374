"""The CUDA side of a kernel during one plan: its CUDA processes, and which GPU their memory belongs to.

Each method acts on every CUDA process of the kernel's tree, one after the other, and registers the
undo of each process's step on the plan's context right after that process took it: a step that
fails on the second process is undone on the first (saga.py), so all processes end in one state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import placement
from .cudackpt import CudaProcess, gpu_mapping
from .errors import MigrateError
from .gpus import GpuInfo
from .saga import Context

log = logging.getLogger(__name__)


class GpuState:
    def __init__(self, lock_timeout: float, inventory: Callable[[], list[GpuInfo]]) -> None:
        self.pids: list[int] = []
        self.lock_timeout = lock_timeout
        self.inventory = inventory
        #: UUIDs of the GPUs the kernel must be on if all is undone (its home), by index
        self.home: list[str] = []
        self.needed = 0  # bytes of GPU memory it holds
        #: per process: each home GPU -> the GPU that memory is on now (or belongs to, checkpointed)
        self.at: dict[int, dict[str, str]] = {}

    def track(self, pids: list[int], on: list[str] | str | None, needed: int = 0) -> None:
        """The kernel's CUDA processes, on the GPUs ``on`` (its home, if all is undone)."""
        home = [on] if isinstance(on, str) else list(on or [])
        self.pids, self.home, self.needed = list(pids), home, needed
        self.at = {pid: {h: h for h in home} for pid in self.pids} if home else {}

    def holds_gpu(self, ctx: Context | None = None) -> bool:
        return bool(self.pids)

    def runs(self) -> bool:
        """Whether every CUDA process of the kernel runs (neither locked nor checkpointed), as the driver says."""
        try:
            return all(CudaProcess(pid).state == "running" for pid in self.pids)
        except MigrateError:
            return False

    # -- the steps, each undone per process ----------------------------------------------------------

    def lock(self, ctx: Context) -> None:
        for pid in self.pids:
            process = CudaProcess(pid)
            process.lock(self.lock_timeout)
            ctx.undo(process.unlock)

    def unlock(self, ctx: Context, cleanup: bool = False) -> None:
        """CUDA calls go on; each undo locks again (``cleanup``: a tree that is killed next, whose lock
        failing leaves nothing in doubt)."""
        for pid in self.pids:
            process = CudaProcess(pid)
            process.unlock()
            ctx.undo(lambda p=process: p.lock(self.lock_timeout), cleanup=cleanup)

    def checkpoint(self, ctx: Context) -> None:
        """Each process's GPU memory into its host memory. One undo for them all, registered once the
        first is checkpointed: they go back together, onto their GPUs (:meth:`restore_home`)."""
        done: list[CudaProcess] = []
        for pid in self.pids:
            process = CudaProcess(pid)
            process.checkpoint()
            done.append(process)
            if len(done) == 1:
                ctx.undo(lambda: self.restore_home(done))

    def restore_to(self, ctx: Context, assignment: dict[str, str], undoable: bool = True) -> None:
        """Put the checkpointed memory of each home GPU on its GPU in ``assignment`` (home UUID -> target
        UUID): a remap where that differs from where it was checkpointed. With ``undoable``, each
        process's undo takes its memory off the targets again (and records that it belongs there, so that
        the checkpoint's undo maps it home from the right GPUs). A restore whose undo kills the tree (a
        resume) needs none."""
        for pid in self.pids:
            process = CudaProcess(pid)
            process.restore(self._mapping(self.at[pid], assignment))
            self.at[pid] = dict(assignment)
            if undoable:
                ctx.undo(process.checkpoint)

    # -- helpers -------------------------------------------------------------------------------------

    def _mapping(self, now: dict[str, str], wanted: dict[str, str]) -> dict[str, str] | None:
        """The driver's mapping from where the memory of each home GPU is (``now``) to ``wanted``; None
        where nothing moves."""
        moves = {now[home]: target for home, target in wanted.items()}
        if all(source == target for source, target in moves.items()):
            return None
        # Every GPU the driver sees; one NVML cannot name is left out rather than named wrongly.
        known = [g.uuid for g in self.inventory() if not g.uuid.startswith("unknown-")]
        return gpu_mapping(known, moves)

    def _restore_all(self, processes: list[CudaProcess], assignment: dict[str, str]) -> None:
        """All of ``processes`` onto ``assignment``, or none: those restored are checkpointed again if one fails."""
        restored: list[CudaProcess] = []
        try:
            for process in processes:
                process.restore(self._mapping(self.at[process.pid], assignment))
                self.at[process.pid] = dict(assignment)
                restored.append(process)
        except BaseException:
            for process in reversed(restored):
                try:
                    process.checkpoint()
                except Exception:  # the restore's own error is the one to report
                    log.exception("could not checkpoint process %s again", process.pid)
            raise

    def restore_home(self, processes: list[CudaProcess]) -> None:
        """Undo of a checkpoint: the processes back onto the GPUs the kernel came from, together; if that
        fails for a kernel on one GPU (it filled up meanwhile), onto another GPU of the same model with
        room, all of them, so that the kernel runs again, on one GPU."""
        assert self.home
        try:
            self._restore_all(processes, {h: h for h in self.home})
            return
        except MigrateError as home_error:
            if len(self.home) > 1:
                raise
            inventory = self.inventory()
            home = next((g for g in inventory if g.uuid == self.home[0]), None)
            for other in placement.same_model_with_room(inventory, home, self.needed):
                try:
                    self._restore_all(processes, {self.home[0]: other.uuid})
                except MigrateError:
                    continue
                log.warning("kernel processes %s could not go back to GPU %s (%s); they run on GPU %s",
                            [p.pid for p in processes], home.index if home else "?", home_error, other.index)
                return
            raise
