"""`jupyter gpumigrate`: doctor, list, suspend, resume, migrate, drain.

The CLI talks to running Jupyter servers through their REST API, found the way `jupyter server list`
finds them (runtime files), or named with --url and --token. HTTP goes through the standard library's
urllib: four JSON calls do not justify another dependency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from .engine import doctor
from .engine.nodehelper import DEFAULT_SOCKET

API = "api/gpumigrate"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 0, 1, 2, 3


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Server:
    url: str
    token: str

    def request(self, method: str, path: str, body: dict | None = None, timeout: float = 30) -> Any:
        url = self.url.rstrip("/") + "/" + path.lstrip("/")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"token {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403):
                raise CliError(
                    f"The server at {self.url} refused the token (HTTP {exc.code}): pass its token with "
                    f"--token or $JUPYTER_TOKEN (`jupyter server list` shows it).",
                    EXIT_NO_SERVER,
                ) from None
            try:
                message = json.loads(exc.read()).get("message") or exc.reason
            except ValueError:
                message = exc.reason
            raise CliError(f"{message}", EXIT_FAILED) from None
        except (urllib.error.URLError, OSError) as exc:
            raise CliError(f"Cannot reach the server at {self.url}: {exc}.", EXIT_NO_SERVER) from None


def find_servers(args: argparse.Namespace) -> list[Server]:
    if args.url:
        return [Server(args.url, args.token or os.environ.get("JUPYTER_TOKEN", ""))]
    from jupyter_server.serverapp import list_running_servers

    servers = [Server(info["url"], info.get("token", "")) for info in list_running_servers()]
    found = []
    for server in servers:
        try:
            server.request("GET", f"{API}/kernels", timeout=5)
        except CliError:
            continue  # not running the extension, or not answering
        found.append(server)
    if not found:
        raise CliError(
            "No running Jupyter server with jupyter_gpumigrate was found. Start one (see README), or name "
            "it with --url URL --token TOKEN.",
            EXIT_NO_SERVER,
        )
    return found


def all_kernels(servers: list[Server]) -> list[tuple[Server, dict]]:
    return [(server, k) for server in servers for k in server.request("GET", f"{API}/kernels")]


def find_kernel(servers: list[Server], wanted: str) -> tuple[Server, dict]:
    """The kernel whose id is ``wanted`` or starts with it (unique prefix)."""
    kernels = all_kernels(servers)
    exact = [(s, k) for s, k in kernels if k["id"] == wanted]
    matches = exact or [(s, k) for s, k in kernels if k["id"].startswith(wanted)]
    if not matches:
        raise CliError(f"No kernel {wanted} on {', '.join(s.url for s in servers)}: see `jupyter gpumigrate list`.")
    if len(matches) > 1:
        ids = ", ".join(k["id"] for _, k in matches)
        raise CliError(f"'{wanted}' matches several kernels ({ids}): give more of the id.", EXIT_USAGE)
    return matches[0]


def human_bytes(n: int | None) -> str:
    if not n:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1024 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


# -- commands ---------------------------------------------------------------------------------------


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks(args.criu, args.helper_socket or None)
    ok = doctor.can_migrate(checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [c.to_dict() for c in checks]}, indent=1))
    else:
        rows = [[c.name, c.status.upper(), c.detail, c.remedy] for c in checks]
        print(table(rows, ["CHECK", "STATUS", "DETAIL", "REMEDY"]))
        print()
        print("This machine can suspend and migrate kernels." if ok else "This machine cannot migrate kernels yet: "
              "apply the remedies of the FAIL rows.")
    return EXIT_OK if ok else EXIT_FAILED


def cmd_list(args: argparse.Namespace) -> int:
    kernels = all_kernels(find_servers(args))
    if args.json:
        print(json.dumps([dict(k, server=s.url) for s, k in kernels], indent=1))
        return EXIT_OK
    rows = []
    for _, k in kernels:
        gpus = ",".join(str(g["index"]) for g in k["gpus"]) or "-"
        rows.append([k["id"], k["name"], k.get("host") or "-", str(k["pid"] or "-"), k["state"],
                     k["execution_state"] or "-", gpus, human_bytes(k["image_bytes"])])
    if not rows:
        print("No kernels are running.")
    else:
        print(table(rows, ["KERNEL", "NAME", "HOST", "PID", "STATE", "EXECUTION", "GPUS", "IMAGES"]))
    return EXIT_OK


def cmd_action(args: argparse.Namespace) -> int:
    server, kernel = find_kernel(find_servers(args), args.kernel_id)
    body = {"to_gpu": args.to_gpu} if getattr(args, "to_gpu", None) is not None else {}
    if getattr(args, "to_host", None):
        body["to_host"] = args.to_host
    if getattr(args, "no_fast_path", False):
        body["fast_path"] = "off"
    if args.command == "migrate" and not body.keys() - {"fast_path"}:
        print("migrate needs --to-gpu N or --to-host NAME.", file=sys.stderr)
        return EXIT_USAGE
    op = server.request("POST", f"{API}/kernels/{kernel['id']}/{args.command}", body)
    op = follow(server, op, quiet=args.json, timeout=args.timeout)
    if args.json:
        print(json.dumps(op, indent=1))
    elif op["status"] == "succeeded":
        slowest = max(op["timings"], key=op["timings"].get) if op["timings"] else "-"
        if args.command == "migrate" and op.get("to_host"):
            gpu = f", GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
            print(f"Kernel {kernel['id']} moved from host {op['from_host']} to host {op['to_host']}{gpu} in "
                  f"{op['total']:.2f} s ({human_bytes(op['bytes'])} sent; slowest phase: {slowest}).")
        elif args.command == "migrate":
            fast = op.get("fast_path") or {}
            how = (f", {human_bytes(fast['stashed'])} of it by the fast path" if fast.get("stashed") else
                   f"; by the driver alone: {fast['reason']}" if fast.get("reason") else "")
            print(f"Kernel {kernel['id']} moved from GPU {op['from_gpu']} to GPU {op['to_gpu']} in "
                  f"{op['total']:.2f} s ({human_bytes(op['bytes'])} of GPU memory{how}; slowest phase: {slowest}).")
        else:
            done = "suspended" if args.command == "suspend" else "resumed"
            where = f" onto GPU {op['to_gpu']}" if op.get("to_gpu") is not None else ""
            print(f"Kernel {kernel['id']} {done}{where} in {op['total']:.2f} s ({human_bytes(op['bytes'])} of "
                  f"images; slowest phase: {slowest}).")
    if op["status"] != "succeeded":
        if not args.json:
            print(f"{args.command} failed in phase {op.get('failed_phase') or op.get('phase')}: {op['error']}",
                  file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    servers = find_servers(args)
    if len(servers) > 1 and not args.url:
        raise CliError("Several servers run jupyter_gpumigrate here: name one with --url and --token.", EXIT_USAGE)
    server = servers[0]
    body = {"to_gpu": args.to_gpu} if args.to_gpu is not None else {}
    op = server.request("POST", f"{API}/gpus/{args.gpu}/drain", body)
    progress = DrainProgress()

    def show(op: dict) -> None:
        for line in progress.lines(op):
            print(line, file=sys.stderr, flush=True)

    op = follow(server, op, quiet=args.json, timeout=args.timeout, on_change=None if args.json else show)
    moved = [r for r in op["results"] if r["status"] == "succeeded"]
    if args.json:
        print(json.dumps(op, indent=1))
    elif not op["results"] and op["status"] == "succeeded":
        print(f"GPU {args.gpu} holds no kernel of this server: nothing to move.")
    elif op["status"] == "succeeded":
        where = ", ".join(sorted({f"GPU {r['to_gpu']}" for r in moved}))
        print(f"GPU {args.gpu} drained: {len(moved)} kernel(s) moved to {where} in {op['total']:.2f} s.")
    else:
        print(f"GPU {args.gpu} not drained: {len(moved)} of {len(op['results'])} kernel(s) moved; the others "
              f"run on where they were.")
    if op["status"] != "succeeded":
        if not args.json:
            print(f"drain failed: {op['error']}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


class DrainProgress:
    """One line per kernel of a drain each time its result changes (moving, moved, NOT moved)."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def lines(self, op: dict) -> list[str]:
        out = []
        for r in op.get("results") or []:
            if self.seen.get(r["kernel_id"]) == r["status"] or r["status"] == "pending":
                continue
            self.seen[r["kernel_id"]] = r["status"]
            if r["status"] == "running":
                out.append(f"  kernel {r['kernel_id']}: moving to GPU {r.get('to_gpu')}...")
            elif r["status"] == "succeeded":
                out.append(f"  kernel {r['kernel_id']}: moved to GPU {r.get('to_gpu')}")
            else:
                out.append(f"  kernel {r['kernel_id']}: NOT moved: {r.get('error') or 'unknown error'}")
        return out


def follow(server: Server, op: dict, quiet: bool, timeout: float, on_change: Any = None) -> dict:
    """Follow the operation until it ends, printing each phase as it starts (to stderr), and calling
    ``on_change(op)`` with each version seen, the first and the last included."""
    deadline = time.monotonic() + timeout
    shown = None
    while True:
        if on_change is not None:
            on_change(op)
        if op["status"] in ("succeeded", "failed"):
            return op
        if op["phase"] and op["phase"] != shown and not quiet:
            print(f"  {op['phase']}...", file=sys.stderr, flush=True)
            shown = op["phase"]
        if time.monotonic() > deadline:
            raise CliError(
                f"Operation {op['id']} is still {op['status']} after {timeout:.0f} s; it goes on in the server. "
                f"Follow it with GET /api/gpumigrate/operations/{op['id']}."
            )
        # The server holds this request until the operation changes (long poll): no busy polling.
        op = server.request("GET", f"{API}/operations/{op['id']}?after={op['version']}", timeout=60)


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", help="the server's URL (default: every running server with the extension)")
    remote.add_argument("--token", help="the server's token (default: from its runtime file, or $JUPYTER_TOKEN)")
    remote.add_argument("--timeout", type=float, default=3600, help="seconds to wait for an operation")

    top = argparse.ArgumentParser(
        prog="jupyter gpumigrate", description="Suspend, resume and move live Jupyter kernels."
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("doctor", parents=[common], help="can this machine migrate kernels? what to fix")
    d.add_argument("--criu", help="the CRIU binary to check (default: /usr/local/sbin/criu, else PATH)")
    d.add_argument("--helper-socket", default=DEFAULT_SOCKET,
                   help=f"the node helper's socket, used by a server run by an ordinary user ({DEFAULT_SOCKET}; "
                   "empty: none)")
    d.set_defaults(func=cmd_doctor)
    lst = sub.add_parser("list", parents=[common, remote], help="kernels, their state, GPUs and images")
    lst.set_defaults(func=cmd_list)
    s = sub.add_parser("suspend", parents=[common, remote], help="write a kernel to disk and free its memory")
    s.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    s.set_defaults(func=cmd_action)
    r = sub.add_parser("resume", parents=[common, remote], help="bring a suspended kernel back")
    r.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    r.add_argument("--to-gpu", type=int, help="GPU index to resume a GPU kernel on")
    r.set_defaults(func=cmd_action)
    m = sub.add_parser("migrate", parents=[common, remote],
                       help="move a running kernel to another GPU, or to a peer host and back")
    m.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    m.add_argument("--to-gpu", type=int, help="index of the GPU to move it to (on --to-host, that host's)")
    m.add_argument("--to-host", metavar="NAME", help="a peer server (c.GPUMigrateApp.peers); the server's own "
                   "name brings a kernel back")
    m.add_argument("--no-fast-path", action="store_true", help="let the CUDA driver copy all GPU memory (no stash "
                   "of tensors on the target GPU; docs/performance.md)")
    m.set_defaults(func=cmd_action)
    dr = sub.add_parser("drain", parents=[common, remote], help="move every kernel off a GPU (maintenance)")
    dr.add_argument("--gpu", type=int, required=True, help="index of the GPU to empty")
    dr.add_argument("--to-gpu", type=int, help="where to put them (default: the GPU with most room, each)")
    dr.set_defaults(func=cmd_drain)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc)}))
        else:
            print(f"jupyter gpumigrate: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
