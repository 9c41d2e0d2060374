"""Suspended kernels on storage shared by several hosts (c.MigratableProvisioner.shared_dir).

The hosts are the network namespaces of tests/hosts.py, each with its own HTTPS jupyter_server and local
state folder, sharing one folder for their suspended kernels. They share the PID namespace too: once a's
kernel is dumped, its PIDs are free for b.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import BUILD_STATE, CHECK_STATE, EXPECTED
from hosts import Host, Network, make_certificate
from test_cross_host import WHERE, call, new_kernel, open_tab

from jupyter_gpumigrate.engine.shared import ClaimLost, SharedFolder

pytestmark = pytest.mark.usefixtures("criu_binary")

#: the hosts' heartbeat, in seconds: a stopped host's kernels are taken after three of them
BEAT = 0.5


def _claim(root: Path, host: str, barrier: object, results: object) -> None:
    shared = SharedFolder(root, host)
    barrier.wait()  # type: ignore[attr-defined]
    try:
        shared.claim("a", "k1")
        results.put((host, "won"))  # type: ignore[attr-defined]
    except ClaimLost as exc:
        results.put((host, str(exc)))  # type: ignore[attr-defined]


def _images_of_a(root: Path) -> Path:
    folder = SharedFolder(root, "a").images_root() / "k1"
    folder.mkdir(parents=True)
    (folder / "pages-1.img").write_bytes(b"x" * 4096)
    (folder / "manifest.json").write_text("{}")
    return folder


def test_of_two_hosts_claiming_one_kernel_at_once_exactly_one_wins_and_the_other_is_told_who(tmp_path):
    context = multiprocessing.get_context("fork")
    for _ in range(10):
        _images_of_a(tmp_path)
        barrier, results = context.Barrier(2), context.Queue()
        racers = [context.Process(target=_claim, args=(tmp_path, h, barrier, results)) for h in ("b", "c")]
        for racer in racers:
            racer.start()
        outcomes = dict(results.get(timeout=30) for _ in racers)
        for racer in racers:
            racer.join(timeout=30)
        winners = [host for host, said in outcomes.items() if said == "won"]
        assert len(winners) == 1, outcomes
        winner, loser = winners[0], ({"b", "c"} - set(winners)).pop()
        assert f"host {winner} took it first; nothing was changed here" in outcomes[loser], outcomes
        taken = SharedFolder(tmp_path, winner).images_root() / "k1"
        assert (taken / "pages-1.img").read_bytes() == b"x" * 4096 and (taken / "manifest.json").exists()
        assert not (SharedFolder(tmp_path, "a").images_root() / "k1").exists()
        assert not (SharedFolder(tmp_path, loser).images_root() / "k1").exists()
        # Given back, it is a's again, whole.
        SharedFolder(tmp_path, winner).give_back("a", "k1")
        assert (SharedFolder(tmp_path, "a").images_root() / "k1" / "pages-1.img").stat().st_size == 4096
        os.system(f"rm -r {SharedFolder(tmp_path, 'a').images_root() / 'k1'}")


def test_a_hosts_kernels_are_candidates_only_once_its_heartbeat_is_stale_and_only_with_a_manifest(tmp_path):
    a, b = SharedFolder(tmp_path, "a", 0.2), SharedFolder(tmp_path, "b", 0.2)
    _images_of_a(tmp_path)
    (a.images_root() / "k2").mkdir()  # a dump in progress: never taken
    a.beat(0.2)
    assert b.runs("a") and b.candidates() == []
    for _ in range(5):  # a heartbeat that moves is alive, however long b watches
        time.sleep(0.2)
        a.beat(0.2)
        assert b.runs("a")
    time.sleep(0.7)  # still for three of its intervals, as b's own clock says
    assert not b.runs("a")
    assert [(c.host, c.kernel_id) for c in b.candidates()] == [("a", "k1")]
    assert a.candidates() == []  # its own are not candidates
    # A fresh watcher judges nothing stale before it has watched long enough itself (clocks need not agree).
    c = SharedFolder(tmp_path, "c", 0.2)
    assert c.runs("a") and c.candidates() == []


def test_a_link_planted_as_a_hosts_images_hands_out_nothing(tmp_path):
    a, b = SharedFolder(tmp_path, "a", 0.2), SharedFolder(tmp_path, "b", 0.2)
    _images_of_a(tmp_path)
    a.beat(0.2)
    (tmp_path / "hosts" / "old").mkdir()
    (tmp_path / "hosts" / "old" / "images").symlink_to(a.images_root())  # "old" is silent, a is alive
    assert b.runs("a") and b.candidates() == []
    time.sleep(0.7)
    a.beat(0.2)  # a beats again: alive; the link's "host" is stale, but its images are a's
    assert b.runs("a") and [c.host for c in b.candidates()] == []
    with pytest.raises(ClaimLost):
        b.claim("old", "k1")
    assert (a.images_root() / "k1" / "manifest.json").exists(), "a keeps its kernel"


@pytest.fixture(scope="module")
def shared_hosts(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-hosts")
    net = Network(20 + (os.getpid() + 101) % 200).up()
    hosts: list[Host] = []
    try:
        addresses = [net.add(name, 2 + i) for i, name in enumerate("abc")]
        cert, key = make_certificate(root, [ip for _, ip in addresses])
        shared = root / "shared"
        shared.mkdir(mode=0o700)
        extra = {"MigratableProvisioner": {"shared_dir": str(shared)}, "GPUMigrateApp": {"shared_heartbeat": BEAT}}
        hosts = [Host(name, ns, ip, root / name, cert, key, extra=extra)
                 for name, (ns, ip) in zip("abc", addresses)]
        yield (*hosts, shared)
    finally:
        for host in hosts:
            host.stop()
        net.close()


async def suspended_on(a: Host, running: tuple[Host, ...], stopped: tuple[Host, ...], cell: str) -> str:
    """With ``running`` hosts up and ``stopped`` ones down: a kernel of a's that ran ``cell``, suspended; its id."""
    for host in stopped:
        host.stop()
    for host in (a, *running):
        if host.proc is None or host.proc.poll() is not None:
            host.start({})
    kernel_id, tab = await new_kernel(a)
    await tab.run(cell)
    assert (await call(a.operate, kernel_id, "suspend"))["status"] == "succeeded"
    tab.ws.close()
    return kernel_id


async def listed_by(host: Host, kernel_id: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kernels = {k["id"]: k for k in await call(host.api, "GET", "api/kernels")}
        if kernel_id in kernels:
            return kernels[kernel_id]
        assert time.monotonic() < deadline, f"{host.name} never took kernel {kernel_id}:\n{host.server_log()}"
        await asyncio.sleep(0.25)


async def test_a_kernel_suspended_on_a_host_that_died_is_resumed_on_the_other_from_the_shared_folder(
        shared_hosts, tmp_path):
    a, b, _c, shared = shared_hosts
    a.start({})
    b.start({})
    kernel_id, tab = await new_kernel(a)
    assert "built" in await tab.run(f"PATH = {str(tmp_path / 'notes.txt')!r}\n" + BUILD_STATE)
    op = await call(a.operate, kernel_id, "suspend")
    assert op["status"] == "succeeded", op
    assert (shared / "hosts" / "a" / "images" / kernel_id / "manifest.json").is_file()
    # While a's server runs, its kernel is its own: b leaves it alone.
    await asyncio.sleep(4 * BEAT)
    assert kernel_id not in [k["id"] for k in await call(b.api, "GET", "api/kernels")]

    tab.ws.close()
    a.stop(signal.SIGKILL)
    await listed_by(b, kernel_id)
    view = await call(b.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
    assert view["state"] == "suspended" and view["host"] == "b", view
    assert (shared / "hosts" / "b" / "images" / kernel_id / "manifest.json").is_file()
    assert not (shared / "hosts" / "a" / "images" / kernel_id).exists()
    # b says it took the kernel once its take-back returned (sharing.py), a moment after the kernel is listed
    deadline = time.monotonic() + 30
    while f"took kernel {kernel_id} of host a" not in b.server_log(tail=None):
        assert time.monotonic() < deadline, b.server_log()
        await asyncio.sleep(0.1)

    # A cell over b's websocket resumes it, in b's network namespace, with all its state.
    tab = await open_tab(b, kernel_id)
    assert (await tab.run(CHECK_STATE)).splitlines() == EXPECTED
    assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
    assert not (shared / "hosts" / "b" / "images" / kernel_id).exists()  # resumed: its images are gone

    # a's next server does not list it: it is b's now.
    a.start({})
    assert kernel_id not in [k["id"] for k in await call(a.api, "GET", "api/kernels")]
    assert (await tab.run("print(x + 1, next(gen))")).strip() == "42 7"
    tab.ws.close()
    await call(b.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)
    a.stop()


async def test_two_hosts_starting_at_once_take_a_stopped_hosts_kernel_exactly_once(shared_hosts):
    a, b, c, shared = shared_hosts
    kernel_id = await suspended_on(a, (), (b,), "x = 41; gen = iter(range(10)); next(gen)")
    a.stop(signal.SIGKILL)
    await asyncio.sleep(4 * BEAT)  # a's heartbeat is stale as b and c start

    starts = [threading.Thread(target=host.start, args=({},)) for host in (b, c)]
    for start in starts:
        start.start()
    for start in starts:
        start.join()
    deadline = time.monotonic() + 30
    while True:
        holders = [h for h in (b, c) if kernel_id in [k["id"] for k in await call(h.api, "GET", "api/kernels")]]
        if holders or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(4 * BEAT)  # the loser has had ticks to try
    holders = [h for h in (b, c) if kernel_id in [k["id"] for k in await call(h.api, "GET", "api/kernels")]]
    assert len(holders) == 1, f"held by {[h.name for h in holders]}\n{b.server_log()}\n{c.server_log()}"
    winner = holders[0]
    loser = c if winner is b else b
    assert (shared / "hosts" / winner.name / "images" / kernel_id / "manifest.json").is_file()
    assert not (shared / "hosts" / loser.name / "images" / kernel_id).exists()
    assert not (shared / "hosts" / "a" / "images" / kernel_id).exists()
    # The loser, if it tried, says who won.
    lost = [line for line in loser.server_log().splitlines() if kernel_id in line]
    assert all(f"host {winner.name} took it first" in line for line in lost), lost

    tab = await open_tab(winner, kernel_id)
    assert (await tab.run("print(x + 1, next(gen))")).strip() == "42 1"
    tab.ws.close()
    await call(winner.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)


async def test_a_running_host_whose_suspended_kernel_another_took_drops_it_and_deletes_nothing(shared_hosts):
    # What a host's server does when another host claimed one of its kernels (the two raced at its start):
    # the claim is made here as b's server makes it, while b runs (so a does not take it back), and it is
    # b's next start that takes the kernel from its own folder.
    a, b, c, shared = shared_hosts
    kernel_id = await suspended_on(a, (b,), (c,), "x = 41")
    images = SharedFolder(shared, "b").claim("a", kernel_id)
    files = sorted(p.name for p in images.iterdir())
    deadline = time.monotonic() + 30
    while kernel_id in [k["id"] for k in await call(a.api, "GET", "api/kernels")]:
        assert time.monotonic() < deadline, a.server_log()
        await asyncio.sleep(0.25)
    assert f"kernel {kernel_id} was taken by host b from the shared folder" in a.server_log()
    assert sorted(p.name for p in images.iterdir()) == files  # nothing deleted
    a.stop()

    b.stop()
    b.start({})
    await listed_by(b, kernel_id)
    tab = await open_tab(b, kernel_id)
    assert (await tab.run("print(x + 1)")).strip() == "42"
    tab.ws.close()
    await call(b.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)


@pytest.mark.gpu
async def test_a_gpu_kernel_suspended_on_a_host_that_died_resumes_on_the_other_with_its_tensors(shared_hosts):
    # The hosts share the machine's GPUs (one model): b resumes a's GPU kernel from the shared folder.
    a, b, c, shared = shared_hosts
    cell = "import torch; t = torch.arange(1 << 24, device='cuda', dtype=torch.float32); s0 = float(t.sum())"
    kernel_id = await suspended_on(a, (b,), (c,), cell)
    manifest = json.loads((shared / "hosts" / "a" / "images" / kernel_id / "manifest.json").read_text())
    assert manifest["gpus"] and manifest["gpus"][0]["name"], manifest["gpus"]
    a.stop(signal.SIGKILL)
    await listed_by(b, kernel_id, timeout=60)
    tab = await open_tab(b, kernel_id)
    assert (await tab.run("print(float(t.sum()) == s0, t.device, float((t * 2).sum()) == 2 * s0)")).strip() == \
        "True cuda:0 True"
    assert (await tab.run(WHERE)).strip() == f"{b.ip}/24"
    tab.ws.close()
    await call(b.api, "DELETE", f"api/kernels/{kernel_id}", expect=204)
