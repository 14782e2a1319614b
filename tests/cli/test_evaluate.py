"""`completer evaluate` measures what is served: completions through the
pipeline and the engine, with the served template, healing and stop logic."""

import asyncio

from completer.config import SpecConfig
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


def test_the_context_evaluation_reports_each_site_with_the_windows_retrieval_placed():
    import argparse

    from completer.evaluate import context_rows

    target = load(EMBEDDED_TARGET, "fp32")
    args = argparse.Namespace(package=["pip"], lines=4, seed=5, context_tokens=512 + 64)
    (row,), sites = context_rows(args, target, None)
    assert row.sites == len(sites) == 4 and row.with_context == sum(bool(s.context_files) for s in sites)
    assert row.exact_match_retrieved == sum(s.retrieved == s.expected for s in sites) / 4
    _, files = heldout_files("pip", own_code_only=True)
    for s in sites:
        text = next(f.text for f in files if f.path == s.path)
        assert text.split("\n")[s.line - 1].strip() == s.expected.strip()
        # every placed window comes from a file the site's client sent
        assert all(w.rsplit(":", 1)[0] in s.context_files for w in s.windows)
    assert any(s.windows for s in sites)
