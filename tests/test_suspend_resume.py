"""Suspend and resume real kernels of a real server with real CRIU."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import (
    BUILD_STATE,
    CHECK_STATE,
    EXPECTED,
    OPEN_IO_URING,
    KernelSession,
    WebSocketTab,
    api,
    hold_pid,
    notebook,
    operate,
    resident,
    restarted,
    start_kernel,
)

pytestmark = pytest.mark.usefixtures("criu_binary")


async def test_round_trip_keeps_every_kind_of_state(jp_fetch, jp_serverapp, kernel, tmp_path):
    data_file = tmp_path / "notes.txt"
    assert "built" in await kernel.run(f"PATH = {str(data_file)!r}\n" + BUILD_STATE)
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]

    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert set(op["timings"]) == {"prepare", "dump"} and op["bytes"] > 1_000_000
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and view["pid"] is None and view["image_bytes"] == op["bytes"]
    assert not Path(f"/proc/{pid}").exists(), "the kernel process must be gone while suspended"

    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images" / kernel.id
    assert stat.S_IMODE(images.stat().st_mode) == 0o700
    manifest = json.loads((images / "manifest.json").read_text())
    assert manifest["kernel_id"] == kernel.id and manifest["kernel_name"] == "python3"
    assert manifest["criu_version"].startswith("4.") and manifest["image_bytes"] == op["bytes"]
    assert pid in manifest["ids"] and "key" not in manifest["connection_info"]
    assert manifest["host"] and manifest["gpus"] == [] and manifest["created"] > 0
    assert "inventory.img" in manifest["files"] and sum(manifest["files"].values()) <= manifest["image_bytes"]

    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "restore", "adopt"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid  # CRIU gives the same PID back
    assert not images.exists(), "images are deleted once the kernel runs again"

    # The same client, whose channels were never closed, goes on.
    out = (await kernel.run(CHECK_STATE)).splitlines()
    assert out == EXPECTED

    # And again: a kernel restored once (no longer the server's child by birth) suspends and resumes,
    # with a child process of its own this time (it becomes the server's orphan at the dump).
    await kernel.run("import subprocess; child = subprocess.Popen(['sleep', '600'])")
    for _ in range(2):
        assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(next(gen), x + 1, child.poll())")).split() == ["7", "42", "None"]


async def test_notebook_websocket_keeps_working(jp_fetch, jp_ws_fetch, jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    assert (await tab.run("secret = 'kept'; print('set')")).strip() == "set"
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel_id, "resume"))["status"] == "succeeded"
    assert (await tab.run("print(secret)")).strip() == "kept"
    tab.ws.close()


async def test_any_kernelspec_not_only_ipython(jp_fetch, jp_serverapp):
    # pytest-jupyter's echo kernel: another kernelspec and another kernel class.
    kernel_id = await start_kernel(jp_fetch, "echo")
    session = KernelSession(jp_serverapp, kernel_id)
    await session.ready()
    assert (await api(jp_fetch, "kernels", kernel_id))["name"] == "echo"
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel_id, "resume"))["status"] == "succeeded"
    reply = await session.client.execute("hello", reply=True, timeout=30)
    assert reply["content"]["status"] == "ok"
    session.close()


async def test_restarter_leaves_a_suspended_kernel_alone(jp_fetch, jp_serverapp, kernel):
    await kernel.run("kept = 'yes'")
    manager = jp_serverapp.kernel_manager.get_kernel(kernel.id)
    assert manager.autorestart and manager._restarter is not None
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    # The restarter polls every time_to_dead seconds and would start a new kernel on a dead one.
    await asyncio.sleep(manager._restarter.time_to_dead * 2 + 0.5)
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and view["pid"] is None
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(kept)")).strip() == "yes"


async def test_culler_leaves_a_suspended_kernel_alone(jp_fetch, jp_serverapp, kernel):
    km = jp_serverapp.kernel_manager
    km.cull_idle_timeout = 1  # every kernel is "idle" after a second
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    await asyncio.sleep(1.5)
    await km.cull_kernel_if_idle(kernel.id)
    assert kernel.id in km and (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    await asyncio.sleep(1.5)  # the resume itself was activity
    await km.cull_kernel_if_idle(kernel.id)  # a running idle kernel is culled as before
    assert kernel.id not in km


async def test_delete_a_suspended_kernel_removes_its_images(jp_fetch, jp_serverapp, kernel):
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images" / kernel.id
    assert images.is_dir()
    response = await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    assert response.code == 204
    assert not images.exists()
    await api(jp_fetch, "kernels", kernel.id, expect=404)


async def test_restart_a_suspended_kernel_starts_afresh(jp_fetch, jp_serverapp, kernel):
    await kernel.run("gone = 1")
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    await jp_fetch("api", "kernels", kernel.id, "restart", method="POST", body="{}")
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"]
    await kernel.ready()
    assert (await kernel.run("print('gone' in dir())")).strip() == "False"


async def test_failed_dump_leaves_the_kernel_running(jp_fetch, kernel):
    await kernel.run(OPEN_IO_URING + "value = 'still here'")  # the failure is CRIU's own
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump"
    assert "CRIU could not dump" in op["error"] and "Full log:" in op["error"]
    assert "The kernel runs on, unchanged" in op["error"] and "try again" in op["error"]
    log_file = Path(op["error"].split("Full log: ")[1].split()[0].rstrip("."))
    assert log_file.is_file() and "Error" in log_file.read_text(), "the log the error names is kept"
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid and view["image_bytes"] is None
    assert not (log_file.parent.parent / kernel.id).exists(), "the rollback removed the half-written images"
    assert (await kernel.run("print(value)")).strip() == "still here"
    await kernel.run("os.close(ring)")
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"


async def test_failed_restore_keeps_the_images_and_says_how_to_retry(jp_fetch, kernel, tmp_path):
    data_file = tmp_path / "held-open.txt"
    data_file.write_text("content")
    await kernel.run(f"held = open({str(data_file)!r}); marker = 'survived'")
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    moved = tmp_path / "moved-away.txt"
    data_file.rename(moved)

    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "failed" and op["failed_phase"] == "restore"
    assert str(data_file) in op["error"] and "resume again" in op["error"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and view["image_bytes"] > 0

    moved.rename(data_file)
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(marker, held.read())")).strip() == "survived content"


async def test_resume_names_a_pid_taken_meanwhile_then_works(jp_fetch, kernel):
    await kernel.run("answer = 42")
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    holder = hold_pid(pid)
    try:
        op = await operate(jp_fetch, kernel.id, "resume")
        assert op["status"] == "failed" and op["failed_phase"] == "prepare"
        assert f"PID {pid}" in op["error"] and "'sleep'" in op["error"] and "resume again" in op["error"]
        assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
    finally:
        holder.stop()
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(answer)")).strip() == "42"


async def test_no_operation_starts_on_a_kernel_being_shut_down(jp_fetch, jp_serverapp, kernel):
    # An attack: a suspend asked a moment after the kernel's DELETE began was accepted, and failed saying that
    # "Jupyter restarts it". The kernel is held still (SIGSTOP) so that its shutdown lasts.
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    manager = jp_serverapp.kernel_manager.get_kernel(kernel.id)
    os.kill(pid, signal.SIGSTOP)
    try:
        deleting = asyncio.ensure_future(jp_fetch("api", "kernels", kernel.id, method="DELETE"))
        deadline = time.monotonic() + 30
        while not manager.shutting_down:
            assert time.monotonic() < deadline and not deleting.done(), "the shutdown did not begin"
            await asyncio.sleep(0.01)
        for action in ("suspend", "migrate"):
            body = {"to_host": "elsewhere"} if action == "migrate" else {}
            error = await api(jp_fetch, "kernels", kernel.id, action, method="POST", body=body, expect=409)
            assert error["message"] == (f"Kernel {kernel.id} is being shut down (or restarted): no {action} starts "
                                        "now. Start it again, or wait for its restart, then try again."), error
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await deleting).code == 204
    assert kernel.id not in [k["id"] for k in json.loads((await jp_fetch("api", "kernels")).body)]


async def test_bad_requests(jp_fetch, jp_serverapp, kernel):
    await api(jp_fetch, "kernels", "no-such-kernel", expect=404)
    await api(jp_fetch, "kernels", "no-such-kernel", "suspend", method="POST", expect=404)
    await api(jp_fetch, "operations", "no-such-operation", expect=404)
    error = await api(jp_fetch, "kernels", kernel.id, "resume", method="POST", expect=409)
    assert "running" in error["message"]
    for body, words in [
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ({"to_gpu": "one"}, "whole number"),
        ({"to_gpu": -1}, "whole number"),
        ({"to_gpu": True}, "whole number"),
        ({"gpu": 1}, "Unknown field"),
    ]:
        error = await api(jp_fetch, "kernels", kernel.id, "resume", method="POST", body=body, expect=400)
        assert words in error["message"], error
    error = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", body={"to_gpu": 0}, expect=400)
    assert "Unknown field" in error["message"]

    first = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202)
    error = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=409)
    assert f"already has an operation under way (its suspend, operation {first['id']})" in error["message"] or \
        "suspended" in error["message"], error
    from helpers import wait_operation

    assert (await wait_operation(jp_fetch, first))["status"] == "succeeded"
    error = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=409)
    assert "suspended, so it cannot be suspended. Nothing to do: it is suspended already." in error["message"], error
    error = await api(jp_fetch, "kernels", kernel.id, "resume", method="POST", body={"to_gpu": 0}, expect=409)
    assert "GPU" in error["message"]
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"


async def test_criu_missing_is_a_clear_error_and_the_kernel_runs_on(jp_fetch, jp_serverapp, kernel):
    operations = jp_serverapp.web_app.settings["gpumigrate_operations"]
    operations.criu_path = "/nonexistent/criu"
    await kernel.run("value = 7")
    error = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=503)
    assert "CRIU was not found at /nonexistent/criu" in error["message"]
    assert "ensure-criu" in error["message"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    assert (await kernel.run("print(value)")).strip() == "7"


async def test_requests_need_authentication(jp_fetch):
    # Every user route, every method it has (the peer routes have their own credential: tests/test_cross_host.py).
    from jupyter_gpumigrate.handlers import PEER, handlers

    tried = 0
    for pattern, handler in handlers():
        if pattern.startswith(PEER):
            continue
        path = re.sub(r"\(\?P<action>([a-z]+)\|[^)]*\)", r"\1", pattern.replace("(/.*)?", "/nowhere"))
        path = re.sub(r"\(\?P<index>[^)]*\)", "0", path)
        path = re.sub(r"\(\?P<\w+>[^)]*\)", "x", path).removesuffix("/?")
        ours = [cls for cls in handler.__mro__ if cls.__module__.startswith("jupyter_gpumigrate")]
        for method in ("GET", "POST", "DELETE"):
            if not any(method.lower() in vars(cls) for cls in ours):
                continue
            response = await jp_fetch(*path.strip("/").split("/"), method=method, headers={"Authorization": ""},
                                      body="{}" if method == "POST" else None, raise_error=False)
            assert response.code == 403, (method, path, response.code)
            tried += 1
    assert tried >= 7, tried


async def test_gpus_with_no_gpu_is_an_empty_list(jp_fetch, kernel):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver; the gpu suite covers it")
    listed = await api(jp_fetch, "gpus")
    assert listed["driver_version"] is None and listed["gpus"] == [] and listed["host"]
    assert (await api(jp_fetch, "kernels", kernel.id))["gpus"] == []


async def test_a_prepare_that_fails_leaves_the_kernel_running(jp_fetch, jp_serverapp, kernel):
    # The images folder cannot be made (a file is in its way): a real failure, inside prepare.
    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images"
    images.parent.mkdir(parents=True, exist_ok=True)
    images.write_text("not a folder")
    await kernel.run("kept = 'here'")
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "prepare", op
    assert "Cannot make the images folder" in op["error"] and "state_dir" in op["error"]
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["operation"] is None, "not stuck in 'migrating'"
    assert (await kernel.run("print(kept)")).strip() == "here"
    images.unlink()
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"


async def test_a_cell_run_on_a_suspended_kernel_resumes_it(jp_fetch, jp_ws_fetch, jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    assert (await tab.run("secret = 'kept'; print('set')")).strip() == "set"
    operations = jp_serverapp.web_app.settings["gpumigrate_operations"]
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    # Opening or inspecting a notebook does not bring its kernel back; only running a cell does.
    tab.send("kernel_info_request", {})
    tab.send("complete_request", {"code": "secr", "cursor_pos": 4})
    await asyncio.sleep(2)
    assert (await api(jp_fetch, "kernels", kernel_id))["state"] == "suspended"
    # The cell waits while the kernel is restored, then runs on it: its reply reaches the tab.
    assert (await tab.run("print(secret)")).strip() == "kept"
    view = await api(jp_fetch, "kernels", kernel_id)
    assert view["state"] == "running" and view["pid"]
    resumes = [op for op in operations.operations.values() if op.kernel_id == kernel_id and op.action == "resume"]
    assert [(op.trigger, op.status) for op in resumes] == [("cell", "succeeded")]
    tab.ws.close()


async def test_a_malformed_message_to_a_suspended_kernel_drops_only_itself(jp_fetch, jp_ws_fetch, jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    assert (await tab.run("secret = 'kept'; print('set')")).strip() == "set"
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    tab.ws.write_message("{this is not JSON")  # held with the cell below, then read when they go out
    assert (await tab.run("print(secret)")).strip() == "kept"
    assert (await tab.run("print('and the next one')")).strip() == "and the next one"
    tab.ws.close()


async def test_a_cell_that_cannot_resume_its_kernel_says_why_and_waits(jp_fetch, jp_ws_fetch, jp_serverapp):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    await tab.run("value = 41")
    operations = jp_serverapp.web_app.settings["gpumigrate_operations"]
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    operations.criu_path = "/nonexistent/criu"
    events: list[dict] = []
    operations.emit, emit = (lambda data: (events.append(data), emit(data))), operations.emit
    cell = asyncio.ensure_future(tab.run("print(value + 1)"))
    for _ in range(50):
        if any(e["trigger"] == "cell" for e in events):
            break
        await asyncio.sleep(0.1)
    failed = [e for e in events if e["trigger"] == "cell"]
    assert failed and failed[-1]["status"] == "failed", events
    assert "could not be resumed" in failed[-1]["error"] and "CRIU was not found" in failed[-1]["error"]
    assert (await api(jp_fetch, "kernels", kernel_id))["state"] == "suspended" and not cell.done()
    # Resumed the ordinary way, the kernel runs the cell that waited.
    operations.criu_path = None
    assert (await operate(jp_fetch, kernel_id, "resume"))["status"] == "succeeded"
    out = await asyncio.wait_for(cell, 60)
    assert "could not be resumed" in out and "CRIU was not found" in out, "the tab is told why, under the cell"
    assert out.strip().endswith("42")
    tab.ws.close()


async def test_a_cell_held_for_a_suspended_kernel_does_not_run_in_a_restarted_one(jp_fetch, jp_ws_fetch,
                                                                                 jp_serverapp, tmp_path):
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    await tab.run("ready = 1")
    operations = jp_serverapp.web_app.settings["gpumigrate_operations"]
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    operations.criu_path = "/nonexistent/criu"  # the cell's resume cannot start: the cell waits
    marker = tmp_path / "ran"
    cell = tab.send("execute_request", {"code": f"open({str(marker)!r}, 'w').close()", "silent": False,
                                        "store_history": True, "user_expressions": {}, "allow_stdin": False})
    await asyncio.sleep(1)
    await jp_fetch("api", "kernels", kernel_id, "restart", method="POST", body="{}")
    fresh = KernelSession(jp_serverapp, kernel_id, own_identity=True)  # the restarted kernel answers
    await fresh.ready()
    fresh.close()
    said = []
    deadline = time.monotonic() + 10
    while not any("this cell did not run" in text for text in said):
        assert time.monotonic() < deadline, f"the tab was not told, under its cell: {said}"
        raw = await asyncio.wait_for(tab.ws.read_message(), deadline - time.monotonic())
        message = json.loads(raw) if isinstance(raw, str) else {}
        if message.get("msg_type") == "stream" and message["parent_header"].get("msg_id") == cell:
            said.append(message["content"]["text"])
    assert not marker.exists(), "a cell sent to the suspended kernel must not run in the restarted one"
    assert (await tab.run("print('fresh' if 'ready' not in dir() else 'old')")).strip() == "fresh"
    operations.criu_path = None
    tab.ws.close()


def test_the_shell_message_type_is_read_in_both_websocket_protocols():
    from jupyter_client.session import Session
    from jupyter_server.services.kernels.connection.base import serialize_msg_to_ws_v1

    from jupyter_gpumigrate.autoresume import V1, shell_msg_type

    session = Session(key=b"")
    msg = session.msg("execute_request", {"code": "1"})
    parts = session.serialize(msg)[2:]  # header, parent, metadata, content (after the delimiter and signature)
    assert shell_msg_type(serialize_msg_to_ws_v1(parts, "shell"), V1) == "execute_request"
    assert shell_msg_type(serialize_msg_to_ws_v1(parts, "control"), V1) is None
    legacy = json.dumps({**msg, "channel": "shell"}, default=str)
    assert shell_msg_type(legacy, None) == "execute_request"
    assert shell_msg_type(json.dumps({**msg, "channel": "stdin"}, default=str), None) is None
    assert shell_msg_type("not json", None) is None and shell_msg_type(b"\x00", V1) is None


async def test_a_kernel_being_suspended_is_migrating_and_left_alone(jp_fetch, jp_serverapp, kernel):
    # 1.5 GB of touched memory: the dump lasts long enough to look at the kernel meanwhile.
    await kernel.run("blob = b'x' * (1536 * 2**20); kept = 'yes'")
    km = jp_serverapp.kernel_manager
    km.cull_idle_timeout = 1
    await asyncio.sleep(1.5)  # idle for longer than the culler allows
    started = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202)
    seen = []
    while True:
        view = await api(jp_fetch, "kernels", kernel.id)
        seen.append(view["state"])
        if view["state"] != "migrating":
            break
        # What the restarter asks (a kernel whose poll() is not None is restarted) and what the culler does.
        assert await km.get_kernel(kernel.id).provisioner.poll() is None
        await km.cull_kernel_if_idle(kernel.id)
        assert kernel.id in km
        assert view["operation"] == started["id"]
        await asyncio.sleep(0.05)
    assert "migrating" in seen and seen[-1] == "suspended", seen
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(kept, len(blob))")).split() == ["yes", str(1536 * 2**20)]


async def test_a_cell_sent_right_after_a_suspend_gets_all_its_output(jp_fetch, jp_ws_fetch, jp_serverapp):
    # What the notebook sends while its kernel is away waits in the server, then goes on once the
    # kernel's clients are back: the first cell's output is not lost to a re-dialling IOPub socket.
    kernel_id, tab = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    await tab.run("n = 0")
    for round in range(1, 4):
        assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
        assert (await tab.run("n += 1; print(n)")).strip() == str(round)
    tab.ws.close()


async def test_a_tab_opened_on_a_suspended_kernel_connects_at_once_and_its_cell_resumes_it(
        jp_fetch, jp_ws_fetch, jp_serverapp):
    kernel_id, first = await notebook(jp_fetch, jp_ws_fetch, jp_serverapp)
    await first.run("kept = 'across a reload'")
    first.ws.close()
    assert (await operate(jp_fetch, kernel_id, "suspend"))["status"] == "succeeded"
    # A reloaded page: a new WebSocket. jupyter_server alone would wait for a kernel-info reply (up
    # to kernel_info_timeout, 60 s) before the tab could send anything.
    ws = await asyncio.wait_for(jp_ws_fetch("api", "kernels", kernel_id, "channels"), 20)
    tab = WebSocketTab(ws)
    tab.send("kernel_info_request", {})  # what JupyterLab sends first: it resumes nothing
    await asyncio.sleep(1)
    assert (await api(jp_fetch, "kernels", kernel_id))["state"] == "suspended"
    assert (await tab.run("print(kept)")).strip() == "across a reload"
    assert (await api(jp_fetch, "kernels", kernel_id))["state"] == "running"
    tab.ws.close()


def _servers_criu(action: bytes) -> Iterator[tuple[int, list[bytes]]]:
    """The `criu ACTION` processes this test's server started (their PID and argv). The tasks CRIU forks carry
    its command line too: only the one the server started is named."""
    from jupyter_gpumigrate.engine import proctree

    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"criu") and action in argv:
            if (info := proctree.info(int(name))) is not None and info.ppid == os.getpid():
                yield int(name), argv


def _kill_criu_restore_once_tree_is_back(pid: int, timeout: float) -> str | None:
    """Watch for the server's `criu restore`; SIGKILL it as soon as the process with ``pid`` exists again
    (CRIU has forked the tree and is restoring its memory). The signal sent, or None if the restore ended
    first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for criu, _ in _servers_criu(b"restore"):
            if Path(f"/proc/{pid}").exists():
                os.kill(criu, signal.SIGKILL)
                return "SIGKILL"
        time.sleep(0.001)
    return None


async def test_criu_killed_during_a_resume_leaves_no_process_behind_and_the_next_resume_works(
        jp_fetch, kernel):
    # Enough memory that CRIU spends a while restoring it, after it has forked the tree.
    assert (await kernel.run("x = 41\nblob = bytes(range(256)) * 4_000_000\nprint('ok')")).strip() == "ok"
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    for attempt in range(3):
        assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
        killer = asyncio.get_running_loop().run_in_executor(None, _kill_criu_restore_once_tree_is_back, pid, 60)
        op = await operate(jp_fetch, kernel.id, "resume")
        killed = await killer
        if killed and op["status"] == "failed":
            break
        assert op["status"] == "succeeded", op  # the restore won the race: try again
    else:
        pytest.skip("CRIU restored the kernel before it could be killed, three times")
    assert op["failed_phase"] == "restore" and "killed by SIGKILL" in op["error"], op
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and view["image_bytes"], view
    # Nothing of the half-restored tree is left: no process, no zombie holds the kernel's PID.
    assert not Path(f"/proc/{pid}").exists(), Path(f"/proc/{pid}/status").read_text()

    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op
    assert (await kernel.run("print(x + 1, len(blob))")).split() == ["42", str(256 * 4_000_000)]


async def _suspend_killing(jp_fetch: Any, kernel: Any, kill: Callable[[int], object], won: str) -> tuple[dict, int]:
    """Suspend ``kernel`` while ``kill(pid)`` (in a thread) kills what it kills; where the suspend won the race
    (nothing killed, or killed too late), resume the kernel and try again, three times at most (then skip, saying
    ``won``). The failed operation, and the PID of the kernel it suspended."""
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    for _ in range(3):
        killer = asyncio.get_running_loop().run_in_executor(None, kill, pid)
        op = await operate(jp_fetch, kernel.id, "suspend")
        if await killer and op["status"] == "failed":
            return op, pid
        assert op["status"] == "succeeded", op  # the suspend won the race: resume, and try again
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
        pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    pytest.skip(won)


def _kill_criu_dump(when: str, timeout: float) -> str | None:
    """Watch for the server's `criu dump`; SIGKILL it ``early`` (as soon as it runs: while it seizes the
    tree and its parasite is inside the kernel) or once it writes ``pages`` (the kernel's memory). The
    moment it was killed, or None if the dump ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for criu, argv in _servers_criu(b"dump"):
            folder = Path(argv[argv.index(b"--images-dir") + 1].decode())
            while when == "pages" and time.monotonic() < deadline:
                if any(p.stat().st_size > 0 for p in folder.glob("pages-*.img")):
                    break
                time.sleep(0.001)
            try:
                os.kill(criu, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return when
        time.sleep(0.001)
    return None


@pytest.mark.parametrize("when", ["early", "pages"])
async def test_criu_killed_during_a_suspends_dump_leaves_the_kernel_running_with_its_state(jp_fetch, kernel, when):
    # Enough memory that CRIU spends a while writing it.
    assert (await kernel.run("x = 41\nblob = bytes(range(256)) * 4_000_000\nprint('ok')")).strip() == "ok"
    op, pid = await _suspend_killing(jp_fetch, kernel, lambda pid: _kill_criu_dump(when, 60),
                                     "CRIU dumped the kernel before it could be killed, three times")
    assert op["failed_phase"] == "dump" and "SIGKILL" in op["error"] and "runs on, unchanged" in op["error"], op
    # The same process runs on, with its state, and answers.
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "running" and view["pid"] == pid and not view["image_bytes"], view
    assert (await kernel.run("print(x + 1, len(blob))")).split() == ["42", str(256 * 4_000_000)]
    # Nothing half-dumped is left to be taken for an image, and the next suspend and resume work.
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(x + 1, len(blob))")).split() == ["42", str(256 * 4_000_000)]


def _kill_before_criu_holds(pid: int, timeout: float) -> bool:
    """Watch for the server's `criu dump`; hold it (SIGSTOP) as soon as it runs and, where it has not taken hold of
    the kernel's process ``pid`` yet (no tracer), SIGKILL that process before CRIU goes on. Whether it did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for criu, _ in _servers_criu(b"dump"):
            os.kill(criu, signal.SIGSTOP)
            try:
                tracer = re.search(r"TracerPid:\s*(\d+)", Path(f"/proc/{pid}/status").read_text())
                if tracer is None or int(tracer.group(1)) != 0:
                    return False
                os.kill(pid, signal.SIGKILL)
                return True
            finally:
                os.kill(criu, signal.SIGCONT)
        time.sleep(0.001)
    return False


async def test_a_kernel_that_ends_before_criu_takes_hold_of_it_is_said_dead_with_nothing_dumped(
        jp_fetch, jp_serverapp, kernel):
    """The kernel's process SIGKILLed as the dump begins, before CRIU took hold of it (CRIU held meanwhile): the
    operation said that the kernel "ended while CRIU dumped it"; it ended before CRIU began, and nothing was
    dumped, which it now says. Jupyter restarts the kernel, as the error says."""
    op, pid = await _suspend_killing(jp_fetch, kernel, lambda pid: _kill_before_criu_holds(pid, 60),
                                     "CRIU took hold of the kernel before it could be killed, three times")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    assert op["error"] == (f"The kernel's process {pid} ended before CRIU began to dump it, so nothing was dumped "
                           "and what it held is lost: the kernel is dead, and Jupyter restarts it (or restart it "
                           "yourself)."), op["error"]
    await restarted(jp_serverapp, kernel.id, pid)


async def test_a_suspended_kernel_resumes_though_ipythons_history_file_grew_meanwhile(jp_fetch, kernel):
    """IPython's history database is one file for all of a user's IPythons (kernels, terminals), which CRIU
    would have to find at its old size to restore a kernel that held it open. The kernels the server starts
    keep their history in memory (c.MigratableProvisioner.kernel_history): another IPython may grow the file
    while a kernel is suspended."""
    import sqlite3

    folder = (await kernel.run("from IPython.paths import get_ipython_dir; print(get_ipython_dir())")).strip()
    assert (await kernel.run("x = 41\nprint('set')")).strip() == "set"
    assert (await kernel.run("print(len(In) > 2, 'x = 41' in In[-2])")).strip() == "True True"
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    database = Path(folder) / "profile_default" / "history.sqlite"
    database.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(database) as db:  # another IPython's cells: some 400 KB
        db.execute("CREATE TABLE IF NOT EXISTS grown (cell TEXT)")
        db.executemany("INSERT INTO grown VALUES (?)", [("z" * 4000,)] * 100)
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded", op["error"]
    assert (await kernel.run("print(x + 1, any('x = 41' in cell for cell in In))")).strip() == "42 True"


async def test_a_suspend_to_disk_leaves_the_page_cache_to_others(jp_fetch, jp_serverapp, kernel):
    """CRIU writes the kernel's 200 MB through the page cache; once the images are whole they leave it (read
    once, at the resume, they would otherwise push other processes' cached files out of memory)."""
    assert (await kernel.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 200\n"
                             "before = hashlib.sha256(blob).hexdigest(); print('set')")).strip() == "set"
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images" / kernel.id
    pages = list(images.glob("pages-*.img"))
    written = sum(p.stat().st_size for p in pages)
    assert written > 200 << 20 and resident(pages) < written // 20, (written, resident(pages))
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(hashlib.sha256(blob).hexdigest() == before)")).strip() == "True"
