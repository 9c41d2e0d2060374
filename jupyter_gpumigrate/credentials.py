"""Per-kernel credentials: each kernel may call the API about itself, and nothing else.

The provisioner gives every kernel it starts a random secret in its environment
(``JUPYTER_GPUMIGRATE_TOKEN``, with ``JUPYTER_GPUMIGRATE_URL`` and ``JUPYTER_GPUMIGRATE_KERNEL_ID``);
``%migrate`` sends it as ``Authorization: gpumigrate-kernel <secret>``. The server keeps only a hash of
each secret, maps it to its kernel, and revokes it when the kernel is shut down. A request with it is
allowed to read the GPU and kernel lists and to operate on that kernel alone: code in one notebook cannot
move, suspend or shut down another user's or another notebook's kernel with it, and it is no server
token (no files, no terminals, no other API). It stays in the kernel's memory across suspend and resume.
"""

from __future__ import annotations

import hashlib
import secrets

SCHEME = "gpumigrate-kernel"
ENV_URL, ENV_KERNEL_ID, ENV_TOKEN = "JUPYTER_GPUMIGRATE_URL", "JUPYTER_GPUMIGRATE_KERNEL_ID", "JUPYTER_GPUMIGRATE_TOKEN"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KernelCredentials:
    """The secrets of one server's kernels, and the URL at which kernels reach that server."""

    def __init__(self, server_url: str) -> None:
        self.server_url = server_url
        self._kernel_of: dict[str, str] = {}  # sha256(secret) -> kernel id
        self._secret_of: dict[str, str] = {}  # kernel id -> secret (to give the same one on restart)

    def issue(self, kernel_id: str) -> str:
        """The kernel's secret, made on first use."""
        if kernel_id not in self._secret_of:
            secret = secrets.token_urlsafe(32)
            self._secret_of[kernel_id] = secret
            self._kernel_of[_digest(secret)] = kernel_id
        return self._secret_of[kernel_id]

    def env(self, kernel_id: str) -> dict[str, str]:
        return {ENV_URL: self.server_url, ENV_KERNEL_ID: kernel_id, ENV_TOKEN: self.issue(kernel_id)}

    def revoke(self, kernel_id: str) -> None:
        secret = self._secret_of.pop(kernel_id, None)
        if secret is not None:
            self._kernel_of.pop(_digest(secret), None)

    def resolve(self, authorization: str) -> str | None:
        """The kernel id an ``Authorization`` header speaks for, or None if it is no kernel credential."""
        scheme, _, secret = authorization.strip().partition(" ")
        if scheme != SCHEME or not secret:
            return None
        return self._kernel_of.get(_digest(secret.strip()))

    def is_kernel_credential(self, authorization: str) -> bool:
        return authorization.strip().startswith(SCHEME + " ")
