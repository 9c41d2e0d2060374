"""Where a machine's CPUs go while a bench runs: every --every seconds, the share of all CPUs busy, and the
processes that used the most of it, grouped by what they are (a server, a bulk listener's process, a kernel,
the stash helper, CRIU), one JSON line per sample.

Run it beside a bench and stop it with SIGINT or SIGTERM (or --seconds):

    python3 bench/cpu_sample.py --out /tmp/cpu.jsonl & python3 bench/host_bench.py ...; kill %1

A line: {"t": unix time, "busy": CPUs busy (of "cpus"), "top": [[group, CPUs busy], ...]}. It reads /proc
itself (psutil's per-process cpu_percent needs one object kept per process, and the samples here are many
short-lived processes; /proc/PID/stat's utime and stime are what it reads too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")

#: command-line fragments -> the group a process is counted in (the first that matches)
GROUPS = (("gpumigrate.bulkd", "bulkd"), ("nodehelper", "nodehelper"), ("prefetch", "stash-helper"),
          ("engine.stash", "stash-helper"), ("ipykernel", "kernel"), ("jupyter-server", "server"),
          ("jupyter_server", "server"), ("criu", "criu"), ("host_bench", "bench"))


def group_of(pid: str) -> str:
    """What the process is, and its network namespace (``@`` and the last digits of its inode: the bench's two
    hosts are two namespaces)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        netns = os.readlink(f"/proc/{pid}/ns/net").strip("net:[]")[-3:]
    except OSError:
        return "?"
    for fragment, name in GROUPS:
        if fragment in cmd:
            return f"{name}@{netns}"
    return f"{(cmd.split(' ', 1)[0].rsplit('/', 1)[-1] or '?')[:24]}@{netns}"


def per_process() -> dict[str, tuple[str, int]]:
    """PID -> (group, ticks of CPU used so far), all threads counted."""
    out: dict[str, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[entry.name] = int(fields[11]) + int(fields[12])  # utime, stime
    return {pid: (group_of(pid), ticks) for pid, ticks in out.items()}


def total() -> tuple[int, int]:
    """(busy, all) jiffies of all CPUs."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--seconds", type=float, default=3600.0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(1))
    cpus = os.cpu_count() or 1
    end = time.time() + args.seconds
    before, t_before = per_process(), total()
    with open(args.out, "a") as out:
        while not stop and time.time() < end:
            time.sleep(args.every)
            now, t_now = per_process(), total()
            busy, every = t_now[0] - t_before[0], t_now[1] - t_before[1]
            groups: dict[str, float] = {}
            for pid, (group, ticks) in now.items():
                used = ticks - (before[pid][1] if pid in before else 0)
                if used > 0:
                    groups[group] = groups.get(group, 0.0) + used / TICK / args.every
            top = sorted(groups.items(), key=lambda g: -g[1])[:12]
            out.write(json.dumps({"t": round(time.time(), 2), "cpus": cpus,
                                  "busy": round(cpus * busy / every, 2) if every else 0.0,
                                  "top": [[g, round(c, 2)] for g, c in top]}) + "\n")
            out.flush()
            before, t_before = now, t_now
    return 0


if __name__ == "__main__":
    sys.exit(main())
