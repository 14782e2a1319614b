"""RELIABILITY.md, regenerated: the long fuzz (latency_bench/fuzz.py), the soak
and the fairness run (latency_bench/soak.py), each a subprocess writing its
JSON under docs/results/, then the page rendered from those files alone.

    python -m latency_bench reliability               # fuzz 100000 frames, soak 1800 s, fairness
    python -m latency_bench reliability --from-json   # re-render from docs/results/, running nothing

What a soak or fairness result is, and the invariants a soak must hold:
run_results.py.

Past 300 lines: it renders RELIABILITY.md, whose sections follow the
runs' results one by one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import msgspec

from latency_bench.run_results import (RSS_TOLERANCE, FairnessResult, Gauges, Machine, RunRecord, SoakResult, machine,
                                       now, rss_growth, violations)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "RELIABILITY.md"
FUZZ = ROOT / "latency_bench" / "fuzz.py"
JSON = {name: RESULTS / f"reliability_{name}.json" for name in ("fuzz", "soak", "fairness", "run")}
# A shorter fuzz run made after the long one, when it found something (fuzz.py --remark says what).
FUZZ_CHECK = RESULTS / "reliability_fuzz_check.json"
FUZZ_HTTP = RESULTS / "reliability_fuzz_http.json"  # latency_bench/fuzz_http.py --json
# The soak's issue #31 parts: the compat port's clients, a prefill worker stopped and killed, model loads beside.
SOAK_OPTIONS = ("--http-editors", "8", "--disagg", "--loads", "2", "--memory-probe")
# Where a client or a peer meets the server, and what bounds each (the tests that hold it).
SURFACES = [
    ("WebSocket port (`/v1/ws`, `/metrics`, `/v1/stats`)", "token, Host, Origin; frames and documents bounded; "
     "handshake timeout ~10 s; `server.max_connections`", "test_server_security, test_fuzz"),
    ("WebSocket connections' liveness", "pinged every `server.keepalive_s`; closed (1011) only after three "
     "periods with nothing heard, never for a late pong while frames come; a reader `server.send_queue_frames` "
     "behind is closed (1008)", "test_server_limits, test_server_security"),
    ("compat HTTP port (`/infill`, `/completion`, `/v1/completions`)", "the same checks; every error in the JSON "
     "envelope (aiohttp's parse errors too); `compat.header_timeout_s`, `body_timeout_s`, `idle_timeout_s`, "
     "`max_connections` (a connection that never sent the token makes room, the first one open past "
     "`header_timeout_s` first; an authenticated one never while such are open)", "test_compat_hardening, fuzz_http"),
    ("compat HTTP port's authenticated keep-alive clients", "floods of idle unauthenticated connections past "
     "`compat.max_connections` never close a client that sent its token; a connection not authenticated within "
     "`compat.header_timeout_s` is the first to go", "test_compat_hardening"),
    ("compat cache under `prefix_cache_scope = \"connection\"`", "salt and document state per TCP connection: "
     "`cache_n` reveals nothing of another client's prompts", "test_compat_hardening"),
    ("prefill link's rendezvous store (`disagg`)", "on the link's address only; a peer must send the "
     "per-connection secret from `Hello`; keys, values and bytes bounded", "test_disagg"),
    ("K/V blocks of jobs whose requests ended", "returned when the job closes (a lost link included), "
     "without another request to wake the engine", "test_disagg"),
    ("server memory across prompts of new lengths", "oneDNN's and ideep's per-shape primitive caches (the int4 "
     "path's bf16 matmuls) held to `model.kernel_cache_entries` (128) each", "test_cpu_decode"),
    ("server memory across a client's documents", "retrieval's windows cut, and their token counts kept, once per "
     "file for all of a client's documents, within its context store plus one request's files (not once per "
     "document)", "test_service, test_retrieval"),
    ("server memory after a connection closes", "its session, documents and retrieval windows freed as it closes "
     "(no reference cycle leaves them to the next full collection)", "test_server_limits"),
    ("server memory across connections' context", "all connections' context stores and retrieval window "
     "caches together within `server.context_chars_total` characters; the least recently used (any "
     "connection's) dropped first, a connection's files in use kept; a closed connection's stop counting",
     "test_context_memory"),
    ("cached named models (default, gemma3-270m)", "size checked on every load, sha256 when the file changed and on "
     "`completer models pull`; symbolic links refused; fetched again on a mismatch", "test_model_store"),
    ("Ray cluster on several machines (`completer cluster head`/`join`)", "Ray's token auth on for every node; "
     "every port a node opens off loopback refuses a request without the token (GCS, raylet, workers; job API "
     "401); Ray's Prometheus servers off; a node joins only with a private copy of the token",
     "test_cluster_security"),
    ("Ray on one machine (`completer serve --cluster`)", "every Ray port on 127.0.0.1 (Serve's replica gRPC "
     "too); token file 0600, made so or refused; Ray's temp folder inside a 0700 folder of the user's, checked "
     "at start", "test_cluster_security"),
    ("a front door joining a cluster (`cluster.address`)", "refused in one line without the token, with "
     "`RAY_AUTH_MODE` set to anything but `token`, or when the head answers without a token",
     "test_cluster_security"),
    ("the fused CPU layer's kernel cache", "folders 0700; a .so in a folder another user owns or group/others "
     "can write is never loaded (one WARNING, built in a private folder); size and sha256 recorded at build and "
     "checked before each load (a truncated or damaged .so rebuilt, no bus error); a lock left by a killed build "
     "taken over, a live holder waited on at most `COMPLETER_KERNEL_BUILD_TIMEOUT_S`, SIGTERM ends the wait; a "
     "fallback to torch's ops said at WARNING and in `/metrics` (`completer_fused_cpu_active`)",
     "test_kernel_cache"),
    ("one client's flood beside another's keystrokes", "admission and interactive prefill in turns across "
     "connections (the one running fewest first, the shortest prompt first within a turn); a full queue makes "
     "room for another client from the newest of the one holding most; deadlines cut to "
     "`server.max_deadline_ms`; the drafter's catch-up in 256-token passes with deadlines checked between them",
     "test_fairness"),
    ("a hung engine replica (`--cluster`; stopped, stuck)", "the front door keeps each request's time whatever "
     "its replica does: 0.2 s past its deadline it ends `deadline` with the text so far; a cancel or "
     "superseding keystroke ends it `cancelled` at once (still sent to the replica); a replica silent 1 s while "
     "it holds a request past its end is stalled and gets no new requests while another is up, until it "
     "answers again", "test_cluster_hung"),
]


# -- the page ---------------------------------------------------------------------

def num(x) -> str:
    """A figure as a reader wants it: no `.0` on counts, `-` for none."""
    if x is None:
        return "-"
    return f"{x:g}" if isinstance(x, float) else str(x)


def table(header: tuple[str, ...], rows) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(num(c) for c in row) + " |" for row in rows), ""]


def duration(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} minutes"


def run_lines(command: str, date: str | None, m: Machine | None, remark: str = "") -> list[str]:
    """What every section starts with: its own run's command, when it ended and
    the machine, from that run's JSON (never another run's), then its note."""
    lines = [f"`{command}`", ""]
    if date and m is not None:
        lines += [f"Ended {date}. Machine: {m.cpu}, {m.cores} cores, {m.memory_gb:g} GB; {m.platform}; Python "
                  f"{m.python}; load average {m.load_average} then; commit {m.commit}"
                  f"{' with uncommitted changes' if m.uncommitted_changes else ''}.", ""]
    else:
        lines += ["When and where it ran: not in its JSON (written before the fuzz runs recorded their date and "
                  "machine)" + ("; see its note." if remark else "."), ""]
    return lines + ([remark, ""] if remark else [])


def when(date: str | None, remark: str = "") -> str:
    """A run's date as the summary gives it: to the minute (a JSON without one: its note, if it has one)."""
    return date[:16].replace("T", " ") if date else "in its note" if remark else "not recorded"


def soak_section(r: SoakResult) -> list[str]:
    e, kv, broken = r.events, r.kv, violations(r)
    g = lambda name: e.get(name, 0)  # noqa: E731
    lines = [f"## Soak: {r.editors} editors, {duration(r.duration_s)}", "",
             *run_lines(r.command, r.date, r.machine),
             f"- {r.editors} simulated editors typed pip's sources into their own documents (300-4000 chars, "
             f"growing a key at a time): {g('keystrokes')} keystrokes, one `complete` each, ~150 ms apart with "
             f"jitter, {g('bursts')} bursts of 5-30 keys 3-20 ms apart (supersede storms), {g('cancels')} "
             f"explicit cancels, {g('disconnects_clean')} clean and {g('disconnects_abrupt')} abrupt disconnects "
             f"(each followed by a reconnect), {g('long_files')} files of 200-500 KB opened and typed into.",
             f"- KV budget `engine.kv_cache_mb={kv.kv_cache_mb:g}`: pools of {kv.pool_blocks} blocks; a "
             f"full-window request reserves {kv.full_window_blocks}. Requests that got a token prefilled "
             f"{r.prompt_blocks_computed} full blocks of new prompt, "
             f"{r.prompt_blocks_computed / kv.pool_blocks['target']:.1f}x the target pool (past 1x the prefix "
             f"cache must have evicted); their cache hit rate "
             f"{'-' if r.cache_hit_rate is None else f'{r.cache_hit_rate:.0%}'}.",
             *([f"- The editors waited after each key as the `{r.client_wait}` rule says "
                f"(latency_bench/client_wait.py): {r.keys} keys, {r.requests_per_key:.2f} requests per key, "
                f"{r.served_before_next_key:.1%} of the keys answered before the next."]
               if r.client_wait != "none" and r.keys else []),
             f"- After typing stopped, the last answer came {r.drain_s:.1f} s later; the editors then left.", "",
             "Every `complete` on a connection still open gets exactly one `done` or `error` "
             "(`unanswered`, `duplicate`, `after_terminal` and `unknown_id` must be 0; `abandoned` counts "
             "requests pending when an editor itself disconnected):", ""]
    lines += table(("outcome", "requests"), sorted(r.outcomes.items()))
    lines += issue31_lines(r)
    if r.server_closes:
        lines += [f"Connections the server closed, by the close code and reason the editor received (1006: none "
                  f"came): {r.server_closes}.", ""]
    if r.server_disconnects:
        lines += [f"Connections the server chose to close, by its own count: {r.server_disconnects} (slow: a reader "
                  "`server.send_queue_frames` frames behind, 1008; silent: nothing heard for three ping periods, "
                  "1011).", ""]
    def kv(g: Gauges) -> str:
        if g.kv_blocks_used is None:
            return num(g.kv_usage)
        return ", ".join(f"{pool} {num(n)}" for pool, n in sorted(g.kv_blocks_used.items()))

    lines += table(("server", "KV blocks in use", "event loop tasks", "requests in flight"),
                   [(name, kv(x), x.tasks, x.in_flight)
                    for name, x in (("before the load", r.baseline), ("after the drain", r.after_drain))])
    if r.baseline.kv_blocks_used is None:
        lines += ["(KV is the target pool's share in use: the server had no `completer_kv_blocks_used`; "
                  "`-`: no such gauge.)", ""]
    peak = lambda name: max((v for s in r.samples if (v := getattr(s, name)) is not None), default=None)  # noqa: E731
    lines += [f"Sampled every few seconds during the load: at most {num(peak('in_flight'))} requests in flight, "
              f"{num(peak('tasks'))} event loop tasks, {num(peak('kv_in_use'))} KV in use. A superseded or "
              f"cancelled request got its `done` (cancelled) in {num(r.cancelled_p50_ms)} ms at the median, "
              f"{num(r.cancelled_p99_ms)} ms at p99.", ""]
    lines += [f"Server RSS: {r.rss_mb_after_warmup:.0f} MB after warm-up, {r.rss_mb_end:.0f} MB at the end, "
              f"{r.rss_mb_max:.0f} MB at most. Afterwards `/healthz` answered "
              f"{'200' if r.healthz_after else 'no 200'} and a fresh completion ended "
              f"`{r.fresh_completion_after}`.", "",
              "Time to done (frame sent to `done` read) of the completions an editor would show "
              "(not cancelled), by the minute they were asked in:", ""]
    lines += table(("minute", "shown", "p50 ms", "p99 ms"),
                   [(m.minute, m.shown, m.p50_ms, m.p99_ms) for m in r.time_to_done])
    if r.p99_drift is not None:
        lines += [f"p99 of the last minute / the first: {r.p99_drift:.2f}x.", ""]
    lines += idle_lines(r)
    lines += ["Invariants: " + ("all held." if not broken else "**broken**: " + "; ".join(broken)), ""]
    if broken:
        lines += ["The server's last lines:", "", "```", *(ln.rstrip("\n") for ln in r.server_log_tail), "```", ""]
    return lines


PORTS = {"ws": "WebSocket editors", "ws_long": "WebSocket, long uncached prompts", "http": "compat HTTP clients"}


def issue31_lines(r: SoakResult) -> list[str]:
    """The compat port's clients, the prefill worker's faults and the loads beside (when the run had them)."""
    lines = []
    if r.side_loads:
        lines += [f"Beside the server all along, CPU-heavy processes starving it: {r.side_loads}.", ""]
    if r.by_port:
        e = r.events
        lines += [f"Per port (the first column is the table above; `unanswered` in all: **{r.unanswered}**). "
                  f"{r.http_editors} llama.vim-like HTTP clients typed {e.get('http_keystrokes', 0)} keystrokes "
                  f"({e.get('http_bursts', 0)} bursts), each a POST /infill (one client in four /completion) "
                  "with `cache_prompt`, a new keystroke aborting the request before it by closing its connection "
                  "(`aborted`); `done:` is a 200 with llama.cpp's JSON, `error:` a status with the JSON error "
                  "envelope, `not_json:` and `no_answer:` must not occur.", ""]
        ports = [p for p in PORTS if p in r.by_port]
        names = sorted({name for p in ports for name in r.by_port[p]})
        lines += table(("outcome", *(PORTS[p] for p in ports)),
                       [(name, *(r.by_port[p].get(name, 0) for p in ports)) for name in names]
                       + [("sent", *(r.sent_by_port.get(p, 0) for p in ports))])
    if r.disagg:
        routes = ", ".join(f"{k} {v}" for k, v in sorted(r.prefill_routes.items())) or "none reported"
        lines += [f"Disaggregated prefill: one local prefill worker. Requests by where their prefill ran and why "
                  f"(`completer_prefill_decisions`; `local/long`: sent to the worker, ended before its K/V "
                  f"came): {routes}. "
                  "Faults injected into the worker (seconds since the load started; outcomes of the requests "
                  "sent from 10 s before the fault to 10 s after a worker was up again):", ""]
        lines += table(("fault", "at", "until", "no worker up from", "up again", "pid -> pid", "outcomes around it"),
                       [(f.kind, f.at_s, f.until_s, f.down_at_s, f.up_again_s, f"{f.pid} -> {num(f.pid_after)}",
                         "; ".join(f"{port}: " + ", ".join(f"{k} {v}" for k, v in sorted(o.items()))
                                   for port, o in f.around.items() if o))
                        for f in r.faults])
    if r.slowest:
        lines += ["The longest any request waited for its terminal answer, by port (and, for a `done`, the "
                  "server's own time from reading its frame to its `done`; the rest is the way there and back, "
                  "both ends' event loops included): "
                  + "; ".join(f"{PORTS.get(p, p)} {s.waited_s:g} s (`{s.outcome}`"
                              + (f", server {s.server_ms / 1000:.2f} s)" if s.server_ms is not None else ")")
                              for p, s in r.slowest.items()) + ".", ""]
    return lines


def idle_lines(r: SoakResult) -> list[str]:
    if not r.idle:
        return []
    lines = ["The server idle after each phase (all clients gone; memory read 1 s later, past the engine's own "
             "`malloc_trim`): seconds until no KV block was in use, then resident memory by kind (MB; anon: "
             "RssAnon, file: RssFile, heap: the brk heap, anon maps: other anonymous mappings and their count):",
             ""]
    spans = {p.name: p for p in r.phases}
    lines += table(("after", "typing ended at s", "drain s", "KV 0 after s", "RSS", "anon", "file", "heap",
                    "anon maps", "threads"),
                   [(c.after, spans[c.after].end_s if c.after in spans else None,
                     spans[c.after].drain_s if c.after in spans else None, c.kv_zero_s,
                     *((m.rss_mb, m.anon_mb, m.file_mb, m.heap_mb, f"{num(m.anon_maps_mb)} ({m.anon_maps})",
                        m.threads) if (m := c.memory) is not None else ("-",) * 6))
                    for c in r.idle])
    probed = [c for c in r.idle if c.probe and "malloc" in c.probe]
    if probed:
        lines += ["The server's own figures at each idle (`--memory-probe`, MB): glibc's arenas and mmapped chunks, "
                  "what malloc has in use and holds free, RSS before and after an explicit `malloc_trim(0)`, live "
                  "Python objects (and traced Python allocations with `--tracemalloc`):", ""]
        lines += table(("after", "arenas", "mmapped", "in use", "free", "RSS", "trimmed", "objects", "traced"),
                       [(c.after, m["arena_mb"], m["mmapped_mb"], m["in_use_mb"], m["free_mb"],
                         m["rss_mb_before_trim"], m["rss_mb_after_trim"], c.probe["objects"]["total"],
                         c.probe.get("traced_mb")) for c in probed for m in [c.probe["malloc"]]])
        a, b = probed[0].probe, probed[-1].probe
        ma, mb = a["malloc"], b["malloc"]
        traced = (f", traced Python allocations {b['traced_mb'] - a['traced_mb']:+.1f} MB"
                  if a.get("traced_mb") is not None and b.get("traced_mb") is not None else "")
        lines += [f"From the first idle to the last: malloc in use {mb['in_use_mb'] - ma['in_use_mb']:+.1f} MB, free "
                  f"inside its arenas {mb['free_mb'] - ma['free_mb']:+.1f} MB (held, not returned: "
                  f"`malloc_trim(0)` then gave back "
                  f"{mb['rss_mb_before_trim'] - mb['rss_mb_after_trim']:.1f} MB), live Python objects "
                  f"{b['objects']['total'] - a['objects']['total']:+d}{traced}. In use and not Python's: native "
                  "allocations (torch, oneDNN, OpenMP) still held; free: the allocator's retention.", ""]
        if (pa := a.get("pymalloc")) and (pb := b.get("pymalloc")):
            lines += [f"Python's small-object allocator (its own mmapped arenas, not in malloc's figures): arenas "
                      f"{pa['arenas_mb']:g} -> {pb['arenas_mb']:g} MB; in them, live blocks "
                      f"{pb['blocks_in_use_mb'] - pa['blocks_in_use_mb']:+.1f} MB, free blocks "
                      f"{pb['blocks_free_mb'] - pa['blocks_free_mb']:+.1f} MB, unused pools "
                      f"{pb['unused_pools_mb'] - pa['unused_pools_mb']:+.1f} MB.", ""]
        if (ca := a.get("cycles")) and (cb := b.get("cycles")):
            lines += [f"Then a full `gc.collect()` (after the figures above) found {ca['unreachable']:,} and "
                      f"{cb['unreachable']:,} objects held only by reference cycles at the first and last idle; "
                      f"retrieval windows before and after it: {ca['windows_before']:,} -> {ca['windows_after']:,}, "
                      f"{cb['windows_before']:,} -> {cb['windows_after']:,}.", ""]
        if (ha := a.get("held")) and (hb := b.get("held")):
            lines += ["What the service itself kept at the first idle and the last (its clients: the compatible "
                      "routes' one lives on between HTTP connections): "
                      + "; ".join(f"{k.replace('_', ' ')} {ha[k]:,} -> {hb[k]:,}" for k in ha) + ".", ""]
        if grew := probed[-1].probe.get("grew"):
            lines += ["Python allocations that grew most from the first idle to the last:", "", "```", *grew, "```",
                      ""]
    growth = rss_growth(r)
    if growth is not None:
        mem = [c.memory for c in r.idle if c.memory is not None]
        first, last = mem[0], mem[-1]
        verdict = "within" if abs(growth) <= RSS_TOLERANCE else "**beyond**"
        lines += [f"RSS at the last idle vs the first after the warm-up: {first.rss_mb:g} -> {last.rss_mb:g} MB "
                  f"({growth:+.1%}), {verdict} {RSS_TOLERANCE:.0%}. Where it went: anon "
                  f"{last.anon_mb - first.anon_mb:+.1f} MB (heap {last.heap_mb - first.heap_mb:+.1f}, anon maps "
                  f"{last.anon_maps_mb - first.anon_maps_mb:+.1f}), file {last.file_mb - first.file_mb:+.1f} MB."
                  + (f" Between the idles: {', '.join(f'{m.rss_mb:g}' for m in mem)} MB: growth that stops "
                     "after the first phases is what the allocator keeps (fragmented arenas: the engine's trim "
                     "already ran), growth that goes on at each phase is a leak." if len(mem) > 2 else "")
                  + (f" From the first phase's idle to the last: {mem[1].rss_mb:g} -> {last.rss_mb:g} MB "
                     f"({last.rss_mb / mem[1].rss_mb - 1:+.1%}; {min(m.rss_mb for m in mem[1:]):g}-"
                     f"{max(m.rss_mb for m in mem[1:]):g} MB over {len(mem) - 1} idles)." if len(mem) > 2 else ""),
                  ""]
    return lines


def fairness_section(r: FairnessResult) -> list[str]:
    lines = [f"## Fairness: 1 editor alone vs {r.together.editors} together", "",
             *run_lines(r.command, r.date, r.machine),
             f"Closed loop (each editor sends its next keystroke when the last is answered), default config; "
             f"{r.rounds} round(s) alternating alone ({r.alone.requests // r.rounds} keys) and together "
             f"({r.requests_per_editor} keys per editor). Each editor first opens its document (one request, "
             "not timed: the same cold prefill alone or not) and waits for all the others to have theirs; the "
             "keystrokes after that are timed.", ""]
    lines += table(("editors", "requests", "p50 ms", "p99 ms", "deadline hit", "outcomes"),
                   [(p.editors, p.requests, p.p50_ms, p.p99_ms, f"{p.deadline_share:.1%}",
                     ", ".join(f"{k} {v}" for k, v in sorted(p.outcomes.items())))
                    for p in (r.alone, r.together)])
    verdict = "within" if r.p99_ratio <= r.aim else "**beyond**"
    if r.alone.deadline_share > 0.01:
        lines += [f"**Caveat**: alone, {r.alone.deadline_share:.0%} of requests already hit their deadline (load "
                  f"average {r.machine.load_average} on {r.machine.cores} cores): the machine was too busy for "
                  "the ratio to say much.", ""]
    return lines + [f"p99 ratio, {r.together.editors} editors vs 1: **{r.p99_ratio:.1f}x**, {verdict} the aim "
                    f"of {r.aim:g}x (the issue's baseline: 139 ms vs 2,657 ms, 19x, 10% of requests past "
                    f"their deadline).", ""]


RUN_KEYS = ("command", "remark", "date", "machine")  # a fuzz JSON's run, said above its figures


def fuzz_machine(fuzz: dict) -> Machine | None:
    return msgspec.convert(fuzz["machine"], Machine) if fuzz.get("machine") else None


def fuzz_section(fuzz: dict, heading: str = "## Fuzz") -> list[str]:
    """latency_bench/fuzz.py's (or fuzz_http.py's) JSON as it is: its run, its
    remark, its top-level figures."""
    lines = [heading, "", *run_lines(fuzz.get("command", "python -m latency_bench fuzz"), fuzz.get("date"),
                                     fuzz_machine(fuzz), fuzz.get("remark", ""))]
    return lines + table(("figure", "value"), [(k, json.dumps(v)[:300]) for k, v in fuzz.items()
                                               if k not in RUN_KEYS])


def run_record_section(run: RunRecord) -> list[str]:
    """docs/results/reliability_run.json: what the last `python -m latency_bench
    reliability` (or its runs made one by one) recorded, under its own date."""
    return ["## The run record", "",
            "`docs/results/reliability_run.json`, written by `python -m latency_bench reliability` when it runs "
            "everything (each section below names its own run):", "",
            *run_lines(run.command, run.date, run.machine),
            "Exit codes: " + (", ".join(f"{k} {'not run' if v is None else v}" for k, v in run.exit_codes.items())
                              or "none") + ".", ""]


def page(run: RunRecord, fuzz: dict | None, soak: SoakResult | None, fairness: FairnessResult | None) -> str:
    lines = ["# Reliability", "",
             "Do not edit by hand: `python -m latency_bench reliability --from-json` renders it from "
             "`docs/results/reliability_*.json`, and without `--from-json` re-runs everything first. Each section "
             "names its own run (the command, when it ended, the machine), as that run's JSON recorded it. The "
             "server is `completer serve --model embedded` on CPU; times are what a client on the same machine "
             "saw.", ""]
    fuzz_figures = ", ".join(f"{fuzz[k]} {k.replace('_', ' ')}" for k in ("unanswered", "wrong_answers",
                                                                          "connections_lost") if k in (fuzz or {}))
    summary = [("fuzz", when((fuzz or {}).get("date"), (fuzz or {}).get("remark", "")),
                "not run" if fuzz is None else f"{fuzz.get('frames', '?')} frames", fuzz_figures or "see below")]
    if FUZZ_HTTP.exists():
        http = json.loads(FUZZ_HTTP.read_text())
        fivexx = sum(n for status, n in http["statuses"].items() if status.startswith("5"))
        summary.append(("fuzz, HTTP routes", when(http.get("date"), http.get("remark", "")),
                        f"{http['requests']} requests",
                        f"{fivexx} 5xx, {http['statuses'].get('None', 0)} without a status, "
                        f"{sum(http['problems'].values())} other problems"))
    if soak is not None:
        broken = violations(soak)
        summary.append(("soak", when(soak.date),
                        f"{soak.editors} editors, {duration(soak.duration_s)}, {soak.sent} requests",
                        "invariants held" if not broken else f"{len(broken)} invariants broken"))
    if fairness is not None:
        summary.append(("fairness", when(fairness.date), f"1 vs {fairness.together.editors} editors, closed loop",
                        f"p99 {fairness.p99_ratio:.1f}x (aim {fairness.aim:g}x)"
                        + (", machine too busy: see the caveat" if fairness.alone.deadline_share > 0.01 else "")))
    lines += table(("run", "ended", "how much", "result"), summary)
    lines += run_record_section(run)
    code = run.exit_codes.get("fuzz")
    lines += fuzz_section(fuzz) if fuzz is not None else ["## Fuzz", "", (
        "Not run: latency_bench/fuzz.py was not there when this page was generated." if code is None
        else f"latency_bench/fuzz.py exited {code} without writing its JSON."), ""]
    if FUZZ_CHECK.exists():
        lines += fuzz_section(json.loads(FUZZ_CHECK.read_text()), "## Fuzz, checked again")
    if FUZZ_HTTP.exists():
        lines += fuzz_section(json.loads(FUZZ_HTTP.read_text()), "## Fuzz, HTTP routes")
    lines += soak_section(soak) if soak is not None else []
    lines += fairness_section(fairness) if fairness is not None else []
    lines += ["## Surfaces", "", "What reaches the server from outside it, and what bounds each.", ""]
    lines += table(("surface", "bounded by", "checked in"), SURFACES)
    return "\n".join(lines)


# -- the command ------------------------------------------------------------------

def run_all(fuzz_frames: int, soak_s: float, fairness_requests: int, command: str) -> None:
    """Each run a subprocess writing its JSON; a run that finds a broken
    invariant exits 1 and still writes it: the page shows what broke."""
    py, out = sys.executable, {name: str(path.relative_to(ROOT)) for name, path in JSON.items()}
    bench = [py, "-m", "latency_bench"]
    runs = {"fuzz": [*bench, "fuzz", "--frames", str(fuzz_frames), "--json", out["fuzz"]],
            "soak": [*bench, "soak", "--duration", f"{soak_s:g}", *SOAK_OPTIONS, "--json", out["soak"]],
            "fairness": [*bench, "soak", "--fairness", "--requests", str(fairness_requests), "--json", out["fairness"]]}
    exit_codes: dict[str, int | None] = {}
    for name, cmd in runs.items():
        JSON[name].unlink(missing_ok=True)  # never a page mixing this run with an older one
        if name == "fuzz" and not FUZZ.exists():
            print("latency_bench/fuzz.py is not there: the fuzz is left out", file=sys.stderr)
            exit_codes[name] = None
            continue
        print("+ python " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
        exit_codes[name] = subprocess.run(cmd, cwd=ROOT).returncode
    RESULTS.mkdir(parents=True, exist_ok=True)
    JSON["run"].write_bytes(msgspec.json.format(msgspec.json.encode(RunRecord(now(), machine(), command,
                                                                              exit_codes))))


def load(name: str, kind):
    path = JSON[name]
    if not path.exists():
        return None
    return json.loads(path.read_text()) if kind is dict else msgspec.json.decode(path.read_bytes(), type=kind)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fuzz-frames", type=int, default=100_000)
    ap.add_argument("--soak-duration", type=float, default=1800.0, help="seconds")
    ap.add_argument("--fairness-requests", type=int, default=20, help="keys per editor per round")
    ap.add_argument("--from-json", action="store_true", help="re-render the page from docs/results/ only")
    args = ap.parse_args()
    if not args.from_json:
        run_all(args.fuzz_frames, args.soak_duration, args.fairness_requests,
                "python -m latency_bench reliability " + " ".join(sys.argv[1:]))
    run = load("run", RunRecord)
    if run is None:
        raise SystemExit(f"{JSON['run']} is missing: run without --from-json first")
    PAGE.write_text(page(run, load("fuzz", dict), load("soak", SoakResult), load("fairness", FairnessResult)))
    print(f"wrote {PAGE.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
