"""A busy kernel's safe point (engine/safepoint.py, kernel/safepoint.py), on CPU kernels: a cell in the middle
of a loop serves the host stash of a suspend between two of its bytecodes, waits there across the dump and
the restore, and goes on whole; a cell that cannot get there in time is carried by CRIU alone, and the
signal that reaches it late changes nothing; the fast path's session is served at a safe point too. Attacks:
a server or CRIU SIGKILLed while the cell waits there, a full disk during the stash, a failed dump, an alarm
during the wait, a lock held where the signal stops the cell, garbage in the request: the cell goes on whole.

The GPU suite covers CUDA storages (tests/test_gpu.py): the calls are the same code.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import (OPEN_IO_URING, api, operate, server_sees_idle, small_tmpfs, start_busy, wait_operation,
                     wait_suspended)
from test_hibernation import criu_of, cut_dump, notebook_session, tab_on, taken_back

from jupyter_gpumigrate.engine import proctree
from jupyter_gpumigrate.engine.safepoint import SIGNAL, SafePoint, signal_main_thread
from jupyter_gpumigrate.kernel import safepoint as kernel_safepoint
from jupyter_gpumigrate.engine.stash import Stash

pytestmark = pytest.mark.usefixtures("criu_binary")

#: three buffers of 96 MiB, each of its own known bytes, so that the test can compute what the loop makes
MAKE = """
import hashlib, time
blobs = [bytearray((bytes(range(k, 256)) + bytes(range(k))) * (96 * 4096)) for k in range(3)]
print(len(blobs[2]))
"""
#: a cell that changes the buffers as it goes, and says what they hold at its end
LOOP = """
for i in range({steps}):
    blobs[i % 3][i * 7919 % len(blobs[0])] ^= 0x5A
    time.sleep(0.05)
result = hashlib.sha256(b"".join(blobs)).hexdigest() + " " + str(i)
{end}
"""


def expected(steps: int) -> str:
    """What the loop of ``steps`` prints (0: the digest of the buffers as made)."""
    blobs = [bytearray((bytes(range(k, 256)) + bytes(range(k))) * (96 * 4096)) for k in range(3)]
    for i in range(steps):
        blobs[i % 3][i * 7919 % len(blobs[0])] ^= 0x5A
    return hashlib.sha256(b"".join(blobs)).hexdigest() + f" {steps - 1}"


def _config(state_dir: Path, **provisioner: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(state_dir), "host_stash_min": 10**8, "suspend_to": "disk",
                                  **provisioner},
    }


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return _config(tmp_path / "gpumigrate", safe_point_timeout=2.0)


async def test_a_busy_cell_is_suspended_at_a_safe_point_and_goes_on_whole(jp_fetch, jp_serverapp, kernel):
    assert (await kernel.run(MAKE)).strip() == str(96 << 20)
    cell = await start_busy(jp_fetch, kernel, LOOP.format(steps=120, end="print(result)"))
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert op["stash"]["stashed"] == 3 * 96 << 20 and op["stash"]["safe_point"] < 2.0, op["stash"]
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    folder = provisioner.images.path_for(kernel.id)
    assert json.loads((folder / "manifest.json").read_text())["stash"]["buffers"] == 3
    assert not cell.done(), "the cell waits, suspended, at its safe point"
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded" and op["stash"]["unstashed"] == 3 * 96 << 20, op
    result = await cell
    assert result.status == "ok", result.errors
    assert result.out.strip() == expected(120), "every step ran once, on buffers that came back whole"
    assert not list(provisioner.safe_point_dir.glob("waiting-*")), "the kernel no longer waits"
    assert (await kernel.run("print(len(blobs[0]))")).strip() == str(96 << 20)


async def test_a_kernel_heard_idle_whose_main_thread_runs_is_served_at_its_safe_point(jp_fetch, jp_serverapp,
                                                                                           kernel):
    """The server hears a kernel idle while its main thread runs: work scheduled on the kernel's event loop (an
    asyncio task, a timer) runs between cells, with no 'busy'; and a cell whose first call holds the GIL
    starves the kernel's IOPub thread, whose 'busy' then goes out only after that call. Asked between cells,
    such a kernel answered only after that work: the suspend waited for all of it. The server now sees the
    main thread run, takes the kernel as busy, and the stash is served at its safe point; the work goes on
    whole after the resume."""
    assert (await kernel.run(MAKE)).strip() == str(96 << 20)
    pid = (await api(jp_fetch, "kernels", kernel.id))["pid"]
    later = ("import asyncio\ndef work():\n    global result\n    end = time.monotonic() + 40\n"
             "    while time.monotonic() < end:\n        pass\n" +
             "".join(f"    {line}\n" for line in LOOP.format(steps=10, end="").strip().splitlines()) +
             "asyncio.get_running_loop().call_later(0.2, work)\nprint('scheduled')")
    assert (await kernel.run(later)).strip() == "scheduled"
    deadline = time.monotonic() + 10
    while not proctree.main_thread_running(pid):
        assert time.monotonic() < deadline, "the scheduled work did not start"
        await asyncio.sleep(0.05)
    await server_sees_idle(jp_fetch, kernel)  # the cell is over: nothing says the kernel works
    started = time.monotonic()
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded" and op["stash"].get("stashed") == 3 * 96 << 20, op
    assert "safe_point" in op["stash"], op["stash"]
    assert time.monotonic() - started < 30, "suspended while the work ran, not after it"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    # A cell waits behind the work on the kernel's event loop, then says what the work made.
    assert (await kernel.run("print(result)", timeout=120)).strip() == expected(10)


async def test_a_failed_suspend_gives_the_buffers_back_to_the_busy_cell(jp_fetch, jp_serverapp, kernel):
    assert (await kernel.run(OPEN_IO_URING + MAKE)).strip() == str(96 << 20)  # CRIU cannot dump an io_uring
    cell = await start_busy(jp_fetch, kernel, LOOP.format(steps=80, end="print(result)"))
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    assert "stash" in op["timings"], "the dump failed after the stash, whose undo gave the buffers back"
    result = await cell
    assert result.status == "ok" and result.out.strip() == expected(80), result.errors


async def test_a_cell_holding_a_lock_of_the_threading_module_is_served_once_it_lets_go(jp_fetch, jp_serverapp,
                                                                                        kernel):
    """The stash lists and starts threads: stopped where the cell holds threading's own lock, it would wait
    for itself forever. The handler lets those signals pass; the server's next one, once the lock is free,
    is served."""
    assert (await kernel.run(MAKE)).strip() == str(96 << 20)
    hold = "import threading\nwith threading._shutdown_locks_lock:\n    time.sleep(1.0)\n" + \
        LOOP.format(steps=60, end="print(result)")
    cell = await start_busy(jp_fetch, kernel, hold)
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded" and op["stash"].get("stashed") == 3 * 96 << 20, op
    assert op["stash"]["safe_point"] > 0.3, "served only once the lock was let go"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    result = await cell
    assert result.status == "ok" and result.out.strip() == expected(60), result.errors


async def test_criu_killed_while_the_cell_waits_at_its_safe_point_gives_the_cell_its_buffers_back(
        jp_fetch, jp_serverapp, kernel):
    """SIGKILL of CRIU during the dump (the cell waiting at its safe point, its buffers in the stash): the
    suspend fails in the dump, its undo releases the cell, which reads them back and goes on whole."""
    # 1.5 GB that CRIU dumps itself: the dump lasts long enough to be cut.
    assert (await kernel.run(MAKE + "ballast = bytes(range(256)) * 6_000_000")).strip() == str(96 << 20)
    cell = await start_busy(jp_fetch, kernel, LOOP.format(steps=80, end="print(result)"))
    op = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202)
    criu = await asyncio.to_thread(criu_of, os.getpid(), b"dump", 60)
    assert criu is not None, "the dump did not start"
    os.kill(criu, signal.SIGKILL)
    op = await wait_operation(jp_fetch, op)
    if op["status"] == "succeeded":
        # Found late (a loaded machine), CRIU was killed once it had written everything and said its final
        # state (criu.dump_finished takes that as a dump that succeeded): the kernel is suspended whole, and
        # its resume gives the cell its buffers back instead of the undo.
        assert "stash" in op["timings"], op
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    else:
        assert op["status"] == "failed" and op["failed_phase"] == "dump" and "stash" in op["timings"], op
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    result = await cell
    assert result.status == "ok" and result.out.strip() == expected(80), result.errors
    assert (await kernel.run("print(len(ballast))")).strip() == str(256 * 6_000_000)


async def test_garbage_in_the_request_changes_nothing(jp_fetch, jp_serverapp, kernel):
    """A request file that is not JSON, or names no call this version has: the signal costs the cell nothing,
    and the kernel answers a real request after."""
    await kernel.run("import time")
    cell = await start_busy(jp_fetch, kernel, "for i in range(80):\n    time.sleep(0.05)\nprint(i)")
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    request = provisioner.safe_point_dir / f"request-{provisioner.pid}.json"
    request.write_bytes(b"\x00{not json")
    signal_main_thread(provisioner.pid, SIGNAL)
    point = SafePoint(provisioner.safe_point_dir, provisioner.pid)
    claim = await asyncio.to_thread(point.call, "no-such-call", {}, 5.0)
    assert claim is not None, point.reason
    with pytest.raises(RuntimeError, match="no call 'no-such-call' at the safe point"):
        await asyncio.to_thread(claim.reply, 10.0)
    assert not request.exists() and not list(provisioner.safe_point_dir.glob("waiting-*"))
    result = await cell
    assert result.status == "ok" and result.out.strip() == "79", result.errors


async def test_the_fast_paths_session_is_served_at_a_safe_point(jp_fetch, jp_serverapp, kernel):
    """A GPU move's stager, asked while a cell runs: on this CPU kernel it says why it steps aside, from
    inside the cell, which goes on."""
    await kernel.run("import time")
    cell = await start_busy(jp_fetch, kernel, "for i in range(60):\n    time.sleep(0.05)\nprint(i)")
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    stash = Stash()
    try:
        assert await asyncio.to_thread(provisioner.invite_stager, stash.path, stash.token) is None
        offer = await asyncio.to_thread(stash.accept, 10.0)
        assert offer is not None and offer.pid == provisioner.pid, stash.reason
        assert offer.aside == "the kernel does not use CUDA through PyTorch"
        assert not cell.done(), "the cell waits while the session lasts"
    finally:
        await asyncio.to_thread(stash.close)
    result = await cell
    assert result.status == "ok" and result.out.strip() == "59"


async def test_migrate_suspend_writes_the_notebooks_buffers_at_its_own_safe_point(jp_fetch, jp_serverapp, kernel):
    """%migrate --suspend: the cell that asks is busy waiting for its own suspend, so the host stash is served
    at its safe point; once resumed, the cell says how it went and every buffer is back."""
    assert (await kernel.run(MAKE)).strip() == str(96 << 20)
    cell = asyncio.ensure_future(kernel.execute("%migrate --suspend\nafter = 'went on'", timeout=180))
    await wait_suspended(jp_fetch, kernel.id, cell, 120)
    folder = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.images.path_for(kernel.id)
    stash = json.loads((folder / "manifest.json").read_text())["stash"]
    assert stash["stashed"] == 3 * 96 << 20 and stash["buffers"] == 3, stash
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    result = await cell
    assert result.status == "ok" and "Everything in memory is as it was." in result.out, result.errors
    assert (await kernel.run("print(after, hashlib.sha256(b''.join(blobs)).hexdigest())")).split() == \
        ["went", "on", expected(0).split()[0]]


class _OnASmallDisk:
    """A server whose state folder is on a tmpfs of :attr:`size`."""

    size = ""

    @pytest.fixture
    def small_disk(self, tmp_path: Path):
        with small_tmpfs(tmp_path / "small", self.size) as folder:
            yield folder

    @pytest.fixture
    def jp_server_config(self, small_disk: Path) -> dict[str, Any]:
        return _config(small_disk / "gpumigrate")


class TestFullDisk(_OnASmallDisk):
    """A 200 MB tmpfs: room for the kernel's CRIU images, not for its 288 MB of buffers."""

    size = "200m"

    async def test_a_disk_that_fills_during_the_stash_at_a_safe_point_leaves_the_cell_going_on_whole(
            self, jp_fetch, jp_serverapp, kernel, small_disk):
        assert (await kernel.run(MAKE)).strip() == str(96 << 20)
        cell = await start_busy(jp_fetch, kernel, LOOP.format(steps=60, end="print(result)"))
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "failed" and op["failed_phase"] == "stash", op
        assert "full" in op["error"] and "runs on, unchanged" in op["error"], op["error"]
        result = await cell
        assert result.status == "ok" and result.out.strip() == expected(60), result.errors
        provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
        assert not provisioner.images.path_for(kernel.id).exists(), "the partial files are removed"
        assert not list(provisioner.safe_point_dir.glob("waiting-*"))


class TestDiskFullForTheDump(_OnASmallDisk):
    """A 310 MB tmpfs: room for the kernel's 288 MB of buffers, not for CRIU's images after them."""

    size = "310m"

    async def test_a_dump_that_fills_the_disk_after_the_stash_gives_the_cell_its_buffers_back(
            self, jp_fetch, jp_serverapp, kernel, small_disk):
        """The stash is written at the cell's safe point, and CRIU's dump then fills the disk. The undo's release
        (a file in the safe-point folder, on the same disk) must still reach the cell waiting there: the
        reserve kept beside it makes room for it."""
        assert (await kernel.run(MAKE)).strip() == str(96 << 20)
        cell = await start_busy(jp_fetch, kernel, LOOP.format(steps=60, end="print(result)"))
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "failed" and op["failed_phase"] == "dump", op
        assert "stash" in op["timings"], op  # the stash was written: the dump came after it
        assert "full" in op["error"] and "runs on, unchanged" in op["error"], op["error"]
        assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
        result = await asyncio.wait_for(cell, 120)
        assert result.status == "ok" and result.out.strip() == expected(60), result.errors
        provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
        assert not provisioner.images.path_for(kernel.id).exists(), "the partial files are removed"
        assert not list(provisioner.safe_point_dir.glob("waiting-*"))
        assert not list(provisioner.safe_point_dir.glob(".*.tmp")), "no half-written file is left"


class TestNoSafePointInTime:
    @pytest.fixture
    def jp_server_config(self, tmp_path: Path) -> dict[str, Any]:
        return _config(tmp_path / "gpumigrate", safe_point_timeout=1.0)

    async def test_a_cell_that_cannot_reach_one_is_carried_by_criu_alone(self, jp_fetch, jp_serverapp, kernel):
        """The cell holds the safe point's signal back (as a long call into C would delay it): the request
        is withdrawn after the bound, CRIU carries the buffers, and the signal, delivered once the cell lets
        it through after the resume, finds nothing to do."""
        assert (await kernel.run(MAKE)).strip() == str(96 << 20)
        hold = (f"import signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {{{SIGNAL}}})\n"
                + LOOP.format(steps=100, end=f"signal.pthread_sigmask(signal.SIG_UNBLOCK, {{{SIGNAL}}})\nprint(result)"))
        cell = await start_busy(jp_fetch, kernel, hold)
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "succeeded", op
        assert "did not reach a safe point within 1 s" in op["stash"]["aside"], op["stash"]
        provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
        assert not list(provisioner.safe_point_dir.glob("request-*")), "the request was withdrawn"
        folder = provisioner.images.path_for(kernel.id)
        assert "stash" not in json.loads((folder / "manifest.json").read_text()) or \
            not json.loads((folder / "manifest.json").read_text())["stash"]
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
        result = await cell
        assert result.status == "ok" and result.out.strip() == expected(100), result.errors
        assert (await kernel.run("print(sum(len(b) for b in blobs))")).strip() == str(3 * 96 << 20)


def test_an_interrupt_while_the_cell_waits_is_held_until_its_buffers_are_back(tmp_path: Path) -> None:
    """The kernel's side, here in the main thread: an alarm whose handler raises (a time limit) fires while
    the cell waits at its safe point with its buffers away; the wait goes on until the release, the buffers
    come back, and only then is the alarm's exception handed to the cell."""

    class Alarm(Exception):
        pass

    def ring(signum: int, frame: Any) -> None:
        raise Alarm()

    gc.collect()
    ns = {"blob": bytearray(b"x" * (32 << 20)), "In": []}
    blob = ns["blob"]
    points, images = tmp_path / "points", tmp_path / "images"
    points.mkdir()
    images.mkdir()
    me = os.getpid()

    # The server, a process of its own (a thread here would make the stash step aside): once the stash has
    # answered (the buffers are away, the cell waits), it sets off the alarm, and releases the wait a second
    # later. (A timer of 0.5 s went off in the stash itself on a loaded machine: the test then failed.)
    server = subprocess.Popen([sys.executable, "-c", f"""
import os, signal, time
from pathlib import Path
from jupyter_gpumigrate.engine.safepoint import write_whole
points = Path({str(points)!r})
while not (points / "reply-r1.json").exists():
    time.sleep(0.01)
os.kill({me}, signal.SIGALRM)
time.sleep(1.0)
write_whole(points / "release-{me}.json", {{"id": "back", "for": "r1", "args": {{"folder": {str(images)!r}}}}})
"""])
    old = signal.signal(signal.SIGALRM, ring)  # (pytest-timeout's own is put back after)
    try:
        deferred = kernel_safepoint._serve(points, me, {"id": "r1", "call": "hoststash",
                                                        "args": {"folder": str(images), "min_total": 1}})
    finally:
        signal.signal(signal.SIGALRM, old)
        server.kill()
        server.wait()
    assert isinstance(deferred, Alarm), deferred
    assert blob == bytearray(b"x" * (32 << 20)), "the buffer is back before the alarm reaches the cell"
    assert json.loads((points / "reply-r1.json").read_text())["stashed"] == 32 << 20
    assert json.loads((points / "reply-back.json").read_text())["unstashed"] == 32 << 20
    assert not (points / f"waiting-{me}.json").exists()


def test_a_kernel_without_its_handler_is_not_signalled(tmp_path: Path) -> None:
    """No armed file, or a process that does not catch the signal (its default would end it): not asked."""
    point = SafePoint(tmp_path, 1)
    assert point.call("hoststash", {}, 0.1) is None and "no safe point" in point.reason
    (tmp_path / "armed-1.json").write_text(json.dumps({"signal": SIGNAL}))  # PID 1 catches no such signal
    assert point.call("hoststash", {}, 0.1) is None and "not armed" in point.reason
    assert not list(tmp_path.glob("request-*"))


# -- a server killed while the cell waits at its safe point --------------------------------------------------


async def test_a_server_killed_while_the_cell_waits_at_its_safe_point_loses_nothing(process_server, tmp_path):
    server = process_server
    server.start()
    _, kernel_id = notebook_session(server)
    tab = await tab_on(server, kernel_id)
    # Its buffers go to the stash; 1.5 GB more that CRIU dumps itself, so that the dump can be cut.
    assert (await tab.run(MAKE + "ballast = bytes(range(256)) * 6_000_000")).strip() == str(96 << 20)
    out = tmp_path / "result.txt"
    tab.send("execute_request", {"code": LOOP.format(steps=100, end=f"open({str(out)!r}, 'w').write(result)"),
                                 "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False})
    deadline = time.monotonic() + 30
    while server.api("GET", f"api/kernels/{kernel_id}")["execution_state"] != "busy":
        assert time.monotonic() < deadline, "the cell did not start"
        time.sleep(0.05)
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    points = server.state / "safepoints" / kernel_id

    def waits() -> None:
        assert (points / f"waiting-{pid}.json").is_file(), "the cell waits at its safe point, its buffers away"

    cut_dump(server, kernel_id, pid, waits)
    tab.ws.close()
    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "running" and view["pid"] == pid, view
    assert "read back the buffers it had written" in server.server_log()
    deadline = time.monotonic() + 60
    while not out.exists():
        assert time.monotonic() < deadline, "the cell did not go on"
        time.sleep(0.1)
    time.sleep(0.2)
    assert out.read_text() == expected(100)
    assert not (points / f"waiting-{pid}.json").exists()
