"""The keystroke's path to its first token: token healing verified inside
the prefill pass, the drafter's prefill deferred past the first token, and a
pass given up when every request in it was superseded. Each changes when
text arrives, never which text."""

import msgspec
import pytest
import torch

from completer.config import EngineConfig, SpecConfig
from completer.engine.moved_kv import longest_shared_run
from completer.engine.request import Request
from completer.healing import TokenHealer
from completer.model import Transformer
from support.engine_harness import CFG, StepLoop, build_models, free_mode, make_core, prompts, run, usage

CONFIG = EngineConfig(block_size=4, prefill_chunk=64)


@pytest.fixture(scope="module")
def models():
    return build_models()


def healed(tokenizer, prompt, token):
    """A request as the pipeline builds it when `token` ended the prompt: backed off, to be re-spelled."""
    return dict(prompt=prompt, heal=tokenizer.token_bytes(token), heal_token=token)


def heal_tokens(tokenizer):
    """A token that is the only one spelling its bytes (the healed first token
    must be it: the draft always holds), and one that many tokens start with
    (the model chooses: the draft may fail)."""
    healer = TokenHealer(tokenizer)
    ids = [i for i in range(5, 320) if tokenizer.token_bytes(i)]
    only = next(i for i in ids if healer.agreeing(tokenizer.token_bytes(i)) == [i])
    many = max(ids, key=lambda i: len(healer.agreeing(tokenizer.token_bytes(i))))
    return only, many


def test_heal_in_prefill_gives_the_same_text_with_fewer_passes(models, code_tok):
    only, many = heal_tokens(code_tok)
    requests = [Request(f"{i}-{t}", params=free_mode(12), **healed(code_tok, p, t))
                for i, p in enumerate(prompts(6, seed=4)) for t in (only, many)]
    off = make_core(models, code_tok, config=msgspec.structs.replace(CONFIG, heal_in_prefill=False))
    on = make_core(models, code_tok, config=CONFIG)
    want, got = run(off, requests), run(on, requests)
    assert {k: f.text for k, f in got.items()} == {k: f.text for k, f in want.items()}
    for r in requests:
        before, after = want[r.id].timings, got[r.id].timings
        assert after.generated_tokens == before.generated_tokens
        if r.heal_token == only and after.first_token_passes:  # the draft held: one pass saved
            assert after.first_token_passes == before.first_token_passes - 1
            assert after.decode_passes == before.decode_passes - 1
    assert any(got[r.id].timings.first_token_passes == 1 for r in requests if r.heal_token == only)
    assert usage(on) == 0 and usage(on, "draft") == 0


def test_heal_draft_is_never_served_from_the_prefix_cache(models, code_tok):
    """The heal token's K/V rode the pass but was not accepted when the model
    chose otherwise: a later prompt that ends with that token computes it."""
    _, many = heal_tokens(code_tok)
    p = prompts(1, seed=9, length=(40, 41))[0]
    core = make_core(models, code_tok, draft=None, config=CONFIG)
    run(core, [Request("healed", params=free_mode(6), **healed(code_tok, p, many))])
    warm = run(core, [Request("plain", p + [many], free_mode(6))])["plain"]
    cold = run(make_core(models, code_tok, draft=None, config=CONFIG), [Request("cold", p + [many], free_mode(6))])
    assert warm.text == cold["cold"].text
    assert warm.timings.cached_tokens <= len(p)


def test_deferred_draft_prefill_keeps_greedy_output_and_the_first_token_waits_for_no_drafter(models, code_tok):
    ps = prompts(5, seed=6)
    requests = [Request(str(i), p, free_mode(16)) for i, p in enumerate(ps)]
    eager = run(make_core(models, code_tok, spec=SpecConfig(defer_draft_prefill=False)), requests)
    deferred = run(make_core(models, code_tok), requests)
    assert {k: f.text for k, f in deferred.items()} == {k: f.text for k, f in eager.items()}
    # Between the prefill pass and the decode pass (where first tokens go out):
    # the target chose the first token; the drafter has not run unless told to.
    for defer, drafter_has in ((True, 0), (False, len(ps[0]))):
        core = make_core(models, code_tok, spec=SpecConfig(defer_draft_prefill=defer))
        core.add(Request("a", ps[0], free_mode(16)))
        seen = []
        core.step(StepLoop(lambda events: seen.append(  # noqa: B023
            (core.scheduler.requests["a"].num_generated, core.scheduler.requests["a"].kv["draft"].computed)) or []))
        assert seen == [(1, drafter_has)]
        while core.has_work:
            core.step()
        assert usage(core) == 0 and usage(core, "draft") == 0


def test_priming_still_fills_the_drafters_cache(models, code_tok):
    core = make_core(models, code_tok)
    p = prompts(1, seed=2, length=(41, 42))[0]
    run(core, [Request("prime", p, free_mode(0))])
    seen = run(core, [Request("real", p + [9], free_mode(4))])["real"]
    assert seen.timings.cached_tokens == 40
    cached, _ = core.kv.pools["draft"].match_prefix(p + [9])  # the drafter's blocks were published too
    assert len(cached) == 10
    core.kv.pools["draft"].release(cached)


def test_a_decode_pass_whose_requests_were_all_superseded_is_given_up(models, code_tok):
    """Cancels waiting for every running request stop a decode pass before its
    next layer: the requests end `cancelled`, their blocks return, and the next
    request's text is what a fresh engine gives. A prefill pass runs to its
    end: the next keystroke's prompt starts with the same text and finds its K/V."""
    core = make_core(models, code_tok)
    p, q = prompts(2, seed=8)
    waiting: list[str] = []

    def loop_of(core):
        return StepLoop(lambda events: [w for w in waiting if w in core.scheduler.requests],
                        lambda ids: bool(waiting) and set(ids) <= set(waiting))

    core.add(Request("old", p, free_mode(20)))
    core.step(loop_of(core))  # its prefill, first tokens and a decode pass
    waiting.append("old")  # a newer keystroke's cancel, there while the next pass runs
    events = core.step(loop_of(core))
    assert [(e.id, e.reason) for e in events if hasattr(e, "reason")] == [("old", "cancelled")]
    assert not core.has_work and usage(core) == 0 and usage(core, "draft") == 0
    assert core.passes_interrupted == 1
    # Cancelled while its prefill runs: the prefill ends (its K/V cached), the decode pass never starts.
    core.add(Request("older", q, free_mode(20)))
    waiting.append("older")
    events = core.step(loop_of(core))
    assert [(e.id, e.reason) for e in events if hasattr(e, "reason")] == [("older", "cancelled")]
    cached, _ = core.kv.pools["target"].match_prefix(q + [1])
    assert len(cached) == len(q) // 4
    core.kv.pools["target"].release(cached)
    assert core.passes_interrupted == 1 and usage(core) == 0
    waiting.clear()
    after = run(core, [Request("new", q, free_mode(12))])["new"]
    assert after.text == run(make_core(models, code_tok), [Request("new", q, free_mode(12))])["new"].text
    # Off (`engine.interrupt_superseded`): the pass runs to its end.
    off = make_core(models, code_tok, config=msgspec.structs.replace(CONFIG, interrupt_superseded=False))
    waiting.clear()
    off.add(Request("old", p, free_mode(20)))
    off.step(loop_of(off))
    waiting.append("old")
    off.step(loop_of(off))
    assert off.passes_interrupted == 0


def test_timings_account_for_the_passes(models, code_tok):
    core = make_core(models, code_tok)
    done = run(core, [Request(str(i), p, free_mode(10)) for i, p in enumerate(prompts(3, seed=1))])
    for f in done.values():
        t = f.timings
        assert t.prefill_ms > 0 and t.decode_passes >= 1 and t.decode_ms > 0
        assert t.decode_passes <= t.generated_tokens - 1  # the first token came with the prefill pass
        assert t.prefill_ms + t.decode_ms + t.draft_ms <= t.total_ms + 1e-6


# -- a jump within a file: K/V of text that moved ---------------------------------------------

def test_longest_shared_run_finds_the_moved_text():
    donor = list(range(100, 300))
    new = [1, 2, 3] + donor[40:150] + [7, 8, 9]
    assert longest_shared_run(new, 0, len(new) - 1, donor) == (3, 40, 110)
    assert longest_shared_run(new, 50, len(new) - 1, donor) == (50, 87, 63)  # from `start` on
    assert longest_shared_run([5] * 20, 0, 19, donor)[2] == 0


def one_layer_models():
    """K/V of a single layer depend only on each token and its position, so
    moved K/V re-rotated are exactly what recomputing them gives."""
    torch.manual_seed(1)
    target = Transformer(msgspec.structs.replace(CFG, num_hidden_layers=1)).eval()
    target.init_weights(0.3)
    return target, None


def test_moved_kv_reproduces_recomputed_text_on_a_one_layer_model(code_tok):
    models = one_layer_models()
    g = torch.Generator().manual_seed(3)
    text = torch.randint(5, 320, (260,), generator=g).tolist()
    first = [11, 12, 13, 14] + text[:200]  # the window before the jump
    after = [11, 12, 13, 14] + text[56:250]  # after it: the start moved 56 tokens down
    core = make_core(models, code_tok, draft=None, config=CONFIG)
    run(core, [Request("before", first, free_mode(4))])
    got = run(core, [Request("jump", after, free_mode(16))])["jump"]
    fresh = run(make_core(models, code_tok, draft=None, config=CONFIG), [Request("jump", after, free_mode(16))])
    assert got.timings.moved_tokens >= 128 and got.timings.cached_tokens == 4
    assert got.text == fresh["jump"].text
    assert usage(core) == 0
    off = make_core(models, code_tok, draft=None, config=msgspec.structs.replace(CONFIG, reuse_moved_kv=False))
    run(off, [Request("before", first, free_mode(4))])
    assert run(off, [Request("jump", after, free_mode(16))])["jump"].timings.moved_tokens == 0


def test_moved_kv_up_the_file_and_a_cancel_before_the_copy_return_every_block(models, code_tok):
    g = torch.Generator().manual_seed(5)
    text = torch.randint(5, 320, (300,), generator=g).tolist()
    core = make_core(models, code_tok, config=CONFIG)
    run(core, [Request("low", [3] * 4 + text[100:280], free_mode(4))])
    # Up the file: new text first, then the text the last prompt began with (copied mid-prompt).
    up = run(core, [Request("up", [3] * 4 + text[40:200], free_mode(8))])["up"]
    assert up.timings.moved_tokens >= 64
    core.add(Request("gone", [3] * 4 + text[10:170], free_mode(8)))
    core.step()  # admitted, the moved run's source blocks held, prefill begun
    core.abort("gone")
    core.step()
    assert usage(core) == 0 and usage(core, "draft") == 0
