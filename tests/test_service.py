"""The completion service alone (server/service.py), over a stand-in
pipeline and engine: admission and its order, the in-flight limit that a
superseded keystroke no longer counts against, a client's documents and
salt, a request followed to its end however it is left. The doors' words
for all of it are tested through the real server (test_server_limits,
test_compat_api)."""

import asyncio

import pytest

from completer.config import load_config
from completer.engine.engine import RequestStream
from completer.engine.request import Delta, EngineError, Finished, Request, SamplingParams, Timings
from completer.protocol import ContextItem, Document
from completer.server.metrics import Metrics
from completer.server.service import CompletionService, Refused, RequestOptions, request_chars


class Pipeline:
    def __init__(self):
        self.made = []  # `retrieval` of each document state made

    def document(self, retrieval=None):
        self.made.append(retrieval)
        return object()

    def request(self, request_id, document, context, options, state, arrival):
        if document.prefix == "boom":
            raise ValueError("no prompt")
        return Request(request_id, [1], SamplingParams(), cache_salt=options.cache_salt, arrival=arrival)


class Engine:
    def __init__(self):
        self.submitted, self.cancelled, self.streams = [], [], {}

    def submit(self, request, supersede=None, ends_others=True, affinity=""):
        self.submitted.append((request, supersede, ends_others, affinity))
        self.streams[request.id] = stream = RequestStream(request.id)
        return stream

    def cancel(self, request_id):
        self.cancelled.append(request_id)

    def finish(self, request_id, text="x", reason="eos"):
        self.streams[request_id].queue.put_nowait(Finished(request_id, reason, text, Timings()))


def service(*settings, ready=True):
    s = CompletionService(load_config(None, list(settings)), Metrics())
    if ready:
        s.attach(Pipeline(), Engine(), None, None)
    return s


def submit(client, request_id, uri="a", supersede=True, prefix="p"):
    state, _ = client.document(uri)
    return client.submit(request_id, Document(uri=uri, prefix=prefix, suffix=""), [], RequestOptions(), state, 0.0,
                         supersede=uri, ends_others=supersede)


def test_a_keystroke_is_admitted_where_the_ones_it_supersedes_held_the_slots():
    s = service("server.max_inflight_per_connection=2")
    c = s.client("c1")
    submit(c, "1", "a")
    submit(c, "2", "a", supersede=False)  # beside the first: both hold slots
    with pytest.raises(Refused) as refused:
        c.admit("3", 10, "b")
    assert (refused.value.kind, refused.value.count, refused.value.limit) == ("busy", 2, 2)
    c.admit("3", 10, "a")  # it ends both
    submit(c, "3", "a")
    c.admit("4", 10, "b")  # the two superseded ones no longer count
    assert [(r.id, key, ends) for r, key, ends, _ in s.engine.submitted] == [
        ("1", "c1/a", True), ("2", "c1/a", False), ("3", "c1/a", True)]
    for request_id in ("1", "2", "3"):
        c.release(request_id)
    assert (len(c.inflight), c.inflight.current, c.inflight.superseded) == (0, {}, set())


def test_admission_says_what_can_never_be_served_first():
    s = service("server.max_document_chars=10", "server.max_inflight_per_connection=1")
    c = s.client("c1")
    submit(c, "1")
    s.stopping = True
    kinds = []
    for request_id, chars in (("1", 11), ("1", 10), ("2", 10)):
        with pytest.raises(Refused) as refused:
            c.admit(request_id, chars, "b")
        kinds.append(refused.value.kind)
    s.stopping = False
    with pytest.raises(Refused) as busy:
        c.admit("2", 10, "b")
    assert kinds + [busy.value.kind] == ["too_large", "duplicate", "stopping", "busy"]
    with pytest.raises(Refused) as loading:
        service(ready=False).check_open()
    assert loading.value.kind == "loading"
    assert Refused("too_large", 11, 10).words({"too_large": (413, "{count} > {limit} ({id})")}, "r") == \
        (413, "11 > 10 (r)")


def test_the_size_counts_document_context_and_stop_strings():
    document = Document(uri="u", prefix="ab", suffix="c")
    assert request_chars(document, [ContextItem(uri="f", text="xyz")], ["\n\n"]) == 1 + 3 + 4 + 2


def test_a_client_keeps_its_recent_documents_and_salts_its_requests_by_its_scope():
    s = service("server.max_documents_per_connection=2", 'server.prefix_cache_scope="connection"')
    c = s.client("c1")
    assert [c.document(uri)[1] for uri in ("a", "b", "a", "c", "b")] == [True, True, False, True, True]
    assert list(c.documents) == ["c", "b"]
    c.document("d", retrieval=False)
    assert s.pipeline.made[-1] is False
    flight = submit(c, "1")
    assert flight.request.cache_salt == "c1" and s.engine.submitted[-1][3] == "c1"
    assert service().client("c2").salt == ""


def test_senders_share_their_clients_documents_and_limit_with_salts_of_their_own():
    s = service('server.prefix_cache_scope="connection"')
    door = s.client("compat", limit=1)
    one, two = door.sender("10.0.0.1/0"), door.sender("10.0.0.2/0")
    one.document(("10.0.0.1/0", False))
    state, _ = two.document(("10.0.0.2/0", False))
    assert list(door.documents) == [("10.0.0.1/0", False), ("10.0.0.2/0", False)]
    two.submit("http1", Document(uri="", prefix="p", suffix=""), [], RequestOptions(), state, 0.0, route="infill")
    request, supersede, _, affinity = s.engine.submitted[-1]
    assert (request.cache_salt, supersede, affinity) == ("10.0.0.2/0", None, "10.0.0.2/0")
    with pytest.raises(Refused):
        one.admit("http2", 1)
    assert s.in_flight == 1
    s.stop()
    assert s.engine.cancelled == ["http1"] and s.stopping


def test_a_pipeline_failure_is_an_internal_error_naming_it():
    c = service().client("c1")
    with pytest.raises(EngineError) as e:
        submit(c, "1", prefix="boom")
    assert (e.value.code, str(e.value)) == ("internal", "ValueError: no prompt")
    assert len(c.inflight) == 0


async def test_a_followed_request_frees_its_slot_and_is_cancelled_unless_it_finished():
    s = service()
    c, engine = s.client("c1"), s.engine

    async def keep(text):
        return False

    flight = submit(c, "done")
    engine.finish("done", "abc")
    assert (await c.follow(flight, keep)).text == "abc"
    assert engine.cancelled == [] and len(c.inflight) == 0

    flight = submit(c, "cut")
    engine.streams["cut"].queue.put_nowait(Delta("cut", "t"))

    async def cut(text):
        engine.finish("cut", "t", "cancelled")  # the engine ends it on the cancel
        return True

    assert (await c.follow(flight, cut)).reason == "cancelled"
    assert engine.cancelled == ["cut"]

    flight = submit(c, "left")
    engine.streams["left"].queue.put_nowait(EngineError("overloaded", "busy"))
    with pytest.raises(EngineError):
        await c.follow(flight, keep)
    assert engine.cancelled == ["cut", "left"] and len(c.inflight) == 0

    flight = submit(c, "gone")
    following = asyncio.create_task(c.follow(flight, keep))
    await asyncio.sleep(0)
    following.cancel()  # the client disconnected
    with pytest.raises(asyncio.CancelledError):
        await following
    assert engine.cancelled[-1] == "gone" and len(c.inflight) == 0
    c.close()
    assert s.clients == set()
