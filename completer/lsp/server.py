"""`completer lsp`: inline completion over the Language Server Protocol
(3.18's `textDocument/inlineCompletion`), for any editor with a language
client, forwarded to a running `completer serve` (upstream.py).

A request: the document's text around the cursor (text.py), the context of
the other open documents (context.py), a `complete` frame; its `done` becomes
the items. A new request or an edit of the same document supersedes the one
in flight (the server cancels it: the engine stops at once, as for our own
clients), and `$/cancelRequest` cancels it at the server. An accepted item
runs the `completer.accept` command, which reports the accept back as our
clients' feedback does; an item the next request of its document finds
neither accepted nor typed through is reported dismissed."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import cattrs
import msgspec
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcParseError
from pygls.lsp.server import LanguageServer
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.language_server import lsp_method
from pygls.workspace import TextDocument
from pygls.workspace.position_codec import ServerTextPosition

from completer import __version__
from completer.client import RULES_OFF
from completer.lsp import privacy, text
from completer.lsp.context import ContextRing, OpenDocument
from completer.lsp.settings import LspSettings, updated
from completer.lsp.upstream import Upstream
from completer.protocol import Complete, Document, Done, Feedback

log = logging.getLogger(__name__)

ACCEPT_COMMAND = "completer.accept"


def empty() -> lsp.InlineCompletionList:
    """No suggestion: an empty list, not null (Neovim keeps showing the last items on null)."""
    return lsp.InlineCompletionList(items=[])


class Shown(msgspec.Struct):
    """The items last returned for a document, until accepted or superseded."""
    id: str
    prefix: str  # the document's prefix when asked
    texts: list[str]  # what each item inserts at the cursor
    accepted: bool = False


class BridgeProtocol(LanguageServerProtocol):
    """pygls' protocol, answering a malformed request with an error response
    (pygls logs it and answers nothing; a client would wait forever), and
    advertising inline completion as `true`."""

    @lsp_method(lsp.INITIALIZE)
    def lsp_initialize(self, params: lsp.InitializeParams):
        result = yield from super().lsp_initialize(params)
        # `true`, not pygls' `{}`: lsp-mode 10.0 with plists reads an empty object as no provider.
        result.capabilities.inline_completion_provider = True
        return result

    def structure_message(self, data):
        try:
            return super().structure_message(data)
        except JsonRpcException as error:
            if isinstance(data, dict) and "method" in data and "id" in data:
                cause = error.__cause__
                detail = "; ".join(cattrs.transform_error(cause)) if isinstance(cause, cattrs.BaseValidationError) \
                    else str(cause or error)
                self._send_response(data["id"], error=JsonRpcInvalidParams(
                    f"invalid params for {data['method']}: {detail}").to_response_error())
                error.answered = True
            raise


class CompleterLanguageServer(LanguageServer):
    def __init__(self, settings: LspSettings | None = None):
        super().__init__("completer-lsp", __version__, protocol_cls=BridgeProtocol,
                         text_document_sync_kind=lsp.TextDocumentSyncKind.Incremental)
        self.settings = settings or LspSettings()
        self.upstream = Upstream(lambda: self.settings, self.tell)
        self.ring = ContextRing()
        self.ids = itertools.count(1)
        self.in_flight: dict[str, str] = {}  # document uri -> the id of its request in flight
        self.shown: dict[str, Shown] = {}  # document uri -> its items last returned
        self.asked: dict[str, int] = {}  # document uri -> the newest inlineCompletion's number
        self.priming: str | None = None  # the id of the last prime sent
        self.verdicts: dict[str, str | None] = {}  # document uri -> why it may not be sent (None: it may)

    def tell(self, message: str, kind: lsp.MessageType = lsp.MessageType.Warning) -> None:
        self.window_show_message(lsp.ShowMessageParams(type=kind, message=message))

    def report_server_error(self, error: Exception, source) -> None:
        """A message that could not be read: a JSON-RPC error response (id null
        unless the request's id was read and answered), and the server goes on."""
        if getattr(error, "answered", False):
            return
        if isinstance(error, json.JSONDecodeError):
            self.answer_unread(JsonRpcParseError(f"not JSON: {error}"))
        elif source is JsonRpcException:
            self.answer_unread(JsonRpcInvalidRequest(f"not a JSON-RPC 2.0 message: {error}"))
        log.warning("%s", error)

    def answer_unread(self, error: JsonRpcException) -> None:
        # JSON-RPC 2.0: `"id": null` when the id could not be read (pygls' encoder would leave it out).
        self.protocol._send_data({"jsonrpc": "2.0", "id": None,
                                  "error": {"code": error.code, "message": error.message}})

    def configure(self, raw: object) -> None:
        try:
            self.settings = updated(self.settings, raw)
            self.verdicts.clear()
        except msgspec.ValidationError as e:
            self.tell(f"completer: settings not applied: {e}", lsp.MessageType.Error)
        self.ring.changed()

    # -- documents --------------------------------------------------------------------------------

    def sendable(self) -> dict[str, OpenDocument]:
        """The open documents that may be sent (privacy.py)."""
        return {uri: OpenDocument(uri, doc.source, doc.language_id or "")
                for uri, doc in self.workspace.text_documents.items()
                if self.blocked(uri) is None}

    def blocked(self, uri: str) -> str | None:
        """privacy.blocked, remembered per document until the settings change: a
        request checks every open document, and each check matches ~45 globs."""
        if uri not in self.verdicts:
            self.verdicts[uri] = privacy.blocked(uri, self.settings)
        return self.verdicts[uri]

    def opened(self, doc: TextDocument) -> None:
        self.ring.touch(doc.uri)
        self.ring.changed()
        if not (self.settings.enabled and self.settings.prime) or self.blocked(doc.uri):
            return
        # Warm the server's cache for the document (max_tokens 0): its first keystroke finds it prefilled.
        # One prime at a time: an editor restoring a session opens many documents at once, and the
        # newest is the one the user sees.
        if self.priming is not None:
            self.upstream.cancel(self.priming)
        lines = list(doc.lines)
        prefix, suffix, _, _ = text.around(lines, max(0, len(lines) - 1), 0, self.settings.max_lines)
        self.priming = f"p{next(self.ids)}"
        self.upstream.prime(Complete(id=self.priming, max_tokens=0, workspace=self.workspace_of(doc.uri),
                                     document=Document(uri=doc.uri, prefix=prefix, suffix=suffix,
                                                       language=doc.language_id or "")))

    def edited(self, uri: str, changes) -> None:
        for change in changes:
            if isinstance(change, lsp.TextDocumentContentChangePartial):
                self.ring.edit(uri, *text.changed_lines(change.range.start.line, change.text))
        # The cursor moved on: what is in flight for the document answers a stale position.
        if (request_id := self.in_flight.pop(uri, None)) is not None:
            self.upstream.cancel(request_id)

    def closed(self, uri: str) -> None:
        self.report_unaccepted(uri, None)
        self.ring.close(uri)
        self.asked.pop(uri, None)
        self.verdicts.pop(uri, None)

    def workspace_of(self, uri: str) -> str:
        """The workspace folder holding `uri` (the longest), else the root, else ''."""
        folders = [f.uri for f in self.workspace.folders.values()]
        inside = [f for f in folders if uri.startswith(f.rstrip("/") + "/")]
        return max(inside, key=len) if inside else (self.workspace.root_uri or "")

    # -- feedback ---------------------------------------------------------------------------------

    def report_unaccepted(self, uri: str, prefix: str | None) -> None:
        """The items of `uri` last returned were not accepted: typed through as
        far as `prefix` (the document's prefix now) continues them, or dismissed."""
        shown = self.shown.pop(uri, None)
        if shown is None or shown.accepted:
            return
        if prefix is not None and prefix.startswith(shown.prefix) and (added := prefix[len(shown.prefix):]):
            for i, t in enumerate(shown.texts):
                if t.startswith(added):
                    self.upstream.send(Feedback(id=shown.id, accepted_chars=0, typed_chars=len(added), candidate=i))
                    return
        self.upstream.send(Feedback(id=shown.id, accepted_chars=0))

    def accepted(self, request_id: str, candidate: int, chars: int) -> None:
        for shown in self.shown.values():
            if shown.id == request_id:
                shown.accepted = True
        self.upstream.send(Feedback(id=request_id, accepted_chars=max(0, chars), candidate=candidate))

    # -- inline completion ------------------------------------------------------------------------

    async def inline_completion(self, params: lsp.InlineCompletionParams) -> lsp.InlineCompletionList:
        uri = params.text_document.uri
        doc = self.workspace.text_documents.get(uri)
        settings = self.settings
        if doc is None or not settings.enabled or self.blocked(uri):
            return empty()
        number = self.asked[uri] = self.asked.get(uri, 0) + 1
        lines = list(doc.lines)  # (split once: each of pygls' conversions would split the document again)
        codec = doc.position_codec
        at = codec.position_from_client_units(lines, params.position)
        prefix, suffix, first, last = text.around(lines, at.line, at.character, settings.max_lines)
        self.report_unaccepted(uri, prefix)
        wait_s = max(settings.debounce_ms / 1000, self.upstream.hold_until - asyncio.get_running_loop().time())
        if wait_s > 0:
            await asyncio.sleep(wait_s)
            if self.asked.get(uri) != number:
                return empty()  # a newer request for the document came meanwhile
        docs = self.sendable()
        self.ring.request(uri, at.line, docs, settings.context)
        invoked = params.context.trigger_kind == lsp.InlineCompletionTriggerKind.Invoked
        line = lines[at.line] if at.line < len(lines) else ""
        before, after = line[:at.character], line[at.character:]
        request = Complete(
            id=str(next(self.ids)), document=Document(uri=uri, prefix=prefix, suffix=suffix,
                                                      language=doc.language_id or ""),
            context=self.ring.items(uri, first, last, docs, settings.context),
            mode=text.mode(settings.mode, before, after), max_tokens=settings.max_tokens,
            deadline_ms=settings.deadline_ms, workspace=self.workspace_of(uri),
            n=max(1, min(4, settings.candidates)) if invoked else 1,
            # Asked for by the user: something shows (the server's confidence rules off), as our clients do.
            **(RULES_OFF if invoked else {}))
        self.in_flight[uri] = request.id
        try:
            done = await self.upstream.complete(request)
        finally:
            if self.in_flight.get(uri) == request.id:
                del self.in_flight[uri]
        if not isinstance(done, Done) or done.reason == "cancelled" or not done.text:
            return empty()
        texts = [done.text, *(done.candidates or [])]
        self.shown[uri] = Shown(done.id, prefix, texts)
        rest = text.unix(after).rstrip("\n")
        # The rest of the line is replaced by itself after the text: the item
        # shows (and, accepted, leaves) the line as it will read.
        end = codec.position_to_client_units(lines, ServerTextPosition(at.line, at.character + len(rest))) \
            if rest else params.position
        return lsp.InlineCompletionList(items=[
            lsp.InlineCompletionItem(
                insert_text=t + rest, range=lsp.Range(start=params.position, end=end),
                command=lsp.Command(title="completer: accepted", command=ACCEPT_COMMAND,
                                    arguments=[done.id, i, len(t)]))
            for i, t in enumerate(texts)])


def build(settings: LspSettings | None = None) -> CompleterLanguageServer:
    server = CompleterLanguageServer(settings)

    @server.feature(lsp.INITIALIZE)
    def initialize(params: lsp.InitializeParams) -> None:
        if params.initialization_options:
            server.configure(params.initialization_options)

    @server.feature(lsp.WORKSPACE_DID_CHANGE_CONFIGURATION)
    def did_change_configuration(params: lsp.DidChangeConfigurationParams) -> None:
        server.configure(params.settings)

    @server.feature(lsp.TEXT_DOCUMENT_DID_OPEN)
    def did_open(params: lsp.DidOpenTextDocumentParams) -> None:
        server.opened(server.workspace.get_text_document(params.text_document.uri))

    @server.feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(params: lsp.DidChangeTextDocumentParams) -> None:
        server.edited(params.text_document.uri, params.content_changes)

    @server.feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(params: lsp.DidCloseTextDocumentParams) -> None:
        server.closed(params.text_document.uri)

    @server.feature(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, lsp.InlineCompletionOptions())
    async def inline_completion(params: lsp.InlineCompletionParams):
        return await server.inline_completion(params)

    @server.command(ACCEPT_COMMAND)
    def accept(request_id: str, candidate: int, chars: int) -> None:
        server.accepted(request_id, candidate, chars)

    @server.feature(lsp.SHUTDOWN)
    async def shutdown(params) -> None:
        await server.upstream.close()

    return server
