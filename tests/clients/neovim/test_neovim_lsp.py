"""Neovim 0.12 with no completer plugin, only `vim.lsp` configuration: the
built-in inline completion (`vim.lsp.inline_completion`) shows ghost text
from `completer lsp`, `vim.lsp.inline_completion.get()` accepts it (and
runs the accept command the server counts), and a keystroke after a jump
supersedes the request in flight (the server counts it cancelled)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from latency_bench.harness import RULES_OFF, TOKEN, sample
from latency_bench.nvim_editor import Editor, free_port, keys, nvim_build, server_on, wait_until

SETTINGS = ("engine.threads=1", *RULES_OFF)
CODE = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.re"
NAMESPACE = "nvim.lsp.inline_completion"

# What a user puts in init.lua (docs/lsp.md), with the bench's python for `completer`.
CONFIG = """
local cmd, settings = ...
vim.lsp.config('completer', { cmd = cmd, filetypes = { 'python' }, settings = settings })
vim.lsp.enable('completer')
vim.lsp.inline_completion.enable()
vim.keymap.set('i', '<Tab>', function()
  if not vim.lsp.inline_completion.get() then return '<Tab>' end
end, { expr = true })
"""


@pytest.fixture(scope="module")
def server():
    with server_on(free_port(), *SETTINGS) as s:
        yield s


def editor_with_lsp(tmp_path: Path, server, settings: dict | None = None) -> Editor:
    env = {"COMPLETER_TOKEN": TOKEN, "COMPLETER_URL": server.ws_url, "XDG_CONFIG_HOME": str(tmp_path / "config")}
    ed = Editor(tmp_path, nvim_build("modern"), env=env, plugin=["set noswapfile shortmess+=I"])
    ed.lua(CONFIG, [sys.executable, "-m", "completer.cli", "lsp"], {"completer": settings or {}})
    assert not ed.lua("return package.loaded['completer'] ~= nil"), "the plugin must not be loaded"
    return ed


def ghost(ed: Editor) -> str | None:
    """The inline completion's virtual text (first line, then its virt_lines), read with the API."""
    ns = ed.nvim.api.get_namespaces().get(NAMESPACE)
    marks = ed.nvim.api.buf_get_extmarks(0, ns, 0, -1, {"details": True}) if ns is not None else []
    if not marks:
        return None
    d = marks[0][3]
    lines = [d.get("virt_text", []), *d.get("virt_lines", [])]
    return "\n".join("".join(chunk[0] for chunk in line) for line in lines)


def attached(ed: Editor) -> bool:
    return ed.lua("return #vim.lsp.get_clients({ bufnr = 0, name = 'completer' }) == 1")


@pytest.fixture
def editor(tmp_path, server):
    ed = editor_with_lsp(tmp_path, server)
    try:
        yield ed
        messages = ed.nvim.api.exec("messages", True)
        assert "Error" not in messages and "stack traceback" not in messages, messages
    finally:
        ed.close()


def test_ghost_text_from_completer_lsp_and_get_accepts_it(server, editor, tmp_path):
    editor.open_python(tmp_path / "app.py", CODE)
    wait_until(lambda: attached(editor), 20, what="the language client")
    before = sample(server, "completer_feedback_accepted_chars_total")
    editor.nvim.input("G")
    editor.nvim.input("A")
    editor.nvim.input("a")  # `f.rea`: the client asks 200 ms after the key
    shown = wait_until(lambda: ghost(editor), 15, what="ghost text")
    line_before = editor.nvim.current.line
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.nvim.current.line != line_before, 5, what="the accept")
    assert editor.nvim.current.line == line_before + shown.split("\n")[0]
    assert editor.nvim.api.get_mode()["mode"] == "i"
    wait_until(lambda: sample(server, "completer_feedback_accepted_chars_total") >= before + len(shown), 10,
               what="the accept counted at the server")


def test_a_keystroke_after_a_jump_supersedes_the_request_in_flight(server, tmp_path):
    # Long answers (free mode, 400 tokens: over a second here), so the request is still running at the jump.
    ed = editor_with_lsp(tmp_path, server, {"mode": "free", "max_tokens": 400})
    try:
        body = "".join(f"value_{i} = compute({i})\n" for i in range(40)) + CODE
        ed.open_python(tmp_path / "jump.py", body)
        wait_until(lambda: attached(ed), 20, what="the language client")
        ed.nvim.input("G")
        ed.nvim.input("A")
        ed.nvim.input("a")
        time.sleep(0.2 + 0.35)  # the client's 200 ms, then the request runs (the open's prime is superseded)
        assert ghost(ed) is None
        cancelled = sample(server, "completer_request_success_total", finished_reason="cancelled")
        ed.nvim.input("<C-o>10G<End>")  # a jump, then keys there
        ed.nvim.input(keys("  # x"))
        wait_until(lambda: sample(server, "completer_request_success_total", finished_reason="cancelled")
                   > cancelled, 10, what="the request in flight cancelled")
        shown = wait_until(lambda: ghost(ed), 20, what="ghost text at the new place")
        row = ed.nvim.api.get_namespaces()[NAMESPACE]
        mark = ed.nvim.api.buf_get_extmarks(0, row, 0, -1, {})[0]
        assert mark[1] == 9 and shown  # on the line jumped to (0-based 9)
    finally:
        ed.close()
