"""llama.vim-like clients of the compatible HTTP routes, for the soak
(latency_bench/soak.py): each types into its documents as the WebSocket
editors do (editors.py's documents and keystroke gaps: bursts make supersede
storms), and per keystroke POSTs /infill (llama.vim's body, `cache_prompt`)
or, one client in four, /completion, on a connection of its own. A new
keystroke aborts the request before it by closing its connection, as
llama.vim stops its curl job.

Every request is booked once in a `Book`: `done:STOP_TYPE` (200 and
llama.cpp's JSON), `error:STATUS` (the JSON error envelope), `aborted` (the
client closed it), or what must not happen: `not_json:STATUS`,
`no_answer:EXCEPTION` (the connection ended without a status) and
`unanswered` (nothing within the drain window after typing stopped)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import aiohttp

from latency_bench.compat_bench import AUTH, infill_body
from latency_bench.editors import Book, documents, keystroke_gaps

N_PREDICT = 32
BROKEN = ("not_json", "no_answer", "unanswered")  # outcome prefixes no request may end with


def outcome_of(status: int, raw: bytes) -> str:
    try:
        answer = json.loads(raw)
    except ValueError:
        return f"not_json:{status}"
    if status == 200:
        return f"done:{answer.get('stop_type') if isinstance(answer, dict) else 'array'}"
    envelope = answer.get("error") if isinstance(answer, dict) else None
    return f"error:{status}" if isinstance(envelope, dict) and envelope.get("code") == status \
        else f"not_json:{status}"


async def ask(session: aiohttp.ClientSession, url: str, body: dict, book: Book) -> None:
    """One request to its answer, booked. Not booked when cancelled (the editor books its abort)."""
    sent = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=AUTH) as response:
            outcome = outcome_of(response.status, await response.read())
    except (aiohttp.ClientError, OSError) as e:
        outcome = f"no_answer:{type(e).__name__}"
    book.outcomes[outcome] += 1
    book.answered.append((sent - book.start, waited := time.perf_counter() - sent, outcome))
    book.slowest = max(book.slowest, (waited, None, outcome), key=lambda s: s[0])


def body_for(route: str, prefix: str, suffix: str, slot: int) -> dict:
    if route == "/completion":  # plain text to continue (a client filling no FIM template)
        return {"prompt": prefix, "n_predict": N_PREDICT, "cache_prompt": True, "stream": False, "id_slot": slot}
    line_start = prefix.rfind("\n") + 1
    return {**infill_body(prefix[:line_start], prefix[line_start:], suffix, N_PREDICT), "id_slot": slot}


async def http_editor(index: int, port: int, corpus: list[str], book: Book, events: Counter, stop_at: float,
                      seed: int, drain_s: float) -> None:
    """Type until `stop_at`, then wait up to `drain_s` for the last answer."""
    rng = random.Random(seed * 1000 + 500 + index)
    gaps = keystroke_gaps(rng, events)
    route = "/completion" if index % 4 == 3 else "/infill"
    url = f"http://127.0.0.1:{port}{route}"
    inflight: asyncio.Task | None = None
    connector = aiohttp.TCPConnector(force_close=True, limit=0)  # a connection per request, as curl
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        for _, text, cursor, chunk in documents(rng, corpus, events, long_first=False):
            for typed in range(1, chunk + 1):
                if time.perf_counter() >= stop_at:
                    if inflight is not None and not (await asyncio.wait([inflight], timeout=drain_s))[0]:
                        book.outcomes["unanswered"] += 1
                        inflight.cancel()
                        await asyncio.wait([inflight])
                    return
                if inflight is not None and not inflight.done():
                    inflight.cancel()  # closes its connection: the server cancels its engine request
                    book.outcomes["aborted"] += 1
                body = body_for(route, text[:cursor + typed], text[cursor + chunk:], index)
                book.sent += 1
                events["keystrokes"] += 1
                inflight = asyncio.create_task(ask(session, url, body, book))
                await asyncio.sleep(next(gaps))
    raise AssertionError("documents() never ends")
