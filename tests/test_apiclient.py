"""apiclient.Client against a real jupyter_server with the extension and a real kernel: follow() by long
poll through a real suspend and resume, and the errors it raises (the server's sentence and status, no
answer, a redirect, an answer that is not JSON, a follow that gives up). The client blocks: each call
runs in a thread while the server serves on the test's loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import api

from jupyter_gpumigrate_client.apiclient import ApiError, Client, NotFinished, Unreachable
from jupyter_gpumigrate.opformat import progress, report

pytestmark = pytest.mark.usefixtures("criu_binary")


def client_of(serverapp) -> Client:
    return Client.with_token(serverapp.connection_url, serverapp.identity_provider.token)


async def test_follow_sees_each_version_of_a_real_suspend_and_resume(jp_serverapp, kernel):
    await kernel.run("kept = 'here'")
    client = client_of(jp_serverapp)
    for action in ("suspend", "resume"):
        started = await asyncio.to_thread(client.act, kernel.id, action)
        assert started["status"] in ("pending", "running") and started["action"] == action, started
        seen: list[dict] = []
        op = await asyncio.to_thread(client.follow, started, seen.append, 120)
        assert op["status"] == "succeeded", op
        assert seen[0] is started and seen[-1] == op, "the first version and the last are both seen"
        versions = [v["version"] for v in seen]
        assert versions == sorted(set(versions)), f"each version once, in order: {versions}"
        phases = [v["phase"] for v in seen if v["phase"]]
        # Each answer is the operation as it is once it changed (versions in between may be passed over):
        # the phases seen are phases it ran, in order.
        assert phases and set(phases) <= set(op["timings"]), (op["timings"], phases)
        assert list(dict.fromkeys(phases)) == [p for p in op["timings"] if p in phases], (op["timings"], phases)
        if op.get("phases"):  # the plan's own list, once the record carries it
            assert [p for p in op["phases"] if p in phases] == list(dict.fromkeys(phases)), (op["phases"], phases)
            assert progress(op) == (len(op["phases"]), len(op["phases"]))
        done = {"suspend": "suspended to disk", "resume": "resumed"}[action]
        assert report(op, kernel.id).startswith(f"Kernel {kernel.id} {done} in "), report(op, kernel.id)
    assert (await asyncio.to_thread(client.kernel, kernel.id))["state"] == "running"
    assert (await kernel.run("print(kept)")).strip() == "here"


async def test_follow_gives_up_after_its_timeout_and_the_operation_goes_on(jp_fetch, jp_serverapp, kernel):
    client = client_of(jp_serverapp)
    started = await asyncio.to_thread(client.act, kernel.id, "suspend")
    with pytest.raises(NotFinished) as info:
        await asyncio.to_thread(client.follow, started, None, 0)
    assert info.value.op["id"] == started["id"] and "goes on in the server" in str(info.value)
    assert f"operations/{started['id']}" in str(info.value)
    assert (await asyncio.to_thread(client.follow, info.value.op))["status"] == "succeeded"
    resumed = await asyncio.to_thread(client.follow, await asyncio.to_thread(client.act, kernel.id, "resume"))
    assert resumed["status"] == "succeeded", resumed
    assert (await api(jp_fetch, "kernels", kernel.id))["state"] == "running"


async def test_errors_carry_the_servers_sentence_and_status(jp_serverapp, kernel):
    client = client_of(jp_serverapp)
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(client.act, kernel.id, "resume")
    assert info.value.status == 409 and "is running, so it cannot be resumed" in str(info.value), info.value
    assert not isinstance(info.value, Unreachable) and not info.value.refused

    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(client.operation, "no-such-operation")
    assert info.value.status == 404 and str(info.value), info.value

    wrong = Client.with_token(jp_serverapp.connection_url, "not-the-token")
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(wrong.kernels)
    assert info.value.refused, info.value.status
    forged = Client.for_kernel(jp_serverapp.connection_url, "forged")
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(forged.kernel, kernel.id)
    assert info.value.status == 403, info.value

    # Outside the API: the login page of a caller who is logged in redirects (a JSON API never does, and
    # the redirect is not followed), the server's root is HTML.
    site = Client.with_token(jp_serverapp.connection_url, jp_serverapp.identity_provider.token, prefix="")
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(site.get, "login")
    assert 300 <= info.value.status < 400 and "redirect" in str(info.value), info.value
    with pytest.raises(ApiError) as info:
        await asyncio.to_thread(site.get, "")
    assert info.value.status == 200 and "not JSON" in str(info.value), info.value
    assert (await asyncio.to_thread(client.kernel, kernel.id))["state"] == "running"


def test_no_server_is_unreachable_and_follow_keeps_asking_for_its_patience():
    nobody = Client.with_token("http://127.0.0.1:9", "t")  # the discard port: nothing listens there
    with pytest.raises(Unreachable) as info:
        nobody.kernels()
    assert info.value.status is None and "does not answer" in str(info.value) and info.value.reason
    started = time.monotonic()
    with pytest.raises(Unreachable):
        nobody.follow({"id": "x", "status": "running", "version": 1, "phase": None}, patience=0.6)
    assert time.monotonic() - started >= 0.6, "it kept asking"


def test_a_server_its_user_controls_cannot_hold_a_client_or_feed_it_what_json_forbids():
    """The Hub's service reads user servers, whose users control them: an answer dripped a byte at a time
    (each read within the timeout, the whole never) is given up once the timeout has passed; lists nested
    100,000 deep and NaN (which Python's json takes and browsers refuse) are not JSON."""
    import http.server
    import threading

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            if self.path.endswith("/drip"):
                self.send_header("Content-Length", "1000000")
                self.end_headers()
                try:
                    while True:
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:  # the client gave up
                    return
            if self.path.endswith("/cut"):  # says 100 bytes, sends 10, and closes
                self.send_header("Content-Length", "100")
                self.end_headers()
                self.wfile.write(b'{"a": 1, "')
                return
            body = {"/deep": b"[" * 100_000 + b"]" * 100_000, "/nan": b'[{"extra": NaN}]',
                    "/huge": b'[{"extra": 1e999}]'}[self.path[self.path.rindex("/"):]]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = Client(f"http://127.0.0.1:{server.server_address[1]}/", "", timeout=1.0)
        with pytest.raises(Unreachable) as given_up:
            client.get("drip")
        assert given_up.value.timed_out and "did not answer in time" in str(given_up.value), given_up.value
        for path in ("deep", "nan", "huge"):
            with pytest.raises(ApiError, match="answered something that is not JSON"):
                client.get(path)
        with pytest.raises(Unreachable, match="does not answer"):  # cut short: not "not JSON", not None
            client.get("cut")
    finally:
        server.shutdown()
        server.server_close()
