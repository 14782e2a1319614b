"""`server.request_log`: a JSON line per finished request, from either door,
with its timings and never its text; a file only its user reads; a path
that cannot be opened stops the start with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgspec

from completer.server.request_log import RequestRecord
from latency_bench.harness import ROOT, TOKEN, collect, complete_msg, connect, running_server
from support.compat_http import AUTH, call

SECRET = "def launch_codes_4471(x):\n    return x * "


async def test_each_finished_request_is_one_line_with_its_timings_and_not_its_text(tmp_path):
    path = tmp_path / "requests.jsonl"
    with running_server(f"server.request_log={path}", "request.max_tokens=4") as server:
        async with connect(server) as ws:
            await ws.send(complete_msg("k1", SECRET, "\n", max_tokens=4, mode="free"))
            await collect(ws, "k1")
        reply = call(server.compat, "POST", "/infill", {"input_prefix": SECRET, "input_suffix": "\n", "n_predict": 3},
                     headers=AUTH)
        assert reply.status == 200, reply.raw
    text = path.read_text()
    records = [msgspec.json.decode(line, type=RequestRecord) for line in text.splitlines()]
    assert [(r.route, r.id.rsplit("/")[-1], r.reason in ("length", "eos", "stop", "limit")) for r in records] == \
        [("ws", "k1", True), ("infill", "http1", True)]
    for r in records:
        assert r.timings.prompt_tokens > 10 and r.timings.total_ms >= r.timings.ttft_ms > 0 and r.client
        assert abs(r.arrived - os.path.getmtime(path)) < 120
    assert "launch_codes" not in text and TOKEN not in text
    assert os.stat(path).st_mode & 0o777 == 0o600
    json.loads(text.splitlines()[0])  # plain JSON lines


def test_a_log_path_that_cannot_be_opened_stops_the_start_with_one_line(tmp_path):
    bad = tmp_path / "no" / "such" / "dir" / "log.jsonl"
    done = subprocess.run([sys.executable, "-m", "completer.cli", "serve", "--model", "embedded", "--port", "0",
                           "--token", TOKEN, "--set", "compat.port=0", "--set", f"server.request_log={bad}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "server.request_log" in last and "No such file" in last, done.stderr
