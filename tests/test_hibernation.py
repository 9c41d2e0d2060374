"""Suspended kernels outlive their server: stopped (SIGTERM) or killed (SIGKILL), the next server takes them
back under the same id, with their notebook's session, and a cell in that notebook resumes them intact.

Real servers, run as processes and stopped for real; real CRIU; real kernels.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BUILD_STATE, CHECK_STATE, EXPECTED, WebSocketTab, cli
from servers import LocalServer

from jupyter_gpumigrate_client import contract
from jupyter_gpumigrate.engine import proctree
from tornado.websocket import websocket_connect

pytestmark = pytest.mark.usefixtures("criu_binary")


@pytest.fixture
def server(tmp_path: Path):
    srv = LocalServer(tmp_path / "server")
    yield srv
    srv.stop(signal.SIGKILL)
    srv.kill_kernels()


def taken_back(srv: LocalServer, kernel_id: str, timeout: float = 30) -> dict:
    """The kernel's view once the restarted server has taken it back (it does so as it starts)."""
    deadline = time.monotonic() + timeout
    while True:
        listed = {k["id"]: k for k in srv.api("GET", "api/gpumigrate/kernels")}
        if kernel_id in listed:
            return listed[kernel_id]
        assert time.monotonic() < deadline, srv.server_log()
        time.sleep(0.1)


def notebook_session(srv: LocalServer, path: str = "analysis.ipynb") -> tuple[str, str]:
    """A notebook's session, as JupyterLab makes it: (session id, kernel id)."""
    made = srv.api("POST", "api/sessions", {"path": path, "name": path, "type": "notebook",
                                            "kernel": {"name": "python3"}}, expect=201)
    return made["id"], made["kernel"]["id"]


async def notebook_running(srv: LocalServer, code: str, timeout: float = 60) -> tuple[str, str, str]:
    """A notebook's session on ``srv``, ``code`` run in it from its tab (closed after): (session id,
    kernel id, what the cell printed, stripped)."""
    session_id, kernel_id = notebook_session(srv)
    tab = await tab_on(srv, kernel_id)
    out = (await tab.run(code, timeout=timeout)).strip()
    tab.ws.close()
    return session_id, kernel_id, out


async def tab_on(srv: LocalServer, kernel_id: str) -> WebSocketTab:
    ws = await websocket_connect(srv.ws_url(kernel_id) + f"&session_id={uuid.uuid4().hex}")
    return WebSocketTab(ws)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["sigterm", "sigint", "sigkill"])
async def test_a_suspended_kernel_comes_back_after_its_server_stops(server, tmp_path, stop):
    server.start()
    session_id, kernel_id = notebook_session(server)
    tab = await tab_on(server, kernel_id)
    assert "built" in await tab.run(f"PATH = {str(tmp_path / 'notes.txt')!r}\n" + BUILD_STATE)
    op = server.operate(kernel_id, "suspend")
    assert op["status"] == "succeeded", op
    tab.ws.close()

    server.stop(stop)
    images = server.state / "images" / kernel_id
    assert (images / "manifest.json").is_file(), "stopping the server keeps a suspended kernel's images"
    assert (server.state / "logs" / f"kernel-{kernel_id}.log").is_file(), "and the files the kernel had open"

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "suspended" and view["image_bytes"], view
    assert kernel_id in [k["id"] for k in server.api("GET", "api/kernels")]
    sessions = server.api("GET", "api/sessions")
    assert [(s["id"], s["path"], s["kernel"]["id"]) for s in sessions] == [(session_id, "analysis.ipynb", kernel_id)]

    # The notebook's tab reconnects; its next cell resumes the kernel, with every kind of state intact.
    tab = await tab_on(server, kernel_id)
    assert (await tab.run(CHECK_STATE, timeout=120)).splitlines() == EXPECTED
    view = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["state"] == "running" and view["pid"], view
    assert not images.exists(), "its images go once it runs again"
    # Its own credential works on the new server (which listens for kernels where the last one did).
    assert f"{kernel_id[:8]}*" in await tab.run("%migrate --list", timeout=60)
    tab.ws.close()

    # And it is an ordinary kernel of this server again: it suspends and resumes, and shuts down for good.
    assert server.operate(kernel_id, "suspend")["status"] == "succeeded"
    assert server.operate(kernel_id, "resume")["status"] == "succeeded"
    server.api("DELETE", f"api/kernels/{kernel_id}", expect=204)
    assert not images.exists()


async def test_the_next_server_removes_an_unfinished_dump_and_refuses_a_foreign_record(server):
    server.start()
    _, kernel_id = notebook_session(server)
    assert server.operate(kernel_id, "suspend")["status"] == "succeeded"
    server.stop(signal.SIGKILL)

    images = server.state / "images"
    # A dump its server did not live to finish: images without a manifest.
    unfinished = images / str(uuid.uuid4())
    unfinished.mkdir(mode=0o700)
    (unfinished / "pages-1.img").write_bytes(b"\0" * 4096)
    # A record that is not this user's (forged, or left by another account): never taken back, never deleted.
    foreign = images / str(uuid.uuid4())
    foreign.mkdir(mode=0o700)
    manifest = json.loads((images / kernel_id / "manifest.json").read_text())
    (foreign / "manifest.json").write_text(json.dumps({**manifest, "kernel_id": foreign.name, "owner": 4242}))
    # Damaged records: not a manifest at all, and one whose fields have the wrong types.
    damaged = []
    for text in ("[]", json.dumps({**manifest, "pid": "1; rm -rf /"})):
        folder = images / str(uuid.uuid4())
        folder.mkdir(mode=0o700)
        (folder / "manifest.json").write_text(text.replace(kernel_id, folder.name))
        damaged.append(folder)
    # A running kernel's record left empty by a host that went down as it was replaced (such records are not
    # synced): removed, saying so, not refused.
    empty = server.state / "kernels" / f"{uuid.uuid4()}.json"
    empty.parent.mkdir(mode=0o700, exist_ok=True)
    empty.write_bytes(b"")

    server.start()
    taken_back(server, kernel_id)
    listed = {k["id"]: k["state"] for k in server.api("GET", "api/gpumigrate/kernels")}
    assert listed == {kernel_id: "suspended"}, listed
    assert not unfinished.exists(), "an unfinished dump is removed"
    assert (foreign / "manifest.json").is_file(), "a foreign record is left where it is"
    log = server.server_log()
    assert "a dump that never finished" in log and f"not taking back the kernel in {foreign}" in log
    assert "uid 4242" in log
    for folder in damaged:
        assert (folder / "manifest.json").is_file() and f"not taking back the kernel in {folder}" in log
    assert "is damaged" in log
    assert not empty.exists() and f"the record {empty} is empty (written as the host went down)" in log, log

    # The refused records are told where a user looks: the API, `list` (with the reason) and `doctor` (with
    # what to do), while they stay on disk.
    answer = server.api("GET", "api/gpumigrate/refused")
    contract.validate("RefusedList", answer)
    records = {r["path"]: r for r in answer}
    assert set(records) == {str(foreign), *map(str, damaged)}, records
    assert "uid 4242" in records[str(foreign)]["reason"] and "Nothing was deleted" in records[str(foreign)]["remedy"]
    where = ["--url", server.url, "--token", server.token]
    code, out, err = await cli("list", *where)
    assert code == 0, err
    assert "Not taken back at the server's start" in out
    assert f"  {foreign}: its manifest belongs to uid 4242" in out, out
    assert all(f"  {folder}: {folder / 'manifest.json'} is damaged" in out for folder in damaged), out
    code, out, err = await cli("list", "--json", *where)
    assert {r["path"] for r in json.loads(out)["refused"]} == set(records)
    code, out, err = await cli("doctor", "--json", *where)
    rows = [c for c in json.loads(out)["checks"] if c["name"].startswith("record ")]
    assert sorted(r["detail"] for r in rows) == sorted(f"not taken back: {path}: {r['reason']}"
                                                       for path, r in records.items()), rows
    assert all(r["status"] == "warn" and f"rm -r {r['detail'].split(': ')[1]}" in r["remedy"] for r in rows), rows
    code, out, err = await cli("doctor", *where)
    assert f"record {foreign.name[:8]}" in out and "It is not this user's kernel" in out, out
    assert foreign.is_dir() and all(folder.is_dir() for folder in damaged), "nothing is deleted"
    # One removed by hand is no longer listed.
    shutil.rmtree(damaged[0])
    assert {r["path"] for r in server.api("GET", "api/gpumigrate/refused")} == {str(foreign), str(damaged[1])}


async def test_the_retention_discards_kernels_suspended_longer_at_start_and_while_the_server_runs(tmp_path):
    gap = 20.0  # the server's start may take a few seconds on a loaded machine: gap / 2 of margin
    server = LocalServer(tmp_path / "server")
    try:
        server.start()
        _, old = notebook_session(server, "old.ipynb")
        assert server.operate(old, "suspend")["status"] == "succeeded"
        time.sleep(gap)
        _, young = notebook_session(server, "young.ipynb")
        assert server.operate(young, "suspend")["status"] == "succeeded"
        server.stop(signal.SIGTERM)
        images = server.state / "images"
        created = {k: json.loads((images / k / "manifest.json").read_text())["created"] for k in (old, young)}
        assert created[young] - created[old] >= gap

        # A retention between their ages as the server starts: the old kernel is past it, the young one
        # for another gap / 2 seconds (how long the start may take), then the hourly pass (here every
        # second) finds it past it too.
        retention = time.time() - created[young] + gap / 2
        server.extra_config = {"GPUMigrateApp": {"retention": retention, "retention_interval": 1.0}}
        server.start()
        assert taken_back(server, young)["state"] == "suspended"
        # The first pass runs once the kernels are taken back, one by one: the old one may not be listed
        # yet, so what is awaited is its images going and it no longer being listed.
        deadline = time.monotonic() + 30
        while (images / old).exists() or old in {k["id"] for k in server.api("GET", "api/gpumigrate/kernels")}:
            assert time.monotonic() < deadline, server.server_log()
            time.sleep(0.1)
        assert (images / young / "manifest.json").is_file(), "the young kernel's are kept"
        said = rf"discarded kernel {old}: suspended \d+ s ago, longer than the retention \(\d+ s\); [\d.]+ [KMG]?B of " \
               r"images deleted"
        while not re.search(said, log := (server.root / "server.log").read_text()):  # said once its shutdown ended
            assert time.monotonic() < deadline, log
            time.sleep(0.1)
        assert f"discarded kernel {young}" not in log

        deadline = time.monotonic() + 30  # its images go first, then the kernel manager drops it
        while (images / young).exists() or server.api("GET", "api/gpumigrate/kernels"):
            assert time.monotonic() < deadline, server.server_log()
            time.sleep(0.2)
        assert server.api("GET", "api/sessions") == [], "their notebooks' sessions went with them"
        # Each discard is an operation of the server, on its event bus like the others: recorded once its
        # shutdown returned (retention.discard_expired), a moment after the kernel manager dropped it.
        deadline = time.monotonic() + 30
        while True:
            discards = {op["kernel_id"]: op for op in server.api("GET", "api/gpumigrate/operations")
                        if op["action"] == "discard"}
            if young in discards:
                break
            assert time.monotonic() < deadline, (discards, server.server_log())
            time.sleep(0.2)
        assert set(discards) == {old, young}
        assert all(op["status"] == "succeeded" and op["trigger"] == "retention" and op["bytes"] > 0
                   for op in discards.values()), discards
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_with_the_suspend_policy_stopping_the_server_suspends_every_kernel_and_they_come_back(tmp_path):
    server = LocalServer(tmp_path / "server", extra_config={"GPUMigrateApp": {"stop_policy": "suspend"}})
    try:
        server.start()
        kernels = {}
        for i in range(3):
            _, kernel_id = notebook_session(server, f"notebook-{i}.ipynb")
            tab = await tab_on(server, kernel_id)
            assert (await tab.run(f"value = {i} * 1000 + 7\nprint('ok')")).strip() == "ok"
            tab.ws.close()
            kernels[kernel_id] = i * 1000 + 7
        server.stop(signal.SIGINT)  # as JupyterHub's spawners stop a server, with no terminal
        log = server.server_log()
        assert "suspending 3 kernel(s)" in log and "not suspended within" not in log, log

        server.start()
        for kernel_id in kernels:
            assert taken_back(server, kernel_id)["state"] == "suspended"
        assert sorted(s["path"] for s in server.api("GET", "api/sessions")) == [
            f"notebook-{i}.ipynb" for i in range(3)]
        for kernel_id, value in kernels.items():
            tab = await tab_on(server, kernel_id)
            assert (await tab.run("print(value)", timeout=120)).strip() == str(value)
            tab.ws.close()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_a_kernel_not_suspended_within_the_bound_is_shut_down_and_the_stop_is_not_held(tmp_path):
    server = LocalServer(tmp_path / "server",
                         extra_config={"GPUMigrateApp": {"stop_policy": "suspend", "stop_timeout": 0.2}})
    try:
        server.start()
        _, kernel_id = notebook_session(server)
        tab = await tab_on(server, kernel_id)
        # Some 2 GB to write: far more than 0.2 s of dump.
        assert (await tab.run("blob = bytes(range(256)) * 8_000_000\nprint('ok')")).strip() == "ok"
        pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        tab.ws.close()
        started = time.monotonic()
        server.stop(signal.SIGTERM)
        assert time.monotonic() - started < 30, "the stop waited for the dump"
        log = server.server_log()
        assert f"not suspended within 0 s ({kernel_id})" in log, log
        assert not Path(f"/proc/{pid}").exists(), "the kernel was shut down, as without the policy"
        assert not (server.state / "images" / kernel_id / "manifest.json").exists()
        server.start()
        time.sleep(1)
        assert server.api("GET", "api/gpumigrate/kernels") == []
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


@pytest.mark.parametrize("policy", ["shutdown", "suspend"])
async def test_a_server_stopped_while_jupyter_restarts_a_dead_kernel_stops_and_leaves_nothing_running(
        tmp_path, policy):
    """An attack: the kernel SIGKILLed, and the server stopped (SIGTERM, as a Hub's culler does) just as Jupyter's
    restarter starts it again. jupyter_client's shutdown asks the kernel manager's pending ``ready`` future for its
    exception, which raised: the server's stop died there, it never exited, and a SIGKILL then left the restarted
    kernel running, known to no server. Now the stop waits for the restart, then ends the kernel as its policy
    says: no process left ('shutdown'), or suspended for the next server, where a cell resumes it ('suspend')."""
    for attempt in range(3):  # the restart takes some 30 ms: the stop must land inside it
        server = LocalServer(tmp_path / f"server-{attempt}", extra_config={"GPUMigrateApp": {"stop_policy": policy}})
        try:
            server.start()
            _, kernel_id = notebook_session(server)
            tab = await tab_on(server, kernel_id)
            assert (await tab.run("print(6 * 7)")).strip() == "42"
            tab.ws.close()
            pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while "restarting kernel" not in server.server_log():
                assert time.monotonic() < deadline, "Jupyter's restarter did not restart the dead kernel"
                time.sleep(0.001)
            # Held while the stop is asked for, so that the stop begins before the restart can end.
            os.kill(server.proc.pid, signal.SIGSTOP)
            os.kill(server.proc.pid, signal.SIGTERM)
            os.kill(server.proc.pid, signal.SIGCONT)
            try:
                server.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the server did not stop within 60 s of SIGTERM:\n{server.server_log()}")
            log = server.server_log()
            assert "InvalidStateError" not in log, log
            if "that Jupyter is restarting" not in log:
                continue  # the restart was over before the stop began: not the window under attack
            assert server.kernel_processes() == {} or policy == "suspend" and not any(
                state != "Z" for state in server.kernel_processes().values()), server.kernel_processes()
            server.start()
            if policy == "shutdown":
                time.sleep(1)
                assert server.api("GET", "api/gpumigrate/kernels") == [], "the kernel ended with its server"
                assert server.kernel_processes() == {}, "nothing of it runs"
            else:
                assert taken_back(server, kernel_id)["state"] == "suspended"
                tab = await tab_on(server, kernel_id)
                assert (await tab.run("print('x' in dir(), 6 * 7)", timeout=120)).strip() == "False 42"
                tab.ws.close()
            return
        finally:
            server.stop(signal.SIGKILL)
            server.kill_kernels()
    pytest.fail("the restart was over before the stop began, three times")


async def _stopped_then_back_with_its_value(server: LocalServer, kept: str) -> None:
    """Once ``server`` has stopped (signalled already), ``kept`` has whole images; the next start lists it
    suspended, and a cell brings it back with its ``value`` (41)."""
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not stop within 60 s:\n{server.server_log()}")
    assert (server.state / "images" / kept / "manifest.json").is_file(), server.server_log()
    server.start()
    assert taken_back(server, kept)["state"] == "suspended"
    tab = await tab_on(server, kept)
    assert (await tab.run("print(value + 1)", timeout=120)).strip() == "42"
    tab.ws.close()


async def test_a_second_signal_during_the_stop_keeps_the_images_of_a_kernel_suspended_before(tmp_path):
    """An attack: with the stop policy 'suspend', a second SIGTERM while the first stop suspends the running
    kernels. jupyter_server then shuts every kernel down at once; the extension said the server was stopping
    only once its own suspends were over, so a kernel its user had suspended before was shut down as by its
    user, and its images were deleted. Now they are kept, and the next server resumes it whole; so does it the
    kernel whose suspend the second signal found under way (its shutdown waits for it)."""
    server = LocalServer(tmp_path / "server", extra_config={"GPUMigrateApp": {"stop_policy": "suspend"}})
    try:
        server.start()
        _, kept = notebook_session(server, "kept.ipynb")
        tab = await tab_on(server, kept)
        assert (await tab.run("value = 41\nprint('ok')")).strip() == "ok"
        tab.ws.close()
        assert server.operate(kept, "suspend")["status"] == "succeeded"
        _, big = notebook_session(server, "big.ipynb")
        tab = await tab_on(server, big)  # some 2 GB: its suspend as the server stops lasts a while
        assert (await tab.run("blob = bytes(range(256)) * 8_000_000\nprint('ok')")).strip() == "ok"
        tab.ws.close()
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "suspending 1 kernel(s)" not in server.server_log():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.server_log()
            time.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        await _stopped_then_back_with_its_value(server, kept)
        # The kernel the first stop was suspending: its shutdown waited for that suspend, which it finished.
        assert taken_back(server, big)["state"] == "suspended"
        tab = await tab_on(server, big)
        assert (await tab.run("print(len(blob))", timeout=120)).strip() == str(256 * 8_000_000)
        tab.ws.close()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_a_cell_run_on_a_suspended_kernel_while_the_server_stops_does_not_lose_it(tmp_path):
    """An attack: the server stops (the stop policy 'suspend', held open here by another kernel's dump, which
    is SIGSTOPped), and a cell is run in the open tab of a kernel its user suspended before. The cell used to
    resume that kernel, only for jupyter_server's shutdown to end it as the stop went on: its images and record
    gone for good. Now no operation starts once the stop has begun but the stop's own: the tab is told, the
    kernel stays suspended, and the next server brings it back when the cell is run again."""
    server = LocalServer(tmp_path / "server", extra_config={"GPUMigrateApp": {"stop_policy": "suspend"}})
    criu = None
    try:
        server.start()
        _, kept = notebook_session(server, "kept.ipynb")
        tab = await tab_on(server, kept)
        assert (await tab.run("value = 41\nprint('ok')")).strip() == "ok"
        assert server.operate(kept, "suspend")["status"] == "succeeded"
        _, other = notebook_session(server, "other.ipynb")
        other_tab = await tab_on(server, other)  # 1 GB: its dump lasts long enough to be caught and held
        assert (await other_tab.run("blob = bytes(range(256)) * 4_000_000\nprint('ok')")).strip() == "ok"
        other_tab.ws.close()
        server.proc.send_signal(signal.SIGTERM)
        criu = criu_of(server.proc.pid, b"dump", 30)
        assert criu is not None, server.server_log()
        os.kill(criu, signal.SIGSTOP)  # the stop waits for that suspend: the window stays open
        asked = tab.send("execute_request", {"code": "print(value + 1)", "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False})
        said = ""
        deadline = time.monotonic() + 30
        while "The server is stopping" not in said:
            raw = await asyncio.wait_for(tab.ws.read_message(), max(0.1, deadline - time.monotonic()))
            assert raw is not None and time.monotonic() < deadline, said
            reply = json.loads(raw) if isinstance(raw, str) else {}
            if reply.get("parent_header", {}).get("msg_id") == asked and reply.get("msg_type") == "stream":
                said += reply["content"]["text"]
        assert "could not be resumed" in said and "stays as it is" in said, said
        os.kill(criu, signal.SIGCONT)
        criu = None
        tab.ws.close()
        await _stopped_then_back_with_its_value(server, kept)
        assert taken_back(server, other)["state"] == "suspended", "the stop's own suspend went on"
    finally:
        if criu is not None:
            os.kill(criu, signal.SIGCONT)
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_a_kernel_left_running_by_a_killed_server_is_adopted_with_its_notebook(server):
    server.start()
    session_id, kernel_id, out = await notebook_running(server, "x = 41\nprint('set')")
    assert out == "set"
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    server.stop(signal.SIGKILL)
    assert Path(f"/proc/{pid}").exists(), "the kernel runs on without its server"
    # Records of kernels on another host beside it: one whose peer this server does not know (no longer
    # configured), one that does not say its peer right. Neither is taken back nor deleted: both are listed.
    own = json.loads((server.state / "kernels" / f"{kernel_id}.json").read_text())
    elsewhere = {}
    for remote in ({"peer": "nowhere", "gpus": []}, "nowhere"):
        other = str(uuid.uuid4())
        elsewhere[other] = server.state / "kernels" / f"{other}.json"
        elsewhere[other].write_text(json.dumps({**own, "kernel_id": other, "pid": None, "remote": remote}))

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "running" and view["pid"] == pid, view
    # Its state is heard with no client yet: it stayed 'starting' until one talked to it, and a suspend then took
    # it for busy (its stash stepped aside: a large kernel's suspend many times slower).
    deadline = time.monotonic() + 15
    while view["execution_state"] != "idle":
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
        view = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")
    refused = {r["kernel_id"]: r for r in server.api("GET", "api/gpumigrate/refused")}
    assert set(refused) == set(elsewhere) and all(path.exists() for path in elsewhere.values()), refused
    first, second = elsewhere
    assert "runs on peer nowhere, which this server does not know" in refused[first]["reason"], refused
    assert "Configure peer nowhere again (c.GPUMigrateApp.peers)" in refused[first]["remedy"], refused
    assert "its peer is not said right" in refused[second]["reason"], refused
    for path in elsewhere.values():
        path.unlink()
    sessions = server.api("GET", "api/sessions")
    assert [(s["id"], s["kernel"]["id"]) for s in sessions] == [(session_id, kernel_id)]
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(x + 1)")).strip() == "42"
    tab.ws.close()
    # It shuts down with its server, as its other kernels do. (It is no child of this server: suspended,
    # its exited process is collected by whoever became its parent, PID 1 here, and a PID 1 that collects
    # nothing keeps its PID taken; the resume then names that process: docs/internals.md.)
    server.stop(signal.SIGTERM)
    assert not proctree.is_alive(pid), "a running kernel ends with its server (the default policy)"
    assert not (server.state / "kernels" / f"{kernel_id}.json").exists()


GPU_BUILD = r"""
import hashlib, torch
torch.manual_seed(0)
model = torch.nn.Linear(1024, 1024).cuda()
big = torch.randn(256 * 1024 * 1024, device="cuda")   # 1 GiB
def digest():
    h = hashlib.sha256()
    for t in (*model.state_dict().values(), big):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
before = digest()
print(before)
"""


@pytest.mark.gpu
async def test_a_gpu_kernel_suspended_comes_back_after_its_server_restarts_with_its_tensors(server):
    from jupyter_gpumigrate.engine import gpus as gpus_mod

    gpus = gpus_mod.snapshot()
    server.start()
    _, kernel_id, before = await notebook_running(server, GPU_BUILD, timeout=180)
    op = server.operate(kernel_id, "suspend")
    assert op["status"] == "succeeded" and "checkpoint" in op["timings"], op
    server.stop(signal.SIGTERM)

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "suspended" and view["suspended_on"], view
    # Onto the other GPU where there are two of one model (a remap), else back onto the same one.
    same_model = [g.index for g in gpus if g.name == gpus[0].name]
    to_gpu = same_model[1] if len(same_model) > 1 else same_model[0]
    op = server.operate(kernel_id, "resume", {"to_gpu": to_gpu})
    assert op["status"] == "succeeded" and op["to_gpu"] == to_gpu, op
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(digest())", timeout=180)).strip() == before
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    assert {g.index for g in gpus_mod.snapshot() if pid in g.processes} == {to_gpu}
    tab.ws.close()


def criu_of(server_pid: int, action: bytes, timeout: float) -> int | None:
    """The PID of the server's `criu <action>` once it runs, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            found = proctree.info(int(entry.name))
            if found is None or found.ppid != server_pid:
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"criu") and action in argv:
                return int(entry.name)
        time.sleep(0.005)
    return None


def cut_dump(server: LocalServer, kernel_id: str, pid: int, meanwhile: Callable[[], None] | None = None) -> None:
    """Suspend the kernel (``pid``) and SIGKILL its server once CRIU's dump runs (and ``meanwhile()`` has run):
    CRIU dies with its server, and the kernel runs on."""
    server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
    criu = criu_of(server.proc.pid, b"dump", 60)
    assert criu is not None, "the dump did not start"
    if meanwhile is not None:
        meanwhile()
    server.stop(signal.SIGKILL)
    assert proctree.wait_gone(criu, 10), "CRIU dies with its server"
    assert proctree.is_alive(pid), "the kernel runs on: CRIU gave it back"


async def test_a_server_killed_during_a_dump_loses_nothing(server):
    server.start()
    session_id, kernel_id, out = await notebook_running(
        server, "x = 41\nblob = bytes(range(256)) * 8_000_000\nprint('ok')")
    assert out == "ok"
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    cut_dump(server, kernel_id, pid, lambda: time.sleep(0.2))  # CRIU is writing some 2 GB

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "running" and view["pid"] == pid, view
    assert not (server.state / "images" / kernel_id).exists(), "the unfinished dump is removed"
    assert [s["id"] for s in server.api("GET", "api/sessions")] == [session_id]
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(x + 1, len(blob))")).split() == ["42", str(256 * 8_000_000)]
    tab.ws.close()


@pytest.mark.parametrize("criu", ["ended", "killed as it killed the kernel"])
async def test_a_server_killed_between_the_dump_and_the_manifest_loses_nothing(server, criu):
    # CRIU wrote every image and killed the kernel; the server died before it wrote the manifest: the
    # folder holds the images, CRIU's log, and the manifest to be (pending.json), not the manifest. Or the
    # server died as CRIU killed the kernel, and CRIU with it (a Hub's SIGKILL of a user's server, 0.45 s into
    # a suspend of 600 MB): its log ends at "Unfreezing tasks into 2" and the unseizing of the tree, not at
    # "Dumping finished successfully"; the images were whole all the same.
    server.start()
    _, kernel_id, out = await notebook_running(server, "x = 41\nprint('set')")
    assert out == "set"
    assert server.operate(kernel_id, "suspend")["status"] == "succeeded"
    server.stop(signal.SIGKILL)
    images = server.state / "images" / kernel_id
    (images / "manifest.json").rename(images / "pending.json")
    if criu != "ended":
        log = server.state / "images" / ".logs" / f"{kernel_id}-dump.log"
        lines = log.read_bytes().splitlines(keepends=True)
        turn = next(i for i, line in enumerate(lines) if b"Unfreezing tasks into 2" in line)
        log.write_bytes(b"".join(lines[:turn + 2]))  # the turn, and the unseizing of the first task
        assert b"Dumping finished successfully" not in log.read_bytes()

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "suspended", view
    assert (images / "manifest.json").is_file() and not (images / "pending.json").exists()
    assert "completed the images of kernel" in server.server_log()
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(x + 1)", timeout=120)).strip() == "42"
    tab.ws.close()


@pytest.mark.gpu
async def test_a_gpu_kernel_left_checkpointed_by_a_killed_server_runs_again_with_its_tensors(server):
    from jupyter_gpumigrate.engine import gpus as gpus_mod
    from jupyter_gpumigrate.engine.cudackpt import CudaProcess

    server.start()
    _, kernel_id, before = await notebook_running(server, GPU_BUILD, timeout=180)
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    on = {g.index for g in gpus_mod.snapshot() if pid in g.processes}
    # What a server killed in the middle of a GPU move or suspend leaves: the kernel locked and its GPU
    # memory checkpointed into its host memory (made here with the driver's own API), then the server dies.
    cuda = CudaProcess(pid)
    cuda.lock(60)
    cuda.checkpoint()
    assert cuda.state == "checkpointed"
    server.stop(signal.SIGKILL)

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "running" and view["pid"] == pid, view
    assert CudaProcess(pid).state == "running"
    assert {g.index for g in gpus_mod.snapshot() if pid in g.processes} == on, "back on its GPU"
    assert "was left checkpointed by its server; it runs again" in server.server_log()
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(digest())", timeout=180)).strip() == before
    tab.ws.close()


def collect_exited(session: int, timeout: float = 5) -> None:
    """Collect the exited processes of a kernel's session that a killed server left to this process, as a
    machine's init collects those left to it. (This machine's PID 1 collects nothing, so the tests' process
    stands in for it as the subreaper of its servers' orphans; with a PID 1 that collects none, the PIDs of
    a killed half-restored tree would stay taken: docs/internals.md, "PIDs".)"""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proctree.reap_orphans({session}, set())
        time.sleep(0.05)


@pytest.mark.parametrize("when", ["restore starts", "tree half restored"])
async def test_a_server_killed_during_a_restore_loses_nothing_and_leaves_no_process_behind(server, when):
    assert proctree.become_subreaper()  # the init of what its servers leave (collect_exited)
    server.start()
    session_id, kernel_id, out = await notebook_running(
        server, "x = 41\nblob = bytes(range(256)) * 1_600_000\nprint('ok')")  # some 400 MB to restore
    assert out == "ok"
    assert server.operate(kernel_id, "suspend")["status"] == "succeeded"
    assert server.kernel_processes() == {}, "suspended: no process of it runs"
    pid = json.loads((server.state / "images" / kernel_id / "manifest.json").read_text())["pid"]

    # Resume, followed through the API; the server is killed as soon as the operation says "restore".
    op = server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/resume", {}, expect=202)
    deadline = time.monotonic() + 60
    while op["phase"] != "restore":
        assert op["status"] in ("pending", "running") and time.monotonic() < deadline, op
        op = server.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    criu = criu_of(server.proc.pid, b"restore", 5)
    assert criu is not None, "CRIU's restore had ended before it was seen: make the kernel bigger"
    if when == "tree half restored":
        # CRIU has made the kernel's process again (under its own PID) and is filling in its memory.
        while not proctree.is_alive(pid):
            assert proctree.is_alive(criu), "CRIU ended before the kernel's process was seen: make it bigger"
            time.sleep(0.001)
    server.stop(signal.SIGKILL)
    assert proctree.wait_gone(criu, 10), "CRIU dies with its server"

    server.start()
    view = taken_back(server, kernel_id)
    collect_exited(pid)
    # Whatever CRIU had done by then: the kernel is back, running whole, or suspended from its intact images.
    assert view["state"] in ("running", "suspended"), view
    left = server.kernel_processes()
    if view["state"] == "suspended":
        assert left == {}, f"a half-restored tree was left: {left}"
        assert (server.state / "images" / kernel_id / "manifest.json").is_file()
    else:
        assert set(left) <= set(proctree.descendants(view["pid"])), (view, left)
    assert [s["id"] for s in server.api("GET", "api/sessions")] == [session_id]
    tab = await tab_on(server, kernel_id)  # a cell resumes it if it is suspended
    assert (await tab.run("print(x + 1, len(blob))", timeout=120)).split() == ["42", str(256 * 1_600_000)]
    tab.ws.close()
    view = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["state"] == "running", view
    left = server.kernel_processes()
    assert set(left) == set(proctree.descendants(view["pid"])), f"processes of no kernel: {left}"
    assert all(state not in ("T", "t", "Z") for state in left.values()), f"stopped or dead: {left}"
    assert not (server.state / "images" / kernel_id).exists(), "no stale images"
