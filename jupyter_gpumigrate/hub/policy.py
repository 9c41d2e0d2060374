"""The idle policy: suspend kernels idle for longer than N minutes instead of culling them.

Their GPUs (and memory) are freed, their state is kept on disk, and the user resumes them from the
panel, the CLI or by asking the server. Every decision is logged, with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone

from .servers import ServerError, Servers, kernel_path

log = logging.getLogger("jupyter_gpumigrate.hub.policy")


@dataclass
class IdlePolicy:
    minutes: float
    gpu_only: bool = True

    def decide(self, kernel: dict, now: datetime) -> tuple[bool, str]:
        """(suspend it?, why) for one kernel as a user's server describes it."""
        if kernel["state"] != "running" or not kernel.get("migratable", True):
            return False, f"it is {kernel['state']}"
        if self.gpu_only and not kernel["gpus"]:
            return False, "it holds no GPU"
        # "starting" lasts until a client first talks to the kernel: one nobody used is idle too.
        if kernel.get("execution_state") not in ("idle", "starting"):
            return False, f"it is {kernel.get('execution_state') or 'not idle'}"
        last = kernel.get("last_activity")
        if not last:
            return False, "its last activity is unknown"
        idle = (now - datetime.fromisoformat(last)).total_seconds() / 60
        if idle < self.minutes:
            return False, f"idle for {idle:.1f} min, under {self.minutes:g}"
        return True, f"idle for {idle:.1f} min"

    async def run_once(self, servers: Servers) -> list[dict]:
        """Look at every user's kernels once; suspend those the policy picks. Returns the decisions."""
        decisions = []
        now = datetime.now(timezone.utc)
        for server in await servers.running():
            view = await servers.view(server)
            for kernel in view["kernels"]:
                try:
                    suspend, why = self.decide(kernel, now)
                except (KeyError, TypeError, ValueError) as exc:  # a server answering nonsense
                    log.warning("idle policy: skipping a kernel of %s that its server describes oddly: %r",
                                server.user, exc)
                    continue
                decision = {"user": server.user, "kernel": kernel["id"], "suspend": suspend, "reason": why}
                if suspend:
                    try:
                        op = await servers.call(server, kernel_path(kernel["id"], "suspend"), "POST")
                        decision["operation"] = op["id"]
                        log.info("idle policy: suspending %s's kernel %s: %s", server.user, kernel["id"], why)
                    except ServerError as exc:
                        decision["error"] = str(exc)
                        log.warning("idle policy: could not suspend %s's kernel %s (%s): %s",
                                    server.user, kernel["id"], why, exc)
                else:
                    log.debug("idle policy: keeping %s's kernel %s: %s", server.user, kernel["id"], why)
                decisions.append(decision)
        return decisions
