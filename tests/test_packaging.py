"""The packages as pip users get them: the sdists and wheels that `python -m build` makes from this tree (each
wheel built from its sdist, as PyPI users' pip would), their metadata, and what they leave out. Two
distributions: jupyter-gpumigrate (the server's package, from the root) and jupyter-gpumigrate-client (the REST
client, the contract and the Hub service, from client/), which the first depends on at its own version."""

from __future__ import annotations

import email.parser
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Dist:
    sdist: Path
    wheel: Path
    #: jupyter-gpumigrate-client's
    client_sdist: Path
    client_wheel: Path

    def wheels(self) -> list[str]:
        """What pip installs: both wheels (the client is not in any package index this test may reach)."""
        return [str(self.wheel), str(self.client_wheel)]


def build(tmp_path_factory: pytest.TempPathFactory, source: Path) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"python -m build failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    sdists, wheels = list(out.glob("*.tar.gz")), list(out.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, f"build made {sorted(p.name for p in out.iterdir())}"
    return sdists[0], wheels[0]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Dist:
    """Each sdist and the wheel built from it, by `python -m build` (the test extra's `build`), as a release
    would build them (the labextension is the one `scripts/setup.sh` built)."""
    return Dist(*build(tmp_path_factory, ROOT), *build(tmp_path_factory, ROOT / "client"))


def wheel_metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_wheel_metadata_license_classifiers_and_one_version(dist: Dist) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    package_json = json.loads((ROOT / "labextension" / "package.json").read_text())
    meta = wheel_metadata(dist.wheel)

    classifiers = meta.get_all("Classifier")
    # JupyterLab's extension manager lists PyPI packages by this classifier.
    assert "Framework :: Jupyter :: JupyterLab :: Extensions :: Prebuilt" in classifiers
    assert "Framework :: Jupyter :: JupyterLab :: 4" in classifiers
    assert meta["License-Expression"] == pyproject["license"] == package_json["license"] == "BSD-3-Clause"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert {u.split(",")[0] for u in meta.get_all("Project-URL")} >= {"Homepage", "Source", "Issues"}

    with zipfile.ZipFile(dist.wheel) as zf:
        names = zf.namelist()
        license_text = zf.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode()
        shared = next(n for n in names if n.endswith("share/jupyter/labextensions/jupyter-gpumigrate/package.json"))
        built_json = json.loads(zf.read(shared))
        version_py = zf.read("jupyter_gpumigrate/_version.py").decode()
        ensure_criu = zf.read("jupyter_gpumigrate/ensure-criu.sh").decode()
    # JupyterLab's extension manager reads install.json: there, once.
    assert [n for n in names if n.endswith("labextensions/jupyter-gpumigrate/install.json")] != [] and \
        len([n for n in names if n.endswith("/install.json")]) == 1, [n for n in names if "install" in n]
    # `jupyter gpumigrate install-criu` runs the script that the checkout's set-up runs.
    assert ensure_criu == (ROOT / "scripts" / "ensure-criu.sh").read_text()
    assert license_text == (ROOT / "LICENSE").read_text()
    assert "BSD 3-Clause License" in license_text

    # One version source (labextension/package.json), the same everywhere.
    version = package_json["version"]
    assert meta["Version"] == version
    assert built_json["version"] == version, (
        "the built labextension is stale: run `npm run build:prod` in labextension/ (scripts/setup.sh does)")
    assert f"__version__ = VERSION = '{version}'" in version_py
    assert dist.wheel.name.startswith(f"jupyter_gpumigrate-{version}-")
    with tarfile.open(dist.sdist) as tf:
        pkg_info = tf.extractfile(f"jupyter_gpumigrate-{version}/PKG-INFO").read().decode()
    assert email.parser.Parser().parsestr(pkg_info)["Version"] == version
    # The client: the same version, the same licence, and the server's package pinned to it.
    client = wheel_metadata(dist.client_wheel)
    assert client["Version"] == version and dist.client_wheel.name.startswith(f"jupyter_gpumigrate_client-{version}-")
    assert f"jupyter-gpumigrate-client=={version}" in meta.get_all("Requires-Dist")
    assert client["License-Expression"] == "BSD-3-Clause" and client.get_all("License-File") == ["LICENSE"]
    with zipfile.ZipFile(dist.client_wheel) as zf:
        names = zf.namelist()
        assert zf.read(next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))).decode() == license_text
        assert "jupyter_gpumigrate_client/contract/api.schema.json" in names
        assert "jupyter-gpumigrate-hub = jupyter_gpumigrate_client.hub.service:main" in zf.read(
            next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    # Only what the Hub needs: the contract's validator, and JupyterHub with the `hub` extra.
    assert client.get_all("Requires-Dist") == ["jsonschema>=4.18", "jupyterhub<7,>=5; extra == 'hub'"]
    with tarfile.open(dist.client_sdist) as tf:
        client_info = tf.extractfile(f"jupyter_gpumigrate_client-{version}/PKG-INFO").read().decode()
    assert email.parser.Parser().parsestr(client_info)["Version"] == version
    # JupyterLab's extension manager finds the Python package to install from this.
    assert built_json["jupyterlab"]["discovery"]["server"]["base"]["name"] == pyproject["name"]


def test_sdist_has_no_build_leftovers(dist: Dist) -> None:
    with tarfile.open(dist.client_sdist) as tf:
        client_names = tf.getnames()
    with tarfile.open(dist.sdist) as tf:
        names = tf.getnames()
    for listing in (names, client_names):
        leftovers = [n for n in listing if n.endswith((".tsbuildinfo", ".png", ".pyc")) or "/test-results/" in n
                     or "/playwright-report/" in n or "/node_modules/" in n or "__pycache__" in n or "/.venv/" in n]
        assert not leftovers, f"the sdist carries build leftovers: {leftovers[:10]}"
    # The client's sources are its own sdist's, not the server's.
    assert not [n for n in names if "/client/" in n], [n for n in names if "/client/" in n][:5]
    # What a wheel built from it without Node.js needs: the built labextension, the LICENSE.
    top = names[0].split("/")[0]
    assert f"{top}/jupyter_gpumigrate/labextension/static/style.js" in names
    assert f"{top}/LICENSE" in names


def lab_bounds() -> list[str]:
    """The lowest and the highest JupyterLab that the package accepts, as pip requirements."""
    lab = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["lab"]
    spec = next(r for r in lab if r.startswith("jupyterlab"))
    low = re.search(r">=\s*([0-9.]+)", spec).group(1)
    return [f"jupyterlab=={low}.0" if low.count(".") == 1 else f"jupyterlab=={low}", spec]


def clean_env() -> dict[str, str]:
    """The environment of a process of a fresh venv: nothing of this checkout's on its Python path."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")} | {"NO_COLOR": "1"}


def fresh_venv(path: Path) -> Path:
    """A new virtual environment; its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin"


def pip_install(bin_dir: Path, *requirements: str) -> None:
    proc = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *requirements], capture_output=True, text=True, timeout=900, env=clean_env())
    assert proc.returncode == 0, f"pip install {' '.join(requirements)} failed:\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("jupyterlab", lab_bounds(), ids=["lowest", "highest"])
def test_the_prebuilt_extension_is_ok_with_the_lowest_and_highest_jupyterlab(
        dist: Dist, tmp_path: Path, jupyterlab: str) -> None:
    bin_dir = fresh_venv(tmp_path / "venv")
    pip_install(bin_dir, *dist.wheels(), jupyterlab)
    lab_version = subprocess.run([str(bin_dir / "jupyter"), "lab", "--version"], capture_output=True, text=True,
                                 timeout=60, env=clean_env()).stdout.strip()
    proc = subprocess.run([str(bin_dir / "jupyter"), "labextension", "list"], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    listing = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    version = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    assert re.search(rf"jupyter-gpumigrate v{re.escape(version)} enabled +OK", listing), (
        f"JupyterLab {lab_version} does not take the prebuilt extension:\n{listing}")
    assert "not compatible" not in listing, listing


def test_an_isolated_install_suspends_and_resumes_a_kernel_with_its_own_server_and_cli(
        dist: Dist, tmp_path: Path) -> None:
    """As the extension template's isolated test: the wheels alone in a fresh venv, run with no Node.js on the
    PATH and far from this source tree, enables its server extension and provisioner, and its own server and
    CLI suspend and resume a kernel."""
    bin_dir = fresh_venv(tmp_path / "venv")
    pip_install(bin_dir, *dist.wheels())
    home = tmp_path / "home"
    work = tmp_path / "work"
    for folder in (home, work):
        folder.mkdir()
    env = clean_env() | {"PATH": f"{bin_dir}:/usr/local/sbin:/usr/sbin:/sbin", "HOME": str(home),
                         "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
                         "JUPYTER_RUNTIME_DIR": str(home / "runtime")}

    def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, cwd=work,
                              env=env, timeout=timeout)

    listing = re.sub(r"\x1b\[[0-9;]*m", "", (lambda p: p.stdout + p.stderr)(run("jupyter", "server", "extension",
                                                                               "list")))
    assert re.search(r"jupyter_gpumigrate enabled", listing) and "jupyter_gpumigrate" in listing, listing
    providers = run("python", "-c", "from importlib.metadata import entry_points; "
                    "print(sorted(e.name for e in entry_points(group='jupyter_client.kernel_provisioners')))")
    assert "gpumigrate-provisioner" in providers.stdout, providers
    assert run("python", "-c", "import shutil; print(shutil.which('node'))").stdout.strip() == "None"

    sys.path.insert(0, str(ROOT / "tests"))
    from servers import free_port  # noqa: E402

    port, token = free_port(), "isolated-token"
    url = f"http://127.0.0.1:{port}/"
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [str(bin_dir / "jupyter"), "server", "--no-browser", "--allow-root", "--ip=127.0.0.1", f"--port={port}",
         f"--IdentityProvider.token={token}", f"--MigratableProvisioner.state_dir={home / 'state'}",
         "--MigratableProvisioner.suspend_to=disk"],
        cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        cli = ("jupyter", "gpumigrate")
        remote = ("--url", url, "--token", token)
        deadline = time.monotonic() + 60
        while run(*cli, "list", *remote, "--json").returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        started = run("python", "-c", "import json, sys, urllib.request as u; r = u.Request(sys.argv[1] + "
                      "'api/kernels', data=b'{\"name\": \"python3\"}', method='POST', headers={'Authorization': "
                      "'token ' + sys.argv[2]}); print(json.load(u.urlopen(r))['id'])", url, token)
        kernel_id = started.stdout.strip()
        assert kernel_id, started.stderr
        for action in ("suspend", "resume"):
            done = run(*cli, action, kernel_id, *remote, "--json", timeout=300)
            deadline = time.monotonic() + 120
            while action == "resume" and (taken := re.search(r"PID (\d+) that the kernel used is now taken",
                                                             done.stdout + done.stderr)):
                # CI forks fast enough to wrap its 32768 PIDs: a short-lived process (this test's own CLI, a
                # compiler...) took one of the kernel's PIDs while it was suspended. The product refused and
                # kept the images, as it must; do what its message says: once that process is gone, again (as
                # often as it takes: the next try may find another of them taken, as it did once in CI).
                while os.path.exists(f"/proc/{taken.group(1)}"):
                    assert time.monotonic() < deadline, f"PID {taken.group(1)} stayed taken: {done.stdout}"
                    time.sleep(0.2)
                assert time.monotonic() < deadline, f"the kernel's PIDs stayed taken: {done.stdout}"
                done = run(*cli, action, kernel_id, *remote, "--json", timeout=300)
            assert done.returncode == 0, done.stdout + done.stderr
            op = json.loads(done.stdout)
            assert op["status"] == "succeeded" and op["action"] == action, op
        assert op["timings"] and "restore" in op["timings"], op
        listed = json.loads(run(*cli, "list", *remote, "--json").stdout)
        assert [k["state"] for k in listed["kernels"] if k["id"] == kernel_id] == ["running"], listed
    finally:
        os.killpg(server.pid, 15)  # a server stopped with SIGTERM shuts its running kernels down
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, 9)
            server.wait(timeout=30)
        log.close()
        subprocess.run(["pkill", "-9", "-f", str(home / "runtime")], check=False)  # its kernels, if any outlived it
