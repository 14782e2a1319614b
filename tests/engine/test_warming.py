"""Warming (completer/warming.py, server/warming.py, `server.warm_windows`):
the windows an open document's next jump may take are prefilled while the
engine has nothing else to do. The heads are the prompts a jump builds, up
to its cursor; the engine runs them after all other bulk work, one at a
time, never in a keystroke's way; through the real server a jump after a
pause finds its prompt cached."""

from __future__ import annotations

import asyncio
import inspect
import json.decoder
import random
import time

import msgspec
import pytest

from completer.document import DocumentPrompt
from completer.config import EngineConfig
from completer.engine.request import Finished, Request, SamplingParams
from completer.prompt import PromptBuilder, Snippet, get_template
from completer.warming import warm_heads
from support.engine_harness import StepLoop, free_mode, make_core, prompts, usage

BULK = EngineConfig(block_size=4, prefill_chunk=64, bulk_tokens=64, bulk_chunk=256)
WARM = SamplingParams(max_tokens=0)
CONTEXT = [Snippet("lib/util.py", "def helper(x):\n    return x + 1\n")]


def long_prompt(n: int = 600, seed: int = 11) -> list[int]:
    return (prompts(1, seed=seed, length=(60, 61))[0] * 20)[:n]


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def source_text() -> str:
    """Real code of a few hundred lines, longer than any window here."""
    import argparse
    return inspect.getsource(argparse)[:40_000] + inspect.getsource(json.decoder)


@pytest.mark.parametrize("order", ["prefix", "psm"])
def test_a_jump_of_up_to_40_lines_builds_a_prompt_that_one_of_5_warm_heads_holds_but_its_last_tokens(code_tok, order):
    template = get_template("prefix") if order == "prefix" else msgspec.structs.replace(
        get_template("default"), order="psm")
    text = source_text()
    lines = text.split("\n")
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)
    rng, left, cold = random.Random(3), [], []
    for _ in range(12):
        row = rng.randrange(80, len(lines) - 80)
        state = DocumentPrompt(PromptBuilder(code_tok, template, 1600))
        cursor = starts[row] + len(lines[row]) // 2
        before = state.update(text[:cursor], text[cursor:], "pkg/mod.py", CONTEXT).tokens
        heads = warm_heads(state, 5, text[:cursor], text[cursor:])
        assert 1 <= len(heads) <= 5
        for jump in (5, 20, 40):
            for to in (row - jump, row + jump):
                at = starts[to] + min(2, len(lines[to]))
                again = DocumentPrompt(state.builder)  # (the same state, as the jump finds it)
                again.__dict__.update({k: (v[:] if isinstance(v, list) else v) for k, v in state.__dict__.items()})
                again.update(text[:at], text[at:], "pkg/mod.py", CONTEXT)
                prompt = again.builder.head(again.context, again.prefix_ids)  # (PSM: the suffix follows)
                left.append(len(prompt) - max(common(prompt, h) for h in heads))
                cold.append(len(prompt) - common(prompt, before))
    left.sort()
    assert left[len(left) // 2] <= 2 and left[int(0.9 * len(left))] <= 8, left
    assert sorted(cold)[len(cold) // 2] > 50  # without the heads most of these jumps computed their window


def test_no_heads_for_spm_prompts_nor_when_turned_off(code_tok):
    state = DocumentPrompt(PromptBuilder(code_tok, get_template("default"), 400))  # SPM: the suffix comes first
    text = source_text()
    state.update(text[:5000], text[5000:], "pkg/mod.py")
    assert warm_heads(state, 3, text[:5000], text[5000:]) == []
    state = DocumentPrompt(PromptBuilder(code_tok, get_template("prefix"), 400))
    state.update(text[:5000], text[5000:], "pkg/mod.py")
    assert warm_heads(state, 0, text[:5000], text[5000:]) == []
    assert len(warm_heads(state, 2, text[:5000], text[5000:])) == 2


def test_warming_runs_after_all_other_bulk_work_and_never_gets_a_starved_slice(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(
        BULK, bulk_starve_ms=500.0, bulk_slice_ms=25.0))
    core.add(Request("warm", long_prompt(100, seed=3), WARM, warm=True))
    core.add(Request("prime", long_prompt(600), WARM))
    plan = core.scheduler.schedule(0.0)
    assert [c.seq.id for c in plan.prefill] == ["prime"]  # though the warm prompt has less left
    core.abort("prime")

    core.add(Request("key", prompts(1, seed=5)[0], free_mode(40)))
    core.step(StepLoop())  # the keystroke prefilled: it decodes now
    assert core.scheduler.requests["warm"].bulk and core.scheduler.requests["warm"].kv["target"].computed == 0
    for now in (10.0, 10.6, 30.0):  # a prime would get its slice past bulk_starve_ms; warming never
        assert core.scheduler.schedule(now).prefill == []


def test_one_warm_prompt_is_admitted_at_a_time(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=BULK)
    for i in range(3):
        core.add(Request(f"warm{i}", long_prompt(200, seed=20 + i), WARM, warm=True))
    core.scheduler.schedule(0.0)
    assert [s.id for s in core.scheduler.running] == ["warm0"]
    events = []
    loop = StepLoop(between=lambda sent: (events.extend(sent), [])[1])  # (ends go out between passes too)
    while core.has_work:
        events += core.step(loop)
        assert sum(s.request.warm for s in core.scheduler.running) <= 1
    done = [e.id for e in events if isinstance(e, Finished)]
    assert done == ["warm0", "warm1", "warm2"] and usage(core) == 0


def test_a_warm_pass_stops_for_any_other_request_and_never_stops_another_pass(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=BULK)
    core.add(Request("warm", long_prompt(600), WARM, warm=True))
    core.scheduler.schedule(0.0)
    warm = core.scheduler.requests["warm"]
    prime = Request("prime", long_prompt(900, seed=4), WARM)  # more left than the warm prompt: still first
    assert core.goes_first(prime, warm, 256)
    core.add(Request("other", long_prompt(300, seed=5), WARM))
    core.scheduler.schedule(0.0)
    assert not core.goes_first(Request("warm2", long_prompt(50, seed=6), WARM, warm=True), core.scheduler.requests["other"], 256)


def test_a_warm_prompt_already_cached_ends_at_once_without_a_pass(models, tokenizer):
    core = make_core(models, tokenizer, draft=None, config=BULK)
    prompt = long_prompt(300)
    core.add(Request("prime", prompt, WARM))
    while core.has_work:
        core.step(StepLoop())
    passes = []
    start = core.runners["target"].start
    core.runners["target"].start = lambda *a, **k: (passes.append(1), start(*a, **k))[1]
    core.add(Request("warm", prompt, WARM, warm=True))
    events = core.output.drain()
    assert [(e.id, e.reason) for e in events if isinstance(e, Finished)] == [("warm", "length")]
    assert events[0].timings.cached_tokens >= 300 - 4 and passes == [] and not core.has_work


# -- through the real server ------------------------------------------------

SERVER = ['model.target="embedded"', 'model.template="prefix"', "model.context_tokens=512", "request.max_tokens=16",
          "server.warm_after_ms=50"]


async def test_through_the_server_a_jump_after_a_pause_finds_its_window_warm_and_not_with_warming_off():
    from latency_bench.harness import collect, complete_msg, connect, running_server, scrape

    text = source_text()
    lines = text.split("\n")
    at = sum(len(line) + 1 for line in lines[:400])
    jump_to = at + sum(len(line) + 1 for line in lines[400:412])  # 12 lines down
    left, warmed = {}, {}
    for windows in (3, 0):
        with running_server(*SERVER, f"server.warm_windows={windows}") as server:
            async with connect(server) as ws:
                await ws.send(complete_msg("1", text[:at], text[at:], max_tokens=4, mode="free"))
                await collect(ws, "1")
                end = time.monotonic() + 60
                while windows and not scrape(server).get('completer_warm_requests_total{"outcome": "length"}') \
                        and time.monotonic() < end:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.0)  # the pause (the same with warming off)
                await ws.send(complete_msg("2", text[:jump_to], text[jump_to:], max_tokens=4, mode="free"))
                _, done = await collect(ws, "2")
                timings = done["timings"]
                left[windows] = timings["prompt_tokens"] - timings["cached_tokens"]
                warmed[windows] = sum(v for k, v in scrape(server).items()
                                      if k.startswith("completer_warm_requests_total"))
    assert left[3] <= 8 < 50 <= left[0], (left, warmed)  # without: the 12 lines (~96 tokens) computed
    assert warmed[3] >= 1 and warmed[0] == 0


def test_a_full_queue_refuses_warming_and_a_keystroke_takes_a_waiting_warm_prompts_place(models, tokenizer):
    from completer.engine.request import EngineError

    core = make_core(models, tokenizer, draft=None, config=msgspec.structs.replace(BULK, max_running=1, max_queue=3))
    core.add(Request("key0", prompts(1, seed=5)[0], free_mode(2), client="a"))
    core.add(Request("warm", long_prompt(200, seed=3), WARM, warm=True, client="a"))
    core.add(Request("key1", prompts(1, seed=6)[0], free_mode(2), client="b"))
    try:
        core.add(Request("warm2", long_prompt(200, seed=4), WARM, warm=True, client="b"))
        raise AssertionError("a full queue took a warm prompt")
    except EngineError as e:
        assert e.code == "overloaded"
    core.add(Request("key2", prompts(1, seed=7)[0], free_mode(2), client="a"))  # the warm prompt gives way
    ended = [(e.id, e.reason) for e in core.output.drain() if isinstance(e, Finished)]
    assert ended == [("warm", "cancelled")]
    assert [s.id for s in core.scheduler.waiting] == ["key0", "key1", "key2"]
