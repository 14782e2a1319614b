"""The Neovim plugin's tests' shared pieces (tests/clients/neovim/): the
settings of their server, and helpers that drive the plugin in a real
Neovim (latency_bench.nvim_editor.Editor) and read what it sent and shows.
Their fixtures (server, build, editor) are in that folder's conftest.py."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from latency_bench.harness import RULES_OFF, TOKEN
from latency_bench.nvim_editor import Editor, keys, wait_until

# Skipped without Neovim on a developer's machine; in CI (CI=true) a missing nvim fails.
needs_nvim = pytest.mark.skipif(shutil.which("nvim") is None and not os.environ.get("CI")
                                and not os.environ.get("COMPLETER_TEST_NVIM"), reason="nvim is not installed")

SETTINGS = ("engine.threads=1", *RULES_OFF)  # (the embedded model: the plugin's behaviour, not the rules)


CODE = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        "


def no_errors(ed: Editor):
    messages = ed.messages()
    assert not any(word in messages for word in ("Error", "E5108", "E5560", "stack traceback")), messages


def setup(ed: Editor, server, **opts):
    ed.setup(url=server.ws_url, token=TOKEN, **opts)
    wait_until(ed.connected, 15, what="connection to the server")


def expand(text: str, ts: int = 8) -> str:
    return text.replace("\t", " " * ts)


def lua_current(ed: Editor):
    return ed.lua("return require('completer').current()")


def idle(ed: Editor):
    """No request in flight, so every feedback owed has been sent."""
    wait_until(lambda: ed.lua("return vim.tbl_isempty(require('completer')._state.requests)"), 20, what="idle")
    time.sleep(0.3)


def next_id(ed: Editor) -> int:
    """The last request id used (completions, primes and speculative requests share the counter)."""
    return ed.lua("return require('completer')._state.next_id")


def settle(ed: Editor, tick0: int | None = None, timeout: float = 10):
    """The keystroke just sent handled (the buffer's changedtick moved past
    `tick0`), and nothing pending: no debounce running, the completion shown
    (if any) finished."""
    if tick0 is not None:
        wait_until(lambda: ed.tick() != tick0, 5, 0.005, "the keystroke")
    wait_until(lambda: not ed.lua("return require('completer').busy()"), timeout, 0.005, "the plugin to settle")


def start_typing(ed: Editor, path: Path, content: str = CODE):
    """Open `content`, put the cursor at its end in insert mode."""
    ed.open_python(path, content)
    ed.nvim.input("G")
    ed.nvim.input("A")


def type_until_completion(ed: Editor, chars: str, need_newline: bool = False, usable=None) -> dict:
    """Type `chars` one by one until a completion asked for by one of these
    keystrokes has finished and is shown (some cursor positions get an empty
    one; a keystroke typed through the completion shown asks for nothing);
    returns the shown request."""
    for ch in chars:
        first_id, tick0 = next_id(ed), ed.tick()
        ed.nvim.input(keys(ch))
        try:
            settle(ed, tick0)
        except AssertionError:
            continue
        cur = lua_current(ed)
        if not (cur and cur["kind"] == "complete" and int(cur["id"]) > first_id and cur["done"] and cur["text"]):
            continue
        if need_newline and "\n" not in cur["text"].strip("\n"):
            continue
        if usable is None or usable(cur["text"]):
            return cur
    raise AssertionError(f"no usable completion after typing {chars!r}")


def status(ed: Editor) -> dict:
    return ed.lua("return require('completer').status()")


def results(ed: Editor) -> list[dict]:
    return ed.lua("return require('completer').results()")


def result_of(ed: Editor, request_id: str) -> dict:
    """The recorded end of one request (a prime or speculative request may end after it, so not `last()`)."""
    return wait_until(lambda: next((r for r in results(ed) if r["id"] == request_id), None), 15,
                      what=f"the end of request {request_id}")


CAPTURE = """
_G.sent = {}
local c = require('completer')._state.client
local send = c.send
c.send = function(self, msg)
  table.insert(_G.sent, vim.deepcopy(msg))
  return send(self, msg)
end
"""


def capture(ed: Editor):
    """Record every message the plugin sends from now on (after setup: it makes a new client)."""
    ed.lua(CAPTURE)


def sent(ed: Editor, kind: str = "complete") -> list[dict]:
    return [m for m in ed.lua("return _G.sent") if m["type"] == kind]


def uri_of(path: Path) -> str:
    return "file://" + str(path)

