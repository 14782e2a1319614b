"""What a /v1/stats call costs the event loop, by requests served in the last
15 minutes: the per-second histograms it reads now (completer/server/rolling_stats.py)
against sorting every kept request per window and per 10 s step, as it did
before. Both measured side by side, alternating, on the same requests (spread
over the last 15 minutes); also what recording one request costs each.

    python -m latency_bench stats [--sizes 1000 61000 200000] [--out bench-results/stats.json]

Ratios are what count (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

from completer.server.metrics import Metrics
from completer.server.rolling_stats import SERIES_STEP_S, WINDOWS, Record
from latency_bench.run_results import write_result


class SortingStats:
    """The figures /v1/stats gives, from every kept request, sorted per call."""

    def __init__(self) -> None:
        self.records: deque[Record] = deque(maxlen=200_000)

    def add(self, r: Record) -> None:
        self.records.append(r)

    @staticmethod
    def _quantiles(values: list[float]) -> list[float | None]:
        ordered = sorted(values)
        return [ordered[max(0, math.ceil(q * len(ordered)) - 1)] if ordered else None for q in (0.5, 0.95, 0.99)]

    def _figures(self, rs: list[Record]) -> dict:
        return {"requests": len(rs), "ttft": self._quantiles([r.ttft for r in rs]),
                "e2e": self._quantiles([r.e2e for r in rs]),
                "itl": self._quantiles([r.itl for r in rs if r.itl is not None]),
                "sums": [sum(getattr(r, k) for r in rs) for k in ("queue", "prefill", "decode", "prompt_tokens",
                                                                 "cached_tokens", "proposed", "accepted")]}

    def stats(self, now: float) -> dict:
        kept = [r for r in self.records if now - r.at < max(WINDOWS.values())]
        windows = {name: self._figures([r for r in kept if now - r.at < s]) for name, s in WINDOWS.items()}
        steps: dict[int, list[Record]] = {}
        for r in kept:
            steps.setdefault(int(r.at // SERIES_STEP_S), []).append(r)
        return {"windows": windows, "series": [self._figures(steps[s]) for s in sorted(steps)]}


def requests(n: int, now: float, seed: int = 0) -> list[Record]:
    rng = np.random.default_rng(seed)
    ages = np.sort(rng.uniform(0, 899, n))[::-1]  # oldest first, as they were served
    ttft = rng.lognormal(math.log(0.02), 1.0, n)
    return [Record(at=now - a, ttft=t, e2e=t * 2.5, itl=t / 5, queue=0.001, prefill=t * 0.8, decode=t * 1.5,
                   prompt_tokens=400, cached_tokens=300, generated=8, proposed=6, accepted=4)
            for a, t in zip(ages.tolist(), ttft.tolist())]


def seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(n: int, repeats: int) -> dict:
    now = time.time()
    records = requests(n, now)
    metrics, sorting = Metrics(clock=lambda: now), SortingStats()
    start = time.perf_counter()
    for r in records:
        metrics.rolling.add_request(r)
    record_new = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for r in records:
        sorting.add(r)
    record_old = (time.perf_counter() - start) / n
    metrics.stats()  # the first call clears the slots no request used
    new, old = [], []
    for _ in range(repeats):  # alternating, so both see the same machine
        new.append(seconds(metrics.stats))
        old.append(seconds(lambda: sorting.stats(now)))
    new_s, old_s = statistics.median(new), statistics.median(old)
    return {"requests": n, "stats_call_ms": {"histograms": new_s * 1000, "sorting": old_s * 1000},
            "sorting_over_histograms": old_s / new_s,
            "record_us": {"histograms": record_new * 1e6, "sorting": record_old * 1e6}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 61_000, 200_000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = [measure(n, args.repeats) for n in args.sizes]
    print(f"{'requests':>9} {'histograms ms':>14} {'sorting ms':>11} {'sorting/hist':>13} "
          f"{'record µs (hist / deque)':>25}")
    for row in rows:
        call, rec = row["stats_call_ms"], row["record_us"]
        print(f"{row['requests']:>9} {call['histograms']:>14.2f} {call['sorting']:>11.2f} "
              f"{row['sorting_over_histograms']:>12.1f}x {rec['histograms']:>14.2f} / {rec['sorting']:.2f}")
    if args.out:
        write_result(args.out, {"command": " ".join(sys.argv), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
