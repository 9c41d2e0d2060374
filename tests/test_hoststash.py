"""The host stash of a suspend (kernel/hoststash.py), on CPU kernels: large bytearrays are written by the
kernel's own threads into the images, read back at resume and checked; a damaged file is refused with the
images kept; a full disk and a kernel killed mid-stash leave the kernel as it was or no half image.

The GPU suite covers CUDA storages (tests/test_gpu.py); the file format and its checks are the same code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import json
import logging
import logging.handlers
import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from helpers import api, operate, restarted, server_sees_idle, small_tmpfs, wait_operation
from test_hibernation import cut_dump, notebook_running, tab_on, taken_back

from jupyter_gpumigrate.kernel import hoststash, stager

pytestmark = pytest.mark.usefixtures("criu_binary")

#: the kernels' buffers: three of 96 MB, each of its own pattern, and their checksum (computed in the kernel)
MAKE = """
import hashlib, os
blobs = [bytearray(os.urandom(1 << 20) * 96) for _ in range(3)]
alias = blobs[1]
small = bytearray(b"s" * 1000)
digest = lambda: hashlib.sha256(b"".join(bytes(b) for b in blobs) + bytes(small)).hexdigest()
print(digest())
"""


def _config(state_dir: Path, suspend_to: str = "auto") -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(state_dir), "host_stash_min": 10**8, "suspend_to": suspend_to},
    }


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return _config(tmp_path / "gpumigrate")


def _flip(path: Path, offset: int) -> None:
    """Invert the bits of one byte of ``path`` (twice puts it right)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def _images(serverapp: Any, kernel_id: str) -> Path:
    return serverapp.kernel_manager.get_kernel(kernel_id).provisioner.images.path_for(kernel_id)


# -- the format, in this process ---------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_garbage() -> None:
    """The stash takes every large buffer of the process it runs in: here, that of pytest, where an earlier
    test's frames (a failure's, or pytest.raises') may still hold some, until the collector runs."""
    gc.collect()


def test_the_format_round_trips_and_refuses_what_does_not_match(tmp_path: Path) -> None:
    # As in a notebook, the buffers are held by a namespace (a dict, which also holds other objects: the
    # collector tracks only dicts that hold an object it tracks).
    ns = {"blob": bytearray(os.urandom(1 << 20) * 200), "view_held": bytearray(32 << 20), "In": []}
    blob, view_held = ns["blob"], ns["view_held"]
    held = memoryview(view_held)  # a bytearray that a view holds cannot be resized: it stays
    expect = bytes(blob)
    said = json.loads(hoststash.stash(str(tmp_path), min_total=1, threads=3))
    assert said["stashed"] == len(expect) and said["buffers"] == 1, said
    assert len(blob) == 0 and len(view_held) == 32 << 20, "the stashed buffer is freed, the held one stays"
    index = hoststash.read_index(tmp_path)
    assert index["format"] == hoststash.FORMAT and sum(c.size for c in index["chunks"]) == len(expect)
    assert sorted(p.name for p in tmp_path.iterdir()) == [hoststash.PART.format(p) for p in range(index["parts"])] \
        + [hoststash.INDEX]
    assert all((tmp_path / hoststash.PART.format(p)).stat().st_mode & 0o777 == 0o600 for p in range(index["parts"]))
    # A flipped byte: refused, naming the file.
    chunk = index["chunks"][-1]
    part = tmp_path / hoststash.PART.format(chunk.part)
    _flip(part, chunk.offset + 7)
    with pytest.raises(hoststash.StashDamaged, match=f"{part.name} at byte {chunk.offset}: its checksum"):
        hoststash.take_back(str(tmp_path), threads=3)
    # Put right, it comes back whole, in the same object.
    _flip(part, chunk.offset + 7)
    said = json.loads(hoststash.take_back(str(tmp_path), threads=3))
    assert said["unstashed"] == len(expect) and bytes(blob) == expect
    del held


def _stashed(folder: Path, mib: int) -> tuple[bytearray, bytes]:
    """A bytearray of ``mib`` MiB held by a namespace (a dict), stashed into ``folder`` by two threads: the
    bytearray (now empty), and the bytes it held. The namespace lives as long as the bytearray."""
    ns = {"blob": bytearray(os.urandom(1 << 20) * mib), "In": []}
    expect = bytes(ns["blob"])
    json.loads(hoststash.stash(str(folder), min_total=1, threads=2))
    return ns["blob"], expect


def test_a_move_asks_for_cuda_tensors_alone_and_leaves_host_buffers_be(tmp_path: Path) -> None:
    # A move between GPUs without peer access (engine/plans/gpu_move.py) has the kernel write only its CUDA
    # storages: host memory does not change GPU. This process has none: nothing is written or freed.
    ns = {"blob": bytearray(64 << 20), "In": []}
    said = json.loads(hoststash.stash(str(tmp_path), min_total=1, gpu_only=True))
    assert "aside" in said and "0.0 GB of large buffers" in said["aside"], said
    assert len(ns["blob"]) == 64 << 20 and not list(tmp_path.iterdir()) and not hoststash.away()
    assert [b.kind for b in hoststash.collect(None, 1 << 20)] == ["bytearray"], "a suspend would take it"


def test_a_move_writes_no_checksum_and_reads_back_all_the_same(tmp_path: Path) -> None:
    """The parts' writer and reader as a move between GPUs uses them (``check=False``: its files live in
    memory for the move alone): no checksum is computed, none is asked for, every byte comes back."""
    source = bytearray(os.urandom(1 << 20) * 48)
    target = bytearray(len(source))
    address = lambda b: ctypes.addressof(ctypes.c_char.from_buffer(b))  # noqa: E731
    chunks = hoststash.plan_chunks([len(source)], threads=2, chunk=8 << 20)
    for part in range(2):
        fd = os.open(tmp_path / hoststash.PART.format(part), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            hoststash.write_part(fd, chunks, part, [address(source)], [False], None, durable=False, check=False)
        finally:
            os.close(fd)
    assert all(c.xxh3 is None for c in chunks)
    for part in range(2):
        assert hoststash.read_part(tmp_path / hoststash.PART.format(part), chunks, part, [address(target)], [False],
                                   None, check=False) is None
    assert target == source
    # Whether to check is the reader's own record, not the table's: a table without checksums (a transplant's
    # edited on disk, say) is refused where a check is due.
    said = hoststash.read_part(tmp_path / hoststash.PART.format(0), chunks, 0, [address(target)], [False], None)
    assert said == f"{hoststash.PART.format(0)} at byte 0: its checksum is missing"


def test_each_chunk_is_hashed_piece_by_piece_to_the_digest_of_the_whole(tmp_path: Path) -> None:
    """Chunks are written and read a piece at a time, each piece hashed in the cache: the checksum in the table
    is still XXH3-64 of the whole chunk (the files of an older suspend read back), and a byte flipped in the
    last, short piece of a chunk is found as one in its first."""
    source = bytearray(os.urandom((7 << 20) + 12345))
    target = bytearray(len(source))
    address = lambda b: ctypes.addressof(ctypes.c_char.from_buffer(b))  # noqa: E731
    size = (2 * hoststash.PIECE) + hoststash.PIECE // 2 + 3  # two whole pieces and a short one
    chunks = hoststash.plan_chunks([len(source)], threads=2, chunk=size)
    for part in range(2):
        fd = os.open(tmp_path / hoststash.PART.format(part), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            hoststash.write_part(fd, chunks, part, [address(source)], [False], None, durable=False)
        finally:
            os.close(fd)
    whole = memoryview(source)
    assert [c.xxh3 for c in chunks] == [hoststash.checksum(whole[c.at:c.at + c.size]) for c in chunks]
    last = chunks[1]
    path = tmp_path / hoststash.PART.format(last.part)
    _flip(path, last.offset + last.size - 1)
    assert hoststash.read_part(path, chunks, last.part, [address(target)], [False], None) == \
        f"{path.name} at byte {last.offset}: its checksum does not match"
    _flip(path, last.offset + last.size - 1)
    for part in range(2):
        assert hoststash.read_part(tmp_path / hoststash.PART.format(part), chunks, part, [address(target)], [False],
                                   None) is None
    assert target == source


def _write_parts(folder: Path, chunks: list, parts: int, address: int) -> None:
    """The stash's part files of one host buffer at ``address`` (checksummed, not synced) in ``folder``."""
    for part in range(parts):
        fd = os.open(folder / hoststash.PART.format(part), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            hoststash.write_part(fd, chunks, part, [address], [False], None, durable=False)
        finally:
            os.close(fd)


def _trickle(src: Path, dest: Path, pieces: int, pause: float, stop: threading.Event) -> None:
    """Write ``src`` into ``dest`` in ``pieces`` appends, ``pause`` seconds apart (as a peer's file arrives)."""
    data = src.read_bytes()
    step = -(-len(data) // pieces)
    with open(dest, "wb") as f:
        for start in range(0, len(data), step):
            if stop.is_set():
                return
            f.write(data[start:start + step])
            f.flush()
            time.sleep(pause)


def test_a_part_is_read_as_it_arrives_each_chunk_once_there(tmp_path: Path) -> None:
    """A move's receiving host has its prefetch read each part as it arrives (kernel/hoststash.py's Follow, one
    for all the parts): a file that does not exist yet is waited for, each chunk is read once the file holds
    it, checked, and every byte comes back. The second part begins to arrive only once the first is whole (as
    a sender with one stream sends them), after longer than the stall: it waits while the first grows."""
    source = bytearray(os.urandom((24 << 20) + 4321))
    target = bytearray(len(source))
    address = lambda b: ctypes.addressof(ctypes.c_char.from_buffer(b))  # noqa: E731
    chunks = hoststash.plan_chunks([len(source)], threads=2, chunk=3 << 20)
    written, arriving = tmp_path / "written", tmp_path / "arriving"
    written.mkdir()
    arriving.mkdir()
    _write_parts(written, chunks, 2, address(source))
    stop = threading.Event()

    def send_one_after_the_other() -> None:
        for p in range(2):
            _trickle(written / hoststash.PART.format(p), arriving / hoststash.PART.format(p), 16, 0.05, stop)

    writer = threading.Thread(target=send_one_after_the_other)
    said: list = [None, None]
    seen_short: list[int] = []
    follow = hoststash.Follow(stall=0.5)  # shorter than the first part takes to arrive (16 x 0.05 s)

    def read(part: int) -> None:
        said[part] = hoststash.read_part(arriving / hoststash.PART.format(part), chunks, part, [address(target)],
                                         [False], None, follow=follow)

    readers = [threading.Thread(target=read, args=(p,)) for p in range(2)]
    for t in readers:  # before any byte is there: each waits for its file to appear
        t.start()
    time.sleep(0.1)
    assert not any((arriving / hoststash.PART.format(p)).exists() for p in range(2))
    assert all(t.is_alive() for t in readers)
    writer.start()
    while writer.is_alive():
        size = sum(p.stat().st_size for p in arriving.iterdir())
        if size < len(source):
            seen_short.append(size)
        time.sleep(0.01)
    for t in [*readers, writer]:
        t.join(30)
    assert seen_short, "the files arrived in pieces"
    assert said == [None, None]
    assert target == source


@pytest.mark.parametrize("how", ["removed", "stalled", "gone", "another failed"])
def test_a_part_that_stops_arriving_is_given_up_with_a_reason(tmp_path: Path, how: str) -> None:
    """A part followed as it arrives that is removed (its transfer failed: another copy, or none, comes), that
    stops growing, whose reader's caller is gone, or whose sibling part failed, ends the reading with why: never
    a wait for ever, never a chunk read from what is not there."""
    source = bytearray(os.urandom(8 << 20))
    target = bytearray(len(source))
    address = lambda b: ctypes.addressof(ctypes.c_char.from_buffer(b))  # noqa: E731
    chunks = hoststash.plan_chunks([len(source)], threads=1, chunk=1 << 20)
    path = tmp_path / hoststash.PART.format(0)
    _write_parts(tmp_path, chunks, 1, address(source))
    whole = path.read_bytes()
    with open(path, "r+b") as f:
        f.truncate(len(whole) // 2)  # half of it has arrived
    gone = threading.Event()
    follow = hoststash.Follow(stall=0.5 if how == "stalled" else 30.0,
                              gone=lambda: "the server is gone" if gone.is_set() else None)
    result: list = []
    reader = threading.Thread(target=lambda: result.append(
        hoststash.read_part(path, chunks, 0, [address(target)], [False], None, follow=follow)))
    began = time.monotonic()
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive(), "it waits for the rest"
    if how == "removed":
        path.unlink()
        path.write_bytes(whole)  # a new copy arrives whole under the same name: another file, not followed
    elif how == "gone":
        gone.set()
    elif how == "another failed":  # another part of the same stash, whole but damaged
        other = bytearray(len(source))
        damaged = path.with_name("elsewhere")
        damaged.write_bytes(whole)
        _flip(damaged, 10)
        wrong = hoststash.read_part(damaged, chunks, 0, [address(other)], [False], None, follow=follow)
        assert wrong == "elsewhere at byte 0: its checksum does not match", wrong
    reader.join(10)
    assert not reader.is_alive() and time.monotonic() - began < 5
    expected = {"removed": "it was removed or replaced while it arrived", "stalled": "nothing of the stash arrived",
                "gone": "the server is gone", "another failed": "another part failed (elsewhere at byte 0"}[how]
    assert result and result[0].startswith(f"{path.name}: {expected}"), result
    half = len(whole) // 2 // (1 << 20) * (1 << 20)
    assert target[:half] == source[:half] and not any(target[len(whole) // 2 + (1 << 20):]), \
        "what arrived was read, nothing beyond it"


def test_a_prefetch_is_taken_only_if_the_index_it_was_checked_against_is_the_kernels_own(monkeypatch) -> None:
    """A resume's prefetch (engine/prefetch.py) checks the files against the index on disk; the kernel copies
    from it only if that index's table, checksums included, is the one in its own memory, and only within the
    prefetch's memory. Each refusal comes before any CUDA call: the kernel then reads its files itself."""
    from jupyter_gpumigrate.engine import prefetch, stash as stash_mod

    sizes = [96 << 20, 40 << 20]
    chunks = hoststash.plan_chunks(sizes, threads=3)
    for n, c in enumerate(chunks):
        c.xxh3 = 1000 + n
    buffers = [hoststash.Buffer("cuda", None, size, away=True) for size in sizes]
    monkeypatch.setattr(hoststash, "_chunks", chunks)
    monkeypatch.setattr(hoststash, "_session", "s1")
    monkeypatch.setattr(hoststash, "_checked", True)
    listed = [{"kind": "cuda", "size": size} for size in sizes]
    bases, size = stash_mod.layout(listed)
    assert bases == [0, 96 << 20] and size == 136 << 20 and prefetch.cuda_bytes({"buffers": listed}) == size
    assert stash_mod.layout([{"kind": "cpu", "size": 5}, {"kind": "cuda", "size": 700}, {"kind": "cuda", "size": 1}]) \
        == ([None, 0, 1024], 1025), "each CUDA buffer at a multiple of 512; host buffers take no room"

    def copy(index_chunks: list, gpu: dict, index_session: str = "s1") -> str:
        index = {"session": index_session, "chunks": index_chunks, "buffers": listed}
        with pytest.raises(ValueError) as caught:
            hoststash._copy_prefetched(gpu, index, buffers, [0, 0], None, 0)
        return str(caught.value)

    good = {"handle": "00", "bases": bases, "size": size, "session": "s1"}
    edited = [hoststash.Chunk(**{**c.__dict__, "xxh3": 7}) if n == 2 else c for n, c in enumerate(chunks)]
    assert copy(edited, good) == "the stash's index on disk is not this kernel's own table"
    moved = [hoststash.Chunk(**{**c.__dict__, "offset": c.offset + 1}) if n == 0 else c for n, c in enumerate(chunks)]
    assert copy(moved, good) == "the stash's index on disk is not this kernel's own table"
    assert copy(chunks, {**good, "session": "s2"}) == "the prefetch read another stash"
    assert copy(chunks, good, index_session="s2") == "the prefetch read another stash"
    assert copy(chunks, {**good, "size": size - 1}) == "the prefetch's memory does not hold every buffer"
    assert copy(chunks, {**good, "bases": [0, -512]}) == "the prefetch's memory does not hold every buffer"
    monkeypatch.setattr(hoststash, "_checked", False)
    assert copy(chunks, good) == "this stash carries no checksums"
    # Room: the kernel as it was suspended (its buffers included), the helper's copy, the helper's context.
    assert prefetch.room_for(free=80 * 10**9, needed=33 * 10**9, nbytes=32 * 10**9)
    assert not prefetch.room_for(free=60 * 10**9, needed=33 * 10**9, nbytes=32 * 10**9)


def test_the_helpers_lines_are_each_read_at_once_however_they_arrive() -> None:
    """A prefetch's helper says two lines (its handle once allocated, then what it read): when both are in
    the pipe together, the second is read at once, not after the timeout (a buffered readline after a select
    took both and left the second waiting); a line that comes in pieces is whole; the end is "" at once."""
    from jupyter_gpumigrate.engine.stash import _readline

    read_end, write_end = os.pipe()
    with os.fdopen(read_end, "r") as stream:
        pending = bytearray()
        os.write(write_end, b'{"early": true}\n{"handle": "ab"}\n{"par')
        started = time.monotonic()
        assert _readline(stream, pending, 30) == '{"early": true}'
        assert _readline(stream, pending, 30) == '{"handle": "ab"}'
        assert time.monotonic() - started < 5
        assert _readline(stream, pending, 0.2) == "", "a line not yet whole is not said"
        threading.Timer(0.2, lambda: os.write(write_end, b'tial": 1}\n')).start()
        assert _readline(stream, pending, 30) == '{"partial": 1}'
        os.close(write_end)
        started = time.monotonic()
        assert _readline(stream, pending, 30) == "" and time.monotonic() - started < 5


def test_odd_classes_do_not_break_the_search() -> None:
    """A metaclass with __eq__ and no __hash__, and a class whose __module__ is not a string, in the process
    and in a handed thread's frame: the searches read past them (before, one raised out of the kernel's side)."""
    torch = pytest.importorskip("torch")

    class Meta(type):
        def __eq__(cls, other: object) -> bool:
            return cls is other

    class Odd(metaclass=Meta):
        pass

    class Numbered:
        __module__ = 5  # type: ignore[assignment]

    odd, numbered, blob = Odd(), Numbered(), bytearray(1 << 20)
    numbered.blob = blob  # type: ignore[attr-defined]
    tensor = torch.ones(4)
    assert any(t is tensor for t in stager.Live(torch).tensors) and odd is not None
    release = threading.Event()
    worker = threading.Thread(target=lambda held: release.wait(30), args=([odd, numbered],), daemon=True)
    worker.start()
    try:
        assert ("bytearray", id(blob)) in stager.reach([worker], torch)
    finally:
        release.set()
        worker.join(10)


def test_a_short_file_or_a_foreign_index_is_refused(tmp_path: Path) -> None:
    blob, expect = _stashed(tmp_path, 160)
    index_path = tmp_path / hoststash.INDEX
    good = index_path.read_text()
    index_path.write_text(good.replace('"session": "', '"session": "x'))
    with pytest.raises(hoststash.StashDamaged, match="not the one this kernel wrote"):
        hoststash.take_back(str(tmp_path))
    index_path.write_text('{"format": 1, "chunks": [{"buffer": 9}]}')
    with pytest.raises(hoststash.StashDamaged, match="damaged"):
        hoststash.take_back(str(tmp_path))
    index_path.write_text(good)
    second = tmp_path / hoststash.PART.format(1)
    whole = second.read_bytes()
    os.truncate(second, 100)
    with pytest.raises(hoststash.StashDamaged, match="ended .* short"):
        hoststash.take_back(str(tmp_path))
    assert hoststash.away() == len(expect), "still away: the files are the copy"
    second.write_bytes(whole)
    hoststash.take_back(str(tmp_path))
    assert bytes(blob) == expect and hoststash.away() == 0


def test_the_index_on_disk_cannot_tell_the_kernel_where_its_bytes_go(tmp_path: Path) -> None:
    # The kernel checks the files against the chunk table it kept in its own memory: an index whose
    # chunks were swapped or dropped changes nothing.
    blob, expect = _stashed(tmp_path, 100)
    path = tmp_path / hoststash.INDEX
    index = json.loads(path.read_text())
    index["chunks"][0]["at"], index["chunks"][1]["at"] = index["chunks"][1]["at"], index["chunks"][0]["at"]
    del index["chunks"][2]
    path.write_text(json.dumps(index))
    said = json.loads(hoststash.take_back(str(tmp_path), threads=2))
    assert said["unstashed"] == len(expect) and bytes(blob) == expect


@contextlib.contextmanager
def _running(kind: str) -> Iterator[str]:
    """A thread of the notebook's that runs (or may wake up at any moment): its name."""
    stop = threading.Event()
    if kind == "thread":
        worker = threading.Thread(target=stop.wait, name="users-thread")
        worker.start()
        yield "users-thread"
        stop.set()
        worker.join()
    elif kind == "pool task":  # its frame sits between the pool's loop and the event it waits on
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="users-pool") as pool:
            pool.submit(stop.wait, 30)
            time.sleep(0.2)
            yield "users-pool"
            stop.set()
    else:  # an event loop runs whatever is scheduled on it
        loop = asyncio.new_event_loop()
        runner = threading.Thread(target=loop.run_forever, name="users-loop")
        runner.start()
        yield "users-loop"
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


@pytest.mark.parametrize("kind", ["thread", "pool task", "event loop"])
def test_a_running_thread_of_the_users_makes_it_step_aside(tmp_path: Path, kind: str) -> None:
    ns = {"blob": bytearray(32 << 20), "In": []}
    with _running(kind) as name:
        said = json.loads(hoststash.stash(str(tmp_path), min_total=1))
    assert name in said["aside"] and len(ns["blob"]) == 32 << 20 and not list(tmp_path.iterdir()), said


def test_a_thread_the_notebook_marks_is_taken_at_its_word(tmp_path: Path) -> None:
    """Unmarked, the notebook's thread makes the stash step aside, and the reason says how to mark it;
    marked "handed", it runs on and the tensor its variables hold stays; marked "quiet", it runs on and
    everything goes."""
    torch = pytest.importorskip("torch")
    ns = {"blob": bytearray(b"f" * (32 << 20)), "In": []}
    stop = threading.Event()

    def prefetch(batch: Any) -> None:  # holds its batch while it waits
        stop.wait(30)

    batch = torch.full((8 << 20,), 3.0)  # 32 MiB
    worker = threading.Thread(target=prefetch, args=(batch,), name="prefetch")
    worker.start()
    try:
        said = json.loads(hoststash.stash(str(tmp_path / "unmarked"), min_total=1))
        assert "'prefetch'" in said["aside"] and "thread.gpumigrate = 'quiet' or 'handed'" in said["aside"], said
        worker.gpumigrate = "handed"  # type: ignore[attr-defined]
        (tmp_path / "handed").mkdir()
        said = json.loads(hoststash.stash(str(tmp_path / "handed"), min_total=1))
        assert said.get("stashed") == 32 << 20 and len(ns["blob"]) == 0, said
        assert batch.untyped_storage().nbytes() == 32 << 20, "the thread's own batch stayed"
        json.loads(hoststash.take_back(str(tmp_path / "handed")))
        worker.gpumigrate = "quiet"  # type: ignore[attr-defined]
        (tmp_path / "quiet").mkdir()
        said = json.loads(hoststash.stash(str(tmp_path / "quiet"), min_total=1))
        assert said.get("stashed") == 64 << 20, said
        json.loads(hoststash.take_back(str(tmp_path / "quiet")))
    finally:
        stop.set()
        worker.join()
    assert ns["blob"] == bytearray(b"f" * (32 << 20)) and bool((batch == 3.0).all())


def test_a_pool_worker_with_nothing_to_do_runs_on(tmp_path: Path) -> None:
    ns = {"blob": bytearray(32 << 20), "In": []}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(int).result()
        said = json.loads(hoststash.stash(str(tmp_path), min_total=1))
        assert said.get("stashed") == 32 << 20, said
        json.loads(hoststash.take_back(str(tmp_path)))
    assert len(ns["blob"]) == 32 << 20


def test_a_thread_that_touches_only_what_it_is_handed_runs_on_and_keeps_it(tmp_path: Path) -> None:
    """A logging QueueListener (one of stager.HANDED_THREADS), busy writing a record whose arguments hold a
    bytearray and a tensor: the stash goes ahead beside it, and leaves those two where they are."""
    torch = pytest.importorskip("torch")
    # A namespace holds them (one with a list in it, as a kernel's: CPython does not track a dict of bytes alone).
    ns = {"handed": bytearray(b"h" * (32 << 20)), "free": bytearray(b"f" * (32 << 20)), "In": []}
    handed_blob, free_blob = ns["handed"], ns["free"]
    handed_tensor, free_tensor = torch.full((8 << 20,), 1.5), torch.full((8 << 20,), 2.5)  # 32 MiB each
    writing, done = threading.Event(), threading.Event()

    class SlowHandler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            writing.set()
            done.wait(30)

    records: queue.Queue = queue.Queue()
    listener = logging.handlers.QueueListener(records, SlowHandler())
    listener.start()
    records.put(logging.LogRecord("x", logging.INFO, __file__, 1, "%s %s", (handed_blob, handed_tensor), None))
    try:
        assert writing.wait(10)
        said = json.loads(hoststash.stash(str(tmp_path), min_total=1))
        assert said.get("stashed") == 64 << 20 and said["buffers"] == 2, said
        assert len(free_blob) == 0 and free_tensor.untyped_storage().nbytes() == 0, "the others went"
        assert len(handed_blob) == 32 << 20 and handed_tensor.untyped_storage().nbytes() == 32 << 20, \
            "what the thread holds stayed"
        json.loads(hoststash.take_back(str(tmp_path)))
    finally:
        done.set()
        listener.stop()
    assert free_blob == bytearray(b"f" * (32 << 20)) and bool((free_tensor == 2.5).all())


def test_what_a_handed_thread_holds_is_read_again_if_it_changes_and_else_the_stash_steps_aside() -> None:
    """A container that a running thread changes while it is read ("deque mutated during iteration": a
    queue's buffer its feeder empties) is read again; one that keeps changing makes the search give up
    with a sentence, never an exception out of the kernel's side."""

    class Changing(list):
        def __init__(self, items: list, fails: int) -> None:
            super().__init__(items)
            self.fails = fails

        def __iter__(self):  # type: ignore[no-untyped-def]
            if self.fails:
                self.fails -= 1
                raise RuntimeError("deque mutated during iteration")
            return super().__iter__()

    blob = bytearray(1 << 20)
    held: list[Any] = [Changing([blob], fails=2)]
    release = threading.Event()
    worker = threading.Thread(target=lambda box: release.wait(30), args=(held,), name="feeder", daemon=True)
    worker.start()
    try:
        assert stager.reach([worker], None) == {("bytearray", id(blob))}
        held[0] = Changing([blob], fails=stager.REREAD)
        with pytest.raises(stager.StepAside, match="what thread 'feeder' holds keeps changing"):
            stager.reach([worker], None)
    finally:
        release.set()
        worker.join(10)


# -- through a real server and kernel -----------------------------------------------------------------


async def test_suspend_writes_the_buffers_itself_and_resume_reads_them_back(jp_fetch, jp_serverapp, kernel):
    digest = (await kernel.run(MAKE)).strip()
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    assert "stash" in op["phases"] and "stash" in op["timings"], op
    folder = _images(jp_serverapp, kernel.id)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["stash"]["stashed"] == 3 * 96 << 20 and manifest["stash"]["buffers"] == 3, manifest["stash"]
    parts = [n for n in manifest["files"] if n.startswith("stash-")]
    assert "stash-index.json" in parts and sum(manifest["files"][n] for n in parts) >= 3 * 96 << 20
    # CRIU did not carry them a second time: its images hold less than the buffers.
    criu_bytes = sum(size for name, size in manifest["files"].items() if not name.startswith("stash-"))
    assert criu_bytes < 96 << 20, manifest["files"]
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded" and "unstash" in op["timings"], op
    assert (await kernel.run("print(digest(), alias is blobs[1], len(blobs[0]))")).split() == [digest, "True",
                                                                                           str(96 << 20)]
    assert not folder.exists(), "the images are removed once the kernel runs"


async def test_a_kernel_asked_to_map_a_prefetch_early_says_why_not_and_changes_nothing(jp_fetch, jp_serverapp,
                                                                                        kernel, tmp_path):
    """A resume with a prefetch asks the restored kernel to map the helper's memory while the helper still reads
    (kernel/hoststash.py's open_prefetch). Through the real wire, a kernel that cannot says why at once, and
    its buffers come back from the files all the same: CPU buffers, another stash, an older version."""
    digest = (await kernel.run(MAKE)).strip()
    provisioner = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner
    folder = tmp_path / "stash"
    folder.mkdir()
    await server_sees_idle(jp_fetch, kernel)  # heard busy still, the stash would go to the cell's safe point
    said = await asyncio.to_thread(provisioner.host_stash, str(folder), 10**8, 60)
    assert said["stashed"] == 3 * 96 << 20 and "safe_point" not in said, said
    session = json.loads((folder / hoststash.INDEX).read_text())["session"]
    handle = "ab" * 64

    def early(session: str) -> str | None:
        return provisioner.host_open_prefetch(str(folder), {"handle": handle, "session": session}, 10)

    assert await asyncio.to_thread(early, "another") == "it is not this kernel's stash"
    assert await asyncio.to_thread(early, session) == "its CUDA buffers are not on one GPU"
    await kernel.run("import jupyter_gpumigrate.kernel.hoststash as _m; _saved = _m.open_prefetch; del _m.open_prefetch")
    assert await asyncio.to_thread(early, session) == "its jupyter-gpumigrate is older"
    await kernel.run("_m.open_prefetch = _saved")
    said = await asyncio.to_thread(provisioner.host_take_back, str(folder), 60)
    assert said["unstashed"] == 3 * 96 << 20, said
    assert (await kernel.run("print(digest(), alias is blobs[1])")).split() == [digest, "True"]


async def test_a_client_gone_while_the_kernel_was_suspended_is_named_and_not_waited_for(jp_fetch, jp_serverapp,
                                                                                        kernel, caplog):
    """A client counted at the suspend (a subscriber of the kernel's IOPub, outside the kernel) closes before the
    resume. The resume's adopt waits for every client counted to re-dial, until the counts stop changing: it names
    the one that never came, on its channel, and its wait ends (from the restore on: here the kernel read its
    stash back meanwhile, the live clients re-dialled long before). The kernel runs on, with its buffers."""
    import zmq

    from jupyter_gpumigrate.engine import netstate

    digest = (await kernel.run(MAKE)).strip()
    manager = jp_serverapp.kernel_manager.get_kernel(kernel.id)
    info, pid = manager.get_connection_info(), manager.provisioner.pid
    iopub = int(info["iopub_port"])
    before = netstate.client_counts([pid], skip_own=True)[iopub]
    extra = zmq.Context.instance().socket(zmq.SUB)
    try:
        extra.setsockopt(zmq.SUBSCRIBE, b"")
        extra.connect(f"tcp://{info['ip']}:{iopub}")
        deadline = time.monotonic() + 30
        while netstate.client_counts([pid], skip_own=True)[iopub] <= before:
            assert time.monotonic() < deadline, "the extra subscriber never connected"
            await asyncio.sleep(0.02)
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "succeeded", op
        manifest = json.loads((_images(jp_serverapp, kernel.id) / "manifest.json").read_text())
        assert manifest["clients"][str(iopub)] == before + 1, manifest["clients"]
    finally:
        extra.close(linger=0)
    caplog.set_level(logging.INFO, logger="jupyter_gpumigrate")
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "succeeded" and "unstash" in op["timings"], op
    said = [r.getMessage() for r in caplog.records if "did not reconnect" in r.getMessage()]
    assert len(said) == 1 and ": 1 on iopub, of " in said[0], said
    assert (await kernel.run("print(digest(), alias is blobs[1])")).split() == [digest, "True"]


async def test_a_handed_thread_in_a_kernel_keeps_what_it_holds_and_no_more(jp_fetch, jp_serverapp, kernel):
    """In a kernel, a thread's own attributes lead to the whole notebook (``Thread._stderr`` is ipykernel's
    stream, whose session leads to the shell and its namespace): the search of what a handed thread may
    touch goes through no Jupyter object, so a logging QueueListener busy with a record keeps that record's
    buffer and the notebook's others are written, as a DataLoader's pin-memory thread keeps its batch."""
    digest = (await kernel.run(MAKE)).strip()
    await kernel.run("""
import logging, logging.handlers, queue, threading
held, writing, done = bytearray(b"h" * (48 << 20)), threading.Event(), threading.Event()
class Slow(logging.Handler):
    def emit(self, record):
        writing.set()
        done.wait(120)
records = queue.Queue()
listener = logging.handlers.QueueListener(records, Slow())
listener.start()
records.put(logging.LogRecord("x", logging.INFO, "", 1, "%s", (held,), None))
assert writing.wait(10)
""")
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "succeeded", op
    manifest = json.loads((_images(jp_serverapp, kernel.id) / "manifest.json").read_text())
    assert manifest["stash"]["stashed"] == 3 * 96 << 20 and manifest["stash"]["buffers"] == 3, manifest["stash"]
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    said = await kernel.run("done.set(); listener.stop(); print(digest(), held == bytearray(b'h' * (48 << 20)))")
    assert said.split() == [digest, "True"]


async def test_a_damaged_stash_file_fails_the_resume_and_keeps_the_images(jp_fetch, jp_serverapp, kernel):
    digest = (await kernel.run(MAKE)).strip()
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    folder = _images(jp_serverapp, kernel.id)
    index = hoststash.read_index(folder)
    chunk = index["chunks"][5]
    part = folder / hoststash.PART.format(chunk.part)
    _flip(part, chunk.offset + 1000)
    op = await operate(jp_fetch, kernel.id, "resume")
    assert op["status"] == "failed" and op["failed_phase"] == "unstash", op
    assert part.name in op["error"] and "checksum does not match" in op["error"] and "kept" in op["error"], op
    view = await api(jp_fetch, "kernels", kernel.id)
    assert view["state"] == "suspended" and (folder / "manifest.json").exists()
    # Repaired, the same images bring the kernel back whole: nothing was lost by the failed try.
    _flip(part, chunk.offset + 1000)
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(digest())")).strip() == digest


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 200 MB tmpfs: room for the kernel's CRIU images, not for its 288 MB of buffers."""
    with small_tmpfs(tmp_path / "small", "200m") as folder:
        yield folder


class TestFullDisk:
    @pytest.fixture
    def jp_server_config(self, small_disk: Path) -> dict[str, Any]:
        return _config(small_disk / "gpumigrate", suspend_to="disk")

    async def test_a_full_disk_during_the_stash_leaves_the_kernel_running_whole(self, jp_fetch, jp_serverapp,
                                                                                kernel, small_disk):
        digest = (await kernel.run(MAKE)).strip()
        op = await operate(jp_fetch, kernel.id, "suspend")
        assert op["status"] == "failed" and op["failed_phase"] == "stash", op
        assert "full" in op["error"] and str(small_disk / "gpumigrate") in op["error"], op["error"]
        assert "runs on, unchanged" in op["error"]
        assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
        assert (await kernel.run("print(digest())")).strip() == digest
        assert not _images(jp_serverapp, kernel.id).exists(), "the partial files are removed"


async def test_a_kernel_killed_mid_stash_leaves_no_half_image(jp_fetch, jp_serverapp, kernel):
    # Enough to take a while to write on this machine, so that the kill lands during the stash.
    await kernel.run("import os\nbig = [bytearray(os.urandom(1 << 20) * 200) for _ in range(4)]\nprint('ok')")
    pid = jp_serverapp.kernel_manager.get_kernel(kernel.id).provisioner.pid
    op = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", expect=202)
    deadline = time.monotonic() + 60
    while not any((folder := _images(jp_serverapp, kernel.id)).glob("stash-*.bin")):  # memory or disk
        assert time.monotonic() < deadline, "the stash never started"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    op = await wait_operation(jp_fetch, op)
    assert op["status"] == "failed" and op["failed_phase"] == "stash", op
    assert f"The kernel's process {pid} ended while it wrote its large buffers" in op["error"], op["error"]
    assert "Jupyter restarts it" in op["error"], op["error"]
    assert not folder.exists(), "no half image is left"
    await restarted(jp_serverapp, kernel.id, pid)  # as the error says


# -- a server killed while the buffers are in the stash -----------------------------------------------


async def test_a_server_killed_between_the_stash_and_the_dump_loses_nothing(process_server):
    server = process_server
    server.start()
    # The stashed buffers, and 1.5 GB that CRIU dumps itself: the dump lasts long enough to be cut.
    _, kernel_id, digest = await notebook_running(server, MAKE + "ballast = bytes(range(256)) * 6_000_000")
    pid = server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["pid"]
    folder = server.state / "images" / kernel_id

    def stashed() -> None:  # the dump starts once the stash is written: the buffers are away now
        assert (folder / hoststash.INDEX).is_file() and (folder / "pending.json").is_file()

    cut_dump(server, kernel_id, pid, stashed)

    server.start()
    view = taken_back(server, kernel_id)
    assert view["state"] == "running" and view["pid"] == pid, view
    assert "read back the buffers it had written" in server.server_log()
    assert not folder.exists(), "once the kernel has its buffers, the unfinished dump is removed"
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(digest(), len(ballast))")).split() == [digest, str(256 * 6_000_000)]
    tab.ws.close()


async def test_a_server_killed_while_the_resumed_kernel_reads_its_stash_loses_nothing(process_server):
    server = process_server
    server.start()
    _, kernel_id, digest = await notebook_running(
        server, MAKE.replace("for _ in range(3)", "for _ in range(12)"))  # 1.2 GB to read back
    assert server.operate(kernel_id, "suspend")["status"] == "succeeded"
    folder = server.state / "images" / kernel_id
    assert json.loads((folder / "manifest.json").read_text())["stash"]["buffers"] == 12
    op = server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/resume", {}, expect=202)
    deadline = time.monotonic() + 60
    while op["phase"] != "unstash":
        assert op["status"] in ("pending", "running") and time.monotonic() < deadline, op
        op = server.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    server.stop(signal.SIGKILL)

    server.start()
    view = taken_back(server, kernel_id)
    # The kernel had read its buffers back, or finished after its server died: it runs whole. Or it
    # could not, and is suspended from its intact images. Either way nothing is lost.
    assert view["state"] in ("running", "suspended"), view
    tab = await tab_on(server, kernel_id)
    assert (await tab.run("print(digest())", timeout=120)).strip() == digest
    tab.ws.close()
    assert server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["state"] == "running"
    assert not folder.exists(), "no stale images"
