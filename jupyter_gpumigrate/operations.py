"""Operations: migrations started through the REST API, run in a worker thread, followed by id; drains.

The server's event loop never blocks on CRIU: each operation's plan runs in a thread, and its phase
changes come back to the loop, where they update the record and go out on the server's event bus.
This module keeps the registry of operations, their events and the drains; what the API says of
kernels and GPUs is views.py, which GPU may take a kernel the engine's placement module.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml
from traitlets import TraitError

from .bulkd import BulkListener, BulkTransfers
from .engine import gpus as gpus_mod
from .engine import cudackpt, placement
from .engine.access import open_criu
from .engine.criu import Criu
from .engine.nodehelper import HelperCriu
from .engine.errors import GpuError, InvalidState, MigrateError, PhaseFailed, no_room
from .engine.migration import BROKEN, REMOTE, RUNNING, STOPPED, SUSPENDED, Migration
from .engine.plans import ALL_PHASES, PHASES
from .engine.plans import gpu_move, host_move
from .engine.plans import transplant as transplant_plan
from .engine.stash import Stash
from .peers import STREAMS, Peer, PeerLink, UnknownPeer
from .provisioner import PROVISIONER_NAME, MigratableProvisioner
from .views import KernelNotFound, Views

log = logging.getLogger(__name__)

#: Threads for transplants' dry runs: as many kernels are asked at once, the others wait their turn.
SURVEY_THREADS = 4

EVENT_SCHEMA_ID = "https://events.jupyter.org/jupyter_gpumigrate/operation/v1"
EVENT_SCHEMA_FILE = Path(__file__).parent / "event_schemas" / "operation" / "v1.yaml"


def event_schema() -> dict[str, Any]:
    """The operation events' schema, its phase names taken from the plans' own tables."""
    schema = yaml.safe_load(EVENT_SCHEMA_FILE.read_text())
    schema["properties"]["phase"]["enum"] = ["", *ALL_PHASES]
    schema["properties"]["phases"]["items"]["enum"] = list(ALL_PHASES)
    return schema


PENDING, RUNNING_OP, SUCCEEDED, FAILED = "pending", "running", "succeeded", "failed"
ACTIONS = ("suspend", "resume", "migrate", "transplant", "back", "drain", "discard")
KEEP_FINISHED = 200


__all__ = ["KernelNotFound", "Operation", "OperationManager", "OperationNotFound"]


class ServerStopping(MigrateError):
    """The server is stopping: it starts no operation but those of its own stop."""

    http_status = 503


class OperationNotFound(MigrateError):
    http_status = 404


#: Fields of an Operation that the API never shows: the fast path's socket (told only to the kernel that
#: serves it, with its start), and why it failed where that is a full disk (the server's own).
NOT_WRITTEN = ("stager", "no_room")


@dataclass
class Operation:
    kernel_id: str
    action: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: str = PENDING
    phase: str | None = None
    error: str | None = None
    failed_phase: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    to_gpu: int | None = None
    from_gpu: int | None = None
    #: a kernel on several GPUs: the GPU each of its GPUs goes to, and those it held, in the same order
    #: (to_gpu and from_gpu are the first of each)
    to_gpus: list[int] | None = None
    from_gpus: list[int] | None = None
    #: a move between hosts: the host it goes to and the one it leaves (names, as in kernel lists)
    to_host: str | None = None
    from_host: str | None = None
    #: drain: the GPU drained, the child operations (one per kernel) and what became of each kernel
    gpu: int | None = None
    children: list[str] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    finished: float | None = None
    #: bumped on every change; GET /operations/{id}?after=N waits until it is past N
    version: int = 0
    #: a move to another GPU: what the fast path carried (stashed bytes, seconds) or why it stepped aside
    fast_path: dict[str, Any] | None = None
    #: a suspend: where its images go, as asked ("memory", "disk", "auto"; None: the server's default,
    #: c.MigratableProvisioner.suspend_to), then as done ("memory" or "disk")
    images: str | None = None
    #: a suspend that succeeded: why its images went where they did (images.choose's judgement of the room in
    #: memory, "asked for", or memory that filled as they were written: plans/suspend.py)
    images_why: str | None = None
    #: a suspend or resume: what the kernel's host stash wrote or read back, or why it stepped aside
    stash: dict[str, Any] | None = None
    #: what asked for it: "api" (REST, CLI, panel, magic, Hub), "cell" (a cell run on a suspended kernel) or
    #: "retention" (a discard of a kernel suspended longer than c.GPUMigrateApp.retention)
    trigger: str = "api"
    #: a failed operation: the folder whose file system was full, where that is why (engine/errors.no_room);
    #: the server's own (a stop tries memory instead), not in the API
    no_room: str | None = None
    #: a transplant: where to, what it carries and what it leaves (the dry run's answer), then its seconds
    transplant: dict[str, Any] | None = None
    #: the phases of its plan, in order (engine/plans); empty for a drain
    phases: list[str] = field(default_factory=list)
    #: the fast path's socket, when the kernel's own %migrate serves it (told to that caller only)
    stager: dict[str, str] | None = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.status in (SUCCEEDED, FAILED)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for private in NOT_WRITTEN:
            data.pop(private)
        data["total"] = round(sum(self.timings.values()), 4)
        data["timings"] = {k: round(v, 4) for k, v in self.timings.items()}
        return data


Emit = Callable[[dict[str, Any]], None]


class OperationManager:
    def __init__(self, kernel_manager: Any, emit: Emit | None = None, criu_path: str | None = None,
                 host_name: str | None = None, peers: dict[str, Peer] | None = None,
                 api_address: Callable[[], tuple[str, int] | None] = lambda: None,
                 session_manager: Any = None, stream_dump: bool = True) -> None:
        self.kernel_manager = kernel_manager
        #: a move to another host sends CRIU's pages as the dump writes them (c.GPUMigrateApp.stream_dump)
        self.stream_dump = stream_dump
        #: the server's bulk listener (bulkd.py), whose processes receive the large files of a way home
        self.bulk: BulkListener | None = None
        #: image files sent or fetched at once by a move to another host (c.GPUMigrateApp.transfer_streams; 0:
        #: peers.STREAMS)
        self.transfer_streams = 0
        self.session_manager = session_manager
        self.emit = emit or (lambda data: None)
        self.criu_path = criu_path
        self.host_name = host_name or socket.gethostname()
        self.peers = peers or {}
        self.active: dict[str, Operation] = {}
        self.views = Views(kernel_manager, self.active, self.host_name, sorted(self.peers), self._draining)
        self.api_address = api_address
        self.operations: OrderedDict[str, Operation] = OrderedDict()
        self._changed = asyncio.Event()  # set (and replaced) on every change of any operation
        # One GPU placement at a time: two moves checked against the same free memory could both
        # restore onto one GPU, and a restore that runs out of GPU memory can leave a process stuck.
        self._placing = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        #: kernels being discarded (retention.py): no operation starts on them
        self.discarding: set[str] = set()
        #: kernels whose images are being moved from memory to disk (memorywatch.py, a stopping server)
        self.moving_images: set[str] = set()
        #: set as the server's stop begins (app.py): no operation starts but the stop's own. A resume started
        #: then (by a cell still open in a tab, say) would bring back a kernel that the stop keeps suspended,
        #: only for jupyter_server's shutdown to end it, images and record gone.
        self.closing = False
        #: each kernel's dry run under way (a transplant's survey): asked again meanwhile, the kernel is not
        #: asked twice; the dry runs' own threads, so that kernels slow to answer (a long cell: up to
        #: transplant.WAIT) never hold up the threads that suspends and the rest of the server use
        self._surveys: dict[str, asyncio.Future] = {}
        self._survey_threads = ThreadPoolExecutor(max_workers=SURVEY_THREADS, thread_name_prefix="gpumigrate-survey")

    # -- kernels ----------------------------------------------------------------------------------------

    def provisioner(self, kernel_id: str) -> MigratableProvisioner:
        provisioner = getattr(self.views.kernel(kernel_id), "provisioner", None)
        if not isinstance(provisioner, MigratableProvisioner):
            name = type(provisioner).__name__ if provisioner is not None else "none"
            raise InvalidState(
                f"Kernel {kernel_id} was started by the {name} provisioner, which cannot suspend it. Restart "
                f"the kernel on a server with jupyter_gpumigrate enabled (its kernels use the "
                f"'{PROVISIONER_NAME}' provisioner)."
            )
        return provisioner

    # -- operations ----------------------------------------------------------------------------------

    def get(self, op_id: str) -> Operation:
        try:
            return self.operations[op_id]
        except KeyError:
            raise OperationNotFound(f"There is no operation {op_id} on this server.") from None

    def start(self, kernel_id: str, action: str, to_gpu: int | None = None, to_host: str | None = None,
              fast_path: str = "auto", images: str | None = None, accept_left: list[str] | None = None,
              to_gpus: list[int] | None = None, for_stop: bool = False, idle_since: datetime | None = None
              ) -> Operation:
        """Check the request, then start the operation; raises a :class:`MigrateError` if it cannot start.
        ``to_gpus`` (a migrate or resume of a kernel on several GPUs): one GPU for each GPU it holds, in
        the order of their indices; it stands for ``to_gpu``. ``for_stop``: the server's stop's own (the stop
        policy 'suspend'), the only ones that start once it began. ``idle_since`` (a suspend or transplant):
        only if the kernel is idle and was not active after that time."""
        if self.closing and not for_stop:
            raise ServerStopping(f"The server is stopping: kernel {kernel_id} stays as it is, and no {action} "
                                 "starts now. Try again once the server runs again.")
        if idle_since is not None:
            self._still_idle(kernel_id, idle_since)
        # GPUs of this host the operation names (a kernel brought home names one of ours too)
        named = ({*(to_gpus or ()), *(() if to_gpu is None else (to_gpu,))} if to_host in (None, self.host_name)
                 else set())
        drained = sorted(named & self._draining())
        if drained:
            drain = next(o for o in self.operations.values()
                         if o.action == "drain" and not o.done and o.gpu == drained[0])
            raise InvalidState(f"GPU {drained[0]} is being drained (operation {drain.id}): no kernel is sent there "
                               f"until it is over. Name another GPU, or wait; kernel {kernel_id} stays as it is.")
        if to_gpus is not None and (to_host is not None or action not in ("migrate", "resume")):
            raise InvalidState("to_gpus names the GPUs of a move or resume on this host: use to_gpu for the rest.")
        provisioner = self.provisioner(kernel_id)
        if kernel_id in self.discarding:
            raise InvalidState(f"Kernel {kernel_id} is being discarded: it was suspended longer than the server's "
                               "retention (c.GPUMigrateApp.retention), and its images are being deleted.")
        if getattr(provisioner.parent, "shutting_down", False):  # jupyter_client's, until the kernel starts again
            raise InvalidState(f"Kernel {kernel_id} is being shut down (or restarted): no {action} starts now. "
                               "Start it again, or wait for its restart, then try again.")
        if kernel_id in self.moving_images:
            raise InvalidState(f"Kernel {kernel_id}'s images are being moved from memory to disk (the host's memory "
                               "runs short, or the server stops): try again in a few seconds.")
        if kernel_id in self.active:
            under_way = self.active[kernel_id]
            raise InvalidState(f"Kernel {kernel_id} already has an operation under way (its {under_way.action}, "
                               f"operation {under_way.id}): wait for it to finish.")
        if action == "transplant":
            return self._start_transplant(kernel_id, provisioner, to_gpu, accept_left, to_host)
        if action == "back":
            return self._start_back(kernel_id, provisioner)
        if to_host is not None or provisioner.state == REMOTE:
            return self._start_host_move(kernel_id, provisioner, action, to_gpu, to_host)
        to: int | list[int] | None = list(to_gpus) if to_gpus is not None else to_gpu
        resumable = action == "resume" and provisioner.resumable_broken()
        if provisioner.state == BROKEN and not resumable:
            raise InvalidState(f"Kernel {kernel_id} is broken: {provisioner.broken_reason}")
        wanted = SUSPENDED if action == "resume" else RUNNING
        if provisioner.state != wanted and not resumable:
            verb = {"suspend": "suspended", "resume": "resumed", "migrate": "moved"}[action]
            raise InvalidState(f"Kernel {kernel_id} is {provisioner.state}, so it cannot be {verb}. "
                               f"{_way_out(provisioner.state, action)}")
        # Refuse what cannot work now, with the reason, rather than start an operation bound to fail.
        # The plan checks again in its prepare phase, before anything is locked.
        move: placement.Move | None = None
        if action == "migrate":
            assert to is not None
            gpus = gpus_mod.snapshot()
            held = placement.held_by_tree(provisioner.pid, gpus)
            move = placement.plan_move(gpus, held, to, gpus_mod.driver_major())
        elif action == "resume" and to is not None:
            manifest = provisioner.images.read_manifest(kernel_id)
            if not manifest.gpus:
                raise GpuError(
                    f"Kernel {kernel_id} held no GPU when it was suspended, so it cannot be resumed onto GPU "
                    f"{to}: resume it without to_gpu."
                )
            move = placement.plan_resume(gpus_mod.snapshot(), manifest.gpus, to, gpus_mod.driver_major())
        if action == "migrate" or (action == "resume" and self._resumes_on_gpu(provisioner)):
            cudackpt.ensure_available()  # CudaUnavailable (503) says what to install
        criu = None
        if action != "migrate":
            criu = self._criu(provisioner)
        plan = {"suspend": "suspend", "resume": "resume", "migrate": "move_to_gpu"}[action]
        several = move is not None and move.several
        op = Operation(kernel_id=kernel_id, action=action, phases=list(PHASES[plan]),
                       to_gpu=move.target.index if move is not None else to_gpu,
                       from_gpu=move.source.index if move is not None and action == "migrate" else None,
                       to_gpus=move.to_gpus if several else None,
                       from_gpus=move.from_gpus if several and action == "migrate" else None,
                       images=images if action == "suspend" else None)
        via = self._move_via(provisioner, move, fast_path) if action == "migrate" else None
        stash = None
        if via == gpu_move.PEER:
            try:
                stash = Stash()  # listening before the caller hears where, so that it cannot come too early
            except OSError as exc:  # the driver moves everything
                log.warning("gpumigrate: no fast path for kernel %s: %s", kernel_id, exc)
            if stash is not None and fast_path == "caller":
                op.stager = {"path": stash.path, "token": stash.token}
        self.active[kernel_id] = op
        return self._launch(op, self._run(op, provisioner, criu, stash=stash, invite=fast_path != "caller", via=via))

    def _still_idle(self, kernel_id: str, since: datetime) -> None:
        """Refuse (InvalidState) unless the kernel is idle and was last active at ``since`` or before: the
        caller decided on what it saw then (the Hub's idle policy), and a cell may have started since."""
        kernel = self.views.kernel(kernel_id)
        heard = getattr(kernel, "execution_state", None)
        try:
            last = getattr(kernel, "last_activity", None)
        except TraitError:  # not set yet: the kernel is starting, and was never active
            last = None
        since = since if since.tzinfo else since.replace(tzinfo=timezone.utc)
        if isinstance(last, datetime) and last.tzinfo is None:
            last = last.replace(tzinfo=timezone.utc)
        if heard not in ("idle", "starting") or (isinstance(last, datetime) and last > since):
            when = last.isoformat() if isinstance(last, datetime) else "unknown"
            raise InvalidState(f"Kernel {kernel_id} is {heard}, last active at {when}, after {since.isoformat()} "
                               "(idle_since): it is left as it is.")

    @staticmethod
    def _move_via(provisioner: MigratableProvisioner, move: placement.Move | None, fast_path: str) -> str | None:
        """Where a move's large tensors wait (engine/plans/gpu_move.py): over the GPUs' peer link, in the
        host stash, or nowhere (the driver moves everything): c.MigratableProvisioner.move_stash, and the
        request's fast_path ("off": nowhere; "caller": the kernel's own %migrate serves the peer link)."""
        if fast_path == "off" or move is None or move.several:
            return None
        wanted = provisioner.move_stash
        if wanted == gpu_move.AUTO:
            wanted = gpu_move.PEER if gpus_mod.peer_access(move.source, move.target) is not False else gpu_move.HOST
        return wanted

    def _check_transplant(self, kernel_id: str, provisioner: MigratableProvisioner, to_gpu: int | None,
                          to_host: str | None = None) -> bool:
        """Refuse a transplant that cannot start now; whether the target GPU is of the kernel's own model (this
        host's GPUs only: a peer's are compared there, by the room they have)."""
        if provisioner.state == BROKEN:
            raise InvalidState(f"Kernel {kernel_id} is broken: {provisioner.broken_reason}")
        if provisioner.state == REMOTE:
            raise InvalidState(f"Kernel {kernel_id} runs on {provisioner.remote_host}: bring it back to "
                               f"{self.host_name} first (migrate with to_host \"{self.host_name}\"), then transplant it.")
        if provisioner.state != RUNNING:
            raise InvalidState(f"Kernel {kernel_id} is {provisioner.state}, so it cannot be transplanted: only a "
                               "running kernel can.")
        if to_host is not None and to_host not in self.peers:
            known = ", ".join(sorted(self.peers)) or "none (c.GPUMigrateApp.peers is empty)"
            raise UnknownPeer(f"There is no peer named {to_host!r}; this server's peers: {known}.")
        if to_gpu is None or to_host is not None:
            return False
        gpus = gpus_mod.snapshot()
        target = placement.gpu_by_index(gpus, to_gpu)
        held = placement.held_by_tree(provisioner.pid, gpus)
        return any(h.get("name") == target.name or h.get("uuid") == target.uuid for h in held)

    async def survey(self, kernel_id: str, to_gpu: int | None, to_host: str | None = None) -> dict[str, Any]:
        """The dry run of a transplant: what would carry to GPU ``to_gpu`` (None: the CPU) of this host or of
        the peer ``to_host``, and what not."""
        provisioner = self.provisioner(kernel_id)
        if kernel_id in self.active:
            raise InvalidState(f"Kernel {kernel_id} is being moved by operation {self.active[kernel_id].id}: wait "
                               "for it to finish.")
        to_host = None if to_host == self.host_name else to_host
        same_model = self._check_transplant(kernel_id, provisioner, to_gpu, to_host)
        asked = self._surveys.get(kernel_id)
        if asked is None:
            loop = asyncio.get_running_loop()
            asked = self._surveys[kernel_id] = loop.run_in_executor(self._survey_threads, provisioner.transplant_survey,
                                                                    transplant_plan.WAIT)
            asked.add_done_callback(lambda done: self._surveys.pop(kernel_id) if self._surveys.get(kernel_id) is done
                                    else None)
        try:
            said = dict(await asyncio.shield(asked))
        except TimeoutError as exc:
            raise InvalidState(f"Kernel {kernel_id} did not answer within {transplant_plan.WAIT:.0f} s (a cell that "
                               "runs long?): ask again once it is idle.") from exc
        except (RuntimeError, ConnectionError) as exc:
            raise InvalidState(f"Kernel {kernel_id} could not say what of it would carry: {exc}") from exc
        except ValueError as exc:  # not the survey's JSON
            raise InvalidState(f"Kernel {kernel_id}'s answer was not understood ({exc}): install the same version "
                               "of jupyter-gpumigrate in the kernel's environment as in the server's.") from exc
        return {**said, "to": "cpu" if to_gpu is None else "gpu", "to_gpu": to_gpu, "same_model": same_model,
                "to_host": to_host}

    def _start_transplant(self, kernel_id: str, provisioner: MigratableProvisioner, to_gpu: int | None,
                          accept_left: list[str] | None, to_host: str | None = None) -> Operation:
        to_host = None if to_host == self.host_name else to_host
        self._check_transplant(kernel_id, provisioner, to_gpu, to_host)
        held = placement.held_by_tree(provisioner.pid, gpus_mod.snapshot()) if provisioner.pid else []
        if held:
            cudackpt.ensure_available()  # the source's GPU memory is checkpointed before its dump
        link = None
        if to_host is not None:  # the new process starts there; this host relays the kernel to it
            link = self.link_to(to_host, kernel_id, provisioner.kernel_connection_info, provisioner)
        op = Operation(kernel_id=kernel_id, action="transplant", to_gpu=to_gpu,
                       from_gpu=int(held[0]["index"]) if held else None, to_host=to_host,
                       from_host=self.host_name if to_host is not None else None,
                       phases=list(PHASES["transplant_to_host" if to_host is not None else "transplant"]))
        self.active[kernel_id] = op
        return self._launch(op, self._run(op, provisioner, self._criu(provisioner), link, accept_left=accept_left))

    def _start_back(self, kernel_id: str, provisioner: MigratableProvisioner) -> Operation:
        if provisioner.state == REMOTE:
            raise InvalidState(f"Kernel {kernel_id} runs on {provisioner.remote_host}: bring it back to "
                               f"{self.host_name} first (migrate with to_host \"{self.host_name}\"), then go back to "
                               "the process its transplant replaced, which is kept here.")
        if provisioner.state != RUNNING:
            raise InvalidState(f"Kernel {kernel_id} is {provisioner.state}: only a running kernel can go back to the "
                               "process its transplant replaced.")
        if provisioner.back_until() is None:
            raise InvalidState(f"Kernel {kernel_id} has no earlier process to go back to: none is kept from a "
                               "transplant (c.MigratableProvisioner.keep_transplant_source says for how long one is).")
        held = placement.held_by_tree(provisioner.pid, gpus_mod.snapshot()) if provisioner.pid else []
        kept = provisioner.images.kept(kernel_id)
        if kept is None:  # deleted as its time ran out, just now
            raise InvalidState(f"Kernel {kernel_id}'s earlier process is no longer kept: its time is up.")
        if held or provisioner.images.read_manifest_at(kept[0]).gpus:
            cudackpt.ensure_available()  # the current process is checkpointed, the earlier one remapped
        op = Operation(kernel_id=kernel_id, action="back", from_gpu=int(held[0]["index"]) if held else None,
                       phases=list(PHASES["back"]))
        self.active[kernel_id] = op
        return self._launch(op, self._run(op, provisioner, self._criu(provisioner)))

    def resume_for_cell(self, kernel_id: str) -> Operation:
        """A cell was run on suspended kernel ``kernel_id`` (autoresume.py): resume it where it is best
        placed. If it cannot start, the refusal is still an operation, failed, so that it reaches the
        panel and the log; the cell waits until the kernel is resumed some other way."""
        try:
            if self.provisioner(kernel_id).state == BROKEN:  # a person's call: README, "broken"
                raise InvalidState(f"it is broken: {self.provisioner(kernel_id).broken_reason}")
            op = self.start(kernel_id, "resume")
            op.trigger = "cell"
            log.info("gpumigrate: resuming kernel %s: a cell was run on it (operation %s)", kernel_id, op.id)
            return op
        except MigrateError as exc:
            op = Operation(kernel_id=kernel_id, action="resume", trigger="cell", status=FAILED,
                           error=f"A cell was run on suspended kernel {kernel_id}, but it could not be resumed: "
                                 f"{exc} The cell runs once the kernel is resumed.", finished=time.time())
            log.warning("gpumigrate: %s", op.error)
            self.operations[op.id] = op
            self._trim()
            self._emit(op)
            return op

    def record_discard(self, kernel_id: str, image_bytes: int, trigger: str) -> Operation:
        """A suspended kernel was discarded (its images deleted): listed, and announced on the event bus, as
        a finished operation, so that the panel and event listeners hear of it."""
        op = Operation(kernel_id=kernel_id, action="discard", status=SUCCEEDED, bytes=image_bytes, trigger=trigger,
                       finished=time.time())
        self.operations[op.id] = op
        self._trim()
        self._emit(op)
        return op

    def _start_host_move(self, kernel_id: str, provisioner: MigratableProvisioner, action: str,
                         to_gpu: int | None, to_host: str | None) -> Operation:
        runs_on = provisioner.remote_host if provisioner.state == REMOTE else self.host_name
        if action != "migrate" or to_host is None:
            raise InvalidState(
                f"Kernel {kernel_id} runs on {runs_on}: bring it back first (migrate with to_host "
                f"\"{self.host_name}\"), then {action} it here."
            )
        if to_host == runs_on:
            raise InvalidState(f"Kernel {kernel_id} already runs on {to_host}.")
        if to_host != self.host_name and to_host not in self.peers:
            known = ", ".join(sorted(self.peers)) or "none (set c.GPUMigrateApp.peers)"
            raise UnknownPeer(f"There is no peer named {to_host!r}; this server's peers: {known}.")
        if provisioner.state == REMOTE and to_host != self.host_name:
            raise InvalidState(f"Kernel {kernel_id} runs on {runs_on}: bring it back to {self.host_name} first, "
                               f"then move it to {to_host}.")
        if provisioner.state not in (RUNNING, REMOTE):
            raise InvalidState(f"Kernel {kernel_id} is {provisioner.state}, so it cannot be moved. "
                               f"{_way_out(provisioner.state, 'migrate')}")
        if provisioner.state == RUNNING and provisioner.pid:
            host_move.refuse_several(placement.held_by_tree(provisioner.pid, gpus_mod.snapshot()))
        criu = self._criu(provisioner)
        if provisioner.state == REMOTE:
            link = provisioner.remote_link
        else:
            link = self.link_to(to_host, kernel_id, provisioner.kernel_connection_info, provisioner)
        plan = "return_home" if provisioner.state == REMOTE else "move_to_host"
        op = Operation(kernel_id=kernel_id, action=action, to_gpu=to_gpu, to_host=to_host, from_host=runs_on,
                       phases=list(PHASES[plan]))
        self.active[kernel_id] = op
        return self._launch(op, self._run(op, provisioner, criu, link))

    def link_to(self, peer: str, kernel_id: str, connection_info: dict,
                provisioner: MigratableProvisioner | None = None) -> PeerLink:
        """The link to peer ``peer`` for kernel ``kernel_id`` (on the server's event loop): with ``provisioner``,
        the kernel's clients and whether it can stash now come from it (revive.py sets them once it has one).
        UnknownPeer if this server has no such peer."""
        if peer not in self.peers:
            known = ", ".join(sorted(self.peers)) or "none (set c.GPUMigrateApp.peers)"
            raise UnknownPeer(f"There is no peer named {peer!r}; this server's peers: {known}.")
        link = PeerLink(self.peers[peer], kernel_id, connection_info, asyncio.get_running_loop(), self.api_address(),
                        self.host_name, stream=self.stream_dump)
        if provisioner is not None:
            link.clients, link.idle = provisioner.client_identities, provisioner.can_stash_now
        if self.bulk is not None and self.bulk.running:
            link.fetcher = link.sender = BulkTransfers(self.bulk, link)
        link.streams = self.transfer_streams or STREAMS
        return link

    def _criu(self, provisioner: MigratableProvisioner) -> Criu | HelperCriu:
        # CriuNotFound, PrivilegeMissing or HelperError (503) say what to install or set up.
        return open_criu(self.criu_path or provisioner.criu_path or None, provisioner.helper_socket or None)

    @staticmethod
    def _resumes_on_gpu(provisioner: MigratableProvisioner) -> bool:
        manifest = provisioner.manifest()
        return bool(manifest and manifest.gpus)

    def _launch(self, op: Operation, work: Any) -> Operation:
        self.operations[op.id] = op
        self._trim()
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._emit(op)
        return op

    # -- drain ---------------------------------------------------------------------------------------

    def drain(self, index: int, to_gpu: int | None = None, transplant: bool = False) -> Operation:
        """Move every kernel off GPU ``index``: one operation, with a child operation per kernel.
        ``transplant``: a kernel on GPU ``index`` alone that the driver cannot move (its move is refused: no
        other GPU of its model, none with room...) is transplanted instead, onto ``to_gpu`` if named, or
        else the GPU of any model with the most room, or else to the CPU, provided that everything of it
        carries (the dry run names nothing left). A kernel no longer on the GPU when its turn comes is
        left alone, and not listed."""
        if self.closing:
            raise ServerStopping("The server is stopping: no drain starts now. Try again once it runs again.")
        gpus = gpus_mod.snapshot()
        placement.gpu_by_index(gpus, index)
        if to_gpu is not None:
            placement.gpu_by_index(gpus, to_gpu)
            if to_gpu == index:
                raise GpuError(f"GPU {index} cannot be drained onto itself: name another GPU, or none.")
        running = next((o for o in self.operations.values()
                        if o.action == "drain" and o.gpu == index and not o.done), None)
        if running is not None:
            raise InvalidState(f"GPU {index} is already being drained by operation {running.id}: wait for it "
                               "to finish.")
        if to_gpu is not None and to_gpu in self._draining():
            raise InvalidState(f"GPU {to_gpu} is being drained itself: name another GPU, or none.")
        op = Operation(kernel_id="", action="drain", gpu=index, to_gpu=to_gpu)
        return self._launch(op, self._drain(op, transplant))

    async def _drain(self, op: Operation, transplant: bool) -> None:
        # One kernel after the other: each move already saturates the driver's copy path, and a GPU's
        # free memory is known for the next choice only once the previous move is done.
        op.status = RUNNING_OP
        self._emit(op)
        try:
            # From now on no operation sends a kernel to the GPU (start refuses it, the plans avoid it); one
            # begun before may still: its kernel is there once it is over, and is listed with the others.
            await self._landing_on(op)
            assert op.gpu is not None
            await self._drain_each(op, self.views.kernels_on(op.gpu, gpus_mod.snapshot()), transplant)
        except Exception as exc:  # a drain must always end with a status (NVML may fail on a failing GPU)
            log.exception("gpumigrate: drain of GPU %s failed", op.gpu)
            op.status, op.error = FAILED, f"The drain stopped: {exc}. Kernels not yet moved run where they were."
            op.finished = time.time()
            self._emit(op)

    async def _drain_each(self, op: Operation, kernel_ids: list[str], transplant: bool) -> None:
        started = time.perf_counter()
        for kernel_id in kernel_ids:
            result: dict[str, Any] = {"kernel_id": kernel_id, "status": PENDING, "operation": None, "error": None,
                                      "way": "move"}
            holds: list[int] = []
            try:
                gpus = gpus_mod.snapshot()
                assert op.gpu is not None
                # A kernel on several GPUs: the drained one goes to the target, the others stay.
                holds = sorted(int(h["index"]) for h in placement.held_by_tree(self.provisioner(kernel_id).pid, gpus))
            except MigrateError as exc:  # gone meanwhile (shut down, say)
                op.results.append(dict(result, status=FAILED, error=str(exc)))
                self._emit(op)
                continue
            if op.gpu not in holds:  # it left the GPU since the drain began (its user moved it, say): done
                log.info("gpumigrate: drain of GPU %s: kernel %s is no longer on it", op.gpu, kernel_id)
                continue
            op.results.append(result)
            try:
                try:
                    target = op.to_gpu if op.to_gpu is not None else placement.drain_target(
                        gpus, op.gpu, kernel_id, draining={*self._draining(), *holds})
                    if len(holds) > 1:
                        child = self.start(kernel_id, "migrate", to_gpus=[target if i == op.gpu else i for i in holds])
                    else:
                        child = self.start(kernel_id, "migrate", to_gpu=target)
                except GpuError as exc:  # where the driver cannot take it
                    if not transplant or len(holds) > 1:
                        raise
                    result["way"] = "transplant"
                    child, target = await self._drain_transplant(op, kernel_id, exc)
            except Exception as exc:  # noqa: BLE001  one kernel's failure (a MigrateError, or its dry run's) is its own
                done = "transplanted" if result["way"] == "transplant" else "moved"
                if not isinstance(exc, MigrateError):
                    log.exception("gpumigrate: drain of GPU %s: kernel %s could not be %s", op.gpu, kernel_id, done)
                result.update(status=FAILED, error=str(exc) if isinstance(exc, MigrateError) else
                              f"It could not be {done} ({type(exc).__name__}: {exc}); it runs on, on GPU {op.gpu}.")
                self._emit(op)
                continue
            op.children.append(child.id)
            result.update(operation=child.id, status=RUNNING_OP, to_gpu=target)
            self._emit(op)
            while not child.done:
                await self.wait_change(child, child.version, 30)
            # A kernel on several GPUs: where its drained GPU went (the child's to_gpu is its first GPU's).
            result.update(status=child.status, error=child.error, to_gpu=target if len(holds) > 1 else child.to_gpu)
            self._emit(op)
        op.timings = {"drain": time.perf_counter() - started}
        op.bytes = sum(self.operations[c].bytes for c in op.children if c in self.operations)
        stuck = [r for r in op.results if r["status"] != SUCCEEDED]
        if stuck:
            moved = len(op.results) - len(stuck)
            op.status = FAILED
            op.error = (
                f"{moved} of {len(op.results)} kernels left GPU {op.gpu}; still there, and running: "
                + "; ".join(f"{r['kernel_id']}: {r['error']}" for r in stuck)
            )
        else:
            op.status = SUCCEEDED
        op.finished = time.time()
        self._emit(op)

    async def _drain_transplant(self, op: Operation, kernel_id: str, why: GpuError) -> tuple[Operation, int | None]:
        """A drain's transplant of a kernel the driver cannot move (``why``): started only if everything of
        it carries; onto the drain's ``to_gpu``, else the roomiest GPU, else the CPU."""
        driver = str(why).rstrip(".")
        try:
            survey = await self.survey(kernel_id, None)
        except MigrateError as exc:
            raise InvalidState(f"{driver}; and its dry run for a transplant failed: {exc} It runs on, on GPU "
                               f"{op.gpu}.") from exc
        left = survey.get("left") or []
        if left:
            lost = ", ".join(f"{r.get('name')} ({r.get('reason')})" for r in left)
            raise InvalidState(f"{driver}; a transplant would lose {lost}, so it was not transplanted. It runs on, "
                               f"on GPU {op.gpu}.")
        if not survey.get("carries"):
            raise InvalidState(f"{driver}; and it holds nothing a transplant would carry. It runs on, on GPU {op.gpu}.")
        target = op.to_gpu
        if target is None:
            assert op.gpu is not None
            needed = int(survey.get("gpu_bytes", survey.get("bytes", 0)))
            target = placement.transplant_target(gpus_mod.snapshot(), op.gpu, needed, self._draining())
        log.info("gpumigrate: drain of GPU %s: kernel %s is transplanted to %s: %s", op.gpu, kernel_id,
                 "the CPU" if target is None else f"GPU {target}", why)
        return self.start(kernel_id, "transplant", to_gpu=target, accept_left=[]), target

    async def _landing_on(self, drain: Operation) -> None:
        """Wait for the operations begun before ``drain`` that may still place a kernel on its GPU: a resume
        (where it was, or the roomiest), a move or transplant there, a back, a kernel coming home."""
        def may_land(o: Operation) -> bool:
            if o.done or o is drain or o.created > drain.created or o.action == "drain":
                return False
            if o.to_host is not None and o.to_host != self.host_name:
                return False  # to another host: its GPUs are that host's
            named = {*(o.to_gpus or ()), *(() if o.to_gpu is None else (o.to_gpu,))}
            return drain.gpu in named or (not named and o.action in ("resume", "back", "migrate"))

        for other in [o for o in self.operations.values() if may_land(o)]:
            log.info("gpumigrate: the drain of GPU %s waits for operation %s (%s of kernel %s) first", drain.gpu,
                     other.id, other.action, other.kernel_id)
            while not other.done:
                await self.wait_change(other, other.version, 30)

    def _draining(self) -> set[int]:
        """GPUs being drained now: no kernel is sent there. Called from the plans' threads too (Tools.avoid),
        while the event loop adds and trims operations: it reads a copy."""
        return {o.gpu for o in tuple(self.operations.values())
                if o.action == "drain" and not o.done and o.gpu is not None}

    async def wait_any_change(self, timeout: float) -> None:
        """Return once any operation changes, or after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    async def wait_change(self, op: Operation, after: int, timeout: float) -> None:
        """Return once ``op`` is past version ``after`` or done, or after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while op.version <= after and not op.done:
            left = deadline - loop.time()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def _run(self, op: Operation, provisioner: MigratableProvisioner, criu: Criu | None,
                   link: PeerLink | None = None, stash: Stash | None = None, invite: bool = True,
                   accept_left: list[str] | None = None, via: str | None = None) -> None:
        loop = asyncio.get_running_loop()

        def progress(phase: str, event: str, timings: dict[str, float]) -> None:
            loop.call_soon_threadsafe(self._on_progress, op, phase, event, dict(timings))

        if op.action == "suspend":
            provisioner.sessions = await self._sessions_of(op.kernel_id)  # kept with its images
        migration = Migration(provisioner, provisioner.images, criu, progress,
                              lock_timeout=provisioner.gpu_lock_timeout, host_stash_min=provisioner.host_stash_min,
                              images=op.images or provisioner.suspend_to,
                              keep_source=provisioner.keep_transplant_source,
                              prefetch=provisioner.resume_prefetch, avoid=self._draining)
        steps = {
            "suspend": migration.suspend,
            "resume": lambda: migration.resume(op.to_gpus if op.to_gpus is not None else op.to_gpu),
            "migrate": lambda: migration.move_to_gpu(op.to_gpus if op.to_gpus is not None else op.to_gpu,
                                                     stash=stash, invite=invite, via=via),
            "transplant": lambda: migration.transplant(op.to_gpu, accept_left),
            "back": migration.back,
        }
        if link is not None and op.to_host == self.host_name:
            steps["migrate"] = lambda: migration.return_home(link, op.to_gpu)
        elif link is not None:
            steps["migrate"] = lambda: migration.move_to_host(link, op.to_gpu)
            steps["transplant"] = lambda: migration.transplant_to_host(link, op.to_gpu, accept_left)
        op.status = RUNNING_OP
        self._emit(op)
        try:
            if op.action == "suspend":
                outcome = await asyncio.to_thread(steps[op.action])
            else:
                async with self._placing:
                    migration.spare_pids(op.action)  # before a thread of the server may take one of its PIDs
                    outcome = await asyncio.to_thread(steps[op.action])
        except PhaseFailed as exc:
            await asyncio.sleep(0)  # let the last progress callbacks land first
            op.status, op.error, op.failed_phase = FAILED, str(exc), exc.phase
            op.no_room = no_room(exc.cause)
            log.warning("gpumigrate: %s of kernel %s failed in %s: %s", op.action, op.kernel_id, exc.phase, exc)
        except Exception as exc:  # an operation must always end with a status
            log.exception("gpumigrate: %s of kernel %s failed", op.action, op.kernel_id)
            op.status, op.error = FAILED, f"Unexpected error: {exc}. The server log has the details."
        else:
            await asyncio.sleep(0)
            op.status, op.bytes, op.timings = SUCCEEDED, outcome.bytes, dict(outcome.result.timings)
            if outcome.from_gpu is not None:
                op.from_gpu = outcome.from_gpu
            if outcome.to_gpu is not None or op.to_host is not None:
                op.to_gpu = outcome.to_gpu
            if outcome.to_gpus is not None:
                op.to_gpus = outcome.to_gpus
                op.from_gpus = outcome.from_gpus if op.action == "migrate" else None
            if outcome.transferred is not None:
                op.bytes = outcome.transferred
            op.fast_path = outcome.fast_path.to_dict() if outcome.fast_path is not None else None
            op.stash = outcome.stash
            op.transplant = outcome.transplant
            if outcome.images is not None:
                op.images, op.images_why = outcome.images, outcome.images_why or None
            log.info("gpumigrate: %s of kernel %s took %.2f s", op.action, op.kernel_id, outcome.result.total)
        finally:
            op.finished = time.time()
            op.phase = None if op.status == SUCCEEDED else op.phase
            self.active.pop(op.kernel_id, None)
            provisioner.stop_requested = None  # a stop that outwaited the plan was for it alone (read by now)
            self._emit(op)

    async def _sessions_of(self, kernel_id: str) -> list[dict]:
        """The server's sessions (notebooks, consoles) on ``kernel_id``: id, path, name, type."""
        if self.session_manager is None:
            return []
        try:
            listed = await self.session_manager.list_sessions()
        except Exception:  # noqa: BLE001  the kernel is suspended all the same; its tab can pick it again
            log.exception("gpumigrate: could not list the sessions of kernel %s", kernel_id)
            return []
        return [{"id": s["id"], "path": s.get("path"), "name": s.get("name"), "type": s.get("type")}
                for s in listed if (s.get("kernel") or {}).get("id") == kernel_id]

    def _on_progress(self, op: Operation, phase: str, event: str, timings: dict[str, float]) -> None:
        op.phase, op.timings = phase, timings
        self._emit(op, phase_event=event)

    def _emit(self, op: Operation, phase_event: str | None = None) -> None:
        op.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        data = {
            "operation_id": op.id,
            "kernel_id": op.kernel_id,
            "action": op.action,
            "status": op.status,
            "phase": op.phase or "",
            "phase_event": phase_event or "",
            "timings": {k: round(v, 4) for k, v in op.timings.items()},
            "bytes": op.bytes,
            "error": op.error or "",
            "version": op.version,
            "trigger": op.trigger,
            "phases": list(op.phases),
        }
        for key in ("from_gpu", "to_gpu", "from_gpus", "to_gpus", "from_host", "to_host"):
            if getattr(op, key) is not None:
                data[key] = getattr(op, key)
        if op.fast_path is not None:
            data["fast_path"] = {"stashed": op.fast_path["stashed"], "reason": op.fast_path["reason"] or "",
                                 "via": op.fast_path.get("via") or ""}
        if op.action == "drain":
            data["gpu"] = op.gpu
            data["children"] = list(op.children)
            data["results"] = [{k: v for k, v in r.items() if v is not None} for r in op.results]
        try:
            self.emit(data)
        except Exception:  # events are best effort; the operation record is the truth
            log.exception("gpumigrate: could not emit an event")

    def _trim(self) -> None:
        finished = [op_id for op_id, op in self.operations.items() if op.done]
        for op_id in finished[: max(0, len(self.operations) - KEEP_FINISHED)]:
            del self.operations[op_id]

    async def wait_idle(self) -> None:
        """Wait for every running operation (used at server shutdown and by tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _way_out(state: str, action: str) -> str:
    """What to do about an ``action`` refused to a kernel in ``state`` (a sentence)."""
    if state == SUSPENDED:
        return "Nothing to do: it is suspended already." if action == "suspend" else "Resume it first."
    if state == RUNNING and action == "resume":
        return "Nothing to do: it runs already."
    if state == STOPPED:
        return "It is between its exit and its restart: try again in a few seconds."
    return "Try again once it is running (GET api/gpumigrate/kernels/ID says its state)."
