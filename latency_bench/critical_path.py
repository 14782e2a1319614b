"""Where a keystroke's milliseconds go, at one editor.

    python -m latency_bench critical-path   # default config, 30 s of typing
    python -m latency_bench critical-path --set model.precision=int4 --set spec.defer_draft_prefill=false
    python -m latency_bench critical-path --seconds 60 --out /tmp/path.json

One editor replays its trace (`replay.py`: pip's sources typed key by key, a
`complete` per key, each superseding the last) against a fresh `completer
serve` on the default model. Every keystroke that got a first delta is split
along its timeline, which the server reports in `done.timings`:

    prepare      frame read -> the engine has the request (document update, tokens)
    wait         -> the engine thread takes it (a pass already running)
    admission    -> admitted (KV blocks matched and reserved)
    prefill      the target's prefill passes
    to first     -> the first delta leaves the engine (decode passes, the drafter)
    hop          -> the editor reads it (event loop, socket)

Printed for the keystroke at the p50, p90 and p99 time to first delta (nearest
rank over the keystrokes with one; the count is printed), and the median of
each part over all of them. Run it alone: a second process on a 2-core machine
moves every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from collections import Counter
from pathlib import Path

from latency_bench.editors import percentile_ms
from latency_bench.harness import TOKEN, running_server
from latency_bench.keystrokes import corpus_files
from latency_bench.replay import ReplayOptions, Sample, replay, traces

PARTS = ("prepare", "wait", "admission", "prefill", "to_first", "hop")
MIN_SAMPLES = 20  # below this a percentile is not printed


def timeline(s: Sample) -> dict[str, float]:
    """One keystroke's parts, in ms, adding up to its time to first delta as the editor saw it."""
    t = s.timings
    ttft = s.ttft_s * 1000
    admitted = t["queue_ms"]
    prefill = t.get("prefill_ms", 0.0)
    return {
        "prepare": t.get("prepare_ms", 0.0),
        "wait": t.get("wait_ms", 0.0),
        "admission": admitted - t.get("prepare_ms", 0.0) - t.get("wait_ms", 0.0),
        "prefill": prefill,
        "to_first": t["ttft_ms"] - admitted - prefill,
        "hop": ttft - t["ttft_ms"],
        "ttft": ttft,
        "passes": t.get("first_token_passes", 0),
        "new_tokens": t["prompt_tokens"] - t["cached_tokens"],
    }


def critical_path(samples: list[Sample]) -> dict:
    lines = sorted((timeline(s) for s in samples if s.ttft_s is not None and s.timings is not None
                    and s.timings.get("ttft_ms", 0) <= s.timings.get("total_ms", 0)),
                   key=lambda x: x["ttft"])
    gaps = [s for s in samples if s.next_key_s is not None]
    out = {"keystrokes": len(samples), "with_first_delta": len(lines),
           "outcomes": dict(Counter(s.outcome for s in samples)),
           "empty_answers": sum(s.outcome.startswith("done:") and s.outcome != "done:cancelled"
                                and not s.text.strip() for s in samples),
           "served_before_next_key": round(sum(s.ttft_s is not None and s.ttft_s <= s.next_key_s for s in gaps)
                                           / max(1, len(gaps)), 4),
           "next_key_gap_p50_ms": percentile_ms(sorted(s.next_key_s for s in gaps), 0.5), "rows": {}}
    if len(lines) >= MIN_SAMPLES:
        for q in (50, 90, 99):
            at = min(len(lines) - 1, max(0, -(-q * len(lines) // 100) - 1))  # nearest rank
            out["rows"][f"p{q} keystroke"] = {k: round(v, 1) for k, v in lines[at].items()}
        out["rows"]["median of each part"] = {
            k: round(statistics.median(x[k] for x in lines), 1) for k in (*PARTS, "ttft", "passes", "new_tokens")}
    return out


def render(result: dict) -> str:
    cp = result["critical_path"]
    head = (f"{cp['with_first_delta']} of {cp['keystrokes']} keystrokes had a first delta; "
            f"{cp['served_before_next_key']:.1%} before the next key (median gap {cp['next_key_gap_p50_ms']} ms); "
            f"{cp['empty_answers']} answered with no text; outcomes {cp['outcomes']}")
    if not cp["rows"]:
        return head + f"\n(under {MIN_SAMPLES} samples: no percentiles)"
    cols = (*PARTS, "ttft", "passes", "new_tokens")
    rows = ["| keystroke | " + " | ".join(c.replace("_", " ") for c in cols) + " |",
            "|---|" + "---|" * len(cols)]
    for name, row in cp["rows"].items():
        rows.append(f"| {name} | " + " | ".join(f"{row[c]:g}" for c in cols) + " |")
    return head + "\n\n" + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--set", dest="settings", action="append", default=[], help="section.key=value for the server")
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    corpus, files = corpus_files(args.corpus)
    opts = ReplayOptions(editors=1, seconds=args.seconds, seed=args.seed, run="critical-path")
    with running_server(*args.settings, model=args.model, timeout=300) as server:
        samples = asyncio.run(replay(traces(files, opts), opts, url=server.ws_url, token=TOKEN))
    result = {"settings": args.settings, "seconds": args.seconds, "corpus": corpus,
              "critical_path": critical_path(samples)}
    print(render(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
