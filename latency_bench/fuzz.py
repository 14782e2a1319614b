"""Protocol fuzzing: the frames a broken or hostile client can send, and a
long run of them against the real server.

    python latency_bench/fuzz.py --frames 100000 [--json out.json]

starts `completer serve --model embedded` on an ephemeral port, sends the
frames over a few connections while another session keeps completing, checks
that each frame gets the answer docs/protocol.md promises, and prints figures:
frames sent and answers by kind, frames left unanswered or answered wrongly,
connections lost, wall time, the server's RSS before and after. It exits 1
when any frame was answered wrongly or not at all, or a connection was lost.
Two things close a connection by design and are left out: invalid UTF-8 goes
in binary frames (in a text frame it closes with 1007), and no frame is larger
than `server.max_frame_bytes` (1009).

The generators are hypothesis strategies; tests/test_fuzz.py draws from these
same ones (property tests of `protocol.decode`, and a short run of this one).
One file past 300 lines on purpose: the generators, the answer checks and the
command are what the test and the long run share, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Literal

import hypothesis.strategies as st
import msgspec
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as with_seed
from websockets.exceptions import ConnectionClosed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from server_harness import ServerProcess, collect, complete_msg, connect, running_server  # noqa: E402

from completer.protocol import (CLIENT_TYPES, MAX_DEADLINE_MS, MAX_ID_CHARS, MAX_TOKENS,  # noqa: E402
                                PROTOCOL_VERSION, Cancel, Complete, ContextItem, Document, Error, Feedback, Hello,
                                decode)

TOKEN = "fuzz-token-0123456789abcdef"  # the server wants 16 characters or more
# The run is about the protocol, not the model: few tokens, a short window
# (a huge document costs one cheap prefill), deadlines that are never hit.
SERVER_SETTINGS = ("request.deadline_ms=60000", "request.max_tokens=4", "model.context_tokens=256")
MAX_NEW_TOKENS = 4  # what a served frame may ask for


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
BAD_IDS = st.just("") | long_text(MAX_ID_CHARS + 1) | NOT_A_STRING | st.just(DELETE)
FLOATS = dict(allow_nan=False, allow_infinity=False)
# (path, bad values, what the error names) for each message type.
MUTATIONS = {
    "complete": [
        (("temperature",), st.floats(max_value=0, exclude_max=True, **FLOATS)
         | st.floats(min_value=2, exclude_min=True, **FLOATS) | st.none() | TEXT, "temperature"),
        (("max_tokens",), st.integers(max_value=0) | st.integers(MAX_TOKENS + 1, 2**200) | st.just(2.5) | TEXT,
         "max_tokens"),
        (("deadline_ms",), st.floats(max_value=0, **FLOATS) | st.floats(min_value=MAX_DEADLINE_MS, exclude_min=True,
                                                                        **FLOATS) | TEXT, "deadline_ms"),
        (("id",), BAD_IDS, "id"),
        (("document", "uri"), long_text(4097) | NOT_A_STRING, "document.uri"),
        (("document", "language"), long_text(65), "document.language"),
        (("document", "prefix"), NOT_A_STRING | st.just(DELETE), "document.prefix"),
        (("document",), NOT_A_STRING | TEXT | st.just(DELETE), "document"),
        (("stop",), st.lists(st.text(min_size=1, max_size=4), min_size=17, max_size=30) | st.just([""])
         | long_text(257).map(lambda s: [s]) | TEXT
         | st.integers(17, 100_000).map(lambda n: Verbatim("[" + ",".join(['"s"'] * n) + "]")), "stop"),
        (("context",), CONTEXT_ITEMS.map(lambda c: [msgspec.to_builtins(c)] * 65)
         | long_text(4097).map(lambda uri: [{"uri": uri, "text": ""}]) | TEXT, "context"),
        (("mode",), TEXT.filter(lambda m: m not in ("line", "block", "free")) | NOT_A_STRING, "mode"),
    ],
    "feedback": [(("accepted_chars",), st.integers(max_value=-1) | st.just(1.5) | NOT_A_STRING | st.just(DELETE),
                  "accepted_chars"), (("id",), BAD_IDS, "id")],
    "cancel": [(("id",), BAD_IDS, "id")],
}
NUMBER_MUTATIONS = [  # (field, the number as written, valid?) beyond what a float or the range holds
    ("temperature", "2.0000000000000004", False), ("temperature", "1e400", False), ("temperature", "-1e400", False),
    ("temperature", "-1e-400", True), ("temperature", "1E0", True), ("max_tokens", "1", True),
    ("max_tokens", "-0", False), ("max_tokens", "1" + "0" * 30, False), ("max_tokens", "1e400", False),
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


# -- against the real server ---------------------------------------------------------------

class Expected(msgspec.Struct, frozen=True):
    # "either": a stream, or an error whose id may be null. Near the parser's
    # depth whether a frame decodes depends on how deep the caller's stack
    # already is (msgspec counts Python's recursion limit): the server, deep
    # in its event loop, refuses at ~990 levels what this process decodes.
    what: Literal["error", "ready", "stream", "either", "nothing"]
    id: str | None = None
    code: str | None = None


def expected_answer(frame: Frame) -> Expected:
    """What docs/protocol.md promises for `frame` (test_fuzz.py checks that
    `decode`, used here, answers as the generators expect)."""
    if isinstance(frame.data, bytes):
        return Expected("error", None, "bad_request")  # a binary frame, whatever it holds
    message = decode(frame.data)
    if isinstance(message, Error):
        return Expected("error", message.id, message.code)
    if isinstance(message, Complete):
        return Expected("either" if frame.valid is None else "stream", message.id)
    if isinstance(message, Hello):
        return Expected("ready") if message.protocol == PROTOCOL_VERSION else Expected("error", None, "unsupported")
    return Expected("nothing")  # cancel (of nothing in flight), feedback


async def exchange(ws, frame: Frame, expected: Expected, probe_id: str, timeout: float) -> list[dict]:
    """Send `frame`, then a probe the server answers with an error carrying
    `probe_id`. A session handles frames in order, so what arrives before the
    probe's answer is the frame's; only a stream's end may come after it."""
    await ws.send(frame.data)
    await ws.send(json.dumps({"type": "fuzz-probe", "id": probe_id}))
    answers: list[dict] = []
    probe_answered, streaming = False, expected.what in ("stream", "either")
    while not probe_answered or streaming:
        message = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if message.get("id") == probe_id and message.get("type") == "error":
            probe_answered = True
            continue
        answers.append(message)
        ends = message.get("type") in ("done", "error") and (
            message.get("id") == expected.id or expected.what == "either" and message.get("id") is None)
        if streaming and ends:
            streaming = False
    return answers


def wrong_answer(expected: Expected, answers: list[dict]) -> str | None:
    """How `answers` differ from what was promised; None when they do not."""
    if expected.what == "nothing":
        return f"expected no answer, got {answers}" if answers else None
    if expected.what == "ready":
        return None if [a["type"] for a in answers] == ["ready"] else f"expected ready, got {answers}"
    if expected.what == "error":
        ok = len(answers) == 1 and answers[0]["type"] == "error" and \
            (answers[0]["id"], answers[0]["code"]) == (expected.id, expected.code)
        return None if ok else f"expected one error (id {expected.id!r}, {expected.code}), got {answers}"
    if expected.what == "either" and [(a["type"], a["id"]) for a in answers] == [("error", None)]:
        return None if answers[0]["code"] == "bad_request" else f"expected bad_request, got {answers}"
    *deltas, last = answers or [{}]
    if any(d.get("type") != "delta" or d.get("id") != expected.id for d in deltas):
        return f"expected deltas of {expected.id!r}, got {answers}"
    if last.get("id") != expected.id or last.get("type") not in ("done", "error"):
        return f"expected one done or error for {expected.id!r}, got {answers}"
    if last["type"] == "done" and last["text"] != "".join(d["text"] for d in deltas):
        return f"done's text is not the deltas joined: {answers}"
    if last["type"] == "error" and last["code"] == "internal":
        return f"internal error: {last['message']}"
    return None


class Figures(msgspec.Struct):
    command: str = ""
    frames: int = 0
    sent_by_kind: dict[str, int] = {}
    answers_by_kind: dict[str, int] = {}  # "error:bad_request", "done:length", "delta", ...
    unanswered: int = 0  # no answer (or no probe's answer) within the timeout, or the connection closed first
    wrong_answers: int = 0
    examples: list[str] = []  # the first few unanswered or wrong ones
    connections_lost: int = 0
    neighbour_done: int = 0  # another session's completions while the fuzz ran
    neighbour_failed: int = 0
    wall_s: float = 0.0
    server_rss_mb_before: float | None = None
    server_rss_mb_after: float | None = None
    remark: str = ""  # why this run was made (--remark), for RELIABILITY.md

    def note(self, frame: Frame, problem: str) -> None:
        if len(self.examples) < 20:
            self.examples.append(f"{frame.kind} {frame.data[:200]!r}: {problem[:500]}")

    def broken(self) -> bool:
        return bool(self.unanswered or self.wrong_answers or self.connections_lost or self.neighbour_failed
                    or not self.neighbour_done)


async def fuzz_connection(server: ServerProcess, queue: asyncio.Queue, figures: Figures, name: str,
                          timeout: float) -> None:
    """Send the queue's frames over one connection, one after the other,
    checking each answer; a lost connection is counted and opened again."""
    ws = await connect(server, token=TOKEN)
    number = 0
    while (frame := await queue.get()) is not None:
        number += 1
        figures.sent_by_kind[frame.kind] = figures.sent_by_kind.get(frame.kind, 0) + 1
        try:
            expected = expected_answer(frame)
        except Exception as e:  # decode raised, the bug this hunts: the server's answer will show it too
            figures.note(frame, f"decode raised {e!r}")
            expected = Expected("error", None, "bad_request")
        try:
            answers = await exchange(ws, frame, expected, f"fuzz-probe-{name}-{number}", timeout)
        except (asyncio.TimeoutError, ConnectionClosed) as e:
            figures.unanswered += 1
            figures.connections_lost += isinstance(e, ConnectionClosed)
            figures.note(frame, f"no answer: {e!r}")
            await ws.close()
            ws = await connect(server, token=TOKEN)  # what is left on the old one would muddle the next
            continue
        for a in answers:
            key = a["type"] + {"error": f":{a.get('code')}", "done": f":{a.get('reason')}"}.get(a["type"], "")
            figures.answers_by_kind[key] = figures.answers_by_kind.get(key, 0) + 1
        if (problem := wrong_answer(expected, answers)) is not None:
            figures.wrong_answers += 1
            figures.note(frame, problem)
    try:  # after all that, still open and answering
        await ws.send(json.dumps({"type": "hello", "protocol": PROTOCOL_VERSION}))
        assert json.loads(await asyncio.wait_for(ws.recv(), timeout))["type"] == "ready"
    except (asyncio.TimeoutError, ConnectionClosed, AssertionError) as e:
        figures.connections_lost += 1
        figures.examples.append(f"the connection did not answer after its frames: {e!r}")
    await ws.close()


async def neighbour(server: ServerProcess, stop: asyncio.Event, figures: Figures) -> None:
    """Another editor that keeps completing while the fuzz runs."""
    ws = await connect(server, token=TOKEN)
    while not stop.is_set():
        request_id = f"n{figures.neighbour_done + figures.neighbour_failed}"
        try:
            await ws.send(complete_msg(request_id, "def total(items):\n    result = 0\n    ", mode="free",
                                       max_tokens=MAX_NEW_TOKENS))
            deltas, done = await asyncio.wait_for(collect(ws, request_id), 120)
        except (asyncio.TimeoutError, ConnectionClosed) as e:
            figures.neighbour_failed += 1
            figures.examples.append(f"neighbour: {e!r}")
            await ws.close()
            ws = await connect(server, token=TOKEN)
            continue
        if done["type"] == "done" and done["text"] == "".join(deltas):
            figures.neighbour_done += 1
        else:
            figures.neighbour_failed += 1
            figures.examples.append(f"neighbour: {done}")
    await ws.close()


async def fuzz_server(server: ServerProcess, batches: AsyncIterator[list[Frame]], connections: int = 1,
                      timeout: float = 60.0, progress: bool = False) -> Figures:
    """Send every frame of `batches` over `connections` connections while a
    neighbour session completes; the figures of it all."""
    figures, stop = Figures(), asyncio.Event()
    queue: asyncio.Queue[Frame | None] = asyncio.Queue(maxsize=4 * connections)
    started = time.perf_counter()

    async def feed() -> None:
        async for batch in batches:
            for frame in batch:
                await queue.put(frame)
                figures.frames += 1
            if progress:
                print(f"{figures.frames} frames sent, {time.perf_counter() - started:.0f} s, "
                      f"{figures.wrong_answers + figures.unanswered} answered wrongly or not", file=sys.stderr)
        for _ in range(connections):
            await queue.put(None)

    neighbour_task = asyncio.create_task(neighbour(server, stop, figures))
    tasks = [asyncio.create_task(feed())] + [
        asyncio.create_task(fuzz_connection(server, queue, figures, str(n), timeout)) for n in range(connections)]
    try:  # a task that fails ends the run (the feeder would otherwise wait on a full queue forever)
        await asyncio.gather(*tasks)
        stop.set()
        await neighbour_task
    finally:
        for task in [neighbour_task, *tasks]:
            task.cancel()
    figures.wall_s = round(time.perf_counter() - started, 1)
    return figures


# -- the command -------------------------------------------------------------------------------

async def generated_batches(frames: int, seed: int, batch: int) -> AsyncIterator[list[Frame]]:
    """Batches of frames drawn in another process (hypothesis is slow: ~5 ms a
    frame), the next one while this one is sent."""
    loop = asyncio.get_running_loop()
    sizes = [min(batch, frames - start) for start in range(0, frames, batch)]
    with ProcessPoolExecutor(max_workers=1) as pool:
        pending = [loop.run_in_executor(pool, draw_frames, size, seed + i, MAX_NEW_TOKENS)
                   for i, size in enumerate(sizes[:2])]
        for i in range(len(sizes)):
            drawn = await pending[i]
            if i + 2 < len(sizes):
                pending.append(loop.run_in_executor(pool, draw_frames, sizes[i + 2], seed + i + 2, MAX_NEW_TOKENS))
            yield drawn


def rss_mb(server: ServerProcess) -> float:
    import psutil  # the command's alone: the test extra does not install it

    return round(psutil.Process(server.proc.pid).memory_info().rss / 2**20, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frames", type=int, default=100_000)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1000, help="frames drawn at a time")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--remark", default="", help="why this run was made (shown in RELIABILITY.md)")
    args = ap.parse_args()
    with running_server(*SERVER_SETTINGS, token=TOKEN) as server:
        before = rss_mb(server)
        figures = asyncio.run(fuzz_server(server, generated_batches(args.frames, args.seed, args.batch),
                                          args.connections, progress=True))
        figures.server_rss_mb_before, figures.server_rss_mb_after = before, rss_mb(server)
    shown = [a for a, before in zip(sys.argv[1:], ["", *sys.argv[1:]]) if "--remark" not in (a, before)]
    figures.command = "python latency_bench/fuzz.py " + " ".join(shown)
    figures.remark = args.remark
    report = msgspec.json.format(msgspec.json.encode(figures))
    print(report.decode())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(report)
    return 1 if figures.broken() else 0


if __name__ == "__main__":
    sys.exit(main())
