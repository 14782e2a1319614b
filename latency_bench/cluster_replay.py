"""The keystroke replay through a cluster (issue #26): N editors against one
process, one replica, and two replicas with the affinity router and with Ray
Serve's default router, in one run; then the routing decision alone, timed
at 100 replicas and 10,000 editors.

    python -m latency_bench cluster-replay   # ~6 min on 2 cores -> docs/results/cluster_replay.json
    python -m latency_bench cluster-replay --editors 2 --seconds 20 --rows affinity_2 ray_default_2 --out /tmp/c.json

Rows (each a fresh `completer serve` on the default model, the same traces):

- `single`: no cluster (the engine in the front door's process, every core);
- `cluster_1`: one replica holding both cores (what the hop through Ray costs);
- `affinity_2`: two replicas of one core each, the affinity router;
- `ray_default_2`: the same two replicas, Serve's power-of-two-choices router.

`--kill-replica-at S` kills (SIGKILL) one engine replica's process S seconds
into each replay of a row with two replicas: the outcomes then count what
ended with an error, and `unanswered` what got no answer at all.

Per row: keystrokes answered before the next key, TTFT and line percentiles
(with their sample counts), the cached share of prompt tokens (the warm KV a
router keeps or throws away), errors, and from /metrics the router's
decisions by outcome, requests per replica and its time per decision. Run it
alone: a second process on a 2-core machine moves every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from completer.cluster.routing import AffinityTable, prefix_holders, ranks
from latency_bench.editors import keep_reading_log
from latency_bench.harness import ROOT, TOKEN, running_server
from latency_bench.keystrokes import corpus_files
from latency_bench.replay import ReplayOptions, replay, summarize, traces
from latency_bench.run_results import machine, now

KV = "engine.kv_cache_mb=1024"  # every editor's window stays cached in each engine
CLUSTER = ("cluster.enabled=true", "cluster.health_check_period_s=1", "cluster.routing_stats_period_s=1")
ROWS: dict[str, tuple[str, ...]] = {
    "single": (KV,),
    "cluster_1": (KV, *CLUSTER, "cluster.replicas=1", "cluster.cpus_per_replica=2"),
    "affinity_2": (KV, *CLUSTER, "cluster.replicas=2", "cluster.cpus_per_replica=1"),
    "ray_default_2": (KV, *CLUSTER, "cluster.replicas=2", "cluster.cpus_per_replica=1",
                      "cluster.router=ray_default"),
}


def cluster_figures(http: str) -> dict:
    req = urllib.request.Request(f"{http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out: dict = {"outcomes": {}, "routed": {}, "router": {}}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "completer_cluster_routing_decisions":
                out["outcomes"][s.labels["outcome"]] = s.value
            elif s.name == "completer_cluster_requests_routed":
                out["routed"][s.labels["replica"]] = s.value
            elif s.name == "completer_cluster_router":
                out["router"][s.labels["figure"]] = s.value
    return out


def kill_one_replica() -> dict:
    """SIGKILL the newest Serve replica process of the engine deployment (as a crash would)."""
    import os
    import signal
    import subprocess

    pids = subprocess.run(["pgrep", "-n", "-f", "ServeReplica:completer:engine"], capture_output=True,
                          text=True).stdout.split()
    if not pids:
        return {"killed": None}
    os.kill(int(pids[0]), signal.SIGKILL)
    return {"killed": int(pids[0]), "at": now()}


def run_row(name: str, args, files) -> dict:
    runs = {}
    with running_server(*ROWS[name], model=args.model, timeout=600) as server:
        tail = keep_reading_log(server)
        for n in args.editors:
            opts = ReplayOptions(editors=n, seconds=args.seconds, seed=args.seed, run=f"{name}-{n}")
            kill = None
            if args.kill_replica_at is not None and "cluster.replicas=2" in ROWS[name]:
                kill = {}
                timer = threading.Timer(args.kill_replica_at, lambda: kill.update(kill_one_replica()))
                timer.start()
            samples = asyncio.run(replay(traces(files, opts), opts, url=server.ws_url, token=TOKEN))
            summary = summarize(samples)
            if kill is not None:
                timer.cancel()
                summary["replica_kill"] = {"at_s": args.kill_replica_at, **kill}
            summary.pop("finished_sites")
            # Outside the engine: the editor's time to first text less the engine's own (which counts
            # from the arrival, the front door's tokenizing included): WebSocket, event loops and, in
            # a cluster, the hop to the replica and back.
            outside = sorted(s.ttft_s * 1000 - s.timings["ttft_ms"] for s in samples
                             if s.ttft_s is not None and s.timings and s.timings.get("ttft_ms"))
            summary["outside_engine_ms_p50"] = round(outside[len(outside) // 2], 1) if len(outside) >= 20 else None
            summary["outside_engine_n"] = len(outside)
            summary["cluster"] = cluster_figures(server.http)
            runs[str(n)] = summary
        trouble = [line.rstrip() for line in tail if "Traceback" in line or "ERROR" in line]
    return {"settings": list(ROWS[name]), "runs": runs, "server_trouble": trouble[-10:]}


def routing_cost(replicas: int = 100, editors: int = 10_000, decisions: int = 50_000, seed: int = 0) -> dict:
    """The decision `AffinityRouter.choose_replicas` makes per request, alone:
    `editors` route keys over `replicas`, each replica reporting 512 prompt
    heads; loads drawn at random; the ranks built as the router builds them."""
    rng = random.Random(seed)
    names = [f"r{i:03d}" for i in range(replicas)]
    tracemalloc.start()
    table = AffinityTable(move_margin=4)
    holders = prefix_holders({r: [rng.getrandbits(63) for _ in range(512)] for r in names})
    for e in range(editors):
        table.choose(f"door/c{e}/file:///src/f{e}.py", e, dict.fromkeys(names, 0), holders)
    state_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    keys = [f"door/c{e}/file:///src/f{e}.py" for e in (rng.randrange(editors) for _ in range(decisions))]
    load_draws = [{r: rng.randrange(8) for r in names} for _ in range(64)]
    started = time.perf_counter()
    for i, key in enumerate(keys):
        loads = load_draws[i % 64]
        ranks(table.choose(key, 0, loads, holders).replica, list(loads))
    per_decision_us = (time.perf_counter() - started) / decisions * 1e6
    return {"replicas": replicas, "editors": editors, "decisions": decisions,
            "per_decision_us": round(per_decision_us, 1), "state_mb": round(state_bytes / 2**20, 1),
            "keys_held": len(table.home)}


def fmt(v, unit: str = "") -> str:
    return "-" if v is None else f"{v:,.0f}{unit}"


def report(result: dict) -> str:
    lines = ["| row | editors | keys | served before next key | TTFT p50 / p99 (n) | line p50 / p99 (n) | "
             "first text outside the engine p50 (n) | cached share | errors | router: hit / prefix / new / moved | "
             "requests per replica | ms per decision |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        for n, r in row["runs"].items():
            c = r["cluster"]
            o = c["outcomes"]
            routed = " / ".join(f"{v:.0f}" for v in sorted(c["routed"].values(), reverse=True)) or "-"
            decided = c["router"].get("decisions", 0)
            per = f"{c['router']['decision_seconds'] / decided * 1000:.3f}" if decided else "-"
            outcomes = " / ".join(f"{o.get(k, 0):.0f}" for k in ("hit", "prefix", "new", "moved")) if o else "-"
            outside = "-" if r["outside_engine_ms_p50"] is None else f"{r['outside_engine_ms_p50']:.1f} ms"
            lines.append(
                f"| {name} | {n} | {r['keystrokes']} | {r['served_before_next_key']:.1%} | "
                f"{fmt(r['ttft_p50_ms'])} / {fmt(r['ttft_p99_ms'])} ms ({r['ttft_n']}) | "
                f"{fmt(r['e2e_p50_ms'])} / {fmt(r['e2e_p99_ms'])} ms ({r['e2e_n']}) | "
                f"{outside} ({r['outside_engine_n']}) | "
                f"{r['cached_share']:.1%} | {r['errors']} | {outcomes} | {routed} | {per} |")
    for name, row in result["rows"].items():
        for n, r in row["runs"].items():
            if kill := r.get("replica_kill"):
                o = r["outcomes"]
                lines.append(f"\n{name}, {n} editors: replica process {kill.get('killed')} killed "
                             f"{kill['at_s']:.0f} s in; {r['keystrokes']} keystrokes: "
                             + ", ".join(f"{k} {v}" for k, v in sorted(o.items()))
                             + f"; unanswered {o.get('unanswered', 0)}")
    cost = result["routing_cost"]
    lines.append("")
    lines.append(f"Routing decision alone at {cost['replicas']} replicas and {cost['editors']:,} editors "
                 f"({cost['decisions']:,} decisions): {cost['per_decision_us']} us each; affinity table and "
                 f"prefix index {cost['state_mb']} MB.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--editors", nargs="+", type=int, default=[4])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-replica-at", type=float, default=None,
                    help="seconds into each two-replica replay at which one replica's process is killed")
    ap.add_argument("--model", default="default")
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "cluster_replay.json")
    args = ap.parse_args()
    corpus, files = corpus_files(args.corpus)
    result = {"date": now(), "machine": msgspec.to_builtins(machine()), "command": sys.argv, "corpus": corpus,
              "seconds": args.seconds, "editors": args.editors, "rows": {}}
    for name in args.rows:
        print(f"{name} ...", flush=True)
        result["rows"][name] = run_row(name, args, files)
        args.out.write_text(json.dumps(result))
    result["routing_cost"] = routing_cost()
    args.out.write_text(json.dumps(result, indent=1))
    print(report(result))


if __name__ == "__main__":
    main()
