"""Helpers shared by the tests: REST calls, kernel clients, a notebook tab over websocket, PID holders."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_client.session import Session


def rest(base_url: str, token: str, method: str, path: str, body: Any = None, expect: int | None = None,
         headers: dict[str, str] | None = None, context: Any = None) -> Any:
    """A blocking REST call to a server run as a process of its own; asserts ``expect`` if given, else
    success; the decoded JSON."""
    data = json.dumps(body).encode() if body is not None else (b"" if method in ("POST", "PUT") else None)
    req = urllib.request.Request(base_url + path, data=data, method=method)
    req.add_header("Authorization", f"token {token}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=120, context=context) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
        if expect is None:
            raise AssertionError(f"{method} {path}: {status} {raw[:500]!r}") from None
    if expect is not None:
        assert status == expect, f"{method} {path}: {status} {raw[:500]!r}"
    return json.loads(raw) if raw else None


def two_gpus() -> list:
    """The GPUs, or a skip saying why: a test that moves a kernel between two GPUs of one model needs them."""
    from jupyter_gpumigrate.engine import gpus as gpus_mod
    import pytest

    gpus = gpus_mod.snapshot()
    if len(gpus) < 2 or gpus[0].name != gpus[1].name:
        pytest.skip(f"needs two GPUs of the same model (nvidia-h200-x2); this machine has {len(gpus)}")
    return gpus


def operate_on(server: Any, kernel_id: str, action: str, body: dict | None = None, timeout: float = 180) -> dict:
    """An operation on a server run as a process (``api``), followed to its end by long polls."""
    op = server.api("POST", f"api/gpumigrate/kernels/{kernel_id}/{action}", body or {}, expect=202)
    deadline = time.monotonic() + timeout
    while op["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, op
        op = server.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
    return op


def wait_answering(server: Any, timeout: float = 60) -> None:
    """Wait until a server started as a process (``proc``, ``api``, ``server_log``) answers GET api/status."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            server.api("GET", "api/status")
            return
        except (OSError, urllib.error.URLError):
            assert server.proc.poll() is None, server.server_log()
            assert time.monotonic() < deadline, server.server_log()
            time.sleep(0.2)


async def api(jp_fetch: Any, *parts: str, method: str = "GET", body: Any = None, expect: int = 200,
              params: dict | None = None) -> Any:
    """Call /api/gpumigrate/...; assert the status; return the decoded JSON."""
    kwargs: dict[str, Any] = {"method": method, "raise_error": False, "params": params}
    if method == "POST":
        kwargs["body"] = body if isinstance(body, str) else json.dumps(body or {})
    response = await jp_fetch("api", "gpumigrate", *parts, **kwargs)
    text = response.body.decode() if response.body else ""
    assert response.code == expect, f"{method} {'/'.join(parts)}: {response.code} {text}"
    return json.loads(text) if text else None


async def start_kernel(jp_fetch: Any, name: str = "python3") -> str:
    response = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": name}))
    return json.loads(response.body)["id"]


async def ready_kernel(jp_fetch: Any, serverapp: Any) -> KernelSession:
    """A new kernel started through the REST API, ready, with a client: a test's starting point.

    A kernel that dies before its first reply is started once more, with a warning that says how it ended:
    jupyter_client picks the kernel's ports by binding port 0 and closing it, and until the kernel binds
    them another process may take one (an outgoing connection's local port, on a machine whose PIDs and
    ports are busy with a whole suite). Any other failure, or a second death, fails the test."""
    for attempt in (1, 2):
        kernel_id = await start_kernel(jp_fetch)
        session = KernelSession(serverapp, kernel_id)
        try:
            await session.ready()
        except RuntimeError as exc:
            session.close()
            if attempt == 2 or "died before replying" not in str(exc):
                raise
            provisioner = session.manager.provisioner
            process = getattr(provisioner, "process", None)
            code = process.poll() if process is not None else None
            # Its own words (the provisioner keeps the kernel's stdout and stderr in a log), for the next time.
            log_path = getattr(provisioner, "log_path", None)
            try:
                said = log_path.read_text(errors="replace")[-1500:].strip() if log_path else ""
            except OSError:
                said = ""
            warnings.warn(f"kernel {kernel_id} died as it started (exit status {code}); started another. Its "
                          f"log ({log_path}) ends: {said or '(empty)'}", stacklevel=2)
            await jp_fetch("api", "kernels", kernel_id, method="DELETE", raise_error=False)  # not restarted
            continue
        session.id = kernel_id  # type: ignore[attr-defined]
        return session
    raise AssertionError("unreachable")


async def restarted(serverapp: Any, kernel_id: str, pid: int, timeout: float = 60) -> None:
    """Wait until Jupyter's restarter has started the kernel whose process ``pid`` died again, and the new one
    answers; fail the test otherwise. A test whose kernel died must end this way: the restarter polls every
    few seconds, and a restart still in flight when the in-process server is cleaned up leaves the kernel
    manager's ``ready`` future pending, which makes jupyter_client's ``shutdown_kernel`` raise
    ``InvalidStateError`` in the teardown (and every later in-process test's teardown with it)."""
    manager = serverapp.kernel_manager.get_kernel(kernel_id)
    deadline = time.monotonic() + timeout
    while not (manager.provisioner is not None and manager.provisioner.pid not in (None, pid)
               and manager.ready.done()):
        assert time.monotonic() < deadline, f"the kernel whose process {pid} died was not restarted in {timeout} s"
        await asyncio.sleep(0.1)
    assert manager.ready.exception() is None, f"the restart failed: {manager.ready.exception()}"
    session = KernelSession(serverapp, kernel_id, own_identity=True)
    try:
        await session.ready(timeout=max(deadline - time.monotonic(), 10))
        assert (await session.run("print(6 * 7)")).strip() == "42"
    finally:
        session.close()


async def notebook(jp_fetch: Any, jp_ws_fetch: Any, serverapp: Any) -> tuple[str, WebSocketTab]:
    """A new kernel, ready, and a notebook tab on it (the server's WebSocket)."""
    session = await ready_kernel(jp_fetch, serverapp)
    kernel_id = session.id  # type: ignore[attr-defined]
    session.close()
    return kernel_id, WebSocketTab(await jp_ws_fetch("api", "kernels", kernel_id, "channels"))


async def wait_operation(jp_fetch: Any, op: dict, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while op["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"operation still {op['status']} after {timeout} s: {op}"
        await asyncio.sleep(0.05)
        op = await api(jp_fetch, "operations", op["id"])
    return op


async def server_sees_idle(jp_fetch: Any, kernel: Any, timeout: float = 30) -> None:
    """Wait until the server, not only our client, has seen the kernel go idle: it hears the kernel's
    last "idle" a moment later, and a move asks an idle kernel for the fast path but not a busy one."""
    deadline = time.monotonic() + timeout
    turn = 0
    while (await api(jp_fetch, "kernels", kernel.id))["execution_state"] != "idle":
        assert time.monotonic() < deadline, "the server never saw the kernel idle"
        turn += 1
        if turn % 100 == 0:
            await kernel.run("pass")  # a fresh busy/idle pair for the server's activity watcher
        await asyncio.sleep(0.05)


async def start_busy(jp_fetch: Any, kernel: Any, code: str, timeout: float = 600, settle: float = 0.5) -> asyncio.Task:
    """Start ``code`` in ``kernel`` (a :class:`KernelSession`); return its task (an :class:`Execution`) once the
    server sees the kernel busy with it, and ``settle`` seconds more (well inside the cell)."""
    task = asyncio.get_running_loop().create_task(kernel.execute(code, timeout=timeout))
    deadline = time.monotonic() + 30
    while (await api(jp_fetch, "kernels", kernel.id))["execution_state"] != "busy":
        assert time.monotonic() < deadline and not task.done(), "the cell did not start"
        await asyncio.sleep(0.05)
    await asyncio.sleep(settle)
    return task


async def operate(jp_fetch: Any, kernel_id: str, action: str, body: Any = None) -> dict:
    op = await api(jp_fetch, "kernels", kernel_id, action, method="POST", body=body, expect=202)
    return await wait_operation(jp_fetch, op)


@dataclass
class Execution:
    status: str
    out: str
    errors: list[str]
    reply: dict
    messages: list[dict]


class KernelSession:
    """A client of one kernel over ZMQ, kept across suspend and resume, that behaves like a frontend:
    its event loop reads IOPub all the time.

    That matters after a resume: a ZMQ SUB socket re-sends its subscription only when its owner
    touches it, so a client that reads IOPub only while it waits for a cell loses that cell's first
    messages. Every real frontend (jupyter_server's streams, JupyterLab) reads continuously.
    """

    def __init__(self, serverapp: Any, kernel_id: str, own_identity: bool = False) -> None:
        """``own_identity``: a Session of its own, not the kernel manager's. A client made by ``manager.client()``
        shares the manager's Session, whose id is its shell socket's ZMQ identity; the kernel's ROUTER ignores a
        second connection with an identity it already has, so such a client made after another one connected
        is never answered (seen after a restart, where the server's own client had connected first)."""
        self.manager = serverapp.kernel_manager.get_kernel(kernel_id)
        own = {"session": Session(key=self.manager.session.key, signature_scheme=self.manager.session.signature_scheme,
                                  username="test")} if own_identity else {}
        self.client = self.manager.client(**own)
        self.client.start_channels()
        self.iopub: asyncio.Queue = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    async def _read_iopub(self) -> None:
        while True:
            await self.iopub.put(await self.client.get_iopub_msg())

    async def ready(self, timeout: float = 60) -> None:
        # wait_for_ready reads IOPub itself: stop our reader meanwhile, or it takes those messages.
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        await self.client.wait_for_ready(timeout=timeout)
        self.iopub = asyncio.Queue()
        self._reader = asyncio.get_running_loop().create_task(self._read_iopub())

    async def run(self, code: str, timeout: float = 60) -> str:
        """Execute ``code``; return what it printed; fail the test on an error."""
        result = await self.execute(code, timeout)
        assert result.status == "ok", "".join(result.errors) or result.reply
        return result.out

    async def execute(self, code: str, timeout: float = 60) -> Execution:
        """Execute ``code``; return its status, output, error text and every IOPub message it caused."""
        msg_id = self.client.execute(code)
        out: list[str] = []
        errors: list[str] = []
        messages: list[dict] = []
        deadline = time.monotonic() + timeout
        reply = None
        idle = False
        while reply is None or not idle:
            left = deadline - time.monotonic()
            assert left > 0, f"no complete answer to {code!r} within {timeout} s (reply: {reply}, output: {out})"
            if reply is None:
                try:
                    candidate = await self.client.get_shell_msg(timeout=min(left, 0.05))
                except Exception:  # noqa: BLE001 - queue.Empty: nothing yet
                    candidate = None
                if candidate is not None and candidate["parent_header"].get("msg_id") == msg_id:
                    reply = candidate
            try:
                msg = await asyncio.wait_for(self.iopub.get(), min(max(left, 0.01), 0.05))
            except asyncio.TimeoutError:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            messages.append(msg)
            kind = msg["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind == "error":
                errors.append("\n".join(msg["content"]["traceback"]))
            elif kind == "execute_result":
                out.append(msg["content"]["data"].get("text/plain", "") + "\n")
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
        return Execution(reply["content"]["status"], "".join(out), errors, reply["content"], messages)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.client.stop_channels()


class Widgets:
    """The frontend's half of ipywidgets' comm protocol, over a real kernel's ZMQ channels: the models as
    the kernel opens and updates them, and what a frontend sends (a state update, a button's click)."""

    def __init__(self, kernel: KernelSession, messages: list[dict]) -> None:
        self.kernel = kernel
        self.models: dict[str, dict] = {}
        self.history: dict[str, list[dict]] = {}  # each model's updates, in order
        for m in messages:
            self._see(m)
        view = next(m for m in messages if m["msg_type"] == "display_data"
                    and "application/vnd.jupyter.widget-view+json" in m["content"]["data"])
        self.root = view["content"]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]

    def _see(self, m: dict) -> None:
        content = m["content"]
        if m["msg_type"] == "comm_open":
            self.models[content["comm_id"]] = dict(content["data"]["state"])
            self.history[content["comm_id"]] = []
        elif m["msg_type"] == "comm_msg" and content["data"].get("method") in ("update", "echo_update"):
            self.models[content["comm_id"]].update(content["data"]["state"])
            self.history[content["comm_id"]].append(dict(content["data"]["state"]))

    def child(self, parent: str, index: int) -> str:
        return self.models[parent]["children"][index].removeprefix("IPY_MODEL_")

    def picker(self) -> dict[str, str]:
        """The picker's parts (MigrateWidget's layout): target, button, reasons, progress, message."""
        row = self.child(self.root, 2)
        return {"target": self.child(row, 0), "button": self.child(row, 1), "reasons": self.child(self.root, 3),
                "progress": self.child(self.root, 4), "message": self.child(self.root, 5)}

    def send(self, comm_id: str, data: dict) -> None:
        client = self.kernel.client
        client.shell_channel.send(client.session.msg("comm_msg", {"comm_id": comm_id, "data": data}))

    def update(self, comm_id: str, **state: object) -> None:
        self.send(comm_id, {"method": "update", "state": state, "buffer_paths": []})

    def click(self, comm_id: str) -> None:
        self.send(comm_id, {"method": "custom", "content": {"event": "click"}})

    async def until(self, done, timeout: float = 30) -> None:
        """Read what the kernel sends (from any thread of it) until ``done(self.models)`` holds."""
        deadline = time.monotonic() + timeout
        while not done(self.models):
            left = deadline - time.monotonic()
            assert left > 0, f"the widget did not get there within {timeout} s: {self.models}"
            try:
                self._see(await asyncio.wait_for(self.kernel.iopub.get(), min(left, 0.2)))
            except asyncio.TimeoutError:
                pass


async def wait_suspended(jp_fetch: Any, kernel_id: str, cell: asyncio.Future, timeout: float = 120) -> dict:
    """Wait until a kernel that suspends itself from ``cell`` (``%migrate --suspend``) is suspended; its view."""
    deadline = time.monotonic() + timeout
    while (view := await api(jp_fetch, "kernels", kernel_id))["state"] != "suspended":
        assert not cell.done(), cell.result()
        assert time.monotonic() < deadline, f"the kernel never got suspended: {view}"
        await asyncio.sleep(0.1)
    return view


class WebSocketTab:
    """What a notebook tab does: talk to the kernel through the server's /api/kernels/{id}/channels."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.session = Session(key=b"", username="test")

    def send(self, msg_type: str, content: dict) -> str:
        """Send a shell request as the notebook's frontend does; its msg_id."""
        msg = self.session.msg(msg_type, content)
        msg["channel"] = "shell"
        msg["header"]["date"] = msg["header"]["date"].isoformat()
        msg["parent_header"] = {}
        self.ws.write_message(json.dumps(msg, default=str))
        return msg["header"]["msg_id"]

    async def run(self, code: str, timeout: float = 60) -> str:
        msg_id = self.send("execute_request", {"code": code, "silent": False, "store_history": True,
                                               "user_expressions": {}, "allow_stdin": False})
        out: list[str] = []
        deadline = time.monotonic() + timeout
        status = None
        idle = False
        while status is None or not idle:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no reply to {code!r} within {timeout} s"
            raw = await asyncio.wait_for(self.ws.read_message(), remaining)
            assert raw is not None, "the websocket closed"
            if isinstance(raw, bytes):
                continue
            reply = json.loads(raw)
            if reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = reply["msg_type"]
            if kind == "stream":
                out.append(reply["content"]["text"])
            elif kind == "execute_reply":
                status = reply["content"]["status"]
            elif kind == "status" and reply["content"]["execution_state"] == "idle":
                idle = True
        assert status == "ok", out
        return "".join(out)


@dataclass
class PidHolder:
    """A process started so that it holds one given PID (as root, through ns_last_pid)."""

    proc: subprocess.Popen

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


#: Code that opens an io_uring instance in a kernel, as ``ring``: a kind of file CRIU cannot dump, so a
#: suspend fails for real, in CRIU's own dump (close it with ``os.close(ring)``).
OPEN_IO_URING = (
    "import ctypes, os\n"
    "params = ctypes.create_string_buffer(120)\n"
    "ring = ctypes.CDLL(None, use_errno=True).syscall(425, 4, params)\n"
    "assert ring >= 0, os.strerror(ctypes.get_errno())\n"
)


def start_sleep(*args: str, **kwargs: Any) -> subprocess.Popen:
    """Start ``sleep``, and return once it runs as ``sleep`` (until exec, /proc names the forking python)."""
    proc = subprocess.Popen(["sleep", *args], **kwargs)
    deadline = time.monotonic() + 10
    while True:
        try:
            with open(f"/proc/{proc.pid}/comm") as f:
                if f.read().strip() == "sleep":
                    return proc
        except FileNotFoundError:
            pass
        assert time.monotonic() < deadline, f"sleep (PID {proc.pid}) did not start"
        time.sleep(0.005)


def hold_pid(pid: int, attempts: int = 50) -> PidHolder:
    """Start `sleep` with exactly ``pid``; the kernel is Linux, we are root (CI is).

    This leaves the kernel's PID allocation cursor at ``pid``, right below the other PIDs and TIDs of a
    dumped tree: the next processes started take them, which is what the engine must cope with.
    """
    for _ in range(attempts):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = start_sleep("600", start_new_session=True)
        if proc.pid == pid:
            return PidHolder(proc)
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not start a process with PID {pid}")


def new_name() -> str:
    return uuid.uuid4().hex[:8]


async def cli(*args: str, env: dict | None = None) -> tuple[int, str, str]:
    """Run the real console entry point in a subprocess while the server keeps serving."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "jupyter_gpumigrate.cli", *args, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env or dict(os.environ),
    )  # no terminal to ask on, even under pytest -s
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    return proc.returncode, out.decode(), err.decode()


def remote(serverapp) -> list[str]:
    return ["--url", serverapp.connection_url, "--token", serverapp.identity_provider.token]


#: State of every kind a kernel can hold (the suspend/resume and cross-host tests build and check it).
BUILD_STATE = r"""
import threading, time, socket, itertools

x = 41
data = {"list": [1, 2, 3], "text": "héllo"}
square = lambda v: v * v

class Point:
    def __init__(self, a, b):
        self.a, self.b = a, b
    def norm2(self):
        return self.a ** 2 + self.b ** 2

p = Point(3, 4)

def counter():
    for i in itertools.count():
        yield i

gen = counter()
first = [next(gen) for _ in range(5)]          # the generator stops halfway, at 5

ticks = [0]
stop = threading.Event()
def tick():
    while not stop.is_set():
        ticks[0] += 1
        time.sleep(0.01)
worker = threading.Thread(target=tick, daemon=True)
worker.start()

f = open(PATH, "w+")
f.write("line one\nline two\n")
f.flush()
f.seek(5)

left, right = socket.socketpair()
left.sendall(b"in flight")                    # unread when the kernel is suspended
print("built")
"""

CHECK_STATE = r"""
before = ticks[0]
time.sleep(0.3)
print(x + 1, data["text"], square(7), p.norm2(), isinstance(p, Point))
print(next(gen), next(gen))
print(worker.is_alive(), ticks[0] > before)
print(f.tell(), repr(f.read()))
print(right.recv(100).decode())
right.sendall(b"pong"); print(left.recv(100).decode())
"""

EXPECTED = ["42 héllo 49 25 True", "5 6", "True True", "5 'one\\nline two\\n'", "in flight", "pong"]


@contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's notation: 24m) mounted on ``folder``, for as long as the block runs (root)."""
    import pytest

    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"this test mounts a small tmpfs, as root: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def resident(paths: list[Path]) -> int:
    """Bytes of ``paths`` in the page cache (util-linux's fincore, which asks mincore(2))."""
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(line) for line in out.split())


def fill(disk: Path) -> Path:
    """Fill ``disk`` up: a file ``filler`` on it, written until there is no room left; its path."""
    import errno

    try:
        with open(disk / "filler", "wb") as filler:
            while True:
                filler.write(bytes(1 << 20))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    return disk / "filler"


class ThisServer:
    """What the Hub service's idle policy asks of its ``Servers`` (jupyter_gpumigrate_client/hub/servers.py), answered by this test's
    own server with the extension: one user's server, its real kernels and answers. The Hub's own path to
    users' servers (tokens, proxy) is tested in test_hub.py with a real Hub; this puts the policy's
    decisions on kernels the Hub tests cannot make (one on a GPU)."""

    parallel = 1
    view_timeout = 10.0

    def __init__(self, jp_fetch: Any) -> None:
        self.jp_fetch = jp_fetch

    async def running(self) -> list:
        from jupyter_gpumigrate_client.hub.servers import UserServer

        return [UserServer("me", "", "http://this-test")]

    async def views(self, servers: list) -> list[dict]:
        return [{"error": None, "kernels": await api(self.jp_fetch, "kernels")} for _ in servers]

    async def call(self, server: Any, path: str, method: str = "GET", body: Any = None, timeout: float | None = None
                   ) -> Any:
        """The answer, or ServerError with the server's message and status, as the service's own call says."""
        from jupyter_gpumigrate_client.hub.servers import ServerError

        kwargs: dict[str, Any] = {"method": method, "raise_error": False}
        if method == "POST":
            kwargs["body"] = json.dumps(body or {})
        response = await self.jp_fetch("api", "gpumigrate", *path.split("/"), **kwargs)
        answer = json.loads(response.body) if response.body else None
        if response.code >= 400:
            raise ServerError(str((answer or {}).get("message") or response.code), response.code)
        return answer


def transplant_processes() -> list[int]:
    """The processes started as a transplant's new process (on any "host" of this machine: the network
    namespaces of tests/hosts.py share the PID namespace). A kernel it became keeps that command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"jupyter_gpumigrate.kernel.transplant" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def peer_server_config(tmp_path: Path, peer_token: str) -> dict:
    """conftest's in-process server, with a peer token: it is its own peer for the peer routes."""
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(tmp_path / "gpumigrate"), "suspend_to": "disk"},
        "GPUMigrateApp": {"peer_token": peer_token},
    }


def criu_running(*args: str, timeout: float = 120) -> int:
    """A CRIU running with all of ``args``, once it runs (not the shell that becomes it, nor a zombie)."""
    wanted = [a.encode() for a in args]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if argv and argv[0].endswith(b"criu") and all(w in argv for w in wanted) and state != "Z":
                return int(entry.name)
        time.sleep(0.005)
    raise AssertionError(f"no CRIU ran with {args} within {timeout} s")
