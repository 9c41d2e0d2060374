"""Build hook: jupyter-gpumigrate depends on jupyter-gpumigrate-client at exactly its own version.

The two are built from one tree and read one API contract, so a server and its client must not drift
apart. The version has one source (labextension/package.json); ``project.dependencies`` cannot refer to
it, so the dependencies are listed under ``[tool.hatch.metadata.hooks.custom]`` and this hook adds the
pinned client to them. A build from the sdist takes all of it from PKG-INFO instead.
"""

from __future__ import annotations

from typing import Any

from hatchling.metadata.plugin.interface import MetadataHookInterface

CLIENT = "jupyter-gpumigrate-client"


class ClientPinHook(MetadataHookInterface):
    def update(self, metadata: dict[str, Any]) -> None:
        pinned = f"{CLIENT}=={metadata['version']}"
        metadata["dependencies"] = [*self.config.get("dependencies", []), pinned]
