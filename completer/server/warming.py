"""One client's warming: once a request on a document has ended and the
client sent nothing more for that document within `server.warm_after_ms`
(and twice its usual gap between keystrokes there), and the engine has
nothing running or waiting, the windows its next jump may take (`completer.warming.warm_heads`) go to
the engine as `warm` requests: prefilled only while no other work waits,
a layer at a time, preempted by any keystroke (engine/scheduler.py). A newer
set for the document replaces the one in flight; their K/V is the prefix
cache's, never pinned, so the pool's LRU bounds it across documents and
connections. `server.warm_windows` = 0 turns it off."""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import Hashable
from typing import Protocol

from completer.config import Config
from completer.document import DocumentPrompt
from completer.engine.request import EngineError, Request, SamplingParams
from completer.server.metrics import Metrics
from completer.warming import warm_heads


class Service(Protocol):
    """What warming reads of the completion service (server/service.py)."""

    config: Config
    metrics: Metrics
    engine: object  # its `submit` and `cancel`; None while loading
    stopping: bool

log = logging.getLogger(__name__)
TYPING_GAP_S = 1.0  # gaps between a document's requests longer than this are pauses, not its typing rhythm
WARM_DEADLINE_S = 60.0  # a warm set still waiting this long is stale: the user has moved on
_serial = itertools.count(1)


class Warmer:
    def __init__(self, service: Service, key: str):
        self.service, self.key = service, key
        self.pending: dict[Hashable, asyncio.TimerHandle | asyncio.Task] = {}  # document -> its plan to come
        self.sent: dict[Hashable, list[str]] = {}  # document -> its warm requests in flight
        self.tasks: set[asyncio.Task] = set()  # (held: the loop keeps only weak references to tasks)
        self.closed = False
        # document -> (when its last request came, the average gap between its requests under TYPING_GAP_S)
        self.rhythm: dict[Hashable, tuple[float | None, float]] = {}

    @property
    def windows(self) -> int:
        return self.service.config.server.warm_windows

    def touched(self, document: Hashable) -> None:
        """A request for `document` starts: a plan not yet sent is called off
        (the request's end makes a new one, for the document as it then is),
        and the client's rhythm on it is noted."""
        self._call_off(document)
        now = time.monotonic()
        last, rhythm = self.rhythm.get(document, (None, 0.0))
        if last is not None and (gap := now - last) < TYPING_GAP_S:
            rhythm = gap if rhythm == 0.0 else 0.3 * gap + 0.7 * rhythm
        self.rhythm[document] = (now, rhythm)
        while len(self.rhythm) > 64:
            del self.rhythm[next(iter(self.rhythm))]

    def _call_off(self, document: Hashable) -> None:
        if (plan := self.pending.pop(document, None)) is not None:
            plan.cancel()

    def ended(self, document: Hashable, state: DocumentPrompt, text: tuple[str, str], salt: str) -> None:
        """A request for `document` ended: warm its next windows once the
        client pauses, for `server.warm_after_ms` and twice its usual gap
        between requests on the document (typing is not a pause)."""
        if self.windows <= 0 or self.closed or self.service.engine is None or self.service.stopping \
                or not self.service.config.engine.prefix_cache:
            return
        self._call_off(document)
        delay = max(self.service.config.server.warm_after_ms / 1000, 2 * self.rhythm.get(document, (0, 0.0))[1])
        self._arm(document, (state, text), salt, delay)

    def _arm(self, document: Hashable, state: tuple[DocumentPrompt, tuple[str, str]], salt: str,
             delay: float) -> None:
        """`state`: the document's prompt state and the text its last request had (held only till planned)."""
        self.pending[document] = asyncio.get_running_loop().call_later(
            delay, lambda: self._plan(document, state, salt))

    def _plan(self, document: Hashable, state: tuple[DocumentPrompt, tuple[str, str]], salt: str) -> None:
        live = getattr(self.service.engine, "live", None)
        if live is not None and ((now := live()).running or now.waiting):
            # Busy: warming is for an idle engine (planning it costs the busy one too); ask again later.
            self._arm(document, state, salt, max(0.05, self.service.config.server.warm_after_ms / 1000))
            return
        self.pending[document] = task = asyncio.create_task(self._send(document, state, salt))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _send(self, document: Hashable, state: tuple[DocumentPrompt, tuple[str, str]], salt: str) -> None:
        # Tokenizing a few windows takes ~5 ms each: off the event loop, which keeps answering keystrokes;
        # the thread reads a copy of the state as it is now (an update replaces its lists, never edits them).
        prompt, (prefix, suffix) = state
        try:
            heads = await asyncio.to_thread(warm_heads, copy.copy(prompt), self.windows, prefix, suffix)
        except Exception:  # (warming is optional: a bug in it must not go unheard, nor take anything down)
            log.exception("warming: planning the windows of %s failed", document)
            return
        if self.pending.get(document) is not asyncio.current_task():
            return  # a request for the document came meanwhile
        del self.pending[document]
        engine, supersede = self.service.engine, f"{self.key}/{document}#warm"
        streams = []
        for i, head in enumerate(heads):
            request = Request(f"warm{next(_serial)}", head, SamplingParams(max_tokens=0, deadline_s=WARM_DEADLINE_S),
                              cache_salt=salt, warm=True)
            streams.append(engine.submit(request, supersede=supersede, ends_others=i == 0, affinity=self.key))
        self.sent[document] = [s.id for s in streams]
        for stream in streams:
            try:
                done = await stream.finished()
            except EngineError:  # (refused: the queue full, the server stopping) warming is optional
                continue
            self.service.metrics.observe_warm(done.reason, done.timings.prompt_tokens, done.timings.cached_tokens)
        if self.sent.get(document) == [s.id for s in streams]:
            del self.sent[document]

    def close(self) -> None:
        """The client is gone: nothing more is warmed for it, nothing in flight goes on."""
        self.closed = True
        for plan in [*self.pending.values(), *self.tasks]:
            plan.cancel()
        self.pending.clear()
        for ids in self.sent.values():
            for request_id in ids:
                self.service.engine.cancel(request_id)
        self.sent.clear()
