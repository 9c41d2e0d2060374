"""Transplants (engine/plans/transplant.py, kernel/transplant.py) on CPU kernels of a real server: the
notebook's objects carried into a new kernel process, the same kernel id; the dry run; refusals; and a
failure at each phase, for real, leaving the source running with its state.

The GPU suite covers CUDA kernels (tests/test_gpu.py): to the CPU and back, and between two GPUs.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (KernelSession, api, cli, notebook, operate, remote, restarted, small_tmpfs, start_kernel,
                     transplant_processes, wait_operation)

from jupyter_gpumigrate.engine import gpus

pytestmark = pytest.mark.usefixtures("criu_binary")

torch = pytest.importorskip("torch", reason="the transplant tests need PyTorch (scripts/setup.sh installs a CPU build)")

#: A notebook's state: a model trained a few steps, its optimizer, tensors and a view sharing storage,
#: NumPy, a function and a class of the notebook's own, RNG streams; and what cannot carry.
BUILD = """
import random, socket, threading
import numpy as np
import torch
torch.manual_seed(1); np.random.seed(2); random.seed(3)
torch.use_deterministic_algorithms(True)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
data, target = torch.randn(64, 8), torch.randn(64, 1)
def step():
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(data), target)
    loss.backward()
    opt.step()
    return round(loss.item(), 6)
losses = [step() for _ in range(5)]
window = data[10:20]
table = np.arange(12.0).reshape(3, 4)
import pandas as pd
frame = pd.DataFrame({"a": np.arange(5), "b": list("vwxyz")})
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
scale = 3
def scaled(x):
    return x * scale
class Point:
    def __init__(self, x):
        self.x = x
    def grown(self):
        return Point(scaled(self.x))
p = Point(2)
gen = (i for i in range(10)); next(gen)
worker = threading.Thread(target=lambda: None)
sock = socket.socket()
notes = open(__file__ if "__file__" in dir() else "/etc/hostname")
"""

#: What the source would print next, and the transplanted kernel must print the same.
CHECK = """
print([step() for _ in range(3)])
print(torch.rand(2).tolist(), np.random.rand(), random.random())
print(window.data_ptr() - data.data_ptr() == 10 * 8 * 4, opt.state_dict()["state"][0]["step"].item())
print(table.sum(), scaled(2), p.grown().x, isinstance(p.grown(), Point), torch.are_deterministic_algorithms_enabled())
print(frame["a"].sum(), "".join(frame["b"]), scaler.get_scale())
"""


async def _expected(kernel) -> str:
    """What CHECK prints in the source, without changing it (the state is saved and put back)."""
    out = await kernel.run(
        "import copy as _c, pickle as _p\n"
        "_saved = _p.dumps((model.state_dict(), opt.state_dict(), torch.get_rng_state(), np.random.get_state(), "
        "random.getstate()))\n" + CHECK +
        "_m, _o, _t, _n, _r = _p.loads(_saved); model.load_state_dict(_m); opt.load_state_dict(_o); "
        "torch.set_rng_state(_t); np.random.set_state(_n); random.setstate(_r)\n")
    return out


async def test_a_cpu_kernel_transplanted_keeps_its_objects_and_goes_on_as_the_same_kernel(jp_fetch, jp_serverapp,
                                                                                          kernel):
    await kernel.run(BUILD)
    expected = await _expected(kernel)
    count = (await kernel.execute("1")).reply["execution_count"]
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]

    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    assert {r["name"] for r in survey["left"]} == {"gen", "worker", "sock", "notes"}, survey
    reasons = {r["name"]: r["reason"] for r in survey["left"]}
    assert "generator" in reasons["gen"] and "socket" in reasons["sock"] and "open file" in reasons["notes"]
    assert {"model", "opt", "data", "window", "table", "frame", "scaler", "scaled", "Point", "p", "losses"} <= \
        {r["name"] for r in survey["carries"]}
    assert survey["to"] == "cpu" and survey["bytes"] >= 64 * 8 * 4 and survey["same_model"] is False
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == pid, "the dry run changes nothing"

    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "start", "export", "load", "dump", "switch"], op
    assert op["transplant"]["to"] == "cpu" and {r["name"] for r in op["transplant"]["left"]} == \
        {"gen", "worker", "sock", "notes"}
    seconds = op["transplant"]["seconds"]
    assert 0 < seconds["export"] and 0 < seconds["load"] and 0 < seconds["start"] < op["timings"]["switch"], seconds
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] != pid and not Path(f"/proc/{pid}").exists()

    # The same client, whose channels were never closed, goes on, in the new process.
    assert await kernel.run(CHECK) == expected
    result = await kernel.execute("print(In[1].split()[1], 'gen' in dir(), len(Out))")
    assert result.reply["execution_count"] == count + 2, "the execution count goes on (CHECK ran in between)"
    assert result.out.split() == ["random,", "False", "1"], result.out
    images = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images
    assert not images.path_for(kernel.id).exists() and images.names() == [], "no images nor folders left"
    assert not list(images.root.glob(".transplant-*"))

    # A transplanted kernel is a kernel like any other: it can be transplanted again.
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    assert {"model", "opt", "Point", "p"} <= {r["name"] for r in survey["carries"]}, survey
    assert (await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True}))["status"] == "succeeded"
    assert "5 3" in await kernel.run("print(len(losses), scale)")


# -- refusals: before anything is done ------------------------------------------------------------------


async def test_what_cannot_be_transplanted_is_refused_saying_why_and_nothing_changes(jp_fetch, jp_serverapp, kernel):
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    await kernel.run("gen = (i for i in range(3))")
    error = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_cpu": True}, expect=202)
    op = await wait_operation(jp_fetch, error)
    assert op["status"] == "failed" and op["failed_phase"] == "prepare", op
    assert "Nothing of the kernel's would carry (its own names that cannot: gen)" in op["error"], op
    for body, says in (({}, "needs to_gpu or to_cpu"), ({"to_gpu": 0, "to_cpu": True}, "needs to_gpu or to_cpu"),
                       ({"to_cpu": True, "what": 1}, "what"), ({"to_gpu": -1}, "to_gpu")):
        answer = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body=body, expect=400)
        assert says in answer["message"], (body, answer)
    if not gpus.snapshot():
        answer = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_gpu": 0},
                           expect=409)
        assert "GPU 0" in answer["message"], answer
    # What was confirmed binds: more left behind than accepted is refused.
    await kernel.run("kept = 1\nimport threading, time\nbusy = threading.Thread(target=time.sleep, args=(30,), "
                     "name='worker', daemon=True)\nbusy.start()")
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    assert any(n["name"] == "thread 'worker'" and "does not go on" in n["note"] for n in survey["notes"]), survey
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True, "accept_left": ["busy"]})
    assert op["status"] == "failed" and "Now gen would not carry, which was not in what you accepted" in op["error"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid
    assert await kernel.run("print(sum(1 for _ in gen))") == "3\n", "the generator is untouched"


async def test_a_kernel_that_is_not_ipython_is_refused_with_the_reason(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch, "echo")
    session = KernelSession(jp_serverapp, kernel_id)
    await session.ready()
    try:
        answer = await api(jp_fetch, "kernels", kernel_id, "transplant", method="POST",
                           body={"to_cpu": True, "dry_run": True}, expect=409)
        assert "cannot be transplanted: the kernel is not an IPython kernel" in answer["message"], answer
    finally:
        session.close()


# -- a failure at each phase, for real: the source runs on with its state -----------------------------


async def _source_runs_on(jp_fetch, kernel, pid: int, op: dict, phase: str, says: str) -> None:
    assert op["status"] == "failed" and op["failed_phase"] == phase, op
    assert says in op["error"], op
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid, view
    assert "5 3" in await kernel.run("print(len(losses), scale)")
    assert not transplant_processes(), "no new process is left"


async def test_no_room_is_refused_and_a_disk_filled_during_the_export_leaves_the_kernel_running(
        jp_fetch, jp_serverapp, kernel, tmp_path):
    await kernel.run(BUILD)
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    with small_tmpfs(tmp_path / "small", "24m") as small:
        provisioner.state_dir, provisioner.memory_dir = str(small), ""
        # Too much for the disk, pickled in band (a list of floats) as raw: refused before anything is done.
        await kernel.run("floats = [float(i) for i in range(4_000_000)]")
        op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
        await _source_runs_on(jp_fetch, kernel, pid, op, "prepare", "No room for the kernel's objects")

        # Room enough as it starts, but the disk fills as the kernel writes (another writer, for real).
        await kernel.run("floats = [float(i) for i in range(1_200_000)]")
        filled = asyncio.get_running_loop().run_in_executor(None, _fill_once_the_export_starts, small)
        op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
        assert await filled, "the disk was filled as the export began"
        await _source_runs_on(jp_fetch, kernel, pid, op, "export", "is full: the kernel's objects could not be written")
        (small / "filler.bin").unlink()
        assert list(small.glob("images/.transplant-*")) == [] and list(small.glob("images/*")) == []


def _fill_once_the_export_starts(small: Path) -> bool:
    """Fill the small disk as soon as the export's first file (its prelude) is there."""
    deadline = time.monotonic() + 60
    while not list(small.glob("images/.transplant-*/prelude.json")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    try:  # unbuffered: no write is left for close() to fail on
        with open(small / "filler.bin", "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * (1 << 20))
    except OSError as exc:  # the disk is full, whoever filled it last
        return exc.errno == errno.ENOSPC


async def test_objects_the_new_process_cannot_take_leave_the_source_running(jp_fetch, jp_serverapp, kernel):
    await kernel.run(BUILD)
    await kernel.run("""
import os
SOURCE = os.getpid()
class Fussy:
    def __setstate__(self, state):
        if os.getpid() != SOURCE:
            raise RuntimeError("only in the source")
        self.__dict__.update(state)
fussy = Fussy()
fussy.kept = 1
""")
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    await _source_runs_on(jp_fetch, kernel, pid, op, "load",
                          "The new kernel process could not take the objects: RuntimeError: only in the source")


async def test_a_new_process_killed_before_the_switch_brings_the_source_back_from_its_images(jp_fetch, jp_serverapp,
                                                                                            kernel):
    await kernel.run(BUILD)
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    started = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_cpu": True},
                        expect=202)
    images = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images
    op = await _kill_the_new_process_once_ready(jp_fetch, images, started)
    await _source_runs_on(jp_fetch, kernel, pid, op, "switch", "The new kernel process ended")
    assert op["timings"].keys() >= {"export", "load", "dump"}, "the source had been dumped, and was restored"
    assert not images.path_for(kernel.id).exists(), "its images went once it ran again"


async def test_the_cli_says_what_would_not_carry_asks_and_then_transplants(jp_fetch, jp_serverapp, kernel):
    await kernel.run(BUILD)
    where = remote(jp_serverapp)
    code, out, err = await cli("transplant", kernel.id[:8], "--to-cpu", "--dry-run", *where)
    assert code == 0, err
    assert "NOT carried: gen (generator): cannot pickle 'generator' object" in out, out
    assert "NOT carried: notes (_io.TextIOWrapper): an open file" in out and "model" in out
    code, out, err = await cli("transplant", kernel.id[:8], "--to-cpu", "--dry-run", "--json", *where)
    assert code == 0 and {r["name"] for r in json.loads(out)["left"]} == {"gen", "worker", "sock", "notes"}
    code, out, err = await cli("transplant", kernel.id, *where)
    assert code == 2 and "needs --to-gpu N or --to-cpu" in err, err
    # Not asked on a terminal: nothing is done without --yes.
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    code, out, err = await cli("transplant", kernel.id, "--to-cpu", *where)
    assert code == 2 and "run it with --yes" in err and "NOT carried: gen" in err, err
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == pid
    code, out, err = await cli("transplant", kernel.id, "--to-cpu", "--yes", *where)
    assert code == 0, err
    assert re.match(rf"Kernel {kernel.id} transplanted to the CPU in [\d.]+ s: \d+ objects carried into a new process "
                    r"\([\d.]+ [KMG]?B of data\); not carried: gen, worker, sock, notes\.", out), out
    assert "phase switch" in err or "switch" in err, err
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] != pid
    assert "5 3" in await kernel.run("print(len(losses), scale)")


async def test_migrate_to_cpu_in_a_cell_asks_first_and_the_next_cell_runs_in_the_new_process(jp_fetch, jp_ws_fetch,
                                                                                            jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    try:
        await tab.run(BUILD)
        pid = (await api(jp_fetch, "kernels", kernel_id))["pid"]
        out = await tab.run("%migrate --to-cpu --yes")
        assert "NOT carried: gen (generator)" in out and "starts as this cell ends" in out, out
        # Sent at once, while the transplant runs: the server holds it, then it runs in the new process.
        out = await tab.run("import os; print(len(losses), scale, os.getpid())", timeout=120)
        losses, scale, new_pid = out.split()
        view = await api(jp_fetch, "kernels", kernel_id)
        assert (losses, scale) == ("5", "3") and int(new_pid) == view["pid"] != pid, (out, view)
        ops = [op for op in await api(jp_fetch, "operations") if op["action"] == "transplant"]
        assert [op["status"] for op in ops] == ["succeeded"], ops
        assert "--to-cpu" in await tab.run("%migrate --help")
    finally:
        tab.ws.close()


# -- the server killed mid-transplant ------------------------------------------------------------------


async def test_a_server_killed_while_the_new_process_waits_loses_nothing_and_leaves_no_process(tmp_path):
    from servers import LocalServer
    from test_hibernation import notebook_running, tab_on, taken_back

    server = LocalServer(tmp_path / "server")
    try:
        server.start()
        _, kernel_id, out = await notebook_running(server, "x = 41\ndef f():\n    return x + 1\nprint(f())")
        assert out == "42"
        pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_cpu": True}, expect=202)
        deadline = time.monotonic() + 60
        while not any((f / "ready.json").exists() for f in _scratch_folders(server, kernel_id)):
            # until the new process holds the objects, and waits
            assert time.monotonic() < deadline, server.server_log()
            await asyncio.sleep(0.01)
        server.stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while transplant_processes():
            assert time.monotonic() < deadline, "the new process must end once its server is gone"
            await asyncio.sleep(0.1)

        server.start()
        view = taken_back(server, kernel_id)
        # The source: still running (killed before its dump), or suspended with complete images (during it).
        assert view["state"] in ("running", "suspended"), view
        tab = await tab_on(server, kernel_id)
        assert (await tab.run("print(f(), x)", timeout=120)).split() == ["42", "41"]
        tab.ws.close()
        assert server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"] == pid, "the source, not a copy"
        assert not _scratch_folders(server, kernel_id), "the next server removed the transplant's folder"
        assert not transplant_processes()
    finally:
        server.stop()  # a server that stops removes its folder in /dev/shm, now empty (SIGKILL would leave it)
        server.kill_kernels()


def _scratch_folders(server, kernel_id: str) -> list[Path]:
    folders = [server.state / "images", *Path("/dev/shm").glob("jupyter-gpumigrate-*")]
    return [f for folder in folders for f in folder.glob(f".transplant-{kernel_id}-*")]


async def test_tensors_that_came_from_a_gpu_are_marked_to_go_back_onto_one(jp_fetch, kernel, tmp_path):
    # Without a GPU here, the mark itself: a transplanted kernel's storages that its source had on a GPU.
    await kernel.run("import torch\nt = torch.arange(4.0)\nu = torch.ones(2)")
    await kernel.run("import jupyter_gpumigrate.kernel.transplant as _t\n_t._FROM_GPU.add(t.untyped_storage())")
    assert (await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True}))["status"] == "succeeded"
    out = await kernel.run("import jupyter_gpumigrate.kernel.transplant as _t\n"
                           "print(t.untyped_storage() in _t._FROM_GPU, u.untyped_storage() in _t._FROM_GPU, t.sum().item())")
    assert out.split() == ["True", "False", "6.0"], out


#: Large buffers (the host stash takes bytearrays and PyTorch storages) and their checksum.
BIG = """
import hashlib, os
blobs = [bytearray(os.urandom(1 << 20) * 48) for _ in range(3)]
weights = torch.arange(12 * 2**20, dtype=torch.float32)
def big_digest():
    return hashlib.sha256(b"".join(bytes(b) for b in blobs) + weights.clone().numpy().tobytes()).hexdigest()
print(big_digest())
"""


async def test_a_large_source_stashes_its_buffers_before_its_dump_and_takes_them_back_on_a_rollback(
        jp_fetch, jp_serverapp, kernel):
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    provisioner.host_stash_min = 10**8  # these 192 MB of bytearrays and 48 MB tensor are worth it
    await kernel.run(BUILD)
    digest = await kernel.run(BIG)
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]

    # The new process dies once it holds the objects: the source, dumped small, comes back and reads its
    # buffers back from the stash.
    started = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_cpu": True},
                        expect=202)
    images = provisioner.images
    op = await _kill_the_new_process_once_ready(jp_fetch, images, started)
    await _source_runs_on(jp_fetch, kernel, pid, op, "switch", "The new kernel process ended")
    assert "stash" in op["timings"], op
    assert await kernel.run("print(big_digest())") == digest, "the source took its buffers back, unchanged"

    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "start", "export", "load", "stash", "dump", "switch"], op
    assert op["stash"]["stashed"] >= 3 * 48 * 2**20 + 48 * 2**20, op["stash"]
    assert await kernel.run("print(big_digest())") == digest, "the new process has them all"
    assert not images.path_for(kernel.id).exists()

    # Back to the source, dumped with its stash: it reads its buffers back once restored.
    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "stash", "dump", "restore", "unstash", "adopt"], op
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == pid
    assert await kernel.run("print(big_digest())") == digest, "the source has them all again"


async def _kill_the_new_process_once_ready(jp_fetch, images, started: dict) -> dict:
    """SIGKILL the transplant's new process as soon as it holds the objects; the operation, once over."""
    deadline = time.monotonic() + 60
    while not [f for f in _scratch_folders_of(images) if (f / "ready.json").exists()]:
        assert time.monotonic() < deadline, "the new process never got ready"
        await asyncio.sleep(0.01)
    for new in transplant_processes():
        os.kill(new, signal.SIGKILL)
    return await wait_operation(jp_fetch, started)


def _scratch_folders_of(images) -> list[Path]:
    roots = [images.root, *([images.memory_root] if images.memory_root else [])]
    return [f for root in roots if root.is_dir() for f in root.glob(".transplant-*")]


async def test_a_server_killed_as_the_new_process_takes_over_leaves_one_kernel_with_its_state(tmp_path):
    from servers import LocalServer
    from test_hibernation import notebook_running, tab_on, taken_back

    server = LocalServer(tmp_path / "server")
    try:
        server.start()
        _, kernel_id, out = await notebook_running(server, "x = 41\ndef f():\n    return x + 1\nprint(f())")
        source = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_cpu": True}, expect=202)
        marker = server.state / "images" / kernel_id / "transplanted.json"
        deadline = time.monotonic() + 60
        while not marker.exists():  # the source is dumped, and the new process told to take the ports
            assert time.monotonic() < deadline, server.server_log()
            await asyncio.sleep(0.005)
        server.stop(signal.SIGKILL)

        server.start()
        view = taken_back(server, kernel_id, timeout=60)
        assert view["state"] in ("running", "suspended"), view
        tab = await tab_on(server, kernel_id)
        assert (await tab.run("print(f(), x)", timeout=120)).split() == ["42", "41"]
        tab.ws.close()
        pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        others = [p for p in transplant_processes() if p != pid]
        assert others == [], "one process is the kernel, no other is left"
        assert pid == source or not Path(f"/proc/{source}").exists()
        assert not (server.state / "images" / kernel_id).exists(), "no images are left of a kernel that runs"
        assert "transplanted into process" in server.server_log() or pid == source, server.server_log()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_the_notebooks_own_imports_folder_and_ipython_references_carry(jp_fetch, kernel, tmp_path):
    package = tmp_path / "src"
    package.mkdir()
    (package / "mymodels.py").write_text("class Net:\n    def __init__(self, size):\n        self.size = size\n")
    await kernel.run(f"""
import os, sys, torch
sys.path.append({str(package)!r})
os.chdir({str(tmp_path)!r})
os.environ["MY_SETTING"] = "on"
from mymodels import Net
net = Net(3)
ip = get_ipython()
def count():
    return get_ipython().execution_count
exit = "mine now"
ghost = torch.empty(4, device="meta")
""")
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    carries = {r["name"] for r in survey["carries"]}
    assert {"net", "Net", "ip", "count", "exit", "ghost"} <= carries and survey["left"] == [], survey
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded", op
    out = await kernel.run("print(net.size, type(net).__module__, os.getcwd(), os.environ['MY_SETTING'], "
                           "ip is get_ipython(), count() == get_ipython().execution_count, ghost.device, exit)")
    assert out.split() == ["3", "mymodels", str(tmp_path), "on", "True", "True", "meta", "mine", "now"], out


async def test_a_dry_run_queued_behind_a_failing_cell_says_so(jp_fetch, kernel):
    kernel.client.execute("import time; time.sleep(1); 1 / 0")  # the kernel drops what is queued behind an error
    await asyncio.sleep(0.2)
    answer = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True}, expect=409)
    assert "Aborted: a cell queued before this request failed" in answer["message"] and "try again" in \
        answer["message"], answer
    await asyncio.sleep(0.5)
    survey = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST",
                       body={"to_cpu": True, "dry_run": True})
    assert survey["to"] == "cpu"


async def test_a_storage_file_damaged_after_the_export_is_refused_by_the_new_process(kernel, tmp_path):
    """The storages go into files by many threads, each chunk with its checksum: a byte changed between the
    export and the load is found, and the new process refuses the objects (the server then keeps the source
    running, as for any object the new process cannot take: above)."""
    folder = tmp_path / "objects"
    folder.mkdir()
    said = await kernel.run("import torch\nt = torch.arange(2**20, dtype=torch.float32)\nx = [t, t[:5]]\n"
                            f"import jupyter_gpumigrate.kernel.transplant as _t\nprint(_t.export({str(folder)!r}))")
    assert json.loads(said)["bytes"] >= 4 * 2**20, said
    parts = sorted(p.name for p in folder.glob("storage-*.bin"))
    # Under one chunk in all: one thread, one file. t's storage first (both tensors share it: written once),
    # then the RNG state's.
    assert parts == ["storage-00.bin"], parts
    assert 4 * 2**20 < (folder / parts[0]).stat().st_size < 4 * 2**20 + 2**16
    load = [sys.executable, "-c", "import pathlib, torch; from jupyter_gpumigrate.kernel import transplant as t; "
            f"ns = {{}}; t.load(pathlib.Path({str(folder)!r}), ns); "
            "print(ns['t'].equal(torch.arange(2**20, dtype=torch.float32)), ns['x'][1].untyped_storage().data_ptr() "
            "== ns['t'].untyped_storage().data_ptr())"]
    whole = subprocess.run(load, capture_output=True, text=True, timeout=120)
    assert whole.returncode == 0 and whole.stdout.split() == ["True", "True"], whole.stderr
    with open(folder / parts[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    damaged = subprocess.run(load, capture_output=True, text=True, timeout=120)
    assert damaged.returncode != 0, damaged.stdout
    assert ("OSError: the objects' files are damaged: storage-00.bin at byte 0: its checksum does not match"
            in damaged.stderr), damaged.stderr


async def test_a_kernel_killed_as_it_writes_its_storages_leaves_no_files_and_no_new_process(
        jp_fetch, jp_serverapp, kernel):
    """An attack: the source SIGKILLed while its threads write the storages' files. Its state is lost (the
    attacker killed it), but nothing of the transplant is left behind: no objects' folder, no new process;
    and the server says what happened."""
    await kernel.run("import torch\nbig = [torch.ones(2**27) for _ in range(8)]")  # 4 GiB, 8 storages
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    provisioner.memory_dir = ""  # the objects' folder on disk, where this test looks for it
    roots = [provisioner.images.root]
    started = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_cpu": True},
                        expect=202)
    deadline = time.monotonic() + 60
    while not [p for root in roots for p in root.glob(".transplant-*/storage-*.bin")]:
        assert time.monotonic() < deadline, "the export never began writing the storages"
        await asyncio.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    op = await wait_operation(jp_fetch, started, timeout=120)
    assert op["status"] == "failed" and op["failed_phase"] == "export", op
    assert "stopped answering while it wrote its objects" in op["error"], op
    assert not [p for root in roots for p in root.glob(".transplant-*")], "the objects' folder is removed"
    assert not transplant_processes(), "the new process is stopped"
    await restarted(jp_serverapp, kernel.id, pid)


async def test_a_kernel_shut_down_during_a_transplant_stops_it_before_the_source_is_touched(jp_fetch, jp_serverapp,
                                                                                            kernel):
    """Shutting the kernel down (its tab closed, the panel, DELETE) while its objects are being written ends the
    transplant there, undone, instead of carrying them first: no new process, no objects' folder, no source."""
    await kernel.run(BUILD + "\nbig = torch.ones(300_000_000)\nprint('ok')")
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    images = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images
    started = await api(jp_fetch, "kernels", kernel.id, "transplant", method="POST", body={"to_cpu": True},
                        expect=202)
    deadline = time.monotonic() + 60
    while not transplant_processes():  # the new process starts as the export begins
        assert time.monotonic() < deadline, "the transplant's new process never started"
        await asyncio.sleep(0.01)
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    op = await wait_operation(jp_fetch, started)
    assert op["status"] == "failed" and "shut down" in op["error"], op
    assert op["failed_phase"] in ("export", "load", "stash"), op
    assert "dump" not in op["timings"], "stopped before the source was saved"
    assert not transplant_processes(), "no new process is left"
    assert not Path(f"/proc/{pid}").exists(), "the source was shut down"
    assert not _scratch_folders_of(images), "no objects' folder is left"
    assert not images.path_for(kernel.id).exists()


def test_the_new_process_never_says_starting_even_after_other_statuses() -> None:
    """ipykernel publishes "starting" as its kernel starts; the server's nudge may be answered (busy, idle)
    before that. Every "starting" of the new process is said as "idle", whatever came first."""
    from jupyter_gpumigrate.kernel.transplant import _go_on_idle

    class Kernel:  # ipykernel's Kernel, as far as _go_on_idle touches it
        def __init__(self) -> None:
            self.said: list[str] = []

        def _publish_status(self, status: str, channel: str, parent: object = None) -> None:
            self.said.append(status)

    kernel = Kernel()
    _go_on_idle(kernel)
    for status in ("busy", "idle", "starting", "busy", "idle"):
        kernel._publish_status(status, "shell")
    assert kernel.said == ["busy", "idle", "idle", "busy", "idle"]
