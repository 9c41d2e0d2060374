"""Where a kernel's start goes: IPKernelApp.initialize timed and profiled in a fresh process, as a
transplant's new process runs it (PyTorch imported, CUDA set up and holding tensors, or not).

A transplant's switch on 2 x H100 took 3.9-5.4 s, nearly all of it the new process's kernel start
(``transplant.seconds.start``), against about 1.0 s for the whole switch on the development machine.
This says which calls take it (there, it found torch.use_deterministic_algorithms's import of
torch._inductor, 0.8 s). Prints, per case, the seconds and the 20 calls with the most cumulative time.

    python3 bench/kernel_start_probe.py [--cases cpu,cuda]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

CASE = r"""
import cProfile, io, os, pstats, sys, time
case, folder = sys.argv[1], sys.argv[2]
import torch
if case == "cuda":
    torch.cuda.init()
    held = torch.ones(2**28, device="cuda")  # 1 GiB, as a transplanted kernel holds
from jupyter_client.connect import write_connection_file
path, _ = write_connection_file(os.path.join(folder, case + ".json"))
from ipykernel.kernelapp import IPKernelApp
app = IPKernelApp.instance()
profile = cProfile.Profile()
started = time.perf_counter()
profile.enable()
app.initialize(["-f", path, "--ext=jupyter_gpumigrate"])  # as the server starts kernels
profile.disable()
took = time.perf_counter() - started
from jupyter_gpumigrate.kernel.transplant import _set_torch, _torch_settings
at = time.perf_counter()
_set_torch(_torch_settings())  # what the new process sets after initialize
settings = time.perf_counter() - at
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(20)
# The kernel's own streams replaced stdout (and its file descriptor): the report goes to a file.
with open(os.path.join(folder, case + ".txt"), "w") as report:
    report.write(f"{case}: initialize {took:.3f} s, torch settings {settings:.3f} s\n{out.getvalue()[-6000:]}")
os._exit(0)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="cpu,cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpumigrate-start-probe-") as folder:
        for case in args.cases.split(","):
            done = subprocess.run([sys.executable, "-c", CASE, case, folder], capture_output=True, text=True,
                                  timeout=300)
            report = Path(folder) / f"{case}.txt"
            print(report.read_text() if report.exists() else f"{case}: no report")
            if done.returncode != 0:
                print(f"{case}: failed ({done.returncode}): {done.stderr[-2000:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
