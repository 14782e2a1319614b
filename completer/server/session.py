"""One editor connection: its documents' prompt state, its requests in flight,
and the protocol's message handling. A bad frame gets an `error` and the
connection goes on; nothing one session does reaches another.

Frames leave through a queue drained by one writer task. A reader too slow
to take them (its socket's buffers full, `server.send_queue_frames` frames
waiting behind them) is disconnected (1008), not buffered for; a burst of
frames to a reader that keeps up is not "slow"."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from completer import __version__
from completer.context_store import ContextStore
from completer.document import DocumentPrompt
from completer.engine.engine import RequestStream
from completer.engine.request import EngineError
from completer.pipeline import RequestOptions
from completer.protocol import (PROTOCOL_VERSION, Cancel, Complete, Delta, Done, Error, Feedback, Hello,
                                ModelNames, Ready, RequestDefaults, decode, encode)
from completer.workspace import WorkspaceFiles

if TYPE_CHECKING:
    from completer.server.app import App


class Session:
    def __init__(self, app: "App", ws: ServerConnection, number: int):
        self.app = app
        self.ws = ws
        self.key = f"c{number}"
        self.documents: OrderedDict[str, DocumentPrompt] = OrderedDict()  # by URI, least recently used first
        self.inflight: dict[str, asyncio.Task] = {}  # protocol id -> the task relaying its stream
        self.document_of: dict[str, str] = {}  # protocol id in flight -> its document's URI
        # URI -> its requests in flight that no newer one superseded (one, unless
        # some came with `supersede: false`).
        self.current: dict[str, set[str]] = {}
        # Ids a newer keystroke in the same document replaced: still in flight
        # until the engine ends them, but holding no slot of the connection's.
        self.superseded: set[str] = set()
        # id -> the length of each text its `done` offered (`text`, then the
        # candidates), until its feedback comes.
        self.offered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.outbox: asyncio.Queue[str] = asyncio.Queue()
        self.writer: asyncio.Task | None = None
        self.closing: asyncio.Task | None = None
        self.too_slow = False
        # The other files this client has shown us: retrieval candidates for its later requests.
        self.context_store = ContextStore(app.config.server.context_store_chars if app.config.model.retrieval else 0)
        # The files a document imports, read from its workspace where server.workspace_roots allows.
        self.workspace_files = WorkspaceFiles(app.config.server.workspace_roots, app.config.server.workspace_file_bytes)

    def engine_id(self, request_id: str) -> str:
        return f"{self.key}/{request_id}"

    def send(self, message) -> None:
        if self.too_slow or self.ws.close_code is not None:
            return
        if self.outbox.qsize() >= self.app.config.server.send_queue_frames and self.ws.paused:
            self.too_slow = True
            self.app.metrics.slow_disconnects.inc()
            self.closing = asyncio.create_task(self.ws.close(1008, "client too slow"))
            return
        self.outbox.put_nowait(encode(message))

    async def write(self) -> None:
        while True:
            frame = await self.outbox.get()
            try:
                await self.ws.send(frame)
            except ConnectionClosed:
                return
            finally:
                self.outbox.task_done()

    async def flush(self) -> None:
        """Wait until every queued frame went to the socket (or the writer ended: the socket is gone)."""
        if self.writer is None or self.writer.done():
            return
        joined = asyncio.ensure_future(self.outbox.join())
        await asyncio.wait([joined, self.writer], return_when=asyncio.FIRST_COMPLETED)
        joined.cancel()

    def error(self, request_id: str | None, code: str, message: str) -> None:
        self.app.metrics.errors.labels(code).inc()
        self.send(Error(request_id, code, message))

    async def run(self) -> None:
        self.writer = writer = asyncio.create_task(self.write())
        try:
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    self.error(None, "bad_request", "binary frames are not supported; send text")
                    continue
                self.handle(decode(frame), time.perf_counter())
        except ConnectionClosed:
            pass
        finally:
            for request_id in list(self.inflight):
                self.app.engine.cancel(self.engine_id(request_id))
            if self.inflight:
                await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            writer.cancel()

    def handle(self, msg, received: float) -> None:
        if isinstance(msg, Error):
            self.error(msg.id, msg.code, msg.message)
        elif isinstance(msg, Complete):
            self.start(msg, received)
        elif isinstance(msg, Cancel):
            if msg.id in self.inflight:
                self.app.engine.cancel(self.engine_id(msg.id))
        elif isinstance(msg, Feedback):
            offered = self.offered.pop(msg.id, None)
            if offered is not None and msg.candidate < len(offered):
                self.app.metrics.observe_feedback(offered[msg.candidate], msg.accepted_chars, msg.typed_chars,
                                                  msg.shown)
        elif isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                self.error(None, "unsupported",
                           f"protocol {msg.protocol} is not supported (this server speaks {PROTOCOL_VERSION})")
            else:
                app = self.app
                defaults = app.config.request
                self.send(Ready(PROTOCOL_VERSION, f"completer/{__version__}",
                                ModelNames(app.target.name, app.draft.name if app.draft else None),
                                RequestDefaults(defaults.deadline_ms, defaults.max_tokens,
                                                defaults.first_deadline_ms)))

    def supersede_key(self, uri: str) -> str:
        return f"{self.key}/{uri}"

    def invalid(self, msg: Complete) -> tuple[str, str] | None:
        limits = self.app.config.server
        # Ranges and per-field lengths were checked as the frame was decoded (protocol.py).
        d = msg.document
        size = len(d.uri) + len(d.prefix) + len(d.suffix) + sum(len(c.uri) + len(c.text) for c in msg.context) \
            + sum(map(len, msg.stop))
        if size > limits.max_document_chars:
            return "too_large", f"document and context hold {size} characters; the limit is {limits.max_document_chars}"
        if msg.id in self.inflight:
            return "bad_request", f"id {msg.id!r} is already in flight on this connection"
        if self.app.stopping:
            return "overloaded", "the server is shutting down"
        # The keystroke the user wants now is never the one refused: the ones it supersedes free their slots.
        replaced = len(self.current.get(msg.document.uri, ())) if msg.supersede else 0
        live = len(self.inflight) - len(self.superseded) - replaced
        if live >= limits.max_inflight_per_connection:
            return "overloaded", f"{live} requests in flight on this connection (other documents)"
        return None

    def start(self, msg: Complete, received: float) -> None:
        """Build the request and submit it now (a `cancel` read next finds it in
        the engine); a task relays its stream."""
        if (problem := self.invalid(msg)) is not None:
            self.error(msg.id, *problem)
            return
        app, uri = self.app, msg.document.uri
        state = self.documents.pop(uri, None)
        deadline_ms = msg.deadline_ms
        if state is None:  # the document's first request: a cold prefill, and no keystroke racing it
            state = app.pipeline.document()
            if deadline_ms is None:
                deadline_ms = app.config.request.first_deadline_ms
        self.documents[uri] = state
        while len(self.documents) > app.config.server.max_documents_per_connection:
            self.documents.popitem(last=False)  # its next keystroke builds its prompt afresh
        salt = self.key if app.config.server.prefix_cache_scope == "connection" else ""
        options = RequestOptions(mode=msg.mode, max_tokens=msg.max_tokens, temperature=msg.temperature,
                                 stop=tuple(msg.stop), deadline_ms=deadline_ms, cache_salt=salt, n=msg.n)
        try:
            found = self.workspace_files.imported(msg.workspace, msg.document)
            context = self.context_store.candidates(msg.document, msg.context, msg.workspace, found)
            request = app.pipeline.request(self.engine_id(msg.id), msg.document, context, options, state,
                                           arrival=received)
        except Exception as e:  # never let one request take the connection down
            self.error(msg.id, "internal", f"{type(e).__name__}: {e}")
            return
        stream = app.engine.submit(request, supersede=self.supersede_key(uri), ends_others=msg.supersede)
        current = self.current.setdefault(uri, set())
        if msg.supersede:
            self.superseded |= current
            current.clear()
        current.add(msg.id)
        self.document_of[msg.id] = uri
        task = asyncio.create_task(self.relay(msg, stream, received, request.params.priming))
        self.inflight[msg.id] = task
        task.add_done_callback(lambda _: self.release(msg.id, task))

    def release(self, request_id: str, task: asyncio.Task | None = None) -> None:
        """Forget a request in flight (its id is free again); `task`: only if it is still that one's."""
        if request_id not in self.inflight or task is not None and self.inflight[request_id] is not task:
            return
        del self.inflight[request_id]
        self.superseded.discard(request_id)
        uri = self.document_of.pop(request_id)
        if (current := self.current.get(uri)) is not None:
            current.discard(request_id)
            if not current:
                del self.current[uri]

    async def relay(self, msg: Complete, stream: RequestStream, received: float, priming: bool) -> None:
        app, request_id = self.app, msg.id
        try:
            async for delta in stream:
                self.send(Delta(request_id, delta.text))
        except EngineError as e:
            self.release(request_id)  # before the answer: the client may reuse the id at once
            self.error(request_id, e.code, str(e))
            return
        except Exception as e:  # never let one request take the connection down
            app.engine.cancel(self.engine_id(request_id))
            self.release(request_id)
            self.error(request_id, "internal", f"{type(e).__name__}: {e}")
            return
        done = stream.result
        self.release(request_id)
        if not priming:  # remembered before sending: the client may answer `done` with feedback at once
            self.remember_offered(request_id, (done.text, *done.candidates))
        # `candidates` only for a client that asked for them (an older one never sees the field).
        self.send(Done(request_id, done.reason, done.text, done.timings,
                       list(done.candidates) if msg.n > 1 else None))
        app.metrics.observe_done(done.timings, done.reason, received, priming)

    def remember_offered(self, request_id: str, texts: tuple[str, ...]) -> None:
        self.offered[request_id] = tuple(map(len, texts))
        while len(self.offered) > 1024:
            self.offered.popitem(last=False)
