"""The Python client of ``/api/gpumigrate``: the CLI, the kernel's ``%migrate`` and the Hub service use it.

Standard library HTTP only (urllib): it runs inside users' kernels too, where it must add no
dependency. JSON in and out; an error is an :class:`ApiError` carrying the server's sentence and the
HTTP status; :meth:`Client.follow` waits for an operation to end by long poll
(``GET operations/{id}?after={version}``: the server answers once the operation has changed).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: the Authorization scheme of a kernel's own credential (the server side: jupyter_gpumigrate.credentials)
SCHEME = "gpumigrate-kernel"
#: where the extension's API lives under a server's base URL
API = "api/gpumigrate"
#: the statuses of an operation that has ended
DONE = ("succeeded", "failed")
#: how long one long-poll request may take (the server answers within 25 s, changed or not)
POLL_TIMEOUT = 60.0


class ApiError(Exception):
    """The server refused or failed a request: ``str(exc)`` is the server's sentence, ``status`` the HTTP
    status (None when there was no answer), ``url`` what was asked."""

    def __init__(self, message: str, status: int | None = None, url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.url = url

    @property
    def refused(self) -> bool:
        """The server did not accept the credential (or it grants no right to this)."""
        return self.status in (401, 403)


class Unreachable(ApiError):
    """No answer: the server is not there, not listening, cut the connection, or took longer than the
    request's timeout (``timed_out``). ``reason`` is what the network layer said."""

    def __init__(self, message: str, url: str = "", reason: str = "", timed_out: bool = False) -> None:
        super().__init__(message, None, url)
        self.reason = reason
        self.timed_out = timed_out


class NotFinished(ApiError):
    """:meth:`Client.follow` gave up waiting; the operation goes on in the server. ``op`` is its last version."""

    def __init__(self, message: str, op: dict) -> None:
        super().__init__(message)
        self.op = op


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # A JSON API answers, it does not redirect: a redirect is the proxy or a login page speaking.
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _message(exc: urllib.error.HTTPError, url: str) -> str:
    """The server's sentence (``{"message": ...}``, as jupyter_server and the Hub answer errors)."""
    if 300 <= exc.code < 400:
        where = exc.headers.get("Location") if exc.headers else None
        return (f"{url} answered with a redirect (HTTP {exc.code}{f' to {where}' if where else ''}), not with "
                "JSON: is the server running, and is this its URL?")
    try:
        data = json.loads(exc.read() or b"null")
    except (ValueError, OSError, http.client.HTTPException):
        data = None
    message = data.get("message") if isinstance(data, dict) else None
    return str(message or exc.reason or f"HTTP {exc.code}")


#: The largest answer read from a server (its user may control it): the longest list of operations or
#: kernels is a small fraction of it.
MAX_ANSWER = 64 << 20


def _read_all(resp: Any, deadline: float) -> bytes:
    """The whole answer, by the ``deadline`` (the request's timeout bounds each read of the socket, not the
    whole: a server sending a byte every few seconds held a thread, and the Hub's service with it, for
    minutes); raises TimeoutError past it, an HTTPException past :data:`MAX_ANSWER` bytes, and
    IncompleteRead for an answer cut short (a connection closed before its Content-Length)."""
    parts, size = [], 0
    while True:
        part = resp.read1(1 << 16)
        if not part:
            if resp.length:  # bytes it said would come, and did not
                raise http.client.IncompleteRead(b"".join(parts), resp.length)
            return b"".join(parts)
        parts.append(part)
        size += len(part)
        if size > MAX_ANSWER:
            raise http.client.HTTPException(f"an answer of more than {MAX_ANSWER} bytes")
        if time.monotonic() > deadline:
            raise TimeoutError("its answer was still coming when the time was up")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity, which browsers refuse


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: json.loads makes it inf, which json.dumps writes as Infinity
        raise ValueError(f"{text} is too large a number")
    return value


@dataclass
class Client:
    """One server's ``/api/gpumigrate`` (or, with ``prefix=""``, any JSON API under ``url``).

    ``authorization`` is the whole ``Authorization`` header: ``token <user token>`` (:meth:`with_token`)
    or the kernel credential (:meth:`for_kernel`); empty, none is sent.
    """

    url: str
    authorization: str = ""
    prefix: str = API
    timeout: float = 30.0
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def with_token(cls, url: str, token: str, **kwargs: Any) -> Client:
        return cls(url, f"token {token}" if token else "", **kwargs)

    @classmethod
    def for_kernel(cls, url: str, secret: str, **kwargs: Any) -> Client:
        """A kernel's client, with the credential its provisioner gave it (credentials.py)."""
        return cls(url, f"{SCHEME} {secret}", **kwargs)

    def address(self, path: str) -> str:
        base = self.url.rstrip("/") + "/"
        if self.prefix:
            base += self.prefix.strip("/") + "/"
        return base + path.lstrip("/")

    def request(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """Send ``body`` as JSON (a POST without one sends ``{}``); the decoded JSON answer."""
        url = self.address(path)
        if body is None and method in ("POST", "PUT", "PATCH"):
            body = {}
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        req.add_header("Accept", "application/json")
        if self.authorization:
            req.add_header("Authorization", self.authorization)
        for name, value in self.headers.items():
            req.add_header(name, value)
        wait = self.timeout if timeout is None else timeout
        try:
            with _OPENER.open(req, timeout=wait) as resp:
                status, raw = resp.status, _read_all(resp, time.monotonic() + wait)
        except urllib.error.HTTPError as exc:
            raise ApiError(_message(exc, url), exc.code, url) from None
        except (TimeoutError, socket.timeout) as exc:
            raise Unreachable(f"The server at {url} did not answer in time ({exc or 'timed out'}).", url, str(exc) or "timed out",
                              timed_out=True) from None
        except urllib.error.URLError as exc:
            timed_out = isinstance(exc.reason, (TimeoutError, socket.timeout))
            raise Unreachable(f"The server at {url} does not answer ({exc.reason}).", url, str(exc.reason),
                              timed_out=timed_out) from None
        except (OSError, http.client.HTTPException) as exc:
            # HTTPException: a connection cut mid-answer (CRIU restores a kernel's sockets closed).
            raise Unreachable(f"The server at {url} does not answer ({exc or type(exc).__name__}).", url,
                              str(exc) or type(exc).__name__) from None
        try:
            return json.loads(raw or b"null", parse_constant=_no_constant, parse_float=_finite)
        except (ValueError, RecursionError):  # RecursionError: lists nested thousands deep
            raise ApiError(f"{url} answered something that is not JSON: is it a Jupyter server with "
                           "jupyter-gpumigrate?", status, url) from None

    def get(self, path: str, timeout: float | None = None) -> Any:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any = None, timeout: float | None = None) -> Any:
        return self.request("POST", path, body, timeout)

    # -- the API's resources ---------------------------------------------------------------------------

    def kernels(self, timeout: float | None = None) -> list[dict]:
        return self.get("kernels", timeout)

    def kernel(self, kernel_id: str, timeout: float | None = None) -> dict:
        return self.get(f"kernels/{quote(kernel_id)}", timeout)

    def gpus(self, timeout: float | None = None) -> dict:
        return self.get("gpus", timeout)

    def operations(self, timeout: float | None = None) -> list[dict]:
        return self.get("operations", timeout)

    def act(self, kernel_id: str, action: str, body: dict | None = None) -> dict:
        """Start ``suspend``, ``resume``, ``migrate`` or ``transplant`` of a kernel: the operation (202); a
        transplant with ``dry_run`` answers what would carry (200)."""
        return self.post(kernel_path(kernel_id, action), body or {})

    def drain(self, gpu: int, body: dict | None = None) -> dict:
        return self.post(f"gpus/{int(gpu)}/drain", body or {})

    def operation(self, op_id: str, after: int | None = None, timeout: float | None = None) -> dict:
        """The operation; with ``after``, once it is past that version (or done, or 25 s later)."""
        query = f"?after={int(after)}" if after is not None else ""
        return self.get(f"operations/{quote(op_id)}{query}",
                        POLL_TIMEOUT if timeout is None and after is not None else timeout)

    def follow(self, op: dict, on_change: Callable[[dict], None] | None = None, timeout: float | None = None,
               patience: float = 0.0) -> dict:
        """Wait until the operation ends; its last version.

        ``on_change(op)`` is called with each version seen, the first and the last included. The server
        holds each request until the operation changes: this does not poll. After ``timeout`` seconds
        (None: no limit) it raises :class:`NotFinished`. A server that does not answer raises
        :class:`Unreachable`, unless ``patience`` > 0: it keeps asking for that many seconds (a kernel
        being moved loses its connection to its server for a while).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        lost_since: float | None = None
        if on_change is not None:
            on_change(op)
        while op["status"] not in DONE:
            if deadline is not None and time.monotonic() > deadline:
                raise NotFinished(
                    f"Operation {op['id']} is still {op['status']} after {timeout:.0f} s; it goes on in the server. "
                    f"Follow it with GET /{API}/operations/{op['id']}.", op)
            try:
                op = self.operation(op["id"], after=op["version"])
            except Unreachable:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > patience:
                    raise
                time.sleep(0.2)
                continue
            lost_since = None
            if on_change is not None:
                on_change(op)
        return op


def quote(part: str) -> str:
    """One path segment, escaped."""
    return urllib.parse.quote(str(part), safe="")


def kernel_path(kernel_id: str, action: str) -> str:
    """``kernels/{id}/{action}``, relative to the API."""
    return f"kernels/{quote(kernel_id)}/{action}"
