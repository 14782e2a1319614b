"""`completer lsp` driven as an editor's language client drives it (pytest-lsp
starts the real `completer lsp` over stdio), forwarding to the real
`completer serve` (the embedded model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import pytest
import pytest_lsp
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcRequestCancelled
from pytest_lsp import ClientServerConfig, LanguageClient

from latency_bench.harness import RULES_OFF, TOKEN, collect, complete_msg, connect, running_server, sample
from latency_bench.nvim_editor import free_port

pytestmark = pytest.mark.asyncio(loop_scope="module")

SETTINGS = ("engine.threads=1", *RULES_OFF)
ROOT_URI = "file:///work/project"
CODE = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.re"
PORT = free_port()
LSP = [sys.executable, "-m", "completer.cli", "lsp"]
ENV = {"COMPLETER_TOKEN": TOKEN, "COMPLETER_URL": f"ws://127.0.0.1:{PORT}/v1/ws", "PYTHONUNBUFFERED": "1"}
INIT = lsp.InitializeParams(capabilities=lsp.ClientCapabilities(), root_uri=ROOT_URI,
                            workspace_folders=[lsp.WorkspaceFolder(uri=ROOT_URI, name="project")])


@pytest.fixture(scope="module")
def server():
    with running_server(*SETTINGS, port=PORT) as s:
        yield s


@pytest_lsp.fixture(config=ClientServerConfig(server_command=LSP, server_env=ENV), scope="module")
async def client(lsp_client: LanguageClient, server):
    lsp_client.init_result = await lsp_client.initialize_session(INIT)
    yield
    await lsp_client.shutdown_session()


def open_doc(client: LanguageClient, uri: str, text: str, version: int = 1) -> None:
    client.text_document_did_open(lsp.DidOpenTextDocumentParams(
        text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=version, text=text)))


def end_of(text: str) -> lsp.Position:
    lines = text.split("\n")
    return lsp.Position(line=len(lines) - 1, character=len(lines[-1]))


def params(uri: str, position: lsp.Position, invoked: bool = False) -> lsp.InlineCompletionParams:
    kind = lsp.InlineCompletionTriggerKind.Invoked if invoked else lsp.InlineCompletionTriggerKind.Automatic
    return lsp.InlineCompletionParams(text_document=lsp.TextDocumentIdentifier(uri=uri), position=position,
                                      context=lsp.InlineCompletionContext(trigger_kind=kind))


async def ask(client: LanguageClient, uri: str, position: lsp.Position, invoked: bool = False):
    return await client.text_document_inline_completion_async(params(uri, position, invoked))


def answered_empty(result) -> bool:
    """An empty list, not null: Neovim keeps showing the last items on null."""
    return isinstance(result, lsp.InlineCompletionList) and len(result.items) == 0


def configure(client: LanguageClient, **fields) -> None:
    client.workspace_did_change_configuration(lsp.DidChangeConfigurationParams(settings={"completer": fields}))


async def direct(server, uri: str, prefix: str, suffix: str, **fields) -> dict:
    """The same completion asked over the WebSocket protocol itself."""
    async with connect(server) as ws:
        await ws.send(complete_msg("direct", prefix, suffix, uri=uri, **fields))
        _, done = await collect(ws, "direct")
    assert done["type"] == "done", done
    return done


async def test_initialize_advertises_inline_completion_sync_and_the_accept_command(client: LanguageClient):
    caps = client.init_result.capabilities
    assert caps.inline_completion_provider is True
    sync = caps.text_document_sync
    assert sync.open_close and sync.change == lsp.TextDocumentSyncKind.Incremental
    assert "completer.accept" in caps.execute_command_provider.commands


async def test_the_item_is_the_servers_completion_at_the_cursor(server, client: LanguageClient):
    uri = f"{ROOT_URI}/read.py"
    open_doc(client, uri, CODE)
    configure(client, context={"enabled": False})  # the direct request below sends no other documents
    try:
        result = await ask(client, uri, end_of(CODE))
    finally:
        configure(client, context={"enabled": True})
    assert result.items, result
    item = result.items[0]
    done = await direct(server, uri, CODE, "", mode="line", workspace=ROOT_URI)
    assert item.insert_text == done["text"] and done["text"]
    assert item.range.start == item.range.end == end_of(CODE)
    assert item.command.command == "completer.accept" and list(item.command.arguments[1:]) == [0, len(done["text"])]


async def test_incremental_edits_reach_the_prompt(server, client: LanguageClient):
    uri = f"{ROOT_URI}/edit.py"
    text = "def total(values):\n    result = 0\n    for v in values:\n        result += v\n    return "
    open_doc(client, uri, text)
    # An incremental change: `values` renamed in the signature.
    client.text_document_did_change(lsp.DidChangeTextDocumentParams(
        text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=2),
        content_changes=[lsp.TextDocumentContentChangePartial(
            range=lsp.Range(start=lsp.Position(line=0, character=10), end=lsp.Position(line=0, character=16)),
            text="numbers")]))
    new = text.replace("(values)", "(numbers)")
    # And a whole-document change (a client that syncs in full): the last line retyped.
    new = new[:new.rindex("return ")] + "return result + "
    client.text_document_did_change(lsp.DidChangeTextDocumentParams(
        text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=3),
        content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=new)]))
    configure(client, context={"enabled": False})
    try:
        result = await ask(client, uri, end_of(new))
    finally:
        configure(client, context={"enabled": True})
    done = await direct(server, uri, new, "", mode="line", workspace=ROOT_URI)
    assert result.items[0].insert_text == done["text"]


async def test_mid_line_the_item_replaces_the_rest_of_the_line_with_itself(server, client: LanguageClient):
    uri = f"{ROOT_URI}/mid.py"
    text = "import os\n\nprint(os.path.join('a', )\n"
    open_doc(client, uri, text)
    at = lsp.Position(line=2, character=text.split("\n")[2].index(" )") + 1)
    result = await ask(client, uri, at, invoked=True)
    item = result.items[0]
    assert item.range.start == at and item.range.end == lsp.Position(line=2, character=len(text.split("\n")[2]))
    assert item.insert_text.endswith(")") and len(item.insert_text) > 1


async def test_invoked_asks_for_several_items(server, client: LanguageClient):
    uri = f"{ROOT_URI}/cycle.py"
    open_doc(client, uri, CODE)
    result = await ask(client, uri, end_of(CODE), invoked=True)
    texts = [i.insert_text for i in result.items]
    assert len(texts) >= 2 and len(set(texts)) == len(texts), texts
    assert [i.command.arguments[1] for i in result.items] == list(range(len(texts)))


@contextlib.asynccontextmanager
async def long_answers(client: LanguageClient):
    """Free mode, 400 tokens (over a second here): a request still runs 0.3 s after it was sent."""
    configure(client, mode="free", max_tokens=400)
    try:
        yield
    finally:
        configure(client, mode="auto", max_tokens=None)


def cancelled(server) -> float:
    return sample(server, "completer_request_success_total", finished_reason="cancelled")


async def test_cancel_request_cancels_at_the_server(server, client: LanguageClient):
    uri = f"{ROOT_URI}/cancel.py"
    open_doc(client, uri, CODE)
    async with long_answers(client):
        future = client.protocol.send_request(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, params(uri, end_of(CODE)),
                                              msg_id="cancel-me")
        await asyncio.sleep(0.3)
        before = cancelled(server)  # (after the open's prime, which the request superseded)
        client.protocol.notify(lsp.CANCEL_REQUEST, lsp.CancelParams(id="cancel-me"))
        with pytest.raises(JsonRpcRequestCancelled):
            await asyncio.wait_for(asyncio.wrap_future(future), 10)  # (pygls answers a concurrent future)
        await wait_for(lambda: cancelled(server) > before)


async def test_a_new_request_supersedes_the_one_in_flight(server, client: LanguageClient):
    uri = f"{ROOT_URI}/supersede.py"
    open_doc(client, uri, CODE)
    async with long_answers(client):
        first = asyncio.ensure_future(ask(client, uri, end_of(CODE)))
        await asyncio.sleep(0.3)
        before = cancelled(server)
    second = await ask(client, uri, end_of(CODE))
    assert answered_empty(await first)  # superseded
    assert second and second.items
    await wait_for(lambda: cancelled(server) > before)


async def test_accepting_runs_the_command_that_counts_the_accept(server, client: LanguageClient):
    uri = f"{ROOT_URI}/accept.py"
    open_doc(client, uri, CODE)
    result = await ask(client, uri, end_of(CODE))
    item = result.items[0]
    before = sample(server, "completer_feedback_accepted_chars_total")
    await client.workspace_execute_command_async(lsp.ExecuteCommandParams(
        command=item.command.command, arguments=item.command.arguments))
    await wait_for(lambda: sample(server, "completer_feedback_accepted_chars_total") == before + len(item.insert_text))


async def test_settings_exclude_a_document_and_a_bad_value_is_told(server, client: LanguageClient):
    uri = f"{ROOT_URI}/private/keys.py"
    open_doc(client, uri, CODE)
    configure(client, exclude=["**/private/**"])
    try:
        assert answered_empty(await ask(client, uri, end_of(CODE)))
        told = len(client.messages)
        configure(client, debounce_ms="soon")
        await wait_for(lambda: len(client.messages) > told)
        assert "debounce_ms" in client.messages[-1].message
    finally:
        configure(client, exclude=[])
    assert (await ask(client, uri, end_of(CODE))).items


async def test_a_secret_file_gets_nothing(server, client: LanguageClient):
    uri = f"{ROOT_URI}/.env"
    open_doc(client, uri, "API_KEY=")
    assert answered_empty(await ask(client, uri, lsp.Position(line=0, character=8)))


async def wait_for(check, timeout: float = 10.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not check():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.05)


# -- without pytest-lsp: bytes an editor would never send, a server that is not there -------------


def frame(payload: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(payload) + payload


def read_frame(stream) -> dict:
    length = 0
    while (line := stream.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return json.loads(stream.read(length))


def responses(proc, want: int) -> list[dict]:
    """The next `want` responses (notifications such as window/showMessage skipped)."""
    out = []
    while len(out) < want:
        msg = read_frame(proc.stdout)
        if "method" not in msg:
            out.append(msg)
    return out


async def test_a_malformed_message_gets_an_error_and_the_server_goes_on(server):
    with subprocess.Popen(LSP, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          env={**os.environ, **ENV}) as proc:
        send = lambda msg: (proc.stdin.write(frame(json.dumps(msg).encode())), proc.stdin.flush())  # noqa: E731
        send({"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"capabilities": {}, "rootUri": ROOT_URI, "processId": None}})
        assert responses(proc, 1)[0]["result"]["capabilities"]["inlineCompletionProvider"] is True
        send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        proc.stdin.write(frame(b"{this is not json")), proc.stdin.flush()
        parse = responses(proc, 1)[0]
        assert parse["id"] is None and parse["error"]["code"] == -32700
        send({"jsonrpc": "2.0", "id": 2, "method": "textDocument/inlineCompletion",
              "params": {"textDocument": {"uri": "file:///x.py"}}})  # no position, no context
        bad = responses(proc, 1)[0]
        assert bad["id"] == 2 and bad["error"]["code"] == -32602 and "position" in bad["error"]["message"]
        send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": f"{ROOT_URI}/ok.py", "languageId": "python", "version": 1, "text": CODE}}})
        send({"jsonrpc": "2.0", "id": 3, "method": "textDocument/inlineCompletion", "params": {
            "textDocument": {"uri": f"{ROOT_URI}/ok.py"}, "position": {"line": 5, "character": 16},
            "context": {"triggerKind": 2}}})
        ok = responses(proc, 1)[0]
        assert ok["id"] == 3 and ok["result"]["items"][0]["insertText"], ok
        send({"jsonrpc": "2.0", "id": 4, "method": "shutdown"})
        assert responses(proc, 1)[0] == {"jsonrpc": "2.0", "id": 4, "result": None}
        send({"jsonrpc": "2.0", "method": "exit"})
        assert proc.wait(10) == 0


async def test_after_the_server_went_away_requests_answer_empty_and_say_so_once():
    port = free_port()
    config = ClientServerConfig(server_command=LSP, server_env={**ENV, "COMPLETER_URL": f"ws://127.0.0.1:{port}/v1/ws"})
    client = await config.start()
    try:
        await client.initialize_session(INIT)
        uri = f"{ROOT_URI}/alone.py"
        with running_server(*SETTINGS, port=port):
            open_doc(client, uri, CODE)
            assert (await ask(client, uri, end_of(CODE))).items
        assert not client.messages
        assert answered_empty(await ask(client, uri, end_of(CODE)))  # the server went away meanwhile
        for _ in range(3):
            await asyncio.sleep(0.6)  # past the retry pause: each asks the server again
            assert answered_empty(await ask(client, uri, end_of(CODE)))
        assert len(client.messages) == 1, [m.message for m in client.messages]
        assert "cannot reach completer serve" in client.messages[0].message
        with running_server(*SETTINGS, port=port):  # back: completions again, and the next outage is told again
            await asyncio.sleep(0.6)
            assert (await ask(client, uri, end_of(CODE))).items
        await asyncio.sleep(0.6)
        assert answered_empty(await ask(client, uri, end_of(CODE)))
        assert len(client.messages) == 2
        await client.shutdown_session()
    finally:
        with contextlib.suppress(ProcessLookupError):
            client._server.kill()  # (a failed assertion above left it running: stop() would wait for it)
        await client.stop()


async def test_a_cursor_on_the_line_after_the_last_newline(server, client: LanguageClient):
    uri = f"{ROOT_URI}/tail.py"
    text = "def area(r):\n    return 3.14 * r * r\n\n"
    open_doc(client, uri, text)
    result = await ask(client, uri, lsp.Position(line=3, character=0), invoked=True)
    assert result.items and all(i.range.start == i.range.end == lsp.Position(line=3, character=0)
                                for i in result.items)
