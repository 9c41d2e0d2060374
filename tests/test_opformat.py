"""opformat: sizes in powers of 1000, and what the CLI, %migrate and its widget say of an operation, on
records of the shape GET /api/gpumigrate/operations/{id} answers (tests/test_apiclient.py formats real ones)."""

from __future__ import annotations

import time

import pytest

from jupyter_gpumigrate.opformat import (DrainProgress, PhaseProgress, describe, describe_suspension, drain_report,
                                         failure, gb, progress, report, size, slowest)

KID = "5f0c3a52-8d0e-4d7b-a0a4-0d1b1e0f6c11"


def record(**fields: object) -> dict:
    """An operation as the server answers it, succeeded unless told otherwise."""
    base = {"id": "op1", "kernel_id": KID, "action": "migrate", "status": "succeeded", "phase": None, "error": None,
            "failed_phase": None, "timings": {}, "total": 0.0, "bytes": 0, "to_gpu": None, "from_gpu": None,
            "to_host": None, "from_host": None, "gpu": None, "results": [], "version": 9, "fast_path": None,
            "trigger": "api"}
    return base | fields


@pytest.mark.parametrize("n, text", [
    (None, "0 B"), (0, "0 B"), (999, "999 B"), (1000, "1.0 KB"), (74_200_000, "74.2 MB"), (999_949_999, "999.9 MB"), (999_950_000, "1.0 GB"), (999.4, "999 B"), (999.5, "1.0 KB"),
    (8_600_000_000, "8.6 GB"), (2**30, "1.1 GB"), (151 * 10**9, "151.0 GB"), (2 * 10**12, "2.0 TB"),
])
def test_sizes_are_in_powers_of_1000(n, text):
    assert size(n) == text


def test_gb_is_a_bare_number_of_gb():
    assert gb(80 * 10**9) == "80.0" and gb(1.25e9) == "1.2"


def test_a_move_to_another_gpu_in_both_voices():
    timings = {"prepare": 0.001, "stash": 0.31, "lock": 0.2, "checkpoint": 0.3, "remap": 0.29, "unlock": 0.0,
               "unstash": 0.13, "verify": 0.0}
    op = record(from_gpu=0, to_gpu=1, bytes=8_600_000_000, timings=timings, total=1.38,
                fast_path={"stashed": 8_000_000_000, "seconds": 0.44})
    assert slowest(op) == ("stash", 0.31)
    assert describe(op) == ("Moved from GPU 0 to GPU 1: 8.6 GB in 1.38 s (8.0 GB of tensors by the fast path); "
                            "slowest phase stash 0.31 s. torch still calls it cuda:0.")
    assert report(op) == (f"Kernel {KID} moved from GPU 0 to GPU 1 in 1.38 s (8.6 GB of GPU memory, 8.0 GB of it "
                          "by the fast path; slowest phase: stash).")
    busy = op | {"fast_path": {"stashed": 8_000_000_000, "reason": None, "seconds": {"safe_point": 0.031}}}
    assert "(8.0 GB of tensors by the fast path, at the running cell's safe point (reached in 0.03 s))" in describe(busy)
    assert "8.0 GB of it by the fast path, at the running cell's safe point (reached in 0.03 s);" in report(busy)
    part = op | {"fast_path": {"stashed": 8_000_000_000, "left": "7.5 GB that its search did not reach"}}
    assert "(8.0 GB of tensors by the fast path; the driver carried 7.5 GB that its search did not reach);" in \
        describe(part)
    assert "8.0 GB of it by the fast path; the driver carried 7.5 GB that its search did not reach; slowest" in \
        report(part)
    aside = op | {"fast_path": {"stashed": 0, "reason": "the kernel is busy"}}
    assert "(by the driver alone: the kernel is busy);" in describe(aside)
    assert "(8.6 GB of GPU memory; by the driver alone: the kernel is busy; slowest phase: stash)" in report(aside)


def test_a_move_to_another_host_in_both_voices():
    op = record(from_host="a", to_host="b", to_gpu=0, bytes=600_000_000, timings={"transfer": 2.5, "dump": 1.0},
                total=3.5)
    assert describe(op) == ("Moved from host a to host b, GPU 0: 600.0 MB in 3.50 s; slowest phase transfer 2.50 s. "
                            "This notebook reaches it through a if that is its home; everything in memory came along.")
    assert report(op, "k1") == "Kernel k1 moved from host a to host b, GPU 0 in 3.50 s (600.0 MB sent; slowest phase: transfer)."


def test_suspend_resume_and_failures_in_the_clis_voice():
    suspended = record(action="suspend", bytes=74_200_000, timings={"prepare": 0.01, "dump": 0.4}, total=0.41)
    assert report(suspended) == f"Kernel {KID} suspended in 0.41 s (74.2 MB of images; slowest phase: dump)."
    resumed = record(action="resume", to_gpu=1, bytes=74_200_000, timings={"restore": 0.19}, total=0.19)
    assert report(resumed, "k") == "Kernel k resumed onto GPU 1 in 0.19 s (74.2 MB of images; slowest phase: restore)."
    stashed = record(action="suspend", images="memory", bytes=33_000_000_000, total=5.07,
                     timings={"stash": 3.65, "dump": 0.92}, stash={"stashed": 32_000_000_000, "buffers": 16})
    assert report(stashed, "k") == ("Kernel k suspended to memory in 5.07 s (33.0 GB of images, 32.0 GB of it by "
                                    "the kernel's own threads; slowest phase: stash).")
    fetched = record(action="resume", to_gpu=0, bytes=33_000_000_000, total=2.5, timings={"unstash": 1.19},
                     stash={"unstashed": 32_000_000_000, "from_gpu": 32_000_000_000,
                            "prefetch": {"bytes": 32_000_000_000, "seconds": {"read": 2.03}}})
    assert report(fetched, "k") == ("Kernel k resumed onto GPU 0 in 2.50 s (33.0 GB of images, 32.0 GB of it by the "
                                    "kernel's own threads, 32.0 GB of that read onto its GPU by a helper while CRIU "
                                    "restored it; slowest phase: unstash).")
    mid_cell = stashed | {"stash": {"stashed": 32_000_000_000, "safe_point": 0.012}}
    assert "32.0 GB of it by the kernel's own threads, at the running cell's safe point (reached in 0.01 s);" in \
        report(mid_cell, "k")
    failed = record(action="resume", status="failed", phase="restore", failed_phase="restore",
                    error="CRIU could not restore.")
    assert report(failed) == "resume failed in phase restore: CRIU could not restore."
    assert failure(failed) == "CRIU could not restore. (phase restore)"
    assert failure(failed | {"failed_phase": None, "phase": "dump"}).endswith("(phase dump)")
    assert report(record(action="suspend")).endswith("(0 B of images; slowest phase: -).")


def test_a_suspension_said_by_the_kernel_once_it_is_back():
    now = time.time()
    suspended = record(action="suspend", bytes=38_000_000, finished=now - 2.0)
    resumed = record(action="resume", total=0.45, finished=now, trigger="cell")
    line = describe_suspension(suspended, resumed, {"gpus": [{"index": 1}]})
    assert line == ("Suspended for 2.0 s (38.0 MB of images); resumed on GPU 1 in 0.45 s (started by a cell). "
                    "Everything in memory is as it was.")
    assert "resumed on CPU (this kernel holds no GPU memory). Everything" in describe_suspension(suspended, None, {})


def test_progress_counts_the_phases_of_the_operations_own_plan():
    phases = ["prepare", "stash", "lock", "checkpoint", "remap", "unlock", "unstash", "verify"]
    running = record(status="running", phases=phases)
    assert progress(running) == (0, 8)
    assert progress(running | {"phase": "checkpoint"}) == (3, 8)
    assert progress(running | {"status": "succeeded", "phase": "verify"}) == (8, 8)
    assert progress(record(status="running", phase="dump")) == (0, 0), "no phases listed: no progress"
    assert progress(record(status="running", phase="dump", phases=[])) == (0, 0)


def test_phase_lines_once_each_while_it_runs():
    lines = PhaseProgress()
    seen = [lines.lines(record(status=s, phase=p)) for s, p in
            [("pending", None), ("running", "prepare"), ("running", "prepare"), ("running", "dump"),
             ("succeeded", "dump")]]
    assert seen == [[], ["  prepare..."], [], ["  dump..."], []]


def test_drain_lines_and_summary():
    a, b = "a" * 32, "b" * 32
    progress_lines = DrainProgress()
    running = record(action="drain", gpu=0, status="running", results=[{"kernel_id": a, "status": "running", "to_gpu": 1}])
    assert progress_lines.lines(running) == [f"  kernel {a}: moving to GPU 1..."]
    done = record(action="drain", gpu=0, total=2.5, results=[{"kernel_id": a, "status": "succeeded", "to_gpu": 1},
                                                             {"kernel_id": b, "status": "succeeded", "to_gpu": 2}])
    assert drain_report(done) == "GPU 0 drained: 2 kernel(s) moved to GPU 1, GPU 2 in 2.50 s."
    assert drain_report(record(action="drain", gpu=3)) == "GPU 3 holds no kernel of this server: nothing to move."
    half = done | {"status": "failed", "results": [done["results"][0], {"kernel_id": b, "status": "failed"}]}
    assert drain_report(half) == "GPU 0 not drained: 1 of 2 kernel(s) moved; the others run on where they were."
    # A drain that may transplant: what went into a new process says so, and where it went.
    carried = {"kernel_id": b, "status": "running", "to_gpu": None, "way": "transplant"}
    assert progress_lines.lines(record(action="drain", gpu=0, status="running", results=[carried])) == [
        f"  kernel {b}: transplanting to the CPU..."]
    assert progress_lines.lines(record(action="drain", gpu=0, results=[carried | {"status": "succeeded"}])) == [
        f"  kernel {b}: transplanted to the CPU"]
    both = done | {"results": [done["results"][0], carried | {"status": "succeeded"}]}
    assert drain_report(both) == ("GPU 0 drained: 2 kernel(s) moved to GPU 1, the CPU (1 of them transplanted: their "
                                  "objects, in a new process) in 2.50 s.")
