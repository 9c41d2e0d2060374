"""A state folder on a full disk: the suspend fails saying so, and the kernel runs on with its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import api, operate, small_tmpfs

pytestmark = pytest.mark.usefixtures("criu_binary")


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 24 MB tmpfs: too small for any kernel's images (an idle one needs some 75 MB)."""
    with small_tmpfs(tmp_path / "small", "24m") as folder:
        yield folder


@pytest.fixture
def jp_server_config(small_disk: Path) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"jupyter_gpumigrate": True}},
        "MigratableProvisioner": {"state_dir": str(small_disk / "gpumigrate"), "suspend_to": "disk"},
    }


async def test_a_full_disk_says_so_names_the_folder_and_the_kernel_runs_on(jp_fetch, kernel, small_disk):
    assert (await kernel.run("x = 41\nprint('set')")).strip() == "set"
    op = await operate(jp_fetch, kernel.id, "suspend")
    assert op["status"] == "failed" and op["failed_phase"] == "dump", op
    assert "full" in op["error"] and str(small_disk / "gpumigrate") in op["error"], op["error"]
    assert "runs on, unchanged" in op["error"] and "close it in the notebook" not in op["error"]
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"
    assert (await kernel.run("print(x + 1)")).strip() == "42"
    # The half-written images were removed: the disk has its room back.
    images = small_disk / "gpumigrate" / "images"
    assert not (images / kernel.id).exists()
    logs = images / ".logs"
    assert [p.name for p in logs.iterdir()] == [f"{kernel.id}-dump.log"], "the failed dump's log is kept"
    await jp_fetch("api", "kernels", kernel.id, method="DELETE")
    assert list(logs.iterdir()) == [], "and removed with its kernel"
