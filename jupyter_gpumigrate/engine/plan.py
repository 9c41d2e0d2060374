"""Plans: an ordered list of phases, each with its undo.

A plan runs its phases in order. When a phase raises, the undos of the phases that completed run in
reverse order, so the world goes back to how it was before the plan started, and the error is raised
again as :class:`PhaseFailed`, naming the phase. Each phase's wall time is recorded.

The phases of a migration (``migration.py``) are built on this; nothing here knows about kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import PhaseFailed

log = logging.getLogger(__name__)

#: The phase names, in the order they can appear in a migration.
PHASES = ("prepare", "stash", "lock", "checkpoint", "dump", "transfer", "restore", "remap", "unlock", "unstash",
          "verify", "adopt")

Step = Callable[[], None]


@dataclass
class Phase:
    """One step of a plan. ``undo`` runs only if this phase completed and a later one failed.

    ``when``, if given, is asked as the phase comes up: a phase that does not apply (the GPU phases of
    a CPU kernel, known only once ``prepare`` ran) is skipped, neither timed nor reported.
    """

    name: str
    do: Step
    undo: Step | None = None
    when: Callable[[], bool] | None = None


@dataclass
class PlanResult:
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.timings.values())

    @property
    def slowest(self) -> str | None:
        return max(self.timings, key=self.timings.__getitem__) if self.timings else None


ProgressCallback = Callable[[str, str, dict[str, float]], None]
"""Called as ``progress(phase, event, timings)`` with event ``start``, ``done``, ``undo`` or ``failed``."""


class Plan:
    def __init__(self, phases: list[Phase], progress: ProgressCallback | None = None) -> None:
        self.phases = phases
        self.progress = progress or (lambda phase, event, timings: None)
        self.result = PlanResult()

    def run(self) -> PlanResult:
        done: list[Phase] = []
        for phase in self.phases:
            if phase.when is not None and not phase.when():
                continue
            self.progress(phase.name, "start", self.result.timings)
            started = time.perf_counter()
            try:
                phase.do()
            except BaseException as exc:  # everything must roll back, KeyboardInterrupt too
                self.result.timings[phase.name] = time.perf_counter() - started
                self.progress(phase.name, "failed", self.result.timings)
                undo_errors = self._roll_back(done)
                raise PhaseFailed(phase.name, exc, rolled_back=not undo_errors, undo_errors=undo_errors) from exc
            self.result.timings[phase.name] = time.perf_counter() - started
            self.progress(phase.name, "done", self.result.timings)
            done.append(phase)
        return self.result

    def _roll_back(self, done: list[Phase]) -> list[str]:
        errors: list[str] = []
        for phase in reversed(done):
            if phase.undo is None:
                continue
            self.progress(phase.name, "undo", self.result.timings)
            try:
                phase.undo()
            except Exception as exc:  # keep undoing the rest, report all
                log.exception("undo of phase %s failed", phase.name)
                errors.append(f"undo of {phase.name}: {exc}")
        return errors
