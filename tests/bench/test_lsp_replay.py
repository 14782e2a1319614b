"""The keystroke replay through `completer lsp` (latency_bench/lsp_replay.py,
issue #46): the editor's incremental edits rebuild exactly the document the
WebSocket editor sends (so both rows ask for the same prompts); one editor
replayed for a few seconds against the real server through its own bridge
gets every keystroke answered or superseded; the report puts the LSP row's
figures beside the WebSocket's. Invariants only: the benchmark measures speed."""

import asyncio

import pytest
from lsprotocol import types as lsp
from lsprotocol.converters import get_converter
from pygls.workspace import TextDocument

from completer.lsp import text
from latency_bench.harness import RULES_OFF, TOKEN, running_server
from latency_bench.keystroke_report import bridge
from latency_bench.keystrokes import EditorState, corpus_files, make_trace
from latency_bench.lsp_replay import position
from latency_bench.replay import ReplayOptions, replay, summarize, traces


@pytest.fixture(scope="module")
def files():
    return corpus_files()[1]


def test_the_keys_as_lsp_edits_rebuild_the_websocket_editors_document_and_prompt(files):
    """Each key's didChange (a range in UTF-16 units of the text before it) applied as
    the bridge applies it (pygls) gives the editor's text, and the bridge's prefix and
    suffix at the request's position are the WebSocket frame's: some files of the corpus
    hold characters beyond the BMP (two UTF-16 units each)."""
    beyond = [f for f in files if any(ord(c) > 0xFFFF for c in f[1])]
    assert beyond
    convert = get_converter()
    for seed, corpus in ((1, beyond), (2, files)):
        trace = make_trace(corpus, seed, 0, 1500)
        state, docs = EditorState(trace), {}
        for key in trace.keys:
            before = state.texts[key.doc]
            doc = docs.setdefault(key.doc, TextDocument(trace.documents[key.doc].uri, before, version=1))
            doc.apply_change(convert.structure(
                {"range": {"start": position(before, key.at - key.delete), "end": position(before, key.at)},
                 "text": key.insert}, lsp.TextDocumentContentChangePartial))
            prefix, suffix = state.press(key)
            assert doc.source == state.texts[key.doc]
            cursor = position(doc.source, key.at - key.delete + len(key.insert))
            at = doc.position_from_client_units(convert.structure(cursor, lsp.Position))
            assert text.around(list(doc.lines), at.line, at.character, 0)[:2] == (prefix, suffix)


def test_one_editor_through_completer_lsp_gets_every_keystroke_answered_or_superseded(files):
    opts = ReplayOptions(editors=1, seconds=8, run="ci-lsp", via="lsp")
    with running_server(*RULES_OFF) as server:  # rules off: an answer has text more often (none is asserted)
        samples = asyncio.run(replay(traces(files, opts), opts, url=server.ws_url, token=TOKEN))
    summary = summarize(samples)
    outcomes = summary["outcomes"]
    assert summary["keystrokes"] >= 20 and summary["errors"] == 0, outcomes
    # Every key one outcome: items, null (empty, or superseded by a later key or cancelled on leaving
    # its document), or nothing sent.
    assert set(outcomes) <= {"done:text", "done:empty", "done:cancelled", "not_sent"}, outcomes
    assert all(s.next_key_s is not None for s in samples if s.outcome == "done:cancelled")
    served = [s for s in samples if s.outcome == "done:text"]
    assert served, outcomes  # completions came back through the bridge
    # An LSP answer is whole: its first text is its answer.
    assert all(s.text and s.ttft_s is not None and s.ttft_s == s.answer_s for s in served)
    assert all(s.ttft_s is None for s in samples if s.outcome != "done:text")
    assert summary["ttft_n"] == len(served)
    assert summary["next_key_n"] == summary["keystrokes"] - 1  # the last key has none after it


def test_the_report_gives_the_lsp_row_minus_the_websocket_row():
    def run(ttft: float, e2e: float, served: float) -> dict:
        return {"ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 3, "ttft_n": 300, "e2e_p50_ms": e2e, "e2e_p99_ms": e2e * 3,
                "e2e_n": 320, "served_before_next_key": served, "served_n": round(400 * served), "next_key_n": 400,
                "line_sites": {f"0-{k}": e2e + k % 7 for k in range(100)},
                "ttft_sites": {f"0-{k}": ttft + k % 7 for k in range(0, 100, 2)}}

    result = {"rows": {"lsp": {"kind": "completer", "via": "lsp", "runs": {"1": run(60.0, 60.0, 0.8)}},
                       "all_on": {"kind": "completer", "via": "websocket", "runs": {"1": run(20.0, 55.0, 0.9)}}}}
    text = "\n".join(bridge(result))
    assert "TTFT p50 60 vs 20 ms (+40.0 ms; aim within 10 ms: missed)" in text
    assert "served before next key 80.0% (320 of 400) vs 90.0% (360 of 400) (-10.0 points)" in text
    # The LSP's answers with text against the WebSocket's whole answers on the same keystrokes (every other one).
    assert "LSP answer vs the WebSocket's whole answer: p50 63 vs 58 ms (+5.0 ms)" in text and "(n 50)" in text
    assert "end-to-end: p50 60 vs 55 ms (+5.0 ms)" in text
