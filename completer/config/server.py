"""`[server]` (the WebSocket server: its listener, limits, warming) and `[compat]` (the
llama.cpp- and OpenAI-compatible routes, on a listener of their own)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

import msgspec


from completer.config.problem import ConfigProblem


class ServerSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8750
    token: str = ""  # "" reads (or creates) token_file
    token_file: str = ""  # "" = the per-user default path
    allowed_origins: list[str] = []
    tls_cert: str = ""
    tls_key: str = ""
    max_frame_bytes: int = 4 * 2**20
    max_document_chars: int = 2_000_000
    max_inflight_per_connection: int = 8
    max_connections: int = 64
    send_queue_frames: int = 256  # frames waiting behind a stalled reader before it is disconnected
    keepalive_s: float = 20.0  # ping period; a connection silent for 3 periods (no frame, no pong) is closed
    max_documents_per_connection: int = 256  # prompt state kept per connection (least recently used goes)
    prefix_cache_scope: Literal["shared", "connection"] = "shared"  # who may reuse a prompt's cached K/V
    public_metrics: bool = False  # true: /metrics without the token (a scraper that cannot send one)
    # Per connection: the files its client sent (context, documents) kept as retrieval candidates (0: none).
    context_store_chars: int = 1_000_000
    # All connections together: the characters their stores and retrieval window caches hold (~15 bytes of
    # memory each), the least recently used, whichever connection's, dropped first (context_store.LEDGER).
    context_chars_total: int = 32_000_000
    # Folders on this machine under which a request's `workspace` may be read to resolve its document's
    # imports (completer/workspace.py); absolute paths. Empty: the server never reads a client's files.
    workspace_roots: list[str] = []
    workspace_file_bytes: int = 256 * 1024  # a larger imported file is not read
    # Warming (completer/server/warming.py): after a request on a document, once its client pauses this
    # long, up to this many windows its next jump may take are prefilled while the engine is idle (0: none).
    warm_windows: int = 3
    # The longest deadline a request may ask for (the protocol allows 600,000 ms): longer ones are cut to it,
    # so no client holds the engine's slots for minutes (never below request.deadline_ms, first_deadline_ms).
    max_deadline_ms: float = 60000.0
    warm_after_ms: float = 100.0
    # A file to append one JSON line to per finished request: its arrival, route, client, end and timings,
    # never its text (server/request_log.py). "": none.
    request_log: str = ""
    # `done.hold_ms`: how long the server asks a client to wait after a keystroke before asking (0 unless
    # other clients share the engine and requests wait for it; server/hold.py). false: not sent.
    client_hold: bool = True


class CompatSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The llama.cpp- and OpenAI-compatible HTTP routes (`server/compat/`), on a listener of their own."""

    enabled: bool = True
    host: str = ""  # "" = server.host
    # llama.vim's and llama.vscode's default endpoint is http://127.0.0.1:8012: their users change nothing.
    port: int = 8012
    max_inflight: int = 32  # requests in flight on these routes together; more get 429
    # Slow or idle clients (server/compat/connections.py): each holds a socket and a file descriptor.
    # Open at once; past it one not busy is closed: one that never sent the token before any that did
    # (compat/connections.py, ConnectionGuard.victim).
    max_connections: int = 128
    header_timeout_s: float = 10.0  # from a request's first byte to its last header line
    body_timeout_s: float = 30.0  # to read a request's whole body
    idle_timeout_s: float = 60.0  # a connection with no request in it (keep-alive, or never used)


def server_problems(s: ServerSection) -> list[ConfigProblem]:
    """Values of `[server]` that cannot work (whether the TLS files exist is checked at start)."""
    found = []
    if not 0 <= s.port <= 65535:
        found.append(ConfigProblem(("server.port",), f"server.port = {s.port}: must be 0 (any free port) to 65535"))
    if s.context_store_chars < 0:
        found.append(ConfigProblem(("server.context_store_chars",), f"server.context_store_chars = "
                                   f"{s.context_store_chars}: must be 0 (none) or more"))
    if s.context_chars_total < 0:
        found.append(ConfigProblem(("server.context_chars_total",), f"server.context_chars_total = "
                                   f"{s.context_chars_total}: must be 0 (nothing kept across requests) or more"))
    for i, root in enumerate(s.workspace_roots):
        if not Path(root).is_absolute() or not Path(root).is_dir():
            found.append(ConfigProblem(("server.workspace_roots",), f"server.workspace_roots[{i}] = {root!r}: "
                                       "must be the absolute path of an existing folder"))
    for key in ("max_frame_bytes", "max_document_chars", "max_inflight_per_connection", "max_connections",
                "send_queue_frames", "max_documents_per_connection", "workspace_file_bytes"):
        if getattr(s, key) < 1:
            found.append(ConfigProblem((f"server.{key}",), f"server.{key} = {getattr(s, key)}: must be at least 1"))
    if not (s.max_deadline_ms > 0 and math.isfinite(s.max_deadline_ms)):
        found.append(ConfigProblem(("server.max_deadline_ms",), f"server.max_deadline_ms = {s.max_deadline_ms}: "
                                   "must be a positive number of milliseconds"))
    if s.warm_windows < 0:
        found.append(ConfigProblem(("server.warm_windows",), f"server.warm_windows = {s.warm_windows}: "
                                   "must be 0 (no warming) or more"))
    if not (s.warm_after_ms >= 0 and math.isfinite(s.warm_after_ms)):
        found.append(ConfigProblem(("server.warm_after_ms",), f"server.warm_after_ms = {s.warm_after_ms}: "
                                   "must be 0 or more milliseconds"))
    if not s.keepalive_s > 0:
        found.append(ConfigProblem(("server.keepalive_s",), f"server.keepalive_s = {s.keepalive_s}: must be above 0"))
    if s.tls_key and not s.tls_cert:
        found.append(ConfigProblem(("server.tls_key", "server.tls_cert"),
                                   "server.tls_key is set but server.tls_cert is not: TLS needs both"))
    return found


def compat_problems(c: CompatSection, s: ServerSection) -> list[ConfigProblem]:
    """Values of `[compat]` that cannot work, alone or beside `[server]`'s listener."""
    found = []
    if not 0 <= c.port <= 65535:
        found.append(ConfigProblem(("compat.port",), f"compat.port = {c.port}: must be 0 (any free port) to 65535"))
    if c.max_inflight < 1:
        found.append(ConfigProblem(("compat.max_inflight",), f"compat.max_inflight = {c.max_inflight}: "
                                   "must be at least 1"))
    if c.max_connections < 1:
        found.append(ConfigProblem(("compat.max_connections",), f"compat.max_connections = {c.max_connections}: "
                                   "must be at least 1"))
    for key in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
        if not (getattr(c, key) > 0 and math.isfinite(getattr(c, key))):
            found.append(ConfigProblem((f"compat.{key}",), f"compat.{key} = {getattr(c, key)}: "
                                       "must be a positive number of seconds"))
    if c.enabled and c.port and c.port == s.port and (c.host or s.host) == s.host:
        found.append(ConfigProblem(("compat.port", "server.port"), f"compat.port = {c.port} is server.port: "
                                   "the compatible routes need a port of their own"))
    return found
