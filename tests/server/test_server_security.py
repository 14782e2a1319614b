"""Security and observability against the real server: token, Origin, Host,
limits (each while another session keeps streaming), metrics that agree with
the traffic, /v1/stats that agrees with the client's clock, graceful shutdown."""

import asyncio
import http.client
import json
import signal
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from latency_bench.harness import (TOKEN, ServerProcess, collect, complete_msg, connect, in_process_server,
                                   never_reading_client, running_server, scrape, small_buffer_listener)

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


async def more_results(neighbour: asyncio.Task, results: list, than: int, within: float = 120) -> None:
    """Until the neighbour has finished more than `than` requests: it failing
    fails the test at once, a loaded machine only makes the wait longer."""
    async with asyncio.timeout(within):
        while len(results) <= than:
            if neighbour.done():
                await neighbour  # its error, if any
                raise AssertionError(f"the other session stopped after {len(results)} requests")
            await asyncio.sleep(0.02)


async def with_neighbour(server, attack):
    """`attack` while another session streams: it completes requests before,
    during and after the attack, every one of them whole."""
    stop, results = asyncio.Event(), []
    neighbour = asyncio.create_task(streaming_neighbour(server, stop, results))
    try:
        await more_results(neighbour, results, 0)  # streaming
        await attack()
        # The one in flight when the attack ended, then one begun after it.
        await more_results(neighbour, results, len(results) + 1)
    finally:
        stop.set()
        await neighbour
    assert all(results), "the other session was disturbed"


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


def stats(server) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    return json.loads(conn.getresponse().read())


async def test_metrics_and_stats_agree_with_the_traffic():
    with running_server() as server:
        await metrics_scenario(server)


async def metrics_scenario(server):
    before = scrape(server)
    measured, served, generated, prompt = [], [], 0, 0
    async with connect(server) as ws:
        for i in range(6):
            started = time.perf_counter()
            await ws.send(complete_msg(f"m{i}", PREFIX + "t" * i, mode="free", max_tokens=5))
            _, done = await collect(ws, f"m{i}")
            measured.append((time.perf_counter() - started) * 1000)
            served.append(done["timings"]["total_ms"])
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
    # the server timed it (frame read to done sent). Each request's time so is at
    # least its `total_ms` (frame read to its last token) and at most the client's
    # own figure (sent to done read): bounds a loaded machine cannot break (a
    # factor of the client's figure did: its event loop's waits count on its side).
    window = stats(server)["windows"]["1m"]
    assert window["requests"] == 6
    p99 = window["e2e_ms"]["p99"]
    assert max(served) <= p99 <= max(measured), (served, p99, measured)
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

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json").read_text())
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
    server runs in this process, so the test can look at the queue."""
    frames = [complete_msg(f"s{i}", "def f(x):\n    ", uri=f"file:///s{i}.py", mode="free", max_tokens=400)
              for i in range(8)]  # deltas pile up behind the full socket
    loop = asyncio.get_running_loop()
    async with in_process_server("server.send_queue_frames=16", "request.deadline_ms=120000",
                                 sock=small_buffer_listener()) as s:
        app = s.app
        client = await never_reading_client(s.port, frames)
        try:
            for _ in range(2400):  # 120 s: a loaded machine decodes slowly
                if app.metrics.slow_disconnects._value.get() >= 1:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the reader that never reads was not disconnected")
            (slow,) = [session for session in app.sessions if session.too_slow]
            # The bound holds give or take what arrived while the writer was not yet blocked (a busy
            # loop can let several steps' deltas in at once); the 8 requests would have made ~3200.
            queued = slow.outbox.qsize()
            assert queued < 16 + 8 * 16, queued
            async with connect(s.server) as neighbour:
                await neighbour.send(complete_msg("n", PREFIX, mode="free", max_tokens=6))
                deltas, done = await collect(neighbour, "n")
                assert done["type"] == "done" and done["text"] == "".join(deltas)
            assert slow.outbox.qsize() <= queued  # nothing more was queued for the closed reader
            with pytest.raises((ConnectionResetError, EOFError)):  # closed: read what got through, then the end
                while True:
                    if not await asyncio.wait_for(loop.sock_recv(client.sock, 65536), 30):
                        raise EOFError
        finally:
            client.close()


# -- token handling at start ------------------------------------------------------
# Imports here: these tests were added at the end of the file.
import os  # noqa: E402
import re  # noqa: E402
import stat  # noqa: E402
from pathlib import Path  # noqa: E402

from latency_bench.harness import stop_server  # noqa: E402
from support.serve import refused, serve_until_listening, start  # noqa: E402

SHORT = "fifteen-chars-x"  # one under the minimum


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def config_home(tmp_path) -> tuple[dict, Path]:
    """An $XDG_CONFIG_HOME with its completer directory (0700), as the server
    makes it; (the environment to start with, the default token path there)."""
    (tmp_path / "completer").mkdir(mode=0o700)
    return {"XDG_CONFIG_HOME": str(tmp_path), "COMPLETER_TOKEN": ""}, tmp_path / "completer" / "token"


@pytest.mark.parametrize("source", ["--token", "--token-file", "$COMPLETER_TOKEN", "server.token"])
def test_a_token_under_16_characters_is_refused_from_every_source(source, tmp_path):
    args, (env, _) = ["--model", "embedded"], config_home(tmp_path)
    if source == "--token":
        args += ["--token", SHORT]
    elif source == "--token-file":
        args += ["--token-file", str(private_file(tmp_path / "mine", SHORT + "\n"))]
    elif source == "$COMPLETER_TOKEN":
        env["COMPLETER_TOKEN"] = SHORT
    else:
        args += ["--set", f'server.token="{SHORT}"']
    error = refused(*args, env=env)
    assert "15 characters" in error and "at least 16" in error and SHORT not in error


@pytest.mark.parametrize("mode", [0o640, 0o602])  # group may read; others may write
def test_a_token_file_group_or_others_may_read_or_write_is_refused(mode, tmp_path):
    env, path = config_home(tmp_path)
    private_file(path, TOKEN + "\n", mode)
    assert f"chmod 600 {path}" in refused("--model", "embedded", env=env)


def test_a_symlink_at_the_token_path_is_refused_not_followed(tmp_path):
    """Both to an existing private token file, and dangling (creating the
    token through it would write it wherever it points)."""
    env, path = config_home(tmp_path)
    path.symlink_to(private_file(tmp_path / "elsewhere", TOKEN + "\n"))
    assert "symbolic link" in refused("--model", "embedded", env=env)
    path.unlink()
    path.symlink_to(tmp_path / "planted")
    assert "symbolic link" in refused("--model", "embedded", env=env)
    assert not (tmp_path / "planted").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_token_file_another_user_owns_is_refused(tmp_path):
    env, path = config_home(tmp_path)
    os.chown(private_file(path, TOKEN + "\n"), 65534, 65534)
    assert "owned by uid 65534" in refused("--model", "embedded", env=env)


def test_token_on_the_command_line_is_warned_about():
    status, output = serve_until_listening("--model", "embedded", "--token", TOKEN)
    assert status is None, output
    assert any(line.startswith("warning: --token") and "--token-file" in line for line in output.splitlines())


def test_a_missing_token_file_is_created_private_and_kept(tmp_path):
    """Created 0600 in a 0700 directory, whole (no temporary file left
    beside it), and read back unchanged by the next start."""
    env = {"XDG_CONFIG_HOME": str(tmp_path), "COMPLETER_TOKEN": ""}
    path = tmp_path / "completer" / "token"
    status, output = serve_until_listening("--model", "embedded", env=env)
    assert status is None, output
    assert f"token: {path}" in output and "warning" not in output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(token) >= 16 and os.listdir(path.parent) == ["token"]
    status, output = serve_until_listening("--model", "embedded", env=env)
    assert status is None and path.read_text().strip() == token, output


@pytest.mark.parametrize("source", ["--token-file", "$COMPLETER_TOKEN"])
async def test_a_token_from_a_file_or_the_environment_is_the_one_served(source, tmp_path):
    token = "from-" + source.strip("-$").lower() + "-0123456789"
    args, env = ["--model", "embedded"], {"XDG_CONFIG_HOME": str(tmp_path)}
    if source == "--token-file":
        args += ["--token-file", str(private_file(tmp_path / "mine", token + "\n"))]
    else:
        env["COMPLETER_TOKEN"] = token
    proc, lines = start(*args, env=env, until="ready")
    try:
        output = "".join(lines)
        assert "ready" in output and "warning" not in output, output
        server = ServerProcess(proc, int(re.search(r"127\.0\.0\.1:(\d+)/v1/ws", output).group(1)), lines)
        async with connect(server, token=token) as ws:
            await ws.send(json.dumps({"type": "hello"}))
            assert json.loads(await ws.recv())["type"] == "ready"
        with pytest.raises(InvalidStatus):
            async with connect(server, token=TOKEN):
                pass
    finally:
        stop_server(proc)
        proc.stdout.close()
