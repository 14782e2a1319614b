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
from completer.document import DocumentPrompt
from completer.engine.engine import RequestStream
from completer.engine.request import EngineError
from completer.pipeline import RequestOptions
from completer.protocol import (PROTOCOL_VERSION, Cancel, Complete, Delta, Done, Error, Feedback, Hello,
                                ModelNames, Ready, decode, encode)
from completer.server.metrics import Record

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
        self.latest: dict[str, str] = {}  # URI -> the id of its newest request in flight
        # Ids a newer keystroke in the same document replaced: still in flight
        # until the engine ends them, but holding no slot of the connection's.
        self.superseded: set[str] = set()
        self.shown: OrderedDict[str, int] = OrderedDict()  # id -> chars shown, for feedback
        self.outbox: asyncio.Queue[str] = asyncio.Queue()
        self.writer: asyncio.Task | None = None
        self.closing: asyncio.Task | None = None
        self.too_slow = False

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
            shown = self.shown.pop(msg.id, None)
            if shown is not None:
                self.app.metrics.observe_feedback(shown, max(0, min(msg.accepted_chars, shown)))
        elif isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                self.error(None, "unsupported",
                           f"protocol {msg.protocol} is not supported (this server speaks {PROTOCOL_VERSION})")
            else:
                app = self.app
                self.send(Ready(PROTOCOL_VERSION, f"completer/{__version__}",
                                ModelNames(app.target.name, app.draft.name if app.draft else None)))

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
        # The keystroke the user wants now is never the one refused: the one it supersedes frees its slot.
        live = len(self.inflight) - len(self.superseded) - (msg.document.uri in self.latest)
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
        state = self.documents.pop(uri, None) or app.pipeline.document()
        self.documents[uri] = state
        while len(self.documents) > app.config.server.max_documents_per_connection:
            self.documents.popitem(last=False)  # its next keystroke builds its prompt afresh
        salt = self.key if app.config.server.prefix_cache_scope == "connection" else ""
        options = RequestOptions(mode=msg.mode, max_tokens=msg.max_tokens, temperature=msg.temperature,
                                 stop=tuple(msg.stop), deadline_ms=msg.deadline_ms, cache_salt=salt)
        try:
            request = app.pipeline.request(self.engine_id(msg.id), msg.document, msg.context, options, state,
                                           arrival=received)
        except Exception as e:  # never let one request take the connection down
            self.error(msg.id, "internal", f"{type(e).__name__}: {e}")
            return
        stream = app.engine.submit(request, supersede=self.supersede_key(uri))
        if (older := self.latest.get(uri)) is not None:
            self.superseded.add(older)
        self.latest[uri] = msg.id
        self.document_of[msg.id] = uri
        task = asyncio.create_task(self.relay(msg.id, stream, received))
        self.inflight[msg.id] = task
        task.add_done_callback(lambda _: self.release(msg.id, task))

    def release(self, request_id: str, task: asyncio.Task | None = None) -> None:
        """Forget a request in flight (its id is free again); `task`: only if it is still that one's."""
        if request_id not in self.inflight or task is not None and self.inflight[request_id] is not task:
            return
        del self.inflight[request_id]
        self.superseded.discard(request_id)
        uri = self.document_of.pop(request_id)
        if self.latest.get(uri) == request_id:
            del self.latest[uri]

    async def relay(self, request_id: str, stream: RequestStream, received: float) -> None:
        app = self.app
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
        # Remember before sending: the client may answer `done` with feedback at once.
        self.remember_shown(request_id, len(done.text))
        self.send(Done(request_id, done.reason, done.text, done.timings))
        t = done.timings
        ttft, total = t.ttft_ms / 1000, t.total_ms / 1000
        decode_s = max(0.0, total - ttft)
        app.metrics.observe(Record(
            at=time.time(), ttft=ttft, e2e=time.perf_counter() - received,  # e2e: with the hop to the socket
            itl=decode_s / (t.generated_tokens - 1) if t.generated_tokens > 1 else None,
            queue=t.queue_ms / 1000, prefill=max(0.0, ttft - t.queue_ms / 1000), decode=decode_s,
            prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens, generated=t.generated_tokens,
            proposed=t.draft_proposed, accepted=t.draft_accepted), done.reason, t.prefill)
        if t.prefill_reason:
            app.metrics.observe_prefill(t.prefill, t.prefill_reason, t.kv_transfer_bytes, t.kv_transfer_ms / 1000)

    def remember_shown(self, request_id: str, chars: int) -> None:
        self.shown[request_id] = chars
        while len(self.shown) > 1024:
            self.shown.popitem(last=False)
