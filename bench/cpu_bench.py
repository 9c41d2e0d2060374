"""Suspend and resume timings of real kernels through a real server, against the memory a kernel holds.

Starts `jupyter server` with the extension (a token, a free port, a temporary root and state dir), and
for each size starts an IPython kernel, fills that much memory in it, then suspends and resumes it
through the REST API, checking after the resume that the kernel still holds its data. Phase timings come
from the operations themselves. The last thing printed is a short table; --out writes all as JSON.

``--ways`` compares who runs CRIU (docs/users.md), in one run, side by side: ``root`` (the server is
root), ``helper`` (the server runs as an ordinary user made for the run, the node helper as root) and
``capabilities`` (that user, and a copy of CRIU given cap_checkpoint_restore,cap_setpcap). The user
ways need root to set up, and reuse the tests' users.py. A way may name where the images go:
``-memory`` (/dev/shm; the helper's own tmpfs, --memory-root, in /run) or ``-disk`` (the run's folder under /tmp);
without it, the server's default (root: auto, memory where there is room; the users' ways: disk). The
floors, measured in the same run before the kernels, for each place a way names: one file of the largest
size written and read by dd (O_DIRECT on disk), as CRIU writes and reads its pages file; memory's in
/dev/shm, a tmpfs as the helper's is.

    .venv/bin/python bench/cpu_bench.py [--sizes 0,1,4] [--repeat 2] [--ways root,helper-memory] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import websocket  # websocket-client, a dependency of jupyter_server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import text_table  # noqa: E402

GB = 10**9

FILL = """
size = int({size} * 1e9)
data = bytearray(size)
for i in range(0, size, 4096):   # touch every page: the kernel really holds {size} GB
    data[i] = i % 251
print(len(data))
"""
CHECK = "print(all(data[i] == i % 251 for i in range(0, len(data), 4096 * 97)), len(data))"


class Way:
    """What the bench needs of a server, however it runs: ``api``, and these two."""

    url = token = ""

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        raise NotImplementedError

    def run(self, kernel_id: str, code: str, timeout: float = 600) -> str:
        return execute(self.url, self.token, kernel_id, code, timeout)

    @staticmethod
    def succeeded(op: dict, action: str) -> dict:
        if op["status"] != "succeeded":
            raise RuntimeError(f"{action} failed: {op['error']}")
        return op


class Server(Way):
    def __init__(self, root: Path, config: dict | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = open(root / "server.log", "wb")  # noqa: SIM115 - closed in stop()
        # The extension is enabled here, not by the installed jupyter-config: where the package was
        # installed with pip --target (the GPU machine), that file is not on Jupyter's config path.
        settings = {"ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
                    "MigratableProvisioner": {"state_dir": str(root / "state")}}
        for section, values in (config or {}).items():
            settings.setdefault(section, {}).update(values)
        path = root / "server_config.json"
        path.write_text(json.dumps(settings))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", f"--config={path}", "--no-browser", "--allow-root",
             f"--port={self.port}", "--ip=127.0.0.1", f"--ServerApp.token={self.token}",
             f"--ServerApp.root_dir={root}"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.api("GET", "api/gpumigrate/kernels")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"the server did not start; see {root / 'server.log'}") from None
                time.sleep(0.2)

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode() if method == "POST" else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Authorization", f"token {self.token}")
        with urllib.request.urlopen(req, timeout=600) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else {}

    def operate(self, kernel_id: str, action: str, body: dict | None = None) -> dict:
        op = self.api("POST", f"api/gpumigrate/kernels/{kernel_id}/{action}", body)
        while op["status"] not in ("succeeded", "failed"):
            op = self.api("GET", f"api/gpumigrate/operations/{op['id']}?after={op['version']}")
        return self.succeeded(op, action)

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=60)
        self.log.close()


def execute(url: str, token: str, kernel_id: str, code: str, timeout: float = 600) -> str:
    """Execute ``code`` through the server's websocket, as a notebook tab does; return its output."""
    ws = websocket.create_connection(
        url.replace("http", "ws") + f"api/kernels/{kernel_id}/channels",
        header=[f"Authorization: token {token}"], timeout=timeout,
    )
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "bench", "session": msg_id,
                   "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "channel": "shell",
        "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                    "allow_stdin": False},
    }))
    out = []
    try:
        while True:
            msg = json.loads(ws.recv())
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise RuntimeError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        ws.close()


class UserWay(Way):
    """A server run by an ordinary user, CRIU through the node helper or with capabilities (users.py)."""

    def __init__(self, way: str, root: Path, where: str | None = None) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from users import NodeHelper, UserServer, Users, root_only_folder

        self.users = Users([f"gmbench{os.getpid()}"])
        self.helper = None
        self.memory: Path | None = None
        name = self.users.names[0]
        os.chmod(root, 0o755)
        if way == "helper":
            # in memory: a tmpfs the helper mounts on a way only root writes (NodeHelper.stop unmounts it)
            self.memory = root_only_folder("gpumigrate-bench-memory-") if where == "memory" else None
            self.helper = NodeHelper(root, memory=self.memory / "memory" if self.memory else None, memory_size="50%")
            config = {"helper_socket": str(self.helper.socket)}
        else:
            criu = root / "criu-with-capabilities"
            shutil.copy("/usr/local/sbin/criu", criu)
            subprocess.run(["setcap", "cap_checkpoint_restore,cap_setpcap+eip", str(criu)], check=True)
            config = {"helper_socket": "", "criu_path": str(criu)}
        self.server = UserServer(name, root / name, {**config, **({"suspend_to": where} if where else {})}).start()
        self.url, self.token = self.server.url, self.server.token

    def api(self, method: str, path: str, body: dict | None = None) -> dict:
        return self.server.api(method, path, body if method == "POST" else None) or {}

    def operate(self, kernel_id: str, action: str) -> dict:
        return self.succeeded(self.server.operate(kernel_id, action, timeout=3600), action)

    def stop(self) -> None:
        self.server.stop()
        if self.helper is not None:
            self.helper.stop()
        if self.memory is not None:
            shutil.rmtree(self.memory, ignore_errors=True)
        self.users.close()


def table(rows: list[dict], floors: dict | None = None) -> str:
    """One line per round. Written: the seconds the images took to write (the host stash, where the kernel's
    large buffers went, then CRIU's dump); read: to read back (CRIU's restore, then the unstash)."""
    head = ["way", "images", "kernel GB", "images GB", "suspend s", "written s", "resume s", "read s", "adopt s",
            "GB/s written", "GB/s read", "floor GB/s write / read"]
    body = []
    for r in rows:
        s, m = r["suspend"]["timings"], r["resume"]["timings"]
        gbytes = r["image_bytes"] / GB
        written, read = s.get("stash", 0) + s["dump"], m["restore"] + m.get("unstash", 0)
        place = r["suspend"].get("images") or "?"
        floor = (floors or {}).get(place)
        body.append([r.get("way", "root"), place, f"{r['size_gb']:g}", f"{gbytes:.2f}", f"{r['suspend']['total']:.2f}",
                     f"{written:.2f}", f"{r['resume']['total']:.2f}", f"{read:.2f}", f"{m['adopt']:.2f}",
                     f"{gbytes / written:.2f}", f"{gbytes / read:.2f}",
                     f"{floor['write']:.2f} / {floor['read']:.2f}" if floor else ""])
    return text_table(head, body)


def place_floors(places: set[str], nbytes: int, disk_dir: Path) -> dict:
    """One file of ``nbytes`` written then read by dd in each of ``places`` (memory: /dev/shm; disk: ``disk_dir``,
    O_DIRECT, as the page cache would otherwise answer the read), GB/s: what one CRIU pages file could get."""
    out: dict = {}
    count = max(1, nbytes // (16 << 20))
    for place in sorted(places):
        folder = Path("/dev/shm") if place == "memory" else disk_dir
        probe = folder / f"gpumigrate-floor-{os.getpid()}.bin"
        direct = place == "disk"
        try:
            speeds = []
            for args in ([f"of={probe}", "if=/dev/zero", *(["oflag=direct"] if direct else [])],
                         [f"if={probe}", "of=/dev/null", *(["iflag=direct"] if direct else [])]):
                t0 = time.perf_counter()
                subprocess.run(["dd", *args, "bs=16M", f"count={count}", "status=none"], check=True)
                speeds.append(round(count * (16 << 20) / (time.perf_counter() - t0) / GB, 2))
            out[place] = {"write": speeds[0], "read": speeds[1]}
        finally:
            probe.unlink(missing_ok=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0,1,4", help="GB of memory each kernel holds")
    parser.add_argument("--repeat", type=int, default=2, help="suspend/resume rounds per size")
    parser.add_argument("--ways", default="root", help="who runs CRIU: root, helper, capabilities (comma-separated)")
    parser.add_argument("--out", help="write every row as JSON here")
    args = parser.parse_args()
    rows: list[dict] = []
    ways = args.ways.split(",")
    for way in ways:
        who, _, where = way.partition("-")
        if who not in ("root", "helper", "capabilities") or where not in ("", "memory", "disk"):
            parser.error(f"{way!r} is not a way: root, helper or capabilities, then -memory or -disk if you like")
    largest = int(max(float(s) for s in args.sizes.split(",")) * GB)
    floors = place_floors({w.partition("-")[2] for w in ways} - {""}, max(largest, GB), Path("/tmp"))
    for way in ways:
        who, _, where = way.partition("-")
        root = Path(tempfile.mkdtemp(prefix="gpumigrate-cpu-bench-", dir="/tmp"))
        if who == "root":
            server: Way = Server(root, {"MigratableProvisioner": {"suspend_to": where}} if where else None)
        else:
            server = UserWay(who, root, where or None)
        try:
            bench(server, way, args, rows)
        finally:
            server.stop()
            shutil.rmtree(root, ignore_errors=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "kernel": os.uname().release, "floors": floors,
            "command": " ".join(["bench/cpu_bench.py", *sys.argv[1:]])}
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"\n# {meta['date']}, {meta['cpus']} CPUs, Linux {meta['kernel']}")
    print(table(rows, floors))
    return 0


def bench(server: Way, way: str, args: argparse.Namespace, rows: list[dict]) -> None:
    for size in (float(s) for s in args.sizes.split(",")):
        kernel_id = server.api("POST", "api/kernels", {"name": "python3"})["id"]
        server.run(kernel_id, FILL.format(size=size))
        for _ in range(args.repeat):
            suspended = server.operate(kernel_id, "suspend")
            resumed = server.operate(kernel_id, "resume")
            assert server.run(kernel_id, CHECK).split()[0] == "True", "the kernel lost its data"
            row = {"way": way, "size_gb": size, "image_bytes": suspended["bytes"], "suspend": suspended,
                   "resume": resumed}
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("way", "size_gb", "image_bytes")} | {
                "suspend": suspended["timings"], "resume": resumed["timings"]}), flush=True)
        server.api("DELETE", f"api/kernels/{kernel_id}")


if __name__ == "__main__":
    sys.exit(main())
