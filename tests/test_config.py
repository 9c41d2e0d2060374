"""With c.GPUMigrateApp.default_provisioner = False the server keeps jupyter_client's own provisioner."""

from __future__ import annotations

import pytest
from helpers import api, start_kernel


@pytest.fixture
def jp_server_config(tmp_path):
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "GPUMigrateApp": {"default_provisioner": False},
        "MigratableProvisioner": {"state_dir": str(tmp_path / "gpumigrate")},
    }


async def test_the_switch_keeps_the_default_provisioner_and_says_so(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    view = await api(jp_fetch, "kernels", kernel_id)
    assert view["migratable"] is False and view["state"] == "running"
    error = await api(jp_fetch, "kernels", kernel_id, "suspend", method="POST", expect=409)
    assert "LocalProvisioner" in error["message"] and "gpumigrate-provisioner" in error["message"]
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")
