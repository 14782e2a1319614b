"""The language server's parts without a server: the window it cuts equals the
Neovim plugin's (the Lua, run in a real Neovim), the context ring keeps its
list still while the user types in one document, settings refuse a bad
value naming it."""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from completer.lsp import text
from completer.lsp.context import ContextRing, OpenDocument
from completer.lsp.settings import ContextSettings, LspSettings, updated
from latency_bench.nvim_editor import PLUGIN, nvim_build


def lua_windows(cases: list[tuple[int, int, int]]) -> list[list[int]]:
    """The plugin's text.window(row, n, max_lines) for each case, in a headless Neovim."""
    build = nvim_build("modern")
    script = ("local t = require('completer.text'); local out = {}; "
              "for _, c in ipairs(vim.json.decode(vim.env.CASES)) do "
              "local a, b = t.window(c[1], c[2], c[3]); out[#out + 1] = { a, b } end; "
              "io.stdout:write(vim.json.encode(out)); vim.cmd('qa!')")
    result = subprocess.run([build.binary, "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN}",
                             "-c", f"lua {script}"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **build.env, "CASES": json.dumps(cases)})
    return json.loads(result.stdout)


def test_the_window_is_the_neovim_plugins():
    cases = [(row, n, max_lines) for max_lines in (0, 1, 5, 40, 64, 100, 2000) for n in (1, 50, 300, 5000)
             for row in (0, 1, 31, 32, 33, n // 2, n - 1)]
    assert [list(text.window(*c)) for c in cases] == lua_windows(cases)


def test_around_cuts_prefix_and_suffix_at_the_cursor_in_the_window():
    lines = [f"line {i}\n" for i in range(300)]
    prefix, suffix, first, last = text.around(lines, 150, 4, 64)
    assert (first, last) == text.window(150, 300, 64) == (64, 224)
    assert prefix == "".join(lines[64:150]) + "line" and suffix == " 150\n" + "".join(lines[151:224])
    # CRLF files: the server sees \n; a cursor past the last line (after the final newline) is a blank line.
    prefix, suffix, _, _ = text.around(["a\r\n", "b\r\n"], 2, 0, 0)
    assert (prefix, suffix) == ("a\nb\n", "")


@pytest.mark.parametrize("setting, before, after, mode", [
    ("auto", "    ", "", "block"), ("auto", "    x = ", "", "line"), ("auto", "", ")", "line"),
    ("free", "x", "", "free"), ("line", "", "", "line")])
def test_auto_asks_block_on_a_blank_line_only(setting, before, after, mode):
    assert text.mode(setting, before, after) == mode


def doc(uri: str, lines: int, language: str = "python") -> OpenDocument:
    return OpenDocument(uri, "".join(f"{uri.rsplit('/', 1)[-1]}_{i} = {i}\n" for i in range(lines)), language)


def test_the_ring_picks_the_document_left_and_keeps_the_list_while_typing():
    cfg = ContextSettings(chunk_lines=8)
    a, b, c = doc("file:///w/a.py", 100), doc("file:///w/b.py", 100), doc("file:///w/c.js", 100, "javascript")
    docs = {d.uri: d for d in (a, b, c)}
    ring = ContextRing()
    ring.request(a.uri, 50, docs, cfg)
    ring.edit(a.uri, 50, 51)
    first = ring.items(a.uri, 0, 100, docs, cfg)
    assert [(i.uri, i.kind) for i in first] == [(b.uri, "open")]  # the other python document; not c.js
    ring.request(a.uri, 51, docs, cfg)  # typing on in a: the same list, the same object
    assert ring.items(a.uri, 0, 100, docs, cfg) is first
    ring.request(b.uri, 10, docs, cfg)  # left a: its edit and its cursor's lines come first
    items = ring.items(b.uri, 0, 100, docs, cfg)
    assert [(i.uri, i.kind) for i in items] == [(a.uri, "edit")]  # the visited chunk overlaps the edit's
    assert "a.py_50 = 50" in items[0].text and len(items[0].text.splitlines()) == 8
    assert ring.items(b.uri, 0, 100, {b.uri: b}, cfg) == []  # a document that may not be sent is left out
    ring.close(a.uri)  # closed: its chunks go; the editor no longer has it open
    assert ring.ring == [] and ring.items(b.uri, 0, 100, {b.uri: b, c.uri: c}, cfg) == []


def test_settings_merge_and_refuse_a_bad_value_by_name():
    s = updated(LspSettings(), {"completer": {"mode": "line", "context": {"max_chunks": 2}}})
    assert s.mode == "line" and s.context.max_chunks == 2 and s.context.enabled
    s = updated(s, {"debounce_ms": 30})  # flat, as some clients send it
    assert s.debounce_ms == 30 and s.mode == "line"
    with pytest.raises(msgspec.ValidationError, match="mode"):
        updated(s, {"mode": "sometimes"})
    with pytest.raises(msgspec.ValidationError, match="max_chars"):
        updated(s, {"context": {"max_chars": "lots"}})
