"""One compatible request through the completion service
(server/service.py), as a WebSocket `complete` goes: the same admission,
the prompt built by `CompletionPipeline` (template, window, token healing)
from a per-client document state, the engine's stop logic and prefix
cache, the server's limits and metrics. Here: the service's refusals and
the engine's errors as HTTP statuses, and what llama.cpp's clients expect
that the protocol does not.

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
from collections.abc import Awaitable, Callable

import msgspec

from completer.engine.request import EngineError, Timings
from completer.protocol import MAX_TEMPERATURE, ContextItem, Document
from completer.server.compat.wire import CONNECTIONS, HttpError
from completer.server.service import CompletionService, Flight, Refused, RequestOptions, request_chars

# The engine's error codes (the protocol's) as HTTP statuses.
STATUS_OF = {"bad_request": 400, "too_large": 413, "overloaded": 503, "internal": 500, "unsupported": 501}
# The service's refusals as HTTP statuses and messages.
REFUSALS = {
    "too_large": (413, "prefix, suffix, extra context and stop strings hold {count} characters; "
                       "the limit is {limit} (server.max_document_chars)"),
    "duplicate": (400, "request {id} is already in flight"),
    "loading": (503, "Loading model"),  # llama.cpp's words: clients wait on them
    "stopping": (503, "the server is shutting down"),
    "busy": (429, "{count} requests in flight on these routes (compat.max_inflight); retry when one ends"),
}


def http_error(refused: Refused, request_id: str = "") -> HttpError:
    return HttpError(*refused.words(REFUSALS, request_id))


def engine_http_error(e: EngineError) -> HttpError:
    return HttpError(STATUS_OF.get(e.code, 500), str(e))


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


class CompatEngine:
    """The compatible routes' adapter to the completion service: one client
    of it for all their HTTP clients (one document state, kept per sender,
    and one in-flight limit, compat.max_inflight), each sender with its own
    cache salt and affinity."""

    def __init__(self, service: CompletionService):
        self.service, self.config = service, service.config
        self.door = service.client("compat", limit=service.config.compat.max_inflight)
        self.count = 0
        self.started = int(time.time())  # /v1/models' `created`

    @property
    def body_limit(self) -> int:
        """A request body is the HTTP side's frame: server.max_frame_bytes bounds both."""
        return self.config.server.max_frame_bytes

    @property
    def body_timeout_s(self) -> float:
        return self.config.compat.body_timeout_s

    @property
    def model_name(self) -> str:
        return self.service.target.name

    def client_of(self, request, slot: object) -> str:
        """Who sent `request`, for its document state, its cache salt and a
        cluster's affinity: its address and `slot`; under
        server.prefix_cache_scope = "connection", its TCP connection instead
        (every local process is 127.0.0.1 and llama.vim sends no id_slot, so
        the address would let one process read another's cache in cache_n)."""
        if self.config.server.prefix_cache_scope == "connection":
            conn = request.app[CONNECTIONS].of(request)
            return f"connection {conn.serial if conn is not None else id(request)}/{slot}"
        return f"{request.remote}/{slot}"

    def check_ready(self) -> None:
        try:
            self.service.check_open()
        except Refused as r:
            raise http_error(r) from None

    def start(self, route: str, client: str, document: Document, context: list[ContextItem],
              options: RequestOptions, received: float) -> tuple[Flight, bool]:
        """Submit the request from `client` (client_of); the flight and whether
        the window left out the document's start. Raises HttpError (413, 503
        loading, 429) before any work, 500 if the request could not be built."""
        sender, request_id = self.door.sender(client), f"http{self.count + 1}"
        try:
            sender.admit(request_id, request_chars(document, context, options.stop))
        except Refused as r:
            raise http_error(r, request_id) from None
        # llama.cpp's placement: input_extra chunks in the order sent (llama.vim primes them so, with
        # an empty prefix, and expects the next keystroke to find them cached), not retrieved.
        state, _ = sender.document((client, options.priming), retrieval=False)
        self.count += 1
        try:
            flight = sender.submit(request_id, document, context, options, state, received, route=route,
                                   warm=None if options.priming else client)
        except EngineError as e:
            raise engine_http_error(e) from None
        return flight, state.prefix_start > 0

    async def run(self, flight: Flight, budget: Budget, truncated: bool,
                  on_piece: Callable[[str], Awaitable[None]] | None = None) -> Outcome:
        """Follow one request to its end; `on_piece` takes the text as it
        comes. Raises HttpError for what the engine refused. If the caller
        is cancelled (its client disconnected) or `on_piece` fails (a write
        to a closed socket), the engine request is cancelled at once."""
        text, cut, started = "", False, None

        async def take(piece: str) -> bool:
            nonlocal text, cut, started
            now = time.perf_counter()
            started = started or now
            if (end := budget.end(text, piece, now - started)) is not None:
                piece, cut = piece[:end], True
            text += piece
            if piece and on_piece is not None:
                await on_piece(piece)
            return cut

        try:
            done = await self.door.follow(flight, take)
        except EngineError as e:
            raise engine_http_error(e) from None
        if done.reason == "cancelled" and not cut:  # not ours: the server's shutdown
            raise http_error(Refused("stopping"))
        reason = "limit" if cut else done.reason
        candidates = tuple(c[:indent_end(c, budget.n_indent)] for c in done.candidates)
        self.service.observe(flight, done, reason)
        return Outcome(text if cut else done.text, reason, done.timings, candidates,
                       flight.request.params.max_tokens, truncated)

    def cancel_all(self) -> None:
        """Shutdown: every request in flight ends now (its client gets 503)."""
        self.door.cancel_all()
