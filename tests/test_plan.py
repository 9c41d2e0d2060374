"""Plans run their phases in order and undo the completed ones, in reverse, when one fails."""

from __future__ import annotations

import pytest

from jupyter_gpumigrate.engine.errors import PhaseFailed
from jupyter_gpumigrate.engine.plan import Phase, Plan


def recorder(log: list[str], name: str, fail: bool = False):
    def step() -> None:
        log.append(name)
        if fail:
            raise RuntimeError(f"{name} broke")

    return step


def test_phases_run_in_order_and_are_timed():
    log: list[str] = []
    events: list[tuple[str, str]] = []
    plan = Plan(
        [Phase(n, recorder(log, n), recorder(log, "undo " + n)) for n in ("prepare", "dump", "adopt")],
        progress=lambda phase, event, timings: events.append((phase, event)),
    )
    result = plan.run()
    assert log == ["prepare", "dump", "adopt"]
    assert list(result.timings) == ["prepare", "dump", "adopt"] and result.total >= 0
    assert events == [(p, e) for p in ("prepare", "dump", "adopt") for e in ("start", "done")]
    assert result.slowest in result.timings


def test_a_failure_undoes_completed_phases_in_reverse():
    log: list[str] = []
    events: list[tuple[str, str]] = []
    plan = Plan(
        [
            Phase("prepare", recorder(log, "prepare"), recorder(log, "undo prepare")),
            Phase("lock", recorder(log, "lock"), None),
            Phase("checkpoint", recorder(log, "checkpoint"), recorder(log, "undo checkpoint")),
            Phase("dump", recorder(log, "dump", fail=True), recorder(log, "undo dump")),
            Phase("adopt", recorder(log, "adopt"), recorder(log, "undo adopt")),
        ],
        progress=lambda phase, event, timings: events.append((phase, event)),
    )
    with pytest.raises(PhaseFailed) as info:
        plan.run()
    assert log == ["prepare", "lock", "checkpoint", "dump", "undo checkpoint", "undo prepare"]
    assert info.value.phase == "dump" and info.value.rolled_back
    assert str(info.value) == "dump broke" and isinstance(info.value.cause, RuntimeError)
    assert ("dump", "failed") in events and events[-1] == ("prepare", "undo")


def test_a_failing_undo_is_reported_and_the_others_still_run():
    log: list[str] = []
    plan = Plan(
        [
            Phase("prepare", recorder(log, "prepare"), recorder(log, "undo prepare")),
            Phase("checkpoint", recorder(log, "checkpoint"), recorder(log, "undo checkpoint", fail=True)),
            Phase("restore", recorder(log, "restore", fail=True)),
        ]
    )
    with pytest.raises(PhaseFailed) as info:
        plan.run()
    assert log[-2:] == ["undo checkpoint", "undo prepare"]
    assert not info.value.rolled_back
    assert "Rolling back also failed: undo of checkpoint: undo checkpoint broke" in str(info.value)
