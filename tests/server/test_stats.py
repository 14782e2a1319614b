"""The dashboard's figures (/v1/stats) and /metrics.

- Their cost does not grow with the requests served: what the stats keep, and
  what a /v1/stats call allocates, is the same after 1k and after 200k
  requests (a call used to sort every request of the last 15 minutes on the
  event loop: 173 ms at 61k, which stalled every editor's completions).
- Their quantiles stay within the documented bucket error of the exact ones.
- They need the token (they tell when and how much someone types); /healthz
  and the dashboard's page do not.
- The gauges read at scrape time follow a request in flight and go back to
  idle after it: KV blocks per pool, requests in flight, event-loop tasks.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import json
import math
import sys
import time
import tracemalloc
import types

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from completer.server.metrics import Metrics
from completer.server.rolling_stats import RELATIVE_ERROR, Record
from latency_bench.harness import TOKEN, collect, complete_msg, connect, running_server

PREFIX = "def total(items):\n    result = 0\n    for item in items:\n        "


def record(at: float, ttft: float = 0.02, e2e: float = 0.05, itl: float | None = 0.004) -> Record:
    return Record(at=at, ttft=ttft, e2e=e2e, itl=itl, queue=0.001, prefill=0.01, decode=0.03,
                  prompt_tokens=100, cached_tokens=60, generated=8, proposed=6, accepted=3)


def exact(values: list[float], q: float) -> float:
    """The order statistic /v1/stats reports: the value of rank ceil(q * n)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


# -- cost: not growing with the requests served ---------------------------------

def held_bytes(root) -> int:
    """Bytes of the objects reachable from `root`, leaving out code, classes
    and modules (shared by everything, and the same whatever was observed)."""
    shared = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    seen, stack, total = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, shared):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)  # a NumPy array that owns its data counts it
        stack.extend(gc.get_referents(obj))
    return total


def stats_call_peak_bytes(metrics: Metrics) -> int:
    """What one stats() call allocates at its peak (a measure of its work that
    does not depend on the machine's speed)."""
    tracemalloc.start()
    try:
        metrics.stats()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def served_1k_then_200k():
    """Held bytes and a stats() call's peak after 1k requests, then after 200k,
    spread over the same 850 seconds (so the series has as many points)."""
    metrics, now = Metrics(), time.time()
    measured, served = {}, 0
    for count in (1_000, 200_000):
        for i in range(served, count):
            metrics.observe(record(now - i % 850 - 0.5, ttft=0.01 + i % 97 / 1000), "stop", "local")
        served = count
        metrics.stats()  # anything a first call sets up is not growth
        measured[count] = held_bytes(metrics), stats_call_peak_bytes(metrics)
    return measured


def test_stats_keep_the_same_memory_after_200k_requests_as_after_1k(served_1k_then_200k):
    held_1k, held_200k = served_1k_then_200k[1_000][0], served_1k_then_200k[200_000][0]
    # A kept record would be ~150 bytes: 199k of them, 30 MB.
    assert held_200k - held_1k < 64 * 1024, (held_1k, held_200k)


def test_a_stats_call_does_the_same_work_after_200k_requests_as_after_1k(served_1k_then_200k):
    peak_1k, peak_200k = served_1k_then_200k[1_000][1], served_1k_then_200k[200_000][1]
    assert peak_200k <= peak_1k * 1.1, (peak_1k, peak_200k)


# -- accuracy --------------------------------------------------------------------

NOW = 1_700_000_000.25  # a fixed clock: which second a record falls in is known


def test_quantiles_are_within_the_bucket_error_of_the_exact_ones():
    """Every window's and every series point's p50/p95/p99 of three
    lognormal latencies (2 ms to seconds), against sorting the records."""
    rng = np.random.default_rng(7)
    n = 30_000
    ages = rng.uniform(0, 895, n)
    ttft = rng.lognormal(math.log(0.02), 1.0, n)
    e2e = ttft + rng.lognormal(math.log(0.05), 0.7, n)
    itl = rng.lognormal(math.log(0.004), 0.5, n)
    metrics = Metrics(clock=lambda: NOW)
    records = [record(NOW - a, t, e, i if k % 10 else None)  # some requests made one token: no ITL
               for k, (a, t, e, i) in enumerate(zip(ages, ttft, e2e, itl))]
    for r in records:
        metrics.observe(r, "stop", "local")
    stats = metrics.stats()

    def check(figures: dict, chosen: list[Record], where: str) -> None:
        assert figures["requests"] == len(chosen), where
        for key, pick in (("ttft_ms", lambda r: r.ttft), ("e2e_ms", lambda r: r.e2e), ("itl_ms", lambda r: r.itl)):
            values = [pick(r) for r in chosen if pick(r) is not None]
            for q in (0.5, 0.95, 0.99):
                got, want = figures[key][f"p{round(q * 100)}"], exact(values, q) * 1000
                assert abs(got / want - 1) <= RELATIVE_ERROR + 1e-9, (where, key, q, got, want)

    current = math.floor(NOW)
    for name, seconds in (("1m", 60), ("5m", 300), ("15m", 900)):
        chosen = [r for r in records if current - math.floor(r.at) < seconds]
        assert chosen, name
        check(stats["windows"][name], chosen, name)
    steps: dict[int, list[Record]] = {}
    for r in records:
        steps.setdefault(math.floor(r.at) // 10, []).append(r)
    shown = sorted(s for s in steps if s > current // 10 - 90)  # the oldest, partial step is left out
    assert [p["t"] for p in stats["series"]] == [min((s + 1) * 10, NOW) for s in shown]
    for point, step in zip(stats["series"], shown):
        check(point, steps[step], f"step {step}")


def test_the_p99_of_fewer_than_100_requests_is_the_slowest_one_exactly():
    metrics = Metrics(clock=lambda: NOW)
    e2e = [0.2131, 0.1875, 0.2502, 0.1933, 0.3117, 0.2046]
    for value in e2e:
        metrics.observe(record(NOW - 1, e2e=value), "stop", "local")
    window = metrics.stats()["windows"]["1m"]
    assert window["e2e_ms"]["p99"] == max(e2e) * 1000
    assert window["e2e_ms"]["p50"] == pytest.approx(exact(e2e, 0.5) * 1000, rel=RELATIVE_ERROR)


def test_windows_hold_only_their_last_seconds():
    clock = [NOW]
    metrics = Metrics(clock=lambda: clock[0])
    metrics.observe(record(NOW - 120), "stop", "local")
    metrics.observe(record(NOW - 2), "stop", "local")
    metrics.observe_feedback(40, 10)
    windows = metrics.stats()["windows"]
    assert [windows[w]["requests"] for w in ("1m", "5m", "15m")] == [1, 2, 2]
    assert windows["1m"]["accept_rate"] == 0.25
    assert windows["15m"]["cache_hit_rate"] == 0.6 and windows["15m"]["draft_acceptance"] == 0.5
    assert windows["15m"]["breakdown_ms"]["prefill"] == pytest.approx(10)

    clock[0] = NOW + 400  # both requests now older than 5 minutes
    windows = metrics.stats()["windows"]
    assert [windows[w]["requests"] for w in ("1m", "5m", "15m")] == [0, 0, 2]
    assert windows["1m"]["ttft_ms"] == {"p50": None, "p95": None, "p99": None}

    clock[0] = NOW + 900  # the same slot, a horizon later: it holds only the new second
    metrics.observe(record(NOW + 900 - 2, ttft=0.5), "stop", "local")
    stats = metrics.stats()
    assert [stats["windows"][w]["requests"] for w in ("1m", "5m", "15m")] == [1, 1, 1]
    assert stats["windows"]["15m"]["ttft_ms"]["p50"] == 500
    assert [p["requests"] for p in stats["series"]] == [1]


# -- against the real server --------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def get(server, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize("path, headers, expected", [
    ("/metrics", {}, 401),
    ("/metrics", {"Authorization": "Bearer wrong"}, 401),
    (f"/metrics?token={TOKEN}x", {}, 401),
    ("/metrics", BEARER, 200),
    ("/v1/stats", {}, 401),
    ("/v1/stats", {"Authorization": "Bearer wrong"}, 401),
    ("/v1/stats", BEARER, 200),
    (f"/v1/stats?token={TOKEN}", {}, 200),
    ("/dashboard", {}, 200),  # the page itself holds no figures
    ("/healthz", {}, 200),
])
def test_figures_need_the_token_and_health_and_the_page_do_not(server, path, headers, expected):
    status, response_headers, _ = get(server, path, headers)
    assert status == expected
    if status == 401:
        assert response_headers.get("WWW-Authenticate", "").startswith("Bearer")


def test_public_metrics_opens_metrics_only():
    with running_server("server.public_metrics=true") as s:
        assert get(s, "/metrics")[0] == 200
        assert get(s, "/v1/stats")[0] == 401


def scrape(server) -> dict[str, float]:
    status, _, body = get(server, "/metrics", BEARER)
    assert status == 200
    return {sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else ""): sample.value
            for family in text_string_to_metric_families(body.decode()) for sample in family.samples}


def live(server) -> dict:
    """The gauges read at scrape time, from /metrics and /v1/stats (which must
    agree when nothing changed between the two reads: a request decoding
    takes a block every few tokens, so they are read again until it did not)."""
    for _ in range(50):
        m = scrape(server)
        stats = json.loads(get(server, "/v1/stats", BEARER)[2])
        pools = {json.loads(k.removeprefix("completer_kv_blocks_used"))["pool"]: v
                 for k, v in m.items() if k.startswith("completer_kv_blocks_used{")}
        if pools == stats["kv_blocks_used"]:
            break
    assert pools == stats["kv_blocks_used"]
    assert m["completer_requests_in_flight"] == stats["requests_in_flight"]
    return {"blocks": pools, "in_flight": stats["requests_in_flight"], "tasks": m["completer_event_loop_tasks"]}


async def wait_until_idle(server, tasks_at_most: float | None = None) -> dict:
    for _ in range(100):
        now = await asyncio.to_thread(live, server)
        if (now["in_flight"] == 0 and not any(now["blocks"].values())
                and (tasks_at_most is None or now["tasks"] <= tasks_at_most)):
            return now
        await asyncio.sleep(0.1)
    raise AssertionError(f"not back to idle: {now} (tasks then: {tasks_at_most})")


async def test_live_gauges_follow_a_request_in_flight_and_return_to_idle(server):
    idle = await wait_until_idle(server)
    assert set(idle["blocks"]) >= {"target"} and idle["tasks"] >= 1
    async with connect(server) as ws:
        await ws.send(complete_msg("long", PREFIX, mode="free", max_tokens=400, deadline_ms=60000))
        first = json.loads(await ws.recv())
        assert first["type"] == "delta"
        busy = await asyncio.to_thread(live, server)
        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
        await collect(ws, "long")
    assert busy["in_flight"] == 1
    assert busy["blocks"]["target"] > 0, busy  # the prompt's K/V
    assert busy["tasks"] > idle["tasks"], (busy, idle)  # the connection's handler and the request's relay
    await wait_until_idle(server, tasks_at_most=idle["tasks"])
