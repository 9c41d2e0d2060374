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
        self.home: str | None = None  # UUID of the GPU the kernel must be on if all is undone
        self.needed = 0  # bytes of GPU memory it holds
        self.at: dict[int, str] = {}  # per process: UUID of the GPU its checkpointed memory belongs to

    def track(self, pids: list[int], on: str | None, needed: int = 0) -> None:
        """The kernel's CUDA processes, all on GPU ``on`` (its home, if all is undone)."""
        self.pids, self.home, self.needed = list(pids), on, needed
        self.at = {pid: on for pid in self.pids} if on else {}

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
        first is checkpointed: they go back together, onto one GPU (:meth:`restore_home`)."""
        done: list[CudaProcess] = []
        for pid in self.pids:
            process = CudaProcess(pid)
            process.checkpoint()
            done.append(process)
            if len(done) == 1:
                ctx.undo(lambda: self.restore_home(done))

    def restore_to(self, ctx: Context, target: str, undoable: bool = True) -> None:
        """Put the checkpointed memory on ``target``: a remap where it was checkpointed elsewhere. With
        ``undoable``, each process's undo takes its memory off ``target`` again (and records that it
        belongs there, so that the checkpoint's undo maps it home from the right GPU). A restore whose
        undo kills the tree (a resume) needs none."""
        for pid in self.pids:
            process = CudaProcess(pid)
            process.restore(self._mapping(self.at[pid], target))
            self.at[pid] = target
            if undoable:
                ctx.undo(process.checkpoint)

    # -- helpers -------------------------------------------------------------------------------------

    def _mapping(self, source: str, target: str) -> dict[str, str] | None:
        # Every GPU the driver sees; one NVML cannot name is left out rather than named wrongly.
        known = [g.uuid for g in self.inventory() if not g.uuid.startswith("unknown-")]
        return None if source == target else gpu_mapping(known, source, target)

    def _restore_all(self, processes: list[CudaProcess], target: str) -> None:
        """All of ``processes`` onto ``target``, or none: those restored are checkpointed again if one fails."""
        restored: list[CudaProcess] = []
        try:
            for process in processes:
                process.restore(self._mapping(self.at[process.pid], target))
                self.at[process.pid] = target
                restored.append(process)
        except BaseException:
            for process in reversed(restored):
                try:
                    process.checkpoint()
                except Exception:  # the restore's own error is the one to report
                    log.exception("could not checkpoint process %s again", process.pid)
            raise

    def restore_home(self, processes: list[CudaProcess]) -> None:
        """Undo of a checkpoint: the processes back onto the GPU the kernel came from, together; if that
        fails (it filled up meanwhile), onto another GPU of the same model with room, all of them, so that
        the kernel runs again, on one GPU."""
        assert self.home is not None
        try:
            self._restore_all(processes, self.home)
            return
        except MigrateError as home_error:
            inventory = self.inventory()
            home = next((g for g in inventory if g.uuid == self.home), None)
            for other in placement.same_model_with_room(inventory, home, self.needed):
                try:
                    self._restore_all(processes, other.uuid)
                except MigrateError:
                    continue
                log.warning("kernel processes %s could not go back to GPU %s (%s); they run on GPU %s",
                            [p.pid for p in processes], home.index if home else "?", home_error, other.index)
                return
            raise
