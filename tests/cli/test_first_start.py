"""A new user's first start, as the README tells it (issue #32): `completer
serve` on the default model with an empty model cache and no token yet; wait
for what the README says is ready (a line ending in `ready`); then run the
README's client example as written, which must print a whole suggestion,
every time.

What differs from a user's terminal, and why: the server gets `--port 0`
(8750 may be another server's here) and the client finds it through
$COMPLETER_URL, its documented default; the cache and the token's directory
are temporary ($COMPLETER_CACHE, $XDG_CONFIG_HOME); and where the checkout has
no `.venv`, the example's `.venv/bin/python` is this interpreter. The model is
fetched with pip as on a first start (pip's own HTTP cache may answer)."""

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from support.readme_blocks import ROOT, shell_blocks
from latency_bench.harness import stop_server
from support.serve import start


def readme_client_example() -> str:
    (block,) = [b for b in shell_blocks() if b.mark == "client-example"]
    body = block.body.strip()
    if not (ROOT / ".venv" / "bin" / "python").exists():
        body = body.replace(".venv/bin/python", sys.executable)
    return body


def whole_suggestion(line: str) -> bool:
    """The perimeter's expression, complete: it names both sides and its brackets close."""
    return (line.startswith("return") and "self.width" in line and "self.height" in line
            and line.count("(") == line.count(")") and not line.rstrip().endswith(("+", "*", "(", ",")))


def healthz(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.timeout(1200)  # a start on an empty cache (up to 600 s) and the client example (300 s)
def test_a_first_start_then_the_readme_client_example_gives_a_whole_suggestion(tmp_path):
    env = {"COMPLETER_CACHE": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc, lines = start(env=env, until="starting on port", timeout=600)
    try:
        bound = re.search(r"starting on port (\d+)", lines[-1])
        assert bound, "".join(lines)
        port = int(bound.group(1))
        # Bound, not ready: /healthz says so, with how far the start is.
        status, health = healthz(port)
        assert (status, health["status"]) == (503, "loading"), health
        assert 0 <= health["progress"] < 1 and health["message"].startswith("loading, "), health
        for line in proc.stdout:  # what the README says is ready
            lines.append(line)
            if line.rstrip().endswith("ready"):
                break
        output = "".join(lines)
        assert "; ready" in output, output
        # One progress display: the download first (an empty cache), then the load, in order, never going back.
        stages = [line for line in lines if line.startswith("starting: loading, ")]
        assert "downloading the model" in stages[0], output
        assert any("loading the model" in s for s in stages) and any("starting the engine" in s for s in stages)
        percents = [int(re.search(r"loading, (\d+)%", s).group(1)) for s in stages]
        assert percents == sorted(percents), output
        assert healthz(port) == (200, {"status": "ok"})
        assert (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()

        client_env = {**os.environ, **env, "COMPLETER_URL": f"ws://127.0.0.1:{port}/v1/ws"}
        for attempt in range(2):  # each run is a new connection: its document's first request
            done = subprocess.run(["bash", "-c", readme_client_example()], cwd=ROOT, env=client_env,
                                  capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            suggestion = done.stdout.strip().splitlines()[0]
            assert whole_suggestion(suggestion), (attempt, done.stdout, done.stderr)
            assert re.search(r"^\[stop\] ttft", done.stderr, re.M), done.stderr  # ended by the line, not a deadline
    finally:
        stop_server(proc)
        proc.stdout.close()
