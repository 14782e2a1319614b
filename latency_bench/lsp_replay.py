"""The keystroke replay through `completer lsp` (issue #46): the same traces,
typed into one language server per simulated editor, so the bridge's cost
beside the WebSocket editor (`replay.completer_editor`) is a number.

Each editor starts `completer lsp` over stdio before the run's clock starts
(initialize with a root folder, initialized, its settings by
`workspace/didChangeConfiguration`), then, at each key of its trace:

- `textDocument/didOpen` the first time the key's document is used (its text
  as opened), then `textDocument/didChange` with the key's edit alone, as an
  editor sends it: a range (UTF-16 line/character in the text before the key)
  and the text that replaces it;
- after the plugins' wait (`client_wait.py`), `textDocument/inlineCompletion`
  (triggerKind Automatic) at the cursor; the previous request is not awaited:
  the next key's didChange supersedes it in the bridge, which answers it
  with no items. Moving to another document cancels the request in flight there
  (`$/cancelRequest`), as the WebSocket editor sends `cancel`.

An LSP answer is whole (items, or none): `ttft_s` and `answer_s` are both the
time from the key to the response, so this row's TTFT compares with the
WebSocket row's TTFT (first streamed text) and, for what the bridge alone
costs, with its line end-to-end (its `done`). An answer without items is `done:cancelled`
when a later key came before it (superseded; so is the RequestCancelled error
of a request cancelled on leaving its document), `done:empty` otherwise (the
bridge does not say which of empty, refused or unreachable it was). The
bridge passes no `done.timings`: the row has no cached share, token counts or
inter-token latency.

The bridge's settings match the WebSocket editor's frames: mode `line`, its
max_tokens and deadline, the whole document sent (`max_lines` 0), no prime on
open, no debounce, and context on only when the row sends context
(`context_files`; then the bridge's own snippets, not whole files). The
server's `hold_ms` is not visible to an LSP client: the bridge waits it out
itself, and that wait is in the answer's time as the WebSocket editor's is.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from typing import Any

import msgspec

from latency_bench.client_wait import ClientWait
from latency_bench.keystrokes import EditorState, Trace
from latency_bench.replay import DRAIN_S, ReplayOptions, Sample, accepted, keys_in_time, wait_to_send

REQUEST_CANCELLED = -32800  # LSP's error code for a request the client cancelled
STARTUP_S = 60.0  # `completer lsp` to answer initialize (imports on a loaded 2-core machine)


class RpcError(msgspec.Struct):
    code: int
    message: str = ""


class Incoming(msgspec.Struct):
    """A JSON-RPC message from the bridge: a response (id, result or error),
    a notification (method), or a request of its own (id and method)."""
    id: int | str | None = None
    method: str | None = None
    params: Any = None
    result: Any = None
    error: RpcError | None = None


class Command(msgspec.Struct):
    title: str
    command: str
    arguments: list[Any] = []


class InlineItem(msgspec.Struct, rename="camel"):
    insert_text: str
    command: Command | None = None


class InlineList(msgspec.Struct):
    items: list[InlineItem]


decode_incoming = msgspec.json.Decoder(Incoming).decode


def settings(opts: ReplayOptions) -> dict:
    """The bridge's settings that make its `complete` frames the WebSocket editor's."""
    return {"completer": {
        "mode": "line", "max_tokens": opts.max_tokens, "deadline_ms": opts.deadline_ms,
        "max_lines": 0, "prime": False, "debounce_ms": 0,
        "context": {"enabled": opts.context_files > 0, "buffers": max(1, opts.context_files)}}}


def position(text: str, offset: int) -> dict:
    """The LSP position (line, UTF-16 code units) of code point `offset` in `text`
    (lines end in \\n: the corpus has no other line breaks)."""
    start = text.rfind("\n", 0, offset) + 1
    return {"line": text.count("\n", 0, offset),
            "character": len(text[start:offset].encode("utf-16-le")) // 2}


class LspConnection:
    """One `completer lsp` process over stdio: Content-Length framed JSON-RPC."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.told: list[str] = []  # window/showMessage lines (unreachable server, refused settings)
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def start(cls, url: str, token: str) -> LspConnection:
        env = {**os.environ, "COMPLETER_URL": url, "COMPLETER_TOKEN": token}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "completer.cli", "lsp", env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, limit=2 ** 24)
        return cls(proc)

    def _write(self, message: dict) -> None:
        body = msgspec.json.encode({"jsonrpc": "2.0", **message})
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def notify(self, method: str, params: Any) -> None:
        self._write({"method": method, "params": params})

    def request(self, method: str, params: Any) -> tuple[int, asyncio.Future]:
        rid = next(self.ids)
        future = self.pending[rid] = asyncio.get_running_loop().create_future()
        self._write({"id": rid, "method": method, "params": params})
        return rid, future

    def cancel(self, rid: int) -> None:
        if rid in self.pending:
            self.notify("$/cancelRequest", {"id": rid})

    async def _read(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while (line := await out.readline()) not in (b"\r\n", b""):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if not line or length is None:
                break
            msg = decode_incoming(await out.readexactly(length))
            if msg.method is None:
                future = self.pending.pop(msg.id, None)
                if future is not None and not future.done():
                    future.set_result(msg)
            elif msg.id is not None:  # a request of the bridge's (none expected): answered empty
                self._write({"id": msg.id, "result": None})
            elif msg.method == "window/showMessage":
                self.told.append(str((msg.params or {}).get("message")))
        for future in self.pending.values():
            if not future.done():
                future.set_exception(ConnectionError("completer lsp exited"))

    async def call(self, method: str, params: Any, timeout: float) -> Incoming:
        _, future = self.request(method, params)
        return await asyncio.wait_for(future, timeout)

    async def close(self) -> None:
        try:
            await self.call("shutdown", None, 10)
            self.notify("exit", None)
            await asyncio.wait_for(self.proc.wait(), 10)
        except (TimeoutError, ConnectionError, BrokenPipeError):
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
        self.reader.cancel()


async def started(trace: Trace, url: str, token: str, opts: ReplayOptions) -> LspConnection:
    """A bridge for `trace`'s editor, initialized and configured."""
    conn = await LspConnection.start(url, token)
    root = trace.documents[0].uri.rsplit(f"/e{trace.editor}/", 1)[0] + f"/e{trace.editor}"
    await conn.call("initialize", {
        "processId": os.getpid(), "rootUri": root, "workspaceFolders": [{"uri": root, "name": root}],
        "capabilities": {"textDocument": {"inlineCompletion": {}, "synchronization": {}}}}, STARTUP_S)
    conn.notify("initialized", {})
    conn.notify("workspace/didChangeConfiguration", {"settings": settings(opts)})
    # A round trip: the settings are applied (notifications are handled in order) before the first key.
    await conn.call("textDocument/inlineCompletion", inline_params("file:///nowhere", {"line": 0, "character": 0}), 10)
    if any("not applied" in line for line in conn.told):
        raise RuntimeError(f"completer lsp refused the bench's settings: {conn.told}")
    return conn


def inline_params(uri: str, at: dict) -> dict:
    return {"textDocument": {"uri": uri}, "position": at, "context": {"triggerKind": 2}}  # 2: Automatic


async def lsp_editor(trace: Trace, conn: LspConnection, start: float, opts: ReplayOptions,
                     samples: list[Sample], progress) -> None:
    wait = ClientWait(opts.client_wait)
    state = EditorState(trace)
    versions: dict[int, int] = {}  # document -> its version (opened: 1)
    pressed = -1  # the newest key pressed: an empty answer after a later key was superseded
    asked: set[asyncio.Task] = set()
    last: tuple[int, int, asyncio.Task] | None = None  # the newest request: (rpc id, document, its task)

    async def answered(s: Sample, future: asyncio.Future) -> None:
        try:
            msg = await future
        except ConnectionError:
            s.outcome = "error:lsp_exited"
            return
        now = time.perf_counter() - start
        s.answer_s = now - s.sent_s
        if msg.error is not None:  # RequestCancelled: the editor moved to another document and cancelled it
            s.outcome = "done:cancelled" if msg.error.code == REQUEST_CANCELLED else f"error:{msg.error.code}"
            return
        result = msg.result  # an InlineCompletionList; the spec also allows a bare list of items, or null
        items = [] if not result else msgspec.convert(result, list[InlineItem]) if isinstance(result, list) \
            else msgspec.convert(result, InlineList).items
        if not items:
            s.outcome = "done:cancelled" if pressed > s.key else "done:empty"
            if s.outcome == "done:empty":
                wait.answered(s.answer_s - s.wait_s, None, now)
            return
        item = items[0]
        # The item inserts the text, then the rest of the line; the accept command's
        # arguments are (request id, candidate, the text's length).
        args = item.command.arguments if item.command else []
        chars = args[2] if len(args) == 3 else len(item.insert_text)
        s.ttft_s, s.outcome, s.text = s.answer_s, "done:text", item.insert_text[:chars]
        wait.answered(s.answer_s - s.wait_s, None, now)
        if item.command and accepted(s) and (s.next_key_s is None or s.answer_s <= s.next_key_s):
            conn.request("workspace/executeCommand",  # what an editor runs when the item is taken
                         {"command": item.command.command, "arguments": args})

    for n, key, at, nxt in keys_in_time(trace, opts.seconds):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        doc = trace.documents[key.doc]
        before = state.texts[key.doc]
        if key.doc not in versions:
            versions[key.doc] = 1
            conn.notify("textDocument/didOpen", {"textDocument": {
                "uri": doc.uri, "languageId": "python", "version": 1, "text": before}})
        versions[key.doc] += 1
        conn.notify("textDocument/didChange", {
            "textDocument": {"uri": doc.uri, "version": versions[key.doc]},
            "contentChanges": [{"range": {"start": position(before, key.at - key.delete),
                                          "end": position(before, key.at)}, "text": key.insert}]})
        state.press(key)
        pressed = n
        if (delay := await wait_to_send(wait, trace, n, key, at, nxt, start, samples, progress)) is None:
            continue
        if last is not None and last[1] != key.doc and not last[2].done():  # left that document
            conn.cancel(last[0])
        s = Sample(trace.editor, n, time.perf_counter() - start - delay, nxt, key.expect, wait_s=delay)
        samples.append(s)
        cursor = position(state.texts[key.doc], key.at - key.delete + len(key.insert))
        rid, future = conn.request("textDocument/inlineCompletion", inline_params(doc.uri, cursor))
        task = asyncio.create_task(answered(s, future))
        last = (rid, key.doc, task)
        asked.add(task)
        task.add_done_callback(asked.discard)
        progress()
    if asked:
        await asyncio.wait(set(asked), timeout=opts.deadline_ms / 1000 + DRAIN_S)
    for task in asked:
        task.cancel()  # its sample stays `unanswered`


async def lsp_replay(traces_: list[Trace], opts: ReplayOptions, url: str, token: str,
                     progress=lambda: None) -> list[Sample]:
    """All editors at once, each through its own `completer lsp`; every keystroke's sample."""
    conns = await asyncio.gather(*(started(t, url, token, opts) for t in traces_))
    samples: list[Sample] = []
    try:
        start = time.perf_counter()
        await asyncio.gather(*(lsp_editor(t, c, start, opts, samples, progress) for t, c in zip(traces_, conns)))
    finally:
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
    return sorted(samples, key=lambda s: (s.editor, s.key))
