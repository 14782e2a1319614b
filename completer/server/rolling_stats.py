"""The rolling figures behind `/v1/stats` and the dashboard: the last 15
minutes of finished requests and feedback.

They are kept incrementally, so that reading them costs the same whatever
the traffic was (a poller must not stall the event loop every editor
shares): one slot per second of the last 15 minutes, each holding the
second's sums and a log-spaced histogram per latency. A finished request adds
to one slot (O(1)); `/v1/stats` reads the 900 slots; the memory (about 4 MB)
is allocated once, at start. A window is whole seconds: "1m" is the current
second and the 59 before it.

Quantiles come from the histograms: a latency between LOWEST_S and HIGHEST_S
is read back within RELATIVE_ERROR (1.96%) of the exact order statistic (the
value of rank ceil(q * n)). The lowest and highest ranks are kept exactly, so
the p99 of fewer than 100 requests is the slowest one itself, and no estimate
leaves the range of the values seen.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

WINDOWS = {"1m": 60, "5m": 300, "15m": 900}
HORIZON_S = max(WINDOWS.values())
SERIES_STEP_S = 10
assert HORIZON_S % SERIES_STEP_S == 0  # so each step's seconds sit in ten adjacent slots

# The rolling histograms' bins: [LOWEST_S * GROWTH**(i-1), LOWEST_S * GROWTH**i)
# for i in 1..SPAN, with one bin below and one above. A bin is read back as
# the value whose relative distance to both of its edges is the same, so no
# value in it is further than RELATIVE_ERROR from what is read back.
LOWEST_S = 50e-6
HIGHEST_S = 100.0
GROWTH = 1.04
RELATIVE_ERROR = (GROWTH - 1) / (GROWTH + 1)
_LOG_GROWTH = math.log(GROWTH)
SPAN = math.ceil(math.log(HIGHEST_S / LOWEST_S) / _LOG_GROWTH)
NUM_BINS = SPAN + 2
_READ_BACK = np.concatenate((
    [LOWEST_S],
    LOWEST_S * GROWTH ** np.arange(SPAN) * (2 * GROWTH / (1 + GROWTH)),
    [HIGHEST_S]))

QUANTILES = (0.5, 0.95, 0.99)
LATENCIES = ("ttft", "e2e", "itl")
# Per-slot sums: means and rates over any window are sums of these.
SUMS = ("requests", "queue", "prefill", "decode", "prompt_tokens", "cached_tokens", "proposed", "accepted",
        "shown_chars", "accepted_chars")
_COLUMN = {name: i for i, name in enumerate(SUMS)}


class Record(msgspec.Struct, array_like=True):
    """One finished request, as the stats need it (seconds)."""

    at: float
    ttft: float
    e2e: float
    itl: float | None
    queue: float
    prefill: float
    decode: float
    prompt_tokens: int
    cached_tokens: int
    generated: int
    proposed: int
    accepted: int


def bin_of(seconds: float) -> int:
    if seconds < LOWEST_S:
        return 0
    return min(NUM_BINS - 1, 1 + int(math.log(seconds / LOWEST_S) / _LOG_GROWTH))


def quantiles(counts: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """QUANTILES read off histograms `counts` (..., NUM_BINS) whose smallest
    and largest values are `low` and `high` (...): (..., len(QUANTILES)),
    NaN where a histogram is empty."""
    n = counts.sum(axis=-1)[..., None]
    ranks = np.maximum(1, np.ceil(np.array(QUANTILES) * n))
    cumulative = counts.cumsum(axis=-1)
    found = (cumulative[..., None, :] >= ranks[..., None]).argmax(axis=-1)
    low, high = low[..., None], high[..., None]
    values = np.clip(_READ_BACK[found], low, high)
    values = np.where(ranks >= n, high, np.where(ranks <= 1, low, values))
    return np.where(n > 0, values, np.nan)


_NAMES = tuple(f"p{round(q * 100)}" for q in QUANTILES)


def as_ms(row: list[float]) -> dict[str, float | None]:
    """One histogram's quantiles (a row of quantiles().tolist()) as the dashboard reads them."""
    return {name: None if math.isnan(v) else v * 1000 for name, v in zip(_NAMES, row)}


def merge(counts: np.ndarray, low: np.ndarray, high: np.ndarray, sums: np.ndarray,
          axis: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Histograms, smallest and largest values, and sums merged along `axis`."""
    return (counts.sum(axis=axis, dtype=np.int64), low.min(axis=axis, initial=np.inf),
            high.max(axis=axis, initial=-np.inf), sums.sum(axis=axis))


class RollingStats:
    """The last HORIZON_S seconds of finished requests and feedback, one slot
    per second: second s lives in slot s % HORIZON_S, which is cleared when a
    later second takes it over (or a read finds it past the horizon)."""

    def __init__(self) -> None:
        self.second = np.full(HORIZON_S, -1, np.int64)  # the second each slot holds
        self.counts = np.zeros((HORIZON_S, len(LATENCIES), NUM_BINS), np.uint32)
        self.low = np.full((HORIZON_S, len(LATENCIES)), np.inf)
        self.high = np.full((HORIZON_S, len(LATENCIES)), -np.inf)
        self.sums = np.zeros((HORIZON_S, len(SUMS)))

    def _clear(self, slots) -> None:
        self.counts[slots] = 0
        self.low[slots] = np.inf
        self.high[slots] = -np.inf
        self.sums[slots] = 0

    def _slot(self, at: float) -> int | None:
        second = math.floor(at)
        slot = second % HORIZON_S
        held = int(self.second[slot])
        if held > second:  # a later second holds it: this one is past the horizon
            return None
        if held < second:
            self.second[slot] = second
            self._clear(slot)
        return slot

    def add_request(self, r: Record) -> None:
        if (slot := self._slot(r.at)) is None:
            return
        low, high = self.low[slot], self.high[slot]
        for kind, value in enumerate((r.ttft, r.e2e, r.itl)):
            if value is None:
                continue
            self.counts[slot, kind, bin_of(value)] += 1
            low[kind] = min(low[kind], value)
            high[kind] = max(high[kind], value)
        self.sums[slot] += (1, r.queue, r.prefill, r.decode, r.prompt_tokens, r.cached_tokens, r.proposed,
                            r.accepted, 0, 0)  # in SUMS' order

    def add_feedback(self, at: float, shown: int, accepted: int) -> None:
        if (slot := self._slot(at)) is None:
            return
        self.sums[slot, _COLUMN["shown_chars"]] += shown
        self.sums[slot, _COLUMN["accepted_chars"]] += accepted

    def _expire(self, current: int) -> None:
        """Make every slot hold its second of the horizon ending at `current`
        (one that held another second, or none, is cleared), so that reads
        need not check what each slot holds."""
        expected = current - (current - np.arange(HORIZON_S)) % HORIZON_S
        stale = np.flatnonzero(self.second != expected)
        if stale.size:
            self.second[stale] = expected[stale]
            self._clear(stale)

    def _merged(self, parts: list[slice]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The slots in `parts`, merged."""
        each = [merge(self.counts[p], self.low[p], self.high[p], self.sums[p]) for p in parts]
        return merge(*(np.stack(field) for field in zip(*each)))

    @staticmethod
    def _last(current: int, seconds: int) -> list[slice]:
        """The slots of the `seconds` seconds up to `current`: one run of
        adjacent slots, or two where it wraps around."""
        start, end = (current - seconds + 1) % HORIZON_S, current % HORIZON_S + 1
        return [slice(start, end)] if start < end else [slice(start, HORIZON_S), slice(0, end)]

    def summary(self, now: float) -> tuple[dict[str, dict], list[dict]]:
        """The WINDOWS' figures and the series, at `now`."""
        current = math.floor(now)
        self._expire(current)
        rows = self._rows()
        return self._windows(current, rows), self._series(current, now, rows)

    def _rows(self) -> tuple[np.ndarray, ...]:
        """The slots merged per row of SERIES_STEP_S adjacent ones: each row
        is a step's seconds, but for the current step's row (see _series)."""
        def by_row(a: np.ndarray) -> np.ndarray:
            return a.reshape((HORIZON_S // SERIES_STEP_S, SERIES_STEP_S) + a.shape[1:])

        return merge(by_row(self.counts), by_row(self.low), by_row(self.high), by_row(self.sums), axis=1)

    def _windows(self, current: int, rows: tuple[np.ndarray, ...]) -> dict[str, dict]:
        out = {}
        for name, seconds in WINDOWS.items():
            if seconds == HORIZON_S:  # every slot: merged from the rows, a tenth as many
                counts, low, high, sums = merge(*rows)
            else:
                counts, low, high, sums = self._merged(self._last(current, seconds))
            q = quantiles(counts, low, high).tolist()
            s = dict(zip(SUMS, sums.tolist()))
            n = int(s["requests"])
            out[name] = {
                "requests": n,
                "requests_per_s": n / seconds,
                "ttft_ms": as_ms(q[0]), "e2e_ms": as_ms(q[1]), "itl_ms": as_ms(q[2]),
                "breakdown_ms": {k: (s[k] / n * 1000 if n else None) for k in ("queue", "prefill", "decode")},
                "draft_acceptance": s["accepted"] / s["proposed"] if s["proposed"] else None,
                "cache_hit_rate": s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else None,
                "accept_rate": s["accepted_chars"] / s["shown_chars"] if s["shown_chars"] else None,
            }
        return out

    def _series(self, current: int, now: float, rows: tuple[np.ndarray, ...]) -> list[dict]:
        """One point per SERIES_STEP_S step that saw requests, oldest first.
        A step's seconds are SERIES_STEP_S adjacent slots, so each step is one
        row of them, except the current one: its row also holds the oldest,
        partial step (left out)."""
        counts, low, high, sums = (a.copy() for a in rows)
        step_of_row = self.second[::SERIES_STEP_S] // SERIES_STEP_S
        now_row = current % HORIZON_S // SERIES_STEP_S
        counts[now_row], low[now_row], high[now_row], sums[now_row] = self._merged(
            self._last(current, current % SERIES_STEP_S + 1))
        step_of_row[now_row] = current // SERIES_STEP_S
        requests = sums[:, _COLUMN["requests"]]
        seen = np.flatnonzero(requests)
        seen = seen[np.argsort(step_of_row[seen])]
        q = quantiles(counts[seen], low[seen], high[seen]).tolist()
        return [{"t": min(float((step + 1) * SERIES_STEP_S), now), "requests": int(n),
                 "ttft_ms": as_ms(ttft), "e2e_ms": as_ms(e2e), "itl_ms": as_ms(itl)}
                for step, n, (ttft, e2e, itl) in zip(step_of_row[seen].tolist(), requests[seen].tolist(), q)]
