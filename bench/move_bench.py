"""Moves between the GPUs of one host through a real server: the peer stash, the host stash, the driver alone,
and a kernel on two GPUs swapped live and through a suspend.

For each way a `jupyter server` with the extension is started; an IPython kernel fills GPU 0 with ``--sizes``
GB of PyTorch tensors (from seeds), idle, and is moved to GPU 1 and back through the REST API. After every
operation each tensor is compared, on the GPU, with one rebuilt from its seed (torch.equal: exact).

Ways:
  peer     c.MigratableProvisioner.move_stash = "peer": the tensors go over the GPUs' peer link into a stash
           on the target GPU (engine/stash.py), the driver moves the rest
  host     move_stash = "host", as on GPUs without peer access: the tensors go to files in memory through
           pinned buffers (kernel/hoststash.py), the driver moves the rest
  driver   fast_path "off": the CUDA driver copies everything
  two      half the size on each of GPUs 0 and 1: swapped live (to_gpus [1, 0], the driver), then suspended
           and resumed swapped again (images in memory)
  train    a training loop (wide linear layers, Adam, a DataLoader with two spawned workers and pinned memory)
           holding the size in all, moved 0 -> 1 in the middle of its cell (the fast path at the cell's safe
           point); its losses must equal those of the same loop run unmoved before, bit for bit

``--trips N`` moves the kernel of each way (but two and train) 0 -> 1 -> 0 N times: the first trip into a
machine's fresh memory is slower than the next (bench/results/2026-11-26-gpu-move.md), and a way named twice
(``--ways peer,host,peer``) runs again after the others, so that the order of the ways can be told apart.

Floors, measured in the same run: the peer copy GPU 0 -> GPU 1, pinned host <-> GPU copies, and tmpfs written
by 16 threads twice, as many bytes as the largest size (the first: a fresh machine's first touch of that memory),
then read (GB/s).
Writes ``<out-dir>/<date>-<tag>-move.json``; the table comes last.

    python3 bench/move_bench.py [--sizes 32] [--ways peer,host,driver,two] [--trips 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_bench import Server  # noqa: E402
from report import text_table  # noqa: E402
from suspend_bench import pinned_floors, tmpfs_floors  # noqa: E402

BUILD = """
import torch
PART = 2 * 10**9
def part(i, n, device):
    g = torch.Generator(device=device).manual_seed(i)
    return torch.randint(0, 255, (n,), dtype=torch.uint8, device=device, generator=g)
tensors = []
for device, size in {layout}:
    left = int(size * 1e9)
    while left > 0:
        n = min(PART, left); left -= n
        tensors.append(part(len(tensors), n, device))
torch.cuda.synchronize()
torch.cuda.empty_cache()
print(sum(t.numel() for t in tensors))
"""
CHECK = """
ok = all(torch.equal(t, part(i, t.numel(), t.device)) for i, t in enumerate(tensors))
torch.cuda.empty_cache()
print(ok)
"""
# --ways train: a training loop (a model of wide linear layers, Adam, a DataLoader with two worker processes
# and pinned memory) holding {size} GB in all (parameters, gradients, Adam's two moments: four times the
# parameters), moved mid-cell; its losses against an unmoved run of the same loop from the same seed.
TRAIN_SETUP = """
import os, time, gc
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.use_deterministic_algorithms(True)
WIDTH = 16384
LAYERS = max(1, round({size} * 1e9 / 4 / (WIDTH * WIDTH * 4)))  # parameters, gradients, two moments
_g = torch.Generator().manual_seed(7)
data = TensorDataset(torch.randn(2048, WIDTH, generator=_g), torch.randint(0, 10, (2048,), generator=_g))
loader = DataLoader(data, batch_size=64, pin_memory=True, num_workers=2, multiprocessing_context="spawn",
                    persistent_workers=True)

def make(seed):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    model = torch.nn.Sequential(*[m for l in layers for m in (l, torch.nn.ReLU())], torch.nn.Linear(WIDTH, 10)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    return model, opt

def run(model, opt, steps, started=None):
    losses = []
    while len(losses) < steps:
        for x, y in loader:
            x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if started and len(losses) == 3:
                open(started, "w").close()  # the bench moves the kernel from now on
            if len(losses) == steps:
                break
    return losses

def drop():
    global m, o
    m = o = None
    gc.collect()
    torch.cuda.empty_cache()

m, o = make(1)
reference = run(m, o, {steps})
held = torch.cuda.memory_allocated()
drop()
print(len(reference), held)
"""
TRAIN_STEPS = 150


def peer_floor(nbytes: int = 4 << 30) -> dict:
    """GPU 0 -> GPU 1 copy of ``nbytes`` with peer access, GB/s (the second of two rounds)."""
    code = (f"import torch,time\nn={nbytes}\na=torch.empty(n,dtype=torch.uint8,device='cuda:0');"
            "b=torch.empty(n,dtype=torch.uint8,device='cuda:1')\nfor _ in (0,1):\n t=time.perf_counter();"
            "b.copy_(a);torch.cuda.synchronize(0);torch.cuda.synchronize(1);s=time.perf_counter()-t\nprint(n/s/1e9)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return {"peer_0_to_1": round(float(done.stdout.split()[-1]), 2)} if done.returncode == 0 else {}


def gpu_names() -> str:
    done = subprocess.run(["nvidia-smi", "--query-gpu=index,name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60)
    return "; ".join(line.strip() for line in done.stdout.splitlines()) if done.returncode == 0 else "unknown"


def checked(server: Server, kernel_id: str, what: str) -> None:
    if server.run(kernel_id, CHECK).split()[-1] != "True":
        raise RuntimeError(f"{what}: the tensors changed")


def train_mid_cell(server: Server, kernel_id: str, size: float, root: Path) -> dict:
    """The ``train`` way: the operation of a move of a training loop mid-cell (0 -> 1), checked against the
    same loop unmoved."""
    print(server.run(kernel_id, TRAIN_SETUP.format(size=size, steps=TRAIN_STEPS), timeout=1200).strip(), flush=True)
    started = root / "started"
    out: list[str] = []
    cell = threading.Thread(target=lambda: out.append(server.run(
        kernel_id, f"m, o = make(1); moved = run(m, o, {TRAIN_STEPS}, {str(started)!r}); print(len(moved))",
        timeout=1200)))
    cell.start()
    deadline = time.monotonic() + 600
    while not started.exists():
        if time.monotonic() > deadline or not cell.is_alive():
            raise RuntimeError(f"the training loop did not start: {out}")
        time.sleep(0.05)
    op = server.operate(kernel_id, "migrate", {"to_gpu": 1})
    busy = cell.is_alive()
    cell.join(1200)
    said = server.run(kernel_id, "print(moved == reference, len(moved), torch.cuda.memory_allocated())").split()
    if said[:2] != ["True", str(TRAIN_STEPS)] or not busy:
        raise RuntimeError(f"train: the moved loop's losses differ from the unmoved run's, or the move was not "
                           f"mid-cell (busy: {busy}): {said} {out}")
    return op


def one_way(way: str, size: float, rows: list[dict], trips: int = 1) -> None:
    root = Path(tempfile.mkdtemp(prefix="gpumigrate-move-bench-", dir="/tmp"))
    provisioner = {"suspend_to": "memory"}
    if way in ("peer", "host"):
        provisioner["move_stash"] = way
    server = Server(root, {"MigratableProvisioner": provisioner})
    try:
        kernel_id = server.api("POST", "api/kernels", {"name": "python3"})["id"]
        if way == "train":
            op = train_mid_cell(server, kernel_id, size, root)
            row = {"way": way, "size_gb": size, "step": "0 -> 1 mid-cell", "total": op["total"],
                   "timings": op["timings"], "fast_path": op.get("fast_path"), "to_gpus": op.get("to_gpus"),
                   "to_gpu": op.get("to_gpu"), "bytes": op.get("bytes"), "losses_equal": True}
            rows.append(row)
            print(json.dumps(row), flush=True)
            server.api("DELETE", f"api/kernels/{kernel_id}")
            return
        layout = [("cuda:0", size / 2), ("cuda:1", size / 2)] if way == "two" else [("cuda:0", size)]
        server.run(kernel_id, BUILD.format(layout=layout))
        if way == "two":
            steps = [("migrate", {"to_gpus": [1, 0]}, "swap live"), ("suspend", {}, "suspend"),
                     ("resume", {"to_gpus": [1, 0]}, "resume swapped")]
        else:
            body = {"fast_path": "off"} if way == "driver" else {}
            steps = [step for trip in range(trips) for step in (
                ("migrate", {"to_gpu": 1, **body}, "0 -> 1" + (f" (trip {trip + 1})" if trips > 1 else "")),
                ("migrate", {"to_gpu": 0, **body}, "1 -> 0" + (f" (trip {trip + 1})" if trips > 1 else "")))]
        for action, body, label in steps:
            op = server.operate(kernel_id, action, body)
            if action != "suspend":
                checked(server, kernel_id, f"{way} {label}")
            row = {"way": way, "size_gb": size, "step": label, "total": op["total"], "timings": op["timings"],
                   "fast_path": op.get("fast_path"), "to_gpus": op.get("to_gpus"), "to_gpu": op.get("to_gpu")}
            rows.append(row)
            print(json.dumps(row), flush=True)
        server.api("DELETE", f"api/kernels/{kernel_id}")
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def table(rows: list[dict], floor: dict) -> str:
    head = ["way", "GB", "step", "total s", "GB/s", "stashed GB", "phases (>= 0.05 s)"]
    body = []
    for r in rows:
        fast = r.get("fast_path") or {}
        phases = " ".join(f"{k} {v:.2f}" for k, v in r["timings"].items() if v >= 0.05)
        body.append([r["way"], f"{r['size_gb']:g}", r["step"], f"{r['total']:.2f}", f"{r['size_gb'] / r['total']:.1f}",
                     f"{(fast.get('stashed') or 0) / 1e9:.1f}", phases])
    return text_table(head, body) + "\nfloors (same run): " + ", ".join(f"{k} {v} GB/s" for k, v in floor.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32", help="GB of tensors the kernel holds (two: half on each GPU)")
    parser.add_argument("--ways", default="peer,host,driver,two")
    parser.add_argument("--trips", type=int, default=1, help="round trips 0 -> 1 -> 0 of each way's kernel")
    parser.add_argument("--out-dir", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--tag", default="gpu")
    parser.add_argument("--memory-floor", action=argparse.BooleanOptionalAction, default=True,
                        help="measure tmpfs's write and read of the largest size first, twice (the first touch)")
    args = parser.parse_args()
    # tmpfs as the host stash writes it, as many bytes as the largest size, twice: the first into memory a fresh
    # machine may never have touched, whose cost any way then pays (the driver's into the process's memory too)
    largest = max(float(s) for s in args.sizes.split(","))
    memory = tmpfs_floors(int(largest * 1e9), rounds=2) if args.memory_floor else {}
    floor = {**peer_floor(), **{k: round(v, 2) for k, v in {**pinned_floors(4 << 30), **memory}.items()}}
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpus": gpu_names(),
            "command": " ".join(["bench/move_bench.py", *sys.argv[1:]])}
    print(json.dumps({"floors": floor}), flush=True)
    rows: list[dict] = []
    out = Path(args.out_dir) / f"{time.strftime('%Y-%m-%d')}-{args.tag}-move.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for size in (float(s) for s in args.sizes.split(",")):
            for way in args.ways.split(","):
                one_way(way, size, rows, args.trips)
                out.write_text(json.dumps({"meta": meta, "floors": floor, "rows": rows}, indent=1))
    finally:
        out.write_text(json.dumps({"meta": meta, "floors": floor, "rows": rows}, indent=1))
        print(table(rows, floor))
    return 0


if __name__ == "__main__":
    sys.exit(main())
