"""Can this machine migrate kernels? One check per concern, each with the remedy when it fails."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from dataclasses import asdict, dataclass

from . import access
from . import criu as criu_mod
from . import gpus as gpus_mod
from .cudackpt import MIN_DRIVER_FOR_REMAP
from .errors import CriuNotFound, HelperError
from .nodehelper import DEFAULT_SOCKET, HelperCriu

OK, WARN, FAIL, INFO = "ok", "warn", "fail", "info"
RECOMMENDED_PID_MAX = 4194304
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


@dataclass
class Check:
    name: str
    status: str
    detail: str
    remedy: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def check_criu(criu_path: str | None, helper_socket: str | None = DEFAULT_SOCKET) -> list[Check]:
    if access.criu_access(criu_path, helper_socket).mode == access.HELPER:
        try:
            helper = HelperCriu(helper_socket or DEFAULT_SOCKET)
            passed, last = helper.check()
        except HelperError as exc:  # its message says what to ask for
            return [Check("criu", FAIL, str(exc), "Ask an administrator to start the node helper (docs/users.md).")]
        checks = [Check("criu", OK, f"{helper.binary.path}, version {helper.binary.version_string}")]
        # The helper ran `criu check --unprivileged` as this user, with what it lends a restore.
        remedy = "Ask an administrator to fix what `criu check --unprivileged` reports in the node helper's log."
        checks.append(Check("criu check", OK if passed else FAIL, last or "failed", "" if passed else remedy))
        if helper.memory_root is not None:
            checks.append(Check("helper images", OK, f"on disk in {helper.images_root}, in memory in "
                                                     f"{helper.memory_root}"))
        else:
            checks.append(Check("helper images", INFO, f"on disk only, in {helper.images_root}: the helper runs "
                                                       "without --memory-root, so suspends go to disk",
                                "Ask an administrator for --memory-root (docs/users.md) for suspends at memory "
                                "speed."))
        if helper.elsewhere:
            checks.append(Check("helper namespaces", FAIL, helper.elsewhere.replace("your server", "this process", 1),
                                "Ask an administrator to run the node helper and the users' servers in the same "
                                "mount, network and PID namespaces (docs/users.md)."))
        elif helper.elsewhere is not None:
            checks.append(Check("helper namespaces", OK, "the helper shares this process's mount, network and PID "
                                                         "namespaces"))
        return checks
    try:
        binary = criu_mod.find(criu_path)
    except CriuNotFound as exc:
        return [Check("criu", FAIL, str(exc).split(". Install")[0] + ".", criu_mod.INSTALL_HINT)]
    checks = [Check("criu", OK, f"{binary.path}, version {binary.version_string}")]
    try:
        passed, output = criu_mod.Criu(binary.path).check()
    except (OSError, subprocess.TimeoutExpired) as exc:
        passed, output = False, str(exc)
    last = output.splitlines()[-1] if output else ""
    if passed:
        checks.append(Check("criu check", OK, last or "passed"))
    else:
        how = "as root" if os.geteuid() == 0 else "--unprivileged as this user"
        checks.append(Check("criu check", FAIL, last or "failed",
                            f"Run `{binary.path} check {how}` and fix what it reports."))
    return checks


def check_privileges(criu_path: str | None, helper_socket: str | None = DEFAULT_SOCKET) -> list[Check]:
    found = access.criu_access(criu_path, helper_socket)
    checks = [Check("privileges", FAIL if found.mode == access.NONE else OK, found.detail, found.remedy)]
    if found.mode != access.ROOT:
        # CRIU runs as this user without CAP_SYS_PTRACE (helper or capabilities): Yama's scope >= 1
        # would keep it from reading the user's own kernels, which are not its descendants.
        try:
            scope = int(open(YAMA_SCOPE).read())
        except (OSError, ValueError):
            scope = 0
        if scope >= 1:
            checks.append(Check(
                "ptrace scope", FAIL,
                f"kernel.yama.ptrace_scope is {scope}: CRIU, run as a user, cannot read that user's kernels",
                "Ask an administrator for sysctl -w kernel.yama.ptrace_scope=0 (and in /etc/sysctl.d/), or "
                "run the Jupyter server as root."))
    return checks


def check_kernel() -> list[Check]:
    release = platform.release()
    try:
        major, minor = (int(x) for x in release.split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    checks = [
        Check("linux", OK, release)
        if (major, minor) >= (5, 9)
        else Check("linux", FAIL, f"{release} is older than 5.9", "Use Linux 5.9 or newer.")
    ]
    try:
        pid_max = int(open("/proc/sys/kernel/pid_max").read())
    except OSError:
        pid_max = 0
    if pid_max >= RECOMMENDED_PID_MAX:
        checks.append(Check("pid_max", OK, str(pid_max)))
    else:
        checks.append(
            Check(
                "pid_max",
                WARN,
                f"{pid_max}: a suspended kernel's PIDs may be taken by new processes before it resumes",
                f"sysctl -w kernel.pid_max={RECOMMENDED_PID_MAX} (and set it in /etc/sysctl.d/ to keep it)",
            )
        )
    return checks


def check_gpus() -> list[Check]:
    version = gpus_mod.driver_version()
    if version is None:
        # Every GPU row, so that the table reads the same on every machine; none is an error here.
        try:
            importlib.import_module("cuda.core.checkpoint")
            api = Check("cuda checkpoint api", INFO, "cuda.core.checkpoint imports (used once there is a driver)")
        except ImportError:
            api = Check("cuda checkpoint api", INFO, "not installed (needed only with NVIDIA GPUs)",
                        "With GPUs: pip install 'jupyter-gpumigrate[gpu]' in the server's environment.")
        return [Check("nvidia driver", INFO, "none found: CPU kernels only (GPU migration unavailable)",
                      f"To move GPU kernels: NVIDIA driver {MIN_DRIVER_FOR_REMAP} or newer (nvidia-smi)."),
                api,
                Check("gpus", INFO, "0 (NVML sees no driver)")]
    checks = []
    major = int(version.split(".")[0])
    if major >= MIN_DRIVER_FOR_REMAP:
        checks.append(Check("nvidia driver", OK, version))
    else:
        checks.append(
            Check(
                "nvidia driver",
                WARN,
                f"{version}: suspend works, moving to another GPU needs {MIN_DRIVER_FOR_REMAP} or newer",
                f"Install NVIDIA driver {MIN_DRIVER_FOR_REMAP} or newer.",
            )
        )
    try:
        importlib.import_module("cuda.core.checkpoint")
        checks.append(Check("cuda checkpoint api", OK, "cuda.core.checkpoint imports"))
    except ImportError as exc:
        checks.append(
            Check(
                "cuda checkpoint api",
                FAIL,
                f"cuda.core.checkpoint does not import ({exc})",
                "pip install 'jupyter-gpumigrate[gpu]' (cuda-core >= 1.2) in the server's environment.",
            )
        )
    gpus = gpus_mod.snapshot()
    names = ", ".join(f"{g.index}: {g.name}" for g in gpus) or "none"
    checks.append(Check("gpus", OK if gpus else WARN, f"{len(gpus)} ({names})",
                        "" if gpus else "The driver is loaded but lists no GPU: check nvidia-smi and dmesg."))
    failing = [f"{g.index} ({g.error})" for g in gpus if g.error]
    if failing:
        checks.append(Check("gpu health", WARN, f"NVML cannot read GPU {', '.join(failing)}",
                            "Check those GPUs with nvidia-smi; kernels are never moved onto them."))
    off = [str(g.index) for g in gpus if g.persistence_mode is False]
    if off:
        checks.append(
            Check(
                "persistence mode",
                WARN,
                f"off on GPU {', '.join(off)}: a restore may fail or be slow while the driver is unloaded",
                "nvidia-smi -pm 1 (as root), or run nvidia-persistenced.",
            )
        )
    elif gpus:
        checks.append(Check("persistence mode", OK, "on"))
    mig = [str(g.index) for g in gpus if g.mig_enabled]
    if mig:
        checks.append(
            Check(
                "mig",
                WARN,
                f"MIG is on for GPU {', '.join(mig)}: kernels on MIG instances cannot be moved",
                "Turn MIG off (nvidia-smi -mig 0) on GPUs whose kernels should move.",
            )
        )
    return checks


def run_checks(criu_path: str | None = None, helper_socket: str | None = DEFAULT_SOCKET) -> list[Check]:
    return [*check_criu(criu_path, helper_socket), *check_privileges(criu_path, helper_socket), *check_kernel(),
            *check_gpus()]


def can_migrate(checks: list[Check]) -> bool:
    return all(c.status != FAIL for c in checks)
