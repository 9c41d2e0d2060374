"""A state folder on a full disk: the suspend fails saying so, and the kernel runs on with its state."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers import api, fill, operate, small_tmpfs
from servers import LocalServer
from test_hibernation import criu_of, notebook_session, tab_on, taken_back

from jupyter_gpumigrate.engine import proctree
from jupyter_gpumigrate.engine.images import FILLED
from jupyter_gpumigrate.engine.plans.suspend import MEMORY_UNDONE
from jupyter_gpumigrate.opformat import report

pytestmark = pytest.mark.usefixtures("criu_binary")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 24 MB tmpfs: too small for any kernel's images (an idle one needs some 75 MB)."""
    with small_tmpfs(tmp_path / "small", "24m") as folder:
        yield folder


@pytest.fixture
def jp_server_config(small_disk: Path) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(small_disk / "gpumigrate"), "suspend_to": "disk"},
    }


async def test_a_full_disk_says_so_names_the_folder_and_the_kernel_runs_on(jp_fetch, kernel, small_disk):
    assert (await kernel.run("x = 41\nprint('set')")).strip() == "set"
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    assert "full" in op["error"] and str(small_disk / "gpumigrate") in op["error"], op["error"]
    assert "runs on, unchanged" in op["error"] and "close it in the notebook" not in op["error"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    assert (await kernel.run("print(x + 1)")).strip() == "42"
    # The half-written images were removed: the disk has its room back.
    images = small_disk / "gpumigrate" / "images"
    assert not (images / kernel.id).exists()
    logs = images / ".logs"
    assert [p.name for p in logs.iterdir()] == [f"{kernel.id}-dump.log"], "the failed dump's log is kept"
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    assert list(logs.iterdir()) == [], "and removed with its kernel"


@pytest.mark.parametrize("where", ["disk", "memory"])
class TestFilledWhileSuspended:
    """The kernel's images are whole, on disk or in memory (a tmpfs); then another process fills that place.
    CRIU's restore writes there (its log, the PID file of what it restored)."""

    @pytest.fixture
    def small_disk(self, tmp_path: Path):
        with small_tmpfs(tmp_path / "small", "200m") as folder:
            yield folder

    @pytest.fixture
    def jp_server_config(self, small_disk: Path, tmp_path: Path, where: str) -> dict[str, Any]:
        if where == "disk":
            places = {"state_dir": str(small_disk / "gpumigrate"), "suspend_to": "disk"}
        else:
            memory = small_disk / "memory"
            memory.mkdir(mode=0o700)
            places = {"state_dir": str(tmp_path / "gpumigrate"), "memory_dir": str(memory), "suspend_to": "memory"}
        return {"ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}}, "MigratableProvisioner": places}

    async def test_the_resume_says_the_place_is_full_keeps_the_images_and_resumes_once_there_is_room(
            self, jp_fetch, kernel, small_disk, where):
        assert (await kernel.run("x = 41\nprint('set')")).strip() == "set"
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "succeeded" and op["images"] == where, op
        filler = fill(small_disk)
        op = await operate(jp_fetch, kernel.id, "resume")
        assert op["status"] == "failed" and op["failed_phase"] == "restore", op
        said = (f"The disk of {small_disk / 'gpumigrate' / 'images'} is full" if where == "disk" else
                f"The memory folder {small_disk / 'memory'} (a tmpfs) is full")
        assert said in op["error"], op["error"]
        assert "the images are kept" in op["error"].lower(), op["error"]
        assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
        filler.unlink()
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
        assert (await kernel.run("print(x + 1)")).strip() == "42"


async def test_a_disk_filled_between_the_dump_and_its_manifest_leaves_the_kernel_resumable(tmp_path):
    """CRIU has dumped the kernel (and so ended it); its server, held still with SIGSTOP, finds the disk full
    when it writes the manifest after it. The undo's restore cannot run there either (CRIU writes its log beside
    the images): the kernel is broken, with whole images that lack only their manifest. Once there is room,
    a resume writes it and brings the kernel back as it was."""
    with small_tmpfs(tmp_path / "small", "200m") as small:
        srv = LocalServer(tmp_path / "server", {"MigratableProvisioner": {"state_dir": str(small / "state")}})
        try:
            srv.start()
            _, kernel_id = notebook_session(srv)
            tab = await tab_on(srv, kernel_id)
            assert (await tab.run("x = 41; print('set')")).strip() == "set"
            tab.ws.close()
            op = srv.api("POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
            criu = criu_of(srv.proc.pid, b"dump", 60)
            assert criu is not None, "the dump did not start"
            os.kill(srv.proc.pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 60
                while (found := proctree.info(criu)) is not None and found.state != "Z":  # ended, not reaped
                    assert time.monotonic() < deadline, "CRIU's dump did not end"
                    time.sleep(0.01)
                filler = fill(small)
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            while op["status"] not in ("succeeded", "failed"):
                op = srv.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            assert op["status"] == "failed" and op["failed_phase"] == "dump", op
            assert "is full: the kernel's manifest could not be written" in op["error"], op["error"]
            view = srv.api("GET", f"api/gpumigrate/kernels/{kernel_id}")
            assert view["state"] == "broken", view
            assert "Its images are whole and kept: resume it" in view["broken_reason"], view["broken_reason"]
            filler.unlink()
            op = srv.operate(kernel_id, "resume")
            assert op["status"] == "succeeded", op
            tab = await tab_on(srv, kernel_id)
            assert (await tab.run("print(x + 1)")).strip() == "42"
            tab.ws.close()
        finally:
            srv.stop(signal.SIGKILL)
            srv.kill_kernels()


async def test_a_server_stopping_with_its_disk_full_suspends_its_kernels_to_memory_instead(tmp_path):
    """The stop policy 'suspend', images to disk, and the disk full: the stop's suspend failed and the kernel was
    shut down, with all it held. Now its images go to memory instead (where there is room): the move to disk as
    the server stops fails too and leaves them there, and the next start on this host takes the kernel back."""
    with small_tmpfs(tmp_path / "small", "200m") as small:
        srv = LocalServer(tmp_path / "server", {
            "MigratableProvisioner": {"state_dir": str(small / "state"), "suspend_to": "disk"},
            "GPUMigrateApp": {"stop_policy": "suspend"}})
        try:
            srv.start()
            _, kernel_id = notebook_session(srv)
            tab = await tab_on(srv, kernel_id)
            assert (await tab.run("x = 41; print('set')")).strip() == "set"
            tab.ws.close()
            filler = fill(small)
            srv.stop(signal.SIGTERM, timeout=120)
            log = srv.server_log()
            assert f"kernel {kernel_id}: its disk is full" in log and "suspending it to memory instead" in log, log
            assert "It is shut down" not in log, log
            filler.unlink()
            srv.start()
            view = taken_back(srv, kernel_id)
            assert view["state"] == "suspended" and view["images"] == "memory", view
            tab = await tab_on(srv, kernel_id)
            assert (await tab.run("print(x + 1)", timeout=120)).strip() == "42"
            tab.ws.close()
        finally:
            srv.stop(signal.SIGKILL)
            srv.kill_kernels()


@pytest.mark.parametrize("disk", ["with room", "full too"])
async def test_memory_filling_during_an_auto_suspend_puts_the_images_on_disk_instead(tmp_path, disk):
    """Images "auto" (the default): memory had room for what the kernel's resident size says, but the kernel
    holds more (a memfd of 190 MB, as a DataLoader's shared buffers may be), and its images fill the tmpfs as
    CRIU writes them. The dump fails and rolls back (the kernel runs on), and the suspend goes again with its
    images on disk, saying why (the operation, the CLI's line), the first attempt's seconds and CRIU log kept:
    a suspend the idle policy asked for still frees the kernel's memory and GPU. It resumes as it was. With
    the disk full too, the suspend fails saying both, and the kernel runs on as it was."""
    async with _holding_more_than_it_shows(tmp_path) as (srv, kernel_id, memory, state):
        filler = fill(state) if disk == "full too" else None
        op = srv.operate(kernel_id, "suspend")
        logs = state / "images" / ".logs"
        assert (logs / f"{kernel_id}-dump-memory.log").is_file(), "the first attempt's CRIU log is kept"
        assert not (memory / kernel_id).exists(), "nothing of the failed images stays in memory"
        if filler is not None:
            assert op["status"] == "failed", op
            assert op["error"].startswith(f"The {FILLED} in {memory}, so the suspend went to disk, where it "
                                          f"failed too: The disk of {state / 'images'} is full"), op["error"]
            assert "runs on, unchanged" in op["error"] and op["timings"][MEMORY_UNDONE] > 0, op
            assert (srv.api("GET", f"api/gpumigrate/kernels/{kernel_id}"))["state"] == "running"
            assert not (state / "images" / kernel_id).exists()
            filler.unlink()
            # Its next suspend (to disk, where memory is not tried) drops it, as each dump drops the last one's
            # log: it would be taken for that suspend's first attempt.
            op = srv.operate(kernel_id, "suspend", {"images": "disk"})
            assert op["status"] == "succeeded" and MEMORY_UNDONE not in op["timings"], op
            assert not (logs / f"{kernel_id}-dump-memory.log").exists(), "an earlier suspend's log stays"
        else:
            assert op["status"] == "succeeded" and op["images"] == "disk", (op, srv.server_log())
            why = f"{FILLED} in {memory}; written to disk instead"
            assert op["images_why"] == why and op["timings"][MEMORY_UNDONE] > 0, op
            assert report(op).startswith(f"Kernel {kernel_id} suspended to disk ({why}) in "), report(op)
            log = srv.server_log()
            assert f"kernel {kernel_id}: {FILLED} in {memory}" in log and "to disk instead" in log, log
        assert srv.operate(kernel_id, "resume")["status"] == "succeeded"
        assert list(logs.glob(f"{kernel_id}-*.log")) == [], "a resume drops the logs of the suspend it undoes"
        tab = await tab_on(srv, kernel_id)
        said = await tab.run("os.lseek(fd, 0, 0)\nprint(next(count), os.read(fd, 1 << 20) == chunk, "
                             "os.fstat(fd).st_size >> 20)")
        assert said.split() == ["42", "True", "190"], said
        tab.ws.close()


@asynccontextmanager
async def _holding_more_than_it_shows(tmp_path: Path) -> AsyncIterator[tuple[LocalServer, str, Path, Path]]:
    """A server of its own whose suspends are "auto", its memory folder on a 200 MB tmpfs and its state folder on
    one of 400 MB, with a kernel that holds more than its resident size shows (a memfd of 190 MB, as a
    DataLoader's shared buffers may be): its images fill the memory folder. The server, the kernel's id, the
    memory folder and the state folder."""
    with small_tmpfs(tmp_path / "small", "200m") as small, small_tmpfs(tmp_path / "disk", "400m") as state:
        memory = small / "memory"
        srv = LocalServer(tmp_path / "server", {"MigratableProvisioner": {
            "state_dir": str(state), "memory_dir": str(memory), "suspend_to": "auto"}})
        try:
            srv.start()
            _, kernel_id = notebook_session(srv)
            tab = await tab_on(srv, kernel_id)
            held = ("import os, itertools\ncount = itertools.count(41); next(count)\nchunk = os.urandom(1 << 20)\n"
                    "fd = os.memfd_create('held')\nfor _ in range(190): os.write(fd, chunk)\nprint('set')")
            assert (await tab.run(held)).strip() == "set"
            tab.ws.close()
            yield srv, kernel_id, memory, state
        finally:
            srv.stop(signal.SIGKILL)
            srv.kill_kernels()


def _ended(srv: LocalServer, op: dict) -> dict:
    while op["status"] not in ("succeeded", "failed"):
        op = srv.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return op


@contextmanager
def _stopped_while_dumped(srv: LocalServer, kernel_id: str, restart: bool = False) -> Iterator[dict]:
    """A suspend of ``kernel_id``, its CRIU held with SIGSTOP while the kernel's user shuts the kernel down
    (DELETE), or restarts it, from a thread: the body runs once the server has begun a shutdown; then CRIU goes
    on, and the shutdown (or restart) is waited for. The suspend's operation, as it began."""
    op = srv.api("POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
    criu = criu_of(srv.proc.pid, b"dump", 60)
    assert criu is not None, "the dump did not start"
    os.kill(criu, signal.SIGSTOP)
    try:
        asked = ("POST", f"api/kernels/{kernel_id}/restart") if restart else ("DELETE", f"api/kernels/{kernel_id}")
        stopping = threading.Thread(target=srv.api, args=asked)
        stopping.start()
        deadline = time.monotonic() + 30  # the request may take a while to arrive on a loaded machine
        while not restart and f"Kernel shutdown: {kernel_id}" not in srv.server_log():
            assert time.monotonic() < deadline and stopping.is_alive(), srv.server_log()
            time.sleep(0.05)
        yield op
    finally:
        os.kill(criu, signal.SIGCONT)
    stopping.join(120)
    assert not stopping.is_alive(), srv.server_log()


async def test_a_kernel_shut_down_while_its_suspend_fails_is_said_to_be_shut_down(tmp_path):
    """An attack: the kernel's user shuts it down (DELETE) while its suspend's first attempt, in memory, runs
    (its CRIU held here with SIGSTOP, so that the shutdown waits for it); the memory then fills and the plan is
    undone. Its error said "The kernel runs on, unchanged", and the kernel was shut down a moment later: now it
    says that the kernel was shut down and nothing of it is kept. Nothing goes again to disk."""
    async with _holding_more_than_it_shows(tmp_path) as (srv, kernel_id, memory, state):
        with _stopped_while_dumped(srv, kernel_id) as op:
            time.sleep(1)  # the shutdown, begun, asks the provisioner, which waits for the suspend
        op = _ended(srv, op)
        assert op["status"] == "failed" and op["failed_phase"] == "dump", op
        assert "runs on" not in op["error"], op["error"]
        assert op["error"] == ("The suspend failed and was undone, and the kernel is being shut down, as asked while "
                               "the suspend ran: nothing of the kernel is kept (the server log says why the suspend "
                               "failed)."), op["error"]
        assert f"kernel {kernel_id}: the suspend failed in dump" in srv.server_log(), srv.server_log()
        assert kernel_id not in [k["id"] for k in srv.api("GET", "api/kernels")]
        assert not (state / "images" / ".logs" / f"{kernel_id}-dump-memory.log").exists(), "no second attempt"


@pytest.mark.parametrize("stop", ["shut down", "restarted"])
async def test_a_stop_that_outwaits_its_kernels_suspend_is_said_by_the_suspend(tmp_path, stop):
    """An attack: the kernel's user shuts it down (DELETE), or restarts it, while its suspend's CRIU is held
    with SIGSTOP, longer than the stop waits for a migration (migration_wait, 1 s here): the stop goes on and
    kills the kernel, and the dump then fails. Its error said "the kernel is dead, and Jupyter restarts it (or
    restart it yourself)": now that the kernel is being shut down (restarted), as asked, and nothing of it is
    kept. Nothing of it is; a restarted kernel runs afresh, and suspends and resumes as any other."""
    srv = LocalServer(tmp_path / "server", {"MigratableProvisioner": {"migration_wait": 1.0}})
    try:
        srv.start()
        _, kernel_id = notebook_session(srv)
        tab = await tab_on(srv, kernel_id)
        assert (await tab.run("x = 41; print('set')")).strip() == "set"
        tab.ws.close()
        pid = srv.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        with _stopped_while_dumped(srv, kernel_id, restart=stop == "restarted") as op:
            deadline = time.monotonic() + 90  # the stop's interrupt, request, and kill, each after 1 s
            while (found := proctree.info(pid)) is not None and found.state != "Z":  # killed, not reaped
                assert time.monotonic() < deadline, srv.server_log()
                time.sleep(0.05)
            # CRIU held on past the stop's waits for the suspend (1 s each, before its interrupt, its request
            # and its kill) and jupyter_client's 5 s for the killed process (a restart then launches the next
            # one, the plan still running): its failure comes when nothing waits for it any more
            time.sleep(6)
        op = _ended(srv, op)
        assert op["status"] == "failed" and op["failed_phase"] == "dump", op
        being = "shut down" if stop == "shut down" else "restarted"
        assert op["error"] == (f"The suspend failed and was undone, and the kernel is being {being}, as asked "
                               "while the suspend ran: nothing of the kernel is kept (the server log says why the "
                               "suspend failed)."), op["error"]
        assert f"kernel {kernel_id}: the suspend failed in dump" in srv.server_log(), srv.server_log()
        assert not (srv.state / "images" / kernel_id).exists()
        if stop == "shut down":
            assert kernel_id not in [k["id"] for k in srv.api("GET", "api/kernels")]
            return
        # The restarted kernel: afresh (x is gone), and the stop asked of the one before is forgotten.
        tab = await tab_on(srv, kernel_id)
        assert (await tab.run("print('x' in globals()); y = 7")).strip() == "False"
        tab.ws.close()
        assert srv.operate(kernel_id, "suspend")["status"] == "succeeded"
        assert srv.operate(kernel_id, "resume")["status"] == "succeeded"
        tab = await tab_on(srv, kernel_id)
        assert (await tab.run("print(y * 6)")).strip() == "42"
        tab.ws.close()
    finally:
        srv.stop(signal.SIGKILL)
        srv.kill_kernels()


async def test_a_kernel_killed_between_the_two_attempts_is_said_to_have_ended_before_the_second(tmp_path):
    """An attack: the kernel's process is SIGKILLed once the suspend's attempt in memory was undone (its server
    held with SIGSTOP as soon as that attempt's CRIU log is kept), before the attempt on disk dumped it. The error
    said the kernel "ended while CRIU dumped it": now it says it ended before that second attempt, and that nothing
    was dumped."""
    async with _holding_more_than_it_shows(tmp_path) as (srv, kernel_id, memory, state):
        pid = srv.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
        op = srv.api("POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
        kept = state / "images" / ".logs" / f"{kernel_id}-dump-memory.log"
        deadline = time.monotonic() + 60
        while not kept.exists():
            assert time.monotonic() < deadline, srv.server_log()
            time.sleep(0.0005)
        os.kill(srv.proc.pid, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        op = _ended(srv, op)
        assert op["status"] == "failed", op
        assert "while CRIU dumped it" not in op["error"] and "where it failed too" not in op["error"], op["error"]
        assert op["error"] == (
            f"The {FILLED} in {memory}, so the suspend went again, to disk; but the kernel's process {pid} ended "
            "before that second attempt dumped it, so nothing was dumped and what it held is lost: the kernel is "
            "dead, and Jupyter restarts it (or restart it yourself)."), op["error"]
        assert not (state / "images" / kernel_id).exists()
