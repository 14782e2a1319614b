"""What reusing K/V costs in suggestions (issue #42): first-line exact match
after a jump, with the prefix cache, moved K/V (`engine.reuse_moved_kv`, an
approximation: keys re-rotated, values computed beside other text) and
warming on, against a full recompute of every prompt, on the same sites.

Each site is reached as an editor reaches it: a request at a line 3-60
lines away in the same file (its document state kept, as a session keeps
it), then, with warming, the heads `completer.warming.warm_heads` lists
after it prefilled as `warm` requests, then the site's own request (line
mode, greedy, the default drafter), the file as it is. The reference row
recomputes every prompt (`engine.prefix_cache=false`, nothing moved).

    python -m latency_bench jump-quality                    # 100 sites -> docs/results/jump_quality.json
    python -m latency_bench jump-quality --sites 20 --out /tmp/jq.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from completer.config import Config, EngineConfig, ModelSection, RequestSection, SpecConfig
from completer.engine.engine import run_in_passing_thread
from completer.engine.request import Request, SamplingParams
from completer.evaluate import heldout_files, hits, line_starts
from completer.loading import load_models
from completer.pipeline import LocalCompleter, RequestOptions
from completer.protocol import Document
from completer.warming import warm_heads
from latency_bench.harness import ROOT
from latency_bench.run_results import machine, now, write_result
from latency_bench.window_bench import wilson

console = Console(width=140)
ROWS = {  # name: (engine settings, warm heads after the request before the jump)
    "recompute": ({"prefix_cache": False, "reuse_moved_kv": False}, 0),
    "reuse": ({}, 0),
    "reuse_and_warming": ({}, 3),  # the defaults
    "warming_no_moved": ({"reuse_moved_kv": False}, 3),
    # Where the texts differ from a recompute: the last tokens' pass (the fused CPU layer's 8-bit
    # activations) rather than the reuse? The same with fp32 activations.
    "warming_fp32_acts": ({"fused_cpu_q8": False}, 3),
    "recompute_fp32_acts": ({"prefix_cache": False, "reuse_moved_kv": False, "fused_cpu_q8": False}, 0),
}
LINE = RequestOptions(max_tokens=48, mode="line")


def jumps_from(picks, seed: int) -> list[int]:
    """For each site, the offset of a line 3-60 lines away in its file (the cursor before the jump)."""
    rng, out = random.Random(seed), []
    for f, cursor, _ in picks:
        starts = [0] + [i + 1 for i, c in enumerate(f.text) if c == "\n"]
        line = f.text.count("\n", 0, cursor)
        near = [n for n in range(max(0, line - 60), min(len(starts), line + 61)) if abs(n - line) >= 3]
        out.append(starts[rng.choice(near)] if near else 0)
    return out


async def row(name: str, target, draft, picks, froms: list[int], window: int) -> dict:
    settings, heads = ROWS[name]
    config = Config(model=ModelSection(context_tokens=window), request=RequestSection(deadline_ms=60_000),
                    engine=EngineConfig(**settings), spec=SpecConfig(draft_model=draft is not None))
    texts, computed, timings = [], [], []
    async with LocalCompleter(target, draft, config) as local:
        for i, ((f, cursor, end), before) in enumerate(zip(picks, froms)):
            uri = Path("/", f.path).as_uri()
            state = local.pipeline.document()
            await local.stream(Document(uri, f.text[:before], f.text[before:]), options=LINE, state=state).finished()
            for n, head in enumerate(warm_heads(state, heads, f.text[:before], f.text[before:])):
                await local.engine.submit(Request(f"warm{i}.{n}", head, SamplingParams(max_tokens=0),
                                                  warm=True)).finished()
            done = await local.stream(Document(uri, f.text[:cursor], f.text[end:]), options=LINE,
                                      state=state).finished()
            texts.append(done.text.rstrip())
            t = done.timings
            computed.append(t.prompt_tokens - t.cached_tokens - t.moved_tokens)
            timings.append({"prompt": t.prompt_tokens, "cached": t.cached_tokens, "moved": t.moved_tokens,
                            "jump_lines": f.text.count("\n", 0, cursor) - f.text.count("\n", 0, before)})
    got = hits(texts, picks)
    computed.sort()
    return {"settings": settings, "warm_windows": heads, "exact_match": round(sum(got) / len(got), 4),
            "hits": sum(got), "n": len(got), "interval95": wilson(sum(got), len(got)),
            "computed_tokens_p50": computed[len(computed) // 2], "sites": got, "texts": texts, "timings": timings}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sites", type=int, default=100)
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/jump_quality.json")
    args = p.parse_args()
    target, draft = run_in_passing_thread(load_models, args.model, "default", "auto")
    corpus, files = heldout_files(own_code_only=True)
    picks = line_starts(files, args.sites, args.seed)
    froms = jumps_from(picks, args.seed)
    rows = {}
    for name in args.rows:
        rows[name] = asyncio.run(row(name, target, draft, picks, froms, args.window))
        r = rows[name]
        console.print(f"{name}: {r['hits']}/{r['n']} exact, {r['computed_tokens_p50']} tokens computed (p50)")
    reference = rows.get("recompute")
    t = Table(title=f"first-line exact match after a jump of 3-60 lines ({corpus}, {args.sites} sites)")
    for c in ("row", "exact match", "95% interval", "hits", "same text as recompute", "tokens computed p50"):
        t.add_column(c, justify="right")
    for name, r in rows.items():
        lo, hi = r["interval95"]
        same = "-" if reference is None else \
            f"{sum(a == b for a, b in zip(r['texts'], reference['texts']))}/{r['n']}"
        r["same_as_recompute"] = same
        t.add_row(name, f"{r['exact_match']:.1%}", f"{lo:.1%}-{hi:.1%}", f"{r['hits']}/{r['n']}", same,
                  str(r["computed_tokens_p50"]))
    console.print(t)
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "corpus": corpus, "args": vars(args) | {"out": str(args.out)}, "rows": rows})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
