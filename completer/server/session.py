"""One editor connection: the WebSocket protocol's adapter to the completion
service (server/service.py), which keeps the connection's documents' prompt
state and requests in flight, admits and submits them. Here: the frames, a
`complete` read into the service's calls and its answers and refusals
written back as `delta`, `done` and `error`, the relays of requests in
flight, feedback. A bad frame gets an `error` and the connection goes on;
nothing one session does reaches another.

Frames leave through a queue drained by one writer task. A reader too slow
to take them (its socket's buffers full, `server.send_queue_frames` frames
waiting behind them) is disconnected (1008), not buffered for; a burst of
frames to a reader that keeps up is not "slow"."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from completer import __version__
from completer.context_store import ContextStore
from completer.protocol import (PROTOCOL_VERSION, Cancel, Complete, Delta, Done, Error, Feedback, Hello,
                                ModelNames, Ready, RequestDefaults, decode, encode)
from completer.server.service import CompletionService, Flight, Refused, RequestOptions, failure, request_chars
from completer.workspace import WorkspaceFiles


# The service's refusals as the protocol's error codes and messages.
REFUSALS = {
    "too_large": ("too_large", "document and context hold {count} characters; the limit is {limit}"),
    "duplicate": ("bad_request", "id {id!r} is already in flight on this connection"),
    "loading": ("overloaded", "the server is loading its models"),  # (a session begins once they are)
    "stopping": ("overloaded", "the server is shutting down"),
    "busy": ("overloaded", "{count} requests in flight on this connection (other documents)"),
}


class Session:
    def __init__(self, service: CompletionService, ws: ServerConnection, number: int):
        self.service = service
        self.config, self.metrics = service.config, service.metrics
        self.ws = ws
        self.key = f"c{number}"
        # Its documents' prompt state (by URI) and its requests in flight, as the service keeps them.
        self.client = service.client(self.key)
        self.inflight: dict[str, asyncio.Task] = {}  # protocol id -> the task relaying its stream
        # id -> the length of each text its `done` offered (`text`, then the
        # candidates), until its feedback comes.
        self.offered: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self.outbox: asyncio.Queue[str] = asyncio.Queue()
        self.writer: asyncio.Task | None = None
        self.closing: asyncio.Task | None = None
        self.too_slow = False
        server = self.config.server
        # The other files this client has shown us: retrieval candidates for its later requests.
        self.context_store = ContextStore(server.context_store_chars if self.config.model.retrieval else 0)
        # The files a document imports, read from its workspace where server.workspace_roots allows.
        self.workspace_files = WorkspaceFiles(server.workspace_roots, server.workspace_file_bytes)

    @property
    def documents(self) -> OrderedDict:
        """Its documents' prompt state by URI, least recently used first."""
        return self.client.documents

    def engine_id(self, request_id: str) -> str:
        return f"{self.key}/{request_id}"

    def send(self, message) -> None:
        if self.too_slow or self.ws.close_code is not None:
            return
        if self.outbox.qsize() >= self.config.server.send_queue_frames and self.ws.paused:
            self.too_slow = True
            self.metrics.slow_disconnects.inc()
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
        self.metrics.errors.labels(code).inc()
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
            self.client.cancel_all()
            if self.inflight:
                await asyncio.gather(*self.inflight.values(), return_exceptions=True)
            self.client.close()
            writer.cancel()
            # The cancelled task keeps its CancelledError, whose traceback holds write()'s frame and so this
            # session: kept here, the closed connection's documents and windows waited for a full collection.
            self.writer = None

    def handle(self, msg, received: float) -> None:
        if isinstance(msg, Error):
            self.error(msg.id, msg.code, msg.message)
        elif isinstance(msg, Complete):
            self.start(msg, received)
        elif isinstance(msg, Cancel):
            self.client.cancel(self.engine_id(msg.id))
        elif isinstance(msg, Feedback):
            offered = self.offered.pop(msg.id, None)
            if offered is not None and msg.candidate < len(offered):
                self.metrics.observe_feedback(offered[msg.candidate], msg.accepted_chars, msg.typed_chars, msg.shown)
        elif isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                self.error(None, "unsupported",
                           f"protocol {msg.protocol} is not supported (this server speaks {PROTOCOL_VERSION})")
            else:
                service, defaults = self.service, self.config.request
                self.send(Ready(PROTOCOL_VERSION, f"completer/{__version__}",
                                ModelNames(service.target.name, service.draft.name if service.draft else None),
                                RequestDefaults(defaults.deadline_ms, defaults.max_tokens,
                                                defaults.first_deadline_ms)))

    def start(self, msg: Complete, received: float) -> None:
        """Build the request and submit it now (a `cancel` read next finds it in
        the engine); a task relays its stream."""
        request_id, uri = self.engine_id(msg.id), msg.document.uri
        try:
            # Ranges and per-field lengths were checked as the frame was decoded (protocol.py).
            self.client.admit(request_id, request_chars(msg.document, msg.context, msg.stop), uri, msg.supersede)
        except Refused as r:
            self.error(msg.id, *r.words(REFUSALS, msg.id))
            return
        state, first = self.client.document(uri)
        deadline_ms = msg.deadline_ms
        if first and deadline_ms is None:  # the document's first request: a cold prefill, no keystroke racing it
            deadline_ms = self.config.request.first_deadline_ms
        options = RequestOptions(mode=msg.mode, max_tokens=msg.max_tokens, temperature=msg.temperature,
                                 stop=tuple(msg.stop), deadline_ms=deadline_ms, n=msg.n,
                                 min_first_prob=msg.min_first_prob, min_token_prob=msg.min_token_prob,
                                 min_line_prob=msg.min_line_prob, report_probs=msg.probs)
        try:
            found = self.workspace_files.imported(msg.workspace, msg.document)
            context = self.context_store.candidates(msg.document, msg.context, msg.workspace, found)
            flight = self.client.submit(request_id, msg.document, context, options, state, received,
                                        supersede=uri, ends_others=msg.supersede, warm=uri)
        except Exception as e:  # never let one request take the connection down
            error = failure(e)
            self.error(msg.id, error.code, str(error))
            return
        task = asyncio.create_task(self.relay(msg, flight))
        self.inflight[msg.id] = task
        task.add_done_callback(lambda _: self.release(msg.id, task))

    def release(self, request_id: str, task: asyncio.Task | None = None) -> None:
        """Forget a request in flight (its id is free again); `task`: only if it is still that one's."""
        if request_id not in self.inflight or task is not None and self.inflight[request_id] is not task:
            return
        del self.inflight[request_id]
        self.client.release(self.engine_id(request_id))

    async def relay(self, msg: Complete, flight: Flight) -> None:
        request_id = msg.id

        async def delta(text: str) -> bool:
            self.send(Delta(request_id, text))
            return False  # the engine's ends only

        try:
            done = await self.client.follow(flight, delta)
        except Exception as e:  # the engine's refusal, or a bug: never let one request take the connection down
            self.release(request_id)  # before the answer: the client may reuse the id at once
            error = failure(e)
            self.error(request_id, error.code, str(error))
            return
        self.release(request_id)
        priming = flight.request.params.priming
        if not priming:  # remembered before sending: the client may answer `done` with feedback at once
            self.remember_offered(request_id, (done.text, *done.candidates))
        self.service.observe(flight, done)
        # `candidates` only for a client that asked for them (an older one never sees the field).
        self.send(Done(request_id, done.reason, done.text, done.timings,
                       list(done.candidates) if msg.n > 1 else None,
                       self.service.hold_ms(flight.request.client), done.cut or None,
                       [list(p) for p in done.probs] if msg.probs else None))

    def remember_offered(self, request_id: str, texts: tuple[str, ...]) -> None:
        self.offered[request_id] = tuple(map(len, texts))
        while len(self.offered) > 1024:
            self.offered.popitem(last=False)
