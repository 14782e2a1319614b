"""Conditional disaggregation: does moving the prefill of long uncached
prompts to a separate worker process keep short keystroke completions fast?

One run, the configurations one after the other on the same seeds and
documents (a fresh `completer serve` each, caches cold):

- off: `disagg.enabled=false`, one engine using every core, chunked prefill;
- on:  `disagg.enabled=true`, one local prefill worker pinned to CPU 1, the
  decode engine pinned to CPU 0, `disagg.threshold_tokens` (1024; 512 with
  `--quick`);
- off_one_core: off, pinned to CPU 0 as on's decode engine is: the decode
  engine's compute held equal, so the difference to on is the long prefill
  moved away (as on a machine where workers get cores of their own).

Workload: `--editors` closed-loop editors type into their own warm documents
(an untimed warm-up request caches each; then one `complete` per keystroke,
the next after the answer plus a 50-150 ms think time), while one more
connection opens a new long document (~`--long-tokens` tokens, pip's sources
concatenated under a unique first line, so nothing is cached; at most
~7.5k tokens, SmolLM2's window being 8192) every `--long-every` seconds (the
next one waits for the last to finish). Every configuration gets the same
documents; each server starts cold.

Reported per configuration: short requests' p50/p99 TTFT (client: frame sent
to first delta, or to `done` when no delta came, e.g. the deadline ended it
first; server: `timings.ttft_ms`), p99 inter-token latency
((total - ttft) / (generated - 1)), share past their deadline; long opens'
TTFT, where they were prefilled and why, K/V bytes and transfer time; the
off/on ratios (aims: short p99 TTFT >= 2x better with disagg on, long TTFT at
most 1.5x worse) and the count of short requests prefilled remotely (must be
0); the `completer_prefill_decisions` lines of `/metrics`.

    python -m latency_bench disagg   # 4 editors, 60 s per configuration -> docs/results/disagg_bench.json
    python -m latency_bench disagg --no-long   # the editors alone: each configuration's baseline
    python -m latency_bench disagg --quick --out /tmp/disagg_quick.json   # 2 editors, 20 s, ~3k-token opens

The JSON holds every sample, the summaries, the machine (with nproc), the
date, the load average around each configuration (a busy machine skews
everything: run it alone) and server log lines that look like trouble.

Past 300 lines: the configurations, the load and the summaries share one
run's servers, so their ratios are side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from completer.checkpoint import load_tokenizer
from completer.evaluate import heldout_files
from completer.model_store import resolve_target
from latency_bench.editors import keep_reading_log
from latency_bench.harness import ROOT, TOKEN, ServerProcess, complete_msg, connect, running_server
from latency_bench.run_results import machine, now, write_result

LONG_DEADLINE_MS = 120_000
COMMON = ("model.context_tokens=8192", "engine.kv_cache_mb=3072")
SUSPICIOUS = ("Traceback", "ERROR", "WARNING", "error", "lost")
console = Console(width=180)  # the table stays whole when piped to a file


def configurations(threshold: int) -> dict[str, tuple[str, ...]]:
    """off and on as the issue poses them; off_one_core holds the decode
    engine's compute equal to on's (one core) and still prefills long
    prompts itself: what moving the prefill away is worth by itself, as on a
    machine where the decode engine keeps its cores and workers get others."""
    return {"off": (*COMMON, "disagg.enabled=false"),
            "on": (*COMMON, "disagg.enabled=true", "disagg.workers=1", "disagg.engine_cpus=[0]",
                   "disagg.worker_cpus=[[1]]", f"disagg.threshold_tokens={threshold}"),
            "off_one_core": (*COMMON, "disagg.enabled=false", "disagg.engine_cpus=[0]")}


# -- documents --------------------------------------------------------------------

def short_documents(corpus: list[str], editors: int, seed: int) -> list[tuple[str, int, int]]:
    """Per editor: (text, cursor, chars it may type). The cursor is a line
    start 4000-6000 chars in (~1000-1500 tokens of warm prefix)."""
    rng = random.Random(seed)
    big = [t for t in corpus if len(t) > 12_000]
    out = []
    for _ in range(editors):
        text = rng.choice(big)
        cursor = text.rfind("\n", 0, rng.randint(4000, 6000)) + 1
        out.append((text, cursor, min(len(text) - cursor - 200, 6000)))
    return out


def long_documents(corpus: list[str], count: int, tokens: int, tokenizer, seed: int) -> list[str]:
    """`count` documents of ~`tokens` tokens: shuffled pip sources joined,
    cut at a line end, under a first line unique to the document."""
    out = []
    for n in range(count):
        rng = random.Random(seed * 7919 + n)
        head = f"# disagg bench: cold open {n}, seed {seed}, nonce {rng.getrandbits(64):016x}\n"
        body = ""
        while len(body) < tokens * 6:
            body += rng.choice(corpus) + "\n"
        ids = tokenizer.encode(head + body)[:tokens]
        text = tokenizer.decode(ids)
        out.append(text[: text.rfind("\n") + 1])
    return out


# -- the clients ------------------------------------------------------------------

async def timed(ws, rid: str, frame: str) -> tuple[float, dict]:
    """Send `frame`; (client TTFT ms: to first delta, or to the terminal frame
    when none came, the terminal frame)."""
    start = time.perf_counter()
    first = None
    await ws.send(frame)
    while True:
        msg = json.loads(await ws.recv())
        if msg.get("id") != rid:
            continue
        if msg["type"] == "delta" and first is None:
            first = time.perf_counter()
        elif msg["type"] in ("done", "error"):
            return ((first or time.perf_counter()) - start) * 1000, msg


def sample(client_ms: float, end: dict) -> dict:
    t = end.get("timings", {})
    gen = t.get("generated_tokens", 0)
    return {"client_ttft_ms": round(client_ms, 1), "outcome": end.get("reason") or f"error:{end.get('code')}",
            "ttft_ms": t.get("ttft_ms"), "itl_ms": (t["total_ms"] - t["ttft_ms"]) / (gen - 1) if gen > 1 else None,
            **{k: t.get(k) for k in ("prompt_tokens", "cached_tokens", "generated_tokens", "prefill",
                                     "prefill_reason", "kv_transfer_bytes", "kv_transfer_ms")}}


async def short_editor(server: ServerProcess, index: int, doc: tuple[str, int, int], warm: asyncio.Barrier,
                       window: dict, deadline_ms: float, seed: int, out: dict) -> None:
    rng = random.Random(seed * 1000 + index)
    text, cursor, room = doc
    suffix, uri = text[cursor + room: cursor + room + 200], f"file:///disagg/short{index}.py"
    async with connect(server) as ws:
        ms, end = await timed(ws, "warm", complete_msg("warm", text[:cursor], suffix, uri=uri,
                                                       deadline_ms=LONG_DEADLINE_MS))
        out["warmups"].append(sample(ms, end))
        await warm.wait()
        for k in range(1, room + 1):
            if time.perf_counter() >= window["stop"]:
                break
            rid = f"k{k}"
            ms, end = await timed(ws, rid, complete_msg(rid, text[:cursor + k], suffix, uri=uri,
                                                        deadline_ms=deadline_ms))
            out["short"].append(sample(ms, end))
            await asyncio.sleep(rng.uniform(0.05, 0.15))


async def long_opener(server: ServerProcess, docs: list[str], started: asyncio.Event, window: dict,
                      every: float, out: dict) -> None:
    async with connect(server) as ws:
        await started.wait()
        for n, text in enumerate(docs):
            due = window["start"] + 1.0 + n * every
            await asyncio.sleep(max(0.0, min(due, window["stop"]) - time.perf_counter()))
            if time.perf_counter() >= window["stop"]:
                break
            rid = f"long{n}"
            ms, end = await timed(ws, rid, complete_msg(rid, text, "\n", uri=f"file:///disagg/long{n}.py",
                                                        deadline_ms=LONG_DEADLINE_MS))
            out["long"].append(sample(ms, end))


async def workload(server: ServerProcess, args, shorts, longs) -> dict:
    out: dict = {"warmups": [], "short": [], "long": []}
    warm = asyncio.Barrier(args.editors + 1)
    window: dict = {"stop": float("inf")}
    started = asyncio.Event()

    async def start_clock() -> None:  # once every editor is warm
        await warm.wait()
        window["start"] = time.perf_counter()
        window["stop"] = window["start"] + args.duration
        started.set()

    opener = [long_opener(server, longs, started, window, args.long_every, out)] if not args.no_long else []
    await asyncio.gather(start_clock(), *opener,
                         *(short_editor(server, i, shorts[i], warm, window, args.deadline_ms, args.seed, out)
                           for i in range(args.editors)))
    out["measured_s"] = round(time.perf_counter() - window["start"], 1)
    return out


def decision_lines(server: ServerProcess) -> list[str]:
    req = urllib.request.Request(server.http + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return [ln for ln in text.splitlines() if ln.startswith(("completer_prefill_decisions_total",
                                                              "completer_kv_transfer_bytes_total"))]


def run_configuration(name: str, settings: tuple[str, ...], args, shorts, longs) -> dict:
    console.print(f"[bold]{name}[/]: " + " ".join(f"--set {s}" for s in settings))
    load_before = os.getloadavg()  # a busy machine (another job) shows here
    with running_server(*settings, model=args.model, timeout=600) as server:
        log = keep_reading_log(server)
        result = asyncio.run(workload(server, args, shorts, longs))
        result["metrics"] = decision_lines(server)
        time.sleep(0.5)
        result["server_log_suspicious"] = [ln.rstrip() for ln in list(log) if any(s in ln for s in SUSPICIOUS)]
        result["server_exit"] = server.proc.poll()
    result["settings"], result["loadavg_before_after"] = list(settings), [load_before, os.getloadavg()]
    return result


# -- figures ----------------------------------------------------------------------

def pct(values: list, q: float) -> float | None:
    """Nearest rank, as the other benchmarks count it."""
    vs = sorted(v for v in values if v is not None)
    return round(vs[max(0, math.ceil(q * len(vs)) - 1)], 1) if vs else None


def mean(values: list) -> float | None:
    vs = [v for v in values if v is not None]
    return round(sum(vs) / len(vs), 1) if vs else None


def summarise(r: dict) -> dict:
    s, lg = r["short"], r["long"]
    col = lambda xs, k: [x[k] for x in xs]  # noqa: E731
    return {
        "short": {"count": len(s), "client_ttft_p50_ms": pct(col(s, "client_ttft_ms"), 0.5),
                  "client_ttft_p99_ms": pct(col(s, "client_ttft_ms"), 0.99), "ttft_p50_ms": pct(col(s, "ttft_ms"), 0.5),
                  "ttft_p99_ms": pct(col(s, "ttft_ms"), 0.99), "itl_p99_ms": pct(col(s, "itl_ms"), 0.99),
                  "past_deadline_share": round(sum(x["outcome"] == "deadline" for x in s) / max(1, len(s)), 4),
                  "outcomes": dict(Counter(col(s, "outcome"))), "prefill": dict(Counter(col(s, "prefill"))),
                  "prefill_reason": dict(Counter(map(str, col(s, "prefill_reason")))),
                  "remote": sum(x["prefill"] == "remote" for x in s),
                  # of those that started (one the deadline ends while waiting reports cached_tokens 0)
                  "uncached_tokens_max": max((x["prompt_tokens"] - x["cached_tokens"] for x in s
                                              if x["generated_tokens"]), default=None)},
        "long": {"count": len(lg), "client_ttft_p50_ms": pct(col(lg, "client_ttft_ms"), 0.5),
                 "ttft_p50_ms": pct(col(lg, "ttft_ms"), 0.5), "ttft_max_ms": pct(col(lg, "ttft_ms"), 1.0),
                 "prompt_tokens_mean": mean(col(lg, "prompt_tokens")), "cached_tokens_sum": sum(
                     x["cached_tokens"] or 0 for x in lg), "outcomes": dict(Counter(col(lg, "outcome"))),
                 "prefill": dict(Counter(col(lg, "prefill"))),
                 "prefill_reason": dict(Counter(map(str, col(lg, "prefill_reason")))),
                 "kv_bytes_mean": mean(col(lg, "kv_transfer_bytes")), "kv_ms_mean": mean(col(lg, "kv_transfer_ms"))},
        "warmups": {"count": len(r["warmups"]), "prefill": dict(Counter(col(r["warmups"], "prefill"))),
                    "prefill_reason": dict(Counter(map(str, col(r["warmups"], "prefill_reason"))))},
    }


def ratio(a, b) -> float | None:
    return round(a / b, 2) if a and b else None


def report(summary: dict, ratios: dict) -> None:
    t = Table(title="disaggregation off vs on")
    for c in ("config", "short n", "p50 TTFT ms", "p99 TTFT ms", "p99 TTFT srv", "p99 ITL ms", "past deadline",
              "long n", "long p50 TTFT ms", "long max TTFT ms", "long prefill", "KV MB/open", "KV ms/open"):
        t.add_column(c, justify="right")
    for name, s in summary.items():
        sh, lg = s["short"], s["long"]
        kv_mb = lg["kv_bytes_mean"] / 1e6 if lg["kv_bytes_mean"] else 0
        t.add_row(name, str(sh["count"]), f"{sh['client_ttft_p50_ms']}", f"{sh['client_ttft_p99_ms']}",
                  f"{sh['ttft_p99_ms']}", f"{sh['itl_p99_ms']}", f"{sh['past_deadline_share']:.1%}",
                  str(lg["count"]), f"{lg['ttft_p50_ms']}", f"{lg['ttft_max_ms']}",
                  " ".join(f"{k}:{v}" for k, v in lg["prefill"].items()), f"{kv_mb:.0f}", f"{lg['kv_ms_mean']}")
    console.print(t)
    console.print(ratios)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--editors", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per configuration")
    p.add_argument("--long-every", type=float, default=8.0)
    p.add_argument("--long-tokens", type=int, default=7000)
    p.add_argument("--configs", default="off,on,off_one_core",
                   help="which to run, in order (off and on are needed for the ratios)")
    p.add_argument("--no-long", action="store_true",
                   help="no long opens: the short editors alone (each configuration's baseline)")
    p.add_argument("--threshold", type=int, default=1024, help="disagg.threshold_tokens of the 'on' run")
    p.add_argument("--deadline-ms", type=float, default=2000.0, help="of the short requests")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "docs/results/disagg_bench.json"))
    p.add_argument("--quick", action="store_true", help="smoke run: 2 editors, 20 s, ~3000-token opens, threshold 512")
    if p.parse_args().quick:  # its defaults; flags given still win
        p.set_defaults(editors=2, duration=20.0, long_tokens=3000, threshold=512)
    args = p.parse_args()
    corpus = [f.text for f in heldout_files()[1]]
    tokenizer = load_tokenizer(resolve_target(args.model))
    shorts = short_documents(corpus, args.editors, args.seed)
    longs = long_documents(corpus, int(args.duration / args.long_every) + 2, args.long_tokens, tokenizer, args.seed)
    raw = {name: run_configuration(name, settings, args, shorts, longs)
           for name, settings in configurations(args.threshold).items() if name in args.configs.split(",")}
    summary = {name: summarise(r) for name, r in raw.items()}
    off, on = summary["off"], summary["on"]
    ratios = {
        "short_p99_ttft_off_over_on": ratio(off["short"]["client_ttft_p99_ms"], on["short"]["client_ttft_p99_ms"]),
        "short_p99_ttft_server_off_over_on": ratio(off["short"]["ttft_p99_ms"], on["short"]["ttft_p99_ms"]),
        "short_p50_ttft_off_over_on": ratio(off["short"]["client_ttft_p50_ms"], on["short"]["client_ttft_p50_ms"]),
        "short_p99_itl_off_over_on": ratio(off["short"]["itl_p99_ms"], on["short"]["itl_p99_ms"]),
        "long_p50_ttft_on_over_off": ratio(on["long"]["ttft_p50_ms"], off["long"]["ttft_p50_ms"]),
        "short_requests_prefilled_remotely_on": on["short"]["remote"],
    }
    if (one := summary.get("off_one_core")) is not None:
        ratios["short_p99_ttft_off_one_core_over_on"] = ratio(one["short"]["client_ttft_p99_ms"],
                                                              on["short"]["client_ttft_p99_ms"])
        ratios["short_p50_ttft_off_one_core_over_on"] = ratio(one["short"]["client_ttft_p50_ms"],
                                                              on["short"]["client_ttft_p50_ms"])
        ratios["long_p50_ttft_on_over_off_one_core"] = ratio(on["long"]["ttft_p50_ms"], one["long"]["ttft_p50_ms"])
    ratios["aims_met"] = {"short p99 TTFT off/on >= 2": (ratios["short_p99_ttft_off_over_on"] or 0) >= 2,
                          "long p50 TTFT on/off <= 1.5": (ratios["long_p50_ttft_on_over_off"] or 9) <= 1.5,
                          "no short request prefilled remotely": on["short"]["remote"] == 0}
    report(summary, ratios)
    for name, r in raw.items():
        for line in r["server_log_suspicious"]:
            print(f"[{name} server log] {line}")
    result = {"date": now(), "machine": msgspec.to_builtins(machine()), "command": " ".join(sys.argv),
              "options": vars(args), "ratios": ratios, "summary": summary,
              "prefill_decisions_metrics": {name: r["metrics"] for name, r in raw.items()},
              "server_log_suspicious": {name: r["server_log_suspicious"] for name, r in raw.items()},
              "samples": {name: {k: r[k] for k in ("warmups", "short", "long", "measured_s", "settings",
                                                   "loadavg_before_after", "server_exit")}
                          for name, r in raw.items()}}
    write_result(Path(args.out), json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
