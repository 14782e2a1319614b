"""A jump within an open file, in a real Neovim on the default model: the
plugin as a user drives it (open a file the project never trained on, jump to
a line, type two characters, again and again), against the real `completer
serve`. What it measures, keystroke to ghost text after each jump, goes to
test-artifacts/neovim_jump.json; the assertions are about what was shown, not
how fast (timed figures are the benchmarks' business)."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from latency_bench.neovim_jump import jumps, ranks
from latency_bench.nvim_editor import Editor, nvim_build, wait_until
from latency_bench.harness import ROOT, TOKEN, running_server
from latency_bench.keystrokes import corpus_files

pytestmark = pytest.mark.skipif(shutil.which("nvim") is None and not os.environ.get("CI")
                                and not os.environ.get("COMPLETER_TEST_NVIM"), reason="nvim is not installed")

JUMPS = 24
TYPED = 2  # characters typed after each jump


def held_out_file(name: str = "_internal/req/req_install.py") -> str:
    """A long module of pip's sources (code this project never trained on)."""
    _, files = corpus_files(None)
    return dict(files)[name]


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(model="default", timeout=300) as s:
        yield s


def test_keystroke_to_ghost_text_after_a_jump_within_an_open_file(server, tmp_path):
    build = nvim_build("modern") if not os.environ.get("COMPLETER_TEST_NVIM") else nvim_build("chosen")
    ed = Editor(tmp_path, build, env={"COMPLETER_TOKEN": "", "XDG_CONFIG_HOME": str(tmp_path / "config")})
    try:
        ed.setup(url=server.ws_url, token=TOKEN, mode="line", debounce_ms=20, context={"enabled": False})
        wait_until(ed.connected, 15, what="connection to the server")
        name = "_internal/req/req_install.py"
        text = held_out_file(name)
        lines = text.split("\n")
        path = tmp_path / Path(name).name
        ed.open_python(path, text)
        ed.nvim.command("setlocal noautoindent nosmartindent indentexpr=")
        time.sleep(3)  # the plugin primes the file it entered; a user reads before the first jump
        shown: list[dict] = []
        for row, kind in jumps(lines, JUMPS, random.Random(0)):
            records = ed.retype_after_jump(row, TYPED)  # a line of code, its first characters retyped
            if records:
                shown.append({"row": row + 1, "jump": kind, **records[-1]})
            ed.nvim.input("<Esc>u")  # the file as it was: the next jump finds the text the server saw
        assert len(shown) >= JUMPS // 2, f"ghost text after only {len(shown)} of {JUMPS} jumps"
        for r in shown:
            assert r["ttft_ms"] <= r["key_to_shown_ms"], r
        report = {"file": name, "jumps": JUMPS, "typed_after_each": TYPED, "with_ghost_text": len(shown),
                  "neovim": ed.lua("local v = vim.version() return ('NVIM v%d.%d.%d'):format(v.major, v.minor, "
                                   "v.patch)"),
                  "keystroke_to_ghost_ms": ranks(shown),
                  "by_jump": {kind: ranks([r for r in shown if r["jump"] == kind]) for kind in ("near", "far")},
                  "records": shown}
        out = ROOT / "test-artifacts" / "neovim_jump.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print("\nkeystroke to ghost text after a jump:", report["keystroke_to_ghost_ms"], report["by_jump"])
    finally:
        ed.close()
