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

Past 300 lines: the simulated editors (Book, Conn, documents, keystroke_gaps,
editor) would make a module of their own; this one was to stay one command.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import threading
import time
import urllib.request
from collections import Counter, deque
from pathlib import Path

import msgspec
import psutil
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.markdown import Markdown
from websockets.exceptions import ConnectionClosed

from reliability import (FairnessResult, Gauges, KvPlan, Minute, Phase, Sample, SoakResult, fairness_section,
                         machine, now, soak_section, violations)

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
BURST_P, PAUSE_P, CANCEL_P = 0.04, 0.02, 0.01  # per keystroke
DISCONNECT_P = 0.002  # per keystroke: a drop every ~500 keys
LONG_FILE_P = 0.04  # per typing session
SAMPLE_S = 2.0
DRAIN_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 20.0
UNANSWERED_AFTER_S = 120.0  # fairness: a request this old is booked unanswered


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


def keep_reading_log(server: ServerProcess) -> deque[str]:
    """Drain the server's output (a full pipe would stall it on a long run); keep its tail."""
    tail: deque[str] = deque(server.log[-50:], maxlen=200)
    threading.Thread(target=lambda: tail.extend(server.proc.stdout), daemon=True).start()
    return tail


# -- the editors ------------------------------------------------------------------

class Book:
    """Every request's fate, as the editors saw it."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.start = time.perf_counter()
        self.sent = 0
        self.outcomes: Counter[str] = Counter()
        self.server_closes: Counter[str] = Counter()
        self.answered: list[tuple[float, float, str]] = []  # (sent at, seconds to answer, outcome)
        self.prompt_tokens = self.cached_tokens = self.computed_blocks = 0

    def frame(self, conn: "Conn", msg: dict) -> None:
        kind, rid = msg.get("type"), msg.get("id")
        if kind not in ("delta", "done", "error"):
            return
        if rid in conn.pending:
            if kind == "delta":
                return
            sent = conn.pending.pop(rid)
            conn.answered.add(rid)
            outcome = f"done:{msg['reason']}" if kind == "done" else f"error:{msg['code']}"
            self.outcomes[outcome] += 1
            self.answered.append((sent - self.start, time.perf_counter() - sent, outcome))
            if kind == "done" and msg["timings"]["generated_tokens"] > 0:  # its whole prompt was computed
                t = msg["timings"]
                self.prompt_tokens += t["prompt_tokens"]
                self.cached_tokens += t["cached_tokens"]
                # Full blocks only: each holds K/V the cache did not have, and is published.
                self.computed_blocks += (t["prompt_tokens"] - t["cached_tokens"]) // self.block_size
        elif rid in conn.answered:
            self.outcomes["duplicate" if kind != "delta" else "after_terminal"] += 1
        elif rid is None and kind == "error":
            self.outcomes[f"error_without_id:{msg['code']}"] += 1
        else:
            self.outcomes["unknown_id"] += 1


class ServerExited(Exception):
    """The server process is gone: the editors stop, the run reports it."""


class Conn:
    """One editor connection: the requests it is owed an answer for, and a
    reader that books every frame against them."""

    def __init__(self, ws, book: Book):
        self.ws, self.book = ws, book
        self.pending: dict[str, float] = {}  # id -> sent at
        self.answered: set[str] = set()
        self.reader = asyncio.create_task(self.read())

    @classmethod
    async def open(cls, server: ServerProcess, book: Book) -> "Conn":
        while True:
            if server.proc.poll() is not None:
                raise ServerExited(server.proc.returncode)
            try:
                return cls(await connect(server), book)
            except (OSError, TimeoutError, ConnectionClosed) as e:  # booked; the editor tries again
                book.outcomes[f"connect_failed:{type(e).__name__}"] += 1
                await asyncio.sleep(1.0)

    async def read(self) -> None:
        try:
            async for raw in self.ws:
                self.book.frame(self, json.loads(raw))
        except ConnectionClosed:
            pass

    async def send_complete(self, rid: str, prefix: str, suffix: str, uri: str, rng: random.Random) -> None:
        self.pending[rid] = time.perf_counter()  # first: the answer may be read before send returns
        self.book.sent += 1
        temperature = rng.choice([0.0] * 8 + [0.2, 1e-4])  # some tiny ones: a known defect to count
        await self.ws.send(complete_msg(rid, prefix, suffix, uri=uri, temperature=temperature,
                                        mode="block" if rng.random() < 0.2 else "line"))

    async def leave(self, abrupt: bool = False) -> None:
        """Close it ourselves: what is still pending is abandoned, not owed."""
        if abrupt:
            self.ws.transport.abort()
        else:
            await self.ws.close()
        await self.reader
        self.book.outcomes["abandoned"] += len(self.pending)
        self.pending.clear()

    def closed_by_server(self) -> None:
        self.reader.result()  # a reader that failed is a bug of this harness: raise it
        self.book.server_closes[str(self.ws.close_code)] += 1
        self.book.outcomes["lost_on_server_close"] += len(self.pending)
        self.pending.clear()


def documents(rng: random.Random, corpus: list[str], events: Counter, long_first: bool):
    """Typing sessions: (uri, text, cursor, chars to retype from the cursor). A
    slice of a pip source of 300-4000 chars, or now and then a 200-500 KB file
    (first of all with `long_first`, so even a short run has one)."""
    for n in itertools.count():
        if (long_first and n == 0) or rng.random() < LONG_FILE_P:
            events["long_files"] += 1
            text, size = "", rng.randint(200_000, 500_000)
            while len(text) < size:
                text += rng.choice(corpus)
            text, chunk = text[:size], rng.randint(5, 40)
        else:
            source = rng.choice(corpus)
            start = source.rfind("\n", 0, rng.randrange(max(1, len(source) - 300))) + 1
            text, chunk = source[start: start + rng.randint(300, 4000)], rng.randint(30, 600)
        cursor = text.rfind("\n", 0, rng.randrange(len(text))) + 1
        yield f"file:///soak/doc{n}.py", text, cursor, min(chunk, len(text) - cursor)


def keystroke_gaps(rng: random.Random, events: Counter):
    """Seconds between keystrokes: ~150 ms with lognormal jitter, bursts of
    3-20 ms (autorepeat, a fast typist: supersede storms), pauses to read."""
    while True:
        roll = rng.random()
        if roll < BURST_P:
            events["bursts"] += 1
            yield from (rng.uniform(0.003, 0.02) for _ in range(rng.randint(5, 30)))
        elif roll < BURST_P + PAUSE_P:
            yield rng.uniform(0.5, 3.0)
        else:
            yield rng.lognormvariate(math.log(0.15), 0.5)


async def editor(index: int, server: ServerProcess, corpus: list[str], book: Book, events: Counter,
                 stop_at: float, seed: int) -> Conn | None:
    """Type until `stop_at`; returns the connection it holds then, still open
    (None when the server died)."""
    try:
        return await type_until(index, server, corpus, book, events, stop_at, seed)
    except ServerExited:
        return None


async def type_until(index: int, server: ServerProcess, corpus: list[str], book: Book, events: Counter,
                     stop_at: float, seed: int) -> Conn:
    rng = random.Random(seed * 1000 + index)
    ids, gaps = itertools.count(), keystroke_gaps(rng, events)
    conn = await Conn.open(server, book)
    for uri, text, cursor, chunk in documents(rng, corpus, events, long_first=index == 0):
        for typed in range(1, chunk + 1):
            if time.perf_counter() >= stop_at:
                return conn
            if conn.reader.done():  # the server closed it
                conn.closed_by_server()
                conn = await Conn.open(server, book)
            rid = f"e{index}-{next(ids)}"
            try:
                await conn.send_complete(rid, text[:cursor + typed], text[cursor + chunk:], uri, rng)
                events["keystrokes"] += 1
                if rng.random() < CANCEL_P:
                    events["cancels"] += 1
                    await conn.ws.send(json.dumps({"type": "cancel", "id": rid}))
            except ConnectionClosed:  # the server closed it: booked once the reader has seen it all
                await asyncio.wait([conn.reader])
            if not conn.reader.done() and rng.random() < DISCONNECT_P:
                abrupt = rng.random() < 0.5
                events["disconnects_abrupt" if abrupt else "disconnects_clean"] += 1
                await conn.leave(abrupt)
                await asyncio.sleep(rng.uniform(0.1, 2.0))
                conn = await Conn.open(server, book)
            await asyncio.sleep(next(gaps))
    raise AssertionError("documents() never ends")


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


def answered_as(end: dict) -> str:
    return f"done:{end['reason']}" if end["type"] == "done" else f"error:{end['code']}"


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


def percentile_ms(ordered: list[float], q: float) -> float | None:
    """Nearest rank (the value q of the answers were at most), in ms."""
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000, 1) if ordered else None


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


# -- fairness -------------------------------------------------------------------

async def closed_loop(server: ServerProcess, editors: int, requests: int, corpus: list[str],
                      seed: int) -> list[tuple[float, str]]:
    """Each editor opens its document (one request, not timed: a cold prompt
    is the same work alone or not), waits until every editor has, then types
    `requests` keys, the next one as soon as the last is answered; (seconds to
    done, outcome) of every typed one."""
    opened = asyncio.Barrier(editors)

    async def one(index: int) -> list[tuple[float, str]]:
        rng = random.Random(seed * 1000 + index)
        text = rng.choice([t for t in corpus if len(t) > 2 * requests + 400])
        cursor = text.rfind("\n", 0, rng.randrange(200, len(text) - requests)) + 1
        out = []
        async with connect(server) as ws:
            # A deadline long enough for 32 cold prompts at once: the document's K/V is what is warmed.
            await ws.send(complete_msg("open", text[:cursor], text[cursor + requests:], uri=f"file:///fair/{index}.py",
                                       deadline_ms=UNANSWERED_AFTER_S * 1000))
            await asyncio.wait_for(collect(ws, "open"), UNANSWERED_AFTER_S)
            await opened.wait()
            for k in range(requests):
                start = time.perf_counter()
                await ws.send(complete_msg(str(k), text[:cursor + k], text[cursor + requests:],
                                           uri=f"file:///fair/{index}.py"))
                try:
                    _, end = await asyncio.wait_for(collect(ws, str(k)), UNANSWERED_AFTER_S)
                except TimeoutError:  # booked; this editor stops (a late answer would be misread)
                    out.append((time.perf_counter() - start, "unanswered"))
                    break
                out.append((time.perf_counter() - start, answered_as(end)))
        return out

    return [x for xs in await asyncio.gather(*(one(i) for i in range(editors))) for x in xs]


def phase(editors: int, answers: list[tuple[float, str]]) -> Phase:
    times = sorted(s for s, _ in answers)
    outcomes = Counter(o for _, o in answers)
    return Phase(editors, len(answers), percentile_ms(times, 0.5), percentile_ms(times, 0.99), dict(outcomes),
                 outcomes["done:deadline"] / len(answers))


async def fairness_load(server: ServerProcess, editors: int, requests: int, rounds: int, seed: int) -> dict:
    corpus = [f.text for f in heldout_files()[1]]
    await closed_loop(server, 1, 5, corpus, seed)  # warm-up: the first passes calibrate the engine
    alone, together = [], []
    for r in range(rounds):  # alternating, so drift of the machine hits both alike
        # Alone types 8x as many keys: the p99 of a few dozen answers would be their max.
        alone += await closed_loop(server, 1, requests * 8, corpus, seed + 1 + 2 * r)
        together += await closed_loop(server, editors, requests, corpus, seed + 2 + 2 * r)
    a, t = phase(1, alone), phase(editors, together)
    return dict(rounds=rounds, requests_per_editor=requests, alone=a, together=t, p99_ratio=t.p99_ms / a.p99_ms)


def run_fairness(editors: int = 32, requests: int = 20, rounds: int = 2, seed: int = 0,
                 command: str = "", settings: tuple[str, ...] = ()) -> FairnessResult:
    with running_server(*settings) as server:  # the default config (unless --set): what an editor meets
        keep_reading_log(server)
        measured = asyncio.run(fairness_load(server, editors, requests, rounds, seed))
    return FairnessResult(date=now(), machine=machine(), command=command, **measured)


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
