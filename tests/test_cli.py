"""`jupyter gpumigrate` against a real server: discovery, list, suspend, resume, doctor, errors."""

from __future__ import annotations

import json

import pytest
from helpers import api, cli, remote

pytestmark = pytest.mark.usefixtures("criu_binary")


async def test_list_suspend_resume_from_the_command_line(jp_fetch, jp_serverapp, kernel):
    await kernel.run("state = [1, 2, 3]")
    # Found through the server's runtime file, the way `jupyter server list` finds it.
    code, out, err = await cli("list")
    assert code == 0, err
    assert kernel.id in out and "running" in out and "python3" in out

    code, out, err = await cli("suspend", kernel.id[:8])
    assert code == 0, err
    assert f"Kernel {kernel.id} suspended in" in out and "slowest phase:" in out
    assert "dump..." in err  # progress while it waits
    code, out, err = await cli("list", "--json", *remote(jp_serverapp))
    row = next(k for k in json.loads(out) if k["id"] == kernel.id)
    assert row["state"] == "suspended" and row["image_bytes"] > 0

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
    assert code == 2 and "--to-gpu" in err
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
