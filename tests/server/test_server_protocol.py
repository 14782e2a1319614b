"""Protocol v1 conformance against the real server (default models, ephemeral
port) through the `websockets` client: every message, default, error code and
close code of docs/protocol.md; run against one process and against a
cluster's front door (`--cluster`: engine replicas on Ray Serve)."""

import asyncio
import json
import urllib.request

import pytest

from latency_bench.harness import CLUSTER, TOKEN, collect, collect_all, complete_msg, connect, running_server

SETTINGS = ("server.max_document_chars=20000", "server.max_frame_bytes=65536",
            "server.max_inflight_per_connection=3")
PREFIX = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        "


@pytest.fixture(scope="module", params=["single", "cluster"])
def server(request):
    """The same conversations with one process and with a cluster (engine replicas on Ray Serve)."""
    cluster = CLUSTER if request.param == "cluster" else ()
    with running_server(*SETTINGS, *cluster, timeout=300) as s:
        yield s


def get(server, path):
    request = urllib.request.Request(server.http + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return r.status, r.headers.get("Content-Type"), r.read()


def test_healthz(server):
    status, ctype, body = get(server, "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"} and "json" in ctype


async def test_hello_ready(server):
    async with connect(server) as ws:
        await ws.send(json.dumps({"type": "hello", "client": "test/1", "protocol": 1}))
        ready = json.loads(await ws.recv())
        assert ready["type"] == "ready" and ready["protocol"] == 1
        assert ready["server"].startswith("completer/")
        assert ready["model"]["target"] and "draft" in ready["model"]
        # What a request that leaves them out gets: the clients time their requests by it.
        assert ready["request"] == {"deadline_ms": 2000.0, "max_tokens": 64, "first_deadline_ms": 15000.0}
        await ws.send(json.dumps({"type": "hello", "protocol": 2}))
        err = json.loads(await ws.recv())
        assert err == {"type": "error", "id": None, "code": "unsupported", "message": err["message"]}


async def test_complete_streams_and_done_text_equals_deltas(server):
    async with connect(server) as ws:
        await ws.send(complete_msg("a", PREFIX, mode="free", max_tokens=12))
        deltas, done = await collect(ws, "a")
        assert done["type"] == "done" and done["reason"] in ("length", "eos")
        assert done["text"] == "".join(deltas)
        t = done["timings"]
        assert set(t) >= {"queue_ms", "ttft_ms", "total_ms", "prompt_tokens", "cached_tokens",
                          "generated_tokens", "draft_proposed", "draft_accepted", "prefill"}
        assert t["prefill"] == "local" and t["prompt_tokens"] > 0 and 0 < t["ttft_ms"] <= t["total_ms"]
        # Same document, one more character: the cache is warm.
        await ws.send(complete_msg("b", PREFIX + "r", mode="free", max_tokens=4))
        _, done = await collect(ws, "b")
        assert done["timings"]["cached_tokens"] > 0


async def test_defaults_apply(server):
    async with connect(server) as ws:
        # No mode (line), max_tokens (server's 64), temperature, stop, deadline.
        await ws.send(complete_msg("d", PREFIX))
        deltas, done = await collect(ws, "d")
        assert done["type"] == "done" and "\n" not in done["text"].strip("\n")
        assert done["timings"]["generated_tokens"] <= 64


async def test_line_mode_and_stop_strings(server):
    async with connect(server) as ws:
        await ws.send(complete_msg("s", PREFIX, mode="free", max_tokens=40, stop=["("]))
        _, done = await collect(ws, "s")
        assert "(" not in done["text"]
        if done["reason"] == "stop":
            assert done["timings"]["generated_tokens"] < 40


async def test_supersede_cancel_and_unknown_cancel(server):
    async with connect(server) as ws:
        await ws.send(complete_msg("1", PREFIX, mode="free", max_tokens=1500))
        await ws.send(complete_msg("2", PREFIX + "x", mode="free", max_tokens=3))
        results = await collect_all(ws, ["1", "2"])
        assert results["1"][1]["reason"] == "cancelled"
        assert results["2"][1]["type"] == "done"
        await ws.send(complete_msg("3", PREFIX, mode="free", max_tokens=1500, uri="file:///other.py"))
        await ws.send(json.dumps({"type": "cancel", "id": "3"}))
        deltas, done = await collect(ws, "3")
        assert done["reason"] == "cancelled" and done["text"] == "".join(deltas)
        # Cancelling an unknown or finished id: no reply at all.
        await ws.send(json.dumps({"type": "cancel", "id": "3"}))
        await ws.send(json.dumps({"type": "cancel", "id": "nope"}))
        await ws.send(json.dumps({"type": "hello", "protocol": 1}))
        assert json.loads(await ws.recv())["type"] == "ready"


async def test_deadline(server):
    async with connect(server) as ws:
        await ws.send(complete_msg("late", PREFIX, mode="free", max_tokens=500, deadline_ms=1))
        deltas, done = await collect(ws, "late")
        assert done["reason"] == "deadline" and done["text"] == "".join(deltas)


@pytest.mark.parametrize("frame, rid, code", [
    ("{broken", None, "bad_request"),
    (json.dumps({"type": "complete", "id": "f", "document": {"uri": "u", "prefix": 3, "suffix": ""}}),
     "f", "bad_request"),
    (json.dumps({"type": "warp", "id": "w"}), "w", "unsupported"),
    (complete_msg("big", "x" * 30000), "big", "too_large"),
    (complete_msg("neg", "x", max_tokens=-1), "neg", "bad_request"),
])
async def test_errors_keep_the_connection(server, frame, rid, code):
    async with connect(server) as ws:
        await ws.send(frame)
        err = json.loads(await ws.recv())
        assert err["type"] == "error" and err["id"] == rid and err["code"] == code and err["message"]
        await ws.send(complete_msg("after", PREFIX, mode="free", max_tokens=2))
        _, done = await collect(ws, "after")
        assert done["type"] == "done"


async def test_field_named_in_error(server):
    async with connect(server) as ws:
        await ws.send(json.dumps({"type": "complete", "id": "f",
                                  "document": {"uri": "u", "prefix": 3, "suffix": ""}}))
        err = json.loads(await ws.recv())
        assert "document.prefix" in err["message"]


async def test_overloaded_and_duplicate_id(server):
    async with connect(server) as ws:
        for i in range(3):
            await ws.send(complete_msg(f"o{i}", PREFIX, uri=f"file:///f{i}.py", mode="free", max_tokens=1500))
        await ws.send(complete_msg("o0", PREFIX, uri="file:///g.py", mode="free", max_tokens=2))
        await ws.send(complete_msg("o3", PREFIX, uri="file:///f3.py", mode="free", max_tokens=2))
        errors = {}
        while len(errors) < 2:
            msg = json.loads(await ws.recv())
            if msg["type"] == "error":
                errors[msg["id"]] = msg["code"]
        assert errors == {"o0": "bad_request", "o3": "overloaded"}
        for i in range(3):
            await ws.send(json.dumps({"type": "cancel", "id": f"o{i}"}))
        results = await collect_all(ws, ["o0", "o1", "o2"])
        assert {r[1]["reason"] for r in results.values()} == {"cancelled"}


async def test_binary_frame_is_an_error_not_a_close(server):
    async with connect(server) as ws:
        await ws.send(b"\x00\x01")
        err = json.loads(await ws.recv())
        assert err["code"] == "bad_request" and err["id"] is None


# Close codes 1009 (oversize frame) and 1007 (invalid UTF-8) are tested in
# test_server_security.py, with another session streaming alongside.


async def test_disconnect_mid_stream_frees_the_request(server):
    async with connect(server) as ws:
        await ws.send(complete_msg("gone", PREFIX, mode="free", max_tokens=400))
        await ws.recv()
    for _ in range(100):
        metrics = get(server, "/metrics")[2].decode()
        running = [line for line in metrics.splitlines() if line.startswith("completer_num_requests_running ")]
        if running and float(running[0].split()[1]) == 0:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("request still running after the client left")


def test_one_line_client(server):
    import subprocess
    import sys

    from latency_bench.harness import ROOT, TOKEN

    done = subprocess.run([sys.executable, "-m", "completer.client", "examples/shapes.py:27:9",
                           "--url", server.ws_url, "--token", TOKEN], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ttft" in done.stderr and "generated" in done.stderr
