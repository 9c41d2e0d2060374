"""%migrate and its widget in real kernels of a real server; events on the server's bus; the per-kernel
credential; drain and long-polled operations. All without a GPU (the gpu suite moves kernels for real)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest
from helpers import (OPEN_IO_URING, KernelSession, WebSocketTab, Widgets, api, cli, operate, remote,
                     start_kernel, wait_suspended)

from jupyter_gpumigrate.provisioner import can_import_package
from jupyter_gpumigrate.engine.errors import GpuError
from jupyter_gpumigrate.engine.stash import Offer, Stash, pack
from jupyter_gpumigrate.kernel import stager
from jupyter_gpumigrate.operations import EVENT_SCHEMA_ID

pytestmark = pytest.mark.usefixtures("criu_binary")

NO_GPU = not os.path.exists("/dev/nvidiactl")


async def test_the_magic_is_there_without_load_ext(kernel):
    out = await kernel.run("%migrate --help")
    assert "Move this kernel to another GPU" in out and "--to-gpu N" in out and "--list" in out
    assert "--suspend" in out and out.startswith("  %migrate [--to-gpu N]"), out[:80]


async def test_bad_arguments_are_usage_errors_without_a_traceback(kernel):
    for line, words in [
        ("%migrate --to-gpu one", "--to-gpu takes a GPU index, or one per GPU the kernel holds separated by commas"),
        ("%migrate --to-gpu 1,x", "got '1,x'"),
        ("%migrate --to-gpu=-1", "GPU indices, 0 or more"),
        ("%migrate --to-gpu 1,0 --transplant", "several GPUs (--to-gpu N,M) go with a move on this host only"),
        ("%migrate --list --to-gpu 1", "one of --list, --suspend, --back or a target"),
        ("%migrate --list --to-host b", "one of --list, --suspend, --back or a target"),
        ("%migrate --suspend --to-gpu 1", "one of --list, --suspend, --back or a target"),
        ("%migrate --back --to-cpu", "one of --list, --suspend, --back or a target"),
        ("%migrate --frobnicate", "unrecognized arguments"),
        ('%migrate --to-host "b', "No closing quotation"),
        ('%migrate --to-host ""', "--to-host needs a server's name"),
        ("%migrate --to-host '  '", "--to-host needs a server's name"),
    ]:
        result = await kernel.execute(line)
        assert result.status == "error" and result.reply["ename"] == "UsageError", (line, result.reply)
        assert words in result.reply["evalue"], (line, result.reply["evalue"])
        text = "\n".join(result.errors)
        assert "Traceback" not in text and 'File "' not in text, (line, text)
    assert (await kernel.run("print('still fine')")).strip() == "still fine"


@pytest.mark.skipif(not NO_GPU, reason="this machine has GPUs: the gpu suite runs %migrate --to-gpu for real")
async def test_no_gpu_is_one_clear_sentence(kernel):
    result = await kernel.execute("%migrate --to-gpu 1")
    assert result.status == "error" and result.reply["ename"] == "MigrateFailed"
    text = "\n".join(result.errors)
    assert "no NVIDIA GPU" in text and "Traceback" not in text and 'File "' not in text, text


@pytest.mark.skipif(not NO_GPU, reason="this machine has GPUs")
async def test_list_with_zero_gpus(kernel):
    out = await kernel.run("%migrate --list")
    assert "No NVIDIA GPU is visible to the Jupyter server." in out
    assert f"No GPU: {kernel.id[:8]}* (running)" in out


async def test_the_widget_renders_its_model(kernel):
    result = await kernel.execute("%migrate")
    assert result.status == "ok", result.errors
    views = [m for m in result.messages if m["msg_type"] == "display_data"
             and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
    assert len(views) == 1, "one widget shown"
    models: dict[str, dict] = {}
    for m in result.messages:  # each model's state as opened, then as updated
        if m["msg_type"] == "comm_open":
            models[m["content"]["comm_id"]] = dict(m["content"]["data"]["state"])
        elif m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update":
            models[m["content"]["comm_id"]].update(m["content"]["data"]["state"])
    root = views[0]["content"]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
    assert models[root]["_model_name"] == "VBoxModel"
    names = sorted(state["_model_name"] for state in models.values())
    assert {"ButtonModel", "DropdownModel", "IntProgressModel", "HTMLModel"} <= set(names)
    button = next(s for s in models.values() if s["_model_name"] == "ButtonModel")
    assert button["description"] == "Migrate"
    if NO_GPU:
        texts = " ".join(s.get("value", "") for s in models.values() if s["_model_name"] == "HTMLModel")
        assert "No NVIDIA GPU is visible" in texts and button["disabled"] is True


async def test_clicking_migrate_with_no_target_says_why_in_place_and_asks_nothing(jp_fetch, kernel):
    """The widget's interactive half, driven as a frontend drives it: a click message on the Migrate
    button's comm. With no target to pick (no GPU here, or none that can take this kernel) the click
    asks the server nothing and says why in the widget."""
    result = await kernel.execute("%migrate")
    assert result.status == "ok", result.errors
    widgets = Widgets(kernel, result.messages)
    part = widgets.picker()
    assert widgets.models[part["button"]]["description"] == "Migrate"
    assert widgets.models[part["target"]]["_model_name"] == "DropdownModel"
    if NO_GPU:
        assert widgets.models[part["target"]]["_options_labels"] == [] and widgets.models[part["button"]]["disabled"]
    widgets.update(part["target"], index=None)  # nothing picked, as a frontend can send
    widgets.click(part["button"])
    await widgets.until(lambda m: "Nothing to migrate to" in m[part["message"]]["value"])
    message = widgets.models[part["message"]]["value"]
    assert "error-color" in message, message
    if NO_GPU:
        assert "there is no GPU this kernel can move to now" in message, message
    else:
        assert "pick a GPU in 'Move to' first" in message or "no GPU this kernel can move to" in message, message
    progress = widgets.models[part["progress"]]
    assert progress["bar_style"] == "danger" and progress["value"] == 0
    operations = await api(jp_fetch, "operations")
    assert not [op for op in operations if op["kernel_id"] == kernel.id], "the click asked the server nothing"
    assert (await kernel.run("print('still fine')")).strip() == "still fine"


async def test_load_ext_works_in_plain_ipython_and_says_why_it_cannot_move():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTER_GPUMIGRATE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "IPython", "--quick", "--no-banner", "--colors=nocolor",
         "-c", "%load_ext jupyter_gpumigrate\n%migrate --list"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    text = proc.stdout + proc.stderr
    assert "not started by a Jupyter server with jupyter-gpumigrate" in text, text


async def test_events_follow_suspend_and_resume_phase_by_phase(jp_fetch, jp_serverapp, kernel):
    events: list[dict] = []

    async def listener(logger, schema_id, data):
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA_ID, listener=listener)
    suspended = await operate(jp_fetch, kernel.id, "suspend")
    resumed = await operate(jp_fetch, kernel.id, "resume")
    await asyncio.sleep(0.2)  # listeners run as tasks
    for op, phases in ((suspended, ["prepare", "dump"]), (resumed, ["prepare", "restore", "adopt"])):
        mine = [e for e in events if e["operation_id"] == op["id"]]
        steps = [(e["phase"], e["phase_event"]) for e in mine if e["phase_event"]]
        assert steps == [(p, ev) for p in phases for ev in ("start", "done")], steps
        assert [e["status"] for e in mine][0] == "pending" and mine[-1]["status"] == "succeeded"
        assert set(mine[-1]["timings"]) == set(phases) and mine[-1]["kernel_id"] == kernel.id
        assert [e["version"] for e in mine] == sorted(e["version"] for e in mine)


async def test_a_failed_suspend_sends_the_failure_the_undo_and_the_error_as_events(jp_fetch, jp_serverapp, kernel):
    events: list[dict] = []

    async def listener(logger, schema_id, data):
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA_ID, listener=listener)
    await kernel.run(OPEN_IO_URING + "value = 'still here'")
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    await asyncio.sleep(0.2)  # listeners run as tasks
    mine = [e for e in events if e["operation_id"] == op["id"]]
    steps = [(e["phase"], e["phase_event"]) for e in mine if e["phase_event"]]
    # The dump starts and fails; the phase before it that has an undo (prepare: forget the images) is undone.
    assert steps == [("prepare", "start"), ("prepare", "done"), ("dump", "start"), ("dump", "failed"),
                     ("prepare", "undo")], steps
    failed = next(e for e in mine if e["phase_event"] == "failed")
    assert failed["status"] == "running" and set(failed["timings"]) == {"prepare", "dump"}
    last = mine[-1]
    assert last["status"] == "failed" and last["phase_event"] == "" and last["kernel_id"] == kernel.id
    assert last["error"] == op["error"] and "CRIU could not dump" in last["error"], last
    assert "The kernel runs on, unchanged" in last["error"]
    assert [e["version"] for e in mine] == sorted(e["version"] for e in mine)
    assert (await kernel.run("print(value)")).strip() == "still here"
    await kernel.run("os.close(ring)")


async def test_migrate_suspend_stops_the_cell_and_finishes_it_once_resumed(jp_fetch, kernel):
    """%migrate --suspend: the kernel has its own server dump it in the middle of the cell; once resumed
    (here through REST, as the panel and the CLI do), the same cell goes on, prints one line and ends."""
    await kernel.run("kept = {'a': [1, 2, 3]}")
    cell = asyncio.ensure_future(kernel.execute("%migrate --suspend\nafter = 'the cell went on'", timeout=180))
    view = await wait_suspended(jp_fetch, kernel.id, cell, 120)
    assert view["image_bytes"] > 0
    await asyncio.sleep(1.0)  # away for a second at least
    assert not cell.done(), "the cell waits while the kernel is suspended"
    resumed = await operate(jp_fetch, kernel.id, "resume")
    assert resumed["status"] == "succeeded", resumed
    result = await cell
    assert result.status == "ok", result.errors
    line = result.out.strip()
    pattern = (r"Suspended for (\d+\.\d) s \((\d+\.\d) MB of images\); resumed on CPU \(this kernel holds no GPU "
               r"memory\)( in \d+\.\d\d s)?\. Everything in memory is as it was\.")
    match = re.fullmatch(pattern, line)
    assert match, line
    assert float(match.group(1)) >= 1.0 and float(match.group(2)) == round(view["image_bytes"] / 1e6, 1), (line, view)
    assert (await kernel.run("print(kept['a'], after)")).strip() == "[1, 2, 3] the cell went on"
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


async def test_migrate_suspend_in_a_notebook_is_resumed_by_running_the_next_cell(jp_fetch, jp_ws_fetch, jp_serverapp):
    """The way a notebook user meets it: one cell suspends the kernel; running the next cell (through the
    notebook's WebSocket) resumes it; the first cell then prints its line, and the next one runs."""
    kernel_id = await start_kernel(jp_fetch)
    session = KernelSession(jp_serverapp, kernel_id)
    await session.ready()
    tab = WebSocketTab(await jp_ws_fetch("api", "kernels", kernel_id, "channels"))
    try:
        await tab.run("kept = 'here'")
        request = {"silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False}
        first = tab.send("execute_request", dict(request, code="%migrate --suspend"))
        deadline = time.monotonic() + 120
        while (await api(jp_fetch, "kernels", kernel_id))["state"] != "suspended":
            assert time.monotonic() < deadline, "the kernel never got suspended"
            await asyncio.sleep(0.1)
        second = tab.send("execute_request", dict(request, code="print(kept)"))
        out: dict[str, str] = {first: "", second: ""}
        status: dict[str, str] = {}
        idle: set[str] = set()
        while len(status) < 2 or len(idle) < 2:
            left = deadline + 60 - time.monotonic()
            assert left > 0, (out, status)
            raw = await asyncio.wait_for(tab.ws.read_message(), left)
            assert raw is not None, "the websocket closed"
            if isinstance(raw, bytes):
                continue
            msg = json.loads(raw)
            parent = msg.get("parent_header", {}).get("msg_id")
            if parent not in out:
                continue
            if msg["msg_type"] == "stream":
                out[parent] += msg["content"]["text"]
            elif msg["msg_type"] == "error":
                out[parent] += "\n".join(msg["content"]["traceback"])
            elif msg["msg_type"] == "execute_reply":
                status[parent] = msg["content"]["status"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                idle.add(parent)
        assert status == {first: "ok", second: "ok"}, (status, out)
        assert re.fullmatch(r"Suspended for \d+\.\d s \(\d+\.\d MB of images\); resumed on CPU \(this kernel holds no "
                            r"GPU memory\)( in \d+\.\d\d s \(started by a cell\))?\. Everything in memory is as it "
                            r"was\.", out[first].strip()), out[first]
        assert out[second].strip() == "here"
        operations = jp_serverapp.web_app.settings["gpumigrate_operations"].operations.values()
        resumes = [(op.trigger, op.status) for op in operations if op.kernel_id == kernel_id and op.action == "resume"]
        assert resumes == [("cell", "succeeded")]
    finally:
        tab.ws.close()
        session.close()


async def test_a_kernels_credential_is_refused_for_another_kernel(jp_fetch, jp_serverapp, kernel):
    other_id = await start_kernel(jp_fetch)
    other = KernelSession(jp_serverapp, other_id)
    await other.ready()
    token = (await kernel.run("import os; print(os.environ['JUPYTER_GPUMIGRATE_TOKEN'])")).strip()
    assert (await kernel.run("print(os.environ['JUPYTER_GPUMIGRATE_KERNEL_ID'])")).strip() == kernel.id
    as_kernel = {"Authorization": f"gpumigrate-kernel {token}"}

    async def call(*parts, method="GET", headers=as_kernel, params=None):
        body = "{}" if method == "POST" else None
        response = await jp_fetch("api", "gpumigrate", *parts, method=method, body=body, headers=dict(headers),
                                  params=params, raise_error=False)
        return response.code, json.loads(response.body or b"null")

    code, error = await call("kernels", other_id, "suspend", method="POST")
    assert code == 403 and "act on itself only" in error["message"], error
    op = await api(jp_fetch, "kernels", other_id, "suspend", method="POST", expect=202)
    code, error = await call("operations", op["id"])
    assert code == 403, "nor may it follow another kernel's operation"
    code, _ = await call("gpus", "0", "drain", method="POST")
    assert code == 403, "a kernel may not drain a GPU"
    code, error = await call("operations")
    assert code == 403, "nor list every operation"
    assert error["message"].startswith(f"A kernel's credential (kernel {kernel.id}'s) may read the kernels and the "
                                       "GPUs, and act on its own kernel and follow its operations; not GET /") and \
        error["message"].endswith("/api/gpumigrate/operations: use a token of the server's."), error
    code, kernels = await call("kernels")
    assert code == 200 and {k["id"] for k in kernels} >= {kernel.id, other_id}
    code, _ = await call("kernels", kernel.id, method="GET", headers={"Authorization": "gpumigrate-kernel forged"})
    assert code == 403
    assert (await api(jp_fetch, "kernels", other_id))["state"] in ("migrating", "suspended")

    # On itself it may act: suspend itself, be resumed, and follow its own operations.
    code, op = await call("kernels", kernel.id, "suspend", method="POST")
    assert code == 202, op
    while op["status"] not in ("succeeded", "failed"):
        code, op = await call("operations", op["id"], params={"after": op["version"]})
        assert code == 200
    assert op["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(os.environ['JUPYTER_GPUMIGRATE_KERNEL_ID'])")).strip() == kernel.id

    # Shut down, a kernel's credential is worth nothing.
    other.close()
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    code, _ = await call("kernels")
    assert code == 403


async def test_operations_are_followed_by_long_poll(jp_fetch, kernel):
    op = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202)
    seen = op["version"]
    changed = await api(jp_fetch, "operations", op["id"], params={"after": seen})
    assert changed["version"] > seen, "the server answered once the operation changed"
    while changed["status"] not in ("succeeded", "failed"):
        changed = await api(jp_fetch, "operations", op["id"], params={"after": changed["version"]})
    assert changed["status"] == "succeeded"
    error = await api(jp_fetch, "operations", op["id"], params={"after": "x"}, expect=400)
    assert "version number" in error["message"]
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"


@pytest.mark.skipif(not NO_GPU, reason="this machine has GPUs: the gpu suite drains for real")
async def test_drain_without_a_gpu(jp_fetch, jp_serverapp, kernel):
    error = await api(jp_fetch, "gpus", "0", "drain", method="POST", expect=409)
    assert "no NVIDIA GPU" in error["message"]
    await api(jp_fetch, "gpus", "0", "drain", method="POST", body={"to_gpu": "1"}, expect=400)
    code, out, err = await cli("drain", "--gpu", "0", *remote(jp_serverapp))
    assert code == 1 and "no NVIDIA GPU" in err
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


async def test_an_idle_kernel_serves_the_fast_path_and_a_busy_one_is_not_asked(jp_fetch, jp_serverapp, kernel):
    """The server's end of the fast path (engine/stash.py) and the kernel's (kernel/stager.py) over the
    real socket: an idle kernel without torch's CUDA comes, gives the session's token and steps aside,
    changing nothing; a stranger without the token is turned away; a busy kernel is not asked when its safe
    point is turned off."""
    manager = jp_serverapp.kernel_manager.get_kernel(kernel.id)
    provisioner = manager.provisioner
    for _ in range(600):  # the server hears the kernel's last "idle" a moment after the client does
        if manager.execution_state == "idle":
            break
        if _ % 100 == 99:
            await kernel.run("pass")  # a fresh busy/idle pair for the server's activity watcher
        await asyncio.sleep(0.05)
    assert manager.execution_state == "idle", f"the server still sees the kernel {manager.execution_state}"
    stash = Stash()
    try:
        assert provisioner.invite_stager(stash.path, stash.token) is None
        offer = await asyncio.to_thread(stash.accept, 20)
        assert offer is not None and offer.pid == provisioner.pid and offer.storages == []
        assert offer.aside == "the kernel does not use CUDA through PyTorch"
        assert stash.stash("GPU-unused", 1 << 40) == 0 and stash.helper is None, "no helper for nothing"
        # What the server decides with what a kernel offers (largest first), before any helper starts:
        stash.offer = Offer(offer.pid, [10**9, 5 * 10**8])
        assert stash.stash("GPU-unused", 1 << 40) == 0 and stash.helper is None
        assert stash.reason == "the kernel holds 1.5 GB of large tensors: under 2 GB the driver alone is as fast"
        stash.offer = Offer(offer.pid, [3 * 10**9, 2 * 10**9])
        assert stash.stash("GPU-unused", 2 * 10**9) == 0 and stash.helper is None
        assert stash.reason.startswith("the target GPU has no room for a stash beside the kernel")
        assert pack([3000, 1000, 700, 10], 4200) == ([0, 1, 3], [0, 3072, 4096], 4106)
        # The helper starts early, while the kernel gathers its storages; where it cannot hold the stash
        # the allocation says why, and the fast path would step aside.
        stash.warm("GPU-unused")
        helper = stash.helper
        assert helper is not None
        stash.offer = Offer(offer.pid, [3 * 10**9])
        # (No GPU is called GPU-unused on a GPU machine either: its CUDA sees no device.)
        with pytest.raises(GpuError, match="The stash helper could not hold 3.0 GB on GPU GPU-unused: .+"):
            await asyncio.to_thread(stash.stash, "GPU-unused", 1 << 40)
        assert helper.proc.poll() is not None, "the helper has ended"
        # A move has the helper allocate as it starts (what the target has beyond the move): the stash then
        # takes no more than that, and the same failure is said with the size it was asked for.
        stash.helper = None
        stash.warm("GPU-unused", 4 * 10**9)
        early = stash.helper
        assert early is not None and early.size == 4 * 10**9
        stash.offer = Offer(offer.pid, [3 * 10**9, 3 * 10**9])
        with pytest.raises(GpuError, match="The stash helper could not hold 4.0 GB on GPU GPU-unused: .+"):
            await asyncio.to_thread(stash.stash, "GPU-unused", 1 << 40)
        assert early.proc.poll() is not None, "the helper has ended"
        # What did not fit is said, for the operation's record (the driver carries it).
        assert stash.left == "3.0 GB of tensors that did not fit in the stash (4.0 GB of room on the target)"
        # So is what the kernel's search did not offer: left to a thread, or out of its reach.
        assert Offer(1, [3 * 10**9], allocated=3 * 10**9 + 10**8).unreached() is None
        assert Offer(1, [3 * 10**9], allocated=9 * 10**9, spared=2 * 10**9).unreached() == (
            "2.0 GB that a thread running on may touch, 4.0 GB that its search did not reach or cannot offer (held "
            "only by C++, such as autograd's saved tensors and the gradients of a backward pass under way, or in "
            "tensors small, sparse or wrapped)")
    finally:
        await asyncio.to_thread(stash.close)
    assert not os.path.exists(stash.path) and not os.path.exists(stash.folder)
    assert (await kernel.run("x = 41; print(x + 1)")).strip() == "42"

    stranger = Stash()
    try:
        answer = asyncio.create_task(asyncio.to_thread(stager.run, stranger.path, "not-the-token"))
        assert await asyncio.to_thread(stranger.accept, 20) is None
        assert stranger.reason == "the kernel's side of the fast path did not give the session's token"
        assert "aside" in await answer
    finally:
        await asyncio.to_thread(stranger.close)

    busy = asyncio.create_task(kernel.execute("import time; time.sleep(4)"))
    for _ in range(100):
        if manager.execution_state == "busy":
            break
        await asyncio.sleep(0.05)
    later = Stash()
    try:
        # A busy kernel is asked at its safe point (tests/test_safepoint.py), unless that is turned off.
        provisioner.safe_point_timeout = 0
        try:
            assert "busy with a cell" in provisioner.invite_stager(later.path, later.token)
        finally:
            provisioner.safe_point_timeout = 5.0
        # A kernel whose interpreter lacks this package (a kernelspec of another environment) is not
        # asked either: it could not come, and the move would wait 10 s for it. Debian's own python3,
        # without this test's PYTHONPATH, is such an interpreter here.
        assert can_import_package(provisioner.python, provisioner.python_path)
        assert not can_import_package("/usr/bin/python3", None)
        ours = provisioner.python, provisioner.python_path
        provisioner.python, provisioner.python_path = "/usr/bin/python3", None
        try:
            assert "cannot import jupyter_gpumigrate" in provisioner.invite_stager(later.path, later.token)
        finally:
            provisioner.python, provisioner.python_path = ours
    finally:
        later.close()
    assert (await busy).status == "ok"


async def test_the_fast_path_field_is_checked(jp_fetch, kernel):
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST",
                      body={"to_gpu": 1, "fast_path": "warp"}, expect=400)
    assert "'fast_path' is one of auto, off" in error["message"]
    error = await api(jp_fetch, "kernels", kernel.id, "migrate", method="POST",
                      body={"to_gpu": 1, "fast_path": "caller"}, expect=400)
    assert "'caller' is for a kernel's own %migrate" in error["message"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


async def test_a_kernels_answer_says_when_its_status_came_and_a_wrong_port_hangs_nothing(jp_serverapp, kernel):
    # what a slow adopt logs (plans/common.adopt_tree): the seconds until the kernel's status on IOPub and how many
    # requests were sent meanwhile (a reply on control before that status, where the subscription reached the
    # kernel late, is said too). A port taken by a socket of another kind refuses the connection: a request to it
    # blocked for ever; now each call gives up within its own timeout.
    import zmq

    from jupyter_gpumigrate import kernelwire

    info = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.connection_info
    said: dict = {}
    assert await asyncio.to_thread(kernelwire.kernel_answers, info, 10.0, said)
    assert said["asked"] >= 1 and 0 < said["status"] < 10, said
    with socket.socket() as nobody:  # a port no kernel serves: asked again and again, no answer
        nobody.bind(("127.0.0.1", 0))
        assert not await asyncio.to_thread(kernelwire.kernel_answers,
                                           {**info, "control_port": nobody.getsockname()[1]}, 1.0, said := {})
    assert said["asked"] >= 2 and "status" not in said and "reply" not in said, said

    # The kernel serves (its reply on control) but its status never reaches the subscriber (here the subscription
    # goes to a publisher of another port's, which says nothing, as a subscription that has not reached the
    # kernel yet): no answer, and the wait says the reply came, and when.
    with zmq.Context() as context, context.socket(zmq.PUB) as quiet:
        port = quiet.bind_to_random_port("tcp://127.0.0.1")
        assert not await asyncio.to_thread(kernelwire.kernel_answers, {**info, "iopub_port": port}, 1.0, said := {})
    assert 0 < said["reply"] < 1 and "status" not in said and said["asked"] >= 2, said

    # kernel_answers asks again and again: a request sent once the refusal came blocked it for ever (this test
    # hung). A one-shot call's request may be queued before the refusal, or not: either way it returns in time.
    with zmq.Context() as context, context.socket(zmq.XPUB) as other:
        port = other.bind_to_random_port("tcp://127.0.0.1")
        wrong = {**info, "control_port": port, "shell_port": port}
        for call, args, answer in ((kernelwire.kernel_answers, (1.0,), False),
                                   (kernelwire.run_silently, ("", 1.0), False),
                                   (kernelwire.send_silently, ("", 1.0), None)):
            started = time.monotonic()
            assert await asyncio.to_thread(call, wrong, *args) is answer
            assert time.monotonic() - started < 5, call
        with pytest.raises(TimeoutError, match="did not answer within 1 s"):
            await asyncio.to_thread(kernelwire.evaluate_silently, wrong, "1", 1.0)


def test_a_connection_info_without_a_port_is_an_error_at_once_not_a_hang():
    """A kernel's connection info read from a damaged record: the short-lived sockets' own ZMQ context
    (kernelwire._sockets) must not wait forever for a socket that never connected."""
    import threading

    from jupyter_gpumigrate.kernelwire import kernel_answers, run_silently

    raised: list[BaseException] = []

    def call() -> None:
        for info, fn in (({"ip": "127.0.0.1"}, run_silently), ({"ip": "127.0.0.1", "control_port": None}, kernel_answers)):
            try:
                fn(info, "", 0.5) if fn is run_silently else fn(info, 0.5)
            except Exception as exc:  # noqa: BLE001  what the caller gets
                raised.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "a bad connection info hangs the caller"
    assert [type(e).__name__ for e in raised] == ["KeyError", "ZMQError"], raised
