"""Fixtures: a real jupyter_server with the extension, real kernels, real CRIU.

Nothing here stands in for CRIU, the kernel or the server. Tests that need CRIU fail (not skip) when
it is missing: `make test` installs it first, and CI must prove suspend and resume for real.
"""

from __future__ import annotations

import signal

from pathlib import Path
from typing import Any

import pytest
from helpers import ready_kernel

from jupyter_gpumigrate.engine import criu as criu_mod

pytest_plugins = ["pytest_jupyter.jupyter_server"]

CRIU_READY: str | None = None
try:
    criu_mod.find()
except Exception as exc:  # noqa: BLE001
    CRIU_READY = str(exc)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from jupyter_gpumigrate.engine import gpus

    reason = None
    major = gpus.driver_major()
    if not gpus.snapshot():
        reason = "no NVIDIA GPU is visible to NVML on this machine (the gpu suite runs on the GPU machine)"
    elif major is None or major < 580:
        reason = f"the NVIDIA driver is {gpus.driver_version()}: the gpu suite needs 580 or newer (GPU remap)"
    for item in items:
        if reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    """On a failure, show the errors of every CRIU log the test left: CI keeps no files."""
    outcome = yield
    report = outcome.get_result()
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not report.failed or not isinstance(tmp, Path):
        return
    for log in sorted(tmp.rglob("*.log")):
        if log.name in (criu_mod.DUMP_LOG, criu_mod.RESTORE_LOG) or log.parent.name == ".logs":
            lines = log.read_text(errors="replace").splitlines()
            wanted = [ln for ln in lines if "Error" in ln or "Warn" in ln] or lines[-40:]
            report.sections.append((f"CRIU log {log}", "\n".join(wanted[-60:])))


@pytest.fixture
def criu_binary() -> str:
    if CRIU_READY is not None:
        pytest.fail(f"CRIU is required for this test: {CRIU_READY}")
    return criu_mod.find().path


@pytest.fixture
def jp_server_config(tmp_path: Any) -> dict:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        # Images on disk, in the state folder, where these tests look; images in memory (the default's
        # choice where there is room) have tests of their own (test_image_places.py, test_hoststash.py).
        "MigratableProvisioner": {"state_dir": str(tmp_path / "gpumigrate"), "suspend_to": "disk"},
    }


@pytest.fixture
def kernel(jp_fetch: Any, jp_serverapp: Any, jp_asyncio_loop: Any):
    """A running IPython kernel started through the server's REST API, with a client connected."""

    session = jp_asyncio_loop.run_until_complete(ready_kernel(jp_fetch, jp_serverapp))
    yield session
    session.close()


@pytest.fixture
def process_server(tmp_path: Any):
    """A server run as a process of its own (it is killed), its host stash used from 100 MB, images on disk."""
    from servers import LocalServer

    srv = LocalServer(tmp_path / "server", {"MigratableProvisioner": {"host_stash_min": 10**8}})
    yield srv
    srv.stop(signal.SIGKILL)
    srv.kill_kernels()
