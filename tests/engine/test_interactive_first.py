"""Interactive work first (engine/scheduler.py, `engine.interactive_first`):
a keystroke never waits behind bulk work (a prime, a long cold prompt); a
bulk pass stops between layers for it and goes on from that layer; bulk work
that interactive work starves still gets its slices."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from completer.config import EngineConfig
from completer.engine.engine import Engine
from completer.engine.request import Delta, Finished, Request, SamplingParams
from support.engine_harness import StepLoop, free_mode, make_core, prompts, run, usage

BULK = EngineConfig(block_size=4, prefill_chunk=64, bulk_tokens=64, bulk_chunk=256)


def long_prompt(n: int = 600) -> list[int]:
    return (prompts(1, seed=11, length=(60, 61))[0] * 20)[:n]


class ArrivingLoop(StepLoop):
    """An engine loop where a request arrives before layer `at` of the next
    bulk pass (counting the pause checks) and is in the inbox until taken."""

    def __init__(self, at: int, request: Request):
        super().__init__()
        self.asked, self.at, self.request = 0, at, request

    def arrivals(self) -> list[Request]:
        self.asked += 1
        return [self.request] if self.asked >= self.at else []


def counting_starts(core) -> list[int]:
    """Row lengths of every pass the target runner starts."""
    runner, started = core.runners["target"], []
    start = runner.start

    def counted(states, rows, *args, **kwargs):
        started.append(len(rows[0]))
        return start(states, rows, *args, **kwargs)

    runner.start = counted
    return started


def test_a_bulk_pass_stops_between_layers_for_a_keystroke_and_goes_on_from_there_to_the_same_text(
        models, tokenizer):
    reference = run(make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(
        BULK, interactive_first=False)), [Request("bulk", long_prompt(), free_mode(8))])["bulk"]

    core = make_core(models, tokenizer, draft=None, config=BULK)
    started = counting_starts(core)
    core.add(Request("bulk", long_prompt(), free_mode(8)))
    keystroke = prompts(1, seed=5)[0]
    key = Request("key", keystroke, free_mode(4))
    assert core.step(ArrivingLoop(2, key)) == []  # one layer ran, then a keystroke came
    bulk = core.scheduler.requests["bulk"]
    assert bulk.bulk and bulk.kv["target"].computed == 0 and ("target", "bulk") in core.executor.paused

    core.add(key)
    events = core.step(StepLoop())
    assert any(isinstance(e, Delta) and e.id == "key" for e in events)  # its first token, bulk still stopped
    assert bulk.kv["target"].computed == 0 and ("target", "bulk") in core.executor.paused

    done = {}
    while core.has_work:
        done.update({e.id: e for e in core.step() if isinstance(e, Finished)})
    assert core.scheduler.requests == {} and done["bulk"].text == reference.text and done["key"].reason == "length"
    bulk_passes = [n for n in started if n > len(keystroke)]
    assert bulk_passes == [256, 256, 88], "the stopped pass went on; no chunk was computed twice"
    assert usage(core) == 0


def test_a_keystroke_is_planned_before_a_long_prompt_that_came_first_and_not_with_interactive_first_off(
        models, tokenizer):
    for interactive_first in (True, False):
        core = make_core(models, tokenizer, draft=None,
                         config=msgspec.structs.replace(BULK, interactive_first=interactive_first))
        core.add(Request("bulk", long_prompt(), free_mode(8)))
        core.add(Request("key", prompts(1, seed=5)[0], free_mode(4)))
        plan = core.scheduler.schedule(0.0)
        planned = [c.seq.id for c in plan.prefill]
        assert planned == (["key"] if interactive_first else ["bulk"])  # off: the long prompt takes the budget


def test_a_prime_is_bulk_work_and_a_cancel_drops_its_stopped_pass(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=BULK)
    core.add(Request("prime", prompts(1, seed=2)[0], SamplingParams(max_tokens=0)))
    assert core.step(ArrivingLoop(1, Request("key", prompts(1, seed=5)[0], free_mode(4)))) == []
    assert core.scheduler.requests["prime"].bulk and ("target", "prime") in core.executor.paused
    core.abort("prime")
    assert core.executor.paused == {} and usage(core) == 0


def test_bulk_work_starved_by_decoding_keystrokes_gets_a_slice_after_bulk_starve_ms(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(
        BULK, bulk_starve_ms=500.0, bulk_slice_ms=25.0))
    core.add(Request("key", prompts(1, seed=5)[0], free_mode(40)))
    core.step(StepLoop())  # the keystroke prefilled: it decodes now
    core.add(Request("bulk", long_prompt(), free_mode(8)))
    assert core.scheduler.schedule(10.0).prefill == []  # behind the decoding keystroke
    assert core.scheduler.schedule(10.4).prefill == []
    plan = core.scheduler.schedule(10.6)
    assert [(c.seq.id, c.seq.bulk) for c in plan.prefill] == [("bulk", True)] and plan.slice_until == pytest.approx(10.625)


@pytest.mark.parametrize("interactive_first", [True, False])
async def test_through_the_engine_a_keystroke_after_a_long_prompt_ends_before_its_first_token(
        models, tokenizer, interactive_first):
    config = msgspec.structs.replace(BULK, interactive_first=interactive_first, prefill_chunk=512, bulk_chunk=512)
    engine = Engine(make_core(models, tokenizer, draft=None, config=config))
    engine.start()
    order: list[str] = []
    try:
        async def follow(stream, name):
            async for event in stream:
                if not order or order[-1] != name:
                    order.append(name)
            return await stream.finished()

        bulk = engine.submit(Request("bulk", long_prompt(900), free_mode(2)))
        key = engine.submit(Request("key", prompts(1, seed=5)[0], free_mode(2)))
        results = await asyncio.wait_for(asyncio.gather(follow(bulk, "bulk"), follow(key, "key")), 60)
    finally:
        engine.stop()
    assert all(isinstance(r, Finished) for r in results)
    assert order[0] == ("key" if interactive_first else "bulk")


def test_a_shorter_bulk_prompt_stops_a_longer_ones_pass_and_both_keep_their_progress(models, tokenizer):
    config = msgspec.structs.replace(BULK, bulk_tokens=16)
    alone = {r: run(make_core(models, tokenizer, draft=None, config=config), [req])[r].text
             for r, req in (("long", Request("long", long_prompt(600), free_mode(4))),
                            ("short", Request("short", long_prompt(120)[7:], free_mode(4))))}
    core = make_core(models, tokenizer, draft=None, config=config)
    started = counting_starts(core)
    core.add(Request("long", long_prompt(600), free_mode(4)))
    short = Request("short", long_prompt(120)[7:], free_mode(4))
    core.step(ArrivingLoop(2, short))
    assert ("target", "long") in core.executor.paused  # stopped after a layer for the shorter one
    core.add(short)
    done = {}
    while core.has_work:
        done.update({e.id: e for e in core.step(StepLoop()) if isinstance(e, Finished)})
    assert {r: f.text for r, f in done.items()} == alone
    assert [n for n in started if n > 16] == [256, 113, 256, 88], "the short one ran first; the long one went on"


def test_the_drafter_makes_no_catch_up_pass_over_a_bulk_prompt_and_the_ngram_proposer_still_serves_it(
        models, tokenizer):
    core = make_core(models, tokenizer, config=BULK)  # with the drafter
    drafter = next(p for p in core.speculator.proposers if p.source == "draft")
    proposed_for: set[str] = set()
    propose = drafter.propose
    drafter.propose = lambda work: (proposed_for.update(s.id for s, _ in work), propose(work))[1]
    core.add(Request("bulk", long_prompt(), free_mode(8)))
    core.add(Request("key", long_prompt(40), free_mode(8)))
    core.step(StepLoop())  # both admitted; the keystroke prefilled
    bulk, key = core.scheduler.requests["bulk"], core.scheduler.requests["key"]
    assert bulk.bulk and not key.bulk
    assert drafter.offer(bulk, 4) == 0 and drafter.offer(key, 4) == 4
    done = {}
    while core.has_work:
        done.update({e.id: e for e in core.step(StepLoop()) if isinstance(e, Finished)})
    assert done["bulk"].reason == "length" and "bulk" not in proposed_for
    assert core.kv.pools["draft"].usage() == 0


def test_a_keystroke_after_the_prime_of_its_position_lets_the_primes_pass_finish_and_reuses_it(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=BULK)
    prompt = long_prompt(200)
    core.add(Request("prime", prompt, SamplingParams(max_tokens=0)))
    keystroke = Request("key", prompt + [7, 8], free_mode(4))
    core.step(ArrivingLoop(2, keystroke))
    assert ("target", "prime") not in core.executor.paused  # its pass went on: it is the keystroke's prefill
    core.add(keystroke)
    done = {}
    while core.has_work:
        done.update({e.id: e for e in core.step(StepLoop()) if isinstance(e, Finished)})
    assert done["key"].timings.cached_tokens >= 200 - 4  # the prime's blocks (whole blocks of 4)
