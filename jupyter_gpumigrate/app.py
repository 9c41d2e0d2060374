"""The jupyter_server extension: REST API under /api/gpumigrate, events, and the default provisioner."""

from __future__ import annotations

from typing import Any

from jupyter_client.provisioning import KernelProvisionerFactory
from jupyter_server.extension.application import ExtensionApp
from tornado.ioloop import PeriodicCallback
from traitlets import Bool, Unicode

from .credentials import KernelCredentials
from .engine import proctree
from .handlers import handlers
from .operations import EVENT_SCHEMA, EVENT_SCHEMA_ID, OperationManager
from .provisioner import PROVISIONER_NAME, MigratableProvisioner


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

    def initialize_settings(self) -> None:
        factory = KernelProvisionerFactory.instance(parent=self.serverapp.kernel_manager)
        if self.default_provisioner:
            factory.default_provisioner_name = PROVISIONER_NAME
        else:
            # The factory is one per process: say explicitly that this server's configuration decides.
            configured = self.serverapp.config.get("KernelProvisionerFactory", {})
            factory.default_provisioner_name = configured.get("default_provisioner_name", "local-provisioner")
        # Each kernel gets a credential for itself (credentials.py); the provisioner finds this object
        # on its kernel manager's parent, the server's multi-kernel manager.
        credentials = KernelCredentials(lambda: self.serverapp.connection_url)
        self.serverapp.kernel_manager.gpumigrate_credentials = credentials
        self.settings["gpumigrate_credentials"] = credentials
        event_logger = self.serverapp.event_logger
        event_logger.register_event_schema(EVENT_SCHEMA)
        operations = OperationManager(
            self.serverapp.kernel_manager,
            emit=lambda data: event_logger.emit(schema_id=EVENT_SCHEMA_ID, data=data),
            criu_path=self.criu_path or None,
        )
        self.settings["gpumigrate_operations"] = operations
        self._keep_culler_off_moving_kernels()
        if proctree.become_subreaper():
            # Restored kernels are now our children: reap them, and their orphans, as they exit.
            self._reaper = PeriodicCallback(self._reap_kernel_orphans, 2000)
            self._reaper.start()
        else:
            self.log.warning("gpumigrate: could not become a child subreaper: a kernel restored once may "
                             "not resume a second time if PID 1 does not reap it")

    def _reap_kernel_orphans(self) -> None:
        km = self.serverapp.kernel_manager
        sessions, skip = set(), set()
        for kernel_id in km.list_kernel_ids():
            provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
            if isinstance(provisioner, MigratableProvisioner) and provisioner.pgid:
                sessions.add(provisioner.pgid)  # kernels start in a session of their own
                if provisioner.process is not None:
                    skip.add(provisioner.process.pid)  # its Popen reaps it
        if sessions:
            proctree.reap_orphans(sessions, skip)

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

    def initialize_handlers(self) -> None:
        self.handlers.extend(handlers())

    async def stop_extension(self) -> None:
        await self.settings["gpumigrate_operations"].wait_idle()
