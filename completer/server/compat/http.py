"""The compatible routes' listener (`[compat]`): an aiohttp server beside
the WebSocket one, on the same event loop, over the same engine and
pipeline. (websockets' HTTP parser takes GET only; these clients POST.)

    POST /infill, /completion      llama.cpp's server API (llama_api)
    GET  /health, /props
    POST /v1/completions           OpenAI's completions API (openai_api)
    GET  /v1/models, /models

Every request passes the server's checks first: the Host (DNS rebinding),
the Origin (a web page in the user's browser), then the token on all but
/health, which tells only whether the model is loaded. Errors, the
server's and aiohttp's own (404, 405, 413), answer in the JSON envelope.
A client that disconnects cancels its handler (`handler_cancellation`),
and with it its engine request.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import sys

from aiohttp import web

from completer.server import security
from completer.server.compat import llama_api, openai_api
from completer.server.compat.connections import ConnectionGuard, GuardedSite
from completer.server.compat.generation import CompatEngine
from completer.server.compat.wire import CONNECTIONS, ENGINE, HttpError, error_response
from completer.server.service import CompletionService

log = logging.getLogger(__name__)
# aiohttp logs each malformed request with its traceback (and answers it 400): a log any client
# could flood. Only what aiohttp itself deems critical is kept.
PARSER_LOG = logging.getLogger(__name__ + ".parser")
PARSER_LOG.setLevel(logging.CRITICAL)

ROUTES = [
    ("POST", "/infill", llama_api.infill, "infill"),
    ("POST", "/completion", llama_api.completion, "completion"),
    ("POST", "/completions", llama_api.completion, "completion"),  # llama.cpp's alias (not OpenAI's shape)
    ("GET", "/health", llama_api.health, "health"),
    ("GET", "/v1/health", llama_api.health, "health"),
    ("GET", "/props", llama_api.props, "props"),
    ("POST", "/v1/completions", openai_api.completions, openai_api.ROUTE),
    ("GET", "/v1/models", openai_api.models, "models"),
    ("GET", "/models", openai_api.models, "models"),
]
ROUTE_LABELS = {path: label for _, path, _, label in ROUTES}
PUBLIC = {"/health", "/v1/health"}
CORS_HEADERS = {"Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": "Authorization, Content-Type, X-Api-Key, api-key",
                "Access-Control-Max-Age": "600"}


class CompatServer:
    def __init__(self, service: CompletionService, token: str):
        self.config, self.metrics, self.token = service.config, service.metrics, token
        self.engine = CompatEngine(service)
        self.host = self.config.compat.host or self.config.server.host
        self.scheme = "http"
        self.runner: web.AppRunner | None = None
        c = self.config.compat
        self.connections = ConnectionGuard(lambda: None, c.max_connections, c.header_timeout_s, c.idle_timeout_s)
        self.port: int | None = None  # once listening

    async def start(self, tls: ssl.SSLContext | None, grace_s: float) -> int | None:
        """Listen (with the server's TLS, if any); the port, or None when it
        cannot be had: the WebSocket server still serves, with a warning (a
        llama-server already on 8012 is no reason to refuse the editors)."""
        c = self.config.compat
        self.scheme = "https" if tls is not None else "http"
        if not security.is_loopback(self.host) and tls is None:
            print(f"warning: compat API on {self.host} without TLS; the token travels in clear text",
                  file=sys.stderr)
        application = web.Application(middlewares=[self.guard], client_max_size=self.engine.body_limit)
        application[ENGINE] = self.engine
        application[CONNECTIONS] = self.connections
        application.on_response_prepare.append(self.allow_origin)
        for method, path, handler, _ in ROUTES:
            application.router.add_route(method, path, handler)
        self.runner = web.AppRunner(application, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=grace_s, logger=PARSER_LOG)
        await self.runner.setup()
        try:
            await GuardedSite(self.runner, self.host, c.port, self.connections, ssl_context=tls).start()
        except OSError as e:
            await self.runner.cleanup()
            self.runner = None
            print(f"warning: compat API not served: cannot listen on {self.host}:{c.port} ({e.strerror}); "
                  f"set compat.port (0: any free port), or compat.enabled = false", file=sys.stderr, flush=True)
            return None
        self.port = self.runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Requests in flight end (503), then the listener closes."""
        if self.runner is None:
            return
        self.engine.cancel_all()
        await self.runner.cleanup()
        self.runner = None

    def check(self, request: web.Request) -> bool:
        """The Host, Origin and token checks of the WebSocket route, in HTTP's
        words; whether it carried the token (/health and a preflight need none)."""
        host = request.headers.get("Host")
        if not security.host_allowed(host, self.host):
            raise HttpError(403, "Host not allowed (the server is bound to loopback)")
        if not security.origin_allowed(request.headers.get("Origin"), host, self.scheme,
                                       self.config.server.allowed_origins):
            raise HttpError(403, "Origin not allowed (server.allowed_origins)")
        h = request.headers
        if security.api_key_matches(self.token, h.get("Authorization"), h.get("X-Api-Key"), h.get("api-key")):
            return True
        if request.path not in PUBLIC and request.method != "OPTIONS":
            raise HttpError(401, "Invalid API Key: send the server's token as `Authorization: Bearer TOKEN` "
                                 "(llama.vim: g:llama_config.api_key; the server prints where it keeps it)")
        return False

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        route = ROUTE_LABELS.get(request.path, "other")
        connection = self.connections.busy(request)
        try:
            if self.check(request):  # its connection outranks those that never sent the token
                self.connections.authenticated(connection)
            if request.method == "OPTIONS":  # a CORS preflight from an allowed origin
                return web.Response(status=204, headers=CORS_HEADERS)
            return await handler(request)
        except HttpError as e:
            response = error_response(e.status, e.message, e.param)
        except web.HTTPException as e:  # aiohttp's own answers (no route, wrong method, body too large)
            response = error_response(e.status, e.reason)
        except (asyncio.CancelledError, ConnectionError) as e:
            # The client left: aiohttp cancels its handler, or a write to it fails first (its
            # engine request is cancelled either way). Nobody to answer; 499 is for the books.
            self.metrics.count_route(route, "disconnected")
            if isinstance(e, asyncio.CancelledError):
                raise
            return web.Response(status=499)
        except Exception as e:  # a bug: the envelope still, never aiohttp's plain-text 500
            log.exception("compat: %s %s failed", request.method, request.path)
            response = error_response(500, f"internal error ({type(e).__name__})")
        finally:
            if request.body_exists and not request.content.is_eof():
                # Answered before its body was read: aiohttp lingers to take the rest, which is
                # that body, not a next request to time out with a second answer (a 408).
                self.connections.lingering(connection)
            else:
                self.connections.done(connection)
        self.metrics.count_route(route, str(response.status))
        return response

    async def allow_origin(self, request: web.Request, response: web.StreamResponse) -> None:
        """An allowed web origin may read the answers (an editor sends no Origin)."""
        origin = request.headers.get("Origin")
        if origin is not None and security.origin_allowed(origin, request.headers.get("Host"), self.scheme,
                                                          self.config.server.allowed_origins):
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Vary"] = "Origin"
