"""jupyter-gpumigrate: suspend, resume and move live Jupyter kernels, GPU state included."""

from __future__ import annotations

from typing import Any



def _version() -> str:
    """The version, whose one source is labextension/package.json: a build writes it to _version.py; a
    checkout never built takes the installed distribution's."""
    try:
        from ._version import __version__ as version

        return version
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version as dist_version

        try:
            return dist_version("jupyter-gpumigrate")
        except PackageNotFoundError:
            return "0+unknown"


__version__ = _version()


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
    from .kernel.safepoint import install

    ipython.register_magics(MigrateMagics)
    install()  # where the server gave the kernel a safe-point folder
