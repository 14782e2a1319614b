"""The confidence rules through the real server (issue #44): a suggestion
ends before the first token the model gives less than `min_token_prob`; none
is shown when a token up to the first visible one is below `min_first_prob`;
a block ends before its first later line holding a token below
`min_line_prob`; `done.cut` names the rule. Where the model is unsure comes
from the server itself, asked with the rules off (`probs`: each token's text
and probability), at held-out line starts (token healing off, so the first
token is the model's own)."""

from __future__ import annotations

import asyncio

import pytest

from completer.engine.stopping import line_mode_end
from completer.evaluate import heldout_files
from completer.protocol import Document
from latency_bench.harness import collect, complete_msg, connect, running_server
from latency_bench.typist import sites

SETTINGS = ("model.token_healing=false", "request.max_tokens=48")
MARGIN = 0.02  # a threshold this far from every probability it decides on
OFF = {"min_first_prob": 0, "min_token_prob": 0, "min_line_prob": 0}


@pytest.fixture(scope="module")
def server():
    with running_server(*SETTINGS) as server:
        yield server


def places(count: int = 12) -> list[Document]:
    _, files = heldout_files("websockets")
    return [Document(uri=f"file:///proj/ws/{n}/{s.path}", language="python", prefix=s.prefix, suffix=s.suffix)
            for n, s in enumerate(sites(files, count, seed=3, lines=1))]


async def answer(server, document: Document, **fields) -> dict:
    msg = complete_msg("c", document.prefix, document.suffix, uri=document.uri, **fields)
    async with connect(server) as ws:  # a connection each: nothing kept from the request before
        await ws.send(msg)
        deltas, done = await collect(ws, "c")
    assert done["type"] == "done", done
    assert "".join(deltas) == done["text"]  # nothing sent was taken back
    return done


def served(server, document: Document, cut: str | None = None, **fields) -> str:
    """The text served; `cut`: the confidence rule `done` must say ended it (None: none did)."""
    done = asyncio.run(answer(server, document, **fields))
    assert done.get("cut") == cut, done
    return done["text"]


def steps_of(server, document: Document, mode: str) -> tuple[str, list[tuple[str, float]]]:
    """The text with the rules off, and each token's (text before it, its probability)."""
    done = asyncio.run(answer(server, document, mode=mode, probs=True, **OFF))
    pieces, before, steps = done["probs"], "", []
    assert "cut" not in done and "".join(t for t, _ in pieces).startswith(done["text"].rstrip())
    for text, prob in pieces:
        steps.append((before, prob))
        before += text
    return done["text"], steps


def gap_below(steps, start: int, end: int, after: int = 0, mid_line: bool = False) -> tuple[int, float] | None:
    """The first token in steps[after:end] whose probability lies 2 MARGINs below all those before it
    from `start` (`mid_line`: one with code before it on its line), and a threshold between: (its index,
    threshold)."""
    floor = 1.0
    for i in range(start, end):
        prob = steps[i][1]
        line = steps[i][0][steps[i][0].rfind("\n") + 1:]
        if i >= after and prob < floor - 2 * MARGIN and (line.strip() or not mid_line):
            return i, prob + MARGIN
        floor = min(floor, prob)
    return None


def test_a_line_ends_before_the_first_token_the_model_is_unsure_of(server):
    checked = 0
    for document in places():
        full, steps = steps_of(server, document, "line")
        end = next((i for i, (text, _) in enumerate(steps) if line_mode_end(text) is not None), len(steps))
        visible = next((i for i, (text, _) in enumerate(steps) if text.strip()), end)  # the first token after text
        found = gap_below(steps, 0, end - 1, after=visible)  # a token on the line, after some text
        if found is None or not full:
            continue
        i, threshold = found
        before = steps[i][0]
        assert full.startswith(before.rstrip()), (full, before)
        cut = served(server, document, "token", mode="line", min_first_prob=0, min_token_prob=threshold)
        assert cut == before.rstrip(), (cut, before, threshold)
        # ... and nothing at all where a token up to the first visible one is below the first-token rule
        first_threshold = min(p for _, p in steps[:visible]) + MARGIN
        if first_threshold <= 1:
            assert served(server, document, "first", mode="line", min_first_prob=first_threshold,
                          min_token_prob=0) == ""
        checked += 1
    assert checked >= 2, "too few places with an unsure token mid-line"


def test_a_block_ends_before_its_first_unsure_line(server):
    checked = 0
    for document in places():
        full, steps = steps_of(server, document, "block")
        if full.count("\n") < 2:
            continue
        later = next((i for i, (text, _) in enumerate(steps) if line_mode_end(text) is not None), None)
        # an unsure token on a later line the full block has (not its last: the block's end comes first)
        last_line = full.rfind("\n")
        stop = next((i for i, (text, _) in enumerate(steps) if len(text) > last_line), len(steps))
        # mid-line: the start of its line, held back until the line is complete, goes too
        found = gap_below(steps, later, stop, mid_line=True) if later is not None else None
        if found is None:
            continue
        i, threshold = found
        before = steps[i][0]
        expected = before[: before.rfind("\n")].rstrip()
        assert full.startswith(expected), (full, expected)
        cut = served(server, document, "line", mode="block", min_first_prob=0, min_token_prob=0,
                     min_line_prob=threshold)
        assert cut == expected and len(cut) < len(full), (cut, expected, threshold)
        checked += 1
    assert checked >= 1, "no block with an unsure later line"
