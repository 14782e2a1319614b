"""The simulated editors of the soak (latency_bench/soak.py): each types
real Python into its own documents over its own connection, one `complete`
per keystroke at human intervals (after the wait a client rule gives, none by
default: `client_wait.py`), with bursts (supersede storms), cancels, pauses,
disconnects and long files; a `Book` records every request's fate as the
editors saw it, and every key's: answered before the next key or not. Also the small helpers the soak and the fairness run
share."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import threading
import time
from collections import Counter, deque

from websockets.exceptions import ConnectionClosed

from latency_bench.client_wait import ClientWait
from latency_bench.harness import ServerProcess, complete_msg, connect

BURST_P, PAUSE_P, CANCEL_P = 0.04, 0.02, 0.01  # per keystroke
DISCONNECT_P = 0.002  # per keystroke: a drop every ~500 keys
LONG_FILE_P = 0.04  # per typing session


def keep_reading_log(server: ServerProcess) -> deque[str]:
    """Drain the server's output (a full pipe would stall it on a long run); keep its tail."""
    tail: deque[str] = deque(server.log[-50:], maxlen=200)
    threading.Thread(target=lambda: tail.extend(server.proc.stdout), daemon=True).start()
    return tail


def answered_as(end: dict) -> str:
    return f"done:{end['reason']}" if end["type"] == "done" else f"error:{end['code']}"


def percentile_ms(ordered: list[float], q: float) -> float | None:
    """Nearest rank (the value q of the answers were at most), in ms."""
    return round(ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000, 1) if ordered else None



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
        # The request that waited longest for its answer: (seconds the client waited, the server's own
        # `total_ms` from reading its frame to its `done`, or None, outcome).
        self.slowest: tuple[float, float | None, str] = (0.0, None, "")
        self.keys = self.served_keys = 0  # keystrokes typed; those answered (first text, or an end) before the next

    def frame(self, conn: "Conn", msg: dict) -> None:
        kind, rid = msg.get("type"), msg.get("id")
        if kind not in ("delta", "done", "error"):
            return
        if rid in conn.pending:
            next_key = conn.next_key.pop(rid, None)
            if next_key is not None and time.perf_counter() <= next_key:  # its first answer
                self.served_keys += 1
            if kind == "delta":
                return
            sent = conn.pending.pop(rid)
            conn.answered.add(rid)
            outcome = f"done:{msg['reason']}" if kind == "done" else f"error:{msg['code']}"
            self.outcomes[outcome] += 1
            self.answered.append((sent - self.start, waited := time.perf_counter() - sent, outcome))
            if waited > self.slowest[0]:
                self.slowest = (waited, msg["timings"].get("total_ms") if kind == "done" else None, outcome)
            if kind == "done" and msg["reason"] != "cancelled":
                conn.wait.answered(waited, msg.get("hold_ms"), time.perf_counter())
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

    def __init__(self, ws, book: Book, wait: ClientWait | None = None):
        self.ws, self.book = ws, book
        self.wait = wait or ClientWait("none")  # its editor's rule, told each answer
        self.pending: dict[str, float] = {}  # id -> sent at
        self.next_key: dict[str, float] = {}  # id -> when its editor's next key comes (until its first answer)
        self.answered: set[str] = set()
        self.reader = asyncio.create_task(self.read())

    @classmethod
    async def open(cls, server: ServerProcess, book: Book, wait: ClientWait | None = None) -> "Conn":
        while True:
            if server.proc.poll() is not None:
                raise ServerExited(server.proc.returncode)
            try:
                # No keepalive of its own: like the editor clients, it takes any frame as a sign of
                # life (websockets' rule, a pong within 20 s, closes a reader busy with a backlog).
                return cls(await connect(server, ping_interval=None), book, wait)
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
        # The code and reason as received (1006: no close frame came, the TCP connection just ended).
        self.book.server_closes[f"{self.ws.close_code} {self.ws.close_reason}".strip()] += 1
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
                 stop_at: float, seed: int, client_wait: str = "none") -> Conn | None:
    """Type until `stop_at`; returns the connection it holds then, still open
    (None when the server died)."""
    try:
        return await type_until(index, server, corpus, book, events, stop_at, seed, ClientWait(client_wait))
    except ServerExited:
        return None


async def type_until(index: int, server: ServerProcess, corpus: list[str], book: Book, events: Counter,
                     stop_at: float, seed: int, wait: ClientWait) -> Conn:
    rng = random.Random(seed * 1000 + index)
    ids, gaps = itertools.count(), keystroke_gaps(rng, events)
    conn = await Conn.open(server, book, wait)
    for uri, text, cursor, chunk in documents(rng, corpus, events, long_first=index == 0):
        for typed in range(1, chunk + 1):
            if time.perf_counter() >= stop_at:
                return conn
            if conn.reader.done():  # the server closed it
                conn.closed_by_server()
                conn = await Conn.open(server, book, wait)
            gap, key_at = next(gaps), time.perf_counter()
            book.keys += 1
            wait.keystroke(key_at)
            delay = wait.delay(key_at)
            if delay >= gap:  # the next key comes first: this one asks nothing
                events["keys_not_sent"] += 1
                await asyncio.sleep(gap)
                continue
            await asyncio.sleep(delay)
            rid = f"e{index}-{next(ids)}"
            conn.next_key[rid] = key_at + gap
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
                conn = await Conn.open(server, book, wait)
            await asyncio.sleep(max(0.0, key_at + gap - time.perf_counter()))
    raise AssertionError("documents() never ends")


async def long_prompts(server: ServerProcess, corpus: list[str], book: Book, events: Counter, stop_at: float,
                       seed: int, chars: int = 6000, every_s: float = 2.5) -> Conn | None:
    """Until `stop_at`, every ~`every_s` a `complete` of a document never seen
    before (its first line unique), `chars` long: an uncached prompt each time,
    what a prefill worker takes (the soak's disaggregation). Returns the
    connection it holds then (None when the server died)."""
    rng = random.Random(seed * 1000 + 999)
    try:
        conn = await Conn.open(server, book)
        for n in itertools.count():
            if time.perf_counter() >= stop_at:
                return conn
            if conn.reader.done():
                conn.closed_by_server()
                conn = await Conn.open(server, book)
            text = f"# long prompt {seed}-{n}\n"
            while len(text) < chars:
                text += rng.choice(corpus)
            try:
                await conn.send_complete(f"long{n}", text[:chars], "\n", f"file:///soak/long{n}.py", rng)
                events["long_prompts"] += 1
            except ConnectionClosed:
                await asyncio.wait([conn.reader])
            await asyncio.sleep(rng.uniform(0.5, 2 * every_s - 0.5))
    except ServerExited:
        return None
    raise AssertionError("itertools.count() never ends")
