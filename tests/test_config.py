"""Which provisioner a server's kernels get: the extension jupyter-config/ enables makes it ours; the switch
c.GPUMigrateApp.default_provisioner = False, or a server's own choice of default provisioner, keeps
jupyter_client's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import api, start_kernel

SHIPPED = Path(__file__).parent.parent / "jupyter-config" / "jupyter_server_config.d" / "jupyter_gpumigrate.json"


@pytest.fixture
def jp_server_config(tmp_path, request):
    config = {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(tmp_path / "gpumigrate"), "suspend_to": "disk"},
    }
    config.update(request.param)
    return config


@pytest.mark.parametrize(
    "jp_server_config",
    [{"GPUMigrateApp": {"default_provisioner": False}},
     {"KernelProvisionerFactory": {"default_provisioner_name": "local-provisioner"}}],
    indirect=True, ids=["the switch", "the server's own default"],
)
async def test_the_default_provisioner_is_kept_when_asked_and_says_so(jp_fetch, jp_serverapp):
    kernel_id = await start_kernel(jp_fetch)
    view = await api(jp_fetch, "kernels", kernel_id)
    assert view["migratable"] is False and view["state"] == "running"
    error = await api(jp_fetch, "kernels", kernel_id, "suspend", method="POST", expect=409)
    assert "LocalProvisioner" in error["message"] and "gpumigrate-provisioner" in error["message"]
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("jp_server_config", [json.loads(SHIPPED.read_text())], indirect=True, ids=["shipped"])
async def test_the_shipped_configuration_makes_every_kernel_migratable(jp_fetch, jp_serverapp):
    # What the package installs enables the extension, which makes its provisioner the default.
    assert jp_serverapp.jpserver_extensions.get("jupyter_gpumigrate") is True
    kernel_id = await start_kernel(jp_fetch)
    assert (await api(jp_fetch, "kernels", kernel_id))["migratable"] is True
    await jp_fetch("api", "kernels", kernel_id, method="DELETE")


@pytest.mark.parametrize("setting, value, words", [
    ("memory_low", 2.0, "is a share of the host's memory, from 0 (never) to 1 (got 2.0)"),
    ("memory_check_interval", 0.0, "memory_check_interval must be a number of seconds above 0"),
    ("shared_heartbeat", -1.0, "shared_heartbeat must be a number of seconds above 0"),
    ("stop_timeout", -1.0, "The value of the 'stop_timeout' trait of a GPUMigrateApp instance should not be less "
     "than 0.0, but a value of -1.0 was specified"),
    ("guest_images_expire", -5.0, "'guest_images_expire' trait of a GPUMigrateApp instance should not be less"),
    ("transfer_streams", -2, "'transfer_streams' trait of a GPUMigrateApp instance should not be less than 0"),
    ("bulk_port", 70000, "'bulk_port' trait of a GPUMigrateApp instance should not be greater than 65535"),
    ("transfer_nice", 20, "'transfer_nice' trait of a GPUMigrateApp instance should not be greater than 19"),
    ("migration_wait", -1.0, "'migration_wait' trait of a MigratableProvisioner instance should not be less"),
    ("gpu_lock_timeout", -1.0, "'gpu_lock_timeout' trait of a MigratableProvisioner instance should not be less"),
    ("host_stash_min", -1, "'host_stash_min' trait of a MigratableProvisioner instance should not be less"),
])
def test_settings_out_of_range_are_refused_saying_what_they_may_be(setting, value, words):
    from traitlets import TraitError

    from jupyter_gpumigrate.app import GPUMigrateApp
    from jupyter_gpumigrate.provisioner import MigratableProvisioner

    settings = MigratableProvisioner if setting in MigratableProvisioner.class_trait_names() else GPUMigrateApp
    with pytest.raises(TraitError, match=re.escape(words)):
        settings(**{setting: value})


@pytest.mark.parametrize("setting", ["--MigratableProvisioner.suspend_to=tape", "--GPUMigrateApp.stop_timeout=-3"])
def test_a_server_with_a_refused_setting_does_not_start_and_says_which(tmp_path, setting):
    # jupyter_server ran on without the extension: suspended kernels unlisted, every kernel refused at its start
    # ("Unhandled error"), and a stop that died in the extension's own, so that one SIGTERM did not end it.
    env = {**os.environ, **{f"JUPYTER_{name}_DIR": str(tmp_path / name.lower()) for name in ("CONFIG", "DATA",
                                                                                            "RUNTIME")}}
    server = subprocess.run([sys.executable, "-m", "jupyter_server", "--allow-root", "--no-browser", "--port=0",
                             f"--ServerApp.root_dir={tmp_path}", setting], env=env, capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert server.returncode == 1, server.stderr[-3000:]
    name = setting.split("=")[0].split(".")[-1]
    said = [line for line in server.stderr.splitlines() if "jupyter-gpumigrate: a setting is refused:" in line]
    assert len(said) == 1 and f"'{name}' trait" in said[0] and "Correct it" in said[0], server.stderr[-3000:]
    assert "is running at" not in server.stderr
