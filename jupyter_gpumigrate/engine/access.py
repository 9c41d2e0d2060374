"""How this process gets CRIU's privileged work done: as root, through the node helper, or by a CRIU
binary given capabilities. One choice, made the same way for every operation and for ``doctor``.

- root: CRIU runs directly (the set-up of a container per user, or a single-user machine).
- helper: an ordinary user's server on a shared node; a system service runs CRIU as that user, on
  that user's kernels only (the nodehelper package). Used whenever its socket exists.
- capabilities: an ordinary user's server, and a CRIU binary an administrator gave
  ``cap_checkpoint_restore,cap_setpcap+eip``: CRIU runs directly in its ``--unprivileged`` mode.

The CUDA checkpoint API needs none of this: a user may checkpoint their own processes (docs/users.md).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import criu as criu_mod
from .errors import CriuNotFound, HelperError, PrivilegeMissing
from .nodehelper import DEFAULT_SOCKET, HelperCriu
from .nodehelper.client import traced

ROOT, HELPER, CAPABILITIES, NONE = "root", "helper", "capabilities", "none"


@dataclass(frozen=True)
class Access:
    mode: str
    detail: str
    remedy: str = ""


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def remedy(criu_path: str | None) -> str:
    located = criu_mod.locate(criu_path) or "/usr/local/sbin/criu"
    return (
        "Ask an administrator to set up one of these once (docs/users.md): the node helper, a system "
        "service for every user of this machine (systemctl enable --now jupyter-gpumigrate-helper); or "
        f"capabilities on CRIU for this machine's users: {criu_mod.SETCAP_HINT.format(path=located)}. "
        "Or run the Jupyter server as root."
    )


def criu_access(criu_path: str | None = None, helper_socket: str | None = DEFAULT_SOCKET) -> Access:
    """Which way this process would run CRIU now, and why (never raises)."""
    if os.geteuid() == 0:
        return Access(ROOT, "running as root: CRIU runs directly")
    user = f"running as uid {os.geteuid()}"
    if helper_socket and _is_socket(helper_socket):
        return Access(HELPER, f"{user}: CRIU runs through the node helper at {helper_socket}")
    located = criu_mod.locate(criu_path)
    if located:
        caps = criu_mod.file_capabilities(located)
        if caps == set(criu_mod.NEEDED_CAPS):
            return Access(CAPABILITIES, f"{user}: CRIU at {located} has the capabilities it needs")
        if caps:
            return Access(NONE, f"{user}: CRIU at {located} has {', '.join(sorted(caps))} but not all of "
                          f"{', '.join(criu_mod.NEEDED_CAPS)}", remedy(criu_path))
    where = f" at {helper_socket}" if helper_socket else ""
    return Access(NONE, f"{user}, with no node helper{where} and no CRIU with capabilities: kernels "
                  "cannot be suspended or moved", remedy(criu_path))


def open_criu(criu_path: str | None = None, helper_socket: str | None = DEFAULT_SOCKET
              ) -> criu_mod.Criu | HelperCriu:
    """The CRIU driver this process should use; :class:`PrivilegeMissing` (or :class:`CriuNotFound`,
    :class:`HelperError`) saying what an administrator must do if there is none."""
    found = criu_access(criu_path, helper_socket)
    if found.mode == HELPER:
        assert helper_socket
        return HelperCriu(helper_socket)
    if found.mode == NONE:
        criu_mod.find(criu_path)  # CriuNotFound first: installing CRIU comes before its privileges
        raise PrivilegeMissing(f"This server is {found.detail.removeprefix('running as ')}. {found.remedy}")
    return criu_mod.Criu(criu_path)


_helper_roots: dict[str, tuple[Path, Path | None]] = {}


def _helper_folders(helper_socket: str | None) -> tuple[Path, Path | None] | None:
    """The folders the node helper made for this user, on disk and in memory (None: it keeps none in memory),
    asked once, then kept; None where this server does not go through a helper."""
    if os.geteuid() == 0 or not helper_socket or not _is_socket(helper_socket):
        return None
    if helper_socket not in _helper_roots:
        helper = HelperCriu(helper_socket, hello_timeout=5)
        _helper_roots[helper_socket] = (helper.images_root, helper.memory_root)
    return _helper_roots[helper_socket]


def dump_watch(helper_socket: str | None) -> Callable[[int], list[int]]:
    """What still runs of a dump of a PID by the node helper (its CRIU's processes, the kernel's tracer), as a
    function of that PID, asking the helper once: a server that went mid-dump left it running, and the next
    must not judge its images meanwhile. Nothing runs where this server does not go through a helper; where
    the helper does not answer, only the tracer is looked at."""
    if os.geteuid() == 0 or not helper_socket or not _is_socket(helper_socket):
        return lambda pid: []
    try:
        return HelperCriu(helper_socket, hello_timeout=5).busy
    except HelperError:
        return lambda pid: [pid] if traced(pid) else []


def images_root(default: Path, helper_socket: str | None = DEFAULT_SOCKET) -> Path:
    """Where this server keeps images: ``default``, or, with the node helper, the folder the helper
    made for this user (the only place it dumps to and restores from, with its folder in memory: see
    :func:`memory_root`). Raises :class:`HelperError` if the helper is there but does not say: never
    another folder meanwhile."""
    folders = _helper_folders(helper_socket)
    return default if folders is None else folders[0]


def memory_root(default: Path | None, helper_socket: str | None = DEFAULT_SOCKET) -> Path | None:
    """Where this server keeps images in memory: ``default``, or, with the node helper, the folder the
    helper made for this user in memory, or None where the helper keeps none (run without --memory-root)."""
    folders = _helper_folders(helper_socket)
    return default if folders is None else folders[1]


__all__ = ["Access", "criu_access", "open_criu", "images_root", "memory_root", "dump_watch", "CriuNotFound", "ROOT", "HELPER", "CAPABILITIES", "NONE"]
