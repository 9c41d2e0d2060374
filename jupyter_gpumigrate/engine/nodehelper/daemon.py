"""The node helper: a small privileged service that runs CRIU for the ordinary users of a shared machine,
each on their own kernels only.

CRIU needs capabilities that an ordinary user lacks (CAP_CHECKPOINT_RESTORE; CAP_SETPCAP to restore
where the bounding set is not full, as in containers and VMs: restore_caps()). The helper runs as root, listens on a
Unix socket, learns who calls from the socket itself (SO_PEERCRED: the kernel's word, not the
caller's), and for each request runs CRIU *as the caller*, with only those capabilities lent
(``setpriv``). So the kernel itself enforces what the checks below refuse first, with a sentence:

- a dump reads only a tree whose every process and thread belongs to the caller (all four user IDs)
  and holds no capability; CRIU, running as the caller without CAP_SYS_PTRACE, could not read
  another user's process anyway;
- images live in ``ROOT/UID/...`` (ROOT root-owned 0711, ``UID`` 0700 and owned by that user): every
  folder on the way is opened without following links and must belong to the caller and be closed
  to others; CRIU writes as the caller, so images are the caller's and readable by nobody else;
- a restore runs as the caller, so it cannot make a process of anyone else, whatever the images say;
  and the images are the caller's files, so they may be forged: CRIU reads a staged copy in a folder
  no user can reach, whose core images (each thread's credentials) were checked first
  (criuimages.py: the caller's IDs, no capability, no securebits);
- each CRIU run is confined in a cgroup of its own (cgroups.py): the helper learns what a restore
  made from that cgroup, never from a file of the caller's. It freezes it, checks every process in it
  (the caller's IDs, no capability left over from those lent), and only then moves them into the
  caller's server's cgroup and lets them run. On any failure or refusal, whatever is left in the
  cgroup is killed.

The CUDA checkpoint API needs no helper: the driver lets a user lock, checkpoint and restore only
their own processes (measured, docs/users.md), so the user's server calls it directly.

The requests and answers are protocol.py's; the user's server asks through client.py. Every request
is logged: who, what, and how it ended. At most 32 requests run at once, 2 per user; more are answered
"busy".

Run it as root: ``jupyter-gpumigrate-helper`` (or ``python -m jupyter_gpumigrate.engine.nodehelper``);
examples/jupyter-gpumigrate-helper.service is a systemd unit for it. It imports nothing from Jupyter.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import os
import pwd
import re
import signal
import socket
import socketserver
import stat
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import cgroups
from .. import criu as criu_mod
from .. import criuimages, proctree
from .. import images as images_mod
from .protocol import (BUSY, CGROUP_PREFIX, CHECK_RUN, CRIU_FAILED, DEFAULT_SOCKET, DUMP_RUN, INTERNAL, MAX_DEPTH,
                       MAX_IDS, NAME, PROTOCOL_VERSION, REFUSED, RESTORE_RUN, BadRequest, NoRoom, Refused, encode, failure, run_name,
                       read_request)

log = logging.getLogger("jupyter_gpumigrate.helper")

DEFAULT_IMAGES = "/var/lib/jupyter-gpumigrate/images"
EXAMPLE_MEMORY = "/var/lib/jupyter-gpumigrate/memory"
#: each images root's folder for restores' checked copies
STAGING = ".staging"
#: where a dump or restore's images are: under the images root on disk, or under the one in memory
DISK, MEMORY = "disk", "memory"
#: how each run's cgroup name ends (older helpers' end with the caller's uid)
OPS = tuple(f"-{run}" for run in (CHECK_RUN, DUMP_RUN, RESTORE_RUN))


def _left_stopped(cgroup: cgroups.Cgroup, criu: bool = False) -> bool:
    """Whether every process in ``cgroup`` is stopped (state T, not a tracer's stop) and none is CRIU: a tree
    CRIU restored with --leave-stopped and no helper handed over; or, with ``criu``, every one is CRIU."""
    procs = cgroup.procs()
    for pid in procs:
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            return False
        if rest.split()[0] != "T" or (head.partition("(")[2] == "criu") != criu:
            return False
    return bool(procs)
MAX_CLIENTS = 32
MAX_PER_USER = 2
MAX_CORE_IMAGE = 16 << 20
MAX_STAGED_BYTES = 256 << 20
MAX_STAGED_FILES = 1 << 17
#: what a restore neither checks nor needs: CRIU's own outputs in the caller's folder
SKIPPED = {criu_mod.DUMP_LOG, criu_mod.RESTORE_LOG, criu_mod.RESTORE_PIDFILE, "stats-dump", "stats-restore"}
#: lent to CRIU, as setpriv names them (capabilities(7))
DUMP_CAPS = ("checkpoint_restore",)
RESTORE_CAPS = ("checkpoint_restore", "setpcap")  # setpcap only where it is needed: restore_caps()
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Caller:
    """Who is at the other end of the socket, as the kernel says (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int
    #: its cgroup2 path when it connected: where the kernels it gets restored will run
    cgroup: str | None = None

    def __str__(self) -> str:
        try:
            name = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            name = "?"
        return f"uid={self.uid}({name}) pid={self.pid}"


def peer_credentials(sock: socket.socket) -> Caller:
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Caller(pid, uid, gid, cgroups.of(pid))


def _status(path: str) -> dict[str, str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f if ":" in line)}


def foreign(pid: int, uid: int) -> str | None:
    """Why the process ``pid`` (each of its threads) is not wholly ``uid``'s to checkpoint, or None."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return f"process {pid} does not exist"
    for tid in tids:
        try:
            fields = _status(f"/proc/{pid}/task/{tid}/status")
        except OSError:
            continue  # a thread that just exited
        uids = {int(u) for u in fields.get("Uid", "").split()}
        if uids != {uid}:
            return f"process {pid} runs as user {sorted(uids)}, not as you ({uid})"
        if uid != 0 and any(int(fields.get(k, "0"), 16) for k in ("CapPrm", "CapEff", "CapAmb", "CapInh")):
            return f"process {pid} holds capabilities"
    return None


#: the namespaces a process must share with the helper: CRIU carries those of a tree that differ from its own
#: (and restores new ones), which the helper does not let it do: a kernel must come back into the network,
#: mounts and PIDs of its user's server
SHARED_NAMESPACES = {"mnt": "mount", "net": "network", "pid": "PID"}


def elsewhere(pid: int) -> str | None:
    """Which of SHARED_NAMESPACES process ``pid`` does not share with the helper, as a sentence, or None. A
    process whose namespaces cannot be read is not taken to share them: a caller outside the helper's PID
    namespace is pid 0 to it, and one gone meanwhile is nobody to serve."""
    for kind, name in SHARED_NAMESPACES.items():
        try:
            ours = os.readlink(f"/proc/self/ns/{kind}")
        except OSError:
            continue  # no such namespace on this kernel
        try:
            theirs = os.readlink(f"/proc/{pid}/ns/{kind}") if pid > 0 else None
        except PermissionError:
            return (f"the node helper may not read process {pid}'s namespaces: it needs CAP_SYS_PTRACE (do not take "
                    "it away in its unit's CapabilityBoundingSet)")
        except OSError:
            theirs = None
        if theirs is None:
            return (f"process {pid}'s {name} namespace cannot be read (it is gone, or outside the helper's PID "
                    "namespace): run the helper in the same mount, network and PID namespaces as the users' "
                    "servers")
        if theirs != ours:
            return (f"process {pid} is in another {name} namespace than the node helper (a container, or a "
                    "systemd unit with PrivateTmp=, PrivateNetwork=, ProtectSystem= or the like): run the helper "
                    "in the same mount, network and PID namespaces as the users' servers")
    return None


def _unescape(field: bytes) -> bytes:
    """A mountinfo path: octal escapes (\\040 for a space...) back to their bytes."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field)


def _tmpfs_at(path: Path) -> bool:
    """Whether ``path`` is the root of a tmpfs mounted there, the one on top (not a bind of a folder of another
    file system, nor a tmpfs with something mounted over it): the mount in /proc/self/mountinfo whose device is
    the path's and whose mount point is the path, mounting that tmpfs's own root."""
    try:
        dev = os.stat(path).st_dev
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    wanted = (os.major(dev), os.minor(dev))
    for line in lines:
        fields = line.split()
        if b"-" not in fields or len(fields) < 5:
            continue
        major, _, minor = fields[2].partition(b":")
        if (int(major), int(minor)) == wanted and _unescape(fields[4]) == os.fsencode(path) and fields[3] == b"/" \
                and fields[fields.index(b"-") + 1] == b"tmpfs":
            return True
    return False


def tree_resident(pids: list[int]) -> int:
    """Bytes the processes ``pids`` hold in memory (VmRSS): what a dump of them writes, about."""
    total = 0
    for pid in pids:
        try:
            total += int(_status(f"/proc/{pid}/status").get("VmRSS", "0 kB").split()[0]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def restore_caps() -> tuple[str, ...]:
    """What a restore needs lent. CRIU's restorer trims the restored task's bounding set to the
    image's, which needs CAP_SETPCAP for every capability not in it; where this machine's bounding set
    is full (bare metal, most servers), the images' is too and nothing needs trimming. Lending it only
    where needed keeps a forged image from setting securebits or trimming anything elsewhere."""
    try:
        last = int(open("/proc/sys/kernel/cap_last_cap").read())
        bounding = int(_status("/proc/self/status").get("CapBnd", "0"), 16)
    except (OSError, ValueError):
        return RESTORE_CAPS
    return RESTORE_CAPS[:1] if bounding == (1 << (last + 1)) - 1 else RESTORE_CAPS


def _setpriv(caller: Caller, caps: tuple[str, ...]) -> list[str]:
    """The command prefix that runs the rest as ``caller`` with only ``caps`` (util-linux's setpriv:
    the well-kept tool for exactly this; Python has no capset)."""
    try:
        pwd.getpwuid(caller.uid)
        groups = "--init-groups"
    except KeyError:
        groups = "--clear-groups"
    lent = ",".join(f"+{c}" for c in caps)
    return ["setpriv", f"--reuid={caller.uid}", f"--regid={caller.gid}", groups,
            f"--inh-caps=-all,{lent}", f"--ambient-caps=-all,{lent}", "--"]


class CriuBroker:
    """What the service does: checks each request, runs CRIU for it as the caller, and checks what CRIU
    made. One request per call of :meth:`handle` (threads may overlap)."""

    def __init__(self, images_root: str | os.PathLike[str], criu_path: str | None = None,
                 criu_timeout: float = 3600.0, memory_root: str | os.PathLike[str] | None = None,
                 memory_size: str | None = None) -> None:
        self.criu = criu_mod.find(criu_path)
        self.criu_timeout = criu_timeout
        self.cgroups = cgroups.base()
        if self.cgroups is None:
            raise SystemExit("The helper needs cgroup v2 (mounted, with this process in it): it confines each "
                             "CRIU run in a cgroup of its own. Under systemd, set Delegate=yes in the unit.")
        self.root = self._own_root(Path(images_root))
        #: the images root in memory (a tmpfs of its own), or None: images on disk only
        self.memory = self._own_root(Path(memory_root), True, memory_size) if memory_root else None
        self._spawn = threading.Lock()  # taken to start a child, and by the reaper: see reap()
        self._ours: set[int] = set()
        self._runs = itertools.count(1)
        self.restore_caps = restore_caps()
        self._kept: set[cgroups.Cgroup] = set()  # cgroups not empty yet when their run ended: removed later
        self._tidy_earlier_runs()

    @staticmethod
    def _own_root(root: Path, memory: bool = False, tmpfs_size: str | None = None) -> Path:
        """Make ``root`` (and the folders to it) if missing, check that no one else can change it or the
        folders to it, and empty its staging folder: restores' checked copies, which no one else may reach,
        on its file system (they are hard links). A ``memory`` root must be a tmpfs of its own, whose size
        bounds all users' images in memory, on a way no one else can write (sticky folders such as /tmp and
        /dev/shm included: someone could make the name first, and systemd-logind's RemoveIPC empties /dev/shm
        of a user's files); with ``tmpfs_size``, the helper mounts one there if none is, never over anything,
        and leaves it mounted (it holds suspended kernels: it outlives the helper)."""
        root = Path(os.path.realpath(root))  # the links on the way, resolved once: then each folder is checked
        for folder in [*reversed(root.parents), root]:
            if not folder.exists():
                folder.mkdir()
                os.chmod(folder, 0o711 if folder == root else 0o755)  # users pass through to ROOT/UID
            st = os.lstat(folder)
            # Each folder on the way is root's, and no one else can rename what is in it (not writable by
            # others, or, on the way to a disk root, sticky: then what is in it is theirs to move only if
            # theirs, and the next is root's): so the path names these folders for as long as the helper runs.
            others = st.st_mode & 0o022 and (folder == root or memory or not st.st_mode & stat.S_ISVTX)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or others:
                raise SystemExit(f"{folder} must be a folder owned by uid {os.geteuid()} that no one else can "
                                 f"write{' (chmod 711)' if folder == root else ''}: it is on the way to, or is, "
                                 f"{root}, which holds every user's images folder. Name another place.")
        if memory and not _tmpfs_at(root):
            if not tmpfs_size:
                raise SystemExit(f"{root} is no tmpfs of its own: give --memory-size (the helper then mounts one "
                                 f"there), or mount one yourself: mount -t tmpfs -o size=50%,mode=0711 tmpfs {root}")
            if not re.fullmatch(r"[0-9]+[kmgKMG%]?", tmpfs_size):
                raise SystemExit(f"--memory-size {tmpfs_size!r} is not a size: bytes, with k, m or g, or a share of "
                                 "the machine's memory such as 50%")
            if any(name != STAGING for name in os.listdir(root)):
                raise SystemExit(f"{root} is not empty: the helper mounts its tmpfs only on an empty folder (what is "
                                 "there would be hidden). Move it away, or name another place.")
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_size},mode=0711,nosuid,nodev",
                                   "jupyter-gpumigrate-memory", str(root)], capture_output=True, text=True)
            if done.returncode != 0 or not _tmpfs_at(root):
                raise SystemExit(f"Could not mount a tmpfs of {tmpfs_size} at {root}: {done.stderr.strip()}")
            log.info("mounted a tmpfs of %s at %s for images in memory (it stays mounted)", tmpfs_size, root)
            st = os.lstat(root)
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise SystemExit(f"the tmpfs mounted at {root} is not root's alone to write")
        os.chmod(root, 0o711)
        staging = root / STAGING
        staging.mkdir(mode=0o700, exist_ok=True)
        os.chmod(staging, 0o700)
        if os.lstat(staging).st_uid != os.geteuid() or staging.is_symlink():
            raise SystemExit(f"{staging} must be a folder of uid {os.geteuid()}")
        for left in staging.iterdir():  # an earlier helper's, interrupted
            shutil.rmtree(left, ignore_errors=True)
        return root

    def _place(self, request: dict) -> Path:
        """The images root a dump or restore names (``"place"``: "disk", the default, or "memory")."""
        place = request.get("place", DISK)
        if place == DISK:
            return self.root
        if place != MEMORY:
            raise BadRequest('"place" must be "disk" or "memory"')
        if self.memory is None:
            raise Refused("this helper keeps no images in memory (it runs without --memory-root): suspend to disk")
        return self.memory

    def _memory_room(self, tree: list[int]) -> None:
        """Refuse a dump into memory that the memory root has no room for: what the tree holds now (VmRSS) and
        10 % more, as the user's server judges it first (engine/images.py's choose, which also keeps a quarter
        of the machine's memory available; not judged again here, where a GPU kernel's checkpointed memory
        would count twice). An estimate at the request, not a bound: a tree can grow before CRIU freezes it,
        and hold what RSS does not show (a memfd, swap). The tmpfs's size is the bound on all users together."""
        assert self.memory is not None
        need = tree_resident(tree)
        free = images_mod.memory_free(self.memory)
        if free < need * 1.1:
            raise NoRoom(f"no room in memory for {need / 1e9:.1f} GB of images ({free / 1e9:.1f} GB free in "
                          f"{self.memory}): suspend to disk")

    def _tidy_earlier_runs(self) -> None:
        """Cgroups of an earlier helper that went mid-run (killed, restarted: the unit's KillMode=process leaves
        its children): the empty ones are removed. A restore's is killed first: what it holds never ran, and
        never will (CRIU left the tree stopped for a check no helper makes now; its server took the restore as
        failed and kept the images, whose next restore needs those PIDs). Any other (a dump's CRIU, which its
        server waits for and goes by) runs on, and goes once empty (the reaper)."""
        assert self.cgroups is not None
        for path in self.cgroups.glob(CGROUP_PREFIX + "*"):
            cgroup = cgroups.Cgroup(path)
            if cgroup.remove():
                continue
            # A restore's (an older helper's names say no op: one whose processes are all stopped, none CRIU)
            if path.name.endswith(f"-{RESTORE_RUN}") or (not path.name.endswith(OPS) and _left_stopped(cgroup)):
                log.warning("%s, an earlier helper's restore, still holds processes %s: killed (they were never "
                            "handed over)", path, cgroup.procs())
                cgroup.kill()
            else:
                log.warning("%s, left by an earlier helper, still holds processes %s: left to end", path,
                            cgroup.procs())
            self._kept.add(cgroup)

    # -- requests ------------------------------------------------------------------------------------

    def handle(self, caller: Caller, request: Any) -> dict:
        if not isinstance(request, dict) or not isinstance(request.get("op"), str):
            raise BadRequest('a request is a JSON object with "op"')
        op = request["op"]
        handler = {"hello": self.hello, "check": self.check, "dump": self.dump, "restore": self.restore}.get(op)
        if handler is None:
            raise BadRequest(f"unknown op {op[:40]!r}: hello, check, dump or restore")
        return handler(caller, request)

    def hello(self, caller: Caller, request: dict) -> dict:
        for root in (self.root, self.memory):
            if root is not None:
                os.close(self._user_dir(caller, root))
        return {"ok": True, "version": PROTOCOL_VERSION, "uid": caller.uid, "images": str(self.root / str(caller.uid)),
                "memory": str(self.memory / str(caller.uid)) if self.memory is not None else None,
                "criu": self.criu.version_string, "criu_path": self.criu.path, "elsewhere": self._elsewhere(caller),
                "runs": str(self.cgroups) if self.cgroups is not None else None, "runs_by_pid": True}

    @staticmethod
    def _elsewhere(caller: Caller) -> str:
        """Why the caller's server is not in the helper's namespaces (what its restores would refuse), or ""."""
        why = elsewhere(caller.pid)
        return why.replace(f"process {caller.pid}", "your server", 1) if why else ""

    def check(self, caller: Caller, request: dict) -> dict:
        """``criu check --unprivileged``, run as the caller with what a restore lends: what users get."""
        with self._confined(caller, CHECK_RUN) as cgroup:
            proc = self._criu(caller, self.restore_caps, None, ["check"], None, cgroup)
        lines = [ln for ln in (proc.stdout or "").splitlines() if not any(h in ln for h in criu_mod._HARMLESS)]
        return {"ok": proc.returncode == 0, "output": lines[-1].strip() if lines else ""}

    def dump(self, caller: Caller, request: dict) -> dict:
        pid = request.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
            raise BadRequest('"pid" must be a process ID (an integer above 1)')
        if pid == os.getpid():
            raise Refused("that is the helper itself")
        tree = proctree.descendants(pid)
        if not tree:
            raise Refused(f"process {pid} does not exist")
        for p in tree:
            why = foreign(p, caller.uid)
            if why:
                raise Refused(f"{why}: you may only suspend your own processes")
        why = self._elsewhere(caller) or elsewhere(pid)  # the caller's PID numbers are ours only in our namespace
        if why:
            raise Refused(why)
        root = self._place(request)
        if root == self.memory:
            self._memory_room(tree)
        fd = self._open_images(caller, request.get("images"), root)
        try:
            start = time.monotonic()
            with self._confined(caller, DUMP_RUN, pid) as cgroup:
                args = ["dump", "--tree", str(pid), *criu_mod.COMMON_OPTIONS, *criu_mod.DUMP_OPTIONS]
                proc = self._criu(caller, DUMP_CAPS, fd, args, criu_mod.DUMP_LOG, cgroup)
            if proc.returncode != 0:
                return failure(CRIU_FAILED, f"CRIU could not dump process {pid}", log=criu_mod.DUMP_LOG)
            # The tree's processes that were ours (kernels we restored) are zombies now: collect them,
            # or their PIDs stay taken and the next restore fails. Only those: the tree was checked.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with self._spawn:  # no Popen of ours may be given one of these PIDs meanwhile
                    left = [p for p in tree if p not in self._ours and (info := proctree.info(p)) is not None
                            and info.ppid == os.getpid()]
                    for p in left:
                        proctree.reap(p)
                if not left:
                    break
                time.sleep(0.02)
            return {"ok": True, "seconds": round(time.monotonic() - start, 3)}
        finally:
            os.close(fd)

    def restore(self, caller: Caller, request: dict) -> dict:
        ids = request.get("ids") or []
        if not isinstance(ids, list) or len(ids) > MAX_IDS or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 < i < 1 << 22 for i in ids):
            raise BadRequest(f'"ids" must be a list of at most {MAX_IDS} process IDs')
        why = self._elsewhere(caller)  # what CRIU restores lands in the helper's namespaces, not the caller's
        if why:
            raise Refused(why)
        root = self._place(request)
        fd = self._open_images(caller, request.get("images"), root)
        try:
            try:
                os.unlink(criu_mod.RESTORE_PIDFILE, dir_fd=fd)
            except FileNotFoundError:
                pass
            proctree.steer_pid_allocation(ids)  # only moves the PID cursor forward
            start = time.monotonic()
            with self._staged(fd, caller, root / STAGING) as staged, self._confined(caller, RESTORE_RUN) as cgroup:
                proc = self._criu(caller, self.restore_caps, fd, [
                    "restore", "--restore-detached", "--leave-stopped", "--pidfile", criu_mod.RESTORE_PIDFILE,
                    *criu_mod.COMMON_OPTIONS], criu_mod.RESTORE_LOG, cgroup, images_fd=staged)
                # Whatever CRIU said, what it made is in the cgroup and nowhere else: stop it all from
                # running (the caller may signal its own processes) while it is looked at.
                if not cgroup.freeze():
                    raise Refused("the restored processes could not be stopped to be checked; they were killed")
                made = cgroup.procs()
                if proc.returncode != 0:
                    # _confined kills what it made
                    return failure(CRIU_FAILED, "CRIU could not restore the process", log=criu_mod.RESTORE_LOG)
                pid = self._restored_pid(fd, caller)
                if pid not in made:
                    raise Refused(f"{criu_mod.RESTORE_PIDFILE} names process {pid}, which this restore did not make")
                for p in made:
                    why = foreign(p, caller.uid)
                    if why:
                        raise Refused(f"the restored processes were killed: {why}; these images cannot be restored")
                self._hand_over(cgroup, made, caller)
            return {"ok": True, "pid": pid, "seconds": round(time.monotonic() - start, 3)}
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _staged(self, fd: int, caller: Caller, staging: Path) -> Iterator[int]:
        """The caller's images as CRIU will read them: in a folder of ours that no user can reach or
        write. The core images, which say what credentials each thread gets, are copied and checked
        (the caller's IDs, no capability, no securebits); the rest is hard-linked (memory pages and
        the like: the caller's own data, whatever they write into it). So nothing the caller does
        during the restore changes what was checked, nor stalls CRIU after it let the tasks go."""
        path = Path(tempfile.mkdtemp(prefix=f"{caller.uid}-", dir=staging))
        os.chmod(path, 0o755)  # CRIU, as the caller, reaches it only through our descriptor
        staged = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            cores = total = 0
            names = os.listdir(fd)
            if len(names) > MAX_STAGED_FILES:
                raise Refused(f"the folder holds more than {MAX_STAGED_FILES} files")
            for name in names:
                if name in SKIPPED or not NAME.fullmatch(name) or name.startswith("creds-"):
                    continue  # creds-*.img: an old format's credentials, never read when core images have them
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                checked = name.startswith("core-") and name.endswith(".img") or name == "inventory.img"
                if checked:
                    data = self._read_own(fd, name, caller, MAX_CORE_IMAGE)
                    total += len(data)
                    if total > MAX_STAGED_BYTES:
                        raise Refused(f"the core images add up to more than {MAX_STAGED_BYTES} bytes")
                    if name == "inventory.img":
                        why = self._inventory_why_not(data)
                    else:
                        why = criuimages.why_not(data, caller.uid, caller.gid)
                        cores += 1
                    if why:
                        raise Refused(f"{name}: {why}; these images cannot be restored")
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=staged)
                    with os.fdopen(out, "wb") as f:
                        f.write(data)
                else:
                    os.link(name, name, src_dir_fd=fd, dst_dir_fd=staged, follow_symlinks=False)
                    if not stat.S_ISREG(os.stat(name, dir_fd=staged, follow_symlinks=False).st_mode):
                        raise Refused(f"{name} changed into something else than a file while it was read")
            if "inventory.img" not in names:
                raise Refused("the folder holds no inventory.img")
            if not cores:
                raise Refused("the folder holds no CRIU core images")
            yield staged
        finally:
            os.close(staged)
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _inventory_why_not(data: bytes) -> str | None:
        try:
            version = criuimages.inventory_version(data)
        except (ValueError, IndexError, struct.error) as exc:
            return f"it is not an inventory this helper can check ({exc})"
        return None if version == criuimages.IMAGES_V1_1 else f"it says image version {version}"

    @staticmethod
    def _read_own(fd: int, name: str, caller: Caller, limit: int) -> bytes:
        try:
            handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            raise Refused(f"{name} cannot be read ({exc.strerror})") from exc
        with os.fdopen(handle, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != caller.uid or st.st_size > limit or st.st_nlink != 1:
                raise Refused(f"{name} is not a file of yours, of one name and at most {limit} bytes")
            return f.read(limit + 1)[:limit]

    @contextlib.contextmanager
    def _confined(self, caller: Caller, op: str, pid: int | None = None) -> Iterator[cgroups.Cgroup]:
        """A cgroup for one CRIU run (named by its ``op``: an earlier helper's are told apart at start; a dump's
        by the PID of the tree too, which its caller waits on should this helper go: run_name). Whatever
        is still in it when the block ends (a failure, a refusal, CRIU's own leftovers) is killed, and the PIDs
        of its dead that came to us are collected."""
        assert self.cgroups is not None
        while True:
            try:
                cgroup = cgroups.Cgroup.create(self.cgroups, run_name(os.getpid(), next(self._runs), caller.uid, op, pid))
                break
            except FileExistsError:  # one an earlier helper of the same PID kept
                continue
        try:
            yield cgroup
        finally:
            if cgroup.populated():
                cgroup.kill()
                # Its dead come to us (the subreaper) a moment after they leave the cgroup: collect
                # them before answering, so that their PIDs are free for the next try.
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    self.reap()
                    time.sleep(0.02)
            if not cgroup.remove():
                log.warning("could not remove %s yet; the reaper tries again", cgroup.path)
                cgroup.kill()
                self._kept.add(cgroup)

    def _hand_over(self, cgroup: cgroups.Cgroup, made: list[int], caller: Caller) -> None:
        """Let a checked, restored tree run in the cgroup of the caller's server (where its kernels run),
        then wake it (CRIU left it stopped). Refused (and so killed) if it cannot go there: it must not
        run on in the helper's cgroup, outside the user's limits."""
        mount, path = cgroups.mount_point(), caller.cgroup
        target = mount / path.lstrip("/") if mount is not None and path is not None else None
        if target is None or cgroups.of(caller.pid) != path:
            raise Refused("the process that asked is gone, so there is no cgroup to restore into; ask again "
                          "from the Jupyter server")
        # The reaper waits meanwhile: no PID of the tree is freed, and so none reused, before it runs.
        with self._spawn:
            moved = cgroup.move(made, target)
            if sorted(moved) != sorted(made):
                raise Refused(f"the restored processes could not join the cgroup {path} of the process that asked")
            for p in made:
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass

    # -- what keeps users apart ----------------------------------------------------------------------

    def _user_dir(self, caller: Caller, root: Path) -> int:
        """An open descriptor of ``ROOT/UID`` (``root``: the images root on disk or in memory), made (0700, the
        caller's) if missing."""
        name = str(caller.uid)
        parent = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
                os.chown(name, caller.uid, caller.gid, dir_fd=parent, follow_symlinks=False)
            except FileExistsError:
                pass
            return self._enter(parent, name, caller, str(root / name))
        finally:
            os.close(parent)

    @staticmethod
    def _enter(parent: int, name: str, caller: Caller, shown: str) -> int:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
        except OSError as exc:
            if os.path.islink(f"/proc/self/fd/{parent}/{name}"):
                raise Refused(f"{shown} is a symbolic link; image folders must be real folders") from exc
            raise Refused(f"{shown} cannot be opened as a folder ({exc.strerror})") from exc
        st = os.fstat(fd)
        why = None
        if st.st_uid != caller.uid:
            why = f"{shown} belongs to uid {st.st_uid}, not to you ({caller.uid})"
        elif st.st_mode & 0o077:
            why = f"{shown} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 700 it"
        if why:
            os.close(fd)
            raise Refused(why)
        return fd

    def _open_images(self, caller: Caller, rel: Any, root: Path) -> int:
        """An open descriptor of the caller's image folder ``rel`` under ``root``, each step checked."""
        if not isinstance(rel, str) or not rel:
            raise BadRequest('"images" must name a folder inside your images folder')
        parts = rel.split("/")
        if rel.startswith("/") or len(parts) > MAX_DEPTH or not all(NAME.fullmatch(p) for p in parts):
            raise Refused(f"{rel!r} is not a folder inside your images folder {root / str(caller.uid)} "
                          f"(1 to {MAX_DEPTH} plain names, no '..', no absolute path)")
        fd = self._user_dir(caller, root)
        shown = root / str(caller.uid)
        for part in parts:
            shown = shown / part
            try:
                nxt = self._enter(fd, part, caller, str(shown))
            finally:
                os.close(fd)
            fd = nxt
        return fd

    def _restored_pid(self, fd: int, caller: Caller) -> int:
        try:
            pf = os.open(criu_mod.RESTORE_PIDFILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
            try:
                st = os.fstat(pf)
                text = os.read(pf, 32) if stat.S_ISREG(st.st_mode) and st.st_uid == caller.uid else b""
            finally:
                os.close(pf)
        except OSError as exc:
            raise Refused(f"CRIU left no readable {criu_mod.RESTORE_PIDFILE} ({exc.strerror})") from exc
        if not text.strip().isdigit():
            raise Refused(f"{criu_mod.RESTORE_PIDFILE} is not what CRIU wrote")
        return int(text)

    # -- CRIU, as the caller -------------------------------------------------------------------------

    def _criu(self, caller: Caller, caps: tuple[str, ...], fd: int | None, args: list[str],
              log_name: str | None, cgroup: cgroups.Cgroup, images_fd: int | None = None) -> subprocess.CompletedProcess:
        # A root shell puts itself in the run's cgroup and sets a private umask, then becomes setpriv,
        # which becomes CRIU as the caller: nothing of the run is ever outside the cgroup. CRIU finds its
        # folders through descriptors opened and checked here (/proc/self/fd/N, resolved by CRIU, which
        # holds N), so nothing can swap them on the way: its work folder (logs, pidfile) is the
        # caller's image folder ``fd``; the images it reads are ``images_fd`` (a restore's staged copy)
        # or that same folder.
        wrapper = ['sh', '-c', 'echo $$ > "$0/cgroup.procs" || exit 125; umask 077; exec "$@"', str(cgroup.path)]
        cmd = [*wrapper, *_setpriv(caller, caps), self.criu.path, *args, "--unprivileged"]
        fds = tuple(f for f in (fd, images_fd) if f is not None)
        if log_name is not None and fd is not None:
            images = images_fd if images_fd is not None else fd
            cmd += ["--images-dir", f"/proc/self/fd/{images}", "--work-dir", f"/proc/self/fd/{fd}",
                    "--log-file", log_name, "-v4"]
        env = {"PATH": SAFE_PATH, "LANG": "C.UTF-8"}
        if os.environ.get("LD_LIBRARY_PATH"):  # a CRIU bundle with its own libraries
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        # Its output goes to a file, not a pipe: a child of a CRIU killed mid-run would hold a pipe open, and
        # the caller would wait for that child's end, not CRIU's (engine/criu.py does the same).
        with tempfile.TemporaryFile(mode="w+") as said:
            with self._spawn:
                proc = subprocess.Popen(cmd, cwd="/", pass_fds=fds, env=env, text=True,
                                        stdin=subprocess.DEVNULL, stdout=said, stderr=subprocess.STDOUT)
                self._ours.add(proc.pid)
            try:
                proc.wait(timeout=self.criu_timeout)
            except subprocess.TimeoutExpired:
                cgroup.kill()
                proc.wait()
            finally:
                with self._spawn:
                    self._ours.discard(proc.pid)
            said.seek(0)
            return subprocess.CompletedProcess(cmd, proc.returncode, said.read())

    def reap(self) -> list[int]:
        """Collect our zombie children but those a Popen of ours waits for. Restored trees are re-parented
        to us (we are a subreaper): when one dies, or is dumped again, its PIDs must be freed."""
        me, reaped = os.getpid(), []
        with self._spawn:  # no Popen is between fork and registration meanwhile
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in self._ours:
                    continue
                info = proctree.info(int(name))
                if info is not None and info.ppid == me and info.state in ("Z", "X"):
                    if proctree.reap(int(name)) is not None:
                        reaped.append(int(name))
        for cgroup in list(self._kept):
            if not cgroup.populated() and cgroup.remove():
                self._kept.discard(cgroup)
            elif cgroup.path.name.endswith(f"-{DUMP_RUN}") and _left_stopped(cgroup, criu=True):
                # An earlier helper's dump whose CRIU went, leaving only the child it forks as it starts,
                # which stops itself until CRIU has looked at it: it waits for good, and the user's server
                # waits for it where /proc hides it from its user.
                log.warning("%s, an earlier helper's dump, holds only stopped CRIUs %s: killed", cgroup.path,
                            cgroup.procs())
                cgroup.kill()
        return reaped


# -- the service -----------------------------------------------------------------------------------


def _summary(request: Any) -> str:
    if not isinstance(request, dict):
        return "?"
    parts = [repr(request.get("op"))[:60]]
    for key in ("pid", "images", "place"):
        if key in request:
            value = request[key]
            parts.append(f"{key}={value[:200]!r}" if isinstance(value, str) else f"{key}={str(value)[:200]}")
    if isinstance(request.get("ids"), list):
        parts.append(f"ids=[{len(request['ids'])}]")
    return " ".join(parts)


class _Connection(socketserver.BaseRequestHandler):
    server: Service

    def handle(self) -> None:
        sock: socket.socket = self.request
        caller = peer_credentials(sock)
        server = self.server
        with server.lock:
            mine = server.per_user.get(caller.uid, 0)
            if mine >= MAX_PER_USER:
                busy = f"you have {MAX_PER_USER} requests in progress already"
            elif not server.slots.acquire(blocking=False):
                busy = f"{MAX_CLIENTS} requests are in progress"
            else:
                busy = None
                server.per_user[caller.uid] = mine + 1
        if busy:
            log.warning("%s: busy: %s", caller, busy)
            self._reply(caller, failure(BUSY, f"the helper is busy ({busy}): try again"))
            return
        self._counted = caller.uid
        try:
            self._serve(sock, caller)
        finally:
            self._uncount()

    def _uncount(self) -> None:
        """This request no longer counts as in progress: done before its answer is sent, so that a client
        asking again as soon as it has the answer is never refused as busy with the request it just had."""
        uid, self._counted = getattr(self, "_counted", None), None
        if uid is None:
            return
        server = self.server
        with server.lock:
            server.per_user[uid] -= 1
            if not server.per_user[uid]:
                del server.per_user[uid]
        server.slots.release()

    def _serve(self, sock: socket.socket, caller: Caller) -> None:
        start = time.monotonic()
        request: Any = None
        try:
            line = read_request(sock)
            if line is None:
                log.warning("%s: left before the end of its request", caller)
                return
            try:
                request = json.loads(line)
            except ValueError as exc:
                raise BadRequest(f"not JSON ({exc})") from exc
            sock.settimeout(None)
            reply = self.server.broker.handle(caller, request)
        except (socket.timeout, ConnectionError) as exc:
            log.warning("%s: %s: the request did not arrive (%s)", caller, _summary(request), exc)
            return
        except (BadRequest, Refused) as exc:
            reply = failure(exc.code, str(exc))
        except Exception:  # noqa: BLE001 - the service must outlive any one request
            log.exception("%s: %s: failed", caller, _summary(request))
            reply = failure(INTERNAL, "the helper failed; its log says why")
        outcome = "ok" if reply.get("ok") else f"{reply.get('code')}: {reply.get('error')}"
        level = logging.WARNING if reply.get("code") == REFUSED else logging.INFO
        log.log(level, "%s: %s: %s (%.3f s)", caller, _summary(request), outcome, time.monotonic() - start)
        self._uncount()
        self._reply(caller, reply)
        if reply.get("ok") and isinstance(request, dict) and request.get("op") == "dump":
            self.server.broker.reap()

    def _reply(self, caller: Caller, reply: dict) -> None:
        try:
            self.request.sendall(encode(reply))
        except OSError as exc:
            log.warning("%s: went away before its answer (%s)", caller, exc)


class Service(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str, broker: CriuBroker) -> None:
        self.broker = broker
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.lock = threading.Lock()
        self.per_user: dict[int, int] = {}
        folder = os.path.dirname(path)
        if folder and not os.path.isdir(folder):
            os.makedirs(folder, exist_ok=True)
            os.chmod(folder, 0o755)  # every user must reach the socket
        if os.path.exists(path) or os.path.islink(path):
            os.unlink(path)
        # Made 0666 as it is bound (anyone may ask; SO_PEERCRED says who asks), not by a chmod of its path
        # after, which would follow whatever someone put there meanwhile.
        mask = os.umask(0o111)
        try:
            super().__init__(path, _Connection)
        finally:
            os.umask(mask)


def _reaper(broker: CriuBroker, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            broker.reap()
        except Exception:  # noqa: BLE001
            log.exception("reaping failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jupyter-gpumigrate-helper", description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", default=DEFAULT_SOCKET, help=f"the Unix socket to listen on ({DEFAULT_SOCKET})")
    parser.add_argument("--images-root", default=DEFAULT_IMAGES,
                        help=f"where users' images folders are made ({DEFAULT_IMAGES}); on a disk with room")
    parser.add_argument("--memory-root", default="",
                        help="where users' images folders in memory are made: a tmpfs of its own, in folders that "
                             f"only root can change (for example {EXAMPLE_MEMORY}); none by default: images on disk "
                             "only. Users' servers then suspend to memory where it has room (docs/users.md says what "
                             "that costs)")
    parser.add_argument("--memory-size", default="",
                        help="mount a tmpfs of this size at --memory-root if none is mounted there (mount's size=: "
                             "bytes with k, m or g, or a share of the machine's memory such as 50%%); it stays "
                             "mounted when the helper stops")
    parser.add_argument("--criu", default=None, help="the CRIU binary (default: /usr/local/sbin/criu, else PATH)")
    parser.add_argument("--log-file", default=None, help="also log every request to this file")
    parser.add_argument("--criu-timeout", type=float, default=3600.0,
                        help="seconds one CRIU run may take before it is killed (3600; images of 100 GB take minutes)")
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log_file:
        handlers.append(logging.FileHandler(args.log_file))
    logging.basicConfig(level=logging.INFO, handlers=handlers,
                        format="%(asctime)s jupyter-gpumigrate-helper %(levelname)s %(message)s")
    if os.geteuid() != 0:
        parser.error("the helper runs as root (it lends CRIU's capabilities to each caller, as that caller)")
    try:
        broker = CriuBroker(args.images_root, args.criu, args.criu_timeout, args.memory_root or None,
                            args.memory_size or None)
    except Exception as exc:  # CriuNotFound says what to install
        log.error("%s", exc)
        return 1
    if not proctree.become_subreaper():
        log.warning("could not become a subreaper: restored kernels will be re-parented to PID 1")
    service = Service(args.socket, broker)
    stop = threading.Event()
    threading.Thread(target=_reaper, args=(broker, stop), daemon=True, name="reaper").start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=service.shutdown).start())
    log.info("listening on %s; images in %s%s; CRIU %s (%s); a restore is lent %s", args.socket, broker.root,
             f" and, in memory, {broker.memory}" if broker.memory is not None else "", broker.criu.version_string,
             broker.criu.path, ", ".join(broker.restore_caps))
    try:
        service.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        stop.set()
        service.server_close()
        try:
            os.unlink(args.socket)
        except OSError:
            pass
    log.info("stopped")
    return 0

