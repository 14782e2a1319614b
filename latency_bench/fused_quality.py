"""Does the fused CPU layer (#25) change what users are suggested? First-line
exact match at the same held-out sites, served as `completer serve` serves them
(the pipeline, the engine, the default speculation, greedy), with the fused
layer as configured by default (8-bit activations, fp32 K/V), with fp32
activations, with fp16 K/V, and without it (torch's ops), on the same weights
in one run.

    python -m latency_bench fused-quality   # ~55 min on 2 cores (~7 min a row)
    python -m latency_bench fused-quality --rows torch fused --sites "line starts" --lines 50 --out /tmp/q.json

Prints exact match per row at line starts and mid-line, and how often each
row's suggestion is the same text as the torch row's (a torch row runs first
at each kind of site). JSON, written after each row:
docs/results/fused_quality.json.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import msgspec

from completer.config import EngineConfig, SpecConfig
from completer.engine.engine import run_in_passing_thread
from completer.evaluate import heldout_files, line_starts, served
from completer.loading import load_models
from completer.pipeline import RequestOptions
from latency_bench.harness import ROOT

ROWS = {"torch": EngineConfig(fused_cpu=False), "fused": EngineConfig(),  # (8-bit activations, fp32 K/V)
        "fused_fp32_acts": EngineConfig(fused_cpu_q8=False), "fused_kv_fp16": EngineConfig(kv_dtype="fp16")}


class Row(msgspec.Struct):
    row: str
    sites: str
    n: int
    exact_match: float
    same_as_torch: float


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--sites", nargs="+", choices=["line starts", "mid-line"], default=["line starts", "mid-line"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "fused_quality.json")
    args = ap.parse_args()
    target, draft = run_in_passing_thread(load_models, "default", "default", "int4")
    _, files = heldout_files("pip")
    sites = {"line starts": line_starts(files, args.lines, args.seed),
             "mid-line": line_starts(files, args.lines, args.seed + 1, mid_line=True)}
    sites = {kind: picks for kind, picks in sites.items() if kind in args.sites}
    rows, texts = [], {}
    for kind, picks in sites.items():
        for name, engine in ((n, ROWS[n]) for n in args.rows):
            done = asyncio.run(served(target, draft, picks, 1024, RequestOptions(max_tokens=48, mode="line"),
                                      SpecConfig(), engine=engine))
            texts[kind, name] = [d.text for d in done]
            hits = sum(d.text.rstrip() == f.text[c:e].rstrip() for d, (f, c, e) in zip(done, picks))
            same = sum(a == b for a, b in zip(texts[kind, name], texts.get((kind, "torch"), texts[kind, name])))
            rows.append(Row(name, kind, len(picks), hits / len(picks), same / len(picks)))
            print(f"{kind:11} {name:9} exact match {rows[-1].exact_match:6.1%} (n {len(picks)}), "
                  f"same text as torch's {rows[-1].same_as_torch:6.1%}", flush=True)
            args.out.write_bytes(msgspec.json.format(msgspec.json.encode(  # what is done survives a stop
                {"target": target.name, "precision": target.precision, "lines": args.lines, "rows": rows})) + b"\n")


if __name__ == "__main__":
    main()
