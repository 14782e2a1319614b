"""Soak and fairness runs against the real server (`completer serve --model
embedded`, started as the tests start it, on an ephemeral port).

Soak: `--editors` simulated editors type real Python (pip's sources) into
their own documents for `--duration` seconds, one `complete` per keystroke at
human intervals with jitter, bursts of fast keys (supersede storms), explicit
cancels, pauses, disconnects (clean and abrupt) with reconnects, and now and
then a 200-500 KB file. The KV budget is small enough that the prefix cache
must evict, yet a full-window request still fits. Then typing stops, the
answers drain, the editors leave, and the server must be back where it started.

Fairness: closed loop (an editor sends its next keystroke when the last one is
answered), 1 editor alone and `--editors` together, alternating in one run;
the figure is the ratio of their p99 time-to-done.

    python latency_bench/soak.py --duration 1800 --json docs/results/reliability_soak.json
    python latency_bench/soak.py --fairness --json docs/results/reliability_fairness.json

Whatever the server answers is counted, never retried or hidden: `overloaded`
under a storm and deadlines overshot show up in the outcomes. Times are what
the editor sees (frame sent to done read), client event loop included. What a
result holds, and how it reads, is in reliability.py.

The simulated editors are in editors.py, the fairness run in fairness.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.markdown import Markdown
from websockets.exceptions import ConnectionClosed

from editors import Book, Conn, answered_as, editor, keep_reading_log, percentile_ms
from fairness import run_fairness
from reliability import (Gauges, KvPlan, Minute, Sample, SoakResult, fairness_section, machine, now, soak_section,
                         violations)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_harness import TOKEN, ServerProcess, collect, complete_msg, connect, running_server  # noqa: E402

from completer.checkpoint import parse_config  # noqa: E402
from completer.config import Config  # noqa: E402
from completer.engine.block_manager import BlockManager  # noqa: E402
from completer.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from completer.engine.paged_kv import pool_blocks  # noqa: E402
from completer.evaluate import heldout_files  # noqa: E402
from completer.model_store import EMBEDDED_DRAFT, EMBEDDED_TARGET  # noqa: E402

# 16 MB gives the embedded target 145 blocks: a full-window request reserves 65
# (two run at once), while 32 editors' documents need ~1000, so the prefix
# cache evicts all the time (the run reports by how much).
SOAK_KV_MB = 16.0
SAMPLE_S = 2.0
DRAIN_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 20.0


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
                  found.get("completer_event_loop_tasks"), found.get("completer_requests_in_flight"))


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


async def drain(conns: list[Conn | None], book: Book) -> float:
    """Wait for every answer owed on the connections still open, book what
    never came as unanswered, then leave. Returns the seconds it took."""
    start = time.perf_counter()
    while time.perf_counter() - start < DRAIN_TIMEOUT_S and \
            any(c.pending and not c.reader.done() for c in conns if c is not None):
        await asyncio.sleep(0.05)
    drain_s = time.perf_counter() - start
    for conn in filter(None, conns):
        if conn.reader.done():
            conn.closed_by_server()
        else:
            book.outcomes["unanswered"] += len(conn.pending)
            conn.pending.clear()
            await conn.leave()
    return drain_s


async def settle(server: ServerProcess, baseline: Gauges) -> Gauges:
    """The gauges once back at the baseline, or as they are after SETTLE_TIMEOUT_S
    (closed connections take a moment to unwind)."""
    end = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        gauges = await asyncio.to_thread(scrape, server)
        if settled(gauges, baseline) or time.monotonic() > end:
            return gauges
        await asyncio.sleep(0.5)


async def fresh_completion(server: ServerProcess) -> str:
    """A new editor's first completion, after the soak."""
    try:
        async with connect(server) as ws:
            await ws.send(complete_msg("fresh", "import os\n\n\ndef main():\n    ", mode="line"))
            _, end = await asyncio.wait_for(collect(ws, "fresh"), 60)
        return answered_as(end)
    except (OSError, TimeoutError, ConnectionClosed) as e:
        return f"failed:{type(e).__name__}"


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


async def soak_load(server: ServerProcess, editors: int, duration: float, seed: int) -> dict:
    corpus = [f.text for f in heldout_files()[1] if len(f.text) >= 300]
    baseline = await asyncio.to_thread(scrape, server)
    book, events, samples, stop = Book(Config().engine.block_size), Counter(), [], asyncio.Event()
    sampler = asyncio.create_task(sample_server(server, book, samples, stop))
    stop_at = book.start + duration
    progress(f"{editors} editors typing for {duration:g} s")
    conns = await asyncio.gather(*(editor(i, server, corpus, book, events, stop_at, seed) for i in range(editors)))
    progress(f"{book.sent} requests sent; draining")
    drain_s = await drain(conns, book)
    progress(f"drained in {drain_s:.1f} s; waiting for the server to settle")
    stop.set()
    await sampler
    alive = server.proc.poll() is None
    after = await settle(server, baseline) if alive else Gauges(None, None, None, None)
    minutes = per_minute(book)
    cancelled = sorted(seconds for _, seconds, outcome in book.answered if outcome == "done:cancelled")
    warm = min(60.0, duration / 4)
    rss = [s.rss_mb for s in samples] or [0.0]
    if alive:  # the end is after the drain: what the server keeps
        rss.append(round(psutil.Process(server.proc.pid).memory_info().rss / 2**20, 1))
    return dict(
        editors=editors, duration_s=duration, sent=book.sent, outcomes=dict(book.outcomes), events=dict(events),
        server_closes=dict(book.server_closes), drain_s=round(drain_s, 2),
        prompt_blocks_computed=book.computed_blocks,
        cache_hit_rate=book.cached_tokens / book.prompt_tokens if book.prompt_tokens else None,
        time_to_done=minutes,
        cancelled_p50_ms=percentile_ms(cancelled, 0.5), cancelled_p99_ms=percentile_ms(cancelled, 0.99),
        p99_drift=minutes[-1].p99_ms / minutes[0].p99_ms if len(minutes) > 1 and minutes[0].p99_ms else None,
        rss_mb_after_warmup=next((s.rss_mb for s in samples if s.t >= warm), rss[-1]), rss_mb_end=rss[-1],
        rss_mb_max=max(rss), samples=samples, baseline=baseline, after_drain=after,
        healthz_after=alive and healthz(server),
        fresh_completion_after=await fresh_completion(server) if alive else "failed:server_exited",
        server_exit_code=server.proc.poll())


def run_soak(editors: int = 32, duration: float = 60.0, kv_mb: float = SOAK_KV_MB, seed: int = 0,
             command: str = "") -> SoakResult:
    plan = kv_plan(kv_mb)
    if not plan.fits:
        raise SystemExit(f"engine.kv_cache_mb={kv_mb} cannot hold a full-window request ({plan})")
    with running_server(f"engine.kv_cache_mb={kv_mb}") as server:
        log = keep_reading_log(server)
        measured = asyncio.run(soak_load(server, editors, duration, seed))
    return SoakResult(date=now(), machine=machine(), command=command, kv=plan, server_log_tail=list(log)[-20:],
                      **measured)


# -- the command ------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="soak seconds of typing")
    ap.add_argument("--editors", type=int, default=32)
    ap.add_argument("--kv-mb", type=float, default=SOAK_KV_MB, help="the soak's engine.kv_cache_mb")
    ap.add_argument("--fairness", action="store_true", help="the fairness run instead of the soak")
    ap.add_argument("--requests", type=int, default=20, help="fairness: keys per editor per round")
    ap.add_argument("--rounds", type=int, default=2, help="fairness: alone/together alternations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the result here")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="fairness: a server setting (repeatable), e.g. engine.batch_prefill=false")
    args = ap.parse_args()
    command = "python latency_bench/soak.py " + " ".join(sys.argv[1:])
    if args.fairness:
        result = run_fairness(args.editors, args.requests, args.rounds, args.seed, command, tuple(args.set))
        section, broken = fairness_section(result), []
    else:
        result = run_soak(args.editors, args.duration, args.kv_mb, args.seed, command)
        section, broken = soak_section(result), violations(result)
    Console().print(Markdown("\n".join(section)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
