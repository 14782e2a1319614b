"""Fairness: closed loop (an editor sends its next keystroke when the last
one is answered), 1 editor alone and N together, alternating in one run; the
figure is the ratio of their p99 time-to-done. Run through
`python -m latency_bench soak --fairness`."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

from completer.evaluate import heldout_files
from latency_bench.editors import answered_as, keep_reading_log, percentile_ms
from latency_bench.harness import ServerProcess, collect, complete_msg, connect, running_server
from latency_bench.run_results import FairnessResult, Phase, machine, now

UNANSWERED_AFTER_S = 120.0  # a request this old is booked unanswered


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
