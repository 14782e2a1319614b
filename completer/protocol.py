"""The wire protocol, version 1 (docs/protocol.md): every message a msgspec Struct.

Client messages form a tagged union on `type`; decoding validates them, and a
failure becomes an `error` frame that names the field. Unknown fields are
ignored, so newer clients keep working.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from completer.engine.request import Timings

PROTOCOL_VERSION = 1


class Document(msgspec.Struct, frozen=True):
    uri: str
    prefix: str
    suffix: str
    language: str = ""


class ContextItem(msgspec.Struct, frozen=True):
    uri: str
    text: str


# -- client -> server ---------------------------------------------------------

class Hello(msgspec.Struct, tag="hello", tag_field="type", frozen=True):
    client: str = ""
    protocol: int = PROTOCOL_VERSION


class Complete(msgspec.Struct, tag="complete", tag_field="type", frozen=True):
    id: str
    document: Document
    context: list[ContextItem] = []
    mode: Literal["line", "block", "free"] = "line"
    max_tokens: int | None = None  # None: the server's config
    temperature: float = 0.0
    stop: list[str] = []
    deadline_ms: float | None = None  # None: the server's config


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", frozen=True):
    id: str


class Feedback(msgspec.Struct, tag="feedback", tag_field="type", frozen=True):
    id: str
    accepted_chars: int


ClientMessage = Hello | Complete | Cancel | Feedback
CLIENT_TYPES = {"hello", "complete", "cancel", "feedback"}

# -- server -> client ---------------------------------------------------------


class ModelNames(msgspec.Struct, frozen=True):
    target: str
    draft: str | None = None


class Ready(msgspec.Struct, tag="ready", tag_field="type", frozen=True):
    protocol: int
    server: str
    model: ModelNames


class Delta(msgspec.Struct, tag="delta", tag_field="type", frozen=True):
    id: str
    text: str


class Done(msgspec.Struct, tag="done", tag_field="type", frozen=True):
    id: str
    reason: Literal["stop", "length", "eos", "cancelled", "deadline"]
    text: str
    timings: Timings


ErrorCode = Literal["bad_request", "unsupported", "too_large", "overloaded", "internal"]


class Error(msgspec.Struct, tag="error", tag_field="type", frozen=True):
    id: str | None
    code: ErrorCode
    message: str


ServerMessage = Ready | Delta | Done | Error

_decoder = msgspec.json.Decoder(ClientMessage)
_encoder = msgspec.json.Encoder()


def encode(message: ServerMessage) -> str:
    return _encoder.encode(message).decode()


def decode(frame: str | bytes) -> ClientMessage | Error:
    """A client frame as its message, or the `error` to answer it with."""
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:
        problem = str(e)
    try:
        raw = msgspec.json.decode(frame)
    except msgspec.DecodeError:
        return Error(None, "bad_request", f"frame is not a JSON object: {problem}")
    if not isinstance(raw, dict):
        return Error(None, "bad_request", "frame is not a JSON object")
    request_id = raw.get("id") if isinstance(raw.get("id"), str) else None
    kind = raw.get("type")
    if kind is None:
        return Error(request_id, "bad_request", "message has no `type`")
    if kind not in CLIENT_TYPES:
        return Error(request_id, "unsupported", f"unknown message type {kind!r}")
    return Error(request_id, "bad_request", problem)
