"""The link process's engine (link.py): submit, cancel and stop as `Engine`
offers them, each request one streaming call through the Serve deployment
handle to the replica the router picks.

Ids and keys get this front door's name before they leave: several front
doors share the replicas, and each numbers its connections from 1. A cancel
(a `cancel` frame, a closed connection, a superseding keystroke) cancels the
call, and the replica cancels the request in its engine. A superseding
keystroke also carries its key to the replica, whose engine ends the older
request before it admits the new one, in the same step, when both landed
there. A replica lost before it answered is retried on another while the
deadline allows; one lost mid-stream ends its requests with an error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time

import msgspec

from completer.cluster.config import ClusterConfig
from completer.cluster.routing import Hop, prefix_hash
from completer.engine.streams import RequestStream, Superseding
from completer.engine.request import Delta, EngineError, Failed, Finished, Request, Timings

log = logging.getLogger(__name__)
RETRIES = 2  # replicas lost before answering, tried again elsewhere


class Call:
    """One request in flight through the cluster."""

    def __init__(self, request: Request, stream: RequestStream):
        self.request = request
        self.stream = stream
        self.response = None  # the DeploymentResponseGenerator, once sent
        self.cancelled = False
        self.text: list[str] = []
        self.task: asyncio.Task | None = None


class ClusterEngine:
    def __init__(self, handle, config: ClusterConfig):
        self.handle = handle.options(stream=True)
        self.config = config
        self.door = secrets.token_hex(4)  # this front door's name among those sharing the replicas
        self.calls: dict[str, Call] = {}
        self._superseding = Superseding()

    def submit(self, request: Request, supersede: str | None = None, ends_others: bool = True,
               affinity: str = "") -> RequestStream:
        """As Engine.submit; call from the event loop's thread. The route key is
        `supersede` (session and document), else `affinity` (a client of the
        compatible routes)."""
        stream = RequestStream(request.id)
        if supersede is not None:
            for old in self._superseding.add(supersede, request.id, ends_others):
                self.cancel(old)
        call = self.calls[request.id] = Call(request, stream)
        call.task = asyncio.create_task(self._run(call, supersede, ends_others, affinity))
        return stream

    def cancel(self, request_id: str) -> None:
        call = self.calls.get(request_id)
        if call is None or call.cancelled:
            return
        call.cancelled = True
        if call.response is not None:
            call.response.cancel()

    def cancel_all(self) -> None:
        for request_id in list(self.calls):
            self.cancel(request_id)

    def stop(self) -> None:
        self.cancel_all()

    # -- one call ---------------------------------------------------------------

    def _hop(self, call: Call, supersede: str | None, ends_others: bool, affinity: str) -> Hop:
        r = call.request
        salt = f"{self.door}/{r.cache_salt}" if r.cache_salt else ""
        key = f"{self.door}/{supersede}" if supersede is not None else None
        route = key or (f"{self.door}/{affinity}" if affinity else "")
        return Hop(msgspec.structs.replace(r, id=f"{self.door}/{r.id}", cache_salt=salt),
                   route_key=route, prefix_hash=prefix_hash(r.prompt, salt), supersede=key,
                   ends_others=ends_others, age_s=time.perf_counter() - r.arrival)

    async def _run(self, call: Call, supersede: str | None, ends_others: bool, affinity: str) -> None:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import RequestCancelledError

        deadline_s = call.request.params.deadline_s
        give_up = call.request.arrival + (deadline_s if deadline_s is not None else math.inf) \
            + self.config.answer_grace_s
        tries = 0
        try:
            while True:
                answered = False
                try:
                    hop = self._hop(call, supersede, ends_others, affinity)
                    call.response = self.handle.generate.remote(hop)
                    if call.cancelled:
                        call.response.cancel()
                    events = call.response.__aiter__()
                    while True:
                        wait = None if answered else max(0.0, give_up - time.perf_counter())
                        try:
                            event = await asyncio.wait_for(events.__anext__(), wait)
                        except StopAsyncIteration:
                            raise EngineError("internal", "the engine replica ended the stream early") from None
                        answered = True
                        if self._deliver(call, event):
                            return
                except RayActorError:
                    if not answered and not call.cancelled and tries < RETRIES and time.perf_counter() < give_up:
                        tries += 1
                        log.warning("cluster: request %s lost its replica before an answer; retrying", call.request.id)
                        continue
                    raise EngineError("internal", "the engine replica serving this request was lost; "
                                                  "the next request goes to another") from None
        except RequestCancelledError:
            self._finish(call, Finished(call.request.id, "cancelled", "".join(call.text), self._timings(call)))
        except TimeoutError:
            if call.response is not None:
                call.response.cancel()
            self._fail(call, EngineError("overloaded", "no engine replica answered before the request's "
                                                       "deadline (are any up?)"))
        except EngineError as e:
            self._fail(call, e)
        except asyncio.CancelledError:
            if call.response is not None:
                call.response.cancel()
            raise
        except Exception as e:  # the link to Ray: a clear error, the front door goes on
            log.exception("cluster: request %s failed", call.request.id)
            self._fail(call, EngineError("internal", f"the cluster could not serve it ({type(e).__name__}: {e})"))

    def _deliver(self, call: Call, event) -> bool:
        """Pass one replica event on; True once the request has ended."""
        if isinstance(event, Delta):
            call.text.append(event.text)
            call.stream.queue.put_nowait(Delta(call.request.id, event.text))
            return False
        if isinstance(event, Finished):
            self._finish(call, msgspec.structs.replace(event, id=call.request.id))
            return True
        if isinstance(event, Failed):
            self._fail(call, EngineError(event.code, event.message))
            return True
        raise EngineError("internal", f"unexpected event from the engine replica: {type(event).__name__}")

    def _timings(self, call: Call) -> Timings:
        total = (time.perf_counter() - call.request.arrival) * 1000
        return Timings(total_ms=total, prompt_tokens=len(call.request.prompt))

    def _finish(self, call: Call, done: Finished) -> None:
        call.stream.queue.put_nowait(done)
        self._forget(call)

    def _fail(self, call: Call, error: EngineError) -> None:
        call.stream.queue.put_nowait(error)
        self._forget(call)

    def _forget(self, call: Call) -> None:
        request_id = call.request.id
        if self.calls.get(request_id) is call:
            del self.calls[request_id]
        self._superseding.ended(request_id)
