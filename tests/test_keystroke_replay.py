"""The keystroke replay (latency_bench/keystrokes.py, replay.py,
keystroke_bench.py): traces type real code back; two editors replayed for a
few seconds against the real server get every keystroke answered once; the
matrix command runs end to end and a switched-off prefix cache shows."""

import asyncio
import json
import subprocess
import sys
import urllib.request

import pytest

from server_harness import ROOT, TOKEN, running_server

sys.path.insert(0, str(ROOT / "latency_bench"))
from keystrokes import EditorState, corpus_files, make_trace  # noqa: E402
from replay import ReplayOptions, replay, summarize, traces  # noqa: E402


@pytest.fixture(scope="module")
def files():
    return corpus_files()[1]


def test_a_trace_types_the_real_lines_back_and_depends_only_on_its_seed(files):
    trace = make_trace(files, seed=3, editor=1, keys=600)
    assert trace == make_trace(files, seed=3, editor=1, keys=600)
    assert trace != make_trace(files, seed=4, editor=1, keys=600)
    originals = dict(files)  # by path; a document's URI ends with its file's path
    state = EditorState(trace)
    checked = 0
    for key in trace.keys:
        prefix, _ = state.press(key)
        if key.expect:  # the line as typed so far, then what is left of it: a line of the real file
            line = prefix[prefix.rfind("\n") + 1:] + key.expect
            assert f"\n{line}\n" in originals[trace.documents[key.doc].uri.split("/", 7)[-1]], line
            checked += 1
    assert checked > 400
    assert sum(k.delete for k in trace.keys) > 0  # typos get erased
    assert len({k.doc for k in trace.keys}) > 1  # it moves between files


def test_two_editors_replayed_against_the_server_get_every_keystroke_answered_once(files):
    opts = ReplayOptions(editors=2, seconds=6, run="ci")
    with running_server() as server:
        samples = asyncio.run(replay(traces(files, opts), opts, url=server.ws_url, token=TOKEN))
        req = urllib.request.Request(f"{server.http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        metrics = urllib.request.urlopen(req).read().decode()
    summary = summarize(samples)
    assert summary["keystrokes"] >= 40 and {s.editor for s in samples} == {0, 1}
    assert summary["errors"] == 0, summary["outcomes"]
    assert all(s.outcome.startswith("done:") for s in samples), summary["outcomes"]
    assert summary["completed"] > 0 and summary["ttft_p50_ms"] is not None
    assert summary["cached_share"] > 0.5  # each keystroke's prompt is mostly the one before
    shown = [line for line in metrics.splitlines() if line.startswith("completer_feedback_shown_chars_total")]
    assert summary["shown"] == 0 or float(shown[0].split()[-1]) > 0  # feedback reached the server


def test_the_matrix_command_runs_its_rows_and_writes_the_report(tmp_path):
    out = tmp_path / "k.json"
    subprocess.run([sys.executable, str(ROOT / "latency_bench/keystroke_bench.py"), "--model", "embedded",
                    "--rows", "all_on", "no_prefix_cache", "--editors", "1", "2", "--seconds", "4",
                    "--out", str(out), "--no-docs"], check=True, cwd=ROOT, timeout=600)
    result = json.loads(out.read_text())
    on, off = result["rows"]["all_on"]["runs"], result["rows"]["no_prefix_cache"]["runs"]
    assert set(on) == set(off) == {"1", "2"}
    for n in ("1", "2"):
        assert on[n]["errors"] == off[n]["errors"] == 0
        assert on[n]["cached_share"] > 0.5 and off[n]["cached_share"] == 0
    assert (out.with_suffix("") / "ttft_cdf.png").stat().st_size > 10_000
    assert (out.with_suffix("") / "p99_vs_editors.png").stat().st_size > 10_000
    if (out.with_suffix("") / "dashboard.png").exists():
        assert (out.with_suffix("") / "dashboard.png").stat().st_size > 10_000
