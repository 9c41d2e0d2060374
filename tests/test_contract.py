"""The API's contract (client/jupyter_gpumigrate_client/contract/api.schema.json) against the live server.

A real jupyter_server with the extension, a real kernel, real CRIU: every route under /api/gpumigrate
is called, the peer routes with a peer token, and every answer (errors included) is checked against
the schema. Response objects in the schema refuse unknown fields, so a field the server adds without
describing it fails here; the panel's types are generated from the same schema (labextension/src/
contract.ts, checked by scripts/ui-tests.sh).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from helpers import api, operate, peer_server_config, ready_kernel, start_busy
from jsonschema import Draft202012Validator
from jupyter_client.asynchronous import AsyncKernelClient
from servers import free_port

from jupyter_gpumigrate_client import contract
from jupyter_gpumigrate_client.contract import ROUTES, ContractError, schema
from jupyter_gpumigrate.engine import hostfit, kernelproc
from jupyter_gpumigrate.engine.gpus import GpuInfo
from jupyter_gpumigrate.engine.plans import ALL_PHASES, PHASES
from jupyter_gpumigrate.handlers import API_PREFIX, handlers
from jupyter_gpumigrate.handlers.base import NoRouteHandler
from jupyter_gpumigrate.handlers.peer import NoPeerRouteHandler
from jupyter_gpumigrate.operations import NOT_WRITTEN, Operation
from jupyter_gpumigrate.peers import SCHEME, digest_file, image_files

PEER_TOKEN = "contract-test-peer-token"
NO_GPU = not os.path.exists("/dev/nvidiactl")
DONE = ("succeeded", "failed")


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict:
    return peer_server_config(tmp_path, PEER_TOKEN)


def check(name: str, data: Any) -> None:
    try:
        contract.validate(name, data)
    except ContractError as exc:
        pytest.fail(f"this {name} does not match the API's schema: {exc}\n{json.dumps(data, indent=1)[:3000]}")


class Walk:
    """Calls routes of ROUTES by their template; checks each request body sent and each answer
    against the schema; remembers which routes it called."""

    def __init__(self, jp_fetch: Any, headers: dict[str, str] | None = None) -> None:
        self.fetch = jp_fetch
        self.headers = headers or {}
        self.visited: set[tuple[str, str]] = set()

    async def call(self, method: str, template: str, *, expect: int, body: Any = None, raw: bytes | str | None = None,
                   params: dict | None = None, headers: dict[str, str] | None = None, **values: str) -> Any:
        route = next((r for r in ROUTES if r.method == method and r.path == template), None)
        assert route is not None, f"{method} {template} is not in jupyter_gpumigrate_client.contract.ROUTES"
        if body is not None:
            assert route.request is not None, f"{method} {template} takes no JSON body"
            check(route.request, body)
            raw = json.dumps(body)
        kwargs: dict[str, Any] = {"method": method, "raise_error": False, "params": params, "request_timeout": 120,
                                  "headers": {**self.headers, **(headers or {})}}
        if method in ("POST", "PUT"):
            kwargs["body"] = raw if raw is not None else b""
        path = template.format(**values)
        response = await self.fetch(*API_PREFIX.strip("/").split("/"), *path.strip("/").split("/"), **kwargs)
        text = response.body or b""
        assert response.code == expect, f"{method} {path}: {response.code} {text[:800]!r}"
        self.visited.add((method, template))
        if expect >= 400:
            assert response.headers.get("Content-Type", "").startswith("application/json"), response.headers
            data = json.loads(text)
            check("ErrorBody", data)
            return data
        assert expect in route.responses, f"{method} {template} answered {expect}, which ROUTES does not list"
        if route.responses[expect] is None:
            return text
        data = json.loads(text)
        check(route.responses[expect], data)
        return data

    async def follow(self, op: dict) -> dict:
        """Follow an operation to its end with GET /operations/{id}?after=N, checking each answer."""
        while op["status"] not in DONE:
            op = await self.call("GET", "/operations/{op_id}", op_id=op["id"], params={"after": op["version"]},
                                 expect=200)
        return op


# -- the schema itself -----------------------------------------------------------------------------------


def test_the_schema_is_a_valid_draft_2020_12_schema_and_names_what_routes_use():
    document = contract.document()
    Draft202012Validator.check_schema(document)
    assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    used = {r.request for r in ROUTES} | {n for r in ROUTES for n in r.responses.values()}
    assert used - {None} <= set(contract.names())
    with pytest.raises(ValueError, match="no definition 'Nope'"):
        contract.validate("Nope", {})
    # Every response object refuses unknown fields: a field added on the server fails these tests.
    for name in contract.names():
        definition = schema(name)
        if definition.get("type") == "object" and not name.endswith("Request") and name != "Seconds":
            assert definition.get("additionalProperties") is False, name


def test_every_route_of_the_server_is_in_the_contract():
    served: set[tuple[str, str]] = set()
    for pattern, handler in handlers():
        if handler in (NoRouteHandler, NoPeerRouteHandler):
            continue  # the catch-alls: what no route takes (a JSON 404)
        path = pattern.removeprefix(API_PREFIX).removesuffix("/?")
        alternatives = re.search(r"\(\?P<action>([a-z|]+)\)", path)
        for action in alternatives.group(1).split("|") if alternatives else [""]:
            template = re.sub(r"\(\?P<action>[^)]*\)", action, path)
            template = re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", template)
            ours = [cls for cls in handler.__mro__ if cls.__module__.startswith("jupyter_gpumigrate")]
            for method in ("GET", "POST", "PUT", "DELETE"):
                if any(method.lower() in vars(cls) for cls in ours):
                    served.add((method, template))
    listed = {(r.method, r.path) for r in ROUTES}
    assert served == listed, f"served, not in ROUTES: {served - listed}; in ROUTES, not served: {listed - served}"


def test_the_schema_knows_every_phase_and_kernel_state():
    assert set(schema("Phase")["enum"]) == set(ALL_PHASES)
    states = {kernelproc.RUNNING, kernelproc.MIGRATING, kernelproc.SUSPENDED, kernelproc.STOPPED, kernelproc.BROKEN}
    assert set(schema("KernelState")["enum"]) == states


def test_every_field_the_server_writes_is_described():
    # Operation.to_dict: every field, once each way (the live walks below check real records too).
    described = set(schema("Operation")["properties"])
    written = {f.name for f in dataclasses.fields(Operation)} - set(NOT_WRITTEN) | {"total"}
    assert written == described - {"stager"}, f"undescribed: {written - described}; gone: {described - written}"
    move = Operation(kernel_id="k", action="migrate", status="succeeded", phase=None, phases=list(PHASES["move_to_gpu"]),
                     timings={"prepare": 0.01, "stash": 1.2}, bytes=8_000_000_000, to_gpu=1, from_gpu=0,
                     fast_path={"stashed": 7_000_000_000, "reason": None, "seconds": {"stash": 1.1}, "via": "peer"},
                     finished=2.0)
    check("Operation", move.to_dict())
    # A kernel on two GPUs, swapped by the driver alone; and a move through the host stash.
    swap = Operation(kernel_id="k", action="migrate", status="succeeded", phases=list(PHASES["move_to_gpu"]),
                     to_gpu=1, from_gpu=0, to_gpus=[1, 0], from_gpus=[0, 1], finished=2.0,
                     fast_path={"stashed": 0, "reason": "the kernel holds several GPUs", "seconds": {}, "via": None})
    check("Operation", swap.to_dict())
    host = Operation(kernel_id="k", action="migrate", status="succeeded", phases=list(PHASES["move_to_gpu"]),
                     timings={"host stash": 1.2, "take back": 0.7}, to_gpu=1, from_gpu=0, finished=2.0,
                     fast_path={"stashed": 9, "reason": None, "seconds": {"stash": 1.1, "unstash": 0.6}, "via": "host"})
    check("Operation", host.to_dict())
    failed = Operation(kernel_id="k", action="migrate", status="failed", phase="transfer", failed_phase="transfer",
                       error="b went away.", to_host="b", from_host="a", phases=list(PHASES["move_to_host"]))
    check("Operation", failed.to_dict())
    drain = Operation(kernel_id="", action="drain", gpu=0, to_gpu=None, children=["c1"], results=[
        {"kernel_id": "k1", "status": "succeeded", "operation": "c1", "error": None, "to_gpu": 1, "way": "move"},
        {"kernel_id": "k2", "status": "failed", "operation": None, "error": "no room", "way": "move"},
        {"kernel_id": "k3", "status": "succeeded", "operation": "c3", "error": None, "to_gpu": None,
         "way": "transplant"}])
    check("Operation", drain.to_dict())
    reply = {**move.to_dict(), "stager": {"path": "/run/x.sock", "token": "t"}}  # to the kernel's own %migrate
    check("Operation", reply)
    with pytest.raises(ContractError, match="Unknown field.*surprise"):
        contract.validate("Operation", {**move.to_dict(), "surprise": 1})

    # A GPU as GET /gpus lists it: GpuInfo.to_dict and the kernels on it (this machine may have no GPU).
    gpu = GpuInfo(index=0, uuid="GPU-0", name="NVIDIA H200", memory_total=150_754_820_096, memory_used=10**9,
                  utilization=37, persistence_mode=True, mig_enabled=False, processes={4242: 10**9})
    assert {f.name for f in dataclasses.fields(GpuInfo)} | {"kernels"} == set(schema("Gpu")["properties"])
    check("Gpu", {**gpu.to_dict(), "kernels": [{"id": "k", "memory_used": 10**9}]})


def test_request_bodies_are_refused_with_the_field_and_what_it_may_be():
    cases = [
        ("ResumeRequest", [1], "The body must be a JSON object"),
        ("ResumeRequest", {"to_gpu": "one"}, "'to_gpu' must be a whole number >= 0 or null (got 'one')"),
        ("ResumeRequest", {"to_gpu": True}, "'to_gpu' must be a whole number >= 0"),
        ("SuspendRequest", {"to_gpu": 0}, "Unknown field(s) to_gpu; allowed fields: idle_since, images."),
        ("SuspendRequest", {"images": "ram"}, "'images' is one of auto, memory, disk"),
        ("MigrateRequest", {"to_gpu": None}, "'migrate' needs to_gpu, to_gpus (a kernel on several GPUs: one GPU for "
                                              "each) or to_host"),
        ("MigrateRequest", {"to_gpu": 1, "to_gpus": [1, 0]}, "to_gpus goes alone"),
        ("MigrateRequest", {"to_gpus": [1, 1]}, "'to_gpus' names 1 more than once (got [1, 1]): GPU indices, one per "
                                                "GPU a kernel holds, in the order of their indices; each once"),
        ("MigrateRequest", None, "The body must be a JSON object (got None)"),
        ("TransplantRequest", [], "The body must be a JSON object (got [])"),
        ("ResumeRequest", {"to_gpu": 0, "to_gpus": [1, 0]}, "'resume' takes to_gpu (one GPU) or to_gpus"),
        ("MigrateRequest", {"to_gpu": 1, "fast_path": "warp"}, "'fast_path' is one of auto, off, caller"),
        ("PeerSignalRequest", {}, "The body needs the field 'signum'"),
        ("PeerCheckRequest", {"kernel_id": "k", "requirements": {"ids": [], "processes": {"x": 1}, "listens": [],
                                                                 "files": {}}},
         "The field names of 'requirements.processes' must each be a string matching"),
        ("ResumeRequest", {"to_gpu": json.loads("[" * 40 + "]" * 40)}, "more than 32 levels deep"),
    ]
    for name, body, words in cases:
        with pytest.raises(ContractError) as info:
            contract.validate(name, body)
        assert words in str(info.value), (name, body, str(info.value))
        assert info.value.http_status == 400 and info.value.definition == name
    # A long list that mixes types is checked in one pass: jsonschema's own uniqueItems compared every pair
    # (8,000 items took 19 s, these 100,000 would take hours), and the server checks bodies on its event loop.
    with pytest.raises(ContractError, match=r"'to_gpus\[100000\]' must be a whole number"):
        contract.validate("MigrateRequest", {"to_gpus": [*range(100_000), "x"]})
    contract.validate("MigrateRequest", {"to_gpu": None, "to_host": "b"})  # what a kernel's %migrate sends
    contract.validate("MigrateRequest", {"to_gpus": [1, 0], "fast_path": "caller"})  # a %migrate --to-gpu 1,0


# -- the live server -------------------------------------------------------------------------------------

pytestmark_criu = pytest.mark.usefixtures("criu_binary")


@pytestmark_criu
async def test_hostile_requests_get_a_sentence_each_and_hold_up_nothing(jp_fetch, jp_serverapp, kernel, tmp_path):
    """What an attacker with a token (or a kernel with its credential) may send: a body too large, one with too
    many values, odd version numbers and GPU indices; and dry runs of a transplant of a kernel busy with a cell,
    asked many times at once, which wait for the cell's end (up to a minute) and held every thread the server's
    other work uses: another kernel's suspend waited for them."""
    kid = kernel.id
    error = await api(jp_fetch, "kernels", kid, "transplant", method="POST", expect=413,
                      body={"to_cpu": True, "accept_left": ["x" * 100] * 11_000})
    assert "bytes; this API's bodies are at most 1048576 bytes" in error["message"], error
    error = await api(jp_fetch, "kernels", kid, "transplant", method="POST", expect=400,
                      body={"to_cpu": True, "accept_left": ["x"] * 60_000})
    assert "holds more than 50000 values" in error["message"], error
    error = await api(jp_fetch, "kernels", kid, "migrate", method="POST", body={"to_gpus": [0, 0]}, expect=400)
    assert "'to_gpus' names 0 more than once" in error["message"], error
    op = await operate(jp_fetch, kid, "suspend")
    for after in ("\u00b2", "9" * 5000, "-1"):
        error = await api(jp_fetch, "operations", op["id"], params={"after": after}, expect=400)
        assert "'after' must be a version number" in error["message"], error
    for index in ("9" * 5000, "1234567"):  # a GPU index of more than 6 digits: no such GPU, said in JSON
        error = await api(jp_fetch, "gpus", index, "drain", method="POST", body={}, expect=404)
        assert "This host has no GPU" in error["message"] and len(error["message"]) < 200, error
    # Paths no route takes (an id that is no id, a GPU that is no index) get JSON, not jupyter_server's page
    for parts in (("kernels", "\u20ac\U0001f600", "suspend"), ("kernels", kid + " ", "suspend"), ("gpus", "-1", "drain"),
                  ("nowhere",)):
        error = await api(jp_fetch, *parts, method="POST", body={}, expect=404)
        assert error["message"].startswith("No route of jupyter-gpumigrate's API is ") and \
            f"/api/gpumigrate/{'/'.join(parts)}:" in error["message"], error
    error = await api(jp_fetch, "gpus", method="POST", body={}, expect=405)
    assert error["message"].startswith("POST is not a method of /") and \
        error["message"].endswith("/api/gpumigrate/gpus: it takes GET."), error
    error = await api(jp_fetch, "kernels", kid, "resume", method="POST", body={"to_gpus": []}, expect=400)
    assert error["message"].startswith("'to_gpus' must be a list of at least 1 item (got [])"), error
    assert (await operate(jp_fetch, kid, "resume"))["status"] == "succeeded"

    flag = tmp_path / "go"
    cell = await start_busy(jp_fetch, kernel, f"import os, time\nwhile not os.path.exists({str(flag)!r}): "
                                              "time.sleep(0.05)\nprint('done')")
    other = await ready_kernel(jp_fetch, jp_serverapp)
    try:
        await other.run("y = 7")
        # As many as the default threads of a 2-core machine (6); under the test client's 10 connections.
        dry = [asyncio.ensure_future(jp_fetch("api", "gpumigrate", "kernels", kid, "transplant", method="POST",
                                              body=json.dumps({"to_cpu": True, "dry_run": True}),
                                              request_timeout=120)) for _ in range(6)]
        await asyncio.sleep(1)
        op = await operate(jp_fetch, other.id, "suspend")
        assert op["status"] == "succeeded", op
        assert not [t for t in dry if t.done()], "the dry runs still wait for the cell, and held nothing up"
        flag.touch()
        said = [json.loads(r.body) for r in await asyncio.gather(*dry)]
        assert all(s["to"] == "cpu" for s in said) and (await cell).out.strip() == "done"
        assert (await operate(jp_fetch, other.id, "resume"))["status"] == "succeeded"
        assert (await other.run("print(y)")).strip() == "7"
    finally:
        flag.touch()
        other.close()


@pytestmark_criu
async def test_every_route_answers_as_the_schema_says(jp_fetch, kernel):
    walk = Walk(jp_fetch)
    kid = kernel.id
    await kernel.run("kept = 'here'")
    listed = await walk.call("GET", "/kernels", expect=200)
    assert kid in [k["id"] for k in listed]
    view = await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    assert view["state"] == "running" and set(view) == set(schema("Kernel")["properties"])
    gpus = await walk.call("GET", "/gpus", expect=200)
    assert gpus["host"] == view["home"]
    await walk.call("GET", "/operations", expect=200)
    # (A server run in this process takes nothing back as it starts: the records it refuses, and their
    # schema, are in test_hibernation.py.)
    assert await walk.call("GET", "/refused", expect=200) == []

    # Suspend, followed with ?after=, the kernel seen while it moves and once it is suspended.
    op = await walk.call("POST", "/kernels/{kernel_id}/suspend", kernel_id=kid, body={}, expect=202)
    assert op["phases"] == list(PHASES["suspend"]) and op["status"] in ("pending", "running")
    await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    op = await walk.follow(op)
    assert op["status"] == "succeeded" and op["finished"] and op["bytes"] > 0, op
    assert set(op["timings"]) <= set(op["phases"])
    view = await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    assert view["state"] == "suspended" and view["image_bytes"] == op["bytes"]
    await walk.call("GET", "/operations/{op_id}", op_id=op["id"], expect=200)

    # Resume: an empty body, and the field given as null (both allowed).
    op = await walk.call("POST", "/kernels/{kernel_id}/resume", kernel_id=kid, body={"to_gpu": None}, expect=202)
    assert op["phases"] == list(PHASES["resume"])
    assert (await walk.follow(op))["status"] == "succeeded"
    assert (await kernel.run("print(kept)")).strip() == "here"
    # A transplant: its dry run (200, what would carry), then the real one (202), to the CPU.
    survey = await walk.call("POST", "/kernels/{kernel_id}/transplant", kernel_id=kid,
                             body={"to_cpu": True, "dry_run": True}, expect=200)
    assert [r["name"] for r in survey["carries"]] == ["kept"] and survey["to"] == "cpu", survey
    op = await walk.call("POST", "/kernels/{kernel_id}/transplant", kernel_id=kid, body={"to_cpu": True}, expect=202)
    assert op["phases"] == list(PHASES["transplant"]) and op["transplant"] is None
    op = await walk.follow(op)
    assert op["status"] == "succeeded" and op["transplant"]["carried"] == ["kept"], op
    assert (await kernel.run("print(kept)")).strip() == "here"
    error = await walk.call("POST", "/kernels/{kernel_id}/transplant", kernel_id=kid, raw='{"to_gpu": 0, "to_cpu": true}',
                            expect=400)
    assert "needs to_gpu or to_cpu" in error["message"], error
    # Back to the process the transplant replaced (kept meanwhile): its view said until when.
    view = await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    assert view["back_until"], view
    op = await walk.call("POST", "/kernels/{kernel_id}/back", kernel_id=kid, body={}, expect=202)
    assert op["phases"] == list(PHASES["back"])
    assert (await walk.follow(op))["status"] == "succeeded"
    error = await walk.call("POST", "/kernels/{kernel_id}/back", kernel_id=kid, body={}, expect=409)
    assert "no earlier process" in error["message"], error
    ops = await walk.call("GET", "/operations", expect=200)
    assert [o["action"] for o in ops] == ["suspend", "resume", "transplant", "back"]

    # Refusals are error bodies: a move with no GPU here, a drain, bad bodies, unknown ids.
    if NO_GPU:
        error = await walk.call("POST", "/kernels/{kernel_id}/migrate", kernel_id=kid, body={"to_gpu": 0}, expect=409)
        assert "no NVIDIA GPU" in error["message"]
        error = await walk.call("POST", "/gpus/{index}/drain", index="0", body={}, expect=409)
        assert "no NVIDIA GPU" in error["message"]
    error = await walk.call("POST", "/kernels/{kernel_id}/migrate", kernel_id=kid, raw="{}", expect=400)
    assert "needs to_gpu, to_gpus" in error["message"]
    error = await walk.call("POST", "/gpus/{index}/drain", index="0", raw='{"to_gpu": "1"}', expect=400)
    assert error["message"].startswith("'to_gpu' must be a whole number >= 0"), error
    error = await walk.call("POST", "/gpus/{index}/drain", index="0", raw='{"transplant": "yes"}', expect=400)
    assert error["message"].startswith("'transplant' must be true or false"), error
    error = await walk.call("POST", "/kernels/{kernel_id}/resume", kernel_id=kid, raw='{"to_gpu": 0, "x": 1}',
                            expect=400)
    assert error["message"] == "Unknown field(s) x; allowed fields: to_gpu, to_gpus.", error
    await walk.call("GET", "/kernels/{kernel_id}", kernel_id="no-such-kernel", expect=404)
    await walk.call("GET", "/operations/{op_id}", op_id="no-such-operation", expect=404)
    error = await walk.call("GET", "/operations/{op_id}", op_id=op["id"], params={"after": "x"}, expect=400)
    assert "version number" in error["message"]
    await walk.call("GET", "/kernels", headers={"Authorization": ""}, expect=403)

    # A body nested past what Python's JSON parser can take is a 400, as is one nested past the API's limit.
    for raw in ("[" * 100_000 + "]" * 100_000, '{"to_gpu": ' * 60 + "1" + "}" * 60):
        error = await walk.call("POST", "/kernels/{kernel_id}/resume", kernel_id=kid, raw=raw, expect=400)
        assert "nests" in error["message"] and "deep" in error["message"], error

    users = {(r.method, r.path) for r in ROUTES if not r.path.startswith("/peer/")}
    if not NO_GPU:
        users -= {("POST", "/kernels/{kernel_id}/migrate"), ("POST", "/gpus/{index}/drain")}
    assert users <= walk.visited, f"not called: {users - walk.visited}"
    assert (await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200))["state"] == "running"


@pytestmark_criu
async def test_every_peer_route_answers_as_the_schema_says(jp_fetch, jp_serverapp, kernel):
    """This server is its own peer: it takes its own suspended kernel's images, runs the kernel as a
    guest, dumps and resumes it, and discards it; then the kernel resumes where it was."""
    walk = Walk(jp_fetch, headers={"Authorization": f"{SCHEME} {PEER_TOKEN}"})
    kid = kernel.id
    await kernel.run("kept = 'here'")
    await Walk(jp_fetch, headers={"Authorization": f"{SCHEME} wrong"}).call("POST", "/peer/check", raw="{}",
                                                                             expect=403)
    error = await walk.call("GET", "/peer/kernels/{kernel_id}/channels", kernel_id=kid, expect=403,
                            headers={"Authorization": f"{SCHEME} wrong"})
    assert error["message"] == "This peer credential is not valid here."
    # A peer route this server lacks (another version's): said so, not "your token is refused"
    for token, code in ((PEER_TOKEN, 404), ("wrong", 403)):
        response = await jp_fetch("api", "gpumigrate", "peer", "kernels", kid, "teleport", method="POST", body="{}",
                                  headers={"Authorization": f"{SCHEME} {token}"}, raise_error=False)
        error = json.loads(response.body)
        assert response.code == code, (response.code, error)
    assert error["message"] == "This peer credential is not valid here.", error
    response = await jp_fetch("api", "gpumigrate", "peer", "kernels", kid, "teleport", method="POST", body="{}",
                              headers={"Authorization": f"{SCHEME} {PEER_TOKEN}"}, raise_error=False)
    error = json.loads(response.body)
    assert error["message"].startswith("No peer route of jupyter-gpumigrate's API is ") and \
        "the two hosts may run different versions" in error["message"], error

    # What the kernel needs of a host, as a peer asks: this host has it running, so it says why not.
    manager = jp_serverapp.kernel_manager.get_kernel(kid)
    pid = manager.provisioner.pid
    needs = hostfit.requirements_of(pid, kernelproc.kernel_listens(manager.provisioner.kernel_connection_info))
    asked = {"kernel_id": kid, "requirements": json.loads(json.dumps(needs.to_dict())), "gpu": None, "to_gpu": None,
             "from": "a"}
    answer = await walk.call("POST", "/peer/check", body=asked, expect=200)
    assert answer["problems"], "the kernel's own PIDs are taken here: the check must say so"
    assert answer["stash"] is True, "this version has a kernel write and read its stash when sent the key"
    error = await walk.call("POST", "/peer/check", raw=json.dumps({**asked, "extra": 1}), expect=400)
    assert "Unknown field(s) extra" in error["message"]
    error = await walk.call("POST", "/peer/check", raw="[" * 100_000 + "]" * 100_000, expect=400)
    assert "nests" in error["message"]

    # The kernel's images, sent to the guest side of the same server.
    assert (await operate(jp_fetch, kid, "suspend"))["status"] == "succeeded"
    images = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "images" / kid
    files = [(p, *digest_file(p)) for p in image_files(images)]
    total = sum(size for _, size, _ in files)
    assert (await walk.call("POST", "/peer/images/{kernel_id}", kernel_id=kid, body={"bytes": total},
                            expect=201))["kernel_id"] == kid
    # A GPU kernel's prefetch, asked as its images arrive: this host has no GPU of the model, so none begins,
    # and the answer says why (the restore then makes its own, or the kernel reads its files itself).
    gpu = {"index": 0, "uuid": "GPU-6f1e2a3b-0000-4000-8000-000000000001", "memory_used": 3 << 30, "name": "NVIDIA H200"}
    index = {"format": 1, "parts": 1, "session": "s", "buffers": [{"kind": "cuda", "size": 2 << 30}],
             "chunks": [{"buffer": 0, "at": 0, "size": 2 << 30, "part": 0, "offset": 0, "xxh3": 1}]}
    said = await walk.call("POST", "/peer/images/{kernel_id}/prefetch", kernel_id=kid,
                           body={"index": index, "gpu": gpu, "to_gpu": None}, expect=200)
    assert said["gpu"] is None and "NVIDIA H200" in said["reason"], said
    damaged = {**index, "chunks": [{**index["chunks"][0], "size": 3 << 30}]}  # beyond its buffer
    said = await walk.call("POST", "/peer/images/{kernel_id}/prefetch", kernel_id=kid,
                           body={"index": damaged, "gpu": gpu}, expect=200)
    assert said["gpu"] is None and "the stash's index sent is damaged (a chunk out of bounds" in said["reason"], said
    error = await walk.call("POST", "/peer/images/{kernel_id}/prefetch", kernel_id=kid, raw='{"index": {}}',
                            expect=400)
    assert "gpu" in error["message"], error
    first = files[0][0]
    error = await walk.call("PUT", "/peer/images/{kernel_id}/{name}", kernel_id=kid, name=first.name,
                            raw=first.read_bytes(), headers={"X-Content-XXH3": "0" * 16}, expect=400)
    assert "arrived damaged" in error["message"]
    for path, _, digest in files:
        stored = await walk.call("PUT", "/peer/images/{kernel_id}/{name}", kernel_id=kid, name=path.name,
                                 raw=path.read_bytes(), headers={"X-Content-XXH3": digest}, expect=201)
        assert stored["name"] == path.name
    sent = [{"name": p.name, "size": s, "xxh3": h} for p, s, h in files]
    # Sent as the peers send it: no checksum up front (they hash as they send); the list at the end is checked.
    await walk.call("PUT", "/peer/images/{kernel_id}/{name}", kernel_id=kid, name=first.name, raw=first.read_bytes(),
                    expect=201)
    wrong = [{**f, "xxh3": "0" * 16} if f["name"] == first.name else f for f in sent]
    error = await walk.call("POST", "/peer/images/{kernel_id}/complete", kernel_id=kid, body={"files": wrong},
                            expect=400)
    assert f"{first.name} arrived damaged" in error["message"] and "send the images again" in error["message"]
    await walk.call("POST", "/peer/images/{kernel_id}", kernel_id=kid, body={"bytes": total}, expect=201)  # again
    for path, _, _ in files:
        await walk.call("PUT", "/peer/images/{kernel_id}/{name}", kernel_id=kid, name=path.name, raw=path.read_bytes(),
                        expect=201)
    assert (await walk.call("POST", "/peer/images/{kernel_id}/complete", kernel_id=kid, body={"files": sent},
                            expect=200))["kernel_id"] == kid
    listing = await walk.call("GET", "/peer/images/{kernel_id}", kernel_id=kid, expect=200)
    assert sorted(listing["files"], key=lambda f: f["name"]) == sorted(sent, key=lambda f: f["name"])
    quick = await walk.call("GET", "/peer/images/{kernel_id}", kernel_id=kid, params={"checksums": "false"},
                            expect=200)  # names and sizes at once: the way home fetches as the checksums come
    assert sorted(quick["files"], key=lambda f: f["name"]) == \
        sorted(({"name": f["name"], "size": f["size"]} for f in sent), key=lambda f: f["name"])
    got = await walk.call("GET", "/peer/images/{kernel_id}/{name}", kernel_id=kid, name=first.name, expect=200)
    assert got == first.read_bytes()

    # The guest: restored, described, signalled, dumped, resumed, discarded.
    restored = await walk.call("POST", "/peer/kernels/{kernel_id}/restore", kernel_id=kid, body={"to_gpu": None},
                               expect=200)
    assert restored["pid"] and restored["gpus"] == []
    error = await walk.call("POST", "/peer/images/{kernel_id}/prefetch", kernel_id=kid,
                            body={"index": index, "gpu": gpu}, expect=409)  # restored: no images arrive any more
    assert "are not being received here" in error["message"], error
    guest = await walk.call("GET", "/peer/kernels/{kernel_id}", kernel_id=kid, expect=200)
    assert guest["state"] == "running" and guest["requirements"]["ids"] and guest["stash"] is True
    error = await walk.call("POST", "/peer/kernels/{kernel_id}/signal", kernel_id=kid, raw='{"signum": 0}',
                            expect=400)
    assert error["message"].startswith("'signum' must be a whole number from 1 to 64"), error
    assert await walk.call("POST", "/peer/kernels/{kernel_id}/signal", kernel_id=kid,
                           body={"signum": int(signal.SIGCONT)}, expect=200) == {}
    dumped = await walk.call("POST", "/peer/kernels/{kernel_id}/dump", kernel_id=kid, expect=200)
    assert dumped["bytes"] > 0
    await walk.call("POST", "/peer/kernels/{kernel_id}/resume", kernel_id=kid, body={}, expect=200)
    assert await walk.call("DELETE", "/peer/kernels/{kernel_id}", kernel_id=kid, expect=204) == b""
    await walk.call("GET", "/peer/kernels/{kernel_id}", kernel_id=kid, expect=404)

    # The kernel itself, suspended all along on its own side, comes back with its state.
    assert (await operate(jp_fetch, kid, "resume"))["status"] == "succeeded"
    assert (await kernel.run("print(kept)")).strip() == "here"

    # A transplant's new process, for a peer: the kernel's objects, as a peer's transplant writes and sends them,
    # go to a guest (another id, ports of its own: the kernel runs on here), which takes them and answers.
    asked = {"kernel_id": kid, "kernel_name": "python3", "bytes": 0, "gpu_bytes": 0, "to_gpu": None,
             "listens": [list(a) for a in kernelproc.kernel_listens(manager.provisioner.kernel_connection_info)]}
    answer = await walk.call("POST", "/peer/transplants/check", body=asked, expect=200)
    assert answer["problems"] and "is not free here" in answer["problems"][0], answer
    gid = f"guest-{kid}"
    error = await walk.call("POST", "/peer/kernels/{kernel_id}/transplant", kernel_id=gid, expect=409, body={
        "files": [], "kernel_name": "python3", "connection_info": {"key": "k"}, "to_gpu": None, "wait": 5})
    assert "send them first" in error["message"], error
    objects = Path(jp_serverapp.config.MigratableProvisioner.state_dir) / "objects"
    objects.mkdir()
    survey = await asyncio.to_thread(manager.provisioner.transplant_survey, 60)
    await asyncio.to_thread(manager.provisioner.transplant_export, str(objects),
                            [r["name"] for r in survey["carries"]], 60)
    files = [(p, *digest_file(p)) for p in image_files(objects)]
    await walk.call("POST", "/peer/images/{kernel_id}", kernel_id=gid, body={"bytes": sum(f[1] for f in files)},
                    expect=201)
    for path, _, digest in files:
        await walk.call("PUT", "/peer/images/{kernel_id}/{name}", kernel_id=gid, name=path.name,
                        raw=path.read_bytes(), headers={"X-Content-XXH3": digest}, expect=201)
    info = {"ip": "127.0.0.1", "transport": "tcp", "key": os.urandom(16).hex(), "signature_scheme": "hmac-sha256",
            **{f"{c}_port": free_port() for c in ("shell", "iopub", "stdin", "control", "hb")}}
    body = {"files": [{"name": p.name, "size": s, "xxh3": h} for p, s, h in files], "kernel_name": "python3",
            "connection_info": info, "to_gpu": None, "wait": 60}
    loaded = await walk.call("POST", "/peer/kernels/{kernel_id}/transplant", kernel_id=gid, body=body, expect=200)
    assert loaded["pid"] and loaded["gpu"] is None and loaded["loaded"]["names"] >= 1, loaded
    switched = await walk.call("POST", "/peer/kernels/{kernel_id}/switch", kernel_id=gid, body={}, expect=200)
    assert switched["pid"] == loaded["pid"]
    client = AsyncKernelClient()
    client.load_connection_info(info)
    client.start_channels()
    try:
        out: list[str] = []
        reply = await client.execute_interactive("print(kept)", timeout=60,
                                                 output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok" and "".join(out).strip() == "here", (reply["content"], out)
    finally:
        client.stop_channels()
    error = await walk.call("POST", "/peer/kernels/{kernel_id}/switch", kernel_id=gid, body={}, expect=409)
    assert "No transplant of kernel" in error["message"]
    assert await walk.call("DELETE", "/peer/kernels/{kernel_id}", kernel_id=gid, expect=204) == b""
    assert not Path(f"/proc/{loaded['pid']}").exists() or \
        Path(f"/proc/{loaded['pid']}/stat").read_text().split()[2] == "Z"

    peers = {(r.method, r.path) for r in ROUTES if r.path.startswith("/peer/")}
    assert peers <= walk.visited, f"not called: {peers - walk.visited}"


@pytest.mark.gpu
@pytestmark_criu
async def test_gpu_answers_match_the_schema(jp_fetch, kernel):
    """On a GPU machine (the gpu suite): GPUs with kernels on them, a kernel's targets, a move to
    another GPU (where there is one), a GPU kernel suspended and resumed onto a GPU, a drain with its
    results (with one GPU, a drain that fails, kernel by kernel)."""
    walk = Walk(jp_fetch)
    kid = kernel.id
    await kernel.run("import torch; x = torch.ones(1 << 28, device='cuda'); torch.cuda.synchronize()")
    gpus = await walk.call("GET", "/gpus", expect=200)
    assert gpus["driver_version"] and any(k["id"] == kid for g in gpus["gpus"] for k in g["kernels"]), gpus
    view = await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    home = view["gpus"][0]["index"]
    assert [t["index"] for t in view["targets"]] == [g["index"] for g in gpus["gpus"]], view
    target = next((t["index"] for t in view["targets"] if t["ok"]), None)

    if target is not None:
        op = await walk.call("POST", "/kernels/{kernel_id}/migrate", kernel_id=kid, body={"to_gpu": target},
                             expect=202)
        assert op["phases"] == list(PHASES["move_to_gpu"])
        op = await walk.follow(op)
        assert op["status"] == "succeeded" and (op["from_gpu"], op["to_gpu"]) == (home, target), op
    where = home if target is None else target

    op = await walk.follow(await walk.call("POST", "/kernels/{kernel_id}/suspend", kernel_id=kid, body={},
                                           expect=202))
    assert op["status"] == "succeeded", op
    view = await walk.call("GET", "/kernels/{kernel_id}", kernel_id=kid, expect=200)
    assert view["suspended_on"][0]["index"] == where and view["suspended_on"][0]["name"], view
    op = await walk.follow(await walk.call("POST", "/kernels/{kernel_id}/resume", kernel_id=kid,
                                           body={"to_gpu": home}, expect=202))
    assert op["status"] == "succeeded" and op["to_gpu"] == home, op

    drain = await walk.call("POST", "/gpus/{index}/drain", index=str(home), body={}, expect=202)
    assert drain["action"] == "drain" and drain["phases"] == []
    drain = await walk.follow(drain)
    assert [r["kernel_id"] for r in drain["results"]] == [kid], drain
    assert drain["status"] == ("succeeded" if len(gpus["gpus"]) > 1 else "failed"), drain
    await walk.call("GET", "/operations", expect=200)
    assert (await kernel.run("print(int(x.sum()))")).strip() == str(1 << 28)
