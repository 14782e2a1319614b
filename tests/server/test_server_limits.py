"""One connection's limits, held by the real server running in this process
(so a test can look at its state): superseded keystrokes hold no slot, an id
is free once its answer is sent, a connection keeps its recent documents
only, any URI is a name, the prefix cache can be kept per connection, and a
shutdown starts nothing new and ends within its grace."""

import asyncio
import time

import pytest

from latency_bench.harness import (collect, collect_all, complete_msg, connect, in_process_server,
                                   never_reading_client, small_buffer_listener)

PREFIX = "def total(items):\n    result = 0\n    for item in items:\n        "


async def test_a_supersede_storm_never_refuses_the_newest_keystroke():
    """31k of 53k keystrokes got `overloaded` in a 32-session storm: the ones
    they superseded held their slots until the engine's next step."""
    async with in_process_server("server.max_inflight_per_connection=2", "request.deadline_ms=60000") as s:
        async with connect(s.server) as ws:
            ids = [f"k{i}" for i in range(24)]
            for i, rid in enumerate(ids):  # typing faster than the engine steps
                await ws.send(complete_msg(rid, PREFIX + "x" * i, mode="free", max_tokens=8))
            await ws.send(complete_msg("other", PREFIX, uri="file:///proj/other.py", mode="free", max_tokens=4))
            answers = await asyncio.wait_for(collect_all(ws, ids + ["other"]), 120)
    terminal = {rid: t for rid, (_, t) in answers.items()}
    assert [t for t in terminal.values() if t["type"] != "done"] == []
    assert terminal["k23"]["reason"] == terminal["other"]["reason"] == "length"
    assert {terminal[rid]["reason"] for rid in ids[:-1]} <= {"cancelled", "length"}


async def test_an_id_is_free_again_once_its_answer_is_sent():
    async with in_process_server() as s, connect(s.server) as ws:
        for _ in range(20):
            await ws.send(complete_msg("same", PREFIX, mode="free", max_tokens=1))
            _, terminal = await asyncio.wait_for(collect(ws, "same"), 60)
            assert terminal["type"] == "done", terminal


async def test_a_connection_keeps_the_prompt_state_of_its_recent_documents_only():
    """10,000 URIs on one connection once held 426 MB of prompt state."""
    async with in_process_server("server.max_documents_per_connection=4") as s, connect(s.server) as ws:
        for i in range(10):
            await ws.send(complete_msg(f"d{i}", PREFIX, uri=f"file:///proj/m{i}.py", max_tokens=1))
            await asyncio.wait_for(collect(ws, f"d{i}"), 60)
        (session,) = s.app.sessions
        assert list(session.documents) == [f"file:///proj/m{i}.py" for i in range(6, 10)]
        await ws.send(complete_msg("again", PREFIX, uri="file:///proj/m0.py", max_tokens=1))
        _, terminal = await asyncio.wait_for(collect(ws, "again"), 60)
        assert terminal["type"] == "done"


@pytest.mark.parametrize("uri", ["http://[", "file:///" + "x" * 4000 + ".py", "not a uri at all", ""])
async def test_any_uri_is_a_name_and_counts_toward_the_window(uri):
    async with in_process_server() as s, connect(s.server) as ws:
        await ws.send(complete_msg("u", PREFIX, uri=uri, max_tokens=4))
        _, terminal = await asyncio.wait_for(collect(ws, "u"), 60)
    assert terminal["type"] == "done", terminal
    window = s.app.config.model.context_tokens
    assert terminal["timings"]["prompt_tokens"] + 4 <= window


@pytest.mark.parametrize("scope", ["shared", "connection"])
async def test_the_prefix_cache_is_shared_only_within_its_scope(scope):
    """With a shared cache, one connection's `cached_tokens` tells whether
    another's prompt started the same way; `connection` keeps each to its own."""
    prefix = "import os\nimport sys\n\n\n" + "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
    async with in_process_server(f'server.prefix_cache_scope="{scope}"') as s:
        cached = []
        for rid in ("first", "second"):
            async with connect(s.server) as ws:
                for n in (0, 1):  # the second keystroke in the same connection reuses its own prompt
                    await ws.send(complete_msg(f"{rid}{n}", prefix + "x" * n, max_tokens=1))
                    _, terminal = await asyncio.wait_for(collect(ws, f"{rid}{n}"), 60)
                    cached.append(terminal["timings"]["cached_tokens"])
    assert cached[1] > 0 and cached[3] > 0
    assert (cached[2] > 0) is (scope == "shared"), cached


async def test_shutdown_starts_nothing_new():
    async with in_process_server("request.deadline_ms=60000") as s, connect(s.server) as ws:
        await ws.send(complete_msg("long", PREFIX, mode="free", max_tokens=400))
        await ws.recv()
        shutting_down = asyncio.create_task(s.app.shutdown())
        await asyncio.sleep(0)  # it has begun
        await ws.send(complete_msg("late", PREFIX, max_tokens=4))
        answers = await asyncio.wait_for(collect_all(ws, ["long", "late"]), 30)
        await shutting_down
    assert answers["long"][1]["reason"] == "cancelled"
    assert answers["late"][1]["type"] == "error" and answers["late"][1]["code"] == "overloaded"
    assert "shutting down" in answers["late"][1]["message"]


async def test_shutdown_ends_within_its_grace_with_a_reader_that_never_reads():
    """Exit once took 11-16 s, not the 5 s grace: closing waited on a reader
    that would never answer the close handshake."""
    from completer.server.app import SHUTDOWN_GRACE_S

    frames = [complete_msg(f"s{i}", PREFIX, uri=f"file:///s{i}.py", mode="free", max_tokens=400) for i in range(4)]
    async with in_process_server("request.deadline_ms=60000", sock=small_buffer_listener()) as s:
        client = await never_reading_client(s.port, frames)
        try:
            await asyncio.sleep(2)  # deltas pile up behind the full socket
            started = time.perf_counter()
            s.stop.set()
            await asyncio.wait_for(s.serving, 60)
            took = time.perf_counter() - started
        finally:
            client.close()
    assert took < SHUTDOWN_GRACE_S + 1, took


async def test_a_client_that_keeps_sending_is_not_closed_for_a_late_pong_and_a_silent_one_is():
    """websockets' own keepalive (no pong within its timeout: closed) drops a
    live editor whose pong waits behind frames it has not read yet, with its
    requests (issue #31's first soak lost 641 on two connections). Any frame
    heard now counts; three ping periods of silence still close."""
    import json

    from websockets.protocol import State

    period = 0.2
    async with in_process_server(f"server.keepalive_s={period}") as s:
        client = await never_reading_client(s.port, [])  # never reads: no pong ever
        try:
            (session,) = s.app.sessions
            for i in range(30):  # 3 s of typing, 15 ping periods without one pong
                await client.send([json.dumps({"type": "cancel", "id": f"c{i}"})])
                await asyncio.sleep(0.1)
            assert session.ws.state is State.OPEN
            await asyncio.sleep(3 * period + 2 * period + 0.5)  # silent now: closed on the next look
            assert session.ws.state is not State.OPEN
            assert session.ws.protocol.close_sent.code == 1011
            assert s.app.metrics.silent_disconnects._value.get() == 1
        finally:
            client.close()


async def test_a_closed_connections_documents_and_windows_are_freed_at_once_not_by_the_collector():
    """The soak's idle server held ~12,000 retrieval windows of connections long
    closed: the session's cancelled writer task kept its traceback, whose frame
    held the session, so its state waited for a full collection."""
    import gc
    import weakref

    from completer.retrieval import Window

    files = [{"uri": f"file:///proj/lib{i}.py", "text": "\n".join(f"def helper_{i}_{j}(x):\n    return x + {j}"
                                                                  for j in range(100))} for i in range(2)]
    async with in_process_server("model.retrieval=true") as s:
        gc.collect()
        gc.disable()  # what refcounting frees, not the collector
        try:
            async with connect(s.server) as ws:
                await ws.send(complete_msg("1", "x = helper_1_", max_tokens=2, context=files))
                _, terminal = await asyncio.wait_for(collect(ws, "1"), 60)
                assert terminal["type"] == "done", terminal
                (session,) = s.app.sessions
                held = [weakref.ref(session), weakref.ref(session.client),
                        *(weakref.ref(d) for d in session.client.documents.values())]
                assert sum(type(o) is Window for o in gc.get_objects()) > 0  # retrieval cut the files
                del session
            for _ in range(100):
                if not s.app.sessions:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)  # the connection's handler returns
            assert [r for r in held if r() is not None] == []
            assert sum(type(o) is Window for o in gc.get_objects()) == 0
        finally:
            gc.enable()
