"""Security and observability against the real server: token, Origin, Host,
limits (each while another session keeps streaming), metrics that agree with
the traffic, /v1/stats that agrees with the client's clock, graceful shutdown."""

import asyncio
import http.client
import json
import signal
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.exceptions import ConnectionClosed, InvalidStatus

from server_harness import TOKEN, ServerProcess, collect, complete_msg, connect, running_server

PREFIX = "def total(items):\n    result = 0\n    for item in items:\n        "


@pytest.fixture(scope="module")
def server():
    with running_server("server.max_frame_bytes=65536") as s:
        yield s


def status_of(server, path, headers):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", path, headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                       "Sec-WebSocket-Version": "13",
                                       "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", **headers})
    status = conn.getresponse().status
    conn.close()
    return status


async def streaming_neighbour(server, stop: asyncio.Event, results: list):
    """Another editor session that keeps completing while the test misbehaves."""
    async with connect(server) as ws:
        i = 0
        while not stop.is_set():
            await ws.send(complete_msg(f"n{i}", PREFIX + "x" * (i % 3), mode="free", max_tokens=6))
            deltas, done = await collect(ws, f"n{i}")
            results.append(done["type"] == "done" and done["text"] == "".join(deltas))
            i += 1


async def with_neighbour(server, attack):
    stop, results = asyncio.Event(), []
    neighbour = asyncio.create_task(streaming_neighbour(server, stop, results))
    await asyncio.sleep(0.3)
    before = len(results)
    await attack()
    await asyncio.sleep(0.3)
    stop.set()
    await neighbour
    assert len(results) > before and all(results), "the other session was disturbed"


@pytest.mark.parametrize("headers, path, expected", [
    ({}, "/v1/ws", 401),
    ({"Authorization": "Bearer wrong"}, "/v1/ws", 401),
    ({"Authorization": f"Bearer {TOKEN}", "Origin": "http://evil.example"}, "/v1/ws", 403),
    ({"Authorization": f"Bearer {TOKEN}", "Host": "evil.example:80"}, "/v1/ws", 403),
    ({"Host": "rebind.example"}, "/healthz", 403),
    ({}, f"/v1/ws?token={TOKEN}", 101),
    ({"Authorization": f"Bearer {TOKEN}", "Origin": "http://127.0.0.1:{port}"}, "/v1/ws", 101),
])
async def test_handshake_checks(server, headers, path, expected):
    headers = {k: v.replace("{port}", str(server.port)) for k, v in headers.items()}

    async def attack():
        assert await asyncio.to_thread(status_of, server, path, headers) == expected

    await with_neighbour(server, attack)


async def test_oversize_and_invalid_utf8_close_only_their_connection(server):
    async def attack():
        async with connect(server) as ws:
            await ws.send("y" * 70000)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1009
        async with connect(server) as ws:
            await ws.send(b"\xc3\x28", text=True)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
            assert closed.value.rcvd.code == 1007

    await with_neighbour(server, attack)


async def test_client_library_sees_401():
    with running_server() as s:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(s, token="bad"):
                pass
        assert refused.value.response.status_code == 401


def scrape(server) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else "")
            values[key] = sample.value
    return values


def stats(server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/stats")
    return json.loads(conn.getresponse().read())


async def test_metrics_and_stats_agree_with_the_traffic():
    with running_server() as server:
        await metrics_scenario(server)


async def metrics_scenario(server):
    before = scrape(server)
    measured, generated, prompt = [], 0, 0
    async with connect(server) as ws:
        for i in range(6):
            started = time.perf_counter()
            await ws.send(complete_msg(f"m{i}", PREFIX + "t" * i, mode="free", max_tokens=5))
            _, done = await collect(ws, f"m{i}")
            measured.append((time.perf_counter() - started) * 1000)
            generated += done["timings"]["generated_tokens"]
            prompt += done["timings"]["prompt_tokens"]
        await ws.send(json.dumps({"type": "feedback", "id": "m5", "accepted_chars": 1}))
        await ws.send(json.dumps({"type": "hello"}))
        await ws.recv()  # feedback is processed in order before this
    after = scrape(server)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    finished = sum(v for k, v in delta.items() if k.startswith("completer_request_success_total"))
    assert finished == 6
    assert delta["completer_generation_tokens_total"] == generated
    assert delta["completer_prompt_tokens_total"] == prompt
    assert delta["completer_feedback_accepted_chars_total"] == 1
    assert delta["completer_e2e_request_latency_seconds_count"] == 6
    # This server saw only these 6 requests: /v1/stats' p99 is the slowest one as
    # the server timed it (frame read to done sent), a little under the
    # client's own figure, well within one histogram bucket of it.
    window = stats(server)["windows"]["1m"]
    assert window["requests"] == 6
    p99 = window["e2e_ms"]["p99"]
    assert max(measured) - 10 <= p99 <= max(measured)
    assert stats(server)["series"], "no time series"


def test_graceful_shutdown_ends_requests_with_done():
    async def scenario(s):
        async with connect(s) as ws:
            await ws.send(complete_msg("long", PREFIX, mode="free", max_tokens=2000, deadline_ms=60000))
            first = json.loads(await ws.recv())
            assert first["type"] == "delta"
            s.proc.send_signal(signal.SIGTERM)
            deltas, done = await collect(ws, "long")
            return [first["text"]] + deltas, done

    with running_server() as s:
        deltas, done = asyncio.run(scenario(s))
        assert done["reason"] == "cancelled" and done["text"] == "".join(deltas)
        assert s.proc.wait(timeout=30) == 0


async def test_grafana_dashboard_uses_metrics_the_server_exports(server):
    """Every metric the shipped Grafana dashboard queries exists in /metrics."""
    import re
    from pathlib import Path

    async with connect(server) as ws:  # labelled counters appear with their first sample
        await ws.send(complete_msg("g", PREFIX, mode="free", max_tokens=2))
        await collect(ws, "g")
        await ws.send(json.dumps({"type": "feedback", "id": "g", "accepted_chars": 0}))

    dashboard = json.loads((Path(__file__).resolve().parents[1] / "configs" / "grafana-dashboard.json").read_text())
    exported = {key.split("{")[0] for key in scrape(server)}  # sample names, labels dropped
    queried = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            queried |= set(re.findall(r"completer_[a-z0-9_]+", target["expr"]))
    assert queried, "no queries"
    missing = queried - exported
    assert not missing, missing
    assert any("histogram_quantile(0.99" in t["expr"] for p in dashboard["panels"] for t in p["targets"])


async def test_a_reader_that_never_reads_is_disconnected_and_its_neighbour_goes_on():
    """`server.send_queue_frames` bounds what waits for a reader whose socket
    stopped taking frames: the connection is closed (and counted), the queue
    does not grow without end, and another session keeps completing. The real
    server runs in this process on a listening socket with small kernel
    buffers (loopback's would otherwise absorb a megabyte first); the slow
    reader is a bare socket (a client library would read into its own buffers)."""
    import socket

    from websockets.client import ClientProtocol
    from websockets.uri import parse_uri

    from completer.config import load_config
    from completer.server.app import App

    config = load_config(None, ['model.target="embedded"', "server.send_queue_frames=16",
                                "request.deadline_ms=30000"])
    app = App(config, TOKEN)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited by accepted sockets
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    ready, stop = asyncio.Event(), asyncio.Event()
    serving = asyncio.create_task(app.serve(stop, lambda port, loaded=None: loaded and ready.set(), sock=listener))
    await asyncio.wait_for(ready.wait(), 120)
    loop = asyncio.get_running_loop()
    try:
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
        assert events[0].status_code == 101
        for i in range(8):  # then never read again: deltas pile up behind the full socket
            protocol.send_text(complete_msg(f"s{i}", "def f(x):\n    ", uri=f"file:///s{i}.py", mode="free",
                                            max_tokens=400).encode())
        await loop.sock_sendall(sock, b"".join(protocol.data_to_send()))
        for _ in range(600):
            if app.metrics.slow_disconnects._value.get() >= 1:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the reader that never reads was not disconnected")
        (slow,) = [s for s in app.sessions if s.too_slow]
        # The bound holds give or take what arrived while the writer was not yet blocked (a busy
        # loop can let several steps' deltas in at once); the 8 requests would have made ~3200.
        queued = slow.outbox.qsize()
        assert queued < 16 + 8 * 16, queued
        async with connect(ServerProcess(None, port, [])) as neighbour:
            await neighbour.send(complete_msg("n", PREFIX, mode="free", max_tokens=6))
            deltas, done = await collect(neighbour, "n")
            assert done["type"] == "done" and done["text"] == "".join(deltas)
        assert slow.outbox.qsize() <= queued  # nothing more was queued for the closed reader
        with pytest.raises((ConnectionResetError, EOFError)):  # closed: read what got through, then the end
            while True:
                if not await asyncio.wait_for(loop.sock_recv(sock, 65536), 30):
                    raise EOFError
    finally:
        sock.close()
        stop.set()
        await asyncio.wait_for(serving, 60)
