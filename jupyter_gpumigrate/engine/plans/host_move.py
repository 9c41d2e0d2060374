"""A move to another host, and back home. The other host is a :class:`HostLink` (peers.py).

Away (``move_to_host``):

    prepare     that host checks it can take the tree; images     undo: remove them (logs kept)
                folder and manifest here
    stream      the images start going there as they are written  undo: stop sending; that host
                (if that host takes files that grow): the stash's discards what it has
                files as the kernel writes them, CRIU's pages as
                the dump writes them
    stash       an idle kernel writes its large buffers into the  undo: the kernel reads them back
                images and frees them (the suspend's host stash)
    send stash  (without stream) the stash's files start going    undo: stop sending; that host
                there, written already, while the driver and CRIU discards what it has
                run
    prefetch    (GPU, stash, if that host can) that host begins    (undone with stream / send stash:
    there       its restore's prefetch: the stash helper reads     that host discards what it has, its
                each chunk onto the GPU the restore will take as   prefetch with it)
                soon as it has arrived (never fails the move)
    lock        CUDA calls wait (GPU only)                        undo: unlock
    checkpoint  GPU memory into host memory (GPU only)            undo: back onto its GPU
    dump        CRIU writes the tree and kills it (not if a file  undo: restore it here, from the images
                sent early failed)
    transfer    the rest of the images go there                   undo: that host discards them
    restore     this host's record of the kernel names that host  undo: that host discards it; the
                (a server that dies from here on finds it there); record goes
                that host restores the tree (onto its GPU), and
                the kernel reads its buffers back there
    adopt       this host relays the kernel's ports there, and    undo: stop relaying
                the kernel answers through the relay
    on success  this host's copy of the images is stale: removed

Home (``return_home``):

    prepare     this host can take the tree back; images folder   undo: remove it (logs kept)
                (in memory where there is room, as a suspend's)
    stream      the files of that host's dump come here as they  undo: stop fetching
                are written (if that host serves them so): the
                stash's parts, then CRIU's pages files
    fetch stash (without stream) the stash's parts come here once  undo: stop fetching
                that host's stash wrote them all, while its
                driver and CRIU run (if that host lists them so)
    dump        that host dumps the kernel (its images stay       undo: that host resumes it
                there), an idle one's large buffers written first
    prefetch    (GPU, stashed there) its manifest and stash's      undo: the helper frees and ends
                index read from there first; choose the GPU; the
                stash helper reads the stashed CUDA buffers onto
                it, each chunk as soon as it has arrived here,
                while the transfer and the next three phases run
                (as a resume's: engine/prefetch.py)
    transfer    the rest of the images come here (a file that     (the folder goes with prepare's undo;
                came whole as it was written is kept); choose     a prefetch begun here: as above)
                the GPU (unless the prefetch did, from the same
                manifest); where no prefetch began before and
                one can, it begins now
    restore     the relay lets go of the ports; CRIU restores     undo: kill the tree, relay again
    remap       GPU memory onto the chosen GPU (GPU only)         (undone with the restore)
    unlock      CUDA calls go on (GPU only)                       undo: lock (tidiness: the tree is killed)
    unstash     the kernel reads its buffers back (if it wrote):   (undone with the restore)
                its CUDA buffers from the prefetch where it
                holds them; then the helper ends
    adopt       the tree is the kernel again; its record names    (last)
                the dump there until that is removed
    on success  the images here and there are removed (a dump there that cannot be, a server that dies
                first: the next server removes it as it starts)

This host keeps its copy of the images until the kernel answers from there: any failure before that
brings the kernel back here, from that copy.

The stash (the suspend's, kernel/hoststash.py) is what makes a large kernel quick to move either way:
its own threads write its large buffers (CUDA ones through pinned memory) into the images at memory
speed and free them, so the CUDA driver checkpoints only the context and CRIU dumps, and the other side
restores, only the rest; the files travel with CRIU's over the same link (as they are written, where
that host takes files that grow), and the restored kernel reads them back, checking each chunk. The
other host has the kernel write or read them with the kernel's key, which this host sends with each call
that needs it (held in memory there for that call). A busy kernel is not asked (its cell's safe point
could not be released across hosts): CRIU and the driver carry it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Protocol

from .. import hostfit, netstate
from . import resume, suspend
from ..errors import GpuError, ImageError, InvalidState, MigrateError
from ..images import DISK, MANIFEST, MEMORY, choose, manifest_from
from ..kernelproc import KernelProcess, kernel_listens
from ..saga import ON_SUCCESS, ProgressCallback, Saga, Step
from .common import (KernelContext, Outcome, Tools, adopt_restored, checkpoint, dump, forget_images, gpu_use,
                     lock, new_images, place, remap_restored, restore_tree, running_pid,
                     unlock_restored)

log = logging.getLogger(__name__)


def away() -> Saga[HostContext]:
    return Saga(
        "move_to_host",
        [
            Step("prepare", prepare_away),
            Step("stream", stream, when=lambda ctx: ctx.link.takes_growing()),
            Step("stash", stash_between_cells, when=lambda ctx: suspend.worth_asking(ctx) and ctx.link.takes_stash()),
            Step("send stash", stream, when=lambda ctx: "stashed" in ctx.stash and not ctx.link.takes_growing()),
            Step("prefetch there", prefetch_there,
                 when=lambda ctx: "stashed" in ctx.stash and ctx.on_gpu() and ctx.link.takes_prefetch()),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump_away),
            Step("transfer", send_images),
            Step("restore", restore_there),
            Step("adopt", adopt_there),
            Step("forget images", forget_images, kind=ON_SUCCESS),
        ],
        start_from=("running",),
        success="remote",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be moved.",
    )


def home() -> Saga[HostContext]:
    return Saga(
        "return_home",
        [
            Step("prepare", prepare_home),
            Step("stream", stream_home, when=lambda ctx: ctx.link.takes_growing()),
            Step("fetch stash", fetch_stash_home, when=lambda ctx: ctx.link.fetches_stash()),
            Step("dump", dump_there),
            Step("prefetch", prefetch_home, when=stashed_on_gpu_there),
            Step("transfer", fetch_images),
            Step("restore", restore_here),
            Step("remap", remap_restored, when=KernelContext.on_gpu),
            Step("unlock", unlock_restored, when=KernelContext.on_gpu),
            Step("unstash", unstash_here, when=lambda ctx: bool(ctx.manifest and ctx.manifest.stash)),
            Step("adopt", adopt_home),
            Step("forget images", forget_images, kind=ON_SUCCESS),
            Step("forget images there", discard_there, kind=ON_SUCCESS),
        ],
        start_from=("remote",),
        success="running",
        refuse=lambda state: f"The kernel is {state} here, not on another host: it is home already.",
    )


class HostLink(Protocol):
    """Another host, as a move of one kernel needs it (the server extension implements it over HTTPS).

    Each method raises a :class:`MigrateError` whose message says what went wrong there.
    """

    host: str

    def check(self, requirements: hostfit.Requirements, gpu: dict | None, to_gpu: int | None) -> None:
        """Refuse, with every reason, if that host cannot restore the tree (PIDs, ports, files, GPU)."""

    def send_images(self, images: Path) -> int:
        """Copy the image folder there (what :meth:`start_sending` has not sent); the bytes sent in all."""

    def start_sending(self, images: Path, expect: int, follow: bool = False) -> None:
        """Begin sending the files now in ``images`` there, in the background; ``expect``: the bytes the whole
        images are judged to take (that host places them by it, and checks its room). ``follow``: also send
        the files the dump will append to, as it writes them (:meth:`send_images` ends them)."""

    def check_sending(self) -> None:
        """Raise what went wrong with a file sent since :meth:`start_sending`, if anything did so far."""

    def stop_sending(self) -> None:
        """Send no more of what :meth:`start_sending` began; return once the files on their way ended."""

    def takes_growing(self) -> bool:
        """Whether a dump's pages files travel as they are written: going away, that host takes them so (it said
        so in :meth:`check`) and this host's setting lets them; coming home, that host serves them so (it said
        so in :meth:`requirements`, by its own setting) and this host's setting lets them."""

    def takes_stash(self) -> bool:
        """Whether that host can have the kernel write and read back its large buffers (it said so in
        :meth:`check` or :meth:`requirements`; an older one cannot)."""

    def takes_prefetch(self) -> bool:
        """Whether that host begins a GPU kernel's prefetch as its images arrive (it said so in :meth:`check`)."""

    def begin_prefetch(self, index: dict, gpu: dict, to_gpu: int | None) -> dict:
        """Have that host begin its restore's prefetch now, as the stash's files arrive (``index``: the stash's
        index as its file holds it; ``gpu``: the GPU the kernel holds here): ``{"gpu", "reason"}``, the GPU it
        began on, or why none began."""

    def restore(self, to_gpu: int | None, stashed: bool = False) -> dict:
        """Restore the kernel there from the images sent (and onto its GPU; ``stashed``: the kernel then reads
        back the buffers it wrote into them); what it says of it (pid, gpu, gpus, timings, stash)."""

    def discard(self) -> None:
        """Kill the kernel there if it runs, and delete its images there."""

    def attach(self, clients: dict | None = None) -> None:
        """Bind the kernel's ports here and relay them to the kernel there; then wait (briefly) until
        ``clients`` (port -> how many) are connected to them again."""

    def detach(self) -> None:
        """Stop relaying and free the kernel's ports here."""

    def requirements(self) -> hostfit.Requirements:
        """What the tree running there needs of a host."""

    def estimate(self) -> int | None:
        """The memory the way home's images in memory would take here: the kernel's host and GPU memory there (its
        images), and its host memory again (its process restored beside them), as :meth:`requirements` learnt
        them; None where that host does not say (an older version)."""

    def dump(self, stash_min: int | None = None) -> dict:
        """Suspend the kernel there; its images stay there. With ``stash_min``, a kernel that can (idle, and that
        host able to ask it) holding that many bytes of large buffers or more writes them into the images first
        (the suspend's stash). What that host said of it: ``bytes``, and ``timings`` of its phases."""

    def read_json(self, name: str) -> dict:
        """The image file ``name`` there, a small JSON one (the manifest, the stash's index), as parsed."""

    def resume(self) -> None:
        """Undo of :meth:`dump`: bring the kernel back to life there."""

    def fetches_stash(self) -> bool:
        """Coming home, where the files do not come as they are written (not :meth:`takes_growing`): whether
        that host lists its stash's parts once its stash wrote them all, while its dump runs on (it said so in
        :meth:`requirements`; an older one does not)."""

    def start_fetching(self, images: Path, stash_only: bool = False) -> None:
        """Begin fetching into ``images`` the files that host's dump appends to, as it writes them (it said
        it serves them so: :meth:`takes_growing`); ``stash_only``: its stash's parts only, each once all are
        written (:meth:`fetches_stash`). :meth:`fetch_images` takes what came whole."""

    def stop_fetching(self) -> None:
        """Fetch no more of what :meth:`start_fetching` began; return once the fetches on their way ended."""

    def fetch_images(self, images: Path) -> int:
        """Copy the kernel's images from there into ``images``; the bytes received."""


class HostContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, link: HostLink, to_gpu: int | None) -> None:
        super().__init__(kernel, tools)
        self.link = link
        self.to_gpu = to_gpu
        #: bytes sent there or received from there
        self.transferred = 0
        #: what that host said of the kernel it restored: pid, gpu, gpus
        self.there: dict = {}
        #: what that host said of its dump for the way home: bytes, timings of its phases
        self.dumped: dict = {}


# -- away ---------------------------------------------------------------------------------------------


def prepare_away(ctx: HostContext) -> None:
    pid = running_pid(ctx)
    # The other host says everything it lacks before anything here is touched.
    _, held, _ = gpu_use(ctx, pid)
    refuse_several(held)
    ctx.link.check(hostfit.requirements_of(pid, kernel_listens(ctx.kernel.kernel_connection_info)),
                   held[0] if held else None, ctx.to_gpu)
    # Images that live only until the kernel answers there: in memory where there is room (images.choose),
    # as the server's suspend_to allows.
    new_images(ctx, pid, ctx.tools.images)


def refuse_several(held: list[dict]) -> None:
    """A move to another host takes a kernel on one GPU: the other host checks room for one GPU before the
    dump, and a return names one GPU. Said before anything is touched."""
    if len(held) > 1:
        where = " and ".join(str(h["index"]) for h in sorted(held, key=lambda h: int(h["index"])))
        raise GpuError(f"The kernel holds GPUs {where}: a move to another host takes a kernel on one GPU. Free the "
                       "others in the kernel (delete their tensors, then torch.cuda.empty_cache()), or move it "
                       "between this host's GPUs (--to-gpu with one GPU for each).")


def stash_between_cells(ctx: HostContext) -> None:
    """The suspend's stash (suspend.stash), asked of an idle kernel only: a busy cell's safe point is
    released through a folder of this host, which the kernel there cannot see. Where its parts go as they
    are written (stream), their sending stops before the kernel reads them back, in any undo: registered
    after the stash's own undo, it runs first."""
    try:
        suspend.stash(ctx, idle_only=True)
    finally:
        ctx.undo(ctx.link.stop_sending)


def stream(ctx: HostContext) -> None:
    """The images start going there before the dump, instead of after it: if that host takes files that grow,
    from before the stash, each file as it is written (the stash's parts as the kernel's threads write them,
    then CRIU's pages files as the dump writes them); if not, after the stash, its files, written already. The
    driver's checkpoint and CRIU's dump run while the bytes travel."""
    ctx.undo(ctx.link.discard, cleanup=True)
    ctx.link.start_sending(ctx.images, ctx.estimate, follow=ctx.link.takes_growing())
    ctx.undo(ctx.link.stop_sending)


def prefetch_there(ctx: HostContext) -> None:
    """That host begins its restore's prefetch while the stash's files arrive, instead of once the restore
    begins: its helper reads each chunk onto the GPU the restore will take as soon as it is there (32 GB read
    onto the GPU after the transfer took 2.1-2.5 s of the restore). Never fails the move: where that host
    cannot (no room for a second copy, say), its restore makes its own, or the kernel reads its files there.
    Its undo is the stream's (or send stash's), which has that host discard what it has of the kernel, its
    prefetch with it."""
    assert ctx.manifest is not None and ctx.manifest.gpus
    try:
        index = json.loads((ctx.images / "stash-index.json").read_text())
        said = ctx.link.begin_prefetch(index, ctx.manifest.gpus[0], ctx.to_gpu)
    except (OSError, ValueError, MigrateError) as exc:
        said = {"gpu": None, "reason": f"it could not be asked ({exc})"}
    if said.get("reason"):  # its restore's own account of the prefetch says what it did instead
        log.info("kernel %s: %s begins no prefetch as its images arrive: %s", ctx.kernel.kernel_id, ctx.link.host,
                 said["reason"])
    else:
        log.info("kernel %s: %s begins its prefetch onto its GPU %s as its images arrive", ctx.kernel.kernel_id,
                 ctx.link.host, said.get("gpu"))


def dump_away(ctx: HostContext) -> None:
    """CRIU's dump, unless a file sent early failed already (that host's disk full, say): the dump ends the
    process, and undoing it costs a restore here."""
    ctx.undo(ctx.link.stop_sending)  # a failed dump stops the pages on their way before the rest is undone
    ctx.link.check_sending()
    dump(ctx)


def send_images(ctx: HostContext) -> None:
    # Whatever arrived there goes; if that host is gone, so is what it had: litter, not a kernel in doubt.
    ctx.undo(ctx.link.discard, cleanup=True)
    ctx.transferred = ctx.link.send_images(ctx.images)


def restore_there(ctx: HostContext) -> None:
    # Written down first: a server that dies from here on has its next one ask that host, whose copy, once
    # restored, is the kernel (the images here are, if it has none), instead of resuming a second copy here.
    ctx.kernel.record_moving(ctx.link.host)
    ctx.undo(lambda: ctx.kernel.record_moving(None))
    try:
        ctx.there = ctx.link.restore(ctx.to_gpu, stashed="stashed" in ctx.stash)
    except MigrateError as exc:  # that host's own words (its resume's) end with what it did there: say ours
        raise MigrateError(f"{exc} The move is undone: the kernel is brought back here, from its images here.") \
            from exc
    if "stashed" in ctx.stash:
        said = ctx.there.get("stash") or {}
        ctx.stash["unstashed"] = int(said.get("unstashed") or 0)
        if isinstance(said.get("prefetch"), dict):  # that host's prefetch, where it made one
            ctx.stash["prefetch"] = said["prefetch"]
    # A kernel runs there now: if it cannot be discarded, two copies may run, which is no litter.
    ctx.undo(ctx.link.discard)


def adopt_there(ctx: HostContext) -> None:
    # This host keeps the kernel's ports and relays them: its clients re-dial, as after a resume, and
    # reach the kernel there. It must answer through the relay, or all is undone.
    assert ctx.manifest is not None
    ctx.link.attach(ctx.manifest.clients)
    ctx.undo(ctx.link.detach)
    ctx.kernel.adopt_remote(ctx.link, ctx.there)
    if not ctx.kernel.wait_ready(max(ctx.tools.reconnect_timeout, 10.0)):
        raise InvalidState(f"The kernel was restored on {ctx.link.host} but does not answer through the relay; "
                           "it was brought back here.")


def move_to_host(kernel: KernelProcess, tools: Tools, link: HostLink, to_gpu: int | None = None,
                 progress: ProgressCallback | None = None) -> Outcome:
    """Move the running kernel to ``link``'s host (onto its GPU ``to_gpu``, or where it has room)."""
    ctx = HostContext(kernel, tools, link, to_gpu)
    result = away().run(ctx, progress)
    assert ctx.manifest is not None
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest, to_host=link.host,
                   to_gpu=ctx.there.get("gpu"), transferred=ctx.transferred, stash=ctx.stash or None,
                   from_gpu=ctx.manifest.gpus[0]["index"] if ctx.manifest.gpus else None)


# -- home ---------------------------------------------------------------------------------------------


def prepare_home(ctx: HostContext) -> None:
    needs = ctx.link.requirements()
    needs.listens = []  # its ports are held here by the relay, which lets go of them before the restore
    problems = hostfit.problems(needs)
    if problems:
        raise InvalidState(f"The kernel cannot come back here: {'; '.join(problems)}. It runs on "
                           f"{ctx.link.host} as before.")
    store, kernel_id = ctx.tools.store, ctx.kernel.kernel_id
    # In memory where there is room, as a suspend's (images.choose, the server's suspend_to): 32 GB received
    # on disk were 28 GB of dirty pages, which every writer of the host then waited behind (a record's fsync:
    # 0.3-0.7 s). An older host that does not say the kernel's size: on disk, as before. A folder of the
    # kernel's left from before, wherever it is, is replaced.
    # The room asked of memory: the images, and the restored process beside them until they are removed,
    # charged to this server's cgroup. No room for 'memory' fails no way home: it goes to disk, saying why.
    estimate = ctx.link.estimate()
    if estimate is None:
        ctx.images_where, ctx.images_why = DISK, f"{ctx.link.host} does not say the kernel's size"
    else:
        try:
            ctx.images_where, ctx.images_why = choose(store, ctx.tools.images, estimate, os.getpid())
        except ImageError as exc:
            ctx.images_where, ctx.images_why = DISK, str(exc)
    ctx.images = store.create(kernel_id, ctx.images_where)
    log.info("gpumigrate: kernel %s: its images come home %s (%s)", kernel_id,
             "in memory" if ctx.images_where == MEMORY else "on disk", ctx.images_why)
    ctx.undo(lambda: store.remove(kernel_id, keep_logs=True), cleanup=True)


def stream_home(ctx: HostContext) -> None:
    """The files of that host's dump (its stash's parts, then CRIU's pages files) come as they are written,
    instead of after it."""
    ctx.link.start_fetching(ctx.images)
    ctx.undo(ctx.link.stop_fetching)


def fetch_stash_home(ctx: HostContext) -> None:
    """The stash's parts come once that host's stash wrote them, while its driver checkpoints and CRIU dumps:
    the mirror of 'send stash' going away."""
    ctx.link.start_fetching(ctx.images, stash_only=True)
    ctx.undo(ctx.link.stop_fetching)


def dump_there(ctx: HostContext) -> None:
    ctx.dumped = ctx.link.dump(ctx.tools.host_stash_min) or {}
    ctx.undo(ctx.link.resume)


def stashed_on_gpu_there(ctx: HostContext) -> bool:
    """Whether the dump there checkpointed a GPU kernel that was asked its stash (where this server's
    ``resume_prefetch`` lets a restore here prefetch it)."""
    timings = ctx.dumped.get("timings") or {}
    return bool(ctx.tools.prefetch and "checkpoint" in timings and "stash" in timings)


def prefetch_home(ctx: HostContext) -> None:
    """The dump there is over: its manifest and its stash's index (small) are read from there first, the GPU
    is chosen (a GPU here that cannot take the kernel fails the move now, not after the transfer), and the
    stash helper begins reading the stash's parts onto it as they arrive here, each chunk as soon as its file
    holds it (resume.prefetch). Where the two cannot be read first, one begins after the transfer, as before;
    where the stash stepped aside there, none: the kernel reads its files itself, and its account says why."""
    try:
        manifest = manifest_from(ctx.link.read_json(MANIFEST), f"{ctx.link.host}'s {MANIFEST}")
        index = ctx.link.read_json("stash-index.json") if manifest.stash else None
    except MigrateError as exc:  # the transfer's phase begins one once the files are here, as before
        log.warning("kernel %s: its manifest and stash's index could not be read from %s first (%s): its prefetch "
                    "begins after the transfer", ctx.kernel.kernel_id, ctx.link.host, exc)
        return
    if manifest.kernel_id != ctx.kernel.kernel_id:
        ctx.no_prefetch = f"{ctx.link.host}'s manifest is not the kernel's"  # the transfer refuses it
        return
    place(ctx, manifest, ctx.to_gpu, _no_gpu_there(ctx))
    if index is None:
        ctx.no_prefetch = f"the kernel's stash stepped aside on {ctx.link.host}"
        return
    resume.prefetch(ctx, index=index)


def _no_gpu_there(ctx: HostContext) -> str:
    return f"The kernel holds no GPU on {ctx.link.host}, so it cannot come back onto GPU {ctx.to_gpu}."


def fetch_images(ctx: HostContext) -> None:
    ctx.transferred = ctx.link.fetch_images(ctx.images)
    manifest = ctx.tools.store.read_manifest(ctx.kernel.kernel_id)
    if manifest.kernel_id != ctx.kernel.kernel_id:
        raise ImageError(f"{ctx.link.host} sent the images of kernel {manifest.kernel_id}, not "
                         f"{ctx.kernel.kernel_id}.")
    if ctx.manifest is not None and manifest != ctx.manifest:  # placed by the prefetch, from what it read first
        log.warning("kernel %s: the manifest that came from %s is not the one read from there first: its GPU is "
                    "chosen again, and the prefetch ends", ctx.kernel.kernel_id, ctx.link.host)
        if ctx.prefetch is not None:
            ctx.prefetch.stop(wait=True)  # its memory free before the GPU is chosen again
            ctx.prefetch = None
        ctx.no_prefetch, ctx.manifest = "the manifest that came is not the one read first", None
    if ctx.manifest is None:
        place(ctx, manifest, ctx.to_gpu, _no_gpu_there(ctx))
    if ctx.prefetch is None and ctx.no_prefetch is None and resume.prefetching(ctx):
        resume.prefetch(ctx)  # none began before the transfer (the two files could not be read first): now


def restore_here(ctx: HostContext) -> None:
    assert ctx.manifest is not None
    # The clients to wait for after the restore are those of the relay here, not those the kernel had
    # there (the relay's own).
    ports = {port for _, port in kernel_listens(ctx.kernel.kernel_connection_info)}
    ctx.manifest.clients = {p: n for p, n in netstate.client_counts([os.getpid()]).items() if p in ports}
    ctx.link.detach()  # the kernel's ports, held by the relay, are the kernel's own again
    ctx.undo(ctx.link.attach)
    restore_tree(ctx)


def unstash_here(ctx: HostContext) -> None:
    """The kernel, restored here, reads back the buffers it wrote there, each chunk checked. If it cannot,
    everything is undone: it runs on there, from its images there."""
    assert ctx.manifest is not None
    try:
        said = resume.take_back(ctx)
    except (RuntimeError, OSError, TimeoutError) as exc:
        raise ImageError(f"The kernel could not read its large buffers back here ({exc or 'no answer in time'}); "
                         f"it runs on, on {ctx.link.host}.") from exc
    ctx.stash = {"stashed": int(ctx.manifest.stash.get("stashed", 0)), "unstashed": int(said.get("unstashed") or 0),
                 **({"prefetch": said["prefetch"]} if "prefetch" in said else {})}


def adopt_home(ctx: HostContext) -> None:
    # The dump there is written down with the kernel's adoption (the same write of its record): whatever ends
    # this server before that dump is discarded, the next one discards it, and no memory there is held for ever.
    ctx.kernel.record_copy_left(ctx.link.host)
    adopt_restored(ctx)


def discard_there(ctx: HostContext) -> None:
    try:
        ctx.link.discard()  # its images there hold the kernel's memory
    except MigrateError:
        log.warning("kernel %s is back, but %s could not delete its images there: this server's next start does",
                    ctx.kernel.kernel_id, ctx.link.host)
        return
    ctx.kernel.record_copy_left(None)


def return_home(kernel: KernelProcess, tools: Tools, link: HostLink, to_gpu: int | None = None,
                progress: ProgressCallback | None = None) -> Outcome:
    """Bring the kernel that runs on ``link``'s host back to this one (onto GPU ``to_gpu``)."""
    ctx = HostContext(kernel, tools, link, to_gpu)
    result = home().run(ctx, progress)
    assert ctx.manifest is not None
    return Outcome(result, bytes=ctx.manifest.image_bytes, manifest=ctx.manifest, to_host="",
                   from_host=link.host, transferred=ctx.transferred, stash=ctx.stash or None,
                   to_gpu=ctx.move.target.index if ctx.move else None)
