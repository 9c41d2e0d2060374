"""Typed errors of the engine.

Every message is a sentence a person can act on: what went wrong and what to do next.
The REST API and the CLI show ``str(error)`` as it is.
"""

from __future__ import annotations

import errno
import os
from typing import TypeVar


E = TypeVar("E", bound=BaseException)


class MigrateError(Exception):
    """Base class of every error jupyter-gpumigrate raises on purpose."""

    #: HTTP status that the server extension answers with when this error is raised before an
    #: operation starts.
    http_status: int = 500


class CriuNotFound(MigrateError):
    """No usable CRIU binary."""

    http_status = 503


class CriuFailed(MigrateError):
    """A CRIU command failed; ``log_path`` holds its full log."""

    def __init__(self, message: str, log_path: str | None = None, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_path = log_path
        self.log_tail = log_tail


class PidConflict(MigrateError):
    """A PID or TID of a suspended process tree is held by another process."""

    http_status = 409

    def __init__(self, message: str, pid: int, holder: str) -> None:
        super().__init__(message)
        self.pid = pid
        self.holder = holder


class ImageError(MigrateError):
    """An image directory is missing, incomplete or not ours."""

    http_status = 409


class InvalidState(MigrateError):
    """The kernel is not in a state that allows the request."""

    http_status = 409


class GpuError(MigrateError):
    """A GPU request cannot be met (wrong index, no driver support, not enough memory...)."""

    http_status = 409


class PhaseFailed(MigrateError):
    """A phase of a plan failed; the plan was rolled back as far as ``rolled_back`` says."""

    def __init__(self, phase: str, cause: BaseException, rolled_back: bool, undo_errors: list[str],
                 before: str = "", ended: str = "") -> None:
        """``before``: what the sentence begins with, where the plan had run once already (a suspend's first
        attempt in memory). ``ended``: what became of the kernel, said instead of the cause's words (which say
        what the rollback left: "the kernel runs on") where the kernel did not go on as they say (shut down
        while the plan ran)."""
        message = before + (ended or said(cause))
        if undo_errors:
            message += " Rolling back also failed: " + "; ".join(undo_errors)
        super().__init__(message)
        self.phase = phase
        self.cause = cause
        self.rolled_back = rolled_back
        self.undo_errors = undo_errors
        self.ended = ended


class Stopped(MigrateError):
    """The kernel was asked to stop (shut down, restarted) while a plan ran, before a phase that may be
    stopped: the plan was undone there instead of being carried to its end first."""

    http_status = 409


class CudaUnavailable(MigrateError):
    """cuda-core's checkpoint API, or a driver that has it, is missing in the server's environment."""

    http_status = 503


class CudaCheckpointFailed(MigrateError):
    """A CUDA checkpoint call (lock, checkpoint, restore, unlock) failed on a process."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


class HelperError(MigrateError):
    """The node helper (engine/nodehelper/) is unreachable, or refused a request."""

    http_status = 503


class HelperGone(HelperError):
    """The node helper took a request and went (killed, restarted) before it answered: what it started, a CRIU
    run, may still be running."""


class PrivilegeMissing(MigrateError):
    """This server runs as an ordinary user, and nothing lends CRIU the privileges it needs."""

    http_status = 503


#: How a sentence about a kernel whose process ended mid-operation ends: what became of it, and the way out.
DEAD = "what it held is lost: the kernel is dead, and Jupyter restarts it (or restart it yourself)."


def said(cause: BaseException) -> str:
    """``cause`` as a sentence: its own words for our errors; a full disk that no step foresaw (a raw
    ENOSPC or EDQUOT) says which disk is full and what to do, instead of "[Errno 28] ..."."""
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        written = cause.filename2 or cause.filename  # a copy's: (source, destination)
        folder = os.path.dirname(os.path.abspath(os.fsdecode(written))) if written else ""
        where = f"The disk of {folder}" if folder else "A disk"
        quota = " (or your quota on it)" if cause.errno == errno.EDQUOT else ""
        return f"{where} is full{quota} ({cause.strerror or 'no space left'}). Free space on it, then try again."
    return str(cause) or type(cause).__name__


def no_room(cause: BaseException) -> str | None:
    """The folder whose file system was full, where that is why ``cause`` failed (our errors that say so carry
    it as ``full_folder``; a raw ENOSPC or EDQUOT names it in its file name), or None."""
    found = getattr(cause, "full_folder", None)
    if found:
        return str(found)
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        written = cause.filename2 or cause.filename
        return os.path.dirname(os.path.abspath(os.fsdecode(written))) if written else None
    return None


def for_full(error: E, folder: str | os.PathLike[str]) -> E:
    """``error``, marked as caused by the full file system of ``folder`` (:func:`no_room`)."""
    error.full_folder = os.fspath(folder)  # type: ignore[attr-defined]
    return error
