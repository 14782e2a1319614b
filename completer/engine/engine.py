"""The engine's async face: submit a request, iterate its deltas, get the final
result; cancel by id. The loop itself runs on one thread (torch releases the
GIL in its kernels, so the asyncio event loop stays responsive) and hands its
events back with `call_soon_threadsafe`."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from completer.config import EngineConfig, SpecConfig
from completer.engine import calibration
from completer.engine.core import EngineCore
from completer.engine.kv_connector import KVConnector
from completer.engine.request import EngineError, Finished, Request
from completer.engine.streams import EngineLive, RequestStream, Superseding, as_delivered
from completer.loading import LoadedModel

T = TypeVar("T")
TRIM_AFTER_IDLE_S = 0.5  # idle this long: what the burst of work freed goes back to the system
TRANSFER_POLL_S = 0.02  # while only workers' K/V are awaited: how often deadlines are checked
log = logging.getLogger(__name__)
# glibc keeps what a burst of work freed (a 2 MB document's tokens, a long
# prefill's activations) as its high-water mark: RSS rose 829 -> 939 MB over
# four rounds of 2 MB documents, and malloc_trim(0) gave it back (835 MB).
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)


def run_in_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread that ends with it. Torch work off the engine
    thread (loading models, a benchmark's baseline) goes through here: a thread
    that ran a parallel torch op keeps its OpenMP team until it exits, and once
    teams hold more threads than there are cores, libgomp stops spin-waiting in
    every team, the engine's included. Measured on 2 cores: a parallel region
    costs 5 us with one team, 48 us while a second one lives."""
    result: list = []

    def target() -> None:
        try:
            result.append((True, fn(*args)))
        except BaseException as e:
            result.append((False, e))

    thread = threading.Thread(target=target, name="completer-passing")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value


class Engine:
    def __init__(self, core: EngineCore):
        self.core = core
        self._inbox: list[tuple[str, object]] = []
        self._cond = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._superseding = Superseding()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._cancels = 0  # cancels in the inbox (read without the lock: a stale count costs a layer)
        self._sent = threading.Event()  # set by the loop once it has written what a pass produced
        self._live = EngineLive()

    @classmethod
    def build(cls, target: LoadedModel, draft: LoadedModel | None, config: EngineConfig = EngineConfig(),
              spec: SpecConfig = SpecConfig(), connector: KVConnector | None = None) -> "Engine":
        """connector: where K/V may be computed elsewhere (`kv_connector`), if anywhere."""
        stop_ids = target.prompt_builder(1).stop_ids
        engine = cls(EngineCore.build(target.model, draft.model if draft else None, target.tokenizer,
                                      stop_ids, config, spec, connector=connector))
        if connector is not None:
            connector.wake = engine._wake
        return engine

    def _wake(self) -> None:
        """From the connector's thread: a job closed. An op in the inbox, not a
        bare notify: with no request left (all ended at their deadlines, their
        blocks handed to the jobs) the loop waits for the inbox alone, and the
        blocks would stay held until some unrelated request arrived."""
        with self._cond:
            if ("jobs", None) not in self._inbox:  # one poll takes in every job closed meanwhile
                self._inbox.append(("jobs", None))
            self._cond.notify()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the loop's thread; returns once it has calibrated speculation's
        pass costs (seconds), so no request is timed against that. All of the
        engine's torch work runs on that one thread (see run_in_passing_thread).
        `loop`: the event loop its streams belong to, when called off it (a
        server starting the engine while its loop answers /healthz); default:
        the running one."""
        self._loop = loop or asyncio.get_running_loop()
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            core = self.core
            try:
                calibration.prepare(core)
            except BaseException as e:  # reported by start(), in the caller's thread
                failed.append(e)
                return
            finally:
                self._publish()
                ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name="completer-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        if self.core.connector is not None:
            self.core.connector.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def live(self) -> EngineLive:
        """The snapshot the engine thread published last; the workers up are
        the links' own count, current even while the engine sleeps."""
        connector = self.core.connector
        return msgspec.structs.replace(self._live, prefill_workers_up=connector.workers_up if connector else 0)

    def _publish(self) -> None:
        """On the engine thread, at the end of a turn (nothing changes the
        queues and pools meanwhile). Block 0 is scratch, never free nor handed
        out; a free block may still hold cached K/V, but no sequence references it."""
        core = self.core
        self._live = EngineLive(running=len(core.scheduler.running), waiting=len(core.scheduler.waiting),
                                kv_cache_usage=core.kv.usage(),
                                kv_blocks_used={role: pool.num_blocks - 1 - pool.num_free
                                                for role, pool in core.kv.pools.items()})

    def submit(self, request: Request, supersede: str | None = None, ends_others: bool = True,
               affinity: str = "") -> RequestStream:
        """Queue a request. With `supersede` (a session and document), the
        requests submitted under the same key before it, still in flight, are
        cancelled: a newer keystroke in the same document. With `ends_others`
        False it joins them instead (a speculative request beside the one
        shown), and the next request that ends others ends it too. The engine
        is the one owner of supersede and cancel; call from the event loop's
        thread. `affinity`: who sent it (the request's `client`, whom the
        scheduler shares the engine between; a cluster keeps a sender's
        requests on one replica)."""
        if affinity and not request.client:
            request = msgspec.structs.replace(request, client=affinity)
        stream = RequestStream(request.id)
        self._streams[request.id] = stream
        with self._cond:
            if supersede is not None:
                ended = self._superseding.add(supersede, request.id, ends_others)
                self._inbox += [("cancel", old) for old in ended]
                self._cancels += len(ended)
            self._inbox.append(("add", (request, time.perf_counter())))
            self._cond.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        with self._cond:
            self._inbox.append(("cancel", request_id))
            self._cancels += 1
            self._cond.notify()

    def cancel_waiting(self, request_ids: list[str]) -> bool:
        """From the engine thread, between layers: every one of these has a cancel in the inbox."""
        if not self._cancels or not request_ids:
            return False
        with self._cond:
            waiting = {arg for op, arg in self._inbox if op == "cancel"}
        return waiting.issuperset(request_ids)

    def arrivals(self) -> list[Request]:
        """From the engine thread, before each layer of a bulk pass: the
        requests in the inbox (the core stops the pass for those that go first)."""
        if not self._inbox:  # (read without the lock: a stale answer costs a layer)
            return []
        with self._cond:
            return [arg[0] for op, arg in self._inbox if op == "add"]

    def _run(self) -> None:
        core = self.core
        busy = False  # since the memory was last handed back
        while True:
            with self._cond:
                if busy and not self._inbox and not core.has_work:
                    # Trimmed once the editor has paused, not between keystrokes: a trim takes
                    # ~2-3 ms, and a keystroke arriving meanwhile would wait for it.
                    self._cond.wait(TRIM_AFTER_IDLE_S)
                idle = not self._inbox and not core.has_work and not self._stopping
            if idle and busy and _malloc_trim is not None:
                _malloc_trim(0)  # idle: the next request does not wait for it
                busy = False
            with self._cond:
                while not self._inbox and not self._stopping:
                    if not core.has_work:
                        self._cond.wait()
                    elif core.only_transfers:  # woken when one closes; deadlines still checked
                        self._cond.wait(TRANSFER_POLL_S)
                        break
                    else:
                        break
                busy = True
                if self._stopping:
                    return
                inbox, self._inbox, self._cancels = self._inbox, [], 0
            events: list = []
            for op, arg in inbox:
                if op == "cancel":
                    core.abort(arg)
                    continue
                if op == "jobs":
                    core.take_closed_jobs()
                    continue
                request, submitted = arg
                try:
                    core.add(request, submitted)
                except EngineError as e:
                    events.append((request.id, e))
                except Exception as e:  # a bug: this request fails, the engine goes on
                    log.exception("engine: request %s failed to start", request.id)
                    events.append((request.id, EngineError("internal", f"{type(e).__name__}: {e}")))
            if core.has_work:
                try:
                    events += as_delivered(core.step(self))
                except Exception as e:  # fail this step's requests, not the server
                    log.exception("engine step failed; its %d running requests end with an internal error",
                                  len(core.scheduler.running))
                    events += core.fail_running(f"{type(e).__name__}: {e}")
            else:  # what aborts left, and the failures of jobs taken in from the inbox (a `Failed`: an error)
                events += as_delivered(core.output.drain())
            self._publish()  # before the answers go out: a client that saw its `done` sees its blocks back
            if events:
                self._loop.call_soon_threadsafe(self._dispatch, events)

    def between_passes(self, events: list) -> list[str]:
        """Mid-step: send what the prefill pass produced; take the cancels of
        requests in flight that arrived meanwhile (a cancel of one still in
        the inbox keeps its place behind that request's `add`)."""
        if events:
            self._loop.call_soon_threadsafe(self._dispatch, as_delivered(events))
            self._let_loop_send()
        with self._cond:
            ops = self._inbox
            now = [arg for op, arg in ops if op == "cancel" and arg in self.core.scheduler.requests]
            self._inbox = [(op, arg) for op, arg in ops if not (op == "cancel" and arg in now)]
            self._cancels = sum(op == "cancel" for op, _ in self._inbox)
        return now

    def _let_loop_send(self) -> None:
        """Wait (up to `engine.yield_to_loop_ms`) while the event loop writes the
        first tokens out: the next pass keeps every core busy, and on a machine
        with as many cores as the pass has threads the loop would otherwise get
        one only when the scheduler takes it from the pass."""
        wait_s = self.core.config.yield_to_loop_ms / 1000
        if wait_s <= 0:
            return
        self._sent.clear()
        # The stream wakes its relay, the relay the session's writer: the third
        # turn of the loop after the dispatch runs after the write.
        self._loop.call_soon_threadsafe(self._after_turns, 3)
        self._sent.wait(wait_s)

    def _after_turns(self, turns: int) -> None:
        if turns <= 1:
            self._sent.set()
        else:
            self._loop.call_soon(self._after_turns, turns - 1)

    def _dispatch(self, events: list) -> None:
        for request_id, event in events:
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            stream.queue.put_nowait(event)
            if isinstance(event, (Finished, EngineError)):
                del self._streams[request_id]
                self._superseding.ended(request_id)
