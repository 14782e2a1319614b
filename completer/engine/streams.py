"""What the engine hands the event loop: each request's stream of deltas,
the supersede bookkeeping of editor sessions, and the engine's published
snapshot (`EngineLive`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from completer.engine.request import Delta, EngineError, Failed, Finished


def as_delivered(events: list) -> list:
    """(request id, event) as streams take them; a request's `Failed` is its error."""
    return [(e.id, EngineError(e.code, e.message) if isinstance(e, Failed) else e) for e in events]


class EngineLive(msgspec.Struct, frozen=True):
    """What an engine holds (the server's gauges, a replica's routing stats),
    as its thread published it at the end of its last turn."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_blocks_used: dict[str, int] = {}  # pool ("target", "draft") -> blocks referenced
    prefill_workers_up: int = 0  # a KV connector's prefill workers connected now


class RequestStream:
    """Deltas of one request as they are accepted, then its `Finished`."""

    def __init__(self, request_id: str):
        self.id = request_id
        self.queue: asyncio.Queue[Delta | Finished | EngineError] = asyncio.Queue()
        self.result: Finished | None = None

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[Delta]:
        while self.result is None:
            event = await self.queue.get()
            if isinstance(event, EngineError):
                raise event
            if isinstance(event, Finished):
                self.result = event
                return
            yield event

    async def finished(self) -> Finished:
        """Drain the stream; the final event."""
        async for _ in self:
            pass
        assert self.result is not None
        return self.result


class Superseding:
    """Requests in flight under each supersede key (a session and document):
    a newer keystroke's request ends the ones before it."""

    def __init__(self) -> None:
        self._under: dict[str, set[str]] = {}
        self._key_of: dict[str, str] = {}  # request id -> its key

    def add(self, key: str, request_id: str, ends_others: bool) -> list[str]:
        """Record a request under `key`; the ones it ends (all before it, unless `ends_others` is False)."""
        in_flight = self._under.setdefault(key, set())
        ended = sorted(in_flight) if ends_others else []
        if ends_others:
            in_flight.clear()
        in_flight.add(request_id)
        self._key_of[request_id] = key
        return ended

    def ended(self, request_id: str) -> None:
        key = self._key_of.pop(request_id, None)
        if key is not None and (in_flight := self._under.get(key)) is not None:
            in_flight.discard(request_id)
            if not in_flight:
                del self._under[key]
