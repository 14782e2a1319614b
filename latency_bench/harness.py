"""Start the real `completer serve` (the small embedded models unless the
caller names another, ephemeral port) for tests and benchmarks, and a small
protocol client over the `websockets` library: connect, `complete` frames,
collecting answers, scraping /metrics. The tests import it as
`latency_bench.harness`, as the benchmarks do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import websockets

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-1234567890"  # servers refuse tokens under 16 characters
# `--cluster` on this 2-core machine: a Ray cluster of its own, 2 engine replicas of 1 CPU each,
# dead replicas noticed and load reported every half second.
CLUSTER = ("cluster.enabled=true", "cluster.replicas=2", "cluster.cpus_per_replica=1",
           "cluster.health_check_period_s=0.5", "cluster.routing_stats_period_s=0.5")


def model_arguments(parser) -> None:
    """`--target` and `--draft` as the in-process benchmarks take them."""
    parser.add_argument("--target", default="default", help="as `completer serve --model` (default: SmolLM2-135M)")
    parser.add_argument("--draft", default="default", help="as model.draft: the target's own drafter, if any")


class ServerProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log: list[str]):
        self.proc, self.port, self.log = proc, port, log

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


# The confidence rules off (a request that leaves them out gets the model's whole line): for tests of the
# clients and the server's plumbing on the small embedded model, which is unsure nearly everywhere (the rules
# themselves: tests/server/test_confidence.py), and the typist's `before_confidence` row.
RULES_OFF = ("request.min_first_prob=0", "request.min_token_prob=0", "request.min_line_prob=0")


@contextmanager
def running_server(*settings: str, token: str = TOKEN, timeout: float = 120, port: int = 0,
                   model: str = "embedded", preexec_fn=None):
    """`completer serve --model MODEL` with `--set` settings on `port` (0: an
    ephemeral one); yields once the models are loaded. preexec_fn: run in the
    child before it starts (e.g. a lower open-file limit)."""
    cmd = [sys.executable, "-m", "completer.cli", "serve", "--model", model, "--port", str(port), "--token", token]
    # The compatible routes on an ephemeral port too: 8012, their default, may be another server's.
    for s in ("compat.port=0", *settings):
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=preexec_fn)
    log: list[str] = []
    port = compat = None
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited:\n" + "".join(log))
            log.append(line)
            if m := re.search(r"wss?://127\.0\.0\.1:(\d+)/v1/ws", line):  # wss: with server.tls_cert
                port = int(m.group(1))
            if m := re.search(r"compat API .* on https?://127\.0\.0\.1:(\d+)", line):
                compat = int(m.group(1))
            if line.rstrip().endswith("; ready") and port:
                break
        else:
            raise RuntimeError("server did not become ready:\n" + "".join(log))
        server = ServerProcess(proc, port, log)
        server.compat = compat
        yield server
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sample(server: ServerProcess, name: str, **labels: str) -> float:
    """One sample of /metrics by its name and labels (0 while the counter has no such sample)."""
    key = name + (json.dumps(labels, sort_keys=True) if labels else "")
    return scrape(server).get(key, 0.0)


def scrape(server: ServerProcess) -> dict[str, float]:
    """/metrics as {sample name + its labels as sorted JSON: value}."""
    import http.client

    from prometheus_client.parser import text_string_to_metric_families

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = conn.getresponse().read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else "")
            values[key] = sample.value
    return values


def connect(server: ServerProcess, token: str = TOKEN, **kwargs):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return websockets.connect(server.ws_url, additional_headers=headers, max_size=None, **kwargs)


def complete_msg(request_id: str, prefix: str, suffix: str = "\n", uri: str = "file:///proj/app/main.py",
                 **fields) -> str:
    return json.dumps({"type": "complete", "id": request_id,
                       "document": {"uri": uri, "language": "python", "prefix": prefix, "suffix": suffix},
                       **fields})


async def collect(ws, request_id: str) -> tuple[list[str], dict]:
    """Deltas of `request_id` until its terminal message (done or error)."""
    deltas = []
    while True:
        msg = json.loads(await ws.recv())
        if msg.get("id") != request_id:
            continue
        if msg["type"] == "delta":
            deltas.append(msg["text"])
        elif msg["type"] in ("done", "error"):
            return deltas, msg


async def collect_all(ws, ids: list[str]) -> dict[str, tuple[list[str], dict]]:
    """Deltas and the terminal message of each of `ids`, however they interleave;
    checks that exactly one terminal arrives per id before returning."""
    out: dict[str, tuple[list[str], dict | None]] = {i: ([], None) for i in ids}
    while any(t is None for _, t in out.values()):
        msg = json.loads(await ws.recv())
        rid = msg.get("id")
        if rid not in out:
            continue
        deltas, terminal = out[rid]
        assert terminal is None, f"message after the terminal one for {rid}: {msg}"
        if msg["type"] == "delta":
            deltas.append(msg["text"])
        else:
            out[rid] = (deltas, msg)
    return out


class InProcessServer:
    """The real App serving in this process, for tests that look inside it."""

    def __init__(self, app, port: int, stop, serving):
        self.app, self.port, self.stop, self.serving = app, port, stop, serving
        self.server = ServerProcess(None, port, [])  # what `connect` takes


@asynccontextmanager
async def in_process_server(*settings: str, sock=None):
    """`App` on a listening socket (an ephemeral loopback one unless given),
    the embedded models, `settings` as `--set` items; stops when the block ends."""
    import asyncio
    import socket

    from completer.config import load_config
    from completer.server.app import App

    app = App(load_config(None, ['model.target="embedded"', "compat.port=0", *settings]), TOKEN)
    if sock is None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    ready, stop = asyncio.Event(), asyncio.Event()
    serving = asyncio.create_task(app.serve(stop, lambda port, loaded=None: loaded and ready.set(), sock=sock))
    waiting = asyncio.ensure_future(ready.wait())
    await asyncio.wait([serving, waiting], timeout=120, return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        serving.result()  # raises what stopped it
    waiting.cancel()
    try:
        yield InProcessServer(app, sock.getsockname()[1], stop, serving)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 60)


def small_buffer_listener():
    """A loopback listening socket whose accepted sockets have small send
    buffers (loopback's would otherwise absorb a megabyte before a reader
    that stopped reading is noticed)."""
    import socket

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by accepted sockets
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener


class NeverReadingClient:
    """A WebSocket client on a bare socket that never reads past the
    handshake: no pong, no frame taken (a client library would read into its
    own buffers and answer pings)."""

    def __init__(self, sock, protocol):
        self.sock, self.protocol = sock, protocol

    async def send(self, frames: list[str]) -> None:
        import asyncio

        for frame in frames:
            self.protocol.send_text(frame.encode())
        await asyncio.get_running_loop().sock_sendall(self.sock, b"".join(self.protocol.data_to_send()))

    def close(self) -> None:
        self.sock.close()


async def never_reading_client(port: int, frames: list[str]) -> NeverReadingClient:
    """A `NeverReadingClient` past the handshake that sent `frames`; the caller closes it."""
    import asyncio
    import socket

    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri

    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    protocol = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/ws"))
    handshake = protocol.connect()
    handshake.headers["Authorization"] = f"Bearer {TOKEN}"
    protocol.send_request(handshake)
    await loop.sock_sendall(sock, b"".join(protocol.data_to_send()))
    events = []
    while not events:  # byte by byte: nothing past the 101 is read
        protocol.receive_data(await asyncio.wait_for(loop.sock_recv(sock, 1), 30))
        events = protocol.events_received()
    assert events[0].status_code == 101, events[0]
    client = NeverReadingClient(sock, protocol)
    await client.send(frames)
    return client
