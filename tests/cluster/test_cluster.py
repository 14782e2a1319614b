"""`completer serve --cluster`: engine replicas on a real local Ray cluster
(Ray Serve), the real front door on an ephemeral port. Greedy completions
equal the single process's; a session's keystrokes stay where their K/V is
warm; a cancel ends the request on its replica; a replica killed mid-stream
loses no request without an answer and is replaced. Protocol conformance
through the cluster is test_server_protocol.py's `cluster` run."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import pytest

from completer.cluster.routing import AffinityTable, prefix_hash, prefix_holders, ranks
from latency_bench.harness import CLUSTER, ROOT, collect, complete_msg, connect, running_server, scrape

DOCS = {
    "file:///proj/shapes.py": "import math\n\n\nclass Circle:\n    def __init__(self, radius):\n        self.",
    "file:///proj/io_utils.py": "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        ",
    "file:///proj/stats.py": "def mean(values):\n    total = 0\n    for v in values:\n        total +=",
}


# -- the routing decision alone (no Ray) -----------------------------------------


def test_a_session_keeps_its_replica_until_it_is_a_margin_busier():
    table = AffinityTable(move_margin=2)
    assert table.choose("s1", 1, {"a": 0, "b": 0}, {}).outcome == "new"
    home = table.home["s1"]
    other = "b" if home == "a" else "a"
    assert table.choose("s1", 1, {home: 2, other: 0}, {}) == (home, "hit")
    assert table.choose("s1", 1, {home: 3, other: 0}, {}) == (other, "moved")
    assert table.choose("s1", 1, {home: 3, other: 0}, {}) == (other, "hit")  # it stays where it moved


def test_new_sessions_spread_over_idle_replicas_and_follow_a_warm_prefix():
    table = AffinityTable(move_margin=4)
    homes = {table.choose(f"s{i}", i, {"a": 0, "b": 0, "c": 0}, {}).replica for i in range(3)}
    assert homes == {"a", "b", "c"}
    holders = prefix_holders({"a": [7], "b": [], "c": [9]})
    assert table.choose("fresh", 9, {"a": 0, "b": 0, "c": 1}, holders) == ("c", "prefix")
    assert table.choose("fresh2", 9, {"a": 0, "b": 0, "c": 5}, holders).outcome == "new"  # too busy to follow


def test_a_dead_replicas_sessions_move_and_the_table_is_bounded():
    table = AffinityTable(move_margin=4, max_keys=3)
    table.choose("s1", 1, {"a": 0}, {})
    table.forget_replica("a")
    assert table.choose("s1", 1, {"b": 0}, {}) == ("b", "moved")
    for i in range(10):
        table.choose(f"k{i}", i, {"b": 0}, {})
    assert len(table.home) == 3 and sum(table.homed.values()) == 3


def test_prefix_hash_names_the_head_and_the_salt():
    tokens = list(range(100))
    assert prefix_hash(tokens, "") == prefix_hash(tokens[:64] + [5] * 40, "")
    assert prefix_hash(tokens, "") != prefix_hash(tokens, "c1")
    assert prefix_hash(tokens, "") != prefix_hash([1] + tokens, "")


def test_the_chosen_replica_is_tried_alone_before_every_other_one():
    assert ranks("b", ["a", "b", "c"]) == [["b"], ["a", "c"]]
    assert ranks("a", ["a"]) == [["a"]]  # no empty rank for Serve to wait on


# -- the real cluster -------------------------------------------------------------


@pytest.fixture(scope="module")
def single():
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def cluster():
    with running_server(*CLUSTER, timeout=300) as s:
        yield s


def ray_address(server) -> str:
    for line in server.log:
        if m := re.search(r"Ray cluster at (\S+)", line):
            return m.group(1)
    raise AssertionError("the front door did not say where its Ray cluster is:\n" + "".join(server.log))


def replica_figures(server) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for key, value in scrape(server).items():
        if key.startswith("completer_cluster_replica{"):
            labels = json.loads(key[len("completer_cluster_replica"):])
            figures.setdefault(labels["replica"], {})[labels["figure"]] = value
    return figures


async def complete_each(server, documents: dict[str, str], ids: list[str], **fields) -> dict[str, dict]:
    """One connection per document, all at once, each asking with the same ids in turn."""
    async def one(uri: str, prefix: str) -> dict:
        out = {}
        async with connect(server) as ws:
            for rid in ids:
                await ws.send(complete_msg(rid, prefix, uri=uri, **fields))
                deltas, done = await collect(ws, rid)
                assert done["type"] == "done", done
                assert done["text"] == "".join(deltas)
                out[rid] = done
        return out

    results = await asyncio.gather(*(one(uri, prefix) for uri, prefix in documents.items()))
    return dict(zip(documents, results))


async def test_greedy_completions_equal_the_single_process_and_never_cross_sessions(single, cluster):
    # One document at a time, the same text as one process: batched with others, a near tie in
    # the logits may go the other way (the batch's shape changes the kernels' sums), here or there.
    fields = dict(mode="free", max_tokens=16, deadline_ms=60000)  # whole answers, on a busy machine too
    expected, alone = {}, {}
    for uri, prefix in DOCS.items():
        expected |= await complete_each(single, {uri: prefix}, ["1", "2"], **fields)
        alone |= await complete_each(cluster, {uri: prefix}, ["1", "2"], **fields)
    for uri in DOCS:
        for rid in ("1", "2"):
            assert expected[uri][rid]["reason"] == "length", expected[uri][rid]
            assert alone[uri][rid]["text"] == expected[uri][rid]["text"], uri
    # Every session at once, with the same request ids: none gets another document's text.
    together = await complete_each(cluster, DOCS, ["1", "2"], **fields)
    for uri in DOCS:
        for rid in ("1", "2"):
            text = together[uri][rid]["text"]
            others = {expected[o][rid]["text"] for o in DOCS if o != uri} - {expected[uri][rid]["text"]}
            assert text not in others, (uri, rid, text)
    assert len({expected[uri]["1"]["text"] for uri in DOCS}) == len(DOCS)


async def type_keys(server, uri: str, prefix: str, keys: str) -> list[dict]:
    """Type `keys` one at a time into the document, waiting for each suggestion."""
    dones = []
    async with connect(server) as ws:
        for i in range(len(keys) + 1):
            rid = f"k{i}"
            await ws.send(complete_msg(rid, prefix + keys[:i], uri=uri, max_tokens=4))
            _, done = await collect(ws, rid)
            assert done["type"] == "done", done
            dones.append(done)
    return dones


async def warm_share(server) -> float:
    """Cached share of the prompt over every keystroke after each document's first."""
    typed = await asyncio.gather(*(type_keys(server, uri, prefix, "value = compute(x)")
                                   for uri, prefix in DOCS.items()))
    later = [d["timings"] for dones in typed for d in dones[1:]]
    return sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later)


async def test_a_sessions_keystrokes_stay_where_their_kv_is_warm(cluster):
    share = await warm_share(cluster)
    metrics = scrape(cluster)
    outcomes = {o: metrics.get(f'completer_cluster_routing_decisions{{"outcome": "{o}"}}', 0)
                for o in ("hit", "prefix", "new", "moved")}
    print(f"affinity router: warm cached share {share:.3f}; decisions {outcomes}")
    assert share >= 0.9
    assert outcomes["hit"] >= 3 * len("value = compute(x)")
    routed = {k: v for k, v in metrics.items() if k.startswith("completer_cluster_requests_routed")}
    assert len(routed) == 2 and all(v > 0 for v in routed.values()), routed  # both replicas used


async def test_rays_default_router_beside_it():
    """The same typing through Serve's own router: its figure, for the record (no affinity promised)."""
    with running_server(*CLUSTER, "cluster.router=ray_default", timeout=300) as server:
        share = await warm_share(server)
    print(f"ray_default router: warm cached share {share:.3f}")
    assert 0 < share <= 1


async def test_cancel_ends_the_request_on_its_replica(cluster):
    async with connect(cluster) as ws:
        await ws.send(complete_msg("long", DOCS["file:///proj/stats.py"], uri="file:///c.py", mode="free",
                                   max_tokens=900, deadline_ms=60000))
        first = json.loads(await ws.recv())
        assert first["type"] == "delta", first
        await ws.send(json.dumps({"type": "cancel", "id": "long"}))
        deltas, done = await asyncio.wait_for(collect(ws, "long"), 10)
        assert done["reason"] == "cancelled"
    for _ in range(40):  # the replicas report every 0.5 s: nothing left running there
        figures = replica_figures(cluster)
        if figures and all(f.get("running", 0) == 0 for f in figures.values()):
            break
        await asyncio.sleep(0.25)
    else:
        raise AssertionError(f"still running on a replica after the cancel: {figures}")


@pytest.fixture
def environ_restored():
    """secure_join sets Ray's environment in this process (Ray reads it when imported): the tests after
    this one, and the processes they start, must not inherit it (a join with loopback's settings fails)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


async def test_a_killed_replica_loses_no_request_and_is_replaced(cluster, environ_restored):
    from completer.cluster.ray_join import secure_join

    # Before Ray is imported: the front door's cluster asks for its token, and is on loopback.
    address = secure_join(ray_address(cluster))
    import ray

    before = set(replica_figures(cluster))
    assert len(before) == 2

    async def stream_then_type(uri: str, prefix: str) -> tuple[dict, dict]:
        async with connect(cluster) as ws:
            await ws.send(complete_msg("s", prefix, uri=uri, mode="free", max_tokens=600, deadline_ms=20000))
            first = json.loads(await ws.recv())
            assert first["type"] in ("delta", "done"), first
            await killed.wait()
            _, during = await asyncio.wait_for(collect(ws, "s"), 30)  # an answer, never a hang
            await ws.send(complete_msg("next", prefix + "x", uri=uri, max_tokens=4))
            _, after = await asyncio.wait_for(collect(ws, "next"), 30)
            return during, after

    killed = asyncio.Event()
    ray.init(address=address, namespace="serve", log_to_driver=False)
    try:
        tasks = [asyncio.create_task(stream_then_type(f"file:///kill{i}.py", p))
                 for i, p in enumerate(list(DOCS.values()) * 2)]
        await asyncio.sleep(1.0)  # every stream under way
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::completer#engine#")]
        assert len(names) == 2, names
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        killed.set()
        results = await asyncio.gather(*tasks)
    finally:
        ray.shutdown()
    during = [d for d, _ in results]
    answered = [d["type"] for d in during]
    lost = [d for d in during if d["type"] == "error"]
    print(f"replica killed mid-stream: {len(during)} requests, {answered.count('done')} done, "
          f"{len(lost)} errors ({sorted({d['code'] for d in lost})})")
    assert all(d["type"] == "done" or d["code"] == "internal" and "replica" in d["message"] for d in during)
    assert all(a["type"] == "done" for _, a in results), [a for _, a in results]  # the next keystroke served
    for _ in range(240):  # Serve replaces it; the router takes the new one in
        now = set(replica_figures(cluster))
        if len(now) == 2 and now != before:
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"no replacement replica: {before} -> {now}")
    new = (now - before).pop()
    for i in range(12):  # new sessions spread to it
        await type_keys(cluster, f"file:///after{i}.py", "def f():\n    return", "")
        if scrape(cluster).get(f'completer_cluster_requests_routed{{"replica": "{new}"}}', 0) > 0:
            break
    else:
        raise AssertionError("the replacement replica was never routed to")


def test_serve_without_cluster_imports_no_ray(single):
    maps = open(f"/proc/{single.proc.pid}/maps").read()
    assert "_raylet" not in maps and "/ray/" not in maps
    code = "import sys, completer.server.app, completer.cli, completer.config; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_cluster_settings_are_checked_at_start():
    out = subprocess.run([sys.executable, "-m", "completer.cli", "serve", "--cluster", "--model", "embedded",
                          "--set", "cluster.replicas=0", "--token", "test-token-1234567890"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("error:") and "cluster.replicas" in out.stderr


async def test_scale_up_and_down_under_traffic_loses_no_request(monkeypatch):
    # Serve's autoscaler on a short clock: load reported every half second.
    monkeypatch.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    settings = (*CLUSTER, "cluster.min_replicas=1", "cluster.max_replicas=2", "cluster.target_ongoing_requests=1",
                "cluster.upscale_delay_s=1", "cluster.downscale_delay_s=3")
    answers: list[dict] = []

    async def typist(server, uri: str, prefix: str, until: asyncio.Event, gap_s: float, **fields) -> None:
        async with connect(server) as ws:
            i = 0
            while not until.is_set():
                rid = f"t{i}"
                await ws.send(complete_msg(rid, prefix + "x" * (i % 7), uri=uri, **fields))
                _, end = await asyncio.wait_for(collect(ws, rid), 30)
                answers.append(end)
                i += 1
                await asyncio.sleep(gap_s)

    async def replicas_become(server, count: int, timeout_s: float) -> set[str]:
        for _ in range(int(timeout_s / 0.5)):
            if len(now := set(replica_figures(server))) == count:
                return now
            await asyncio.sleep(0.5)
        raise AssertionError(f"never {count} replicas: {now}")

    with running_server(*settings, timeout=300) as server:
        assert len(await replicas_become(server, 1, 30)) == 1
        busy, quiet = asyncio.Event(), asyncio.Event()
        heavy = [asyncio.create_task(typist(server, f"file:///up{i}.py", p, busy, 0.0, mode="free", max_tokens=48))
                 for i, p in enumerate(list(DOCS.values()) * 2)]
        light = asyncio.create_task(typist(server, "file:///light.py", DOCS["file:///proj/stats.py"], quiet, 0.3,
                                           max_tokens=4))
        await replicas_become(server, 2, 120)
        up = len(answers)
        busy.set()
        await asyncio.gather(*heavy)
        await replicas_become(server, 1, 120)
        quiet.set()
        await light
    print(f"autoscaled 1 -> 2 -> 1 replicas under traffic: {len(answers)} requests answered "
          f"({up} before the second replica was up)")
    assert answers and all(a["type"] == "done" for a in answers), [a for a in answers if a["type"] != "done"]
    assert len(answers) > up


def link_process(server) -> int:
    """The front door's link to Ray (cluster/link.py): its one child running that module."""
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", "completer.cluster.link"],
                         capture_output=True, text=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def healthz(server) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(server.http + "/healthz", timeout=5) as r:
            return json.loads(r.read())["status"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["status"]


def gcs_of(pid: int) -> int:
    """The GCS server of the local cluster the process `pid` started."""
    for child in subprocess.run(["pgrep", "-f", "gcs_server"], capture_output=True, text=True).stdout.split():
        if subprocess.run(["ps", "-o", "pgid=", "-p", child], capture_output=True, text=True).stdout.strip() \
                == str(pid):
            return int(child)
    raise AssertionError(f"no GCS server in process group {pid}")


@pytest.mark.parametrize("loss", ["link killed", "cluster's GCS killed"])
async def test_the_front_door_losing_its_ray_link_answers_errors_and_recovers(loss, monkeypatch):
    """Ray ends a driver whose cluster is gone (here after 3 s instead of 60);
    the front door is not one, so its editors' connections stay open: what was
    in flight ends with an error that says why, requests meanwhile are refused
    as `overloaded`, and once a new link (here: a new local cluster) is up the
    same connection is served."""
    import os
    import signal

    import time

    monkeypatch.setenv("RAY_gcs_rpc_server_reconnect_timeout_s", "3")
    # No speculation: the in-flight request must outlast Ray's notice of the loss, and a repetitive
    # completion verified in n-gram chunks ran its 900 tokens out first on CI.
    with running_server(*CLUSTER, "cluster.replicas=1", "spec.ngram=false", "spec.draft_model=false",
                        timeout=300) as server:
        async with connect(server) as ws:
            await ws.send(complete_msg("long", "def f():\n    x = [", uri="file:///lost.py", mode="free",
                                       max_tokens=900, deadline_ms=60000))
            assert json.loads(await ws.recv())["type"] in ("delta", "done")
            link = link_process(server)
            os.kill(link if loss == "link killed" else gcs_of(link), signal.SIGKILL)
            killed = time.monotonic()
            _, lost = await asyncio.wait_for(collect(ws, "long"), 30)
            noticed = time.monotonic() - killed
            assert lost["type"] == "error" and lost["code"] == "internal", lost
            assert "lost its connection to the Ray cluster" in lost["message"], lost
            assert healthz(server) == "reconnecting"
            await ws.send(complete_msg("meanwhile", "def g():\n    return", uri="file:///lost.py", max_tokens=4))
            _, meanwhile = await asyncio.wait_for(collect(ws, "meanwhile"), 30)
            assert meanwhile["type"] == "error" and meanwhile["code"] == "overloaded", meanwhile
            for attempt in range(240):  # a new link: Ray started again, the replica loaded again
                await asyncio.sleep(0.5)
                if healthz(server) == "ok":
                    break
            else:
                raise AssertionError("the link never came back:\n" + "".join(server.log[-20:]))
            await ws.send(complete_msg("after", "def g():\n    return", uri="file:///lost.py", max_tokens=4))
            _, after = await asyncio.wait_for(collect(ws, "after"), 60)
            assert after["type"] == "done", after
        print(f"{loss}: in-flight answered {lost['code']!r} {noticed:.1f} s after the kill, meanwhile {meanwhile['code']!r}, "
              f"back after {attempt / 2:.1f} s, next request {after['reason']!r}")
