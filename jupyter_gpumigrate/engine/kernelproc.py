"""What the plans need of the kernel they move: :class:`KernelProcess`, and its states.

The provisioner (provisioner.py) implements it for the server's own kernels, ``Guest`` (peers.py) for
the kernels a peer hosts. Only the saga runner (saga.py) writes ``state`` and ``broken_reason``
while a plan runs; the implementer writes them for its own lifecycle (started, stopped).
"""

from __future__ import annotations

from typing import Protocol

from .saga import BROKEN, MIGRATING, REMOTE, RUNNING, STOPPED, SUSPENDED

__all__ = ["BROKEN", "MIGRATING", "REMOTE", "RUNNING", "STOPPED", "SUSPENDED", "KernelProcess", "kernel_listens",
           "public_connection_info"]


class KernelProcess(Protocol):
    kernel_id: str
    state: str
    #: set with state ``broken``: what failed, and what its undo could not put back
    broken_reason: str | None
    #: what points at the kernel in its server (notebook sessions: id, path, name, type), kept with its
    #: images so that a server started later points there again
    sessions: list[dict]
    #: set while the kernel is being shut down or restarted: why (a plan reads it, saga.Saga.stoppable);
    #: optional, None when absent
    stop_requested: str | None
    #: optional: how the last :meth:`wait_ready` went (``reply``, ``status``: seconds; ``asked``: requests sent)
    answered: dict

    @property
    def kernel_name(self) -> str: ...

    @property
    def kernel_pid(self) -> int | None: ...

    @property
    def kernel_connection_info(self) -> dict: ...

    def secrets(self) -> dict:
        """What must be kept private with the images to take the kernel back later (its connection key)."""

    def release(self) -> None:
        """The tree was dumped and killed: collect the dead root and forget it."""

    def adopt(self, pid: int) -> None:
        """A restored tree rooted at ``pid`` is the kernel from now on."""

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the restored kernel serves its clients again; False if it did not in time."""

    def carry_over(self, pid: int) -> None:
        """What was sent to the kernel's process ``pid`` goes to its process from now on (another one)."""

    def finish_cells(self, timeout: float) -> bool:
        """Wait until the kernel has run the cells it was sent before now; False if it had not within ``timeout``
        seconds (a long cell runs)."""

    def release_gpu_cache(self) -> None:
        """If the kernel is idle and can, free the GPU memory it caches but does not use (best effort)."""

    def invite_stager(self, path: str, token: str) -> str | None:
        """If the kernel is idle and can, have it connect to the fast path's socket at ``path`` (see
        stash.py) and serve it; None if invited, else why not."""

    def host_stash(self, folder: str, min_total: int, timeout: float, gpu_only: bool = False,
                   idle_only: bool = False) -> dict:
        """If the kernel is idle (or, unless ``idle_only``, busy with a cell that reaches its safe point) and
        can, have it write its large buffers (``gpu_only``: its CUDA tensors alone) into files in ``folder``
        and free them (kernel/hoststash.py): ``{"stashed": bytes, ...}``, or ``{"aside": reason}`` (nothing
        changed).
        Raises TimeoutError, RuntimeError (the kernel's error) or an error saying the kernel ended."""

    def host_take_back(self, folder: str, timeout: float, pid: int | None = None, gpu: dict | None = None) -> dict:
        """Have the kernel (its process ``pid``, by default the one adopted; the one on the other host where it
        runs there) read its stashed buffers back from ``folder`` (``{"unstashed": bytes, ...}``);
        RuntimeError naming ``StashDamaged`` if a file does not hold what was written. ``gpu``: a prefetch
        holds its CUDA buffers on its GPU already (engine/prefetch.py; where it runs here only)."""

    def host_open_prefetch(self, folder: str, gpu: dict, timeout: float, pid: int | None = None) -> str | None:
        """Where the kernel (its process ``pid``) is idle, have it begin mapping a prefetch's memory (``gpu``:
        ``handle``, ``session``) for its stash in ``folder`` while the helper reads the files, so that
        :meth:`host_take_back` need not wait for that; returns at once. None if it began, else why not
        (nothing changed; best effort)."""

    def transplant_survey(self, timeout: float) -> dict:
        """The dry run of a transplant (kernel/transplant.py's survey): what carries, what not and why.
        :class:`~.errors.MigrateError` where the kernel cannot be transplanted (not an IPython kernel with
        this package); TimeoutError, RuntimeError or ConnectionError as ``host_stash``."""

    def transplant_export(self, folder: str, names: list[str], timeout: float) -> dict:
        """Have the kernel write its objects ``names`` into ``folder`` (which exists): what it wrote."""

    def transplant_start(self, folder: str, gpu_uuid: str | None) -> int:
        """Start the new process of a transplant, on GPU ``gpu_uuid`` (the only one it sees) or none: it reads
        the objects in ``folder``, writes ready.json there and waits for SIGUSR1. Its PID."""

    def transplant_adopt(self) -> None:
        """The new process is the kernel from now on (it is about to take the kernel's ports)."""

    def transplant_abandon(self) -> None:
        """Kill the new process, if any, and collect it; the kernel is what it was before."""

    def transplant_finish(self) -> None:
        """The transplant is over, done or undone: forget its new process (the kernel, or gone)."""

    def record_moving(self, host: str | None) -> None:
        """Write down, before ``host`` restores the kernel, that it may run there from now on (so a server that
        dies before :meth:`adopt_remote` has its next one ask that host first); None: the move is undone."""

    def record_copy_left(self, host: str | None) -> None:
        """Name ``host``, which the kernel comes home from, in its record from its adoption here on, as holding a
        dump of it still (so that a server that dies before it is discarded has its next one discard it); None
        once it is."""

    def adopt_remote(self, link: object, where: dict) -> None:
        """The kernel runs on ``link``'s host now (``where``: what that host said of it: pid, gpu, gpus)."""


def kernel_listens(connection_info: dict) -> list[tuple[str, int]]:
    """The (address, port) of each channel a kernel listens on, from its connection info."""
    if connection_info.get("transport", "tcp") != "tcp":
        return []
    ip = str(connection_info.get("ip", "127.0.0.1"))
    return [(ip, int(connection_info[k])) for k in
            ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port") if connection_info.get(k)]


def public_connection_info(connection_info: dict) -> dict:
    """Connection info without the HMAC key (the manifest is not the place for secrets)."""
    return {k: (v.decode() if isinstance(v, bytes) else v) for k, v in connection_info.items() if k != "key"}
