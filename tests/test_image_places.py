"""Images in memory or on disk (engine/images.py): where a suspend puts them, and their move to disk."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import resident, small_tmpfs
from servers import LocalServer
from test_hibernation import notebook_running, notebook_session, tab_on, taken_back

from jupyter_gpumigrate.engine import images
from jupyter_gpumigrate.engine.criu import stop_runs
from jupyter_gpumigrate.engine.errors import ImageError, MigrateError, PhaseFailed, for_full
from jupyter_gpumigrate.engine.images import AUTO, DISK, FILLED, MEMORY, ImageStore, Manifest
from jupyter_gpumigrate.engine.plans.common import Tools
from jupyter_gpumigrate.engine.plans.suspend import memory_filled


def _store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "state" / "images", tmp_path / "shm" / "gpumigrate")


def _suspended(store: ImageStore, name: str, where: str) -> Path:
    folder = store.create(name, where)
    (folder / "pages-1.img").write_bytes(os.urandom(4096))
    store.write_manifest(folder, Manifest(kernel_id=name, kernel_name="python3", pid=1, ids=[1]), {"key": "k"})
    return folder


def test_a_kernel_in_memory_is_found_there_listed_and_removed(tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = _suspended(store, "k1", MEMORY)
    _suspended(store, "k2", DISK)
    assert folder.parent == store.memory_root and store.path_for("k1") == folder and store.where("k1") == MEMORY
    assert store.where("k2") == DISK and store.names() == ["k1", "k2"]
    assert store.read_manifest("k1").kernel_id == "k1"
    assert oct(store.memory_root.stat().st_mode & 0o777) == "0o700" and oct(folder.stat().st_mode & 0o777) == "0o700"
    store.create("k1", DISK)  # a new suspend to disk replaces the memory images
    assert not folder.exists() and store.where("k1") == DISK
    _suspended(store, "k1", MEMORY)
    store.remove("k1")
    assert store.names() == ["k2"]


def test_images_removed_later_free_their_name_at_once_and_go_in_a_thread(tmp_path: Path) -> None:
    import threading

    store = _store(tmp_path)
    _suspended(store, "k1", MEMORY)
    _suspended(store, "k2", DISK)
    store.remove("k1", later=True)
    # The name is free at once: new images of k1 go where asked, not mixed with the old ones.
    assert store.names() == ["k2"] and not (store.memory_root / "k1").exists()
    fresh = _suspended(store, "k1", DISK)
    assert store.path_for("k1") == fresh and store.read_manifest("k1").kernel_id == "k1"
    for thread in [t for t in threading.enumerate() if t.name == "gpumigrate-remove-images"]:
        thread.join(30)
    assert not store.memory_root.exists(), "the memory folder, empty, is gone with the last of it"
    assert sorted(p.name for p in store.root.iterdir() if not p.name.startswith(".logs")) == ["k1", "k2"]
    # One that a server ended before it was gone (SIGKILL) is deleted at the next start.
    left = store.root / f"{images.REMOVING}0123456789abcdef"
    left.mkdir()
    (left / "pages-1.img").write_bytes(b"stale")
    assert store.drop_removing() == [left.name] and not left.exists()
    assert store.names() == ["k1", "k2"]


def test_to_disk_moves_every_file_and_leaves_the_manifest_readable(tmp_path: Path) -> None:
    store = _store(tmp_path)
    folder = _suspended(store, "k1", MEMORY)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    moved = store.to_disk("k1")
    assert moved == store.root / "k1" and not folder.exists() and store.where("k1") == DISK
    assert not store.memory_root.exists(), "no empty memory folder left once no kernel is there"
    assert {p.name: p.read_bytes() for p in moved.iterdir()} == before
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in moved.iterdir())
    assert store.to_disk("k1") == moved, "images already on disk stay where they are"


def test_a_dump_is_taken_as_finished_only_by_its_own_log_and_with_its_images(tmp_path: Path) -> None:
    """finished_dump: the pending manifest of images that lack only their manifest. Not for a folder whose
    CRIU images were never all written (no inventory), nor on a log left by an earlier dump of the kernel."""
    store = _store(tmp_path)
    folder = store.create("k1", DISK)
    pending = Manifest(kernel_id="k1", kernel_name="python3", pid=1, ids=[1])
    log = store.log_path("k1", "dump")
    log.write_text("(00.5) Dumping finished successfully\n")
    os.utime(log, (time.time() - 60, time.time() - 60))  # an earlier dump's
    store.write_pending(folder, pending)
    (folder / "pages-1.img").write_bytes(b"x" * 4096)
    assert store.finished_dump("k1") is None, "no inventory: CRIU did not get to the end"
    (folder / "inventory.img").write_bytes(b"i")
    assert store.finished_dump("k1") is None, "the log is older than this dump"
    log.write_text("(00.1) Error (criu/cr-dump.c:2000): Dumping FAILED.\n")
    assert store.finished_dump("k1") is None, "this dump's log says it failed"
    log.write_text("(00.5) Dumping finished successfully\n")
    assert store.finished_dump("k1") == pending
    store.write_manifest(folder, pending)
    assert store.finished_dump("k1") is None and store.read_manifest("k1").kernel_id == "k1"


def test_images_removed_while_they_move_to_disk_are_gone_from_both(tmp_path: Path) -> None:
    """A kernel discarded (DELETE, the retention) while the memory watcher moves its images to disk: the
    removal waits for the move, then deletes both copies. Before, the move went on after the memory copy was
    deleted and renamed a whole copy into place on disk, and the next server brought back the kernel its user
    had discarded."""
    import threading

    store = _store(tmp_path)
    folder = _suspended(store, "k1", MEMORY)
    (folder / "pages-2.img").write_bytes(os.urandom(256 << 20))  # a copy that lasts a while
    mover = threading.Thread(target=store.to_disk, args=("k1",))
    mover.start()
    deadline = time.monotonic() + 30
    while not (store.root / ".moving-k1").exists():
        assert time.monotonic() < deadline and mover.is_alive(), "the move did not begin"
        time.sleep(0.0005)
    store.remove("k1")
    mover.join(30)
    assert not (store.root / "k1").exists() and not folder.exists() and not (store.root / ".moving-k1").exists()
    assert store.names() == []


def test_images_written_to_disk_leave_the_page_cache_to_others(tmp_path: Path) -> None:
    """Images go to disk to be read once, at the resume: cached, they would push other processes' files out of
    memory. Those a dump wrote (made whole by write_manifest) and those moved from memory are dropped from the
    page cache once on disk; images in memory (a tmpfs, whose pages are the files) are not touched."""
    store = _store(tmp_path)
    on_disk = store.create("k1", DISK)
    (on_disk / "pages-1.img").write_bytes(os.urandom(32 << 20))
    assert resident([on_disk / "pages-1.img"]) > 16 << 20, "just written: cached"
    store.write_manifest(on_disk, Manifest(kernel_id="k1", kernel_name="python3", pid=1, ids=[1]))
    assert resident([on_disk / "pages-1.img"]) < 1 << 20
    in_memory = store.create("k2", MEMORY)
    (in_memory / "pages-1.img").write_bytes(os.urandom(32 << 20))
    store.write_manifest(in_memory, Manifest(kernel_id="k2", kernel_name="python3", pid=1, ids=[1]))
    assert resident([in_memory / "pages-1.img"]) > 16 << 20, "a memory folder's files are left alone"
    moved = store.to_disk("k2")
    assert resident([moved / "pages-1.img"]) < 1 << 20


def test_a_move_cut_short_is_finished_at_the_next_start(tmp_path: Path) -> None:
    store = _store(tmp_path)
    # Stopped while copying: the partial copy goes, the memory images stay the kernel's.
    folder = _suspended(store, "k1", MEMORY)
    partial = store.root / f"{images.MOVING}k1"
    partial.mkdir(parents=True)
    (partial / "pages-1.img").write_bytes(b"half")
    # Stopped after the rename, before the memory folder was removed: the disk copy is complete and wins.
    other = _suspended(store, "k2", MEMORY)
    complete = store.root / "k2"
    complete.mkdir()
    for entry in other.iterdir():
        (complete / entry.name).write_bytes(entry.read_bytes())
    assert store.path_for("k2") == complete
    assert sorted(store.tidy()) == ["k1", "k2"]
    assert not partial.exists() and store.path_for("k1") == folder and not other.exists()
    assert json.loads((complete / "manifest.json").read_text())["kernel_id"] == "k2"


def test_a_link_in_place_of_the_memory_folder_is_refused(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.memory_root.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    store.memory_root.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ImageError, match="not a private folder of this user's"):
        store.create("k1", MEMORY)


def test_a_memory_folder_made_by_someone_else_is_never_read_nor_written(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.memory_root.mkdir(parents=True)
    planted = store.memory_root / "planted"
    planted.mkdir()
    os.chown(store.memory_root, 12345, 12345)  # as if another user had made it first (we are root here)
    assert "not a private folder of this user's" in store.memory_refused()
    assert store.names() == [] and store.where("planted") == DISK and store.path_for("planted").parent == store.root
    where, why = images.choose(store, "auto", 10**6)
    assert where == DISK and "not a private folder" in why, "auto goes to disk, saying why"
    with pytest.raises(ImageError, match="Images cannot go to memory: .* not a private folder"):
        images.choose(store, MEMORY, 10**6)
    os.chown(store.memory_root, os.geteuid(), os.getegid())
    os.chmod(store.memory_root, 0o777)
    assert store.memory_refused(), "open to others: refused too"


def test_auto_takes_memory_only_with_room(tmp_path: Path) -> None:
    store = _store(tmp_path)
    total, available = images.host_memory()
    assert total > 0 and available > 0
    assert images.choose(store, "auto", 10**6)[0] == MEMORY
    where, why = images.choose(store, "auto", available)
    assert where == DISK and "no room in memory" in why, "it would leave the host less than a quarter"
    with pytest.raises(ImageError, match="No room for the kernel's images in memory .* suspend it to disk"):
        images.choose(store, MEMORY, available)
    assert images.choose(store, DISK, 1) == (DISK, "asked for")
    without = ImageStore(tmp_path / "images")
    assert images.choose(without, "auto", 1)[0] == DISK
    with pytest.raises(ImageError, match="no memory folder"):
        images.choose(without, MEMORY, 1)


# -- through a real server ---------------------------------------------------------------------------


@pytest.fixture
def memory_server(tmp_path: Path):
    """A server run as a process of its own, whose suspends put images in memory."""
    srv = LocalServer(tmp_path / "server", {"MigratableProvisioner": {"suspend_to": "memory"}})
    yield srv
    srv.stop(signal.SIGKILL)
    srv.kill_kernels()


def _memory_images(server: LocalServer, kernel_id: str) -> list[Path]:
    config = json.loads((server.root / "config" / "jupyter_server_config.json").read_text())
    state = config["MigratableProvisioner"]["state_dir"]
    from jupyter_gpumigrate.provisioner import MigratableProvisioner

    found = MigratableProvisioner(state_dir=state).images
    assert found.memory_root is not None and str(found.memory_root).startswith("/dev/shm/")
    return [p for p in (found.memory_root / kernel_id,) if p.exists()]


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
async def test_a_kernel_suspended_to_memory_comes_back_after_its_server_stops(memory_server, stop):
    server = memory_server
    server.start()
    _, kernel_id, out = await notebook_running(server, "x = 41\nprint('set')")
    assert out == "set"
    op = server.operate(kernel_id, "suspend")
    assert op["status"] == "succeeded" and op["images"] == "memory", op
    view = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["images"] == "memory" and _memory_images(server, kernel_id)
    assert not (server.state / "images" / kernel_id).exists()
    server.stop(stop)
    if stop == signal.SIGTERM:  # stopped: its images went to disk, which outlives a reboot
        assert (server.state / "images" / kernel_id / "manifest.json").is_file()
        assert not _memory_images(server, kernel_id) and "moved from memory to" in server.server_log()
    else:  # killed: they stay in memory, and the next server takes the kernel back from there
        assert _memory_images(server, kernel_id)

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "suspended" and view["images"] == ("disk" if stop == signal.SIGTERM else "memory")
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(x + 1)", timeout=120)).strip() == "42"
    tab.ws.close()
    assert not _memory_images(server, kernel_id) and not (server.state / "images" / kernel_id).exists()


async def test_memory_without_room_is_refused_when_asked_for_and_passed_over_by_auto(tmp_path):
    with small_tmpfs(tmp_path / "shm", "24m") as shm:  # too small for any kernel's images
        server = LocalServer(tmp_path / "server", {"MigratableProvisioner": {"memory_dir": str(shm / "gpumigrate")}})
        try:
            server.start()
            _, kernel_id, _ = await notebook_running(server, "x = 41")
            op = server.operate(kernel_id, "suspend", {"images": "memory"})
            assert op["status"] == "failed" and op["failed_phase"] == "prepare", op
            assert "No room for the kernel's images in memory" in op["error"] and "runs on, unchanged" in op["error"]
            op = server.operate(kernel_id, "suspend", {"images": "auto"})
            assert op["status"] == "succeeded" and op["images"] == "disk", op
            assert (server.state / "images" / kernel_id / "manifest.json").is_file()
            tab = await tab_on(server, kernel_id)
            assert (await tab.run("print(x + 1)", timeout=120)).strip() == "42"
            tab.ws.close()
        finally:
            server.stop(signal.SIGKILL)
            server.kill_kernels()


async def test_memory_images_go_to_disk_when_the_hosts_memory_runs_short(tmp_path):
    # memory_low at 100% of the total: memory always "runs short" here, so the check moves them at once.
    server = LocalServer(tmp_path / "server", {"GPUMigrateApp": {"memory_low": 1.0, "memory_check_interval": 0.5}})
    try:
        server.start()
        _, kernel_id, out = await notebook_running(server, "x = 41\nprint('set')")
        assert out == "set"
        op = server.operate(kernel_id, "suspend", {"images": "memory"})
        assert op["status"] == "succeeded" and op["images"] == "memory", op
        deadline = time.monotonic() + 30
        while server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["images"] != "disk":
            assert time.monotonic() < deadline, server.server_log()
            time.sleep(0.2)
        assert (server.state / "images" / kernel_id / "manifest.json").is_file()
        said = rf"memory runs short \(.*\): kernel {kernel_id}'s images \(.*\) moved from memory to"
        while not re.search(said, (server.root / "server.log").read_text()):  # logged just after the move
            assert time.monotonic() < deadline, server.server_log()
            time.sleep(0.2)
        tab = await tab_on(server, kernel_id)  # a cell resumes it, from disk, with its state
        assert (await tab.run("print(x + 1)", timeout=120)).strip() == "42"
        tab.ws.close()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


def _moving_soon(server: LocalServer, kernel_id: str, timeout: float = 60) -> None:
    """Once the memory watcher's move of the kernel's images to disk has begun (its folder ``.moving-<id>``)."""
    deadline = time.monotonic() + timeout
    while not (server.state / "images" / f".moving-{kernel_id}").exists():
        assert time.monotonic() < deadline, server.server_log()
        time.sleep(0.002)


#: 1.5 GB: its images take a second or more to copy to disk, a window to act in
BIG = "value = 41\nblob = bytes(range(256)) * 6_000_000\nprint('set')"


async def test_a_cell_run_while_the_images_move_to_disk_runs_once_they_are_there(tmp_path):
    """An attack: a cell run on a suspended kernel while the memory watcher moves its images to disk. Its resume
    was refused ('being moved... try again') and never asked again: the cell waited for ever. Now the resume is
    asked once the move is over, and the cell runs."""
    server = LocalServer(tmp_path / "server", {"GPUMigrateApp": {"memory_low": 1.0, "memory_check_interval": 0.5}})
    try:
        server.start()
        _, kernel_id = notebook_session(server)
        tab = await tab_on(server, kernel_id)
        assert (await tab.run(BIG, timeout=120)).strip() == "set"
        op = server.operate(kernel_id, "suspend", {"images": "memory"})
        assert op["status"] == "succeeded" and op["images"] == "memory", op
        _moving_soon(server, kernel_id)
        assert (await tab.run("print(value + 1, len(blob))", timeout=120)).split() == ["42", str(256 * 6_000_000)]
        assert "could not be resumed" not in server.server_log()
        tab.ws.close()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


async def test_a_stop_during_the_memory_watchers_move_waits_for_it_and_makes_no_second(tmp_path):
    """An attack: SIGTERM while the memory watcher moves a suspended kernel's images to disk. The stop cancelled
    the watcher, which said at once that the move was over while its copy went on; the stop then began a second
    move of the same images, which removed the first one's copy under it: both failed (the images stayed in
    memory, lost if the host restarts), or the memory copy went with a partial one in its place. Now the stop
    waits for the copy, finds the images on disk, and the next server resumes the kernel from there."""
    server = LocalServer(tmp_path / "server", {"GPUMigrateApp": {"memory_low": 1.0, "memory_check_interval": 0.5}})
    try:
        server.start()
        _, kernel_id, out = await notebook_running(server, BIG, timeout=120)
        assert out == "set"
        op = server.operate(kernel_id, "suspend", {"images": "memory"})
        assert op["status"] == "succeeded" and op["images"] == "memory", op
        _moving_soon(server, kernel_id)
        server.stop(signal.SIGTERM, timeout=120)
        log = server.server_log()
        assert "moving the images of" not in log and "stay in memory" not in log, log
        assert (server.state / "images" / kernel_id / "manifest.json").is_file(), log
        assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}")), "no copy left in memory"
        server.start()
        assert taken_back(server, kernel_id)["images"] == "disk"
        tab = await tab_on(server, kernel_id)
        assert (await tab.run("print(value + 1, len(blob))", timeout=120)).split() == ["42", str(256 * 6_000_000)]
        tab.ws.close()
    finally:
        server.stop(signal.SIGKILL)
        server.kill_kernels()


def test_only_an_auto_suspend_given_back_whole_after_its_memory_filled_goes_again_to_disk(tmp_path):
    """plans/suspend.py's memory_filled decides whether a failed suspend goes again, to disk: only images "auto"
    whose memory folder filled, a plan rolled back whole with the kernel running, and no stop under way."""
    (tmp_path / "memory").mkdir(mode=0o700)
    store = ImageStore(tmp_path / "disk", tmp_path / "memory")
    memory = store.memory_root
    assert memory is not None
    proc = subprocess.Popen(["sleep", "60"])
    try:
        def kernel(**changed: object) -> SimpleNamespace:
            return SimpleNamespace(**{"kernel_id": "k", "kernel_pid": proc.pid, "state": "running",
                                      "stop_requested": None, **changed})

        def failed(folder: Path = memory, rolled_back: bool = True) -> PhaseFailed:
            return PhaseFailed("dump", for_full(MigrateError("full"), folder), rolled_back, [])

        auto = Tools(store, None, images=AUTO)
        assert memory_filled(failed(), kernel(), auto) == f"{FILLED} in {memory}"
        assert memory_filled(failed(), kernel(), Tools(store, None, images=MEMORY)) is None, "memory was asked"
        assert memory_filled(failed(tmp_path / "disk"), kernel(), auto) is None, "the disk filled"
        assert memory_filled(PhaseFailed("dump", MigrateError("CRIU failed"), True, []), kernel(), auto) is None
        assert memory_filled(failed(rolled_back=False), kernel(), auto) is None, "an undo failed"
        assert memory_filled(failed(), kernel(state="broken"), auto) is None
        assert memory_filled(failed(), kernel(stop_requested="its server stops"), auto) is None
        assert memory_filled(failed(), kernel(kernel_id="given-up"), auto) == f"{FILLED} in {memory}"
        stop_runs(store.places("given-up"))  # a stopping server gave its operations up
        assert memory_filled(failed(), kernel(kernel_id="given-up"), auto) is None
        proc.kill()
        proc.wait()
        assert memory_filled(failed(), kernel(), auto) is None, "the kernel's process is gone"
    finally:
        proc.kill()
        proc.wait()
