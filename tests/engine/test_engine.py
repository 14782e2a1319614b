"""The engine on small random models: speculation never changes greedy output,
batching never changes output, blocks always return to the pool, and the
cancel / deadline / stop behaviours hold."""

import asyncio
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton decode path runs on CPU in tests

import pytest

from completer.engine.calibration import calibrate_speculation
from completer.config import EngineConfig, SpecConfig
from completer.engine.engine import Engine
from completer.engine.request import EngineError, Finished, Request, SamplingParams
from support.engine_harness import StepLoop, free_mode, greedy_reference, make_core, prompts, run, usage


@pytest.mark.parametrize("draft, ngram", [(None, False), ("other", False), ("same", False),
                                          ("cut", False), (None, True), ("other", True)])
def test_greedy_with_speculation_equals_plain_greedy(models, tokenizer, draft, ngram):
    core = make_core(models, tokenizer, draft=draft, spec=SpecConfig(ngram=ngram))
    ps = prompts(12)
    done = run(core, [Request(str(i), p, free_mode()) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        want = tokenizer.decode(greedy_reference(models, p, 24))
        assert done[str(i)].text == want, (draft, ngram, i)
    if draft == "same":  # a perfect drafter: every draft accepted
        t = done["0"].timings
        assert t.draft_proposed > 0 and t.draft_accepted == t.draft_proposed
        assert 0 < t.draft_rounds <= t.draft_proposed
    if draft == "cut":  # it proposes only tokens of its head, and some are accepted
        assert sum(done[str(i)].timings.draft_accepted for i in range(len(ps))) > 0
    assert usage(core) == 0


def test_every_block_a_step_writes_is_planned_and_rejected_drafts_keep_only_the_lookahead(models, tokenizer,
                                                                                         monkeypatch):
    """The scheduler allocates a verify step's and the drafter's blocks
    (`grow_ahead`); a rejected draft's blocks stay, no more than the
    lookahead past the accepted tokens. Without the plan's lookahead the
    pass refuses to write into blocks nobody allocated."""
    core = make_core(models, tokenizer, draft="cut")  # it proposes, and some drafts are rejected
    for i, p in enumerate(prompts(4)):
        core.add(Request(str(i), p, free_mode()))
    bs, rejected = core.kv.block_size, 0
    while core.has_work:
        core.step()
        for seq in core.scheduler.decoding():
            rejected += seq.timings.draft_proposed - seq.timings.draft_accepted
            for role, state in seq.kv.items():
                assert len(state.table) <= -(-(len(seq.tokens) + 2 + core.kv.lookahead) // bs), role
    assert rejected > 0 and usage(core) == 0
    monkeypatch.setattr(type(core.kv), "grow_ahead", lambda self, seq, starting: None)
    core = make_core(models, tokenizer, draft="cut")
    with pytest.raises(RuntimeError, match="no blocks planned"):
        run(core, [Request("0", prompts(1)[0], free_mode())])


def test_sixteen_concurrent_equal_one_by_one(models, tokenizer):
    ps = prompts(16, seed=3)
    together = run(make_core(models, tokenizer), [Request(str(i), p, free_mode()) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        alone = run(make_core(models, tokenizer), [Request("x", p, free_mode())])["x"]
        assert together[str(i)].text == alone.text


def test_prefix_cache_reuses_and_matches_cold(models, tokenizer):
    core = make_core(models, tokenizer)
    p = prompts(1, seed=5, length=(50, 51))[0]
    first = run(core, [Request("a", p, free_mode())])["a"]
    second = run(core, [Request("b", p + [7], free_mode())])["b"]
    cold = run(make_core(models, tokenizer, config=EngineConfig(block_size=4, prefix_cache=False)),
               [Request("c", p + [7], free_mode())])["c"]
    assert first.timings.cached_tokens == 0
    assert second.timings.cached_tokens == 48
    assert cold.timings.cached_tokens == 0 and second.text == cold.text


def test_small_cache_evicts_and_stays_correct(models, tokenizer):
    ps = prompts(10, seed=7)
    small = make_core(models, tokenizer, blocks=40)  # forces eviction and queueing
    done = run(small, [Request(str(i), p, free_mode(16)) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert done[str(i)].text == tokenizer.decode(greedy_reference(models, p, 16))
    assert usage(small) == 0 and usage(small, "draft") == 0


def test_cancel_frees_blocks(models, tokenizer):
    core = make_core(models, tokenizer)
    ps = prompts(4, seed=9)
    for i, p in enumerate(ps):
        core.add(Request(str(i), p, free_mode(40)))
    core.step()
    core.step()
    assert usage(core) > 0
    for i in range(4):
        core.abort(str(i))
    events = core.step()
    reasons = {e.id: e.reason for e in events if isinstance(e, Finished)}
    assert reasons == {str(i): "cancelled" for i in range(4)}
    assert usage(core) == 0 and usage(core, "draft") == 0
    assert all(c == 0 for c in core.kv.pools["target"].ref_count)


@pytest.mark.parametrize("between_passes", [True, False])
def test_first_tokens_leave_before_the_decode_pass_and_a_cancel_meanwhile_skips_it(models, tokenizer,
                                                                                   between_passes):
    core = make_core(models, tokenizer, draft=None, config=EngineConfig(block_size=4, prefill_chunk=256,
                                                                        between_passes=between_passes))
    seen: list = []

    def hook(events):  # the engine loop's part: send these, apply the cancels that came meanwhile
        seen.extend(events)
        return ["b"]

    ps = prompts(2, seed=3)
    core.add(Request("a", ps[0], free_mode(8)))
    core.add(Request("b", ps[1], free_mode(8)))
    after = core.step(StepLoop(hook))
    if not between_passes:
        assert seen == [] and not any(isinstance(e, Finished) for e in after)
        return
    assert {e.id for e in seen} == {"a", "b"}  # each one's first token, before the decode pass
    assert not any(isinstance(e, Finished) for e in seen)
    finished = {e.id: e for e in after if isinstance(e, Finished)}
    assert finished["b"].reason == "cancelled" and finished["b"].timings.generated_tokens == 1
    assert "a" not in finished and core.scheduler.requests["a"].kv["target"].computed > len(ps[0])  # "a" decoded on


def test_deadline_and_length(models, tokenizer):
    core = make_core(models, tokenizer)
    p = prompts(1)[0]
    done = run(core, [Request("d", p, SamplingParams(max_tokens=50, mode="free", deadline_s=0.0)),
                      Request("l", p, SamplingParams(max_tokens=5, mode="free"))])
    assert done["d"].reason == "deadline"
    assert done["l"].reason == "length" and done["l"].timings.generated_tokens == 5


def test_overloaded_and_too_large(models, tokenizer):
    core = make_core(models, tokenizer, blocks=20, config=EngineConfig(block_size=4, max_queue=2))
    with pytest.raises(EngineError) as e:
        core.add(Request("big", list(range(5, 200)), free_mode()))
    assert e.value.code == "too_large"
    core.add(Request("1", [5, 6], free_mode()))
    core.add(Request("2", [5, 6], free_mode()))
    with pytest.raises(EngineError) as e:
        core.add(Request("3", [5, 6], free_mode()))
    assert e.value.code == "overloaded"


async def test_async_engine_streams_and_supersedes(models, tokenizer):
    engine = Engine(make_core(models, tokenizer))
    engine.start()
    try:
        p = prompts(1)[0]
        first = engine.submit(Request("1", p, free_mode(60)), supersede="conn:file.py")
        second = engine.submit(Request("2", p + [9], free_mode(8)), supersede="conn:file.py")
        r1, r2 = await asyncio.wait_for(asyncio.gather(first.finished(), second.finished()), 30)
        assert r1.reason == "cancelled"
        assert r2.reason == "length"
        deltas = [d.text async for d in engine.submit(Request("3", p, free_mode(6)))]
        assert len(deltas) >= 1
    finally:
        engine.stop()
    assert usage(engine.core) == 0


async def test_a_failing_step_ends_its_requests_as_internal_and_the_engine_goes_on(models, tokenizer):
    core = make_core(models, tokenizer)
    engine = Engine(core)
    engine.start()
    verify, calls = core.executor.decode, []

    def verify_that_fails_once(seqs):  # a fault injected into one step (nothing else is faked)
        calls.append(len(seqs))
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return verify(seqs)

    core.executor.decode = verify_that_fails_once
    try:
        p = prompts(2, seed=3)
        with pytest.raises(EngineError) as e:
            await asyncio.wait_for(engine.submit(Request("a", p[0], free_mode(30))).finished(), 30)
        assert e.value.code == "internal" and "RuntimeError: injected fault" in str(e.value)
        assert usage(core) == 0 and usage(core, "draft") == 0
        assert not core.scheduler.running and not core.scheduler.requests
        # The engine thread lives on: the next request decodes to its length.
        after = await asyncio.wait_for(engine.submit(Request("b", p[1], free_mode(8))).finished(), 30)
        assert after.reason == "length" and after.timings.generated_tokens == 8
    finally:
        engine.stop()
    assert len(calls) > 1 and usage(core) == 0


def test_token_healing_constrains_the_first_tokens(models, tokenizer):
    core = make_core(models, tokenizer)
    heal = tokenizer.token_bytes(tokenizer.encode("def")[0])
    p = prompts(1, seed=11)[0]
    core.add(Request("h", p, free_mode(8), heal=heal))
    seq = core.scheduler.requests["h"]
    done = None
    while core.has_work:
        for e in core.step():
            if isinstance(e, Finished):
                done = e
    spelled = b"".join(tokenizer.token_bytes(t) for t in seq.generated)
    assert spelled.startswith(heal)
    assert done.text == spelled[len(heal):].decode("utf-8", errors="replace")


@pytest.mark.parametrize("draft", [None, "other"])
def test_triton_decode_path_equals_torch_path(models, tokenizer, draft):
    """The GPU decode path (static buffers, Triton paged attention reading the
    block tables, padded batch buckets; verify passes through TritonAttention) on
    CPU under the Triton interpreter: the same greedy text as the gather +
    SDPA path, alone and three at once."""
    ps = prompts(3, seed=3)
    requests = [Request(str(i), p, free_mode(12)) for i, p in enumerate(ps)]
    want = run(make_core(models, tokenizer, draft=draft), requests)
    core = make_core(models, tokenizer, draft=draft, kernel=True)
    together = run(core, requests)
    alone = run(make_core(models, tokenizer, draft=draft, kernel=True), requests[:1])
    assert {k: f.text for k, f in together.items()} == {k: f.text for k, f in want.items()}
    assert alone["0"].text == want["0"].text
    assert set(core.target.graphs.buckets) >= {4}  # 3 rows padded to a bucket of 4
    if draft is not None:  # verify passes ran, through TritonAttention (widths <= k_max + 1)
        assert sum(f.timings.draft_rounds for f in together.values()) > 0
    assert usage(core) == 0


def test_calibration_times_every_width_and_returns_its_blocks(models, tokenizer):
    core = make_core(models, tokenizer)
    calibrate_speculation(core, context=32, reps=1)
    widths = set(range(1, core.spec.k_max + 2))
    for batch in (1, 4):
        assert {w for b, w in core.policy.costs.target if b == batch} == widths
        assert core.policy.costs.draft[batch] > 0
    assert usage(core) == 0 and usage(core, "draft") == 0
    # A pool too small to hold the dummy sequences: nothing timed, nothing held.
    tiny = make_core(models, tokenizer, blocks=8)
    calibrate_speculation(tiny, context=32, reps=1)
    assert tiny.policy.costs.target == {} and usage(tiny) == 0


def test_run_in_passing_thread_returns_and_raises_on_a_thread_that_ends():
    import threading

    from completer.engine.engine import run_in_passing_thread

    seen = []
    assert run_in_passing_thread(lambda a, b: seen.append(threading.current_thread()) or a + b, 2, 3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="bad"):
        run_in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def test_prefill_passes_pad_at_most_twice_what_they_hold_and_keep_every_chunk():
    from completer.engine.executor import padded_groups

    lengths = [3, 500, 17, 30, 28, 1, 64, 512, 31, 2, 200]
    groups = padded_groups([(str(i), n) for i, n in enumerate(lengths)])
    assert sorted(c for g in groups for c in g) == sorted((str(i), n) for i, n in enumerate(lengths))
    for g in groups:
        assert len(g) * max(n for _, n in g) <= 2 * sum(n for _, n in g)
    assert len(groups) < len(lengths)


def test_batched_prefill_equals_a_pass_per_sequence(models, tokenizer):
    ps = prompts(12, seed=7)
    requests = [Request(str(i), p, free_mode(8)) for i, p in enumerate(ps)]
    batched = run(make_core(models, tokenizer), requests)
    alone = run(make_core(models, tokenizer, config=EngineConfig(block_size=4, prefill_chunk=64,
                                                                 batch_prefill=False)), requests)
    assert {k: v.text for k, v in batched.items()} == {k: v.text for k, v in alone.items()}
