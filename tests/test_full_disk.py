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


class TestADiskFilledWhileSuspended:
    """The kernel's images are whole; then another process fills their disk. CRIU's restore writes there (its
    log, the PID file of what it restored)."""

    @pytest.fixture
    def small_disk(self, tmp_path: Path):
        with small_tmpfs(tmp_path / "small", "200m") as folder:
            yield folder

    async def test_the_resume_says_the_disk_is_full_keeps_the_images_and_resumes_once_there_is_room(
            self, jp_fetch, kernel, small_disk):
        assert (await kernel.run("x = 41\nprint('set')")).strip() == "set"
        assert (await operate(jp_fetch, kernel.id, "suspend"))["status"] == "succeeded"
        filler = small_disk / "filler"
        with open(filler, "wb") as out, pytest.raises(OSError, match="No space left"):
            while True:
                out.write(bytes(1 << 20))
        op = await operate(jp_fetch, kernel.id, "resume")
        assert op["status"] == "failed" and op["failed_phase"] == "restore", op
        images = small_disk / "gpumigrate" / "images"
        assert f"The disk of {images} is full" in op["error"], op["error"]
        assert "the images are kept" in op["error"].lower(), op["error"]
        assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
        filler.unlink()
        assert (await operate(jp_fetch, kernel.id, "resume"))["status"] == "succeeded"
        assert (await kernel.run("print(x + 1)")).strip() == "42"
