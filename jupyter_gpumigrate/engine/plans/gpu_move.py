"""A live move to another GPU of the same host: the running kernel goes on, on the new GPU.

    prepare     check the targets, drop cached blocks, check again (nothing to undo)
    stash       large tensors into a stash on the target (fast     undo: the kernel takes them back
                path over the peer link, when the kernel serves it)
    host stash  or, where the GPUs have no peer access: large      undo: the kernel reads them back
                tensors into files in memory (kernel/hoststash.py)
    lock        CUDA calls of each CUDA process wait               undo: unlock
    checkpoint  GPU memory into the process's host memory          undo: back onto its GPUs
    remap       GPU memory onto the targets                        undo: checkpoint it again
    unlock      CUDA calls go on, on the targets                   undo: lock
    unstash     the tensors come back from the stash               (nothing to undo)
    take back   or from the host stash's files                     (nothing to undo)
    verify      NVML shows the kernel on the targets alone         (last)
    always      the stash is closed (a kernel left locked keeps it until it runs); the host stash's
                folder is removed (kept while buffers are in it)

The fast path (stash.py): when the kernel can (an IPython kernel with PyTorch, idle, busy with a cell
that reaches a safe point in time (kernel/safepoint.py: the cell waits there until the move is over,
then goes on, on the target), or one whose own %migrate serves it), its large tensors go to the target
over the GPUs' peer link first, and the driver moves only the rest. Where the two GPUs have no peer
access (``via="host"``: most PCIe cards; or forced, c.MigratableProvisioner.move_stash), the kernel
writes them instead into files in memory through pinned buffers, the suspend's host stash, and reads
them back onto the target after the remap. Where either steps aside, it says why, and the driver moves
it all. A kernel on several GPUs moves them all at once, each to the GPU named for it; the driver moves
it all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from .. import gpus as gpus_mod
from .. import placement
from ..errors import GpuError, ImageError
from ..images import AUTO as WHERE_THERE_IS_ROOM
from ..images import MEMORY, choose
from ..kernelproc import KernelProcess
from ..saga import ALWAYS, ProgressCallback, Saga, Step
from ..stash import HELPER_RESERVE, MIN_STASH, Stash
from . import suspend
from .common import FastPath, KernelContext, Outcome, Tools, checkpoint, forget_new_images, gpu_use, lock, \
    manifest_of, release_cache, running_pid, unlock

#: Where a move's large tensors wait while the driver moves the rest: in a stash on the target GPU over
#: the peer link, in files in memory (the host stash), or chosen by the GPUs' peer access (auto).
PEER, HOST, AUTO = "peer", "host", "auto"


def saga() -> Saga[MoveContext]:
    return Saga(
        "move_to_gpu",
        [
            Step("prepare", prepare),
            Step("stash", stash_tensors, when=lambda ctx: ctx.peer_stash is not None and ctx.via == PEER),
            Step("host stash", host_stash, when=lambda ctx: ctx.via == HOST),
            Step("lock", lock),
            Step("checkpoint", checkpoint),
            Step("remap", remap),
            Step("unlock", unlock),
            Step("unstash", unstash, when=lambda ctx: ctx.peer_stash is not None and ctx.peer_stash.held > 0),
            Step("take back", take_back_host, when=lambda ctx: "stashed" in ctx.stash_said),
            Step("verify", verify),
            Step("close the stash", close_stash, when=lambda ctx: ctx.peer_stash is not None, kind=ALWAYS),
            Step("remove the host stash", remove_host_stash, when=lambda ctx: ctx.host_folder, kind=ALWAYS),
        ],
        start_from=("running",),
        success="running",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be moved.",
    )


class MoveContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, to: int | Sequence[int], stash: Stash | None, invite: bool,
                 verify_timeout: float, via: str | None = AUTO) -> None:
        super().__init__(kernel, tools)
        #: the target GPU, or one per GPU the kernel holds (in the order of their indices)
        self.to = to
        #: the fast path's stash, listening; None: no stash over the peer link. (KernelContext.stash, a dict,
        #: is what a host stash said elsewhere; here that is stash_said.)
        self.peer_stash = stash
        #: ask the kernel to serve the stash (else the caller, the kernel's own %migrate, connects)
        self.invite = invite
        self.verify_timeout = verify_timeout
        #: peer, host or auto (decided in prepare); None: the driver moves everything
        self.via: str | None = via
        #: the host stash: its folder (None: not made), and what the kernel said (``stashed``..., or ``aside``)
        self.host_folder: Path | None = None
        self.stash_said: dict = {}
        #: why the host stash or the fast path stepped aside, set where it is decided
        self.aside: str | None = None
        #: what the target had free beyond the move before the stash's helper was started there (None: it was
        #: not started in prepare)
        self.target_room: int | None = None


def prepare(ctx: MoveContext) -> None:
    pid = running_pid(ctx)
    # Refuse what cannot work before anything is touched; then drop cached blocks, and check again
    # with what the kernel really holds.
    _, held, gpus = gpu_use(ctx, pid)
    first = placement.plan_move(gpus, held, ctx.to, ctx.tools.driver_major())
    room = placement.free(first.target) - first.needed  # read before any helper's context is there
    if ctx.peer_stash is not None and _by_peer(ctx, first) and first.needed >= MIN_STASH and \
            room >= HELPER_RESERVE + MIN_STASH and not gpus_mod.one_context_only(first.target.uuid):
        # The stash's helper makes its context on the target while the kernel drops its cached blocks (an
        # idle move of 32 GB waited 0.08-0.12 s for it after the kernel had gathered its storages, started
        # at the stash; 0.04-0.06 s now). Only where the target has room for it beside the move and a stash,
        # so that its context cannot decide the check below; the stash's budget is this reading, which does
        # not count it. Should the stash not be used after all, it ends here or where the stash steps aside.
        ctx.target_room = room
        ctx.peer_stash.warm(first.target.uuid)
        ctx.undo(ctx.peer_stash.stop_helper, cleanup=True)
    if ctx.invite:
        release_cache(ctx)
    cuda_pids, held, gpus = gpu_use(ctx, pid)
    move = ctx.move = placement.plan_move(gpus, held, ctx.to, ctx.tools.driver_major())
    ctx.gpu.track(cuda_pids, [p.source.uuid for p in move.pairs], move.needed)
    if move.several:
        ctx.via, ctx.aside = None, "the kernel holds several GPUs: the driver moves them together"
    elif ctx.via == AUTO:
        ctx.via = PEER if _by_peer(ctx, move) else HOST
    if ctx.via != PEER and ctx.peer_stash is not None:
        ctx.peer_stash.stop_helper()  # no context of the helper's may take the target's room


def _by_peer(ctx: MoveContext, move: placement.Move) -> bool:
    """The stash goes over the peer link: asked for, or, left to the GPUs, where they have peer access. Without
    it, the host stash, unless the caller (%migrate in the kernel) serves the stash itself, where the kernel's
    side then finds it cannot open it and steps aside. A kernel on several GPUs: the driver alone."""
    if move.several or ctx.via not in (AUTO, PEER):
        return False
    if ctx.via == PEER:
        return True
    return ctx.tools.peer_access(move.source, move.target) is not False or (ctx.peer_stash is not None and
                                                                           not ctx.invite)


def remap(ctx: MoveContext) -> None:
    assert ctx.move is not None
    ctx.gpu.restore_to(ctx, ctx.move.assignment())


def host_stash(ctx: MoveContext) -> None:
    """The kernel writes its large CUDA tensors into files in memory and frees them (kernel/hoststash.py,
    the suspend's own), so that the driver moves only the rest; they come back onto the target after the
    remap. The folder is the kernel's image folder in memory, its manifest pending: should this server die
    meanwhile, the next one has the kernel read them back (revive.py). Steps aside where memory has no room."""
    assert ctx.move is not None and ctx.pid is not None
    if ctx.move.needed < MIN_STASH:
        ctx.aside = (f"the kernel holds {ctx.move.needed / 1e9:.1f} GB of GPU memory: under "
                     f"{MIN_STASH / 1e9:.0f} GB the driver alone is as fast")
        return
    store, kernel = ctx.tools.store, ctx.kernel
    earlier = store.path_for(kernel.kernel_id)
    if earlier.exists() or earlier.is_symlink():
        # An earlier stash the kernel could not read back (a server start said so): its only copy.
        ctx.aside = f"{earlier} holds an earlier stash of this kernel, not read back yet: restart the server to retry"
        return
    where, why = choose(store, WHERE_THERE_IS_ROOM, ctx.move.needed, ctx.pid)
    if where != MEMORY:
        ctx.aside = f"no host stash: {why}"
        return
    ctx.images = ctx.host_folder = store.create(kernel.kernel_id, MEMORY)
    ctx.undo(lambda: forget_new_images(ctx), cleanup=True)
    held = [{"index": p.source.index, "uuid": p.source.uuid, "name": p.source.name, "memory_used": p.needed}
            for p in ctx.move.pairs]
    ctx.manifest = manifest_of(kernel, ctx.pid, held, list(ctx.gpu.pids), criu_version="")  # no dump: no CRIU
    ctx.stash_said = suspend.write_stash(ctx, MIN_STASH, ctx.move.needed, gpu_only=True)
    if "stashed" not in ctx.stash_said:
        ctx.aside = str(ctx.stash_said.get("aside") or "the kernel did not write its tensors")


def take_back_host(ctx: MoveContext) -> None:
    """The kernel, on the target now, reads its tensors back from the host stash (files in memory carry no
    checksum: the kernel reads back from memory what it wrote there; on disk each chunk is checked)."""
    timeout = suspend.STASH_WAIT + int(ctx.stash_said.get("stashed", 0)) / suspend.STASH_RATE
    keep, ctx.keep_images = ctx.keep_images, True  # the files are all there is of them until it has
    try:
        said = ctx.kernel.host_take_back(str(ctx.host_folder), timeout)
    except (OSError, RuntimeError, TimeoutError) as exc:
        raise ImageError(f"The kernel could not read its tensors back from {ctx.host_folder} ({exc}): the move "
                         "is undone, and the kernel reads them back on the GPU it came from (if it cannot, they "
                         "stay in that folder, and the error says so).") from exc
    finally:
        ctx.keep_images = keep  # the undo of the host stash keeps them again for as long as it reads
    # The same record the host stash's undo reads: nothing is away any more.
    ctx.stash_said.update(taken_back=True, unstashed=said.get("unstashed"), unstash_seconds=said.get("seconds"))


def remove_host_stash(ctx: MoveContext) -> None:
    """The host stash's folder goes, unless buffers are still in it (a kernel that could not read them
    back keeps them there: the next server start asks it again)."""
    if not ctx.keep_images:
        ctx.tools.store.remove(ctx.kernel.kernel_id)


def stash_tensors(ctx: MoveContext) -> None:
    """What fits on the target beside the move goes into a stash there, over the peer link. Where the
    fast path steps aside, nothing changed and the driver moves it all."""
    stash, move = ctx.peer_stash, ctx.move
    assert stash is not None and move is not None
    try:
        if ctx.invite and move.needed < MIN_STASH:
            # NVML's count bounds the tensors: too little for the fast path to pay; the kernel is not even
            # asked (a session with it costs a lock that waits on its stager).
            stash.reason = (f"the kernel holds {move.needed / 1e9:.1f} GB of GPU memory: under "
                            f"{MIN_STASH / 1e9:.0f} GB the driver alone is as fast")
            return
        if gpus_mod.one_context_only(move.target.uuid):
            stash.reason = (f"GPU {move.target.index} takes one process's CUDA context at a time (its compute "
                            "mode): the stash's helper there would keep the kernel out")
            return
        # What the target has beyond the move (read in prepare, after the kernel's cache was dropped): the
        # helper allocates that much, up to what the kernel holds, as soon as its context is made, while the
        # kernel gathers. Should another process fill the target meanwhile, the remap finds no room and the
        # move is undone (as when it fills up between the check and the remap).
        budget = ctx.target_room if ctx.target_room is not None else placement.free(move.target) - move.needed
        early = min(move.needed, budget - HELPER_RESERVE)
        invited = time.perf_counter()
        stash.warm(move.target.uuid, early if early >= MIN_STASH else 0)
        if ctx.invite:
            stash.reason = ctx.kernel.invite_stager(stash.path, stash.token)
            if stash.reason:
                return
        offer = stash.accept(timeout=10.0 if ctx.invite else 30.0)
        stash.seconds["invite"] = time.perf_counter() - invited
        if offer is not None and offer.safe_point:  # a busy cell waits at its safe point from now on
            stash.seconds["safe_point"] = stash.seconds["invite"]
        if offer is None or offer.aside:
            return
        stash.stash(move.target.uuid, budget)
    except Exception as exc:
        if stash.held or stash.unsure:
            raise  # tensors may be in the stash: closing it has the kernel take them back, not the driver
        stash.reason = str(exc) or type(exc).__name__  # nothing left the kernel: the driver moves it all
        return
    finally:
        if not stash.held and not stash.unsure:
            stash.stop_helper()  # it stepped aside: no context of the helper's may take the target's room
    ctx.undo(lambda: take_back(ctx))


def take_back(ctx: MoveContext) -> None:
    """Undo of the stash: the tensors come back onto the GPU the kernel is on again. A kernel that a
    failed rollback left locked cannot take them: they stay in the stash (kept) until it can."""
    assert ctx.peer_stash is not None
    if ctx.peer_stash.held and not ctx.gpu.runs():
        raise GpuError("The kernel is left locked, so its tensors stay in the stash on the target GPU; it takes "
                       "them back by itself once unlocked. Restart the kernel if it stays stuck.")
    ctx.peer_stash.unstash()


def unstash(ctx: MoveContext) -> None:
    assert ctx.peer_stash is not None
    ctx.peer_stash.unstash()


def verify(ctx: MoveContext) -> None:
    """NVML, read here in the server, must show the kernel's memory on the targets and none left elsewhere."""
    assert ctx.move is not None
    deadline = time.monotonic() + ctx.verify_timeout
    targets = {p.target.uuid for p in ctx.move.pairs}
    while True:
        gpus = ctx.tools.inventory()
        on = {g.uuid for g in gpus for p in ctx.gpu.pids if p in g.processes}
        if on == targets:
            return
        if time.monotonic() >= deadline:
            where = ", ".join(str(g.index) for g in gpus if g.uuid in on) or "no GPU"
            wanted = ", ".join(str(i) for i in ctx.move.to_gpus)
            plural = "s" if ctx.move.several else ""
            raise GpuError(f"After the move NVML shows the kernel on {where}, not on GPU{plural} {wanted} alone; it "
                           "was moved back.")
        time.sleep(0.1)


def close_stash(ctx: MoveContext) -> None:
    assert ctx.peer_stash is not None
    ctx.peer_stash.close(kernel_runs=not ctx.peer_stash.held or ctx.gpu.runs())


def run(kernel: KernelProcess, tools: Tools, to: int | Sequence[int], stash: Stash | None = None,
        invite: bool = True, verify_timeout: float = 10.0, progress: ProgressCallback | None = None,
        via: str | None = AUTO) -> Outcome:
    """Move the running kernel onto GPU ``to`` (or, on several GPUs, onto one GPU named per GPU it holds).
    With ``stash`` (listening) and the GPUs' peer access (``via``), its large tensors take the fast path:
    the kernel is invited to connect to it (``invite``), or the caller, the kernel's own %migrate, connects
    itself. Without peer access (or ``via="host"``), they go through the host stash."""
    ctx = MoveContext(kernel, tools, to, stash, invite, verify_timeout, via)
    result = saga().run(ctx, progress)
    move = ctx.move
    assert move is not None
    if ctx.via == PEER and stash is not None:
        fast_path = FastPath(stash.stashed, stash.reason, dict(stash.seconds), PEER,
                             stash.left if stash.stashed else None)
    elif ctx.via == HOST:
        said = ctx.stash_said
        seconds = {k: float(v) for k, v in (("stash", said.get("seconds")), ("unstash", said.get("unstash_seconds")),
                                            ("safe_point", said.get("safe_point"))) if v is not None}
        fast_path = FastPath(int(said.get("stashed") or 0), ctx.aside, seconds, HOST)
    else:
        fast_path = FastPath(0, ctx.aside, {}, None) if ctx.aside else None
    return Outcome(result, bytes=move.needed, from_gpu=move.source.index, to_gpu=move.target.index,
                   from_gpus=move.from_gpus if move.several else None, to_gpus=move.to_gpus if move.several else None,
                   fast_path=fast_path)
