"""The engine's answers to protocol round two, on small random models: a
request that only primes the cache, `n` candidates forked from the next most
likely first tokens, and a completion that stops before repeating the file's
next line."""

from collections.abc import Callable

import msgspec
import pytest
import torch

from completer.config import EngineConfig
from completer.engine.request import Confidence, Finished, Request, SamplingParams
from support.engine_harness import free_mode, greedy_reference, make_core, prompts, run

STOP_ID = 0  # make_core's end of text


def ranked_first_tokens(models, prompt: list[int], count: int) -> list[int]:
    """The target's most likely next tokens after `prompt`, end of text left out."""
    with torch.no_grad():
        logits = models[0](torch.tensor([prompt]))[0, -1]
    return [t for t in torch.topk(logits, count + 1).indices.tolist() if t != STOP_ID][:count]


def all_returned(core) -> bool:
    """Every block of every pool back, and no sequence left."""
    return all(pool.usage() == 0 for pool in core.kv.pools.values()) and not core.scheduler.requests \
        and not core.scheduler.running


def step_until(core, done: Callable[[], bool], limit: int = 50) -> list:
    """Step the core until `done()`; the events of those steps."""
    events = []
    for _ in range(limit):
        if done():
            return events
        events += core.step()
    raise AssertionError("the engine did not get there")


# -- max_tokens 0: prime the cache ------------------------------------------------------------

def test_a_priming_request_prefills_every_pool_and_generates_nothing(models, tokenizer):
    core = make_core(models, tokenizer)  # with a drafter: its pool is primed too
    prompt = prompts(1, seed=5, length=(50, 51))[0]
    primed = run(core, [Request("prime", prompt, SamplingParams(max_tokens=0, mode="line"))])["prime"]
    assert (primed.reason, primed.text, primed.timings.generated_tokens) == ("length", "", 0)
    assert primed.timings.prompt_tokens == 50 and primed.timings.cached_tokens == 0
    for pool in core.kv.pools.values():  # 12 full blocks of 4 tokens, left cached
        assert pool.num_cached_free == 12
    after = run(core, [Request("next", prompt + [7], free_mode())])["next"]
    assert after.timings.cached_tokens == 48
    assert all_returned(core)


# -- n: candidates ----------------------------------------------------------------------------

@pytest.mark.parametrize("draft", [None, "other"])
def test_candidates_go_on_greedily_from_the_next_most_likely_first_tokens(models, tokenizer, draft):
    prompt = prompts(1, seed=5)[0]
    core = make_core(models, tokenizer, draft=draft)
    done = run(core, [Request("a", prompt, SamplingParams(max_tokens=8, mode="free", n=3))])["a"]
    alone = run(make_core(models, tokenizer, draft=draft), [Request("a", prompt, free_mode(8))])["a"]
    assert done.text == alone.text and done.timings.generated_tokens == 8
    expected = []
    for first in ranked_first_tokens(models, prompt, 3)[1:]:
        text = tokenizer.decode([first] + greedy_reference(models, prompt + [first], 7))
        if text.strip() and text != done.text and text not in expected:
            expected.append(text)
    assert expected, "the model offers no second completion: pick another prompt"
    assert list(done.candidates) == expected
    assert all_returned(core)


@pytest.mark.parametrize("config", [EngineConfig(block_size=4, prefill_chunk=64, max_running=1),
                                    EngineConfig(block_size=4, prefill_chunk=64, candidates_max_batch=0)])
def test_no_candidates_where_the_engine_cannot_afford_them(models, tokenizer, config):
    ps = prompts(2, seed=5)
    core = make_core(models, tokenizer, config=config)
    done = run(core, [Request("a", ps[0], SamplingParams(max_tokens=8, mode="free", n=3)),
                      Request("b", ps[1], free_mode(8))])
    assert done["a"].candidates == () and done["a"].text
    assert all_returned(core)


def test_a_request_unsure_of_its_first_token_ends_with_nothing_and_no_candidates(models, tokenizer):
    """The confidence rules: below `first` the request ends at once with no text (`cut` "first"), and its
    candidates, whose first tokens are less likely still, are ended with it, not offered."""
    prompt = prompts(1, seed=5)[0]
    with torch.no_grad():
        first_p = torch.softmax(models[0](torch.tensor([prompt]))[0, -1].float(), -1).max().item()
    params = SamplingParams(max_tokens=8, mode="block", n=3)
    plain = run(make_core(models, tokenizer), [Request("a", prompt, params)])["a"]
    assert plain.text and plain.candidates and not plain.cut  # without the rule: a text and alternatives
    core = make_core(models, tokenizer)
    unsure = msgspec.structs.replace(params, confidence=Confidence(first=first_p + 0.01))
    done = run(core, [Request("a", prompt, unsure)])["a"]
    assert (done.text, done.candidates, done.reason, done.cut) == ("", (), "stop", "first")
    assert all_returned(core)


def test_cancelling_a_request_ends_its_candidates_and_frees_their_blocks(models, tokenizer):
    core = make_core(models, tokenizer)
    core.add(Request("a", prompts(1, seed=5)[0], SamplingParams(max_tokens=30, mode="free", n=3)))
    step_until(core, lambda: len(core.scheduler.requests) == 3)  # the request and its two candidates
    core.abort("a")
    finished = [e for e in core.step() if isinstance(e, Finished)]
    assert [(f.id, f.reason, f.candidates) for f in finished] == [("a", "cancelled", ())]
    assert all_returned(core)


def test_a_request_cancelled_before_its_candidates_join_answers_at_once_and_once(models, tokenizer):
    core = make_core(models, tokenizer, draft=None)
    core.add(Request("a", prompts(1, seed=5)[0], SamplingParams(max_tokens=30, mode="free", n=3)))
    core.step()  # prefill and the first token: its candidates asked for, the next plan forks them
    assert "a" in core.scheduler.requests and core.scheduler.forking
    core.abort("a")
    finished = [e for e in core.output.drain() if isinstance(e, Finished)]
    assert [(f.id, f.reason) for f in finished] == [("a", "cancelled")]  # not a step later
    later = step_until(core, lambda: not core.has_work)
    assert not [e for e in later if isinstance(e, Finished)] and all_returned(core)


def test_a_request_that_ended_first_answers_once_its_candidates_end_or_a_cancel_comes(models, tokenizer):
    prompt = prompts(1, seed=5)[0]
    for cancel in (False, True):
        core = make_core(models, tokenizer, draft=None)
        core.add(Request("a", prompt, SamplingParams(max_tokens=2, mode="free", n=2)))
        events = core.step()  # prefill, first token and the candidate asked for; a decode pass ends the request
        assert not core.scheduler.requests and [len(c) for _, c in core.scheduler.forking] == [1]  # the next plan forks
        assert not [e for e in events if isinstance(e, Finished)]  # its answer waits for the candidate
        if cancel:
            core.abort("a")
            events += core.output.drain()  # what the engine loop sends when no step is left to run
        events += step_until(core, lambda: not core.has_work)
        finished = [e for e in events if isinstance(e, Finished)]
        assert [(f.id, f.reason) for f in finished] == [("a", "length")]  # once
        assert len(finished[0].candidates) == (0 if cancel else 1)
        assert all_returned(core)


# -- a line that repeats the file's next line --------------------------------------------------

def test_a_completion_stops_before_a_line_that_repeats_the_next_line(models, tokenizer):
    """The same tokens, told the file's next line: the text ends before the
    first line equal to it (OutputText's rules, through the real engine)."""
    core = make_core(models, tokenizer, draft=None)
    block = SamplingParams(max_tokens=24, mode="block")
    for seed in range(100):  # random weights seldom write a newline (seed 73 does, twice)
        prompt = prompts(1, seed=seed)[0]
        lines = run(core, [Request("whole", prompt, block)])["whole"].text.split("\n")
        # A complete line after the first whose text no line before it has.
        found = [i for i in range(1, len(lines) - 1)
                 if lines[i].strip() and all(line.strip() != lines[i].strip() for line in lines[:i])]
        if found:
            break
    else:
        raise AssertionError("no prompt gave a completion of several lines")
    repeated = lines[found[0]]
    cut = run(core, [Request("cut", prompt, block, next_line=f"  {repeated.strip()} ")])["cut"]
    assert cut.text == "\n".join(lines[: found[0]]).rstrip() and cut.reason == "stop"
    assert all_returned(core)
