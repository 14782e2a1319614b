"""`completer evaluate` measures what is served: completions through the
pipeline and the engine, with the served template, healing and stop logic."""

import asyncio

from completer.engine.config import SpecConfig
from completer.evaluate import served, draft_acceptance, exact_match, heldout_files, line_starts
from completer.loading import load
from completer.model_store import EMBEDDED_TARGET
from completer.pipeline import RequestOptions


def test_exact_match_countsserved_completions_and_a_perfect_drafter_is_always_accepted():
    target, same = load(EMBEDDED_TARGET, "fp32"), load(EMBEDDED_TARGET, "fp32")
    _, files = heldout_files()
    picks = line_starts(files, 6, seed=3)
    mid = line_starts(files, 6, seed=3, mid_line=True)
    for f, cursor, end in mid:  # mid-line cursors sit inside the line's text
        line_start = f.text.rfind("\n", 0, cursor) + 1
        assert f.text[line_start:cursor].strip() and f.text[cursor:end].strip()
    done = asyncio.run(served(target, None, picks, 512 + 64, RequestOptions(max_tokens=48, mode="line"),
                               SpecConfig(draft_model=False)))
    assert all("\n" not in d.text.strip("\n") for d in done)  # line mode, as served
    expected = sum(d.text.rstrip() == f.text[c:e].rstrip() for d, (f, c, e) in zip(done, picks)) / len(picks)
    assert exact_match(target, picks, 512 + 64) == expected
    acceptance, per_pass = draft_acceptance(target, same, picks, 512 + 64, k=3, length=16)
    assert acceptance == 1.0 and 2.0 < per_pass <= 4.0
