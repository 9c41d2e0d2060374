"""GET /refused: the kernels' records this server did not take back as it started (revive.py)."""

from __future__ import annotations

from pathlib import Path

from jupyter_server.auth.decorator import authorized
from tornado import web

from .base import BaseHandler


class RefusedListHandler(BaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        # Those still on disk: one removed by hand since the start is no longer a matter.
        found = self.settings.get("gpumigrate_refused", [])
        self.send_json([r.to_dict() for r in found if Path(r.path).exists() or Path(r.path).is_symlink()])
