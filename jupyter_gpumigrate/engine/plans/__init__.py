"""The plans of a migration, one per module, each with its table of steps first.

``PHASES`` maps each plan to the phases it may run, in order (a phase that does not apply, such as
the GPU phases of a CPU kernel, is skipped), read off the plans' own tables. The operation record
carries its plan's list as ``phases``; the event schema, the panel, the widget and the CLI take it
from there.
"""

from __future__ import annotations

from . import back, gpu_move, host_move, host_transplant, resume, suspend, transplant

#: plan name -> its phases, in order
PHASES: dict[str, tuple[str, ...]] = {
    saga.name: saga.phases
    for saga in (suspend.saga(), resume.saga(), gpu_move.saga(), host_move.away(), host_move.home(),
                  transplant.saga(), host_transplant.saga(), back.saga())
}

#: every phase name any plan may report, in a stable order (for the event schema's enum)
ALL_PHASES: tuple[str, ...] = tuple(dict.fromkeys(p for phases in PHASES.values() for p in phases))
