"""The front door's link to the Ray cluster: a process of its own.

A Ray driver that loses its cluster is ended by Ray itself (the GCS gone for
a minute, or its node's raylet gone: the process exits), so the process that
holds the editors' connections is not a Ray driver. It runs this module as a
child (`python -m completer.cluster.link FD`, the configuration on stdin):
the child joins or starts Ray, deploys or finds the Serve app, and passes
requests and their events over a socket pair, msgpack frames with a length
in front. When the child dies, `front.py` fails what was in flight with a
clear error and starts another.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
import time

import msgspec

from completer.engine.request import Finished, Request

# -- frames --------------------------------------------------------------------


class Submit(msgspec.Struct, tag="submit"):
    request: Request
    age_s: float  # since its arrival, when sent: the link rebases `arrival` on its own clock
    supersede: str | None = None
    ends_others: bool = True
    affinity: str = ""


class Cancel(msgspec.Struct, tag="cancel"):
    id: str


class Stop(msgspec.Struct, tag="stop"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    description: str  # the cluster, in a line (printed at start)


class Fatal(msgspec.Struct, tag="fatal"):
    message: str  # why the link could not start, in a line


class Event(msgspec.Struct, tag="event"):
    """One event of a request: a delta, its end, or its error (`code` set)."""

    id: str
    delta: str | None = None
    finished: Finished | None = None
    code: str = ""
    message: str = ""


class Stats(msgspec.Struct, tag="stats"):
    snapshot: dict  # cluster.routing.RouterStats.snapshot()


ToLink = Submit | Cancel | Stop
FromLink = Ready | Fatal | Event | Stats
_LENGTH = struct.Struct(">I")


class FrameStream:
    """Length-prefixed msgpack frames of one union type over an asyncio stream pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, incoming):
        self.reader, self.writer = reader, writer
        self.decoder = msgspec.msgpack.Decoder(incoming)
        self.encoder = msgspec.msgpack.Encoder()

    def send(self, frame) -> None:
        body = self.encoder.encode(frame)
        self.writer.write(_LENGTH.pack(len(body)) + body)

    async def receive(self):
        """The next frame; None at the end of the stream."""
        try:
            (size,) = _LENGTH.unpack(await self.reader.readexactly(_LENGTH.size))
            return self.decoder.decode(await self.reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None


# -- the link process -------------------------------------------------------------


class Reporter:
    """The router's figures to the front door: every period (the replicas'
    load), and before a request's end when the router decided since the last
    report, so /metrics read after an answer counts the decision behind it."""

    def __init__(self, frames: FrameStream):
        self.frames = frames
        self.decisions = -1

    def send(self, only_if_changed: bool = False) -> None:
        from completer.cluster.routing import ROUTER_STATS

        if only_if_changed and ROUTER_STATS.decisions == self.decisions:
            return
        snapshot = ROUTER_STATS.snapshot()
        self.decisions = snapshot["decisions"]
        self.frames.send(Stats(snapshot))

    async def every(self, period_s: float) -> None:
        while True:
            self.send()
            await asyncio.sleep(period_s)


async def pump(frames: FrameStream, reporter: Reporter, stream) -> None:
    """One request's events, from the cluster engine's stream to the front door."""
    from completer.engine.request import Delta, EngineError

    while True:
        item = await stream.queue.get()
        if isinstance(item, Delta):
            frames.send(Event(stream.id, delta=item.text))
            continue
        reporter.send(only_if_changed=True)
        if isinstance(item, Finished):
            frames.send(Event(stream.id, finished=item))
        elif isinstance(item, EngineError):
            frames.send(Event(stream.id, code=item.code, message=str(item)))
        return


async def serve(config, sock: socket.socket) -> int:
    from completer.cluster.client import ClusterEngine
    from completer.cluster.deploy import Cluster

    reader, writer = await asyncio.open_connection(sock=sock)
    frames = FrameStream(reader, writer, ToLink)
    cluster = Cluster(config)
    try:
        handle = await asyncio.to_thread(cluster.start)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        frames.send(Fatal(f"{type(e).__name__}: {first_line}"))
        await writer.drain()
        await asyncio.to_thread(cluster.stop)
        return 1
    engine = ClusterEngine(handle, config.cluster)
    frames.send(Ready(cluster.describe()))
    reporter = Reporter(frames)
    tasks = {asyncio.create_task(reporter.every(config.cluster.routing_stats_period_s))}
    try:
        while (frame := await frames.receive()) is not None and not isinstance(frame, Stop):
            if isinstance(frame, Submit):
                request = msgspec.structs.replace(frame.request, arrival=time.perf_counter() - frame.age_s)
                stream = engine.submit(request, frame.supersede, frame.ends_others, frame.affinity)
                task = asyncio.create_task(pump(frames, reporter, stream))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            elif isinstance(frame, Cancel):
                engine.cancel(frame.id)
            await writer.drain()
    finally:  # the front door stopped or went away: nothing of its stays on the replicas
        engine.stop()
        for task in tasks:
            task.cancel()
        await asyncio.to_thread(cluster.stop)
    return 0


def main() -> int:
    from completer.config import Config

    fd = int(sys.argv[1])
    os.set_inheritable(fd, False)  # Ray's own processes must not hold the front door's socket open
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=Config)
    return asyncio.run(serve(config, socket.socket(fileno=fd)))


if __name__ == "__main__":
    sys.exit(main())
