"""The node helper: a root service that runs CRIU for the ordinary users of a shared machine, each on
their own kernels only (docs/users.md).

- protocol.py: the requests and answers on its Unix socket, and their limits;
- daemon.py: the service itself, run as root (``jupyter-gpumigrate-helper``);
- client.py: the user's server's side, :class:`HelperCriu`.

This package's names are what the rest of the code imports.
"""

from .client import HelperClient, HelperCriu
from .daemon import main
from .protocol import DEFAULT_SOCKET

__all__ = ["DEFAULT_SOCKET", "HelperClient", "HelperCriu", "main"]
