"""Move live kernels between two hosts: network namespaces on this machine, each with its own server.

tests/hosts.py builds them: a bridge, one namespace per host with its own address, loopback and
jupyter_server (HTTPS), the other host as its peer. The notebook's client stays connected to host a's
server the whole time, as a browser tab would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from helpers import (BUILD_STATE, CHECK_STATE, EXPECTED, WebSocketTab, fill, hold_pid, start_sleep, transplant_processes,
                     two_gpus)
from hosts import Host, Network, host_pair
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpumigrate.credentials import ENV_KERNEL_ID
from jupyter_gpumigrate.engine import hostfit, proctree
from jupyter_gpumigrate.engine.images import Manifest
from jupyter_gpumigrate.peers import Guest, _estimate

pytestmark = pytest.mark.usefixtures("criu_binary")

WHERE = "import subprocess; print(subprocess.run(['ip', '-4', '-o', 'addr', 'show', 'eth0'], capture_output=True, text=True).stdout.split()[3])"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    net = Network(20 + os.getpid() % 200).up()
    a = b = None
    try:
        a, b = host_pair(net, root)
        for host in (a, b):  # a move's images in memory where there is room, as by default (images.choose);
            # the images carried as they are written (c.GPUMigrateApp.stream_dump; 'auto' by default, off in
            # test_a_large_kernel_moves_...[off]); the bulk listener as urgent as its server (transfer_nice 0;
            # 10 by default, which test_bulk checks): on CI's 2 CPUs, a nicer one sent the stash's first part only
            # once the kernel had written all of it, and a kill meant for the stash landed in the dump
            host.extra = {"MigratableProvisioner": {"suspend_to": "auto"},
                          "GPUMigrateApp": {"stream_dump": "on", "transfer_nice": 0}}
        # "c" is b with a wrong credential.
        a.start({"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)})
        b.start({"a": a.peer_entry()})
        yield a, b
    finally:
        for host in (a, b):
            if host is not None:
                host.stop()
        net.close()


def left_behind(a: Host, b: Host) -> list[str]:
    """What a test left on the hosts: kernels (running, relayed or suspended) and b's guests, each as a phrase."""
    found = [f"kernel {k['id']} on a" for k in a.api("GET", "api/kernels")]
    found += [f"kernel {k['id']} of b's own" for k in b.api("GET", "api/kernels")]
    found += [f"a's record of kernel {p.stem}" for p in (a.root / "state" / "kernels").glob("*.json")]
    found += [f"b's guest {p.stem}" for p in (b.root / "state").glob("**/guests-running/*.json")]
    return found


@pytest.fixture(autouse=True)
def leaves_nothing(request):
    """Each test that uses the hosts leaves no kernel on either: one left behind would run on into the next tests
    (and hold its ports on b). What is left (a's and b's kernels, a's kernels' records, b's guests' records) is
    ended, and the test that left it fails, saying what it was."""
    yield
    if "hosts" not in request.fixturenames:
        return
    a, b = request.getfixturevalue("hosts")
    if any(host.proc is None or host.proc.poll() is not None for host in (a, b)):
        return  # a failed test left a server down: its own failure says so
    deadline = time.monotonic() + 60
    while (found := left_behind(a, b)) and time.monotonic() < deadline:
        time.sleep(0.5)  # kernels end, and guests go, a moment after the test's last call
    if not found:
        return
    for host in (a, b):  # each step on its own: one that fails (gone meanwhile) stops none of the others
        for kernel in host.api("GET", "api/kernels"):
            with contextlib.suppress(AssertionError, OSError):
                host.api("DELETE", f"api/kernels/{kernel['id']}", expect=204)
    for record in (b.root / "state").glob("**/guests-running/*.json"):
        with contextlib.suppress(AssertionError, OSError):
            b.api("DELETE", f"api/gpumigrate/peer/kernels/{record.stem}", expect=204,
                  headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
    for record in (a.root / "state" / "kernels").glob("*.json"):  # one of no kernel (refused) ends with no call
        record.unlink(missing_ok=True)
    pytest.fail(f"the test left {', '.join(found)}")


def guest_images_in_memory(kernel_id: str) -> list[Path]:
    """A guest's images in memory, on any host of this machine (their tmpfs folders are beside the users')."""
    return list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*-guests/{kernel_id}"))


async def open_tab(host: Host, kernel_id: str) -> WebSocketTab:
    """A client of the kernel through the host's /api/kernels/{id}/channels, like a notebook tab."""
    request = HTTPRequest(f"wss://{host.ip}:8888/api/kernels/{kernel_id}/channels",
                          headers={"Authorization": f"token {host.token}"}, ca_certs=str(host.cert))
    return WebSocketTab(await websocket_connect(request))


async def call(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def restart_and_find(host: Host, peers: dict, kernel_id: str) -> dict:
    """Start ``host``'s server again and wait until it has taken the kernel back (it does as it starts): its view."""
    await call(host.start, peers)
    deadline = time.monotonic() + 60
    while kernel_id not in [k["id"] for k in await call(host.api, "GET", "api/gpumigrate/kernels")]:
        assert time.monotonic() < deadline, host.server_log()
        await asyncio.sleep(0.2)
    return await call(host.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")


async def new_kernel(host: Host) -> tuple[str, WebSocketTab]:
    kernel = await call(host.api, "POST", "api/kernels", {"name": "python3"})
    tab = await open_tab(host, kernel["id"])
    assert (await tab.run("print('up')")).strip() == "up"
    return kernel["id"], tab


async def kernel_with_bytes(host: Host, n: int = 1_600_000) -> tuple[str, WebSocketTab, int]:
    """A kernel on ``host`` holding ``blob``, 256 * ``n`` bytes (400 MB by default) that the stash does not take
    (bytes, under host_stash_min): CRIU writes them into its pages. ``before`` is their digest. Its tab, PID."""
    kernel_id, tab = await new_kernel(host)
    await tab.run(f"import hashlib\nblob = bytes(range(256)) * {n}\nbefore = hashlib.sha256(blob).hexdigest()")
    return kernel_id, tab, (await call(host.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]


def move_until_phase(host: Host, kernel_id: str, to_host: str, phase: str) -> dict:
    """Start moving the kernel to ``to_host`` and follow the operation until it is in ``phase``: the operation then."""
    op = host.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": to_host})
    while op["phase"] != phase:
        assert op["status"] in ("pending", "running"), op
        op = host.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return op


def followed_to_its_end(host: Host, op: dict) -> dict:
    """The operation ``op`` of ``host``, followed until it has succeeded or failed."""
    while op["status"] in ("pending", "running"):
        op = host.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return op


async def end_kernel(host: Host, kernel_id: str, tab: WebSocketTab | None) -> None:
    """The test's kernel goes, whatever state the test left it in (a failed assertion included)."""
    if tab is not None:
        tab.ws.close()
    # What a server that just started takes back: a kernel's record (it ran, here or at b), or its images (it was
    # suspended here, as a stop under the policy 'suspend' leaves it: on disk, or in memory if it was killed).
    kept = [host.root / "state" / "kernels" / f"{kernel_id}.json",
            host.root / "state" / "images" / kernel_id / "manifest.json",
            *Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}/manifest.json")]
    deadline = time.monotonic() + 60
    while True:
        try:
            await call(host.api, "DELETE", f"api/kernels/{kernel_id}")
            return
        except AssertionError as exc:
            if ": 404 " not in str(exc) or not any(path.exists() for path in kept):
                return  # gone already, or refused: what is left, leaves_nothing ends and names
            assert time.monotonic() < deadline, f"kernel {kernel_id} is not taken back: {host.server_log()}"
            await asyncio.sleep(0.5)  # not yet taken back by a server that just started: it will be


async def test_a_kernel_moves_to_the_other_host_and_back_while_its_tab_keeps_executing(hosts, tmp_path):
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    assert "built" in await tab.run(f"PATH = {str(tmp_path / 'notes.txt')!r}\n" + BUILD_STATE)
    assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"

    op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
    assert op["status"] == "succeeded", op
    assert list(op["timings"]) == ["prepare", "stream", "dump", "transfer", "restore", "adopt"], op
    assert op["from_host"] == "a" and op["to_host"] == "b" and op["bytes"] > 1_000_000
    view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["host"] == "b" and view["remote"] and view["state"] == "running" and view["pid"] is None

    # The same tab, through a's server: the kernel runs in b's network namespace, with all its state.
    assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
    assert (await tab.run(CHECK_STATE)).splitlines() == EXPECTED
    # The kernel's own calls to its server reach a through the relay.
    listing = await tab.run("%migrate --list")
    assert f"{kernel_id[:8]}* on b" in listing and "Host a; peers: b, c" in listing, listing
    # b hosts it, for a peer only: b's own users do not see it among b's kernels.
    assert kernel_id not in [k["id"] for k in await call(b.api, "GET", "api/kernels")]

    # Back home, from inside the kernel, while the tab keeps executing.
    out = await tab.run("%migrate --to-host a")
    assert "Moved from host b to host a" in out, out
    view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["host"] == "a" and not view["remote"] and view["pid"]
    assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
    assert (await tab.run("print(x + 1, next(gen), worker.is_alive(), f.tell())")).strip() == "42 7 True 18"
    # b deleted its copy of the kernel's memory, in memory and on disk; a, its own.
    assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)
    assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}"))
    tab.ws.close()
    await call(a.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)


async def test_a_folder_of_the_kernels_left_in_this_hosts_memory_does_not_keep_it_from_coming_home(hosts):
    """A folder of the kernel's in a's memory folder, as a cleanup that could not finish leaves it: the move
    home makes its images' folder on disk, replacing that one, and must write there. (It fetched into the
    replaced folder's path, failed, and left the kernel on b.)"""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    digest = __import__("hashlib").sha256(os.path.realpath(a.root / "state").encode()).hexdigest()[:12]
    memory = Path(f"/dev/shm/jupyter-gpumigrate-{os.geteuid()}-{digest}")
    try:
        await tab.run("x = 41")
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
        assert op["status"] == "succeeded", op
        (memory / kernel_id).mkdir(mode=0o700, parents=True)
        os.chmod(memory, 0o700)
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert (await tab.run("print(x + 1)")).strip() == "42"
        assert not (memory / kernel_id).exists()
    finally:
        await end_kernel(a, kernel_id, tab)
        shutil.rmtree(memory / kernel_id, ignore_errors=True)


async def test_two_kernels_of_this_host_run_on_the_other_at_once_and_each_reaches_its_server(hosts):
    """Every kernel of a knows a's server by one loopback address, where b listens for their calls while they run
    there: the second kernel to go shares that listener with the first (before, b refused it: 'port not free').
    Once the first ends, the second still reaches a, and comes home from inside."""
    a, b = hosts
    first, first_tab = await new_kernel(a)
    second, second_tab = await new_kernel(a)
    try:
        for kernel_id in (first, second):
            op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        # A peer's dial that names no loopback address for the kernels' server, or garbage, is refused, and the
        # kernel's relay runs on: b never listens for a peer beyond its loopback.
        for api, said in (('["0.0.0.0", 8888]', "must be on a loopback port"), ("[", "Expecting value"),
                          ('["127.0.0.1", 70000]', "must be on a loopback port")):
            request = HTTPRequest(f"wss://{b.ip}:8888/api/gpumigrate/peer/kernels/{first}/channels?api="
                                  + urllib.parse.quote(api), ca_certs=str(b.cert),
                                  headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
            dial = await websocket_connect(request)
            assert await dial.read_message() is None and dial.close_code == 4004, (api, dial.close_code)
            assert said in (dial.close_reason or ""), (api, dial.close_reason)
        for kernel_id, tab in ((first, first_tab), (second, second_tab)):
            assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
            listing = await tab.run("%migrate --list")
            assert f"{kernel_id[:8]}* on b" in listing, listing
        await end_kernel(a, first, first_tab)
        await forgotten(b, first)
        assert f"{second[:8]}* on b" in await second_tab.run("%migrate --list")
        out = await second_tab.run("%migrate --to-host a")
        assert "Moved from host b to host a" in out, out
        assert (await second_tab.run(WHERE)).strip() == f"{a.ip}/24"
    finally:
        await end_kernel(a, first, first_tab)
        await end_kernel(a, second, second_tab)


async def test_two_kernels_on_the_other_host_outlive_its_server_and_each_reaches_its_own_again(hosts):
    """b's server SIGKILLed (its process group) while two kernels of a run there: b's next server takes both back,
    a's two relays dial again, share the listener b makes anew, and each kernel reaches a's server from inside,
    its state whole. Ended from a, both go on b."""
    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    kernels = [await kernel_with_bytes(a, 40_000) for _ in range(2)]
    pids: list[int] = []
    try:
        for kernel_id, _, _ in kernels:
            op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
            pids.append((await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))["pid"])
        os.killpg(b.proc.pid, signal.SIGKILL)
        assert b.proc.wait(10) == -signal.SIGKILL
        await call(b.start, {"a": a.peer_entry()})
        for kernel_id, tab, _ in kernels:
            listing = await tab.run("%migrate --list", timeout=90)
            assert f"{kernel_id[:8]}* on b" in listing, listing
            same = await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")
            assert same.strip() == "True 10240000"
        with collecting(os.getsid(pids[0])), collecting(os.getsid(pids[1])):
            for kernel_id, tab, _ in kernels:
                await end_kernel(a, kernel_id, tab)
                await forgotten(b, kernel_id)
            for pid in pids:
                await until_gone(pid, 10)
        pids = []
    finally:
        for pid in pids:
            if running_state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
        if b.proc.poll() is not None:
            await call(b.start, {"a": a.peer_entry()})
        for kernel_id, tab, _ in kernels:
            await end_kernel(a, kernel_id, tab)


@pytest.mark.parametrize("stream", ["on", "off"], indirect=True)
async def test_a_large_kernel_moves_with_its_buffers_written_and_read_back_by_its_own_threads(hosts, stream):
    # 1.1 GB of buffers, over the default c.MigratableProvisioner.host_stash_min (1 GB): the kernel writes them
    # into the images itself (the host stash), CRIU dumps the rest; b restores it, and the kernel reads them back
    # there. On the way home b has it do the same (a sends the kernel's key with the calls that need it).
    # Every byte and the buffer's identity survive; no image is left on either host. Both ways of sending:
    # each file as it is written (stream_dump on), and off: the stash's files once written.
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        out = await tab.run("import hashlib, os\n"
                            "blob = bytearray(os.urandom(1 << 20)) * 1050\n"
                            "before, ident = hashlib.sha256(blob).hexdigest(), id(blob)\n"
                            "print(len(blob))")
        assert out.strip() == str(1050 << 20), out
        check = "print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident, len(blob))"
        for there, dest in ((b, "b"), (a, "a")):
            op = await call(a.operate, kernel_id, "migrate", {"to_host": dest})
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
            # on: the images go as they are written, from before the stash, its parts first; off: the stash's
            # files once written, CRIU's once the dump is over
            phases = ((["prepare", "stream", "stash"] if stream == "on" else ["prepare", "stash", "send stash"]) +
                      ["dump", "transfer", "restore", "adopt"] if dest == "b" else
                      ["prepare"] + (["stream"] if stream == "on" else ["fetch stash"]) +
                      ["dump", "transfer", "restore", "unstash", "adopt"])
            assert list(op["timings"]) == phases, op
            assert op["stash"]["stashed"] >= 1050 << 20 and op["stash"]["unstashed"] == op["stash"]["stashed"], op
            assert (await tab.run(WHERE)).strip() == f"{there.ip}/24"
            assert (await tab.run(check)).strip() == f"True True {1050 << 20}"
            if dest == "b":  # the large files went to b's bulk listener, each received by a process of its own
                assert f"kernel {kernel_id}: its large files go to b's bulk listener" in a.server_log(), \
                    a.server_log()
                assert f"kernel {kernel_id}: stash-" in (b.root / "server.log").read_text(errors="replace")
                assert "received by a process of its own (201)" in (b.root / "server.log").read_text(errors="replace")
                if stream == "off":  # sent whole, each by a process of a's bulk listener
                    assert re.search(rf"images/{kernel_id}/stash-\S+ sent to b by a process of its own",
                                     a.server_log()), a.server_log()
            else:  # and home, each fetched by a process of a's bulk listener
                assert f"images/{kernel_id}/stash-" in a.server_log() and "fetched from b by a process of its own" \
                    in a.server_log(), a.server_log()
                # from b's bulk listener, each sent by a process of its own there: whole (off), or as b's stash
                # and dump wrote it (on)
                assert f"kernel {kernel_id}: its large files come from b's bulk listener" in a.server_log()
                sent = "sent by a process of its own" if stream == "off" else \
                    r"sent as it was written by a process of its own \(\d+ bytes\)"
                assert re.search(rf"kernel {kernel_id}: stash-\S+ {sent}", b.server_log()), b.server_log()
                if stream == "on":  # their checksums taken as they went, not read again for the listing
                    assert re.search(rf"kernel {kernel_id}: the checksums of \d+ of its \d+ image files listed are "
                                     "those taken as they were sent", b.server_log()), b.server_log()
                # while b's driver and CRIU ran: as they were written (on), or once the stash wrote them all (off)
                fetched = re.search(rf"kernel {kernel_id}: \d+ image files, [\d.]+ GB, fetched from b in [\d.]+ s after "
                                    r"its dump \((\d+) of them, [\d.]+ GB, while the dump ran", a.server_log())
                assert fetched and int(fetched[1]) >= 1, a.server_log()
            assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)
            assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}"))
            assert not list(a.images_glob(f"**/{kernel_id}/stash-*"))
        # b's dump for the way home (and its stash) went to memory, as b's suspend_to 'auto' has it where there
        # is room: the node helper's socket, configured by default but absent, kept them on disk before
        # (where /dev/shm has room, as on any host this runs on but a container's default 64 MB)
        if shutil.disk_usage("/dev/shm").free > 8e9:
            assert f"kernel {kernel_id} hosted for a peer: its images for its way home are in memory here" in \
                b.server_log(), b.server_log()
            # and a placed them by the size b said, as its own suspend_to 'auto' has it: in memory where there is
            # room (on disk, 32 GB were 28 GB of dirty pages that every writer on the host waited behind)
            assert re.search(rf"kernel {kernel_id}: its images come home (in memory|on disk \(no room in memory)",
                             a.server_log(tail=None)), a.server_log()
    finally:
        await end_kernel(a, kernel_id, tab)


async def with_stream_dump(a: Host, b: Host, value: str) -> None:
    """Start both hosts' servers again with c.GPUMigrateApp.stream_dump ``value`` (the module's hosts have it
    on; a test that sets it off sets it on again as it ends)."""
    await call(set_stream_dump, a, b, value)


def set_stream_dump(a: Host, b: Host, value: str) -> None:
    for host, peers in ((a, a_peers(b)), (b, {"a": a.peer_entry()})):
        host.stop()
        host.extra["GPUMigrateApp"]["stream_dump"] = value
        host.start(peers)


@pytest.fixture
def stream(request, hosts):
    """c.GPUMigrateApp.stream_dump for one test, parametrized indirectly: "on" (the module's hosts have it), or
    "off": both servers are started again with it, and again with "on" after the test."""
    if request.param == "off":
        set_stream_dump(*hosts, "off")
    yield request.param
    if request.param == "off":
        set_stream_dump(*hosts, "on")


#: 1100 MiB of random bytes in the kernel (over host_stash_min: its stash's parts go by the bulk listeners), and
#: the check that they, and the object holding them, are the same
BLOB = ("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 1100\n"
        "before, ident = hashlib.sha256(blob).hexdigest(), id(blob)")
BLOB_CHECK = "print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident, len(blob))"


async def runs_whole_on(tab: WebSocketTab, host: Host) -> None:
    """The kernel behind ``tab`` runs on ``host`` with its :data:`BLOB` unchanged."""
    assert (await tab.run(WHERE)).strip() == f"{host.ip}/24"
    assert (await tab.run(BLOB_CHECK)).strip() == f"True True {1100 << 20}"


async def b_keeps_nothing_of(b: Host, kernel_id: str) -> None:
    """Within 30 s, ``b`` holds no folder of the kernel (on its disk or in its memory)."""
    guest = b.root / "state" / "guests" / kernel_id
    deadline = time.monotonic() + 30
    while guest.exists() or guest_images_in_memory(kernel_id):
        assert time.monotonic() < deadline, f"b kept {list(guest.glob('*'))}"
        await asyncio.sleep(0.1)


def bulk_listener_of(host: Host, other_than: int | None = None) -> int:
    """The PID of ``host``'s bulk listener (bulkd.py), once it runs (``other_than``: once one other than that
    one runs: it was started again)."""
    deadline = time.monotonic() + 30
    while True:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if b"jupyter_gpumigrate.bulkd" in cmdline and ppid == host.proc.pid and int(pid) != other_than:
                return int(pid)
        assert time.monotonic() < deadline, f"{host.name} has no bulk listener"
        time.sleep(0.1)


async def test_a_bulk_listener_killed_mid_transfer_either_way_leaves_the_kernel_where_it_ran_and_is_started_again(
        hosts):
    # Going away, b's bulk listener is SIGKILLed as the stash's parts arrive: the move is undone and the kernel
    # runs on here, whole. b starts its listener again (a second later), announces its port, and the next move
    # sends to it and succeeds. Coming home, a's listener is SIGKILLed as its processes fetch: the kernel runs
    # on there, whole (or, where the files followed as b's dump wrote them were on their way, they are fetched
    # again by a's server process, and it comes home); a's listener is started again, and the next way home's
    # processes fetch. Nothing of it is left on either host. (A port that cannot be reached: test_bulk.py.)
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    guest = b.root / "state" / "guests" / kernel_id
    try:
        await tab.run(BLOB)
        listener_b, logged_b = bulk_listener_of(b), log_size(b)

        def kill_bs_listener_as_a_part_arrives() -> dict:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            deadline = time.monotonic() + 60
            while not any(f.name.startswith("stash-") and f.stat().st_size > (16 << 20)
                          for folder in [guest, *guest_images_in_memory(kernel_id)] if folder.is_dir()
                          for f in folder.iterdir()):
                assert time.monotonic() < deadline, "no part of the stash reached b"
                time.sleep(0.001)
            os.kill(listener_b, signal.SIGKILL)
            return finished(a, op)

        op = await call(kill_bs_listener_as_a_part_arrives)
        assert op["status"] == "failed", op
        await runs_whole_on(tab, a)

        await started_again(b, listener_b, logged_b)
        since = await moved_saying(a, kernel_id, "b")
        assert f"kernel {kernel_id}: its large files go to b's bulk listener" in since, since
        await runs_whole_on(tab, b)

        listener_a, logged_a = bulk_listener_of(a), log_size(a)

        def kill_as_listener_as_it_fetches() -> dict:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "a"})
            deadline = time.monotonic() + 60
            while not children_of(listener_a):
                assert time.monotonic() < deadline, "a's listener fetched nothing"
                time.sleep(0.001)
            os.kill(listener_a, signal.SIGKILL)
            return finished(a, op)

        op = await call(kill_as_listener_as_it_fetches)
        if op["status"] == "failed":  # a file fetched after the dump was on its way: undone, the kernel runs there
            assert "bulk listener" in op["error"] or "called off" in op["error"], op["error"]
            await runs_whole_on(tab, b)
            await started_again(a, listener_a, logged_a)
            since = await moved_saying(a, kernel_id, "a")
            assert "fetched from b by a process of its own" in since, since  # the listener started again's
        else:  # the files followed as b's dump wrote them were on their way: each that failed was fetched again
            # after the dump, by a's server process, as a file followed that fails always is
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
            await call(bulk_listener_of, a, listener_a)
        await runs_whole_on(tab, a)
        await b_keeps_nothing_of(b, kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)
        for host, peers in ((b, {"a": a.peer_entry()}), (a, a_peers(b))):  # their listeners again
            host.stop()
            await call(host.start, peers)


def log_size(host: Host) -> int:
    """How long ``host``'s server log is now (what it says later is read from there)."""
    return len((host.root / "server.log").read_bytes())


def log_since(host: Host, size: int) -> str:
    return (host.root / "server.log").read_bytes()[size:].decode(errors="replace")


async def started_again(host: Host, killed: int, logged: int) -> int:
    """The PID of ``host``'s bulk listener started again after ``killed`` was killed: its server said so in its log
    after ``logged`` bytes (the log's size before the kill: an earlier restart's line does not count; on a port
    where it had one) and reaped the killed one."""
    restarted = await call(bulk_listener_of, host, killed)
    deadline = time.monotonic() + 30
    while not re.search(r"the bulk listener was started again (on port \d+|\(it fetches only\))",
                        log_since(host, logged)):
        assert time.monotonic() < deadline, log_since(host, logged)[-3000:]
        await asyncio.sleep(0.1)
    assert running_state(killed) == "gone", f"{host.name}'s server did not reap its killed listener"
    return restarted


async def moved_saying(a: Host, kernel_id: str, to_host: str) -> str:
    """Move the kernel to ``to_host``, which succeeds; what a's log said meanwhile."""
    logged = log_size(a)
    op = await call(a.operate, kernel_id, "migrate", {"to_host": to_host})
    assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
    return log_since(a, logged)


async def comes_home_whole(a: Host, b: Host, tab: WebSocketTab, kernel_id: str) -> None:
    """The kernel moves home to ``a``, which succeeds; it runs there with its :data:`BLOB` unchanged, and ``b``
    keeps nothing of it."""
    await moved_saying(a, kernel_id, "a")
    await runs_whole_on(tab, a)
    await b_keeps_nothing_of(b, kernel_id)


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for child in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(child))
        except (OSError, ValueError, IndexError):
            continue
    return found


def kill_one_child_as_it_moves(a: Host, kernel_id: str, to_host: str, listener: int) -> tuple[dict, int]:
    """Move the kernel to ``to_host`` and SIGKILL the first process of ``listener`` (a bulk listener) seen
    during the move (one file's transfer: the listener and its other processes are left alone); the
    operation once over, and the PID killed."""
    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": to_host})
    deadline = time.monotonic() + 60
    while True:
        for child in children_of(listener):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return finished(a, op), child
        assert time.monotonic() < deadline, "the bulk listener ran no process for the move"
        time.sleep(0.001)


@pytest.mark.parametrize("stream, home_victim", [("off", "b"), ("on", "a"), ("on", "b")], indirect=["stream"])
async def test_one_transfer_process_killed_either_way_is_said_and_the_kernel_stays_whole(hosts, stream, home_victim):
    # One process of a bulk listener, not the listener, is SIGKILLed as an out-of-memory killer would. Going
    # away, one of a's processes sending a file (stream_dump off: whole, once written; on: as it
    # is written); the move is undone, its error names the process killed and not by the server; the kernel
    # runs on here, whole, and the listener goes on: the next move succeeds with it. Coming home, one of b's
    # processes serving a file (off: whole; on: as b's stash or dump writes it, its lock on the file dying
    # with it), or one of a's fetching a file (on): a file fetched during b's dump is fetched again after it
    # (the move succeeds), or the move is undone (the kernel runs on there); either way the kernel is whole
    # where the operation says, the listener goes on, and nothing is left.
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(BLOB)
        listener_a, listener_b = bulk_listener_of(a), bulk_listener_of(b)

        for _ in range(3):  # the process killed may have sent its whole file already: the move then succeeds
            op, killed = await call(kill_one_child_as_it_moves, a, kernel_id, "b", listener_a)
            if op["status"] == "failed":
                break
            assert op["status"] == "succeeded", op
            assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
        assert op["status"] == "failed", op
        assert "killed (SIGKILL), not by this server" in op["error"], op["error"]
        await until_gone(killed, 5)  # reaped by its listener
        await runs_whole_on(tab, a)
        assert bulk_listener_of(a) == listener_a, "a's listener was started again: it should have gone on"

        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        await runs_whole_on(tab, b)

        listener = listener_b if home_victim == "b" else listener_a
        op, killed = await call(kill_one_child_as_it_moves, a, kernel_id, "a", listener)
        await until_gone(killed, 5)  # reaped by its listener
        assert op["status"] == "succeeded" or "from b failed" in op["error"], op
        await runs_whole_on(tab, a if op["status"] == "succeeded" else b)
        assert (bulk_listener_of(a), bulk_listener_of(b)) == (listener_a, listener_b), \
            "a listener was started again: it should have gone on"
        if op["status"] == "failed":
            await comes_home_whole(a, b, tab, kernel_id)
        else:
            await b_keeps_nothing_of(b, kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_this_hosts_bulk_listener_killed_as_it_sends_files_followed_as_they_grow_undoes_the_move(hosts):
    # stream_dump on (the module's hosts have it): going away, each file followed as the stash and the dump write
    # it goes from a process of a's bulk listener. The listener is SIGKILLed as its first such process sends:
    # its processes die with it (their parent-death signal), the move is undone and says the listener ended, the
    # kernel runs on here, whole, and nothing of it stays on b. a starts its listener again, and the next move
    # sends through the new one and succeeds; the kernel comes home whole.
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(BLOB)
        listener, logged = bulk_listener_of(a), log_size(a)

        def kill_as_listener_as_it_sends() -> tuple[dict, list[int]]:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            deadline = time.monotonic() + 60
            while not (senders := children_of(listener)):
                assert time.monotonic() < deadline, "a's listener ran no process for the move"
                time.sleep(0.001)
            os.kill(listener, signal.SIGKILL)
            return finished(a, op), senders

        op, senders = await call(kill_as_listener_as_it_sends)
        assert op["status"] == "failed", op
        assert "the bulk listener ended" in op["error"], op["error"]
        for pid in senders:  # died with the listener, and reaped
            await until_gone(pid, 10)
        await runs_whole_on(tab, a)
        await b_keeps_nothing_of(b, kernel_id)

        restarted = await started_again(a, listener, logged)
        since = await moved_saying(a, kernel_id, "b")
        assert re.search(rf"images/{kernel_id}/stash-\S+ sent to b by a process of its own", since), since
        assert bulk_listener_of(a) == restarted
        await runs_whole_on(tab, b)
        await comes_home_whole(a, b, tab, kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


def reading_back(pid: int) -> bool:
    """Whether process ``pid`` has a stash file open (kernel/hoststash.py: it reads its buffers back)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}")).startswith("stash-"):
                return True
        except OSError:
            continue
    return False


async def test_the_kernel_killed_on_the_other_host_while_it_reads_its_buffers_back_runs_here_again(hosts):
    """SIGKILL of the kernel's process on b while it reads back the buffers it stashed (b restored it: the same
    PID, the hosts share this machine's PIDs): b's restore fails, the move is undone, and the kernel is
    restored here from the images this host kept until then, and reads its buffers back here, every byte."""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 1050\n"
                      "before = hashlib.sha256(blob).hexdigest()")
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        seen: list[str] = []

        def kill_it_on_b_as_it_reads_back() -> None:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            while op["status"] not in ("succeeded", "failed"):
                seen.append(op["phase"] or "")
                if op["phase"] == "restore" and "killed" not in seen:
                    deadline = time.monotonic() + 60
                    while not reading_back(pid):
                        assert time.monotonic() < deadline, "the kernel never read its buffers back on b"
                        time.sleep(0.001)
                    os.kill(pid, signal.SIGKILL)
                    seen.append("killed")
                op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            seen.append(json.dumps(op))

        await call(kill_it_on_b_as_it_reads_back)
        op = json.loads(seen[-1])
        assert "killed" in seen, f"the read back was over before it was seen: {seen}"
        assert op["status"] == "failed" and op["failed_phase"] == "restore", op
        assert "The move is undone: the kernel is brought back here" in op["error"], op["error"]
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and view["state"] == "running" and not view["remote"], view
        record = json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())
        assert "remote" not in record and record["pid"] == view["pid"], record  # the restore's undo took b's name
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob) >> 20)")).strip() == \
            "True 1050"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_the_other_hosts_disk_filling_up_mid_file_is_said_and_the_kernel_runs_on_here(hosts, tmp_path):
    """b keeps guests' images on a disk (a 600 MB tmpfs here) that another process fills while a's images
    arrive: b drops the rest of that file and answers 507 naming it; the move is undone, the kernel runs on
    here with its state, and b keeps nothing of it."""

    from helpers import small_tmpfs

    a, b = hosts
    saved = dict(b.extra)
    try:  # b runs again, whatever happened
        with small_tmpfs(tmp_path / "small", "600m") as small:
            b.stop()
            b.extra = {"MigratableProvisioner": {"state_dir": str(small / "state"), "suspend_to": "disk"}}
            b.start({"a": a.peer_entry()})
            kernel_id, tab = await new_kernel(a)
            try:
                await tab.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 400\n"
                              "before = hashlib.sha256(blob).hexdigest()")
                guest = small / "state" / "guests" / kernel_id
                seen: list[str] = []

                def fill_bs_disk_mid_transfer() -> None:
                    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
                    while op["status"] not in ("succeeded", "failed"):
                        if op["phase"] == "transfer" and "filled" not in seen:
                            deadline = time.monotonic() + 60
                            # once b holds a MiB of a file: the fill (a local write) takes the rest of b's disk long
                            # before the file's 400 MB arrive, whose processes send it at the link's speed
                            while not any(f.stat().st_size > (1 << 20) for f in guest.glob("*") if f.is_file()):
                                assert time.monotonic() < deadline, "b never began to receive"
                                time.sleep(0.001)
                            fill(small)  # b writes on meanwhile: whichever comes first
                            seen.append("filled")
                        op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
                    seen.append(json.dumps(op))

                await call(fill_bs_disk_mid_transfer)
                op = json.loads(seen[-1])
                assert "filled" in seen, seen
                assert op["status"] == "failed" and op["failed_phase"] == "transfer", op
                assert "could not be written here" in op["error"] and "free space here" in op["error"], op["error"]
                view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
                assert view["host"] == "a" and view["state"] == "running", view
                assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before)")).strip() == "True"
                assert not guest.exists(), list(guest.glob("*"))
            finally:
                await end_kernel(a, kernel_id, tab)
                b.stop()
                b.extra = saved
    finally:
        b.start({"a": a.peer_entry()})


@pytest.mark.parametrize("stream", ["on", "off"])
async def test_the_other_hosts_disk_filling_up_as_the_stash_arrives_is_said_and_the_kernel_runs_on_here(
        hosts, tmp_path, stream):
    """The kernel's stash (1.1 GB of buffers, written by its own threads) goes to b part by part: as it is
    written (stream_dump on), or once written (off: phase 'send stash'). b keeps guests' images on
    a disk (a 1.4 GB tmpfs: room for all, as b checks first) that another process fills once a part arrives: b
    answers 507 naming the file (or, where all arrived first, its restore says the disk is full), the move is undone (the parts' sending stopped, the kernel reads its buffers back), the kernel runs
    on here with every byte and the same buffer, and neither host keeps anything of it."""
    from helpers import small_tmpfs

    a, b = hosts
    saved_a = {section: dict(values) for section, values in a.extra.items()}
    saved_b = {section: dict(values) for section, values in b.extra.items()}
    kernel_id, tab = "", None
    try:  # b runs again, whatever happened
        with small_tmpfs(tmp_path / "small", "1400m") as small:
            try:
                b.stop()
                b.extra = {"MigratableProvisioner": {"state_dir": str(small / "state"), "suspend_to": "disk"},
                           "GPUMigrateApp": {"stream_dump": stream}}
                await call(b.start, {"a": a.peer_entry()})
                if stream == "off":
                    a.stop()
                    a.extra["GPUMigrateApp"]["stream_dump"] = "off"
                    await call(a.start, a_peers(b))
                kernel_id, tab = await new_kernel(a)
                await tab.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 1100\n"
                              "before, ident = hashlib.sha256(blob).hexdigest(), id(blob)")
                guest = small / "state" / "guests" / kernel_id

                def fill_bs_disk_as_a_part_arrives() -> tuple[str, dict]:
                    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
                    deadline = time.monotonic() + 60
                    while not any(f.name.startswith("stash-") and f.stat().st_size > (16 << 20)
                                  for f in (guest.iterdir() if guest.is_dir() else ())):
                        assert time.monotonic() < deadline, "no part of the stash reached b"
                        time.sleep(0.001)
                    phase = a.api("GET", f"api/gpumigrate/operations/{op['id']}")["phase"]
                    fill(small)  # b writes on meanwhile: whichever comes first
                    return phase, finished(a, op)

                phase, op = await call(fill_bs_disk_as_a_part_arrives)
                # on: the parts go from the stash's start (the first to pass 16 MiB on b may do so once the stash is
                # over: the stash's threads write faster than the parts travel); off: once written, beside the lock,
                # checkpoint and dump, never during the stash
                assert phase in (("stream", "stash", "lock", "checkpoint", "dump", "transfer") if stream == "on" else
                                 ("send stash", "lock", "checkpoint", "dump", "transfer")), phase
                assert op["status"] == "failed", op
                # b names the file it could not write: a part of the stash or, where the stash was all there before
                # the disk was full (b writes on as it fills), one of CRIU's images or the manifest after it (seen
                # once the parts were received by processes of b's bulk listener, faster); or, where even those
                # were, its restore says the disk is full (CRIU could not write its log there).
                assert re.match(r"b: ((stash-\S+|\S+\.img|manifest\.json) could not be written here \(No space left on device\): free "
                                r"space here|The (disk of|memory folder) \S+ (\(a tmpfs\) )?is full: CRIU could not "
                                r"write its log)", op["error"]), op["error"]
                view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
                assert view["host"] == "a" and view["state"] == "running", view
                assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident)")).strip() \
                    == "True True"
                assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
                deadline = time.monotonic() + 30
                while guest.exists():
                    assert time.monotonic() < deadline, f"b kept {list(guest.glob('*'))}"
                    await asyncio.sleep(0.1)
                assert not list(a.images_glob(f"**/{kernel_id}/stash-*"))
                assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}"))
            finally:
                if tab is not None:
                    await end_kernel(a, kernel_id, tab)
                b.stop()
                b.extra = saved_b
                if a.extra != saved_a:
                    a.stop()
                    a.extra = saved_a
                    await call(a.start, a_peers(b))
    finally:
        b.start({"a": a.peer_entry()})


async def test_a_peer_with_a_wrong_credential_is_refused(hosts):
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    await tab.run("kept = 'still here'")
    op = await call(a.operate, kernel_id, "migrate", {"to_host": "c"})
    assert op["status"] == "failed" and op["failed_phase"] == "prepare"
    assert "refused our credential" in op["error"] and "peer_token" in op["error"], op["error"]
    assert (await tab.run("print(kept)")).strip() == "still here"
    # b's peer routes take b's peer token only: not a wrong one, not b's own user token.
    for header in ("gpumigrate-peer wrong", f"token {b.token}"):
        answer = await call(b.api, "POST", "api/gpumigrate/peer/check", {}, expect=403,
                            headers={"Authorization": header})
        assert answer["message"] == "This peer credential is not valid here.", answer
    # An unknown peer, and a bad body, are refused before anything starts.
    await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "nowhere"}, expect=400)
    await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": 3}, expect=400)
    tab.ws.close()
    await call(a.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)


@pytest.mark.parametrize("when", ["stash arriving", "transfer"])
async def test_the_other_host_going_away_mid_transfer_leaves_the_kernel_running_here(hosts, when):
    """b is killed as the stash's files arrive there (they go as the kernel writes them: 'stream'), or in
    the transfer phase (the rest of the images)."""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    # 1.1 GB of touched memory, over c.MigratableProvisioner.host_stash_min: the kernel writes it into its
    # images itself (the host stash) before the dump, and the transfer takes long enough to be cut in the
    # middle. The undo restores the kernel here, then has it read its buffers back.
    await tab.run("blob = bytearray(b'x') * (1050 << 20); blob[12345] = 7; kept = 'still here'")
    seen: list[str] = []

    def arriving() -> bool:
        return any(f.name.startswith("stash-") and f.stat().st_size > 0
                   for folder in [b.root / "state" / "guests" / kernel_id, *guest_images_in_memory(kernel_id)]
                   if folder.is_dir() for f in folder.iterdir())

    def kill_b() -> None:
        op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
        if when == "stash arriving":
            deadline = time.monotonic() + 120
            while not arriving() and time.monotonic() < deadline:
                time.sleep(0.001)
            b.stop(signal.SIGKILL)
        while op["status"] not in ("succeeded", "failed"):
            seen.append(op["phase"] or "")
            if op["phase"] == "transfer" and b.proc.poll() is None:
                b.stop(signal.SIGKILL)
            op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
        seen.append(json.dumps(op))

    await call(kill_b)
    op = json.loads(seen[-1])
    assert b.proc.poll() is not None, f"b was never killed; phases seen: {seen}"
    # b's going is seen before CRIU's dump if a file on its way failed by then (the stash's parts go as they
    # are written): the kernel never stopped
    assert op["status"] == "failed" and op["failed_phase"] in ("dump", "transfer", "restore"), op
    assert "cannot be reached" in op["error"] or "b:" in op["error"] or "b did not answer" in op["error"], op["error"]
    assert "stash" in op["timings"] and "stream" in op["timings"], op
    view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["host"] == "a" and view["state"] == "running" and not view["remote"]
    assert (await tab.run("print(kept, blob[12345], len(blob) >> 20, blob.count(b'x'))")).strip() == \
        f"still here 7 1050 {(1050 << 20) - 1}"
    assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*[!s]/{kernel_id}")), "a kept images in memory"
    tab.ws.close()
    await call(a.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)
    # What b received before it was killed is litter (a resumed its own copy): b's next server removes it,
    # from memory too, where it would hold the host's memory until a reboot.
    await call(b.start, {"a": a.peer_entry()})
    deadline = time.monotonic() + 30
    while list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}")) or \
            (b.root / "state" / "guests" / kernel_id).exists():
        assert time.monotonic() < deadline, "b's next server kept the images its predecessor received"
        await asyncio.sleep(0.1)


def finished(host: Host, op: dict, within: float = 300.0) -> dict:
    """Operation ``op`` of ``host``, once it succeeded or failed (within ``within`` seconds, or the test fails
    with where it stands and the server's log)."""
    deadline = time.monotonic() + within
    while op["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"{op.get('action')} still {op['status']} in {op.get('phase')} after " \
            f"{within:.0f} s\n{host.server_log()}"
        op = host.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return op


def pages_on(b: Host, kernel_id: str, any_size: bool = False) -> bool:
    """Whether b holds pages of the kernel's (received as its dump writes them): a file not empty, or any."""
    return any(any_size or f.stat().st_size > 0
               for folder in [b.root / "state" / "guests" / kernel_id, *guest_images_in_memory(kernel_id)]
               if folder.is_dir() for f in folder.glob("pages-*.img"))


def kill_once_pages_arrive(a: Host, kernel_id: str, to_host: str, dumper: Host, arrived: Callable[[], bool],
                           victim: int | None = None) -> tuple[bool, dict]:
    """Move the kernel to ``to_host`` (through a's server), and SIGKILL ``dumper``'s CRIU dump (or, once that
    runs, ``victim``: a PID, or a process group as -PGID) once ``arrived()`` says pages of the dump reached
    the other side. Whether it was killed (not if the dump was over before), and the operation once it ended,
    which it must within 30 s of the kill."""
    from test_hibernation import criu_of

    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": to_host})
    criu = criu_of(dumper.proc.pid, b"dump", 60)
    pid = criu if victim is None or criu is None else victim
    killed = False
    deadline = time.monotonic() + 60
    while pid is not None and not arrived() and time.monotonic() < deadline:
        time.sleep(0.001)
    if pid is not None and arrived():
        try:
            os.kill(pid, signal.SIGKILL)
            killed = True
        except ProcessLookupError:
            pass
    began = time.monotonic()
    op = finished(a, op)
    took = time.monotonic() - began
    assert took < 30, f"the operation ended {took:.1f} s after the kill"
    return killed, op


async def test_criu_killed_while_its_pages_stream_to_the_other_host_leaves_the_kernel_running_here(hosts):
    """CRIU's pages go to b as the dump writes them (phase 'stream'). CRIU is SIGKILLed once b holds some of
    them: the dump fails, the file on its way is called off, b deletes what it got, and the kernel runs on
    here, the same process, with its state."""

    a, b = hosts
    kernel_id, tab, pid = await kernel_with_bytes(a)
    try:

        for _ in range(3):
            killed, op = await call(kill_once_pages_arrive, a, kernel_id, "b", a,
                                    lambda: pages_on(b, kernel_id))
            if killed and op["status"] == "failed":
                break
            assert op["status"] == "succeeded", op  # the dump won the race: home, and again
            assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
            pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        else:
            pytest.skip("CRIU dumped the kernel before its pages reached b, three times")
        assert op["failed_phase"] == "dump" and "SIGKILL" in op["error"], op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and view["state"] == "running" and view["pid"] == pid, view
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 409600000"
        deadline = time.monotonic() + 30
        while (b.root / "state" / "guests" / kernel_id).exists() or guest_images_in_memory(kernel_id):
            assert time.monotonic() < deadline, "b kept the pages it got"
            await asyncio.sleep(0.1)
        # And the next move goes through.
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before)")).strip() == "True"
    finally:
        await end_kernel(a, kernel_id, tab)


async def answered_after_restart(tab: WebSocketTab, code: str, tries: int = 4, each: float = 15.0) -> str:
    """What the same tab's cell printed, once the kernel Jupyter's restarter started has it: a cell sent while the
    server re-attaches the tab's channels to the new kernel can be lost, and is sent again (a fresh-clone CI run
    once waited 60 s for one)."""
    for attempt in range(tries):
        try:
            return await tab.run(code, timeout=each)
        except (asyncio.TimeoutError, AssertionError) as exc:
            if attempt == tries - 1 or (isinstance(exc, AssertionError) and "no reply" not in str(exc)):
                raise
    raise AssertionError("unreachable")


async def restarted_here(a: Host, kernel_id: str, pid: int) -> None:
    """Wait (30 s at most) until Jupyter's restarter has started the dead kernel (once ``pid``) again, on a."""
    deadline = time.monotonic() + 30
    while True:
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        if view["pid"] not in (None, pid) and view["state"] == "running":
            break
        assert time.monotonic() < deadline, f"the dead kernel was not restarted: {view}"
        await asyncio.sleep(0.2)
    assert view["host"] == "a" and not view["remote"], view


async def test_the_kernel_killed_while_its_pages_stream_to_the_other_host_is_said_dead_and_restarted(hosts):
    """The kernel's own process SIGKILLed (a user's kernel dying) during the dump, once b holds some of its
    pages: CRIU fails on it, and the operation says that the kernel died and its state is lost (it said "The
    kernel runs on, unchanged" before); the file on its way is called off and b keeps nothing; Jupyter's
    restarter starts the kernel again, as after any kernel death, and the same tab talks to the new one."""

    a, b = hosts
    kernel_id, tab, pid = await kernel_with_bytes(a)
    try:
        for _ in range(3):
            killed, op = await call(kill_once_pages_arrive, a, kernel_id, "b", a,
                                    lambda: pages_on(b, kernel_id), pid)
            if killed and op["status"] == "failed":
                break
            # CRIU had all of it before the kill (it kills the tree itself at the end): the move went through
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
            assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before)")).strip() == "True"
            assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
            pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        else:
            pytest.skip("CRIU's dump was over before the kernel's pages reached b, three times")
        assert op["failed_phase"] == "dump", op
        assert f"The kernel's process {pid} ended while CRIU dumped it" in op["error"], op["error"]
        assert "Jupyter restarts it" in op["error"] and "runs on, unchanged" not in op["error"], op["error"]
        # b keeps nothing of it: no images, no guest.
        deadline = time.monotonic() + 30
        while pages_on(b, kernel_id, any_size=True) or (b.root / "state" / "guests" / kernel_id).exists():
            assert time.monotonic() < deadline, "b kept the pages it got"
            await asyncio.sleep(0.1)
        await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", expect=404,
                   headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        # Jupyter's restarter finds the kernel dead and starts it again, here; the same tab reaches the new
        # one, which holds none of the old one's state.
        await restarted_here(a, kernel_id, pid)
        assert "restarting kernel" in a.server_log(), a.server_log()[-3000:]
        assert (await answered_after_restart(tab, "print('blob' in dir(), 6 * 7)")).strip() == "False 42"
        assert not list((a.root / "state").glob(f"images/{kernel_id}*"))
        assert not list(a.memory_root.glob(f"{kernel_id}*"))
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_the_kernel_killed_while_its_stash_streams_to_the_other_host_is_said_dead_and_restarted(hosts):
    """The kernel's process SIGKILLed while its own threads write its stash and the parts already go to b as
    they are written (phase 'stream' before 'stash'): the stash's call sees the kernel gone at once, the
    operation says that it died and that Jupyter restarts it, the parts on their way are called off, b keeps
    nothing, a keeps no images; the restarter starts a new kernel that the same tab reaches."""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        # over c.MigratableProvisioner.host_stash_min (1 GB): written by the kernel's 16 threads
        await tab.run("blob = bytearray(b'x') * (1100 << 20)")
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]

        def stash_part_on_b() -> bool:
            return any(f.name.startswith("stash-") and f.stat().st_size > 0
                       for folder in [b.root / "state" / "guests" / kernel_id, *guest_images_in_memory(kernel_id)]
                       if folder.is_dir() for f in folder.iterdir())

        def kill_as_the_stash_arrives() -> tuple[str, dict]:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            deadline = time.monotonic() + 60
            while not stash_part_on_b():
                assert time.monotonic() < deadline, "no part of the stash reached b"
                time.sleep(0.001)
            phase = a.api("GET", f"api/gpumigrate/operations/{op['id']}")["phase"]
            os.kill(pid, signal.SIGKILL)
            return phase, finished(a, op)

        phase, op = await call(kill_as_the_stash_arrives)
        assert phase in ("stream", "stash"), f"the stash's parts reached b only in {phase}"
        assert op["status"] == "failed", op
        if op["failed_phase"] == "stash":  # the usual case: the stash was still being written
            assert f"The kernel's process {pid} ended while it wrote its large buffers" in op["error"], op["error"]
        else:  # it had just finished: CRIU's dump finds the kernel gone
            assert op["failed_phase"] in ("lock", "checkpoint", "dump"), op
        assert "Jupyter restarts it" in op["error"] and "runs on, unchanged" not in op["error"], op["error"]
        deadline = time.monotonic() + 30
        while stash_part_on_b() or (b.root / "state" / "guests" / kernel_id).exists() or \
                guest_images_in_memory(kernel_id):
            assert time.monotonic() < deadline, "b kept the parts it got"
            await asyncio.sleep(0.1)
        await restarted_here(a, kernel_id, pid)
        assert (await answered_after_restart(tab, "print('blob' in dir(), 6 * 7)")).strip() == "False 42"
        assert not list((a.root / "state").glob(f"images/{kernel_id}*"))
        assert not list(Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}"))
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_a_dump_that_fails_on_the_other_host_leaves_the_kernel_answering_there(hosts):
    """The kernel opens an io_uring instance on b, which CRIU cannot dump: its way home fails in b's dump,
    and the same tab goes on with it there. b closed the relay for the dump; a dialled again, and b's new end
    had no IOPub subscription until a subscribed it to all (the tab waited for output for ever before)."""
    from helpers import OPEN_IO_URING

    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run("x = 41")
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        await tab.run(OPEN_IO_URING)
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
        assert op["status"] == "failed" and op["failed_phase"] == "dump" and "runs on" in op["error"], op
        assert (await tab.run("print(x + 1)")).strip() == "42"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        await tab.run("os.close(ring)")
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
        assert (await tab.run("print(x + 1)")).strip() == "42"
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_criu_killed_on_the_other_host_while_its_pages_stream_home_leaves_the_kernel_running_there(hosts):
    """Coming home, b's pages come to a as b's dump writes them (phase 'stream'). CRIU is SIGKILLed on b once
    a holds some of them: b's dump fails, the kernel runs on there, the same process with its state, and
    answers the same tab through the relay (which b closed for the dump: a dialled again, and subscribed b's
    new end to all of the kernel's IOPub); a keeps nothing of what came, and the next move home works."""

    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run("import hashlib\nblob = bytes(range(256)) * 1_600_000\n"
                      "before = hashlib.sha256(blob).hexdigest()")
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"

        for _ in range(3):
            guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                    headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
            killed, op = await call(kill_once_pages_arrive, a, kernel_id, "a", b,
                                    lambda: pages_home(a, kernel_id))
            if killed and op["status"] == "failed":
                break
            assert op["status"] == "succeeded", op  # b's dump won the race: away again, and again
            assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        else:
            pytest.skip("b's dump ended before its pages reached a, three times")
        assert op["failed_phase"] == "dump" and "stream" in op["timings"], op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
        there = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert there["pid"] == guest_pid and there["state"] == "running", there
        try:
            out = await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")
        except BaseException:
            print("A LOG", a.server_log()[-6000:])
            print("B LOG", b.server_log()[-6000:])
            raise
        assert out.strip() == "True 409600000"
        assert not list(a.images_glob(f"**/{kernel_id}/pages-*.img"))
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before)")).strip() == "True"
    finally:
        await end_kernel(a, kernel_id, tab)


async def stashed_kernel(a: Host) -> tuple[str, WebSocketTab]:
    """A kernel on ``a`` holding ``blob``, 1050 MiB of random bytes, over host_stash_min: the stash takes it
    (``before``: its digest, ``ident``: its id)."""
    kernel_id, tab = await new_kernel(a)
    await tab.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 1050\n"
                  "before, ident = hashlib.sha256(blob).hexdigest(), id(blob)")
    return kernel_id, tab


async def kill_on_b_as_the_stash_comes_home(a: Host, b: Host, kernel_id: str,
                                            victim: Callable[[int], int] | None = None) -> tuple[int, dict]:
    """Move the stashed kernel to b, then home, killing b's CRIU (or ``victim(the kernel's PID on b)``: a PID, or a
    process group as -PGID) once a holds some of the stash's
    parts (phase 'fetch stash', stream_dump off); again, up to three times, where b's dump won the race (the
    kernel then came home). The kernel's PID on b, and the failed operation; a skip if b always won."""
    def stash_home() -> bool:
        return any(f.stat().st_size > 0 for f in a.images_glob(f"**/{kernel_id}/stash-*.bin"))

    for _ in range(3):
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
        killed, op = await call(kill_once_pages_arrive, a, kernel_id, "a", b, stash_home,
                                victim(guest_pid) if victim is not None else None)
        if killed and op["status"] == "failed":
            assert op["failed_phase"] == "dump" and "fetch stash" in op["timings"], op
            return guest_pid, op
        assert op["status"] == "succeeded", op  # b's dump won the race: away again, and again
        if killed and b.proc.poll() is not None:
            await call(b.start, {"a": a.peer_entry()})
    pytest.skip("b's dump ended before its stash reached a, three times")


async def test_criu_killed_on_the_other_host_while_its_stash_comes_home_leaves_the_kernel_running_there(hosts):
    """stream_dump off: coming home, b's stash's parts come to a once b's stash wrote them all,
    while b's CRIU dumps (phase 'fetch stash'). CRIU is SIGKILLed on b once a holds some of a part: b's dump
    fails, b has the kernel read its buffers back, and it runs on there, the same process with every byte;
    a's fetches are called off and a keeps nothing; the next move home brings it whole."""
    a, b = hosts
    await with_stream_dump(a, b, "off")
    kernel_id, tab = await stashed_kernel(a)
    try:
        check = "print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident)"
        guest_pid, op = await kill_on_b_as_the_stash_comes_home(a, b, kernel_id)
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
        there = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert there["pid"] == guest_pid and there["state"] == "running", there
        assert (await tab.run(check)).strip() == "True True"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        deadline = time.monotonic() + 10  # the fetches called off end, and their files with them
        while list(a.images_glob(f"**/{kernel_id}/stash-*")):
            assert time.monotonic() < deadline, list(a.images_glob(f"**/{kernel_id}/stash-*"))
            await asyncio.sleep(0.1)
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
        assert op["status"] == "succeeded" and "fetch stash" in op["timings"], op
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert (await tab.run(check)).strip() == "True True"
    finally:
        await end_kernel(a, kernel_id, tab)
        await with_stream_dump(a, b, "on")


async def test_the_kernel_killed_on_the_other_host_while_its_stash_comes_home_is_said_dead_and_restarted(hosts):
    """stream_dump off: the kernel's process SIGKILLed on b once a holds some of the stash's parts it wrote for its
    way home (phase 'fetch stash'). b's dump fails, and the kernel is gone there with what it held: the operation
    says so, a keeps nothing of the fetch, b keeps nothing; b's end of the relay says the kernel ended there
    (relay.ENDED), and Jupyter restarts it here, which the same tab reaches."""
    a, b = hosts
    await with_stream_dump(a, b, "off")
    kernel_id, tab = await stashed_kernel(a)
    try:
        guest_pid, op = await kill_on_b_as_the_stash_comes_home(a, b, kernel_id, lambda pid: pid)
        # b's driver and CRIU run while a fetches the parts: the kill lands before CRIU took hold of the kernel
        # (nothing dumped) or after
        assert (f"The kernel's process {guest_pid} ended while CRIU dumped it" in op["error"] or
                f"The kernel's process {guest_pid} ended before CRIU began to dump it" in op["error"]), op["error"]
        assert "the kernel is dead, and Jupyter restarts it" in op["error"], op["error"]
        deadline = time.monotonic() + 30
        while list(a.images_glob(f"**/{kernel_id}/stash-*")) or guest_images_in_memory(kernel_id) or \
                (b.root / "state" / "guests" / kernel_id).exists():
            assert time.monotonic() < deadline, "a or b kept the stash"
            await asyncio.sleep(0.1)
        assert (await answered_after_restart(tab, "print('blob' in dir(), 6 * 7)")).strip() == "False 42"
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and not view["remote"] and view["state"] == "running", view
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert "the kernel's process ended on the other host" in a.server_log(), a.server_log()[-3000:]
    finally:
        await end_kernel(a, kernel_id, tab)
        await forgotten(b, kernel_id)
        await with_stream_dump(a, b, "on")


def test_a_guest_whose_pid_another_process_took_does_not_run():
    # What b judges from a guest's process (its relay's end closed as ended, stash_left, its state in describe,
    # the discard's kill) asks Guest.runs: a PID that another process took after the kernel's died (here
    # taken on purpose, through ns_last_pid) is not the kernel's.
    proc = start_sleep("60")
    guest = Guest(Manifest(kernel_id="k", kernel_name="python3", pid=proc.pid, ids=[proc.pid]), "a")
    guest.adopt(proc.pid)
    assert guest.runs()
    time.sleep(0.05)  # start times count in clock ticks (10 ms): a kernel lives longer than one
    proc.kill()
    proc.wait()
    assert not guest.runs()
    holder = hold_pid(proc.pid)
    try:
        assert proctree.is_alive(proc.pid)
        assert not guest.runs()
    finally:
        holder.stop()


async def test_a_kernel_that_dies_on_the_other_host_is_said_ended_there_and_restarted_here(hosts):
    """The kernel's process on b SIGKILLed while it runs there (an OOM kill, say): b's end of the relay says so
    within a second or two (relay.ENDED, not a network blip that the relay would wait out), a counts it lost, and
    Jupyter's restarter starts it again here, which the same tab reaches; b keeps nothing of it."""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run("x = 6")
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
        os.kill(guest_pid, signal.SIGKILL)
        assert (await answered_after_restart(tab, "print('x' in dir(), 6 * 7)")).strip() == "False 42"
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and not view["remote"] and view["state"] == "running", view
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert "the kernel's process ended on the other host" in a.server_log(), a.server_log()[-3000:]
        await forgotten(b, kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


def pages_home(a: Host, kernel_id: str) -> bool:
    """Whether a holds pages of the kernel's, fetched as b's dump writes them (a file not empty)."""
    return any(f.stat().st_size > 0 for f in a.images_glob(f"**/{kernel_id}/pages-*.img"))


@contextlib.contextmanager
def collecting(session: int) -> Iterator[None]:
    """Meanwhile, collect the exited processes of a kernel's session that came to this process (a subreaper)
    when their server was killed, as a machine's init would."""
    done = threading.Event()

    def collect() -> None:
        while not done.wait(0.05):
            proctree.reap_orphans({session}, set())

    thread = threading.Thread(target=collect, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


async def until_gone(pid: int, seconds: float) -> None:
    """Wait until process ``pid`` (the kernel's on b, or a transfer's) is gone (collected: see :func:`collecting`)."""
    deadline = time.monotonic() + seconds
    while running_state(pid) != "gone":
        assert time.monotonic() < deadline, f"process {pid} is {running_state(pid)}"
        await asyncio.sleep(0.1)


async def forgotten_with_its_record(b: Host, kernel_id: str) -> None:
    """b holds nothing of the kernel: neither images nor the record of a guest that runs there."""
    await forgotten(b, kernel_id)
    assert not list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json")), "b kept its record"


def running_state(pid: int) -> str:
    """The state letter of process ``pid`` (/proc/{pid}/stat), or "gone"."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def home_again(a: Host, b: Host, kernel_id: str, tab: WebSocketTab, guest_pid: int, check: str,
                     expected: str) -> None:
    """Bring home the kernel that b's next server took back (its orphan's exit collected meanwhile: see
    :func:`collecting`): ``check`` prints ``expected`` here, and b holds no record of it."""
    with collecting(os.getsid(guest_pid)):
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
    assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
    assert (await tab.run(check, timeout=30)).strip() == expected
    assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
    assert not list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json")), "b still holds its record"


async def end_on_both(a: Host, b: Host, kernel_id: str, tab: WebSocketTab, guest_pid: int) -> None:
    """A test whose b's server was killed ends: the kernel's orphan on b goes if left, b's server runs again,
    and the kernel ends, with what b holds of it."""
    if guest_pid and running_state(guest_pid) not in ("gone", "Z"):
        os.kill(guest_pid, signal.SIGKILL)
    if b.proc.poll() is not None:
        await call(b.start, {"a": a.peer_entry()})
    await end_kernel(a, kernel_id, tab)
    await forgotten(b, kernel_id)


async def test_the_other_hosts_server_killed_as_its_pages_stream_home_is_said_and_its_next_takes_the_kernel_back(
        hosts):
    """b's server (and its CRIU with it: the process group, as a service manager stops it) SIGKILLed once a
    holds some of the pages b's dump serves home: the move fails at once, saying b cannot be reached; a keeps
    nothing, and the kernel's process runs on b with its state (CRIU let go of it), not frozen. b's next
    server takes it back (GuestHost.take_back: the record b wrote when it restored the kernel), a's relay
    dials it again within its patience, and the same tab reaches the same process, with its state; then the
    kernel comes home.

    b's server killed, the kernel is an orphan; b's next dump ends it, and its PID must be free for a's restore
    (both hosts share one PID space here). This machine's PID 1 collects no orphan, so this test's process
    stands in for a machine's init, as in test_hibernation.py (collecting)."""

    a, b = hosts
    assert proctree.become_subreaper()
    kernel_id, tab, _ = await kernel_with_bytes(a)
    guest_pid = 0
    try:
        for _ in range(3):
            assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
            guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                    headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
            # b's server's process group: the server, and the CRIU it runs
            killed, op = await call(kill_once_pages_arrive, a, kernel_id, "a", b,
                                    lambda: pages_home(a, kernel_id), -b.proc.pid)
            if killed and op["status"] == "failed":
                break
            assert op["status"] == "succeeded", op  # b's dump was over first: the kernel is home; again
            if killed:
                await call(b.start, {"a": a.peer_entry()})
        else:
            pytest.skip("b's dump was over before its pages reached a, three times")
        assert b.proc.wait(10) == -signal.SIGKILL
        assert op["failed_phase"] == "dump" and "cannot be reached" in op["error"], op
        assert not list(a.images_glob(f"**/{kernel_id}/*.img")), "a kept what it fetched"
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
        # The kernel runs on there, untouched by a dump that never ended: not stopped, not traced.
        assert running_state(guest_pid) in ("S", "R"), running_state(guest_pid)

        await call(b.start, {"a": a.peer_entry()})
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert guest["pid"] == guest_pid and guest["state"] == "running", guest
        out = await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))", timeout=30)
        assert out.strip() == "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        await home_again(a, b, kernel_id, tab, guest_pid, "print(hashlib.sha256(blob).hexdigest() == before, "
                                                          "len(blob))", "True 409600000")
    finally:
        await end_on_both(a, b, kernel_id, tab, guest_pid)  # b's images of its dump go with the kernel's end


async def test_the_other_hosts_server_killed_while_its_stash_comes_home_is_said_and_its_next_gives_the_kernel_its_buffers(
        hosts):
    """stream_dump off: b's server (and its CRIU: the process group) SIGKILLed once a holds some of
    the stash's parts b's kernel wrote for its way home (phase 'fetch stash'). The kernel had freed its buffers
    into those files: the move fails at once, saying b cannot be reached, and a keeps nothing. b's next server
    takes the kernel back and has it read its buffers back from its stash (every byte, the same process, the
    same object); the tab reaches it there; then it comes home whole."""

    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    await with_stream_dump(a, b, "off")
    kernel_id, tab = await stashed_kernel(a)
    guest_pid = 0
    try:
        check = "print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident, len(blob))"
        guest_pid, op = await kill_on_b_as_the_stash_comes_home(a, b, kernel_id, lambda _: -b.proc.pid)
        assert b.proc.wait(10) == -signal.SIGKILL
        assert "cannot be reached" in op["error"], op["error"]
        deadline = time.monotonic() + 10  # the fetches called off end, and their files with them
        while list(a.images_glob(f"**/{kernel_id}/stash-*")):
            assert time.monotonic() < deadline, list(a.images_glob(f"**/{kernel_id}/stash-*"))
            await asyncio.sleep(0.1)
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["remote"], view

        await call(b.start, {"a": a.peer_entry()})
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert guest["pid"] == guest_pid and guest["state"] == "running", guest
        # (the relay holds the cell until b is back and the kernel has read its buffers back: as a's relay found
        # b again, it sent the key; a's server did not restart)
        assert (await tab.run(check, timeout=60)).strip() == f"True True {1050 << 20}"
        assert f"kernel {kernel_id} runs on b without its large buffers" in a.server_log(), a.server_log()[-3000:]
        assert f"kernel {kernel_id}, hosted for a peer, read back its large buffers" in b.server_log()
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert "stash_left" not in guest, guest
        assert not [f for folder in [b.root / "state" / "guests" / kernel_id, *guest_images_in_memory(kernel_id)]
                    if folder.is_dir() for f in folder.glob("stash-*")], "b kept the stash it read back"
        # A late or second read back (a's next server, a dial made again) does nothing: never a resume from images.
        again = await call(b.api, "POST", f"api/gpumigrate/peer/kernels/{kernel_id}/resume",
                           {"key": "", "stash_left": True}, headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert again["pid"] == guest_pid and again["stash"] == {"unstashed": 0}, again
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        await home_again(a, b, kernel_id, tab, guest_pid, check, f"True True {1050 << 20}")
    finally:
        await end_on_both(a, b, kernel_id, tab, guest_pid)
        await with_stream_dump(a, b, "on")


async def test_a_kernel_outlives_the_other_hosts_server_and_a_cell_run_while_it_was_down_runs(hosts):
    """b's server SIGKILLed (its process group, as a service manager stops it) while it hosts a kernel: the
    kernel runs on, an orphan. A cell run in its tab meanwhile is held by a's relay; b's next server takes
    the kernel back (GuestHost.take_back), a's relay dials it again, and the cell runs there, in the same
    process, with its state. Ended from a, the kernel goes on b, with its record."""

    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    kernel_id, tab, _ = await kernel_with_bytes(a)
    guest_pid = 0
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
        records = list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json"))
        assert len(records) == 1 and records[0].stat().st_mode & 0o077 == 0, records
        os.killpg(b.proc.pid, signal.SIGKILL)
        assert b.proc.wait(10) == -signal.SIGKILL
        cell = asyncio.ensure_future(tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))",
                                             timeout=90))
        await asyncio.sleep(1)
        assert not cell.done() and running_state(guest_pid) in ("S", "R")
        await call(b.start, {"a": a.peer_entry()})
        assert (await cell).strip() == "True 409600000"
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert guest["pid"] == guest_pid and guest["state"] == "running", guest
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        assert "taken back: its process" in (b.root / "server.log").read_text()
        with collecting(os.getsid(guest_pid)):
            await end_kernel(a, kernel_id, tab)
            await forgotten(b, kernel_id)
            await until_gone(guest_pid, 10)
        assert not list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json")), "b kept its record"
        guest_pid = 0
    finally:
        if guest_pid and running_state(guest_pid) not in ("gone", "Z"):
            os.kill(guest_pid, signal.SIGKILL)
        if b.proc.poll() is not None:
            await call(b.start, {"a": a.peer_entry()})
        if guest_pid:
            await end_kernel(a, kernel_id, tab)
            await forgotten(b, kernel_id)


def a_peers(b: Host) -> dict:
    """a's peers, as the module's fixture starts it."""
    return {"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)}


async def test_a_kernel_on_the_other_host_outlives_this_hosts_server_killed_or_stopped_and_comes_home(hosts):
    """a's server SIGKILLed while its kernel runs on b: b keeps the kernel, and a's next server, from the
    kernel's record, relays to it again (revive.py): a tab opened then runs cells there, in the same process,
    with its state. Stopped (SIGTERM) under the stop policy 'suspend': the kernel is suspended at b (its
    memory freed there, its images kept there), and the next server has b resume it, and relays to it. Then
    it comes home whole."""

    a, b = hosts
    kernel_id, tab, _ = await kernel_with_bytes(a)
    saved = {section: dict(values) for section, values in a.extra.items()}
    check = "print(hashlib.sha256(blob).hexdigest() == before, len(blob))"
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
        record = json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())
        assert record["remote"]["peer"] == "b" and record["pid"] is None, record
        tab.ws.close()
        os.killpg(a.proc.pid, signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        assert running_state(guest_pid) in ("S", "R")

        a.extra.setdefault("GPUMigrateApp", {})["stop_policy"] = "suspend"
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
        tab = await open_tab(a, kernel_id)
        assert (await tab.run(check)).strip() == "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        assert (await tab.run("%migrate --list")).count(f"{kernel_id[:8]}* on b") == 1
        assert "relayed to again, as its server left it" in a.server_log()

        tab.ws.close()
        await call(a.stop)
        assert f"kernel {kernel_id} suspended at b, for the next server" in a.server_log()
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert guest["state"] == "suspended" and guest["pid"] is None, guest
        await until_gone(guest_pid, 10)
        # b keeps its images in memory (suspend_to 'auto', room here), and its own stop moves them to disk, which
        # outlives a reboot: there they may be the kernel's only copy. b's next server takes them from there.
        assert guest_images_in_memory(kernel_id), "b's kept dump is not in memory"
        await call(b.stop)
        assert not guest_images_in_memory(kernel_id), "b's stop left the dump it keeps in memory"
        assert (b.root / "state" / "guests" / kernel_id / "manifest.json").is_file()
        assert f"kernel {kernel_id}: its images moved from memory to" in b.server_log(), b.server_log()[-3000:]
        await call(b.start, {"a": a.peer_entry()})
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["host"] == "b" and view["remote"], view
        assert "left suspended at b by its server" in a.server_log()
        tab = await open_tab(a, kernel_id)
        assert (await tab.run(check)).strip() == "True 409600000"
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                           headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert guest["state"] == "running" and guest["pid"], guest

        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert (await tab.run(check)).strip() == "True 409600000"
        record = json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())
        assert "remote" not in record and record["pid"], record
        await forgotten(b, kernel_id)
    finally:
        if a.proc.poll() is not None or a.extra != saved:
            a.extra = saved
            a.stop()
            await call(a.start, a_peers(b))
        await end_kernel(a, kernel_id, tab)
        await forgotten(b, kernel_id)


async def test_this_server_killed_while_the_other_host_suspends_its_kernel_for_its_stop_loses_nothing(hosts):
    """a stopped under the stop policy 'suspend' while its kernel runs on b, and SIGKILLed once b's dump of it
    has begun: b's dump goes on (its request's sender gone), and b keeps the kernel suspended. a's record
    still names b, and a's next server has b resume it and relays to it: the same state, there."""
    a, b = hosts
    saved = {section: dict(values) for section, values in a.extra.items()}
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    kernel_id, tab = "", None
    try:
        a.extra.setdefault("GPUMigrateApp", {})["stop_policy"] = "suspend"
        a.stop()
        await call(a.start, a_peers(b))
        kernel_id, tab, _ = await kernel_with_bytes(a)
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        tab.ws.close()

        def stop_a_then_kill_it_as_b_dumps() -> str:
            os.killpg(a.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (there := b.api("GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))["state"] \
                    == "running":
                assert time.monotonic() < deadline and a.proc.poll() is None, there
                time.sleep(0.005)
            os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(10)
            return there["state"]

        assert await call(stop_a_then_kill_it_as_b_dumps) in ("migrating", "suspended")  # "suspended": it was quick
        deadline = time.monotonic() + 60
        while (there := await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))[
                "state"] == "migrating":
            assert time.monotonic() < deadline, there
            await asyncio.sleep(0.1)
        assert there["state"] == "suspended" and there["pid"] is None, there
        assert json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())["remote"]["peer"] == "b"
        mark = (a.root / "server.log").stat().st_size
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
        assert b"left suspended at b by its server" in (a.root / "server.log").read_bytes()[mark:]
        tab = await open_tab(a, kernel_id)
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
    finally:
        a.extra = saved
        a.stop(signal.SIGKILL)  # under 'suspend' a stop would leave the kernel at b: it ends below instead
        await call(a.start, a_peers(b))
        if kernel_id and tab is not None:
            await end_kernel(a, kernel_id, tab)
            await forgotten(b, kernel_id)


async def test_a_notebook_opened_while_its_kernel_on_the_other_host_comes_back_gets_that_kernel(hosts):
    """a stopped under the stop policy 'suspend' with a notebook's kernel on b (b keeps it suspended). As a's
    next server starts, b is slow to answer (its server paused): the notebook asks for a session (as JupyterLab
    does when it finds none) meanwhile. It gets the kernel that comes back, with its state, once b resumed it,
    not a new kernel; the notebook has one session."""
    a, b = hosts
    saved = {section: dict(values) for section, values in a.extra.items()}
    notebook = {"path": "work.ipynb", "name": "work.ipynb", "type": "notebook", "kernel": {"name": "python3"}}
    kernel_id, tab = "", None
    try:
        a.extra.setdefault("GPUMigrateApp", {})["stop_policy"] = "suspend"
        a.stop()
        await call(a.start, a_peers(b))
        kernel_id = (await call(a.api, "POST", "api/sessions", notebook))["kernel"]["id"]
        tab = await open_tab(a, kernel_id)
        await tab.run("import hashlib\nblob = bytes(range(256)) * 400_000\nbefore = hashlib.sha256(blob).hexdigest()")
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        tab.ws.close()
        await call(a.stop)
        assert f"kernel {kernel_id} suspended at b, for the next server" in a.server_log()

        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            await call(a.start, a_peers(b))
            asked = asyncio.ensure_future(call(a.api, "POST", "api/sessions", notebook))
            await asyncio.sleep(3)
            assert not asked.done(), "the session was answered before the kernel came back"
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        session = await asyncio.wait_for(asked, 120)
        assert session["kernel"]["id"] == kernel_id, session
        assert [s["kernel"]["id"] for s in await call(a.api, "GET", "api/sessions")
                if s["path"] == "work.ipynb"] == [kernel_id]
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["state"] == "running", view
        tab = await open_tab(a, kernel_id)
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 102400000"
    finally:
        a.extra = saved
        a.stop(signal.SIGKILL)  # under 'suspend' a stop would leave the kernel at b: it ends below instead
        await call(a.start, a_peers(b))
        if kernel_id:  # once the new server has it back (its sessions come with it): listed at once, it may not be
            await end_kernel(a, kernel_id, tab)
        for session in await call(a.api, "GET", "api/sessions"):
            await call(a.api, "DELETE", f"api/sessions/{session['id']}", expect=204)
        if kernel_id:
            await forgotten(b, kernel_id)


async def test_a_kernel_on_the_other_host_whose_server_went_too_is_refused_then_relayed_then_forgotten(hosts):
    """Both servers SIGKILLed while a's kernel runs on b. a's next server cannot ask b: the kernel's record is
    refused, kept on disk and listed with what to do. Once b's next server has taken its guest back, a's next
    relays to it again, the kernel's state whole. Then, a killed once more, the kernel ends on b: a's next
    server finds that b no longer has it, and forgets it."""

    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    kernel_id, tab, _ = await kernel_with_bytes(a)
    record = a.root / "state" / "kernels" / f"{kernel_id}.json"
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    guest_pid = 0
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))["pid"]
        tab.ws.close()
        with collecting(os.getsid(guest_pid)):
            for host in (a, b):
                os.killpg(host.proc.pid, signal.SIGKILL)
                assert host.proc.wait(10) == -signal.SIGKILL
            await call(a.start, a_peers(b))
            deadline = time.monotonic() + 60
            while not (refused := [r for r in await call(a.api, "GET", "api/gpumigrate/refused")
                                   if r["kernel_id"] == kernel_id]):
                assert time.monotonic() < deadline, a.server_log()
                await asyncio.sleep(0.2)
            assert "runs on peer b, which could not be asked" in refused[0]["reason"], refused
            assert "Restart this server once b answers" in refused[0]["remedy"], refused
            assert record.exists() and running_state(guest_pid) in ("S", "R")

            await call(b.start, {"a": a.peer_entry()})
            a.stop()
            assert record.exists()
            view = await restart_and_find(a, a_peers(b), kernel_id)
            assert view["host"] == "b" and view["remote"], view
            tab = await open_tab(a, kernel_id)
            assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
                "True 409600000"

            tab.ws.close()
            os.killpg(a.proc.pid, signal.SIGKILL)
            assert a.proc.wait(10) == -signal.SIGKILL
            await call(b.api, "DELETE", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
            await until_gone(guest_pid, 30)
        guest_pid = 0
        await call(a.start, a_peers(b))
        deadline = time.monotonic() + 60
        while "b no longer has it" not in a.server_log():
            assert time.monotonic() < deadline, a.server_log()
            await asyncio.sleep(0.2)
        assert not record.exists()
        assert kernel_id not in [k["id"] for k in await call(a.api, "GET", "api/kernels")]
        assert kernel_id not in [r["kernel_id"] for r in await call(a.api, "GET", "api/gpumigrate/refused")]
    finally:
        if guest_pid and running_state(guest_pid) not in ("gone", "Z"):
            os.kill(guest_pid, signal.SIGKILL)
        for host, peers in ((b, {"a": a.peer_entry()}), (a, a_peers(b))):
            if host.proc.poll() is not None:
                await call(host.start, peers)
        await end_kernel(a, kernel_id, tab)
        await forgotten(b, kernel_id)


@pytest.mark.parametrize("coming", ["pages", "stash"])
async def test_this_server_killed_as_the_images_come_home_finds_the_kernel_on_the_other_host_again(hosts, coming):
    """a's server SIGKILLed on the kernel's way home, once files of b's dump have arrived: pages, as b's dump
    writes them (stream_dump on), or the stash's parts, once b's kernel wrote them all (off: phase 'fetch
    stash'; the kernel freed its 1.1 GB of buffers into them). b's dump ends, and b keeps it (its only copy).
    a's next server removes its half-fetched images, finds the kernel dumped on b, has b resume it (with its
    key: it reads its buffers back there), and relays to it: its state whole. It then comes home."""

    a, b = hosts
    if coming == "stash":
        await with_stream_dump(a, b, "off")
        kernel_id, tab = await new_kernel(a)
        await tab.run("import hashlib, os\nblob = bytearray(os.urandom(1 << 20)) * 1050\n"
                      "before = hashlib.sha256(blob).hexdigest()")
        size = 1050 << 20
    else:
        kernel_id, tab, _ = await kernel_with_bytes(a)
        size = 409600000
    check = "print(hashlib.sha256(blob).hexdigest() == before, len(blob))"
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}

    def home() -> bool:
        return any(f.stat().st_size > 0 for f in a.images_glob(
            f"**/{kernel_id}/{'pages-*.img' if coming == 'pages' else 'stash-*.bin'}"))

    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        tab.ws.close()
        await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "a"})
        deadline = time.monotonic() + 60
        while not home():
            assert time.monotonic() < deadline, a.server_log()
            await asyncio.sleep(0.001)
        os.killpg(a.proc.pid, signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["host"] == "b" and view["remote"], view
        assert "left suspended at b by its server" in a.server_log()
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
        assert guest["state"] == "running", guest
        # a's half-fetched files go once the kernel answers through the relay (revive.RELAYED_WAIT, 30 s at
        # most): after the kernel is listed, not with it (CI once looked in between); the server says so once
        # they are gone, a moment after (CI once looked in between those too)
        deadline = time.monotonic() + 45
        removed = f"kernel {kernel_id} runs on its peer: its images here, from before, are removed"
        while home() or removed not in a.server_log(tail=None):
            assert time.monotonic() < deadline, a.server_log()[-3000:]
            await asyncio.sleep(0.2)
        tab = await open_tab(a, kernel_id)
        assert (await tab.run(check)).strip() == f"True {size}"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert (coming == "stash") == ("fetch stash" in op["timings"]), op["timings"]
        assert (await tab.run(check)).strip() == f"True {size}"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        await forgotten(b, kernel_id)
    finally:
        if a.proc.poll() is not None:
            await call(a.start, a_peers(b))
        await end_kernel(a, kernel_id, tab)
        await forgotten(b, kernel_id)
        if coming == "stash":
            await with_stream_dump(a, b, "on")


async def test_a_kernel_ended_at_home_while_the_other_hosts_server_was_down_goes_there_once_it_is_back(hosts):
    """b's server SIGKILLed while it hosts a kernel, which its user then ends on a: a cannot tell b, and
    forgets the kernel. b's next server takes the orphan back, and since no relay claims it within
    c.GPUMigrateApp.guest_unclaimed_expire (here 5 s), discards it: no process, no record, no image stays."""

    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    kernel_id, tab, _ = await kernel_with_bytes(a)
    saved = {section: dict(values) for section, values in b.extra.items()}
    guest_pid = 0
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                                headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
        os.killpg(b.proc.pid, signal.SIGKILL)
        assert b.proc.wait(10) == -signal.SIGKILL
        await end_kernel(a, kernel_id, tab)
        kernels = await call(a.api, "GET", "api/kernels")
        assert kernel_id not in [k["id"] for k in kernels], kernels
        assert running_state(guest_pid) in ("S", "R")
        b.extra.setdefault("GPUMigrateApp", {})["guest_unclaimed_expire"] = 5
        with collecting(os.getsid(guest_pid)):
            await call(b.start, {"a": a.peer_entry()})
            await until_gone(guest_pid, 30)
        guest_pid = 0
        await forgotten_with_its_record(b, kernel_id)
        assert "was not relayed by it within 5 s" in (b.root / "server.log").read_text()
    finally:
        if guest_pid and running_state(guest_pid) not in ("gone", "Z"):
            os.kill(guest_pid, signal.SIGKILL)
        b.extra = saved
        b.stop()
        await call(b.start, {"a": a.peer_entry()})


async def test_a_dump_the_other_host_could_not_be_told_to_delete_goes_once_this_server_starts_again(hosts):
    """b's server SIGKILLed on the kernel's way home once a has fetched its dump: the kernel comes home all
    the same, but b cannot be told to delete the dump, and b's next server keeps it (for all b knows, the
    kernel's only copy). a's record of the kernel names that copy (``copy_left``); a's next server adopts the
    kernel, still running here, and has b discard the dump; the record then names nothing there."""
    a, b = hosts
    kernel_id, tab, _ = await kernel_with_bytes(a)
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    record_path = a.root / "state" / "kernels" / f"{kernel_id}.json"
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"

        def kill_b_once_the_dump_is_here() -> dict:
            op = move_until_phase(a, kernel_id, "a", "restore")
            os.killpg(b.proc.pid, signal.SIGKILL)
            b.proc.wait(10)
            return followed_to_its_end(a, op)

        op = await call(kill_b_once_the_dump_is_here)
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert "could not delete its images there" in a.server_log()
        assert json.loads(record_path.read_text())["copy_left"] == {"peer": "b"}
        await call(b.start, {"a": a.peer_entry()})
        there = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
        assert there["state"] == "suspended", there
        tab.ws.close()
        a.stop(signal.SIGKILL)
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["state"] == "running" and view["host"] == "a", view
        await forgotten(b, kernel_id)
        deadline = time.monotonic() + 30
        while "copy_left" in json.loads(record_path.read_text()):  # written again once b said it is deleted
            assert time.monotonic() < deadline, a.server_log()
            await asyncio.sleep(0.1)
        tab = await open_tab(a, kernel_id)
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
    finally:
        if b.proc.poll() is not None:
            await call(b.start, {"a": a.peer_entry()})
        if a.proc.poll() is not None:
            await call(a.start, a_peers(b))
        await end_kernel(a, kernel_id, tab)


def processes_of(kernel_id: str) -> list[int]:
    """The processes that run the kernel, on either host (both share this machine's PIDs): its id is in their
    environment."""
    mark = f"{ENV_KERNEL_ID}={kernel_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and proctree.is_alive(int(entry.name)):
            with contextlib.suppress(OSError):
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


async def test_this_server_killed_as_the_kernel_it_brings_home_is_adopted_leaves_one_copy_and_no_dump(hosts):
    """a's server SIGKILLed as the kernel coming home from b is adopted here (its last phase): whichever side
    of the adoption's record the kill falls on, a's next server ends with one copy of the kernel, with its
    state (here, its dump on b deleted; or on b, resumed there from that dump, the copy here stopped)."""
    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    kernel_id, tab, pid = await kernel_with_bytes(a)
    session = os.getsid(pid)
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        tab.ws.close()

        def kill_a_as_it_adopts() -> None:
            move_until_phase(a, kernel_id, "a", "adopt")
            os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(10)

        with collecting(session):  # a copy restored here, stopped, must free its PIDs for b (the same PIDs)
            await call(kill_a_as_it_adopts)
            view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["state"] == "running", view
        if view["host"] == "a":
            await forgotten(b, kernel_id)
        deadline = time.monotonic() + 30
        while len(processes_of(kernel_id)) != 1:
            assert time.monotonic() < deadline, (view, processes_of(kernel_id), a.server_log())
            await asyncio.sleep(0.1)
        tab = await open_tab(a, kernel_id)
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{(a if view['host'] == 'a' else b).ip}/24"
    finally:
        if a.proc.poll() is not None:
            await call(a.start, a_peers(b))
        await end_kernel(a, kernel_id, tab)
        await forgotten(b, kernel_id)


@pytest.mark.parametrize("coming", ["pages", "stash"])
async def test_this_hosts_disk_filling_up_as_images_come_home_is_said_and_the_kernel_runs_on_there(hosts, coming):
    """a keeps its images on a disk (a tmpfs on its images folder here: the kernel's log stays beside, where b
    sees it) that another process fills once some of what b's dump serves home arrived: its pages, as it writes
    them (stream_dump on), or the parts of the stash its kernel wrote (off: phase 'fetch stash'). The way home
    fails, saying so; b resumes the kernel (with its key: it reads its buffers back there), which answers the
    same tab there with its state, and a keeps no image of it (b keeps its own, the kernel's)."""

    from helpers import small_tmpfs

    a, b = hosts
    saved = dict(a.extra)
    peers = {"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)}
    a.stop()  # a's server sees the mount only if it starts after it
    try:
        with small_tmpfs(a.root / "state" / "images", "600m" if coming == "pages" else "1400m") as small:
            a.extra = {"MigratableProvisioner": {"suspend_to": "disk"},
                       "GPUMigrateApp": {"stream_dump": "on" if coming == "pages" else "off"}}
            a.start(peers)
            if coming == "pages":
                kernel_id, tab, _ = await kernel_with_bytes(a)
                check, whole = "print(hashlib.sha256(blob).hexdigest() == before, len(blob))", "True 409600000"
            else:
                kernel_id, tab = await stashed_kernel(a)
                check = "print(hashlib.sha256(blob).hexdigest() == before, id(blob) == ident, len(blob))"
                whole = f"True True {1050 << 20}"
            try:
                away = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
                assert away["status"] == "succeeded", away["error"]

                def pages_here() -> bool:
                    return any(f.stat().st_size > 16 << 20 for f in small.glob(
                        f"{kernel_id}/{'pages-*' if coming == 'pages' else 'stash-*'}"))

                def fill_as_pages_come() -> tuple[bool, dict]:
                    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "a"})
                    deadline = time.monotonic() + 60
                    while not pages_here() and op["status"] in ("pending", "running") and \
                            time.monotonic() < deadline:
                        op = a.api("GET", f"api/gpumigrate/operations/{op['id']}")
                        time.sleep(0.001)
                    filled = pages_here()
                    if filled:
                        fill(small)  # a writes on meanwhile: whichever comes first
                    return filled, finished(a, op)

                filled, op = await call(fill_as_pages_come)
                if not filled:
                    pytest.skip(f"b's dump was over before its {coming} reached a: {op['status']}")
                assert op["status"] == "failed" and op["failed_phase"] in ("dump", "transfer"), op
                assert (coming == "stash") == ("fetch stash" in op["timings"]), op["timings"]
                assert "No space left on device" in op["error"], op["error"]
                view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
                assert view["host"] == "b" and view["remote"] and view["state"] == "running", view
                assert (await tab.run(check)).strip() == whole
                assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
                assert not list(small.glob(f"{kernel_id}/*.img")) and not list(small.glob(f"{kernel_id}/stash-*")), \
                    "a kept what it fetched"
            finally:
                (small / "filler").unlink(missing_ok=True)
                await end_kernel(a, kernel_id, tab)
                a.stop()
                a.extra = saved
    finally:  # a runs again, without the small disk, whatever happened
        a.stop()
        a.extra = saved
        a.start(peers)


async def test_this_hosts_record_that_cannot_be_written_before_the_restore_there_undoes_the_move(hosts):
    """a's kernels' records on a full disk (a 1 MB tmpfs on their folder here, filled once the kernel runs): a
    cannot write down, before b restores the kernel, that it goes there (a server dying after would resume a
    second copy here). So the move is undone, saying why: the kernel answers the same tab here with its state, b
    holds nothing of it. With room again, it moves."""
    from helpers import small_tmpfs

    a, b = hosts
    peers = {"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)}
    a.stop()  # a's server sees the mount only if it starts after it
    try:
        with small_tmpfs(a.root / "state" / "kernels", "1m") as small:
            a.start(peers)
            kernel_id, tab, _ = await kernel_with_bytes(a)
            try:
                fill(small)
                op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
                assert op["status"] == "failed" and op["failed_phase"] == "restore", op
                assert "No space left on device" in op["error"], op["error"]
                view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
                assert view["host"] == "a" and not view["remote"] and view["state"] == "running", view
                same = await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")
                assert same.strip() == "True 409600000"
                assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
                await forgotten(b, kernel_id)
                assert not list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json"))

                (small / "filler").unlink()
                op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
                assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
                assert json.loads((small / f"{kernel_id}.json").read_text())["remote"]["peer"] == "b"
                assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
            finally:
                (small / "filler").unlink(missing_ok=True)
                await end_kernel(a, kernel_id, tab)
                await forgotten(b, kernel_id)
                a.stop()
    finally:  # a runs again, without the small disk, whatever happened
        a.stop()
        a.start(peers)


async def test_a_relay_whose_other_end_is_gone_gives_up_after_its_patience_without_hammering_it(hosts):
    """The kernel on b is discarded there behind a's back: b answers each of a's dials with 4004 (no such
    guest) as soon as it opens. a dials again a second apart, within one patience (30 s), then counts the
    kernel as lost, and stops. (It dialled in a tight loop for ever before: each open counted as success.)"""
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
        before = a.server_log(tail=None).count("relay: reconnected")
        await call(b.api, "DELETE", f"api/gpumigrate/peer/kernels/{kernel_id}", expect=204,
                   headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        await asyncio.sleep(40)  # past the patience
        dials = a.server_log(tail=None).count("relay: reconnected") - before
        assert 1 <= dials <= 40, f"{dials} dials in 40 s"
        await asyncio.sleep(3)
        assert a.server_log(tail=None).count("relay: reconnected") - before == dials, "it gave up"
    finally:
        await end_kernel(a, kernel_id, tab)


async def forgotten(b: Host, kernel_id: str) -> None:
    """Wait until b holds nothing of ``kernel_id``'s images (it deletes them once it waited for a restore)."""
    deadline = time.monotonic() + 60
    while guest_images_in_memory(kernel_id) or (b.root / "state" / "guests" / kernel_id).exists():
        assert time.monotonic() < deadline, b.server_log()
        await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def a_killable_b_forgetting(a: Host, b: Host, unclaimed: float | None = None
                                  ) -> AsyncIterator[tuple[dict, list]]:
    """For tests that SIGKILL a's server mid-move: b deletes what it received once it waited
    c.GPUMigrateApp.guest_images_expire (20 s here) for a restore (and, given ``unclaimed``, a kernel it restored
    once it waited that long for a relay). Yields a's peers (to start it again) and a list for the test's
    (kernel id, tab); at the end a runs again if it was killed, those kernels end, and b is as it was."""
    peers = {"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)}
    saved = dict(b.extra)
    b.stop()
    b.extra = {**saved, "GPUMigrateApp": {"guest_images_expire": 20,
                                          **({"guest_unclaimed_expire": unclaimed} if unclaimed else {})}}
    b.start({"a": a.peer_entry()})
    kernels: list[tuple[str, WebSocketTab]] = []
    try:
        yield peers, kernels
    finally:
        if a.proc is None or a.proc.poll() is not None:
            await call(a.start, peers)
        for kernel_id, tab in kernels:
            await end_kernel(a, kernel_id, tab)
        b.stop()
        b.extra = saved
        b.start({"a": a.peer_entry()})


async def test_this_server_killed_while_the_pages_stream_to_the_other_host_loses_nothing(hosts):
    """a's server SIGKILLed during the dump, once b holds some of the kernel's pages: CRIU dies with it and
    gives the kernel back, which runs on; the next server on a adopts it, the same process with its state;
    b deletes the half file it got at once (its sender went away mid-file) and the rest once it waited
    c.GPUMigrateApp.guest_images_expire (here 20 s) for a restore that never comes."""
    from test_hibernation import criu_of

    a, b = hosts
    async with a_killable_b_forgetting(a, b) as (peers, kernels):
        kernel_id, tab = await new_kernel(a)
        kernels.append((kernel_id, tab))
        await tab.run("import hashlib\nblob = bytes(range(256)) * 4_000_000\n"
                      "before = hashlib.sha256(blob).hexdigest()")
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]

        def guest() -> list[Path]:
            return [f for folder in [b.root / "state" / "guests" / kernel_id, *guest_images_in_memory(kernel_id)]
                    if folder.is_dir() for f in folder.glob("pages-*.img")]

        def kill_a_once_pages_arrive() -> bool:
            a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            criu = criu_of(a.proc.pid, b"dump", 60)
            deadline = time.monotonic() + 60
            while criu is not None and proctree.is_alive(criu) and time.monotonic() < deadline:
                if any(f.stat().st_size > 0 for f in guest()):
                    a.stop(signal.SIGKILL)
                    return proctree.wait_gone(criu, 10)
                time.sleep(0.001)
            return False

        cut = await call(kill_a_once_pages_arrive)
        tab.ws.close()
        if not cut:  # the dump ended before the pages reached b: nothing to test, and no kernel to lose
            pytest.skip("CRIU's dump ended before any of its pages reached b")
        assert proctree.is_alive(pid), "the kernel runs on: CRIU gave it back"
        deadline = time.monotonic() + 30
        while guest():
            assert time.monotonic() < deadline, "b kept the half pages file"
            await asyncio.sleep(0.1)
        view = await restart_and_find(a, peers, kernel_id)
        assert view["state"] == "running" and view["pid"] == pid and view["host"] == "a", view
        tab = await open_tab(a, kernel_id)
        kernels[:] = [(kernel_id, tab)]
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, len(blob))")).strip() == \
            "True 1024000000"
        await forgotten(b, kernel_id)


async def test_this_server_killed_mid_transfer_of_a_stashed_kernel_loses_nothing(hosts):
    """a's server SIGKILLed while a kernel that stashed its buffers is being sent to b: the kernel is dumped,
    its images (the stash among them) complete on a; the next server on a finds it suspended, and its resume
    has it read its buffers back, every byte. b deletes its half-received copy by itself once it has waited
    c.GPUMigrateApp.guest_images_expire (here 20 s) without a restore."""
    a, b = hosts
    async with a_killable_b_forgetting(a, b) as (peers, kernels):
        kernel_id, tab = await new_kernel(a)
        kernels.append((kernel_id, tab))
        await tab.run("import hashlib\nblob = bytearray(b'y') * (1050 << 20); blob[777] = 3\n"
                      "before = hashlib.sha256(blob).hexdigest()")
        seen: list[str] = []

        def kill_a_during_the_transfer() -> None:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b"})
            while op["phase"] != "transfer":
                assert op["status"] in ("pending", "running"), op
                op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            seen.append(op["phase"])
            deadline = time.monotonic() + 30  # once b has begun to receive
            while not guest_images_in_memory(kernel_id) and not (b.root / "state" / "guests" / kernel_id).exists():
                assert time.monotonic() < deadline, "b never began to receive the images"
                time.sleep(0.01)
            a.stop(signal.SIGKILL)

        await call(kill_a_during_the_transfer)
        assert seen == ["transfer"] and a.proc.poll() is not None
        tab.ws.close()
        view = await restart_and_find(a, peers, kernel_id)
        assert view["state"] == "suspended" and not view["remote"], view
        op = await call(a.operate, kernel_id, "resume")
        assert op["status"] == "succeeded" and "unstash" in op["timings"], op
        tab = await open_tab(a, kernel_id)
        kernels[:] = [(kernel_id, tab)]
        assert (await tab.run("print(hashlib.sha256(blob).hexdigest() == before, blob[777], len(blob) >> 20)")
                ).strip() == "True 3 1050"
        await forgotten(b, kernel_id)
        assert "were never restored here; deleted" in b.server_log()


def images_on_a(a: Host, kernel_id: str) -> list[Path]:
    """a's own images of the kernel (on disk, or in memory), by their manifests."""
    memory = [p for p in Path("/dev/shm").glob(f"jupyter-gpumigrate-*/{kernel_id}/manifest.json")
              if not p.parent.parent.name.endswith("-guests")]
    return [*(a.root / "state").glob(f"**/{kernel_id}/manifest.json"), *memory]


@pytest.mark.parametrize("a_back", ["at once", "after b gave up"])
async def test_this_server_killed_while_the_other_host_restores_the_kernel_leaves_one_copy(hosts, a_back):
    """a's server SIGKILLed while b restores the kernel a moves there: a's record of the kernel names b by
    then. Started again at once, a asks b (again, while b still restores), finds the kernel running there,
    relays to it and removes its own images: a tab reaches the same process there, with its state. Started
    only after b gave up on a relay (its c.GPUMigrateApp.guest_unclaimed_expire, here 5 s: b discards the
    kernel it restored), a finds b without it and takes its own images back: the kernel resumes at home,
    whole. Either way one copy runs, never two."""
    a, b = hosts
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    async with a_killable_b_forgetting(a, b, unclaimed=None if a_back == "at once" else 5) as (peers, kernels):
        kernel_id, tab, _ = await kernel_with_bytes(a)
        kernels.append((kernel_id, tab))
        check = "print(hashlib.sha256(blob).hexdigest() == before, len(blob))"

        def kill_a_as_b_restores() -> str:
            move_until_phase(a, kernel_id, "b", "restore")
            deadline = time.monotonic() + 60
            while True:  # b has begun to restore it
                there = b.api("GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
                if there["state"] != "suspended":
                    break
                assert time.monotonic() < deadline, there
                time.sleep(0.005)
            a.stop(signal.SIGKILL)
            return there["state"]

        seen = await call(kill_a_as_b_restores)
        tab.ws.close()
        if a_back != "at once" and seen != "migrating":  # a may have relayed to it: b then keeps it
            pytest.skip(f"b's restore was over ({seen}) before a could be killed during it")
        record = json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())
        assert record["remote"]["peer"] == "b", record
        assert images_on_a(a, kernel_id), "a keeps its images until the kernel answers from b"
        if a_back == "at once":
            view = await restart_and_find(a, peers, kernel_id)
            assert view["host"] == "b" and view["remote"], view
            there = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
            assert there["state"] == "running", there
            deadline = time.monotonic() + 30  # removed once the kernel answers through the relay
            while images_on_a(a, kernel_id):
                assert time.monotonic() < deadline, a.server_log()
                await asyncio.sleep(0.1)
            where = b.ip
        else:
            deadline = time.monotonic() + 60
            while "within 5 s: its server died during the move" not in b.server_log():
                assert time.monotonic() < deadline, b.server_log()
                await asyncio.sleep(0.2)
            await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer, expect=404)
            view = await restart_and_find(a, peers, kernel_id)
            assert view["state"] == "suspended" and not view["remote"], view
            assert (await call(a.operate, kernel_id, "resume"))["status"] == "succeeded"
            where = a.ip
        tab = await open_tab(a, kernel_id)
        kernels[:] = [(kernel_id, tab)]
        assert (await tab.run(check)).strip() == "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{where}/24"


@pytest.mark.parametrize("when", ["restore starts", "tree half restored"])
async def test_the_other_hosts_server_killed_while_it_restores_the_kernel_leaves_it_running_here(hosts, when):
    """b's server SIGKILLed while its CRIU restores the kernel a moves there (CRIU dies with it): the move fails
    on a, and the kernel runs on here from a's images, its state whole. b's next server leaves nothing of it:
    no process (a tree CRIU had half restored, stuck in CRIU's restorer for ever, is killed), no images. Where
    that tree held the kernel's PIDs (one machine), a's kernel is broken until then, its images whole, and a
    resume brings it back."""
    from test_hibernation import criu_of

    a, b = hosts
    assert proctree.become_subreaper()  # the init of what b's killed server leaves (collecting)
    kernel_id, tab, pid = await kernel_with_bytes(a)
    check = "print(hashlib.sha256(blob).hexdigest() == before, len(blob))"
    try:
        def kill_b_as_it_restores() -> dict:
            op = move_until_phase(a, kernel_id, "b", "restore")
            criu = criu_of(b.proc.pid, b"restore", 30)
            assert criu is not None, "b's CRIU restore was never seen"
            if when == "tree half restored":  # CRIU has made the kernel's process again, and fills its memory
                while not proctree.is_alive(pid):
                    assert proctree.is_alive(criu), "CRIU ended before the kernel's process was seen"
                    time.sleep(0.001)
            b.stop(signal.SIGKILL)
            assert proctree.wait_gone(criu, 10), "CRIU dies with its server"
            return followed_to_its_end(a, op)

        op = await call(kill_b_as_it_restores)
        assert op["status"] == "failed" and op["failed_phase"] == "restore", op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        if view["state"] == "broken":
            # On one machine the two hosts share PIDs, and b's half-restored tree holds the kernel's: a's undo
            # cannot restore it yet, and says how to get it back whole (on two machines it runs on at once).
            assert "is now taken by" in view["broken_reason"] and "resume it once" in view["broken_reason"], view
            await call(b.start, {"a": a.peer_entry()})
            # b takes its guests back (and kills what it finds stuck) in a thread once it answers, not before
            # (app.py: _take_back_guests, from _start_jupyter_server_extension): it says so a moment later
            deadline = time.monotonic() + 60
            while not any(f"kernel {kernel_id}: its process " in line and "is stuck half restored: killed" in line
                          for line in b.server_log(tail=None).splitlines()):
                assert time.monotonic() < deadline, b.server_log()[-3000:]
                await asyncio.sleep(0.2)
            deadline = time.monotonic() + 30
            while running_state(pid) != "gone":  # collected here, as a machine's init would (collecting)
                proctree.reap(pid)
                assert time.monotonic() < deadline, f"the tree b killed is {running_state(pid)}"
                await asyncio.sleep(0.05)
            assert (await call(a.operate, kernel_id, "resume"))["status"] == "succeeded"
            view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
            assert view["broken_reason"] is None, view
        else:
            await call(b.start, {"a": a.peer_entry()})
        assert view["state"] == "running" and not view["remote"], (view, a.server_log()[-3000:])
        tab.ws.close()
        tab = await open_tab(a, kernel_id)
        assert (await tab.run(check)).strip() == "True 409600000"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        await forgotten(b, kernel_id)
        mine = set(proctree.descendants(view["pid"]))
        left = [p for p in processes_of(kernel_id) if p not in mine]
        assert not left, f"processes of the kernel left on b: {left}"
    finally:
        if b.proc.poll() is not None:
            await call(b.start, {"a": a.peer_entry()})
        await end_kernel(a, kernel_id, tab)


async def test_shutting_down_a_kernel_that_runs_on_the_other_host_ends_it_there(hosts):
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    assert (await call(a.operate, kernel_id, "migrate", {"to_host": "b"}))["status"] == "succeeded"
    pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}",
                      headers={"Authorization": f"gpumigrate-peer {b.peer_token}"}))["pid"]
    assert pid and os.path.exists(f"/proc/{pid}")
    # Suspending it there is refused with what to do; it keeps running.
    answer = await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=409)
    assert "bring it back first" in answer["message"]
    tab.ws.close()
    await call(a.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the kernel still runs on b"
        await asyncio.sleep(0.1)
    await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", expect=404,
               headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
    assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)


#: A notebook's state for transplants between the hosts: tensors (one a view), a model and its optimizer, a
#: function and a class of the notebook's own, and a generator, which cannot carry.
OBJECTS = """
import torch
torch.manual_seed(7)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.arange(12.0).reshape(3, 4)
view = data[1:]
def step():
    opt.zero_grad(); loss = model(data).pow(2).sum(); loss.backward(); opt.step(); return round(loss.item(), 5)
class Box:
    def __init__(self, v): self.v = v
box = Box(41)
gen = (i for i in range(10)); next(gen)
print('built', step())
"""
#: What the transplanted kernel must print as the source would (its next step's loss included).
OBJECTS_CHECK = "print(float(view.sum()), view.data_ptr() - data.data_ptr(), box.v + 1, step())"


async def kernel_with_objects(host: Host, more: str = "") -> tuple[str, WebSocketTab]:
    """A kernel on ``host`` holding OBJECTS (and ``more``), for the transplant tests, which need PyTorch."""
    pytest.importorskip("torch", reason="the transplant tests need PyTorch (scripts/setup.sh installs a CPU build)")
    kernel_id, tab = await new_kernel(host)
    assert "built" in await tab.run(OBJECTS + "\n" + more)
    return kernel_id, tab


async def test_a_kernel_transplanted_to_the_other_hosts_cpu_carries_its_objects_comes_home_and_goes_back(hosts):
    a, b = hosts
    kernel_id, tab = await kernel_with_objects(a)
    try:
        expected = (await tab.run("import copy as _c; _m, _o = _c.deepcopy(model.state_dict()), _c.deepcopy(opt.state_dict())\n"
                                  + OBJECTS_CHECK + "\nmodel.load_state_dict(_m); opt.load_state_dict(_o)")).strip()

        # The dry run says where, and what would not carry.
        survey = await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/transplant",
                            {"to_host": "b", "to_cpu": True, "dry_run": True})
        assert survey["to_host"] == "b" and [r["name"] for r in survey["left"]] == ["gen"], survey
        # From the notebook itself: it says what would not carry, then the transplant starts as the cell ends, and
        # the next cell runs in the new process.
        out = await tab.run("%migrate --to-host b --to-cpu --yes")
        assert "NOT carried: gen" in out and "The transplant to the CPU of host b starts as this cell ends" in out, out
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        listed = await call(a.api, "GET", "api/gpumigrate/operations")
        op = next(o for o in listed if o["kernel_id"] == kernel_id and o["action"] == "transplant")
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        assert list(op["timings"]) == ["prepare", "export", "transfer", "load", "dump", "switch"], op["timings"]
        assert op["to_host"] == "b" and op["from_host"] == "a" and op["transplant"]["left"][0]["name"] == "gen", op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["remote"] and view["state"] == "running", view

        # The same tab: the kernel is a new process in b's namespace, with the objects that carried.
        assert (await tab.run(OBJECTS_CHECK)).strip() == expected
        assert (await tab.run("print('gen' in dir())")).strip() == "False"
        # b hosts it for a peer only: not among b's own kernels. What the new process was given there (the key, the
        # source's environment) is gone now that it runs.
        assert kernel_id not in [k["id"] for k in await call(b.api, "GET", "api/kernels")]
        folders = [*guest_images_in_memory(kernel_id), b.root / "state" / "guests" / kernel_id]
        assert not [f for folder in folders for f in ("connection.json", "prelude.json") if (folder / f).exists()]

        # Home, by a move of that process (CRIU, from b), with what it did on b. (Back from b is refused, saying
        # how: the kept process is a's.)
        refused = await call(a.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/back", {}, expect=409)
        assert "runs on b: bring it back" in refused["message"], refused
        assert (await call(a.operate, kernel_id, "migrate", {"to_host": "a"}))["status"] == "succeeded"
        assert (await tab.run(WHERE)).strip() == f"{a.ip}/24"
        assert (await tab.run("print(box.v)")).strip() == "41"
        # Then back to the process the transplant replaced, as it was: the generator is there again.
        assert (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["back_until"]
        op = await call(a.operate, kernel_id, "back")
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        assert (await tab.run("print(next(gen))")).strip() == "1"
        assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


async def test_a_kernel_transplanted_to_the_other_host_outlives_that_hosts_server(hosts):
    """The new process of a transplant to b is the kernel there: b writes it down once it runs, as it does a
    kernel it restored, and its server SIGKILLed, the next takes it back; a's relay dials it again, and a cell
    run meanwhile runs there, with the objects that carried. Ended from a, it goes, with its record."""

    a, b = hosts
    assert proctree.become_subreaper()  # this machine's PID 1 collects no orphan (collecting)
    kernel_id, tab = await new_kernel(a)
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    guest_pid = 0
    try:
        await tab.run("x = 41\nnotes = {'kept': [1, 2, 3]}")
        op = await call(a.operate, kernel_id, "transplant", {"to_host": "b", "to_cpu": True})
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        guest_pid = (await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))["pid"]
        records = list((b.root / "state").glob(f"**/guests-running/{kernel_id}.json"))
        assert len(records) == 1 and json.loads(records[0].read_text())["pid"] == guest_pid, records
        os.killpg(b.proc.pid, signal.SIGKILL)
        assert b.proc.wait(10) == -signal.SIGKILL
        cell = asyncio.ensure_future(tab.run("print(x + 1, notes['kept'])", timeout=90))
        await asyncio.sleep(1)
        assert not cell.done() and running_state(guest_pid) in ("S", "R")
        await call(b.start, {"a": a.peer_entry()})
        assert (await cell).strip() == "42 [1, 2, 3]"
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        guest = await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
        assert guest["pid"] == guest_pid and guest["state"] == "running", guest
        with collecting(os.getsid(guest_pid)):
            await end_kernel(a, kernel_id, tab)
            await until_gone(guest_pid, 10)
        guest_pid = 0
        await forgotten_with_its_record(b, kernel_id)
    finally:
        await end_on_both(a, b, kernel_id, tab, guest_pid)


async def test_a_transplant_to_the_other_host_that_fails_there_leaves_the_source_running_here(hosts):
    a, b = hosts
    kernel_id, tab = await kernel_with_objects(a)
    try:
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]

        # Refused before anything is touched: a GPU that b does not have.
        op = await call(a.operate, kernel_id, "transplant", {"to_host": "b", "to_gpu": 7})
        assert op["status"] == "failed" and op["failed_phase"] == "prepare" and "b cannot take" in op["error"], op

        # The new process on b killed as the source is saved: the source comes back from its images, whole.
        seen: list[str] = []

        def kill_the_new_process_at_the_dump() -> None:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_host": "b", "to_cpu": True})
            while op["status"] not in ("succeeded", "failed"):
                if op["phase"] in ("dump", "switch"):
                    for new in transplant_processes():
                        os.kill(new, signal.SIGKILL)
                op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            seen.append(json.dumps(op))

        await call(kill_the_new_process_at_the_dump)
        op = json.loads(seen[-1])
        assert op["status"] == "failed" and op["failed_phase"] == "switch" and "new kernel process" in op["error"], op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and view["state"] == "running" and not view["remote"] and view["pid"] == pid, view
        assert (await tab.run("print(box.v, next(gen))")).strip() == "41 1"
        assert not transplant_processes()
        await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", expect=404,
                   headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert not (b.root / "state" / "guests" / kernel_id).exists() and not guest_images_in_memory(kernel_id)
    finally:
        await end_kernel(a, kernel_id, tab)


#: A GPU kernel's tensors for the moves between the hosts: 1.07 GB (over host_stash_min, so the stash takes it)
#: and a small one (the CUDA driver's checkpoint carries it); and the cell that checks them.
GPU_TENSORS = ("import torch; t = torch.arange(1 << 28, device='cuda', dtype=torch.float32)\n"
               "s0 = float(t.sum()); small = torch.full((1000,), 3.0, device='cuda')")
GPU_SAME = ("print(torch.equal(t, torch.arange(1 << 28, device='cuda', dtype=torch.float32)), t.device, "
            "float(small.sum()), float((t * 2).sum()) == 2 * s0)")


@pytest.mark.gpu
async def test_a_gpu_kernel_moves_to_the_other_hosts_gpu_and_back(hosts):
    # The two hosts share the machine's GPUs: a's kernel on GPU 0 goes to b's GPU 1 and comes back. Its 1.07 GB
    # tensor (over host_stash_min) is written and read back by the kernel's own threads each way; the small one
    # goes with the CUDA driver's checkpoint.
    two_gpus()
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(GPU_TENSORS)
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert [g["index"] for g in view["gpus"]] == [0], view
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b", "to_gpu": 1})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert ["stream", "stash", "prefetch there", "lock", "checkpoint", "dump", "transfer", "restore"] == \
            list(op["timings"])[1:9], op
        assert op["stash"]["stashed"] >= 4 << 28 and op["stash"]["unstashed"] == op["stash"]["stashed"], op
        assert op["to_gpu"] == 1
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and [g["index"] for g in view["gpus"]] == [1], view
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a", "to_gpu": 0})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert {"remap", "unlock", "unstash"} <= set(op["timings"]) and op["to_gpu"] == 0, op
        assert op["stash"]["stashed"] >= 4 << 28 and op["stash"]["unstashed"] == op["stash"]["stashed"], op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and [g["index"] for g in view["gpus"]] == [0], view
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
    finally:
        await end_kernel(a, kernel_id, tab)


@pytest.mark.gpu
async def test_a_gpu_kernel_moved_to_the_other_host_and_home_copies_its_tensors_from_a_prefetch_each_way(hosts):
    # One GPU is enough: both hosts restore onto GPU 0 (a's kernel has left it by then). Going away, b's stash
    # helper reads the 1 GiB tensor's file onto b's GPU as it arrives (asked in "prefetch there", once the
    # stash is written, before the dump); coming home, a's does (its "prefetch", once b's dump is over, before
    # the transfer); each time the restored kernel copies it from there (having mapped it while the helper read).
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(GPU_TENSORS)
        for to_host, where in (("b", f"{b.ip}/24"), ("a", None)):
            op = await call(a.operate, kernel_id, "migrate", {"to_host": to_host, "to_gpu": 0})
            assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
            stash = op["stash"]
            assert stash["stashed"] >= 1 << 30 and stash["unstashed"] == stash["stashed"], op
            fetched = stash["prefetch"]
            assert fetched["bytes"] >= 1 << 30 and "reason" not in fetched and "mapped_late" not in fetched, op
            phases = list(op["timings"])
            if to_host == "a":  # the home's own phase, once b's dump is over, before the transfer
                assert phases.index("dump") < phases.index("prefetch") < phases.index("transfer"), phases
            else:  # b's, begun once the stash was written
                assert phases.index("stash") < phases.index("prefetch there") < phases.index("dump"), phases
            assert fetched.get("followed") is True, op  # begun as the files arrived, each way
            view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
            assert view["host"] == to_host and [g["index"] for g in view["gpus"]] == [0], view
            if where:
                assert (await tab.run(WHERE)).strip() == where
            assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
    finally:
        await end_kernel(a, kernel_id, tab)


def criu_pids(verb: str) -> list[int]:
    """The CRIU processes that run ``verb`` (dump, restore) on this machine now (not one that ended, unreaped)."""
    found = []
    for comm in Path("/proc").glob("[0-9]*/comm"):
        with contextlib.suppress(OSError, IndexError):
            if comm.read_text(errors="replace").strip() != "criu":
                continue
            if (comm.parent / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            if verb.encode() in (comm.parent / "cmdline").read_bytes().split(b"\0"):
                found.append(int(comm.parent.name))
    return found


def _kill(pid: int) -> bool:
    """SIGKILL ``pid``; whether it was there to kill."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def kill_criu_in(host: Host, op: dict, phase: str, before: tuple[str, ...] = (), verb: str = "dump") -> dict:
    """Follow ``host``'s operation ``op``; from ``phase`` or one of ``before`` (phases just before it in which no
    CRIU runs: a phase of a fraction of a second can be over before its report is read), SIGKILL the first CRIU
    that runs ``verb`` (the only one on the machine then), looked for without a pause (a small kernel's restore takes
    a fraction of a second): the operation, once over, with ``killed`` (in ``phase``, as it should be) and
    ``seen`` (the phases seen)."""
    seen: list[str] = []
    deadline = time.monotonic() + 300
    while op["status"] in ("pending", "running"):
        assert time.monotonic() < deadline, f"still {op['status']} in {op['phase']} after 300 s, phases seen " \
            f"{seen[-5:]}\n{host.server_log()}"
        seen.append(op["phase"])
        if op["phase"] in (phase, *before) or any(p in seen for p in before):
            asked = time.monotonic()
            while time.monotonic() - asked < 0.25:
                if [pid for pid in criu_pids(verb) if _kill(pid)]:
                    op = finished(host, op)
                    return {**op, "killed": op.get("failed_phase") == phase, "seen": seen}
                time.sleep(0.001)
            op = host.api("GET", f"api/gpumigrate/operations/{op['id']}")  # still running? no wait
            continue
        op = host.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return {**op, "killed": False, "seen": seen}


def gpu_processes(index: int) -> dict[int, int]:
    """The processes that hold memory on GPU ``index`` (PID -> bytes), as NVML says."""
    from jupyter_gpumigrate.engine import gpus as gpus_mod

    return next(g.processes for g in gpus_mod.snapshot() if g.index == index)


async def until_gpu_free(index: int, suspect: str, within: float = 30.0) -> None:
    """Wait until no process holds memory on GPU ``index``; fail, naming the holders (``suspect``?), after ``within`` s."""
    deadline = time.monotonic() + within
    while held := gpu_processes(index):
        assert time.monotonic() < deadline, f"GPU {index} is still held by {held} ({suspect}?)"
        await asyncio.sleep(0.2)


@pytest.mark.gpu
@pytest.mark.parametrize("victim", ["b's server", "a's CRIU"])
async def test_a_prefetch_begun_on_the_other_host_ends_with_a_failed_move_and_the_kernel_stays_whole(hosts, victim):
    """b's prefetch begins as the stash arrives ("prefetch there"): its helper holds a copy of the kernel's
    tensors on b's GPU 1. The move then fails: b's server SIGKILLed alone (its helper, orphaned, ends by itself:
    it sees its server gone, or its stdin end), or a's CRIU SIGKILLed in the dump (a's undo has b discard the
    images, and the helper with them). Either way the kernel runs on at home on GPU 0 with every value, and
    nothing holds b's GPU 1 afterwards."""
    two_gpus()
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(GPU_TENSORS)
        assert not gpu_processes(1), "GPU 1 is free before the move"

        def fail_the_move_after_the_prefetch() -> dict:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate", {"to_host": "b", "to_gpu": 1})
            if victim == "a's CRIU":
                op = kill_criu_in(a, op, "dump")
                assert op["killed"], (op["seen"], op["status"], op.get("failed_phase"), op.get("error"))
                return op
            while op["status"] in ("pending", "running"):
                if op["phase"] in ("lock", "checkpoint", "dump", "transfer"):
                    os.kill(b.proc.pid, signal.SIGKILL)  # the server alone: its helper lives on, orphaned
                    return finished(a, op)
                op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            return op

        op = await call(fail_the_move_after_the_prefetch)
        assert op["status"] == "failed", op
        assert "prefetch there" in op["timings"], op
        if victim == "a's CRIU":
            assert op["failed_phase"] == "dump", op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and view["state"] == "running" and [g["index"] for g in view["gpus"]] == [0], view
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
        await until_gpu_free(1, "b's prefetch helper")
    finally:
        if b.proc.poll() is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(b.proc.pid, signal.SIGKILL)  # what the server left of its group
            await call(b.start, {"a": a.peer_entry()})
        await end_kernel(a, kernel_id, tab)


@pytest.mark.gpu
async def test_a_prefetch_begun_at_home_ends_with_a_failed_way_home_and_the_kernel_runs_on_there(hosts):
    """Coming home, a's prefetch begins once b's dump is over, before the transfer: its helper holds a copy of
    the kernel's tensors on a's GPU 0. a's CRIU SIGKILLed in the restore fails the way home: the undo kills what
    CRIU made, ends the helper, and has b resume the kernel, which runs on there on GPU 1 with every value;
    nothing holds a's GPU 0 afterwards."""
    two_gpus()
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(GPU_TENSORS)
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b", "to_gpu": 1})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))

        op = await call(lambda: kill_criu_in(a, a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/migrate",
                                                          {"to_host": "a", "to_gpu": 0}), "restore",
                                             ("prefetch", "transfer"), "restore"))  # after b's dump
        assert op["killed"] and op["status"] == "failed" and op["failed_phase"] == "restore", \
            (op["killed"], op["seen"], op["status"], op.get("failed_phase"), op.get("error"))
        phases = list(op["timings"])
        assert phases.index("dump") < phases.index("prefetch") < phases.index("transfer"), phases
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and view["state"] == "running" and [g["index"] for g in view["gpus"]] == [1], view
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
        await until_gpu_free(0, "a's prefetch helper")
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a", "to_gpu": 0})  # and home it comes
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
    finally:
        await end_kernel(a, kernel_id, tab)


@pytest.mark.gpu
async def test_a_gpu_kernel_on_the_other_host_outlives_this_hosts_server_with_its_tensors(hosts):
    """a's server SIGKILLed while its GPU kernel runs on b's GPU 1: a's next server relays to it again and
    shows the GPU it holds there (b's answer); its tensors are whole, and it comes home onto GPU 0."""
    two_gpus()
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        await tab.run(GPU_TENSORS)
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b", "to_gpu": 1})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        tab.ws.close()
        os.killpg(a.proc.pid, signal.SIGKILL)
        assert a.proc.wait(10) == -signal.SIGKILL
        view = await restart_and_find(a, a_peers(b), kernel_id)
        assert view["host"] == "b" and view["remote"] and [g["index"] for g in view["gpus"]] == [1], view
        tab = await open_tab(a, kernel_id)
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a", "to_gpu": 0})
        assert op["status"] == "succeeded", (op.get("error"), op.get("failed_phase"))
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "a" and [g["index"] for g in view["gpus"]] == [0], view
        assert (await tab.run(GPU_SAME)).strip() == "True cuda:0 3000.0 True"
    finally:
        if a.proc.poll() is not None:
            await call(a.start, a_peers(b))
        await end_kernel(a, kernel_id, tab)


@pytest.mark.gpu
async def test_a_gpu_kernel_transplanted_to_the_other_hosts_gpu_keeps_every_value_and_comes_home(hosts):
    # A transplant forced between the two hosts' GPUs (the driver could move it: the same model), then home.
    two_gpus()
    a, b = hosts
    kernel_id, tab = await new_kernel(a)
    try:
        digest = ("import hashlib; print(hashlib.sha256(b''.join(x.detach().cpu().numpy().tobytes() for x in "
                  "(t, model.weight, model.bias))).hexdigest(), t.device)")
        await tab.run("import torch; torch.manual_seed(3); t = torch.randn(1 << 22, device='cuda'); "
                      "model = torch.nn.Linear(64, 8).cuda()")
        before = (await tab.run(digest)).split()
        op = await call(a.operate, kernel_id, "transplant", {"to_host": "b", "to_gpu": 1})
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        assert {"lock", "checkpoint", "dump", "switch"} <= set(op["timings"]) and op["to_gpu"] == 1, op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["host"] == "b" and [g["index"] for g in view["gpus"]] == [1], view
        assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
        assert (await tab.run(digest)).split() == before
        # Home by a move of that process, onto a's GPU 0, every value kept.
        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a", "to_gpu": 0})
        assert op["status"] == "succeeded", (op["failed_phase"], op["error"])
        assert (await tab.run(digest)).split() == before
    finally:
        await end_kernel(a, kernel_id, tab)


def test_a_guests_images_go_to_memory_where_there_is_room(tmp_path):
    import shutil
    import tempfile

    from jupyter_gpumigrate.engine.errors import ImageError
    from jupyter_gpumigrate.peers import GuestHost

    shm = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="gpumigrate-test-"))
    try:
        guests = GuestHost(tmp_path / "guests", lambda: None, memory_root=shm / "guests")
        assert guests.begin("k1", 10**6).parent == shm / "guests", "a small kernel's images: in memory"
        with pytest.raises(ImageError, match="need"):  # no room in memory, nor on disk: refused, saying so
            guests.begin("k2", 10**15)
        assert not (shm / "guests" / "k2").exists() and not (tmp_path / "guests" / "k2").exists()
        on_disk = GuestHost(tmp_path / "disk", lambda: None, memory_root=shm / "guests", images="disk")
        assert on_disk.begin("k3", 10**6).parent == tmp_path / "disk", "the server's suspend_to says disk"
        guests.discard("k1")
        assert not (shm / "guests").exists(), "no litter in /dev/shm once no guest is there"
    finally:
        shutil.rmtree(shm, ignore_errors=True)


async def test_the_other_host_killed_while_it_loads_a_transplant_leaves_the_source_running_here(hosts):
    a, b = hosts
    kernel_id, tab = await kernel_with_objects(a, "big = torch.ones(100_000_000)")
    pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
    seen: list[str] = []

    def kill_b_during_the_load() -> None:
        op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_host": "b", "to_cpu": True})
        while op["status"] not in ("succeeded", "failed"):
            seen.append(op["phase"] or "")
            if op["phase"] == "load" and b.proc.poll() is None:
                b.stop(signal.SIGKILL)
            op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
        seen.append(json.dumps(op))

    try:
        await call(kill_b_during_the_load)
        op = json.loads(seen[-1])
        assert b.proc.poll() is not None, f"b was never killed; phases seen: {seen}"
        assert op["status"] == "failed" and op["failed_phase"] == "load", op
        assert "cannot be reached" in op["error"] or op["error"].startswith("b:"), op["error"]
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["state"] == "running" and view["pid"] == pid and not view["remote"], view
        assert (await tab.run("print(box.v, next(gen), int(big.sum()))")).strip() == "41 1 100000000"
        deadline = time.monotonic() + 30  # the new process on b ends with its server
        while transplant_processes():
            assert time.monotonic() < deadline, "the new process on b outlived its server"
            await asyncio.sleep(0.2)
    finally:
        tab.ws.close()
        await call(a.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)
        b.start({"a": a.peer_entry()})


async def test_this_server_killed_while_the_peer_loads_a_transplant_loses_nothing(hosts):
    """a's server SIGKILLed while b's new process reads the objects: the source, never saved, runs on, and the
    next server on a takes it back with its notebook's state; b's new process, never told to go, is discarded
    there (by its own expiry, or, as here, by a's word)."""
    a, b = hosts
    kernel_id, tab = await kernel_with_objects(a, "big = torch.ones(100_000_000)")
    peers = {"b": b.peer_entry(), "c": b.peer_entry(token="not-" + b.peer_token)}
    try:
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        seen: list[str] = []

        def kill_a_during_the_load() -> None:
            op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_host": "b", "to_cpu": True})
            while op["phase"] != "load":
                assert op["status"] in ("pending", "running"), op
                op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
            seen.append(op["phase"])
            a.stop(signal.SIGKILL)

        await call(kill_a_during_the_load)
        assert seen == ["load"] and a.proc.poll() is not None
        tab.ws.close()
        assert os.path.exists(f"/proc/{pid}"), "the source ended with its server"
        view = await restart_and_find(a, peers, kernel_id)
        assert view["state"] == "running" and view["pid"] == pid and not view["remote"], view
        tab = await open_tab(a, kernel_id)
        assert (await tab.run("print(box.v, next(gen), int(big.sum()))")).strip() == "41 1 100000000"
        # b still holds the new process (it waits for a go that will not come): a peer's DELETE ends it.
        await call(b.api, "DELETE", f"api/gpumigrate/peer/kernels/{kernel_id}", expect=204,
                   headers={"Authorization": f"gpumigrate-peer {b.peer_token}"})
        assert not transplant_processes() and not guest_images_in_memory(kernel_id)
        assert not (b.root / "state" / "guests" / kernel_id).exists()
    finally:
        if a.proc is None or a.proc.poll() is not None:
            await call(a.start, peers)
        await end_kernel(a, kernel_id, tab)


def transplant_until_b_switches(a: Host, b: Host, kernel_id: str) -> tuple[dict, int]:
    """Transplant the kernel from a to b's CPU, holding b's new process (SIGSTOP) once it holds the objects,
    until b, told to go, waits for it to take the kernel's ports: the operation then, and the held PID."""
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    held: list[int] = []
    op = a.api("POST", f"api/gpumigrate/kernels/{kernel_id}/transplant", {"to_host": "b", "to_cpu": True})
    while op["phase"] != "switch":
        assert op["status"] in ("pending", "running"), op
        if op["phase"] in ("stash", "lock", "checkpoint", "dump") and not held:
            held.extend(transplant_processes())  # loaded: it waits for the word to go
            assert len(held) == 1, held
            os.kill(held[0], signal.SIGSTOP)
            there = b.api("GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer)
            assert there["state"] == "suspended" and there["waiting"] is True, there
        op = a.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    assert held, "the dump was never seen"
    deadline = time.monotonic() + 30
    while (there := b.api("GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer))["state"] != "migrating":
        assert there.get("waiting") and time.monotonic() < deadline, there  # told to go, it cannot: b waits
        time.sleep(0.01)
    return op, held[0]


@pytest.mark.parametrize("new_process", ["takes the ports", "dies"])
async def test_this_server_killed_as_a_transplant_switches_leaves_one_copy(hosts, new_process):
    """a's server SIGKILLed during the switch of a transplant to b's CPU, with b's new process held (SIGSTOP)
    before it takes the kernel's ports: a's record of the kernel names b by then, and b says the kernel is
    migrating. Let go, the new process takes the ports: a's next server asks b, finds the kernel running there,
    relays to it and removes the source's images; a tab reaches the objects there. Killed instead, b discards
    it: a's next server finds b without it and takes the source back from its images, suspended; resumed, the
    objects are there. One copy runs, never two."""
    a, b = hosts
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    async with a_killable_b_forgetting(a, b) as (peers, kernels):
        kernel_id, tab = await kernel_with_objects(a)
        kernels.append((kernel_id, tab))
        _, held = await call(transplant_until_b_switches, a, b, kernel_id)
        a.stop(signal.SIGKILL)
        tab.ws.close()
        record = json.loads((a.root / "state" / "kernels" / f"{kernel_id}.json").read_text())
        assert record["remote"]["peer"] == "b", record
        assert images_on_a(a, kernel_id), "the source's images wait on a"
        if new_process == "takes the ports":
            os.kill(held, signal.SIGCONT)
            view = await restart_and_find(a, peers, kernel_id)
            assert view["host"] == "b" and view["remote"], view
            deadline = time.monotonic() + 30  # the source's images go once the kernel answers through the relay
            while images_on_a(a, kernel_id):
                assert time.monotonic() < deadline, a.server_log()
                await asyncio.sleep(0.1)
            where = b.ip
        else:
            os.kill(held, signal.SIGKILL)

            def gone_from_b() -> bool:  # b discards what did not take the ports
                try:
                    b.api("GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer, expect=404)
                    return True
                except AssertionError:
                    return False

            deadline = time.monotonic() + 30
            while not await call(gone_from_b):
                assert time.monotonic() < deadline, b.server_log()
                await asyncio.sleep(0.1)
            view = await restart_and_find(a, peers, kernel_id)
            assert view["state"] == "suspended" and not view["remote"], view
            assert "no longer has it" in a.server_log()
            assert (await call(a.operate, kernel_id, "resume"))["status"] == "succeeded"
            where = a.ip
        tab = await open_tab(a, kernel_id)
        kernels[:] = [(kernel_id, tab)]
        assert (await tab.run("print(box.v, float(view.sum()), view.data_ptr() - data.data_ptr())")).strip() == "41 60.0 16"
        assert (await tab.run(WHERE)).strip() == f"{where}/24"
        assert len(transplant_processes()) == (1 if new_process == "takes the ports" else 0)


async def test_the_other_hosts_server_killed_as_a_transplant_switches_leaves_one_copy(hosts):
    """b's server SIGKILLed while its new process, held (SIGSTOP), has been told to take the kernel's ports: the
    transplant fails on a, whose source comes back from its images with its state. b wrote the new process down
    before the word to go, so its next server takes it back (or finds it ended with its server) and, never
    relayed to by a, discards it (c.GPUMigrateApp.guest_unclaimed_expire, here 5 s): no process of the kernel is
    left on b that no server knows."""
    a, b = hosts
    peer = {"Authorization": f"gpumigrate-peer {b.peer_token}"}
    async with a_killable_b_forgetting(a, b, unclaimed=5) as (peers, kernels):
        kernel_id, tab = await kernel_with_objects(a)
        kernels.append((kernel_id, tab))
        pid = (await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]

        def kill_b_as_it_switches() -> dict:
            op, held = transplant_until_b_switches(a, b, kernel_id)
            b.stop(signal.SIGKILL)
            os.kill(held, signal.SIGCONT)
            return followed_to_its_end(a, op)

        op = await call(kill_b_as_it_switches)
        assert op["status"] == "failed" and op["failed_phase"] == "switch", op
        view = await call(a.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["state"] == "running" and not view["remote"] and view["pid"] == pid, view
        assert (await tab.run("print(box.v, next(gen), float(view.sum()))")).strip() == "41 1 60.0"
        await call(b.start, {"a": a.peer_entry()})
        deadline = time.monotonic() + 60
        while transplant_processes():
            assert time.monotonic() < deadline, b.server_log()
            await asyncio.sleep(0.2)
        await call(b.api, "GET", f"api/gpumigrate/peer/kernels/{kernel_id}", headers=peer, expect=404)
        assert (await tab.run("print(next(gen))")).strip() == "2"


def test_a_host_says_every_reason_it_cannot_take_a_transplant(tmp_path):
    import socket

    from jupyter_gpumigrate.peers import GuestHost

    def kernelspec(name: str) -> tuple[list[str], dict]:
        specs = {"python3": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                 "other": ["/opt/other-kernel", "--connection", "{connection_file}"]}
        if name not in specs:
            raise KeyError(name)
        return specs[name], {}

    guests = GuestHost(tmp_path / "guests", lambda: None, inventory=list, kernelspec=kernelspec)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        found = guests.check_transplant("k", "python3", [("127.0.0.1", port)], 10**6, 0, 3)
        assert len(found) == 2 and f"port 127.0.0.1:{port} is not free here" in found[0], found
        assert "GPU 3" in found[1], found
    assert guests.check_transplant("k", "python3", [], 10**6, 0, None) == []
    assert "no kernel type 'nope' here" in guests.check_transplant("k", "nope", [], 0, 0, None)[0]
    assert "not started with python -m ipykernel_launcher" in guests.check_transplant("k", "other", [], 0, 0, None)[0]
    assert "of memory available" in guests.check_transplant("k", "python3", [], 10**15, 0, None)[0]


async def test_the_relays_listener_for_one_peers_kernels_is_shared_by_them_and_refused_to_another_peers(tmp_path):
    """The address where b listens for the calls of a peer's kernels to their server (its relays' ApiListeners) is
    no problem for another kernel of that peer; for a kernel of another peer it is, said as such. A call made on
    it goes over the relay of the process that made it (here, this test's), else over the oldest relay still
    open; one that closed while it joined never gets one; the listener closes with the last relay."""
    import socket

    from jupyter_gpumigrate.peers import GuestHost
    from jupyter_gpumigrate.relay import OPEN, RelayServerEnd

    guests = GuestHost(tmp_path / "guests", lambda: None, inventory=list)
    listeners = guests.api_listeners
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = ("127.0.0.1", probe.getsockname()[1])
    carried: dict[str, list[bytes]] = {"first": [], "second": [], "gone": []}

    def end(name: str) -> RelayServerEnd:
        async def send(data: bytes) -> None:
            carried[name].append(data)
        return RelayServerEnd({"transport": "tcp", "ip": "127.0.0.1"}, send)

    def opened() -> dict[str, int]:
        """The calls each relay opened on the far side (its OPEN messages)."""
        return {name: sum(1 for data in sent if data[0] == OPEN) for name, sent in carried.items()}

    async def call_made() -> asyncio.StreamWriter:
        before = sum(opened().values())
        _, writer = await asyncio.open_connection(*address)
        deadline = time.monotonic() + 10
        while sum(opened().values()) == before:
            assert time.monotonic() < deadline, "no relay carried the call"
            await asyncio.sleep(0.05)
        return writer

    first, second, gone = end("first"), end("second"), end("gone")
    second.pid = os.getpid()  # the calls below are this process's: second is their kernel's relay
    await listeners.join(first, address, "10.0.0.8")
    joining = asyncio.ensure_future(listeners.join(gone, address, "10.0.0.8"))
    gone.stop()  # its WebSocket closed as it joined
    await joining
    await listeners.join(second, address, "10.0.0.8")
    try:
        needs = hostfit.Requirements(ids=[], listens=[address])
        assert not [p for p in guests.check(needs, None, None, peer="10.0.0.8") if "port" in p]
        refused = guests.check(hostfit.Requirements(ids=[], listens=[address]), None, None, peer="10.0.0.9")
        assert [f"the port {address[0]}:{address[1]}, where the kernel calls its server, is where kernels that "
                "10.0.0.8 moved here call theirs (it is free once they left this host)"] == \
            [p for p in refused if "port" in p], refused
        assert hostfit.problems(hostfit.Requirements(ids=[], listens=[address]))  # one listener, there

        writer = await call_made()
        assert opened() == {"first": 0, "second": 1, "gone": 0}
        writer.close()
        listeners.leave(second)
        second.stop()
        writer = await call_made()  # its caller's relay gone: the oldest open one carries it
        assert opened() == {"first": 1, "second": 1, "gone": 0}
        writer.close()
        await writer.wait_closed()
    finally:
        for each in (first, second):
            listeners.leave(each)
            each.stop()
        await asyncio.sleep(0.1)  # the relays' streams see their close
    assert hostfit.problems(hostfit.Requirements(ids=[], listens=[address])) == []  # free again


def test_a_restore_cut_short_is_ended_by_the_next_server_only_where_its_mark_says_it_was_its_own(tmp_path, caplog):
    """GuestHost._sweep at a server's start, for images no guest or record names: the process a restore of this
    state folder left (the mark GuestHost.restore writes while CRIU runs: since, boot, owner) is killed; one
    marked by another state folder (images' folder shared), in another boot, or started before the mark, and
    one of another kernel, are left running. A mark that cannot be written refuses the restore, saying why."""
    import subprocess
    import sys
    from dataclasses import asdict

    from jupyter_gpumigrate.engine.images import MANIFEST, Manifest
    from jupyter_gpumigrate.engine.errors import ImageError
    from jupyter_gpumigrate.peers import RESTORING, Guest, GuestHost

    root = tmp_path / "guests"
    root.mkdir(mode=0o700)
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    owner = str(root / "guests-running")
    procs: dict[str, subprocess.Popen] = {}
    try:
        marks = {"ours": (owner, boot), "theirs": (str(tmp_path / "another"), boot), "old": (owner, boot),
                 "rebooted": (owner, "another boot"), "another": (owner, boot)}
        since = proctree.tick_boundary()
        for name, (who, when) in marks.items():
            env = {**os.environ, ENV_KERNEL_ID: "someone-else" if name == "another" else name}
            procs[name] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env,
                                           start_new_session=True)
            folder = root / name
            folder.mkdir(mode=0o700)
            manifest = Manifest(kernel_id=name, kernel_name="python3", pid=procs[name].pid, ids=[procs[name].pid])
            (folder / MANIFEST).write_text(json.dumps(asdict(manifest)))
            # "old": its process started before the mark (a PID that a restore found taken, not its own fork)
            mark_since = proctree.tick_boundary() if name == "old" else since
            (folder / RESTORING).write_text(json.dumps({"since": mark_since, "boot": when, "owner": who}))
            os.utime(folder, (time.time() - 60, time.time() - 60))  # there before the server began
        with caplog.at_level("WARNING", logger="jupyter_gpumigrate.peers"):
            GuestHost(root, lambda: None).take_back()
        procs["ours"].wait(10)  # killed (and collected by the sweep, whose child it is here)
        assert "its process %d" % procs["ours"].pid in caplog.text and "stuck half restored" in caplog.text
        for name in ("theirs", "old", "rebooted", "another"):
            assert procs[name].poll() is None, f"{name}'s process was killed"
        assert not any((root / name).exists() for name in marks), "the images are swept all the same"

        # The mark cannot be written (a read-only disk here): the restore is refused before CRIU runs.
        guests = GuestHost(root, lambda: None)
        folder = root / "refused"
        folder.mkdir(mode=0o700)
        manifest = Manifest(kernel_id="refused", kernel_name="python3", pid=1, ids=[1])
        (folder / MANIFEST).write_text(json.dumps(asdict(manifest)))
        guests.guests["refused"] = Guest(manifest, "10.0.0.1")
        subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
            with pytest.raises(ImageError, match="cannot be restored here: .* cannot be written .*runs on at its peer"):
                guests.restore("refused", None)
        finally:
            subprocess.run(["umount", str(folder)], check=False)
        assert not (folder / RESTORING).exists() and (folder / MANIFEST).exists()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def test_a_host_takes_back_only_the_guests_whose_own_process_runs(tmp_path, caplog):
    """GuestHost.take_back at a server's start: a record whose process runs (the same PID, start time and
    kernel id) is taken back, running, and discarded if no relay claims it in time; one whose process is
    gone but whose dump for its way home is here whole is taken back suspended, its images kept; one whose
    process is gone otherwise, or whose PID another process has now (another start time, another kernel's
    id), is removed; one that cannot be read is left where it is, and said in the log. A records folder that
    others can write is not read at all."""
    import subprocess
    import sys
    from dataclasses import asdict

    from jupyter_gpumigrate.credentials import ENV_KERNEL_ID
    from jupyter_gpumigrate.engine.images import MANIFEST, Manifest
    from jupyter_gpumigrate.peers import RUNNING_GUESTS, GuestHost, GuestNotFound, GuestsNotBack

    root = tmp_path / "guests"
    records = root / RUNNING_GUESTS
    records.mkdir(parents=True, mode=0o700)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env={**os.environ, ENV_KERNEL_ID: "runs"})
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()

        def record(kernel_id: str, pid: int, started: int | None, boot: str = boot) -> Manifest:
            manifest = Manifest(kernel_id=kernel_id, kernel_name="python3", pid=pid, ids=[pid])
            (records / f"{kernel_id}.json").write_text(json.dumps(
                {"manifest": asdict(manifest), "peer": "10.0.0.1", "pid": pid, "started": started, "boot": boot}))
            return manifest

        started = proctree.start_time(alive.pid)
        record("runs", alive.pid, started)
        record("reused", alive.pid, (started or 0) + 1)
        record("another", alive.pid, started)  # the same process, which says it is kernel runs
        record("rebooted", alive.pid, started, boot="another boot")  # written before the host started again
        gone = subprocess.Popen(["true"])
        gone.wait()
        record("gone", gone.pid, 1)
        dumped = record("dumped", gone.pid, 1)
        (root / "dumped").mkdir(mode=0o700)
        (root / "dumped" / MANIFEST).write_text(json.dumps(asdict(dumped)))
        (records / "garbage.json").write_text("{not json")
        (records / "list.json").write_text(json.dumps({"manifest": [1], "peer": "x", "pid": 1, "started": 1}))
        record("other", alive.pid, started)
        (records / "misnamed.json").write_text((records / "other.json").read_text())
        (records / "other.json").unlink()

        records.chmod(0o777)
        assert GuestHost(root, lambda: None).take_back() == []
        assert len(list(records.iterdir())) == 9, "a folder others can write was read"
        records.chmod(0o700)

        guests = GuestHost(root, lambda: None, unclaimed=3600.0)
        guests.back.clear()  # as a server does while there are records: a peer asking now is told to ask again
        with pytest.raises(GuestsNotBack):
            guests.guest("runs")
        with caplog.at_level("INFO", logger="jupyter_gpumigrate.peers"):
            assert guests.take_back() == [("runs", alive.pid)]
        with pytest.raises(GuestNotFound):  # all are back: one not listed is not here
            guests.guest("gone")
        assert guests.guest("runs").state == "running" and guests.guest("runs").pgid == alive.pid
        assert guests.guest("dumped").state == "suspended" and guests.guest("dumped").ran
        assert sorted(p.name for p in records.iterdir()) == ["dumped.json", "garbage.json", "list.json",
                                                             "misnamed.json", "runs.json"]
        assert "garbage, hosted for a peer, cannot be read" in caplog.text
        assert "it is not kernel misnamed's" in caplog.text
        assert "not a private folder" in caplog.text
        # Its check (due in an hour here), made now: while its dump runs, it is kept and looked at again later;
        # once no relay claimed it, it is discarded, its process killed and its record gone.
        guests.dumping["runs"] = object()  # type: ignore[assignment]
        guests._unclaimed("runs", alive.pid)
        assert proctree.is_alive(alive.pid) and (records / "runs.json").exists()
        del guests.dumping["runs"]
        guests._unclaimed("runs", alive.pid)
        assert not proctree.is_alive(alive.pid) and not (records / "runs.json").exists()
        assert "runs" not in guests.guests and (records / "dumped.json").exists()
    finally:
        if alive.poll() is None:
            alive.kill()
        alive.wait()


def test_a_peers_word_on_a_kernels_size_is_taken_only_as_counts():
    """The way home places its images by the size the other host says (GET peer/kernels/{id}: memory, and its
    GPUs' memory_used): its images, and the restored process beside them. Anything but counts is not taken."""
    assert _estimate({"memory": 10, "gpus": [{"index": 0, "memory_used": 5}]}) == 25
    assert _estimate({"memory": 10}) == 20
    for wrong in ({}, {"memory": True}, {"memory": -1}, {"memory": 1.5}, {"memory": "10"},
                  {"memory": 10, "gpus": [{"memory_used": "x"}]}, {"memory": 10, "gpus": "x"},
                  {"memory": 10, "gpus": [3]}, {"memory": 10, "gpus": [{"memory_used": False}]}):
        assert _estimate(wrong) is None, wrong
