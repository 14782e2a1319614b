"""Protocol v1 messages: the examples of the spec decode and encode as written;
bad frames become errors that name the field."""

import json

import pytest

from completer.engine.sequence import Timings
from completer.protocol import (MAX_CANDIDATES, MAX_CONTEXT_ITEMS, MAX_DEADLINE_MS, MAX_ID_CHARS, MAX_LANGUAGE_CHARS,
                                MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TOKENS, MAX_URI_CHARS, Cancel, Complete, Done,
                                Error, Feedback, Hello, ModelNames, Ready, RequestDefaults, decode, encode)

COMPLETE = {
    "type": "complete", "id": "42",
    "document": {"uri": "file:///home/me/app/models.py", "language": "python",
                 "prefix": "text before the cursor", "suffix": "text after the cursor"},
    "context": [{"uri": "file:///home/me/app/db.py", "text": "snippet"}],
    "mode": "line", "max_tokens": 64, "temperature": 0.0, "stop": [], "deadline_ms": 1000,
}


def test_client_examples_decode():
    assert decode(json.dumps({"type": "hello", "client": "neovim/0.1.0", "protocol": 1})) == \
        Hello("neovim/0.1.0", 1)
    msg = decode(json.dumps(COMPLETE))
    assert isinstance(msg, Complete) and msg.document.prefix == "text before the cursor"
    assert msg.context[0].text == "snippet" and msg.deadline_ms == 1000
    assert decode('{"type": "cancel", "id": "42"}') == Cancel("42")
    assert decode('{"type": "feedback", "id": "42", "accepted_chars": 17}') == Feedback("42", 17)


def test_defaults_and_unknown_fields():
    minimal = {"type": "complete", "id": "1", "future_field": True,
               "document": {"uri": "u", "prefix": "p", "suffix": "s", "extra": 1}}
    msg = decode(json.dumps(minimal))
    assert isinstance(msg, Complete)
    assert (msg.context, msg.mode, msg.max_tokens, msg.temperature, msg.stop, msg.deadline_ms) == \
        ([], "line", None, 0.0, [], None)
    assert msg.document.language == ""


@pytest.mark.parametrize("frame, rid, code, needle", [
    ({**COMPLETE, "document": {**COMPLETE["document"], "prefix": 5}}, "42", "bad_request", "document.prefix"),
    ({**COMPLETE, "mode": "paragraph"}, "42", "bad_request", "mode"),
    ({"type": "complete", "id": 7}, None, "bad_request", "id"),
    ({"type": "teleport", "id": "9"}, "9", "unsupported", "teleport"),
    ({"id": "3"}, "3", "bad_request", "type"),
    ([1, 2], None, "bad_request", "object"),
])
def test_bad_frames_name_the_problem(frame, rid, code, needle):
    err = decode(json.dumps(frame))
    assert isinstance(err, Error) and err.id == rid and err.code == code
    assert needle in err.message


def test_not_json():
    err = decode("{nope")
    assert isinstance(err, Error) and err.code == "bad_request" and err.id is None


def test_server_messages_encode_as_specified():
    ready = json.loads(encode(Ready(1, "completer/0.1.0", ModelNames("T", "D"), RequestDefaults(2000.0, 64))))
    assert ready == {"type": "ready", "protocol": 1, "server": "completer/0.1.0",
                     "model": {"target": "T", "draft": "D"}, "request": {"deadline_ms": 2000.0, "max_tokens": 64}}
    done = json.loads(encode(Done("42", "stop", "return self._items", Timings(ttft_ms=11.8))))
    assert done["type"] == "done" and done["reason"] == "stop"
    assert set(done["timings"]) == {"queue_ms", "ttft_ms", "total_ms", "prompt_tokens", "cached_tokens",
                                    "generated_tokens", "draft_proposed", "draft_accepted", "draft_rounds",
                                    "prefill", "prefill_reason", "kv_transfer_bytes", "kv_transfer_ms",
                                    "moved_tokens", "prepare_ms", "wait_ms", "prefill_ms", "draft_ms", "decode_ms",
                                    "decode_passes", "first_token_passes"}
    err = json.loads(encode(Error(None, "bad_request", "x")))
    assert err == {"type": "error", "id": None, "code": "bad_request", "message": "x"}


def test_the_wire_schema_and_the_client_import_neither_torch_nor_the_model():
    """Dependencies point inward: an editor-side tool can use the protocol
    types and `python -m completer.client` without the engine's stack."""
    import subprocess
    import sys

    code = ("import sys, completer.client, completer.protocol; "
            "print(' '.join(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'tokenizers') "
            "or m in ('completer.model', 'completer.engine.core', 'completer.training')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported: {done.stdout.strip()}"


# -- regressions: frames that made decode raise, or answered without the id --------------------

def complete_with(**members) -> str:
    return json.dumps({**COMPLETE, **members})


def with_raw(frame: str, member: str, raw_json: str) -> str:
    """`frame` with one more member whose value is written as is (json.dumps cannot write 1e400)."""
    return frame[:-1] + f', "{member}": {raw_json}}}'


@pytest.mark.parametrize("frame, rid", [
    ('{"type": [1], "id": "5"}', "5"),
    ('{"type": {}}', None),
    ('{"type": 7, "id": "x"}', "x"),
    ('{"type": true}', None),
])
def test_a_type_that_is_not_a_string_is_a_bad_request_not_an_exception(frame, rid):
    err = decode(frame)
    assert err == Error(rid, "bad_request", err.message) and "`$.type`" in err.message


@pytest.mark.parametrize("frame, rid", [
    ("[" * 1000 + "]" * 1000, None),
    ('{"a": ' * 1000 + "1" + "}" * 1000, None),
    ('{"id": "d", "type": "complete", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", "d"),
    ('{"type": "complete", "x": ' + '["id", {"id": "inner"},' * 3000 + "]" * 3000 + ', "id": "late\\"q"}', 'late"q'),
    (with_raw(complete_with(), "stop", "[" * 5000 + "]" * 5000), "42"),
])
def test_json_nested_past_the_parsers_depth_is_a_bad_request_that_keeps_the_id(frame, rid):
    err = decode(frame)
    assert isinstance(err, Error) and err.code == "bad_request"
    assert err.id == rid  # read by a scan that does not recurse, wherever the id is among the members


def test_how_deep_the_callers_stack_is_does_not_lose_the_id():
    """The server decodes deep in its event loop: a frame that this test's
    stack decodes can hit the recursion limit there (the 100k fuzz saw it)."""
    frame = with_raw(complete_with(), "stop", "[" * 150 + "]" * 150)

    def nested(levels: int):
        return decode(frame) if levels == 0 else nested(levels - 1)

    for levels in (0, 700, 900):
        err = nested(levels)
        assert isinstance(err, Error) and err.id == "42" and err.code == "bad_request", (levels, err)


@pytest.mark.parametrize("frame", [b"\xff\xfe", b'{"type": "hello", "client": "\xc3\x28"}', b"\xed\xa0\x80",
                                   '{"type": "hello", "client": "\ud800"}', "\udfff", ""])
def test_undecodable_text_is_a_bad_request_not_an_exception(frame):
    err = decode(frame)
    assert isinstance(err, Error) and err.code == "bad_request"
    encode(err)  # nothing of the bad text comes back unsendable


@pytest.mark.parametrize("field, number", [("temperature", "1e400"), ("temperature", "-1e400"),
                                           ("deadline_ms", "1e400"), ("max_tokens", "1e400")])
def test_an_out_of_range_number_keeps_the_id_and_names_the_field(field, number):
    err = decode(with_raw(complete_with(), field, number))
    assert isinstance(err, Error) and (err.id, err.code) == ("42", "bad_request")
    assert f"`$.{field}`" in err.message and "out of range" in err.message, err.message


@pytest.mark.parametrize("path, frame", [
    ("$.document.uri", json.dumps(COMPLETE).replace("file:///home/me/app/models.py", "a\\ud800b")),
    ("$.stop[1]", with_raw(json.dumps({k: v for k, v in COMPLETE.items() if k != "stop"}), "stop",
                           '["ok", "\\udc00"]')),
    ("$.note", with_raw(json.dumps(COMPLETE), "note", '"\\ud83d\\u0041"')),  # unknown fields too
    ("$.document.prefix", json.dumps(COMPLETE).replace("text before the cursor", "\ud800")),  # a str's own
])
def test_a_lone_surrogate_keeps_the_id_and_names_the_field(path, frame):
    err = decode(frame)
    assert isinstance(err, Error) and (err.id, err.code) == ("42", "bad_request")
    assert f"`{path}`" in err.message and "surrogate" in err.message, err.message


def test_an_id_that_is_itself_a_lone_surrogate_is_not_echoed():
    err = decode('{"type": "cancel", "id": "\\ud800"}')
    assert isinstance(err, Error) and err.id is None and "`$.id`" in err.message


def test_a_surrogate_pair_is_a_character_not_an_error():
    msg = decode(json.dumps({**COMPLETE, "stop": ["\U0001f600"]}, ensure_ascii=True))
    assert isinstance(msg, Complete) and msg.stop == ["\U0001f600"]


# -- limits: validated at the boundary, the error naming the field --------------------------------

CONTEXT_ITEM = {"uri": "file:///x.py", "text": "t"}


@pytest.mark.parametrize("members, rid, needle", [
    ({"temperature": 2.000001}, "42", "$.temperature"),
    ({"temperature": -0.5}, "42", "$.temperature"),
    ({"max_tokens": -1}, "42", "$.max_tokens"),
    ({"max_tokens": MAX_TOKENS + 1}, "42", "$.max_tokens"),
    ({"n": 0}, "42", "$.n"),
    ({"n": MAX_CANDIDATES + 1}, "42", "$.n"),
    ({"n": 2.0}, "42", "$.n"),
    ({"supersede": "false"}, "42", "$.supersede"),
    ({"supersede": 0}, "42", "$.supersede"),
    ({"max_tokens": 10**30}, "42", "$.max_tokens"),
    ({"deadline_ms": 0}, "42", "$.deadline_ms"),
    ({"min_token_prob": 1.01}, "42", "$.min_token_prob"),
    ({"min_first_prob": -0.1}, "42", "$.min_first_prob"),
    ({"min_line_prob": "0.5"}, "42", "$.min_line_prob"),
    ({"deadline_ms": -1}, "42", "$.deadline_ms"),
    ({"deadline_ms": MAX_DEADLINE_MS + 0.5}, "42", "$.deadline_ms"),
    ({"id": ""}, "", "$.id"),
    ({"id": "i" * (MAX_ID_CHARS + 1)}, None, "$.id"),  # too long to echo
    ({"document": {**COMPLETE["document"], "uri": "u" * (MAX_URI_CHARS + 1)}}, "42", "$.document.uri"),
    ({"document": {**COMPLETE["document"], "language": "l" * (MAX_LANGUAGE_CHARS + 1)}}, "42",
     "$.document.language"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "42", "$.stop"),
    ({"stop": ["s"] * 100_000}, "42", "$.stop"),
    ({"stop": [""]}, "42", "$.stop[0]"),
    ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "42", "$.stop[0]"),
    ({"context": [CONTEXT_ITEM] * (MAX_CONTEXT_ITEMS + 1)}, "42", "$.context"),
    ({"context": [{"uri": "u" * (MAX_URI_CHARS + 1), "text": ""}]}, "42", "$.context[0].uri"),
])
def test_limits_refuse_with_bad_request_naming_the_field(members, rid, needle):
    err = decode(complete_with(**members))
    assert isinstance(err, Error) and (err.id, err.code) == (rid, "bad_request"), err
    assert f"`{needle}`" in err.message, err.message


def test_feedback_accepted_chars_must_not_be_negative():
    err = decode('{"type": "feedback", "id": "42", "accepted_chars": -1}')
    assert err == Error("42", "bad_request", err.message) and "`$.accepted_chars`" in err.message


def test_the_optional_fields_default_so_older_clients_mean_what_they_meant():
    msg = decode(complete_with())
    assert isinstance(msg, Complete) and (msg.supersede, msg.n) == (True, 1)
    feedback = decode('{"type": "feedback", "id": "42", "accepted_chars": 3}')
    assert isinstance(feedback, Feedback)
    assert (feedback.shown, feedback.typed_chars, feedback.candidate) == (True, 0, 0)
    full = decode('{"type": "feedback", "id": "42", "accepted_chars": 0, "shown": false, "typed_chars": 5, '
                  '"candidate": 3}')
    assert full == Feedback("42", 0, shown=False, typed_chars=5, candidate=3)


@pytest.mark.parametrize("members, needle", [
    ({"typed_chars": -1}, "$.typed_chars"), ({"typed_chars": 1.5}, "$.typed_chars"),
    ({"typed_chars": "3"}, "$.typed_chars"), ({"shown": "yes"}, "$.shown"), ({"shown": 1}, "$.shown"),
    ({"candidate": -1}, "$.candidate"), ({"candidate": MAX_CANDIDATES}, "$.candidate"),
])
def test_feedback_fields_out_of_bounds_name_the_field(members, needle):
    err = decode(json.dumps({"type": "feedback", "id": "42", "accepted_chars": 0, **members}))
    assert isinstance(err, Error) and (err.id, err.code) == ("42", "bad_request"), err
    assert f"`{needle}`" in err.message, err.message


def test_done_carries_candidates_only_when_given():
    timings = Timings(prompt_tokens=3)
    plain = json.loads(encode(Done("42", "stop", "x", timings)))
    assert "candidates" not in plain
    with_none = json.loads(encode(Done("42", "stop", "x", timings, [])))
    assert with_none["candidates"] == []
    assert json.loads(encode(Done("42", "stop", "x", timings, ["y", "z"])))["candidates"] == ["y", "z"]


@pytest.mark.parametrize("members", [
    {"temperature": 0}, {"temperature": 2}, {"temperature": -0.0}, {"temperature": 1e-40},
    {"temperature": 5e-324}, {"max_tokens": 0}, {"max_tokens": 1}, {"max_tokens": MAX_TOKENS},
    {"deadline_ms": MAX_DEADLINE_MS}, {"n": 1}, {"n": MAX_CANDIDATES}, {"supersede": False},
    {"deadline_ms": 5e-324}, {"id": "i" * MAX_ID_CHARS},
    {"document": {**COMPLETE["document"], "uri": "u" * MAX_URI_CHARS, "language": "l" * MAX_LANGUAGE_CHARS}},
    {"stop": ["s" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}, {"context": [CONTEXT_ITEM] * MAX_CONTEXT_ITEMS},
])
def test_values_at_the_limits_decode(members):
    assert isinstance(decode(complete_with(**members)), Complete)


def test_a_long_bad_value_is_cut_from_the_message_but_the_field_is_named():
    err = decode(complete_with(mode="z" * 100_000))
    assert isinstance(err, Error) and err.id == "42" and len(err.message) < 400
    assert err.message.endswith("`$.mode`"), err.message
    err = decode(json.dumps({"type": "t" * 100_000, "id": "42"}))
    assert isinstance(err, Error) and err.code == "unsupported" and len(err.message) < 400
