"""Protocol round two against the real server (embedded models, ephemeral
port): priming with `max_tokens: 0`, `supersede: false`, feedback's `shown`
and `typed_chars`, `n` candidates, and completions that would repeat the next
line. The server uses the `prefix` template (as for the default model, which
has no FIM tokens): the suffix is then not in the prompt, so a test can change
it without changing what the model writes."""

import json

import pytest

from latency_bench.harness import RULES_OFF, collect, collect_all, complete_msg, connect, running_server, scrape

# A deadline no test here races on a loaded 2-core machine.
SETTINGS = ('model.template="prefix"', "server.max_inflight_per_connection=4", "request.deadline_ms=60000",
            *RULES_OFF)
PREFIX = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        "
BLOCK_SIZE = 4  # engine.block_size's default


@pytest.fixture(scope="module")
def server():
    with running_server(*SETTINGS) as s:
        yield s


async def test_max_tokens_0_primes_the_cache_and_the_next_request_finds_it(server):
    # A prompt of many blocks that no other test sends.
    prefix = "# primed\n" + "".join(f"def f{i}(x):\n    return x * {i}\n\n\n" for i in range(12)) + "def g(y):\n    "
    uri = "file:///proj/app/primed.py"
    async with connect(server) as ws:
        await ws.send(complete_msg("prime", prefix, uri=uri, max_tokens=0))
        deltas, done = await collect(ws, "prime")
        assert done["type"] == "done", done
        assert (deltas, done["text"], done["reason"]) == ([], "", "length")
        primed = done["timings"]
        assert primed["generated_tokens"] == 0 and primed["cached_tokens"] == 0
        assert primed["prompt_tokens"] > 8 * BLOCK_SIZE
        await ws.send(complete_msg("first", prefix, uri=uri, mode="free", max_tokens=4))
        _, done = await collect(ws, "first")
        first = done["timings"]
        assert first["prompt_tokens"] == primed["prompt_tokens"]
        assert first["prompt_tokens"] - first["cached_tokens"] < BLOCK_SIZE  # all but the last, partial block
    assert scrape(server)["completer_cache_primes_total"] >= 1


async def test_supersede_false_leaves_the_request_in_flight_running(server):
    uri = "file:///proj/app/speculative.py"
    async with connect(server) as ws:
        await ws.send(complete_msg("shown", PREFIX, uri=uri, mode="free", max_tokens=16))
        await ws.send(complete_msg("next-line", PREFIX + "x", uri=uri, mode="free", max_tokens=3, supersede=False))
        results = await collect_all(ws, ["shown", "next-line"])
    for rid in ("shown", "next-line"):
        assert results[rid][1]["type"] == "done" and results[rid][1]["reason"] in ("length", "eos"), results[rid]


async def test_a_superseding_request_ends_every_request_of_its_document(server):
    uri = "file:///proj/app/typing.py"
    async with connect(server) as ws:
        await ws.send(complete_msg("a", PREFIX, uri=uri, mode="free", max_tokens=1500))
        await ws.send(complete_msg("b", PREFIX + "x", uri=uri, mode="free", max_tokens=1500, supersede=False))
        await ws.send(complete_msg("other", PREFIX, uri="file:///proj/app/elsewhere.py", mode="free", max_tokens=6))
        await ws.send(complete_msg("c", PREFIX + "xy", uri=uri, mode="free", max_tokens=3))
        results = await collect_all(ws, ["a", "b", "other", "c"])
    assert results["a"][1]["reason"] == "cancelled" and results["b"][1]["reason"] == "cancelled"
    assert results["other"][1]["reason"] in ("length", "eos")  # another document's request is not its to end
    assert results["c"][1]["type"] == "done" and results["c"][1]["reason"] in ("length", "eos")


def changes(before: dict, after: dict) -> dict:
    return {key: after[key] - before.get(key, 0) for key in after}


async def test_feedback_counts_typed_through_chars_as_kept_and_unshown_completions_as_neither(server):
    lengths = {}
    before = scrape(server)
    async with connect(server) as ws:
        for rid in ("typed", "unshown", "dismissed"):
            await ws.send(complete_msg(rid, PREFIX, uri=f"file:///proj/app/{rid}.py", mode="free", max_tokens=8))
            _, done = await collect(ws, rid)
            lengths[rid] = len(done["text"])
        assert lengths["typed"] >= 3, "the completion is too short for this test"
        for feedback in ({"id": "typed", "accepted_chars": 1, "typed_chars": 2},
                         {"id": "unshown", "accepted_chars": 0, "shown": False},
                         {"id": "dismissed", "accepted_chars": 0},
                         {"id": "bad", "accepted_chars": 0, "typed_chars": -1},
                         {"id": "bad", "accepted_chars": 0, "shown": "no"}):
            await ws.send(json.dumps({"type": "feedback", **feedback}))
        errors = [json.loads(await ws.recv()) for _ in range(2)]
        assert [(e["type"], e["id"], e["code"]) for e in errors] == [("error", "bad", "bad_request")] * 2
        assert "`$.typed_chars`" in errors[0]["message"] and "`$.shown`" in errors[1]["message"]
    delta = changes(before, scrape(server))
    assert delta["completer_feedback_accepted_chars_total"] == 3
    assert delta["completer_feedback_typed_chars_total"] == 2
    assert delta["completer_feedback_shown_chars_total"] == lengths["typed"] + lengths["dismissed"]
    outcomes = {o: delta.get(f'completer_feedback_completions_total{{"outcome": "{o}"}}', 0)
                for o in ("accepted", "dismissed", "unshown")}
    assert outcomes == {"accepted": 1, "dismissed": 1, "unshown": 1}


async def test_n_brings_candidates_and_a_request_without_n_sees_no_new_field(server):
    uri = "file:///proj/app/cycle.py"
    async with connect(server) as ws:
        await ws.send(complete_msg("three", PREFIX, uri=uri, mode="free", max_tokens=8, n=3))
        deltas, done = await collect(ws, "three")
        assert done["type"] == "done" and done["text"] == "".join(deltas)
        candidates = done["candidates"]
        assert 1 <= len(candidates) <= 2 and len(set(candidates)) == len(candidates)
        assert done["text"] not in candidates and all(c.strip() for c in candidates)
        await ws.send(complete_msg("one", PREFIX, uri=uri, mode="free", max_tokens=8))
        _, plain = await collect(ws, "one")
        assert plain["type"] == "done" and "candidates" not in plain
        # Feedback about a candidate counts that candidate's length as shown.
        before = scrape(server)
        await ws.send(json.dumps({"type": "feedback", "id": "three", "accepted_chars": 1, "candidate": 1}))
        await ws.send(json.dumps({"type": "hello"}))
        await ws.recv()  # the feedback was handled before this answer
    delta = changes(before, scrape(server))
    assert delta["completer_feedback_shown_chars_total"] == len(candidates[0])


async def test_a_completion_that_repeats_the_next_line_is_dropped(server):
    prefix, uri = "def area(width, height):\n    ", "file:///proj/app/shapes.py"
    async with connect(server) as ws:
        # Twice: the second and third requests then compute the same way (the
        # prompt cached but for its last block), so the same tokens come.
        for rid in ("warm", "open"):
            await ws.send(complete_msg(rid, prefix, suffix="\n", uri=uri))  # line mode
            _, done = await collect(ws, rid)
        line = done["text"].strip()
        assert line and "\n" not in line, done
        # The same prompt (the suffix is not in it), with that line already below the cursor.
        await ws.send(complete_msg("above", prefix, suffix=f"\n\n    {line}\n    pass\n", uri=uri))
        deltas, done = await collect(ws, "above")
        assert done["type"] == "done" and done["reason"] in ("stop", "eos")
        assert (deltas, done["text"]) == ([], "")
