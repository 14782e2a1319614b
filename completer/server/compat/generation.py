"""One compatible request through the same pipeline and engine as a
WebSocket `complete`: the prompt built by `CompletionPipeline` (template,
window, token healing) from a per-client document state, the engine's stop
logic and prefix cache, the server's limits and metrics.

What differs from a WebSocket session, and why:
- No supersede: an HTTP request always gets its answer (llama.vim waits for
  it before it sends the next), and a client that no longer wants it
  disconnects (Continue aborts its fetch); the disconnect cancels it in the
  engine at once, and its blocks return.
- The client is its address and `id_slot`: HTTP clients open a connection
  per request and share the server's one token. Its document state keeps
  the tokenization incremental; a priming request (n_predict 0, the extra
  context alone) keeps a state of its own so the two do not undo each
  other's. The K/V itself is found by the prefix cache, whoever asks.
- llama.cpp's own ends of generation, which the engine does not have, apply
  here to the streamed text: `n_indent` and `t_max_predict_ms` (`Budget`);
  when one ends it, the engine request is cancelled and the text so far is
  the answer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from completer.document import DocumentPrompt
from completer.engine.request import EngineError, Request, Timings
from completer.pipeline import RequestOptions
from completer.protocol import MAX_TEMPERATURE, ContextItem, Document
from completer.server.compat.wire import CONNECTIONS, HttpError

if TYPE_CHECKING:
    from completer.server.app import App

# The engine's error codes (the protocol's) as HTTP statuses.
STATUS_OF = {"bad_request": 400, "too_large": 413, "overloaded": 503, "internal": 500, "unsupported": 501}


def indent_end(text: str, n_indent: int) -> int | None:
    """llama.cpp's `n_indent`: after the completion's first line (the
    cursor's), the first line indented by fewer than `n_indent` spaces or
    tabs, once it shows anything else (a blank line does too), ends the
    completion after that line's indentation. None while nothing ends it."""
    if n_indent <= 0:
        return None
    newline = text.find("\n")
    while newline >= 0:
        start = pos = newline + 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
        if pos < len(text) and pos - start < n_indent:
            return pos
        newline = text.find("\n", newline + 1)
    return None


class Budget(msgspec.Struct, frozen=True):
    """llama.cpp's ends of generation that the engine does not have."""

    n_indent: int = 0
    t_max_predict_ms: float = 0.0  # checked at newlines, from the first text on (llama.cpp: its first token)

    def end(self, text: str, piece: str, elapsed_s: float) -> int | None:
        """Where `piece`, coming after `text`, ends the completion; None if it does not."""
        ends = []
        if (cut := indent_end(text + piece, self.n_indent)) is not None:
            ends.append(max(0, cut - len(text)))
        if 0 < self.t_max_predict_ms < elapsed_s * 1000 and (newline := piece.find("\n")) >= 0:
            ends.append(newline + 1)  # the newline is kept, as llama.cpp keeps its token
        return min(ends, default=None)


class Outcome(msgspec.Struct):
    text: str
    reason: str  # the engine's finish reason, or "limit": ended by the budget
    timings: Timings
    candidates: tuple[str, ...]
    max_tokens: int  # what the request could generate (n_predict as served)
    truncated: bool  # the prompt window began after the document's start


def temperature_of(value: float | None) -> float:
    """Absent or not above 0: greedy (llama.cpp's too); at most the protocol's bound."""
    return min(value, MAX_TEMPERATURE) if value is not None and value > 0 else 0.0


def seed_of(value: int | None) -> int | None:
    """Negative (llama.cpp's -1): unseeded. Tabby sends any u64; torch takes below 2**63 here."""
    return None if value is None or value < 0 else value % 2**63


def document_chars(document: Document, context: Iterable[ContextItem], stop: Iterable[str]) -> int:
    """What server.max_document_chars bounds, counted as a session counts it."""
    return len(document.prefix) + len(document.suffix) + sum(len(c.uri) + len(c.text) for c in context) \
        + sum(map(len, stop))


class CompatEngine:
    """The compatible routes' way into the pipeline and the engine."""

    def __init__(self, app: "App"):
        self.app = app
        self.documents: OrderedDict[tuple[str, bool], DocumentPrompt] = OrderedDict()  # least recent first
        self.inflight: set[str] = set()  # engine ids
        self.count = 0
        self.started = int(time.time())  # /v1/models' `created`

    @property
    def body_limit(self) -> int:
        """A request body is the HTTP side's frame: server.max_frame_bytes bounds both."""
        return self.app.config.server.max_frame_bytes

    @property
    def body_timeout_s(self) -> float:
        return self.app.config.compat.body_timeout_s

    @property
    def model_name(self) -> str:
        return self.app.target.name

    def client_of(self, request, slot: object) -> str:
        """Who sent `request`, for its document state, its cache salt and a
        cluster's affinity: its address and `slot`; under
        server.prefix_cache_scope = "connection", its TCP connection instead
        (every local process is 127.0.0.1 and llama.vim sends no id_slot, so
        the address would let one process read another's cache in cache_n)."""
        if self.app.config.server.prefix_cache_scope == "connection":
            conn = request.app[CONNECTIONS].of(request)
            return f"connection {conn.serial if conn is not None else id(request)}/{slot}"
        return f"{request.remote}/{slot}"

    def check_ready(self) -> None:
        if self.app.engine is None:
            raise HttpError(503, "Loading model")  # llama.cpp's words: clients wait on them
        if self.app.stopping:
            raise HttpError(503, "the server is shutting down")

    def prepare(self, client: str, document: Document, context: list[ContextItem], options: RequestOptions,
                received: float) -> tuple[Request, bool]:
        """The engine request and whether the window left out the document's
        start; raises HttpError (503 loading, 429, 413) before any work."""
        app = self.app
        self.check_ready()
        if len(self.inflight) >= app.config.compat.max_inflight:
            raise HttpError(429, f"{len(self.inflight)} requests in flight on these routes "
                                 f"(compat.max_inflight); retry when one ends")
        limit = app.config.server.max_document_chars
        if (size := document_chars(document, context, options.stop)) > limit:
            raise HttpError(413, f"prefix, suffix, extra context and stop strings hold {size} characters; "
                                 f"the limit is {limit} (server.max_document_chars)")
        if app.config.server.prefix_cache_scope == "connection":
            options = msgspec.structs.replace(options, cache_salt=client)
        key = (client, options.priming)
        # llama.cpp's placement: input_extra chunks in the order sent (llama.vim primes them so, with
        # an empty prefix, and expects the next keystroke to find them cached), not retrieved.
        state = self.documents.pop(key, None) or app.pipeline.document(retrieval=False)
        self.documents[key] = state
        while len(self.documents) > app.config.server.max_documents_per_connection:
            self.documents.popitem(last=False)
        self.count += 1
        try:
            request = app.pipeline.request(f"http{self.count}", document, context, options, state, received)
        except Exception as e:  # never let one request take the server down
            raise HttpError(500, f"{type(e).__name__}: {e}") from None
        return request, state.prefix_start > 0

    async def run(self, route: str, request: Request, budget: Budget, received: float, truncated: bool,
                  on_piece: Callable[[str], Awaitable[None]] | None = None, client: str = "") -> Outcome:
        """Submit and follow one request to its end; `on_piece` takes the text
        as it comes. Raises HttpError for what the engine refused. If the
        caller is cancelled (its client disconnected) or `on_piece` fails (a
        write to a closed socket), the engine request is cancelled at once.
        `client`: who sent it (a cluster keeps its requests on one replica)."""
        app = self.app
        stream = app.engine.submit(request, affinity=client)
        self.inflight.add(request.id)
        text, cut, started = "", False, None
        try:
            async for delta in stream:
                now = time.perf_counter()
                started = started or now
                piece = delta.text
                if (end := budget.end(text, piece, now - started)) is not None:
                    piece, cut = piece[:end], True
                text += piece
                if piece and on_piece is not None:
                    await on_piece(piece)
                if cut:
                    app.engine.cancel(request.id)
                    break
            done = await stream.finished()
        except EngineError as e:
            raise HttpError(STATUS_OF.get(e.code, 500), str(e)) from None
        finally:
            self.inflight.discard(request.id)
            if stream.result is None:  # the client left: the blocks return now, not at its deadline
                app.engine.cancel(request.id)
        if done.reason == "cancelled" and not cut:  # not ours: the server's shutdown
            raise HttpError(503, "the server is shutting down")
        reason = "limit" if cut else done.reason
        candidates = tuple(c[:indent_end(c, budget.n_indent)] for c in done.candidates)
        app.metrics.observe_done(done.timings, reason, received, priming=request.params.priming,
                                 route=route)
        return Outcome(text if cut else done.text, reason, done.timings, candidates, request.params.max_tokens,
                       truncated)

    def cancel_all(self) -> None:
        """Shutdown: every request in flight ends now (its client gets 503)."""
        for request_id in self.inflight:
            self.app.engine.cancel(request_id)
