"""Moving a GPU kernel's state to the other GPU, against the alternatives, in one run on the GPU machine.

For each case (live GB of tensors on GPU 0, and one with 8 GB live + 24 GB freed but cached by
PyTorch's allocator) a plain PyTorch process plays the kernel, and its state goes to GPU 1 by:

  ours        the engine's move_to_gpu, fast path on (engine/stash.py): prepare .. verify
  driver      the CUDA checkpoint driver alone, no preparation: lock, checkpoint, restore+remap, unlock
  suspend     the engine's suspend (CUDA checkpoint + CRIU dump to disk) and resume onto GPU 1
  restart     a new process on GPU 1 that imports torch and rebuilds the tensors from their seeds
              (the cheapest notebook there is: real ones re-train, re-load, re-read)
  snapshot    dill of every global + torch.save of the tensors, loaded by a new process on GPU 1

and for each, whether the state came back whole: a SHA-256 of every tensor, and the live objects a
notebook has (a generator mid-way, an open file, a thread, a socket, a lambda) checked by name.
CPU kernels (real ones, through a real server: bench/cpu_bench.py) are suspended and resumed too.

Writes ``<out-dir>/<date>-<tag>-bench.json`` and a PNG chart beside it; the table comes last.

    python3 bench/gpu_bench.py [--sizes 1,8,32] [--cpu-sizes 0.1,1,4] [--out-dir DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from jupyter_gpumigrate.engine import gpus as gpus_mod  # noqa: E402
from jupyter_gpumigrate.engine import proctree  # noqa: E402
from jupyter_gpumigrate.engine.criu import Criu  # noqa: E402
from jupyter_gpumigrate.engine.cudackpt import CudaProcess, gpu_mapping  # noqa: E402
from jupyter_gpumigrate.engine.images import ImageStore  # noqa: E402
from jupyter_gpumigrate.engine.migration import RUNNING, Migration  # noqa: E402
from jupyter_gpumigrate.engine.stash import Stash  # noqa: E402
from report import text_table  # noqa: E402

GB = 10**9
METHODS = ("ours", "driver", "suspend", "restart", "snapshot")

#: The "kernel": tensors from seeds (so that a restart can rebuild them), a notebook's live objects,
#: and a command loop on stdin (in the main thread, as a kernel's cells are).
WORKER = r"""
import hashlib, json, os, signal, socket, sys, tempfile, threading, time
import torch
live, cached = float(sys.argv[1]), float(sys.argv[2])
PART = 2 * 10**9
def build():
    out = []
    left = int(live * 1e9)
    while left > 0:
        n = min(PART, left)
        g = torch.Generator(device="cuda").manual_seed(len(out))
        out.append(torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=g))
        left -= n
    return out
t0 = time.perf_counter()
tensors = build()
if cached:
    gone = torch.empty(int(cached * 1e9), dtype=torch.uint8, device="cuda"); del gone
torch.cuda.synchronize()
built = time.perf_counter() - t0
def digest():
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(int(t.view(torch.int64)[: t.numel() // 8].sum())).encode())
    return h.hexdigest()
numbers = (i * i for i in range(10**9)); [next(numbers) for _ in range(1000)]
notes = open(tempfile.mktemp(), "w+"); notes.write("line\n" * 10); notes.seek(20)
worker = threading.Thread(target=time.sleep, args=(1,), name="bench-waiter")  # made, not started: a running
                                                                          # one makes the fast path step aside
square = lambda x: x * x
listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
signal.signal(signal.SIGUSR1, lambda *a: print(json.dumps({"digest": digest()}), flush=True))
print(json.dumps({"ready": True, "built": built, "digest": digest()}), flush=True)
for line in sys.stdin:
    cmd, *args = line.split()
    if cmd == "stage":
        from jupyter_gpumigrate.kernel.stager import run
        print(json.dumps({"staged": run(*args)}), flush=True)
    elif cmd == "digest":
        print(json.dumps({"digest": digest(), "device": str(tensors[0].device)}), flush=True)
    elif cmd == "snapshot":
        import dill
        t0 = time.perf_counter()
        torch.save(tensors, os.path.join(args[0], "tensors.pt"))
        names, failed = {}, []
        for name in ("numbers", "notes", "worker", "square", "listener", "live", "cached"):
            try:
                names[name] = dill.dumps(globals()[name])
            except Exception as exc:
                failed.append(f"{name} ({type(exc).__name__})")
        with open(os.path.join(args[0], "names.dill"), "wb") as f:
            dill.dump(names, f)
        print(json.dumps({"saved": time.perf_counter() - t0, "failed": failed}), flush=True)
    elif cmd == "quit":
        break
while True:  # a worker without stdin (to be suspended) lives on signals
    time.sleep(3600)
"""

LOAD = r"""
import dill, json, os, sys, time, torch, hashlib
t0 = time.perf_counter()
tensors = torch.load(os.path.join(sys.argv[1], "tensors.pt"), map_location="cuda:0")
names = {k: dill.loads(v) for k, v in dill.load(open(os.path.join(sys.argv[1], "names.dill"), "rb")).items()}
torch.cuda.synchronize()
h = hashlib.sha256()
for t in tensors:
    h.update(str(int(t.view(torch.int64)[: t.numel() // 8].sum())).encode())
print(json.dumps({"loaded": time.perf_counter() - t0, "digest": h.hexdigest(), "names": sorted(names)}), flush=True)
"""


class Worker:
    """The PyTorch process, as the engine's KernelProcess (what a provisioner does for a kernel)."""

    kernel_name = "bench"
    kernel_connection_info: dict = {}

    def __init__(self, live: float, cached: float = 0.0, piped: bool = True, env: dict | None = None) -> None:
        self.kernel_id = f"bench-{os.getpid()}-{time.monotonic_ns()}"
        self.state = RUNNING
        self.broken_reason: str | None = None
        self.sessions: list[dict] = []
        self.piped = piped
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")
        # CRIU cannot dump pipes to a process outside the tree: a worker to be suspended talks
        # through a file, and hears SIGUSR1.
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(live), str(cached)], cwd=ROOT,
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=subprocess.PIPE if piped else self.log, stderr=self.log, text=True,
            start_new_session=True,
            env={**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
        )
        self.pid: int | None = self.proc.pid
        self.hello = self._answer(600)

    def _answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.piped:
                line = self.proc.stdout.readline()  # type: ignore[union-attr]
                if line.startswith("{"):
                    return json.loads(line)
                if not line:
                    break
            else:
                lines = [x for x in Path(self.log.name).read_text().splitlines() if x.startswith("{")]
                if len(lines) > self._seen:
                    self._seen = len(lines)
                    return json.loads(lines[-1])
                time.sleep(0.1)
        raise RuntimeError(f"worker did not answer: {Path(self.log.name).read_text()[-2000:]}")

    _seen = 0

    def ask(self, command: str, timeout: float = 600) -> dict:
        if self.piped:
            self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        else:
            os.kill(self.pid, signal.SIGUSR1)  # type: ignore[arg-type]
        return self._answer(timeout)

    @property
    def kernel_pid(self) -> int | None:
        return self.pid

    def release(self) -> None:
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def adopt(self, pid: int) -> None:
        self.pid = pid

    def wait_ready(self, timeout: float) -> bool:
        return self.pid is not None and proctree.is_alive(self.pid)

    def release_gpu_cache(self) -> None:
        pass  # the fast path empties the cache itself; the driver path is measured without help

    invited = False

    def secrets(self) -> dict:
        return {}

    def host_stash(self, folder: str, min_total: int, timeout: float, gpu_only: bool = False,
                   idle_only: bool = False) -> dict:
        # Not an IPython kernel: the suspend's own stash steps aside, and CRIU and the driver carry it all (what
        # these rows measure; bench/suspend_bench.py measures the stash through a server).
        return {"aside": "the bench's worker is no IPython kernel"}

    def host_take_back(self, folder: str, timeout: float, pid: int | None = None) -> dict:
        raise RuntimeError("the bench's worker stashes nothing: there is nothing to take back")

    def invite_stager(self, path: str, token: str) -> str | None:
        self.invited = True
        self.proc.stdin.write(f"stage {path} {token}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return None

    def stop(self) -> None:
        if self.pid is not None:
            proctree.kill_tree(self.pid)
            proctree.wait_gone(self.pid, 30)
        self.log.close()


def gpu_bytes(pid: int) -> int:
    held = gpus_mod.held_by([pid], gpus_mod.snapshot())
    return held[0]["memory_used"] if held else 0


def ours(live: float, cached: float) -> dict:
    worker = Worker(live, cached)
    try:
        held = gpu_bytes(worker.pid)  # type: ignore[arg-type]
        out = Migration(worker, ImageStore(tempfile.mkdtemp()), None).move_to_gpu(1, stash=Stash())  # type: ignore[arg-type]
        if worker.invited:  # a kernel under 2 GB is not even asked (engine/plans/gpu_move.py)
            worker._answer(60)  # the stager's own report of the session
        after = worker.ask("digest")
        return dict(seconds=out.result.total, phases=out.result.timings, gpu_bytes=held,
                    fast_path=out.fast_path.to_dict() if out.fast_path else None, kept=after["digest"] == worker.hello["digest"],
                    lost=[] if after["digest"] == worker.hello["digest"] else ["tensor values"])
    finally:
        worker.stop()


def driver(live: float, cached: float) -> dict:
    worker = Worker(live, cached)
    try:
        held = gpu_bytes(worker.pid)  # type: ignore[arg-type]
        uuids = [g.uuid for g in gpus_mod.snapshot()]
        cuda, phases = CudaProcess(worker.pid), {}  # type: ignore[arg-type]
        for name, step in (("lock", lambda: cuda.lock(60)), ("checkpoint", cuda.checkpoint),
                           ("remap", lambda: cuda.restore(gpu_mapping(uuids, {uuids[0]: uuids[1]}))),
                           ("unlock", cuda.unlock)):
            started = time.perf_counter()
            step()
            phases[name] = time.perf_counter() - started
        after = worker.ask("digest")
        return dict(seconds=sum(phases.values()), phases=phases, gpu_bytes=held,
                    kept=after["digest"] == worker.hello["digest"], lost=[])
    finally:
        worker.stop()


def suspend(live: float, cached: float) -> dict:
    worker = Worker(live, cached, piped=False)
    with tempfile.TemporaryDirectory(prefix="gpumigrate-bench-", dir=os.environ.get("BENCH_IMAGES")) as tmp:
        try:
            held = gpu_bytes(worker.pid)  # type: ignore[arg-type]
            migration = Migration(worker, ImageStore(tmp), Criu())  # type: ignore[arg-type]
            down = migration.suspend()
            up = migration.resume(to_gpu=1 if len(gpus_mod.snapshot()) > 1 else 0)  # one GPU: back onto it
            after = worker.ask("digest")
            phases = {f"suspend {k}": v for k, v in down.result.timings.items()}
            phases.update({f"resume {k}": v for k, v in up.result.timings.items()})
            return dict(seconds=down.result.total + up.result.total, phases=phases, gpu_bytes=held,
                        image_bytes=down.bytes, kept=after["digest"] == worker.hello["digest"], lost=[])
        finally:
            worker.stop()


def restart(live: float, cached: float) -> dict:
    target = gpus_mod.snapshot()[-1].uuid  # the other GPU (with one: the same)
    started = time.perf_counter()
    worker = Worker(live, 0.0, env={"CUDA_VISIBLE_DEVICES": target})
    seconds = time.perf_counter() - started
    worker.stop()
    return dict(seconds=seconds, phases={"start + import torch": seconds - worker.hello["built"],
                                         "rebuild tensors": worker.hello["built"]},
                kept=False, lost=["every object not rebuilt by re-running: the generator's position, the file's "
                                  "offset, the thread, the socket; results of work since"])


def snapshot(live: float, cached: float) -> dict:
    worker = Worker(live, cached)
    with tempfile.TemporaryDirectory(prefix="gpumigrate-snap-", dir=os.environ.get("BENCH_IMAGES")) as tmp:
        try:
            saved = worker.ask(f"snapshot {tmp}", timeout=1200)
            target = gpus_mod.snapshot()[-1].uuid  # the other GPU (with one: the same)
            started = time.perf_counter()
            load = subprocess.run([sys.executable, "-c", LOAD, tmp], capture_output=True, text=True, timeout=1200,
                                  env={**os.environ, "CUDA_VISIBLE_DEVICES": target})
            loading = time.perf_counter() - started
            loaded = json.loads(load.stdout.strip().splitlines()[-1]) if load.returncode == 0 else {}
            if not loaded:
                raise RuntimeError(f"loading the snapshot failed: {load.stderr[-2000:]}")
            same = loaded.get("digest") == worker.hello["digest"]
            return dict(seconds=saved["saved"] + loading,
                        phases={"save (dill + torch.save)": saved["saved"], "new process + load": loading},
                        kept=same and not saved["failed"], lost=saved["failed"] + ([] if same else ["tensor values"]))
        finally:
            worker.stop()


def cpu_rows(sizes: str) -> list[dict]:
    """Real CPU kernels through a real server (bench/cpu_bench.py), one suspend/resume per size."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_bench.py"), "--sizes", sizes, "--repeat", "1",
                        "--out", out.name], check=True, timeout=1200)
        rows = json.loads(Path(out.name).read_text())["rows"]
    return [dict(case=f"CPU kernel {r['size_gb']:g} GB", method="suspend", live_gb=r["size_gb"], cached_gb=0,
                 seconds=r["suspend"]["total"] + r["resume"]["total"], image_bytes=r["image_bytes"], kept=True,
                 lost=[], phases={**{f"suspend {k}": v for k, v in r["suspend"]["timings"].items()},
                                  **{f"resume {k}": v for k, v in r["resume"]["timings"].items()}}) for r in rows]


def table(rows: list[dict]) -> str:
    head = ["case", "method", "seconds", "vs ours", "kept all state", "fast path / lost"]
    ours_s = {r["case"]: r["seconds"] for r in rows if r["method"] == "ours"}
    body = []
    for r in rows:
        ratio = f"{r['seconds'] / ours_s[r['case']]:.1f}x" if r["case"] in ours_s else "-"
        note = ", ".join(r.get("lost") or [])
        if r["method"] == "ours" and r.get("fast_path"):
            fp = r["fast_path"]
            note = f"{fp['stashed'] / GB:.1f} GB stashed" if fp["stashed"] else f"aside: {fp['reason']}"
        body.append([r["case"], r["method"], f"{r['seconds']:.2f}", ratio, "yes" if r["kept"] else "no",
                     note[:70] or "-"])
    return text_table(head, body)


def chart(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    cases = [c for c in dict.fromkeys(r["case"] for r in rows) if not c.startswith("CPU")]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(METHODS)
    for i, method in enumerate(METHODS):
        values = [next((r["seconds"] for r in rows if r["case"] == c and r["method"] == method), 0) for c in cases]
        ax.bar([x + i * width for x in range(len(cases))], values, width, label=method)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cases))], cases)
    ax.set_yscale("log")
    ax.set_ylabel("seconds to have the state on GPU 1 (log)")
    ax.set_title("Moving a GPU kernel's state to the other GPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="live GB of tensors per case")
    parser.add_argument("--cached", default="8+24", help="LIVE+CACHED GB case ('' for none)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cpu-sizes", default="0.1,1,4", help="GB held by CPU kernels ('' for none)")
    parser.add_argument("--out-dir", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--tag", default="gpu")
    args = parser.parse_args()
    gpus = gpus_mod.snapshot()
    one_gpu_methods = {"suspend", "restart", "snapshot"}  # the others move between two GPUs
    if not gpus or (len(gpus) < 2 and not set(args.methods.split(",")) <= one_gpu_methods):
        print(f"gpu_bench: the methods {args.methods} need two GPUs (NVML sees {len(gpus)}); with one, ask for "
              f"--methods {','.join(sorted(one_gpu_methods))}. Nothing measured.")
        return 2
    # The server initialises CUDA once, at start (app.py); without this the first case measured would
    # pay it (about 0.4-0.6 s of its lock on the H200s).
    from jupyter_gpumigrate.engine import cudackpt
    cudackpt.ensure_available()
    cases = [(f"{s:g} GB live", s, 0.0) for s in (float(x) for x in args.sizes.split(",") if x)]
    if args.cached:
        live, cached = (float(x) for x in args.cached.split("+"))
        cases.append((f"{live:g} GB live + {cached:g} GB cached", live, cached))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "driver": gpus_mod.driver_version(),
            "gpus": [f"{g.index}: {g.name}, {g.memory_total / GB:.0f} GB" for g in gpus],
            "cpus": os.cpu_count(), "command": " ".join(["bench/gpu_bench.py", *sys.argv[1:]])}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{time.strftime('%Y-%m-%d', time.gmtime())}-{args.tag}-bench"
    rows: list[dict] = []

    def save() -> None:  # after every row: a run cut short keeps what it measured
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))

    if args.cpu_sizes:
        try:
            rows += cpu_rows(args.cpu_sizes)
        except (subprocess.SubprocessError, OSError, ValueError) as exc:
            print(f"gpu_bench: the CPU kernels were not measured: {exc}", flush=True)
        save()
    methods = {"ours": ours, "driver": driver, "suspend": suspend, "restart": restart, "snapshot": snapshot}
    for name, live, cached in cases:
        for method in args.methods.split(","):
            if method == "restart" and cached:
                continue  # the same as without the cache
            try:
                row = methods[method](live, cached)
            except Exception as exc:  # one method failing must not cost the others' numbers
                row = dict(seconds=float("nan"), phases={}, kept=False, lost=[f"failed: {exc}"[:300]])
            row.update(case=name, method=method, live_gb=live, cached_gb=cached)
            rows.append(row)
            save()
            print(json.dumps(row, default=str), flush=True)
    try:
        chart(rows, stem.with_suffix(".png"))
    except ImportError as exc:
        print(f"gpu_bench: no chart ({exc})")
    print(f"\n# {meta['date']}, driver {meta['driver']}, {'; '.join(meta['gpus'])}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
