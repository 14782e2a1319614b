"""The front door's engine under `--cluster`: what `Engine` offers a session
(submit, cancel, live, stop), each request passed to the link process
(`link.py`), which holds the Ray connection.

When the link is lost (Ray ended it, or it died), the requests in flight end
with an `internal` error that says so, new ones are refused with
`overloaded` while a new link starts (again and again, a little slower each
time, until the cluster is back), and the connections to the editors stay
open throughout: their next keystroke after that is served.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
import time

import msgspec

from completer.checkpoint import CheckpointError
from completer.cluster.link import Cancel, Event, Fatal, FrameStream, FromLink, Ready, Stats, Stop, Submit
from completer.engine.streams import EngineLive, RequestStream
from completer.engine.request import Delta, EngineError, Request

log = logging.getLogger(__name__)
RETRY_S = (1.0, 2.0, 5.0, 10.0)  # waits between attempts to bring a lost link back
LOST = "the front door lost its connection to the Ray cluster"


class LinkedEngine:
    def __init__(self, config, start_timeout_s: float = 900.0):
        self.config = config
        self.start_timeout_s = start_timeout_s  # the first start loads models on the replicas: minutes
        self.streams: dict[str, RequestStream] = {}
        self.frames: FrameStream | None = None  # None while the link is down
        self.proc: asyncio.subprocess.Process | None = None
        self.description = ""
        self.snapshot: dict = {}  # the router's and replicas' figures as the link last sent them
        self.links_started = 0
        self._supervisor: asyncio.Task | None = None
        self._stopping = False

    @property
    def up(self) -> bool:
        return self.frames is not None

    # -- the link's lifetime ---------------------------------------------------------

    async def start(self) -> None:
        """The first link; a cluster that cannot start fails the server's start in one line."""
        try:
            await self._connect()
        except RuntimeError as e:
            raise CheckpointError(f"cluster: cannot start the engine replicas ({e})") from None
        self._supervisor = asyncio.create_task(self._supervise())

    async def _connect(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "completer.cluster.link", str(theirs.fileno()),
                stdin=asyncio.subprocess.PIPE, stdout=sys.stderr.fileno(), pass_fds=(theirs.fileno(),),
                start_new_session=True)  # its group holds the Ray processes it starts: ended with it
        finally:
            theirs.close()
        self.links_started += 1
        self.proc.stdin.write(msgspec.json.encode(self.config))
        self.proc.stdin.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        frames = FrameStream(reader, writer, FromLink)
        try:
            first = await asyncio.wait_for(frames.receive(), self.start_timeout_s)
        except TimeoutError:
            first = Fatal(f"no answer from the link process in {self.start_timeout_s:.0f} s")
        if not isinstance(first, Ready):
            writer.close()
            await self._end_process()
            raise RuntimeError(first.message if isinstance(first, Fatal)
                               else f"the link process exited with code {self.proc.returncode}")
        self.description = first.description
        self.frames = frames

    async def _supervise(self) -> None:
        while not self._stopping:
            await self._serve_link()
            if self._stopping:
                return
            self._lost()
            for attempt in itertools.count():
                await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
                if self._stopping:
                    return
                try:
                    await self._connect()
                    log.warning("cluster: the link to the Ray cluster is back (%s)", self.description)
                    break
                except (RuntimeError, OSError) as e:
                    log.warning("cluster: the link to the Ray cluster is still down (%s); trying again", e)

    async def _serve_link(self) -> None:
        frames = self.frames
        while (frame := await frames.receive()) is not None:
            if isinstance(frame, Event):
                self._deliver(frame)
            elif isinstance(frame, Stats):
                self.snapshot = frame.snapshot
        frames.writer.close()
        await self._end_process()

    def _lost(self) -> None:
        code = self.proc.returncode if self.proc is not None else None
        log.warning("cluster: %s (the link process ended with code %s); reconnecting", LOST, code)
        self.frames = None
        self.snapshot = {}
        for stream in self.streams.values():
            stream.queue.put_nowait(EngineError("internal", f"{LOST} while this request was in flight; "
                                                            "it is reconnecting"))
        self.streams.clear()

    async def _end_process(self, timeout_s: float = 10.0) -> None:
        """Wait for the link to exit (kill it past `timeout_s`), then end what
        is left of its process group: a local cluster's Ray processes outlive a
        link that was killed."""
        if self.proc is None:
            return
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _deliver(self, event: Event) -> None:
        stream = self.streams.get(event.id)
        if stream is None:
            return
        if event.delta is not None:
            stream.queue.put_nowait(Delta(event.id, event.delta))
            return
        del self.streams[event.id]
        stream.queue.put_nowait(event.finished if event.finished is not None
                                else EngineError(event.code, event.message))

    # -- what a session calls ------------------------------------------------------------

    def submit(self, request: Request, supersede: str | None = None, ends_others: bool = True,
               affinity: str = "") -> RequestStream:
        """As Engine.submit; call from the event loop's thread."""
        stream = RequestStream(request.id)
        if self.frames is None:
            stream.queue.put_nowait(EngineError("overloaded", f"{LOST}; it is reconnecting, try again shortly"))
            return stream
        self.streams[request.id] = stream
        self.frames.send(Submit(request, time.perf_counter() - request.arrival, supersede, ends_others, affinity))
        return stream

    def cancel(self, request_id: str) -> None:
        if request_id in self.streams and self.frames is not None:
            self.frames.send(Cancel(request_id))

    def cancel_all(self) -> None:
        for request_id in list(self.streams):
            self.cancel(request_id)

    def live(self) -> EngineLive:
        """The replicas' load as they last reported it (every cluster.routing_stats_period_s)."""
        replicas = self.snapshot.get("replicas", {})
        usage = [s.get("kv_cache_usage", 0.0) for s in replicas.values()]
        return EngineLive(running=sum(s.get("running", 0) for s in replicas.values()),
                          waiting=sum(s.get("waiting", 0) for s in replicas.values()),
                          kv_cache_usage=sum(usage) / len(usage) if usage else 0.0)

    def stop(self) -> None:
        """Ask the link to end its requests and leave the cluster; it exits on its own."""
        self._stopping = True
        if self.frames is not None:
            self.frames.send(Stop())
        if self._supervisor is not None:
            self._supervisor.cancel()

    async def wait_stopped(self, timeout_s: float = 20.0) -> None:
        await self._end_process(timeout_s)
