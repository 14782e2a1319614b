"""Whether a WebSocket client is still there.

The server pings every connection each `server.keepalive_s` seconds (which
also keeps NATs and proxies from dropping an idle one), and closes one from
which nothing at all came in for `SILENT_PINGS` of those periods: no frame,
no pong. websockets' own rule (no pong within a timeout) also closes a live
client whose pong waits behind the frames it has not read yet, a client
busy reading a backlog and typing all along, with its requests (issue #31's
first soak lost 641 requests on two connections closed while answers took
up to 62 s to arrive; with this rule, and the soak's editors keeping no
keepalive of their own as ours keep none, the next two lost none). Hearing anything from the
client is proof enough that it is there; a client that stops reading
altogether is `server.send_queue_frames`'s business, not this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from websockets.asyncio.server import Server, ServerConnection

SILENT_PINGS = 3
log = logging.getLogger(__name__)


class HeardConnection(ServerConnection):
    """A server connection that notes when bytes last came in (loop time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.heard_at = self.loop.time()

    def data_received(self, data: bytes) -> None:
        self.heard_at = self.loop.time()
        super().data_received(data)


async def close_silent(server: Server, period_s: float, on_close: Callable[[], None]) -> None:
    """Forever: every `period_s`, close the connections silent for `SILENT_PINGS`
    periods (`on_close()` for each)."""
    loop = asyncio.get_running_loop()
    closing: set[asyncio.Task] = set()
    while True:
        await asyncio.sleep(period_s)
        # One turn for the bytes already waiting (uvloop runs timers before it
        # polls): a starved loop reads late, never falsely silent.
        await asyncio.sleep(0)
        limit = loop.time() - SILENT_PINGS * period_s
        for connection in server.connections:
            if connection.heard_at < limit:
                on_close()
                log.warning("closing a connection from %s: nothing heard for %g s",
                            connection.remote_address, SILENT_PINGS * period_s)
                task = asyncio.create_task(connection.close(1011, f"nothing heard for {SILENT_PINGS * period_s:g} s"))
                closing.add(task)
                task.add_done_callback(closing.discard)


@contextlib.asynccontextmanager
async def watching(server: Server, period_s: float, on_close: Callable[[], None]):
    """`close_silent` while the block runs."""
    task = asyncio.create_task(close_silent(server, period_s, on_close))
    try:
        yield
    finally:
        task.cancel()
