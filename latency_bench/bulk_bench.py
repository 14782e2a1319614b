"""A typing editor beside another editor's long file opens: does a keystroke
wait behind bulk work? (`engine.interactive_first`, issue #42.)

One run, the rows one after the other on the same trace and documents (a
fresh `completer serve` each, caches cold, `model.context_tokens = 8192`):

- fifo: `engine.interactive_first = false` (first come, first served);
- interactive: `engine.interactive_first = true` (the default);
- fifo_disagg, interactive_disagg: the same with disaggregation on as a
  user turns it on (`disagg.enabled = true`: one local prefill worker,
  `disagg.threshold_tokens`; no CPUs pinned, so with interactive_first the
  worker shares the engine's cores and gets nothing: `shared_cores`);
- interactive_disagg_pinned: the worker pinned to CPU 1 and the engine to
  CPU 0, as `python -m latency_bench disagg`'s `on`.

Workload: one editor types steadily into a warm document (a held-out file
of 12 KB or more, the cursor at a line start 4-6 KB in; one untimed request
warms it, then the file's own next characters one every `--key-ms` (150),
a `complete` after each, superseding the last, as the replay's editors do:
`replay.completer_editor`), while a second connection opens a new
~`--long-tokens`-token document (nothing cached) every `--long-every`
seconds, the next after the last has its answer. Per row: the typist's
keystrokes answered before the next key (first text, or the answer, before
the next key), TTFT p50/p90/p99 with their counts, the opens' TTFT, and the
server timeline (`done.timings`) of the slowest keystrokes.

    python -m latency_bench bulk                     # 4 rows, 60 s each -> docs/results/bulk_bench.json
    python -m latency_bench bulk --rows fifo interactive --seconds 30 --out /tmp/bulk.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from completer.checkpoint import load_tokenizer
from completer.evaluate import heldout_files
from completer.model_store import resolve_target
from latency_bench.disagg_bench import configurations, long_documents, sample, timed
from latency_bench.editors import keep_reading_log
from latency_bench.harness import ROOT, TOKEN, ServerProcess, complete_msg, connect, running_server
from latency_bench.keystrokes import Document, Key, Trace
from latency_bench.replay import ReplayOptions, completer_editor, summarize
from latency_bench.run_results import machine, now, write_result

OPEN_DEADLINE_MS = 120_000
WARM_S = 2.0  # from the first (warm) request to the first typed key and the first open
console = Console(width=180)


def rows(threshold: int) -> dict[str, tuple[str, ...]]:
    cfg = configurations(threshold)
    on = (*cfg["off"][:-1], "disagg.enabled=true", "disagg.workers=1", f"disagg.threshold_tokens={threshold}")
    return {"fifo": (*cfg["off"], "engine.interactive_first=false"),
            "interactive": (*cfg["off"], "engine.interactive_first=true"),
            "fifo_disagg": (*on, "engine.interactive_first=false"),
            "interactive_disagg": (*on, "engine.interactive_first=true"),
            "interactive_disagg_pinned": (*cfg["on"], "engine.interactive_first=true")}


def steady_trace(text: str, key_s: float, seconds: float, seed: int) -> Trace:
    """Key 0 types nothing (its document is warm by then: `warm`); then one
    character every `key_s`, the file's own, from a line start 4-6 KB in."""
    import random

    rng = random.Random(seed)
    cursor = text.rfind("\n", 0, rng.randint(4000, 6000)) + 1
    room = min(len(text) - cursor - 200, int(seconds / key_s) + 10)
    typed = text[cursor: cursor + room]
    keys = [Key(0.0, 0, cursor, 0, "", "")]
    for i, ch in enumerate(typed):
        end = typed.find("\n", i + 1)
        keys.append(Key(WARM_S if i == 0 else key_s, 0, cursor + i, 0, ch,
                        typed[i + 1: end if end >= 0 else len(typed)] if ch != "\n" else ""))
    return Trace(0, [Document(f"file:///bulk/typist{seed}.py", text[:cursor] + text[cursor + room:])], keys)


async def opener(server: ServerProcess, docs: list[str], start: float, seconds: float, every: float,
                 out: list[dict]) -> None:
    """A new long document every `every` s (after the last one's answer), until `seconds`."""
    async with connect(server) as ws:
        for n, text in enumerate(docs):
            due = start + WARM_S + n * every
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if time.perf_counter() - start >= seconds:  # (WARM_S + the typing)
                return
            rid = f"open{n}"
            ms, end = await timed(ws, rid, complete_msg(rid, text, "\n", uri=f"file:///bulk/open{n}.py",
                                                        deadline_ms=OPEN_DEADLINE_MS))
            out.append(sample(ms, end))


async def warm(server: ServerProcess, trace: Trace) -> dict:
    """The typist's document prefilled before the clock starts (the server's
    prefix cache is shared between connections by default)."""
    doc, key = trace.documents[0], trace.keys[0]
    async with connect(server) as ws:
        _, end = await timed(ws, "warm", complete_msg("warm", doc.text[: key.at], doc.text[key.at:], uri=doc.uri,
                                                      deadline_ms=OPEN_DEADLINE_MS))
    return end


async def workload(server: ServerProcess, trace, opts: ReplayOptions, docs: list[str], every: float,
                   no_long: bool) -> tuple[list, list[dict]]:
    await warm(server, trace)
    samples: list = []
    opens: list[dict] = []
    start = time.perf_counter()
    runs = [completer_editor(trace, server.ws_url, TOKEN, start, opts, samples, lambda: None)]
    if not no_long:
        runs.append(opener(server, docs, start, opts.seconds, every, opens))
    await asyncio.gather(*runs)
    return samples, opens


def slowest(samples: list, n: int = 8) -> list[dict]:
    """The keystrokes that took longest to their first text (or answer), with the server's timeline."""
    timed_ = [s for s in samples if s.next_key_s is not None and (s.ttft_s or s.answer_s) is not None]
    timed_.sort(key=lambda s: -(s.ttft_s if s.ttft_s is not None else s.answer_s))
    return [{"key": s.key, "ttft_ms": round((s.ttft_s or s.answer_s) * 1000, 1), "outcome": s.outcome,
             "next_key_ms": round(s.next_key_s * 1000, 1), "timings": s.timings} for s in timed_[:n]]


def run_row(name: str, settings: tuple[str, ...], args, trace, docs) -> dict:
    console.print(f"[bold]{name}[/]: " + " ".join(f"--set {s}" for s in settings))
    load_before = os.getloadavg()
    opts = ReplayOptions(editors=1, seconds=WARM_S + args.seconds, seed=args.seed, run=name,
                         deadline_ms=args.deadline_ms)
    with running_server(*settings, model=args.model, timeout=600) as server:
        log = keep_reading_log(server)
        samples, opens = asyncio.run(workload(server, trace, opts, docs, args.long_every, args.no_long))
        suspicious = [ln.rstrip() for ln in list(log) if "Traceback" in ln or "ERROR" in ln]
    warm, samples = samples[0], samples[1:]
    typing = summarize(samples, args.deadline_ms) | {"warm_up": warm.outcome}
    for k in ("finished_sites", "ttft_sites", "line_sites"):
        typing.pop(k)
    reasons = Counter((o["prefill"], str(o["prefill_reason"])) for o in opens)
    return {"settings": list(settings), "typing": typing, "slowest": slowest(samples),
            "open_prefill": {f"{where}/{why}": n for (where, why), n in reasons.items()},
            "opens": opens, "open_count": len(opens),
            "open_ttft_ms": sorted(o["client_ttft_ms"] for o in opens),
            "server_log_suspicious": suspicious, "loadavg_before_after": [load_before, os.getloadavg()]}


def report(results: dict) -> None:
    t = Table(title="typing beside long file opens")
    for c in ("row", "keys", "before next key", "TTFT p50", "p90", "p99", "opens", "open TTFT p50 ms", "errors"):
        t.add_column(c, justify="right")
    for name, r in results.items():
        ty, opens = r["typing"], r["open_ttft_ms"]
        t.add_row(name, str(ty["keystrokes"]), f"{ty['served_before_next_key']:.1%}", str(ty["ttft_p50_ms"]),
                  str(ty["ttft_p90_ms"]), str(ty["ttft_p99_ms"]) + f" (n {ty['ttft_n']})", str(r["open_count"]),
                  str(opens[len(opens) // 2]) if opens else "-", str(ty["errors"]))
    console.print(t)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", default=list(rows(1024)), choices=list(rows(1024)))
    p.add_argument("--seconds", type=float, default=60.0, help="of typing per row")
    p.add_argument("--key-ms", type=float, default=150.0, help="between the typist's keys")
    p.add_argument("--long-every", type=float, default=5.0)
    p.add_argument("--long-tokens", type=int, default=7500)
    p.add_argument("--no-long", action="store_true", help="the typist alone: each row's baseline")
    p.add_argument("--threshold", type=int, default=1024, help="disagg.threshold_tokens of the disagg rows")
    p.add_argument("--deadline-ms", type=float, default=2000.0, help="of the keystrokes")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/bulk_bench.json")
    args = p.parse_args()
    tokenizer = load_tokenizer(resolve_target(args.model))
    docs = long_documents([f.text for f in heldout_files()[1]], int(args.seconds / args.long_every) + 2,
                          args.long_tokens, tokenizer, args.seed)
    big = [f.text for f in heldout_files()[1] if len(f.text) > 12_000]
    trace = steady_trace(big[args.seed % len(big)], args.key_ms / 1000, args.seconds, args.seed)
    every = rows(args.threshold)
    results = {name: run_row(name, every[name], args, trace, docs) for name in args.rows}
    report(results)
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "args": vars(args) | {"out": str(args.out)}, "rows": results})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
