"""One editor connection: its documents' prompt state, its requests in flight,
and the protocol's message handling. A bad frame gets an `error` and the
connection goes on; nothing one session does reaches another."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import msgspec
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from completer import __version__
from completer.document import DocumentPrompt
from completer.engine.core import EngineError, request_for
from completer.engine.sequence import SamplingParams, Timings
from completer.prompt import Snippet
from completer.protocol import (PROTOCOL_VERSION, Cancel, Complete, Delta, Done, Error, Feedback, Hello,
                                ModelNames, Ready, decode, encode)
from completer.server.metrics import Record

if TYPE_CHECKING:
    from completer.server.app import App


def display_path(uri: str) -> str:
    """`file:///home/me/app/models.py` -> `app/models.py` (the prompt's file header)."""
    path = unquote(urlsplit(uri).path) or uri
    return "/".join(path.rstrip("/").split("/")[-2:])


class Session:
    def __init__(self, app: "App", ws: ServerConnection, number: int):
        self.app = app
        self.ws = ws
        self.key = f"c{number}"
        self.documents: dict[str, DocumentPrompt] = {}
        self.inflight: dict[str, asyncio.Task] = {}
        self.inflight_uri: dict[str, str] = {}  # id -> document uri (supersede)
        # Cancels that may arrive before their request reaches the engine (both
        # frames read in one go, the request's task not yet run).
        self.cancelled: set[str] = set()
        self.shown: OrderedDict[str, int] = OrderedDict()  # id -> chars shown, for feedback

    def engine_id(self, request_id: str) -> str:
        return f"{self.key}/{request_id}"

    async def send(self, message) -> None:
        try:
            await asyncio.wait_for(self.ws.send(encode(message)), self.app.send_timeout_s)
        except (ConnectionClosed, asyncio.TimeoutError):
            # A reader too slow to take frames is dropped, not buffered for.
            await self.ws.close(1008, "client too slow") if not self.ws.close_code else None

    async def error(self, request_id: str | None, code: str, message: str) -> None:
        self.app.metrics.errors.labels(code).inc()
        await self.send(Error(request_id, code, message))

    async def run(self) -> None:
        try:
            async for frame in self.ws:
                if isinstance(frame, bytes):
                    await self.error(None, "bad_request", "binary frames are not supported; send text")
                    continue
                await self.handle(decode(frame), time.perf_counter())
        except ConnectionClosed:
            pass
        finally:
            for request_id in list(self.inflight):
                self.app.engine.cancel(self.engine_id(request_id))
            if self.inflight:
                await asyncio.gather(*self.inflight.values(), return_exceptions=True)

    async def handle(self, msg, received: float) -> None:
        if isinstance(msg, Error):
            await self.error(msg.id, msg.code, msg.message)
        elif isinstance(msg, Complete):
            await self.start(msg, received)
        elif isinstance(msg, Cancel):
            if msg.id in self.inflight:
                self.cancelled.add(msg.id)
                self.app.engine.cancel(self.engine_id(msg.id))
        elif isinstance(msg, Feedback):
            shown = self.shown.pop(msg.id, None)
            if shown is not None:
                self.app.metrics.observe_feedback(shown, max(0, min(msg.accepted_chars, shown)))
        elif isinstance(msg, Hello):
            if msg.protocol != PROTOCOL_VERSION:
                await self.error(None, "unsupported",
                                 f"protocol {msg.protocol} is not supported (this server speaks {PROTOCOL_VERSION})")
            else:
                app = self.app
                await self.send(Ready(PROTOCOL_VERSION, f"completer/{__version__}",
                                      ModelNames(app.target.name, app.draft.name if app.draft else None)))

    def invalid(self, msg: Complete) -> tuple[str, str] | None:
        limits = self.app.config.server
        size = len(msg.document.prefix) + len(msg.document.suffix) + sum(len(c.text) for c in msg.context)
        if size > limits.max_document_chars:
            return "too_large", f"document and context hold {size} characters; the limit is {limits.max_document_chars}"
        if msg.id in self.inflight:
            return "bad_request", f"id {msg.id!r} is already in flight on this connection"
        if msg.max_tokens is not None and msg.max_tokens < 1:
            return "bad_request", "max_tokens must be at least 1"
        if msg.temperature < 0:
            return "bad_request", "temperature must not be negative"
        if msg.deadline_ms is not None and msg.deadline_ms <= 0:
            return "bad_request", "deadline_ms must be positive"
        superseded = msg.document.uri in self.inflight_uri.values()
        if len(self.inflight) - superseded >= limits.max_inflight_per_connection:
            return "overloaded", f"{len(self.inflight)} requests in flight on this connection"
        return None

    async def start(self, msg: Complete, received: float) -> None:
        if (problem := self.invalid(msg)) is not None:
            await self.error(msg.id, *problem)
            return
        task = asyncio.create_task(self.complete(msg, received))
        self.inflight[msg.id] = task
        self.inflight_uri[msg.id] = msg.document.uri

        def forget(_: asyncio.Task) -> None:
            self.inflight.pop(msg.id, None)
            self.inflight_uri.pop(msg.id, None)
            self.cancelled.discard(msg.id)

        task.add_done_callback(forget)

    async def complete(self, msg: Complete, received: float) -> None:
        app, doc = self.app, msg.document
        engine_cfg = app.config.engine
        state = self.documents.get(doc.uri)
        if state is None:
            state = self.documents[doc.uri] = DocumentPrompt(app.prompt_builder())
        snippets = [Snippet(display_path(c.uri), c.text) for c in msg.context]
        prompt = state.update(doc.prefix, doc.suffix, display_path(doc.uri), snippets)
        deadline_ms = msg.deadline_ms if msg.deadline_ms is not None else engine_cfg.deadline_ms
        params = SamplingParams(
            max_tokens=msg.max_tokens or engine_cfg.max_tokens, temperature=msg.temperature,
            mode=msg.mode, stop=tuple(msg.stop),
            deadline_s=max(0.0, deadline_ms / 1000 - (time.perf_counter() - received)))
        request = request_for(self.engine_id(msg.id), prompt, doc.prefix, doc.suffix, params,
                              app.engine.core.healer, state.builder.template.order)
        if msg.id in self.cancelled:  # cancelled before it got here
            await self.send(Done(msg.id, "cancelled", "", Timings(prompt_tokens=len(request.prompt))))
            return
        stream = app.engine.submit(request, supersede=f"{self.key}/{doc.uri}")
        first_delta = None
        try:
            async for delta in stream:
                if first_delta is None:
                    first_delta = time.perf_counter()
                await self.send(Delta(msg.id, delta.text))
        except EngineError as e:
            await self.error(msg.id, e.code, str(e))
            return
        except Exception as e:  # never let one request take the connection down
            app.engine.cancel(request.id)
            await self.error(msg.id, "internal", f"{type(e).__name__}: {e}")
            return
        done = stream.result
        now = time.perf_counter()
        ttft = (first_delta or now) - received
        t = msgspec.structs.replace(done.timings, ttft_ms=ttft * 1000, total_ms=(now - received) * 1000)
        # Remember before sending: the client may answer `done` with feedback at once.
        self.remember_shown(msg.id, len(done.text))
        await self.send(Done(msg.id, done.reason, done.text, t))
        engine_ttft = done.timings.ttft_ms / 1000
        decode_s = max(0.0, (now - received) - ttft)
        app.metrics.observe(Record(
            at=time.time(), ttft=ttft, e2e=now - received,
            itl=decode_s / (t.generated_tokens - 1) if t.generated_tokens > 1 else None,
            queue=t.queue_ms / 1000, prefill=max(0.0, engine_ttft - t.queue_ms / 1000), decode=decode_s,
            prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens, generated=t.generated_tokens,
            proposed=t.draft_proposed, accepted=t.draft_accepted), done.reason, t.prefill)

    def remember_shown(self, request_id: str, chars: int) -> None:
        self.shown[request_id] = chars
        while len(self.shown) > 1024:
            self.shown.popitem(last=False)
