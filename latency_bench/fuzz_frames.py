"""The frames a broken or hostile client can send, as hypothesis strategies,
each with what its generator knows of the answer it must get. Drawn by
latency_bench/fuzz.py (the long run against the real server) and by
tests/server/test_fuzz.py (property tests of `protocol.decode`, a short run).

Past 300 lines: one strategy per frame kind, each beside the answer it must
get; split, a strategy and its answer would part.
"""

from __future__ import annotations

import functools
import json
import random

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as with_seed

from completer.protocol import (CLIENT_TYPES, MAX_CANDIDATES, MAX_DEADLINE_MS, MAX_ID_CHARS, MAX_TOKENS, Cancel,
                                Complete, ContextItem, Document, Feedback, Hello)


class Frame(msgspec.Struct, frozen=True):
    """One generated frame and what its generator knows about it."""

    kind: str  # the generator that made it (the figures count by it)
    data: str | bytes  # bytes: a binary WebSocket frame (to `decode`, raw bytes)
    valid: bool | None  # `decode` gives a message (True), an error (False), or either (None: nesting)
    request_id: str | None = None  # the id an error answer must carry
    id_may_be_lost: bool = False  # nested past the parser's depth: the error's id may be null
    code: str = "bad_request"  # the error's code, when it is one
    names: str | None = None  # what the error's message must name (a field, "surrogate")


class Verbatim(str):
    """JSON text placed in a frame as written: what json.dumps cannot write
    (1e400, a lone surrogate escape, NaN, 100,000 stop strings)."""


def to_json(value, ascii_only: bool = False) -> str:
    verbatim: list[str] = []

    def placeholders(v):
        if isinstance(v, Verbatim):
            verbatim.append(v)
            return f"\x00verbatim{len(verbatim) - 1}\x00"
        if isinstance(v, dict):
            return {k: placeholders(item) for k, item in v.items()}
        if isinstance(v, list):
            return [placeholders(item) for item in v]
        return v

    text = json.dumps(placeholders(value), ensure_ascii=ascii_only)
    for i, raw in enumerate(verbatim):
        text = text.replace(json.dumps(f"\x00verbatim{i}\x00"), raw, 1)
    return text


# -- messages -----------------------------------------------------------------------

TEXT = st.text(max_size=30)  # any Unicode but surrogates: astral, NUL, non-characters
NASTY_TEXT = st.text(st.sampled_from("a\x00\t\n\u200f\u0301\ufeff\ufffe\uffff\U0001f600\U0010ffff\\\"/"),
                     max_size=30)
IDS = st.text(min_size=1, max_size=16)


def long_text(at_least: int):
    return st.text(min_size=1, max_size=3).map(lambda s: s * (at_least // len(s) + 1))


CONTEXT_ITEMS = st.builds(ContextItem, uri=TEXT, text=TEXT)
# Valid numbers at the edges of their ranges; floats(0, 2) covers the rest.
EDGE_TEMPERATURES = st.sampled_from([0.0, -0.0, 1e-40, 5e-324, 2.0])


@functools.cache  # a strategy is built once: hypothesis checks each new one, slowly
def completes(max_new_tokens: int, short=TEXT, long=st.text(max_size=200)):
    """Valid `complete` messages; `short` for ids, URIs and the like (at most
    30 characters), `long` for the document's text."""
    document = st.builds(Document, uri=short, prefix=long, suffix=long,
                         language=st.sampled_from(["", "python", "rust"]) | short)
    return st.builds(
        Complete, id=IDS | short.filter(bool), document=document, context=st.lists(CONTEXT_ITEMS, max_size=3),
        mode=st.sampled_from(["line", "block", "free"]), max_tokens=st.none() | st.integers(1, max_new_tokens),
        temperature=EDGE_TEMPERATURES | st.floats(0, 2), stop=st.lists(st.text(min_size=1, max_size=8), max_size=4),
        deadline_ms=st.none() | st.sampled_from([5e-324, MAX_DEADLINE_MS]) | st.floats(1, MAX_DEADLINE_MS))


@functools.cache
def messages(max_new_tokens: int, short=TEXT, long=st.text(max_size=200)):
    return st.one_of(completes(max_new_tokens, short, long),
                     st.builds(Hello, client=short, protocol=st.just(1) | st.integers(-2**70, 2**70)),
                     st.builds(Cancel, id=IDS | short.filter(bool)),
                     st.builds(Feedback, id=IDS, accepted_chars=st.integers(0, 2**70)))


KNOWN_KEYS = {"type"} | {f for cls in (Hello, Complete, Cancel, Feedback) for f in cls.__struct_fields__}
NUMBER_EDGES = st.sampled_from(["1e400", "-1e400", "1e-400", "-0.0", "-0", "1" * 400, "-" + "9" * 5000, "5e-324"])
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**100, 2**100) | TEXT | NUMBER_EDGES.map(Verbatim)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
UNKNOWN_MEMBERS = st.dictionaries(TEXT.filter(lambda k: k not in KNOWN_KEYS), JSON_VALUES, max_size=3)


@functools.cache
@st.composite
def valid_frames(draw, max_new_tokens: int, kind: str = "valid", short=TEXT, long=st.text(max_size=200),
                 extra=UNKNOWN_MEMBERS):
    """A message the protocol accepts; unknown members (any JSON, numbers
    beyond float range included) must be ignored."""
    message = draw(messages(max_new_tokens, short, long))
    members = msgspec.to_builtins(message) | draw(extra)
    return Frame(kind, to_json(members, draw(st.booleans())), True, getattr(message, "id", None))


# -- frames one field away from valid -------------------------------------------------

DELETE = object()  # the mutation removes the member
LONE_SURROGATES = st.tuples(TEXT, st.sampled_from(["\\ud800", "\\udbff", "\\udc00", "\\udfff", "\\ud83d\\u0041",
                                                   "\\ude00\\ud83d", "\\ud800\\ud800"]), TEXT).map(
    lambda t: Verbatim(json.dumps(t[0], ensure_ascii=False)[:-1] + t[1] + json.dumps(t[2], ensure_ascii=False)[1:]))
NOT_A_STRING = st.integers() | st.none() | st.lists(st.integers(), max_size=2)
NOT_A_NUMBER = st.none() | st.lists(st.integers(), max_size=2) | TEXT
BAD_IDS = st.just("") | long_text(MAX_ID_CHARS + 1) | NOT_A_STRING | st.just(DELETE)
FLOATS = dict(allow_nan=False, allow_infinity=False)
# (path, bad values, what the error names) for each message type.
MUTATIONS = {
    "complete": [
        (("temperature",), st.floats(max_value=0, exclude_max=True, **FLOATS)
         | st.floats(min_value=2, exclude_min=True, **FLOATS) | st.none() | TEXT, "temperature"),
        (("max_tokens",), st.integers(max_value=-1) | st.integers(MAX_TOKENS + 1, 2**200) | st.just(2.5) | TEXT,
         "max_tokens"),  # 0 is valid: it primes the cache
        (("n",), st.integers(max_value=0) | st.integers(MAX_CANDIDATES + 1, 2**200) | st.just(1.5) | TEXT, "n"),
        (("supersede",), NOT_A_STRING | TEXT, "supersede"),
        (("deadline_ms",), st.floats(max_value=0, **FLOATS) | st.floats(min_value=MAX_DEADLINE_MS, exclude_min=True,
                                                                        **FLOATS) | TEXT, "deadline_ms"),
        (("id",), BAD_IDS, "id"),
        (("document", "uri"), long_text(4097) | NOT_A_STRING, "document.uri"),
        (("document", "language"), long_text(65), "document.language"),
        # A missing member is named alone ("missing required field `prefix` - at `$.document`").
        (("document", "prefix"), NOT_A_STRING | st.just(DELETE), "prefix"),
        (("document",), NOT_A_STRING | TEXT | st.just(DELETE), "document"),
        (("stop",), st.lists(st.text(min_size=1, max_size=4), min_size=17, max_size=30) | st.just([""])
         | long_text(257).map(lambda s: [s]) | TEXT
         | st.integers(17, 100_000).map(lambda n: Verbatim("[" + ",".join(['"s"'] * n) + "]")), "stop"),
        (("context",), CONTEXT_ITEMS.map(lambda c: [msgspec.to_builtins(c)] * 65)
         | long_text(4097).map(lambda uri: [{"uri": uri, "text": ""}]) | TEXT, "context"),
        (("mode",), TEXT.filter(lambda m: m not in ("line", "block", "free")) | NOT_A_STRING, "mode"),
    ],
    "feedback": [(("accepted_chars",), st.integers(max_value=-1) | st.just(1.5) | NOT_A_NUMBER | st.just(DELETE),
                  "accepted_chars"), (("id",), BAD_IDS, "id"),
                 (("typed_chars",), st.integers(max_value=-1) | st.just(1.5) | NOT_A_NUMBER, "typed_chars"),
                 (("shown",), st.integers() | TEXT, "shown")],
    "cancel": [(("id",), BAD_IDS, "id")],
}
NUMBER_MUTATIONS = [  # (field, the number as written, valid?) beyond what a float or the range holds
    ("temperature", "2.0000000000000004", False), ("temperature", "1e400", False), ("temperature", "-1e400", False),
    ("temperature", "-1e-400", True), ("temperature", "1E0", True), ("max_tokens", "1", True),
    ("max_tokens", "-0", True), ("max_tokens", "1" + "0" * 30, False), ("max_tokens", "1e400", False),
    ("max_tokens", "1.0", False), ("deadline_ms", "5e-324", True), ("deadline_ms", "600000", True),
    ("deadline_ms", "600000.0000001", False), ("deadline_ms", "-0.0", False), ("deadline_ms", "1e-400", False),
    ("deadline_ms", "1e400", False),
]


def with_member(members: dict, path: tuple[str, ...], value) -> dict:
    """`members` with the member at `path` set to `value` (or removed: DELETE)."""
    members = dict(members)
    if len(path) > 1:
        members[path[0]] = with_member(members[path[0]], path[1:], value)
    elif value is DELETE:
        members.pop(path[0], None)
    else:
        members[path[0]] = value
    return members


def expected_id(members: dict) -> str | None:
    """The id an error must carry: the frame's, if a string the protocol can echo."""
    value = members.get("id")
    readable = isinstance(value, str) and not isinstance(value, Verbatim) and len(value) <= MAX_ID_CHARS
    return value if readable else None


@st.composite
def near_valid_frames(draw, max_new_tokens: int):
    message = draw(st.one_of(completes(max_new_tokens), st.builds(Cancel, id=IDS),
                             st.builds(Feedback, id=IDS, accepted_chars=st.integers(0, 100))))
    kind = msgspec.to_builtins(message)["type"]
    path, values, field = draw(st.sampled_from(MUTATIONS[kind]))
    members = with_member(msgspec.to_builtins(message), path, draw(values))
    return Frame("near_valid", to_json(members, draw(st.booleans())), False, expected_id(members), names=field)


@st.composite
def numeric_edge_frames(draw, max_new_tokens: int):
    message = draw(completes(max_new_tokens))
    field, number, valid = draw(st.sampled_from(NUMBER_MUTATIONS))
    members = with_member(msgspec.to_builtins(message), (field,), Verbatim(number))
    return Frame("numeric_edge", to_json(members), valid, message.id, names=None if valid else field)


@st.composite
def lone_surrogate_frames(draw, max_new_tokens: int):
    members = msgspec.to_builtins(draw(completes(max_new_tokens)))
    path = draw(st.sampled_from([("id",), ("document", "uri"), ("document", "prefix"), ("mode",), ("stop",),
                                 ("unknown",)]))
    surrogate = draw(LONE_SURROGATES)
    members = with_member(members, path, Verbatim(f"[{surrogate}]") if path == ("stop",) else surrogate)
    return Frame("unicode", to_json(members, draw(st.booleans())), False, expected_id(members), names="surrogate")


# -- frames that are not a message ---------------------------------------------------------

def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


@st.composite
def bad_json_frames(draw, max_new_tokens: int):
    good = draw(valid_frames(max_new_tokens)).data
    spoiled = draw(st.one_of(
        st.text().filter(lambda t: not is_json_object(t)),
        st.integers(0, len(good) - 1).map(lambda cut: good[:cut]),  # no strict prefix of an object is JSON
        st.sampled_from([" x", "}", ",", "{}", "\x00"]).map(lambda junk: good + junk),
        st.just("\ufeff" + good),
        st.sampled_from(["NaN", "-Infinity", "Infinity", "undefined", "'a'", "01", ".5", "+1", "0x10", "1.",
                         '"a\x01b"', '"\\x41"', '"\\u12"', "True"]).map(lambda v: good[:-1] + f', "z": {v}}}')))
    return Frame("bad_json", spoiled, False)


@st.composite
def wrong_type_frames(draw):
    request_id = draw(st.none() | IDS)
    with_id = {} if request_id is None else {"id": request_id}
    frame = draw(st.one_of(
        JSON_VALUES.filter(lambda v: not isinstance(v, dict)).map(
            lambda v: Frame("wrong_type", to_json(v), False, names="object")),
        NOT_A_STRING.map(lambda kind: Frame("wrong_type", to_json({"type": kind, **with_id}), False, request_id,
                                            names="type")),
        st.just(Frame("wrong_type", to_json({"document": {}, **with_id}), False, request_id, names="type")),
        TEXT.filter(lambda t: t not in CLIENT_TYPES).map(
            lambda kind: Frame("wrong_type", to_json({"type": kind, **with_id}), False, request_id,
                               code="unsupported"))))
    return frame


# Strategies made once, at import: valid_frames keeps each strategy it is given.
HUGE_TEXT = st.tuples(st.text(min_size=1, max_size=3), st.integers(2_000, 30_000)).map(lambda t: t[0] * t[1])
HUGE_MEMBERS = (st.integers(20_000, 300_000).map(lambda n: {"unknown": "x" * n})
                | st.integers(1_000, 15_000).map(lambda n: {f"k{i}": i for i in range(n)}))
HUGE_GARBAGE = st.tuples(st.text(min_size=1, max_size=3), st.integers(20_000, 300_000)).map(
    lambda t: t[0] * (t[1] // len(t[0]))).filter(lambda text: not is_json_object(text))


def huge_frames(max_new_tokens: int):
    return (valid_frames(max_new_tokens, "huge", long=HUGE_TEXT, extra=HUGE_MEMBERS)
            | HUGE_GARBAGE.map(lambda text: Frame("huge", text, False)))


@st.composite
def deep_frames(draw, max_new_tokens: int):
    depth = draw(st.integers(1, 5000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
    nested = Verbatim(opener * depth + "0" + closer * depth)
    lost = depth > 200  # past the parser's depth a frame is refused, and its id may not be read
    members = msgspec.to_builtins(draw(completes(max_new_tokens)))
    where = draw(st.sampled_from(["unknown", "stop", "top"]))
    if where == "top":
        return Frame("deep", str(nested), False)
    frame = to_json(with_member(members, (where,), nested))
    if where == "unknown":
        return Frame("deep", frame, None if lost else True, members["id"], id_may_be_lost=lost)
    return Frame("deep", frame, False, members["id"], id_may_be_lost=lost, names=None if lost else "stop")


BAD_UTF8 = st.sampled_from([b"\xff", b"\xfe", b"\x80", b"\xc0\xaf", b"\xc3\x28", b"\xed\xa0\x80",
                            b"\xf4\x90\x80\x80", b"\xe2\x82"])


@st.composite
def invalid_utf8_frames(draw, max_new_tokens: int):
    text = draw(valid_frames(max_new_tokens)).data
    cut = draw(st.integers(0, len(text)))  # between characters: the bad bytes stay bad
    return Frame("invalid_utf8", text[:cut].encode() + draw(BAD_UTF8) + text[cut:].encode(), False)


@functools.cache
def frame_kinds(max_new_tokens: int = MAX_TOKENS) -> dict[str, st.SearchStrategy[Frame]]:
    m = max_new_tokens
    return {
        "valid": valid_frames(m), "near_valid": near_valid_frames(m), "numeric_edge": numeric_edge_frames(m),
        "unicode": valid_frames(m, "unicode", NASTY_TEXT, NASTY_TEXT) | lone_surrogate_frames(m),
        "bad_json": bad_json_frames(m), "wrong_type": wrong_type_frames(), "huge": huge_frames(m),
        "deep": deep_frames(m), "invalid_utf8": invalid_utf8_frames(m),
        "binary": valid_frames(m).map(lambda f: msgspec.structs.replace(f, kind="binary", data=f.data.encode())),
    }


def frames(max_new_tokens: int = MAX_TOKENS) -> st.SearchStrategy[Frame]:
    """Every kind of frame, valid and not."""
    return st.one_of(*frame_kinds(max_new_tokens).values())


def draw_frames(count: int, seed: int, max_new_tokens: int = MAX_TOKENS) -> list[Frame]:
    """`count` frames, as many of each kind (hypothesis's own mix favours a
    few), shuffled; the same ones for the same seed."""
    kinds = list(frame_kinds(max_new_tokens).values())
    drawn: list[Frame] = []
    for i, strategy in enumerate(kinds):
        @with_seed(seed * len(kinds) + i)
        @settings(max_examples=-(-count // len(kinds)), database=None, phases=[Phase.generate], deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def keep(frame: Frame) -> None:
            drawn.append(frame)

        keep()
    random.Random(seed).shuffle(drawn)
    return drawn[:count]
