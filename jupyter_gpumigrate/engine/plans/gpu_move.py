"""A live move to another GPU of the same host: the running kernel goes on, on the new GPU.

    prepare     check the target, drop cached blocks, check again  (nothing to undo)
    stash       large tensors into a stash on the target (fast     undo: the kernel takes them back
                path, when the kernel serves it)
    lock        CUDA calls of each CUDA process wait               undo: unlock
    checkpoint  GPU memory into the process's host memory          undo: back onto its GPU
    remap       GPU memory onto the target                         undo: checkpoint it again
    unlock      CUDA calls go on, on the target                    undo: lock
    unstash     the tensors come back from the stash               (nothing to undo)
    verify      NVML shows the kernel on the target alone          (last)
    always      the stash is closed (a kernel left locked keeps it until it runs)

The fast path (stash.py): when the kernel can (an IPython kernel with PyTorch, idle, busy with a cell
that reaches a safe point in time (kernel/safepoint.py: the cell waits there until the move is over,
then goes on, on the target), or one whose own %migrate serves it), its large tensors go to the target
over the GPUs' peer link first, and the driver moves only the rest. Where it steps aside, it says why,
and the driver moves it all.
"""

from __future__ import annotations

import time

from .. import placement
from ..errors import GpuError
from ..kernelproc import KernelProcess
from ..saga import ALWAYS, ProgressCallback, Saga, Step
from ..stash import MIN_STASH, Stash
from .common import FastPath, KernelContext, Outcome, Tools, checkpoint, gpu_use, lock, release_cache, running_pid, \
    unlock


def saga() -> Saga[MoveContext]:
    return Saga(
        "move_to_gpu",
        [
            Step("prepare", prepare),
            Step("stash", stash_tensors, when=lambda ctx: ctx.stash is not None),
            Step("lock", lock),
            Step("checkpoint", checkpoint),
            Step("remap", remap),
            Step("unlock", unlock),
            Step("unstash", unstash, when=lambda ctx: ctx.stash is not None and ctx.stash.held > 0),
            Step("verify", verify),
            Step("close the stash", close_stash, when=lambda ctx: ctx.stash is not None, kind=ALWAYS),
        ],
        start_from=("running",),
        success="running",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be moved.",
    )


class MoveContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, to_gpu: int, stash: Stash | None, invite: bool,
                 verify_timeout: float) -> None:
        super().__init__(kernel, tools)
        self.to_gpu = to_gpu
        #: the fast path's stash, listening; None: the driver moves everything
        self.stash = stash
        #: ask the kernel to serve the stash (else the caller, the kernel's own %migrate, connects)
        self.invite = invite
        self.verify_timeout = verify_timeout


def prepare(ctx: MoveContext) -> None:
    pid = running_pid(ctx)
    # Refuse what cannot work before anything is touched; then drop cached blocks, and check again
    # with what the kernel really holds.
    _, held, gpus = gpu_use(ctx, pid)
    placement.plan_move(gpus, held, ctx.to_gpu, ctx.tools.driver_major())
    if ctx.invite:
        release_cache(ctx)
    cuda_pids, held, gpus = gpu_use(ctx, pid)
    ctx.move = placement.plan_move(gpus, held, ctx.to_gpu, ctx.tools.driver_major())
    ctx.gpu.track(cuda_pids, ctx.move.source.uuid, ctx.move.needed)


def remap(ctx: MoveContext) -> None:
    assert ctx.move is not None
    ctx.gpu.restore_to(ctx, ctx.move.target.uuid)


def stash_tensors(ctx: MoveContext) -> None:
    """What fits on the target beside the move goes into a stash there, over the peer link. Where the
    fast path steps aside, nothing changed and the driver moves it all."""
    stash, move = ctx.stash, ctx.move
    assert stash is not None and move is not None
    if ctx.invite and move.needed < MIN_STASH:
        # NVML's count bounds the tensors: too little for the fast path to pay; the kernel is not even
        # asked (a session with it costs a lock that waits on its stager).
        stash.reason = (f"the kernel holds {move.needed / 1e9:.1f} GB of GPU memory: under "
                        f"{MIN_STASH / 1e9:.0f} GB the driver alone is as fast")
        return
    try:
        invited = time.perf_counter()
        if ctx.invite:
            stash.reason = ctx.kernel.invite_stager(stash.path, stash.token)
            if stash.reason:
                return
        offer = stash.accept(timeout=10.0 if ctx.invite else 30.0)
        if offer is not None and offer.safe_point:  # a busy cell waits at its safe point from now on
            stash.seconds["safe_point"] = time.perf_counter() - invited
        if offer is None or offer.aside:
            return
        target = next(g for g in ctx.tools.inventory() if g.uuid == move.target.uuid)
        stash.stash(move.target.uuid, placement.free(target) - move.needed)
    except Exception as exc:
        if stash.held or stash.unsure:
            raise  # tensors may be in the stash: closing it has the kernel take them back, not the driver
        stash.reason = str(exc) or type(exc).__name__  # nothing left the kernel: the driver moves it all
        return
    ctx.undo(lambda: take_back(ctx))


def take_back(ctx: MoveContext) -> None:
    """Undo of the stash: the tensors come back onto the GPU the kernel is on again. A kernel that a
    failed rollback left locked cannot take them: they stay in the stash (kept) until it can."""
    assert ctx.stash is not None
    if ctx.stash.held and not ctx.gpu.runs():
        raise GpuError("The kernel is left locked, so its tensors stay in the stash on the target GPU; it takes "
                       "them back by itself once unlocked. Restart the kernel if it stays stuck.")
    ctx.stash.unstash()


def unstash(ctx: MoveContext) -> None:
    assert ctx.stash is not None
    ctx.stash.unstash()


def verify(ctx: MoveContext) -> None:
    """NVML, read here in the server, must show the kernel's memory on the target and none left on the source."""
    assert ctx.move is not None
    deadline = time.monotonic() + ctx.verify_timeout
    while True:
        gpus = ctx.tools.inventory()
        on = {g.uuid for g in gpus for p in ctx.gpu.pids if p in g.processes}
        if on == {ctx.move.target.uuid}:
            return
        if time.monotonic() >= deadline:
            where = ", ".join(str(g.index) for g in gpus if g.uuid in on) or "no GPU"
            raise GpuError(f"After the move NVML shows the kernel on {where}, not on GPU {ctx.move.target.index} "
                           "alone; it was moved back.")
        time.sleep(0.1)


def close_stash(ctx: MoveContext) -> None:
    assert ctx.stash is not None
    ctx.stash.close(kernel_runs=not ctx.stash.held or ctx.gpu.runs())


def run(kernel: KernelProcess, tools: Tools, to_gpu: int, stash: Stash | None = None, invite: bool = True,
        verify_timeout: float = 10.0, progress: ProgressCallback | None = None) -> Outcome:
    """Move the running kernel onto GPU ``to_gpu``. With ``stash`` (listening), its large tensors take the
    fast path: the kernel is invited to connect to it (``invite``), or the caller, the kernel's own
    %migrate, connects itself."""
    ctx = MoveContext(kernel, tools, to_gpu, stash, invite, verify_timeout)
    result = saga().run(ctx, progress)
    assert ctx.move is not None
    fast_path = FastPath(stash.stashed, stash.reason, dict(stash.seconds)) if stash is not None else None
    return Outcome(result, bytes=ctx.move.needed, from_gpu=ctx.move.source.index, to_gpu=ctx.move.target.index,
                   fast_path=fast_path)
