"""`jupyter gpumigrate`: doctor, list, suspend, resume, migrate, transplant, back, discard, drain.

The CLI talks to running Jupyter servers through their REST API, found the way `jupyter server list`
finds them (runtime files), or named with --url and --token, through apiclient.Client (the standard
library's urllib); what it prints of sizes and operations comes from opformat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import __version__
from jupyter_gpumigrate_client.apiclient import ApiError, Client, NotFinished, Unreachable, quote
from .engine import doctor
from .engine.nodehelper import DEFAULT_SOCKET
from .opformat import DrainProgress, PhaseProgress, drain_report, report, size, survey_report

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_SERVER = 0, 1, 2, 3
#: A reader closed our stdout (`... | head`): what a shell reports for a process killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13

DESCRIPTION = """\
Suspend, resume and move live Jupyter kernels (GPU included) with CRIU.

The commands talk to the running Jupyter servers that have the jupyter_gpumigrate server extension
(found as `jupyter server list` finds them), or to the one named with --url and --token.
Each command takes --help."""

EXAMPLES = """\
Examples
--------

    jupyter gpumigrate doctor                      # can this machine migrate kernels? what to fix
    sudo jupyter gpumigrate install-criu           # CRIU >= 4.2, built if the system has none
    jupyter gpumigrate list                        # kernels, their state, GPUs and images
    jupyter gpumigrate suspend 3f2a --images disk  # a kernel (id or unique prefix) to disk
    jupyter gpumigrate resume 3f2a --to-gpu 1
    jupyter gpumigrate migrate 3f2a --to-gpu 1     # a running kernel to another GPU
    jupyter gpumigrate transplant 3f2a --to-cpu    # its objects into a new kernel without a GPU (asks first)
    jupyter gpumigrate transplant 3f2a --to-host b --to-gpu 0   # ...on a peer's GPU of another model
    jupyter gpumigrate back 3f2a                   # after a transplant: back to the process it replaced
    jupyter gpumigrate drain --gpu 0               # every kernel off GPU 0
    jupyter gpumigrate drain --gpu 0 --transplant  # ...transplanting those the driver cannot move
    jupyter gpumigrate list --json --url http://host:8888/ --token TOKEN

Exit status: 0 done, 1 failed, 2 usage, 3 no server (or token refused)."""


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Server:
    """A server's API, with the CLI's words for what goes wrong: a refused token and no answer exit 3."""

    url: str
    token: str

    @property
    def client(self) -> Client:
        return Client.with_token(self.url, self.token)

    def call(self, fn: Callable[[Client], Any]) -> Any:
        try:
            return fn(self.client)
        except Unreachable as exc:
            raise CliError(f"Cannot reach the server at {self.url}: {exc.reason}.", EXIT_NO_SERVER) from None
        except NotFinished as exc:
            raise CliError(str(exc), EXIT_FAILED) from None
        except ApiError as exc:
            if exc.refused:
                raise CliError(
                    f"The server at {self.url} refused the token (HTTP {exc.status}): pass its token with "
                    f"--token or $JUPYTER_TOKEN (`jupyter server list` shows it).",
                    EXIT_NO_SERVER,
                ) from None
            raise CliError(str(exc), EXIT_FAILED) from None


def find_servers(args: argparse.Namespace) -> list[Server]:
    if args.url:
        try:
            parts = urllib.parse.urlsplit(args.url)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
        except ValueError as exc:
            raise CliError(f"--url {args.url!r} is not an address ({exc}): give the server's, as "
                           "`jupyter server list` prints it (http://127.0.0.1:8888/).", EXIT_USAGE) from None
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise CliError(f"--url {args.url!r} is not an http:// or https:// address: give the server's, as "
                           "`jupyter server list` prints it (http://127.0.0.1:8888/).", EXIT_USAGE)
        return [Server(args.url, args.token or os.environ.get("JUPYTER_TOKEN", ""))]
    from jupyter_server.serverapp import list_running_servers

    servers = [Server(info["url"], info.get("token", "")) for info in list_running_servers()]
    found = []
    for server in servers:
        try:
            server.call(lambda c: c.kernels(timeout=5))
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
    return [(server, k) for server in servers for k in server.call(Client.kernels)]


def find_kernel(servers: list[Server], wanted: str) -> tuple[Server, dict]:
    """The kernel whose id is ``wanted`` or starts with it (unique prefix)."""
    if not wanted.strip():  # an empty variable in a script: it would match every kernel
        raise CliError("Name a kernel: its id, or a unique prefix of it (an empty one names none; "
                       "`jupyter gpumigrate list` shows the ids).", EXIT_USAGE)
    kernels = all_kernels(servers)
    exact = [(s, k) for s, k in kernels if k["id"] == wanted]
    matches = exact or [(s, k) for s, k in kernels if k["id"].startswith(wanted)]
    if not matches:
        raise CliError(f"No kernel {wanted} on {', '.join(s.url for s in servers)}: see `jupyter gpumigrate list`.")
    if len(matches) > 1:
        ids = ", ".join(k["id"] for _, k in matches)
        raise CliError(f"'{wanted}' matches several kernels ({ids}): give more of the id.", EXIT_USAGE)
    return matches[0]


def refused_records(server: Server) -> list[dict]:
    """The records ``server`` did not take back as it started (GET /refused); none from a server too old
    to say."""
    try:
        records = server.call(lambda c: c.get("refused"))
    except CliError:
        return []
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def _images(kernel: dict) -> str:
    """A kernel's images in the list: their size, and where they are ("(memory)", "(disk)")."""
    if not kernel.get("image_bytes"):
        return "-"
    return size(kernel["image_bytes"]) + (f" ({kernel['images']})" if kernel.get("images") else "")


def suspended_total(kernels: list[dict]) -> tuple[int, int]:
    """How many kernels are suspended, and the bytes of their images."""
    suspended = [k for k in kernels if k["state"] == "suspended"]
    return len(suspended), sum(k.get("image_bytes") or 0 for k in suspended)


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    return "\n".join(lines)


# -- commands ---------------------------------------------------------------------------------------


def record_checks(args: argparse.Namespace) -> list[doctor.Check]:
    """One row per record that a running server did not take back as it started, with its remedy."""
    try:
        servers = find_servers(args)
    except CliError:
        return [doctor.Check("kernel records", doctor.INFO, "no running server with jupyter_gpumigrate to ask",
                             "Start the server (or name it with --url and --token) to check its kernels' records.")]
    checks = []
    for server in servers:
        for record in refused_records(server):
            checks.append(doctor.Check(f"record {record['kernel_id'][:8]}", doctor.WARN,
                                       f"not taken back: {record['path']}: {record['reason']}", record["remedy"]))
    if not checks:
        checks.append(doctor.Check("kernel records", doctor.OK, f"every record was taken back ({len(servers)} "
                                   "server(s))"))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor.run_checks(args.criu, args.helper_socket or None) + record_checks(args)
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


def ensure_criu_script() -> str:
    """scripts/ensure-criu.sh: in the package (a wheel carries it), else in the source tree (a checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))
    packaged, checkout = here, os.path.join(os.path.dirname(here), "scripts")
    for path in (os.path.join(packaged, "ensure-criu.sh"), os.path.join(checkout, "ensure-criu.sh")):
        if os.path.isfile(path):
            return path
    raise CliError("ensure-criu.sh is missing from this installation of jupyter-gpumigrate: reinstall it "
                   "(pip install --force-reinstall jupyter-gpumigrate), or run scripts/ensure-criu.sh of its "
                   "source tree as root.")


def cmd_install_criu(args: argparse.Namespace) -> int:
    """Run ensure-criu.sh: keep a working CRIU >= 4.2, or build and install one (as root)."""
    extra = ["--print-path"] if args.print_path else ["--bundle", args.bundle] if args.bundle else []
    launcher = os.path.join(os.path.dirname(sys.executable), "jupyter-gpumigrate")
    command = f"{launcher} install-criu" if os.path.exists(launcher) else "jupyter gpumigrate install-criu"
    env = dict(os.environ, ENSURE_CRIU_COMMAND=command)
    if args.criu_install:
        env["CRIU_INSTALL"] = args.criu_install
    return subprocess.run(["bash", ensure_criu_script(), *extra], env=env).returncode


def cmd_list(args: argparse.Namespace) -> int:
    servers = find_servers(args)
    kernels = all_kernels(servers)
    refused = [dict(r, server=s.url) for s in servers for r in refused_records(s)]
    count, image_bytes = suspended_total([k for _, k in kernels])
    if args.json:
        print(json.dumps({"kernels": [dict(k, server=s.url) for s, k in kernels],
                          "suspended": {"kernels": count, "image_bytes": image_bytes},
                          "refused": refused}, indent=1))
        return EXIT_OK
    rows = []
    for _, k in kernels:
        gpus = ",".join(str(g["index"]) for g in k["gpus"]) or "-"
        rows.append([k["id"], k["name"], k.get("host") or "-", str(k["pid"] or "-"), k["state"],
                     k["execution_state"] or "-", gpus, _images(k)])
    if not rows:
        print("No kernels are running.")
    else:
        print(table(rows, ["KERNEL", "NAME", "HOST", "PID", "STATE", "EXECUTION", "GPUS", "IMAGES"]))
    if count:
        print(f"\n{count} suspended kernel(s): {size(image_bytes)} of images "
              "(`jupyter gpumigrate discard KERNEL --yes` deletes a kernel's).")
    if refused:
        print("\nNot taken back at the server's start (left on disk; `jupyter gpumigrate doctor` says what to do):")
        for record in refused:
            print(f"  {record['path']}: {record['reason']}")
    return EXIT_OK


def cmd_discard(args: argparse.Namespace) -> int:
    """Shut a suspended kernel down for good: its images (its whole memory) are deleted."""
    server, kernel = find_kernel(find_servers(args), args.kernel_id)
    if kernel["state"] != "suspended":
        raise CliError(f"Kernel {kernel['id']} is {kernel['state']}, not suspended: discard deletes a suspended "
                       "kernel's images. Shut a running kernel down from its notebook (or its server's "
                       "/api/kernels).", EXIT_FAILED)
    freed = kernel.get("image_bytes") or 0
    where = f" in {kernel['images']}" if kernel.get("images") else ""
    if not confirmed(args, f"Kernel {kernel['id']} ({kernel.get('name') or 'kernel'}) is deleted for good with its "
                     f"images ({size(freed)}{where}): everything it held is lost.", "Discard it?",
                     "Discarding deletes the kernel's images for good: run it with --yes once you mean it."):
        return EXIT_FAILED
    server.call(lambda _: Client.with_token(server.url, server.token, prefix="api").request(
        "DELETE", f"kernels/{quote(kernel['id'])}"))
    if args.json:
        print(json.dumps({"kernel_id": kernel["id"], "discarded": True, "freed_bytes": freed}))
    else:
        print(f"Kernel {kernel['id']} discarded: {size(freed)} of images deleted.")
    return EXIT_OK


def gpu_list(text: str) -> list[int]:
    """``--to-gpu`` of a move or resume: one GPU (``1``), or one per GPU a kernel holds (``1,0``)."""
    try:
        indices = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a GPU index, nor indices separated by commas (1,0)") from None
    if any(i < 0 for i in indices):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU indices are 0 or more")
    return indices


def gpu_index(text: str) -> int:
    """``--gpu`` of a drain: one GPU index."""
    indices = gpu_list(text)
    if len(indices) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a drain empties one GPU; name it by its index")
    return indices[0]


def seconds(text: str) -> float:
    """``--timeout``: a number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the time to follow an operation is a number of seconds above 0")
    return value


def gpu_body(indices: list[int] | None) -> dict[str, Any]:
    """The request's field for ``--to-gpu``: to_gpu for one GPU, to_gpus for several."""
    if indices is None:
        return {}
    return {"to_gpu": indices[0]} if len(indices) == 1 else {"to_gpus": indices}


def cmd_action(args: argparse.Namespace) -> int:
    server, kernel = find_kernel(find_servers(args), args.kernel_id)
    body = gpu_body(getattr(args, "to_gpu", None))
    if getattr(args, "to_host", None):
        body["to_host"] = args.to_host
    if getattr(args, "no_fast_path", False):
        body["fast_path"] = "off"
    if getattr(args, "images", None):
        body["images"] = args.images
    if args.command == "migrate" and not body.keys() - {"fast_path"}:
        raise CliError("migrate needs --to-gpu N (a GPU of this host) or --to-host NAME (a peer).", EXIT_USAGE)
    op = server.call(lambda c: c.act(kernel["id"], args.command, body))
    return finish(server, op, kernel["id"], args)


def cmd_transplant(args: argparse.Namespace) -> int:
    """Say what would carry; with --yes (or a yes at the prompt) carry it into a new process on the target."""
    if (args.to_gpu is None) == (not args.to_cpu):
        print("transplant needs --to-gpu N or --to-cpu (one of them).", file=sys.stderr)
        return EXIT_USAGE
    server, kernel = find_kernel(find_servers(args), args.kernel_id)
    body: dict[str, Any] = {"to_gpu": args.to_gpu} if args.to_gpu is not None else {"to_cpu": True}
    if args.to_host:
        body["to_host"] = args.to_host
    survey = server.call(lambda c: c.act(kernel["id"], "transplant", {**body, "dry_run": True}))
    if args.dry_run:
        print(json.dumps(survey, indent=1) if args.json else survey_report(survey, kernel["id"]))
        return EXIT_OK
    if not confirmed(args, survey_report(survey, kernel["id"]), "Transplant it?",
                     "A transplant loses what is not carried: run it with --yes once you have read the list above "
                     "(or --dry-run to see it alone)."):
        return EXIT_FAILED
    accepted = [r["name"] for r in survey.get("left", [])]
    op = server.call(lambda c: c.act(kernel["id"], "transplant", {**body, "accept_left": accepted}))
    return finish(server, op, kernel["id"], args)


def cmd_back(args: argparse.Namespace) -> int:
    """Go back to the process the kernel's last transplant replaced; with --yes, or a yes at the prompt."""
    server, kernel = find_kernel(find_servers(args), args.kernel_id)
    if not kernel.get("back_until"):
        raise CliError(f"Kernel {kernel['id']} has no earlier process to go back to: none is kept from a transplant "
                       "(c.MigratableProvisioner.keep_transplant_source says for how long one is).")
    warning = (f"Kernel {kernel['id']} goes back to the process its last transplant replaced (kept until "
               f"{kernel['back_until']}): what it did since the transplant is lost.")
    if not confirmed(args, warning, "Go back?", "Going back loses what the kernel did since its transplant: run it "
                     "with --yes once you mean it."):
        return EXIT_FAILED
    op = server.call(lambda c: c.act(kernel["id"], "back", {}))
    return finish(server, op, kernel["id"], args)


def confirmed(args: argparse.Namespace, loss: str, question: str, refusal: str) -> bool:
    """Whether to go on with what loses something: ``loss`` is always said first (on stderr, but with --json
    --yes); then --yes, or a yes at the prompt. Without a terminal to ask on, :class:`CliError` (``refusal``)."""
    if not args.json or not args.yes:
        print(loss, file=sys.stderr)
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise CliError(refusal, EXIT_USAGE)
    if input(f"{question} [y/N] ").strip().lower() in ("y", "yes"):
        return True
    print("Nothing was done.", file=sys.stderr)
    return False


def finish(server: Server, op: dict, kernel_id: str, args: argparse.Namespace) -> int:
    """Follow a kernel's operation to its end and say how it went (JSON, or a line); its exit status."""
    op = follow(server, op, quiet=args.json, timeout=args.timeout)
    if args.json:
        print(json.dumps(op, indent=1))
    elif op["status"] == "succeeded":
        print(report(op, kernel_id))
    if op["status"] != "succeeded":
        if not args.json:
            print(report(op, kernel_id), file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    servers = find_servers(args)
    if len(servers) > 1 and not args.url:
        raise CliError("Several servers run jupyter_gpumigrate here: name one with --url and --token.", EXIT_USAGE)
    server = servers[0]
    body: dict = {"to_gpu": args.to_gpu} if args.to_gpu is not None else {}
    if args.transplant:
        body["transplant"] = True
    op = server.call(lambda c: c.drain(args.gpu, body))
    progress = DrainProgress()

    def show(op: dict) -> None:
        for line in progress.lines(op):
            print(line, file=sys.stderr, flush=True)

    op = follow(server, op, quiet=args.json, timeout=args.timeout, on_change=None if args.json else show)
    if args.json:
        print(json.dumps(op, indent=1))
    else:
        print(drain_report(dict(op, gpu=args.gpu)))
    if op["status"] != "succeeded":
        if not args.json:
            print(f"drain failed: {op['error']}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def follow(server: Server, op: dict, quiet: bool, timeout: float,
           on_change: Callable[[dict], None] | None = None) -> dict:
    """Follow the operation until it ends (Client.follow), printing each phase as it starts (to stderr)
    unless ``quiet``, and calling ``on_change(op)`` with each version seen, the first and the last included."""
    phases = PhaseProgress()

    def seen(op: dict) -> None:
        if on_change is not None:
            on_change(op)
        if not quiet:
            for line in phases.lines(op):
                print(line, file=sys.stderr, flush=True)

    return server.call(lambda c: c.follow(op, seen, timeout=timeout))


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("--url", help="the server's URL (default: every running server with the extension)")
    remote.add_argument("--token", help="the server's token (default: from its runtime file, or $JUPYTER_TOKEN)")
    waits = argparse.ArgumentParser(add_help=False)
    waits.add_argument("--timeout", type=seconds, default=3600,
                       help="seconds to follow the operation before giving up on it (it goes on in the server; "
                       "default 3600)")

    top = argparse.ArgumentParser(
        prog="jupyter gpumigrate", description=DESCRIPTION, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("--version", action="version", version=__version__, help="print the version and exit")
    sub = top.add_subparsers(title="Subcommands", dest="command", required=True, metavar="COMMAND")
    d = sub.add_parser("doctor", parents=[common, remote],
                       help="can this machine migrate kernels? what to fix; records its servers did not take back")
    d.add_argument("--criu", help="the CRIU binary to check (default: /usr/local/sbin/criu, else PATH)")
    d.add_argument("--helper-socket", default=DEFAULT_SOCKET,
                   help=f"the node helper's socket, used by a server run by an ordinary user ({DEFAULT_SOCKET}; "
                   "empty: none)")
    d.set_defaults(func=cmd_doctor)
    ic = sub.add_parser("install-criu", help="make sure CRIU >= 4.2 works here: use the system's, or build it "
                        "from Debian's source package and install it (as root; what scripts/ensure-criu.sh does)")
    ic.add_argument("--print-path", action="store_true", help="then print only the CRIU binary's path on stdout")
    ic.add_argument("--bundle", metavar="DIR", help="then copy CRIU and its libraries to DIR/bin and DIR/lib")
    ic.add_argument("--criu-install", metavar="PATH", help="where to install a built CRIU (default "
                    "/usr/local/sbin/criu, which the server takes first)")
    ic.set_defaults(func=cmd_install_criu)
    lst = sub.add_parser("list", parents=[common, remote], help="kernels, their state, GPUs and images")
    lst.set_defaults(func=cmd_list)
    s = sub.add_parser("suspend", parents=[common, remote, waits],
                       help="write a kernel to memory or disk and free its GPU (and, on disk, its memory)")
    s.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    s.add_argument("--images", choices=("auto", "memory", "disk"),
                   help="where the images go: memory (a tmpfs: fast, but it holds host memory and is lost with a "
                   "reboot; moved to disk when the server stops), disk, or auto (memory where there is room); "
                   "default: the server's c.MigratableProvisioner.suspend_to")
    s.set_defaults(func=cmd_action)
    r = sub.add_parser("resume", parents=[common, remote, waits], help="bring a suspended kernel back")
    r.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    r.add_argument("--to-gpu", type=gpu_list, metavar="N[,M...]", help="GPU index to resume a GPU kernel on; for "
                   "a kernel that held several GPUs, one per GPU in the order of their indices (1,0 swaps 0 and 1)")
    r.set_defaults(func=cmd_action)
    m = sub.add_parser("migrate", parents=[common, remote, waits],
                       help="move a running kernel to another GPU, or to a peer host and back")
    m.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    m.add_argument("--to-gpu", type=gpu_list, metavar="N[,M...]", help="index of the GPU to move it to (on "
                   "--to-host, that host's); for a kernel on several GPUs, one per GPU it holds, in the order of "
                   "their indices (1,0 swaps GPUs 0 and 1)")
    m.add_argument("--to-host", metavar="NAME", help="a peer server (c.GPUMigrateApp.peers); the server's own "
                   "name brings a kernel back")
    m.add_argument("--no-fast-path", action="store_true", help="let the CUDA driver copy all GPU memory (no stash "
                   "of tensors on the target GPU; docs/performance.md)")
    m.set_defaults(func=cmd_action)
    t = sub.add_parser("transplant", parents=[common, remote, waits],
                       help="where the driver cannot go (another GPU model, the CPU): carry a running kernel's "
                       "objects into a new process there, saying first what would not carry")
    t.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    t.add_argument("--to-gpu", type=int, help="index of the GPU (any model) to carry the objects to")
    t.add_argument("--to-cpu", action="store_true", help="carry the objects into a kernel without a GPU")
    t.add_argument("--to-host", metavar="NAME", help="a peer's name: the new process starts there (--to-gpu is then "
                   "that host's GPU), and this server relays the kernel to it")
    t.add_argument("--dry-run", action="store_true", help="only say what would carry and what not")
    t.add_argument("--yes", "-y", action="store_true", help="do not ask before transplanting (what would not "
                   "carry is still printed, to stderr)")
    t.set_defaults(func=cmd_transplant)
    b = sub.add_parser("back", parents=[common, remote, waits],
                       help="after a transplant: go back to the process it replaced (kept for a while), losing "
                       "what the kernel did since")
    b.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    b.add_argument("--yes", "-y", action="store_true", help="do not ask first")
    b.set_defaults(func=cmd_back)
    dc = sub.add_parser("discard", parents=[common, remote],
                        help="shut a suspended kernel down for good and delete its images")
    dc.add_argument("kernel_id", help="kernel id, or a unique prefix of it")
    dc.add_argument("--yes", "-y", action="store_true", help="do not ask first (the images are deleted for good)")
    dc.set_defaults(func=cmd_discard)
    dr = sub.add_parser("drain", parents=[common, remote, waits], help="move every kernel off a GPU (maintenance)")
    dr.add_argument("--gpu", type=gpu_index, required=True, help="index of the GPU to empty")
    dr.add_argument("--to-gpu", type=int, help="where to put them (default: the GPU with most room, each)")
    dr.add_argument("--transplant", action="store_true",
                    help="where the driver cannot move a kernel (no GPU of its model with room), transplant its "
                         "objects instead: onto --to-gpu if given, or else the GPU of any model with the most room "
                         "for its GPU tensors and 2 GB, or else the CPU; only a kernel on that GPU alone, all of "
                         "whose objects carry")
    dr.set_defaults(func=cmd_drain)
    return top


def main(argv: list[str] | None = None) -> int:
    """The console script: the command's exit status; a closed stdout (`| head`) ends it quietly."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe must be seen while we can still catch it
        return code
    except BrokenPipeError:
        # As Python's documentation says (signal, "Note on SIGPIPE"): point stdout at devnull so that the
        # interpreter's own flush at exit writes nowhere instead of printing another BrokenPipeError.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _run(argv: list[str] | None) -> int:
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
        if getattr(args, "json", False):  # what a script reads: what stopped, and that the server goes on
            print(json.dumps({"error": "Interrupted: an operation already started goes on in the server "
                                       "(`jupyter gpumigrate list` shows it)."}))
        return 130


if __name__ == "__main__":
    sys.exit(main())
