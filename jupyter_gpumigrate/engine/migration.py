"""The story of a migration, told as plans of phases, each side effect followed by its undo.

    suspend:          prepare -> [lock -> checkpoint] -> dump                         plans/suspend.py
    resume:           prepare -> [prefetch] -> restore -> [remap -> unlock] -> [unstash]
                      -> adopt                                                        plans/resume.py
    move to a GPU:    prepare -> [stash | host stash] -> lock -> checkpoint -> remap
                      -> unlock -> [unstash | take back] -> verify                    plans/gpu_move.py
    move to a host:   prepare -> [stash] -> [stream] -> [lock -> checkpoint] -> dump -> transfer
                      -> restore (there, the stash read back) -> adopt                plans/host_move.py
    come back home:   prepare -> [stream] -> dump (there, [stash] first) -> transfer -> restore
                      -> [remap -> unlock] -> [unstash] -> adopt                      plans/host_move.py
    transplant:       prepare -> start -> export -> load -> [stash] -> [lock -> checkpoint] -> dump
                      -> switch                                                       plans/transplant.py
    transplant to a   prepare -> export -> transfer -> load (there) -> [stash] -> [lock ->
    host:             checkpoint] -> dump -> switch (there)                           plans/host_transplant.py

A kernel is a process tree. To suspend it we write the tree to an image directory with CRIU, which
kills it; to resume it CRIU recreates the tree from the images with the same PIDs, and the kernel
manager adopts the new root. The bracketed GPU phases join the plan when the kernel holds a GPU:
CUDA's checkpoint API locks the process's CUDA calls (after the GPU work in flight), moves its GPU
memory into its host memory and frees the GPU; later it puts the memory back on a GPU of our choice
(the remap) and unlocks. A live move to another GPU is those GPU phases alone, on the running process:
the cell that runs goes on, on the new GPU, and torch still calls it cuda:0.

Each plan module starts with its table of steps; saga.py runs it, undoes what was done when a step
fails, and sets the kernel's state (migrating, then the plan's end state; the state it had after a
full rollback; ``broken``, with the reason, when an undo fails). :class:`Migration` here is the one
door the server extension and the peers go through: it holds what every plan acts with (``Tools``).
Nothing in the engine knows about Jupyter: the kernel is anything that fits :class:`KernelProcess`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from . import gpus as gpus_mod
from . import proctree
from .criu import Criu
from .gpus import GpuInfo
from .images import ImageError, ImageStore
from .kernelproc import (BROKEN, MIGRATING, REMOTE, RUNNING, STOPPED, SUSPENDED, KernelProcess, kernel_listens,
                         public_connection_info)
from .plans import back, gpu_move, host_move, host_transplant, resume, suspend, transplant
from .plans.common import FastPath, Outcome, Tools
from .plans.host_move import HostLink
from .plans.host_transplant import TransplantLink
from .prefetch import Prefetch
from .saga import ProgressCallback
from .stash import Stash

__all__ = ["BROKEN", "MIGRATING", "REMOTE", "RUNNING", "STOPPED", "SUSPENDED", "FastPath", "HostLink",
           "KernelProcess", "Migration", "Outcome", "kernel_listens", "public_connection_info"]


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
        host_stash_min: int | None = 10**9,
        images: str = "disk",
        keep_source: float = 0.0,
        prefetch: bool = True,
        avoid: Callable[[], Collection[int]] = tuple,
        early_prefetch: Callable[[Path], Prefetch | None] | None = None,
    ) -> None:
        self.kernel = kernel
        self.progress = progress
        self.tools = Tools(store, criu, inventory, driver_major, reconnect_timeout, lock_timeout, host_stash_min,
                           images, keep_source, prefetch=prefetch, avoid=avoid)
        if early_prefetch is not None:
            self.tools.early_prefetch = early_prefetch

    def suspend(self) -> Outcome:
        return suspend.run(self.kernel, self.tools, self.progress)

    def resume(self, to_gpu: int | Sequence[int] | None = None) -> Outcome:
        """Bring the suspended kernel back: onto ``to_gpu`` (a GPU, or one per GPU it held), else where it
        was, else where there is room."""
        return resume.run(self.kernel, self.tools, to_gpu, self.progress)

    def move_to_gpu(self, to_gpu: int | Sequence[int], verify_timeout: float = 10.0, stash: Stash | None = None,
                    invite: bool = True, via: str | None = gpu_move.AUTO) -> Outcome:
        """Move the running kernel onto GPU ``to_gpu`` (a kernel on several GPUs: one per GPU it holds, in
        the order of their indices). ``via``: where its large tensors wait (gpu_move.PEER, HOST, AUTO;
        None: the driver moves everything)."""
        return gpu_move.run(self.kernel, self.tools, to_gpu, stash, invite, verify_timeout, self.progress, via)

    def move_to_host(self, link: HostLink, to_gpu: int | None = None) -> Outcome:
        return host_move.move_to_host(self.kernel, self.tools, link, to_gpu, self.progress)

    def return_home(self, link: HostLink, to_gpu: int | None = None) -> Outcome:
        return host_move.return_home(self.kernel, self.tools, link, to_gpu, self.progress)

    def transplant(self, to_gpu: int | None, accept_left: list[str] | None = None) -> Outcome:
        """Carry the kernel's objects into a new process on GPU ``to_gpu`` (any model), or the CPU (None)."""
        return transplant.run(self.kernel, self.tools, to_gpu, accept_left, self.progress)

    def transplant_to_host(self, link: TransplantLink, to_gpu: int | None,
                           accept_left: list[str] | None = None) -> Outcome:
        """Carry the kernel's objects into a new process on ``link``'s host: its GPU ``to_gpu``, or its CPU."""
        return host_transplant.run(self.kernel, self.tools, link, to_gpu, accept_left, self.progress)

    def back(self) -> Outcome:
        """Go back to the process that the kernel's last transplant replaced (kept ``keep_source`` seconds)."""
        return back.run(self.kernel, self.tools, self.progress)

    def spare_pids(self, action: str) -> bool:
        """Before the caller starts a thread for ``action`` ("resume" or "back"): move the PID cursor past
        the numbers that CRIU will give back to the tree, if the next ones handed out fall among them.

        A thread is a number too: one that the server starts for the operation would otherwise take
        one of them for as long as it lives, and the restore could never be. The plan steers again
        before CRIU runs; this is for the threads born before it. True if the cursor moved."""
        kernel_id = self.kernel.kernel_id
        try:
            if action == "resume":
                ids = self.tools.store.read_manifest(kernel_id).ids
            elif action == "back" and (kept := self.tools.store.kept(kernel_id)) is not None:
                ids = self.tools.store.read_manifest_at(kept[0]).ids
            else:
                return False
        except (ImageError, ValueError):
            return False  # the plan says what is wrong
        return proctree.steer_pid_allocation(ids)
