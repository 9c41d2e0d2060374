"""`jupyter gpumigrate` against a real server: discovery, list, suspend, resume, doctor, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import api, cli, remote

from jupyter_gpumigrate.cli import DrainProgress
from jupyter_gpumigrate.opformat import size

pytestmark = pytest.mark.usefixtures("criu_binary")


async def test_list_suspend_resume_from_the_command_line(jp_fetch, jp_serverapp, kernel):
    await kernel.run("state = [1, 2, 3]")
    # Found through the server's runtime file, the way `jupyter server list` finds it.
    code, out, err = await cli("list")
    assert code == 0, err
    assert kernel.id in out and "running" in out and "python3" in out

    code, out, err = await cli("suspend", kernel.id[:8])
    assert code == 0, err
    assert f"Kernel {kernel.id} suspended to disk in" in out and "slowest phase:" in out
    assert "dump..." in err  # progress while it waits
    code, out, err = await cli("list", "--json", *remote(jp_serverapp))
    listed = json.loads(out)
    row = next(k for k in listed["kernels"] if k["id"] == kernel.id)
    assert row["state"] == "suspended" and row["image_bytes"] > 0
    assert listed["suspended"] == {"kernels": 1, "image_bytes": row["image_bytes"]} and listed["refused"] == []
    code, out, err = await cli("list", *remote(jp_serverapp))
    assert f"1 suspended kernel(s): {size(row['image_bytes'])} of images (" in out, out

    code, out, err = await cli("resume", kernel.id, "--json", *remote(jp_serverapp))
    assert code == 0, err
    op = json.loads(out)
    assert op["status"] == "succeeded" and set(op["timings"]) == {"prepare", "restore", "adopt"}
    assert (await kernel.run("print(sum(state))")).strip() == "6"


async def test_cli_errors_exit_non_zero_with_a_sentence(jp_fetch, jp_serverapp, kernel):
    code, out, err = await cli("resume", kernel.id, *remote(jp_serverapp))
    assert code == 1 and "is running, so it cannot be resumed" in err
    code, out, err = await cli("suspend", "no-such-kernel", *remote(jp_serverapp))
    assert code == 1 and "No kernel no-such-kernel" in err
    code, out, err = await cli("suspend", "x", "--json", "--url", "http://127.0.0.1:9", "--token", "t")
    assert code == 3 and "Cannot reach the server" in json.loads(out)["error"]
    code, out, err = await cli("list", *remote(jp_serverapp)[:2], "--token", "wrong")
    assert code == 3 and "refused the token" in err and "--token" in err  # a named server is used as given
    code, out, err = await cli("migrate", kernel.id, "--to-gpu", "1", *remote(jp_serverapp))
    assert code == 1 and ("no NVIDIA GPU" in err or "GPU" in err)
    code, out, err = await cli("migrate", kernel.id, *remote(jp_serverapp))
    assert code == 2 and err.startswith("jupyter gpumigrate: migrate needs --to-gpu N"), err
    for wrong, words in ((["--timeout", "-5"], "'-5': the time to follow an operation is a number of seconds above 0"),
                         (["--timeout", "nan"], "'nan': the time to follow an operation is a number of seconds"),
                         (["--timeout", "soon"], "'soon' is not a number of seconds")):
        code, out, err = await cli("suspend", kernel.id, *wrong, *remote(jp_serverapp))
        assert code == 2 and words in err, err
    code, out, err = await cli("drain", "--gpu", "-1", *remote(jp_serverapp))
    assert code == 2 and "'-1': GPU indices are 0 or more" in err, err
    code, out, err = await cli("migrate", kernel.id, "--to-gpu", "1,x", *remote(jp_serverapp))
    assert code == 2 and "'1,x' is not a GPU index, nor indices separated by commas (1,0)" in err, err
    code, out, err = await cli("migrate", kernel.id, "--to-gpu", "1,0", "--json", *remote(jp_serverapp))
    assert code == 1 and ("no NVIDIA GPU" in json.loads(out)["error"] or "GPU" in json.loads(out)["error"]), out
    code, out, err = await cli("frobnicate")
    assert code == 2 and "invalid choice" in err
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


async def test_failed_operation_exits_non_zero(jp_fetch, jp_serverapp, kernel, tmp_path):
    held = tmp_path / "held.txt"
    held.write_text("x")
    await kernel.run(f"h = open({str(held)!r})")
    code, out, err = await cli("suspend", kernel.id, *remote(jp_serverapp))
    assert code == 0, err
    held.unlink()
    code, out, err = await cli("resume", kernel.id, *remote(jp_serverapp))
    assert code == 1 and "resume failed in phase restore" in err and str(held) in err
    held.write_text("x")
    code, out, err = await cli("resume", kernel.id, *remote(jp_serverapp))
    assert code == 0, err


async def test_doctor_json_and_table():
    code, out, err = await cli("doctor", "--json")
    report = json.loads(out)
    assert code == (0 if report["ok"] else 1)
    names = [c["name"] for c in report["checks"]]
    assert names[:2] == ["criu", "criu check"] and "nvidia driver" in names
    code, out, err = await cli("doctor")
    assert "CHECK" in out and "REMEDY" in out and "criu check" in out
    code, out, err = await cli("doctor", "--criu", "/nonexistent/criu")
    assert code == 1 and "FAIL" in out and "ensure-criu.sh" in out and "cannot migrate kernels yet" in out
    assert "sudo jupyter gpumigrate install-criu" in out


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has GPUs: the gpu suite drains for real")
async def test_drain_without_a_gpu_fails_in_json_too(jp_fetch, jp_serverapp, kernel):
    code, out, err = await cli("drain", "--gpu", "0", "--json", *remote(jp_serverapp))
    assert code == 1 and "no NVIDIA GPU" in json.loads(out)["error"], (out, err)
    code, out, err = await cli("drain", "--gpu", "0", "--to-gpu", "1", *remote(jp_serverapp))
    assert code == 1 and "no NVIDIA GPU" in err and out == ""
    # The opt-in transplant is a valid request too (a bad body would be a 400 naming the field).
    code, out, err = await cli("drain", "--gpu", "0", "--transplant", *remote(jp_serverapp))
    assert code == 1 and "no NVIDIA GPU" in err and out == "", (out, err)
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


def test_drain_progress_has_one_line_per_change_of_each_kernels_result():
    """What `drain` prints on stderr from the versions of a drain operation it sees (the shape of GET
    /operations/{id}; the gpu suite drains real kernels). Versions it misses are not made up."""
    progress = DrainProgress()

    def op(*results: dict) -> dict:
        return {"results": [dict({"operation": None, "error": None}, **r) for r in results]}

    a, b = "a" * 32, "b" * 32
    assert progress.lines(op()) == []
    assert progress.lines(op({"kernel_id": a, "status": "pending"})) == []
    assert progress.lines(op({"kernel_id": a, "status": "running", "to_gpu": 1})) == [
        f"  kernel {a}: moving to GPU 1..."]
    assert progress.lines(op({"kernel_id": a, "status": "running", "to_gpu": 1})) == [], "no change, no line"
    assert progress.lines(op({"kernel_id": a, "status": "succeeded", "to_gpu": 1},
                             {"kernel_id": b, "status": "failed", "error": "GPU 1 has 2.0 GiB free."})) == [
        f"  kernel {a}: moved to GPU 1", f"  kernel {b}: NOT moved: GPU 1 has 2.0 GiB free."]
    assert progress.lines(op({"kernel_id": a, "status": "succeeded", "to_gpu": 1},
                             {"kernel_id": b, "status": "failed", "error": "GPU 1 has 2.0 GiB free."})) == []


async def test_discard_deletes_a_suspended_kernels_images_and_refuses_a_running_one(jp_fetch, jp_serverapp, kernel):
    code, out, err = await cli("discard", kernel.id, *remote(jp_serverapp))
    assert code == 1 and "is running, not suspended" in err, err
    code, out, err = await cli("suspend", kernel.id, *remote(jp_serverapp))
    assert code == 0, err
    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images" / kernel.id
    assert images.is_dir()
    # An empty id (a script's empty variable) names no kernel: it matched every one, and this one was the only.
    for empty in ("", " "):
        code, out, err = await cli("discard", empty, "--json", *remote(jp_serverapp))
        assert code == 2 and "Name a kernel" in json.loads(out)["error"], (code, out, err)
    assert images.is_dir()
    # An address that is none: a sentence, in JSON too, not a traceback.
    for url in ("foo", "http://[::1", "http://127.0.0.1:port/"):
        code, out, err = await cli("list", "--json", "--url", url, "--token", "t")
        assert code == 2 and "is not an" in json.loads(out)["error"] and "Traceback" not in err, (url, out, err)
    # It loses the kernel for good: asked first, and without a terminal to ask on, refused without --yes.
    code, out, err = await cli("discard", kernel.id[:8], *remote(jp_serverapp))
    assert code == 2 and f"Kernel {kernel.id} (python3) is deleted for good with its images (" in err, (out, err)
    assert "run it with --yes once you mean it" in err and images.is_dir(), err
    code, out, err = await cli("discard", kernel.id[:8], "--json", "--yes", *remote(jp_serverapp))
    assert code == 0, err
    result = json.loads(out)
    assert result["kernel_id"] == kernel.id and result["discarded"] and result["freed_bytes"] > 1_000_000
    assert not images.exists()
    code, out, err = await cli("list", "--json", *remote(jp_serverapp))
    assert kernel.id not in [k["id"] for k in json.loads(out)["kernels"]]


# -- the console script as a shell runs it: `jupyter gpumigrate ...` through jupyter's own launcher --------

JUPYTER = str(Path(sys.executable).parent / "jupyter")


def test_version_prints_the_packages_version_and_exits_0():
    from jupyter_gpumigrate import __version__

    proc = subprocess.run([JUPYTER, "gpumigrate", "--version"], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip(), proc.stderr) == (0, __version__, "")
    package_json = json.loads((Path(__file__).parents[1] / "labextension" / "package.json").read_text())
    assert __version__ == package_json["version"]


def test_help_is_in_the_jupyter_style():
    proc = subprocess.run([JUPYTER, "gpumigrate", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: jupyter gpumigrate ")
    for part in ("Subcommands", "doctor", "suspend", "resume", "migrate", "drain", "--version", "Examples\n-----"):
        assert part in proc.stdout


def test_a_closed_stdout_ends_quietly_without_a_traceback():
    # A reader that is gone before anything is written: every write fails with EPIPE, deterministically.
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([JUPYTER, "gpumigrate", "doctor", "--json"], stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    # And as users type it: the first line comes through, nothing else is said.
    proc = subprocess.run(["bash", "-c", f"{JUPYTER} gpumigrate doctor --json | head -1"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "{\n", proc.stdout
    assert "Traceback" not in proc.stderr and "Error" not in proc.stderr, proc.stderr


def test_install_criu_keeps_the_working_criu_and_says_where_it_is():
    # This machine has CRIU >= 4.2 (make test's set-up made sure): the command finds it and builds nothing.
    proc = subprocess.run([JUPYTER, "gpumigrate", "install-criu", "--print-path"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip()
    assert os.access(path, os.X_OK) and "Looks good" in proc.stderr, (path, proc.stderr)
    assert "building" not in proc.stderr


def test_the_hub_service_has_a_console_script():
    script = Path(sys.executable).parent / "jupyter-gpumigrate-hub"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--idle-suspend-minutes" in done.stdout and "--idle-images" in done.stdout
