"""examples/: the README walkthrough's commands, run as written against a real server and kernel; the
notebook, executed with nbclient in a kernel of a real server on the GPU machine."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import nbformat
import pytest
from helpers import KernelSession, api, cli, remote, start_kernel, two_gpus

from jupyter_gpumigrate.engine import gpus as gpus_mod

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.usefixtures("criu_binary")


def blocks(kind: str) -> list[str]:
    text = (EXAMPLES / "README.md").read_text()
    return re.findall(rf"```{kind}\n(.*?)```", text, flags=re.S)


async def test_the_walkthrough_runs_as_written(jp_fetch, jp_serverapp, kernel):
    python = blocks("python")
    assert len(python) == 1
    await kernel.run(python[0])
    commands = [line[2:] for block in blocks("console") for line in block.splitlines() if line.startswith("$ ")]
    assert [c.split()[2] for c in commands] == ["list", "suspend", "list", "resume", "drain"]
    has_gpu = bool(gpus_mod.snapshot())
    for command in commands:
        argv = shlex.split(command.replace("KERNEL_ID", kernel.id[:8]))
        assert argv[:2] == ["jupyter", "gpumigrate"]
        code, out, err = await cli(*argv[2:], *remote(jp_serverapp))
        if argv[2] == "drain" and not has_gpu:
            assert code == 1 and "no NVIDIA GPU" in err, (command, out, err)  # as the README says
            continue
        assert code == 0, (command, out, err)
        if argv[2] == "suspend":
            assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "suspended"
    assert (await kernel.run("print(next(counter))")).strip() == "3"


def test_the_notebook_is_valid_and_uses_the_magic():
    nb = nbformat.read(EXAMPLES / "train-and-migrate.ipynb", as_version=4)
    nbformat.validate(nb)
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "%migrate --to-gpu 1" in sources and "%migrate --list" in sources
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "shipped without outputs"


@pytest.mark.gpu
async def test_the_notebook_runs_and_moves_its_kernel(jp_fetch, jp_serverapp, tmp_path):
    from nbclient import NotebookClient

    two_gpus()
    kernel_id = await start_kernel(jp_fetch)
    session = KernelSession(jp_serverapp, kernel_id)
    await session.ready()
    session.close()
    nb = nbformat.read(EXAMPLES / "train-and-migrate.ipynb", as_version=4)
    # The server's own kernel, so that %migrate has its credential: nbclient drives it, the server owns it.
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    await NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).async_execute()
    outputs = ["".join(o.get("text", "") for o in c.outputs) for c in nb.cells if c.cell_type == "code"]
    assert "Moved from GPU 0 to GPU 1" in outputs[2], outputs[2]
    assert "600 steps; torch still says cuda:0" in outputs[3], outputs[3]
    assert any("image/png" in o.get("data", {}) for o in nb.cells[-1].outputs), "the loss curve is drawn"
    pid = km.provisioner.pid
    assert {g.index for g in gpus_mod.snapshot() if pid in g.processes} == {1}
    os.makedirs(tmp_path, exist_ok=True)
    nbformat.write(nb, tmp_path / "executed.ipynb")
