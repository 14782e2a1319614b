"""Disaggregated prefill between processes that reach each other only over a
network: `completer serve` in one network namespace, `completer
prefill-worker` in another, joined by a veth pair (two hosts, as far as
their sockets can tell), and long-context completions whose K/V crossed that
link. Creating namespaces needs root and iproute2 (CI has both); where they
cannot be created the test says why and skips. The same flow over loopback
always runs."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager

import pytest
from prometheus_client.parser import text_string_to_metric_families

from completer.evaluate import heldout_files
from latency_bench.harness import ROOT, TOKEN, collect, complete_msg, connect, running_server, stop_server
from support.netns import linked

PY = sys.executable
START_TIMEOUT_S = 120.0
# The worker must hold K/V interchangeable with the server's: the same model
# and engine shape (block size, prefill chunk), else it refuses the link.
SHARED = ("model.context_tokens=2048", "engine.kv_cache_mb=256")
LISTENING = re.compile(r"prefill worker listening on (\S+):(\d+)")
SERVING = re.compile(r"ws://127\.0\.0\.1:(\d+)/v1/ws")
LONG_CHARS = 12_000  # well over the 2,048-token window: the prompt is cut to it


def disagg_settings(worker: str) -> tuple[str, ...]:
    """The server's: no local worker, `worker` the only one, every prompt over
    64 uncached tokens sent to it (the slack makes remote always the choice).
    No context store: the short request stays short (the long documents sent
    before it on the connection would otherwise be retrieved into its prompt)."""
    return (*SHARED, "disagg.enabled=true", "disagg.workers=0", f'disagg.remote_workers=["{worker}"]',
            "disagg.threshold_tokens=64", "disagg.remote_slack=1000", "server.context_store_chars=0")


def long_requests(n: int) -> list[dict]:
    """`n` long documents, each the start of a different held-out file."""
    _, files = heldout_files()
    files = [f for f in files if len(f.text) > LONG_CHARS + 500]  # sorted by path
    assert len(files) >= n, "too few long held-out files"
    out = []
    for i, f in enumerate(files[:n]):
        cut = f.text.rfind("\n", 0, LONG_CHARS) + 1
        out.append({"id": f"long-{i}", "uri": f"file:///heldout/{f.path}",
                    "prefix": f.text[:cut], "suffix": f.text[cut:cut + 200]})
    return out


SHORT = {"id": "short", "uri": "file:///proj/app/short.py", "prefix": "def add(a, b):\n    return ", "suffix": "\n"}


def check_long_remote(done: dict, log: str) -> None:
    assert done["type"] == "done", f"{done}\n{log}"
    assert done["reason"] in ("stop", "length", "eos"), f"{done}\n{log}"
    t = done["timings"]
    assert t["prompt_tokens"] >= 1500, t
    assert t["prefill"] == "remote", f"{t}\n{log}"
    assert t["prefill_reason"] == "long", t
    assert t["kv_transfer_bytes"] > 0, t


def check_short_local(done: dict, log: str) -> None:
    assert done["type"] == "done", f"{done}\n{log}"
    t = done["timings"]
    assert t["prefill"] == "local", t
    assert t["prefill_reason"] == "short", t
    assert t["kv_transfer_bytes"] == 0, t


# -- processes ------------------------------------------------------------------


class Output:
    """A process's stdout+stderr, drained by a thread (a full pipe would stall
    it), waited on line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self._new = proc, [], queue.SimpleQueue()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, pattern: re.Pattern, what: str, timeout: float = START_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._new.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"{what} exited ({self.proc.wait()}):\n{self.text}")
            if m := pattern.search(line):
                return m
        raise RuntimeError(f"{what}: no {pattern.pattern!r} within {timeout:.0f} s:\n{self.text}")

    @property
    def text(self) -> str:
        return "".join(self.lines)


@contextmanager
def started(cmd: list[str], env: dict[str, str] | None = None):
    """`cmd` running (its Output); stopped, however the block ends."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        yield Output(proc)
    finally:
        stop_server(proc)


def worker_cmd(host: str) -> list[str]:
    cmd = [PY, "-m", "completer.cli", "prefill-worker", "--model", "embedded", "--host", host, "--port", "0"]
    for s in SHARED:
        cmd += ["--set", s]
    return cmd


# -- network namespaces -----------------------------------------------------------


@pytest.fixture
def link():
    with linked(str(os.getpid())) as net:
        yield net


# -- the tests ------------------------------------------------------------------


def test_long_prompts_prefilled_on_a_worker_across_a_network_link_complete_with_their_kv_shipped_over_it(link):
    requests = [*long_requests(3), SHORT]
    with started(link.exec_in(link.b) + worker_cmd(link.B_IP), env={"COMPLETER_TOKEN": TOKEN}) as worker:
        host, port = worker.wait_for(LISTENING, "prefill worker").groups()
        assert host == link.B_IP
        cmd = link.exec_in(link.a) + [PY, "-m", "completer.cli", "serve", "--model", "embedded", "--host",
                                      "127.0.0.1", "--port", "0", "--token", TOKEN]
        for s in disagg_settings(f"{link.B_IP}:{port}"):
            cmd += ["--set", s]
        with started(cmd) as server:
            server_port = int(server.wait_for(SERVING, "server").group(1))
            server.wait_for(re.compile("ready"), "server")
            received_before = link.rx_bytes()
            # The server listens on its namespace's loopback: the client runs there too.
            client = subprocess.run(link.exec_in(link.a) + [PY, str(ROOT / "tests" / "support" / "disagg_client.py"),
                                                            str(server_port)],
                                    input=json.dumps(requests), capture_output=True, text=True, cwd=ROOT,
                                    env={**os.environ, "COMPLETER_TOKEN": TOKEN}, timeout=400)
            received = link.rx_bytes() - received_before
            log = f"client:\n{client.stderr}\nserver:\n{server.text}\nworker:\n{worker.text}"
            assert client.returncode == 0, log
    frames = {f["id"]: f for f in map(json.loads, client.stdout.splitlines())}
    assert sorted(frames) == sorted(r["id"] for r in requests), client.stdout
    for r in requests[:-1]:
        check_long_remote(frames[r["id"]], log)
    check_short_local(frames["short"], log)
    # The K/V came over the veth pair: the server's end received at least that much.
    shipped = sum(frames[r["id"]]["timings"]["kv_transfer_bytes"] for r in requests[:-1])
    assert received >= shipped, (received, shipped)
    assert "Traceback" not in server.text + worker.text, log


async def test_long_prompts_prefilled_on_a_worker_over_loopback_complete_with_their_kv_shipped():
    with started(worker_cmd("127.0.0.1"), env={"COMPLETER_TOKEN": TOKEN}) as worker:
        host, port = worker.wait_for(LISTENING, "prefill worker").groups()
        with running_server(*disagg_settings(f"127.0.0.1:{port}"), model="embedded") as server:
            frames = {}
            async with connect(server) as ws:
                for r in [*long_requests(3), SHORT]:
                    await ws.send(complete_msg(r["id"], r["prefix"], r["suffix"], uri=r["uri"],
                                               deadline_ms=60000, max_tokens=8))
                    _, frames[r["id"]] = await asyncio.wait_for(collect(ws, r["id"]), 120)
            metrics = urllib.request.urlopen(urllib.request.Request(
                server.http + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}), timeout=30).read().decode()
            log = f"server:\n{''.join(server.log)}\nworker:\n{worker.text}"
    for i in range(3):
        check_long_remote(frames[f"long-{i}"], log)
    check_short_local(frames["short"], log)
    assert "Traceback" not in worker.text, log
    # Every decision counted, with its reason; the bytes with them.
    samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for family in text_string_to_metric_families(metrics) for m in family.samples}
    assert samples[("completer_prefill_decisions_total", (("reason", "long"), ("route", "remote")))] == 3
    assert samples[("completer_prefill_decisions_total", (("reason", "short"), ("route", "local")))] == 1
    shipped = sum(frames[f"long-{i}"]["timings"]["kv_transfer_bytes"] for i in range(3))
    assert samples[("completer_kv_transfer_bytes_total", ())] == shipped
    assert samples[("completer_kv_transfer_seconds_count", ())] == 3
    assert samples[("completer_prefill_workers_up", ())] == 1
