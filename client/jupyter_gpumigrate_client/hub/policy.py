"""The idle policy: suspend kernels idle for longer than N minutes instead of culling them.

Their GPUs and memory are freed (their images go to disk unless ``images`` says otherwise), their state is
kept on the node, and the user resumes them
from the panel, the CLI, the REST API, or by running a cell. Each suspension is logged with its reason
(each kernel kept, at debug level), servers that could not be read are logged as warnings, and each
round ends with one summary line.

Opt-in (``to_cpu``): an idle GPU kernel is transplanted to the CPU instead, where its dry run names
nothing that would not carry: its GPU is freed and the notebook goes on answering, on the CPU, with every
object; the user can go back to the process as it was (``%migrate --back``, for as long as the server
keeps it). A kernel that would lose an object is suspended, as without the option, and the decision
says why.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..apiclient import kernel_path
from ..contract import ContractError, validate
from .servers import ServerError, Servers, UserServer

log = logging.getLogger("jupyter_gpumigrate_client.hub.policy")


def _parse_time(value: str) -> datetime:
    when = datetime.fromisoformat(value)
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def last_operations(operations: Any) -> dict[str, datetime]:
    """Kernel id -> when its latest operation finished (or started, if it has not finished), from a
    server's ``GET /api/gpumigrate/operations``."""
    last: dict[str, datetime] = {}
    for op in operations if isinstance(operations, list) else []:
        if not isinstance(op, dict) or not isinstance(op.get("kernel_id"), str):
            continue
        stamp = op.get("finished") or op.get("created")
        if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
            continue
        try:
            when = datetime.fromtimestamp(stamp, timezone.utc)
        except (OverflowError, ValueError, OSError):  # 1e300, NaN: its user controls the server
            continue
        if op["kernel_id"] not in last or when > last[op["kernel_id"]]:
            last[op["kernel_id"]] = when
    return last


@dataclass
class IdlePolicy:
    #: suspend a kernel idle for longer than this
    minutes: float
    #: only kernels that hold a GPU (the default): a CPU kernel frees little when suspended
    gpu_only: bool = True
    #: leave a kernel alone for this long after its last operation (a resume, a move), so that a kernel
    #: just resumed, from the panel for example, is not suspended again at once; None: ``minutes``
    grace_minutes: float | None = None
    #: where its suspends put the images: disk (the default: the policy frees the node's memory too, and an
    #: idle kernel may stay suspended for days), memory, or auto (each server's choice)
    images: str = "disk"
    #: transplant an idle GPU kernel to the CPU instead of suspending it, where every object of it carries
    to_cpu: bool = False
    #: kernels this policy sent to the CPU: one that holds a GPU again (its transplant failed, or its user went
    #: back) is suspended the next time, not transplanted again
    _sent: set[str] = field(default_factory=set, repr=False, compare=False)
    #: nodes where this round started a transplant to the CPU (or is about to): one at a time per node, so
    #: that several users' kernels do not fill a node's memory at once (each checks room only for itself)
    _nodes: set[str] = field(default_factory=set, repr=False, compare=False)

    @property
    def grace(self) -> float:
        return self.minutes if self.grace_minutes is None else self.grace_minutes

    def decide(self, kernel: dict, now: datetime, last_operation: datetime | None = None) -> tuple[bool, str]:
        """(suspend it?, why) for one kernel as a user's server describes it (GET /api/gpumigrate/kernels),
        ``last_operation`` being when the kernel's latest operation ended, if it had one."""
        if kernel["state"] != "running" or not kernel.get("migratable", True):
            return False, f"it is {kernel['state']}" if kernel.get("migratable", True) else "it is not migratable"
        if kernel.get("remote"):
            return False, f"it runs on {kernel.get('host')}, another host"
        if kernel.get("operation"):
            return False, f"operation {kernel['operation']} is under way on it"
        if self.gpu_only and not kernel["gpus"]:
            return False, "it holds no GPU"
        # "starting" lasts until a client first talks to the kernel: one nobody used is idle too.
        if kernel.get("execution_state") not in ("idle", "starting"):
            return False, f"it is {kernel.get('execution_state') or 'not idle'}"
        last = kernel.get("last_activity")
        if not last:
            return False, "its last activity is unknown"
        idle = (now - _parse_time(last)).total_seconds() / 60
        if idle < self.minutes:
            return False, f"idle for {idle:.1f} min, under {self.minutes:g}"
        if last_operation is not None:
            since = (now - last_operation).total_seconds() / 60
            if since < self.grace:
                return False, (f"idle for {idle:.1f} min, but its last operation ended {since:.1f} min ago, "
                               f"within the grace period of {self.grace:g} min")
        return True, f"idle for {idle:.1f} min"

    async def run_once(self, servers: Servers) -> list[dict]:
        """Look at every user's kernels once; suspend those the policy picks. Returns the decisions."""
        now = datetime.now(timezone.utc)
        self._nodes.clear()
        listed = await servers.running()
        views = await servers.views(listed)
        unread = 0
        for server, view in zip(listed, views):
            if view["error"]:
                unread += 1
                log.warning("idle policy: skipping this round: %s", view["error"])
        gate = asyncio.Semaphore(servers.parallel)

        async def one(server: UserServer, view: dict) -> list[dict]:
            async with gate:
                return await self._server(servers, server, view, now)

        rounds = await asyncio.gather(*(one(s, v) for s, v in zip(listed, views) if not v["error"]))
        decisions = [d for found in rounds for d in found]
        acted = [d for d in decisions if d["suspend"] and "operation" in d]
        carried = sum(1 for d in acted if d.get("action") == "transplant")
        failed = sum(1 for d in decisions if d["suspend"] and "error" in d)
        waiting = sum(1 for d in decisions if d.get("action") == "wait")
        log.info("idle policy: %d kernel(s) on %d server(s): %d suspended, %d transplanted to the CPU, %d kept, %d "
                 "waiting for another transplant of their node, %d could not be suspended; %d server(s) could not "
                 "be read", len(decisions), len(listed) - unread, len(acted) - carried, carried,
                 len(decisions) - len(acted) - failed - waiting, waiting, failed, unread)
        return decisions

    async def _server(self, servers: Servers, server: UserServer, view: dict, now: datetime) -> list[dict]:
        decisions = []
        operations: dict[str, datetime] | None = None
        unreadable: str | None = None
        for kernel in view["kernels"]:
            try:
                suspend, why = self.decide(kernel, now)
                if suspend and self.grace > 0:
                    if operations is None and unreadable is None:  # asked only when some kernel is a candidate
                        try:
                            operations = last_operations(
                                await servers.call(server, "operations", timeout=servers.view_timeout))
                        except ServerError as exc:
                            unreadable = str(exc)
                            log.warning("idle policy: keeping the kernels of %s this round: its operations could "
                                        "not be read: %s", server.label, exc)
                    if operations is None:
                        suspend, why = False, f"{why}, but its server's operations could not be read ({unreadable})"
                    else:
                        suspend, why = self.decide(kernel, now, operations.get(kernel["id"]))
            except (KeyError, TypeError, ValueError) as exc:  # a server answering nonsense
                log.warning("idle policy: skipping a kernel that %s describes oddly: %r", server.label, exc)
                continue
            decision = {"user": server.user, "server": server.name, "kernel": kernel["id"], "suspend": suspend,
                        "reason": why}
            if suspend:
                action, reason = "suspend", why
                node = view.get("host") or server.url
                try:
                    if self.to_cpu and kernel["gpus"]:
                        action, reason = await self._cpu_or_suspend(servers, server, kernel, why, node)
                    if action == "wait":
                        decision.update(suspend=False, reason=reason, action="wait")
                        decisions.append(decision)
                        continue
                    body = {"to_cpu": True, "accept_left": []} if action == "transplant" else {"images": self.images}
                    # Refused if a cell started since this view. A dry run ran code in the kernel (silently),
                    # which its server counts as activity: then the kernel is read again, and left if busy.
                    body["idle_since"] = kernel["last_activity"]
                    if self.to_cpu and kernel["gpus"]:
                        fresh = await self._after_dry_run(servers, server, kernel["id"])
                        if fresh.get("execution_state") not in ("idle", "starting"):
                            if action == "transplant":
                                self._nodes.discard(node)
                            decision.update(suspend=False, reason=(
                                f"{why}, but it was {fresh.get('execution_state')} once its dry run was over"))
                            decisions.append(decision)
                            continue
                        body["idle_since"] = fresh.get("last_activity") or kernel["last_activity"]
                    try:
                        op = await servers.call(server, kernel_path(kernel["id"], action), "POST", body)
                    except ServerError as exc:
                        if exc.status != 400 or "Unknown field(s) idle_since" not in str(exc):
                            raise
                        # A server of an older version, which does not know the field: as before it had one.
                        del body["idle_since"]
                        op = await servers.call(server, kernel_path(kernel["id"], action), "POST", body)
                    decision.update(operation=op["id"], action=action, reason=reason)
                    if action == "transplant":
                        self._sent.add(kernel["id"])
                    log.info("idle policy: %s %s's kernel %s%s: %s", "transplanting to the CPU" if action ==
                             "transplant" else "suspending", server.user, kernel["id"], server.where, decision["reason"])
                except (ServerError, KeyError, TypeError, AttributeError) as exc:  # nonsense from a server
                    if action == "transplant":
                        self._nodes.discard(node)  # none started: the node's next kernel may go
                    decision.update(error=str(exc), action=action)
                    log.warning("idle policy: could not %s %s's kernel %s%s (%s): %s", action, server.user,
                                kernel["id"], server.where, why, exc)
            else:
                log.debug("idle policy: keeping %s's kernel %s%s: %s", server.user, kernel["id"], server.where, why)
            decisions.append(decision)
        return decisions

    @staticmethod
    async def _after_dry_run(servers: Servers, server: UserServer, kernel_id: str) -> dict:
        """The kernel's view once its dry run is over: the server hears the kernel idle again a moment after the
        dry run answers (its status comes on another channel), so a kernel still heard busy is read again, for
        a second at most."""
        for _ in range(5):
            fresh = await servers.call(server, f"kernels/{kernel_id}", timeout=servers.view_timeout)
            if not isinstance(fresh, dict):  # its user controls the server: nonsense leaves the kernel be
                raise ServerError(f"{server.label} did not answer with a kernel for {kernel_id}.")
            if fresh.get("execution_state") in ("idle", "starting"):
                break
            await asyncio.sleep(0.25)
        return fresh

    async def _cpu_or_suspend(self, servers: Servers, server: UserServer, kernel: dict, why: str,
                              node: str = "") -> tuple[str, str]:
        """("transplant", why) if the kernel's dry run to the CPU names nothing that would not carry (and
        ``node`` is then taken for this round), ("wait", why) if another kernel of ``node`` is being
        transplanted this round, else ("suspend", why and the reason)."""
        kernel_id = kernel["id"]
        if len(kernel["gpus"]) > 1:
            return "suspend", f"{why}; suspended, as a transplant takes a kernel on one GPU, and it holds several"
        if kernel_id in self._sent:
            return "suspend", (f"{why}; suspended, as it holds a GPU again since this policy sent it to the CPU (its "
                               "transplant failed, or its user went back)")
        if node in self._nodes:
            return "wait", (f"{why}; kept this round: another kernel of its node is being transplanted to the CPU "
                            "(one at a time per node, for the node's memory)")
        self._nodes.add(node)  # taken before the dry run's await: the servers of one node are asked in parallel
        action, reason = await self._dry_run(servers, server, kernel_id, why)
        if action != "transplant":
            self._nodes.discard(node)
        return action, reason

    @staticmethod
    async def _dry_run(servers: Servers, server: UserServer, kernel_id: str, why: str) -> tuple[str, str]:
        try:
            survey = await servers.call(server, kernel_path(kernel_id, "transplant"), "POST",
                                        {"to_cpu": True, "dry_run": True})
            validate("TransplantSurvey", survey, strict=False)  # its user controls the server: believed only then
        except (ServerError, ContractError) as exc:
            return "suspend", f"{why}; suspended, as its dry run to the CPU failed ({exc})"
        if survey["left"]:
            lost = ", ".join(f"{r['name']} ({r['reason']})" for r in survey["left"])
            return "suspend", f"{why}; suspended, as a transplant to the CPU would lose {lost}"
        if not survey["carries"]:
            return "suspend", f"{why}; suspended, as it holds nothing a transplant would carry"
        return "transplant", f"{why}; transplanted to the CPU, where every object of it carries"
