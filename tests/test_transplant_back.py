"""Going back after a transplant (engine/plans/back.py): the process a transplant replaced is kept for a while,
and the kernel can go back to it, losing what it did since. Real server, kernels and CRIU, CPU kernels; the
failures are made for real (a PID of the source taken, its images damaged, its time up).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from helpers import api, cli, hold_pid, notebook, operate, remote, start_busy
from test_hibernation import collect_exited, criu_of, notebook_running, tab_on, taken_back
from test_suspend_resume import _kill_criu_restore_once_tree_is_back
from test_transplant import BUILD

from jupyter_gpumigrate.engine import proctree
from jupyter_gpumigrate.engine.images import KEPT
from jupyter_gpumigrate.retention import expire_sources

pytestmark = pytest.mark.usefixtures("criu_binary")

pytest.importorskip("torch", reason="the transplant tests need PyTorch (scripts/setup.sh installs a CPU build)")

#: What the kernel shows of itself: the training's losses, what the transplant could not carry (the generator
#: goes on where it was only in the source), and a name made after the transplant.
LOOK = "print(len(losses), next(gen), 'after' in dir(), marker)"


async def _transplanted(jp_fetch, kernel) -> tuple[int, dict]:
    """A kernel built and transplanted to the CPU; then changed in its new process. (source PID, view)."""
    await kernel.run(BUILD + "marker = 'source'")
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    op = await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True})
    assert op["status"] == "succeeded", op
    await kernel.run("after = 1; losses.append(0.0); marker = 'new'")
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["pid"] != pid and view["back_until"], view
    return pid, view


async def test_a_transplanted_kernel_goes_back_to_the_process_it_replaced(jp_fetch, jp_serverapp, kernel):
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    images = provisioner.images
    pid, view = await _transplanted(jp_fetch, kernel)
    kept = images.root / KEPT / kernel.id
    assert kept.is_dir() and not (kept / "transplanted.json").exists(), "kept on disk, without the switch's marker"
    assert view["back_until"] > time.strftime("%Y-%m-%dT%H:%M", time.gmtime(time.time() + 3500))
    new_pid = view["pid"]

    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "dump", "restore", "adopt"], op
    after = await api(jp_fetch, "kernels", kernel.id)
    assert after["pid"] == pid and after["state"] == "running" and after["back_until"] is None, after
    assert not Path(f"/proc/{new_pid}").exists(), "the process it went back from is gone"
    # The same client goes on, in the source: as it was, the generator included; what came since is gone.
    assert (await kernel.run(LOOK)).split() == ["5", "1", "False", "source"]
    assert not kept.exists() and not images.path_for(kernel.id).exists() and images.names() == []

    error = await api(jp_fetch, "kernels", kernel.id, "back", method="POST", body={}, expect=409)
    assert "no earlier process to go back to" in error["message"], error
    bad = await api(jp_fetch, "kernels", kernel.id, "back", method="POST", body={"to_gpu": 1}, expect=400)
    assert "to_gpu" in bad["message"], bad


async def test_migrate_back_in_a_cell_asks_first_and_the_next_cell_runs_in_the_earlier_process(jp_fetch, jp_ws_fetch,
                                                                                               jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    try:
        out = await tab.run("try:\n    get_ipython().run_line_magic('migrate', '--back --yes')\n"
                            "except Exception as exc:\n    print(type(exc).__name__, exc)")
        assert "MigrateFailed" in out and "no earlier process to go back to" in out, out
        await tab.run(BUILD + "marker = 'source'")
        pid = (await api(jp_fetch, "kernels", kernel_id))["pid"]
        assert (await operate(jp_fetch, kernel_id, "transplant", {"to_cpu": True}))["status"] == "succeeded"
        await tab.run("marker = 'new'")
        out = await tab.run("%migrate --back --yes")
        assert "what it did since the transplant is lost" in out and "Going back as this cell ends" in out, out
        # Sent at once, while it goes back: the server holds it, then it runs in the earlier process.
        out = await tab.run("import os; print(marker, next(gen), os.getpid())", timeout=120)
        assert out.split() == ["source", "1", str(pid)], out
        ops = [op for op in await api(jp_fetch, "operations") if op["action"] == "back"]
        assert [op["status"] for op in ops] == ["succeeded"], ops
    finally:
        tab.ws.close()


async def test_a_kernel_running_a_cell_does_not_go_back(jp_fetch, jp_serverapp, kernel):
    _, view = await _transplanted(jp_fetch, kernel)
    cell = await start_busy(jp_fetch, kernel, "import time\nfor step in range(600): time.sleep(0.1)\nprint('done')")
    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "failed" and op["failed_phase"] == "prepare", op
    assert "running a cell" in op["error"] and "interrupt it" in op["error"], op
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == view["pid"]
    await jp_fetch("api", "kernels", kernel.id, "interrupt", method="POST", body="{}")
    assert (await cell).status == "error", "interrupted, in the process it ran in"
    assert (await kernel.run("print(marker)")).strip() == "new"


async def test_a_pid_of_the_source_taken_refuses_and_the_kernel_runs_on(jp_fetch, jp_serverapp, kernel):
    images = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images
    pid, view = await _transplanted(jp_fetch, kernel)
    holder = hold_pid(pid)
    try:
        op = await operate(jp_fetch, kernel.id, "back")
        assert op["status"] == "failed" and op["failed_phase"] == "prepare", op
        assert f"PID {pid}" in op["error"] and "runs on, unchanged" in op["error"], op
        assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == view["pid"]
        assert (await kernel.run("print(marker, after)")).split() == ["new", "1"]
        # The back moved the PID cursor past the source's numbers before it started a thread: none of the
        # server's threads (nor anything else) took one of the others meanwhile.
        source = images.read_manifest_at(images.kept(kernel.id)[0])
        assert proctree.first_holder([i for i in source.ids if i != pid]) is None
    finally:
        holder.stop()
    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "succeeded", op
    assert (await kernel.run("print(marker)")).strip() == "source"


async def test_damaged_source_images_bring_the_current_process_back_whole(jp_fetch, jp_serverapp, kernel):
    images = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images
    _, view = await _transplanted(jp_fetch, kernel)
    kept = images.root / KEPT / kernel.id
    for core in kept.glob("core-*.img"):  # CRIU cannot recreate the source's processes without them
        core.write_bytes(b"\0" * 16)

    op = await operate(jp_fetch, kernel.id, "back")
    assert op["status"] == "failed" and op["failed_phase"] == "restore", op
    assert "dump" in op["timings"], "the current process had been dumped, and was restored from its images"
    now = await api(jp_fetch, "kernels", kernel.id)
    assert now["state"] == "running" and now["pid"] == view["pid"], now
    assert (await kernel.run("print(marker, after, len(losses))")).split() == ["new", "1", "6"]
    assert not images.path_for(kernel.id).exists(), "the current process's images went once it ran again"


async def test_criu_killed_while_it_restores_the_source_brings_the_current_process_back_whole(jp_fetch, kernel):
    await kernel.run("blob = bytes(range(256)) * 4_000_000")  # a while for CRIU to restore, once it forked
    source, view = await _transplanted(jp_fetch, kernel)
    for _ in range(3):
        killer = asyncio.get_running_loop().run_in_executor(None, _kill_criu_restore_once_tree_is_back, source, 60)
        op = await operate(jp_fetch, kernel.id, "back")
        if await killer and op["status"] == "failed":
            break
        assert op["status"] == "succeeded", op  # the restore won the race: transplant again, try again
        assert (await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True}))["status"] == "succeeded"
        await kernel.run("after = 1; marker = 'new'")
        view = await api(jp_fetch, "kernels", kernel.id)
    else:
        pytest.skip("CRIU restored the source before it could be killed, three times")
    assert op["failed_phase"] == "restore" and "killed by SIGKILL" in op["error"], op
    now = await api(jp_fetch, "kernels", kernel.id)
    assert now["state"] == "running" and now["pid"] == view["pid"] and now["back_until"], now
    assert not Path(f"/proc/{source}").exists(), "nothing of the half-restored source is left"
    assert (await kernel.run("print(marker, after, len(blob))")).split() == ["new", "1", str(256 * 4_000_000)]
    assert (await operate(jp_fetch, kernel.id, "back"))["status"] == "succeeded", "it can still go back"
    assert (await kernel.run("print(marker)")).strip() == "source"


async def test_the_source_is_kept_only_for_its_time_and_goes_with_a_shutdown(jp_fetch, jp_serverapp, kernel):
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    images, operations = provisioner.images, jp_serverapp.web_app.settings["gpumigrate_operations"]
    provisioner.keep_transplant_source = 1.0
    await _transplanted(jp_fetch, kernel)
    kept = images.root / KEPT / kernel.id
    assert kept.is_dir()
    time.sleep(1.2)
    assert (await api(jp_fetch, "kernels", kernel.id))["back_until"] is None
    error = await api(jp_fetch, "kernels", kernel.id, "back", method="POST", body={}, expect=409)
    assert "keep_transplant_source" in error["message"], error
    assert await expire_sources(images, operations) == [kernel.id] and not kept.exists()

    provisioner.keep_transplant_source = 3600.0
    assert (await operate(jp_fetch, kernel.id, "transplant", {"to_cpu": True}))["status"] == "succeeded"
    assert kept.is_dir() and await expire_sources(images, operations) == [], "in its time, it stays"
    await jp_fetch("api", "kernels", kernel.id, "restart", method="POST", body="{}")
    assert kept.is_dir(), "restarted (after a crash, say), the kernel may still go back"
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    assert not kept.exists(), "shut down: nothing to go back to"


async def test_the_cli_says_what_is_lost_and_asks_first(jp_fetch, jp_serverapp, kernel):
    where = remote(jp_serverapp)
    code, out, err = await cli("back", kernel.id, *where)
    assert code == 1 and "no earlier process to go back to" in err, err
    pid, view = await _transplanted(jp_fetch, kernel)
    code, out, err = await cli("back", kernel.id[:8], *where)
    assert code == 2 and "is lost" in err and "run it with --yes" in err, err
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == view["pid"], "nothing was done"
    code, out, err = await cli("back", kernel.id[:8], "--yes", *where)
    assert code == 0, err
    assert f"Kernel {kernel.id} went back to the process its transplant replaced in" in out, out
    assert (await api(jp_fetch, "kernels", kernel.id))["pid"] == pid
    assert (await kernel.run("print(marker)")).strip() == "source"


@pytest.mark.parametrize("when", ["source half restored", "source reading its stash", "source adopted"])
async def test_a_server_killed_while_the_kernel_goes_back_loses_nothing(process_server, when):
    """Half restored, or restored and reading back the buffers it stashed as it left (held there, stopped):
    the next server stops what CRIU made of the source and takes the current process back from its images
    (the source stays kept). Adopted: the next server adopts the source."""
    server = process_server
    assert proctree.become_subreaper()  # the init of what its servers leave (collect_exited)
    server.start()
    # Some 400 MB: in CRIU's pages (bytes), or, a bytearray, in the stash (over the server's host_stash_min).
    blob = "bytearray(bytes(range(256)) * 1_600_000)" if when == "source reading its stash" else \
        "bytes(range(256)) * 1_600_000"
    _, kernel_id, out = await notebook_running(server, f"x = 41\nblob = {blob}\nprint('ok')")
    assert out == "ok"
    source = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    assert server.operate(kernel_id, "transplant", {"to_cpu": True})["status"] == "succeeded"
    tab = await tab_on(server, kernel_id)
    await tab.run("x = 99")
    tab.ws.close()

    op = server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/back", {}, expect=202)
    phase = {"source half restored": "restore", "source reading its stash": "unstash"}.get(when, "adopt")
    deadline = time.monotonic() + 120
    while op["phase"] != phase:
        assert op["status"] in ("pending", "running") and time.monotonic() < deadline, op
        op = server.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    if phase == "unstash":
        os.kill(source, signal.SIGSTOP)  # its reading stops there (the next server kills it, stopped)
        assert "stash" in op["timings"] and "restore" in op["timings"], op
    elif phase == "restore":
        criu = criu_of(server.proc.pid, b"restore", 5)
        assert criu is not None, "CRIU's restore had ended before it was seen: make the kernel bigger"
        while not proctree.is_alive(source):
            assert proctree.is_alive(criu), "CRIU ended before the source's process was seen: make it bigger"
            time.sleep(0.001)
    else:  # once the mark in the current process's images says the back is complete
        marker = server.state / "images" / kernel_id / "transplanted.json"
        while "started" not in (marker.read_text() if marker.is_file() else ""):
            assert time.monotonic() < deadline, "the back was never marked complete"
            time.sleep(0.001)
    server.stop(signal.SIGKILL)
    collect_exited(source)

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] in ("running", "suspended"), view
    if phase in ("restore", "unstash"):
        assert not proctree.is_alive(source), "what CRIU had made of the source is stopped"
        left = server.kernel_processes()
        assert view["state"] == "suspended" and left == {}, (view, left)
        assert view["back_until"] is None  # suspended: a back starts from a running kernel
    else:
        assert view["pid"] == source and view["state"] == "running", view
    tab = await tab_on(server, kernel_id)  # a cell resumes a suspended kernel
    expected = "99" if phase in ("restore", "unstash") else "41"
    assert (await tab.run("print(x, len(blob))", timeout=120)).split() == [expected, str(256 * 1_600_000)]
    tab.ws.close()
    if phase in ("restore", "unstash"):  # the source stayed kept: the kernel can still go back
        assert server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["back_until"]
        collect_exited(source)  # what the new server killed came to this process, the subreaper
        op = server.operate(kernel_id, "back")
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        tab = await tab_on(server, kernel_id)
        assert (await tab.run("print(x)", timeout=120)).strip() == "41"
        tab.ws.close()
