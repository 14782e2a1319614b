"""Prometheus metrics (vLLM-style names, `completer_` prefix), and the live
figures and rolling windows (`rolling_stats`) behind `/v1/stats` and the
dashboard.
"""

from __future__ import annotations

import time
from typing import Callable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from completer.engine.request import Timings
from completer.server.rolling_stats import SERIES_STEP_S, Record, RollingStats

# Fine at the millisecond scale, so a p99 read off the buckets means something.
LATENCY_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025,
                   0.03, 0.04, 0.05, 0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


CLUSTER_FIGURES = ("running", "waiting", "kv_cache_usage", "requests", "prompt_tokens", "cached_tokens")


class Live(msgspec.Struct):
    """What is true now, read when scraped (App.update_gauges)."""

    sessions: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_used: dict[str, int] = {}  # pool ("target", "draft") -> blocks referenced
    event_loop_tasks: int = 0
    requests_in_flight: int = 0  # across sessions
    prefill_workers_up: int = 0  # disaggregation: workers connected now


class Metrics:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # wall-clock seconds, as Record.at (tests fix it)
        r = self.registry = CollectorRegistry()

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"completer_{name}", doc, buckets=LATENCY_BUCKETS, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Complete frame read to first delta sent.")
        self.itl = hist("inter_token_latency_seconds", "Mean time between tokens of a request.")
        self.e2e = hist("e2e_request_latency_seconds", "Complete frame read to done sent.")
        self.queue = hist("request_queue_time_seconds", "Time waiting for admission.")
        self.prefill = hist("request_prefill_time_seconds", "Admission to first token.")
        self.decode = hist("request_decode_time_seconds", "First token to the end.")
        # The keystroke's critical path (Timings' extensions): what the first token waited for.
        self.prepare = hist("request_prepare_time_seconds", "Frame read to the engine having the request "
                            "(document update, tokenizing).")
        self.engine_wait = hist("request_engine_wait_time_seconds", "The engine having the request to its "
                                "thread taking it: waiting behind a pass already running.")
        self.prefill_pass = hist("request_prefill_pass_time_seconds", "Time in the target's prefill passes.")
        self.first_token_passes = Histogram(
            "completer_request_passes_to_first_token", "Target passes up to a request's first delta.",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
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
        self.silent_disconnects = Counter("completer_silent_client_disconnects",
                                          "Connections closed because nothing came from them for 3 ping periods.",
                                          registry=r)
        self.prefills = Counter("completer_prefill", "Prefills by where they ran.", ["kind"], registry=r)
        self.prefill_decisions = Counter(
            "completer_prefill_decisions", "Disaggregation: where each prompt was prefilled, and why "
            "(worker_lost: recomputed here after its worker failed).", ["route", "reason"], registry=r)
        self.kv_transfer_bytes = Counter("completer_kv_transfer_bytes", "K/V bytes received from prefill workers.",
                                         registry=r)
        self.kv_transfer_seconds = Histogram("completer_kv_transfer_seconds", "Time receiving one request's K/V "
                                             "from a prefill worker.", buckets=LATENCY_BUCKETS, registry=r)
        self.workers_up = Gauge("completer_prefill_workers_up", "Prefill workers connected.", registry=r)
        self.fused_cpu = Gauge("completer_fused_cpu_active", "1: the target's short CPU passes run through the "
                               "fused C++ layer; 0: through torch's ops (a fallback, said at WARNING when the "
                               "layer could not be built or used; or a GPU, a float model, engine.fused_cpu "
                               "off).", registry=r)
        self.shown_chars = Counter("completer_feedback_shown_chars", "Characters of completions reported shown.",
                                   registry=r)
        self.accepted_chars = Counter("completer_feedback_accepted_chars", "Characters users kept, by a key "
                                      "or by typing them through.", registry=r)
        self.typed_chars = Counter("completer_feedback_typed_chars", "Characters users kept by typing them "
                                   "through (also in accepted_chars).", registry=r)
        self.feedback = Counter("completer_feedback_completions", "Completions with feedback, by outcome "
                                "(accepted: some kept; dismissed: shown, none kept; unshown: never displayed).",
                                ["outcome"], registry=r)
        self.confidence_cuts = Counter("completer_confidence_cuts", "Completions a confidence rule ended, by rule "
                                       "(first: none shown; token: a line cut; line: a block cut).", ["rule"],
                                       registry=r)
        self.primes = Counter("completer_cache_primes", "Requests that only primed the cache (max_tokens 0).",
                              registry=r)
        self.warm_requests = Counter("completer_warm_requests", "Warming: windows a document's next jump may "
                                     "take, prefilled while idle, by how each ended (length: warm now; "
                                     "cancelled: a newer set replaced it).", ["outcome"], registry=r)
        self.warm_tokens = Counter("completer_warm_tokens", "Warming: prompt tokens computed (not found cached).",
                                   registry=r)
        self.route_requests = Counter(
            "completer_route_requests", "Requests by route (ws; infill, completion, v1/completions: the "
            "compatible HTTP routes) and how each ended (a finish reason, primed, disconnected, or an HTTP "
            "error status).", ["route", "outcome"], registry=r)
        self.route_counts: dict[str, int] = {}  # route -> requests, for /v1/stats and the dashboard
        self.running = Gauge("completer_num_requests_running", "Requests being decoded.", registry=r)
        self.waiting = Gauge("completer_num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.sessions = Gauge("completer_sessions", "Open editor connections.", registry=r)
        self.kv_usage = Gauge("completer_kv_cache_usage_perc", "Share of KV blocks in use (0-1).", registry=r)
        self.kv_blocks_used = Gauge("completer_kv_blocks_used", "KV blocks referenced by sequences, by pool.",
                                    ["pool"], registry=r)
        self.loop_tasks = Gauge("completer_event_loop_tasks", "asyncio tasks alive in the server's event loop.",
                                registry=r)
        self.in_flight = Gauge("completer_requests_in_flight", "Requests in flight across sessions.", registry=r)
        # `--cluster`: the front door's router and the replicas, as last reported (cluster.routing_stats_period_s).
        self.cluster_routed = Gauge("completer_cluster_requests_routed", "Requests this front door's router "
                                    "sent to each replica (cumulative).", ["replica"], registry=r)
        self.cluster_outcomes = Gauge("completer_cluster_routing_decisions", "Routing decisions (cumulative) by "
                                      "outcome: hit (the session's replica), prefix (a replica that served the "
                                      "prompt's head), new, moved (its replica too loaded, or gone).",
                                      ["outcome"], registry=r)
        self.cluster_replica = Gauge("completer_cluster_replica", "Each replica's own figures: running, waiting, "
                                     "kv_cache_usage, requests, prompt_tokens, cached_tokens.",
                                     ["replica", "figure"], registry=r)
        self.cluster_router = Gauge("completer_cluster_router", "This front door's router: decisions "
                                    "(cumulative), decision_seconds (their time, summed), keys (route keys "
                                    "it holds).", ["figure"], registry=r)
        self.cluster = {}
        self.live = Live()
        self.rolling = RollingStats()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def set_live(self, live: Live) -> None:
        self.live = live
        self.sessions.set(live.sessions)
        self.running.set(live.running)
        self.waiting.set(live.waiting)
        self.kv_usage.set(live.kv_cache_usage)
        for pool, used in live.kv_blocks_used.items():
            self.kv_blocks_used.labels(pool).set(used)
        self.loop_tasks.set(live.event_loop_tasks)
        self.in_flight.set(live.requests_in_flight)
        self.workers_up.set(live.prefill_workers_up)

    def set_cluster(self, snapshot: dict) -> None:
        """cluster.routing.RouterStats.snapshot(): what the router did and the replicas reported."""
        self.cluster = snapshot
        for replica, count in snapshot["routed"].items():
            self.cluster_routed.labels(replica).set(count)
        for outcome, count in snapshot["outcomes"].items():
            self.cluster_outcomes.labels(outcome).set(count)
        self.cluster_router.labels("decisions").set(snapshot["decisions"])
        self.cluster_router.labels("decision_seconds").set(snapshot["decision_s"])
        self.cluster_router.labels("keys").set(snapshot["keys"])
        self.cluster_replica.clear()  # a replica gone is gone from here too
        for replica, figures in snapshot["replicas"].items():
            for figure in CLUSTER_FIGURES:
                self.cluster_replica.labels(replica, figure).set(figures.get(figure, 0))

    def observe_prefill(self, route: str, reason: str, kv_bytes: int, kv_seconds: float) -> None:
        """A finished request's prefill, when disaggregation decided where it ran."""
        self.prefill_decisions.labels(route, reason).inc()
        if kv_bytes:
            self.kv_transfer_bytes.inc(kv_bytes)
            self.kv_transfer_seconds.observe(kv_seconds)

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
        self.rolling.add_request(record)

    def observe_feedback(self, offered: int, accepted: int, typed: int = 0, shown: bool = True) -> None:
        """Feedback on a completion of `offered` chars: the user kept `accepted`
        with a key and typed `typed` more through, both kept (a client reports
        what it counted, so neither may claim more than was offered). One
        never displayed (`shown` False) was neither kept nor dismissed."""
        if not shown:
            self.feedback.labels("unshown").inc()
            return
        typed = min(typed, offered)
        kept = min(accepted + typed, offered)
        self.shown_chars.inc(offered)
        self.accepted_chars.inc(kept)
        self.typed_chars.inc(typed)
        self.feedback.labels("accepted" if kept else "dismissed").inc()
        self.rolling.add_feedback(self.clock(), offered, kept)

    def observe_priming(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request that only primed the cache: its prompt counts, its (tokenless) latency does not."""
        self.primes.inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)

    def observe_warm(self, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.warm_requests.labels(reason).inc()
        if reason == "length":
            self.warm_tokens.inc(prompt_tokens - cached_tokens)

    def count_route(self, route: str, outcome: str) -> None:
        self.route_requests.labels(route, outcome).inc()
        self.route_counts[route] = self.route_counts.get(route, 0) + 1

    def observe_done(self, t: Timings, reason: str, received: float, priming: bool = False,
                     route: str = "ws") -> None:
        """A request that ended with an answer, from its timings: its latencies,
        or only the prompt it cached (`priming`: no token, no latency to
        record). `received`: time.perf_counter() when it was read; end-to-end
        counts to now, with the hop to the socket."""
        self.count_route(route, "primed" if priming else reason)
        if priming:
            self.observe_priming(t.prompt_tokens, t.cached_tokens)
        else:
            ttft, total = t.ttft_ms / 1000, t.total_ms / 1000
            decode_s = max(0.0, total - ttft)
            self.prepare.observe(t.prepare_ms / 1000)
            self.engine_wait.observe(t.wait_ms / 1000)
            self.prefill_pass.observe(t.prefill_ms / 1000)
            if t.first_token_passes:
                self.first_token_passes.observe(t.first_token_passes)
            self.observe(Record(
                at=time.time(), ttft=ttft, e2e=time.perf_counter() - received,
                itl=decode_s / (t.generated_tokens - 1) if t.generated_tokens > 1 else None,
                queue=t.queue_ms / 1000, prefill=max(0.0, ttft - t.queue_ms / 1000), decode=decode_s,
                prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens, generated=t.generated_tokens,
                proposed=t.draft_proposed, accepted=t.draft_accepted), reason, t.prefill)
        if t.prefill_reason:
            self.observe_prefill(t.prefill, t.prefill_reason, t.kv_transfer_bytes, t.kv_transfer_ms / 1000)

    def stats(self) -> dict:
        now = self.clock()
        windows, series = self.rolling.summary(now)
        return {"time": now, "windows": windows, "series": series, "series_step_s": SERIES_STEP_S,
                "routes": dict(self.route_counts), **msgspec.structs.asdict(self.live),
                **({"cluster": self.cluster} if self.cluster else {})}
