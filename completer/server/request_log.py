"""One JSON line per finished request (`server.request_log`): when it
arrived, where from, how it ended and where its time went (the engine's
`Timings`), never its text. What an operator reads to see why a keystroke
was slow, as llama-server's log prints each request's timings; the
benchmarks join it with an editor's key times (latency_bench/llama_vim.py).
The file is the server user's alone (0600): it names clients' addresses."""

from __future__ import annotations

import os
import time

import msgspec

from completer.config import ConfigError
from completer.engine.request import Timings


class RequestRecord(msgspec.Struct):
    arrived: float  # Unix time its door read it
    id: str
    route: str  # "ws", "infill", "completion", ...
    client: str  # who sent it (the engine's fairness key: a connection, or an address and slot)
    reason: str  # how it ended: the door's reason where the door ended it
    priming: bool
    timings: Timings


class RequestLog:
    def __init__(self, path: str):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            raise ConfigError(f"server.request_log = {path!r}: cannot open it: {e.strerror}") from None
        self.file = os.fdopen(fd, "ab", buffering=0)
        self.encoder = msgspec.json.Encoder()

    def write(self, received: float, request_id: str, route: str, client: str, reason: str, priming: bool,
              timings: Timings) -> None:
        """`received`: time.perf_counter() when the request's door read it."""
        arrived = time.time() - (time.perf_counter() - received)
        record = RequestRecord(arrived, request_id, route, client, reason, priming, timings)
        self.file.write(self.encoder.encode(record) + b"\n")

    def close(self) -> None:
        self.file.close()
