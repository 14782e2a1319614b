"""Fuzzing the protocol boundary: whatever a client sends, `decode` answers
it without raising, with the frame's id whenever it can be read; and the real
server answers every frame as docs/protocol.md promises, keeping the
connection, and its neighbour's, going.

The frame generators live in latency_bench/fuzz_frames.py; latency_bench/fuzz.py runs the
same checks over 100,000 frames; here is a bounded run of them.
"""

import json

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings

from completer.protocol import MAX_TOKENS, Error, decode, encode
from latency_bench import fuzz, fuzz_frames
from latency_bench.harness import collect, complete_msg, connect, running_server

# The CI-bounded run: 50 frames of each kind over one connection (~10 s on an
# idle 2-core machine, a minute on a busy one).
SERVER_FRAMES = 500
PROPERTY_SETTINGS = settings(max_examples=300, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def assert_answers_as_its_generator_expects(frame: fuzz_frames.Frame) -> None:
    result = decode(frame.data)
    if frame.valid is True:
        assert not isinstance(result, Error), result
    elif frame.valid is False:
        assert isinstance(result, Error), result
    if isinstance(result, Error):
        assert result.code == frame.code, result
        if frame.id_may_be_lost:
            assert result.id in (None, frame.request_id), result
        else:
            assert result.id == frame.request_id, result
        if frame.names is not None:
            assert frame.names in result.message, result
        assert len(result.message) < 400  # a 4 MB bad value is not sent back
        encode(result)  # sendable: its id and message are valid Unicode


@PROPERTY_SETTINGS
@given(fuzz_frames.frames())
def test_decode_never_raises_and_each_error_carries_the_frames_id_and_names_the_field(frame):
    assert_answers_as_its_generator_expects(frame)


@PROPERTY_SETTINGS
@given(fuzz_frames.messages(MAX_TOKENS))
def test_every_valid_message_decodes_to_itself(message):
    assert decode(json.dumps(msgspec.to_builtins(message))) == message


ANY_CHARACTER = st.characters() | st.integers(0xD800, 0xDFFF).map(chr)  # hypothesis leaves out lone surrogates


@PROPERTY_SETTINGS
@given(st.binary() | st.lists(ANY_CHARACTER).map("".join)
       | st.lists(st.sampled_from(['{"id": "x"', '"type"', ":", ",", "}", "[", "]", "\\ud800", '"', "1e400"]))
       .map("".join))
def test_decode_never_raises_on_any_bytes_or_text(frame):
    result = decode(frame)
    if isinstance(result, Error):
        encode(result)


def test_the_command_draws_every_kind_evenly_and_the_same_frames_for_a_seed():
    frames = fuzz_frames.draw_frames(40, seed=7)
    kinds = {f.kind for f in frames}
    assert kinds == set(fuzz_frames.frame_kinds()), kinds
    assert [f.data for f in fuzz_frames.draw_frames(40, seed=7)] == [f.data for f in frames]
    for frame in frames:
        assert_answers_as_its_generator_expects(frame)


# -- against the real server ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with running_server(*fuzz.SERVER_SETTINGS, token=fuzz.TOKEN) as s:
        yield s


COMPLETE = {"type": "complete", "id": "t", "document": {"uri": "file:///a.py", "prefix": "def f(", "suffix": ""},
            "max_tokens": 2}


async def test_frames_that_closed_the_connection_with_1011_get_an_error_and_it_goes_on(server):
    """Each of these made `decode` raise (or answer without the id) and the
    server closed the connection: now each gets one error and the next frame
    is served."""
    deep = "[" * 1000 + "]" * 1000
    frames = [('{"type": [1], "id": "a"}', "a"), ('{"type": {}}', None), (deep, None),
              ('{"id": "d", "x": ' + deep + "}", "d"),
              (json.dumps(COMPLETE)[:-1] + ', "temperature": 1e400}', "t"),
              (json.dumps(COMPLETE).replace("file:///a.py", "\\ud800"), "t")]
    async with connect(server, token=fuzz.TOKEN) as ws:
        for frame, request_id in frames:
            await ws.send(frame)
            answer = json.loads(await ws.recv())
            assert (answer["type"], answer["id"], answer["code"]) == ("error", request_id, "bad_request"), answer
        await ws.send(complete_msg("after", "def f(x):\n    ", max_tokens=2))
        deltas, done = await collect(ws, "after")
        assert done["type"] == "done" and done["text"] == "".join(deltas)


async def test_fuzzed_frames_each_get_their_documented_answer_and_the_connection_and_a_neighbour_go_on(server):
    frames = fuzz_frames.draw_frames(SERVER_FRAMES, seed=1, max_new_tokens=fuzz.MAX_NEW_TOKENS)

    async def one_batch():
        yield frames

    figures = await fuzz.fuzz_server(server, one_batch(), connections=1)
    assert figures.frames == len(frames)
    assert figures.wrong_answers == 0 and figures.unanswered == 0, figures.examples
    assert figures.connections_lost == 0, figures.examples
    assert figures.neighbour_done > 0 and figures.neighbour_failed == 0, figures.examples
    assert figures.answers_by_kind.get("error:bad_request", 0) > 0 and \
        any(k.startswith("done:") for k in figures.answers_by_kind), figures.answers_by_kind


async def test_fuzzed_http_requests_to_the_compat_routes_each_get_a_status_and_every_error_in_json(server):
    """latency_bench/fuzz_http.py, short: the frames as bodies of the HTTP
    routes, with missing, wrong, non-ASCII keys, foreign hosts and lying lengths."""
    from latency_bench import fuzz_http

    figures = await fuzz_http.fuzz_http(server.compat, 300, seed=2, concurrency=8, batch=300)
    assert figures["problems"] == {}, figures["examples"]
    assert figures["neighbour_done"] > 0 and figures.get("neighbour_failed", 0) == 0, figures
    assert {"200", "400", "401"} <= set(figures["statuses"]), figures["statuses"]
