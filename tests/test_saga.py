"""The saga runner: steps in order, undos registered after each side effect, the kernel's state in each outcome."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from jupyter_gpumigrate.engine.errors import PhaseFailed
from jupyter_gpumigrate.engine.plans import ALL_PHASES, PHASES
from jupyter_gpumigrate.engine.saga import ALWAYS, ON_SUCCESS, Context, Saga, Step


@dataclass
class Kernel:
    state: str = "running"
    broken_reason: str | None = None


class World(Context):
    """A context whose steps change a list, the world, and undo their changes."""

    def __init__(self, kernel: Kernel) -> None:
        super().__init__(kernel)
        self.world: list[str] = []
        self.log: list[str] = []
        self.states: list[str] = []


def change(*names: str, fail_after: int | None = None, undo_fails: str | None = None):
    """A step that makes the changes ``names`` one by one, registering each one's undo right after it;
    it raises after ``fail_after`` of them. The undo of ``undo_fails`` raises."""

    def step(ctx: World) -> None:
        ctx.states.append(ctx.kernel.state)
        for i, name in enumerate(names):
            if fail_after is not None and i == fail_after:
                raise RuntimeError(f"{name} broke")
            ctx.world.append(name)

            def undo(name: str = name) -> None:
                ctx.log.append(f"undo {name}")
                if name == undo_fails:
                    raise OSError(f"cannot undo {name}")
                ctx.world.remove(name)

            ctx.undo(undo)
        if fail_after is not None and fail_after >= len(names):
            raise RuntimeError("broke after its changes")

    return step


def saga(*steps: Step, success: str = "suspended") -> Saga:
    return Saga("test", list(steps), start_from=("running",), success=success,
                refuse=lambda state: f"The kernel is {state}, not running: it cannot be suspended.")


def run(plan: Saga, kernel: Kernel | None = None) -> tuple[World, list[tuple[str, str]]]:
    ctx = World(kernel or Kernel())
    events: list[tuple[str, str]] = []
    plan.run(ctx, lambda phase, event, timings: events.append((phase, event)))
    return ctx, events


def test_phases_run_in_order_are_timed_and_the_kernel_ends_in_the_plan_state():
    ctx = World(Kernel())
    events: list[tuple[str, str]] = []
    plan = saga(Step("prepare", change("folder")), Step("dump", change("images")),
                Step("skipped", change("never"), when=lambda ctx: False),
                Step("tidy", lambda ctx: ctx.log.append("tidy"), kind=ON_SUCCESS),
                Step("close", lambda ctx: ctx.log.append("close"), kind=ALWAYS))
    result = plan.run(ctx, lambda phase, event, timings: events.append((phase, event)))
    assert ctx.world == ["folder", "images"] and ctx.log == ["tidy", "close"]
    assert ctx.states == ["migrating", "migrating"], "migrating while the steps run"
    assert ctx.kernel.state == "suspended" and ctx.kernel.broken_reason is None
    assert list(result.timings) == ["prepare", "dump"] and result.slowest in result.timings
    assert events == [(p, e) for p in ("prepare", "dump") for e in ("start", "done")]
    assert plan.phases == ("prepare", "dump", "skipped")


def test_a_step_that_fails_after_its_side_effect_is_undone_too():
    plan = saga(Step("prepare", change("folder")),
                Step("dump", change("images", "manifest", fail_after=2)),  # both made, then it raised
                Step("adopt", change("adopted")),
                Step("tidy", lambda ctx: ctx.log.append("tidy"), kind=ON_SUCCESS),
                Step("close", lambda ctx: ctx.log.append("close"), kind=ALWAYS))
    ctx = World(Kernel())
    events: list[tuple[str, str]] = []
    with pytest.raises(PhaseFailed) as info:
        plan.run(ctx, lambda phase, event, timings: events.append((phase, event)))
    assert ctx.world == [], "every change undone, the failing step's own included"
    assert ctx.log == ["undo manifest", "undo images", "undo folder", "close"], "newest first; no tidy"
    assert info.value.phase == "dump" and info.value.rolled_back and not info.value.undo_errors
    assert str(info.value) == "broke after its changes" and isinstance(info.value.cause, RuntimeError)
    assert ctx.kernel.state == "running", "the state it had before the plan"
    assert ("dump", "failed") in events and events[-2:] == [("dump", "undo"), ("prepare", "undo")]
    assert ("adopt", "start") not in events


def test_a_step_that_fails_halfway_undoes_what_it_did_and_only_that():
    ctx = World(Kernel())
    with pytest.raises(PhaseFailed) as info:
        saga(Step("lock", change("process 1", "process 2", "process 3", fail_after=2))).run(ctx)
    assert ctx.log == ["undo process 2", "undo process 1"] and ctx.world == []
    assert info.value.phase == "lock" and ctx.kernel.state == "running"


def test_an_undo_that_fails_leaves_the_kernel_broken_with_both_errors_named():
    plan = saga(Step("prepare", change("folder")),
                Step("checkpoint", change("checkpointed", undo_fails="checkpointed")),
                Step("dump", change("images", fail_after=0)))
    ctx = World(Kernel())
    with pytest.raises(PhaseFailed) as info:
        plan.run(ctx)
    assert ctx.log == ["undo checkpointed", "undo folder"], "the other undos still run"
    assert ctx.world == ["checkpointed"]
    assert not info.value.rolled_back
    assert "Rolling back also failed: undo of checkpoint: cannot undo checkpointed" in str(info.value)
    assert ctx.kernel.state == "broken"
    reason = ctx.kernel.broken_reason or ""
    assert "images broke" in reason and "cannot undo checkpointed" in reason and "Restart the kernel" in reason


@dataclass
class KernelWithImages(Kernel):
    """A kernel that knows what is left of it: its way out ends a broken reason."""

    def broken_remedy(self) -> str:
        return f"Its images are whole: resume it (it was {self.state} when asked)."


def test_a_broken_kernels_reason_ends_with_its_own_way_out_and_a_plan_that_succeeds_clears_it():
    kernel = KernelWithImages()
    plan = saga(Step("checkpoint", change("checkpointed", undo_fails="checkpointed")),
                Step("dump", change("images", fail_after=0)))
    with pytest.raises(PhaseFailed):
        plan.run(World(kernel))
    reason = kernel.broken_reason or ""
    assert reason.endswith("Its images are whole: resume it (it was broken when asked).") and "Restart" not in reason
    resume = Saga("resume", [Step("restore", change("process"))], start_from=("suspended", "broken"),
                  success="running")
    resume.run(World(kernel))
    assert kernel.state == "running" and kernel.broken_reason is None


def test_a_cleanup_undo_that_fails_is_reported_but_does_not_break_the_kernel():
    def prepare(ctx: World) -> None:
        ctx.undo(lambda: (_ for _ in ()).throw(OSError("folder busy")), cleanup=True)

    ctx = World(Kernel())
    with pytest.raises(PhaseFailed) as info:
        saga(Step("prepare", prepare), Step("dump", change("images", fail_after=0))).run(ctx)
    assert info.value.rolled_back and "folder busy" in str(info.value)
    assert ctx.kernel.state == "running" and ctx.kernel.broken_reason is None


def test_a_kernel_in_another_state_is_refused_and_left_as_it_is():
    for state in ("suspended", "migrating", "broken"):
        kernel = Kernel(state=state)
        ctx = World(kernel)
        with pytest.raises(PhaseFailed) as info:
            saga(Step("prepare", change("folder"))).run(ctx)
        assert info.value.phase == "prepare" and ctx.world == []
        assert str(info.value) == f"The kernel is {state}, not running: it cannot be suspended."
        assert kernel.state == state


def test_keyboard_interrupt_rolls_back_too():
    def interrupted(ctx: World) -> None:
        raise KeyboardInterrupt

    ctx = World(Kernel())
    with pytest.raises(PhaseFailed):
        saga(Step("prepare", change("folder")), Step("dump", interrupted)).run(ctx)
    assert ctx.world == [] and ctx.kernel.state == "running"


def test_finishing_steps_never_raise():
    def fails(ctx: World) -> None:
        raise OSError("disk gone")

    ctx, _ = run(saga(Step("prepare", change("x")), Step("tidy", fails, kind=ON_SUCCESS),
                      Step("close", fails, kind=ALWAYS)))
    assert ctx.kernel.state == "suspended" and ctx.world == ["x"]


def test_every_plan_publishes_its_phases_from_its_own_table():
    assert PHASES["suspend"] == ("prepare", "stash", "lock", "checkpoint", "dump")
    assert PHASES["resume"] == ("prepare", "prefetch", "restore", "remap", "unlock", "unstash", "adopt")
    assert PHASES["move_to_gpu"] == ("prepare", "stash", "host stash", "lock", "checkpoint", "remap", "unlock", "unstash",
                                     "take back", "verify")
    assert PHASES["move_to_host"][-3:] == ("transfer", "restore", "adopt")
    assert PHASES["return_home"][:6] == ("prepare", "stream", "fetch stash", "dump", "prefetch", "transfer")
    assert set(ALL_PHASES) == {p for phases in PHASES.values() for p in phases}


def test_a_stop_request_undoes_the_plan_before_a_stoppable_phase_and_only_there():
    @dataclass
    class Stoppable(Kernel):
        stop_requested: str | None = None

    def ask_to_stop(ctx: World) -> None:
        ctx.kernel.stop_requested = "the kernel is being shut down"

    def stoppable(*steps: Step, phases: tuple[str, ...]) -> Saga:
        plan = saga(*steps)
        plan.stoppable = phases
        return plan

    # Asked during "write": "read" may be stopped before it, so the plan is undone there.
    kernel = Stoppable()
    plan = stoppable(Step("prepare", change("folder")), Step("write", lambda ctx: (change("objects")(ctx),
                                                                                    ask_to_stop(ctx))),
                     Step("read", change("copy")), phases=("read",))
    with pytest.raises(PhaseFailed) as info:
        run(plan, kernel)
    assert info.value.phase == "read" and "Stopped, and undone, because the kernel is being shut down" in str(
        info.value) and info.value.rolled_back
    assert kernel.state == "running"

    # Asked before a phase that may not be stopped: the plan goes on to its end.
    kernel = Stoppable()
    plan = stoppable(Step("prepare", change("folder")), Step("save", lambda ctx: ask_to_stop(ctx)),
                     Step("switch", change("new")), phases=("prepare",))
    ctx, _ = run(plan, kernel)
    assert ctx.world == ["folder", "new"] and kernel.state == "suspended"

    # Asked during a phase followed by a stoppable one that does not apply (skipped): stopped there all the same.
    kernel = Stoppable()
    plan = stoppable(Step("write", lambda ctx: (change("objects")(ctx), ask_to_stop(ctx))),
                     Step("stash", change("stash"), when=lambda ctx: False), Step("dump", change("images")),
                     phases=("stash",))
    with pytest.raises(PhaseFailed) as info:
        run(plan, kernel)
    assert info.value.phase == "stash" and kernel.state == "running"

    # A kernel without the attribute (a peer's guest) is never stopped.
    ctx, _ = run(stoppable(Step("a", change("x")), phases=("a",)))
    assert ctx.world == ["x"]

    # Asked during a phase that may not be stopped, which then fails: undone whole, and said to be shut down next,
    # not in the failure's words (which say the kernel runs on).
    def fails(ctx: World) -> None:
        ask_to_stop(ctx)
        raise RuntimeError("CRIU failed. The kernel runs on, unchanged.")

    kernel = Stoppable()
    with pytest.raises(PhaseFailed) as info:
        run(Saga("move_to_gpu", [Step("prepare", change("folder")), Step("dump", fails)], start_from=("running",),
                 success="running"), kernel)
    assert str(info.value) == ("The move to GPU failed and was undone, and the kernel is being shut down, as asked "
                               "while the move to GPU ran: nothing of the kernel is kept (the server log says why "
                               "the move to GPU failed)."), str(info.value)
    assert info.value.rolled_back and isinstance(info.value.cause, RuntimeError) and kernel.state == "running"


@pytest.mark.parametrize("code, filename, said", [
    (28, "/state/images/k/marker.json", "The disk of /state/images/k is full (No space left on device). Free space"),
    (122, None, "A disk is full (or your quota on it) (Disk quota exceeded). Free space"),
    (28, ("/dev/shm/source.img", "/state/images/k/pages-1.img"), "The disk of /state/images/k is full"),  # a copy's
])
def test_a_full_disk_no_step_foresaw_is_said_in_a_sentence_not_as_an_errno(code, filename, said):
    def write(ctx: World) -> None:
        ctx.world.append("half a file")
        ctx.undo(lambda: ctx.world.remove("half a file"))
        why = "No space left on device" if code == 28 else "Disk quota exceeded"
        raise OSError(code, why, *filename[:1], None, filename[1]) if isinstance(filename, tuple) else \
            OSError(code, why, filename)

    ctx = World(Kernel())
    with pytest.raises(PhaseFailed) as info:
        saga(Step("switch", write)).run(ctx, lambda phase, event, timings: None)
    assert str(info.value).startswith(said) and "Errno" not in str(info.value), str(info.value)
    assert ctx.world == [] and ctx.kernel.state == "running"
