"""The llama.cpp- and OpenAI-compatible routes (`[compat]`), over real HTTP
to the real `completer serve`: the request bodies llama.vim, llama.vscode,
Continue and Tabby send (written from their documented wire shapes; the
notes are in docs/compat_api.md), the shapes they read back, warm
keystrokes, a client that disconnects mid-generation, the token, Origin,
Host and size checks. Then the pieces that need no server."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time

import pytest

from completer.engine.request import Timings
from completer.server.compat.generation import Budget, indent_end
from completer.server.compat.raw_prompt import split_prompt
from completer.server.compat.shapes import LlamaTimings
from completer.server.security import api_key_matches
from latency_bench.harness import TOKEN, collect, complete_msg, connect, running_server, scrape
from support.compat_http import AUTH, call

BLOCK = 16  # engine.block_size, set for the server below
FRAME_LIMIT = 262_144  # server.max_frame_bytes: the request body's limit
CHARS_LIMIT = 100_000  # server.max_document_chars

PREFIX = "import math\n\n\ndef distance(a, b):\n    dx = a.x - b.x\n    dy = a.y - b.y\n"
SUFFIX = "\n\ndef area(r):\n    return math.pi * r * r\n"
EXTRA = [{"text": "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
                  "    def norm(self):\n        return math.hypot(self.x, self.y)\n",
          "time": [1700000000, 512345], "filename": "geometry/point.py"},
         {"text": "def midpoint(a, b):\n    return Point((a.x + b.x) / 2, (a.y + b.y) / 2)\n",
          "time": [1700000003, 1], "filename": "geometry/ops.py"}]
# llama.vim's response_fields: what its info line and its cache read.
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
QWEN_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
              "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>", "\n\n"]


def vim_fim(prefix: str, line: str, suffix: str, **changes) -> dict:
    """llama.vim's main request (llama#fim): the lines before the cursor, the
    cursor line's text before it as `prompt`, the rest as input_suffix."""
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": EXTRA, "prompt": line,
            "n_predict": 128, "stop": [], "n_indent": len(line) - len(line.lstrip(" \t")), "top_k": 40,
            "top_p": 0.9, "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": VIM_FIELDS, "model": "",
            **changes}


def vim_ring_warmup(extra: list[dict]) -> dict:
    """llama.vim's ring-buffer update: the extra context alone, prefilled and kept."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


@pytest.fixture(scope="module")
def server():
    # A long deadline: a request the server failed to cancel would still be running when checked.
    with running_server("compat.port=0", "compat.max_inflight=2", "request.deadline_ms=120000",
                        f"engine.block_size={BLOCK}", f"server.max_frame_bytes={FRAME_LIMIT}",
                        f"server.max_document_chars={CHARS_LIMIT}") as s:
        found = [m for line in s.log if (m := re.search(r"compat API .* on http://127\.0\.0\.1:(\d+)", line))]
        assert found, "".join(s.log)
        s.compat = int(found[0].group(1))
        yield s


# -- llama.cpp routes -----------------------------------------------------

def test_infill_as_llama_vim_sends_it_answers_one_compact_line_with_the_fields_asked(server):
    reply = call(server.compat, "POST", "/infill", vim_fim(PREFIX, "    ", SUFFIX))
    assert reply.status == 200, reply.raw
    text = reply.raw.decode()
    # llama.vim keeps a body only if it matches these (Vim regexes, here in Python's words).
    assert re.match(r"^\s*{", text) and re.search(r'"content"\s*:"', text), text
    assert "\n" not in text and "NaN" not in text and "Infinity" not in text
    body = reply.json()
    assert set(body) == set(VIM_FIELDS)  # flattened: "timings/prompt_n" is a key
    assert isinstance(body["content"], str) and body["content"].strip()
    assert body["tokens_cached"] >= body["timings/prompt_n"] + body["timings/predicted_n"] > 0
    assert body["truncated"] is False


def test_a_ring_warmup_primes_the_context_and_the_next_keystroke_finds_it_cached(server):
    extra = [{"text": f"def helper_{i}(value):\n    return value * {i} + {i * 7}\n", "filename": f"lib/h{i}.py"}
             for i in range(12)]
    warmup = call(server.compat, "POST", "/infill", vim_ring_warmup(extra))
    assert warmup.status == 200 and warmup.raw == b"{}"  # response_fields [""]: llama.cpp's {}
    # The same warm-up again, this time asking for the figures: all of it was cached.
    again = call(server.compat, "POST", "/infill", {**vim_ring_warmup(extra), "response_fields": None}).json()
    assert again["content"] == "" and again["tokens_predicted"] == 0 and again["stop_type"] == "limit"
    primed = again["tokens_evaluated"]
    assert primed > 100, again  # the chunks are in the warm-up's prompt, in order, as llama.cpp places them
    assert again["timings"]["cache_n"] >= primed - BLOCK
    keystroke = call(server.compat, "POST", "/infill",
                     {**vim_fim(PREFIX, "    re", SUFFIX, input_extra=extra), "response_fields": None}).json()
    t = keystroke["timings"]
    # The context's K/V came from the warm-up (all of it but the block the FIM markers begin in).
    assert t["cache_n"] >= (primed - 1) // BLOCK * BLOCK - BLOCK, t
    assert t["cache_n"] + t["prompt_n"] == keystroke["tokens_evaluated"]


def test_the_second_keystroke_of_a_file_prefills_only_what_changed(server):
    first = call(server.compat, "POST", "/infill",
                 {**vim_fim(PREFIX, "    return math.sq", SUFFIX), "response_fields": None}).json()
    second = call(server.compat, "POST", "/infill",
                  {**vim_fim(PREFIX, "    return math.sqr", SUFFIX), "response_fields": None}).json()
    assert first["tokens_evaluated"] > 4 * BLOCK
    # The embedded model's template ends with the prefix: only its last tokens are new.
    assert second["timings"]["prompt_n"] <= 2 * BLOCK, second["timings"]
    assert second["timings"]["cache_n"] >= second["tokens_evaluated"] - 2 * BLOCK


def test_priming_with_the_keystrokes_own_text_leaves_only_its_last_block_to_compute(server):
    """llama.vscode's pattern: n_predict 0 for the text the next request will send."""
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA,
            "prompt": "    dz = ", "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1}
    primed = call(server.compat, "POST", "/infill", body).json()
    assert primed["content"] == "" and primed["tokens_predicted"] == 0
    warm = call(server.compat, "POST", "/infill", {**body, "n_predict": 8, "t_max_predict_ms": 2500}).json()
    assert warm["tokens_evaluated"] == primed["tokens_evaluated"]
    assert warm["timings"]["cache_n"] >= warm["tokens_evaluated"] - BLOCK, warm["timings"]
    assert warm["tokens_cached"] >= warm["tokens_evaluated"]


def test_llama_vscode_asks_three_completions_and_gets_an_array(server):
    body = {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX,
            "input_extra": [{"text": EXTRA[0]["text"], "time": 1700000000123, "filename": "/home/u/p/point.py"}],
            "prompt": "    return ", "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": 4,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 2500}
    reply = call(server.compat, "POST", "/infill", body)
    assert reply.status == 200, reply.raw
    answers = reply.json()
    assert isinstance(answers, list) and 1 <= len(answers) <= 3
    assert [a["index"] for a in answers] == list(range(len(answers)))
    assert all(isinstance(a["content"], str) for a in answers) and answers[0]["content"]
    for a in answers:  # n_indent 4: nothing after a line indented less than the body
        assert indent_end(a["content"], 4) in (None, len(a["content"]))


def test_completion_streamed_and_not_give_the_same_text_and_read_a_fim_template_back(server):
    """Tabby's llama.cpp/completion (a u64 seed, a field llama.cpp does not
    have) and Continue's llama.cpp provider both send a template filled in as text."""
    prompt = f"<|fim_prefix|>{PREFIX}    return <|fim_suffix|>{SUFFIX}<|fim_middle|>"
    streamed = call(server.compat, "POST", "/completion", {
        "seed": 18446744073709551615, "prompt": prompt, "n_predict": 24, "stream": True, "penalty_last_n": 0,
        "presence_penalty": 0.0})
    assert streamed.status == 200, streamed.raw
    events = [json.loads(e) for e in streamed.events()]  # no [DONE] on llama.cpp's own routes
    assert all(isinstance(e["content"], str) and isinstance(e["stop"], bool) for e in events)  # Tabby unwraps both
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["content"] == "" and events[-1]["tokens_predicted"] <= 24
    text = "".join(e["content"] for e in events)
    whole = call(server.compat, "POST", "/completion", {"prompt": prompt, "n_predict": 24}).json()
    assert whole["content"] == text and text
    # The template read back is the document: /infill with the same text completes the same.
    infill = call(server.compat, "POST", "/infill", {"input_prefix": PREFIX + "    return ", "input_suffix": SUFFIX,
                                                     "n_predict": 24}).json()
    assert infill["content"] == text and infill["tokens_evaluated"] == whole["tokens_evaluated"]


def test_stop_strings_and_n_indent_end_the_text(server):
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    ", "n_predict": 48}
    free = call(server.compat, "POST", "/infill", body).json()["content"]
    assert "\n" in free.rstrip("\n") and indent_end(free, 4) is not None, free  # it goes on past its block
    first_line = free[: free.index("\n")]
    stopped = call(server.compat, "POST", "/infill", {**body, "stop": ["\n"]}).json()
    assert stopped["content"] == first_line and stopped["stop_type"] == "word"
    indented = call(server.compat, "POST", "/infill", {**body, "n_indent": 4}).json()
    assert indented["stop_type"] == "limit" and indented["content"] == free[: indent_end(free, 4)]


# -- OpenAI routes ---------------------------------------------------------

def test_v1_completions_as_continue_streams_it(server):
    body = {"model": "completer", "max_tokens": 24, "temperature": 0.01, "top_p": None, "frequency_penalty": None,
            "presence_penalty": None, "stream": True, "stop": QWEN_STOPS,
            "prompt": f"<|fim_prefix|>{PREFIX}    return <|fim_suffix|>{SUFFIX}<|fim_middle|>"}
    reply = call(server.compat, "POST", "/v1/completions", body, {**AUTH, "api-key": TOKEN})
    assert reply.status == 200, reply.raw
    events = reply.events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and isinstance(c["choices"][0]["text"], str) for c in chunks)
    # Tabby stops at the first chunk with a finish_reason and fails on [DONE] before one.
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 < usage["completion_tokens"] <= 24
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert "\n\n" not in text  # a stop string


@pytest.mark.parametrize("suffix", [None, SUFFIX], ids=["suffix-null", "suffix"])
def test_v1_completions_as_tabby_sends_it(server, suffix):
    body = {"model": "completer", "prompt": PREFIX + "    return ", "suffix": suffix, "max_tokens": 16,
            "temperature": 0.1, "stream": True, "presence_penalty": 0.0}
    events = call(server.compat, "POST", "/v1/completions", body).events()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] is not None
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_v1_completions_without_stream_as_llama_vscode_sends_it(server):
    body = {"model": "", "prompt": f"<|fim_prefix|>{PREFIX}    return <|fim_suffix|>{SUFFIX}<|fim_middle|>",
            "max_tokens": 24, "temperature": 0.1, "top_p": 0.99, "stream": False}
    reply = call(server.compat, "POST", "/v1/completions", body, {"Authorization": f"Bearer {TOKEN}",
                                                                   "X-Stainless-Lang": "js"})
    assert reply.status == 200 and reply.headers["content-type"].startswith("application/json")
    answer = reply.json()
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    (choice,) = answer["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length") and choice["text"]
    assert answer["usage"]["completion_tokens"] <= 24 and isinstance(answer["created"], int)


def test_v1_completions_refuses_what_it_cannot_do_clearly(server):
    for field, value in [("echo", True), ("best_of", 3), ("logprobs", 2)]:
        reply = call(server.compat, "POST", "/v1/completions", {"prompt": "x = ", field: value})
        assert reply.status == 400 and reply.json()["error"]["param"] == field, reply.raw
        assert field in reply.json()["error"]["message"]
    reply = call(server.compat, "POST", "/v1/completions", {"prompt": ["a", "b"]})
    assert reply.status == 400 and "one prompt" in reply.json()["error"]["message"]


def test_health_props_and_models(server):
    health = call(server.compat, "GET", "/health", headers={})  # public, as llama.cpp's
    assert health.status == 200 and health.json() == {"status": "ok"}
    assert call(server.compat, "GET", "/props", headers={}).status == 401
    props = call(server.compat, "GET", "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 1024 and props["total_slots"] >= 1
    for path in ("/v1/models", "/models"):
        models = call(server.compat, "GET", path).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "completer-embedded-target"
        assert models["data"][0]["meta"]["n_ctx"] == 1024


# -- the server's guarantees -------------------------------------------------

def live_figures(server) -> dict[str, float]:
    m = scrape(server)
    return {"running": m["completer_num_requests_running"], "in_flight": m["completer_requests_in_flight"],
            "blocks": m['completer_kv_blocks_used{"pool": "target"}'],
            "disconnected": m.get('completer_route_requests_total{"outcome": "disconnected", "route": "infill"}', 0)}


def wait_for(server, condition, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        figures = live_figures(server)
        if condition(figures) or time.monotonic() > deadline:
            return figures
        time.sleep(0.05)


def open_request(port: int, path: str, body: dict) -> socket.socket:
    """A request sent on a bare socket that is never read: the caller drops it (as llama.vim's curl job ends)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


LONG = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "    ", "n_predict": 900}


def test_a_client_that_disconnects_mid_generation_is_cancelled_and_frees_its_blocks(server):
    # The embedded model may write the whole window's worth before the socket closes (it then
    # ends `length`, nothing to cancel): the client leaves as soon as its request runs, and a
    # request that finished first is tried again.
    for _ in range(3):
        before = wait_for(server, lambda f: f["running"] == 0 and f["blocks"] == 0, 30)
        assert before["running"] == 0 and before["blocks"] == 0, before
        sock = open_request(server.compat, "/infill", LONG)
        busy = wait_for(server, lambda f: f["running"] == 1 and f["blocks"] > 0, 60)
        assert busy["running"] == 1 and busy["blocks"] > 0, busy
        sock.close()
        dropped = time.monotonic()
        # (the route's count comes when the handler's cancellation reaches the guard)
        after = wait_for(server, lambda f: f["running"] == 0 and f["blocks"] == 0 and f["in_flight"] == 0
                         and f["disconnected"] > before["disconnected"], 10)
        if after["disconnected"] > before["disconnected"]:
            break
    assert after["running"] == 0 and after["blocks"] == 0 and after["in_flight"] == 0, after
    assert time.monotonic() - dropped < 5
    assert after["disconnected"] == before["disconnected"] + 1


def test_past_compat_max_inflight_a_request_gets_429_and_the_others_go_on(server):
    socks = [open_request(server.compat, "/infill", {**LONG, "stream": True}) for _ in range(2)]
    try:
        busy = wait_for(server, lambda f: f["in_flight"] == 2, 60)
        assert busy["in_flight"] == 2, busy
        reply = call(server.compat, "POST", "/infill", {"input_prefix": "x", "input_suffix": ""})
        assert reply.status == 429 and reply.json()["error"]["type"] == "rate_limit_error", reply.raw
    finally:
        for sock in socks:
            sock.close()
    after = wait_for(server, lambda f: f["running"] == 0 and f["blocks"] == 0, 10)
    assert after["running"] == 0 and after["blocks"] == 0, after


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer "},  # llama.vim with no api_key set
    {"Authorization": "Bearer empty"},  # the openai SDK with no key (llama.vscode's OpenAI mode)
    {"Authorization": "Bearer undefined"},  # Continue's llama.cpp provider with no key
    {"Authorization": f"Bearer {TOKEN}x"},
    {"X-Api-Key": TOKEN[:-1]},
], ids=["none", "empty-bearer", "empty", "undefined", "wrong", "wrong-x-api-key"])
def test_without_the_token_401_in_the_error_envelope(server, headers):
    for path in ("/infill", "/completion", "/v1/completions"):
        reply = call(server.compat, "POST", path, {"prompt": "x", "input_prefix": "x", "input_suffix": ""},
                     headers)
        assert reply.status == 401, (path, reply.raw)
        error = reply.json()["error"]
        assert error["code"] == 401 and error["type"] == "authentication_error" and "token" in error["message"]


@pytest.mark.parametrize("headers", [
    {"Authorization": TOKEN},  # bare, as llama.cpp also takes it
    {"Authorization": "Bearer ", "X-Api-Key": TOKEN},
    {"api-key": TOKEN},  # Azure's header, which Continue sends too
], ids=["bare", "x-api-key", "api-key"])
def test_the_token_in_the_other_headers_clients_use(server, headers):
    reply = call(server.compat, "POST", "/infill", {"input_prefix": "x = ", "input_suffix": "", "n_predict": 2},
                 headers)
    assert reply.status == 200, reply.raw


def test_a_foreign_origin_or_host_gets_403(server):
    body = {"input_prefix": "x = ", "input_suffix": "", "n_predict": 2}
    for headers in ({"Origin": "http://evil.example"}, {"Host": "evil.example"}):
        reply = call(server.compat, "POST", "/infill", body, {**AUTH, **headers})
        assert reply.status == 403 and reply.json()["error"]["type"] == "permission_error", (headers, reply.raw)


def test_too_large_gets_413_and_a_wrong_field_400(server):
    big = call(server.compat, "POST", "/infill", {"input_prefix": "x" * FRAME_LIMIT, "input_suffix": ""})
    assert big.status == 413 and "server.max_frame_bytes" in big.json()["error"]["message"]
    chars = [{"text": "y" * (CHARS_LIMIT // 4), "filename": f"f{i}.py"} for i in range(5)]
    many = call(server.compat, "POST", "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": chars})
    assert many.status == 413 and "server.max_document_chars" in many.json()["error"]["message"]
    # llama.cpp's own cases of a bad input_extra chunk.
    for chunk in ({}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                  {"filename": 123, "text": 456}):
        reply = call(server.compat, "POST", "/infill", {"input_prefix": "", "input_suffix": "",
                                                        "input_extra": [chunk]})
        assert reply.status == 400 and "input_extra" in reply.json()["error"]["message"], (chunk, reply.raw)
    assert call(server.compat, "POST", "/infill", raw=b"{not json").status == 400
    assert call(server.compat, "POST", "/infill", {"input_suffix": ""}).status == 400  # input_prefix missing
    missing = call(server.compat, "GET", "/nothing-here")
    assert missing.status == 404 and missing.json()["error"]["type"] == "not_found_error"


async def test_metrics_and_stats_count_the_requests_by_route(server):
    call(server.compat, "POST", "/completion", {"prompt": "x = ", "n_predict": 2})
    call(server.compat, "POST", "/v1/completions", {"prompt": "x = ", "max_tokens": 2})
    async with connect(server) as ws:  # and one over the WebSocket protocol, under its own route
        await ws.send(complete_msg("r1", "x = ", max_tokens=2))
        _, done = await collect(ws, "r1")
        assert done["type"] == "done", done
    m = scrape(server)
    routes = {k: v for k, v in m.items() if k.startswith("completer_route_requests_total")}
    for route in ("infill", "completion", "v1/completions", "ws"):
        assert sum(v for k, v in routes.items() if f'"route": "{route}"' in k) > 0, routes
    assert m['completer_route_requests_total{"outcome": "primed", "route": "infill"}'] >= 1
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/v1/stats", headers=AUTH)
    stats = json.loads(conn.getresponse().read())
    assert stats["routes"]["infill"] > 0 and stats["routes"]["v1/completions"] > 0 and stats["routes"]["ws"] == 1


# -- the pieces ------------------------------------------------------------

def test_indent_end_is_llama_cpps_n_indent():
    assert indent_end("x)\n    y\n    z", 4) is None  # every later line indented enough
    assert indent_end("x)\n    y\nz = 1", 4) == len("x)\n    y\n")  # cut before the line's text
    assert indent_end("x)\n  y", 4) == len("x)\n  ")  # the line's short indentation stays
    assert indent_end("x)\n\n    y", 4) == len("x)\n")  # a blank line ends it, as in llama.cpp
    assert indent_end("x)\n  ", 4) is None  # nothing but indentation yet: undecided
    assert indent_end("first line is never checked", 4) is None
    assert indent_end("x)\nz", 0) is None


def test_the_time_budget_ends_at_the_next_newline_after_it_ran_out():
    budget = Budget(t_max_predict_ms=100)
    assert budget.end("a", "b\nc", 0.05) is None  # within the budget
    assert budget.end("a", "bc", 0.2) is None  # past it, but no newline: a long line is never cut
    assert budget.end("a", "b\nc\nd", 0.2) == 2  # past it: the first newline is kept, the rest goes
    assert Budget(n_indent=4, t_max_predict_ms=100).end("x)\n", "z\n", 0.2) == 0  # the earlier end wins


@pytest.mark.parametrize("prompt, expected", [
    ("<|fim_prefix|>def f(<|fim_suffix|>)\n<|fim_middle|>", ("", "def f(", ")\n")),
    ("<fim_prefix><fim_suffix>)\n<fim_middle>def f(", ("", "def f(", ")\n")),  # StarCoder SPM
    ("<PRE> def f( <SUF>)\n <MID>", ("", "def f(", ")\n")),  # CodeLlama's spaced markers
    ("<PRE> <SUF>)\n <MID> def f(", ("", "def f(", ")\n")),
    ("<｜fim▁begin｜>def f(<｜fim▁hole｜>)\n<｜fim▁end｜>", ("", "def f(", ")\n")),
    ("[SUFFIX])\n[PREFIX]def f(", ("", "def f(", ")\n")),  # Codestral
    ("# repo notes\n<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", ("# repo notes\n", "a", "b")),
    ("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>partial", ("", "apartial", "b")),
    ("plain text to continue", ("", "plain text to continue", "")),
    ("<|fim_prefix|> only one marker", ("", "<|fim_prefix|> only one marker", "")),
])
def test_a_template_filled_in_as_text_is_read_back(prompt, expected):
    assert split_prompt(prompt) == expected


def test_timings_never_divide_by_zero():
    t = LlamaTimings.of(Timings(queue_ms=0.0, ttft_ms=5.0, total_ms=5.0, prompt_tokens=10, cached_tokens=10))
    assert t.prompt_n == 0 and t.prompt_per_token_ms == 0.0 and t.predicted_per_second == 0.0
    t = LlamaTimings.of(Timings(queue_ms=1.0, ttft_ms=11.0, total_ms=31.0, prompt_tokens=12, cached_tokens=2,
                                generated_tokens=5))
    assert (t.prompt_n, t.prompt_ms, t.predicted_ms, t.predicted_per_second) == (10, 10.0, 20.0, 250.0)


def test_api_key_headers():
    key = "k" * 20
    assert api_key_matches(key, f"Bearer {key}") and api_key_matches(key, f"bearer  {key} ")
    assert api_key_matches(key, key) and api_key_matches(key, "Bearer", None, key)
    assert not api_key_matches(key, "Bearer ") and not api_key_matches(key, None, "", None)
    assert not api_key_matches(key, f"Bearer{key}") and not api_key_matches(key, f"Basic {key}")
