"""A transplant: where the driver cannot go (another GPU model, the CPU), the notebook's objects go.

    prepare     the target checked (GPU or CPU), the dry run (what      undo: remove the folder
                carries), a folder for the objects
    start       a new kernel process starts for the target: it imports  undo: kill it
                and sets up CUDA while the objects are written
    export      the kernel writes its objects into the folder           (removed with the folder)
    load        the new process reads them (onto its GPU, or into host  (killing it undoes it);
                memory), then waits, the kernel's ports not yet taken;  undo: remove the images' folder
                the source's image folder, placed now
    stash       the source writes its large buffers into its images     undo: it reads them back
                and frees them (the suspend's host stash: the dump
                that keeps it for a rollback is then small)
    lock        the source's CUDA calls wait (GPU only)                 undo: unlock
    checkpoint  the source's GPU memory into its host memory            undo: back onto its GPU
    dump        CRIU writes the source into images and kills it: the    undo: restore it from the images
                kernel's ports are free
    switch      the new process takes the ports and answers: it is the  undo: kill it (the source comes back
                kernel now, under the same kernel id                    by the dump's undo)
    on success  the source's images are kept (on disk) for ``keep_source`` seconds, so that the kernel can go
                back to them (plans/back.py); without that time, removed
    always      the objects' folder goes

The source runs on, untouched, until the new process holds every object (load). What would be lost is
said before anything starts (the dry run, kernel/transplant.py's survey), and is refused outright when
nothing carries. A failure at any phase brings the source back as it was; the server holds what the
notebook sends meanwhile, and delivers it to whichever process is the kernel at the end (autoresume.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from pathlib import Path

from .. import netstate, placement, proctree
from ..errors import GpuError, ImageError, InvalidState, MigrateError
from ..images import cgroup_room, host_memory, write_durably
from ..kernelproc import KernelProcess
from ..saga import ALWAYS, ON_SUCCESS, ProgressCallback, Result, Saga, Step
from . import suspend
from .common import KernelContext, Outcome, Tools, checkpoint, dump, forget_images, gpu_use, lock, new_images, \
    running_pid

log = logging.getLogger(__name__)

#: How long the kernel and the new process get to write and read the objects: this, plus a second per
#: RATE bytes.
WAIT = 60.0
RATE = 2 * 10**8
#: In the source's images once the new process is told to take the kernel's ports: its PID and start time.
SWITCHED = "transplanted.json"


def saga() -> Saga[TransplantContext]:
    return Saga(
        "transplant",
        [
            Step("prepare", prepare),
            Step("start", start),
            Step("export", export),
            Step("load", load),
            Step("stash", suspend.stash, when=suspend.worth_asking),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump),
            Step("switch", switch),
            Step("keep the source", keep_source, kind=ON_SUCCESS),
            Step("remove the objects", remove_folder, kind=ALWAYS),
            Step("forget the new process", lambda ctx: ctx.kernel.transplant_finish(), kind=ALWAYS),
        ],
        start_from=("running",),
        success="running",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be transplanted.",
        # A kernel shut down while its objects are written or read: the transplant is undone there (the new
        # process killed, the folder removed), not carried on to a process that would be shut down at once.
        stoppable=("start", "export", "load", "stash"),
    )


class TransplantContext(KernelContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, to_gpu: int | None,
                 accept_left: list[str] | None = None) -> None:
        super().__init__(kernel, tools)
        #: the names the caller was shown would not carry, and accepted (None: not asked)
        self.accept_left = accept_left
        #: the target: a GPU's index, or None for the CPU
        self.to_gpu = to_gpu
        self.target_uuid: str | None = None
        self.target_index: int | None = None
        self.from_gpu: int | None = None
        #: the dry run's answer (kernel/transplant.py's survey)
        self.survey: dict = {}
        self.folder: Path | None = None
        self.exported: dict = {}
        self.loaded: dict = {}
        #: the new process, once started
        self.new_pid: int | None = None
        #: seconds the new process took from the word to go to its kernel set up on the kernel's ports
        self.started: float | None = None

    def wait(self) -> float:
        return WAIT + int(self.survey.get("bytes", 0)) / RATE


def prepare(ctx: TransplantContext) -> None:
    pid = running_pid(ctx)
    _, held, gpus = gpu_use(ctx, pid)
    if len(held) > 1:
        placement.source_gpu(gpus, held)  # raises: one GPU only
    ctx.from_gpu = int(held[0]["index"]) if held else None
    target = None
    if ctx.to_gpu is not None:
        target = placement.gpu_by_index(gpus, ctx.to_gpu)
        if target.mig_enabled:
            raise GpuError(f"GPU {target.index} is split into MIG instances: a transplant needs a whole GPU.")
    survey(ctx)
    nbytes = int(ctx.survey.get("bytes", 0))
    if target is not None:
        ctx.target_uuid, ctx.target_index = target.uuid, target.index
        on_gpu = int(ctx.survey.get("gpu_bytes", nbytes))
        room = placement.free(target)  # the source, if on it, still holds its memory while the objects load
        if room < on_gpu + placement.TRANSPLANT_HEADROOM:
            raise GpuError(f"GPU {target.index} has {room / 1e9:.1f} GB free; the kernel's GPU tensors need "
                           f"{on_gpu / 1e9:.1f} GB and {placement.TRANSPLANT_HEADROOM / 1e9:.0f} GB beside them. Free memory on it, or "
                           "pick another target. The kernel runs on, unchanged.")
    else:
        total, available = host_memory()
        if total and available < 2 * nbytes:  # the objects' folder, and the new process's copy
            raise MigrateError(f"The host has {available / 1e9:.1f} GB of memory available; a transplant to the "
                               f"CPU of {nbytes / 1e9:.1f} GB of objects needs twice that. Free memory, then try "
                               "again. The kernel runs on, unchanged.")
        left = cgroup_room(pid)
        if left is not None and left < 2 * nbytes:
            raise MigrateError(f"The kernel's memory cgroup has room for {left / 1e9:.1f} GB more; a transplant to "
                               f"the CPU of {nbytes / 1e9:.1f} GB of objects needs twice that within it (its limit, "
                               "memory.max, counts the objects' files and the new process). The kernel runs on, "
                               "unchanged.")
    ctx.folder = ctx.tools.store.scratch(ctx.kernel.kernel_id, nbytes, pid)
    ctx.undo(lambda: remove_folder(ctx))


def survey(ctx: TransplantContext) -> None:
    """The dry run, in the kernel: what of it carries; refused if nothing does, or if more would be left
    behind than the caller accepted."""
    try:
        ctx.survey = ctx.kernel.transplant_survey(WAIT)
    except TimeoutError as exc:
        raise MigrateError(f"The kernel did not say within {WAIT:.0f} s what of it would carry (a cell that runs "
                           "long?): try again once it is idle. It runs on, unchanged.") from exc
    except RuntimeError as exc:
        raise MigrateError(f"The kernel could not say what of it would carry ({exc}); it runs on, "
                           "unchanged.") from exc
    except OSError as exc:  # ConnectionError: the kernel ended, or its socket broke
        raise InvalidState(f"The kernel stopped answering as it was asked what of it would carry ({exc}): "
                           "restart it.") from exc
    except ValueError as exc:  # not the survey's JSON: another version of this package in the kernel?
        raise MigrateError(f"The kernel's answer was not understood ({exc}): install the same version of "
                           "jupyter-gpumigrate in the kernel's environment as in the server's.") from exc
    if not ctx.survey.get("carries"):
        left = ", ".join(r["name"] for r in ctx.survey.get("left", [])) or "none"
        raise InvalidState(f"Nothing of the kernel's would carry (its own names that cannot: {left}): restart it on "
                           "the target instead.")
    left = sorted(r["name"] for r in ctx.survey.get("left", []))
    if ctx.accept_left is not None and set(left) - set(ctx.accept_left):
        unseen = ", ".join(sorted(set(left) - set(ctx.accept_left)))
        raise InvalidState(f"Now {unseen} would not carry, which was not in what you accepted (the kernel ran "
                           "meanwhile?): look at the dry run again, then confirm. The kernel runs on, unchanged.")


def export(ctx: TransplantContext) -> None:
    assert ctx.folder is not None
    try:
        carries = [r["name"] for r in ctx.survey["carries"]]
        ctx.exported = ctx.kernel.transplant_export(str(ctx.folder), carries, ctx.wait())
    except TimeoutError as exc:
        raise MigrateError(f"The kernel did not write its objects within {ctx.wait():.0f} s (a cell that runs "
                           "long?): the transplant is given up; the kernel runs on.") from exc
    except RuntimeError as exc:
        if "No space left" in str(exc):
            raise ImageError(f"The disk of {ctx.folder.parent} is full: the kernel's objects could not be "
                             "written there. Free space on it, then try again. The kernel runs on, "
                             "unchanged.") from exc
        raise MigrateError(f"The kernel could not write its objects ({exc}); it runs on, unchanged.") from exc
    except OSError as exc:  # ConnectionError: the kernel ended, or its socket broke
        raise InvalidState(f"The kernel stopped answering while it wrote its objects ({exc}).") from exc


def start(ctx: TransplantContext) -> None:
    """The new process starts now, so that its imports and CUDA set-up overlap the export."""
    assert ctx.folder is not None
    ctx.new_pid = ctx.kernel.transplant_start(str(ctx.folder), ctx.target_uuid)
    ctx.undo(lambda: ctx.kernel.transplant_abandon())


def load(ctx: TransplantContext) -> None:
    """The new process reads the objects (onto its GPU, or into host memory), says it is ready, and
    waits: the source has the kernel's ports until it is dumped."""
    assert ctx.folder is not None and ctx.new_pid is not None
    deadline = time.monotonic() + ctx.wait()
    ready, failed = ctx.folder / "ready.json", ctx.folder / "failed.json"
    while not ready.exists():
        ctx.check_stop()
        if failed.exists():
            raise MigrateError(f"The new kernel process could not take the objects: "
                               f"{json.loads(failed.read_text()).get('error')}. The kernel runs on, unchanged.")
        if not proctree.is_alive(ctx.new_pid):
            raise MigrateError("The new kernel process ended before it had read the objects (its log, beside the "
                               "kernel's, says why). The kernel runs on, unchanged.")
        if time.monotonic() > deadline:
            raise MigrateError(f"The new kernel process did not read the objects within {ctx.wait():.0f} s. The "
                               "kernel runs on, unchanged.")
        time.sleep(0.05)
    ctx.loaded = json.loads(ready.read_text())
    if ctx.to_gpu is not None and ctx.loaded.get("off_gpu"):
        raise GpuError(f"The new kernel process does not see GPU {ctx.to_gpu} through PyTorch (torch.cuda is not "
                       f"available there), so {ctx.loaded['off_gpu']} GPU tensors would land in host memory. Check "
                       "that the kernel's PyTorch is a CUDA build matching the driver. The kernel runs on, "
                       "unchanged.")
    # The new process holds the objects: their files would only hold memory (a tmpfs) while the source is saved.
    remove_objects(ctx.folder)
    # The source's images, where they fit now that the new process holds the objects.
    new_images(ctx, ctx.pid or running_pid(ctx), ctx.tools.images)


def switch(ctx: TransplantContext) -> None:
    """The new process takes the kernel's ports, which the dump freed, and answers on them."""
    assert ctx.new_pid is not None and ctx.folder is not None
    if not proctree.is_alive(ctx.new_pid):
        raise MigrateError("The new kernel process ended while the source was being saved: the source is brought "
                           "back.")
    ctx.kernel.transplant_adopt()
    # Undone first, before the source is restored: the new process may hold the ports by then.
    ctx.undo(lambda: ctx.kernel.transplant_abandon())
    # Should this server die from here on, the next one must take the new process, not the source's images
    # (revive.py): said in the images, durably, before the new process takes the ports.
    marker = ctx.images / SWITCHED
    ctx.undo(lambda: marker.unlink(missing_ok=True))
    write_durably(marker, json.dumps({"pid": ctx.new_pid, "started": proctree.start_time(ctx.new_pid)}))
    os.kill(ctx.new_pid, signal.SIGUSR1)
    deadline = time.monotonic() + max(ctx.tools.reconnect_timeout, 30.0)
    while not ctx.kernel.wait_ready(1.0):
        if not proctree.is_alive(ctx.new_pid) or time.monotonic() > deadline:
            raise MigrateError("The new kernel process did not answer on the kernel's ports (the kernel's log says "
                               "why): the source is brought back.")
    # The source's clients (the server's own channels among them) re-dial by themselves; a SUB socket not
    # subscribed yet loses what the kernel publishes (the next cell's "busy"). As after a restore (adopt_tree):
    # wait, bounded, until every port has its clients back.
    if ctx.manifest is not None:
        expected = {int(port): n for port, n in ctx.manifest.clients.items()}
        missing = netstate.wait_for_clients(proctree.descendants(ctx.new_pid), expected,
                                            ctx.tools.reconnect_timeout, skip_own=True)
        if missing:
            log.info("kernel %s: %s client(s) did not reconnect to its new process within %.1f s (gone meanwhile?)",
                     ctx.kernel.kernel_id, sum(missing.values()), ctx.tools.reconnect_timeout)
    try:
        ctx.started = json.loads((ctx.folder / "started.json").read_text()).get("seconds")
    except (OSError, ValueError, AttributeError):  # an older new process, or a file cut short: not said
        pass


def keep_source(ctx: TransplantContext) -> None:
    """The source's images: kept for a while, so that the kernel can go back to them, or removed."""
    if ctx.tools.keep_source <= 0:
        forget_images(ctx)
        return
    try:
        ctx.tools.store.keep(ctx.kernel.kernel_id, time.time() + ctx.tools.keep_source, drop=(SWITCHED,))
    except (OSError, ImageError) as exc:  # a full disk, say: the kernel runs in its new process; only the way back is lost
        log.warning("kernel %s: its source could not be kept to go back to (%s): its images are removed",
                    ctx.kernel.kernel_id, exc)
        forget_images(ctx)


def remove_objects(folder: Path) -> None:
    """The objects' files (large), not the folder: what the new process writes there is still read."""
    for name in ("data.bin", "objects.pkl", *(p.name for p in folder.glob("storage-*.bin"))):
        (folder / name).unlink(missing_ok=True)


def remove_folder(ctx: TransplantContext) -> None:
    if ctx.folder is not None:
        shutil.rmtree(ctx.folder, ignore_errors=True)
        if ctx.folder.parent == ctx.tools.store.memory_root:
            try:
                ctx.folder.parent.rmdir()  # no litter in /dev/shm once nothing is there
            except OSError:
                pass


def run(kernel: KernelProcess, tools: Tools, to_gpu: int | None, accept_left: list[str] | None = None,
        progress: ProgressCallback | None = None) -> Outcome:
    """Carry the running kernel's objects into a new process on GPU ``to_gpu``, or on the CPU (None);
    refused if more would be left behind than ``accept_left`` names (when given)."""
    ctx = TransplantContext(kernel, tools, to_gpu, accept_left)
    return outcome(ctx, saga().run(ctx, progress))


def outcome(ctx: TransplantContext, result: Result) -> Outcome:
    """What a finished transplant did: where to, what carried and what not, and its own seconds."""
    said = ctx.survey
    transplant = {"to": "cpu" if ctx.to_gpu is None else "gpu", "carried": [r["name"] for r in said.get("carries", [])],
                  "left": said.get("left", []), "notes": said.get("notes", []),
                  "outputs": said.get("outputs"), "seconds": {"export": ctx.exported.get("seconds"),
                                                              "load": ctx.loaded.get("seconds"),
                                                              "start": ctx.started}}
    return Outcome(result, bytes=int(ctx.exported.get("bytes", 0)), from_gpu=ctx.from_gpu, to_gpu=ctx.target_index,
                   transplant=transplant, stash=ctx.stash or None)
