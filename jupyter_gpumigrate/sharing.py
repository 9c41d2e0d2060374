"""Suspended kernels on storage shared by several hosts (c.MigratableProvisioner.shared_dir).

Each server keeps its kernels' images in its own folder of the shared one and beats there, from a thread of
its own, from before it takes back its own kernels (revive.py) until it has finished stopping
(engine/shared.py). Every ``c.GPUMigrateApp.shared_heartbeat`` seconds, it:

- drops from its list each of its suspended kernels whose folder another host has taken (nothing deleted:
  the images are that host's now);
- takes the suspended kernels of every host whose heartbeat is stale (its server stopped or died): for each,
  a pre-flight (a GPU of the model it ran on, its PIDs and ports free here), then the atomic claim, then the
  same take-back as at start, under its own id and with its sessions. A kernel that cannot be registered
  after all is given back to its host's folder, and said so; nothing is ever deleted on another's behalf.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from .engine import gpus as gpus_mod
from .engine import placement
from .engine.errors import MigrateError
from .engine.hostfit import Requirements, problems
from .engine.images import ImageStore, Manifest
from .engine.kernelproc import SUSPENDED
from .engine.shared import Beating, ClaimLost, SharedFolder
from .provisioner import MigratableProvisioner
from .revive import Found, refused, take_back_images

log = logging.getLogger(__name__)

PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")


def cannot_take(manifest: Manifest) -> str:
    """Why this host cannot bring back the kernel of ``manifest`` now ('' if it can): a GPU of its model
    (engine/placement.py), its PIDs and ports free (engine/hostfit.py)."""
    models = sorted({str(g.get("name")) for g in manifest.gpus if g.get("name")})
    if models:
        here = gpus_mod.snapshot()
        if not placement.same_model(here, models[0]):
            have = ", ".join(sorted({g.name for g in here})) or "none"
            return f"it ran on a {models[0]} and needs a GPU of that model; this host has: {have}"
    info = manifest.connection_info
    address = str(info.get("ip") or "127.0.0.1")
    listens = [(address, int(info[p])) for p in PORTS if isinstance(info.get(p), int) and info[p] > 0]
    found = problems(Requirements(ids=list(manifest.ids), listens=listens))
    return "; ".join(found)


class Sharing:
    """What one server does with the shared folder, tick after tick."""

    def __init__(self, serverapp: Any, operations: Any, shared: SharedFolder, interval: float) -> None:
        self.serverapp = serverapp
        self.operations = operations
        self.shared = shared
        self.interval = interval
        #: (host, kernel) -> the last reason said for not taking it, so that it is logged once
        self._said: dict[tuple[str, str], str] = {}
        #: kernels claimed, then given back because this server could not register them: not tried again
        self._given_back: set[tuple[str, str]] = set()

    def start_beating(self) -> None:
        """Beat now (before anything is taken back: no other host takes this one's kernels meanwhile), then
        from a thread of its own until :meth:`stop_beating`."""
        self.shared.beat(self.interval)
        self.beating = Beating(self.shared, self.interval, self._beat_failed)
        self.beating.start()

    def stop_beating(self) -> None:
        if self.beating is not None:
            self.beating.stop()

    beating: Beating | None = None

    def _beat_failed(self, exc: OSError) -> None:
        self._once(("", "beat"), f"cannot beat in the shared folder ({exc}): other hosts may take this host's "
                   "suspended kernels once its heartbeat looks stopped")

    def _once(self, key: tuple[str, str], said: str) -> None:
        if self._said.get(key) != said:
            self._said[key] = said
            log.warning("gpumigrate: %s", said)

    async def tick(self) -> list[Found]:
        await self.drop_taken()
        return await self.take_from_stopped_hosts()

    async def drop_taken(self) -> list[str]:
        """Drop this server's suspended kernels whose images another host took; their ids."""
        km = self.serverapp.kernel_manager
        dropped = []
        for kernel_id in list(km.list_kernel_ids()):
            provisioner = getattr(km.get_kernel(kernel_id), "provisioner", None)
            if (not isinstance(provisioner, MigratableProvisioner) or provisioner.state != SUSPENDED
                    or kernel_id in self.operations.active or provisioner.images.path_for(kernel_id).is_dir()):
                continue
            holder = await asyncio.to_thread(self.shared.where, kernel_id)
            if holder is None or holder == self.shared.host:
                continue  # gone from every host's folder (an unmounted share?): not taken by anyone; listed on
            provisioner.given_away = True
            log.warning("gpumigrate: kernel %s was taken by %s from the shared folder: it is no longer listed here",
                        kernel_id, f"host {holder}")
            await km.shutdown_kernel(kernel_id, now=True)
            dropped.append(kernel_id)
        return dropped

    async def take_from_stopped_hosts(self) -> list[Found]:
        """Take the suspended kernels of the hosts whose server does not run (see the module's story)."""
        km = self.serverapp.kernel_manager
        store: ImageStore = MigratableProvisioner(config=self.serverapp.config).images
        found: list[Found] = []
        def unreadable(host: str, exc: OSError) -> None:
            self._once((host, ""), f"the shared folder of host {host} cannot be read ({exc}): its kernels are not "
                       "taken; the other hosts' are")

        for candidate in await asyncio.to_thread(self.shared.candidates, unreadable):
            key = (candidate.host, candidate.kernel_id)
            if candidate.kernel_id in km or key in self._given_back:
                continue
            try:
                manifest = ImageStore(self.shared.images_root(candidate.host)).read_manifest(candidate.kernel_id)
                why_not = await asyncio.to_thread(cannot_take, manifest)
            except MigrateError as exc:
                if not candidate.folder.is_dir():  # claimed by another host since it was listed: as a lost claim
                    winner = await asyncio.to_thread(self.shared.where, candidate.kernel_id)
                    log.info("gpumigrate: kernel %s of host %s (stopped): %s", candidate.kernel_id, candidate.host,
                             f"host {winner} took it first" if winner else "its images are gone from the shared folder")
                    continue
                why_not = str(exc)
            if why_not:
                if self._said.get(key) != why_not:
                    self._said[key] = why_not
                    log.warning("gpumigrate: not taking kernel %s of host %s (stopped) from the shared folder: %s",
                                candidate.kernel_id, candidate.host, why_not)
                continue
            try:
                await asyncio.to_thread(self.shared.claim, candidate.host, candidate.kernel_id)
            except ClaimLost as exc:
                log.info("gpumigrate: %s", exc)
                continue
            except MigrateError as exc:  # a rename that cannot work (another file system, read-only...): the next
                self._once(key, str(exc))
                continue
            try:
                result = await take_back_images(self.serverapp, store, candidate.kernel_id)
            except Exception as exc:  # noqa: BLE001  given back below, whatever it was
                log.exception("gpumigrate: could not take kernel %s of host %s", candidate.kernel_id, candidate.host)
                result = refused(candidate.kernel_id, store.path_for(candidate.kernel_id), str(exc) or type(exc).__name__)
            if result.outcome in ("suspended", "running"):
                log.warning("gpumigrate: took kernel %s of host %s, whose server has stopped, from the shared folder: "
                            "it is %s here", candidate.kernel_id, candidate.host, result.outcome)
                found.append(result)
                continue
            self._given_back.add(key)
            try:
                back = await asyncio.to_thread(self.shared.give_back, candidate.host, candidate.kernel_id)
            except OSError as exc:
                log.error("gpumigrate: kernel %s of host %s could not be taken (%s), nor given back (%s): its images "
                          "stay in %s", candidate.kernel_id, candidate.host, result.reason, exc,
                          store.path_for(candidate.kernel_id))
                found.append(result)
                continue
            log.error("gpumigrate: kernel %s of host %s could not be taken here (%s): its images are back in %s",
                      candidate.kernel_id, candidate.host, result.reason, back)
        return found

    async def run(self, refused_list: list[Found]) -> None:
        """Tick every ``interval`` seconds until cancelled (the server stops)."""
        while True:
            try:
                refused_list.extend(f for f in await self.tick() if f.outcome == "refused")
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001  the next tick tries again
                log.exception("gpumigrate: the shared folder's tick failed")
            await asyncio.sleep(self.interval)
