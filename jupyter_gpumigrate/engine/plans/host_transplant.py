"""A transplant to another host: where the driver cannot go there (a GPU of another model, or its CPU), the
notebook's objects go to a new kernel process on that host, and this host relays the kernel's channels to
it, as after a move to another host (plans/host_move.py).

    prepare     the dry run (what carries); that host says whether it   undo: remove the folder
                can take the objects (the kernel's ports free there,
                its kernel type, room on its GPU or in its memory); a
                folder for them here
    export      the kernel writes its objects into the folder           (removed with the folder)
    transfer    the objects go there                                    undo: that host discards them
    load        that host starts the new process, which reads them      undo: that host discards it (if
                (onto its GPU, or into host memory) and waits; the      it cannot, the process ends by
                source's image folder, placed now                       itself: litter)
    stash       the source writes its large buffers into its images     undo: it reads them back
    lock        the source's CUDA calls wait (GPU only)                 undo: unlock
    checkpoint  the source's GPU memory into its host memory            undo: back onto its GPU
    dump        CRIU writes the source into images and kills it: the    undo: restore it from the images
                kernel's ports here are free
    switch      this host's record of the kernel names that host (a    undo: stop relaying; that host
                server that dies from here on has its next one ask      discards the new process (if it
                there: revive.py); the new process takes the kernel's   cannot once it answered there, the
                ports there; this host relays them, and the kernel      kernel is broken; that host discards
                answers through the relay: it is the kernel now, under  one never relayed to by itself); the
                the same kernel id                                      record goes
    on success  the source's images are kept for ``keep_source`` seconds, as after a transplant on this host
    always      the objects' folder here goes

The source runs on, untouched, until the new process there holds every object. A failure at any phase
brings it back as it was. Afterwards the kernel is on that host as after a move there: it comes home by a
move (CRIU, from there; a process on that host's CPU comes home to this host's CPU), and goes back to the
kept source once it is home.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol

from ..errors import InvalidState
from ..kernelproc import KernelProcess, kernel_listens, public_connection_info
from ..saga import ALWAYS, ON_SUCCESS, ProgressCallback, Saga, Step
from . import suspend, transplant
from .common import KernelContext, Outcome, Tools, checkpoint, dump, gpu_use, lock, new_images, running_pid

log = logging.getLogger(__name__)


def saga() -> Saga[HostTransplantContext]:
    return Saga(
        "transplant_to_host",
        [
            Step("prepare", prepare),
            Step("export", transplant.export),
            Step("transfer", send_objects),
            Step("load", load_there),
            Step("stash", suspend.stash, when=suspend.worth_asking),
            Step("lock", lock, when=KernelContext.on_gpu),
            Step("checkpoint", checkpoint, when=KernelContext.on_gpu),
            Step("dump", dump),
            Step("switch", switch_there),
            Step("keep the source", transplant.keep_source, kind=ON_SUCCESS),
            Step("remove the objects", transplant.remove_folder, kind=ALWAYS),
        ],
        start_from=("running",),
        success="remote",
        refuse=lambda state: f"The kernel is {state}, not running: it cannot be transplanted.",
        stoppable=("export", "transfer", "load", "stash"),
    )


class TransplantLink(Protocol):
    """Another host, as a transplant there needs it (peers.PeerLink implements it over HTTPS). Each method
    raises a :class:`MigrateError` whose message says what went wrong there."""

    host: str

    def check_transplant(self, kernel_name: str, listens: list[tuple[str, int]], nbytes: int, gpu_bytes: int,
                         to_gpu: int | None) -> None:
        """Refuse, with every reason, if that host cannot start the kernel's new process (its kernel type, the
        kernel's ports, room on GPU ``to_gpu`` or, for None, in its memory)."""

    def send_objects(self, folder: Path) -> int:
        """Copy the objects' files there; the bytes sent."""

    def load_objects(self, kernel_name: str, connection_info: dict, to_gpu: int | None, wait: float) -> dict:
        """Start the new process there, on GPU ``to_gpu`` or the CPU, and wait (``wait`` seconds at most) until
        it holds the objects; what it says (``loaded``: its ready.json; ``gpu``, ``gpus``: where it is)."""

    def switch(self) -> dict:
        """Have the new process take the kernel's ports there and answer on them."""

    def discard(self) -> None:
        """Kill the kernel (or new process) there if it runs, and delete what it had there."""

    def attach(self, clients: dict | None = None) -> None:
        """Bind the kernel's ports here and relay them there (as plans/host_move.py's HostLink)."""

    def detach(self) -> None:
        """Stop relaying and free the kernel's ports here."""


class HostTransplantContext(transplant.TransplantContext):
    def __init__(self, kernel: KernelProcess, tools: Tools, link: TransplantLink, to_gpu: int | None,
                 accept_left: list[str] | None = None) -> None:
        super().__init__(kernel, tools, to_gpu, accept_left)
        self.link = link
        #: bytes sent there
        self.transferred = 0
        #: what that host said of the new process: pid, gpu, gpus, loaded
        self.there: dict = {}


def prepare(ctx: HostTransplantContext) -> None:
    pid = running_pid(ctx)
    _, held, _ = gpu_use(ctx, pid)
    if len(held) > 1:
        raise InvalidState("The kernel holds several GPUs: a transplant takes a kernel on one GPU at most. Free "
                           "the others in the kernel, then try again. It runs on, unchanged.")
    ctx.from_gpu = int(held[0]["index"]) if held else None
    ctx.kernel.carry_over(pid)  # what the notebook sends meanwhile goes to the new process, should it take over
    transplant.survey(ctx)
    nbytes = int(ctx.survey.get("bytes", 0))
    # What that host lacks is said before anything here is touched.
    ctx.link.check_transplant(ctx.kernel.kernel_name, kernel_listens(ctx.kernel.kernel_connection_info), nbytes,
                              int(ctx.survey.get("gpu_bytes", nbytes)), ctx.to_gpu)
    ctx.folder = ctx.tools.store.scratch(ctx.kernel.kernel_id, nbytes, pid)
    ctx.undo(lambda: transplant.remove_folder(ctx))


def send_objects(ctx: HostTransplantContext) -> None:
    assert ctx.folder is not None
    # Whatever arrived there goes; if that host is gone, so is what it had: litter, not a kernel in doubt.
    ctx.undo(ctx.link.discard, cleanup=True)
    ctx.transferred = ctx.link.send_objects(ctx.folder)
    # Sent: here, they would only hold memory (a tmpfs) while the source is saved.
    transplant.remove_objects(ctx.folder)
    ctx.check_stop()


def load_there(ctx: HostTransplantContext) -> None:
    # The new process signs the kernel's messages: it needs the key, which a manifest never holds.
    secrets = ctx.kernel.secrets()
    info = {**public_connection_info(ctx.kernel.kernel_connection_info),
            **{k: secrets[k] for k in ("key", "signature_scheme") if k in secrets}}
    ctx.there = ctx.link.load_objects(ctx.kernel.kernel_name, info, ctx.to_gpu, ctx.wait())
    # Not yet the kernel (it waits, off the kernel's ports): if that host cannot discard it now, it ends by
    # itself (once its server does, or 30 minutes later): litter, not a kernel in doubt.
    ctx.undo(ctx.link.discard, cleanup=True)
    ctx.loaded = dict(ctx.there.get("loaded") or {})
    ctx.target_index = ctx.there.get("gpu")
    ctx.check_stop()
    new_images(ctx, ctx.pid or running_pid(ctx), ctx.tools.images)


def switch_there(ctx: HostTransplantContext) -> None:
    """The new process takes the kernel's ports there, which are its own on that host; this host's, freed by the
    dump, are bound by the relay, and the kernel must answer through it, or all is undone."""
    assert ctx.manifest is not None
    # Written down first, as before a move's restore there: a server that dies from here on has its next one ask
    # that host, whose new process is the kernel once told to go (it discards one still waiting, and takes the
    # source back from its images here), instead of taking the source back beside it.
    ctx.kernel.record_moving(ctx.link.host)
    ctx.undo(lambda: ctx.kernel.record_moving(None))
    # Told to go, it takes the kernel's ports there. Should that host not hear, or its answer be lost, and
    # the discard fail too: that host discards, by itself, a new process whose channels this host never relays.
    ctx.undo(ctx.link.discard, cleanup=True)
    said = ctx.link.switch()
    # It answers there now: if it cannot be discarded, two copies may run.
    ctx.undo(ctx.link.discard)
    ctx.started = said.get("seconds")
    ctx.link.attach(ctx.manifest.clients)
    ctx.undo(ctx.link.detach)
    ctx.kernel.adopt_remote(ctx.link, ctx.there)
    if not ctx.kernel.wait_ready(max(ctx.tools.reconnect_timeout, 10.0)):
        raise InvalidState(f"The new kernel process on {ctx.link.host} does not answer through the relay: the "
                           "source is brought back here.")


def run(kernel: KernelProcess, tools: Tools, link: TransplantLink, to_gpu: int | None,
        accept_left: list[str] | None = None, progress: ProgressCallback | None = None) -> Outcome:
    """Carry the running kernel's objects into a new process on ``link``'s host: onto its GPU ``to_gpu`` (any
    model), or its CPU (None)."""
    ctx = HostTransplantContext(kernel, tools, link, to_gpu, accept_left)
    result = saga().run(ctx, progress)
    outcome = transplant.outcome(ctx, result)
    outcome.to_host, outcome.transferred = link.host, ctx.transferred
    return outcome
