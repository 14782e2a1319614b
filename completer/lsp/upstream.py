"""The language server's one WebSocket to `completer serve` (protocol v1):
opened on the first request, opened again on a request after it dropped, so
every editor behind `completer lsp` shares the server's warm K/V, drafter and
metrics. A request waits for its terminal frame (`done` or `error`); an
inline completion is answered whole, so deltas are not needed.

When the server cannot be reached (not running, still loading, no token)
the editor is told once, in one line, and requests answer empty until a
connection opens again; the next outage is told again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import websockets

from completer import __version__
from completer.client import loading_message
from completer.lsp.settings import LspSettings
from completer.protocol import PROTOCOL_VERSION, Cancel, Complete, Delta, Done, Error, Feedback, Hello, Ready

log = logging.getLogger(__name__)

RETRY_S = 0.5  # a request this soon after a failed connect answers empty at once (no connect storm)
CONNECT_TIMEOUT_S = 5.0

ServerMessage = Ready | Delta | Done | Error
decode = msgspec.json.Decoder(ServerMessage).decode


class Upstream:
    def __init__(self, settings: Callable[[], LspSettings], say: Callable[[str], None]):
        self.settings = settings
        self.say = say  # tells the editor one line (window/showMessage)
        self.ws = None
        self.pending: dict[str, asyncio.Future] = {}
        self.lock = asyncio.Lock()
        self.retry_at = 0.0
        self.told = False  # this outage was told
        self.hold_until = 0.0  # the server's `hold_ms`: wait before the next request (loop time)
        self.tasks: set[asyncio.Task] = set()  # held: the loop keeps only weak references

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _connection(self):
        if self.ws is not None:
            return self.ws
        async with self.lock:
            if self.ws is not None or time.monotonic() < self.retry_at:
                return self.ws
            settings = self.settings()
            url = settings.server_url()
            token, source = settings.server_token()
            if token is None:
                return self._unreachable(f"no token for {url}: {source}; start `completer serve` "
                                         f"or set $COMPLETER_TOKEN")
            try:
                ws = await asyncio.wait_for(websockets.connect(
                    url, additional_headers={"Authorization": f"Bearer {token}"}, max_size=None,
                    compression=None, open_timeout=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S + 1)
            except (OSError, TimeoutError, websockets.exceptions.WebSocketException) as e:
                loading = loading_message(e)
                return self._unreachable(f"completer serve at {url} is {loading}" if loading else
                                         f"cannot reach completer serve at {url}: {e or type(e).__name__}")
            await ws.send(msgspec.json.encode(Hello(client=f"completer-lsp/{__version__}",
                                                    protocol=PROTOCOL_VERSION)).decode())
            self.ws, self.told = ws, False
            self._spawn(self._read(ws))
            return ws

    def _unreachable(self, why: str) -> None:
        self.retry_at = time.monotonic() + RETRY_S
        if not self.told:
            self.told = True
            self.say(f"completer: {why}; completions are empty until it answers")
        log.info("%s", why)
        return None

    async def _read(self, ws) -> None:
        try:
            async for raw in ws:
                try:
                    msg = decode(raw)
                except msgspec.DecodeError:
                    continue  # a message type newer than this bridge
                if isinstance(msg, Done) and msg.hold_ms:
                    self.hold_until = asyncio.get_running_loop().time() + msg.hold_ms / 1000
                if isinstance(msg, Done | Error) and msg.id is not None:
                    future = self.pending.pop(msg.id, None)
                    if future is not None and not future.done():
                        future.set_result(msg)
        except websockets.exceptions.ConnectionClosed:
            pass
        finally:
            if self.ws is ws:
                self.ws = None
            for future in self.pending.values():
                if not future.done():
                    future.set_result(None)
            self.pending.clear()

    async def complete(self, request: Complete) -> Done | Error | None:
        """The request's terminal frame; None when the server is not there
        (told once) or the connection dropped meanwhile. Cancelling the
        awaiting task cancels the request at the server."""
        ws = await self._connection()
        if ws is None:
            return None
        future = asyncio.get_running_loop().create_future()
        self.pending[request.id] = future
        try:
            await ws.send(msgspec.json.encode(request).decode())
            return await future
        except websockets.exceptions.ConnectionClosed:
            return None
        except asyncio.CancelledError:
            # (Cancelling the task cancels the future it awaits: a result is the only sign the request ended.)
            if future.cancelled() or not future.done():
                self.send(Cancel(id=request.id))
            raise
        finally:
            self.pending.pop(request.id, None)

    def send(self, message: Cancel | Feedback | Complete) -> None:
        """A frame that waits for no answer (cancel, feedback, a prime), if connected."""
        if self.ws is not None:
            self._spawn(self._send(self.ws, message))

    async def _send(self, ws, message) -> None:
        try:
            await ws.send(msgspec.json.encode(message).decode())
        except websockets.exceptions.ConnectionClosed:
            pass

    def prime(self, request: Complete) -> None:
        """Send a prime (`max_tokens` 0), connecting first if need be; its `done` is not waited for."""
        async def connect_and_send():
            ws = await self._connection()
            if ws is not None:
                await self._send(ws, request)
        self._spawn(connect_and_send())

    def cancel(self, request_id: str) -> None:
        self.send(Cancel(id=request_id))  # (an id already finished is no error: the server ignores it)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
