"""jupyter-gpumigrate: suspend, resume and move live Jupyter kernels, GPU state included."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    from .app import GPUMigrateApp

    return [{"module": "jupyter_gpumigrate", "app": GPUMigrateApp}]
