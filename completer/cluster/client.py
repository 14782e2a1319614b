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

Whatever a replica does, this side keeps each request's time: at its
deadline a request a replica holds ends `deadline` with the text so far (a
healthy replica's own answer comes first: its engine ends it on time, and
this waits DEADLINE_SLACK_S more), and a cancel or a superseding keystroke
ends it `cancelled` at once; the cancel still goes to the replica, best
effort. The replica's stream is read on after that end, for its word alone:
a replica that holds a request past its end (deadline or cancel) and sends
nothing for STALLED_AFTER_S is marked stalled (routing.HEALTH), and the
router sends new requests elsewhere until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time

import msgspec

from completer.cluster.routing import HEALTH, Hop, prefix_hash
from completer.config import ClusterConfig
from completer.engine.streams import RequestStream, Superseding
from completer.engine.request import Delta, EngineError, Failed, Finished, Request, Timings

log = logging.getLogger(__name__)
RETRIES = 2  # replicas lost before answering, tried again elsewhere
DEADLINE_SLACK_S = 0.2  # past a request's deadline, the time its replica's own `deadline` answer has to come
STALLED_AFTER_S = 1.0  # a replica silent this long while it holds a request past its end is stalled


class Call:
    """One request in flight through the cluster."""

    def __init__(self, request: Request, stream: RequestStream):
        self.request = request
        self.stream = stream
        self.response = None  # the DeploymentResponseGenerator, once sent
        self.cancelled = False
        self.answered = False  # the replica sent something
        self.ended_at: float | None = None  # when its end went to the stream (perf_counter)
        self.reading = True  # the replica's stream is still read
        self.text: list[str] = []
        self.first_at: float | None = None  # its first delta (perf_counter)
        self.task: asyncio.Task | None = None
        self.timer: asyncio.TimerHandle | None = None

    @property
    def ended(self) -> bool:
        return self.ended_at is not None


class ClusterEngine:
    def __init__(self, handle, config: ClusterConfig):
        self.handle = handle.options(stream=True)
        self.config = config
        self.door = secrets.token_hex(4)  # this front door's name among those sharing the replicas
        self.calls: dict[str, Call] = {}
        self.heard: dict[str, float] = {}  # replica -> when it last sent anything (perf_counter)
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
        deadline_s = request.params.deadline_s
        if deadline_s is not None:
            due = request.arrival + deadline_s + DEADLINE_SLACK_S
            call.timer = asyncio.get_running_loop().call_later(max(0.0, due - time.perf_counter()),
                                                               self._expire, call)
        call.task = asyncio.create_task(self._run(call, supersede, ends_others, affinity))
        return stream

    def cancel(self, request_id: str) -> None:
        """Ends the request `cancelled` now, whatever its replica does; the
        replica is told (best effort)."""
        call = self.calls.get(request_id)
        if call is None or call.cancelled:
            return
        call.cancelled = True
        if call.response is not None:
            call.response.cancel()
        self._finish(call, Finished(call.request.id, "cancelled", "".join(call.text), self._timings(call)))

    def cancel_all(self) -> None:
        for request_id in list(self.calls):
            self.cancel(request_id)

    def stop(self) -> None:
        self.cancel_all()

    # -- one call ---------------------------------------------------------------

    def _hop_id(self, call: Call) -> str:
        return f"{self.door}/{call.request.id}"

    def _hop(self, call: Call, supersede: str | None, ends_others: bool, affinity: str) -> Hop:
        r = call.request
        salt = f"{self.door}/{r.cache_salt}" if r.cache_salt else ""
        key = f"{self.door}/{supersede}" if supersede is not None else None
        route = key or (f"{self.door}/{affinity}" if affinity else "")
        return Hop(msgspec.structs.replace(r, id=self._hop_id(call), cache_salt=salt),
                   route_key=route, prefix_hash=prefix_hash(r.prompt, salt), supersede=key,
                   ends_others=ends_others, age_s=time.perf_counter() - r.arrival)

    def _replica(self, call: Call) -> str | None:
        """The replica the router sent it to (None: not routed yet, or not by our router)."""
        return HEALTH.placement(self._hop_id(call))

    async def _run(self, call: Call, supersede: str | None, ends_others: bool, affinity: str) -> None:
        from ray.exceptions import RayActorError, TaskCancelledError
        from ray.serve.exceptions import RequestCancelledError

        deadline_s = call.request.params.deadline_s
        give_up = call.request.arrival + (deadline_s if deadline_s is not None else math.inf) \
            + self.config.answer_grace_s
        tries = 0
        try:
            while True:
                if call.ended:  # cancelled (or superseded) before it was sent
                    return
                try:
                    hop = self._hop(call, supersede, ends_others, affinity)
                    call.response = self.handle.generate.remote(hop)
                    events = call.response.__aiter__()
                    while True:  # no time limit here: the timers (_expire) keep the request's time
                        try:
                            event = await events.__anext__()
                        except StopAsyncIteration:
                            self._heard(call)
                            raise EngineError("internal", "the engine replica ended the stream early") from None
                        call.answered = True
                        self._heard(call)
                        if self._deliver(call, event):
                            return
                except RayActorError:
                    self._lost(call)
                    if not call.answered and not call.ended and tries < RETRIES \
                            and time.perf_counter() < give_up:
                        tries += 1
                        log.warning("cluster: request %s lost its replica before an answer; retrying", call.request.id)
                        continue
                    raise EngineError("internal", "the engine replica serving this request was lost; "
                                                  "the next request goes to another") from None
        except (RequestCancelledError, TaskCancelledError):
            self._heard(call)
            self._finish(call, Finished(call.request.id, "cancelled", "".join(call.text), self._timings(call)))
        except EngineError as e:
            self._fail(call, e)
        except asyncio.CancelledError:
            if call.response is not None:
                call.response.cancel()
            if asyncio.current_task().cancelling():  # this task was cancelled
                raise
            # else the call's: cancelled before a replica took it (ended here already, as a rule)
            self._finish(call, Finished(call.request.id, "cancelled", "".join(call.text), self._timings(call)))
        except Exception as e:  # the link to Ray: a clear error, the front door goes on
            if not call.ended:
                log.exception("cluster: request %s failed", call.request.id)
            self._fail(call, EngineError("internal", f"the cluster could not serve it ({type(e).__name__}: {e})"))
        finally:
            call.reading = False
            HEALTH.unplace(self._hop_id(call))

    def _deliver(self, call: Call, event) -> bool:
        """Pass one replica event on; True once the request has ended. After the
        request has ended here, the replica's events are its word alone."""
        if isinstance(event, Delta):
            if not call.ended:
                if call.first_at is None:
                    call.first_at = time.perf_counter()
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

    # -- time kept here, and the replicas' silence ---------------------------------

    def _expire(self, call: Call) -> None:
        """The request's deadline (and the slack) passed: it ends `deadline` with
        the text so far, as its replica's engine would have ended it. One no
        replica has taken yet is left to routing until `answer_grace_s` past it."""
        call.timer = None
        if call.ended:
            return
        if not call.answered and self._replica(call) is None:
            wait_s = self.config.answer_grace_s - DEADLINE_SLACK_S
            call.timer = asyncio.get_running_loop().call_later(max(0.0, wait_s), self._give_up, call)
            return
        if call.response is not None:
            call.response.cancel()
        self._finish(call, Finished(call.request.id, "deadline", "".join(call.text), self._timings(call)))

    def _give_up(self, call: Call) -> None:
        """`answer_grace_s` past its deadline and no replica answered: none is up, or all are full."""
        call.timer = None
        if call.ended:
            return
        if call.response is not None:
            call.response.cancel()
        self._fail(call, EngineError("overloaded", "no engine replica answered before the request's "
                                                   "deadline (are any up?)"))

    def _heard(self, call: Call) -> None:
        replica = self._replica(call)
        if replica is None:
            return
        self.heard[replica] = time.perf_counter()
        if HEALTH.answered(replica):
            log.warning("cluster: replica %s answers again; it is routed to again", replica)

    def _lost(self, call: Call) -> None:
        replica = self._replica(call)
        if replica is not None:
            HEALTH.answered(replica)  # gone: Serve replaces it, the router forgets it
            self.heard.pop(replica, None)

    def _watch(self, call: Call) -> None:
        """While the replica's stream of an ended request stays open: a replica
        that sent nothing for STALLED_AFTER_S since then is stalled."""
        if not call.reading:
            return
        replica = self._replica(call)
        if replica is not None:
            silent_s = time.perf_counter() - max(self.heard.get(replica, -math.inf), call.ended_at)
            if silent_s >= STALLED_AFTER_S and HEALTH.stall(replica):
                log.warning("cluster: replica %s holds request %s past its end and has sent nothing for "
                            "%.1f s; new requests go to other replicas until it answers", replica,
                            call.request.id, silent_s)
        asyncio.get_running_loop().call_later(STALLED_AFTER_S / 2, self._watch, call)

    def _timings(self, call: Call) -> Timings:
        """For an end made here: what this side saw (the engine's own figures stay on the replica)."""
        now, arrival = time.perf_counter(), call.request.arrival
        return Timings(ttft_ms=((call.first_at or now) - arrival) * 1000, total_ms=(now - arrival) * 1000,
                       prompt_tokens=len(call.request.prompt))

    def _finish(self, call: Call, done: Finished) -> None:
        self._end(call, done)

    def _fail(self, call: Call, error: EngineError) -> None:
        self._end(call, error)

    def _end(self, call: Call, last: Finished | EngineError) -> None:
        """The request's one end; later ones (the replica's, after this side ended it) are dropped."""
        if call.ended:
            return
        call.ended_at = time.perf_counter()
        call.stream.queue.put_nowait(last)
        if call.timer is not None:
            call.timer.cancel()
            call.timer = None
        request_id = call.request.id
        if self.calls.get(request_id) is call:
            del self.calls[request_id]
        self._superseding.ended(request_id)
        if call.reading and call.task is not None and asyncio.current_task() is not call.task:
            asyncio.get_running_loop().call_later(STALLED_AFTER_S / 2, self._watch, call)
