"""`done.hold_ms` (server/hold.py): 0 for a client alone or while requests
do not wait for the engine, about their wait while clients share a loaded
one; absent with `server.client_hold` off. The rule alone, then the real
server idle and loaded."""

from __future__ import annotations

import asyncio
import json
import random

from completer.engine.request import Timings
from completer.server.hold import HOLD_FROM_MS, HOLD_MOST_MS, HOLD_WINDOW_S, ClientHold
from latency_bench.harness import collect, collect_all, complete_msg, connect, running_server


def waited(ms: float) -> Timings:
    return Timings(queue_ms=ms + 0.5, prepare_ms=0.5, ttft_ms=ms + 10)


def test_the_hold_is_the_median_wait_of_a_shared_loaded_engine_and_zero_otherwise():
    hold = ClientHold()
    assert hold.hold_ms(0.0, "a") == 0.0  # nothing seen: ask at once
    for i, ms in enumerate([80, 90, 70, 85]):
        hold.observe(i * 0.1, "a", waited(ms))
    assert hold.hold_ms(0.4, "a") == 0.0  # alone: its requests wait behind its own superseded work
    for i, ms in enumerate([2, 3, 1, 4, 2]):
        hold.observe(0.5 + i * 0.1, "b", waited(ms))
    assert hold.hold_ms(1.0, "a") == 0.0 == hold.hold_ms(1.0, "b")  # shared, not loaded: median 4 ms
    for i, ms in enumerate([60, 75, 95, 88]):
        hold.observe(1.0 + i * 0.1, "b", waited(ms))
    # 13 waits within the window: 1 2 2 3 4 60 70 75 80 85 88 90 95
    assert HOLD_FROM_MS <= hold.hold_ms(1.4, "a") == 70.0 == hold.hold_ms(1.4, "b")
    assert hold.hold_ms(1.3 + HOLD_WINDOW_S + 0.01, "a") == 0.0  # all of them older than the window
    for i in range(5):
        hold.observe(10 + i * 0.01, "ab"[i % 2], waited(5000))
    assert hold.hold_ms(10.1, "a") == HOLD_MOST_MS


async def test_an_idle_server_says_ask_at_once_and_one_told_not_to_says_nothing():
    with running_server("request.max_tokens=4") as server:
        async with connect(server) as ws:
            await ws.send(complete_msg("a", "def add(a, b):\n    return ", mode="free"))
            _, done = await collect(ws, "a")
    assert done["type"] == "done" and done["hold_ms"] == 0
    with running_server("request.max_tokens=4", "server.client_hold=false") as server:
        async with connect(server) as ws:
            await ws.send(complete_msg("a", "def add(a, b):\n    return ", mode="free"))
            _, done = await collect(ws, "a")
    assert done["type"] == "done" and "hold_ms" not in done


async def test_a_loaded_server_asks_its_clients_to_hold_back():
    rng = random.Random(7)

    def long_prefix() -> str:  # distinct files: nothing cached, every prompt a long prefill
        return "".join(f"value_{rng.randrange(10**6)} = compute({rng.randrange(999)}, name='{rng.random()}')\n"
                       for _ in range(120)) + "def f():\n    return "

    with running_server("request.max_tokens=2", "engine.max_running=2") as server:
        async def editor(k: int) -> list[dict]:
            async with connect(server) as ws:
                ids = [f"{k}-{i}" for i in range(6)]
                for rid in ids:
                    await ws.send(complete_msg(rid, long_prefix(), uri=f"file:///p/{rid}.py", mode="free",
                                               deadline_ms=120000))
                answers = await collect_all(ws, ids)
                return [answers[rid][1] for rid in ids]

        ends = [d for ds in await asyncio.gather(*(editor(k) for k in range(4))) for d in ds]
    assert all(d["type"] == "done" for d in ends), json.dumps(ends)[:2000]
    waits = sorted(d["timings"]["queue_ms"] - d["timings"]["prepare_ms"] for d in ends)
    assert waits[len(waits) // 2] > HOLD_FROM_MS  # the load is real
    last = max(ends, key=lambda d: d["timings"]["total_ms"])
    assert last["hold_ms"] > HOLD_FROM_MS, (last["hold_ms"], waits)
