"""One client never starves another (issue #43 item 5): admission and
interactive prefill go in turns across clients (`Request.client`, set by
Engine.submit from its affinity), a full queue makes room for another
client from the one holding most of it, a deadline is cut to
`server.max_deadline_ms`, and the drafter's catch-up over a long prompt
runs in chunks with the deadline checked between them."""

from __future__ import annotations

import time

import msgspec

from completer.config import EngineConfig, SpecConfig, load_config
from completer.engine.request import EngineError, Failed, Finished, Request, SamplingParams
from completer.pipeline import CompletionPipeline
from completer.protocol import Document
from completer.pipeline import RequestOptions
from support.engine_harness import StepLoop, free_mode, make_core, prompts

# Cold prompts of a few hundred tokens are interactive work here (bulk_tokens above them): a flood of
# new documents is what the scheduler shares between clients.
FAIR = EngineConfig(block_size=4, prefill_chunk=512, bulk_tokens=4096)


def cold(seed: int, n: int = 400) -> list[int]:
    return (prompts(1, seed=seed, length=(60, 61))[0] * 20)[:n]


def test_one_clients_flood_of_prompts_never_plans_before_anothers_keystroke(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=FAIR)
    for i in range(8):
        core.add(Request(f"flood{i}", cold(30 + i), free_mode(8), client="flooder"))
    core.add(Request("key", prompts(1, seed=5)[0], free_mode(4), client="typist"))
    plan = [c.seq.id for c in core.scheduler.schedule(time.perf_counter()).prefill]
    assert plan[0] == "key", plan  # first come, first served planned flood0 and flood1 (the whole budget)


def test_a_free_slot_goes_to_the_client_holding_fewest(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(FAIR, max_running=2))
    for i in range(3):
        core.add(Request(f"flood{i}", cold(30 + i, 100), free_mode(2), client="flooder"))
    core.scheduler.schedule(time.perf_counter())
    core.add(Request("key", prompts(1, seed=5)[0], free_mode(2), client="typist"))
    assert [s.id for s in core.scheduler.running] == ["flood0", "flood1"]
    core.abort("flood0")
    core.scheduler.schedule(time.perf_counter())
    assert [s.id for s in core.scheduler.running] == ["flood1", "key"]  # not flood2, which came first


def test_a_full_queue_makes_room_for_another_client_from_the_one_holding_most(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(FAIR, max_running=1,
                                                                                   max_queue=4))
    for i in range(4):
        core.add(Request(f"flood{i}", cold(30 + i, 100), free_mode(2), client="flooder"))
    try:
        core.add(Request("flood4", cold(40, 100), free_mode(2), client="flooder"))
        raise AssertionError("a full queue took the flooder's fifth")
    except EngineError as e:
        assert e.code == "overloaded"
    core.add(Request("key", prompts(1, seed=5)[0], free_mode(2), client="typist"))
    failed = [e for e in core.output.drain() if isinstance(e, Failed)]
    assert [(e.id, e.code) for e in failed] == [("flood3", "overloaded")]  # the flooder's newest made room
    assert [s.id for s in core.scheduler.waiting] == ["flood0", "flood1", "flood2", "key"]


def test_a_deadline_passing_during_the_drafters_catch_up_ends_the_request_within_a_chunk(models, tokenizer):
    core = make_core(models, tokenizer, config=FAIR, spec=SpecConfig(defer_draft_prefill=True, ngram=False))
    core.add(Request("long", cold(7, 900), free_mode(16), client="typist"))
    drafter = next(p for p in core.speculator.proposers if p.source == "draft")
    rows, execute = [], drafter.runner.execute

    def timed(states, batch, *args, **kwargs):
        rows.append(len(batch[0]))
        if len(batch[0]) > 1:  # a catch-up pass: the deadline passes during it
            core.scheduler.requests["long"].deadline = time.perf_counter()
        return execute(states, batch, *args, **kwargs)

    drafter.runner.execute = timed
    events = []
    loop = StepLoop(between=lambda sent: (events.extend(sent), [])[1])
    while core.has_work:
        events += core.step(loop)
    assert rows == [256], rows  # one chunk of the 900-token catch-up, then no more drafting for it
    assert [(e.id, e.reason) for e in events if isinstance(e, Finished)] == [("long", "deadline")]


def test_a_deadline_longer_than_the_servers_cap_is_cut_to_it(tokenizer):
    from completer.loading import load_models

    config = load_config(None, ['model.target="embedded"', "server.max_deadline_ms=20000"])
    target, _ = load_models("embedded", "", "fp32")
    pipeline = CompletionPipeline(target, config)
    request = pipeline.request("r", Document("file:///a.py", "def f(x):\n    return", ""),
                               options=RequestOptions(deadline_ms=600_000))
    assert request.params.deadline_s == 20.0
    short = pipeline.request("s", Document("file:///a.py", "x = ", ""), options=RequestOptions(deadline_ms=500))
    assert short.params.deadline_s == 0.5
    assert SamplingParams().deadline_s is None  # (the engine's own default: none)
