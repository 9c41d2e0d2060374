"""Ordinary users on one machine: each suspends and resumes their own kernels through the node helper (or a
CRIU given capabilities), and nobody reaches anyone else's kernels or images. Real users (made here),
the real helper as root, real servers run by those users, real CRIU."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from helpers import WebSocketTab, criu_running, two_gpus
from jupyter_gpumigrate.engine import cgroups
from jupyter_gpumigrate.engine.images import FILLED
from jupyter_gpumigrate.engine.nodehelper.client import QUIET
from users import (NodeHelper, UserServer, Users, as_user, forge_capabilities, proc_hiding_others, remove,
                   root_only_folder, user_env)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes Unix users and runs the node helper: needs root")

# Names of this run's own: two runs at once (a review beside CI) must not share users.
A, B = f"gm{os.getpid()}a", f"gm{os.getpid()}b"


@pytest.fixture(scope="module")
def world():
    base = Path(tempfile.mkdtemp(prefix="gm-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    memory = root_only_folder("gm-users-memory-") / "memory"  # images in memory too, on a way only root writes
    users = helper = None
    servers: dict[str, UserServer] = {}
    try:
        users = Users([A, B])
        helper = NodeHelper(base, memory=memory)
        for name in (A, B):
            servers[name] = UserServer(name, base / name, {"helper_socket": str(helper.socket)}).start()
        yield users, helper, servers, base
    finally:
        for server in servers.values():
            server.stop()
        if helper is not None:
            helper.stop()
        subprocess.run(["umount", "--lazy", str(memory)], capture_output=True)  # if it was left mounted
        if users is not None:
            users.close()
        remove(base)
        remove(memory.parent)


async def open_tab(server: UserServer, kernel_id: str) -> WebSocketTab:
    request = HTTPRequest(f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels",
                          headers={"Authorization": f"token {server.token}"})
    return WebSocketTab(await websocket_connect(request))


async def call(fn, *args, **kwargs):
    return await asyncio.to_thread(fn, *args, **kwargs)


async def new_kernel(server: UserServer) -> tuple[str, WebSocketTab]:
    try:
        kernel = await call(server.api, "POST", "api/kernels", {"name": "python3"})
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- server log:\n{server.server_log()}") from None
    tab = await open_tab(server, kernel["id"])
    assert (await tab.run("print('up')")).strip() == "up"
    return kernel["id"], tab


def sleep_as(user: str) -> subprocess.Popen:
    """A process of ``user``, a session leader (as kernels are), and our child (so that we reap it)."""
    return subprocess.Popen([*as_user(user), "setsid", "sleep", "300"], cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ask_as(users: Users, user: str, helper: NodeHelper, *requests: dict, netns: str | None = None) -> list[dict]:
    """Send each request to the helper from a process of ``user`` (so SO_PEERCRED says ``user``), in network
    namespace ``netns`` where given."""
    script = (
        "import json, sys\n"
        "from jupyter_gpumigrate.engine.nodehelper import HelperClient\n"
        f"client = HelperClient({str(helper.socket)!r})\n"
        "for line in sys.stdin:\n"
        "    print(json.dumps(client.request(json.loads(line))), flush=True)\n"
    )
    enter = ["nsenter", f"--net=/run/netns/{netns}"] if netns else []
    done = subprocess.run([*enter, *as_user(user), sys.executable, "-c", script], env=user_env(user), cwd="/",
                          input="".join(json.dumps(r) + "\n" for r in requests), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


async def test_each_user_suspends_and_resumes_their_own_kernel_through_the_helper(world):
    users, helper, servers, _ = world
    for name, other in ((A, B), (B, A)):
        server, uid = servers[name], users.uid(name)
        kernel_id, tab = await new_kernel(server)
        code = "import os, itertools\nsecret = 'only " + name + "'\ncount = itertools.count(41)\nnext(count)\n"
        await tab.run(code)
        op = await call(server.operate, kernel_id, "suspend")
        assert op["status"] == "succeeded", (op, server.server_log())
        listed = await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert listed["state"] == "suspended" and listed["pid"] is None

        # The images are the user's, closed to everyone else, in the folder the helper made for them.
        images = helper.images / str(uid) / "images" / kernel_id
        assert images.is_dir() and images.stat().st_uid == uid and images.stat().st_mode & 0o077 == 0
        pages = sorted(images.glob("pages-*.img"))
        assert pages and all(p.stat().st_uid == uid for p in pages)
        assert all(f.stat().st_mode & 0o077 == 0 for f in images.iterdir()), sorted(
            (f.name, oct(f.stat().st_mode)) for f in images.iterdir())
        peek = users.run(other, "cat", str(pages[0]))
        assert peek.returncode != 0 and "Permission denied" in peek.stderr

        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op, server.server_log())
        out = await tab.run("print(secret, next(count), os.getuid())")
        assert out.split() == ["only", name, "42", str(uid)]
        log = helper.log()
        assert f"uid={uid}({name})" in log and "'dump' pid=" in log and f"'restore' images='images/{kernel_id}'" in log


async def test_an_ordinary_users_kernel_suspends_to_memory_through_the_helper_and_no_one_else_reads_it(world):
    """The helper run with --memory-root: a user's suspend puts the images in memory, in the folder the helper
    made there for that user (asked for, then chosen by auto where there is room), private as on disk; the
    kernel comes back whole. Another user can neither read them nor have them restored."""
    users, helper, servers, _ = world
    server, uid = servers[A], users.uid(A)
    kernel_id, tab = await new_kernel(server)
    await tab.run("import itertools, hashlib, os\ncount = itertools.count(41)\nnext(count)\n"
                  "blob = bytes(range(256)) * 400_000\nbefore = hashlib.sha256(blob).hexdigest()")
    mine = f"images-{state_digest(server)}"  # this server's own folder in the user's folder in memory
    images = helper.memory / str(uid) / mine / kernel_id
    try:
        for asked in ("memory", "auto"):
            op = await call(server.operate, kernel_id, "suspend", {"images": asked})
            assert op["status"] == "succeeded" and op["images"] == "memory", (asked, op, server.server_log())
            assert (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["images"] == "memory"
            pages = sorted(images.glob("pages-*.img"))
            assert pages and images.stat().st_uid == uid and images.stat().st_mode & 0o077 == 0
            assert all(f.stat().st_uid == uid and f.stat().st_mode & 0o077 == 0 for f in images.iterdir())
            assert not (helper.images / str(uid) / "images" / kernel_id).exists()
            peek = users.run(B, "cat", str(pages[0]))
            assert peek.returncode != 0 and "Permission denied" in peek.stderr
            stolen = await call(ask_as, users, B, helper,
                                {"op": "restore", "images": f"../{uid}/{mine}/{kernel_id}", "place": "memory"},
                                {"op": "restore", "images": f"{mine}/{kernel_id}", "place": "memory"})
            assert [r["code"] for r in stolen] == ["refused", "refused"], stolen
            assert "inside your images folder" in stolen[0]["error"], stolen  # and B's own folder has none of it:
            assert f"{helper.memory / str(users.uid(B)) / mine} cannot be opened" in stolen[1]["error"], stolen
            op = await call(server.operate, kernel_id, "resume")
            assert op["status"] == "succeeded", (op, server.server_log())
            out = await tab.run("print(next(count) - 41, hashlib.sha256(blob).hexdigest() == before, os.getuid())")
            assert out.split() == ["1" if asked == "memory" else "2", "True", str(uid)]
            assert not images.exists()
        assert f"'restore' images='{mine}/{kernel_id}' place='memory'" in helper.log()
        (odd,) = await call(ask_as, users, A, helper, {"op": "restore", "images": "images/x", "place": "tape"})
        assert odd["code"] == "bad-request" and '"place" must be "disk" or "memory"' in odd["error"], odd
    finally:
        tab.ws.close()
        await call(server.api, "DELETE", f"api/kernels/{kernel_id}")


async def restarted(server: UserServer, kernel_id: str, start: bool = True) -> dict:
    """Start ``server`` again (``start``: else it is started already); its view of ``kernel_id`` once it has
    taken it back."""
    if start:
        server.start()
    deadline = time.monotonic() + 60
    while kernel_id not in [k["id"] for k in await call(server.api, "GET", "api/gpumigrate/kernels")]:
        assert time.monotonic() < deadline, server.server_log()
        await asyncio.sleep(0.2)
    return await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")


async def test_a_users_kernel_suspended_to_memory_through_the_helper_goes_to_disk_as_its_server_stops(world):
    """Memory images of the helper's go to the user's folder on disk when their server stops (its own files,
    moved by the server as the user), and the next server resumes the kernel from there."""
    users, helper, _, base = world
    uid = users.uid(A)
    server = UserServer(A, base / "a-stops", {"helper_socket": str(helper.socket), "suspend_to": "memory"}).start()
    kernel_id = None
    try:
        kernel_id, tab = await new_kernel(server)
        await tab.run("x = 41")
        tab.ws.close()
        op = await call(server.operate, kernel_id, "suspend")
        assert op["status"] == "succeeded" and op["images"] == "memory", (op, server.server_log())
        memory = helper.memory / str(uid) / f"images-{state_digest(server)}" / kernel_id
        disk = helper.images / str(uid) / "images" / kernel_id
        assert (memory / "manifest.json").is_file() and not disk.exists()
        server.stop()
        assert (disk / "manifest.json").is_file() and not memory.exists(), server.server_log()
        assert "moved from memory to" in server.server_log()
        assert all(f.stat().st_uid == uid and f.stat().st_mode & 0o077 == 0 for f in [disk, *disk.iterdir()])
        view = await restarted(server, kernel_id)
        assert view["state"] == "suspended" and view["images"] == "disk", view
        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op, server.server_log())
        tab = await open_tab(server, kernel_id)
        assert (await tab.run("print(x + 1)")).strip() == "42"
        tab.ws.close()
    finally:
        if kernel_id is not None and server.proc is not None and server.proc.poll() is None:
            with contextlib.suppress(AssertionError, OSError):
                await call(server.api, "DELETE", f"api/kernels/{kernel_id}")
        server.stop()


def state_digest(server: UserServer) -> str:
    """What names ``server``'s own folders in its user's folders in memory (provisioner.py's state_digest)."""
    return hashlib.sha256(os.path.realpath(server.root / "state").encode()).hexdigest()[:12]


async def test_a_helper_refuses_a_memory_root_others_could_change_and_a_dump_into_memory_without_room(world):
    """The helper's memory root: every folder on the way to it is root's and closed to others, sticky ones
    included (in one a user owns, or /tmp, someone else could make the name first or swap it for a link, and the
    helper would then write where they chose): refused at start, saying which, with nothing mounted. A dump into
    memory that the helper's tmpfs has no room for is refused (asked of the helper directly, as a user could),
    and the process runs on."""
    users, _, _, base = world
    uid = users.uid(A)
    ways = root_only_folder("gm-users-ways-")
    theirs, sticky = ways / "theirs", ways / "sticky"
    theirs.mkdir()
    os.chown(theirs, uid, -1)
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    for n, (memory, named) in enumerate(((theirs / "memory", theirs), (sticky / "memory", sticky))):
        folder = base / f"refused-{n}"
        folder.mkdir(mode=0o755)
        bad = NodeHelper(folder, memory=memory, wait=False)
        try:
            assert bad.proc.wait(timeout=30) != 0
            said = (folder / "helper.out").read_text()
            assert f"{named} must be a folder owned by uid 0 that no one else can write" in said, said
            assert not memory.exists() and not bad.socket.exists(), said
        finally:
            bad.stop()
    remove(ways)
    small_base = base / "small"
    small_base.mkdir(mode=0o755)
    small_memory = root_only_folder("gm-users-memory-small-") / "memory"
    try:
        small = NodeHelper(small_base, memory=small_memory, memory_size="16m")
        holder = subprocess.Popen([*as_user(A), sys.executable, "-c", "import time\nx = b'1' * (64 << 20)\n"
                                   "print('held', flush=True)\ntime.sleep(300)"], cwd="/", env=user_env(A),
                                  stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            assert holder.stdout.readline().strip() == "held"
            (dump,) = await call(ask_as, users, A, small, {"op": "dump", "pid": holder.pid, "images": "images/big",
                                                           "place": "memory"})
            assert dump["code"] == "no-room" and "no room in memory for 0.1 GB of images" in dump["error"], dump
            assert "suspend to disk" in dump["error"] and holder.poll() is None
            # A server's client of the helper says it as memory's room (a suspend "auto" then goes to disk).
            script = ("import sys\nfrom jupyter_gpumigrate.engine.errors import HelperError, no_room\n"
                      "from jupyter_gpumigrate.engine.nodehelper.client import HelperCriu\n"
                      f"criu = HelperCriu({str(small.socket)!r})\n"
                      "try:\n    criu.dump(int(sys.argv[1]), criu.memory_root / 'big')\n"
                      "except HelperError as exc:\n    print(no_room(exc), criu.memory_root, sep='\\n')\n")
            done = subprocess.run([*as_user(A), sys.executable, "-c", script, str(holder.pid)], env=user_env(A),
                                  cwd="/", capture_output=True, text=True, timeout=60)
            folder, memory_root = done.stdout.split()
            assert folder == memory_root and holder.poll() is None, (done.stdout, done.stderr)
        finally:
            holder.kill()
            holder.wait()
            small.stop()
    finally:
        subprocess.run(["umount", "--lazy", str(small_memory)], capture_output=True)
        remove(small_memory.parent)


def doctor_in(netns: str, user: str, helper: NodeHelper) -> dict[str, dict]:
    """`jupyter-gpumigrate doctor --json` run by ``user`` in network namespace ``netns`` with ``helper``: its rows."""
    cli = str(Path(sys.executable).parent / "jupyter-gpumigrate")
    done = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", *as_user(user), cli, "doctor", "--json",
                           "--helper-socket", str(helper.socket)], env=user_env(user), cwd="/", capture_output=True,
                          text=True, timeout=120)
    return {c["name"]: c for c in json.loads(done.stdout)["checks"]}


async def test_a_user_naming_another_users_kernel_or_images_is_refused_and_logged(world):
    users, helper, servers, _ = world
    b_kernel, b_tab = await new_kernel(servers[B])
    await b_tab.run("x = 'b was here'")
    b_pid = (await call(servers[B].api, "GET", f"api/gpumigrate/kernels/{b_kernel}"))["pid"]
    assert b_pid
    # B suspends once, so that B's images exist, then resumes.
    assert (await call(servers[B].operate, b_kernel, "suspend"))["status"] == "succeeded"
    b_images = f"images/{b_kernel}"
    b_uid = users.uid(B)
    replies = await call(ask_as, users, A, helper,
                         {"op": "restore", "images": f"../{b_uid}/{b_images}"},
                         {"op": "restore", "images": str(helper.images / str(b_uid) / b_images)})
    assert [r["code"] for r in replies] == ["refused", "refused"], replies
    assert all("inside your images folder" in r["error"] for r in replies)
    assert (await call(servers[B].operate, b_kernel, "resume"))["status"] == "succeeded"
    b_pid = (await call(servers[B].api, "GET", f"api/gpumigrate/kernels/{b_kernel}"))["pid"]

    (dump,) = await call(ask_as, users, A, helper, {"op": "dump", "pid": b_pid, "images": "images/stolen"})
    assert dump["ok"] is False and dump["code"] == "refused", dump
    assert f"not as you ({users.uid(A)})" in dump["error"]
    # B's kernel never noticed.
    assert (await b_tab.run("print(x)")).strip() == "b was here"
    refusals = [line for line in helper.log().splitlines() if "WARNING" in line and f"uid={users.uid(A)}(" in line]
    assert any(f"'dump' pid={b_pid}" in line and "refused" in line for line in refusals), refusals
    assert sum("restore" in line and "refused" in line for line in refusals) >= 2, refusals


async def test_forged_image_folders_are_refused(world):
    users, helper, servers, _ = world
    a_uid, b_uid = users.uid(A), users.uid(B)
    mine = helper.images / str(a_uid)
    # As A: a folder open to others, a link to B's images folder, a path through that link.
    made = users.run(A, "sh", "-c", f"cd {mine} && mkdir -m 755 open && ln -s {helper.images / str(b_uid)} link "
                     "&& mkdir -m 700 real && ln -s real alias")
    assert made.returncode == 0, made.stderr
    # As root, in A's folder: a folder that is not A's (A could not make it, but it must not count).
    os.mkdir(mine / "roots", 0o700)
    replies = await call(ask_as, users, A, helper,
                         {"op": "restore", "images": "roots"},
                         {"op": "restore", "images": "open"},
                         {"op": "restore", "images": "link"},
                         {"op": "restore", "images": "link/images"},
                         {"op": "restore", "images": "alias"},
                         {"op": "restore", "images": "real/../../0"},
                         {"op": "dump", "pid": os.getpid(), "images": "real"})
    assert [r.get("code") for r in replies] == ["refused"] * 7, replies
    errors = [r["error"] for r in replies]
    assert "belongs to uid 0" in errors[0]
    assert "open to other users" in errors[1]
    assert "symbolic link" in errors[2] and "symbolic link" in errors[3] and "symbolic link" in errors[4]
    assert "inside your images folder" in errors[5]
    assert "runs as user [0]" in errors[6]
    assert helper.proc.poll() is None


async def test_forged_images_asking_for_capabilities_or_securebits_are_refused(world):
    """The images are the user's files. The helper restores from its own copy of the core images,
    checked first: no capability, no securebits, the caller's IDs (docs/users.md)."""
    users, helper, _, _ = world
    for name, capabilities, securebits, said in (("forged-caps", [8, 40], 0, "capabilities"),
                                                  ("forged-secbits", [], 0x3, "securebits 0x3"),
                                                  ("forged-packed", [8, 40], -1, "capabilities"),
                                                  ("forged-twice", [], -2, "2 creds fields")):
        folder = helper.images / str(users.uid(A)) / name
        assert users.run(A, "mkdir", "-m", "700", "-p", str(folder)).returncode == 0
        sleeper = sleep_as(A)
        (dumped,) = await call(ask_as, users, A, helper, {"op": "dump", "pid": sleeper.pid, "images": name})
        assert dumped["ok"], dumped
        sleeper.wait(timeout=10)  # its zombie would keep its PID
        # CAP_SETPCAP, CAP_CHECKPOINT_RESTORE; SECBIT_NOROOT and its lock
        forge_capabilities(folder / f"core-{sleeper.pid}.img", capabilities, securebits)
        (restored,) = await call(ask_as, users, A, helper, {"op": "restore", "images": name, "ids": [sleeper.pid]})
        assert restored["ok"] is False and restored["code"] == "refused", restored
        assert f"core-{sleeper.pid}.img: " in restored["error"] and said in restored["error"], restored
        assert str(sleeper.pid) not in users.run(A, "pgrep", "-u", A, "-x", "sleep").stdout.split()
        assert not (folder / "restore.log").exists(), "refused before CRIU ran"
        assert f"'restore' images='{name}'" in helper.log()


async def test_a_restore_whose_pid_file_is_swapped_signals_nothing_outside_it(world):
    """A user may rewrite restore.pid while CRIU runs (it is their file): the helper takes what the
    restore made from the restore's cgroup, and never signals anything else (here: B's kernel)."""
    users, helper, servers, _ = world
    b_kernel, b_tab = await new_kernel(servers[B])
    b_pid = (await call(servers[B].api, "GET", f"api/gpumigrate/kernels/{b_kernel}"))["pid"]
    folder = helper.images / str(users.uid(A)) / "swapped"
    assert users.run(A, "mkdir", "-m", "700", "-p", str(folder)).returncode == 0
    swapper = subprocess.Popen(
        [*as_user(A), "sh", "-c", f"cd {folder} && while :; do echo {b_pid} > x && mv -f x restore.pid; done"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(3):
            sleeper = sleep_as(A)
            (dumped,) = await call(ask_as, users, A, helper, {"op": "dump", "pid": sleeper.pid, "images": "swapped"})
            sleeper.kill()
            sleeper.wait(timeout=10)
            if dumped["ok"]:
                (restored,) = await call(ask_as, users, A, helper, {"op": "restore", "images": "swapped"})
                assert restored.get("pid") != b_pid, restored
    finally:
        os.killpg(swapper.pid, signal.SIGKILL)
        swapper.wait()
    assert (await b_tab.run("print('b still here')")).strip() == "b still here"
    assert helper.proc.poll() is None


async def test_a_restore_whose_asker_left_is_not_let_run_outside_the_users_cgroup(world):
    """The restored tree runs in the cgroup of the process that asked (the user's server, under the
    user's limits). If that process is gone, there is nowhere to put it: it is killed, not let run
    in the helper's cgroup; or, gone before the helper looked at its namespaces, it is refused before CRIU
    runs at all (the usual case now: the asker here leaves at once)."""
    users, helper, _, _ = world
    folder = helper.images / str(users.uid(A)) / "orphan"
    assert users.run(A, "mkdir", "-m", "700", "-p", str(folder)).returncode == 0
    sleeper = sleep_as(A)
    (dumped,) = await call(ask_as, users, A, helper, {"op": "dump", "pid": sleeper.pid, "images": "orphan"})
    assert dumped["ok"], dumped
    sleeper.wait(timeout=10)
    gone = users.run(A, sys.executable, "-c", (
        "import json, socket\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({str(helper.socket)!r})\n"
        f"s.sendall(json.dumps({{'op': 'restore', 'images': 'orphan', 'ids': [{sleeper.pid}]}}).encode() + b'\\n')\n"))
    assert gone.returncode == 0, gone.stderr
    deadline = time.monotonic() + 30
    while not any(said in helper.log() for said in ("the process that asked is gone",
                                                     "your server's mount namespace cannot be read (it is gone")):
        assert time.monotonic() < deadline, helper.log()[-2000:]
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)
    assert str(sleeper.pid) not in users.run(A, "pgrep", "-u", A, "-x", "sleep").stdout.split()


async def test_the_helper_outlives_malformed_oversized_and_abandoned_requests(world):
    users, helper, _, _ = world
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # says nothing at all
    idle.connect(str(helper.socket))
    started = time.monotonic()
    answers = {
        "not json": await call(helper.request, b"{not json\n"),
        "a list": await call(helper.request, b"[1, 2]\n"),
        "unknown op": await call(helper.request, b'{"op": "launch", "argv": ["sh"]}\n'),
        "bad pid": await call(helper.request, b'{"op": "dump", "pid": "1; reboot", "images": "x"}\n'),
        "bad ids": await call(helper.request, b'{"op": "restore", "images": "x", "ids": "all"}\n'),
        "oversized": await call(helper.request, b'{"op": "hello", "pad": "' + b"x" * 300_000),
    }
    for what, reply in answers.items():
        assert reply is not None and reply["ok"] is False and reply["code"] == "bad-request", (what, reply)
    assert "at most 65536 bytes" in answers["oversized"]["error"]
    # A client that leaves halfway through its request, and one that connects and leaves.
    for raw in (b'{"op": "du', b""):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(helper.socket))
            sock.sendall(raw)
    # A client that leaves while its dump runs: the helper finishes it and stays.
    sleeper = users.run(A, "sh", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null & echo $!")
    pid = int(sleeper.stdout.strip())
    made = users.run(A, "mkdir", "-m", "700", "-p", str(helper.images / str(users.uid(A)) / "gone"))
    assert made.returncode == 0, made.stderr
    leave = users.run(A, sys.executable, "-c", (
        "import json, socket\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({str(helper.socket)!r})\n"
        f"s.sendall(json.dumps({{'op': 'dump', 'pid': {pid}, 'images': 'gone'}}).encode() + b'\\n')\n"
        "s.close()\n"))
    assert leave.returncode == 0, leave.stderr
    # The idle client is dropped after the request timeout, and the helper answers as before.
    idle.settimeout(30)
    assert idle.recv(10) == b""
    idle.close()
    assert time.monotonic() - started >= 9
    hello = await call(ask_as, users, A, helper, {"op": "hello"})
    assert hello[0]["ok"] is True and hello[0]["uid"] == users.uid(A)
    assert helper.proc.poll() is None
    log = helper.log()
    assert "left before the end of its request" in log
    assert "did not arrive" in log  # the idle one
    assert "bad-request" in log
    deadline = time.monotonic() + 30
    while f"'dump' pid={pid}" not in helper.log():
        assert time.monotonic() < deadline, helper.log()[-2000:]
        await asyncio.sleep(0.2)


async def test_doctor_tells_an_ordinary_user_what_an_administrator_must_set_up(world):
    users, helper, _, _ = world
    cli = str(Path(sys.executable).parent / "jupyter-gpumigrate")
    alone = users.run(A, cli, "doctor", "--json", "--helper-socket", "")
    assert alone.returncode != 0
    rows = {c["name"]: c for c in json.loads(alone.stdout)["checks"]}
    assert rows["privileges"]["status"] == "fail"
    assert "node helper" in rows["privileges"]["remedy"] and "setcap cap_checkpoint_restore,cap_setpcap+eip" in \
        rows["privileges"]["remedy"]
    helped = users.run(A, cli, "doctor", "--json", "--helper-socket", str(helper.socket))
    rows = {c["name"]: c for c in json.loads(helped.stdout)["checks"]}
    assert rows["privileges"]["status"] == "ok" and "node helper" in rows["privileges"]["detail"]
    assert rows["helper namespaces"]["status"] == "ok", rows["helper namespaces"]
    assert rows["helper images"]["status"] == "ok" and str(helper.memory) in rows["helper images"]["detail"]
    assert rows["criu check"]["status"] == "ok", rows["criu check"]


async def test_a_user_with_a_criu_given_capabilities_needs_no_helper(world):
    users, helper, _, base = world
    criu = base / "criu-with-capabilities"
    criu.write_bytes(Path("/usr/local/sbin/criu").read_bytes())
    os.chmod(criu, 0o755)
    done = await call(subprocess.run, ["setcap", "cap_checkpoint_restore,cap_setpcap+eip", str(criu)],
                      capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    doctor = users.run(A, str(Path(sys.executable).parent / "jupyter-gpumigrate"), "doctor", "--json",
                       "--criu", str(criu), "--helper-socket", "")
    rows = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert rows["privileges"]["status"] == "ok" and "capabilities" in rows["privileges"]["detail"], rows
    server = UserServer(A, base / "a-caps", {"helper_socket": "", "criu_path": str(criu)}).start()
    try:
        kernel_id, tab = await new_kernel(server)
        await tab.run("import os\ny = [1, 2, 3]")
        assert (await call(server.operate, kernel_id, "suspend"))["status"] == "succeeded"
        images = server.root / "state" / "images" / kernel_id
        assert images.stat().st_uid == users.uid(A) and images.stat().st_mode & 0o077 == 0
        assert all(f.stat().st_mode & 0o077 == 0 for f in images.iterdir())
        assert (await call(server.operate, kernel_id, "resume"))["status"] == "succeeded"
        out = await tab.run("print(sum(y), os.getuid())")
        assert out.split() == ["6", str(users.uid(A))]
    finally:
        server.stop()


@pytest.mark.gpu
async def test_an_ordinary_users_gpu_kernel_moves_between_gpus_and_suspends_through_the_helper(world):
    """As user A: the CUDA checkpoint API as A itself, CRIU through the helper (docs/users.md)."""
    two_gpus()
    users, helper, servers, _ = world
    server = servers[A]
    kernel_id, tab = await new_kernel(server)
    await tab.run("import torch\nx = torch.arange(2**28, device='cuda', dtype=torch.float32)\ns = float(x.sum())",
                  timeout=180)

    def on() -> list[int]:
        return [g["index"] for g in server.api("GET", f"api/gpumigrate/kernels/{kernel_id}")["gpus"]]

    start = (await call(on))[0]
    other = 1 - start
    op = await call(server.operate, kernel_id, "migrate", {"to_gpu": other})
    assert op["status"] == "succeeded", (op, server.server_log())
    assert await call(on) == [other]
    assert (await tab.run("print(float(x.sum()) == s, torch.cuda.current_device())")).split() == ["True", "0"]
    op = await call(server.operate, kernel_id, "suspend")
    assert op["status"] == "succeeded", (op, server.server_log())
    assert op["bytes"] > 2**30
    op = await call(server.operate, kernel_id, "resume", {"to_gpu": start})
    assert op["status"] == "succeeded", (op, server.server_log())
    assert await call(on) == [start]
    out = await tab.run("import os; print(float(x.sum()) == s, torch.cuda.current_device(), os.getuid())")
    assert out.split() == ["True", "0", str(users.uid(A))]
    assert f"uid={users.uid(A)}({A})" in helper.log()


@pytest.fixture(scope="module")
def hosts_of_a_user(world):
    """User A's servers on two hosts (tests/hosts.py's network namespaces), each host with a node helper of its
    own in its namespace, as a cluster's machines each have theirs (a's with images in memory too, b's on disk
    only). A's key and certificate are A's."""
    from hosts import Network, host_pair

    users, _, _, base = world
    root = base / "hosts"
    root.mkdir(mode=0o755)
    net = Network(20 + (os.getpid() + 101) % 200).up()
    memory_a = root_only_folder("gm-users-memory-a-") / "memory"
    hosts, helpers = [], []
    try:
        a, b = hosts = list(host_pair(net, root))
        pw = pwd.getpwnam(A)
        os.chown(a.key, pw.pw_uid, pw.pw_gid)
        for host in hosts:  # a's helper keeps images in memory too, b's on disk only
            folder = root / f"{host.name}-helper"
            folder.mkdir(mode=0o755)
            memory = memory_a if host is a else None
            helpers.append(NodeHelper(folder, ns=host.ns, memory=memory))
            host.user = A
            host.extra = {"MigratableProvisioner": {"helper_socket": str(helpers[-1].socket), "suspend_to": "auto"}}
        a.start({"b": b.peer_entry()})
        b.start({"a": a.peer_entry()})
        yield a, b, helpers
    finally:
        for host in hosts:
            host.stop()
        for helper in helpers:
            helper.stop()
        subprocess.run(["umount", "--lazy", str(memory_a)], capture_output=True)
        remove(memory_a.parent)
        net.close()


async def test_an_ordinary_users_kernel_moves_to_another_host_and_home_through_each_hosts_helper(world,
                                                                                                 hosts_of_a_user):
    """docs/users.md: a move to another host goes through the helper on each host, for that host's images. A's
    kernel, on A's server of host a, goes to A's server of host b and comes home: each dump and restore by
    the helper of the host it runs on, the images A's alone, the kernel A's process with all its state."""
    from hosts import Host

    users = world[0]
    a, b, (helper_a, helper_b) = hosts_of_a_user
    uid = pwd.getpwnam(A).pw_uid

    async def tab_of(host: Host, kernel_id: str) -> WebSocketTab:
        request = HTTPRequest(f"wss://{host.ip}:8888/api/kernels/{kernel_id}/channels",
                              headers={"Authorization": f"token {host.token}"}, ca_certs=str(host.cert))
        return WebSocketTab(await websocket_connect(request))

    kernel_id = (await call(a.api, "POST", "api/kernels", {"name": "python3"}))["id"]
    tab = await tab_of(a, kernel_id)
    try:
        where = ("import os, subprocess\nprint(os.getuid(), subprocess.run(['ip', '-4', '-o', 'addr', 'show', "
                 "'eth0'], capture_output=True, text=True).stdout.split()[3])")
        await tab.run("import itertools, hashlib\ncount = itertools.count(41)\nnext(count)\n"
                      "blob = bytes(range(256)) * 400_000\nbefore = hashlib.sha256(blob).hexdigest()")
        assert (await tab.run(where)).split() == [str(uid), f"{a.ip}/24"]

        op = await call(a.operate, kernel_id, "migrate", {"to_host": "b"})
        assert op["status"] == "succeeded", (op.get("failed_phase"), op.get("error"), helper_a.log()[-2000:],
                                             helper_b.log()[-2000:])
        assert (await tab.run(where)).split() == [str(uid), f"{b.ip}/24"]
        pid = int((await tab.run("print(os.getpid())")).strip())
        assert os.stat(f"/proc/{pid}").st_uid == uid
        # Each helper did its own host's part, for A.
        assert f"uid={uid}({A})" in helper_a.log() and "'dump' pid=" in helper_a.log()
        assert f"uid={uid}({A})" in helper_b.log() and "'restore' images=" in helper_b.log()

        op = await call(a.operate, kernel_id, "migrate", {"to_host": "a"})
        assert op["status"] == "succeeded", (op.get("failed_phase"), op.get("error"), helper_a.log()[-2000:],
                                             helper_b.log()[-2000:])
        assert (await tab.run(where)).split() == [str(uid), f"{a.ip}/24"]
        out = await tab.run("print(next(count), hashlib.sha256(blob).hexdigest() == before)")
        assert out.split() == ["42", "True"]
        assert "'dump' pid=" in helper_b.log() and "'restore' images=" in helper_a.log()
        # a's images went to memory (its helper keeps them there), b's to disk (its helper keeps none there).
        assert re.search(r"'dump' pid=\d+ images='images-\w+/[\w-]+' place='memory'", helper_a.log()), helper_a.log()
        assert "place=" not in helper_b.log()
        # Neither host keeps a copy of the kernel's memory (CRIU's logs aside), and what folders are left are A's.
        for folder in (helper_a.images, helper_a.memory, helper_b.images):
            left = [p for p in (folder / str(uid)).rglob("*") if ".logs" not in p.parts]
            assert not [p for p in left if not p.is_dir()], left
            assert all(p.stat().st_uid == uid and p.stat().st_mode & 0o077 == 0 for p in left), left
        (refused,) = await call(ask_as, users, A, helper_b, {"op": "restore", "images": "images/x", "place": "memory"},
                                netns=b.ns)
        assert refused["code"] == "refused" and "keeps no images in memory" in refused["error"], refused
        # doctor, run where b's server runs, says so (and that b's helper shares its namespaces).
        rows = await call(doctor_in, b.ns, A, helper_b)
        assert rows["helper namespaces"]["status"] == "ok", rows["helper namespaces"]
        assert rows["helper images"]["status"] == "info" and "--memory-root" in rows["helper images"]["detail"]
    finally:
        tab.ws.close()
        await call(a.api, "DELETE", f"api/kernels/{kernel_id}")


async def test_a_helper_in_other_namespaces_than_the_users_kernel_or_server_refuses_it_saying_so(world,
                                                                                                hosts_of_a_user):
    """The helper (world's, in this machine's namespaces) is asked by A about processes in host a's network
    namespace (a kernel under a container's or a sandboxed unit's namespaces): CRIU would carry the
    namespaces that differ, or restore into the helper's own, so the helper refuses, saying which and what to
    do, and the process runs on untouched."""
    users, helper, _, _ = world
    a, _, _ = hosts_of_a_user
    netns_only = subprocess.Popen(["nsenter", f"--net=/run/netns/{a.ns}", *as_user(A), "setsid", "sleep", "300"],
                                  cwd="/", stdin=subprocess.DEVNULL)
    mounts_too = subprocess.Popen(["ip", "netns", "exec", a.ns, *as_user(A), "setsid", "sleep", "300"], cwd="/",
                                  stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while any(os.stat(f"/proc/{p.pid}").st_uid != users.uid(A) for p in (netns_only, mounts_too)):
            assert time.monotonic() < deadline, "the sleeps did not become A's"
            time.sleep(0.05)
        replies = await call(ask_as, users, A, helper, {"op": "dump", "pid": netns_only.pid, "images": "images/ns1"},
                             {"op": "dump", "pid": mounts_too.pid, "images": "images/ns2"})
        assert [r["code"] for r in replies] == ["refused", "refused"], replies
        assert f"process {netns_only.pid} is in another network namespace than the node helper" in replies[0]["error"]
        assert f"process {mounts_too.pid} is in another mount namespace than the node helper" in replies[1]["error"]
        assert all("run the helper in the same mount, network and PID namespaces" in r["error"] for r in replies)
        (restore,) = await call(ask_as, users, A, helper, {"op": "restore", "images": "images/ns1"}, netns=a.ns)
        assert restore["code"] == "refused" and "your server is in another network namespace" in restore["error"]
        assert netns_only.poll() is None and mounts_too.poll() is None
        assert not (helper.images / str(users.uid(A)) / "images" / "ns1").exists()
        # A's doctor, run where that server would run, says it before any suspend.
        row = (await call(doctor_in, a.ns, A, helper))["helper namespaces"]
        assert row["status"] == "fail" and "this process is in another network namespace" in row["detail"], row
        assert "same mount, network and PID namespaces" in row["remedy"], row
    finally:
        for proc in (netns_only, mounts_too):
            proc.kill()
            proc.wait()


def holding(n: int) -> str:
    """A cell that makes the kernel hold ``n`` x 256 bytes, with ``x`` and the bytes' digest (see :data:`WHOLE`)."""
    return f"import hashlib\nblob = bytes(range(256)) * {n}\nx = 41\nbefore = hashlib.sha256(blob).hexdigest()"


#: a cell that prints "42 True" where the kernel made by :func:`holding` kept its state
WHOLE = "print(x + 1, hashlib.sha256(blob).hexdigest() == before)"


#: a cell that makes the kernel hold 300 MB in a memfd it does not map: images its resident size does not show
MEMFD = "import os\nchunk = os.urandom(1 << 20)\nfd = os.memfd_create('held')\nfor _ in range(300): os.write(fd, chunk)"
#: a cell that prints "True 300" where the memfd of :data:`MEMFD` came back whole
MEMFD_WHOLE = "os.lseek(fd, 0, 0)\nprint(os.read(fd, 1 << 20) == chunk, os.fstat(fd).st_size >> 20)"


async def is_whole(tab: WebSocketTab) -> bool:
    return (await tab.run(WHOLE)).split() == ["42", "True"]


class HelperGoes:
    """A helper of its own, and A's server on it, for a test that kills the helper mid-run: a kernel holding
    1 GB of bytes (CRIU writes them: a run long enough to be caught), its tab, its PID."""


    def __init__(self, base: Path, name: str, enter: tuple[str, ...] = ()) -> None:
        self.folder = base / f"gone-{name}"
        self.folder.mkdir(mode=0o755)
        self.enter = enter  # the namespaces the helper and the server run in (nsenter ...), where given
        self.helper = NodeHelper(self.folder, enter=enter)
        self.server = UserServer(A, base / f"a-gone-{name}", {"helper_socket": str(self.helper.socket),
                                                              "suspend_to": "disk"}, enter=enter).start()
        self.kernel_id: str | None = None

    async def kernel(self) -> tuple[str, WebSocketTab, int]:
        self.kernel_id, tab = await new_kernel(self.server)
        await tab.run(holding(4_000_000))
        return self.kernel_id, tab, (await call(self.server.api, "GET", f"api/gpumigrate/kernels/{self.kernel_id}"))["pid"]

    def goes_while(self, criu: int) -> None:
        """SIGKILL the helper while ``criu``, a CRIU it started, is held mid-run (SIGSTOPped; the caller says
        what becomes of it)."""
        os.kill(criu, signal.SIGSTOP)
        self.helper.proc.kill()
        self.helper.proc.wait(timeout=30)

    async def ended(self, op: dict) -> dict:
        deadline = time.monotonic() + 150  # within pytest's timeout: a plan that never ends says what it waits for
        while op["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, (op, self.server.server_log(), processes())
            await asyncio.sleep(0.2)
            op = await call(self.server.api, "GET", f"api/gpumigrate/operations/{op['id']}")
        return op

    def next_helper(self) -> None:
        """The next helper, on the same socket, as systemd restarts it (the dead one's socket goes first: the
        next unlinks it too, but it is waited for by its socket)."""
        self.helper.stop()
        self.helper.socket.unlink()
        self.helper = NodeHelper(self.folder, enter=self.enter)

    async def close(self) -> None:
        if self.kernel_id is not None:
            with contextlib.suppress(AssertionError, OSError):
                await call(self.server.api, "DELETE", f"api/kernels/{self.kernel_id}")
        self.server.stop()
        self.helper.stop()


def processes() -> str:
    """What runs now, with each process's state, parent and cgroup (for an assertion's message)."""
    return subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:20,cgroup:60,args"], capture_output=True,
                          text=True).stdout[-6000:]


def stopped_like_a_criu_child(user: str, pid: int, criu: int) -> subprocess.Popen:
    """A stand-in for the child a CRIU forks as it starts, which stops itself until CRIU has looked at it (CRIU
    gone, it waits stopped for good): a process of ``user`` named criu, lent what CRIU is lent, in the cgroup of
    ``criu`` (the CRIU dumping ``pid``), naming that dump, stopped. The real one is caught only now and then
    (CRIU must be held in the moments it lives); this one, every run."""
    child = subprocess.Popen(["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups",
                              "--inh-caps=+checkpoint_restore", "--ambient-caps=+checkpoint_restore", "--",
                              sys.executable, "-c", "import ctypes, os, signal\nctypes.CDLL(None).prctl(15, b'criu', 0, 0, 0)\n"
                              "os.kill(os.getpid(), signal.SIGSTOP)", "dump", "--tree", str(pid)])
    path = next(line for line in Path(f"/proc/{criu}/cgroup").read_text().splitlines() if line.startswith("0::"))
    (cgroups.mount_point() / path[3:].lstrip("/") / "cgroup.procs").write_text(str(child.pid))
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/comm").read_text().strip() != "criu" or (
            Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "T":
        assert time.monotonic() < deadline, "the stand-in of CRIU's probe child did not stop"
        time.sleep(0.01)
    return child


def seized(pid: int, timeout: float = 60) -> None:
    """Wait until process ``pid`` is seized by a tracer (a CRIU dumping it)."""
    deadline = time.monotonic() + timeout
    while "TracerPid:\t0\n" in Path(f"/proc/{pid}/status").read_text():
        assert time.monotonic() < deadline, f"nothing seized process {pid}"
        time.sleep(0.001)


@pytest.mark.parametrize("criu", ["outlives it", "outlives it, hidden by /proc", "dies with it",
                                  "dies, its probe child stopped", "dies, its probe child stopped, hidden by /proc"])
async def test_the_helper_killed_while_its_criu_dumps_a_kernel_loses_nothing(world, criu):
    """The helper SIGKILLed (or restarted: its unit's KillMode=process leaves its children) while the CRIU it
    started dumps a kernel. That CRIU runs on without it: the server waits for it (in the helper's cgroup of
    the run: whatever /proc hides), and goes by what it did (its images complete: the kernel is suspended, and
    resumes through the next helper), not by the helper's going, which said nothing (it took it for a failed
    dump, and CRIU then killed the kernel it said ran on). Where /proc hides that CRIU from its user
    (hidepid=2: a process with capabilities its user lacks) it is waited for all the same. A CRIU killed with
    the helper leaves the kernel running, untouched; the child it left stopped is not waited for (the server
    waited an hour, its CRIU timeout): killed by the server, or, where /proc hides it, by the next helper."""
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context(proc_hiding_others()) if "hidden" in criu else ()
        await helper_killed_mid_dump(world[3], criu, enter)


async def helper_killed_mid_dump(base: Path, criu: str, enter: tuple[str, ...]) -> None:
    gone = HelperGoes(base, re.sub(r"\W+", "-", criu), enter)
    server = gone.server
    probe = dumper = None
    try:
        kernel_id, tab, pid = await gone.kernel()
        op = await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
        dumper = await call(criu_running, "dump", "--tree", str(pid))
        if enter:  # the server's user cannot see it there
            peek = subprocess.run([*enter, *as_user(A), "cat", f"/proc/{dumper}/cmdline"], capture_output=True)
            assert peek.returncode != 0 and b"No such file" in peek.stderr, peek
        if criu.startswith("outlives it"):
            await call(seized, pid)  # held once it holds the kernel: the server must wait for it, seen or not
        if "probe" in criu:
            os.kill(dumper, signal.SIGSTOP)  # held while its stand-in child appears
            probe = await call(stopped_like_a_criu_child, A, pid, dumper)
        gone.goes_while(dumper)
        if criu.startswith("outlives it"):
            await asyncio.sleep(QUIET + 1)  # longer than the server would wait for a CRIU it cannot see
            os.kill(dumper, signal.SIGCONT)
        else:
            os.kill(dumper, signal.SIGKILL)
        dumper = None
        if "hidden" in criu and "probe" in criu:
            gone.next_helper()  # the server cannot see the stopped child: the next helper kills it
            op = await gone.ended(op)
            assert "holds only stopped CRIUs" in gone.helper.log(), gone.helper.log()
        else:
            op = await gone.ended(op)
            gone.next_helper()
        view = await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        if criu.startswith("outlives it"):
            assert op["status"] == "succeeded" and view["state"] == "suspended", (op, server.server_log())
            op = await call(server.operate, kernel_id, "resume")
            assert op["status"] == "succeeded", (op, server.server_log())
        else:
            assert op["status"] == "failed" and op["failed_phase"] == "dump", op
            assert "runs on, unchanged" in op["error"] and view["state"] == "running" and view["pid"] == pid, op
            # its log, or none yet (caught as it began)
            assert "the node helper went during the dump" in op["error"] or "No log of its CRIU" in op["error"], op
        if probe is not None:
            assert await call(probe.wait, timeout=30) == -signal.SIGKILL  # killed, not waited for
            if "hidden" not in criu:
                assert f"killed process {probe.pid}: a CRIU stopped, its helper gone" in server.server_log()
        assert await is_whole(tab)
        tab.ws.close()
    finally:
        if dumper is not None:  # a test failing midway leaves nothing stopped behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(dumper, signal.SIGKILL)
        if probe is not None and probe.poll() is None:
            probe.kill()
            probe.wait()
        await gone.close()


async def test_a_server_whose_helper_went_waits_only_for_the_dump_of_its_own_kernel(world):
    """What a server waits for (and may kill) once its helper went mid-dump is that dump's CRIU: the helper's
    cgroup of each dump is named by the tree's PID, so another dump of the same user (another server of
    theirs) is neither waited for nor killed. Read here as the user's server reads it, while a dump is held;
    a dump cgroup named as older helpers did (without the tree) counts for every tree of its user."""
    users, helper, servers, _ = world
    server = servers[A]
    kernel_id, tab = await new_kernel(server)
    await tab.run(holding(400_000))
    pid = (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
    other = subprocess.Popen([*as_user(A), "sleep", "300"], cwd="/", env=user_env(A), start_new_session=True)
    dumper = legacy = None
    try:
        op = await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
        dumper = await call(criu_running, "dump", "--tree", str(pid))
        os.kill(dumper, signal.SIGSTOP)
        script = ("import json, sys\nfrom jupyter_gpumigrate.engine.nodehelper.client import HelperCriu\n"
                  f"criu = HelperCriu({str(helper.socket)!r})\n"
                  "print(json.dumps([criu.runs_by_pid, str(criu.runs), *(criu.dump_runs(int(p)) for p in sys.argv[1:])]))\n")

        def read() -> list:
            done = subprocess.run([*as_user(A), sys.executable, "-c", script, str(pid), str(other.pid)],
                                  env=user_env(A), cwd="/", capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        by_pid, runs, of_kernel, of_other = read()
        assert by_pid is True and dumper in of_kernel and of_other == [], (of_kernel, of_other)
        # A dump's cgroup named as older helpers did (left by one upgraded mid-dump): it may be any tree's
        legacy = Path(runs) / f"gpumigrate-1-1-{users.uid(A)}-dump"
        legacy.mkdir()
        (legacy / "cgroup.procs").write_text(str(other.pid))
        _, _, of_kernel, of_other = read()
        assert other.pid in of_kernel and other.pid in of_other and dumper not in of_other, (of_kernel, of_other)
        os.kill(dumper, signal.SIGCONT)
        dumper = None
        while op["status"] not in ("succeeded", "failed"):
            op = await call(server.api, "GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
        assert op["status"] == "succeeded", (op, server.server_log())
        assert (await call(server.operate, kernel_id, "resume"))["status"] == "succeeded"
        assert await is_whole(tab)
        tab.ws.close()
    finally:
        if dumper is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(dumper, signal.SIGCONT)
        other.kill()
        other.wait()
        if legacy is not None:
            legacy.rmdir()
        with contextlib.suppress(AssertionError, OSError):
            await call(server.api, "DELETE", f"api/kernels/{kernel_id}")


def collected(pid: int) -> bool:
    """Whether process ``pid`` is gone, its PID free again: a zombie of this process (a subreaper in the whole
    suite's run: the helper's orphans come here) is collected here; PID 1 collects its own."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    return not Path(f"/proc/{pid}").exists()


async def test_the_helper_killed_while_its_criu_restores_a_kernel_loses_nothing(world):
    """The helper SIGKILLed while the CRIU it started restores a kernel: the tree CRIU makes waits, stopped, for
    the helper's check, which never comes. The resume fails, saying so, with the images kept; the next helper
    kills that tree as it starts (it never ran), and the resume asked again brings the kernel back whole."""
    gone = HelperGoes(world[3], "restore")
    server = gone.server
    try:
        kernel_id, tab, pid = await gone.kernel()
        op = await call(server.operate, kernel_id, "suspend")
        assert op["status"] == "succeeded", (op, server.server_log())
        op = await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/resume", {}, expect=202)
        restorer = await call(criu_running, "restore")
        gone.goes_while(restorer)
        forked = Path(f"/proc/{pid}").exists()  # caught that late, the resume's own rollback kills what it made
        op = await gone.ended(op)
        assert op["status"] == "failed" and "did it restart?" in op["error"], op
        assert (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["state"] == "suspended"
        os.kill(restorer, signal.SIGCONT)  # it finishes without the helper: the tree it made waits, stopped
        await call(subprocess.run, ["sh", "-c", f"while [ -e /proc/{restorer} ] && ! grep -q '^State:.*Z' "
                                               f"/proc/{restorer}/status; do sleep 0.1; done"], timeout=120)
        gone.next_helper()  # it kills the tree left stopped
        assert forked or "an earlier helper's restore, still holds processes" in gone.helper.log()
        deadline = time.monotonic() + 60
        while not collected(pid):
            assert time.monotonic() < deadline, f"process {pid} of the tree left stopped is still there"
            await asyncio.sleep(0.1)
        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op.get("failed_phase"), op.get("error"), server.server_log()[-2000:])
        assert await is_whole(tab)
        tab.ws.close()
    finally:
        await gone.close()


@pytest.mark.parametrize("asked", ["memory", "auto"])
async def test_the_helpers_memory_filling_while_its_criu_dumps_a_kernel_loses_nothing(world, asked):
    """The helper's tmpfs fills while its CRIU writes a kernel's images into memory (another user's dump, say:
    the helper's room check is an estimate at request time). CRIU fails on the full tmpfs, the kernel runs on
    with its state and its process, and nothing of the failed images stays in memory. Asked for memory (the
    tmpfs filled as CRIU starts), the suspend says memory was full and how to go to disk; once there is room
    again, it suspends to memory and resumes whole. Asked for auto (the default, and the idle policy's; the
    tmpfs filled in the midst of CRIU's writes, by a memfd of the kernel's that its resident size, which
    the room checks read, does not show), it goes to disk instead, saying why, and resumes whole."""
    users, _, _, base = world
    folder = base / f"fills-{asked}"
    folder.mkdir(mode=0o755)
    memory = root_only_folder("gm-users-memory-fills-") / "memory"
    helper = NodeHelper(folder, memory=memory, memory_size="384m")
    server = UserServer(A, base / f"a-fills-{asked}", {"helper_socket": str(helper.socket)}).start()
    kernel_id = dumper = None
    filler = memory / "filler"
    try:
        kernel_id, tab = await new_kernel(server)
        await tab.run(holding(400_000))
        if asked == "auto":
            await tab.run(MEMFD)
        pid = (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        op = await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {"images": asked},
                        expect=202)
        if asked == "memory":
            dumper = await call(criu_running, "dump", "--tree", str(pid))
            os.kill(dumper, signal.SIGSTOP)
            fill = subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True, text=True)
            assert "No space left on device" in fill.stderr, fill.stderr
            os.kill(dumper, signal.SIGCONT)
            dumper = None
        deadline = time.monotonic() + 120
        while op["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, op
            await asyncio.sleep(0.2)
            op = await call(server.api, "GET", f"api/gpumigrate/operations/{op['id']}")
        in_memory = memory / str(users.uid(A)) / f"images-{state_digest(server)}" / kernel_id
        if asked == "auto":
            assert op["status"] == "succeeded" and op["images"] == "disk", (op, server.server_log())
            assert op["images_why"] == f"{FILLED} in {in_memory.parent}; written to disk instead", op
            assert not in_memory.exists()
            op = await call(server.operate, kernel_id, "resume")
            assert op["status"] == "succeeded", (op, server.server_log())
            assert await is_whole(tab)
            assert (await tab.run(MEMFD_WHOLE)).split() == ["True", "300"]
            tab.ws.close()
            return
        assert op["status"] == "failed" and op["failed_phase"] == "dump", (op, server.server_log())
        said = op["error"]
        assert "(a tmpfs) is full" in said and "Suspend to disk instead" in said and "runs on, unchanged" in said, said
        view = await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}")
        assert view["state"] == "running" and view["pid"] == pid, view
        assert not in_memory.exists()
        assert await is_whole(tab)
        filler.unlink()
        op = await call(server.operate, kernel_id, "suspend", {"images": "memory"})
        assert op["status"] == "succeeded" and op["images"] == "memory", (op, server.server_log())
        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op, server.server_log())
        assert await is_whole(tab)
        tab.ws.close()
    finally:
        if dumper is not None:  # a test failing midway leaves no CRIU stopped (holding the tmpfs) behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(dumper, signal.SIGKILL)
        filler.unlink(missing_ok=True)
        if kernel_id is not None:
            with contextlib.suppress(AssertionError, OSError):
                await call(server.api, "DELETE", f"api/kernels/{kernel_id}")
        server.stop()
        helper.stop()
        subprocess.run(["umount", "--lazy", str(memory)], capture_output=True)
        remove(memory.parent)


async def end_killed(server: UserServer, kernel_id: str | None, held: int | None) -> None:
    """The end of a test that kills a user's server mid-run: the CRIU it held stopped, if it failed before
    letting it go (none is left stopped), is killed; the kernel is shut down and the server stopped."""
    if held is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(held, signal.SIGKILL)
    if kernel_id is not None and server.proc is not None and server.proc.poll() is None:
        with contextlib.suppress(AssertionError, OSError):
            await call(server.api, "DELETE", f"api/kernels/{kernel_id}")
    server.stop()


@pytest.mark.parametrize("place,then", [("disk", "after the dump"), ("memory", "after the dump"),
                                        ("disk", "while the dump runs")])
async def test_a_users_server_killed_while_the_helper_dumps_its_kernel_loses_nothing(world, place, then):
    """A's server SIGKILLed (a Hub's cull or a crash) while the helper's CRIU dumps A's kernel: that CRIU is the
    helper's, not the server's, and runs on to the end (it kills the kernel, its images whole). The next server
    completes the images from the manifest written before the dump, says the kernel is suspended, and resumes
    it through the helper with all its state. (Until 2026-11-30 it refused them as a dump that did not finish:
    it looked for CRIU's log where a server that runs CRIU itself keeps it, not in the folder, where the
    helper's CRIU writes it.) Started while that dump still runs (the user back at once), it waits for the
    dump to end before it judges the folder: it removed it under the running CRIU, a reviewer found."""
    users, helper, _, base = world
    server = UserServer(A, base / f"a-killed-{place}-{then.split()[0]}", {"helper_socket": str(helper.socket),
                                                                         "suspend_to": place}).start()
    kernel_id = held = None
    try:
        kernel_id, tab = await new_kernel(server)
        await tab.run(holding(4_000_000))
        tab.ws.close()
        pid = (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/suspend", {}, expect=202)
        held = dumper = await call(criu_running, "dump", "--tree", str(pid))
        if then == "while the dump runs":
            await call(seized, pid)
        os.kill(dumper, signal.SIGSTOP)  # held until the server is gone (and, while it runs, the next one is up)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        if then == "while the dump runs":
            server.start()
            folder = helper.images / str(users.uid(A)) / "images" / kernel_id
            deadline = time.monotonic() + 30
            while "waiting for the dump to end" not in server.server_log():
                assert time.monotonic() < deadline, server.server_log()
                await asyncio.sleep(0.2)
            await asyncio.sleep(1)
            assert folder.is_dir(), "the folder of a dump that runs was removed"
        os.kill(dumper, signal.SIGCONT)
        held = None
        deadline = time.monotonic() + 120
        while not collected(dumper) or not collected(pid):  # the dump ends, and the kernel's PID is free again
            assert time.monotonic() < deadline, f"CRIU {dumper} or the kernel {pid} is still there"
            await asyncio.sleep(0.1)
        view = await restarted(server, kernel_id, start=then == "after the dump")
        assert view["state"] == "suspended" and view["images"] == place, (view, server.server_log())
        assert "completed the images of kernel" in server.server_log()
        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op.get("failed_phase"), op.get("error"), server.server_log()[-2000:])
        tab = await open_tab(server, kernel_id)
        assert await is_whole(tab)
        tab.ws.close()
    finally:
        await end_killed(server, kernel_id, held)


def processes_of(user: str) -> dict[int, str]:
    """Every process of ``user`` now, and its state (R, S, T, Z...)."""
    uid, found = pwd.getpwnam(user).pw_uid, {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                found[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
    return found


async def test_a_users_server_killed_while_the_helper_restores_its_kernel_loses_nothing(world):
    """A's server SIGKILLed while the helper's CRIU restores A's kernel: the helper finds its asker gone and does
    not hand the tree over (it kills it), so the images stay. The next server says the kernel is suspended, a
    resume brings it back whole, and no process of the cut restore is left."""
    _, helper, _, base = world
    server = UserServer(A, base / "a-killed-restore", {"helper_socket": str(helper.socket)}).start()
    kernel_id = held = None
    try:
        kernel_id, tab = await new_kernel(server)
        await tab.run(holding(1_600_000))
        tab.ws.close()
        op = await call(server.operate, kernel_id, "suspend")
        assert op["status"] == "succeeded", (op, server.server_log())
        others = set(processes_of(A)) - {server.proc.pid}  # world's servers of A, and what they run
        logged = len(helper.log())
        await call(server.api, "POST", f"api/gpumigrate/kernels/{kernel_id}/resume", {}, expect=202)
        held = restorer = await call(criu_running, "restore")
        os.kill(restorer, signal.SIGSTOP)  # held until the server is gone
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        os.kill(restorer, signal.SIGCONT)
        held = None
        deadline = time.monotonic() + 120
        while not collected(restorer):
            assert time.monotonic() < deadline, f"CRIU {restorer} is still there"
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + 60  # the helper says how the restore ended once it has cleaned up
        while "'restore' images=" not in helper.log()[logged:]:
            assert time.monotonic() < deadline, helper.log()[-2000:]
            await asyncio.sleep(0.1)
        assert "refused: the process that asked is gone" in helper.log()[logged:], helper.log()[logged:]
        view = await restarted(server, kernel_id)
        assert view["state"] == "suspended", (view, server.server_log())
        deadline = time.monotonic() + 60  # what the helper killed is collected (by it, PID 1 or us)
        while set(processes_of(A)) - others - {server.proc.pid}:
            assert time.monotonic() < deadline, (processes_of(A), others)
            for pid in set(processes_of(A)) - others:
                collected(pid)
            await asyncio.sleep(0.1)
        op = await call(server.operate, kernel_id, "resume")
        assert op["status"] == "succeeded", (op.get("failed_phase"), op.get("error"), server.server_log()[-2000:])
        tab = await open_tab(server, kernel_id)
        assert await is_whole(tab)
        tab.ws.close()
        kernel = (await call(server.api, "GET", f"api/gpumigrate/kernels/{kernel_id}"))["pid"]
        left = {p: s for p, s in processes_of(A).items() if p not in others and p != server.proc.pid and p != kernel}
        assert all(s not in ("T", "t") for s in left.values()), f"stopped processes left: {left}"
    finally:
        await end_killed(server, kernel_id, held)
