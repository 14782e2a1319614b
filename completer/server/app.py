"""`completer serve`: the WebSocket endpoint and the HTTP routes on one port.

    /v1/ws       the editor protocol (token, Origin and Host checked first)
    /healthz     200 once ready; 503 with how far the start is before
    /metrics     Prometheus exposition (token, unless server.public_metrics)
    /dashboard   the live latency dashboard (open it with ?token=TOKEN)
    /v1/stats    the dashboard's figures as JSON (token)

and, on a port of their own (`[compat]`, `server/compat/`), the llama.cpp-
and OpenAI-compatible routes that existing editor plugins speak.
"""

from __future__ import annotations

import asyncio
import http
import json
import signal
import socket
import ssl
import sys
from importlib import resources
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from completer import context_store
from completer.config import Config
from completer.engine.engine import Engine
from completer.loading import LoadedModel
from completer.pipeline import CompletionPipeline
from completer.server import security
from completer.server.compat.http import CompatServer
from completer.server.engine_start import EngineStart
from completer.server.keepalive import HeardConnection, watching
from completer.server.metrics import Live, Metrics
from completer.server.service import CompletionService
from completer.server.session import Session
from completer.startup import StartupProgress

if TYPE_CHECKING:
    from completer.cluster.front import LinkedEngine

SHUTDOWN_GRACE_S = 5.0


class App:
    def __init__(self, config: Config, token: str, progress: StartupProgress | None = None):
        self.config = config
        # How far the start is: shown as it goes, and said by /healthz and refused handshakes until ready.
        self.progress = progress or StartupProgress(enabled=False)
        self.token = token
        self.metrics = Metrics()
        self.target: LoadedModel | None = None
        self.draft: LoadedModel | None = None
        self.engine: Engine | LinkedEngine | None = None
        self.cluster: LinkedEngine | None = None  # the engine, under `--cluster`
        # Models, prefill workers and engine, started once the port is bound (`start_engine`).
        self.engine_start = EngineStart(config, token, self.progress)
        self.sessions: set[Session] = set()
        self.connections = 0
        # The completions themselves, whichever door they come through (the engine attached once ready).
        self.service = CompletionService(config, self.metrics)
        context_store.LEDGER.bound(config.server.context_chars_total)  # every connection's context, together
        self.scheme = "https" if config.server.tls_cert else "http"
        self.dashboard_html = resources.files("completer.server").joinpath("dashboard.html").read_bytes()
        self.compat = CompatServer(self.service, token) if config.compat.enabled else None

    # -- the engine -----------------------------------------------------------

    async def start_engine(self) -> None:
        """The models loaded and the engine started off the event loop
        (server/engine_start.py), which answers /healthz (and refuses
        handshakes, saying how far it is) meanwhile; then ready."""
        self.attach(await self.engine_start.run())

    def attach(self, engine: Engine | LinkedEngine) -> None:
        """Ready: the service completes through `engine` from now on."""
        s = self.engine_start
        self.target, self.draft, self.cluster = s.target, s.draft, s.cluster
        self.service.attach(CompletionPipeline(self.target, self.config), engine, self.target, self.draft)
        core = getattr(engine, "core", None)  # (none under `--cluster`: the replicas' engines)
        self.metrics.fused_cpu.set(int(core is not None and core.runners["target"].fused is not None))
        self.engine = engine

    # -- HTTP ------------------------------------------------------------------

    def respond(self, conn: ServerConnection, status: int, body: bytes, content_type: str) -> Response:
        response = conn.respond(status, "")
        del response.headers["Content-Type"]
        del response.headers["Content-Length"]
        response.headers["Content-Type"] = content_type
        response.headers["Content-Length"] = str(len(body))
        response.headers["Cache-Control"] = "no-store"
        response.body = body
        return response

    def json_response(self, conn: ServerConnection, status: int, value) -> Response:
        return self.respond(conn, status, json.dumps(value).encode(), "application/json")

    def update_gauges(self) -> None:
        """What is true now, read when scraped, into the gauges and /v1/stats.
        Runs on the event loop (all_tasks is its tasks); the engine thread may
        be changing the lists and pools read here, and len() of them is atomic."""
        live = Live(sessions=len(self.sessions), event_loop_tasks=len(asyncio.all_tasks()),
                    requests_in_flight=self.service.in_flight)
        if self.engine is not None:
            engine = self.engine.live()
            live.running, live.waiting = engine.running, engine.waiting
            live.kv_cache_usage, live.kv_blocks_used = engine.kv_cache_usage, engine.kv_blocks_used
            live.prefill_workers_up = engine.prefill_workers_up
            if self.cluster is not None and self.cluster.snapshot:  # none while the link to the cluster is down
                self.metrics.set_cluster(self.cluster.snapshot)
        self.metrics.set_live(live)

    def unauthorized(self, conn: ServerConnection) -> Response:
        response = conn.respond(http.HTTPStatus.UNAUTHORIZED, "missing or wrong token\n")
        response.headers["WWW-Authenticate"] = 'Bearer realm="completer"'
        return response

    def process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        host = request.headers.get("Host")
        if not security.host_allowed(host, self.config.server.host):
            return conn.respond(http.HTTPStatus.FORBIDDEN, "Host not allowed (the server is bound to loopback)\n")
        path = urlsplit(request.path).path
        ready = self.engine is not None
        # The figures tell when, and how much, someone types: they need the
        # token like the model does. /healthz tells nothing of the kind, and
        # the dashboard's page holds no figures (it fetches them with the token).
        token_ok = security.token_matches(self.token, request.headers.get("Authorization"), request.path)
        if path == "/healthz":
            if self.cluster is not None and not self.cluster.up:  # requests are refused until it is back
                return self.json_response(conn, 503, {"status": "reconnecting"})
            if ready:
                return self.json_response(conn, 200, {"status": "ok"})
            p = self.progress
            return self.json_response(conn, 503, {"status": "loading", "progress": round(p.fraction, 3),
                                                  "stage": p.stage, "message": p.describe()})
        if path == "/metrics":
            if not (token_ok or self.config.server.public_metrics):
                return self.unauthorized(conn)
            self.update_gauges()
            return self.respond(conn, 200, self.metrics.exposition(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/stats":
            if not token_ok:
                return self.unauthorized(conn)
            self.update_gauges()
            return self.json_response(conn, 200, self.metrics.stats())
        if path == "/dashboard":
            return self.respond(conn, 200, self.dashboard_html, "text/html; charset=utf-8")
        if path != "/v1/ws":
            return conn.respond(http.HTTPStatus.NOT_FOUND, "not found\n")
        if not security.origin_allowed(request.headers.get("Origin"), host, self.scheme,
                                       self.config.server.allowed_origins):
            return conn.respond(http.HTTPStatus.FORBIDDEN, "Origin not allowed\n")
        if not token_ok:
            return self.unauthorized(conn)
        if not ready:  # clients show this line (python -m completer.client waits, saying it)
            return conn.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, self.progress.describe() + "\n")
        if len(self.sessions) >= self.config.server.max_connections:
            return conn.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n")
        return None

    # -- WebSocket -------------------------------------------------------------

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        session = Session(self.service, ws, self.connections)
        self.sessions.add(session)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            self.metrics.sessions.set(len(self.sessions))

    async def shutdown(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Start nothing new; end every request in flight with `done` (cancelled)
        and send those frames, within `grace_s`."""
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        # Both doors' requests: the sessions send `done`, the compatible routes' clients get 503 (their
        # listener closes after the sockets).
        self.service.stop()
        pending = [t for s in self.sessions for t in s.inflight.values()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, end - loop.time()))
        flushing = [asyncio.ensure_future(s.flush()) for s in self.sessions]
        if flushing:  # the `done` frames out to the sockets
            await asyncio.wait(flushing, timeout=max(0.0, end - loop.time()))

    async def close_connections(self, server, timeout_s: float) -> None:
        """The close handshake with every connection; those that have not
        answered within `timeout_s` (a reader that stopped reading never will)
        are dropped."""
        server.close()
        try:
            await asyncio.wait_for(asyncio.shield(server.wait_closed()), max(0.0, timeout_s))
        except TimeoutError:
            for session in list(self.sessions):
                session.ws.transport.abort()
            await server.wait_closed()

    async def serve(self, stop: asyncio.Event, on_listening=None, sock: socket.socket | None = None,
                    on_bound=None) -> None:
        """Serve until `stop`; on `server.host`/`port`, or on a listening `sock`
        given. `on_bound(port)` once the port is bound (the models not loaded
        yet); `on_listening(port)` then `on_listening(port, self)` once ready."""
        s = self.config.server
        tls = None
        if s.tls_cert:
            tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            tls.load_cert_chain(s.tls_cert, s.tls_key or None)
        where = {"sock": sock} if sock is not None else {"host": s.host, "port": s.port}
        async with serve(self.handler, **where, process_request=self.process_request,
                         max_size=s.max_frame_bytes, ssl=tls, server_header="completer",
                         create_connection=HeardConnection, ping_interval=s.keepalive_s,
                         ping_timeout=None) as server, \
                watching(server, s.keepalive_s, self.metrics.silent_disconnects.inc):
            port = server.sockets[0].getsockname()[1]
            if self.compat is not None:  # bound now, like the WebSocket port: 503 while the models load
                await self.compat.start(tls, SHUTDOWN_GRACE_S)
            try:
                # "listening" is said once a completion can be answered (issue #32: said before the
                # engine was up, a client run then timed out), so a model that fails to load ends the
                # start with its error alone; bound before, /healthz and handshakes say how far it is.
                if on_bound is not None:
                    on_bound(port)
                loading = asyncio.create_task(self.start_engine())
                stopped = asyncio.create_task(stop.wait())
                await asyncio.wait([loading, stopped], return_when=asyncio.FIRST_COMPLETED)
                if not loading.done():  # stopped mid-start: no thread of it waits on another process
                    self.engine_start.stopping.set()
                if loading.done() and loading.exception() is not None:
                    self.progress.fail()
                    self.engine_start.stop_workers()
                    raise loading.exception()
                if loading.done():
                    self.progress.done()
                    if on_listening is not None:
                        on_listening(port)
                        on_listening(port, self)
                await stopped
                # One grace for all of it: draining the requests, then the close handshakes.
                end = asyncio.get_running_loop().time() + SHUTDOWN_GRACE_S
                if self.engine is not None:
                    await self.shutdown()
                await self.close_connections(server, end - asyncio.get_running_loop().time())
            finally:
                if self.compat is not None:
                    await self.compat.stop()
        if self.engine is not None:
            self.engine.stop()
        if self.cluster is not None:
            await self.cluster.wait_stopped()
        self.engine_start.stop_workers()


def run(config: Config, token: str, token_source: str, progress: StartupProgress | None = None) -> int:
    """Serve until SIGINT/SIGTERM; exit 0 after a graceful shutdown."""
    s = config.server
    if not security.is_loopback(s.host) and not s.tls_cert:
        print(f"warning: serving on {s.host} without TLS; the token travels in clear text", file=sys.stderr)
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    if cpus := config.disagg.engine_cpus:  # before torch starts threads; workers pin themselves
        import os

        import torch

        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    app = App(config, token, progress)
    scheme = "wss" if s.tls_cert else "ws"

    def on_bound(port: int) -> None:
        # (Not the word "ready": scripts wait for the line that ends with it.)
        print(f"completer starting on port {port}: loading the models (GET {app.scheme}://{s.host}:{port}/healthz "
              f"says how far)", flush=True)

    def on_listening(port: int, loaded: App | None = None) -> None:
        if loaded is None:
            print(f"completer listening on {scheme}://{s.host}:{port}/v1/ws "
                  f"(dashboard: {app.scheme}://{s.host}:{port}/dashboard)", flush=True)
            if app.compat is not None and app.compat.port is not None:
                print(f"compat API (llama.cpp /infill, /completion; OpenAI /v1/completions) on "
                      f"{app.compat.scheme}://{app.compat.host}:{app.compat.port}", flush=True)
            print(f"token: {token_source}", flush=True)
        else:
            draft = f", draft {loaded.draft.name}" if loaded.draft else ""
            if loaded.cluster is not None:
                print(loaded.cluster.description, flush=True)
            print(f"models loaded: target {loaded.target.name} ({loaded.target.directory}){draft}; "
                  f"precision {loaded.target.describe_precision()}; ready", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await app.serve(stop, on_listening, on_bound=on_bound)

    asyncio.run(main())
    print("completer stopped", flush=True)
    return 0
