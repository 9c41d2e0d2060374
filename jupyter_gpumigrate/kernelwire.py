"""Talking to a kernel over its own ZMQ channels from the server, outside jupyter_client's clients.

Plain pyzmq sockets with jupyter_client's :class:`Session` for signing: these run in a migration's
worker thread, where jupyter_client's blocking client would try to drive the server's event loop.
"""

from __future__ import annotations

import ast
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

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
#: The same with a prefetch (engine/prefetch.py), which a kernel suspended by an older version, whose
#: take_back has no ``gpu`` yet, is not given.
#: A resume with a prefetch: the kernel begins mapping the helper's memory while the helper reads the files
#: (kernel/hoststash.py's open_prefetch; returns at once). A kernel suspended by an older version has none.
HOST_OPEN_PREFETCH_CALL = (
    "(lambda m: m.open_prefetch({handle!r}, {session!r}) if hasattr(m, 'open_prefetch') else "
    "'{{\"opening\": false, \"reason\": \"its jupyter-gpumigrate is older\"}}')"
    "(__import__('jupyter_gpumigrate.kernel.hoststash', fromlist=['take_back']))"
)
HOST_TAKE_BACK_GPU_CALL = (
    "(lambda m, c: m.take_back({folder!r}, gpu={gpu!r}) if 'gpu' in c.co_varnames[:c.co_argcount] "
    "else m.take_back({folder!r}))(*(lambda m: (m, m.take_back.__code__))"
    "(__import__('jupyter_gpumigrate.kernel.hoststash', fromlist=['take_back'])))"
)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _session(info: dict) -> Session:
    return Session(key=_bytes(info.get("key", b"")), signature_scheme=info.get("signature_scheme", "hmac-sha256"))


@contextmanager
def _sockets(info: dict, *wanted: tuple[int, str], linger: float = 0.0) -> Iterator[list[zmq.Socket]]:
    """Sockets of a ZMQ context of their own on the kernel's channels (``(kind, channel)`` each), closed with
    that context on the way out, which returns once their messages are delivered (up to ``linger``
    seconds) and their connections closed.

    Why not the shared context: a socket closed there lets go of its connection a moment later, in ZMQ's
    I/O thread, and a dump that counts the kernel's clients in that moment (netstate.py) counts it too;
    the kernel's resume would then wait for a client that never comes back.
    """
    context = zmq.Context()
    sockets: list[zmq.Socket] = []
    try:
        for kind, channel in wanted:
            sock = context.socket(kind)
            sockets.append(sock)  # closed below even if connecting fails: term() waits for every socket
            sock.linger = int(linger * 1000)
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(f"{info.get('transport', 'tcp')}://{info['ip']}:{info[channel + '_port']}")
    except BaseException:
        context.destroy(linger=0)  # a connection info without an address or a port: said, not waited on
        raise
    try:
        yield sockets
    finally:
        for sock in sockets:
            sock.close()
        context.term()


def _send(session: Session, sock: zmq.Socket, msg_type: str, content: dict, timeout: float) -> str:
    """Send a request; its id. A DEALER whose peer refused it (a port taken by a socket of another kind) blocks a
    send for ever: after ``timeout`` seconds, TimeoutError."""
    sock.sndtimeo = min(max(int(timeout * 1000), 1), 2**31 - 1)
    try:
        return session.send(sock, msg_type, content)["header"]["msg_id"]
    except zmq.Again:
        raise TimeoutError(f"the kernel's port took no request within {timeout:.1f} s") from None


#: The first wait for a kernel's answer before :func:`kernel_answers` asks again.
ANSWER_RESEND = 0.05


def kernel_answers(connection_info: dict, timeout: float, said: dict | None = None) -> bool:
    """True once the kernel answers kernel_info and its IOPub status reaches a new subscriber.

    The request goes on the control channel, which a kernel busy with a cell still serves. It is sent
    again, soon at first (every :data:`ANSWER_RESEND` seconds, doubling up to half a second): the status
    that answers one goes to the subscribers the kernel has at that moment, and a new subscription takes a
    moment to reach it (longer through a relay to another host). ``said``, if given, gets where the wait went:
    ``reply`` (seconds until the first reply on control; absent if none came), ``status`` (until the status
    on IOPub) and ``asked`` (requests sent): a late reply is a kernel slow to serve, a late status after an
    early reply a subscription slow to reach it.
    """
    session = _session(connection_info)
    with _sockets(connection_info, (zmq.DEALER, "control"), (zmq.SUB, "iopub")) as (control, iopub):
        return _answers(session, control, iopub, timeout, said if said is not None else {})


def _answers(session: Session, control: zmq.Socket, iopub: zmq.Socket, timeout: float, said: dict) -> bool:
    poller = zmq.Poller()
    poller.register(iopub, zmq.POLLIN)
    poller.register(control, zmq.POLLIN)
    began = time.monotonic()
    deadline = began + timeout
    wait, asked = ANSWER_RESEND, set()
    while time.monotonic() < deadline:
        try:
            asked.add(_send(session, control, "kernel_info_request", {}, deadline - time.monotonic()))
        except TimeoutError:
            return False
        said["asked"] = len(asked)
        resend = min(deadline, time.monotonic() + wait)
        wait = min(2 * wait, 0.5)
        while (left := resend - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            if not ready:
                break
            if control in ready:
                control.recv_multipart()  # a reply: the kernel serves; only its status on IOPub ends the wait
                said.setdefault("reply", round(time.monotonic() - began, 4))
            if iopub not in ready:
                continue
            _, frames = session.feed_identities(iopub.recv_multipart())
            msg = session.deserialize(frames, content=False)
            if msg["parent_header"].get("msg_id") in asked and msg["msg_type"] == "status":
                said["status"] = round(time.monotonic() - began, 4)
                return True
    return False


def _silent(code: str, expressions: dict | None = None) -> dict:
    """An execute request's content that leaves no trace: no output, no history, no execution count."""
    return {"code": code, "silent": True, "store_history": False, "user_expressions": expressions or {},
            "allow_stdin": False, "stop_on_error": False}


def run_silently(connection_info: dict, code: str, timeout: float) -> bool:
    """Execute ``code`` silently (no output, no history, no execution count) on the shell channel;
    True if the kernel replied ``ok`` within ``timeout`` seconds."""
    session = _session(connection_info)
    with _sockets(connection_info, (zmq.DEALER, "shell")) as (shell,):
        deadline = time.monotonic() + timeout
        try:
            msg_id = _send(session, shell, "execute_request", _silent(code), timeout)
        except TimeoutError:
            return False
        while (left := deadline - time.monotonic()) > 0:
            if not shell.poll(int(left * 1000) + 1):
                break
            _, frames = session.feed_identities(shell.recv_multipart())
            reply = session.deserialize(frames)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"].get("status") == "ok"
        return False


def send_silently(connection_info: dict, code: str, linger: float = 2.0) -> None:
    """Send ``code`` to run silently on the shell channel and do not wait for its reply (returns once the
    request is delivered, or after ``linger`` seconds)."""
    session = _session(connection_info)
    with _sockets(connection_info, (zmq.DEALER, "shell"), linger=linger) as (shell,), \
            suppress(TimeoutError):
        _send(session, shell, "execute_request", _silent(code), linger)


class KernelGone(ConnectionError):
    """The kernel's process ended while the server waited for its answer."""


def evaluate_silently(connection_info: dict, expression: str, timeout: float,
                      alive: Callable[[], bool] | None = None) -> str:
    """Evaluate ``expression`` in the kernel's main thread, between cells, as a silent request's user
    expression (no output, no history, no execution count); its ``str`` value.

    Raises TimeoutError if no answer comes within ``timeout`` seconds, :class:`KernelGone` as soon as
    ``alive()`` says the kernel ended, and RuntimeError with the kernel's ``ename: evalue`` if it raised."""
    session = _session(connection_info)
    with _sockets(connection_info, (zmq.DEALER, "shell")) as (shell,):
        deadline = time.monotonic() + timeout
        try:
            msg_id = _send(session, shell, "execute_request", _silent("", {"r": expression}), timeout)
        except TimeoutError:
            raise TimeoutError(f"the kernel did not answer within {timeout:.0f} s (its shell port took no "
                               "request)") from None
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
