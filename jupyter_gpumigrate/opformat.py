"""How operations and sizes are told to people: by the CLI, by ``%migrate`` and its widget, by the Hub.

Sizes are in powers of 1000 everywhere (as the panel shows them): ``74.2 MB``, ``8.6 GB``. An operation
is the record ``GET /api/gpumigrate/operations/{id}`` answers. Two voices tell a finished one: the
CLI's (:func:`report`: "Kernel 5f0c… moved from GPU 0 to GPU 1 in 1.38 s (…)") and the kernel's own
(:func:`describe`: "Moved from GPU 0 to GPU 1: 8.6 GB in 1.38 s …", for ``%migrate`` and the widget);
both read the same facts through the helpers here.
"""

from __future__ import annotations

import time
from typing import Any

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
_UNITS = ((TB, "TB"), (GB, "GB"), (MB, "MB"), (KB, "KB"))


def size(n: float | None) -> str:
    """Bytes for a person, in powers of 1000: ``512 B``, ``74.2 MB``, ``8.6 GB``; ``0 B`` for none."""
    if not n:
        return "0 B"
    for unit, name in _UNITS:
        # from where the unit below would round up to 1000 (999.95 MB is 1.0 GB; 999.5 B is 1.0 KB)
        if abs(n) >= unit * (0.9995 if unit == KB else 0.99995):
            return f"{n / unit:.1f} {name}"
    return f"{n:.0f} B"


def gb(n: float) -> str:
    """A number of GB, one decimal, without the unit (for ``used / total GB``)."""
    return f"{n / GB:.1f}"


def finished(op: dict) -> bool:
    return op.get("status") in ("succeeded", "failed")


def slowest(op: dict) -> tuple[str, float] | None:
    """The phase that took longest, and its seconds; None if no phase ran."""
    timings = op.get("timings") or {}
    if not timings:
        return None
    name = max(timings, key=timings.get)
    return name, timings[name]


def failed_in(op: dict) -> str | None:
    """The phase a failed operation failed in."""
    return op.get("failed_phase") or op.get("phase")


def failure(op: dict) -> str:
    """A failed operation's sentence and phase: ``CRIU could not dump … (phase dump)``."""
    return f"{op.get('error')} (phase {failed_in(op)})"


def progress(op: dict) -> tuple[int, int]:
    """(phases done, phases in its plan) from the operation's ``phases``; (0, 0) when it has none.

    A phase that does not apply (the GPU phases of a CPU kernel) is skipped: the count jumps over it.
    """
    phases = list(op.get("phases") or [])
    if not phases:
        return 0, 0
    if op.get("status") == "succeeded":
        return len(phases), len(phases)
    phase = op.get("phase")
    return (phases.index(phase) if phase in phases else 0), len(phases)


def _mid_cell(seconds: dict | None) -> str:
    """Where the kernel was busy: the running cell's safe point, reached after ``seconds["safe_point"]``."""
    reached = seconds.get("safe_point") if isinstance(seconds, dict) else None
    return f", at the running cell's safe point (reached in {reached:.2f} s)" if reached is not None else ""


def _fast_path(op: dict) -> dict[str, Any]:
    return op.get("fast_path") or {}


def _by(fast: dict) -> str:
    """How the large tensors went: over the peer link (the fast path) or through the host stash."""
    return "the host stash" if fast.get("via") == "host" else "the fast path"


def gpus_moved(op: dict) -> str:
    """``from GPU 0 to GPU 1``, or for a kernel on several GPUs ``from GPUs 0, 1 to GPUs 1, 0``."""
    if op.get("to_gpus") and op.get("from_gpus"):
        return (f"from GPUs {', '.join(str(i) for i in op['from_gpus'])} to GPUs "
                f"{', '.join(str(i) for i in op['to_gpus'])}")
    return f"from GPU {op.get('from_gpu')} to GPU {op.get('to_gpu')}"


def gpus_onto(op: dict) -> str:
    """`` onto GPU 1`` (or GPUs 1, 0), or nothing for an operation not onto a GPU."""
    if op.get("to_gpus"):
        return f" onto GPUs {', '.join(str(i) for i in op['to_gpus'])}"
    return f" onto GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""


# -- the kernel's voice: %migrate and its widget --------------------------------------------------------


def describe(op: dict) -> str:
    """One line for a finished move of this kernel: from, to, bytes moved, total time and the slowest phase."""
    slow_phase = slowest(op)
    slow = f"; slowest phase {slow_phase[0]} {slow_phase[1]:.2f} s" if slow_phase else ""
    moved = f"{size(op.get('bytes'))} in {op.get('total', 0):.2f} s"
    if op.get("to_host"):
        gpu = f", GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
        return (f"Moved from host {op.get('from_host')} to host {op['to_host']}{gpu}: {moved}{slow}. This notebook "
                f"reaches it through {op.get('from_host')} if that is its home; everything in memory came along.")
    fast = _fast_path(op)
    if fast.get("stashed"):
        rest = f"; the driver carried {fast['left']}" if fast.get("left") else ""
        how = f" ({size(fast['stashed'])} of tensors by {_by(fast)}{_mid_cell(fast.get('seconds'))}{rest})"
    elif fast.get("reason"):
        how = f" (by the driver alone: {fast['reason']})"
    else:
        how = ""
    same = "Each keeps its torch device number" if op.get("to_gpus") else "torch still calls it cuda:0"
    return f"Moved {gpus_moved(op)}: {moved}{how}{slow}. {same}."


def describe_suspension(suspended: dict, resumed: dict | None, view: dict) -> str:
    """One line for a kernel that suspended itself and is back: for how long, where it runs now (NVML,
    through the server), the size of its images, and how long the resume took if known."""
    end = (resumed or {}).get("finished") or time.time()
    away = max(0.0, end - (suspended.get("finished") or end))
    on = [g["index"] for g in view.get("gpus") or []]
    where = ("GPU " + ", ".join(str(i) for i in on)) if on else "CPU (this kernel holds no GPU memory)"
    took = f" in {resumed['total']:.2f} s" if resumed and resumed.get("status") == "succeeded" else ""
    by = " (started by a cell)" if resumed and resumed.get("trigger") == "cell" else ""
    return (f"Suspended for {away:.1f} s ({size(suspended.get('bytes'))} of images); resumed on {where}"
            f"{took}{by}. Everything in memory is as it was.")


# -- the CLI's voice ----------------------------------------------------------------------------------


def report(op: dict, kernel_id: str | None = None) -> str:
    """The CLI's line for a finished operation of a kernel (suspend, resume, migrate), or for a failure:
    ``<action> failed in phase <phase>: <error>``."""
    action = op.get("action") or "operation"
    if op.get("status") != "succeeded":
        return f"{action} failed in phase {failed_in(op)}: {op.get('error')}"
    kernel = f"Kernel {kernel_id or op.get('kernel_id')}"
    slow = (slowest(op) or ("-", 0.0))[0]
    took = f"in {op.get('total', 0):.2f} s"
    if action == "migrate" and op.get("to_host"):
        gpu = f", GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
        stashed = (op.get("stash") or {}).get("stashed")
        how = f", {size(stashed)} of it written and read back by the kernel's own threads" if stashed else ""
        return (f"{kernel} moved from host {op.get('from_host')} to host {op['to_host']}{gpu} {took} "
                f"({size(op.get('bytes'))} sent{how}; slowest phase: {slow}).")
    if action == "migrate":
        fast = _fast_path(op)
        rest = f"; the driver carried {fast['left']}" if fast.get("left") else ""
        how = (f", {size(fast['stashed'])} of it by {_by(fast)}{_mid_cell(fast.get('seconds'))}{rest}"
               if fast.get("stashed") else f"; by the driver alone: {fast['reason']}" if fast.get("reason") else "")
        return (f"{kernel} moved {gpus_moved(op)} {took} "
                f"({size(op.get('bytes'))} of GPU memory{how}; slowest phase: {slow}).")
    if action == "transplant":
        plant = op.get("transplant") or {}
        where = "the CPU" if op.get("to_gpu") is None else f"GPU {op['to_gpu']}"
        if op.get("to_host"):
            where = f"{where} of host {op['to_host']}"
        left = [r["name"] for r in plant.get("left", [])]
        lost = f"; not carried: {', '.join(left)}" if left else "; nothing was left behind"
        return (f"{kernel} transplanted to {where} {took}: {len(plant.get('carried', []))} objects carried into a new "
                f"process ({size(op.get('bytes'))} of data){lost}.")
    if action == "back":
        where = f" on GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
        return (f"{kernel} went back to the process its transplant replaced{where} {took} ({size(op.get('bytes'))} "
                "of images); what it did since the transplant is gone.")
    done = {"suspend": "suspended", "resume": "resumed"}.get(action, f"{action} done")
    where = gpus_onto(op)
    if action == "suspend" and op.get("images") in ("memory", "disk"):
        where = f" to {op['images']}"
        from .engine.images import FILLED  # here: the kernel imports this module, not the server's image store

        why = op.get("images_why") or ""
        if op["images"] == "disk" and why.startswith(FILLED):  # auto took memory, which filled meanwhile
            where += f" ({why})"
    stash = op.get("stash") or {}
    carried = stash.get("stashed") or stash.get("unstashed")
    how = f", {size(carried)} of it by the kernel's own threads{_mid_cell(stash)}" if carried else ""
    fetched = (stash.get("prefetch") or {}).get("bytes")
    if fetched:  # engine/prefetch.py
        when = "as its images arrived" if (stash.get("prefetch") or {}).get("followed") else "while CRIU restored it"
        how += f", {size(fetched)} of that read onto its GPU by a helper {when}"
    return f"{kernel} {done}{where} {took} ({size(op.get('bytes'))} of images{how}; slowest phase: {slow})."


def survey_report(survey: dict, kernel_id: str) -> str:
    """What a transplant would carry and what not (its dry run), for people: a few lines."""
    where = "the CPU" if survey.get("to") == "cpu" else f"GPU {survey.get('to_gpu')}"
    if survey.get("to_host"):
        where = f"{where} of host {survey['to_host']}"
    carries = survey.get("carries", [])
    names = ", ".join(r["name"] for r in carries[:12]) + (f" and {len(carries) - 12} more" if len(carries) > 12 else "")
    lines = [f"A transplant of kernel {kernel_id} to {where} starts a new kernel process and carries the notebook's "
             "objects into it; the process itself (threads, open files, sockets, the C state of libraries) does "
             "not go.",
             f"  carries: {len(carries)} names ({size(survey.get('bytes'))} of data): {names or 'none'}"]
    outputs = survey.get("outputs") or {}
    if outputs.get("of"):
        lines.append(f"  outputs (Out): {outputs['carried']} of {outputs['of']}")
    for row in survey.get("left", []):
        lines.append(f"  NOT carried: {row['name']} ({row['type']}): {row['reason']}")
    for row in survey.get("notes", []):
        lines.append(f"  note: {row['name']} {row['note']}")
    if survey.get("same_model"):
        lines.append(f"  {where} is of the kernel's own model: `migrate --to-gpu` moves the whole process instead, "
                     "losing nothing.")
    return "\n".join(lines)


def drain_report(op: dict) -> str:
    """The CLI's line for a finished drain of a GPU."""
    results = op.get("results") or []
    moved = [r for r in results if r.get("status") == "succeeded"]
    if not results and op.get("status") == "succeeded":
        return f"GPU {op.get('gpu')} holds no kernel of this server: nothing to move."
    if op.get("status") == "succeeded":
        where = ", ".join(sorted({_drained_to(r) for r in moved}))
        carried = sum(1 for r in moved if r.get("way") == "transplant")
        how = f" ({carried} of them transplanted: their objects, in a new process)" if carried else ""
        return (f"GPU {op.get('gpu')} drained: {len(moved)} kernel(s) moved to {where}{how} in "
                f"{op.get('total', 0):.2f} s.")
    return (f"GPU {op.get('gpu')} not drained: {len(moved)} of {len(results)} kernel(s) moved; the others run on "
            "where they were.")


def _drained_to(result: dict) -> str:
    """Where a drain sent a kernel: ``GPU 1``, or ``the CPU`` (a transplant)."""
    return "the CPU" if result.get("to_gpu") is None else f"GPU {result.get('to_gpu')}"


class DrainProgress:
    """One line per kernel of a drain each time its result changes (moving, moved, NOT moved)."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def lines(self, op: dict) -> list[str]:
        out = []
        for r in op.get("results") or []:
            if self.seen.get(r["kernel_id"]) == r["status"] or r["status"] == "pending":
                continue
            self.seen[r["kernel_id"]] = r["status"]
            verb = ("transplanting", "transplanted") if r.get("way") == "transplant" else ("moving", "moved")
            if r["status"] == "running":
                out.append(f"  kernel {r['kernel_id']}: {verb[0]} to {_drained_to(r)}...")
            elif r["status"] == "succeeded":
                out.append(f"  kernel {r['kernel_id']}: {verb[1]} to {_drained_to(r)}")
            else:
                out.append(f"  kernel {r['kernel_id']}: NOT moved: {r.get('error') or 'unknown error'}")
        return out


class PhaseProgress:
    """One line per phase as it starts (``  dump...``), for the CLI's stderr."""

    def __init__(self) -> None:
        self.shown: str | None = None

    def lines(self, op: dict) -> list[str]:
        phase = op.get("phase")
        if finished(op) or not phase or phase == self.shown:
            return []
        self.shown = phase
        return [f"  {phase}..."]
