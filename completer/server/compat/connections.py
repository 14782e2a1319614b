"""The compatible routes' connections: how many may be open, and how long
each may take to say what it wants.

aiohttp parses HTTP but bounds neither: a connection that sends nothing,
half its headers, a header line every few seconds, or a body a byte at a
time stays open (and holds a file descriptor, which the WebSocket port
needs too). So each connection's protocol is wrapped here:

- idle (connected, or its last answer sent, and no byte since): closed
  after `compat.idle_timeout_s`;
- headers (some bytes, no complete request yet): a 408 and closed after
  `compat.header_timeout_s` from the first byte, however slowly they come;
- busy (a request is being handled): the body's read is bounded by
  `compat.body_timeout_s` where it is read (`wire.read_body`), the
  handling by the engine's deadline;
- at most `compat.max_connections` open: a new one closes another that is
  not busy, and gets a 503 itself only when it cannot. Which one: while any
  connection that never sent a request with the token (a stranger) is open,
  a stranger, never a client that authenticated: first a stranger open for
  longer than `compat.header_timeout_s` without authenticating (the oldest
  of those), else the longest-idle stranger; a 503 when every stranger is
  busy. Only when all are authenticated does the longest-idle of them go.
  (The longest-idle connection, whoever it was, once went: a keep-alive
  editor between two keystrokes, ~150 ms idle, was closed by a flood of
  idle sockets opened after it, and its next request met a broken pipe.)

Each connection also has a serial number: under `server.prefix_cache_scope
= "connection"` it is what keeps one HTTP client's cache from another's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

Phase = str  # "idle", "headers", "busy", "lingering" (answered; the rest of its body may still come)


def raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP response in the routes' JSON envelope, for a connection
    answered before (or without) aiohttp parsing a request on it."""
    body = json.dumps({"error": {"code": status, "message": message, "type": "unavailable_error"
                                 if status == 503 else "timeout_error"}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Connection(asyncio.Protocol):
    """aiohttp's protocol for one connection, with its phase and timers kept."""

    def __init__(self, guard: "ConnectionGuard", inner: asyncio.Protocol):
        self.guard, self.inner = guard, inner
        self.serial = next(guard.serials)
        self.transport: asyncio.Transport | None = None
        self.phase: Phase = "idle"
        self.opened = self.since = time.monotonic()
        self.authenticated = False  # a request with the server's token came on it

    def connection_made(self, transport) -> None:
        self.transport = transport
        if not self.guard.admit(self):
            transport.write(raw_error(503, "Service Unavailable", f"{self.guard.max_connections} connections "
                                      "open on these routes, none idle that may be closed "
                                      "(compat.max_connections); retry"))
            transport.close()
            self.transport = None
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.phase == "idle":
            self.phase, self.since = "headers", time.monotonic()
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received() if self.transport is not None else None

    def connection_lost(self, exc) -> None:
        if self.transport is None:  # refused: aiohttp never saw it
            return
        self.guard.open.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def expire(self, why: bytes | None) -> None:
        """Closed by a timer: `why`, a response to send first (or none)."""
        if self.transport is None or self.transport.is_closing():
            return
        if why:
            self.transport.write(why)
        self.transport.close()


class ConnectionGuard:
    """The protocol factory of the compat listener (`loop.create_server`)."""

    def __init__(self, handler_factory: Callable[[], asyncio.Protocol], max_connections: int,
                 header_timeout_s: float, idle_timeout_s: float):
        self.handler_factory = handler_factory  # aiohttp's web.Server: one RequestHandler per connection
        self.max_connections = max_connections
        self.header_timeout_s, self.idle_timeout_s = header_timeout_s, idle_timeout_s
        self.open: dict[object, Connection] = {}  # transport -> its connection, in the order they came
        self.serials = itertools.count(1)
        self.sweeper: asyncio.Task | None = None

    def __call__(self) -> Connection:
        if self.sweeper is None:
            self.sweeper = asyncio.get_running_loop().create_task(self.sweep())
        return Connection(self, self.handler_factory())

    def admit(self, conn: Connection) -> bool:
        """Room for `conn`, made by closing another if need be (`victim`)."""
        if len(self.open) >= self.max_connections:
            if (gone := self.victim(time.monotonic())) is None:
                return False
            self.open.pop(gone.transport, None)
            gone.expire(raw_error(503, "Service Unavailable", "closed to make room for another connection "
                                  "(compat.max_connections)") if gone.phase == "headers" else None)
        self.open[conn.transport] = conn
        return True

    def victim(self, now: float) -> Connection | None:
        """The connection to close for a new one, or None (all that may go are
        busy): never an authenticated one while a stranger is open."""
        strangers = [c for c in self.open.values() if not c.authenticated]
        if strangers:
            waiting = [c for c in strangers if c.phase != "busy"]
            late = [c for c in waiting if now - c.opened > self.header_timeout_s]
            if late:  # had its chance to send the token, and did not
                return min(late, key=lambda c: c.opened)
        else:
            waiting = [c for c in self.open.values() if c.phase != "busy"]
        return min(waiting, key=lambda c: c.since) if waiting else None

    def of(self, request: web.Request) -> Connection | None:
        return self.open.get(request.transport)

    @staticmethod
    def authenticated(conn: Connection | None) -> None:
        """A request on it carried the server's token: kept over strangers."""
        if conn is not None:
            conn.authenticated = True

    def busy(self, request: web.Request) -> Connection | None:
        """A request's headers are in: its connection is handling it."""
        if (conn := self.of(request)) is not None:
            conn.phase = "busy"
        return conn

    @staticmethod
    def done(conn: Connection | None) -> None:
        """Its answer is out: idle until the next request's first byte."""
        if conn is not None:
            conn.phase, conn.since = "idle", time.monotonic()

    @staticmethod
    def lingering(conn: Connection | None) -> None:
        """Answered before its body was read (a refusal): the bytes that come
        next are that body, which aiohttp reads and drops; closed without a
        word after `header_timeout_s` unless a next request starts."""
        if conn is not None:
            conn.phase, conn.since = "lingering", time.monotonic()

    async def sweep(self) -> None:
        tick = max(0.05, min(self.header_timeout_s, self.idle_timeout_s) / 4)
        late = raw_error(408, "Request Timeout", f"the request's headers took over {self.header_timeout_s:g} s "
                                                 "(compat.header_timeout_s)")
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for conn in list(self.open.values()):
                if conn.phase == "idle" and now - conn.since > self.idle_timeout_s:
                    conn.expire(None)
                elif conn.phase == "headers" and now - conn.since > self.header_timeout_s:
                    conn.expire(late)
                elif conn.phase == "lingering" and now - conn.since > self.header_timeout_s:
                    conn.expire(None)

    def close(self) -> None:
        if self.sweeper is not None:
            self.sweeper.cancel()


class JsonErrors(RequestHandler):
    """aiohttp's protocol, its own answers to what it cannot parse (no Host,
    a header over 8 KB, a broken start line) in the routes' JSON envelope
    rather than plain text, like every other error on these routes."""

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        response = super().handle_error(request, status, exc, message)  # logs, refuses a half-sent answer
        json_error = web.Response(status=status, content_type="application/json", text=json.dumps(
            {"error": {"code": status, "message": (message or "").strip() or str(status),
                       "type": "invalid_request_error" if status < 500 else "server_error"}}))
        json_error.force_close()
        del response
        return json_error


class GuardedSite(web.TCPSite):
    """aiohttp's TCP site with each connection's protocol wrapped by `guard`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, guard: ConnectionGuard, **kwargs):
        super().__init__(runner, host, port, **kwargs)
        self.guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registered with the runner, which stops it at cleanup
        server = self._runner.server  # aiohttp's web.Server: what it would build, as JsonErrors
        self.guard.handler_factory = lambda: JsonErrors(server, loop=server._loop, **server._kwargs)
        self._server = await asyncio.get_running_loop().create_server(
            self.guard, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self.guard.close()
        await super().stop()
