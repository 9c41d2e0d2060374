"""The kernel side and the drain on real GPUs (the `gpu` suite): `jupyter gpumigrate drain` there and back,
a drain that cannot move a kernel, the widget's Migrate button, `%migrate --suspend` of a GPU kernel, and
a broken CUDA context. Skipped with the reason where NVML sees no GPU (conftest); the kernels are real
IPython kernels with PyTorch started by a real server, and NVML, read in this process, says where they are.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest
from helpers import KernelSession, ThisServer, Widgets, api, cli, operate, remote, server_sees_idle, start_kernel, \
    wait_operation, wait_suspended
from test_gpu import GIB, build, where

from jupyter_gpumigrate.engine import gpus as gpus_mod
from jupyter_gpumigrate.engine.plans import PHASES
from jupyter_gpumigrate_client.hub.policy import IdlePolicy

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("criu_binary")]


def fill_other_gpus(keep_free: int = GIB) -> list[subprocess.Popen]:
    """Processes that fill every GPU but 0 until ``keep_free`` bytes are left: no kernel from GPU 0 fits."""
    fillers = []
    for gpu in gpus_mod.snapshot()[1:]:
        free = gpu.memory_total - gpu.memory_used
        fill = (f"import torch, time; x = torch.empty({free - keep_free}, dtype=torch.uint8, device='cuda:{gpu.index}'); "
                "print('full', flush=True); time.sleep(600)")
        fillers.append(subprocess.Popen([sys.executable, "-c", fill], stdout=subprocess.PIPE, text=True))
    for filler in fillers:
        assert filler.stdout.readline().strip() == "full"
    return fillers


async def test_drain_from_the_command_line_and_back(jp_fetch, jp_serverapp, kernel):
    pid = await build(kernel)
    code, out, err = await cli("drain", "--gpu", "0", "--json", *remote(jp_serverapp))
    assert code == 0, (out, err)
    op = json.loads(out)
    assert op["status"] == "succeeded" and op["gpu"] == 0, op
    assert [r["kernel_id"] for r in op["results"]] == [kernel.id] and len(op["children"]) == 1
    [result] = op["results"]
    assert result["status"] == "succeeded" and result["to_gpu"] not in (None, 0), result
    away = result["to_gpu"]
    assert where(pid) == {away}, "NVML shows the kernel on the GPU its result names, and only there"
    assert (await kernel.run("print(state_digest() == before)")).strip() == "True"

    # Back with --to-gpu 0, in text: one progress line per change of the kernel's result on stderr.
    code, out, err = await cli("drain", "--gpu", str(away), "--to-gpu", "0", *remote(jp_serverapp))
    assert code == 0, (out, err)
    assert f"  kernel {kernel.id}: moved to GPU 0" in err.splitlines(), err
    assert re.fullmatch(rf"GPU {away} drained: 1 kernel\(s\) moved to GPU 0 in \d+\.\d\d s\.", out.strip()), out
    back = [o for o in await api(jp_fetch, "operations") if o["action"] == "drain" and o["gpu"] == away]
    assert [r["to_gpu"] for r in back[-1]["results"]] == [0] and back[-1]["status"] == "succeeded"
    assert where(pid) == {0}
    assert (await kernel.run("print(state_digest() == before, len(train(model, opt, gen, 3)))")).split() == ["True", "3"]


async def test_a_kernel_a_drain_cannot_move_is_reported_and_runs_on(jp_fetch, jp_serverapp, kernel):
    pid = await build(kernel)
    fillers = fill_other_gpus()
    try:
        code, out, err = await cli("drain", "--gpu", "0", *remote(jp_serverapp))
    finally:
        for filler in fillers:
            filler.kill()
            filler.wait(timeout=30)
    assert code == 1, (out, err)
    line = next((ln for ln in err.splitlines() if ln.startswith(f"  kernel {kernel.id}: NOT moved: ")), None)
    assert line is not None and "free and the kernel needs" in line, err
    assert "GPU 0 not drained: 0 of 1 kernel(s) moved" in out, out
    [op] = [o for o in await api(jp_fetch, "operations") if o["action"] == "drain"]
    assert op["status"] == "failed" and "0 of 1 kernels left GPU 0" in op["error"], op
    [result] = op["results"]
    assert result["kernel_id"] == kernel.id and result["status"] == "failed", result
    assert re.search(r"GPU \d+ has \d+\.\d GB free and the kernel needs \d+\.\d GB", result["error"]), result
    assert not op["children"], "no move was started for it"
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid and where(pid) == {0}
    assert (await kernel.run("print(state_digest() == before, len(train(model, opt, gen, 3)))")).split() == ["True", "3"]


async def test_the_widgets_migrate_button_moves_the_kernel(jp_fetch, kernel):
    pid = await build(kernel)
    result = await kernel.execute("%migrate")
    assert result.status == "ok", result.errors
    widgets = Widgets(kernel, result.messages)
    part = widgets.picker()
    labels = widgets.models[part["target"]]["_options_labels"]
    assert not [label for label in labels if label.startswith("GPU 0 ")], "the kernel's own GPU is no target"
    index = next(i for i, label in enumerate(labels) if label.startswith("GPU 1 "))
    assert not widgets.models[part["button"]]["disabled"]
    # As a frontend does: the pick, then the click (the kernel handles them in this order).
    widgets.update(part["target"], index=index)
    widgets.click(part["button"])
    await widgets.until(lambda m: m[part["progress"]]["bar_style"] in ("success", "danger")
                        and not m[part["message"]]["value"].endswith("…"), timeout=300)
    message = widgets.models[part["message"]]["value"]
    assert widgets.models[part["progress"]]["bar_style"] == "success", message
    assert message.startswith("Moved from GPU 0 to GPU 1:"), message
    values = [u["value"] for u in widgets.history[part["progress"]] if "value" in u]
    assert values and values[-1] == len(PHASES['move_to_gpu']) and values == sorted(values), values
    assert any(0 < v < len(PHASES['move_to_gpu']) for v in values), f"the bar followed no phase: {values}"
    assert where(pid) == {1}, "NVML shows the kernel on GPU 1 only"
    moves = [o for o in await api(jp_fetch, "operations") if o["kernel_id"] == kernel.id]
    assert [(o["action"], o["to_gpu"], o["status"]) for o in moves] == [("migrate", 1, "succeeded")]
    assert (await kernel.run("print(state_digest() == before, big.device)")).split() == ["True", "cuda:0"]


async def test_migrate_suspend_of_a_gpu_kernel_resumed_on_the_other_gpu(jp_fetch, kernel):
    pid = await build(kernel)
    cell = asyncio.ensure_future(kernel.execute("%migrate --suspend\nafter = 'went on'", timeout=300))
    view = await wait_suspended(jp_fetch, kernel.id, cell, 240)
    assert where(pid) == set() and view["image_bytes"] > GIB
    resumed = await operate(jp_fetch, kernel.id, "resume", {"to_gpu": 1})
    assert resumed["status"] == "succeeded" and resumed["to_gpu"] == 1, resumed
    result = await cell
    assert result.status == "ok", result.errors
    line = result.out.strip()
    assert re.fullmatch(r"Suspended for \d+\.\d s \(\d+\.\d GB of images\); resumed on GPU 1( in \d+\.\d\d s)?\. "
                        r"Everything in memory is as it was\.", line), line
    assert where(pid) == {1}
    out = await kernel.run("print(state_digest() == before, big.device, after)")
    assert out.split() == ["True", "cuda:0", "went", "on"]


async def test_a_broken_cuda_context_is_one_sentence_and_nothing_moves(jp_fetch, kernel):
    pid = await build(kernel)
    # An index out of bounds on the GPU: a device-side assert, an error that sticks to the CUDA context.
    out = await kernel.run(
        "try:\n"
        "    torch.zeros(4, device='cuda')[torch.tensor([9], device='cuda')].sum().item()\n"
        "except RuntimeError as exc:\n"
        "    print('device-side assert' in str(exc))"
    )
    assert out.strip() == "True", out
    result = await kernel.execute("%migrate --to-gpu 1")
    assert result.status == "error" and result.reply["ename"] == "MigrateFailed", result.reply
    text = "\n".join(result.errors)
    assert "PyTorch's CUDA context reports an error" in text and "restart the kernel" in text, text
    assert "Traceback" not in text and 'File "' not in text and len(text.splitlines()) == 1, text
    assert not [o for o in await api(jp_fetch, "operations") if o["kernel_id"] == kernel.id], "nothing was asked"
    assert where(pid) == {0}


async def test_a_drain_that_may_transplant_carries_to_the_cpu_what_the_driver_cannot_move(jp_fetch, jp_serverapp,
                                                                                           kernel):
    """The drain's opt-in transplant (the Hub's drain passes it on): no other GPU has room for the kernel (or
    there is none), so its objects go to the CPU, every value kept; a kernel that would lose a generator
    stays where it is, running, and its result names what would be lost."""
    await build(kernel, gpus=1)
    other_id = await start_kernel(jp_fetch)
    other = KernelSession(jp_serverapp, other_id)
    await other.ready()
    fillers: list[subprocess.Popen] = []
    try:
        made = await other.run("import torch\nt = torch.ones(1000, device='cuda')\ndef count():\n    yield from range(5)\n"
                               "g = count()\nprint(next(g))", timeout=120)
        assert made.strip() == "0", made
        other_pid = (await api(jp_fetch, "kernels", other_id))["pid"]
        fillers = fill_other_gpus()
        code, out, err = await cli("drain", "--gpu", "0", "--transplant", *remote(jp_serverapp))
        assert code == 1, (out, err)
        assert f"  kernel {kernel.id}: transplanted to the CPU" in err.splitlines(), err
        assert "GPU 0 not drained: 1 of 2 kernel(s) moved" in out, out
        [op] = [o for o in await api(jp_fetch, "operations") if o["action"] == "drain"]
        results = {r["kernel_id"]: r for r in op["results"]}
        moved, stayed = results[kernel.id], results[other_id]
        assert moved["status"] == "succeeded" and moved["way"] == "transplant" and moved["to_gpu"] is None, moved
        assert stayed["status"] == "failed" and stayed["way"] == "transplant", "the way last tried: " + str(stayed)
        assert "a transplant would lose g (" in stayed["error"] and "It runs on, on GPU 0." in stayed["error"], stayed
        assert len(op["children"]) == 1
    finally:
        for filler in fillers:
            filler.kill()
            filler.wait(timeout=30)
        try:
            view = await api(jp_fetch, "kernels", other_id)
            assert view["pid"] == other_pid and where(other_pid) == {0}, "the kernel left behind is untouched"
            assert (await other.run("print(next(g), t.device)")).split() == ["1", "cuda:0"]
        finally:
            other.close()
    new = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert where(new) == set(), "the transplanted kernel holds no GPU"
    out = await kernel.run("print(state_digest() == before, big.device)", timeout=120)
    assert out.split() == ["True", "cpu"], out


async def test_the_idle_policy_transplants_an_idle_gpu_kernel_to_the_cpu(jp_fetch, kernel):
    """The Hub's --idle-to-cpu, on a real server: the idle GPU kernel's objects all carry, so it goes on
    on the CPU with every value, its GPU freed, instead of being suspended."""
    pid = await build(kernel, gpus=1)
    await server_sees_idle(jp_fetch, kernel)
    [decision] = await IdlePolicy(minutes=0, grace_minutes=0, to_cpu=True).run_once(ThisServer(jp_fetch))
    assert decision["action"] == "transplant" and decision["reason"].endswith(
        "transplanted to the CPU, where every object of it carries"), decision
    op = await wait_operation(jp_fetch, await api(jp_fetch, "operations", decision["operation"]), timeout=300)
    assert op["action"] == "transplant" and op["status"] == "succeeded" and op["to_gpu"] is None, op
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] != pid and where(view["pid"]) == set() and view["gpus"] == []
    out = await kernel.run("print(state_digest() == before, big.device)", timeout=120)
    assert out.split() == ["True", "cpu"], out
