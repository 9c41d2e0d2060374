"""Talking to a kernel over its own ZMQ channels from the server, outside jupyter_client's clients.

Plain pyzmq sockets with jupyter_client's :class:`Session` for signing: these run in a migration's
worker thread, where jupyter_client's blocking client would try to drive the server's event loop.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable

import zmq
from jupyter_client.session import Session

#: Run silently in an idle Python kernel before its GPU memory is checkpointed. One expression, so it
#: leaves no name behind in the user's namespace; it touches CUDA only if the kernel already did.
RELEASE_TORCH_CACHE = (
    "(lambda t: t is not None and t.cuda.is_initialized() and (t.cuda.synchronize(), t.cuda.empty_cache()))"
    "(__import__('sys').modules.get('torch'))"
)

#: Evaluated in an idle IPython kernel: the host stash of a suspend or a move to another host, and its way
#: back (kernel/hoststash.py).
HOST_STASH_CALL = "__import__('jupyter_gpumigrate.kernel.hoststash', fromlist=['stash']).stash({folder!r}, {min_total}{more})"
HOST_TAKE_BACK_CALL = "__import__('jupyter_gpumigrate.kernel.hoststash', fromlist=['take_back']).take_back({folder!r})"


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _session(info: dict) -> Session:
    return Session(key=_bytes(info.get("key", b"")), signature_scheme=info.get("signature_scheme", "hmac-sha256"))


def _socket(info: dict, kind: int, channel: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(kind)
    sock.linger = 0
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(f"{info.get('transport', 'tcp')}://{info['ip']}:{info[channel + '_port']}")
    return sock


def kernel_answers(connection_info: dict, timeout: float) -> bool:
    """True once the kernel answers kernel_info and its IOPub status reaches a new subscriber.

    The request goes on the control channel, which a kernel busy with a cell still serves.
    """
    info = connection_info
    session = _session(info)
    control = _socket(info, zmq.DEALER, "control")
    iopub = _socket(info, zmq.SUB, "iopub")
    poller = zmq.Poller()
    poller.register(iopub, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg_id = session.send(control, "kernel_info_request", {})["header"]["msg_id"]
            resend = min(deadline, time.monotonic() + 0.5)
            while (left := resend - time.monotonic()) > 0:
                if not poller.poll(int(left * 1000) + 1):
                    break
                _, frames = session.feed_identities(iopub.recv_multipart())
                msg = session.deserialize(frames, content=False)
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
                    return True
        return False
    finally:
        control.close()
        iopub.close()


def run_silently(connection_info: dict, code: str, timeout: float) -> bool:
    """Execute ``code`` silently (no output, no history, no execution count) on the shell channel;
    True if the kernel replied ``ok`` within ``timeout`` seconds."""
    session = _session(connection_info)
    shell = _socket(connection_info, zmq.DEALER, "shell")
    try:
        content = {"code": code, "silent": True, "store_history": False, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": False}
        msg_id = session.send(shell, "execute_request", content)["header"]["msg_id"]
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not shell.poll(int(left * 1000) + 1):
                break
            _, frames = session.feed_identities(shell.recv_multipart())
            reply = session.deserialize(frames)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"].get("status") == "ok"
        return False
    finally:
        shell.close()


def send_silently(connection_info: dict, code: str, linger: float = 2.0) -> None:
    """Send ``code`` to run silently on the shell channel and do not wait for its reply (the socket
    lingers up to ``linger`` seconds to deliver the request)."""
    session = _session(connection_info)
    shell = _socket(connection_info, zmq.DEALER, "shell")
    shell.linger = int(linger * 1000)
    try:
        content = {"code": code, "silent": True, "store_history": False, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": False}
        session.send(shell, "execute_request", content)
    finally:
        shell.close()


class KernelGone(ConnectionError):
    """The kernel's process ended while the server waited for its answer."""


def evaluate_silently(connection_info: dict, expression: str, timeout: float,
                      alive: Callable[[], bool] | None = None) -> str:
    """Evaluate ``expression`` in the kernel's main thread, between cells, as a silent request's user
    expression (no output, no history, no execution count); its ``str`` value.

    Raises TimeoutError if no answer comes within ``timeout`` seconds, :class:`KernelGone` as soon as
    ``alive()`` says the kernel ended, and RuntimeError with the kernel's ``ename: evalue`` if it raised."""
    session = _session(connection_info)
    shell = _socket(connection_info, zmq.DEALER, "shell")
    try:
        content = {"code": "", "silent": True, "store_history": False, "user_expressions": {"r": expression},
                   "allow_stdin": False, "stop_on_error": False}
        msg_id = session.send(shell, "execute_request", content)["header"]["msg_id"]
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not shell.poll(int(min(left, 0.5) * 1000) + 1):
                if alive is not None and not alive():
                    raise KernelGone("the kernel's process ended")
                continue
            _, frames = session.feed_identities(shell.recv_multipart())
            reply = session.deserialize(frames)
            if reply["parent_header"].get("msg_id") != msg_id:
                continue
            if reply["content"].get("status") == "aborted":
                raise RuntimeError("Aborted: a cell queued before this request failed, and the kernel dropped what "
                                   "was queued after it; try again")
            result = (reply["content"].get("user_expressions") or {}).get("r") or {}
            if result.get("status") == "ok":
                value = (result.get("data") or {}).get("text/plain", "")
                return str(ast.literal_eval(value)) if value[:1] in ("'", '"') else value
            error = result or reply["content"]
            raise RuntimeError(f"{error.get('ename', 'Error')}: {error.get('evalue', '')}")
        raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s")
    finally:
        shell.close()
