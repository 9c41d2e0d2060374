#!/usr/bin/env bash
# Probe (GPU machine, root): can an ordinary user CUDA-checkpoint and CRIU-dump/restore its own GPU process?
set -u
cd "$(dirname "$0")/.."
source <(sed -n '/^install_criu()/,/^}/p' scripts/gpu-suite.sh); KIT="$PWD/.gpukit"; log() { echo "probe: $*"; }
install_criu >/dev/null 2>&1; criu --version | head -1
id gmprobe >/dev/null 2>&1 || useradd -m gmprobe
W=/tmp/probe; rm -rf $W; mkdir -p $W; chmod 1777 $W; install -d -o gmprobe -m 700 $W/img
cat > $W/worker.py <<'PY'
import torch, time, os, sys
x = torch.arange(256*1024*1024, device="cuda", dtype=torch.float32)  # 1 GiB
s0 = float(x.sum())
open("/tmp/probe/ready", "w").write(str(os.getpid()))
while True:
    time.sleep(0.5)
    print(time.time(), float(x.sum()) == s0, torch.cuda.get_device_name(), flush=True)
PY
cat > $W/ck.py <<'PY'
import sys, cuda.core.checkpoint as c
from cuda.bindings import driver as d
d.cuInit(0)
pid, act = int(sys.argv[1]), sys.argv[2]
p = c.Process(pid)
if act == "lock": p.lock(10000)
elif act == "checkpoint": p.checkpoint()
elif act == "unlock": p.unlock()
elif act == "restore":
    import json; m = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None; p.restore(m)
print(act, "->", p.state)
PY
chmod 644 $W/*.py
AS="setpriv --reuid=gmprobe --regid=gmprobe --init-groups --"
export PYTHONPATH=${PYTHONPATH:-}
install -o gmprobe -m 644 /dev/null $W/worker.log
(cd $W && $AS env HOME=/home/gmprobe setsid python3 $W/worker.py > $W/worker.log 2>&1 < /dev/null &)
for i in $(seq 60); do [ -f $W/ready ] && break; sleep 1; done
P=$(cat $W/ready); echo "worker pid $P"; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader
U=($(nvidia-smi --query-gpu=uuid --format=csv,noheader | sed 's/^GPU-//'))
MAP="{\"${U[0]}\": \"${U[1]}\", \"${U[1]}\": \"${U[0]}\"}"
echo "--- CUDA checkpoint as the same ordinary user (no capabilities)"
for a in lock checkpoint; do $AS python3 $W/ck.py $P $a 2>&1 | tail -1; done
$AS python3 $W/ck.py $P restore "$MAP" 2>&1 | tail -1; $AS python3 $W/ck.py $P unlock 2>&1 | tail -1
sleep 1.5; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader; tail -1 $W/worker.log
echo "--- CUDA checkpoint as ANOTHER user (must fail)"
id gmother >/dev/null 2>&1 || useradd -m gmother
setpriv --reuid=gmother --regid=gmother --init-groups -- python3 $W/ck.py $P lock 2>&1 | tail -1
echo "--- CUDA checkpoint + CRIU dump/restore as the user (CRIU with lent capabilities)"
$AS python3 $W/ck.py $P lock | tail -1; $AS python3 $W/ck.py $P checkpoint | tail -1
CAPS="+checkpoint_restore"
(cd $W/img && setpriv --reuid=gmprobe --regid=gmprobe --init-groups --inh-caps=$CAPS --ambient-caps=$CAPS -- criu dump --unprivileged -t $P --tcp-close --ext-unix-sk --file-locks -D $W/img -o dump.log -v4); echo "dump rc $?"; grep Error $W/img/dump.log | grep -v RLIMIT | head -3
sleep 0.5
CAPS="+checkpoint_restore,+setpcap"
(cd $W/img && setpriv --reuid=gmprobe --regid=gmprobe --init-groups --inh-caps=$CAPS --ambient-caps=$CAPS -- criu restore --unprivileged -d --tcp-close --ext-unix-sk --file-locks -D $W/img -o restore.log -v4 --pidfile restore.pid); echo "restore rc $?"; grep Error $W/img/restore.log | grep -v RLIMIT | head -3
$AS python3 $W/ck.py $P restore "$MAP" 2>&1 | tail -1; $AS python3 $W/ck.py $P unlock 2>&1 | tail -1
sleep 1.5; nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader; tail -2 $W/worker.log
grep -i "^cap\|^uid" /proc/$P/status
grep -h CapBnd /proc/self/status; cat /proc/sys/kernel/yama/ptrace_scope 2>&1
kill -9 $P
