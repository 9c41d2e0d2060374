"""The jupyter_server extension: REST API under /api/gpumigrate, events, and the default provisioner."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.services.kernels.connection.channels import ZMQChannelsWebsocketConnection
from tornado.httpserver import HTTPServer
from tornado.ioloop import PeriodicCallback
from tornado.netutil import bind_sockets
from traitlets import Bool, Dict, Enum, Float, Int, TraitError, Unicode, default, validate

from .autoresume import resuming
from .bulkd import BulkListener, BulkSettings
from .credentials import KernelCredentials
from .engine import criu as criu_mod
from .engine import cpus, proctree
from .handlers import handlers
from .engine import gpus as gpus_mod
from .engine import cudackpt
from .engine import stash as stash_mod
from .engine.access import images_root, memory_root, open_criu
from .engine.errors import MigrateError
from .engine.images import write_durably
from .engine.migration import SUSPENDED
from .operations import EVENT_SCHEMA_ID, Operation, OperationManager, event_schema
from .peers import RUNNING_GUESTS, GuestHost, Peer
from .provisioner import PROVISIONER_NAME, RECORDS, MigratableProvisioner
from .memorywatch import keep_relieving
from .retention import discard_expired, keep_discarding, keep_expiring_sources
from .revive import let_cuda_run, lock_state, peer_notebooks, revive_all
from .sharing import Sharing


#: With the stop policy 'suspend': how long, past stop_timeout, a stopping server waits for the operations
#: whose CRIU runs it stopped to roll back.
LATE_GRACE = 15.0
#: The longest a stopping server waits for a kernel that Jupyter's restarter is starting again (a kernel's start).
RESTART_GRACE = 30.0
#: The longest the session API waits, as the server starts, for the kernels of an earlier server.
REVIVE_WAIT = 60.0
#: The longest a new session waits, as the server starts, for the kernel of its notebook that runs on a peer
#: (which the peer may have to resume first, or be busy with: revive.PEER_BUSY_WAIT).
REVIVE_PEER_WAIT = 300.0
#: True in the task that takes those kernels back.
REVIVING: contextvars.ContextVar[bool] = contextvars.ContextVar("gpumigrate_reviving", default=False)


def _spare_stash_helper(log: Any) -> None:
    """Where moves between GPUs can happen (two or more GPUs, the driver's bindings installed), have the fast
    path's helper ready for the first one (engine/stash.py: Python and the bindings loaded, no GPU touched)."""
    try:
        if len(gpus_mod.snapshot()) >= 2:
            stash_mod.prestart()
    except OSError as exc:  # no process could start: each move starts its own helper then
        log.warning("gpumigrate: no spare helper for the fast path (%s)", exc)


#: The CPUs this server can use (engine/cpus.py) from which stream_dump 'auto' streams: a stash's 16 writer
#: threads and 8 sending processes go at once. Faster with about 16 a host, slower with about 8 (two hosts on one
#: machine of 32 CPUs, and of 16; a host with 16 of its own is inferred; docs/cross-host.md).
STREAM_CPUS = 16

class GPUMigrateApp(ExtensionApp):
    name = "jupyter_gpumigrate"
    description = "Suspend, resume and move live kernels."

    default_provisioner = Bool(
        True,
        help=f"Make '{PROVISIONER_NAME}' the provisioner of every kernel whose kernelspec names none, so "
        "that every kernel can be suspended and moved. Set False to keep jupyter_client's default; a "
        "kernelspec can still ask for it with metadata.kernel_provisioner.provisioner_name.",
    ).tag(config=True)

    criu_path = Unicode(
        "", help="The CRIU binary; empty: MigratableProvisioner.criu_path, /usr/local/sbin/criu or PATH."
    ).tag(config=True)

    host_name = Unicode(
        help="This server's name for its peers and in kernel lists (default: the host name).",
    ).tag(config=True)

    peers = Dict(
        help="Other servers with jupyter_gpumigrate that kernels can move to, by name: "
        '{"b": {"url": "https://b:8888/", "token": "<b\'s peer_token>", "ca_file": "/path/ca.pem"}}. '
        "url must be https (plain http only on loopback); ca_file is optional (default: system CAs).",
    ).tag(config=True)

    peer_token = Unicode(
        "", help="The credential peers must present to move kernels to this server (and back). Empty: this "
        "server hosts no kernels for peers. Keep it secret; it lets a peer run processes here as this server's user.",
    ).tag(config=True)

    bulk_port = Int(
        0, min=-1, max=65535, help="Where this server takes kernels from peers (peer_token): the port on which the large image files "
        "of a move arrive, each received by a process of its own (a server's one process received four at 1.10 "
        "GB/s in all where four processes took 4.1 GB/s; docs/cross-host.md). On the server's address, with its "
        "certificate; peers learn it as they ask to move a kernel here. 0 (the default): any free port; -1: none, "
        "the files come through the server's port. Peers that cannot connect to it use the server's port. A "
        "server with peers (peers) starts the same listener for its ways home, whose processes fetch the large "
        "files; it listens on a port only where it takes kernels; -1 turns that off too (the server's process "
        "fetches them).",
    ).tag(config=True)

    transfer_streams = Int(
        0, min=0, help="How many image files a move to another host sends or fetches at once, each over a connection "
        "of its own (this server's, both ways: away it sends, home it fetches). 0 (the default): half the CPUs "
        "this server can use (its affinity and its cgroups' CPU quota), at most 8 (each stream takes about a "
        "core on both hosts).",
    ).tag(config=True)

    transfer_nice = Int(
        10, min=0, max=19, help="How nice (0-19, added to the server's own) the bulk listener's processes are: "
        "they encrypt, decrypt, checksum and write a move's large image files on this host (bulk_port). At 10 (the "
        "default) they take the CPUs that the kernels leave, the moving kernel's own stash among them: a 32 GB GPU "
        "kernel went to another host in 7.7 s instead of 8.2 s (docs/cross-host.md). 0: the server's own "
        "priority, for hosts where moves must go fast even while every CPU is busy.",
    ).tag(config=True)

    @default("host_name")
    def _default_host_name(self) -> str:
        return socket.gethostname()

    @validate("peers")
    def _check_peers(self, proposal: Any) -> dict:
        for name, entry in proposal["value"].items():
            if not isinstance(entry, dict):
                raise TraitError(f"Peer {name!r} must be a dict with url and token.")
            try:
                Peer.from_config(name, entry)
            except ValueError as exc:
                raise TraitError(str(exc)) from exc
        return proposal["value"]

    def _link_jupyter_server_extension(self, serverapp: Any) -> None:
        """Link as any extension does, and check the provisioner's settings with ours: a setting refused
        (a wrong type, a value out of range) stops the server from starting, saying which and why. jupyter_server
        would log the error and run on without this extension, its suspended kernels unlisted, and every kernel
        whose provisioner is ours refused at its start ("Unhandled error")."""
        try:
            super()._link_jupyter_server_extension(serverapp)
            MigratableProvisioner(config=serverapp.config)
        except TraitError as exc:
            self.log.critical("jupyter-gpumigrate: a setting is refused: %s. Correct it (in a jupyter_server_config "
                              "file or on the command line; `jupyter --paths` lists the folders), then start the "
                              "server again. It does not start meanwhile: without jupyter-gpumigrate, suspended "
                              "kernels would not be listed, and its kernels could not start.", str(exc).rstrip("."))
            raise SystemExit(1) from exc

    def initialize_settings(self) -> None:
        # The package's module loggers (the engine's, the peers', ...) write into this server's log, as
        # jupyter_server hooks tornado's up: without it their info lines went nowhere.
        package = logging.getLogger(__package__)
        package.propagate = True
        package.parent = self.log
        package.setLevel(self.log.level)
        factory = KernelProvisionerFactory.instance(parent=self.serverapp.kernel_manager)
        # Ours by default (jupyter_server reads only the extension list from jupyter-config/'s folder, so
        # the choice is made here); a server configured with another one keeps it, and is told what that
        # costs; the switch turns ours off.
        configured = self.serverapp.config.get("KernelProvisionerFactory", {}).get("default_provisioner_name")
        if self.default_provisioner and configured and configured != PROVISIONER_NAME:
            self.log.warning("gpumigrate: keeping c.KernelProvisionerFactory.default_provisioner_name = %r: "
                             "kernels whose kernelspec names no provisioner cannot be suspended or moved",
                             configured)
            factory.default_provisioner_name = configured
        elif self.default_provisioner:
            factory.default_provisioner_name = PROVISIONER_NAME
        else:
            # The factory is one per process: say explicitly that this server's configuration decides.
            keep = configured if configured and configured != PROVISIONER_NAME else "local-provisioner"
            factory.default_provisioner_name = keep
        # Each kernel gets a credential for itself (credentials.py); the provisioner finds this object
        # on its kernel manager's parent, the server's multi-kernel manager.
        credentials = KernelCredentials(self._kernel_api_url)
        self.serverapp.kernel_manager.gpumigrate_credentials = credentials
        self.settings["gpumigrate_credentials"] = credentials
        event_logger = self.serverapp.event_logger
        event_logger.register_event_schema(event_schema())
        peers = {name: Peer.from_config(name, entry) for name, entry in self.peers.items()}
        operations = OperationManager(
            self.serverapp.kernel_manager,
            emit=lambda data: event_logger.emit(schema_id=EVENT_SCHEMA_ID, data=data),
            criu_path=self.criu_path or None,
            host_name=self.host_name,
            peers=peers,
            api_address=self._kernel_api_listen,
            session_manager=getattr(self.serverapp, "session_manager", None),
            stream_dump=self._streams_dumps(),
        )
        self.settings["gpumigrate_operations"] = operations
        operations.transfer_streams = max(0, self.transfer_streams)
        #: the records not taken back at start (revive.py), for GET /refused
        self.settings["gpumigrate_refused"] = []
        self._resume_on_cells(operations)
        defaults = MigratableProvisioner(config=self.serverapp.config)
        helper_socket = defaults.helper_socket or None
        # Guests' images in memory where there is room, beside this user's (not inside: a folder there is a
        # kernel's); through the node helper (where its socket is there, for a user not root: images_root then
        # names the helper's folder), in the helper's folders, on disk or, where it keeps them, in memory: it
        # writes nowhere else. The configured socket alone says nothing: it has a default, so testing it kept
        # every guest's images on disk (the way home's stash wrote at the disk's speed).
        guests_root = images_root(Path(defaults.state_dir), helper_socket)
        guests_memory: Path | None = Path(f"{defaults.memory_dir}-guests") if defaults.memory_dir else None
        if guests_root != Path(defaults.state_dir) and guests_memory is not None:
            helper_memory = memory_root(None, helper_socket)
            guests_memory = helper_memory / f"guests-{defaults.state_digest()}" if helper_memory is not None else None
        self.guests = GuestHost(guests_root / "guests",
                                lambda: open_criu(self.criu_path or defaults.criu_path or None, helper_socket),
                                gpus_mod.snapshot, guests_memory, defaults.suspend_to, self._kernelspec,
                                received_expire=self.guest_images_expire, unclaimed=self.guest_unclaimed_expire,
                                records=Path(defaults.state_dir) / RUNNING_GUESTS)
        self.guests.serve_growing = self._streams_dumps()
        self.guests.prefetch = defaults.resume_prefetch
        try:
            if any(self.guests.records.glob("*.json")):
                self.guests.back.clear()  # there are guests to take back: until _take_back_guests has run
        except OSError:
            pass  # an unreadable folder: take_back says so, and takes none back
        self.settings["gpumigrate_guests"] = self.guests
        self.settings["gpumigrate_peer_token"] = self.peer_token
        if self.bulk_port >= 0 and (self.peer_token or self.peers):
            self._start_bulk_listener(operations)
        self._keep_culler_off_moving_kernels()
        self._record_sessions()
        threading.Thread(target=self._initialise_cuda, name="gpumigrate-cuda-init", daemon=True).start()
        if proctree.become_subreaper():
            # Restored kernels are now our children: reap them, and their orphans, as they exit.
            self._reaper = PeriodicCallback(self._reap_kernel_orphans, 2000)
            self._reaper.start()
        else:
            self.log.warning("gpumigrate: could not become a child subreaper: a kernel restored once may "
                             "not resume a second time if PID 1 does not reap it")

    def _start_bulk_listener(self, operations: OperationManager) -> None:
        """Start the bulk listener (bulkd.py) in a thread of its own (a Python process takes a second to start):
        peers use it once it is up, and the server's port meanwhile; so do this server's ways home. It listens
        only where the server takes kernels from peers (peer_token)."""
        app = self.serverapp
        ip = "" if app.ip in ("", "*", "0.0.0.0") else app.ip  # noqa: S104 - the server's own choice
        guests = self.guests

        def listening(port: int | None) -> None:  # at its start, each time it is started again, and None as it ends
            guests.bulk_port, guests.bulk_tls = port, bulk.tls and port is not None
            if port is not None:
                self.log.info("gpumigrate: peers' image files are received on port %d, each by a process of its "
                              "own", port)

        bulk = self._bulk = BulkListener(BulkSettings(
            token=self.peer_token, root=str(self.guests.store.root),
            memory_root=str(self.guests.store.memory_root) if self.guests.store.memory_root else None,
            base_url=app.base_url, host=ip, port=self.bulk_port if self.peer_token else -1,
            certfile=app.certfile or None,
            keyfile=app.keyfile or None,
            dumps=str(self.guests.dump_marks) if self.guests.serve_growing else None,
            nice=self.transfer_nice), on_start=listening)

        def start() -> None:
            try:
                bulk.start()
            except Exception as exc:  # noqa: BLE001 - said; the files go through the server's port
                self.log.warning("gpumigrate: %s", exc)
                return
            operations.bulk = bulk

        threading.Thread(target=start, name="gpumigrate-bulkd", daemon=True).start()

    stop_policy = Enum(
        ["shutdown", "suspend"], default_value="shutdown",
        help="What stopping the server does to its running kernels. 'shutdown': they end, as with any "
        "Jupyter server. 'suspend': each is suspended first (in parallel, within stop_timeout) and comes back "
        "at the next start, with its notebook (to memory if its disk is full, where there is room there); one that "
        "cannot be suspended in time is shut down, and the log says so; one that runs on a peer is suspended there, and the next start resumes it there. Kernels that "
        "are already suspended always stay suspended, whatever the policy (README, 'Kernels outlive their "
        "server').",
    ).tag(config=True)

    guest_images_expire = Float(
        1800.0, min=0.0, help="How long images a peer sent for a move may wait here, never restored, before they are "
        "deleted, in seconds: the peer keeps its own copy until the kernel answers from here, so once it died or "
        "gave up they are litter (memory, in /dev/shm). Images of a kernel dumped here for its way home are never "
        "deleted so: they may be its only copy.",
    ).tag(config=True)

    guest_unclaimed_expire = Float(
        600.0, min=0.0, help="A kernel this host ran for a peer outlives this server (killed or stopped): the next server "
        "takes it back, and the peer's relay dials it again. One that its peer does not relay within this many "
        "seconds of that start is discarded: its peer gave up on it (it restarts a kernel it counts lost after its "
        "relay's 30 s of patience) or went too (docs/cross-host.md). So is one restored here by a move whose peer's "
        "server died before it relayed to it, and came back no sooner: that peer resumes the kernel from its own "
        "images.",
    ).tag(config=True)

    stream_dump = Enum(
        ["auto", "on", "off", True, False], default_value="auto",
        help="Whether this host's dumps for a move to another host (its own kernels going away, and its guests "
        "going home) have their files carried while they are written (phase 'stream': the stash's parts as the "
        "kernel writes them, CRIU's pages files as the dump does), instead of the stash's once it is written "
        "and CRIU's once the dump is over. 'auto' (the default): where this server can use 16 CPUs or more (its "
        "affinity and its cgroups' CPU quota, as a pod's CPU limit sets it): it was faster in 10 of 12 trips side "
        "by side with about 16 CPUs a host (two hosts sharing 2 x H200's 32, with transfer_nice; 2026-11-30), "
        "and slower with about 8 (two hosts sharing 16; 2026-11-29); docs/cross-host.md. "
        "'on' (or true): always; 'off' (or false): never.",
    ).tag(config=True)

    stop_timeout = Float(
        120.0, min=0.0, help="With stop_policy 'suspend': the longest a stopping server waits for its kernels to be "
        "suspended, in seconds. Give a JupyterHub spawner's stop timeout more than this (docs/hub.md).",
    ).tag(config=True)

    retention = Float(
        0.0, help="How long a suspended kernel is kept, in seconds since it was suspended (7 days: 604800); "
        "older ones are discarded, as `jupyter gpumigrate discard` does: their images are deleted. Checked as the "
        "server starts and every retention_interval seconds. 0 (the default): kept until their user resumes or "
        "discards them, since a suspended kernel is someone's work (README, 'Retention').",
    ).tag(config=True)

    shared_heartbeat = Float(
        10.0, help="With c.MigratableProvisioner.shared_dir: how often this server says in the shared folder that "
        "it runs, and looks there for the suspended kernels of hosts that stopped, in seconds. A host whose "
        "heartbeat another sees unchanged for three of its intervals, on its own clock, has stopped: its "
        "suspended kernels may be taken by that one.",
    ).tag(config=True)

    memory_low = Float(
        0.1, help="When the host's available memory falls under this share of its total, suspended kernels' "
        "images in memory are moved to disk, the largest first, until it is above again (0: never).",
    ).tag(config=True)

    memory_check_interval = Float(
        30.0, help="How often the server looks whether memory runs short (memory_low), in seconds.",
    ).tag(config=True)

    retention_interval = Float(
        3600.0, help="With a retention: how often the running server looks for suspended kernels older than it, "
        "in seconds.",
    ).tag(config=True)

    @validate("shared_heartbeat", "memory_check_interval")
    def _positive(self, proposal: Any) -> float:
        if proposal["value"] <= 0:
            raise TraitError(f"c.GPUMigrateApp.{proposal['trait'].name} must be a number of seconds above 0 (got "
                             f"{proposal['value']}).")
        return proposal["value"]

    @validate("memory_low")
    def _share(self, proposal: Any) -> float:
        if not 0 <= proposal["value"] <= 1:
            raise TraitError(f"c.GPUMigrateApp.memory_low is a share of the host's memory, from 0 (never) to 1 "
                             f"(got {proposal['value']}).")
        return proposal["value"]

    @validate("retention", "retention_interval")
    def _not_negative(self, proposal: Any) -> float:
        if proposal["value"] < 0 or (proposal["trait"].name == "retention_interval" and proposal["value"] == 0):
            raise TraitError(f"c.GPUMigrateApp.{proposal['trait'].name} must be a number of seconds above 0 "
                             f"(got {proposal['value']}); a retention of 0 keeps suspended kernels forever.")
        return proposal["value"]

    resume_on_execute = Bool(
        True,
        help="Resume a suspended kernel when a cell is run on it (an execute_request from its notebook); "
        "the cell then runs on the resumed kernel. Set False to resume only on request (what the notebook "
        "sends meanwhile still waits for the kernel).",
    ).tag(config=True)

    def _resume_on_cells(self, operations: OperationManager) -> None:
        base = self.serverapp.web_app.settings.get("kernel_websocket_connection_class")
        if not (isinstance(base, type) and issubclass(base, ZMQChannelsWebsocketConnection)):
            self.log.warning("gpumigrate: kernel WebSockets are served by %s, not by jupyter_server's ZMQ "
                             "channels: running a cell will not resume a suspended kernel, and a cell sent "
                             "to it may lose its first output", base)
            return
        self.settings["kernel_websocket_connection_class"] = resuming(base, operations, self.resume_on_execute)

    def _initialise_cuda(self) -> None:
        """On a machine with GPUs, initialise the CUDA driver in this process now: the first lock of the
        first move would otherwise wait for it (0.4-0.6 s measured on the H200s). No GPU memory is used."""
        if not gpus_mod.snapshot():
            return
        try:
            cudackpt.ensure_available()
        except MigrateError as exc:  # said again, with the remedy, when a GPU operation is asked for
            self.log.info("gpumigrate: CUDA checkpointing unavailable here: %s", exc)

    _kernel_api_address: tuple[str, int] | None = None

    def _kernel_api_listen(self) -> tuple[str, int] | None:
        """Where the kernels' API listens (:meth:`_kernel_api_url`'s address), listening from the first call."""
        self._kernel_api_url()
        return self._kernel_api_address

    def _kernel_api_url(self) -> str:
        """Where the server's kernels call it (credentials.py): a loopback port of its own.

        The same application, served on a second, random loopback port: the kernel's calls never
        depend on how the server is exposed (a public address, TLS, a proxy), and when a kernel moves
        to another host, that host's end of the relay listens on this address for it (relay.py).
        """
        if self._kernel_api_address is None:
            # The same port as the last server's, if it is free: kernels it left (revive.py) call that one.
            remembered = Path(MigratableProvisioner(config=self.serverapp.config).state_dir) / "kernel-api.port"
            try:
                sock = bind_sockets(int(remembered.read_text()), "127.0.0.1")[0]
            except (OSError, ValueError):
                sock = bind_sockets(0, "127.0.0.1")[0]
                try:
                    remembered.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    write_durably(remembered, str(sock.getsockname()[1]))
                except OSError as exc:
                    self.log.warning("gpumigrate: could not remember the kernels' API port in %s: %s", remembered,
                                     exc)
            server = HTTPServer(self.serverapp.web_app, xheaders=False)
            server.add_sockets([sock])
            self._kernel_api_server = server
            self._kernel_api_address = ("127.0.0.1", sock.getsockname()[1])
        address, port = self._kernel_api_address
        return f"http://{address}:{port}{self.serverapp.base_url}"

    def _reap_kernel_orphans(self) -> None:
        km = self.serverapp.kernel_manager
        sessions, skip = set(), set()
        sessions.update(g.pgid for g in self.guests.guests.values() if g.pgid)
        skip.update(self.guests.waiting_pids())  # a transplant's new process: its Popen reaps it
        for kernel_id in km.list_kernel_ids():
            provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
            if isinstance(provisioner, MigratableProvisioner) and provisioner.pgid:
                sessions.add(provisioner.pgid)  # kernels start in a session of their own
                if provisioner.process is not None:
                    skip.add(provisioner.process.pid)  # its Popen reaps it
        if self._bulk is not None:  # the bulk listener's processes, where it was killed (bulkd.py)
            sessions.update(self._bulk.sessions)
            skip.update(self._bulk.own)  # their Popen reaps them
        if sessions:
            proctree.reap_orphans(sessions, skip)

    def _kernelspec(self, name: str) -> tuple[list[str], dict]:
        """The command line and environment of this server's kernel type ``name`` (for a peer's transplant)."""
        spec = self.serverapp.kernel_spec_manager.get_kernel_spec(name)
        argv = [a.replace("{resource_dir}", spec.resource_dir).replace("{prefix}", sys.prefix) for a in spec.argv]
        if argv and argv[0] in {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}:
            argv[0] = sys.executable  # as jupyter_client's KernelManager does: this server's Python
        return argv, dict(spec.env or {})

    def _streams_dumps(self) -> bool:
        """c.GPUMigrateApp.stream_dump, decided: 'auto' counts the CPUs this process can use (its affinity and its
        cgroups' CPU quota: a pod's CPU limit, not its node's CPUs; engine/cpus.py)."""
        if self.stream_dump in ("on", True):
            return True
        if self.stream_dump in ("off", False):
            return False
        return cpus.usable() >= STREAM_CPUS

    def _keep_culler_off_moving_kernels(self) -> None:
        # The idle culler would shut down (and so delete) a suspended kernel: its last activity is old.
        # jupyter_server has no hook to veto a cull, so wrap this server's kernel manager's method;
        # replacing the kernel manager class would fight other extensions that configure it.
        km = self.serverapp.kernel_manager
        cull = km.cull_kernel_if_idle

        async def cull_unless_moving(kernel_id: str) -> Any:
            kernel = km._kernels.get(kernel_id)
            provisioner = getattr(kernel, "provisioner", None)
            if isinstance(provisioner, MigratableProvisioner) and provisioner.state != "running":
                self.log.debug("gpumigrate: not culling %s kernel %s", provisioner.state, kernel_id)
                return None
            return await cull(kernel_id)

        km.cull_kernel_if_idle = cull_unless_moving

    def _record_sessions(self) -> None:
        """Keep each kernel's sessions (the notebooks that point at it) in its provisioner and its running
        record, so that a server started after a crash points the notebooks at their kernels again
        (revive.py). jupyter_server has no hook for session changes: wrap this server's session manager's
        two methods that make and change them."""
        sessions = getattr(self.serverapp, "session_manager", None)
        if sessions is None:
            return
        km = self.serverapp.kernel_manager
        list_sessions = sessions.list_sessions

        async def refresh() -> None:
            try:
                listed = await list_sessions()
            except Exception:  # noqa: BLE001  best effort: the sessions are read again at the next change
                self.log.debug("gpumigrate: could not list sessions", exc_info=True)
                return
            for kernel_id in km.list_kernel_ids():
                provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
                if not isinstance(provisioner, MigratableProvisioner):
                    continue
                mine = [{"id": s["id"], "path": s.get("path"), "name": s.get("name"), "type": s.get("type")}
                        for s in listed if (s.get("kernel") or {}).get("id") == kernel_id]
                if mine != provisioner.sessions:
                    provisioner.sessions = mine
                    if provisioner.state in ("running", "remote"):
                        provisioner.write_record()

        for name in ("save_session", "update_session", "delete_session"):
            method = getattr(sessions, name)

            async def changed(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                result = await _method(*args, **kwargs)
                await refresh()
                return result

            setattr(sessions, name, changed)

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers())

    def _take_back_guests(self) -> None:
        """The kernels an earlier server of this state folder ran for its peers (GuestHost.take_back): only
        once this server holds the folder, or it would take those of a server that still runs."""
        try:
            for kernel_id, pid in self.guests.take_back():
                let_cuda_run(kernel_id, pid)  # a GPU guest's dump cut short by its server's death leaves it locked
        except Exception:  # noqa: BLE001  the server runs; what is not taken back is left as it is
            self.log.exception("gpumigrate: could not take back the kernels an earlier server ran for its peers")
        finally:
            self.guests.back.set()

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        """Once the server runs: take back the kernels an earlier server left suspended (revive.py)."""
        if not (sys.stdin and sys.stdin.isatty()) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            # With no terminal (systemd, `docker run` without -t, JupyterHub's spawners, which stop a server
            # with SIGINT first), jupyter_server leaves SIGINT to Python, which ends the server with no clean-up
            # at all: its running kernels would be left behind, unreachable. Stop as on SIGTERM instead.
            signal.signal(signal.SIGINT, serverapp._signal_stop)
        state_dir = Path(MigratableProvisioner(config=serverapp.config).state_dir)
        self._state_lock, why_not = lock_state(state_dir)
        if self._state_lock is None:
            self.log.warning("gpumigrate: %s", why_not)
            self.guests.back.set()  # it takes none back
            return
        self.guests.drop_dump_marks()
        await asyncio.to_thread(self._take_back_guests)
        done = self._hold_sessions_until_revived(peer_notebooks(state_dir / RECORDS))
        REVIVING.set(True)  # this task's own session calls are not held
        sharing = None
        try:
            sharing = self._sharing(serverapp)
            if sharing is not None:
                await asyncio.to_thread(sharing.start_beating)  # no other host takes its kernels meanwhile
            operations: OperationManager = self.settings["gpumigrate_operations"]
            found = await revive_all(serverapp, operations.link_to)
            # In place: the web application's settings hold this same list (a copy of the dict, made at load).
            self.settings["gpumigrate_refused"].extend(f for f in found if f.outcome == "refused")
        except Exception:  # noqa: BLE001  the server runs; the kernels' images stay where they are
            self.log.exception("gpumigrate: could not take back the suspended kernels of an earlier server")
        finally:
            done.set()
        self._start_retention()
        await asyncio.to_thread(_spare_stash_helper, self.log)
        self._sources_task = asyncio.get_running_loop().create_task(keep_expiring_sources(
            lambda: MigratableProvisioner(config=serverapp.config).images, self.settings["gpumigrate_operations"]))
        if self.memory_low > 0:
            self._memory_task = asyncio.get_running_loop().create_task(keep_relieving(
                serverapp.kernel_manager, self.settings["gpumigrate_operations"], self.memory_low,
                self.memory_check_interval))
        if sharing is not None:
            self._sharing_task = asyncio.get_running_loop().create_task(
                sharing.run(self.settings["gpumigrate_refused"]))

    _sharing_task: asyncio.Task | None = None
    _memory_task: asyncio.Task | None = None

    def _sharing(self, serverapp: Any) -> Sharing | None:
        """The shared folder's ticks (sharing.py), if c.MigratableProvisioner.shared_dir is set."""
        shared = MigratableProvisioner(config=serverapp.config).shared
        if shared is None:
            return None
        self.log.info("gpumigrate: suspended kernels go to %s, shared with other hosts, as host %s",
                      shared.images_root(), shared.host)
        shared.interval = self.shared_heartbeat
        self._shared = Sharing(serverapp, self.settings["gpumigrate_operations"], shared, self.shared_heartbeat)
        return self._shared

    _shared: Sharing | None = None

    _retention_task: asyncio.Task | None = None
    _bulk: BulkListener | None = None
    _sources_task: asyncio.Task | None = None

    def _start_retention(self) -> None:
        """Discard the suspended kernels older than the retention now, then every retention_interval
        (retention.py), until the server stops."""
        if self.retention <= 0:
            return
        operations: OperationManager = self.settings["gpumigrate_operations"]
        km = self.serverapp.kernel_manager

        async def run() -> None:
            try:
                await discard_expired(km, operations, self.retention)
            except Exception:  # noqa: BLE001  the server runs on; the next pass tries again
                self.log.exception("gpumigrate: the retention pass failed")
            await keep_discarding(km, operations, self.retention, self.retention_interval)

        self._retention_task = asyncio.get_running_loop().create_task(run())

    def _hold_sessions_until_revived(self, on_peers: set[str]) -> asyncio.Event:
        """JupyterLab, reconnecting as the server starts, asks which session a notebook has, and makes one,
        with a new kernel, if there is none yet: the session API waits (at most REVIVE_WAIT) until the
        kernels of an earlier server are back, with their sessions. A new session asked for meanwhile is the
        notebook's session that came back, if one did (never a second kernel for it); for a notebook whose
        kernel runs on a peer (``on_peers``: their paths), which may first have to resume it, it waits up to
        REVIVE_PEER_WAIT."""
        done = asyncio.Event()
        sessions = getattr(self.serverapp, "session_manager", None)
        if sessions is None:
            return done

        async def until_done(seconds: float) -> None:
            if not done.is_set() and not REVIVING.get():
                try:
                    await asyncio.wait_for(done.wait(), seconds)
                except asyncio.TimeoutError:
                    pass

        create, exists, get = sessions.create_session, sessions.session_exists, sessions.get_session
        for name in ("list_sessions", "get_session"):
            method = getattr(sessions, name)

            async def held(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
                await until_done(REVIVE_WAIT)
                return await _method(*args, **kwargs)

            setattr(sessions, name, held)

        async def held_create(*args: Any, **kwargs: Any) -> Any:
            if done.is_set() or REVIVING.get():
                return await create(*args, **kwargs)
            path = kwargs.get("path", args[0] if args else None)
            await until_done(REVIVE_PEER_WAIT if path in on_peers else REVIVE_WAIT)
            if path is not None and kwargs.get("kernel_id") is None and await exists(path=path):
                return await get(path=path)  # its kernel came back with this session meanwhile
            return await create(*args, **kwargs)

        sessions.create_session = held_create
        return done

    _stopping = False

    async def stop_extension(self) -> None:
        if "gpumigrate_operations" not in self.settings:
            return  # it never loaded (jupyter_server logged why): nothing of it runs, and the server's stop goes on
        if self._stopping:
            # A second signal while the first stop runs: jupyter_server shuts every kernel down as soon as this
            # returns. Kernels suspended before keep their images (until the first stop's own suspends were
            # over, a second signal deleted them: provisioner._server_leaving); the shutdown of one that the
            # first stop is suspending waits for that suspend, as before.
            self.serverapp.kernel_manager.gpumigrate_leaving = True
            await self._settle_restarts()
            return
        self._stopping = True
        self.settings["gpumigrate_operations"].closing = True  # from now on only the stop starts operations
        if self._retention_task is not None:
            self._retention_task.cancel()  # nothing is discarded while the server stops
        if self._sources_task is not None:
            self._sources_task.cancel()
        if self._memory_task is not None:
            self._memory_task.cancel()  # a move under way finishes (below: waited for)
        if self._sharing_task is not None:
            self._sharing_task.cancel()  # nothing is taken while it stops; it beats until the very end
        operations: OperationManager = self.settings["gpumigrate_operations"]
        await self._settle_restarts()
        if self.stop_policy == "suspend":
            await self._suspend_all(operations)
        # From here on a suspended kernel that the server shuts down keeps its images (provisioner.py).
        self.serverapp.kernel_manager.gpumigrate_stopping = True
        if self.stop_policy != "suspend":
            await operations.wait_idle()
        else:
            try:  # the suspends were waited for within their bound; other operations get the grace alone
                await asyncio.wait_for(asyncio.shield(operations.wait_idle()), LATE_GRACE)
            except asyncio.TimeoutError:
                self.log.warning("gpumigrate: stopping: operations still under way after %.0f s more: not waited "
                                 "for", LATE_GRACE)
        if self.stop_policy == "suspend":
            await self._leave_remote_kernels(operations)
        await self._images_to_disk()
        await asyncio.to_thread(stash_mod.end_spare)
        if self._bulk is not None:
            await asyncio.to_thread(self._bulk.stop)
        guests = self.settings.get("gpumigrate_guests")
        for memory in (MigratableProvisioner(config=self.serverapp.config).images.memory_root,
                       guests.store.memory_root if guests is not None else None):
            if memory is not None:
                try:
                    memory.rmdir()  # no empty folder left in /dev/shm (one with a kernel's images in it stays)
                except OSError:
                    pass
        if self._shared is not None:
            self._shared.stop_beating()  # done: from now on other hosts may take its suspended kernels
        await self._settle_restarts()  # one restarted through REST meanwhile: jupyter_server shuts down next

    async def _settle_restarts(self) -> None:
        """Before jupyter_server shuts the kernels down: no kernel may be in the middle of a restart by Jupyter's
        restarter. jupyter_client's ``shutdown_kernel`` asks the kernel manager's ``ready`` future for its
        exception, which raises while a restart is in flight; the server's whole stop died there, and the
        process never exited (an attack: SIGTERM as the restarter starts a kernel that was killed). First, no
        kernel is restarted from now on: a stopping server starts none (its restarter stopped, and autorestart
        off, or the restart under way would start the restarter again as it ends). A restart under way is
        waited for (``RESTART_GRACE`` at most), so that the stop then treats the kernel as any other; one still
        not done is given up (its ``ready`` cancelled) and the shutdown ends the kernel as it finds it; should
        that restart launch its process after the shutdown, the process outlives this server, and its record
        has the next server adopt it."""
        km = self.serverapp.kernel_manager
        managers = {kernel_id: km.get_kernel(kernel_id) for kernel_id in km.list_kernel_ids()}
        for manager in managers.values():
            try:
                manager.stop_restarter()  # first: it does nothing once autorestart is off
                manager.autorestart = False
            except Exception as exc:  # noqa: BLE001 - a kernel manager of another kind: its own business
                self.log.debug("gpumigrate: stopping: could not stop a kernel's restarter: %s", exc)

        def starting() -> dict[str, asyncio.Future]:  # a restart is a shutdown, then a start: a future for each
            return {kernel_id: manager.ready for kernel_id, manager in managers.items()
                    if isinstance(getattr(manager, "_ready", None), asyncio.Future) and not manager.ready.done()}

        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTART_GRACE
        if waiting := starting():
            self.log.info("gpumigrate: stopping: waiting for %d kernel(s) that Jupyter is restarting or shutting "
                          "down (%s; at most %.0f s)", len(waiting), ", ".join(waiting), RESTART_GRACE)
        while waiting and loop.time() < deadline:
            await asyncio.wait(list(waiting.values()), timeout=deadline - loop.time())
            waiting = starting()
        for kernel_id, ready in waiting.items():
            ready.cancel()
            self.log.warning("gpumigrate: stopping: kernel %s was still being restarted or shut down after %.0f s: "
                             "the stop goes on without waiting for it", kernel_id, RESTART_GRACE)

    async def _leave_remote_kernels(self, operations: OperationManager) -> None:
        """The stop policy 'suspend': each kernel that runs on a peer is suspended there, in parallel, within
        ``stop_timeout`` (the peer keeps its images, as for a way home: its GPU and memory are freed), and the
        next server has the peer resume it and relays to it again (revive.py). One the peer did not suspend in
        time runs on there (or is suspended there later), and the next server relays to it the same. Those an
        operation still moves are shut down with the others."""
        km = self.serverapp.kernel_manager
        remote = [(kernel_id, provisioner) for kernel_id in km.list_kernel_ids()
                  if isinstance(provisioner := getattr(km.get_kernel(kernel_id), "provisioner", None),
                                MigratableProvisioner)
                  and provisioner.state == "remote" and kernel_id not in operations.active]

        async def suspend_there(kernel_id: str, provisioner: MigratableProvisioner) -> None:
            host = provisioner.remote_host
            try:
                await asyncio.to_thread(provisioner.remote_link.dump, None, self.stop_timeout)
                self.log.info("gpumigrate: stopping: kernel %s suspended at %s, for the next server", kernel_id,
                              host)
            except Exception as exc:  # noqa: BLE001  whatever the answer, the kernel stays there
                self.log.warning("gpumigrate: stopping: kernel %s could not be suspended at %s (%s): it is left "
                                 "there for the next server", kernel_id, host, exc)
            finally:
                await provisioner.leave_remote()

        if remote:
            self.log.info("gpumigrate: stopping: suspending %d kernel(s) on other hosts there", len(remote))
            await asyncio.gather(*(suspend_there(kernel_id, provisioner) for kernel_id, provisioner in remote))

    async def _images_to_disk(self) -> None:
        """Suspended kernels kept for the next server with their images in memory: those go to disk, which
        outlives a reboot, in parallel, within ``stop_timeout`` (crash-safe: images.ImageStore.to_disk; what
        is not done by then stays in memory, and the next server on this host takes it back from there)."""
        km = self.serverapp.kernel_manager
        operations: OperationManager = self.settings["gpumigrate_operations"]
        deadline = time.monotonic() + self.stop_timeout
        while operations.moving_images and time.monotonic() < deadline:  # a move because memory ran short
            await asyncio.sleep(0.1)
        moves: dict[str, Any] = {}
        for kernel_id in km.list_kernel_ids():
            provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
            if isinstance(provisioner, MigratableProvisioner) and provisioner.keeps_whole_images():
                store = provisioner.images
                if store.where(kernel_id) == "memory":
                    moves[kernel_id] = asyncio.ensure_future(asyncio.to_thread(store.to_disk, kernel_id))
        # And the dumps this host keeps for its peers' kernels (a way home not over yet, a peer's stop policy):
        # there, they may be the kernel's only copy.
        guests: GuestHost | None = self.settings.get("gpumigrate_guests")
        for kernel_id, guest in list(guests.guests.items()) if guests is not None else []:
            if guest.state == SUSPENDED and kernel_id not in guests.dumping and \
                    guests.store.where(kernel_id) == "memory":
                moves[kernel_id] = asyncio.ensure_future(asyncio.to_thread(guests.store.to_disk, kernel_id))
        if not moves:
            return
        self.log.info("gpumigrate: stopping: moving the images of %d suspended kernel(s) from memory to disk",
                      len(moves))
        started = time.monotonic()
        await asyncio.wait(moves.values(), timeout=self.stop_timeout)
        for kernel_id, move in moves.items():
            if not move.done():
                self.log.warning("gpumigrate: stopping: kernel %s: its images are still being moved to disk after "
                                 "%.0f s; the server exits once that is done. Killed before, it leaves them in "
                                 "memory (lost if the host restarts), and the next start takes them from there",
                                 kernel_id, self.stop_timeout)
            elif move.exception() is not None:
                self.log.error("gpumigrate: stopping: kernel %s: its images stay in memory (lost if the host "
                               "restarts): %s", kernel_id, move.exception())
            else:
                self.log.info("gpumigrate: kernel %s: its images moved from memory to %s in %.1f s", kernel_id,
                              move.result(), time.monotonic() - started)

    def _disk_was_full(self, op: Operation) -> bool:
        """Whether ``op`` failed because the disk of the kernel's images was full (not its memory folder)."""
        provisioner = getattr(self.serverapp.kernel_manager.get_kernel(op.kernel_id), "provisioner", None) \
            if op.kernel_id in self.serverapp.kernel_manager else None
        memory = provisioner.images.memory_root if isinstance(provisioner, MigratableProvisioner) else None
        return op.no_room is not None and (memory is None or not Path(op.no_room).is_relative_to(memory))

    def _suspend_to_memory(self, operations: OperationManager, failed: Operation) -> Operation:
        """The stop's suspend of a kernel whose disk was full, again, with its images in memory where there is
        room, rather than the kernel being shut down with all it held: the move to disk as the server stops
        then fails too and leaves them in memory, where the next start on this host takes them back (lost only
        if the host restarts meanwhile). ``failed`` itself where that cannot start."""
        try:
            again = operations.start(failed.kernel_id, "suspend", images="memory", for_stop=True)
        except MigrateError as exc:
            self.log.warning("gpumigrate: stopping: kernel %s: its disk is full, and its images cannot go to memory "
                             "either (%s)", failed.kernel_id, exc)
            return failed
        self.log.warning("gpumigrate: stopping: kernel %s: its disk is full (%s); suspending it to memory instead",
                         failed.kernel_id, failed.error)
        return again

    def _images_of(self, kernel_id: str) -> list[Path]:
        """Where the kernel's images may be written: on disk and in memory (a suspend 'auto' whose memory filled
        goes on to disk: a stop's cancel must reach that one too)."""
        km = self.serverapp.kernel_manager
        provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None) if kernel_id in km else None
        store = provisioner.images if isinstance(provisioner, MigratableProvisioner) else None
        return store.places(kernel_id) if store is not None else []

    async def _suspend_all(self, operations: OperationManager) -> None:
        """The stop policy 'suspend': every running kernel, in parallel, within ``stop_timeout``."""
        km = self.serverapp.kernel_manager
        started = []
        for kernel_id in km.list_kernel_ids():
            provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
            if not isinstance(provisioner, MigratableProvisioner) or provisioner.state != "running":
                continue
            if kernel_id in operations.active:
                continue  # an operation of its own is under way; wait_idle waits for it
            try:
                started.append(operations.start(kernel_id, "suspend", for_stop=True))
            except MigrateError as exc:
                self.log.warning("gpumigrate: stopping: kernel %s cannot be suspended (%s): it is shut down",
                                 kernel_id, exc)
        if not started:
            return
        self.log.info("gpumigrate: stopping: suspending %d kernel(s) (at most %.0f s)", len(started),
                      self.stop_timeout)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.stop_timeout
        retried: set[str] = set()
        while loop.time() < deadline:
            for i, op in enumerate(started):  # as soon as each fails
                if op.done and op.status == "failed" and op.kernel_id not in retried and self._disk_was_full(op):
                    retried.add(op.kernel_id)
                    started[i] = self._suspend_to_memory(operations, op)
            if all(op.done for op in started):
                break
            await operations.wait_any_change(max(0.0, min(1.0, deadline - loop.time())))
        late = [op for op in started if not op.done]
        if late:
            # Their CRIU runs stopped, their dumps give the kernels back (each plan rolls back); then they are
            # shut down with the others. (Through the node helper, CRIU is the helper's: it runs to its end.)
            stopped = criu_mod.stop_runs([folder for op in late for folder in self._images_of(op.kernel_id)])
            self.log.warning("gpumigrate: stopping: %d kernel(s) not suspended within %.0f s (%s): they are shut "
                             "down (stopped %d CRIU run(s))", len(late), self.stop_timeout,
                             ", ".join(op.kernel_id for op in late), stopped)

        for op in started:
            if op.done and op.status != "succeeded":
                self.log.warning("gpumigrate: stopping: kernel %s could not be suspended: %s. It is shut down.",
                                 op.kernel_id, op.error)
