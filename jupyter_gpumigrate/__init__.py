"""jupyter-gpumigrate: suspend, resume and move live Jupyter kernels, GPU state included."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """The prebuilt JupyterLab extension (for `jupyter labextension develop` in a checkout)."""
    return [{"src": "labextension", "dest": "jupyter-gpumigrate"}]


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .app import GPUMigrateApp

    return [{"module": "jupyter_gpumigrate", "app": GPUMigrateApp}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext jupyter_gpumigrate``: the ``%migrate`` magic (loaded by itself in kernels that a server
    with the extension starts)."""
    from .kernel.magics import MigrateMagics

    ipython.register_magics(MigrateMagics)
