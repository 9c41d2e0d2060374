"""Per-kernel credentials: each kernel may call the API about itself, and nothing else.

The provisioner gives every kernel it starts a random secret in its environment
(``JUPYTER_GPUMIGRATE_TOKEN``, with ``JUPYTER_GPUMIGRATE_URL`` and ``JUPYTER_GPUMIGRATE_KERNEL_ID``);
``%migrate`` sends it as ``Authorization: gpumigrate-kernel <secret>``. The server keeps only a hash of
each secret, maps it to its kernel, and revokes it when the kernel is shut down. A request with it is
allowed to read the GPU and kernel lists and to operate on that kernel alone: code in one notebook cannot
move, suspend or shut down another user's or another notebook's kernel with it, and it is no server
token (no files, no terminals, no other API). It stays in the kernel's memory across suspend and resume.

What it does not do: code in a kernel runs as the server's user, so it can read whatever that user
can, the server's own runtime files (and token) included. The credential limits what *it* grants; on a
multi-user system, isolation between users comes from running each user's server as that user
(JupyterHub's spawners do).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from jupyter_gpumigrate_client.apiclient import SCHEME

ENV_URL, ENV_KERNEL_ID, ENV_TOKEN = "JUPYTER_GPUMIGRATE_URL", "JUPYTER_GPUMIGRATE_KERNEL_ID", "JUPYTER_GPUMIGRATE_TOKEN"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KernelCredentials:
    """The secrets of one server's kernels (their hashes only), and how kernels reach that server.

    ``server_url`` is asked at each kernel launch: the server's port is settled only once it listens.
    """

    def __init__(self, server_url: Callable[[], str]) -> None:
        self.server_url = server_url
        self._kernel_of: dict[str, str] = {}  # sha256(secret) -> kernel id
        self._digest_of: dict[str, str] = {}  # kernel id -> sha256 of its current secret

    def issue(self, kernel_id: str) -> str:
        """A new secret for the kernel (each launch or restart gets one; the last one replaces the others)."""
        self.revoke(kernel_id)
        secret = secrets.token_urlsafe(32)
        self._digest_of[kernel_id] = _digest(secret)
        self._kernel_of[self._digest_of[kernel_id]] = kernel_id
        return secret

    def env(self, kernel_id: str) -> dict[str, str]:
        return {ENV_URL: self.server_url(), ENV_KERNEL_ID: kernel_id, ENV_TOKEN: self.issue(kernel_id)}

    def digest(self, kernel_id: str) -> str | None:
        """The hash of the kernel's current secret (kept with its images when it is suspended)."""
        return self._digest_of.get(kernel_id)

    def restore(self, kernel_id: str, digest: str) -> None:
        """Accept again the secret whose hash is ``digest`` for ``kernel_id`` (a kernel a previous server
        suspended keeps the secret it was given in its memory)."""
        self.revoke(kernel_id)
        self._digest_of[kernel_id] = digest
        self._kernel_of[digest] = kernel_id

    def revoke(self, kernel_id: str) -> None:
        digest = self._digest_of.pop(kernel_id, None)
        if digest is not None:
            self._kernel_of.pop(digest, None)

    def resolve(self, authorization: str) -> str | None:
        """The kernel id an ``Authorization`` header speaks for, or None if it is no kernel credential."""
        scheme, _, secret = authorization.strip().partition(" ")
        if scheme != SCHEME or not secret:
            return None
        return self._kernel_of.get(_digest(secret.strip()))

    def is_kernel_credential(self, authorization: str) -> bool:
        return authorization.strip().startswith(SCHEME + " ")
