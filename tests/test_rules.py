"""DEVELOPERS.md's rules that a machine can check: the engine imports nothing from Jupyter, and the code has
no error that pyflakes' rules (ruff's F) find."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the engine must not import, directly or through anything it imports (DEVELOPERS.md, "Layout").
JUPYTER = ("jupyter_client", "jupyter_server", "jupyter_core", "jupyter_events", "ipykernel", "IPython",
           "tornado", "traitlets", "zmq", "jupyterhub")

IMPORT_EVERY_ENGINE_MODULE = r"""
import importlib, json, pkgutil, sys
import jupyter_gpumigrate.engine as engine
names = [m.name for m in pkgutil.walk_packages(engine.__path__, "jupyter_gpumigrate.engine.")]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": sorted(sys.modules)}))
"""


def test_the_engine_imports_nothing_from_jupyter() -> None:
    """Every module of jupyter_gpumigrate.engine imported in a fresh interpreter loads none of Jupyter's
    packages (nor tornado, traitlets or zmq): the engine runs under the node helper and in tools without them."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_EVERY_ENGINE_MODULE], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert "jupyter_gpumigrate.engine.plans.suspend" in found["modules"], found["modules"]
    jupyter = sorted({name.split(".")[0] for name in found["loaded"]} & set(JUPYTER))
    assert jupyter == [], f"the engine loads {jupyter}: import them in the adapters, not in engine/"
    adapters = sorted(name for name in found["loaded"]
                      if name.startswith("jupyter_gpumigrate.") and not name.startswith("jupyter_gpumigrate.engine")
                      and name != "jupyter_gpumigrate._version")
    assert adapters == [], f"the engine loads the adapters {adapters}: the engine is the layer below them"


def test_the_code_has_no_pyflakes_errors() -> None:
    """`ruff check --select F` (undefined names, unused imports and variables...) on every Python folder, as
    DEVELOPERS.md asks before a commit."""
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "F", "--no-cache",
                           "jupyter_gpumigrate", "client", "tests", "bench", "examples"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, f"ruff found errors (run the same command to see them):\n{proc.stdout[-6000:]}"
