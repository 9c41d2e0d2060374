"""The JupyterHub service with a real Hub: configurable-http-proxy, SimpleLocalProcessSpawner,
DummyAuthenticator, users with real servers (the extension enabled) and real kernels, real CRIU.

The Hub is configured by examples/jupyterhub_config.py itself; the tests change only ports, paths, test
users (and named servers), the service's timings, and add a service of their own to drive the Hub."""

from __future__ import annotations

import asyncio
import copy
import http.cookiejar
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import ThisServer, WebSocketTab, api, operate, server_sees_idle, wait_operation
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from jupyter_gpumigrate_client.contract import ContractError
from jupyter_gpumigrate_client.hub.policy import IdlePolicy, last_operations
from jupyter_gpumigrate_client.hub.servers import ServerError, check_answers

pytestmark = pytest.mark.usefixtures("criu_binary")

VENV_BIN = Path(sys.executable).parent
CHP = Path(sys.prefix) / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "jupyterhub_config.py"
TESTER_TOKEN = "tester-" + os.urandom(8).hex()
SCOPE = "custom:gpumigrate:admin"
#: boss: a Hub admin, in no role of ours; carol: an operator through the example's group, no Hub admin;
#: alice and bob: plain users with kernels.
USERS = ("alice", "bob", "boss", "carol")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # the 302 itself comes back, as an HTTPError


class Hub:
    """A JupyterHub in a subprocess, configured by examples/jupyterhub_config.py, driven through its REST
    API with a test service's token."""

    def __init__(self, root: Path, service_options: dict[str, str | bool],
                 service_program: list[str] | None = None) -> None:
        """``service_program`` replaces the example's ``python -m jupyter_gpumigrate_client.hub`` (the
        service run from another environment)."""
        self.root = root
        self.port, hub_port, proxy_api, self.service_port = (free_port() for _ in range(4))
        self.url = f"http://127.0.0.1:{self.port}"
        options = {"--proxy-url": self.url, **service_options}
        config = root / "jupyterhub_config.py"
        config.write_text(f"""
c = get_config()
load_subconfig({str(EXAMPLE)!r})

# Ports and paths.
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {self.port}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.ConfigurableHTTPProxy.command = [{str(CHP)!r}]
c.JupyterHub.db_url = "sqlite:///{root}/hub.sqlite"
c.JupyterHub.cookie_secret_file = "{root}/cookie_secret"
c.JupyterHub.pid_file = "{root}/hub.pid"
c.SimpleLocalProcessSpawner.home_dir_template = "{root}/home/{{username}}"
c.Spawner.cmd = [{str(VENV_BIN / "jupyterhub-singleuser")!r}]
c.Spawner.args = [*c.Spawner.args, "--allow-root"]  # the example's (its stop policy), and root for CI
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL"]
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60

# Test users: boss is a Hub admin, carol an operator through the example's group.
c.JupyterHub.authenticator_class = "dummy"
c.JupyterHub.spawner_class = "simple"
c.Authenticator.allowed_users = {set(USERS)!r}
c.Authenticator.admin_users = {{"boss"}}
c.JupyterHub.load_groups = {{"gpu-operators": {{"users": ["carol"]}}}}
c.JupyterHub.allow_named_servers = True

# The example's service on a free port, reaching users' servers through this Hub's proxy, with the
# test's timings.
service = next(s for s in c.JupyterHub.services if s["name"] == "gpumigrate")
service["url"] = "http://127.0.0.1:{self.service_port}"
command = service["command"]
if {service_program!r} is not None:
    command[:3] = {service_program!r}
for option, value in {options!r}.items():
    if option in command:
        if value is not True:
            command[command.index(option) + 1] = value
    else:
        command += [option] if value is True else [option, value]

# The tests' own driver.
c.JupyterHub.load_roles.append({{"name": "tester", "services": ["tester"],
                                "scopes": ["admin:users", "admin:servers", "access:servers", "tokens"]}})
c.JupyterHub.services.append({{"name": "tester", "api_token": {TESTER_TOKEN!r}}})
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

    def service_pid(self) -> int:
        """The process that listens on the service's port."""
        listening = [c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == self.service_port]
        assert listening, f"nothing listens on the service's port {self.service_port}"
        return listening[0]

    def hub_log(self) -> str:
        return (self.root / "hub.log").read_text(errors="replace")

    def wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if check():
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"{what}; hub log:\n{self.hub_log()[-4000:]}")
            time.sleep(0.2)

    def request(self, method: str, url: str, token: str | None, body: Any = None,
                opener: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method)
        if token:
            req.add_header("Authorization", f"token {token}")
        req.add_header("Content-Type", "application/json")
        try:
            with (opener or urllib.request.build_opener()).open(req, timeout=60) as resp:
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

    def service(self, method: str, path: str, token: str | None, body: Any = None, opener: Any = None
                ) -> tuple[int, Any]:
        return self.request(method, f"{self.url}/services/gpumigrate/{path}", token, body, opener)

    def user_api(self, user: str, method: str, path: str, body: Any = None, server: str = "") -> Any:
        base = f"{self.url}/user/{user}/" + (f"{server}/" if server else "")
        code, data = self.request(method, f"{base}api/{path}", TESTER_TOKEN, body)
        assert code < 300, (user, server, method, path, code, data)
        return data

    def start_server(self, user: str, name: str = "") -> None:
        self.hub_api("POST", f"/users/{user}/servers/{name}")
        self.wait(lambda: self.hub_api("GET", f"/users/{user}")["servers"].get(name, {}).get("ready"), 90,
                  f"{user}'s server {name!r} did not start")

    def server_pid(self, user: str) -> int:
        return self.hub_api("GET", f"/users/{user}")["servers"][""]["state"]["pid"]

    def start_kernel(self, user: str, server: str = "") -> str:
        return self.user_api(user, "POST", "kernels", {"name": "python3"}, server)["id"]

    def token(self, user: str, scopes: list[str] | None = None) -> str:
        body: dict = {"note": "test"} | ({"scopes": scopes} if scopes is not None else {})
        return self.hub_api("POST", f"/users/{user}/tokens", body)["token"]

    def browser(self, user: str, next_path: str) -> tuple[Any, int, str]:
        """Log in to the Hub's login form as ``user`` as a browser does, going on to ``next_path``; the
        browser (an opener with the cookies), and the final status and page."""
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with opener.open(f"{self.url}/hub/login", timeout=30) as resp:
            form = resp.read().decode()
        xsrf = re.search(r'name="_xsrf" value="([^"]+)"', form)
        assert xsrf, form[:2000]
        data = urllib.parse.urlencode({"username": user, "password": "any", "_xsrf": xsrf.group(1)}).encode()
        url = f"{self.url}/hub/login?" + urllib.parse.urlencode({"next": next_path})
        try:
            with opener.open(urllib.request.Request(url, data=data, method="POST"), timeout=60) as resp:
                return opener, resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            return opener, exc.code, exc.read().decode(errors="replace")

    async def tab(self, user: str, kernel_id: str) -> WebSocketTab:
        url = f"ws://127.0.0.1:{self.port}/user/{user}/api/kernels/{kernel_id}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {TESTER_TOKEN}"}))
        return WebSocketTab(ws)

    def stop(self) -> None:
        for user in ("alice", "bob"):
            try:
                servers = list(self.hub_api("GET", f"/users/{user}")["servers"])
            except (AssertionError, OSError, urllib.error.URLError):
                continue
            for name in servers:
                # Its kernels first, through the server (its provisioner knows restored kernels, which are
                # not its children): a server stopped by the Hub, or left behind with it, does not always
                # get to shut them down, and they would outlive the test.
                try:
                    for kernel in self.user_api(user, "GET", "kernels", server=name):
                        self.user_api(user, "DELETE", f"kernels/{kernel['id']}", server=name)
                except (AssertionError, OSError, urllib.error.URLError):
                    pass
                try:
                    self.hub_api("DELETE", f"/users/{user}/servers/{name}")
                except (AssertionError, OSError, urllib.error.URLError):
                    pass
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        self._end_leftovers()

    def _end_leftovers(self) -> None:
        """The proxy and the services the Hub started run in sessions of their own: a Hub that did not stop
        them (killed, or too slow) leaves them behind. End those that serve this Hub's ports."""
        marks = (f"--port {self.port}".encode(), f"127.0.0.1:{self.port}".encode())
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if (b"configurable-http-proxy" in cmdline or b"jupyter_gpumigrate_client.hub" in cmdline
                    or b"jupyter-gpumigrate-hub" in cmdline) and any(
                    mark in cmdline for mark in marks):
                found.append(int(entry.name))
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def make_hub(tmp_path):
    if not CHP.exists():
        pytest.fail(f"configurable-http-proxy is missing at {CHP}: `make test` installs it (scripts/setup.sh)")
    hubs: list[Hub] = []

    def make(service_program: list[str] | None = None, **service_options: str | bool) -> Hub:
        root = tmp_path / f"hub{len(hubs)}"
        root.mkdir()
        hub = Hub(root, {f"--{k.replace('_', '-')}": v for k, v in service_options.items()}, service_program)
        hubs.append(hub)
        return hub

    yield make
    for hub in hubs:
        hub.stop()
    shutil.rmtree(tmp_path, ignore_errors=True)


async def wait_for(check: Any, timeout: float, what: Any) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.25)


def follow(hub: Hub, token: str, op: dict, server: str = "") -> dict:
    where = f"&server={server}" if server else ""
    while op["status"] not in ("succeeded", "failed"):
        code, op = hub.service("GET", f"api/users/{op['user']}/operations/{op['id']}?after={op['version']}{where}",
                               token)
        assert code == 200, op
    return op


#: Node runs the page's own script on the views given, with a document and fetch of its own: what the page shows.
RENDER = """
const fs = require("fs"), vm = require("vm");
const {script, views} = JSON.parse(fs.readFileSync(0, "utf8"));
const found = {};
const element = id => found[id] ??= {innerHTML: "", textContent: "", className: "",
                                      classList: {contains: name => found[id].className.split(" ").includes(name)}};
const context = vm.createContext({document: {cookie: "", activeElement: null, getElementById: element,
                                             addEventListener() {}},
                                  fetch: async () => ({ok: true, status: 200, json: async () => views}),
                                  setInterval() {}, setTimeout() {}, encodeURIComponent, decodeURIComponent});
vm.runInContext(script, context);
setTimeout(() => process.stdout.write(found.nodes.innerHTML), 200);
"""


def rendered(page: str, views: list[dict]) -> str:
    """The HTML the Hub page (as served: ``page``) puts in its nodes' section, given ``views`` (api/kernels)."""
    node = shutil.which("node")
    assert node is not None, "Node (which the lab extension's build needs) runs the page's script"
    script = re.search(r"<script>(.*?)</script>", page, re.S)
    assert script is not None, page[:2000]
    done = subprocess.run([node, "-e", RENDER], input=json.dumps({"script": script.group(1), "views": views}),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout, done.stderr
    return done.stdout


async def test_admins_and_operators_see_every_users_kernels_and_act_on_them(make_hub):
    hub = make_hub(server_timeout="3")  # the example's 10 s, shortened for the stopped server below
    kernels = {}
    for user in ("alice", "bob"):
        hub.start_server(user)
        kernels[user] = hub.start_kernel(user)
    hub.start_server("alice", "second")
    named = hub.start_kernel("alice", "second")
    alice = await hub.tab("alice", kernels["alice"])
    assert (await alice.run("secret = 'alice state'; print('set')")).strip() == "set"

    # A Hub admin in no role of ours (admin-ui), and an operator who is no Hub admin (the custom scope
    # through the example's group) both get in, with their tokens as they come.
    boss, carol = hub.token("boss"), hub.token("carol")
    assert not hub.hub_api("GET", "/users/carol")["admin"]
    for token in (boss, carol):
        code, views = hub.service("GET", "api/kernels", token)
        assert code == 200, views
        listed = {(v["user"], v["server"]): [k["id"] for k in v["kernels"]] for v in views}
        assert listed == {("alice", ""): [kernels["alice"]], ("alice", "second"): [named],
                          ("bob", ""): [kernels["bob"]]}, views
        assert all(v["host"] == socket.gethostname() and v["gpus"] == [] and v["error"] is None for v in views)
    # Each server was called with its own user's token, limited to that user's servers, never the service's.
    minted = [t for t in hub.hub_api("GET", "/users/alice/tokens")["api_tokens"] if t["note"] == "jupyter-gpumigrate service"]
    assert minted and all("access:servers!user=alice" in t["scopes"] for t in minted)
    # (the Hub adds alice's own identity scopes; nothing reaches beyond alice)
    assert all(scope.endswith("!user=alice") for t in minted for scope in t["scopes"]), minted

    # The page, as a browser gets it: the Hub admin logs in and the service's OAuth lets them in.
    browser, code, page = hub.browser("boss", "/services/gpumigrate/")
    assert code == 200 and "GPU kernels of every user" in page and '"/services/gpumigrate/"' in page, page[:2000]
    code, views = hub.service("GET", "api/kernels", None, opener=browser)
    assert code == 200 and {v["user"] for v in views} == {"alice", "bob"}, views

    # The admin suspends and resumes alice's kernel; its state survives.
    code, op = hub.service("POST", f"api/users/alice/kernels/{kernels['alice']}/suspend", boss, {})
    assert code == 202 and op["user"] == "alice" and op["server"] == "", op
    assert follow(hub, boss, op)["status"] == "succeeded"
    assert hub.user_api("alice", "GET", f"gpumigrate/kernels/{kernels['alice']}")["state"] == "suspended"
    assert hub.user_api("bob", "GET", f"gpumigrate/kernels/{kernels['bob']}")["state"] == "running"
    code, op = hub.service("POST", f"api/users/alice/kernels/{kernels['alice']}/resume", carol, {})
    assert code == 202, op
    assert follow(hub, carol, op)["status"] == "succeeded"
    assert (await alice.run("print(secret)")).strip() == "alice state"
    alice.ws.close()

    # A kernel of a named server: ?server= says which; alice's default server does not have it.
    code, body = hub.service("POST", f"api/users/alice/kernels/{named}/suspend", boss, {})
    assert code == 404 and named in body["message"], body
    code, op = hub.service("POST", f"api/users/alice/kernels/{named}/suspend?server=second", boss, {})
    assert code == 202 and op["server"] == "second", op
    assert follow(hub, boss, op, "second")["status"] == "succeeded"
    view = hub.user_api("alice", "GET", f"gpumigrate/kernels/{named}", server="second")
    assert view["state"] == "suspended"
    # Disk use: each server's suspended kernels and the bytes of their images (the page adds them up per user
    # and per node).
    code, views = hub.service("GET", "api/kernels", boss)
    memory = view["image_bytes"] if view["images"] == "memory" else 0  # the page tells memory from disk
    assert {(v["user"], v["server"]): v["suspended"] for v in views} == {
        ("alice", ""): {"kernels": 0, "image_bytes": 0, "memory_bytes": 0},
        ("bob", ""): {"kernels": 0, "image_bytes": 0, "memory_bytes": 0},
        ("alice", "second"): {"kernels": 1, "image_bytes": view["image_bytes"], "memory_bytes": memory}}, views
    assert view["image_bytes"] > 0
    # The page says where each suspended kernel's images are, and adds up the node's disk and memory apart.
    shown = rendered(page, views)
    where = "in memory" if memory else "on disk"
    assert re.search(rf"[0-9.]+ GB {where}</td>", shown) and "Images in memory" in shown, shown
    assert re.search(r"Suspended kernels: 1, [0-9.]+ GB of images on this node's disk and [0-9.]+ GB in its memory",
                     shown), shown
    code, body = hub.service("POST", f"api/users/alice/kernels/{named}/resume?server=third", boss, {})
    assert code == 404 and "?server=" in body["message"], body

    # Drains: by index (no GPU here: nothing to drain), by an unknown GPU uuid (said so).
    code, result = hub.service("POST", "api/gpus/0/drain", boss, {})
    assert code == 202 and result["operations"] == [] and result["errors"] == [], result
    code, body = hub.service("POST", "api/gpus/GPU-00000000-0000-0000-0000-000000000000/drain", carol, {})
    assert code == 404 and "uuid" in body["message"], body
    # Numbers that are none (a superscript digit, 5000 digits): 400 with a sentence, not a 500.
    code, body = hub.service("POST", f"api/gpus/{'9' * 5000}/drain", boss, {})
    assert code == 400 and "more than 6 digits" in body["message"], body
    for after in ("%C2%B2", "9" * 5000):
        code, body = hub.service("GET", f"api/users/alice/operations/{op['id']}?after={after}", boss)
        assert code == 400 and "'after' must be a version number" in body["message"], body

    # A server that does not answer is an error row, after --server-timeout; the others are listed.
    pid = hub.server_pid("bob")
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, views = hub.service("GET", "api/kernels", boss)
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
    assert code == 200, views
    assert took < 15, took
    by = {(v["user"], v["server"]): v for v in views}
    assert "did not answer within 3 s" in by[("bob", "")]["error"] and by[("bob", "")]["kernels"] == [], views
    assert [k["id"] for k in by[("alice", "")]["kernels"]] == [kernels["alice"]] and by[("alice", "")]["error"] is None

    # A user who is not allowed learns nothing about anyone's kernels, with a token or through the page.
    bob = hub.token("bob")
    refusals = []
    for method, path in (("GET", ""), ("GET", "api/kernels"), ("POST", f"api/users/alice/kernels/{kernels['alice']}/suspend"),
                         ("POST", "api/gpus/0/drain"), ("GET", "api/policy")):
        code, body = hub.service(method, path, bob, {} if method == "POST" else None)
        assert code == 403, (method, path, code, body)
        assert kernels["alice"] not in json.dumps(body) and "alice" not in json.dumps(body)
        refusals.append(body)
    assert all(body == refusals[0] for body in refusals) and "admin" in refusals[0]["message"], refusals
    _, code, page = hub.browser("bob", "/services/gpumigrate/")
    assert code == 403 and kernels["alice"] not in page
    # API calls without credentials, or with a wrong token, get 403 JSON, not a login redirect; the page
    # sends a browser to the Hub's login.
    no_redirect = urllib.request.build_opener(NoRedirect)
    for token in (None, "not-a-token"):
        for method, path in (("GET", "api/kernels"), ("POST", "api/gpus/0/drain"), ("GET", "api/policy")):
            code, body = hub.service(method, path, token, {} if method == "POST" else None, opener=no_redirect)
            assert code == 403 and isinstance(body, dict) and body["message"] == refusals[0]["message"], \
                (token, method, path, code, body)
    code, _ = hub.service("GET", "", None, opener=no_redirect)
    assert code == 302
    # A POST that is not JSON is refused (the page's cookie must not be usable by another site's form).
    req = urllib.request.Request(f"{hub.url}/services/gpumigrate/api/gpus/0/drain", data=b"x", method="POST")
    req.add_header("Authorization", f"token {boss}")
    req.add_header("Content-Type", "text/plain")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400


def test_the_service_runs_from_its_own_distribution_without_the_server_stack(make_hub, tmp_path_factory):
    """What a Hub admin installs: `pip install 'jupyter-gpumigrate-client[hub]'`, here the wheel built from
    client/ with its extra, into an environment of its own. Nothing of a user's server comes with it, and its
    console script serves a real Hub: it lists a user's kernel and suspends it."""
    out = tmp_path_factory.mktemp("client-wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                            "-w", str(out), str(EXAMPLE.parent.parent / "client")],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-4000:]
    wheel = next(out.glob("jupyter_gpumigrate_client-*.whl"))
    venv = tmp_path_factory.mktemp("hub-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    installed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                                f"{wheel}[hub]"], capture_output=True, text=True, timeout=900, env=env)
    assert installed.returncode == 0, installed.stderr[-4000:]
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import importlib.util as u; print(' '.join(m for m in ('jupyter_server', "
         "'jupyter_client', 'ipykernel', 'jupyterlab', 'jupyter_gpumigrate', 'jupyterhub') if u.find_spec(m)))"],
        capture_output=True, text=True, timeout=60, env=env, cwd=venv)
    assert found.stdout.split() == ["jupyterhub"], f"the Hub's install has more than it needs: {found.stdout}"

    hub = make_hub(service_program=[str(venv / "bin" / "jupyter-gpumigrate-hub")])
    assert f"{venv}/bin/jupyter-gpumigrate-hub" in psutil.Process(hub.service_pid()).cmdline()
    hub.start_server("alice")
    kernel = hub.start_kernel("alice")
    boss = hub.token("boss")
    code, views = hub.service("GET", "api/kernels", boss)
    assert code == 200 and [(v["user"], [k["id"] for k in v["kernels"]]) for v in views] == [("alice", [kernel])], views
    code, op = hub.service("POST", f"api/users/alice/kernels/{kernel}/suspend", boss, {})
    assert code == 202, op
    assert follow(hub, boss, op)["status"] == "succeeded"
    assert hub.user_api("alice", "GET", f"gpumigrate/kernels/{kernel}")["state"] == "suspended"


async def test_the_idle_policy_suspends_an_idle_kernel_and_not_a_busy_one_and_a_cell_resumes_it(make_hub):
    # Kernels idle for 15 s are suspended (CPU kernels too, since CI has no GPU), checked every second.
    # 15 s is the margin for bob's kernel to start and turn busy, and for alice's to run its cell.
    hub = make_hub(idle_suspend_minutes="0.25", idle_include_cpu=True, idle_check_seconds="1")
    for user in ("alice", "bob"):
        hub.start_server(user)
    boss = hub.token("boss")

    def kernel(user: str, kernel_id: str) -> dict:
        return hub.user_api(user, "GET", f"gpumigrate/kernels/{kernel_id}")

    busy_id = hub.start_kernel("bob")
    bob = await hub.tab("bob", busy_id)
    busy_cell = asyncio.ensure_future(bob.run("import time; time.sleep(90); print('done')", timeout=120))
    await wait_for(lambda: kernel("bob", busy_id)["execution_state"] == "busy", 30, "the busy cell did not start")
    idle_id = hub.start_kernel("alice")
    alice = await hub.tab("alice", idle_id)
    await alice.run("x = 'kept while suspended'")  # used, then left idle

    # (suspended, and its suspend operation closed)
    await wait_for(lambda: (lambda k: k["state"] == "suspended" and not k["operation"])(kernel("alice", idle_id)), 60,
                   lambda: f"the idle kernel was not suspended: {hub.service('GET', 'api/policy', boss)}")
    assert kernel("alice", idle_id)["images"] == "disk", "the policy's suspends free the node's memory too"
    code, policy = hub.service("GET", "api/policy", boss)
    assert code == 200 and policy["idle_suspend_minutes"] == 0.25 and policy["grace_minutes"] == 0.25 \
        and policy["to_cpu"] is False, policy
    kept = [d for d in policy["last_decisions"] if d["kernel"] == busy_id]
    assert kept and not kept[0]["suspend"] and "busy" in kept[0]["reason"], policy

    # Alice comes back and runs a cell in her tab: the kernel resumes by itself and the cell runs on it.
    try:
        printed = await alice.run("print(x)", timeout=60)
    except (AssertionError, asyncio.TimeoutError):
        raise AssertionError(f"the cell did not run: {kernel('alice', idle_id)}; "
                             f"{hub.user_api('alice', 'GET', 'gpumigrate/operations')}; hub log:\n{hub.hub_log()[-6000:]}"
                             ) from None
    assert printed.strip() == "kept while suspended"
    # (the server holds the cell until the resume's operation closes: the kernel runs by now)
    await wait_for(lambda: kernel("alice", idle_id)["state"] == "running", 30, "the resumed kernel is not running")
    resumes = [op for op in hub.user_api("alice", "GET", "gpumigrate/operations")
               if op["kernel_id"] == idle_id and op["action"] == "resume"]
    assert [(op["trigger"], op["status"]) for op in resumes] == [("cell", "succeeded")], resumes

    # The busy kernel was never suspended, nor tried: bob's server ran no operation on it.
    assert kernel("bob", busy_id)["state"] == "running" and not busy_cell.done()
    assert [op for op in hub.user_api("bob", "GET", "gpumigrate/operations") if op["kernel_id"] == busy_id] == []
    log = hub.hub_log()
    assert "idle policy: suspending alice's kernel" in log and "idle policy: suspending bob's kernel" not in log
    assert re.search(r"idle policy: 2 kernel\(s\) on 2 server\(s\): \d+ suspended", log), log[-3000:]
    busy_cell.cancel()
    bob.ws.close()
    alice.ws.close()


async def test_a_users_server_stopped_through_the_hub_brings_its_kernels_back(make_hub):
    # The example configuration's stop policy: a server the Hub stops suspends its kernels first.
    hub = make_hub()
    hub.start_server("alice")
    kernel_id = hub.start_kernel("alice")
    tab = await hub.tab("alice", kernel_id)
    await tab.run("x = 'kept across a stop'\ngen = iter(range(10)); next(gen)")
    tab.ws.close()

    hub.hub_api("DELETE", "/users/alice/server")
    await wait_for(lambda: not hub.hub_api("GET", "/users/alice")["servers"], 60, "alice's server did not stop")
    hub.start_server("alice")
    view = await wait_for(
        lambda: next((k for k in hub.user_api("alice", "GET", "gpumigrate/kernels") if k["id"] == kernel_id), None),
        30, lambda: f"the kernel is not back: {hub.user_api('alice', 'GET', 'gpumigrate/kernels')}")
    assert view["state"] == "suspended", view
    tab = await hub.tab("alice", kernel_id)
    assert (await tab.run("print(x, next(gen))", timeout=120)).strip() == "kept across a stop 1"
    tab.ws.close()


async def test_the_idle_policy_decides_on_real_kernel_records(jp_fetch, kernel):
    """decide() and the answers' checks, on what a real server with the extension says of a real kernel."""
    await kernel.run("y = 1")
    await server_sees_idle(jp_fetch, kernel)
    record = await api(jp_fetch, "kernels", kernel.id)
    gpus = await api(jp_fetch, "gpus")
    check_answers([record], gpus)  # what a server answers passes
    active = datetime.fromisoformat(record["last_activity"])
    policy = IdlePolicy(minutes=10)  # the default: GPU kernels only

    # This kernel holds no GPU: never suspended under the default rule, however long idle.
    assert policy.decide(record, active + timedelta(hours=5)) == (False, "it holds no GPU")
    # The same kernel as a server describes one that holds a GPU.
    on_gpu = copy.deepcopy(record) | {"gpus": [{"index": 0, "uuid": "GPU-0", "memory_used": 2 << 30}]}
    check_answers([on_gpu], gpus)
    assert policy.decide(on_gpu, active + timedelta(minutes=9))[0] is False
    assert "under 10" in policy.decide(on_gpu, active + timedelta(minutes=9))[1]
    assert policy.decide(on_gpu, active + timedelta(minutes=11)) == (True, "idle for 11.0 min")
    assert policy.decide(on_gpu | {"execution_state": "busy"}, active + timedelta(hours=1)) == (False, "it is busy")
    assert policy.decide(on_gpu | {"state": "suspended"}, active + timedelta(hours=1)) == (False, "it is suspended")
    # --idle-include-cpu: the CPU kernel too.
    assert IdlePolicy(minutes=10, gpu_only=False).decide(record, active + timedelta(minutes=11))[0] is True

    # The grace period, from the kernel's real operations: just resumed, it is left alone.
    assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    last = last_operations(await api(jp_fetch, "operations"))[kernel.id]
    resumed = await api(jp_fetch, "kernels", kernel.id)
    assert resumed["state"] == "running"
    lazy = IdlePolicy(minutes=1, gpu_only=False, grace_minutes=30)
    keep, why = lazy.decide(resumed, last + timedelta(minutes=5), last)
    assert not keep and "grace period of 30 min" in why, why
    assert lazy.decide(resumed, last + timedelta(minutes=31), last)[0] is True
    assert IdlePolicy(minutes=1, gpu_only=False).grace == 1  # by default as long as the idle time

    # What a server answers is checked against the API's contract before it is shown: a malformed entry
    # is refused, with what is wrong.
    for broken, words in [
        ([dict(record, id=None)], r"'\[0\]\.id' must be a string"),
        ([dict(record, gpus="GPU 0")], r"'\[0\]\.gpus' must be a list"),
        ([dict(record, gpus=[{"index": "0"}])], r"'\[0\]\.gpus\[0\]\.index' must be a whole number"),
        ([dict(record, targets=[{"index": 0}])], r"'\[0\]\.targets\[0\]' needs the field 'ok'"),
        ([dict(record, name=["<b>"])], r"'\[0\]\.name' must be a string"),
        ("kernels", "must be a list"),
    ]:
        with pytest.raises(ContractError, match=words):
            check_answers(broken, gpus)
    a_gpu = {"index": 0, "uuid": "GPU-0", "name": "H100", "memory_total": 80 << 30, "memory_used": 1 << 30,
             "utilization": 3, "persistence_mode": True, "mig_enabled": False,
             "processes": [{"pid": record["pid"], "memory_used": 1 << 30}], "error": None,
             "kernels": [{"id": kernel.id, "memory_used": 1 << 30}]}
    check_answers([record], dict(gpus, gpus=[a_gpu]))
    for broken, words in [
        (dict(a_gpu, memory_total="lots"), r"'gpus\[0\]\.memory_total' must be a whole number"),
        (dict(a_gpu, uuid=None), r"'gpus\[0\]\.uuid' must be a string"),
        (dict(a_gpu, kernels=None), r"'gpus\[0\]\.kernels' must be a list"),
    ]:
        with pytest.raises(ContractError, match=words):
            check_answers([record], dict(gpus, gpus=[broken]))


async def test_the_idle_policy_leaves_a_kernel_that_was_active_after_it_looked(jp_fetch, kernel):
    """The policy decides from a view of a server's kernels, then asks for each suspend: a cell run in between
    was suspended at its safe point, its work frozen until another cell resumed it. The suspend now carries the
    last activity the policy saw (idle_since): the server refuses it (409), and the kernel runs on. A request
    whose idle_since is not a time is refused (400); one that matches what the server saw goes ahead."""
    servers = ThisServer(jp_fetch)
    [server] = await servers.running()
    await server_sees_idle(jp_fetch, kernel)
    [view] = await servers.views([server])  # what the policy sees
    assert (await kernel.run("y = 6 * 7\nprint(y)")).strip() == "42"  # a cell, after that
    await server_sees_idle(jp_fetch, kernel)
    policy = IdlePolicy(minutes=0, gpu_only=False, grace_minutes=0)
    [decision] = await policy._server(servers, server, view, datetime.now(timezone.utc))
    assert decision["suspend"] and "operation" not in decision, decision
    assert f"Kernel {kernel.id} is idle, last active at" in decision["error"] and "(idle_since)" in decision["error"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", body={"idle_since": "yesterday"}, expect=400)
    seen = (await api(jp_fetch, "kernels", kernel.id))["last_activity"]
    op = await api(jp_fetch, "kernels", kernel.id, "suspend", method="POST", body={"idle_since": seen}, expect=202)
    assert (await wait_operation(jp_fetch, op))["status"] == "succeeded"
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"

    # A user's server of an older version refuses the field it does not know (as its schema says, 400): the
    # policy asks again without it, as it did before it had one.
    class Older(ThisServer):
        async def call(self, server, path, method="GET", body=None, timeout=None):
            if "idle_since" in (body or {}):
                raise ServerError("Unknown field(s) idle_since; allowed fields: images.", 400)
            return await super().call(server, path, method, body, timeout)

    await server_sees_idle(jp_fetch, kernel)
    [view] = await servers.views([server])
    [decision] = await policy._server(Older(jp_fetch), server, view, datetime.now(timezone.utc))
    assert decision["suspend"] and "operation" in decision, decision
    assert (await wait_operation(jp_fetch, await api(jp_fetch, "operations", decision["operation"])))["status"] == \
        "succeeded"


async def test_the_idle_policys_cpu_option_transplants_only_a_kernel_whose_objects_all_carry(jp_fetch, kernel):
    """--idle-to-cpu, decided on a real server's dry runs: a kernel whose objects all carry goes to the CPU,
    one with a generator is suspended and the decision names it. A kernel on the CPU already is suspended
    whatever the option says. (The transplant of an idle GPU kernel runs in the gpu suite,
    test_gpu_kernel_side.py.)"""
    servers = ThisServer(jp_fetch)
    [server] = await servers.running()
    policy = IdlePolicy(minutes=0, gpu_only=False, grace_minutes=0, to_cpu=True)
    await kernel.run("x = [1, 2, 3]")
    # As a server describes a kernel on one GPU (this one holds none: the dry run is the same).
    on_gpu = {"id": kernel.id, "gpus": [{"index": 0, "uuid": "GPU-0", "memory_used": 2 << 30}]}
    assert await policy._cpu_or_suspend(servers, server, on_gpu, "idle for 11.0 min", "node-a") == (
        "transplant", "idle for 11.0 min; transplanted to the CPU, where every object of it carries")
    # One at a time per node in a round (each transplant checks the node's memory for itself alone).
    action, why = await policy._cpu_or_suspend(servers, server, on_gpu, "idle", "node-a")
    assert action == "wait" and "another kernel of its node is being transplanted" in why, why
    assert (await policy._cpu_or_suspend(servers, server, on_gpu, "idle", "node-b"))[0] == "transplant"
    on_two = dict(on_gpu, gpus=on_gpu["gpus"] * 2)
    assert (await policy._cpu_or_suspend(servers, server, on_two, "idle", "node-c"))[0] == "suspend", "one GPU only"
    await kernel.run("def count():\n    yield from range(3)\ng = count()\nnext(g)")
    action, why = await policy._cpu_or_suspend(servers, server, on_gpu, "idle for 11.0 min", "node-c")
    assert action == "suspend", why
    assert re.fullmatch(r"idle for 11\.0 min; suspended, as a transplant to the CPU would lose g \(.+\)", why), why
    assert "node-c" not in policy._nodes, "a kernel suspended instead leaves its node free"

    # A user's server answers the dry run with what it likes (its user controls it): believed only if the
    # answer is a dry run's, else the kernel is suspended, saying why.
    class Lying(ThisServer):
        async def call(self, server, path, method="GET", body=None, timeout=None):
            if (body or {}).get("dry_run"):
                return {"carries": "everything", "left": []}
            return await super().call(server, path, method, body, timeout)

    action, why = await policy._cpu_or_suspend(Lying(jp_fetch), server, on_gpu, "idle", "node-d")
    assert action == "suspend" and why.startswith("idle; suspended, as its dry run to the CPU failed ("), why
    assert "node-d" not in policy._nodes

    await server_sees_idle(jp_fetch, kernel)
    [decision] = await policy.run_once(servers)
    assert decision["suspend"] and decision["action"] == "suspend" and decision["kernel"] == kernel.id, decision
    op = await wait_operation(jp_fetch, await api(jp_fetch, "operations", decision["operation"]))
    assert op["action"] == "suspend" and op["status"] == "succeeded", op

    # Acted on as a kernel on a GPU is (its view says it holds one: the dry run runs, then the request, with the
    # last activity read once the dry run, which ran code in the kernel, was over: a view's own would be refused).
    assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
    await kernel.run("del g")
    await server_sees_idle(jp_fetch, kernel)
    [view] = await servers.views([server])
    view["kernels"][0]["gpus"] = on_gpu["gpus"]
    policy = IdlePolicy(minutes=0, gpu_only=False, grace_minutes=0, to_cpu=True)
    [decision] = await policy._server(servers, server, view, datetime.now(timezone.utc))
    assert decision.get("action") == "transplant" and "operation" in decision, decision
    op = await wait_operation(jp_fetch, await api(jp_fetch, "operations", decision["operation"]))
    assert op["action"] == "transplant" and op["status"] == "succeeded", op
