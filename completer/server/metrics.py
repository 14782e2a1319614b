"""Prometheus metrics (vLLM-style names, `completer_` prefix) and the rolling
figures behind `/v1/stats` and the dashboard."""

from __future__ import annotations

import math
import time
from collections import deque

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Fine at the millisecond scale, so a p99 read off the buckets means something.
LATENCY_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025,
                   0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)

WINDOWS = {"1m": 60, "5m": 300, "15m": 900}
SERIES_STEP_S = 10


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


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return sorted_values[index]


def quantiles_ms(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {f"p{int(q * 100)}": (v * 1000 if (v := percentile(ordered, q)) is not None else None)
            for q in (0.5, 0.95, 0.99)}


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"completer_{name}", doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Complete frame read to first delta sent.")
        self.itl = hist("inter_token_latency_seconds", "Mean time between tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Complete frame read to done sent.")
        self.queue = hist("request_queue_time_seconds", "Time waiting for admission.")
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to the end.")
        self.prompt_tokens = Counter("completer_prompt_tokens", "Prompt tokens.", registry=r)
        self.cached_tokens = Counter("completer_prompt_tokens_cached", "Prompt tokens whose KV came from cache.",
                                     registry=r)
        self.generation_tokens = Counter("completer_generation_tokens", "Generated tokens.", registry=r)
        self.draft_proposed = Counter("completer_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                      registry=r)
        self.draft_accepted = Counter("completer_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                      registry=r)
        self.requests = Counter("completer_request_success", "Finished requests by reason.",
                                ["finished_reason"], registry=r)
        self.errors = Counter("completer_request_errors", "Error frames sent, by code.", ["code"], registry=r)
        self.slow_disconnects = Counter("completer_slow_client_disconnects",
                                        "Connections closed because the reader fell send_queue_frames behind.",
                                        registry=r)
        self.prefills = Counter("completer_prefill", "Prefills by where they ran.", ["kind"], registry=r)
        self.shown_chars = Counter("completer_feedback_shown_chars", "Characters of completions reported shown.",
                                   registry=r)
        self.accepted_chars = Counter("completer_feedback_accepted_chars", "Characters accepted by users.",
                                      registry=r)
        self.running = Gauge("completer_num_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge("completer_num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.sessions = Gauge("completer_sessions", "Open editor connections.", registry=r)
        self.kv_usage = Gauge("completer_kv_cache_usage_perc", "Share of KV blocks in use (0-1).", registry=r)
        self.records: deque[Record] = deque(maxlen=200_000)
        self.feedback: deque[tuple[float, int, int]] = deque(maxlen=200_000)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, record: Record, reason: str, prefill_kind: str) -> None:
        self.ttft.observe(record.ttft)
        self.e2e.observe(record.e2e)
        if record.itl is not None:
            self.itl.observe(record.itl)
        self.queue.observe(record.queue)
        self.prefill.observe(record.prefill)
        self.decode.observe(record.decode)
        self.prompt_tokens.inc(record.prompt_tokens)
        self.cached_tokens.inc(record.cached_tokens)
        self.generation_tokens.inc(record.generated)
        self.draft_proposed.inc(record.proposed)
        self.draft_accepted.inc(record.accepted)
        self.requests.labels(reason).inc()
        self.prefills.labels(prefill_kind).inc()
        self.records.append(record)

    def observe_feedback(self, shown: int, accepted: int) -> None:
        self.shown_chars.inc(shown)
        self.accepted_chars.inc(accepted)
        self.feedback.append((time.time(), shown, accepted))

    def _window(self, records: list[Record], feedback: list, seconds: float) -> dict:
        proposed = sum(r.proposed for r in records)
        prompt = sum(r.prompt_tokens for r in records)
        shown = sum(f[1] for f in feedback)
        n = len(records)
        return {
            "requests": n,
            "requests_per_s": n / seconds,
            "ttft_ms": quantiles_ms([r.ttft for r in records]),
            "e2e_ms": quantiles_ms([r.e2e for r in records]),
            "itl_ms": quantiles_ms([r.itl for r in records if r.itl is not None]),
            "breakdown_ms": {k: (sum(getattr(r, k) for r in records) / n * 1000 if n else None)
                             for k in ("queue", "prefill", "decode")},
            "draft_acceptance": sum(r.accepted for r in records) / proposed if proposed else None,
            "cache_hit_rate": sum(r.cached_tokens for r in records) / prompt if prompt else None,
            "accept_rate": sum(f[2] for f in feedback) / shown if shown else None,
        }

    def stats(self) -> dict:
        now = time.time()
        records = [r for r in self.records if now - r.at <= WINDOWS["15m"]]
        feedback = [f for f in self.feedback if now - f[0] <= WINDOWS["15m"]]
        windows = {name: self._window([r for r in records if now - r.at <= s],
                                      [f for f in feedback if now - f[0] <= s], s)
                   for name, s in WINDOWS.items()}
        series = []
        start = now - WINDOWS["15m"]
        buckets: dict[int, list[Record]] = {}
        for r in records:
            buckets.setdefault(int((r.at - start) // SERIES_STEP_S), []).append(r)
        for i in sorted(buckets):
            rs = buckets[i]
            series.append({"t": start + (i + 1) * SERIES_STEP_S, "requests": len(rs),
                           "ttft_ms": quantiles_ms([r.ttft for r in rs]),
                           "e2e_ms": quantiles_ms([r.e2e for r in rs]),
                           "itl_ms": quantiles_ms([r.itl for r in rs if r.itl is not None])})
        return {"time": now, "windows": windows, "series": series, "series_step_s": SERIES_STEP_S,
                "sessions": self.sessions._value.get(), "running": self.running._value.get(),
                "waiting": self.waiting._value.get(), "kv_cache_usage": self.kv_usage._value.get()}
