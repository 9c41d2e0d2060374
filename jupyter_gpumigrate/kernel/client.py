"""The kernel's client of its server's /api/gpumigrate, with the credential the provisioner gave it, and
what ``%migrate`` and its widget both need before they ask for a move.

HTTP goes through :mod:`jupyter_gpumigrate_client.apiclient` (the standard library's urllib): a handful of JSON
calls from inside a user's kernel should add no dependency to the user's environment.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from jupyter_gpumigrate_client.apiclient import ApiError, Client, Unreachable
from ..credentials import ENV_KERNEL_ID, ENV_TOKEN, ENV_URL

__all__ = ["ApiError", "MigrateFailed", "NotManaged", "ServerClient", "Unreachable", "release_torch_cache"]


class NotManaged(Exception):
    """This kernel was not started by a server with jupyter-gpumigrate, so it cannot be moved."""


class MigrateFailed(Exception):
    """Shown as its one sentence, never as a traceback (IPython calls ``_render_traceback_``)."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31mmigrate: {self}\x1b[0m"]


def release_torch_cache() -> None:
    """Drop the GPU blocks PyTorch caches but does not use: they would be moved too. Only if this kernel
    already uses CUDA through torch (never initialise CUDA here).

    Raises :class:`MigrateFailed` when torch's CUDA context is broken (a device-side assert, an
    illegal access: CUDA errors stick to the context), before anything is asked of the server."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise MigrateFailed(
            f"PyTorch's CUDA context reports an error ({first}), so this kernel was not moved: such errors "
            "stick to the process; save what you need and restart the kernel."
        ) from None


class ServerClient:
    """This kernel's server, called about this kernel with this kernel's credential.

    Errors are :class:`ApiError` (the server's sentence), :class:`Unreachable` when it does not answer.
    """

    def __init__(self, url: str, kernel_id: str, token: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.kernel_id = kernel_id
        self.api = Client.for_kernel(self.url, token)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ServerClient:
        env = os.environ if environ is None else environ
        missing = [name for name in (ENV_URL, ENV_KERNEL_ID, ENV_TOKEN) if not env.get(name)]
        if missing:
            raise NotManaged(
                "This kernel was not started by a Jupyter server with jupyter-gpumigrate, so it cannot be "
                "moved: start it from JupyterLab with the extension enabled (see jupyter gpumigrate doctor)."
            )
        return cls(env[ENV_URL], env[ENV_KERNEL_ID], env[ENV_TOKEN])

    def gpus(self) -> dict:
        return self.api.gpus()

    def kernels(self) -> list[dict]:
        return self.api.kernels()

    def me(self) -> dict:
        return self.api.kernel(self.kernel_id)

    def migrate(self, to_gpu: int | list[int] | None, to_host: str | None = None, fast_path: str | None = None) -> dict:
        """Start a move of this kernel: to GPU ``to_gpu`` (a list: one per GPU it holds), to ``to_host``."""
        body: dict = {"to_gpus": to_gpu} if isinstance(to_gpu, list) else {"to_gpu": to_gpu}
        if to_host:
            body["to_host"] = to_host
        if fast_path:
            body["fast_path"] = fast_path
        return self.api.act(self.kernel_id, "migrate", body)

    def transplant(self, to_gpu: int | None, accept_left: list[str], to_host: str | None = None) -> dict:
        """Start a transplant of this kernel to GPU ``to_gpu`` (any model) or the CPU (None), of this host or of
        the peer ``to_host``, leaving behind no more than ``accept_left``."""
        body: dict = {"to_gpu": to_gpu} if to_gpu is not None else {"to_cpu": True}
        if to_host is not None:
            body["to_host"] = to_host
        return self.api.act(self.kernel_id, "transplant", {**body, "accept_left": accept_left})

    def back(self) -> dict:
        """Start going back to the process this kernel's last transplant replaced."""
        return self.api.act(self.kernel_id, "back", {})

    def suspend(self, images: str | None = None) -> dict:
        return self.api.act(self.kernel_id, "suspend", {"images": images} if images else None)

    def operation(self, op_id: str) -> dict:
        return self.api.operation(op_id)

    def follow(self, op: dict, on_change: Callable[[dict], None] | None = None, patience: float = 120.0) -> dict:
        """Wait for the operation to end, calling ``on_change`` with each version seen (the server holds
        each request until something changes, so this does not poll).

        While this kernel itself is being moved, its connection to the server breaks, and until the
        relay is up it has none: it keeps asking for up to ``patience`` seconds.
        """
        return self.api.follow(op, on_change, patience=patience)
