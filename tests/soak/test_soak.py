"""A bounded soak against the real server (32 editors typing for 60 s, with
supersede storms, cancels, disconnects, a long file and a KV budget a few
full-window requests fill; 4 llama.vim-like clients storming the compat
port beside them): the invariants of docs/protocol.md and of a server that
gives back what it took. Speed is not asserted here; latency_bench/soak.py
and RELIABILITY.md report it."""

import time
from types import SimpleNamespace

import pytest

from latency_bench import http_editors, soak
from latency_bench.client_wait import ClientWait

# A tier of its own (~2 minutes): `python -m pytest -m soak` runs it; a bare `python -m pytest` leaves it out.
pytestmark = pytest.mark.soak

OWED = ("unanswered", "duplicate", "after_terminal", "unknown_id", "lost_on_server_close")


@pytest.fixture(scope="module")
def result():
    return soak.run_soak(editors=32, duration=60.0, seed=13, plan=soak.Plan(http_editors=4))


def test_the_server_survives_the_soak(result):
    assert result.server_exit_code is None, "".join(result.server_log_tail)
    assert result.server_closes == {}, result.server_closes


def test_the_load_exercised_storms_cancels_disconnects_and_a_long_file(result):
    e = result.events
    assert e["keystrokes"] > 1000 and e["bursts"] and e["cancels"] and e["long_files"], e
    assert e.get("disconnects_clean", 0) + e.get("disconnects_abrupt", 0) > 0, e


def test_every_request_fits_the_small_kv_budget(result):
    # How much the cache evicted depends on how fast the machine is: reported, not asserted.
    assert result.kv.fits and result.kv.pool_blocks["target"] < 4 * result.kv.full_window_blocks
    assert "error:too_large" not in result.outcomes, result.outcomes


def test_every_complete_on_an_open_connection_is_answered_exactly_once(result):
    o = result.outcomes
    assert {name: o[name] for name in OWED if o.get(name)} == {}, o
    # The books balance: each request sent ended one way (answered, or pending when its editor left).
    answered = sum(n for name, n in o.items() if name.startswith(("done:", "error:")))
    ended = answered + sum(o.get(name, 0) for name in ("abandoned", "unanswered", "lost_on_server_close"))
    assert ended == result.sent, o


def test_kv_blocks_in_use_return_to_baseline_after_the_drain(result):
    assert result.baseline.kv_blocks_used is not None, "the server exposes completer_kv_blocks_used"
    assert result.after_drain.kv_blocks_used == result.baseline.kv_blocks_used


def test_event_loop_tasks_and_requests_in_flight_return_to_baseline_after_the_drain(result):
    assert result.baseline.tasks is not None, "the server exposes completer_event_loop_tasks"
    assert result.after_drain.tasks == result.baseline.tasks
    assert result.after_drain.in_flight == 0


def test_the_server_answers_health_and_a_fresh_completion_after_the_soak(result):
    assert result.healthz_after
    assert result.fresh_completion_after.startswith("done:"), result.fresh_completion_after


def test_every_http_request_gets_one_status_with_json_or_was_aborted_by_its_client(result):
    o, sent = result.by_port["http"], result.sent_by_port["http"]
    assert o.get("aborted", 0) > 0, o  # keystrokes closed the connection of the request before them
    assert any(name.startswith("done:") for name in o), o
    assert {name: n for name, n in o.items() if name.startswith(http_editors.BROKEN) and n} == {}, o
    assert sum(o.values()) == sent, o  # each request booked exactly once
    assert result.unanswered == 0


def test_kv_returns_to_zero_within_5_s_of_each_idle_spell(result):
    assert [c.after for c in result.idle] == ["warm-up", "phase 1", "phase 2"]
    assert all(c.kv_zero_s is not None and c.kv_zero_s <= 5.0 for c in result.idle), result.idle
    assert all(c.memory is not None and c.memory.anon_mb > 0 for c in result.idle)


def test_an_http_answer_is_booked_by_its_status_and_body():
    assert http_editors.outcome_of(200, b'{"content": "x", "stop_type": "limit"}') == "done:limit"
    assert http_editors.outcome_of(503, b'{"error": {"code": 503, "message": "busy"}}') == "error:503"
    assert http_editors.outcome_of(503, b"Service Unavailable") == "not_json:503"
    assert http_editors.outcome_of(400, b'{"detail": "no envelope"}') == "not_json:400"


def test_the_books_catch_a_second_answer_a_delta_after_it_and_an_unknown_id():
    # The soak's own bookkeeping, without a server: what the invariants above rely on.
    book = soak.Book(block_size=16)
    wait = ClientWait("server")
    conn = SimpleNamespace(pending={"1": book.start, "3": book.start}, answered=set(), wait=wait,
                           next_key={"1": time.perf_counter() + 60, "3": time.perf_counter() - 1})
    done = {"type": "done", "id": "1", "reason": "stop", "text": "", "hold_ms": 40.0,
            "timings": {"prompt_tokens": 40, "cached_tokens": 8, "generated_tokens": 1}}
    for msg in (done, done, {"type": "delta", "id": "1", "text": "x"}, {**done, "id": "2"},
                {"type": "delta", "id": "3", "text": "y"}, {**done, "id": "3"}):
        book.frame(conn, msg)
    assert book.outcomes == {"done:stop": 2, "duplicate": 1, "after_terminal": 1, "unknown_id": 1}
    assert conn.pending == {} and book.computed_blocks == 4
    # Key 1 was answered before its next key, key 3 after (its next key had come); the hold reached the rule.
    assert book.served_keys == 1 and conn.next_key == {}
    assert wait.delay(time.perf_counter()) == pytest.approx(0.04)


def test_the_new_invariants_break_on_an_http_request_without_json_kv_held_past_5_s_and_a_worker_never_back(result):
    # The verdict's own logic, on the soak's result with one thing at a time gone wrong.
    import msgspec

    from latency_bench.run_results import Fault, violations

    assert violations(result) == []
    replace = msgspec.structs.replace
    http = {**result.by_port, "http": {**result.by_port["http"], "no_answer:ServerDisconnectedError": 1}}
    assert violations(replace(result, by_port=http)) == ["1 no_answer:ServerDisconnectedError (http)"]
    slow = [replace(c, kv_zero_s=6.0) if i == 1 else c for i, c in enumerate(result.idle)]
    assert violations(replace(result, idle=slow)) == ["KV not back to 0 within 5 s of idle after the phase 1 (6.0 s)"]
    lost = Fault("kill", 30.0, 30.0, 1234)
    assert violations(replace(result, faults=[lost])) == ["no prefill worker up again after the kill at 30 s"]
