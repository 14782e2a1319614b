"""The wire protocol, version 1 (docs/protocol.md): every message a msgspec Struct.

Client messages form a tagged union on `type`; decoding validates them,
including the limits below, and a failure becomes an `error` frame that names
the field. Unknown fields are ignored, so newer clients keep working.
`decode` never raises: whatever a client sends, the session has an answer.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from completer.engine.request import Timings

PROTOCOL_VERSION = 1

# Limits on what one frame may ask for. They bound the work and memory a
# single message can cost (100k stop strings stalled the engine; a 60,000-char
# URI went into the prompt uncut) and are far above what an editor sends.
MAX_ID_CHARS = 256
MAX_URI_CHARS = 4096
MAX_LANGUAGE_CHARS = 64
MAX_CONTEXT_ITEMS = 64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOKENS = 4096
MAX_TEMPERATURE = 2.0
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
MAX_DEADLINE_MS = 600_000.0
MAX_CANDIDATES = 4  # `n`: each one more is a sequence decoded beside the first

RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS)]
Uri = Annotated[str, Meta(max_length=MAX_URI_CHARS)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class Document(msgspec.Struct, frozen=True):
    uri: Uri
    prefix: str
    suffix: str
    language: Annotated[str, Meta(max_length=MAX_LANGUAGE_CHARS)] = ""


# Where a context item came from: "" unknown; "open" an open buffer; "visited"
# a recently visited file; "edit" a recently edited range; "yank" yanked or
# copied text; "definition" the definition of a name the document imports or
# uses (the editor's language server, or the server's import resolver).
# Retrieval ranks definitions and recent edits a little ahead.
ContextKind = Literal["", "open", "visited", "edit", "yank", "definition"]


class ContextItem(msgspec.Struct, frozen=True):
    uri: Uri  # its path goes into the prompt, like the document's
    text: str
    kind: ContextKind = ""


# -- client -> server ---------------------------------------------------------

class Hello(msgspec.Struct, tag="hello", tag_field="type", frozen=True):
    client: str = ""
    protocol: int = PROTOCOL_VERSION


class Complete(msgspec.Struct, tag="complete", tag_field="type", frozen=True):
    id: RequestId
    document: Document
    context: Annotated[list[ContextItem], Meta(max_length=MAX_CONTEXT_ITEMS)] = []
    mode: Literal["line", "block", "free"] = "line"
    # None: the server's config; 0: prefill the prompt into the cache, generate
    # nothing (a client warms a file it opened). The bounds also keep out
    # 1e400, which JSON numbers can spell but no float holds.
    max_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)] = 0.0
    stop: Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    deadline_ms: Annotated[float, Meta(gt=0.0, le=MAX_DEADLINE_MS)] | None = None
    # False: requests in flight for the same document go on (a speculative
    # "next line" request sent after an accept must not end the one shown).
    supersede: bool = True
    n: Annotated[int, Meta(ge=1, le=MAX_CANDIDATES)] = 1  # completions wanted; `done.candidates` has the others
    # The root folder (a URI) of the editor workspace the document belongs to: the
    # connection's stored files are candidates only within it, and a server that
    # allows the folder (server.workspace_roots) resolves the document's imports there.
    workspace: Uri = ""
    # The confidence rules (engine.request.Confidence; None: the server's `[request]` default): a token's
    # probability below which nothing is shown (up to the first visible token), the line ends before it (the
    # first line), the block ends before its line (block mode's later lines).
    min_first_prob: Probability | None = None
    min_token_prob: Probability | None = None
    min_line_prob: Probability | None = None
    # An extension: `done.probs` lists each token taken, its text and its probability (as the rules see it).
    probs: bool = False


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", frozen=True):
    id: RequestId


class Feedback(msgspec.Struct, tag="feedback", tag_field="type", frozen=True):
    id: RequestId
    accepted_chars: Annotated[int, Meta(ge=0)]
    shown: bool = True  # False: the completion arrived but was never displayed (neither kept nor dismissed)
    typed_chars: Annotated[int, Meta(ge=0)] = 0  # chars of it the user typed through: kept, not dismissed
    # Which text the feedback is about, with `n` > 1: 0 is `done.text`, i is `done.candidates[i - 1]`.
    candidate: Annotated[int, Meta(ge=0, lt=MAX_CANDIDATES)] = 0


ClientMessage = Hello | Complete | Cancel | Feedback
CLIENT_TYPES = {"hello", "complete", "cancel", "feedback"}

# -- server -> client ---------------------------------------------------------


class ModelNames(msgspec.Struct, frozen=True):
    target: str
    draft: str | None = None


class RequestDefaults(msgspec.Struct, frozen=True, omit_defaults=True):
    """What a request that leaves them out gets (the server's `[request]`): clients time requests by it."""

    deadline_ms: float
    max_tokens: int
    # The deadline of a document's first request on the connection (a cold prefill of all of it).
    first_deadline_ms: float | None = None


class Ready(msgspec.Struct, tag="ready", tag_field="type", frozen=True):
    protocol: int
    server: str
    model: ModelNames
    request: RequestDefaults | None = None


class Delta(msgspec.Struct, tag="delta", tag_field="type", frozen=True):
    id: str
    text: str


class Done(msgspec.Struct, tag="done", tag_field="type", frozen=True, omit_defaults=True):
    id: str
    reason: Literal["stop", "length", "eos", "cancelled", "deadline"]
    text: str
    timings: Timings
    # Only when the request asked for `n` > 1 (so older clients never see it):
    # the other completions, most likely first token first; maybe fewer than n - 1.
    candidates: list[str] | None = None
    # An extension (`server.client_hold`): wait this long after a keystroke before the next `complete`;
    # 0 (ask at once) unless other clients share a loaded engine (server/hold.py). Absent: the server does not say.
    hold_ms: float | None = None
    # An extension: the confidence rule that ended the text (docs/protocol.md): "first" (nothing shown: the
    # model was unsure from the start), "token" (the line ends where it became unsure), "line" (a block's).
    cut: Literal["first", "token", "line"] | None = None
    # An extension, only when the request asked (`probs`): [text, probability] of each token taken, in order;
    # their texts joined begin as `text` does (a trimmed end may leave some out of it).
    probs: list[tuple[str, float]] | None = None


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
    if isinstance(frame, (bytes, bytearray, memoryview)):
        try:
            frame = bytes(frame).decode("utf-8")
        except UnicodeDecodeError as e:
            return Error(None, "bad_request", f"the frame is not valid UTF-8 (byte {e.start})")
    try:
        return _decoder.decode(frame)
    except msgspec.DecodeError as e:  # malformed JSON, or a field that breaks the schema
        problem = _reworded(str(e))
    except UnicodeEncodeError:  # a str with a lone surrogate (a caller's; a WebSocket text frame cannot hold one)
        problem = "the frame holds a lone UTF-16 surrogate, which is not valid Unicode"
    except RecursionError:  # msgspec recurses once per level of nesting, up to Python's limit
        return Error(_readable_id(_top_level_id(frame)), "bad_request", _TOO_DEEP)
    return _answer_to_bad_frame(frame, problem)


# -- answering a frame that did not decode --------------------------------------
#
# The answer carries the frame's `id` whenever one can be read, so that the
# client can tie it to its request, and its message names the field at fault.

_TOO_DEEP = "the frame nests JSON too deeply (keep it under a few hundred levels)"
_MAX_MESSAGE_CHARS = 300  # msgspec quotes the bad value; a 4 MB one need not come back
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")
_SURROGATE_IN_FRAME = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|[\ud800-\udfff]")


class _Envelope(msgspec.Struct):
    """The two members an error answer needs, undecoded (a Raw holds their
    JSON text); every other member is skipped without being parsed, so out of
    range numbers elsewhere do not stop us reading the id."""

    type: msgspec.Raw = msgspec.Raw()
    id: msgspec.Raw = msgspec.Raw()


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_JSON_KINDS = {"{": "an object", "[": "an array", '"': "a string", "t": "a boolean", "f": "a boolean",
               "n": "null"}


def _answer_to_bad_frame(frame: str, problem: str) -> Error:
    try:
        envelope = _envelope_decoder.decode(frame)
    except msgspec.ValidationError:  # well-formed JSON, but not an object
        return Error(None, "bad_request", "the frame is not a JSON object")
    except (msgspec.DecodeError, UnicodeEncodeError):
        return _answer_to_malformed_frame(frame, problem)
    except RecursionError:
        return Error(_readable_id(_top_level_id(frame)), "bad_request", _TOO_DEEP)
    request_id = _readable_id(_json_string(envelope.id))
    kind_json = bytes(envelope.type)
    if kind_json in (b"", b"null"):
        return Error(request_id, "bad_request", "the message has no `type`")
    kind = _json_string(envelope.type)
    if kind is None:
        what = _JSON_KINDS.get(kind_json[:1].decode(), "a number")
        return Error(request_id, "bad_request", f"`type` must be a string, not {what} - at `$.type`")
    if kind not in CLIENT_TYPES:
        return Error(request_id, "unsupported", _shortened(f"unknown message type {kind!r}"))
    return Error(request_id, "bad_request", problem)


def _answer_to_malformed_frame(frame: str, problem: str) -> Error:
    """msgspec refuses lone UTF-16 surrogates (`"\\ud800"`) as malformed JSON;
    Python's parser reads them, so we can still name the field and the id.
    It is only asked when the frame has a surrogate: it is slower than msgspec."""
    if _SURROGATE_IN_FRAME.search(frame):
        try:
            # The values do not matter here: parse_int=float spares Python's
            # 4300-digit limit on ints; NaN and Infinity are not JSON.
            value = json.loads(frame, parse_int=float, parse_constant=_refuse)
        except (ValueError, RecursionError):
            value = None
        if value is not None and not isinstance(value, dict):
            return Error(None, "bad_request", "the frame is not a JSON object")
        if value is not None and (path := _lone_surrogate_path(value)) is not None:
            request_id = value.get("id")
            return Error(_readable_id(request_id if isinstance(request_id, str) else None), "bad_request",
                         f"a string holds a lone UTF-16 surrogate, which is not valid Unicode - at `{path}`")
    return Error(None, "bad_request", f"the frame is not valid JSON: {problem}")


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _json_string(raw: msgspec.Raw) -> str | None:
    """The string that the JSON text `raw` spells, or None when it is not a string."""
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw, type=str)
    except msgspec.DecodeError:
        return None


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[{]+|[\]}]+|[^"\[\]{}]+', re.DOTALL)


def _top_level_id(frame: str) -> str | None:
    """The `id` member of a frame nested too deeply for a parser that
    recurses (msgspec, Python's json): one pass over its strings and runs of
    brackets, reading the string value of `"id":` at the object's own level."""
    depth, at, key = 0, 0, None
    while (m := _JSON_TOKEN.match(frame, at)) is not None:
        token, at = m.group(), m.end()
        if token[0] == '"':
            if depth == 1 and key == '"id"':
                return _json_string(msgspec.Raw(token.encode()))
            key = token if depth == 1 and frame[at: at + 64].lstrip()[:1] == ":" else None
        elif token[0] in "[{":
            depth, key = depth + len(token), None
        elif token[0] in "]}":
            depth, key = depth - len(token), None
        elif token.strip(" \t\r\n:"):  # a number, a literal, a comma: not the key's string value
            key = None
    return None


def _readable_id(request_id: str | None) -> str | None:
    """An id we can echo: a string short enough for the protocol, valid Unicode."""
    if request_id is None or len(request_id) > MAX_ID_CHARS or _LONE_SURROGATE.search(request_id):
        return None
    return request_id


def _lone_surrogate_path(value: dict) -> str | None:
    """Where (`$.document.uri`) a string or key with a lone surrogate is. A
    loop with a stack, not recursion: the value may nest deeply."""
    pending: list[tuple[str, dict | list]] = [("$", value)]
    while pending:
        path, container = pending.pop()
        members = container.items() if isinstance(container, dict) else enumerate(container)
        for key, item in members:
            if (isinstance(key, str) and _LONE_SURROGATE.search(key)) or \
                    (isinstance(item, str) and _LONE_SURROGATE.search(item)):
                return _member_path(path, key)
            if isinstance(item, (dict, list)):
                pending.append((_member_path(path, key), item))
    return None


def _member_path(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    # Surrogates escaped, so that the message can be sent; cut short.
    return f"{path}.{_shortened(key.encode('utf-8', 'backslashreplace').decode('utf-8'), 64)}"


def _reworded(problem: str) -> str:
    """msgspec's message with its range error made plain, and a long quoted
    value cut short (the field it names kept)."""
    problem = problem.replace("Number out of range", "Number out of range (not a finite 64-bit number)", 1)
    what, at, where = problem.rpartition(" - at `")
    return _shortened(what) + at + where if at else _shortened(problem)


def _shortened(text: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
