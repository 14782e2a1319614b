"""Soak and fairness runs against the real server (`completer serve --model
embedded`, started as the tests start it, on an ephemeral port).

Soak: `--editors` simulated editors type real Python (pip's sources) into
their own documents for `--duration` seconds, one `complete` per keystroke at
human intervals with jitter, bursts of fast keys (supersede storms), explicit
cancels, pauses, disconnects (clean and abrupt) with reconnects, and now and
then a 200-500 KB file. The KV budget is small enough that the prefix cache
must evict, yet a full-window request still fits. Issue #31's parts, each an
option: `--http-editors` llama.vim-like clients storm the compat port the
same way (each keystroke a POST /infill or /completion with `cache_prompt`,
the one before it aborted by closing its connection); `--disagg` gives the
server a prefill worker, keeps long uncached prompts flowing to it, SIGSTOPs
it for a while (then SIGCONT) and later SIGKILLs it (the server starts it
again); `--loads` runs CPU-heavy processes beside (the default model loaded
again and again) to starve the server. The run is phases: a warm-up, then
phases of ~5 minutes (two at least; with `--disagg` the worker stopped in
one, killed in the next); after each, typing stops, the answers drain, the
clients leave, and the server must be back where it started: no KV block in
use within 5 s, RSS compared with the first idle after the warm-up, by kind
of memory, at every idle (a plateau is the allocator's, a steady climb a leak).

Fairness: closed loop (an editor sends its next keystroke when the last one is
answered), 1 editor alone and `--editors` together, alternating in one run;
the figure is the ratio of their p99 time-to-done.

    python -m latency_bench soak --duration 1800 --http-editors 8 --disagg --loads 2 \
        --json docs/results/reliability_soak.json
    python -m latency_bench soak --fairness --json docs/results/reliability_fairness.json

Whatever the server answers is counted, never retried or hidden: `overloaded`
under a storm and deadlines overshot show up in the outcomes. Times are what
the editor sees (frame sent to done read), client event loop included. What a
result holds, and how it reads, is in reliability.py.

The simulated editors are in editors.py and http_editors.py, the loads and
faults in stress.py, the fairness run in fairness.py.

Past 300 lines: the phases, their checks at each idle and the report are
one run's story; its editors, loads and faults live in their own modules.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.markdown import Markdown
from websockets.exceptions import ConnectionClosed

from completer.checkpoint import parse_config
from completer.config import Config
from completer.engine.block_manager import BlockManager
from completer.engine.kv_cache_manager import KVCacheManager
from completer.engine.paged_kv import pool_blocks
from completer.evaluate import heldout_files
from completer.model_store import EMBEDDED_DRAFT, EMBEDDED_TARGET
from latency_bench.editors import Book, Conn, answered_as, editor, keep_reading_log, long_prompts, percentile_ms
from latency_bench.fairness import run_fairness
from latency_bench.harness import ROOT, TOKEN, ServerProcess, collect, complete_msg, connect, running_server
from latency_bench.harness import scrape as scrape_all
from latency_bench.http_editors import http_editor
from latency_bench.reliability import fairness_section, soak_section
from latency_bench.run_results import (Fault, Gauges, IdleCheck, KvPlan, Minute, PhaseSpan, Sample, Slowest, SoakResult,
                                       machine, now, violations, write_result)
from latency_bench.stress import SideLoads, inject, memory

# 16 MB gives the embedded target 145 blocks: a full-window request reserves 65
# (two run at once), while 32 editors' documents need ~1000, so the prefix
# cache evicts all the time (the run reports by how much).
SOAK_KV_MB = 16.0
SAMPLE_S = 2.0
DRAIN_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 20.0
PHASE_S = 300.0  # after the warm-up, an idle spell about this often
AROUND_FAULT_S = 10.0  # a fault's window: requests sent this long before it to this long after the worker is back
# With --disagg: one local prefill worker (its own small KV pool), and prompts past 256 uncached tokens sent to
# it whatever the estimates say (the embedded model's window is 1,024 tokens), so the link is used all along.
DISAGG_SETTINGS = ("disagg.enabled=true", "disagg.workers=1", "disagg.threshold_tokens=256",
                   "disagg.remote_slack=100", "disagg.worker_kv_mb=64", "disagg.use_shared_cores=true")


def kv_plan(kv_mb: float) -> KvPlan:
    """The pools `engine.kv_cache_mb=kv_mb` gives the embedded models, and
    whether a full-window request (prompt budget + default max_tokens) fits."""
    c = Config()
    share = {"target": 1 - c.spec.draft_share, "draft": c.spec.draft_share}
    blocks = {role: pool_blocks(parse_config(d / "config.json"), kv_mb * share[role], c.engine.block_size)
              for role, d in (("target", EMBEDDED_TARGET), ("draft", EMBEDDED_DRAFT))}
    kv = KVCacheManager({r: BlockManager(n, c.engine.block_size) for r, n in blocks.items()}, c.spec.k_max + 1)
    window = c.model.context_tokens - c.request.max_tokens
    return KvPlan(kv_mb, blocks, kv.worst_case(window, c.request.max_tokens),
                  kv.too_large(window, c.request.max_tokens) is None)


def scrape(server: ServerProcess) -> Gauges:
    """The gauges of /metrics the drain is judged by (newer names when the server has them)."""
    request = urllib.request.Request(server.http + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    blocks: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "completer_kv_blocks_used":
                blocks[s.labels.get("pool", "")] = s.value
            else:
                found[s.name] = s.value
    return Gauges(blocks or None, found.get("completer_kv_cache_usage_perc"),
                  found.get("completer_event_loop_tasks"), found.get("completer_requests_in_flight"),
                  found.get("completer_prefill_workers_up"))


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def settled(g: Gauges, baseline: Gauges) -> bool:
    return g.kv_in_use() == baseline.kv_in_use() and g.tasks == baseline.tasks and not g.in_flight


# -- the soak ---------------------------------------------------------------------

async def sample_server(server: ServerProcess, book: Book, samples: list[Sample], stop: asyncio.Event) -> None:
    """RSS and the gauges every SAMPLE_S seconds until `stop` (or the server is gone)."""
    process = psutil.Process(server.proc.pid)
    while not stop.is_set():
        try:
            gauges = await asyncio.to_thread(scrape, server)
        except OSError:  # too busy to answer in time: the sample keeps its RSS
            gauges = None
        try:
            rss = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            return
        t = round(time.perf_counter() - book.start, 1)
        samples.append(Sample(t, round(rss, 1), gauges.kv_in_use(), gauges.tasks, gauges.in_flight) if gauges
                       else Sample(t, round(rss, 1), None, None, None))
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def drain(conns: list[Conn | None], since: float) -> float:
    """Wait for every answer owed on the connections still open, book what
    never came as unanswered (in each connection's book), then leave. Returns
    the seconds from `since` (typing stopped) to the end of it."""
    while time.perf_counter() - since < DRAIN_TIMEOUT_S and \
            any(c.pending and not c.reader.done() for c in conns if c is not None):
        await asyncio.sleep(0.05)
    drain_s = time.perf_counter() - since
    for conn in filter(None, conns):
        if conn.reader.done():
            conn.closed_by_server()
        else:
            conn.book.outcomes["unanswered"] += len(conn.pending)
            conn.pending.clear()
            await conn.leave()
    return drain_s


async def settle(server: ServerProcess, baseline: Gauges) -> tuple[Gauges, float | None]:
    """The gauges once back at the baseline, or as they are after SETTLE_TIMEOUT_S
    (closed connections take a moment to unwind); and the seconds until no KV
    block was in use (None: not within SETTLE_TIMEOUT_S)."""
    start = time.monotonic()
    kv_zero_s = None
    while True:
        gauges = await asyncio.to_thread(scrape, server)
        if kv_zero_s is None and not gauges.kv_in_use():
            kv_zero_s = round(time.monotonic() - start, 2)
        if settled(gauges, baseline) or time.monotonic() > start + SETTLE_TIMEOUT_S:
            return gauges, kv_zero_s
        await asyncio.sleep(0.25)


async def fresh_completion(server: ServerProcess) -> str:
    """A new editor's first completion, after the soak."""
    try:
        async with connect(server) as ws:
            await ws.send(complete_msg("fresh", "import os\n\n\ndef main():\n    ", mode="line"))
            _, end = await asyncio.wait_for(collect(ws, "fresh"), 60)
        return answered_as(end)
    except (OSError, TimeoutError, ConnectionClosed) as e:
        return f"failed:{type(e).__name__}"


def compat_health(server: ServerProcess) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.compat}/health", timeout=10) as r:
        r.read()


def healthz(server: ServerProcess) -> bool:
    try:
        with urllib.request.urlopen(server.http + "/healthz", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


def per_minute(book: Book) -> list[Minute]:
    """Time-to-done of the completions an editor would show, by the minute they were asked in."""
    by_minute: dict[int, list[float]] = {}
    for at, seconds, outcome in book.answered:
        if outcome.startswith("done:") and outcome != "done:cancelled":
            by_minute.setdefault(int(at // 60), []).append(seconds)
    return [Minute(m, len(v), percentile_ms(v, 0.5), percentile_ms(v, 0.99))
            for m, v in ((m, sorted(by_minute[m])) for m in sorted(by_minute))]


class Plan(msgspec.Struct, frozen=True):
    """What a soak does besides its WebSocket editors."""

    http_editors: int = 0  # llama.vim-like clients of the compat port
    disagg: bool = False  # a prefill worker, long uncached prompts, the worker stopped then killed
    loads: int = 0  # CPU-heavy processes beside the server
    memory_probe: bool = False  # the server dumps malloc's and gc's figures at each idle (memory_probe/)
    tracemalloc: bool = False  # and traces Python's allocations (slower)
    client_wait: str = "none"  # the editors' wait after a key (client_wait.py): none, the stress, by default


def phases(duration: float, disagg: bool) -> list[tuple[str, float, str]]:
    """(name, seconds, fault) of the soak's phases: a warm-up, then phases of
    about PHASE_S (two at least), each ending idle: RSS read at each idle tells
    memory that levels off from memory that keeps growing. With disaggregation
    the worker is stopped in the odd phases and killed in the even ones."""
    warm = min(60.0, duration / 4)
    n = max(2, round((duration - warm) / PHASE_S))
    each = (duration - warm) / n
    return [("warm-up", warm, "")] + [(f"phase {i}", each, ("stop" if i % 2 else "kill") if disagg else "")
                                      for i in range(1, n + 1)]


def workers_up(server: ServerProcess) -> float | None:
    try:
        return scrape(server).workers_up
    except OSError:
        return None


async def fault_in(server: ServerProcess, kind: str, seconds: float, start: float) -> Fault | None:
    """`kind` a third into a phase of `seconds`; a stop lasts a quarter of it (6-30 s)."""
    await asyncio.sleep(seconds / 3)
    progress(f"prefill worker: {'SIGSTOP' if kind == 'stop' else 'SIGKILL'}")
    return await inject(server.proc.pid, kind, min(30.0, max(6.0, seconds / 4)), start,
                        lambda: workers_up(server))


async def run_phase(server: ServerProcess, name: str, seconds: float, fault_kind: str, k: int, editors: int,
                    plan: Plan, corpus: list[str], books: dict[str, Book], events: Counter, http_events: Counter,
                    seed: int, faults: list[Fault]) -> PhaseSpan:
    start = books["ws"].start
    began = time.perf_counter()
    stop_at = began + seconds
    progress(f"{name}: {editors} editors, {plan.http_editors} HTTP clients typing for {seconds:g} s")
    fault = asyncio.ensure_future(fault_in(server, fault_kind, seconds, start)) if fault_kind else None
    typing = [editor(i, server, corpus, books["ws"], events, stop_at, seed * 10 + k, plan.client_wait)
              for i in range(editors)]
    typing += [http_editor(i, server.compat, corpus, books["http"], http_events, stop_at, seed * 10 + k,
                           DRAIN_TIMEOUT_S) for i in range(plan.http_editors)]
    if plan.disagg:
        typing.append(long_prompts(server, corpus, books["ws_long"], events, stop_at, seed * 10 + k))
    conns = await asyncio.gather(*typing)
    drain_s = await drain(conns, stop_at)
    progress(f"{name}: drained {drain_s:.1f} s after typing stopped")
    if fault is not None and (done := await fault) is not None:  # (it waits for a worker to be up again)
        faults.append(done)
    return PhaseSpan(name, round(began - start, 1), round(stop_at - start, 1), round(drain_s, 2), fault_kind)


async def idle_check(server: ServerProcess, baseline: Gauges, after: str, start: float) -> IdleCheck:
    """KV back to 0 (and how soon) once the clients left, then memory, past the
    engine's own malloc_trim (it trims 0.5 s into an idle spell)."""
    if server.proc.poll() is not None:
        return IdleCheck(after, None, Gauges(None, None, None, None), None)
    gauges, kv_zero_s = await settle(server, baseline)
    await asyncio.sleep(1.0)
    check = IdleCheck(after, kv_zero_s, gauges, memory(server.proc.pid, round(time.perf_counter() - start, 1)),
                      await probe(server))
    progress(f"idle after {after}: KV 0 after {kv_zero_s} s, RSS {check.memory.rss_mb} MB")
    return check


async def probe(server: ServerProcess) -> dict | None:
    """With --memory-probe: the server's own figures (memory_probe/sitecustomize.py), asked for by SIGUSR2."""
    path = getattr(server, "probe_path", None)
    if path is None:
        return None
    lines = len(path.read_text().splitlines()) if path.exists() else 0
    server.proc.send_signal(signal.SIGUSR2)
    give_up = time.monotonic() + 60
    while time.monotonic() < give_up:
        await asyncio.sleep(0.2)
        if path.exists() and len(dumps := path.read_text().splitlines()) > lines:
            return json.loads(dumps[lines])
    return None


@contextmanager
def probing(plan: Plan):
    """The server started inside sees memory_probe/ first on its path (its sitecustomize); yields the dump file."""
    if not plan.memory_probe:
        yield None
        return
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "COMPLETER_MEMORY_PROBE", "COMPLETER_TRACEMALLOC")}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "memory_probe.jsonl"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT / "latency_bench" / "memory_probe"),
                                                                 str(ROOT), saved["PYTHONPATH"])))
        os.environ["COMPLETER_MEMORY_PROBE"] = str(path)
        if plan.tracemalloc:
            os.environ["COMPLETER_TRACEMALLOC"] = "1"
        try:
            yield path
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def around(fault: Fault, books: dict[str, Book]) -> dict[str, dict[str, int]]:
    """Outcomes of the requests sent from AROUND_FAULT_S before the fault to AROUND_FAULT_S after it ended."""
    lo, hi = fault.at_s - AROUND_FAULT_S, (fault.up_again_s or fault.until_s) + AROUND_FAULT_S
    return {port: dict(Counter(o for at, _, o in book.answered if lo <= at <= hi)) for port, book in books.items()}


def server_disconnects(server: ServerProcess) -> dict[str, int]:
    figures = scrape_all(server)
    return {why: int(figures.get(f"completer_{why}_client_disconnects_total", 0)) for why in ("slow", "silent")}


def prefill_routes(server: ServerProcess) -> dict[str, int]:
    figures = scrape_all(server)
    prefix = "completer_prefill_decisions_total"
    return {f"{labels['route']}/{labels['reason']}": int(v) for k, v in figures.items() if k.startswith(prefix + "{")
            for labels in [json.loads(k[len(prefix):])]}


async def soak_load(server: ServerProcess, editors: int, duration: float, seed: int, plan: Plan) -> dict:
    corpus = [f.text for f in heldout_files()[1] if len(f.text) >= 300]
    if plan.http_editors:  # the compat listener's first connection starts its sweeper task: before the baseline
        await asyncio.to_thread(compat_health, server)
    baseline = await asyncio.to_thread(scrape, server)
    block = Config().engine.block_size
    books = {port: Book(block) for port in ("ws", "ws_long", "http")}
    book = books["ws"]
    for other in books.values():
        other.start = book.start  # one clock: the faults' windows read every port
    events, http_events, samples, stop = Counter(), Counter(), [], asyncio.Event()
    sampler = asyncio.create_task(sample_server(server, book, samples, stop))
    loads = SideLoads(plan.loads) if plan.loads else None
    spans, idle, faults = [], [], []
    for k, (name, seconds, fault_kind) in enumerate(phases(duration, plan.disagg)):
        if server.proc.poll() is not None:
            break
        spans.append(await run_phase(server, name, seconds, fault_kind, k, editors, plan, corpus, books, events,
                                     http_events, seed, faults))
        idle.append(await idle_check(server, baseline, name, book.start))
    progress(f"{sum(b.sent for b in books.values())} requests sent")
    side_loads = await loads.stop() if loads is not None else ""
    stop.set()
    await sampler
    alive = server.proc.poll() is None
    after = idle[-1].gauges if idle else Gauges(None, None, None, None)
    for fault in faults:
        fault.around = around(fault, books)
    minutes = per_minute(book)
    cancelled = sorted(seconds for _, seconds, outcome in book.answered if outcome == "done:cancelled")
    warm = phases(duration, plan.disagg)[0][1]
    rss = [s.rss_mb for s in samples] or [0.0]
    if alive:  # the end is after the drain: what the server keeps
        rss.append(round(psutil.Process(server.proc.pid).memory_info().rss / 2**20, 1))
    return dict(
        editors=editors, duration_s=duration, sent=book.sent, outcomes=dict(book.outcomes),
        client_wait=plan.client_wait, keys=book.keys,
        requests_per_key=round(1 - events["keys_not_sent"] / book.keys, 4) if book.keys else None,
        served_before_next_key=round(book.served_keys / book.keys, 4) if book.keys else None,
        events={**events, **{f"http_{k}": v for k, v in http_events.items()}},
        server_closes=dict(book.server_closes), drain_s=max((p.drain_s for p in spans), default=0.0),
        prompt_blocks_computed=book.computed_blocks,
        cache_hit_rate=book.cached_tokens / book.prompt_tokens if book.prompt_tokens else None,
        time_to_done=minutes,
        cancelled_p50_ms=percentile_ms(cancelled, 0.5), cancelled_p99_ms=percentile_ms(cancelled, 0.99),
        p99_drift=minutes[-1].p99_ms / minutes[0].p99_ms if len(minutes) > 1 and minutes[0].p99_ms else None,
        rss_mb_after_warmup=next((s.rss_mb for s in samples if s.t >= warm), rss[-1]), rss_mb_end=rss[-1],
        rss_mb_max=max(rss), samples=samples, baseline=baseline, after_drain=after,
        healthz_after=alive and healthz(server),
        fresh_completion_after=await fresh_completion(server) if alive else "failed:server_exited",
        server_exit_code=server.proc.poll(),
        http_editors=plan.http_editors, by_port={port: dict(b.outcomes) for port, b in books.items() if b.sent},
        sent_by_port={port: b.sent for port, b in books.items() if b.sent},
        unanswered=sum(b.outcomes["unanswered"] for b in books.values()), disagg=plan.disagg,
        slowest={port: Slowest(round(b.slowest[0], 2), b.slowest[1], b.slowest[2])
                 for port, b in books.items() if b.answered},
        prefill_routes=prefill_routes(server) if alive and plan.disagg else {}, faults=faults,
        side_loads=side_loads, phases=spans, idle=idle,
        server_disconnects=server_disconnects(server) if alive else {})


def soak_settings(kv_mb: float, plan: Plan) -> tuple[str, ...]:
    return (f"engine.kv_cache_mb={kv_mb}", *(DISAGG_SETTINGS if plan.disagg else ()))


def run_soak(editors: int = 32, duration: float = 60.0, kv_mb: float = SOAK_KV_MB, seed: int = 0,
             command: str = "", plan: Plan = Plan()) -> SoakResult:
    kv = kv_plan(kv_mb)
    if not kv.fits:
        raise SystemExit(f"engine.kv_cache_mb={kv_mb} cannot hold a full-window request ({kv})")
    with probing(plan) as probe_path, running_server(*soak_settings(kv_mb, plan)) as server:
        server.probe_path = probe_path
        log = keep_reading_log(server)
        measured = asyncio.run(soak_load(server, editors, duration, seed, plan))
    return SoakResult(date=now(), machine=machine(), command=command, kv=kv, server_log_tail=list(log)[-20:],
                      **measured)


# -- the command ------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="soak seconds of typing")
    ap.add_argument("--editors", type=int, default=32)
    ap.add_argument("--kv-mb", type=float, default=SOAK_KV_MB, help="the soak's engine.kv_cache_mb")
    ap.add_argument("--http-editors", type=int, default=0,
                    help="soak: llama.vim-like clients of the compat port beside the WebSocket editors")
    ap.add_argument("--disagg", action="store_true", help="soak: a prefill worker, long uncached prompts, "
                    "the worker SIGSTOPped then SIGCONTed in the first half, SIGKILLed in the second")
    ap.add_argument("--memory-probe", action="store_true", help="soak: at each idle the server reports malloc's "
                    "in use and free, RSS before and after malloc_trim, live objects (memory_probe/sitecustomize.py)")
    ap.add_argument("--tracemalloc", action="store_true", help="soak, with --memory-probe: and traces Python's "
                    "allocations (slower): the lines that grew")
    ap.add_argument("--loads", type=int, default=0, help="soak: CPU-heavy processes beside the server "
                    "(loading the cached default model again and again; busy loops without it)")
    ap.add_argument("--client-wait", choices=("none", "server", "rhythm"), default="none",
                    help="soak: the editors' wait after a key (latency_bench/client_wait.py): none (every key, the "
                    "stress), the clients' rule now (server), or the rule before (rhythm)")
    ap.add_argument("--fairness", action="store_true", help="the fairness run instead of the soak")
    ap.add_argument("--requests", type=int, default=20, help="fairness: keys per editor per round")
    ap.add_argument("--rounds", type=int, default=2, help="fairness: alone/together alternations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="fairness: a server setting (repeatable), e.g. engine.batch_prefill=false")
    args = ap.parse_args()
    command = "python -m latency_bench soak " + " ".join(sys.argv[1:])
    if args.fairness:
        result = run_fairness(args.editors, args.requests, args.rounds, args.seed, command, tuple(args.set))
        section, broken = fairness_section(result), []
    else:
        result = run_soak(args.editors, args.duration, args.kv_mb, args.seed, command,
                          Plan(args.http_editors, args.disagg, args.loads, args.memory_probe, args.tracemalloc,
                               args.client_wait))
        section, broken = soak_section(result), violations(result)
    Console().print(Markdown("\n".join(section)))
    if args.json:
        write_result(args.json, msgspec.json.format(msgspec.json.encode(result)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
