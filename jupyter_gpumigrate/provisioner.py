"""A kernel provisioner whose kernels survive being checkpointed and restored.

It launches any kernelspec's command line the way jupyter_client's ``LocalProvisioner`` does, with
the changes that CRIU needs (docs/internals.md, "ipykernel under CRIU"):

- ``JPY_PARENT_PID=0``: ipykernel's parent poller would see a new parent after a restore and exit.
- stdin from /dev/null, stdout and stderr to a log file: pipes to the server cannot be carried.
- a new session (as ``LocalProvisioner``), so the kernel's tree is self-contained for CRIU.
- after a dump kills the kernel, its zombie is reaped at once, or its PID stays taken and the restore
  fails with "File exists".
- a restored kernel is no child of the server: liveness and signals go through its PID, not Popen.
- while suspended or migrating, ``poll()`` says "alive", so the auto-restarter leaves it alone;
  shutting a suspended kernel down deletes its images.
- a kernel moved to another host is ``remote``: its ports here are the relay's (relay.py); signals and
  shutdown go to that host, and it counts as dead only if that host loses it.
- a kernel whose rollback failed is ``broken`` (``broken_reason`` says why): alive while its process
  runs, never migrated again; restarting it (or shutting it down) is the way out.

While a plan runs, the engine's saga runner owns ``state``; this class sets it only for its own
lifecycle (launched, stopped).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from jupyter_client.connect import KernelConnectionInfo, LocalPortCache
from jupyter_client.launcher import launch_kernel
from jupyter_client.provisioning import LocalProvisioner
from jupyter_core.paths import jupyter_data_dir
from traitlets import Bool, Enum, Float, Int, Unicode, default

from .credentials import KernelCredentials
from .engine import proctree
from .engine.access import images_root, memory_root
from .engine.images import ImageStore, Manifest, this_process, write_durably
from .engine.nodehelper import DEFAULT_SOCKET
from .engine.shared import SharedFolder
from .engine.errors import ImageError, InvalidState, MigrateError
from .engine.safepoint import FOLDER_ENV as SAFE_POINT_ENV, Claim, SafePoint
from .kernel.hoststash import StashDamaged, read_index as read_stash_index
from .engine.kernelproc import BROKEN, MIGRATING, REMOTE, RUNNING, STOPPED, SUSPENDED
from .kernelwire import (HOST_OPEN_PREFETCH_CALL, HOST_STASH_CALL, HOST_TAKE_BACK_CALL, HOST_TAKE_BACK_GPU_CALL,
                         RELEASE_TORCH_CACHE, evaluate_silently, kernel_answers, run_silently, send_silently)

PROVISIONER_NAME = "gpumigrate-provisioner"



TRANSPLANT_MODULE = "jupyter_gpumigrate.kernel.transplant"


def transplant_argv(cmd: list[str], folder: str) -> list[str] | None:
    """A kernel's command line with ``-m ipykernel_launcher`` made ``-m <transplant> FOLDER``: the new process
    of a transplant (kernel/transplant.py); None if it does not start that way."""
    cmd = list(cmd)
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == "ipykernel_launcher":
            return [*cmd[:i], "-m", TRANSPLANT_MODULE, folder, *cmd[i + 2:]]
    return None


TRANSPLANT_SURVEY_CALL = f"__import__({TRANSPLANT_MODULE!r}, fromlist=['survey']).survey()"
TRANSPLANT_EXPORT_CALL = f"__import__({TRANSPLANT_MODULE!r}, fromlist=['export']).export({{folder!r}}, {{names!r}})"
#: Run silently in an idle IPython kernel: its side of the fast path of a GPU move (kernel/stager.py).
STAGER_CALL = "__import__('jupyter_gpumigrate.kernel.stager', fromlist=['run']).run({path!r}, {token!r})"


@functools.lru_cache(maxsize=32)
def can_import_package(python: str, pythonpath: str | None = None) -> bool:
    """Whether the interpreter ``python``, with ``pythonpath`` as its PYTHONPATH, can import this package
    (so that an IPython kernel it runs can serve the fast path); asked once per pair. Without it, a
    move would wait for a kernel that cannot come (10 s)."""
    same = os.path.realpath(shutil.which(python) or python) == os.path.realpath(sys.executable)
    if same and pythonpath == os.environ.get("PYTHONPATH"):
        return True
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    try:
        done = subprocess.run([python, "-c", "import jupyter_gpumigrate.kernel.stager"], capture_output=True,
                              timeout=30, stdin=subprocess.DEVNULL, env=env,
                              cwd="/")  # not this folder: -c would import from it
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def is_ipython_kernel(cmd: list[str]) -> bool:
    """True for ipykernel's command lines (``python -m ipykernel_launcher ...``, ``ipykernel ...``)."""
    return any(part in ("ipykernel_launcher", "ipykernel") or part.endswith("/ipykernel") for part in cmd)


@dataclass
class Revival:
    """A kernel an earlier server left behind, as the next one takes it back (revive.py)."""

    #: its connection info, its key included
    connection_info: dict
    #: the notebook sessions that pointed at it
    sessions: list[dict]
    #: the hash of its API credential, if it had one, and where the kernel calls the API with it
    credential: str | None
    api_url: str | None
    #: its process, if it runs (adopted as running); None: it comes back suspended, from its images
    pid: int | None
    #: the peers.PeerLink of a kernel that runs on a peer (adopted there: its relay already runs), and what
    #: that peer said of it
    remote: Any = None
    where: dict | None = None
    #: set by the provisioner that took it: one that did not (the kernelspec names another provisioner now)
    #: launched a new kernel instead
    taken: bool = False


#: How long a stopping server's shutdown of a kernel still waits for its migration, in seconds.
STOPPING_WAIT = 5.0

#: Each kernel's safe-point folder (``<state_dir>/safepoints/<id>``, 0700: engine/safepoint.py).
SAFE_POINTS = "safepoints"
#: The record of each running kernel (``<state_dir>/kernels/<id>.json``, 0600), kept up to date while it
#: runs, so that a server started after a crash can adopt the kernels the dead one left running.
RECORDS = "kernels"


def give_back_stash(folder: str, pid: int | None, safe_points: Path, connection_info: dict, timeout: float,
                    asked_at_safe_point: bool = False, gpu: dict | None = None) -> dict:
    """Have the kernel process ``pid`` read back the buffers it stashed into ``folder`` (kernel/hoststash.py),
    whoever asks: the resume, the suspend's undo, a server started after a crash (revive.py). Raises as
    :func:`~.kernelwire.evaluate_silently` does.

    A kernel that stashed at the safe point of a busy cell waits there (engine/safepoint.py): released, through
    ``safe_points`` (this host's folder of the kernel) or, restored on another host, the folder the stash's index
    names, where it watches. Its cell would answer a silent request only once it ends; so where the kernel was
    asked at a safe point (``asked_at_safe_point``) or its index says it stashed at one, and it waits no more, it
    has its buffers (it took nothing, or read them back): nothing to ask. ``gpu``: a prefetch's memory on the
    kernel's GPU (engine/prefetch.py), given to a kernel that waits at this host's safe point or is asked
    here."""
    alive = (lambda: pid is not None and proctree.is_alive(pid))
    local = SafePoint(safe_points, pid or 0, alive=alive)
    if pid is not None and local.waiting():
        return local.release({"folder": folder, **({"gpu": gpu} if gpu else {})}, timeout)
    try:
        index = read_stash_index(folder)
    except StashDamaged:
        index = {}
    at = index.get("safe_point") if index.get("pid") == pid else None
    if isinstance(at, dict) and Path(str(at.get("folder"))) != safe_points:
        # Restored on another host: the kernel watches the folder it had where it was suspended.
        away = Path(str(at["folder"]))
        away.mkdir(parents=True, exist_ok=True, mode=0o700)
        return SafePoint(away, pid or 0, alive=alive).release({"folder": folder, **({"gpu": gpu} if gpu else {})},
                                                              timeout, wait_id=str(at.get("id")), went_on=False)
    if at or asked_at_safe_point:
        return {"unstashed": 0, "seconds": 0.0}
    call = (HOST_TAKE_BACK_GPU_CALL.format(folder=folder, gpu=gpu) if gpu
            else HOST_TAKE_BACK_CALL.format(folder=folder))
    return json.loads(evaluate_silently(connection_info, call, timeout, alive=alive))


#: What :meth:`MigratableProvisioner._activity` says of a kernel: idle, or busy (each reads after "the kernel is").
IDLE = "idle"
BUSY_CELL = "busy with a cell"
BUSY_WAITING = "waiting at its safe point for the buffers a stash took"
BUSY_HIDDEN = "busy: its main thread runs, though Jupyter last heard it idle (work on its event loop, or a cell " \
    "whose first call holds the GIL)"
BUSY = (BUSY_CELL, BUSY_WAITING, BUSY_HIDDEN)


class MigratableProvisioner(LocalProvisioner):  # type:ignore[misc]
    """Launches local kernels so that jupyter-gpumigrate can suspend, resume and move them."""

    #: the kernel is IPython, started with the extension (so it can serve the fast path of a GPU move)
    ipython: bool = False
    #: its interpreter, when its command line names one, and the PYTHONPATH it was started with
    python: str | None = None
    python_path: str | None = None

    state_dir = Unicode(
        help="Where suspended kernels' images and kernels' logs are kept (created 0700). "
        "Images are as large as the kernel's memory: put this on a disk with room.",
    ).tag(config=True)

    criu_path = Unicode(
        "", help="The CRIU binary to use; empty: /usr/local/sbin/criu, else criu on PATH."
    ).tag(config=True)

    helper_socket = Unicode(
        DEFAULT_SOCKET, help="The node helper's socket (docs/users.md). A server run by an ordinary user goes "
        "through the helper whenever this socket exists; empty: never.",
    ).tag(config=True)

    gpu_lock_timeout = Float(
        60.0, min=0.0, help="How long a GPU move or suspend waits for the kernel's GPU work in flight to finish, in "
        "seconds; then it gives up and the kernel runs on where it was.",
    ).tag(config=True)

    suspend_to = Enum(
        ["auto", "memory", "disk"], "auto",
        help="Where a suspend puts the kernel's images when the request does not say: 'memory' (memory_dir, a "
        "tmpfs: some ten times faster both ways, but it holds host memory while the kernel is suspended and "
        "is lost with a reboot; moved to disk when the server stops), 'disk' (state_dir), or 'auto': memory "
        "when the tmpfs has room for the kernel's memory and 10% more and the host keeps a quarter of its "
        "memory available afterwards, disk otherwise.",
    ).tag(config=True)

    memory_dir = Unicode(
        help="The folder on a tmpfs for images in memory (created 0700); empty: images always go to disk. "
        "Default: a folder of this user's and state folder's in /dev/shm; none with a shared_dir (images in "
        "memory are local: another host could not take them).",
    ).tag(config=True)

    shared_dir = Unicode(
        "", help="A folder on storage shared by several hosts (a node pool), this user's: suspended kernels' "
        "images go there, under hosts/<host_name>/images, instead of state_dir/images, and a server takes "
        "the suspended kernels of a host whose server has stopped (its heartbeat there is stale). Records, "
        "logs and locks stay in state_dir, which is local. Empty (the default): no sharing. README, 'Shared "
        "storage', says what must hold (same GPU model, same kernelspecs and paths, the kernel's PIDs free).",
    ).tag(config=True)

    host_stash_min = Int(
        10**9, allow_none=True, min=0,
        help="A suspend has the kernel write its large buffers (PyTorch storages, CUDA or CPU, and bytearrays) "
        "into the images itself, in parallel, when they add up to this many bytes or more: much faster than "
        "CRIU and the CUDA driver alone for large kernels (docs/performance.md). None: never.",
    ).tag(config=True)

    resume_prefetch = Bool(
        True, help="A resume of a GPU kernel whose large buffers are in its images (the host stash) has a helper "
        "read them onto the kernel's GPU while CRIU restores the kernel, where that GPU has room for them twice; "
        "the kernel then copies them from there instead of reading its files (32 GB: docs/performance.md). "
        "False: the kernel reads its files itself, after the restore.",
    ).tag(config=True)

    move_stash = Enum(
        ["auto", "peer", "host"], "auto",
        help="Where a move to another GPU puts the kernel's large CUDA tensors while the driver moves the rest: "
        "'peer', a stash on the target GPU over the GPUs' peer link (NVLink; the fastest); 'host', files in "
        "memory written and read through pinned buffers (for GPUs without peer access, most PCIe cards); "
        "'auto', peer where NVML says the two GPUs have peer access, else host (docs/performance.md).",
    ).tag(config=True)

    safe_point_timeout = Float(
        5.0, min=0.0, help="How long a kernel busy with a cell gets to reach a safe point (the next bytecode of its main "
        "thread: a long call into C, such as a CUDA synchronize, delays it) where it serves the fast path of a GPU "
        "move or the host stash of a suspend while the cell waits. Past it, the CUDA driver and CRIU carry "
        "everything, and the operation says why. 0: never ask a busy kernel.",
    ).tag(config=True)

    kernel_history = Enum(
        ["memory", "ipython"], "memory",
        help="Where the IPython kernels this server starts keep their input history. 'memory': in the kernel "
        "(%history, In and the console's up arrow work within the kernel's life, suspends and moves included). "
        "'ipython': IPython's own database file, which every kernel of the user holds open and writes: CRIU then "
        "restores a suspended kernel only if no other kernel has grown that file meanwhile, and another host "
        "takes a kernel only if its copy of the file has the same size.",
    ).tag(config=True)
    keep_transplant_source = Float(
        3600.0, min=0.0, help="How long, in seconds, a transplant keeps the process it replaced (its images, on disk), so "
        "that the kernel can go back to it (POST /api/gpumigrate/kernels/<id>/back, `jupyter gpumigrate back`); "
        "what the kernel did since is then lost. 0: not kept. A kept process goes when its time is up, when the "
        "kernel is shut down, or at the kernel's next transplant (which keeps its own); a restart keeps it.",
    ).tag(config=True)

    cache_release_timeout = Float(
        10.0, min=0.0, help="How long to wait for an idle kernel to release PyTorch's cached GPU memory before a move."
    ).tag(config=True)

    migration_wait = Float(
        600.0, min=0.0, help="How long a shutdown waits for a migration in progress to end, in seconds; past it, the "
        "shutdown goes on, and the migration's error says the kernel was shut down."
    ).tag(config=True)

    @default("state_dir")
    def _default_state_dir(self) -> str:
        return os.path.join(jupyter_data_dir(), "gpumigrate")

    @default("memory_dir")
    def _default_memory_dir(self) -> str:
        if not os.path.isdir("/dev/shm") or self.shared_dir:
            return ""
        # One per user and state folder: two servers with folders of their own never share it.
        return f"/dev/shm/jupyter-gpumigrate-{os.geteuid()}-{self.state_digest()}"

    def state_digest(self) -> str:
        """A short name of this server's state folder: its memory folders are its own, not its user's other
        servers' (a server takes back and sweeps all that is in its folders)."""
        return hashlib.sha256(os.path.realpath(self.state_dir).encode()).hexdigest()[:12]

    state: str = STOPPED
    broken_reason: str | None = None
    #: while the kernel is being shut down or restarted during a migration: why (a plan may stop there)
    stop_requested: str | None = None
    #: how the last wait_ready went (kernelwire.kernel_answers: reply, status, asked); said by a slow adopt
    answered: dict = {}  # noqa: RUF012  (replaced, never changed in place)
    sessions: list[dict] = []
    #: the kernels the extension is taking back as the server starts (revive.py), by id: their provisioner
    #: launches nothing, and listens on their own ports with their own key
    reviving: dict[str, Revival] = {}
    #: suspended when its server stopped: its images, and the files the kernel had open, stay for the next
    _kept = False
    #: taken by another host from the shared folder: dropped from this server's list, nothing deleted
    given_away = False
    log_path: Path | None = None
    remote_link: Any = None  # peers.PeerLink, while the kernel runs on another host
    remote_gpus: list = []
    _remote_ending = False
    #: left running at its peer as the server stopped (leave_remote): its record stays for the next server
    _left_remote = False
    #: the peer the kernel came home from, until its dump there is discarded (record_copy_left)
    copy_left: str | None = None
    started: int | None = None  # start time of the kernel's root process (proctree.start_time)
    #: the command line and environment the kernel was launched with (a transplant launches its new process so)
    launch_cmd: list[str] = []
    launch_env: dict[str, str] = {}
    #: the new process of a transplant under way (engine/plans/transplant.py), until it is the kernel
    _transplant: subprocess.Popen | None = None
    _transplanted: subprocess.Popen | None = None
    #: earlier processes of this kernel that a transplant replaced: what was sent to them goes to this one
    lineage: set[int] = set()
    #: why the last safe point asked for was not reached
    safe_point_reason: str | None = None
    _stash_claim: Claim | None = None

    # -- what a migration needs (engine.kernelproc.KernelProcess) -----------------------------------

    @property
    def kernel_name(self) -> str:
        return getattr(self.parent, "kernel_name", "") or ""

    @property
    def kernel_pid(self) -> int | None:
        return self.pid

    @property
    def kernel_connection_info(self) -> dict:
        return dict(self.connection_info)

    @property
    def host_name(self) -> str:
        """This server's name (c.GPUMigrateApp.host_name, by default the host's)."""
        return str(self.config.get("GPUMigrateApp", {}).get("host_name") or socket.gethostname())

    @property
    def shared(self) -> SharedFolder | None:
        """The folder shared with other hosts, if one is set and the images go there (not through the node
        helper, which dumps only into its own folder)."""
        if not self.shared_dir or images_root(Path(self.state_dir), self.helper_socket or None) != Path(self.state_dir):
            return None
        return SharedFolder(self.shared_dir, self.host_name)

    @property
    def images(self) -> ImageStore:
        # With the node helper, the folders it made for this user (access.py), on disk and, where it keeps
        # them, in memory (there, one of this state folder's own): it dumps nowhere else (memory_dir ""
        # keeps a user's images on disk all the same).
        # With a shared folder, this host's folder there (engine/shared.py).
        root = images_root(Path(self.state_dir), self.helper_socket or None)
        memory: str | Path | None = self.memory_dir
        if root != Path(self.state_dir) and memory:
            helper_memory = memory_root(None, self.helper_socket or None)
            memory = helper_memory / f"images-{self.state_digest()}" if helper_memory is not None else None
        shared = self.shared
        return ImageStore(shared.images_root() if shared is not None else root / "images", memory or None)

    def secrets(self) -> dict:
        info = self.connection_info
        kept = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in info.items()
                if k in ("key", "signature_scheme", "curve_publickey", "curve_secretkey")}
        credentials = self._credentials()
        if credentials is not None and credentials.digest(self.kernel_id):
            kept["credential"] = credentials.digest(self.kernel_id)
            kept["api_url"] = credentials.server_url()
        return kept

    def manifest(self) -> Manifest | None:
        """The manifest of this kernel's images, if it has complete ones here."""
        try:
            return self.images.read_manifest(self.kernel_id)
        except MigrateError:
            return None

    def back_until(self) -> str | None:
        """Until when the process this kernel's last transplant replaced is kept (ISO 8601), or None."""
        try:
            kept = self.images.kept(self.kernel_id)
        except (OSError, MigrateError):
            return None
        if kept is None or kept[1] <= datetime.now(timezone.utc).timestamp():
            return None
        return datetime.fromtimestamp(kept[1], timezone.utc).isoformat()

    def drop_back(self) -> None:
        """The process this kernel's last transplant replaced is no longer kept (the kernel was shut down)."""
        try:
            self.images.drop_kept(self.kernel_id)
        except (OSError, MigrateError) as exc:
            self.log.warning("gpumigrate: the process kernel %s was transplanted from is still kept: %s",
                             self.kernel_id, exc)

    def release(self) -> None:
        # The dead root must be reaped, or its PID stays taken and the restore fails: by Popen if we
        # started it, else (a restored kernel, when the server is a subreaper) by its PID.
        if self.process is not None:
            self.process.wait(timeout=30)
        elif self.pid is not None:
            proctree.wait_gone(self.pid, timeout=30)
        self.process = None
        self.pid = None
        self.pgid = None
        self.started = None

    @property
    def remote_host(self) -> str | None:
        return self.remote_link.host if self.remote_link is not None else None

    def adopt_remote(self, link: Any, where: dict) -> None:
        self.process = None
        self.pid = self.pgid = self.started = None
        self.remote_link = link
        self.remote_gpus = list(where.get("gpus") or [])
        self.write_record()

    def adopt(self, pid: int) -> None:
        self.remote_link, self.remote_gpus = None, []
        self.process = None
        self.pid = pid
        self.pgid = os.getpgid(pid)
        self.started = proctree.start_time(pid)
        self.write_record()

    # -- the record of a running kernel (revive.py) --------------------------------------------------

    @property
    def record_path(self) -> Path:
        return Path(self.state_dir) / RECORDS / f"{self.kernel_id}.json"

    def record_moving(self, host: str | None) -> None:
        """Write down that the kernel is being restored on peer ``host`` (its process here is dumped): a server
        that dies before :meth:`adopt_remote` leaves its next one a record that asks that host first, whose
        copy, once restored, is the kernel (revive.py); the images here are, if that host has none. None: the
        move is undone, and that record goes (the images here, or the process restored here, say where the
        kernel is)."""
        if host is None:
            self.drop_record()
        else:
            self._write_record({"peer": host, "gpus": []}, strict=True)

    def record_copy_left(self, host: str | None) -> None:
        """Name ``host`` in the kernel's record from its next write (its adoption, on its way home from that
        host) as holding a dump of it still: a server that dies before that dump is discarded has its next one
        discard it (revive.py); None once it is (the record is written again without)."""
        self.copy_left = host
        if host is None:
            self.write_record()

    def write_record(self) -> None:
        """Record what a server started after a crash needs to adopt this kernel (best effort): its running
        process here, or the peer it runs on (``remote``: the next server relays to it again)."""
        link = self.remote_link
        if link is None and (self.pid is None or self.started is None):
            return
        self._write_record({"peer": link.host, "gpus": self.remote_gpus} if link is not None else None)

    def _write_record(self, remote: dict | None, strict: bool = False) -> None:
        """Write the record (``remote``: the peer it names); ``strict``: a failure raises ImageError, else it
        is logged (the kernel runs all the same)."""
        info = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in self.connection_info.items()}
        credentials = self._credentials()
        record = {"kernel_id": self.kernel_id, "kernel_name": self.kernel_name, "pid": self.pid,
                  "started": self.started, "owner": os.geteuid(), "server": this_process(), "connection_info": info,
                  "sessions": list(self.sessions),
                  "credential": credentials.digest(self.kernel_id) if credentials is not None else None,
                  "api_url": credentials.server_url() if credentials is not None else None}
        if remote is not None:
            record["remote"] = remote
        elif self.copy_left:
            record["copy_left"] = {"peer": self.copy_left}
        try:
            self.record_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Synced where it names a peer: a kernel dumped here and running there is found by this record
            # alone, after any crash. The process here that a record names ends with a crash of the host, which
            # the page cache does not outlive either; a crash of the server leaves both.
            write_durably(self.record_path, json.dumps(record), synced=remote is not None)
        except OSError as exc:
            if strict:
                raise ImageError(f"The kernel's record could not be written in {self.record_path.parent} ({exc}); "
                                 "free room there and try again.") from exc
            self.log.warning("gpumigrate: could not record running kernel %s (%s): a server started after a "
                             "crash will not find it", self.kernel_id, exc)

    def drop_record(self) -> None:
        self.record_path.unlink(missing_ok=True)

    def _is_ours(self) -> bool:
        """Our kernel's process still runs (not another process that got its PID since)."""
        return (self.pid is not None and proctree.is_alive(self.pid)
                and (self.started is None or proctree.start_time(self.pid) == self.started))

    def resumable_broken(self) -> bool:
        """Broken, yet whole in its images here: an undo that could not bring it back from them (another process
        holds one of its PIDs, say), with no process of it running and no peer's copy to relay to. A resume
        then brings it back as it was, once what the error names is fixed."""
        if self.state != BROKEN or self.remote_link is not None or self._is_ours():
            return False
        try:
            return self.images.read_manifest(self.kernel_id).kernel_id == self.kernel_id
        except MigrateError:  # whole all the same where only the manifest is missing (the resume writes it)
            return self.images.finished_dump(self.kernel_id) is not None

    def keeps_whole_images(self) -> bool:
        """Its images here are all there is of it: suspended, or broken with them whole (moved to disk as the
        server stops, or as memory runs short)."""
        return self.state == SUSPENDED or self.resumable_broken()

    def broken_remedy(self) -> str:
        """What a broken kernel's reason ends with (saga.Saga): how to get out of it."""
        if self.resumable_broken():
            return ("Its images are whole and kept: resume it once that is fixed, and it runs as it was (restarting "
                    "it would start it afresh, and delete them).")
        return "Restart the kernel."

    def wait_ready(self, timeout: float) -> bool:
        """Wait until the restored kernel answers and publishes on IOPub to a new subscriber (:attr:`answered`
        says how the wait went)."""
        self.answered = {}
        return kernel_answers(self.connection_info, timeout, self.answered)

    def carry_over(self, pid: int) -> None:
        self.lineage = {*self.lineage, pid}

    def finish_cells(self, timeout: float) -> bool:
        # An empty silent request waits behind what the kernel was sent before (it serves them in order).
        return run_silently(self.connection_info, "", timeout)

    def release_gpu_cache(self) -> None:
        """Have an idle Python kernel with torch drop the GPU blocks its allocator caches but does not use.

        Only an idle kernel: a busy one would run this after its cell, too late. Best effort: a kernel
        that does not answer in time is moved with its cache.
        """
        kernelspec = getattr(self.parent, "kernel_spec", None)
        if getattr(kernelspec, "language", "").lower() != "python":
            return
        if self._activity(safe_point=False) != IDLE:
            return
        run_silently(self.connection_info, RELEASE_TORCH_CACHE, timeout=self.cache_release_timeout)

    def invite_stager(self, path: str, token: str) -> str | None:
        """Have an IPython kernel serve the fast path of a GPU move (engine/stash.py) on the socket at
        ``path``: idle, by a silent request whose reply nobody waits for (the socket says what happens);
        busy with a cell, at its next safe point. None if invited, else why not."""
        why = self._cannot_serve("the fast path")
        if why:
            return why
        activity = self._activity()
        if activity in BUSY:
            claim = self._safe_point("stager", {"path": path, "token": token}, activity)
            return None if claim is not None else self.safe_point_reason
        if activity != IDLE:
            return "the kernel is not idle (the fast path runs between cells, at a safe point, or from %migrate)"
        send_silently(self.connection_info, STAGER_CALL.format(path=path, token=token))
        return None

    # -- a busy kernel's safe point (engine/safepoint.py, kernel/safepoint.py) ---------------------------

    @property
    def safe_point_dir(self) -> Path:
        return Path(self.state_dir) / SAFE_POINTS / self.kernel_id

    def _activity(self, safe_point: bool = True) -> str:
        """What the kernel is doing, judged once for a call: what the server last heard (``starting``...), or
        IDLE, or one of BUSY (each a reason that reads after "the kernel is"). Heard idle, it is taken as busy
        when it waits at a safe point (a stash served there and not yet taken back: a silent request would
        never be served), and, where ``safe_point`` (the call can go to its safe point instead of between
        cells), when :meth:`_hidden_busy`."""
        heard = getattr(self.parent, "execution_state", None)
        if heard == "busy":
            return BUSY_CELL
        if heard != "idle":
            return str(heard)
        ours = self.remote_link is None and self.state in (RUNNING, MIGRATING) and self._is_ours()
        point = SafePoint(self.safe_point_dir, self.pid) if ours and self.pid is not None else None
        if point is not None and point.waiting() is not None:
            return BUSY_WAITING
        if safe_point and point is not None and self._hidden_busy(point):
            return BUSY_HIDDEN
        return IDLE

    def _hidden_busy(self, point: SafePoint) -> bool:
        """Heard idle, its main thread runs all the same (proctree.main_thread_running), and its safe point can
        be asked. Work on the kernel's event loop between cells (an asyncio task, a timer) says no 'busy'; a cell
        whose first call holds the GIL starves the kernel's IOPub thread, whose 'busy' then goes out only when
        that call returns. A silent request waits behind all of it (a suspend's stash: up to its bound, minutes);
        at the safe point it is served at the next bytecode, or steps aside within safe_point_timeout. A kernel
        whose safe point cannot be asked keeps the silent request, as before."""
        return (self.safe_point_timeout > 0 and point.why_not() is None
                and proctree.main_thread_running(point.pid))

    def can_stash_now(self) -> bool:
        """Whether the kernel could serve the host stash between cells now: idle, as the server last heard (also
        while it runs on another host), and able to run this package's code."""
        return getattr(self.parent, "execution_state", None) == "idle" and self._cannot_serve("the host stash") is None

    def _safe_point(self, name: str, args: dict, busy: str = "") -> Claim | None:
        """Ask the busy kernel (``busy``: one of BUSY, why it is taken as busy) to run ``name`` at its next safe
        point: the claim, or None (:attr:`safe_point_reason` says why: the cell did not get there in time, say)."""
        busy = busy or BUSY_CELL
        if busy == BUSY_WAITING:  # it serves no second call while it waits there
            self.safe_point_reason = f"the kernel is {busy}: it serves nothing more until they are read back"
            return None
        if self.pid is None or self.safe_point_timeout <= 0:
            self.safe_point_reason = f"the kernel is {busy} (c.MigratableProvisioner.safe_point_timeout is 0)"
            return None
        point = SafePoint(self.safe_point_dir, self.pid, alive=self._is_ours)
        claim = point.call(name, args, self.safe_point_timeout)
        self.safe_point_reason = None if claim else f"{busy}: {point.reason}"
        return claim

    def _cannot_serve(self, what: str) -> str | None:
        """Why this kernel cannot run this package's code for ``what``, or None."""
        if not self.ipython:
            return "the kernel is not an IPython kernel started with the extension"
        if self.python and not can_import_package(self.python, self.python_path):
            return f"the kernel's Python ({self.python}) cannot import jupyter_gpumigrate: install it there for {what}"
        return None

    def host_stash(self, folder: str, min_total: int, timeout: float, gpu_only: bool = False,
                   idle_only: bool = False) -> dict:
        """Have an idle IPython kernel (or a busy one at its safe point, unless ``idle_only``) write its large
        buffers into ``folder`` and free them (kernel/hoststash.py): what it said (``stashed``... or
        ``aside``). Raises what :func:`~.kernelwire.evaluate_silently` raises."""
        why = self._cannot_serve("the host stash")
        if why:
            return {"aside": why}
        self._stash_claim = None  # one left by an earlier suspend (its stash took nothing) is not this one's
        # Judged once: a second look could differ. A move to another host cannot use the safe point, so a kernel
        # heard idle gets the silent request there, as before (served between chunks of cooperative work).
        activity = self._activity(safe_point=not idle_only)
        if activity in BUSY and idle_only:
            return {"aside": f"the kernel is {activity}: a move to another host takes the stash between "
                             "cells only (the cell's safe point could not be released over there)"}
        if activity in BUSY:
            args: dict = {"folder": folder, "min_total": int(min_total)}
            if gpu_only:  # only then: a kernel with an older jupyter-gpumigrate still serves a suspend's stash
                args["gpu_only"] = True
            claim = self._safe_point("hoststash", args, activity)
            if claim is None:
                return {"aside": self.safe_point_reason}
            self._stash_claim = claim  # until a take back: it waits for the reply, if it did not come in time
            said = claim.reply(timeout)
            if "stashed" not in said:
                self._stash_claim = None  # nothing away: nothing to take back
            return {**said, "safe_point": round(claim.seconds, 4)}
        if activity != IDLE:
            return {"aside": "the kernel is not idle"}
        return json.loads(evaluate_silently(self.connection_info, HOST_STASH_CALL.format(folder=folder,
                                            min_total=int(min_total),
                                            # only for a move: a kernel with an older version still serves a suspend
                                            more=", gpu_only=True" if gpu_only else ""), timeout,
                                            alive=self._is_ours))

    def host_take_back(self, folder: str, timeout: float, pid: int | None = None, gpu: dict | None = None) -> dict:
        """Have the kernel (its process ``pid``, by default the one adopted) read its stashed buffers back
        from ``folder``, checking them (kernel/hoststash.py); ``gpu``: a prefetch's (engine/prefetch.py)."""
        root = pid if pid is not None else self.pid
        claim, self._stash_claim = self._stash_claim, None
        if claim is None or claim.point.pid != root:
            claim = None
        elif claim.answer is None and not claim.point.waiting():
            try:  # the stash at a safe point has not said whether it waits: its answer first (one that
                claim.reply(timeout)  # waits is released below, once its stash is done, whatever it says)
            except (OSError, RuntimeError, TimeoutError):
                pass
        return give_back_stash(folder, root, self.safe_point_dir, self.connection_info, timeout,
                               asked_at_safe_point=claim is not None, gpu=gpu)

    def host_open_prefetch(self, folder: str, gpu: dict, timeout: float, pid: int | None = None) -> str | None:
        root = pid if pid is not None else self.pid
        if root is None:
            return "the kernel has no process"
        claim = self._stash_claim
        try:
            index = read_stash_index(folder)
        except StashDamaged:
            index = {}
        if ((claim is not None and claim.point.pid == root) or SafePoint(self.safe_point_dir, root).waiting()
                or (index.get("pid") == root and index.get("safe_point"))):
            # its main thread waits in a cell: a silent request would wait for the cell's end
            return "the kernel waits at its safe point: it maps the memory once released"
        try:
            said = json.loads(evaluate_silently(self.connection_info, HOST_OPEN_PREFETCH_CALL.format(
                handle=str(gpu["handle"]), session=gpu.get("session")), timeout,
                alive=lambda: proctree.is_alive(root)))
        except (OSError, RuntimeError, TimeoutError, ValueError, ConnectionError) as exc:
            return f"it was not asked ({exc})"
        return None if said.get("opening") else str(said.get("reason") or said)

    # -- a transplant (engine/plans/transplant.py, kernel/transplant.py) -------------------------------

    def _transplant_cmd(self, folder: str) -> list[str] | None:
        return transplant_argv(self.launch_cmd, folder)

    def transplant_survey(self, timeout: float) -> dict:
        why = self._cannot_serve("a transplant")
        if why is None and self._transplant_cmd("") is None:
            why = "its command line does not start it with python -m ipykernel_launcher"
        if why:
            raise InvalidState(f"Kernel {self.kernel_id} cannot be transplanted: {why}.")
        return json.loads(evaluate_silently(self.connection_info, TRANSPLANT_SURVEY_CALL, timeout, alive=self._is_ours))

    def transplant_export(self, folder: str, names: list[str], timeout: float) -> dict:
        call = TRANSPLANT_EXPORT_CALL.format(folder=folder, names=list(names))
        return json.loads(evaluate_silently(self.connection_info, call, timeout, alive=self._is_ours))

    def transplant_start(self, folder: str, gpu_uuid: str | None) -> int:
        cmd = self._transplant_cmd(folder)
        assert cmd is not None and self.log_path is not None
        if self.pid is not None:  # what was sent to the source goes to the new process, should it take over
            self.carry_over(self.pid)
        env = dict(self.launch_env or os.environ)
        env["CUDA_VISIBLE_DEVICES"] = gpu_uuid or ""  # the only GPU it sees, or none
        with open(self.log_path, "ab", buffering=0) as out:
            try:
                out.write(f"--- jupyter-gpumigrate: a transplant's new process, on {gpu_uuid or 'the CPU'} ---\n"
                          .encode())
            except OSError as exc:  # its output goes there: a process that cannot write it is not started
                exc.filename = exc.filename or str(self.log_path)
                raise
            self._transplant = launch_kernel(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                             independent=True, cwd=getattr(self, "cwd", None) or os.getcwd())
        return self._transplant.pid

    def transplant_adopt(self) -> None:
        new, self._transplant = self._transplant, None
        assert new is not None
        self._transplanted = new  # until the plan ends: its undo may have to stop it again
        self.process, self.pid = new, new.pid
        self.pgid = os.getpgid(new.pid)
        self.started = proctree.start_time(new.pid)
        self.write_record()

    def transplant_abandon(self) -> None:
        new = self._transplant or self._transplanted
        self._transplant = self._transplanted = None
        if new is None:
            return
        try:
            os.killpg(new.pid, signal.SIGKILL)  # its own session (launched independent)
        except OSError:
            pass
        try:
            new.wait(timeout=60)  # gone, its ports free, before the source is restored onto them
        except subprocess.TimeoutExpired as exc:
            raise MigrateError(f"The transplant's new process {new.pid} did not end within 60 s of SIGKILL (a GPU "
                               "that does not let it go?): the source cannot take its ports back. Its images are "
                               "kept; restart the server once that process is gone.") from exc
        if self.process is new:  # it had been adopted: the source comes back by the dump's undo
            self.process = self.pid = self.pgid = self.started = None

    def transplant_finish(self) -> None:
        self._transplant = self._transplanted = None

    # -- launching -----------------------------------------------------------------------------------

    def client_identities(self) -> list[tuple[str, bytes]]:
        """(channel, routing id) of the server's own clients of this kernel (its WebSocket bridges).

        When the kernel moves to another host, the relay introduces them there before they speak, so
        that the reply to a cell that ran during the move reaches its tab (relay.py). jupyter_client
        has no hook for the sockets its kernel manager makes; so we wrap the one method that makes
        them, on this kernel's manager only.
        """
        manager = self.parent
        if manager is None:
            return []
        if not hasattr(manager, "_gpumigrate_identities"):
            seen: dict[tuple[str, bytes], None] = {}
            make = manager._create_connected_socket

            def recording(channel: str, identity: bytes | None = None) -> Any:
                if identity:
                    seen[(channel, identity)] = None
                    while len(seen) > 256:
                        seen.pop(next(iter(seen)))
                return make(channel, identity=identity)

            manager._create_connected_socket = recording
            manager._gpumigrate_identities = seen
        return list(manager._gpumigrate_identities)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        revival = self.reviving.get(self.kernel_id)
        if revival is not None and self.parent is not None:
            # The kernel listens on its old ports, with its old key: so does its manager.
            self.parent.load_connection_info(revival.connection_info)
            self.ports_cached = True
            # Its ports are taken (by it, now or once resumed): no kernel started later gets one of them.
            LocalPortCache.instance().currently_used_ports.update(self.parent.ports)
        return await super().pre_launch(**kwargs)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        if self.state != MIGRATING:  # a restart's, kept by a plan that outlasted migration_wait and has ended
            self.stop_requested = None
        logs = Path(self.state_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.log_path = logs / f"kernel-{self.kernel_id}.log"
        revival = self.reviving.pop(self.kernel_id, None)
        env = dict(kwargs.pop("env", None) or os.environ)
        env["JPY_PARENT_PID"] = "0"
        env[SAFE_POINT_ENV] = str(self.safe_point_dir)  # the kernel arms it as the extension loads
        self.client_identities()  # start recording the server's clients of this kernel
        credentials = self._credentials()
        if credentials is not None:
            env.update(credentials.env(self.kernel_id))
        self.ipython = is_ipython_kernel(cmd)
        self.python = cmd[0] if self.ipython and "python" in os.path.basename(cmd[0]) else None
        self.python_path = env.get("PYTHONPATH")
        if self.ipython and self.python and not await asyncio.to_thread(can_import_package, self.python,
                                                                       self.python_path):
            self.log.warning("gpumigrate: the Python of kernel %s (%s) cannot import jupyter_gpumigrate: the "
                             "kernel can be suspended and moved, but has no %%migrate (install the package "
                             "there for it)", self.kernel_id, self.python)
        elif self.ipython:
            # %migrate is there without %load_ext (IPython's --ext adds to the extensions it loads).
            cmd = [*cmd, "--ext=jupyter_gpumigrate"]
        if self.ipython and self.kernel_history == "memory":
            # Not IPython's database file, which other kernels grow while this one is suspended (kernel_history);
            # given once (twice, traitlets makes the setting a list, and the kernel does not start).
            cmd = [*(a for a in cmd if not a.startswith("--HistoryManager.hist_file")),
                   "--HistoryManager.hist_file=:memory:"]
        self.launch_cmd, self.launch_env = list(cmd), dict(env)
        self.lineage = set()  # a new process, or a restart: what was sent to earlier ones is not for it
        if revival is not None:  # the kernel an earlier server left: nothing is launched
            self.cwd = kwargs.get("cwd", Path.cwd())
            return self._revive(revival)
        kwargs = self._scrub_kwargs(kwargs)
        with open(self.log_path, "ab", buffering=0) as out:
            self.process = launch_kernel(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env, independent=True, **kwargs
            )
        self.pid = self.process.pid
        self.pgid = os.getpgid(self.pid)
        self.started = proctree.start_time(self.pid)
        self.cwd = kwargs.get("cwd", Path.cwd())
        self.remote_link, self.remote_gpus, self._remote_ending = None, [], False
        self._left_remote, self.copy_left = False, None
        self.state, self.broken_reason = RUNNING, None
        self.write_record()
        return self.connection_info

    def _revive(self, revival: Revival) -> KernelConnectionInfo:
        """Take back a kernel an earlier server left: suspended, nothing launched; or, if its process runs
        (that server died while it ran, or during its resume), adopted as running, stale images removed."""
        self.process, self.pid, self.pgid, self.started = None, None, None, None
        self.remote_link, self.remote_gpus, self._remote_ending = None, [], False
        self.state, self.broken_reason = SUSPENDED, None
        self.sessions = list(revival.sessions)
        revival.taken = True
        if self.parent is not None and self.parent.has_trait("last_activity"):
            # Listed as soon as it starts (the server's GET /api/status reads it); the server sets it again
            # a moment later, once the kernel counts as started.
            self.parent.last_activity = datetime.now(timezone.utc)
        credentials = self._credentials()
        if credentials is not None and revival.credential:
            if revival.api_url == credentials.server_url():
                credentials.restore(self.kernel_id, revival.credential)  # its %migrate goes on working
            else:
                # It calls the API where the last server listened, which this one could not take again:
                # whatever listens there now may have its secret, so the secret is not accepted here.
                self.log.warning("gpumigrate: kernel %s calls the API at %s, which this server does not serve: its "
                                 "%%migrate works again once it is restarted", self.kernel_id, revival.api_url)
        if revival.pid is not None:
            self.adopt(revival.pid)  # revive.py removes its images, if any, once it answers
            self.state = RUNNING
        elif revival.remote is not None:  # it runs on a peer, which revive.py relays to again
            revival.remote.clients, revival.remote.idle = self.client_identities, self.can_stash_now
            self.adopt_remote(revival.remote, revival.where or {})
            self.state = REMOTE
        return self.connection_info

    # -- lifecycle -----------------------------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.state in (MIGRATING, SUSPENDED, REMOTE, BROKEN) or self.pid is not None

    async def poll(self) -> int | None:
        if self.state in (MIGRATING, SUSPENDED):
            return None  # alive, as far as the restarter and the kernel manager are concerned
        if self.state == REMOTE:
            return await self._poll_remote()
        if self.process is not None:
            return self.process.poll()
        if self._is_ours() or (self.state == BROKEN and self.images.path_for(self.kernel_id).is_dir()):
            return None  # a broken kernel's images may be all that is left of it: never auto-restarted
        return 0

    async def _poll_remote(self) -> int | None:
        link = self.remote_link
        if link.lost:
            return 1  # the other host went away and took the kernel with it
        if not self._remote_ending:
            return None  # the relay is up: alive, without asking the other host every few seconds
        try:
            info = await asyncio.to_thread(link.describe)
        except MigrateError:
            return 0  # gone there (or the host with it)
        return 0 if info.get("state") == STOPPED else None

    async def wait(self) -> int | None:
        while await self.poll() is None:
            await asyncio.sleep(0.1)
        code = 0
        if self.process is not None:
            code = self.process.wait()
        self.process = None
        self.pid = None
        self.state = STOPPED
        return code

    async def _migration_done(self, stopping: str | None = None) -> None:
        """Wait for a migration in progress to end. ``stopping``: why the kernel is being stopped; a plan that
        may stop where it is (a transplant writing or reading the objects) is undone there instead. One that
        outlasts ``migration_wait`` keeps the request: the stop goes on meanwhile, and the plan, failing from
        it, says so (saga.py) rather than its own words ("the kernel is dead, and Jupyter restarts it"); the
        plan's end forgets it (operations.py)."""
        if stopping and self.state == MIGRATING and not self._server_stopping():
            self.stop_requested = stopping
        waited = False
        try:
            await self._wait_migration()
            waited = True
        finally:
            if self.state != MIGRATING or not waited:
                self.stop_requested = None

    async def _wait_migration(self) -> None:
        waited = 0.0
        # A stopping server has waited for its operations already, within its own bound (app.py).
        limit = min(self.migration_wait, STOPPING_WAIT) if self._server_stopping() else self.migration_wait
        while self.state == MIGRATING and waited < limit:
            await asyncio.sleep(0.1)
            waited += 0.1

    async def send_signal(self, signum: int) -> None:
        # jupyter_client interrupts a kernel first when it shuts it down (its manager says so)
        # (a restart too: the request it makes next says so, and the stop asked first is kept)
        shutting_down = bool(getattr(self.parent, "shutting_down", False))
        await self._migration_done(self.stop_requested or ("the kernel is being shut down" if shutting_down else None))
        if self.state == SUSPENDED:
            return  # a suspended kernel has no process to signal; interrupts are moot
        if self.state == REMOTE:
            try:
                await asyncio.to_thread(self.remote_link.signal, signum)
            except MigrateError as exc:
                self.log.warning("gpumigrate: could not signal kernel %s on %s: %s", self.kernel_id,
                                 self.remote_host, exc)
            return
        if self.process is None and not self._is_ours():
            return  # a restored kernel that is gone: its PID (and group) may be someone else's now
        if (self.process is not None and self.process.poll() is not None and self.pgid is not None
                and proctree.is_alive(self.pgid) and proctree.start_time(self.pgid) != self.started):
            return  # its root ended, and its PID leads another process (group) now: PIDs wrap (at 32768 here)
        if self.pgid is not None:
            try:
                os.killpg(self.pgid, signum)
                return
            except OSError:
                pass
        if self.pid is not None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass  # it ended meanwhile, as LocalProvisioner takes it

    async def kill(self, restart: bool = False) -> None:
        await self._end(signal.SIGKILL, restart)

    async def terminate(self, restart: bool = False) -> None:
        await self._end(signal.SIGTERM, restart)

    def _server_stopping(self) -> bool:
        return bool(getattr(getattr(self.parent, "parent", None), "gpumigrate_stopping", False))

    def _server_leaving(self) -> bool:
        """The server is stopping, or was told to twice: a second signal has jupyter_server shut every kernel
        down at once, while the first stop may still be suspending some (whose shutdowns wait for those
        suspends as before, not the stopping server's STOPPING_WAIT). What a shutdown would otherwise delete
        for good (a suspended kernel's images, a transplant's kept source) stays for the next server."""
        manager = getattr(self.parent, "parent", None)
        return self._server_stopping() or bool(getattr(manager, "gpumigrate_leaving", False))

    async def _keep_or_discard(self) -> None:
        """A suspended kernel shut down: by its user, its images go; by its server stopping, they stay, and
        the next server takes it back (revive.py); taken by another host (engine/shared.py), they are its now."""
        if self.given_away:
            self._kept = True
            self.state = STOPPED
            self.log.info("gpumigrate: kernel %s was taken by another host from the shared folder: no longer "
                          "listed here", self.kernel_id)
        elif self._server_leaving():
            self._kept = True
            self.state = STOPPED
            self.log.info("gpumigrate: kernel %s stays suspended for the next server (its images are in %s)",
                          self.kernel_id, self.images.path_for(self.kernel_id))
        else:
            await self._discard_images()

    async def _end(self, signum: int, restart: bool = False) -> None:
        # jupyter_client's SIGTERM of a restart does not say it restarts: the request before it did (kept)
        await self._migration_done("the kernel is being restarted" if restart else
                                   self.stop_requested or "the kernel is being shut down")
        if self.state == SUSPENDED:
            await self._keep_or_discard()
            return
        if self._keeps_peer_copy():
            await self.leave_remote()
            return
        if self.state == BROKEN:  # whatever runs of it goes; its images go too, unless the server is stopping
            try:
                await self.send_signal(signum)
            except ProcessLookupError:
                pass
            await self._keep_or_discard()
            return
        if self.state == REMOTE:
            await self._end_remote()
            return
        try:
            await self.send_signal(signum)
        except ProcessLookupError:
            pass

    async def shutdown_requested(self, restart: bool = False) -> None:
        # A suspended kernel never reads the shutdown message: shutting it down means deleting it.
        await self._migration_done("the kernel is being restarted" if restart else "the kernel is being shut down")
        if self.state == SUSPENDED:
            await self._keep_or_discard()
        elif self.state == REMOTE:
            self._remote_ending = True  # poll() now asks the other host whether it has exited

    def _keeps_peer_copy(self) -> bool:
        """A broken kernel (a way home whose undo failed) that its peer still holds, as its server stops: the
        peer's copy may be its only one, so it is left there (:meth:`leave_remote`), as broken images here are
        kept."""
        return self.remote_link is not None and self._server_stopping() and \
            (self.state == BROKEN or self.broken_reason is not None)

    async def leave_remote(self) -> None:
        """The server stops under the stop policy 'suspend', and the kernel was suspended at its peer (or is
        left running there): relayed no longer (the shutdown's message never reaches it); its record stays, and
        the next server has it resumed there and relays to it again (revive.py), as after a crash. The peer
        keeps it meanwhile (docs/cross-host.md)."""
        restarter = getattr(self.parent, "stop_restarter", None)
        if restarter is not None:
            restarter()  # stopped here, it is not dead: no fresh kernel replaces it (and overwrites its record)
        link, self.remote_link = self.remote_link, None
        if link is not None:
            await link.detach_async()
        self._kept = self._left_remote = True
        self.remote_gpus, self._remote_ending = [], False
        self.state = STOPPED

    async def _end_remote(self) -> None:
        """Kill the kernel on the other host, delete its images there, and stop relaying."""
        link, self.remote_link = self.remote_link, None
        if link is not None:
            await link.detach_async()
            try:
                await asyncio.to_thread(link.discard)
            except MigrateError as exc:
                self.log.warning("gpumigrate: kernel %s on %s: %s", self.kernel_id, link.host, exc)
        self.remote_gpus, self._remote_ending = [], False
        self.state = STOPPED

    async def _discard_images(self) -> None:
        self.state = STOPPED  # first: nothing starts on it while its images go
        try:
            # In a thread: a move of them from memory to disk under way (the memory watcher's) is waited for
            # (ImageStore.remove), or it would put a whole copy on disk after they were deleted, and the next
            # server would bring back a kernel its user discarded.
            await asyncio.to_thread(self.images.remove, self.kernel_id)
        except MigrateError as exc:  # the node helper does not answer: say where they stay
            self.log.warning("gpumigrate: the images of kernel %s were not deleted: %s", self.kernel_id, exc)

    async def cleanup(self, restart: bool = False) -> None:
        if self._keeps_peer_copy():
            await self.leave_remote()
        if self.remote_link is not None:
            await self._end_remote()
        await super().cleanup(restart=restart)
        # Shut down: no going back to before its transplant. Restarted (by its user, or after a crash of the
        # transplanted process), it may still go back, within its time.
        if not restart and not self._server_leaving():
            self.drop_back()
        if not restart and not self._left_remote:
            self.drop_record()
        if not restart and not self._kept:
            if self.log_path is not None:
                self.log_path.unlink(missing_ok=True)
            shutil.rmtree(self.safe_point_dir, ignore_errors=True)
            try:
                self.images.remove_logs(self.kernel_id)  # failed dumps' logs go with their kernel
            except (OSError, MigrateError) as exc:
                self.log.warning("gpumigrate: the logs of kernel %s were not deleted: %s", self.kernel_id, exc)
            credentials = self._credentials()
            if credentials is not None:
                credentials.revoke(self.kernel_id)

    def _credentials(self) -> KernelCredentials | None:
        """The server's kernel credentials, when the extension runs in the server that started us."""
        return getattr(getattr(self.parent, "parent", None), "gpumigrate_credentials", None)

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update({"pid": self.pid, "pgid": self.pgid, "state": self.state, "started": self.started})
        return info

    async def load_provisioner_info(self, provisioner_info: dict) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.pid = provisioner_info.get("pid")
        self.pgid = provisioner_info.get("pgid")
        self.state = provisioner_info.get("state", RUNNING)
        self.started = provisioner_info.get("started")
