"""The saga runner: a plan of steps, each side effect followed by its undo, and the kernel's state.

A plan is a table of :class:`Step`. The runner runs its phases (steps of kind ``PHASE``) in order on
a :class:`Context` that the steps read and write. A step that changes the world registers the undo
of that change on the context *right after* making it (``ctx.undo(...)``), so a step that fails
halfway is undone as far as it got. When a phase raises, every registered undo runs, newest first,
and the error is raised again as :class:`PhaseFailed`, naming the phase.

The runner also owns the kernel's state, so no step writes it:

- at the start of the first phase it checks that the kernel is in one of the plan's ``start_from``
  states (refusing with the plan's sentence otherwise) and marks it ``migrating``;
- when every phase succeeded, the kernel is in the plan's ``success`` state;
- after a full rollback, it is in the state it had before the plan;
- when an undo fails, it is ``broken``, with a reason that names the phase's error and the undo's, and
  ends with the way out (the kernel's ``broken_remedy()`` where it has one, else a restart).

A plan may name phases before which it stops when its kernel is asked to stop (``stoppable``): the
kernel's ``stop_requested`` (a sentence, set by whoever shuts it down) is read before each phase, and a
plan asked to stop there is undone as a failure would be, with :class:`Stopped`. Those are the phases
before anything that is slow to undo (a transplant stops while its objects are written or read, not once
its source is saved). A long phase may ask too, in its loop (:meth:`Context.check_stop`). A plan that fails
while its kernel is asked to stop is undone whole, and then the kernel is shut down (or restarted): its error
says so instead of the failure's own words, which say the kernel runs on (or that its images are kept); the
failure is logged.

Steps of kind ``ON_SUCCESS`` run once every phase succeeded, steps of kind ``ALWAYS`` at the very
end whatever happened: they finish (delete what is stale, close what was opened) and are neither
timed nor reported as phases; what fails there is logged, never raised.

Nothing here knows about CRIU or CUDA; the kernel is anything with a ``state`` and ``broken_reason``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from .errors import InvalidState, PhaseFailed, Stopped, said

log = logging.getLogger(__name__)

#: A kernel's states (``KernelProcess.state``).
RUNNING, MIGRATING, SUSPENDED, STOPPED = "running", "migrating", "suspended", "stopped"
#: runs on another host; this host relays its channels there
REMOTE = "remote"
#: a rollback failed: the kernel may be locked, checkpointed or gone; ``broken_reason`` says what happened
BROKEN = "broken"

#: Kinds of step.
PHASE, ON_SUCCESS, ALWAYS = "phase", "on_success", "always"


class Stateful(Protocol):
    state: str
    broken_reason: str | None


C = TypeVar("C", bound="Context")


@dataclass
class Step(Generic[C]):
    """One row of a plan's table: ``do(ctx)``, run if ``when(ctx)`` (asked as the step comes up)."""

    name: str
    do: Callable[[C], None]
    when: Callable[[C], bool] | None = None
    kind: str = PHASE


@dataclass
class _Undo:
    phase: str
    do: Callable[[], None]
    cleanup: bool


class Context:
    """What the steps of one run read and write; each plan subclasses it with its own fields."""

    def __init__(self, kernel: Stateful) -> None:
        self.kernel = kernel
        self._undos: list[_Undo] = []
        self._phase = ""
        #: the phases of the running plan that a stop request ends (Saga.stoppable)
        self._stoppable: tuple[str, ...] = ()

    def check_stop(self) -> None:
        """Raise :class:`Stopped` if the kernel was asked to stop and the phase running may be stopped."""
        reason = getattr(self.kernel, "stop_requested", None)
        if reason and self._phase in self._stoppable:
            raise Stopped(f"Stopped, and undone, because {reason}.")

    def undo(self, do: Callable[[], None], cleanup: bool = False) -> None:
        """Register the undo of the side effect just made. ``cleanup``: its failure leaves litter (a
        folder), not a kernel in doubt, so it is logged and the kernel is not marked broken."""
        self._undos.append(_Undo(self._phase, do, cleanup))

    def forget_undos(self) -> None:
        """What was undoable is now the new truth (a step made it so on purpose): nothing to undo."""
        self._undos.clear()


@dataclass
class Result:
    """Each phase's wall time, in the order they ran."""

    timings: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.timings.values())

    @property
    def slowest(self) -> str | None:
        return max(self.timings, key=self.timings.__getitem__) if self.timings else None


ProgressCallback = Callable[[str, str, dict[str, float]], None]
"""Called as ``progress(phase, event, timings)`` with event ``start``, ``done``, ``undo`` or ``failed``."""


@dataclass
class Saga(Generic[C]):
    """A plan: its steps, the states it starts from, and the state it ends in when it succeeds."""

    name: str
    steps: list[Step[C]]
    start_from: tuple[str, ...]
    success: str
    #: the sentence for a kernel in a state the plan does not start from
    refuse: Callable[[str], str] = lambda state: f"The kernel is {state}: it cannot be migrated now."
    #: the phases before which (and, where they ask, during which) a stop request undoes the plan
    stoppable: tuple[str, ...] = ()
    #: what sentences call the plan; empty: its name, in words
    called: str = ""

    @property
    def phases(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.steps if s.kind == PHASE)

    def run(self, ctx: C, progress: ProgressCallback | None = None) -> Result:
        kernel, result = ctx.kernel, Result()
        initial: str | None = None
        ctx._stoppable = self.stoppable

        def report(phase: str, event: str, timings: dict[str, float]) -> None:
            if progress is not None:
                try:
                    progress(phase, event, timings)
                except Exception:  # a listener gone (the server's loop closed): the plan goes on
                    log.exception("%s: could not report %s %s", self.name, phase, event)

        try:
            for step in (s for s in self.steps if s.kind == PHASE):
                ctx._phase = step.name
                started = time.perf_counter()
                try:
                    if initial is not None:
                        ctx.check_stop()  # before a phase that may be skipped, too
                    if initial is not None and step.when is not None and not step.when(ctx):
                        continue
                    report(step.name, "start", result.timings)
                    started = time.perf_counter()
                    if initial is None:  # the first phase: the kernel is ours from here on
                        if kernel.state not in self.start_from:
                            raise InvalidState(self.refuse(kernel.state))
                        initial, kernel.state = kernel.state, MIGRATING
                    ctx.check_stop()
                    step.do(ctx)
                except BaseException as exc:  # everything must roll back, KeyboardInterrupt too
                    result.timings[step.name] = time.perf_counter() - started
                    report(step.name, "failed", result.timings)
                    failed_undos = self._roll_back(ctx, report, result)
                    broken = [text for text, cleanup in failed_undos if not cleanup]
                    # before the state is settled: whoever shuts the kernel down waits for that, then forgets why
                    stopping = getattr(kernel, "stop_requested", None)
                    self._settle(kernel, initial, step.name, exc, broken)
                    ended = ""
                    if stopping and initial is not None and not broken and not isinstance(exc, Stopped):
                        ended = self._stopped_meanwhile(kernel, step.name, exc, stopping)
                    raise PhaseFailed(step.name, exc, rolled_back=not broken,
                                      undo_errors=[text for text, _ in failed_undos], ended=ended) from exc
                result.timings[step.name] = time.perf_counter() - started
                report(step.name, "done", result.timings)
            kernel.state = self.success
            kernel.broken_reason = None  # whole again (a resume of a broken kernel's whole images)
            self._finish(ctx, ON_SUCCESS)
            return result
        finally:
            self._finish(ctx, ALWAYS)

    def _stopped_meanwhile(self, kernel: Stateful, phase: str, exc: BaseException, stopping: str) -> str:
        """The sentence for a plan that failed, and was undone whole, while its kernel was asked to stop
        (``stopping``: why): the kernel does not run on as the failure's words say, it is shut down next."""
        called = self.called or self.name.replace("_", " ").replace("gpu", "GPU")
        log.warning("kernel %s: the %s failed in %s (%s); it was undone, and %s", getattr(kernel, "kernel_id", "?"),
                    called, phase, said(exc), stopping)
        return (f"The {called} failed and was undone, and {stopping}, as asked while the {called} ran: nothing of "
                f"the kernel is kept (the server log says why the {called} failed).")

    @staticmethod
    def _settle(kernel: Stateful, initial: str | None, phase: str, exc: BaseException,
                undo_errors: list[str]) -> None:
        if initial is None:
            return  # refused before it started: the kernel was never ours
        if undo_errors:
            kernel.state = BROKEN
            remedy = getattr(kernel, "broken_remedy", None)  # the kernel knows what is left of it
            undone = "; ".join(undo_errors).rstrip(".")
            kernel.broken_reason = (f"{phase} failed ({said(exc)}), and undoing it failed "
                                    f"too: {undone}. {remedy() if callable(remedy) else 'Restart the kernel.'}")
        else:
            kernel.state = initial

    @staticmethod
    def _roll_back(ctx: Context, report: ProgressCallback, result: Result) -> list[tuple[str, bool]]:
        """Every registered undo, newest first; the (sentence, cleanup) of each that failed."""
        errors: list[tuple[str, bool]] = []
        announced: set[str] = set()
        while ctx._undos:
            undo = ctx._undos.pop()
            if undo.phase not in announced:
                announced.add(undo.phase)
                report(undo.phase, "undo", result.timings)
            try:
                undo.do()
            except Exception as exc:  # keep undoing the rest, report all
                log.exception("undo of phase %s failed", undo.phase)
                errors.append((f"undo of {undo.phase}: {said(exc)}", undo.cleanup))
        return errors

    def _finish(self, ctx: C, kind: str) -> None:
        for step in (s for s in self.steps if s.kind == kind):
            try:
                if step.when is None or step.when(ctx):
                    step.do(ctx)
            except Exception:
                log.exception("%s: %s failed (the kernel is as the plan left it)", self.name, step.name)
