"""The completion service: what a completion is to the server, whichever
front door it came through. The WebSocket protocol (`server/session.py`)
and the llama.cpp and OpenAI routes (`server/compat/`) are adapters around
it: each reads its wire format into these calls and writes their answers,
and their refusals, back in its own. Once, for both:

- admission (`Client.admit`): the request's size (server.max_document_chars),
  an id already in flight, the start (no engine yet) and the shutdown
  (nothing new starts), the client's in-flight limit;
- a client's state (`Client`): the prompt state of its recent documents
  (past server.max_documents_per_connection the least recently used goes),
  its cache salt (server.prefix_cache_scope), its requests in flight;
- submit: the pipeline's request, then the engine's, under the document's
  supersede key (a newer keystroke ends the ones before it) or the client's
  affinity; cancel; a request followed to its end (`Client.follow`);
- the metrics of a finished request (`observe`).

Only server/app.py builds it (and attaches the engine once loaded); it
knows neither the app nor the doors."""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Literal

import msgspec

from completer.config import Config
from completer.document import DocumentPrompt
from completer.engine.engine import Engine, RequestStream
from completer.engine.request import EngineError, Finished, Request
from completer.loading import LoadedModel
from completer.pipeline import CompletionPipeline, RequestOptions
from completer.protocol import ContextItem, Document
from completer.retrieval import WindowCache
from completer.server.hold import ClientHold
from completer.server.metrics import Metrics
from completer.server.request_log import RequestLog
from completer.server.warming import Warmer

if TYPE_CHECKING:
    from completer.cluster.front import LinkedEngine

# The doors' inputs are the protocol's Document and ContextItem and the pipeline's RequestOptions, which
# they take from here: they import the service, never the pipeline or the engine.
__all__ = ["Client", "CompletionService", "Flight", "InFlight", "Refused", "RequestOptions", "failure",
           "request_chars"]

Refusal = Literal["too_large", "duplicate", "loading", "stopping", "busy"]


class Refused(Exception):
    """A request the service does not start, before any work. `kind`:
    too_large (`count` characters, over `limit`), duplicate (its id is in
    flight), loading (no engine yet), stopping (shutting down), busy
    (`count` requests in flight, the client's `limit`). The door words it."""

    def __init__(self, kind: Refusal, count: int = 0, limit: int = 0):
        super().__init__(kind)
        self.kind, self.count, self.limit = kind, count, limit

    def words(self, table: dict[Refusal, tuple[object, str]], request_id: str = "") -> tuple[object, str]:
        """(code, message) in a door's words: `table` has each kind's code and
        its message, a format of {count}, {limit} and {id} (the request's)."""
        code, message = table[self.kind]
        return code, message.format(count=self.count, limit=self.limit, id=request_id)


def failure(e: Exception) -> EngineError:
    """What a request that raised answers: the engine's refusal as it is;
    anything else (a bug) `internal`, naming it. One request's failure never
    takes a connection or the server down."""
    return e if isinstance(e, EngineError) else EngineError("internal", f"{type(e).__name__}: {e}")


def request_chars(document: Document, context: Iterable[ContextItem], stop: Iterable[str]) -> int:
    """What server.max_document_chars bounds: document, context and stop strings."""
    return len(document.uri) + len(document.prefix) + len(document.suffix) \
        + sum(len(c.uri) + len(c.text) for c in context) + sum(map(len, stop))


@dataclasses.dataclass(frozen=True)
class Flight:
    """A request submitted: what its door follows, and answers from."""

    request: Request
    stream: RequestStream
    received: float  # time.perf_counter() when its door read it
    route: str  # the metrics' route label ("ws", "infill", ...)
    warm: Hashable | None = None  # the document whose next windows are warmed once it ends (None: none)
    state: DocumentPrompt | None = None  # that document's prompt state
    text: tuple[str, str] = ("", "")  # and its text as this request had it (prefix, suffix)

    @property
    def id(self) -> str:
        return self.request.id


class InFlight:
    """Requests in flight that count against one limit (a connection's, or
    the compatible routes' together), by the document whose keystrokes they
    are: one that a newer keystroke superseded holds no slot, though the
    engine has not ended it yet."""

    def __init__(self, limit: int):
        self.limit = limit
        self.document_of: dict[str, str | None] = {}  # engine id -> its supersede document (None: none)
        self.current: dict[str, set[str]] = {}  # document -> its requests that no newer one superseded
        self.superseded: set[str] = set()

    def __len__(self) -> int:
        return len(self.document_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.document_of

    def live(self, supersede: str | None, ends_others: bool) -> int:
        """The slots taken, for a request about to come: the ones it would supersede free theirs."""
        replaced = len(self.current.get(supersede, ())) if ends_others and supersede is not None else 0
        return len(self.document_of) - len(self.superseded) - replaced

    def add(self, request_id: str, supersede: str | None, ends_others: bool) -> None:
        self.document_of[request_id] = supersede
        if supersede is not None:
            current = self.current.setdefault(supersede, set())
            if ends_others:
                self.superseded |= current
                current.clear()
            current.add(request_id)

    def discard(self, request_id: str) -> None:
        if request_id not in self.document_of:
            return
        self.superseded.discard(request_id)
        supersede = self.document_of.pop(request_id)
        if (current := self.current.get(supersede)) is not None:
            current.discard(request_id)
            if not current:
                del self.current[supersede]


class Client:
    """One client of the service: `key` names it (its cache salt under
    server.prefix_cache_scope = "connection", its supersede keys, a
    cluster's affinity); it holds the prompt state of its recent documents
    and its requests in flight. `sender(key)` is another client sharing
    these (the compatible routes: one state for all their HTTP clients)."""

    def __init__(self, service: CompletionService, key: str, documents: OrderedDict, inflight: InFlight,
                 windows: WindowCache, warmer: Warmer | None = None):
        self.service, self.key = service, key
        self.documents: OrderedDict[Hashable, DocumentPrompt] = documents  # least recently used first
        self.inflight = inflight
        self.windows = windows  # the files its documents' retrieval cut, once for all of them
        self.warmer = warmer or Warmer(service, key)  # its documents' next windows, warmed while idle

    @property
    def salt(self) -> str:
        """Who may share its requests' cached prefixes (see server.prefix_cache_scope)."""
        return self.key if self.service.config.server.prefix_cache_scope == "connection" else ""

    def sender(self, key: str) -> Client:
        return Client(self.service, key, self.documents, self.inflight, self.windows, self.warmer)

    def admit(self, request_id: str, chars: int, supersede: str | None = None, ends_others: bool = True) -> None:
        """Raise Refused unless a request of `chars` (request_chars) may start
        now: what can never be served first, then the server's state, then
        the client's room (`supersede`, `ends_others`: as `submit` will)."""
        limit = self.service.config.server.max_document_chars
        if chars > limit:
            raise Refused("too_large", chars, limit)
        if request_id in self.inflight:
            raise Refused("duplicate")
        self.service.check_open()
        # The keystroke the user wants now is never the one refused: the ones it supersedes free their slots.
        if (live := self.inflight.live(supersede, ends_others)) >= self.inflight.limit:
            raise Refused("busy", live, self.inflight.limit)

    def document(self, key: Hashable, retrieval: bool | None = None) -> tuple[DocumentPrompt, bool]:
        """The prompt state of document `key`, and whether it is new (its first
        request: a cold prefill). `retrieval`: as CompletionPipeline.document."""
        state = self.documents.pop(key, None)
        first = state is None
        if first:
            state = self.service.pipeline.document(retrieval, self.windows)
        self.documents[key] = state
        while len(self.documents) > self.service.config.server.max_documents_per_connection:
            self.documents.popitem(last=False)  # its next request builds its prompt afresh
        return state, first

    def submit(self, request_id: str, document: Document, context: Iterable[ContextItem], options: RequestOptions,
               state: DocumentPrompt, received: float, supersede: str | None = None, ends_others: bool = True,
               route: str = "ws", warm: Hashable | None = None) -> Flight:
        """Build the request (raises EngineError, `internal` where the
        pipeline failed) and queue it in the engine now. `supersede`: the
        document whose requests in flight it ends (unless `ends_others` is
        False: it joins them); None: it ends none and none ends it. `warm`:
        the document (`state`'s) whose next windows are warmed after it."""
        if warm is not None:
            self.warmer.touched(warm)
        options = msgspec.structs.replace(options, cache_salt=self.salt)
        try:
            request = self.service.pipeline.request(request_id, document, context, options, state, arrival=received)
        except Exception as e:
            raise failure(e) from None
        request = msgspec.structs.replace(request, client=self.key)
        key = None if supersede is None else f"{self.key}/{supersede}"
        stream = self.service.engine.submit(request, supersede=key, ends_others=ends_others, affinity=self.key)
        self.inflight.add(request_id, supersede, ends_others)
        return Flight(request, stream, received, route, warm, state,
                      (document.prefix, document.suffix) if warm is not None else ("", ""))

    def cancel(self, request_id: str) -> None:
        if request_id in self.inflight:
            self.service.engine.cancel(request_id)

    def cancel_all(self) -> None:
        for request_id in list(self.inflight.document_of):
            self.service.engine.cancel(request_id)
        self.warmer.close()

    def release(self, request_id: str) -> None:
        """Its slot is free (the request ended, or its door gave up on it)."""
        self.inflight.discard(request_id)

    async def follow(self, flight: Flight, on_text: Callable[[str], Awaitable[bool]]) -> Finished:
        """The request to its end: each piece of text to `on_text`, which
        answers True to end it there (cancelled in the engine; its door keeps
        the text so far). Raises the engine's EngineError. However it is
        left (the door's client gone, a write that failed), its slot is
        freed, and a request not finished is cancelled at once (its blocks
        return now, not at its deadline)."""
        stream = flight.stream
        try:
            async for delta in stream:
                if await on_text(delta.text):
                    self.service.engine.cancel(flight.id)
                    break
            return await stream.finished()
        finally:
            self.release(flight.id)
            if stream.result is None:
                self.service.engine.cancel(flight.id)
            elif flight.warm is not None and stream.result.reason != "cancelled":
                self.warmer.ended(flight.warm, flight.state, flight.text, self.salt)

    def close(self) -> None:
        """The client is gone (its requests ended): the service forgets it."""
        self.service.clients.discard(self)


class CompletionService:
    """The completions of every client, through the pipeline and the engine
    that `attach` hands it once loaded."""

    def __init__(self, config: Config, metrics: Metrics):
        self.config, self.metrics = config, metrics
        self.pipeline: CompletionPipeline | None = None
        self.engine: Engine | LinkedEngine | None = None
        self.target: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        self.stopping = False  # shutting down: no new requests start
        self.clients: set[Client] = set()  # until they close (their senders share their state)
        self.request_log = RequestLog(config.server.request_log) if config.server.request_log else None
        self.hold = ClientHold() if config.server.client_hold else None

    def attach(self, pipeline: CompletionPipeline, engine: Engine | LinkedEngine, target: LoadedModel,
               draft: LoadedModel | None) -> None:
        """Ready: the models loaded, the engine started."""
        self.pipeline, self.engine, self.target, self.draft = pipeline, engine, target, draft

    def client(self, key: str, limit: int | None = None) -> Client:
        """A new client; `limit`: its requests in flight (server.max_inflight_per_connection by default)."""
        client = Client(self, key, OrderedDict(),
                        InFlight(self.config.server.max_inflight_per_connection if limit is None else limit),
                        # what its store keeps, and one request's own files
                        WindowCache(self.config.server.context_store_chars + self.config.server.max_document_chars))
        self.clients.add(client)
        return client

    def check_open(self) -> None:
        """Raise Refused while no request can start: loading, or shutting down."""
        if self.engine is None:
            raise Refused("loading")
        if self.stopping:
            raise Refused("stopping")

    @property
    def in_flight(self) -> int:
        return sum(len(c.inflight) for c in self.clients)

    def hold_ms(self, client: str) -> float | None:
        """What a `done` sent now tells `client` to wait after a keystroke (None: the server does not say)."""
        return None if self.hold is None else self.hold.hold_ms(time.perf_counter(), client)

    def stop(self) -> None:
        """Start nothing new, and cancel every request in flight (each ends `cancelled`)."""
        self.stopping = True
        for client in list(self.clients):
            client.cancel_all()

    def observe(self, flight: Flight, finished: Finished, reason: str | None = None) -> None:
        """A request that ended with an answer, into the metrics (`reason`: its
        door's, where that ended it; else the engine's)."""
        reason, priming = reason or finished.reason, flight.request.params.priming
        self.metrics.observe_done(finished.timings, reason, flight.received, priming=priming, route=flight.route)
        if finished.cut:
            self.metrics.confidence_cuts.labels(finished.cut).inc()
        if self.hold is not None and not priming and finished.timings.ttft_ms > 0:  # (admitted: its wait is known)
            self.hold.observe(time.perf_counter(), flight.request.client, finished.timings)
        if self.request_log is not None:
            self.request_log.write(flight.received, flight.id, flight.route, flight.request.client, reason, priming,
                                   finished.timings)
