"""A replica that hangs (SIGSTOP) holds none of the front door's requests:
each ends at its deadline, a cancel and a superseding keystroke end theirs
at once, whatever the replica does, and a replica that stays silent past a
request's end is routed around until it answers again (issue #43, item 3).

First the cluster engine (cluster/client.py) against a stand-in replica
that answers once and then hangs; then a real local Ray cluster of two
replicas, one of them stopped mid-stream."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import time

import pytest

from completer.cluster import client as cluster_client
from completer.config import ClusterConfig
from completer.cluster.routing import HEALTH, ReplicaHealth
from completer.engine.request import Delta, Finished, Request, SamplingParams, Timings
from latency_bench.harness import CLUSTER, TOKEN, complete_msg, connect, running_server

# -- the cluster engine against a replica that hangs (no Ray cluster) -------------------------


class HangingReplica:
    """A deployment handle whose one replica sends a delta per request, then
    nothing at all (not even the answer to a cancel) until `resume` is set."""

    def __init__(self, name: str | None = "r-hung"):
        self.name = name  # None: routing never finds it a replica (none up, all full)
        self.resume = asyncio.Event()
        self.sent: list[str] = []
        self.cancels: list[str] = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, hop):
        self.sent.append(hop.request.id)
        if self.name is None:
            return Stream(self, hop.request.id, first=None)
        HEALTH.place(hop.request.id, self.name)  # as the router does when it routes
        return Stream(self, hop.request.id)


class Stream:
    def __init__(self, replica: HangingReplica, request_id: str, first: str | None = "x = "):
        self.replica, self.request_id, self.first, self.step, self.cancelled = replica, request_id, first, 0, False

    def cancel(self):
        self.cancelled = True
        self.replica.cancels.append(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.serve.exceptions import RequestCancelledError

        self.step += 1
        if self.step == 1 and self.first is not None:
            return Delta(self.request_id, self.first)
        await self.replica.resume.wait()
        if self.cancelled:
            raise RequestCancelledError(self.request_id)
        if self.step == 2:
            return Finished(self.request_id, "stop", "x = ", Timings())
        raise StopAsyncIteration


def request(rid: str, deadline_s: float | None = None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=100, deadline_s=deadline_s))


async def ends(stream, timeout_s: float) -> tuple[list[str], object, float]:
    """The stream's deltas, its end (Finished or the error) and when the end came."""
    deltas = []
    while True:
        item = await asyncio.wait_for(stream.queue.get(), timeout_s)
        if isinstance(item, Delta):
            deltas.append(item.text)
        else:
            return deltas, item, time.perf_counter()


@pytest.fixture
def health():
    """The process's routing health, clean before and after."""
    HEALTH.stalled.clear()
    HEALTH.placed.clear()
    yield HEALTH
    HEALTH.stalled.clear()
    HEALTH.placed.clear()


async def test_a_hung_replica_holds_no_request_past_its_deadline_cancel_or_supersede(health):
    importlib.import_module("ray.serve.exceptions")  # the engine's first call imports it: not timed below

    replica = HangingReplica()
    engine = cluster_client.ClusterEngine(replica, ClusterConfig(enabled=True))
    start = time.perf_counter()
    timed = engine.submit(request("timed", deadline_s=0.5), supersede="s/a.py", ends_others=False)
    cancelled = engine.submit(request("cancelled"), supersede="s/a.py", ends_others=False)
    old = engine.submit(request("old"), supersede="s/b.py")
    await asyncio.sleep(0.1)  # each has its first delta; the replica hangs from here
    engine.cancel("cancelled")
    text, done, at = await ends(cancelled, 1)
    assert isinstance(done, Finished) and done.reason == "cancelled" and done.text == "".join(text) == "x = "
    assert at - start < 0.5
    newer = engine.submit(request("newer", deadline_s=5), supersede="s/b.py")
    superseded_at = time.perf_counter()
    _, done, at = await ends(old, 1)
    assert isinstance(done, Finished) and done.reason == "cancelled" and at - superseded_at < 0.2
    text, done, at = await ends(timed, 2)
    assert isinstance(done, Finished) and done.reason == "deadline" and done.text == "".join(text) == "x = "
    assert 0.5 <= at - start <= 0.5 + cluster_client.DEADLINE_SLACK_S + 0.3
    assert {r.split("/", 1)[1] for r in replica.cancels} == {"timed", "cancelled", "old"}  # still told
    # Silent past those ends: stalled, and the router passes over it while another replica is up.
    await asyncio.sleep(cluster_client.STALLED_AFTER_S * 1.6)
    assert health.stalled == {"r-hung"}
    assert health.usable(["r-hung", "r-ok"]) == ["r-ok"]
    assert health.usable(["r-hung"]) == ["r-hung"]  # the only one left still takes requests
    replica.resume.set()  # it answers again: routed to again
    await asyncio.sleep(0.05)
    assert health.stalled == set()
    _, done, _ = await ends(newer, 1)
    assert done.reason == "stop"  # its replica's own end
    await asyncio.sleep(0.05)
    assert not health.placed  # nothing left behind


async def test_a_request_no_replica_takes_ends_overloaded_its_grace_past_its_deadline(health):
    importlib.import_module("ray.serve.exceptions")

    replica = HangingReplica(name=None)
    engine = cluster_client.ClusterEngine(replica, ClusterConfig(enabled=True, answer_grace_s=0.3))
    start = time.perf_counter()
    _, error, at = await ends(engine.submit(request("waits", deadline_s=0.2)), 2)
    assert getattr(error, "code", None) == "overloaded", error
    assert 0.5 <= at - start < 0.8
    assert not health.stalled  # nothing to hold against a replica
    replica.resume.set()
    await asyncio.sleep(0.05)


def test_a_stalled_replica_is_skipped_only_while_another_is_usable():
    h = ReplicaHealth()
    assert h.stall("a") and not h.stall("a")
    assert h.usable(["a", "b"]) == ["b"] and h.usable(["a"]) == ["a"]
    h.keep({"b"})  # "a" left the deployment
    assert h.usable(["a", "b"]) == ["a", "b"]
    h.stall("b")
    assert h.answered("b") and not h.answered("b") and h.snapshot() == []


# -- a real cluster, one replica stopped mid-stream ----------------------------------------------


def v1_stats(server) -> dict:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/stats", headers={"Authorization": f"Bearer {TOKEN}"})
    return json.loads(conn.getresponse().read())


async def cluster_figures(server, until, timeout_s: float, what: str) -> dict:
    """/v1/stats' `cluster` (the router's and replicas' figures, reported every 0.5 s) once `until` holds."""
    for _ in range(int(timeout_s / 0.1)):
        figures = (await asyncio.to_thread(v1_stats, server)).get("cluster", {})
        if figures and until(figures):
            return figures
        await asyncio.sleep(0.1)
    raise AssertionError(f"never {what}: {figures}")


class Inbox:
    """Every message of a connection, by request id, with when it came."""

    def __init__(self, ws):
        self.ws = ws
        self.got: dict[str, list[tuple[float, dict]]] = {}
        self.task = asyncio.create_task(self._read())

    async def _read(self):
        async for raw in self.ws:
            msg = json.loads(raw)
            self.got.setdefault(msg.get("id"), []).append((time.monotonic(), msg))

    async def first(self, rid: str, timeout_s: float) -> tuple[float, dict]:
        for _ in range(int(timeout_s / 0.01)):
            if self.got.get(rid):
                return self.got[rid][0]
            await asyncio.sleep(0.01)
        raise AssertionError(f"no answer to {rid} in {timeout_s} s")

    async def end(self, rid: str, timeout_s: float) -> tuple[float, dict, str]:
        """When its done (or error) came, that message, and the text of its deltas."""
        for _ in range(int(timeout_s / 0.01)):
            for at, msg in self.got.get(rid, ()):
                if msg["type"] in ("done", "error"):
                    text = "".join(m["text"] for _, m in self.got[rid] if m["type"] == "delta")
                    return at, msg, text
            await asyncio.sleep(0.01)
        raise AssertionError(f"{rid} did not end in {timeout_s} s: {self.got.get(rid, [])[-3:]}")


async def test_a_stopped_replica_ends_nothing_late_and_new_requests_go_to_the_other():
    uri, prefix = "file:///hung.py", "def f():\n    x = ["
    long = dict(mode="free", max_tokens=900, deadline_ms=60000)
    # No speculation: the streams must outlast the steps below.
    with running_server(*CLUSTER, "spec.ngram=false", "spec.draft_model=false", timeout=300) as server:
        figures = await cluster_figures(server, lambda f: len(f.get("replicas", {})) == 2, 60, "two replicas")
        async with connect(server) as ws:
            inbox = Inbox(ws)
            await ws.send(complete_msg("s", prefix, uri=uri, **long))
            await inbox.first("s", 60)
            figures = await cluster_figures(server, lambda f: sum(f["routed"].values()) == 1, 10, "s routed")
            hung = next(r for r, n in figures["routed"].items() if n == 1)
            other = next(r for r in figures["replicas"] if r != hung)
            pid = int(figures["replicas"][hung]["pid"])
            # The same document without superseding: the same route key, the same replica.
            await ws.send(complete_msg("c", prefix, uri=uri, supersede=False, **long))
            await inbox.first("c", 30)
            sent_d = time.monotonic()
            await ws.send(complete_msg("d", prefix, uri=uri, supersede=False, mode="free", max_tokens=900,
                                       deadline_ms=2000))
            _, first_d = await inbox.first("d", 1.5)
            assert first_d["type"] == "delta", first_d
            os.kill(pid, signal.SIGSTOP)
            try:
                await ws.send(json.dumps({"type": "cancel", "id": "c"}))
                cancel_sent = time.monotonic()
                at, done, text = await inbox.end("c", 3)
                assert done["type"] == "done" and done["reason"] == "cancelled" and done["text"] == text, done
                cancel_s = at - cancel_sent
                assert cancel_s < 1.0

                at, done, text = await inbox.end("d", 4)
                assert done["type"] == "done" and done["reason"] == "deadline", done
                assert done["text"] == text and text  # the text so far
                deadline_s = at - sent_d
                assert deadline_s <= 2.75

                figures = await cluster_figures(server, lambda f: hung in f.get("stalled", ()), 5,
                                                f"{hung} marked stalled")
                assert figures["routed"][hung] == 3  # s, c and d were all on it
                routed_other = figures["routed"].get(other, 0)

                await ws.send(complete_msg("s2", prefix + "1", uri=uri, max_tokens=8, deadline_ms=30000))
                superseded = time.monotonic()
                at, done, _ = await inbox.end("s", 3)
                assert done["type"] == "done" and done["reason"] == "cancelled", done
                supersede_s = at - superseded
                assert supersede_s < 1.0
                _, done, _ = await inbox.end("s2", 30)
                assert done["type"] == "done" and done["reason"] != "deadline", done  # served, by the other

                async with connect(server) as ws2:
                    inbox2 = Inbox(ws2)
                    await ws2.send(complete_msg("n", "def g():\n    return", uri="file:///new.py", max_tokens=8,
                                                deadline_ms=30000))
                    _, done, _ = await inbox2.end("n", 30)
                    assert done["type"] == "done" and done["reason"] != "deadline", done
                    inbox2.task.cancel()
                figures = await cluster_figures(
                    server, lambda f: f["routed"].get(other, 0) >= routed_other + 2, 5, "s2 and n routed")
                assert figures["routed"][hung] == 3 and hung in figures["stalled"]
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            # It answers the cancels it was sent: routed to again.
            await cluster_figures(server, lambda f: hung not in f.get("stalled", ()), 30, f"{hung} answering again")
            inbox.task.cancel()
        print(f"replica stopped mid-stream: cancel answered in {cancel_s:.2f} s, 2 s deadline in {deadline_s:.2f} s, "
              f"supersede in {supersede_s:.2f} s; routed to again {time.monotonic() - resumed:.1f} s after SIGCONT")
