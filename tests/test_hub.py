"""The JupyterHub service with a real Hub: configurable-http-proxy, SimpleLocalProcessSpawner,
DummyAuthenticator, two users with real servers (the extension enabled) and real kernels, real CRIU."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from helpers import WebSocketTab
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

pytestmark = pytest.mark.usefixtures("criu_binary")

VENV_BIN = Path(sys.executable).parent
CHP = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
TESTER_TOKEN = "tester-" + os.urandom(8).hex()
SCOPE = "custom:gpumigrate:admin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Hub:
    """A JupyterHub in a subprocess, driven through its REST API with a test service's token."""

    def __init__(self, root: Path, service_args: list[str]) -> None:
        self.root = root
        self.port, hub_port, proxy_api, self.service_port = (free_port() for _ in range(4))
        self.url = f"http://127.0.0.1:{self.port}"
        config = root / "jupyterhub_config.py"
        config.write_text(f"""
import sys
c = get_config()
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.ConfigurableHTTPProxy.command = [{str(CHP)!r}]
c.JupyterHub.db_url = "sqlite:///{root}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{root}/cookie_secret"
c.JupyterHub.pid_file = "{root}/hub.pid"
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {{"alice", "bob", "boss"}}
c.Authenticator.admin_users = {{"boss"}}
c.JupyterHub.spawner_class = "simple"
c.SimpleLocalProcessSpawner.home_dir_template = "{root}/home/{{username}}"
c.Spawner.cmd = [{str(VENV_BIN / "jupyterhub-singleuser")!r}]
c.Spawner.args = ["--allow-root"]
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL"]
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.JupyterHub.custom_scopes = {{"{SCOPE}": {{"description": "gpumigrate admin"}}}}
c.JupyterHub.load_roles = [
    {{"name": "gpumigrate-service", "scopes": ["list:users", "read:users:name", "read:servers", "access:servers", "tokens"],
      "services": ["gpumigrate"]}},
    {{"name": "gpumigrate-admin", "scopes": ["{SCOPE}", "access:services!service=gpumigrate"], "users": ["boss"]}},
    {{"name": "tester", "scopes": ["admin:users", "admin:servers", "access:servers", "tokens"], "services": ["tester"]}},
]
c.JupyterHub.services = [
    {{"name": "gpumigrate", "url": "http://127.0.0.1:{self.service_port}",
      "command": [sys.executable, "-m", "jupyter_gpumigrate.hub", "--proxy-url", "{self.url}", *{service_args!r}],
      "oauth_client_allowed_scopes": ["{SCOPE}"]}},
    {{"name": "tester", "api_token": "{TESTER_TOKEN}"}},
]
""")
        (root / "home").mkdir()
        self.log = open(root / "hub.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [str(VENV_BIN / "jupyterhub"), "-f", str(config)], cwd=root, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.wait(lambda: self.request("GET", f"{self.url}/hub/api", TESTER_TOKEN)[0] == 200, 60,
                  "the Hub did not start")
        self.wait(lambda: self._service_up(), 60, "the gpumigrate service did not start")

    def _service_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.service_port), timeout=1):
                return True
        except OSError:
            return False

    def wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"{what}; hub log:\n{(self.root / 'hub.log').read_text()[-4000:]}")
            time.sleep(0.2)

    def request(self, method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Authorization", f"token {token}")
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                code, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            code, raw = exc.code, exc.read()
        try:
            return code, json.loads(raw) if raw else None
        except ValueError:
            return code, raw.decode(errors="replace")  # the page, or an HTML error

    def hub_api(self, method: str, path: str, body: Any = None) -> Any:
        code, data = self.request(method, f"{self.url}/hub/api{path}", TESTER_TOKEN, body)
        assert code < 300, (method, path, code, data)
        return data

    def service(self, method: str, path: str, token: str, body: Any = None) -> tuple[int, Any]:
        return self.request(method, f"{self.url}/services/gpumigrate/{path}", token, body)

    def user_api(self, user: str, method: str, path: str, body: Any = None) -> Any:
        code, data = self.request(method, f"{self.url}/user/{user}/api/{path}", TESTER_TOKEN, body)
        assert code < 300, (user, method, path, code, data)
        return data

    def start_server(self, user: str) -> None:
        self.hub_api("POST", f"/users/{user}/server")
        self.wait(lambda: self.hub_api("GET", f"/users/{user}")["servers"].get("", {}).get("ready"), 90,
                  f"{user}'s server did not start")

    def start_kernel(self, user: str) -> str:
        return self.user_api(user, "POST", "kernels", {"name": "python3"})["id"]

    def token(self, user: str, scopes: list[str] | None = None) -> str:
        body: dict = {"note": "test"} | ({"scopes": scopes} if scopes is not None else {})
        return self.hub_api("POST", f"/users/{user}/tokens", body)["token"]

    async def tab(self, user: str, kernel_id: str) -> WebSocketTab:
        url = f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{kernel_id}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {TESTER_TOKEN}"}))
        return WebSocketTab(ws)

    def stop(self) -> None:
        for user in ("alice", "bob"):
            try:
                self.hub_api("DELETE", f"/users/{user}/server")
            except (AssertionError, OSError, urllib.error.URLError):
                pass
        os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def make_hub(tmp_path):
    if not CHP.exists():
        pytest.fail(f"configurable-http-proxy is missing at {CHP}: `make test` installs it (scripts/setup.sh)")
    hubs: list[Hub] = []

    def make(*service_args: str) -> Hub:
        hub = Hub(tmp_path / f"hub{len(hubs)}", list(service_args))
        hubs.append(hub)
        return hub

    (tmp_path / "hub0").mkdir()
    (tmp_path / "hub1").mkdir()
    yield make
    for hub in hubs:
        hub.stop()
    shutil.rmtree(tmp_path, ignore_errors=True)


async def wait_for(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.25)


async def test_an_admin_sees_every_users_kernels_and_suspends_and_resumes_one(make_hub):
    hub = make_hub()
    kernels = {}
    for user in ("alice", "bob"):
        hub.start_server(user)
        kernels[user] = hub.start_kernel(user)
    alice = await hub.tab("alice", kernels["alice"])
    assert (await alice.run("secret = 'alice state'; print('set')")).strip() == "set"

    boss = hub.token("boss", [SCOPE])
    code, page = hub.service("GET", "", boss)
    assert code == 200 and "GPU kernels of every user" in page and '"/services/gpumigrate/"' in page
    code, views = hub.service("GET", "api/kernels", boss)
    assert code == 200, views
    listed = {v["user"]: [k["id"] for k in v["kernels"]] for v in views}
    assert listed == {"alice": [kernels["alice"]], "bob": [kernels["bob"]]}
    assert all(v["host"] == socket.gethostname() and v["gpus"] == [] for v in views)
    # Each server was called with its own user's token, limited to that server, never the service's.
    minted = [t for t in hub.hub_api("GET", "/users/alice/tokens")["api_tokens"] if t["note"] == "jupyter-gpumigrate service"]
    assert minted and all("access:servers!user=alice" in t["scopes"] for t in minted)
    # (the Hub adds alice's own identity scopes; nothing reaches beyond alice)
    assert all(scope.endswith("!user=alice") for t in minted for scope in t["scopes"]), minted

    code, op = hub.service("POST", f"api/users/alice/kernels/{kernels['alice']}/suspend", boss, {})
    assert code == 202 and op["user"] == "alice", op
    while op["status"] not in ("succeeded", "failed"):
        code, op = hub.service("GET", f"api/users/alice/operations/{op['id']}?after={op['version']}", boss)
    assert op["status"] == "succeeded", op
    assert hub.user_api("alice", "GET", f"gpumigrate/kernels/{kernels['alice']}")["state"] == "suspended"
    assert hub.user_api("bob", "GET", f"gpumigrate/kernels/{kernels['bob']}")["state"] == "running"

    code, op = hub.service("POST", f"api/users/alice/kernels/{kernels['alice']}/resume", boss, {})
    while op["status"] not in ("succeeded", "failed"):
        code, op = hub.service("GET", f"api/users/alice/operations/{op['id']}?after={op['version']}", boss)
    assert op["status"] == "succeeded", op
    assert (await alice.run("print(secret)")).strip() == "alice state"
    alice.ws.close()

    # A user who is not allowed learns nothing about anyone's kernels.
    bob = hub.token("bob")
    for method, path in (("GET", ""), ("GET", "api/kernels"), ("POST", f"api/users/alice/kernels/{kernels['alice']}/suspend"),
                         ("POST", "api/gpus/0/drain"), ("GET", "api/policy")):
        code, body = hub.service(method, path, bob, {} if method == "POST" else None)
        assert code == 403, (method, path, code, body)
        assert kernels["alice"] not in json.dumps(body)
    # A POST that is not JSON is refused (the page's cookie must not be usable by another site's form).
    req = urllib.request.Request(f"{hub.url}/services/gpumigrate/api/gpus/0/drain", data=b"x", method="POST")
    req.add_header("Authorization", f"token {boss}")
    req.add_header("Content-Type", "text/plain")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400


async def test_the_idle_policy_suspends_an_idle_kernel_and_not_a_busy_one(make_hub):
    # Kernels idle for 15 s are suspended (CPU kernels too, since CI has no GPU), checked every second.
    # 15 s is the margin for bob's kernel to start and turn busy, and for alice's to run its cell.
    hub = make_hub("--idle-suspend-minutes", "0.25", "--idle-include-cpu", "--idle-check-seconds", "1")
    for user in ("alice", "bob"):
        hub.start_server(user)

    def state(user: str, kernel_id: str, key: str = "state") -> str:
        return hub.user_api(user, "GET", f"gpumigrate/kernels/{kernel_id}")[key]

    busy_id = hub.start_kernel("bob")
    bob = await hub.tab("bob", busy_id)
    busy_cell = asyncio.ensure_future(bob.run("import time; time.sleep(45); print('done')", timeout=120))
    await wait_for(lambda: state("bob", busy_id, "execution_state") == "busy", 30, "the busy cell did not start")
    idle_id = hub.start_kernel("alice")
    alice = await hub.tab("alice", idle_id)
    await alice.run("x = 1")  # used, then left idle

    await wait_for(lambda: state("alice", idle_id) == "suspended", 60,
                   lambda: f"the idle kernel was not suspended: {hub.service('GET', 'api/policy', hub.token('boss', [SCOPE]))}")
    assert state("bob", busy_id) == "running" and not busy_cell.done()
    code, policy = hub.service("GET", "api/policy", hub.token("boss", [SCOPE]))
    assert code == 200 and policy["idle_suspend_minutes"] == 0.25
    kept = [d for d in policy["last_decisions"] if d["kernel"] == busy_id]
    assert kept and not kept[0]["suspend"] and "busy" in kept[0]["reason"], policy
    assert "idle policy: suspending alice's kernel" in (hub.root / "hub.log").read_text()
    busy_cell.cancel()
    bob.ws.close()
    alice.ws.close()
