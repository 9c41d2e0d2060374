"""GPU kernels moved between GPUs and suspended/resumed, on real GPUs (the `gpu` suite).

Runs where NVML sees at least two GPUs of one model with driver >= 580 (scripts/gpu-suite.sh on the
device machine); elsewhere every test here is skipped with the reason. The kernels are real IPython
kernels with PyTorch, started by a real server; NVML, read in this (the server's) process, is the
judge of where a kernel's memory is.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (OPEN_IO_URING, KernelSession, api, cli, operate, remote, server_sees_idle, start_busy, start_kernel,
                     two_gpus, wait_operation)

from jupyter_gpumigrate.engine import doctor
from jupyter_gpumigrate.engine import gpus as gpus_mod
from jupyter_gpumigrate.engine.cudackpt import CudaProcess
from jupyter_gpumigrate.engine.errors import PhaseFailed
from jupyter_gpumigrate.engine.migration import Migration
from jupyter_gpumigrate.engine.stash import Stash

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("criu_binary")]

GIB = 1024**3

SETUP = r"""
import os, time, hashlib
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
torch.use_deterministic_algorithms(True)

def make(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return model, opt, gen

def train(model, opt, gen, steps, pause=0.0):
    losses = []
    for _ in range(steps):
        x = torch.randn(512, 512, device="cuda", generator=gen)
        y = torch.randint(0, 10, (512,), device="cuda", generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if pause:
            time.sleep(pause)
    return losses

def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()

def state_digest():
    opt_tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return digest(*model.state_dict().values(), *opt_tensors, big)
"""

BUILD = """
model, opt, gen = make(0)
first = train(model, opt, gen, 20)
big = torch.randn({n}, device="cuda")      # {gib} GiB of live tensor besides the model
before = state_digest()
print(len(first), torch.cuda.current_device())
"""


def where(pid: int) -> set[int]:
    """Indexes of the GPUs on which NVML sees ``pid``."""
    return {g.index for g in gpus_mod.snapshot() if pid in g.processes}


async def build(kernel, gib: float = 1.0, gpus: int = 2) -> int:
    """The kernel trains a model and holds ``gib`` GiB besides it, on GPU 0; skipped unless there are
    ``gpus`` GPUs (2: of one model)."""
    if gpus > 1:
        two_gpus()
    await kernel.run(SETUP, timeout=120)
    out = await kernel.run(BUILD.format(n=int(gib * GIB // 4), gib=gib), timeout=120)
    assert out.split() == ["20", "0"]
    pid = kernel.manager.provisioner.pid
    assert where(pid) == {0}
    return pid


async def test_move_0_to_1_to_0_keeps_every_value(jp_fetch, jp_serverapp, kernel):
    pid = await build(kernel, gib=2)
    for src, dst in ((0, 1), (1, 0)):
        if dst == 1:  # the idle kernel is asked to serve the fast path: its 2 GiB go through the stash
            op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": dst})
            assert op["status"] == "succeeded", op
            assert list(op["timings"]) == ["prepare", "stash", "lock", "checkpoint", "remap", "unlock", "unstash",
                                           "verify"]
            assert op["fast_path"]["stashed"] >= 2 * GIB and op["fast_path"]["reason"] is None, op["fast_path"]
        else:  # the way back through the command line, by the driver alone
            code, out, err = await cli("migrate", kernel.id[:8], "--to-gpu", "0", "--no-fast-path", "--json",
                                       *remote(jp_serverapp))
            assert code == 0, err
            op = json.loads(out)
            assert list(op["timings"]) == ["prepare", "lock", "checkpoint", "remap", "unlock", "verify"]
            assert op["fast_path"] is None
        assert op["status"] == "succeeded", op
        assert (op["from_gpu"], op["to_gpu"]) == (src, dst) and op["bytes"] > 2 * GIB
        assert where(pid) == {dst}, "NVML shows the kernel's memory on the target alone"
        view = await api(jp_fetch, "kernels", kernel.id)
        assert [g["index"] for g in view["gpus"]] == [dst] and view["pid"] == pid
        listed = (await api(jp_fetch, "gpus"))["gpus"]
        assert [k["id"] for k in listed[dst]["kernels"]] == [kernel.id] and not listed[src]["kernels"]
        out = await kernel.run("print(state_digest() == before, torch.cuda.current_device(), big.device)")
        assert out.split() == ["True", "0", "cuda:0"], "same values, and torch still calls it cuda:0"
    # Training goes on where it left off.
    assert "ok" in await kernel.run("more = train(model, opt, gen, 5); print('ok' if all(l == l for l in more) else more)")


async def moved_mid_cell(jp_fetch, kernel, to_gpu: int) -> dict:
    """A training loop runs in a cell while the kernel moves to ``to_gpu``; its losses must be those of an
    unmoved run of the same loop. The move's operation."""
    ref = await kernel.run("m, o, g = make(1); reference = train(m, o, g, 400, pause=0.005); print(len(reference))")
    assert ref.strip() == "400"
    cell = await start_busy(jp_fetch, kernel, "m, o, g = make(1); moved = train(m, o, g, 400, pause=0.005); "
                                              "print(len(moved))")
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": to_gpu})
    assert op["status"] == "succeeded", op
    assert not cell.done(), "the move happened while the cell ran"
    result = await cell
    assert result.status == "ok" and result.out.strip() == "400", result.errors
    out = await kernel.run("print(moved == reference, torch.cuda.current_device(), state_digest() == before)")
    assert out.split() == ["True", "0", "True"], "the loss sequence is identical to the unmoved run"
    assert where(kernel.manager.provisioner.pid) == {to_gpu}
    return op


async def test_a_running_training_loop_moves_and_its_losses_match_an_unmoved_run(jp_fetch, kernel):
    await build(kernel, gib=2)  # enough for the fast path, were the kernel not busy
    fast = (await moved_mid_cell(jp_fetch, kernel, 1))["fast_path"]
    assert fast["stashed"] >= 2 * GIB and "safe_point" in fast["seconds"], "the cell served the fast path at its safe point"


#: LOADER's data through worker processes (spawned: they start no CUDA) and pinned memory: its pin-memory
#: thread and its queues' feeder threads run on through a move (kernel/stager.py's handed threads).
WORKERS = """
wloader = DataLoader(data, batch_size=256, pin_memory=True, num_workers=2, multiprocessing_context="spawn",
                     persistent_workers=True)
"""


async def test_a_training_loop_with_data_loader_workers_moves_mid_cell_by_the_fast_path(jp_fetch, kernel):
    """The loader's threads run on (they touch only what they are handed, and reach the notebook through
    no Jupyter object); everything else, the 2 GiB beside the model included, takes the fast path at the
    cell's safe point, and the losses are those of an unmoved run."""
    await build(kernel, gib=2)
    await kernel.run(LOADER + WORKERS)
    ref = await kernel.run("m, o, _ = make(1); reference = [v for _ in range(12) for v in epoch(m, o, 0, wloader)]; "
                           "print(len(reference))", timeout=300)
    assert ref.strip() == "192"
    cell = await start_busy(jp_fetch, kernel, "m, o, _ = make(1); moved = [v for _ in range(12) for v in "
                            "epoch(m, o, 0.02, wloader)]; print(len(moved))", settle=1.0)
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 1})
    assert op["status"] == "succeeded", op
    assert not cell.done(), "the move happened while the cell ran"
    fast = op["fast_path"]
    assert fast["stashed"] >= 2 * GIB and fast["left"] is None and "safe_point" in fast["seconds"], fast
    result = await cell
    assert result.status == "ok" and result.out.strip() == "192", result.errors
    out = await kernel.run("print(moved == reference, state_digest() == before)")
    assert out.split() == ["True", "True"], "the losses are those of the unmoved run; every value is kept"
    assert where(kernel.manager.provisioner.pid) == {1}


async def test_suspend_on_gpu_0_and_resume_on_gpu_1(jp_fetch, kernel):
    pid = await build(kernel, gib=4)
    used_before = gpus_mod.snapshot()[0].memory_used
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "stash", "lock", "checkpoint", "dump"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and view["image_bytes"] > 4 * GIB
    assert where(pid) == set()
    assert gpus_mod.snapshot()[0].memory_used < used_before - 4 * GIB, "GPU 0's memory is free while suspended"

    op = await operate(jp_fetch, kernel.id, "resume", {"to_gpu": 1})
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "prefetch", "restore", "remap", "unlock", "unstash", "adopt"]
    assert op["to_gpu"] == 1
    # The helper read the tensors onto GPU 1 during the restore; the kernel, remapped there, copied them.
    prefetch = op["stash"]["prefetch"]
    assert prefetch["bytes"] >= 4 * GIB and op["stash"]["from_gpu"] == prefetch["bytes"], op["stash"]
    assert where(pid) == {1}
    out = await kernel.run("print(state_digest() == before, big.device); print(len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "cuda:0", "3"]


async def test_resume_with_no_gpu_named_goes_back_where_it_was(jp_fetch, kernel):
    pid = await build(kernel)
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    view = await api(jp_fetch, "kernels", kernel.id)
    assert [t["index"] for t in view["targets"] if t["ok"]] == [0, 1], view["targets"]
    kernel.manager.provisioner.resume_prefetch = False  # the kernel reads its files itself, as before
    op = await operate(jp_fetch, kernel.id, "resume")  # the default: the GPU it was suspended on
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "restore", "remap", "unlock", "unstash", "adopt"]
    assert "prefetch" not in op["stash"] and "from_gpu" not in op["stash"], op["stash"]
    assert where(pid) == {0} and CudaProcess(pid).state == "running"
    out = await kernel.run("print(state_digest() == before, big.device, len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "cuda:0", "3"]


#: A kernel on both GPUs: the model and ``big`` on its cuda:0, ``other`` on its cuda:1.
ON_TWO = """
other = torch.randn({n}, device="cuda:1")
other_before = digest(other)
print(torch.cuda.device_count(), other.device)
"""
BOTH_KEPT = "print(state_digest() == before, digest(other) == other_before, big.device, other.device, " \
            "(other[:8] * 2).device)"


def held_on(pid: int) -> dict[int, int]:
    """GPU index -> bytes NVML sees ``pid`` hold there."""
    return {g.index: g.processes[pid] for g in gpus_mod.snapshot() if pid in g.processes}


async def on_two(kernel, gib: float) -> int:
    pid = await build(kernel, gib=gib)
    out = await kernel.run(ON_TWO.format(n=int(gib * GIB // 4)), timeout=120)
    assert out.split()[-1] == "cuda:1"
    assert where(pid) == {0, 1}
    return pid


async def test_a_kernel_on_two_gpus_swaps_them_live_and_keeps_every_value(jp_fetch, jp_serverapp, kernel):
    pid = await on_two(kernel, gib=2)
    # A single GPU is no answer for a kernel on two: the list and the refusal say how to name one per GPU.
    view = await api(jp_fetch, "kernels", kernel.id)
    assert [g["index"] for g in view["gpus"]] == [0, 1]
    assert not any(t["ok"] for t in view["targets"]) and "name a GPU for each" in view["targets"][1]["reason"]
    listed = (await api(jp_fetch, "gpus"))["gpus"]
    assert all(kernel.id in [k["id"] for k in g["kernels"]] for g in listed[:2]), "listed under each GPU it holds"
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 1}, expect=409)
    assert "holds GPUs 0 and 1: name a GPU for each, in that order" in error["message"]
    assert CudaProcess(pid).state == "running", "refused before anything was locked"
    before = held_on(pid)
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpus": [1, 0]})
    assert op["status"] == "succeeded", op
    assert (op["from_gpus"], op["to_gpus"], op["from_gpu"], op["to_gpu"]) == ([0, 1], [1, 0], 0, 1), op
    assert op["fast_path"]["via"] is None and "several GPUs" in op["fast_path"]["reason"], op["fast_path"]
    after = held_on(pid)
    assert set(after) == {0, 1} and abs(after[1] - before[0]) < GIB and abs(after[0] - before[1]) < GIB, \
        f"what was on GPU 0 is on GPU 1 and the other way round: {before} -> {after}"
    out = await kernel.run(BOTH_KEPT)
    assert out.split() == ["True", "True", "cuda:0", "cuda:1", "cuda:1"], "torch keeps its device numbers"
    # And back, through the command line.
    code, out, err = await cli("migrate", kernel.id[:8], "--to-gpu", "1,0", "--json", *remote(jp_serverapp))
    assert code == 0, err
    assert json.loads(out)["to_gpus"] == [1, 0]
    assert abs(held_on(pid)[0] - before[0]) < GIB
    assert (await kernel.run("print(state_digest() == before, digest(other) == other_before)")).split() == ["True"] * 2
    assert (await kernel.run("print(len(train(model, opt, gen, 3)))")).strip() == "3", "training goes on"


async def test_a_kernel_on_two_gpus_is_suspended_and_resumed_with_its_gpus_swapped(jp_fetch, kernel):
    pid = await on_two(kernel, gib=4)
    before = held_on(pid)
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert where(pid) == set()
    view = await api(jp_fetch, "kernels", kernel.id)
    assert [g["index"] for g in view["suspended_on"]] == [0, 1]
    error = await api(jp_fetch, "kernels", kernel.id, "resume", method="POST", body={"to_gpu": 1}, expect=409)
    assert "name a GPU for each" in error["message"]
    op = await operate(jp_fetch, kernel.id, "resume", {"to_gpus": [1, 0]})
    assert op["status"] == "succeeded", op
    assert op["to_gpus"] == [1, 0] and op["to_gpu"] == 1, op
    after = held_on(pid)
    assert abs(after[1] - before[0]) < GIB and abs(after[0] - before[1]) < GIB, f"{before} -> {after}"
    out = await kernel.run(BOTH_KEPT)
    assert out.split() == ["True", "True", "cuda:0", "cuda:1", "cuda:1"]
    # Suspended again, it comes back where it was last, by default.
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded" and op["to_gpus"] == [0, 1], op
    assert abs(held_on(pid)[1] - before[0]) < 2 * GIB
    assert (await kernel.run("print(state_digest() == before, digest(other) == other_before)")).split() == ["True"] * 2
    assert (await kernel.run("print(len(train(model, opt, gen, 3)))")).strip() == "3", "training goes on"


async def test_the_host_stash_moves_an_idle_and_a_busy_kernel_and_keeps_every_value(jp_fetch, kernel):
    """Forced (c.MigratableProvisioner.move_stash = "host"), as on GPUs without peer access: the tensors go
    through files in memory; the busy cell serves it at its safe point and its losses match an unmoved run."""
    pid = await build(kernel, gib=3)
    kernel.manager.provisioner.move_stash = "host"
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 1})
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "host stash", "lock", "checkpoint", "remap", "unlock", "take back",
                                   "verify"], op["timings"]
    fast = op["fast_path"]
    assert fast["via"] == "host" and fast["stashed"] >= 3 * GIB and fast["reason"] is None, fast
    print("host stash, idle:", op["total"], op["timings"], fast)
    assert where(pid) == {1} and not _images(kernel).exists(), "the host stash's folder is gone"
    out = await kernel.run("print(state_digest() == before, big.device)")
    assert out.split() == ["True", "cuda:0"]
    op = await moved_mid_cell(jp_fetch, kernel, 0)
    fast = op["fast_path"]
    print("host stash, mid-cell:", op["total"], op["timings"], fast)
    assert fast["via"] == "host" and fast["stashed"] >= 3 * GIB and "safe_point" in fast["seconds"], fast


def test_doctor_on_a_gpu_machine_reports_every_gpu_row():
    two_gpus()
    checks = {c.name: c for c in doctor.run_checks()}
    assert checks["nvidia driver"].status == doctor.OK, checks["nvidia driver"]
    assert checks["cuda checkpoint api"].status == doctor.OK
    assert checks["gpus"].status == doctor.OK and checks["gpus"].detail.startswith(f"{len(gpus_mod.snapshot())} (")
    assert "persistence mode" in checks
    for check in checks.values():
        if check.status in (doctor.WARN, doctor.FAIL):
            assert check.remedy, f"{check.name} says what is wrong but not what to do"


async def test_refusals_leave_the_kernel_running_where_it_was(jp_fetch, kernel):
    pid = await build(kernel)
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 0}, expect=409)
    assert "already on GPU 0" in error["message"]
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 9}, expect=409)
    assert "GPU 9 does not exist" in error["message"]
    # Fill GPU 1 from another process until the kernel no longer fits there.
    free = gpus_mod.snapshot()[1].memory_total - gpus_mod.snapshot()[1].memory_used
    fill = (f"import torch, time; x = torch.empty({free - GIB}, dtype=torch.uint8, device='cuda:1'); "
            "print('full', flush=True); time.sleep(600)")
    filler = subprocess.Popen([sys.executable, "-c", fill], stdout=subprocess.PIPE, text=True)
    try:
        assert filler.stdout.readline().strip() == "full"
        error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 1}, expect=409)
        assert "GPU 1 has" in error["message"] and "free" in error["message"]
    finally:
        filler.kill()
        filler.wait(timeout=30)
    assert where(pid) == {0} and (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    assert (await kernel.run("print(state_digest() == before)")).strip() == "True"


async def test_a_failed_remap_rolls_back_onto_the_original_gpu(jp_fetch, jp_serverapp, kernel):
    pid = await build(kernel)
    provisioner = kernel.manager.provisioner

    def inventory_with_an_unknown_gpu_1() -> list[gpus_mod.GpuInfo]:
        # GPU 1 as NVML describes it, but under a UUID the driver does not know: the driver itself
        # refuses the restore onto it.
        gpus = gpus_mod.snapshot()
        gpus[1] = dataclasses.replace(gpus[1], uuid="GPU-0badc0de-0000-4000-8000-000000000001")
        return gpus

    migration = Migration(provisioner, provisioner.images, None, inventory=inventory_with_an_unknown_gpu_1)
    with pytest.raises(PhaseFailed) as info:
        await asyncio.to_thread(migration.move_to_gpu, 1)
    assert info.value.phase == "remap" and info.value.rolled_back, info.value
    assert provisioner.state == "running"
    assert where(pid) == {0}, "back on the GPU it came from"
    assert CudaProcess(pid).state == "running", "the driver says the kernel is neither locked nor checkpointed"
    out = await kernel.run("print(state_digest() == before); print(len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "3"], "unlocked, with its state intact"


async def test_the_magic_moves_the_kernel_and_the_next_cell_runs_on_the_new_gpu(kernel):
    pid = await build(kernel)
    out = await kernel.run("%migrate --to-gpu 1", timeout=300)
    line = re.fullmatch(r"Moved from GPU 0 to GPU 1: (\d+\.\d) GB in (\d+\.\d\d) s"
                        r"( \(\d+\.\d GB of tensors by the fast path\)| \(by the driver alone: .+\))?"
                        r"; slowest phase (prepare|stash|lock|checkpoint|remap|unlock|unstash|verify) (\d+\.\d\d) s\. "
                        r"torch still calls it cuda:0\.", out.strip())
    assert line and float(line.group(1)) >= 1.0 and float(line.group(5)) <= float(line.group(2)), out
    assert where(pid) == {1}
    out = await kernel.run("print(state_digest() == before, big.device, len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "cuda:0", "3"]
    result = await kernel.execute("%migrate --to-gpu 1")
    assert result.status == "error" and "already on GPU 1" in "".join(result.errors)


async def test_an_idle_kernels_cached_blocks_are_released_before_a_move(jp_fetch, kernel):
    pid = await build(kernel, gib=1)
    await kernel.run("gone = torch.empty(6 * 2**30, dtype=torch.uint8, device='cuda'); del gone")
    held = next(g for g in gpus_mod.snapshot() if pid in g.processes).processes[pid]
    assert held > 7 * GIB, "the allocator keeps the freed 6 GiB"
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 1})
    assert op["status"] == "succeeded", op
    assert op["bytes"] < held - 5 * GIB, f"moved {op['bytes']} bytes of {held}: the cache was not released"
    assert (await kernel.run("print(state_digest() == before)")).strip() == "True"


async def test_draining_gpu_0_moves_both_kernels_on_it(jp_fetch, jp_serverapp, kernel):
    first = await build(kernel)
    other_id = await start_kernel(jp_fetch)
    other = KernelSession(jp_serverapp, other_id)
    await other.ready()
    try:
        second = await build(other)
        op = await api(jp_fetch, "gpus", "0", "drain", method="POST", expect=202)
        op = await wait_operation(jp_fetch, op, timeout=300)
        assert op["status"] == "succeeded", op
        assert sorted(r["kernel_id"] for r in op["results"]) == sorted([kernel.id, other_id])
        assert all(r["status"] == "succeeded" and r["to_gpu"] == 1 for r in op["results"]) and len(op["children"]) == 2
        assert where(first) == {1} and where(second) == {1}
        for session in (kernel, other):
            assert (await session.run("print(state_digest() == before)")).strip() == "True"
    finally:
        other.close()


async def test_no_kernel_lands_on_a_gpu_while_it_is_drained(jp_fetch, jp_serverapp, kernel):
    """A resume going back to GPU 0 is under way as GPU 0's drain starts: the drain waits for it, and at its
    end neither kernel is on GPU 0 (the resumed one was drained too, or went to GPU 1: its plan avoids a
    GPU being drained). Meanwhile a move that names GPU 0 is refused, saying that it is being drained."""
    first = await build(kernel)
    other_id = await start_kernel(jp_fetch)
    other = KernelSession(jp_serverapp, other_id)
    await other.ready()
    try:
        second = await build(other)
        op = await operate(jp_fetch, other_id, "suspend")
        assert op["status"] == "succeeded", op
        resume = await api(jp_fetch, "kernels", other_id, "resume", method="POST", body={}, expect=202)
        drain = await api(jp_fetch, "gpus", "0", "drain", method="POST", expect=202)
        refused = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST", body={"to_gpu": 0}, expect=409)
        assert f"GPU 0 is being drained (operation {drain['id']})" in refused["message"], refused
        resume = await wait_operation(jp_fetch, resume, timeout=300)
        drain = await wait_operation(jp_fetch, drain, timeout=300)
        assert resume["status"] == "succeeded" and drain["status"] == "succeeded", (resume, drain)
        assert kernel.id in [r["kernel_id"] for r in drain["results"]], drain
        assert where(first) == {1} and where(second) == {1}, "nothing is left on the drained GPU"
        for session in (kernel, other):
            assert (await session.run("print(state_digest() == before)")).strip() == "True"
    finally:
        other.close()


async def test_a_gpu_suspend_whose_dump_fails_leaves_the_kernel_on_its_gpu_unlocked(jp_fetch, kernel):
    pid = await build(kernel)
    await kernel.run(OPEN_IO_URING)  # the dump fails after the CUDA checkpoint
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    assert list(op["timings"]) == ["prepare", "stash", "lock", "checkpoint", "dump"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid
    assert where(pid) == {0}, "its GPU memory is back on GPU 0"
    out = await kernel.run("print(state_digest() == before, len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "3"], "CUDA is unlocked and the values are intact"
    await kernel.run("os.close(ring)")


# -- the fast path (engine/stash.py, kernel/stager.py) ---------------------------------------------------

MORE_TENSORS = r"""
half = torch.randn(2**28, device="cuda").to(torch.bfloat16)     # 512 MiB of bf16
ints = torch.arange(2**26, device="cuda", dtype=torch.int64)     # 512 MiB of int64
view = big[1000:2**20 + 1000]                                    # a view: shares big's storage
strided = big[::3]                                               # a strided view of it
small = torch.randn(1000, device="cuda")                         # below the fast path's floor: stays
probe = torch.randn(64, 512, device="cuda")
loss = torch.nn.functional.cross_entropy(model(probe), torch.zeros(64, dtype=torch.long, device="cuda"))
loss.backward()                                                  # gradients too

def every_digest():
    grads = [p.grad for p in model.parameters()]
    return [digest(t) for t in (half, ints, view, strided, small, big, *grads)] + [state_digest(), digest(model(probe))]

all_before = every_digest()
print(len(all_before))
"""


async def test_the_fast_path_changes_no_value(jp_fetch, kernel):
    """Every tensor (bf16, int64, views, strided views, a small one, gradients, the model and Adam's
    state) has the same SHA-256 after going through the stash, there and back, and the model gives
    the same output; views still share their base's storage."""
    pid = await build(kernel, gib=2)
    assert (await kernel.run(MORE_TENSORS, timeout=120)).strip() == "12"
    out = await kernel.run("%migrate --to-gpu 1", timeout=300)
    assert out.startswith("Moved from GPU 0 to GPU 1:") and "by the fast path" in out, out
    assert where(pid) == {1}
    check = ("print(every_digest() == all_before, view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr(),"
             " big.device, len(train(model, opt, gen, 3)))")
    assert (await kernel.run(check)).split() == ["True", "True", "cuda:0", "3"]
    await kernel.run("all_before = every_digest()")  # trained 3 steps: a new reference
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 0})
    assert op["status"] == "succeeded" and op["fast_path"]["stashed"] > 3 * GIB, op
    assert where(pid) == {0}
    assert (await kernel.run("print(every_digest() == all_before)")).strip() == "True"


GRAPH = r"""
static_in = torch.ones(2**20, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    static_out = static_in * 2 + 1                               # warm up outside the capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    static_out = static_in * 2 + 1
graph.replay(); torch.cuda.synchronize()
print(bool((static_out == 3).all()))
"""


async def test_the_fast_path_steps_aside_for_a_cuda_graph_and_for_a_users_thread(jp_fetch, kernel):
    pid = await build(kernel, gib=2)  # enough for the fast path, were it not for what it finds
    assert (await kernel.run(GRAPH)).strip() == "True"
    await server_sees_idle(jp_fetch, kernel)
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 1})
    assert op["status"] == "succeeded" and op["fast_path"]["stashed"] == 0, op
    assert "CUDA graph" in op["fast_path"]["reason"], op["fast_path"]
    out = await kernel.run("static_in.fill_(3); graph.replay(); torch.cuda.synchronize(); print(bool((static_out == 7).all()))")
    assert out.strip() == "True", "the graph's fixed addresses still hold its tensors"
    await kernel.run("del graph; import gc, threading; gc.collect()\n"
                     "threading.Thread(target=time.sleep, args=(300,), name='users-worker', daemon=True).start()")
    await server_sees_idle(jp_fetch, kernel)
    op = await operate(jp_fetch, kernel.id, "migrate", {"to_gpu": 0})
    assert op["status"] == "succeeded" and op["fast_path"]["stashed"] == 0, op
    assert "users-worker" in op["fast_path"]["reason"], op["fast_path"]
    assert where(pid) == {0}
    assert (await kernel.run("print(state_digest() == before)")).strip() == "True"


async def test_a_failed_remap_after_the_stash_brings_the_tensors_back_on_the_original_gpu(kernel):
    pid = await build(kernel, gib=2)
    provisioner = kernel.manager.provisioner
    stash = Stash()

    def inventory() -> list[gpus_mod.GpuInfo]:
        # Once the tensors are in the stash, GPU 1 turns into a UUID the driver does not know: the
        # remap fails, after the stash.
        gpus = gpus_mod.snapshot()
        if stash.held:
            gpus[1] = dataclasses.replace(gpus[1], uuid="GPU-0badc0de-0000-4000-8000-000000000001")
        return gpus

    migration = Migration(provisioner, provisioner.images, None, inventory=inventory)
    with pytest.raises(PhaseFailed) as info:
        await asyncio.to_thread(migration.move_to_gpu, 1, stash=stash)
    assert info.value.phase == "remap" and info.value.rolled_back, info.value
    assert stash.stashed > 2 * GIB and stash.held == 0, "the stash was used, and emptied by the undo"
    assert provisioner.state == "running" and where(pid) == {0}
    out = await kernel.run("print(state_digest() == before); print(len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "3"], "unlocked, with its state intact"


# -- the host stash of a suspend (kernel/hoststash.py): one GPU is enough -------------------------------


def _images(kernel) -> Path:
    provisioner = kernel.manager.provisioner
    return provisioner.images.path_for(provisioner.kernel_id)


async def test_a_gpu_suspend_writes_the_tensors_itself_and_the_resume_keeps_every_value(jp_fetch, kernel):
    pid = await build(kernel, gib=4, gpus=1)
    # CPU tensors of 512 MiB go through the stash too (host buffers: no pinned copy). Compared with torch,
    # not numpy: a storage lent to numpy cannot be resized, and stays.
    await kernel.run("on_cpu = torch.randn(2**27); on_cpu_ref = on_cpu.clone()")
    used_before = gpus_mod.snapshot()[0].memory_used
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "stash", "lock", "checkpoint", "dump"]
    manifest = json.loads((_images(kernel) / "manifest.json").read_text())
    assert manifest["stash"]["stashed"] >= 5 * GIB and manifest["stash"]["buffers"] >= 3, manifest["stash"]
    assert op["stash"]["stashed"] == manifest["stash"]["stashed"] and op["images"] in ("memory", "disk"), op
    criu_bytes = sum(n for name, n in manifest["files"].items() if not name.startswith("stash-"))
    assert criu_bytes < 2 * GIB, f"CRIU did not carry the tensors again: {manifest['files']}"
    assert where(pid) == set() and gpus_mod.snapshot()[0].memory_used < used_before - 4 * GIB
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "prefetch", "restore", "remap", "unlock", "unstash", "adopt"]
    # The CUDA buffers came from the prefetch; the CPU tensor (host memory) from its file.
    assert op["stash"]["from_gpu"] == op["stash"]["prefetch"]["bytes"] >= 4 * GIB, op["stash"]
    assert op["stash"]["unstashed"] >= op["stash"]["from_gpu"] + 2**29, op["stash"]
    assert where(pid) == {0} and CudaProcess(pid).state == "running"
    out = await kernel.run("print(state_digest() == before, big.device, len(train(model, opt, gen, 3)))")
    assert out.split() == ["True", "cuda:0", "3"]
    out = await kernel.run("print(torch.equal(on_cpu, on_cpu_ref), bool(on_cpu.abs().sum() > 0))")
    assert out.split() == ["True", "True"]


#: A training epoch over a DataLoader with pinned memory; the same batches in the same order every time.
#: No worker processes: a child forked after CUDA started maps the GPU without a CUDA context of its own,
#: and CRIU cannot dump it (docs/internals.md); a suspend then fails and the kernel runs on.
LOADER = """
from torch.utils.data import DataLoader, TensorDataset
_g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(4096, 512, generator=_g), torch.randint(0, 10, (4096,), generator=_g))

def epoch(model, opt, pause=0.0, loader=None):
    losses = []
    for x, y in loader if loader is not None else DataLoader(data, batch_size=256, pin_memory=True):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        time.sleep(pause)
    return losses
"""


async def test_a_training_loop_with_a_data_loader_is_suspended_mid_cell_and_its_losses_match(jp_fetch, kernel):
    """The cell serves the host stash at its safe point, waits there while suspended, and goes on after the
    resume: its losses are those of an unmoved run."""
    pid = await build(kernel, gib=4, gpus=1)
    await kernel.run(LOADER)
    ref = await kernel.run("m, o, _ = make(1); reference = [v for _ in range(8) for v in epoch(m, o)]; "
                           "print(len(reference))", timeout=300)
    assert ref.strip() == "128"
    cell = await start_busy(jp_fetch, kernel, "m, o, _ = make(1); moved = [v for _ in range(8) for v in "
                            "epoch(m, o, 0.05)]; print(len(moved))", settle=1.0)
    op = await operate(jp_fetch, kernel.id, "suspend")
    print("suspend mid-cell:", op["status"], op["error"], op["total"], op["timings"], op["stash"])
    assert op["status"] == "succeeded", op
    assert op["stash"].get("stashed", 0) >= 4 * GIB and "safe_point" in op["stash"], op["stash"]
    assert where(pid) == set() and not cell.done()
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op
    print("resume mid-cell:", op["total"], op["timings"], op["stash"])
    result = await cell
    assert result.status == "ok" and result.out.strip() == "128", result.errors
    out = await kernel.run("print(moved == reference, state_digest() == before)")
    assert out.split() == ["True", "True"], "the losses are those of the unmoved run; every value is kept"


async def test_a_cell_stuck_in_a_long_cuda_call_is_suspended_by_the_driver_and_keeps_every_value(jp_fetch, kernel):
    """The cell waits in a CUDA synchronize (C, no bytecode) past the safe point's bound: the request is
    withdrawn, the driver and CRIU carry everything, and the cell goes on after the resume."""
    pid = await build(kernel, gib=4, gpus=1)
    kernel.manager.provisioner.safe_point_timeout = 1.0
    cell = await start_busy(jp_fetch, kernel, "torch.cuda._sleep(int(1e10)); torch.cuda.synchronize(); "
                                              "print(state_digest() == before)")
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    print("suspend of a stuck cell:", op["total"], op["timings"], op["stash"])
    assert "did not reach a safe point within 1 s" in op["stash"]["aside"], op["stash"]
    assert where(pid) == set()
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op
    result = await cell
    assert result.status == "ok" and result.out.strip() == "True", result.errors
    assert not list(kernel.manager.provisioner.safe_point_dir.glob("request-*")), "the request was withdrawn"


async def test_a_damaged_stash_file_of_a_gpu_kernel_is_refused_and_its_images_kept(jp_fetch, kernel):
    await build(kernel, gib=2, gpus=1)
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    from jupyter_gpumigrate.kernel import hoststash

    folder = _images(kernel)
    chunk = hoststash.read_index(folder)["chunks"][3]
    part = folder / hoststash.PART.format(chunk.part)
    with open(part, "r+b") as f:
        f.seek(chunk.offset + 11)
        byte = f.read(1)[0]
        f.seek(chunk.offset + 11)
        f.write(bytes([byte ^ 0x5A]))
    # The prefetch finds the damage and steps aside; the kernel, reading the file itself, refuses it.
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "failed" and op["failed_phase"] == "unstash" and part.name in op["error"], op
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
    with open(part, "r+b") as f:
        f.seek(chunk.offset + 11)
        f.write(bytes([byte]))
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded" and op["stash"]["prefetch"]["bytes"] >= GIB, op
    assert (await kernel.run("print(state_digest() == before)")).strip() == "True"


async def test_a_tensor_sharing_memory_without_its_storage_makes_the_host_stash_step_aside(jp_fetch, kernel):
    # A DLPack alias points at `big`'s memory through a storage of its own that cannot be resized: freeing
    # `big`'s storage would leave it pointing at freed memory. The stash steps aside; the driver and CRIU
    # carry everything, alias included.
    await build(kernel, gib=2, gpus=1)
    await kernel.run("from torch.utils import dlpack\nalias = dlpack.from_dlpack(dlpack.to_dlpack(big))")
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded" and "shares memory" in op["stash"]["aside"], op
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    out = await kernel.run("kept = state_digest() == before; alias[0] = 7.0; print(kept, float(big[0]) == 7.0)")
    assert out.split() == ["True", "True"], "every value kept, and the alias still writes into big's memory"


# -- transplants (engine/plans/transplant.py): one GPU is enough ----------------------------------------

#: What five more training steps give, in the source, without changing it: its state is saved and put back.
REFERENCE = """
import copy
_saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gen.get_state(),
          torch.get_rng_state(), torch.cuda.get_rng_state())
reference = train(model, opt, gen, 5)
model.load_state_dict(_saved[0]); opt.load_state_dict(_saved[1]); gen.set_state(_saved[2])
torch.set_rng_state(_saved[3]); torch.cuda.set_rng_state(_saved[4])
print(state_digest() == before)
"""


async def test_a_transplant_onto_a_gpu_keeps_every_value_and_the_losses_continue_identically(jp_fetch, kernel):
    pid = await build(kernel, gib=1, gpus=1)
    assert (await kernel.run(REFERENCE, timeout=120)).split() == ["True"]
    reference = await kernel.run("print(reference)")
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_gpu": 0})
    assert op["status"] == "succeeded", op
    # The source holds over 1 GB: its buffers go to the suspend's host stash before its dump (kept for a rollback).
    assert list(op["timings"]) == ["prepare", "start", "export", "load", "stash", "lock", "checkpoint", "dump",
                                   "switch"], op
    assert op["from_gpu"] == 0 and op["to_gpu"] == 0 and op["bytes"] >= GIB
    new = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert new != pid and where(new) == {0} and not Path(f"/proc/{pid}").exists()
    out = await kernel.run("print(state_digest() == before, big.device, next(model.parameters()).device)")
    assert out.split() == ["True", "cuda:0", "cuda:0"], out
    assert await kernel.run("print(train(model, opt, gen, 5))", timeout=120) == reference, \
        "the losses go on as they would have in the source"


async def test_a_transplant_forced_onto_the_other_gpu_keeps_every_value_and_the_losses(jp_fetch, kernel):
    """Between two GPUs of one model the driver moves the process; a transplant there, asked for, carries
    the objects into a new process on the other GPU instead, and says so."""
    pid = await build(kernel, gib=1)
    assert (await kernel.run(REFERENCE, timeout=120)).split() == ["True"]
    reference = await kernel.run("print(reference)")
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_gpu": 1, "dry_run": True})
    assert survey["same_model"] is True and survey["to_gpu"] == 1, survey
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_gpu": 1})
    assert op["status"] == "succeeded", op
    assert op["from_gpu"] == 0 and op["to_gpu"] == 1 and op["bytes"] >= GIB
    new = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert new != pid and where(new) == {1} and not Path(f"/proc/{pid}").exists()
    out = await kernel.run("print(state_digest() == before, big.device, torch.cuda.device_count())")
    assert out.split() == ["True", "cuda:0", "1"], "the new process sees its one GPU as cuda:0"
    assert await kernel.run("print(train(model, opt, gen, 5))", timeout=120) == reference


async def test_a_gpu_kernel_transplanted_to_the_cpu_and_back_keeps_every_value(jp_fetch, kernel):
    pid = await build(kernel, gib=1, gpus=1)
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    assert any(n["name"] == "gen" and "CUDA random generator" in n["note"] for n in survey["notes"]), survey
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded" and op["from_gpu"] == 0 and op["to_gpu"] is None, op
    on_cpu = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert where(on_cpu) == set() and where(pid) == set(), "no process of the kernel holds a GPU"
    out = await kernel.run("print(state_digest() == before, big.device, torch.cuda.is_available())", timeout=120)
    assert out.split() == ["True", "cpu", "False"], out

    op = await operate(jp_fetch, kernel.id, "transplant", {"to_gpu": 0})
    assert op["status"] == "succeeded" and op["from_gpu"] is None and op["to_gpu"] == 0, op
    back = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert where(back) == {0}
    # What came from a GPU goes back onto one; training goes on (a new generator: a CPU one cannot draw there).
    out = await kernel.run("print(state_digest() == before, big.device, next(model.parameters()).device)\n"
                           "gen = torch.Generator(device='cuda').manual_seed(1)\n"
                           "print(len(train(model, opt, gen, 3)))", timeout=120)
    assert out.split() == ["True", "cuda:0", "cuda:0", "3"], out


async def test_a_gpu_kernel_goes_back_from_the_cpu_to_its_own_process_on_the_gpu(jp_fetch, kernel):
    pid = await build(kernel, gib=1, gpus=1)
    assert (await kernel.run(REFERENCE, timeout=120)).split() == ["True"]
    reference = await kernel.run("print(reference)")
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded", op
    await kernel.run("after = 1")
    assert (await api(jp_fetch, "kernels", kernel.id))["back_until"]

    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "succeeded" and op["to_gpu"] == 0, op
    assert {"dump", "restore", "remap", "unlock", "unstash", "adopt"} <= set(op["timings"]), op
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == pid and where(pid) == {0}
    out = await kernel.run("print(state_digest() == before, big.device, 'after' in dir())", timeout=120)
    assert out.split() == ["True", "cuda:0", "False"], out
    # The process itself came back: its CUDA generator's stream included, so the losses are the source's.
    assert await kernel.run("print(train(model, opt, gen, 5))", timeout=120) == reference
