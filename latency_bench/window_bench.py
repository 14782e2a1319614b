"""How big a window pays (issue #42): first-line exact match at line starts
of held-out code (pip's own sources) with the prompt window at each size,
the same sites, served through the engine as `completer evaluate` serves
them (line mode, greedy, the default drafter), each prompt cold; and what a
cold prompt costs at each size (its prompt tokens and the seconds the sites
took). The default should be the size where exact match stops rising,
provided the keystroke figures hold there (`python -m latency_bench bulk`,
`neovim-jump`, `keystroke`).

    python -m latency_bench window                          # 1024 2048 4096 8192, 100 sites -> docs/results/window_bench.json
    python -m latency_bench window --windows 1024 2048 --sites 40 --out /tmp/w.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from completer.config import EngineConfig
from completer.engine.engine import run_in_passing_thread
from completer.evaluate import completions, heldout_files, hits, line_starts
from completer.loading import load_models
from latency_bench.harness import ROOT
from latency_bench.run_results import machine, now, write_result

console = Console(width=140)


def wilson(hits_: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% interval of a share (Wilson): how far apart two rows must be to differ."""
    if n == 0:
        return 0.0, 0.0
    p = hits_ / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return round(centre - half, 4), round(centre + half, 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--windows", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--sites", type=int, default=100)
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/window_bench.json")
    args = p.parse_args()
    target, draft = run_in_passing_thread(load_models, args.model, "default", "auto")
    corpus, files = heldout_files(own_code_only=True)
    picks = line_starts(files, args.sites, args.seed)
    rows = {}
    for window in args.windows:
        engine = EngineConfig(kv_cache_mb=max(256.0, window * 0.25))  # one full-window request fits both pools
        started = time.perf_counter()
        texts = completions(target, picks, window, draft, engine=engine)
        took = time.perf_counter() - started
        got = hits(texts, picks)
        rows[window] = {"exact_match": round(sum(got) / len(got), 4), "n": len(got), "hits": sum(got),
                        "interval95": wilson(sum(got), len(got)), "seconds": round(took, 1),
                        "seconds_per_site": round(took / len(got), 2), "sites": got}
        console.print(f"window {window}: {sum(got)}/{len(got)} exact ({sum(got) / len(got):.1%}), {took:.0f} s")
    t = Table(title=f"first-line exact match by window ({corpus}, {args.sites} line starts, cold prompts)")
    for c in ("window", "exact match", "95% interval", "hits", "s per site (cold)"):
        t.add_column(c, justify="right")
    for window, r in rows.items():
        lo, hi = r["interval95"]
        t.add_row(str(window), f"{r['exact_match']:.1%}", f"{lo:.1%}-{hi:.1%}", f"{r['hits']}/{r['n']}",
                  str(r["seconds_per_site"]))
    console.print(t)
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "corpus": corpus, "args": vars(args) | {"out": str(args.out)}, "rows": rows})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
