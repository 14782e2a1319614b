"""Protocol v1 messages: the examples of the spec decode and encode as written;
bad frames become errors that name the field."""

import json

import pytest

from completer.engine.sequence import Timings
from completer.protocol import (Cancel, Complete, Done, Error, Feedback, Hello, ModelNames, Ready,
                                decode, encode)

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
    ready = json.loads(encode(Ready(1, "completer/0.1.0", ModelNames("T", "D"))))
    assert ready == {"type": "ready", "protocol": 1, "server": "completer/0.1.0",
                     "model": {"target": "T", "draft": "D"}}
    done = json.loads(encode(Done("42", "stop", "return self._items", Timings(ttft_ms=11.8))))
    assert done["type"] == "done" and done["reason"] == "stop"
    assert set(done["timings"]) == {"queue_ms", "ttft_ms", "total_ms", "prompt_tokens", "cached_tokens",
                                    "generated_tokens", "draft_proposed", "draft_accepted", "draft_rounds",
                                    "prefill"}
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
