"""The Neovim plugin (editor_clients/neovim) in a real headless Neovim, driven
over pynvim, against the real `completer serve`. The local models write poor
code, so every check compares what Neovim shows or inserts with what the
server sent (done.text), never with expected code."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import statistics
import threading
import time
from pathlib import Path

import pytest

from latency_bench.nvim_editor import Editor, free_port, keys, metric, server_on, wait_until
from latency_bench.harness import ROOT, TOKEN
from support.neovim import (CODE, SETTINGS, capture, expand, idle, lua_current, needs_nvim, next_id, no_errors,
                            result_of, sent, settle, setup, start_typing, status, type_until_completion, uri_of)

pytestmark = needs_nvim

ACCEPTED = "completer_feedback_accepted_chars_total"
SHOWN = "completer_feedback_shown_chars_total"


# -- WebSocket layer ------------------------------------------------------------


def test_sha1_and_accept_key(editor):
    for msg in ["", "abc", "a" * 1000, "é" * 77]:
        assert editor.lua("return require('completer.sha1').hex(...)", msg) == hashlib.sha1(msg.encode()).hexdigest()
    key = base64.b64encode(os.urandom(16)).decode()
    expected = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    assert editor.lua("return require('completer.sha1').websocket_accept(...)", key) == expected.decode()


CONNECT_LUA = """
local port, path = ...
_G.ws_events = {}
local function ev(...) table.insert(_G.ws_events, {...}) end
_G.ws_conn = require('completer.websocket').connect({host = '127.0.0.1', port = port, path = path}, {
  on_open = function() ev('open') end,
  on_message = function(text) ev('message', text) end,
  on_close = function(code, reason, err) ev('close', code or vim.NIL, reason or vim.NIL, err or vim.NIL) end,
})
"""


class ThreadServer:
    """An asyncio server on its own thread: a websockets server or a raw one."""

    def __init__(self, start):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.result: dict = {}
        self.thread = threading.Thread(target=self.run, args=(start,), daemon=True)
        self.thread.start()
        assert self.ready.wait(10)

    def run(self, start):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(start(self))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        async def shutdown():
            self.server.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_websocket_fragments_ping_pong_close(editor):
    from websockets.asyncio.server import serve

    async def start(box):
        async def handler(ws):
            pong = await ws.ping(b"are you there")  # the client must answer
            await asyncio.wait_for(pong, 5)
            box.result["pong"] = True
            await ws.send(["frag", "ment", "ed é"])  # one message in three frames
            await ws.send("x" * 70000)  # 64-bit length
            box.result["from_client"] = [await ws.recv(), await ws.recv()]
            await ws.close(4000, "bye now")
        return await serve(handler, "127.0.0.1", 0)

    srv = ThreadServer(start)
    try:
        editor.lua(CONNECT_LUA, srv.port, "/ws")
        events = lambda: editor.lua("return _G.ws_events")  # noqa: E731
        wait_until(lambda: len(events()) >= 3, 10, what="two messages")
        ev = events()
        assert ev[0] == ["open"] and ev[1] == ["message", "fragmented é"] and ev[2] == ["message", "x" * 70000]
        # The client's frames: one long masked text frame, then a message in two fragments.
        editor.lua("""
            local c = _G.ws_conn
            c:send_text(string.rep('y', 300))
            c:send_frame(1, 'hel', false)
            c:send_frame(9, 'ping in between', true)
            c:send_frame(0, 'lo', true)""")
        wait_until(lambda: len(events()) >= 4, 10, what="close")
        assert events()[3] == ["close", 4000, "bye now", None]
        assert srv.result == {"pong": True, "from_client": ["y" * 300, "hello"]}
    finally:
        srv.close()


def test_handshake_with_a_wrong_accept_key_is_refused(editor):
    async def start(box):
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                         b"Sec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n"
                         b"\x81\x05hello")
            await writer.drain()
            await asyncio.sleep(2)
            writer.close()
        return await asyncio.start_server(handle, "127.0.0.1", 0)

    srv = ThreadServer(start)
    try:
        editor.lua(CONNECT_LUA, srv.port, "/v1/ws")
        ev = wait_until(lambda: editor.lua("return _G.ws_events"), 10, what="close")
        assert ev == [["close", 1006, "", "bad Sec-WebSocket-Accept"]]
    finally:
        srv.close()


# -- Completions against the real server ----------------------------------------------


def test_ghost_text_is_done_text_and_tab_accepts(server, editor, tmp_path):
    setup(editor, server, max_tokens=24)
    start_typing(editor, tmp_path / "app.py")
    cur = type_until_completion(editor, "retur")
    last = result_of(editor, cur["id"])
    assert last["type"] == "done" and last["text"] == cur["text"]
    assert "".join(last["deltas"]) == last["text"]
    shown = editor.ghost()
    assert shown["text"] == expand(last["text"])  # the extmarks, read through the API
    assert editor.lua("return require('completer').ghost_text()") == last["text"]
    row, col = editor.nvim.current.window.cursor
    assert (shown["row"], shown["col"]) == (row - 1, col)
    assert shown["pos"] == ("inline" if editor.nvim.funcs.has("nvim-0.10") else "overlay")
    before = editor.buffer_text()
    idle(editor)
    accepted0 = metric(server, ACCEPTED)
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() != before, 5, what="accept")
    assert editor.buffer_text() == before + last["text"]
    assert editor.ghost() is None and editor.mode() == "i"
    row, col = editor.nvim.current.window.cursor
    lines = editor.nvim.current.buffer[:]
    assert (row, col) == (len(lines), len(lines[-1].encode()))  # the cursor is after the insertion
    wait_until(lambda: metric(server, ACCEPTED) == accepted0 + len(last["text"]), 10, what="feedback")


def cursor_offset(ed: Editor) -> int:
    """The cursor as an index into buffer_text()."""
    row, col = ed.nvim.current.window.cursor
    lines = ed.nvim.current.buffer[:]
    return sum(len(x) + 1 for x in lines[:row - 1]) + len(lines[row - 1].encode()[:col].decode())


def test_ghost_text_inside_a_line(server, editor, tmp_path):
    setup(editor, server, max_tokens=24)
    editor.open_python(tmp_path / "mid.py", CODE + "data = f.read()\n    return data\n")
    editor.nvim.current.window.cursor = (6, 15)  # after "data = "
    editor.nvim.input("i")
    cur = type_until_completion(editor, "json.loads(")
    shown = editor.ghost()
    assert shown["text"] == expand(cur["text"])
    if "\n" not in cur["text"]:
        expected_pos = "inline" if editor.nvim.funcs.has("nvim-0.10") else "eol"
        assert shown["pos"] == expected_pos  # after the line's end before 0.10: the rest stays visible
    before, at = editor.buffer_text(), cursor_offset(editor)
    assert before[at:].startswith("f.read()")
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.ghost() is None, 5, what="accept")
    assert editor.buffer_text() == before[:at] + cur["text"] + before[at:]
    assert cursor_offset(editor) == at + len(cur["text"])


def test_tab_falls_back_when_nothing_is_shown(server, editor, tmp_path):
    setup(editor, server)
    editor.lua("require('completer').disable()")
    editor.open_python(tmp_path / "t.py", "")
    editor.nvim.input("ix<Tab>y")
    wait_until(lambda: editor.buffer_text() == "x\ty", 5, what="a real tab")


def test_streaming_renders_each_delta_before_done(server, editor, tmp_path):
    setup(editor, server, mode="free", max_tokens=48)
    editor.lua("""
        local ghost = require('completer.ghost')
        local show = ghost.show
        _G.shows = {}
        ghost.show = function(buf, row, col, text, hl)
          local r = require('completer')._state.req
          table.insert(_G.shows, {id = r.id, text = text, done = r.done ~= nil})
          return show(buf, row, col, text, hl)
        end""")
    start_typing(editor, tmp_path / "s.py")
    cur = type_until_completion(editor, "for ")
    last = result_of(editor, cur["id"])
    shows = [s for s in editor.lua("return _G.shows") if s["id"] == cur["id"]]
    assert len(last["deltas"]) >= 2
    partial = ["".join(last["deltas"][:i + 1]) for i in range(len(last["deltas"]))]
    # One render per non-empty delta, in order, then once more on done (same text).
    assert [s["text"] for s in shows if not s["done"]] == [p for p in partial if p]
    assert not shows[0]["done"] and shows[-1]["text"] == last["text"]


def test_keystroke_cancels_the_request_in_flight(server, editor, tmp_path):
    setup(editor, server, mode="free", max_tokens=64, debounce_ms=10)
    start_typing(editor, tmp_path / "c.py")
    for ch in "return os":
        first_id = next_id(editor)
        editor.nvim.input(keys(ch))
        try:  # this keystroke's completion streaming in, not finished: type again at once
            cur = wait_until(lambda: (c := lua_current(editor)) and c["kind"] == "complete"
                             and int(c["id"]) > first_id and c["shown"] and c, 10, 0.005, "stream")
        except AssertionError:
            continue
        # A character the completion does not begin with: typing it through would keep the request.
        shown = editor.lua("local c = require('completer').current(); return c and c.text or ''")
        editor.nvim.input("Z" if shown.startswith("x") else "x")
        wait_until(lambda: any(r["id"] == cur["id"] for r in editor.lua("return require('completer').results()")),
                   10, what="the first request's end")
        first = next(r for r in editor.lua("return require('completer').results()") if r["id"] == cur["id"])
        if not cur["done"] and first["cancel_sent"]:
            assert first["reason"] == "cancelled"
            assert editor.ghost() is None or editor.lua("return require('completer').current().id") != cur["id"]
            return
    pytest.fail("no completion was still streaming at the next keystroke")


def next_word(text: str) -> str:
    """What accept word takes (:help completer-accept-word), written independently."""
    return re.match(r"\n[ \t]*|[ \t]*[\w\u0080-\U0010ffff]+|[ \t]*[^\w\s\u0080-\U0010ffff]+|[ \t]+|.",
                    text, re.S | re.A).group()


def next_line(text: str) -> str:
    return "\n" + text[1:].split("\n")[0] if text.startswith("\n") else text.split("\n")[0]


def test_word_and_line_split(editor):
    cases = ["  foo.bar()", ".bar()", "\n    return x", "():\n    pass", "   ", "é = 1", "x\n", "\n\nfoo"]
    for text in cases:
        assert editor.lua("return require('completer.text').next_word(...)", text) == next_word(text), text
        assert editor.lua("return require('completer.text').next_line(...)", text) == next_line(text), text


def test_accept_word_then_line_then_dismiss_sends_feedback(server, editor, tmp_path):
    setup(editor, server, mode="free", max_tokens=40)
    start_typing(editor, tmp_path / "w.py")
    cur = type_until_completion(editor, "for ", need_newline=True)
    text = cur["text"]
    word, rest = next_word(text), text[len(next_word(text)):]
    line = next_line(rest)
    before = editor.buffer_text()
    idle(editor)
    accepted0, shown0 = metric(server, ACCEPTED), metric(server, SHOWN)
    editor.nvim.input("<M-Right>")
    wait_until(lambda: editor.buffer_text() == before + word, 5, what="accept word")
    assert editor.ghost()["text"] == expand(rest)
    editor.nvim.input("<M-C-Right>")
    wait_until(lambda: editor.buffer_text() == before + word + line, 5, what="accept line")
    remaining = rest[len(line):]
    assert (editor.ghost() or {"text": ""})["text"] == expand(remaining)
    editor.nvim.input("<Esc>")
    wait_until(lambda: editor.mode() == "n" and editor.ghost() is None, 5, what="dismiss")
    # One feedback for the completion: the characters taken by both accepts.
    wait_until(lambda: metric(server, ACCEPTED) == accepted0 + len(word) + len(line), 10, what="feedback")
    assert metric(server, SHOWN) == shown0 + len(text)


@pytest.mark.parametrize("how", ["<Esc>", "<Left>", "<C-]>"])
def test_dismiss_reports_zero_accepted(server, editor, tmp_path, how):
    setup(editor, server, max_tokens=24)
    start_typing(editor, tmp_path / "d.py")
    cur = type_until_completion(editor, "retur")
    before = editor.buffer_text()
    idle(editor)
    accepted0, shown0 = metric(server, ACCEPTED), metric(server, SHOWN)
    editor.nvim.input(how)
    wait_until(lambda: editor.ghost() is None, 5, what="dismiss")
    wait_until(lambda: metric(server, SHOWN) >= shown0 + len(cur["text"]), 10, what="feedback")
    assert metric(server, ACCEPTED) == accepted0 and editor.buffer_text() == before
    assert editor.mode() == ("n" if how == "<Esc>" else "i")


# -- Connection: restart, server down, token ------------------------------------------


def test_reconnects_after_a_server_restart(editor, tmp_path):
    port = free_port()
    with server_on(port, *SETTINGS) as s:
        setup(editor, s, max_tokens=16, reconnect_max_ms=1000)
        start_typing(editor, tmp_path / "r.py")
        type_until_completion(editor, "ret")
    wait_until(lambda: status(editor)["state"] != "open", 10, what="the disconnect")
    editor.nvim.input(keys("urn os.pa"))  # typing while the server is down: nothing, quietly
    time.sleep(1.0)
    assert editor.ghost() is None and status(editor)["state"] != "open"
    with server_on(port, *SETTINGS) as s:
        wait_until(editor.connected, 15, what="the reconnect (backoff)")
        assert status(editor)["connects"] == 2
        cur = type_until_completion(editor, "th.jo")
        assert editor.ghost()["text"] == expand(cur["text"]) == expand(result_of(editor, cur["id"])["text"])


def test_server_down_is_quiet_and_typing_retries(editor, tmp_path):
    port = free_port()
    editor.setup(url=f"ws://127.0.0.1:{port}/v1/ws", token=TOKEN, reconnect_min_ms=60000, reconnect_max_ms=60000)
    start_typing(editor, tmp_path / "q.py")
    wait_until(lambda: status(editor).get("error"), 10, what="the failed connect")
    for ch in "x = os.path.join(a, b)":  # keystrokes with nobody listening
        editor.nvim.input(keys(ch))
        time.sleep(0.02)
    time.sleep(0.5)
    st = status(editor)
    assert st["state"] == "disconnected" and "connect" in st["error"] and st["retry_in_ms"] > 0
    assert st["counts"]["sent"] == 0 and editor.ghost() is None
    out = editor.nvim.api.exec("CompleterStatus", True)
    assert "disconnected" in out and "last error" in out and "next try in" in out
    no_errors(editor)
    assert "completer" not in editor.messages()
    # The server comes up; the next retry is a minute away, but a keystroke tries at once.
    with server_on(port, *SETTINGS) as s:
        time.sleep(1.1)
        editor.nvim.input("<BS>")
        wait_until(editor.connected, 10, what="a connect on the keystroke")
        type_until_completion(editor, ")")
        assert status(editor)["connects"] == 1 and s.port == port


def test_wrong_token_warns_once(server, editor, tmp_path):
    editor.setup(url=server.ws_url, token="not-the-token", reconnect_min_ms=50, reconnect_max_ms=100)
    start_typing(editor, tmp_path / "a.py")
    for ch in "import sys":
        editor.nvim.input(keys(ch))
        time.sleep(0.1)
    st = status(editor)
    assert st["state"] != "open" and "401" in st["error"] and st["attempts"] >= 3
    assert editor.messages().count("refused the token") == 1


@pytest.mark.parametrize("in_query", [False, True])
def test_token_from_the_token_file(server, editor, tmp_path, in_query):
    path = tmp_path / "config" / "completer" / "token"
    path.parent.mkdir(parents=True)
    path.write_text(TOKEN + "\n")
    editor.setup(url=server.ws_url, token_in_query=in_query)
    wait_until(editor.connected, 10, what="connection with the file's token")
    assert status(editor)["token_source"] == str(path)


def test_status_and_toggle(server, editor, tmp_path):
    setup(editor, server, max_tokens=16)
    out = wait_until(lambda: (o := editor.nvim.api.exec("CompleterStatus", True)) and "completer/0.1.0" in o and o,
                     10, what="the server's ready")
    assert "enabled, open" in out and "model completer-" in out
    assert "disabled" in editor.nvim.api.exec("CompleterToggle", True)
    start_typing(editor, tmp_path / "t.py")
    for ch in "retu":
        editor.nvim.input(ch)
    time.sleep(0.5)
    assert status(editor)["counts"]["sent"] == 0 and editor.ghost() is None
    assert "enabled" in editor.nvim.api.exec("CompleterToggle", True)
    type_until_completion(editor, "rn ")
    assert status(editor)["counts"]["sent"] >= 1


# -- Issue #17: the window, dead connections, the mode, accept, feedback -----------------


def test_window_start_moves_in_steps(editor):
    editor.nvim.current.buffer[:] = [f"line_{i} = {i}" for i in range(400)]
    firsts = []
    for row in range(100, 200):
        prefix_first, first, last = editor.lua("""
            local d, first, last = require('completer.text').document(0, ..., 0, 40)
            return { d.prefix:match('^[^\\n]*'), first, last }""", row)
        start = int(prefix_first.split("_")[1].split(" ")[0])
        assert start == first and start <= row - 40 and last >= row + 41, (row, first, last)  # at least max_lines
        firsts.append(start)
    # Consecutive lines share the start; it moves a step at a time, not a line per Enter.
    assert len(set(firsts)) <= 100 // 20 + 1, sorted(set(firsts))
    assert sum(a == b for a, b in zip(firsts, firsts[1:])) >= 90
    # A large window moves on the server's 32-line grid.
    step = editor.lua("return require('completer.text').window_step(2000)")
    assert step % 32 == 0 and 500 <= step <= 1000


def test_new_lines_keep_the_servers_cache_warm(server, editor, tmp_path):
    """Past max_lines, Enter after Enter: the prompt's start stays, so the
    server finds all but the new lines cached."""
    setup(editor, server, max_lines=40, mode="line", max_tokens=8, debounce_ms=10, cache_size=0, prime=False,
          speculative=False, type_through=False, context={"enabled": False})
    body = "".join(f"value_{i} = compute({i}, scale={i % 7})\n" for i in range(150))
    editor.open_python(tmp_path / "long.py", body)
    editor.nvim.command("setlocal noautoindent")
    editor.nvim.current.window.cursor = (120, 0)
    editor.nvim.input("A")
    after_enter = []  # the request each Enter started: the one whose prompt start would move
    for ch in "x\ny\nz\nw\nv\nu":
        tick0 = editor.tick()
        editor.nvim.input("<CR>" if ch == "\n" else ch)
        settle(editor, tick0)
        last = editor.last()
        if ch == "\n" and last and last["kind"] == "complete" and last["type"] == "done":
            after_enter.append(last["timings"])
    assert len(after_enter) >= 4, after_enter
    share = sum(t["cached_tokens"] for t in after_enter) / sum(t["prompt_tokens"] for t in after_enter)
    assert share >= 0.6, [(t["cached_tokens"], t["prompt_tokens"]) for t in after_enter]


def test_block_mode_only_on_a_blank_line(server, editor, tmp_path):
    def mode(before, after):
        return editor.lua("return require('completer.text').mode('auto', ...)", before, after)

    assert mode("    ", "return x") == "line"  # blank before the cursor, code after it
    assert mode("    ", "  ") == "block" and mode("", "") == "block"
    assert mode("    x = ", "") == "line"
    setup(editor, server, max_tokens=8, debounce_ms=10)
    capture(editor)
    editor.open_python(tmp_path / "m.py", "def f(x):\n    return x\n")
    editor.nvim.current.window.cursor = (2, 4)  # on `return`, after the indentation
    editor.nvim.input("i")
    def asked():  # not a prime (max_tokens 0), which may also come from here
        return [m for m in sent(editor) if m["document"]["prefix"].endswith("\n    ") and m.get("max_tokens") != 0]

    request = wait_until(lambda: asked() and asked()[0], 10, what="a request")
    assert request["document"]["suffix"].startswith("return x") and request["mode"] == "line"
    editor.nvim.input("<Esc>o")  # a new, blank line
    wait_until(lambda: sent(editor)[-1]["mode"] == "block" and sent(editor)[-1]["document"]["suffix"].startswith("\n"),
               10, what="a request on the blank line")


class FreezingProxy:
    """A TCP proxy to the server that can go silent: freeze() stops
    forwarding, both ways, on the connections open now, while their sockets
    stay open (a half-open connection: the machine slept, a NAT entry was
    dropped); connections made later pass."""

    def __init__(self, target_port: int):
        self.count, self.frozen_upto, self.tasks = 0, 0, set()

        async def start(box):
            async def handle(reader, writer):
                self.tasks.add(asyncio.current_task())
                self.count += 1
                n = self.count
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)

                async def pump(r, w):
                    try:
                        while data := await r.read(65536):
                            if n > self.frozen_upto:
                                w.write(data)
                                await w.drain()
                    finally:
                        w.close()
                await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer), return_exceptions=True)
            return await asyncio.start_server(handle, "127.0.0.1", 0)

        self.srv = ThreadServer(start)
        self.url = f"ws://127.0.0.1:{self.srv.port}/v1/ws"

    def freeze(self):
        self.frozen_upto = self.count

    def close(self):
        async def stop_handlers():  # before the loop stops, so none is left half-run
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop_handlers(), self.srv.loop).result(10)
        self.srv.close()


def test_a_silent_connection_is_found_dead_and_replaced(server, editor, tmp_path):
    proxy = FreezingProxy(server.port)
    try:
        editor.setup(url=proxy.url, token=TOKEN, silence_ms=1000, pong_timeout_ms=500, reconnect_min_ms=100,
                     reconnect_max_ms=200, max_tokens=8)
        wait_until(editor.connected, 15, what="connection through the proxy")
        proxy.freeze()  # the server's pings (every 20 s) and our pongs vanish from now on
        frozen_at = time.time()
        wait_until(lambda: status(editor)["dead"] == 1 and status(editor)["connects"] == 2 and editor.connected(),
                   10, what="the silent connection replaced")
        assert time.time() - frozen_at < 5  # silence_ms + pong_timeout_ms, and a reconnect
        start_typing(editor, tmp_path / "p.py")
        type_until_completion(editor, "retur")  # the new connection completes
    finally:
        proxy.close()


def test_a_request_on_a_dead_connection_times_out(server, editor, tmp_path):
    proxy = FreezingProxy(server.port)
    try:
        editor.setup(url=proxy.url, token=TOKEN, silence_ms=60000, pong_timeout_ms=500, deadline_ms=300,
                     request_timeout_margin_ms=300, reconnect_min_ms=100, reconnect_max_ms=200, debounce_ms=10,
                     max_tokens=8, prime=False)
        wait_until(editor.connected, 15, what="connection through the proxy")
        start_typing(editor, tmp_path / "t.py")
        idle(editor)
        proxy.freeze()
        first_id = next_id(editor)
        editor.nvim.input("x")  # its request goes into a socket nobody reads
        results = lambda: editor.lua("return require('completer').results()")  # noqa: E731
        wait_until(lambda: any(int(r["id"]) > first_id and r["code"] == "timeout" for r in results()), 5,
                   what="the request's timeout")
        assert editor.ghost() is None and status(editor)["counts"]["timeouts"] >= 1
        # The timeout made the client ping; no pong: dead, and replaced (silence_ms alone would take a minute).
        wait_until(lambda: status(editor)["dead"] == 1 and status(editor)["connects"] == 2 and editor.connected(),
                   10, what="the reconnect")
    finally:
        proxy.close()


WAITS = """
_G.waits = {}
local core = require('completer.core')
_G.wait_ms = _G.wait_ms or core.wait_ms -- the plugin's own (setup() again keeps the module)
core.wait_ms = function(uri)
  local w = _G.wait_ms(uri)
  table.insert(_G.waits, w)
  return w
end
"""


def test_requests_without_a_deadline_follow_the_servers(server, editor, tmp_path):
    """A request that names no deadline_ms is given up by the server's default deadline (its ready says
    it: 2 s here) plus the margin, a document's first request on the connection by the server's first
    deadline (15 s: it prefills the document cold); one that names one, by its own; request_timeout_ms
    overrides them all."""
    def waits_for(path: Path, **opts) -> list[float]:
        setup(editor, server, max_tokens=8, request_timeout_margin_ms=1000, prime=False, debounce_ms=10, cache_size=0,
              type_through=False, **opts)  # every keystroke asks
        editor.lua(WAITS)
        start_typing(editor, path)
        for ch in "xy":
            first_id, tick0 = next_id(editor), editor.tick()
            editor.nvim.input(ch)
            settle(editor, tick0)
            wait_until(lambda: next_id(editor) > first_id, 5, what="a request")
            idle(editor)
        editor.nvim.input("<Esc>")
        return editor.lua("return _G.waits")

    # (Entering insert mode may ask too, before the first keystroke: one request more.)
    waits = waits_for(tmp_path / "d.py")
    assert len(waits) >= 2 and waits[0] == 16000 and set(waits[1:]) == {3000}, waits
    assert editor.lua("return require('completer.core').server_deadline_ms()") == 2000
    assert editor.lua("return require('completer').status().server.request.first_deadline_ms") == 15000
    waits = waits_for(tmp_path / "e.py", deadline_ms=300)
    assert len(waits) >= 2 and set(waits) == {1300}, waits
    waits = waits_for(tmp_path / "f.py", request_timeout_ms=700)
    assert len(waits) >= 2 and set(waits) == {700}, waits


def test_undo_takes_back_only_the_accepted_text_and_dot_repeats(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, speculative=False)
    start_typing(editor, tmp_path / "u.py")
    cur = type_until_completion(editor, "retur", usable=lambda t: "\n" not in t)
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    after = editor.buffer_text()
    editor.nvim.input("<Esc>")
    wait_until(lambda: editor.mode() == "n", 5, what="normal mode")
    editor.nvim.input("u")
    wait_until(lambda: editor.buffer_text() == before, 5, what="undo of the accepted text alone")
    editor.nvim.input("<C-r>")
    wait_until(lambda: editor.buffer_text() == after, 5, what="redo")
    # `.` repeats the whole insert: what was typed and what was accepted.
    inserted = after[len(CODE):]
    editor.nvim.input("gg.")
    wait_until(lambda: editor.nvim.current.buffer[0] == "import os" + inserted, 5, what="dot repeat")


def test_tab_chains_to_the_mapping_it_had(server, editor, tmp_path):
    editor.nvim.command("inoremap <expr> <Tab> pumvisible() ? '<C-n>' : 'PREV'")
    setup(editor, server, mode="line", max_tokens=16)
    setup(editor, server, mode="line", max_tokens=16)  # a second setup() keeps the chain
    editor.lua("require('completer').disable()")
    editor.open_python(tmp_path / "tab.py", "")
    editor.nvim.input("i<Tab>")
    wait_until(lambda: editor.buffer_text() == "PREV", 5, what="the previous mapping")
    editor.nvim.input("<Esc>")
    editor.lua("require('completer').enable()")
    start_typing(editor, tmp_path / "tab2.py")
    cur = type_until_completion(editor, "retur")
    before = editor.buffer_text()
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    assert "PREV" not in editor.buffer_text()


POPUP = "<C-r>=complete(col('.'), ['alpha_one', 'alpha_two']) ? '' : ''<CR>"


def test_popup_menu_hides_ghost_text_and_keeps_tab(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16)
    editor.nvim.command("set completeopt=menuone,noinsert,noselect")
    start_typing(editor, tmp_path / "pum.py")
    cur = type_until_completion(editor, "retur")
    shown = editor.ghost()
    editor.nvim.input(POPUP)
    wait_until(lambda: editor.nvim.funcs.pumvisible() == 1, 5, what="the popup menu")
    wait_until(lambda: editor.ghost() is None, 5, what="ghost text hidden under the menu")
    assert not editor.lua("return require('completer').visible()")
    editor.nvim.input("<C-e>")  # close the menu, nothing inserted: the completion comes back
    wait_until(lambda: editor.nvim.funcs.pumvisible() == 0 and editor.ghost() is not None, 5, what="ghost text back")
    assert editor.ghost()["text"] == shown["text"]
    # With hiding off the ghost text stays under the menu, but <Tab> is the menu's.
    editor.lua("require('completer')._state.cfg.hide_during_pum = false")
    before = editor.buffer_text()
    editor.nvim.input(POPUP)
    wait_until(lambda: editor.nvim.funcs.pumvisible() == 1, 5, what="the popup menu")
    assert editor.ghost() is not None
    editor.nvim.input("<Tab>")
    wait_until(lambda: editor.buffer_text() != before, 5, what="the key's own action")
    assert editor.buffer_text() == before + "\t" and cur["text"] not in editor.buffer_text()[len(before):]


def test_typing_what_is_shown_consumes_it_without_a_request(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=24)
    capture(editor)
    start_typing(editor, tmp_path / "tt.py")
    cur = type_until_completion(editor, "retur", usable=lambda t: len(t) >= 3 and not re.search(r"[\n\t]", t[:2]))
    text, mark = cur["text"], editor.ghost()["id"]
    idle(editor)
    first_id, counts0 = next_id(editor), status(editor)["counts"]
    typed0, accepted0, shown0 = (metric(server, "completer_feedback_typed_chars_total"), metric(server, ACCEPTED),
                                 metric(server, SHOWN))
    for n in (1, 2):
        tick0 = editor.tick()
        editor.nvim.input(keys(text[n - 1]))
        wait_until(lambda: editor.tick() != tick0, 5, what="the keystroke")
        shown = editor.ghost()
        # The same extmark, shrunk in the keystroke's own tick: never cleared, so never a flicker.
        assert shown["text"] == expand(text[n:]) and shown["id"] == mark, shown
        settle(editor)
    assert next_id(editor) == first_id and status(editor)["counts"]["sent"] == counts0["sent"]  # nothing asked
    editor.nvim.input("<Esc>")
    wait_until(lambda: any(m["id"] == cur["id"] for m in sent(editor, "feedback")), 5, what="feedback")
    fb = next(m for m in sent(editor, "feedback") if m["id"] == cur["id"])
    assert fb["typed_chars"] == 2 and fb["accepted_chars"] == 0 and fb["shown"] is True
    counts = status(editor)["counts"]
    # Kept, not dismissed.
    assert counts["typed"] == counts0["typed"] + 2 and counts["dismissed"] == counts0["dismissed"]
    wait_until(lambda: metric(server, "completer_feedback_typed_chars_total") == typed0 + 2, 10,
               what="the server's count")
    assert metric(server, ACCEPTED) == accepted0 + 2 and metric(server, SHOWN) == shown0 + len(text)


def test_backspace_and_retype_are_served_from_the_cache(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16)
    start_typing(editor, tmp_path / "bs.py")
    cur = type_until_completion(editor, "retur")
    shown = editor.ghost()["text"]
    wrong = "Q" if not cur["text"].startswith("Q") else "Z"  # not what the completion begins with
    tick0 = editor.tick()
    editor.nvim.input(wrong)
    settle(editor, tick0)  # its own request, finished
    other = lua_current(editor)
    sent0 = status(editor)["counts"]["sent"]
    tick0 = editor.tick()
    editor.nvim.input("<BS>")
    wait_until(lambda: editor.tick() != tick0, 5, what="the backspace")
    assert editor.ghost()["text"] == shown and lua_current(editor)["kind"] == "cache"  # at once, from the cache
    settle(editor)
    if other and other["kind"] == "complete" and other["text"]:  # retyped: that answer comes back too
        tick0 = editor.tick()
        editor.nvim.input(wrong)
        wait_until(lambda: editor.tick() != tick0, 5, what="the retype")
        assert editor.ghost()["text"] == expand(other["text"])
        settle(editor)
    st = status(editor)
    assert st["counts"]["sent"] == sent0 and st["counts"]["cache_hits"] >= 1


# -- Context, privacy, priming, the next line ----------------------------------------------


HELPER = "def helper_alpha(x):\n    return x * 42\n\n\ndef helper_beta(y):\n    return [y] * 3\n"
SECRET = "API_KEY=sk-very-secret-1234567890\nDB_PASSWORD=hunter2\n"


def test_context_from_other_buffers_is_sent_and_stays_the_same(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=8, debounce_ms=10)
    capture(editor)
    helper, secret, main = tmp_path / "helpers.py", tmp_path / ".env", tmp_path / "main.py"
    editor.open_python(helper, HELPER)
    editor.open_python(secret, SECRET)  # filetype python too: only its name keeps it out
    third = tmp_path / "third.py"  # loaded, never entered: its snippet is read, not picked
    third.write_text("def gamma_util():\n    return 'gamma'\n")
    third_buf = editor.lua("""local b = vim.fn.bufadd(...); vim.fn.bufload(b); vim.bo[b].buflisted = true
        vim.bo[b].filetype = 'python'; return b""", str(third))
    start_typing(editor, main)
    for i, ch in enumerate("return helper_"):
        if i == 5:  # another buffer changes meanwhile (a rename, :bufdo): the list does not, mid-insert
            editor.lua("vim.api.nvim_buf_set_lines(..., 0, -1, false, {'def delta_util():', '    pass'})", third_buf)
        tick0 = editor.tick()
        editor.nvim.input(keys(ch))
        settle(editor, tick0)
    requests = [m for m in sent(editor) if m["document"]["uri"] == uri_of(main)]
    assert len(requests) >= 5
    context = requests[0].get("context")
    assert context and any(c["uri"] == uri_of(helper) and "helper_alpha" in c["text"] for c in context), context
    assert any(c["uri"] == uri_of(third) and "gamma_util" in c["text"] for c in context), context
    assert all(m.get("context") == context for m in requests)  # the same chunks, keystroke after keystroke
    # A new insert takes the change in.
    editor.nvim.input("<Esc>o")
    wait_until(lambda: "delta_util" in json.dumps(sent(editor)[-1].get("context")), 10,
               what="the next insert's context")
    everything = json.dumps(editor.lua("return _G.sent"))
    assert "sk-very-secret" not in everything and "hunter2" not in everything and "/.env" not in everything
    assert len(context) <= 64


def test_secret_files_are_never_completed(server, editor, tmp_path):
    setup(editor, server, max_tokens=8, debounce_ms=10)
    capture(editor)
    assert editor.lua("return require('completer').statusline()") == "completer: ready"
    for name in (".env", "server.pem", "id_rsa", "prod.key", ".env.local"):
        start_typing(editor, tmp_path / name, SECRET)
        for ch in "X=1":
            editor.nvim.input(keys(ch))
        time.sleep(0.3)
        assert editor.lua("return require('completer').statusline()") == "completer: excluded"
        assert "excluded by" in editor.lua("return require('completer').blocked()")
        editor.nvim.input("<Esc>")
    assert sent(editor) == [] and status(editor)["counts"]["sent"] == 0  # not a request, not a prime
    # Per filetype and per glob, from the options.
    setup(editor, server, max_tokens=8, debounce_ms=10, filetypes={"python": False}, exclude=["*.txt"])
    assert editor.lua("return require('completer').blocked()") == "filetype python is off"
    (tmp_path / "notes.txt").write_text("x\n")
    editor.nvim.command(f"edit {tmp_path / 'notes.txt'}")
    assert editor.lua("return require('completer').blocked()") == "excluded by *.txt"
    (tmp_path / "main.go").write_text("x\n")
    editor.nvim.command(f"edit {tmp_path / 'main.go'}")
    assert editor.lua("return require('completer').blocked()") is None


def test_entering_a_buffer_primes_the_server(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=8, debounce_ms=10)
    capture(editor)
    main, other = tmp_path / "primed.py", tmp_path / "other.py"
    body = "def total(rows):\n    total = 0\n" + "".join(f"    total += rows[{i}] * {i + 3}\n" for i in range(40)) \
        + "    return total"
    editor.open_python(main, body)
    editor.nvim.command("normal! G$")
    editor.open_python(other, "x = 1\n")
    editor.nvim.command(f"buffer {main}")  # back at the end of CODE: primed there
    results = lambda: editor.lua("return require('completer').results()")  # noqa: E731
    request = wait_until(lambda: next((m for m in sent(editor) if m["document"]["uri"] == uri_of(main)
                                       and m["document"]["prefix"] == body[:-1]), None), 10, what="the prime")
    assert request["max_tokens"] == 0
    prime = wait_until(lambda: next((r for r in results() if r["id"] == request["id"]), None), 10,
                       what="the prime's done")
    assert prime["kind"] == "prime" and prime["type"] == "done", prime
    assert prime["text"] == "" and prime["timings"]["generated_tokens"] == 0
    editor.nvim.input("i")  # where the prime was (with SPM templates the suffix comes first: it must match)
    cur = type_until_completion(editor, "x_")
    done = next(r for r in results() if r["id"] == cur["id"])
    # Nothing of this file was asked for before but the prime: all but the
    # end of the prompt comes from it.
    assert done["timings"]["cached_tokens"] >= 0.8 * done["timings"]["prompt_tokens"], done["timings"]


def test_after_a_whole_accept_the_next_line_is_ready(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=16, prime=False)
    capture(editor)
    start_typing(editor, tmp_path / "spec.py")
    for attempt in ("retur", "x = ", "print("):
        cur = type_until_completion(editor, attempt, usable=lambda t: "\n" not in t)
        editor.nvim.input("<Tab>")
        spec = wait_until(lambda: next((m for m in sent(editor) if m.get("supersede") is False
                                        and int(m["id"]) > int(cur["id"])), None), 5, what="the speculative request")
        indent = editor.nvim.current.line[:len(editor.nvim.current.line) - len(editor.nvim.current.line.lstrip())]
        assert spec["document"]["prefix"].endswith("\n" + indent)
        results = lambda: editor.lua("return require('completer').results()")  # noqa: E731
        done = wait_until(lambda: next((r for r in results() if r["id"] == spec["id"]), None), 10,
                          what="its answer")
        assert done["type"] == "done" and done["reason"] != "cancelled"  # the request for here did not end it
        if not done["text"]:
            editor.nvim.input("<CR>")
            continue
        before = len(sent(editor))
        tick0 = editor.tick()
        editor.nvim.input("<CR>")
        wait_until(lambda: editor.tick() != tick0, 5, what="Enter")
        assert editor.ghost()["text"] == expand(done["text"])  # shown on Enter, from the speculative answer
        settle(editor)
        assert len(sent(editor)) == before  # nothing asked for the new line
        return
    pytest.fail("no speculative answer had text")


# -- Keys for users who map their own, health, statusline, debounce -------------------------


def test_plug_mappings_and_visible(server, editor, tmp_path):
    setup(editor, server, mode="free", max_tokens=40, keymaps=False)
    # No default keys (Neovim 0.11 maps <Tab> itself, for snippets: that one stays).
    assert not editor.nvim.funcs.maparg("<Tab>", "i", False, True).get("desc", "").startswith("completer")
    for lhs, plug in (("<C-l>", "accept"), ("<C-k>", "accept-word"), ("<C-j>", "dismiss")):
        editor.nvim.command(f"imap {lhs} <Plug>(completer-{plug})")
    start_typing(editor, tmp_path / "plug.py")
    cur = type_until_completion(editor, "for ", usable=lambda t: len(next_word(t)) < len(t))
    assert editor.lua("return require('completer').visible()")
    before = editor.buffer_text()
    word = next_word(cur["text"])
    editor.nvim.input("<C-k>")
    wait_until(lambda: editor.buffer_text() == before + word, 5, what="accept word")
    editor.nvim.input("<C-l>")
    wait_until(lambda: editor.buffer_text() == before + cur["text"], 5, what="accept")
    cur = type_until_completion(editor, " x = y")
    editor.nvim.input("<C-j>")
    wait_until(lambda: editor.ghost() is None, 5, what="dismiss")
    assert not editor.lua("return require('completer').visible()")


def test_checkhealth(server, editor, tmp_path):
    setup(editor, server, debounse_ms=5)  # a typo: reported, not fatal
    editor.nvim.command("checkhealth completer")
    out = editor.buffer_text()
    assert "completer" in out and "Neovim" in out, out
    assert "options are valid" in out and "unknown options" in out and "debounse_ms" in out, out
    assert "token from setup()" in out and "is reachable" in out and "connected: completer/" in out, out
    assert "ERROR" not in out, out


def test_checkhealth_without_a_server(editor, tmp_path):
    editor.setup(url=f"ws://127.0.0.1:{free_port()}/v1/ws", token=TOKEN, reconnect_min_ms=60000,
                 reconnect_max_ms=60000)
    editor.nvim.command("checkhealth completer")
    out = editor.buffer_text()
    assert "does not answer" in out and "ERROR" in out, out


def test_the_debounce_asks_at_once_unless_the_server_says_to_hold_back(editor):
    delays = editor.lua("""
        local Debounce = require('completer.debounce')
        local d = Debounce.new(0, 300)
        local out = { d:delay(0) }               -- nothing known: ask at once
        d:hold(0, 1000); out[2] = d:delay(1100)  -- the server says ask at once
        d:hold(60, 2000); out[3] = d:delay(2100) -- the server says it is shared and loaded: its hold
        out[4] = d:delay(2000 + 3001)            -- an old hold is not followed
        d:hold(900, 6000); out[5] = d:delay(6000) -- never past the maximum
        local f = Debounce.new(10, 100)
        out[6] = f:delay(0)                      -- never under the minimum
        return out""")
    assert delays == [0, 0, 60, 0, 300, 10]


def test_the_debounce_follows_what_the_real_server_says(server, editor, tmp_path):
    setup(editor, server, mode="line", max_tokens=8)  # debounce_ms unset: adaptive
    start_typing(editor, tmp_path / "ad.py")
    type_until_completion(editor, "return os.path")
    st = status(editor)["debounce"]
    assert st["hold_ms"] == 0 and st["delay_ms"] == 0, st  # one editor alone: asked at once, and told so
    requests = editor.lua("return require('completer').latency()")
    assert requests and all(r["debounce_ms"] < 50 for r in requests), requests  # (a timer of 0 ms, then the send)


# -- Latency ------------------------------------------------------------------------------

TYPED = ("def parse_config(path):\n"
         "    with open(path) as f:\n"
         "        data = json.load(f)\n"
         "    if not data:\n"
         "        return {}\n"
         "    return {k: v for k, v in data.items() if v}\n")


def keystrokes(text: str) -> list[str]:
    """`text` as typed, with a typo fixed now and then (a wrong letter, then backspace)."""
    out = []
    for i, ch in enumerate(text):
        if i % 13 == 7 and ch.isalpha():
            out += ["Z" if ch != "Z" else "Q", "<BS>"]
        out.append("<CR>" if ch == "\n" else keys(ch))
    return out


def percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    rank = lambda p: xs[min(len(xs) - 1, max(0, round(p / 100 * len(xs) + 0.5) - 1))]  # noqa: E731
    return {"p50": round(statistics.median(xs), 3), "p99": round(rank(99), 3), "mean": round(statistics.fmean(xs), 3),
            "n": len(xs)}


def typing_run(ed: Editor, server, path: Path, **opts) -> dict:
    """Type TYPED (with typos) into a fresh file, one keystroke at a time, each
    once the plugin has settled; the plugin's figures."""
    setup(ed, server, mode="line", max_tokens=16, prime=False, **opts)
    start_typing(ed, path, "import json\nimport os\n\n\n")
    ed.nvim.command("setlocal noautoindent nosmartindent indentexpr=")
    ed.lua("require('completer').clear_latency()")
    counts0 = status(ed)["counts"]
    strokes = keystrokes(TYPED)
    for key in strokes:
        tick0 = ed.tick()
        ed.nvim.input(key)
        try:
            settle(ed, tick0, 5)
        except AssertionError:
            pass  # a slow answer: the next keystroke goes on
        time.sleep(0.02)
    assert ed.buffer_text().endswith(TYPED), "the keystrokes did not all arrive"
    counts = status(ed)["counts"]
    delta = {k: counts[k] - counts0[k] for k in counts}
    shows = ed.lua("return require('completer').ghost_latency()")
    by_source = {src: percentiles([s["ms"] for s in shows if s["source"] == src])
                 for src in sorted({s["source"] for s in shows})}
    return {
        "keystrokes": len(strokes), "counts": delta,
        "requests_per_100_keystrokes": round(100 * (delta["sent"] + delta["speculative"]) / len(strokes), 1),
        "keystroke_to_ghost": percentiles([s["ms"] for s in shows]) if shows else None,
        "keystroke_to_ghost_by_source": by_source,
        "cached_share": round(delta["cached_tokens"] / delta["prompt_tokens"], 3) if delta["prompt_tokens"] else None,
        "records": ed.lua("return require('completer').latency()"),
    }


def test_latency_keystroke_to_ghost_text(server, editor, build, tmp_path):
    debounce = 50
    # Every keystroke asks (type-through, the cache and context off): the bare round trip.
    bare = typing_run(editor, server, tmp_path / "lat.py", debounce_ms=debounce, type_through=False, cache_size=0,
                      speculative=False, context={"enabled": False})
    records, sent = bare["records"], bare["counts"]["sent"]
    assert sent >= 0.9 * bare["keystrokes"]
    assert len(records) >= 0.5 * sent, f"only {len(records)} of {sent} requests showed ghost text"
    for r in records:  # the server's interval lies inside the client's
        assert r["ttft_ms"] <= r["send_to_shown_ms"] <= r["key_to_shown_ms"], r
        assert r["debounce_ms"] >= debounce - 1, r
    ms = {
        "server_ttft": percentiles([r["ttft_ms"] for r in records]),
        "request_to_ghost": percentiles([r["send_to_shown_ms"] for r in records]),
        "keystroke_to_ghost": percentiles([r["key_to_shown_ms"] for r in records]),
        "client_overhead": percentiles([r["send_to_shown_ms"] - r["ttft_ms"] for r in records]),
        "request_to_first_frame": percentiles([r["send_to_first_recv_ms"] for r in records]),
        "keystroke_to_request": percentiles([r["key_to_shown_ms"] - r["send_to_shown_ms"] for r in records]),
    }
    # The same keystrokes with the defaults (type-through, the cache, the wait after a key: none unless the
    # server holds clients back), in a fresh Neovim.
    (tmp_path / "b").mkdir()
    ed2 = Editor(tmp_path / "b", build, env={"COMPLETER_TOKEN": "", "XDG_CONFIG_HOME": str(tmp_path / "config")})
    try:
        served = typing_run(ed2, server, tmp_path / "b" / "lat.py", context={"enabled": False})
        no_errors(ed2)
    finally:
        ed2.close()
    assert served["counts"]["sent"] < sent  # typed-through and cached keystrokes ask for nothing
    figures = {
        "keystrokes": bare["keystrokes"],
        "requests_per_100_keystrokes": {"type_through_and_cache_off": bare["requests_per_100_keystrokes"],
                                        "type_through_and_cache_on": served["requests_per_100_keystrokes"]},
        "keystroke_to_ghost_ms": {"type_through_and_cache_off": bare["keystroke_to_ghost"],
                                  "type_through_and_cache_on": served["keystroke_to_ghost"]},
        "keystroke_to_ghost_ms_by_source_on": served["keystroke_to_ghost_by_source"],
        "cache_hits": served["counts"]["cache_hits"], "typed_through_chars": served["counts"]["typed"],
        "cached_share_of_prompt_tokens_context_off": bare["cached_share"],
        # Steady typing at the defaults: after the keystrokes that sent a request, how much later than the
        # server's first token the ghost text came, and the plugin's wait before it asked (issue #48).
        "defaults_keystroke_to_ghost_minus_server_ttft_ms": percentiles(
            [r["key_to_shown_ms"] - r["ttft_ms"] for r in served["records"]]),
        "defaults_keystroke_to_request_ms": percentiles([r["debounce_ms"] for r in served["records"]]),
    }
    report = {
        "neovim": editor.lua("local v = vim.version() return ('NVIM v%d.%d.%d'):format(v.major, v.minor, v.patch)"),
        "keystrokes": bare["keystrokes"], "requests": sent, "requests_with_ghost_text": len(records),
        "debounce_ms_setting": debounce, "mode": "line", "max_tokens": 16,
        "notes": "client_overhead = request_to_ghost - server_ttft (network both ways, WebSocket, JSON, "
                 "scheduling, extmark); keystroke_to_ghost includes the debounce (keystroke_to_request). "
                 "figures: the same keystrokes (typos fixed with backspace included) with type-through and the "
                 "cache off, then on; keystroke_to_ghost there counts every completion shown (requested or "
                 "cached) and every keystroke typed through one (its rest drawn in the same tick).",
        "ms": ms, "figures": figures,
    }
    out = ROOT / "test-artifacts" / "neovim_latency.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + "\n".join(f"{k:>24}: p50 {v['p50']:8.2f} ms  p99 {v['p99']:8.2f} ms  (n={v['n']})"
                           for k, v in ms.items()))
    print(json.dumps(figures, indent=2))
    assert ms["client_overhead"]["p50"] < 25, ms


def test_cached_share_of_prompt_tokens_with_context(server, editor, tmp_path):
    """With context on (another buffer of the same filetype loaded), the
    server still finds most of each prompt cached: the context stays put."""
    (tmp_path / "helpers.py").write_text(HELPER)
    editor.nvim.command(f"edit {tmp_path / 'helpers.py'}")
    editor.nvim.command("set filetype=python")
    run = typing_run(editor, server, tmp_path / "ctx.py", debounce_ms=50, type_through=False, cache_size=0)
    assert run["counts"]["sent"] > 50
    contexts = editor.lua("return require('completer').context()")
    assert contexts and any("helper_alpha" in c["text"] for c in contexts)
    print(f"\ncached share of prompt tokens, context on: {run['cached_share']}"
          f" ({run['counts']['cached_tokens']} of {run['counts']['prompt_tokens']})")
    out = ROOT / "test-artifacts" / "neovim_context_cache.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({k: v for k, v in run.items() if k != "records"}, indent=2) + "\n")
    assert run["cached_share"] >= 0.8, run["counts"]


# -- Issue #28: exclude beside the secrets list, the generating indicator ----------------------


def test_exclude_adds_to_the_secrets_list_and_the_opt_out_drops_it(server, editor, tmp_path):
    """`exclude` adds globs to the secrets list (config.SECRETS, the VS Code extension's list too) rather
    than replacing it; only `exclude_sensitive_files = false` drops that list."""
    for name, text in (("notes.txt", "x\n"), (".env", SECRET), ("id_ed25519", "key\n"), ("main.py", "x = 1\n")):
        (tmp_path / name).write_text(text)
    blocked = lambda name: editor.lua(  # noqa: E731
        "vim.cmd('edit! ' .. vim.fn.fnameescape(...)) return require('completer').blocked()", str(tmp_path / name))
    setup(editor, server, max_tokens=8, debounce_ms=10, exclude=["*.txt"])
    assert editor.lua("return require('completer').config().exclude") == ["*.txt"]
    assert blocked("notes.txt") == "excluded by *.txt"
    assert blocked(".env") == "excluded by .env"
    assert blocked("id_ed25519") == "excluded by id_ed25519*"
    assert blocked("main.py") is None
    capture(editor)
    start_typing(editor, tmp_path / ".env", SECRET)
    for ch in "X=1":
        editor.nvim.input(keys(ch))
    time.sleep(0.5)
    editor.nvim.input("<Esc>")
    assert sent(editor) == [] and not any(SECRET in json.dumps(m) for m in editor.lua("return _G.sent"))

    setup(editor, server, max_tokens=8, debounce_ms=10, exclude=["*.txt"], exclude_sensitive_files=False)
    assert blocked(".env") is None and blocked("id_ed25519") is None
    assert blocked("notes.txt") == "excluded by *.txt"
    editor.nvim.command("checkhealth completer")
    out = editor.buffer_text()
    assert "1 excluded path globs" in out and "exclude_sensitive_files = false" in out, out
    editor.nvim.command("bwipeout")
    with pytest.raises(Exception, match="exclude_sensitive_files must be a boolean"):
        editor.setup(exclude_sensitive_files="no")


GENERATING = """
_G.generating = {}
vim.api.nvim_create_autocmd('User', { pattern = 'CompleterGenerating',
  group = vim.api.nvim_create_augroup('completer_test_generating', { clear = true }), callback = function(ev)
  table.insert(_G.generating, vim.g.completer_generating)
  if ev.data ~= nil then assert(ev.data.generating == vim.g.completer_generating) end
end })
"""


def events(ed: Editor) -> list[bool]:
    return ed.lua("return _G.generating")


def test_generating_indicator_on_and_off(server, editor, tmp_path):
    """While the completion asked for is being generated: generating() is true, the statusline says
    `generating`, g:completer_generating is true and `User CompleterGenerating` fired; each way a
    request ends turns it off again: done, cancel (leaving insert mode), an error, a timeout."""
    setup(editor, server, max_tokens=200, mode="free", debounce_ms=10, prime=False, cache_size=0,
          type_through=False, speculative=False)
    editor.lua(GENERATING)
    assert editor.lua("return vim.g.completer_generating") is False
    statusline = lambda: editor.lua("return require('completer').statusline()")  # noqa: E731
    generating = lambda: editor.lua("return require('completer').generating()")  # noqa: E731
    start_typing(editor, tmp_path / "g.py")
    assert statusline() == "completer: ready"

    # done (or the server's deadline): on while it streams, off at its end
    first_id = next_id(editor)
    editor.nvim.input("x")
    wait_until(generating, 10, 0.002, "generating")
    assert statusline() == "completer: generating"
    wait_until(lambda: editor.lua("return vim.g.completer_generating"), 5, what="g:completer_generating")
    wait_until(lambda: (r := editor.last()) and int(r["id"]) > first_id, 15, what="the request's end")
    assert editor.last()["type"] == "done" and not generating() and statusline() == "completer: ready"
    wait_until(lambda: events(editor) == [True, False], 5, what=f"on and off events: {events(editor)}")
    assert editor.lua("return vim.g.completer_generating") is False

    # cancelled: off at once, before the server's `done` says so
    for attempt in range(5):
        if attempt:
            editor.nvim.input("A")  # back into insert mode
        first_id = next_id(editor)
        editor.nvim.input("y")
        wait_until(generating, 10, 0.002, "generating")
        editor.nvim.input("<Esc>")
        wait_until(lambda: editor.mode() == "n", 5, what="normal mode")
        assert not generating() and statusline() == "completer: ready"
        wait_until(lambda: (r := editor.last()) and int(r["id"]) > first_id, 15, what="the request's end")
        last = editor.last()
        if last["cancel_sent"] and last["reason"] == "cancelled":
            break
    else:
        raise AssertionError(f"no request was still generating when cancelled: {editor.last()}")
    idle(editor)
    wait_until(lambda: events(editor)[-1] is False, 5, what="the off event")
    assert events(editor) == [True, False] * (len(events(editor)) // 2), events(editor)

    # an error: deadline_ms beyond the protocol's bound (bad_request)
    setup(editor, server, max_tokens=8, deadline_ms=700000, debounce_ms=10, prime=False, cache_size=0)
    editor.lua(GENERATING)
    start_typing(editor, tmp_path / "h.py")
    first_id = next_id(editor)
    editor.nvim.input("x")
    wait_until(lambda: (r := editor.last()) and int(r["id"]) > first_id, 15, what="the error")
    assert editor.last()["type"] == "error" and editor.last()["code"] == "bad_request"
    assert not generating()
    wait_until(lambda: events(editor) == [True, False], 5, what=f"on and off events: {events(editor)}")
    editor.nvim.input("<Esc>")

    # a timeout: a connection that went silent, request_timeout_ms given (it overrides the deadline)
    proxy = FreezingProxy(server.port)
    try:
        editor.setup(url=proxy.url, token=TOKEN, request_timeout_ms=400, pong_timeout_ms=60000, max_tokens=8,
                     debounce_ms=10, prime=False, cache_size=0)
        wait_until(editor.connected, 15, what="connection through the proxy")
        editor.lua(GENERATING)
        start_typing(editor, tmp_path / "t.py")
        proxy.freeze()
        first_id = next_id(editor)
        sent_at = time.time()
        editor.nvim.input("x")
        wait_until(generating, 5, 0.002, "generating")
        wait_until(lambda: not generating(), 5, what="the timeout")
        assert 0.3 < time.time() - sent_at < 2.0
        r = editor.last()
        assert int(r["id"]) > first_id and r["code"] == "timeout", r
        wait_until(lambda: events(editor) == [True, False], 5, what=f"on and off events: {events(editor)}")
        assert "No matching autocommands" not in editor.messages()
    finally:
        proxy.close()


def test_generating_while_a_cycle_key_asks_for_candidates(server, editor, tmp_path):
    """A cycle key's request for candidates beside the completion shown counts as generating too."""
    setup(editor, server, mode="line", max_tokens=16, prime=False, speculative=False)
    capture(editor)
    start_typing(editor, tmp_path / "cg.py")
    type_until_completion(editor, "retur")
    idle(editor)
    editor.lua(GENERATING)
    assert not editor.lua("return require('completer').generating()")
    n0 = len(sent(editor))
    editor.nvim.input("<M-]>")
    ask = wait_until(lambda: next((m for m in sent(editor)[n0:] if m.get("n")), None), 5, what="the cycle's request")
    wait_until(lambda: next((r for r in editor.lua("return require('completer').results()") if r["id"] == ask["id"]),
                            None), 15, what="the candidates")
    wait_until(lambda: events(editor) == [True, False], 5, what=f"on and off events: {events(editor)}")
    assert not editor.lua("return require('completer').generating()")


def test_a_suggestion_the_user_asks_for_is_sent_without_the_first_token_rule(server, editor, tmp_path):
    """Typing: the server's confidence rules (a request leaves them out); :CompleterSuggest: the first-token
    rule off (`min_first_prob` 0), so something shows where the model is unsure from the start."""
    setup(editor, server, max_tokens=8, debounce_ms=10, trigger="auto")
    capture(editor)
    editor.open_python(tmp_path / "u.py", "def f(x):\n    return x\n\n")
    editor.nvim.current.window.cursor = (3, 0)
    editor.nvim.input("ix")
    typed = wait_until(lambda: [m for m in sent(editor) if m.get("max_tokens") != 0
                                and m["document"]["prefix"].endswith("x")], 10, what="a request as it was typed")
    assert "min_first_prob" not in typed[-1]
    editor.nvim.input("<Cmd>CompleterSuggest<CR>")
    asked = wait_until(lambda: [m for m in sent(editor) if m.get("min_first_prob") == 0], 10, what="an asked request")
    assert asked[-1]["document"]["prefix"].endswith("x") and "min_token_prob" not in asked[-1]
