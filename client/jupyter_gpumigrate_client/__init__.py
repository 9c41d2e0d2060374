"""jupyter-gpumigrate-client: the client and the contract of the REST API under ``/api/gpumigrate``, and the
JupyterHub service built on them (``jupyter_gpumigrate_client.hub``).

Its own distribution so that a Hub, or a script, can drive jupyter-gpumigrate's servers without
installing their server stack (jupyter_server, ipykernel...). The servers' package depends on it at the
same version: both sides read one contract.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version as _dist_version

try:
    __version__ = _dist_version("jupyter-gpumigrate-client")
except PackageNotFoundError:  # a checkout on the path, not installed
    __version__ = "0+unknown"
