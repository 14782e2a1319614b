"""The completion service (server/service.py) over the real pipeline and
engine on the embedded model, built once for the module: admission and its
order, the in-flight limit that a superseded keystroke no longer counts
against, a client's documents and salt, a request followed to its end
however it is left. What it did is read from the real parts: the requests'
ends (a superseded one ends `cancelled`), the engine's live snapshot, the
service's own state and the requests it built. The doors' words for all of
it are tested through the real server (test_server_limits, test_compat_api).

The engine runs one request at a time with two waiting at most
(engine.max_running, engine.max_queue): a third waiting one is refused
`overloaded`, the engine's error that a followed request meets here."""

import asyncio
import time
from typing import NamedTuple

import pytest
import pytest_asyncio

from completer.config import load_config
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.request import EngineError
from completer.loading import LoadedModel, load_models
from completer.pipeline import CompletionPipeline, LocalCompleter
from completer.protocol import ContextItem, Document
from completer.server.metrics import Metrics
from completer.server.service import CompletionService, Refused, RequestOptions, request_chars

ENGINE = ['model.target="embedded"', "engine.max_running=1", "engine.max_queue=2"]
CONFIG = load_config(None, ENGINE)
PREFIX = "def f(x):\n    return"  # the embedded models go on past 400 tokens after it, whatever the file
LONG = RequestOptions(mode="free", max_tokens=100_000, deadline_ms=600_000)  # in flight until ended (the window)
SHORT = RequestOptions(mode="free", max_tokens=2, deadline_ms=600_000)
WAIT_S = 30.0  # for what the engine does within a pass or two

# The engine's streams answer on the loop it started on: the module's.
on_the_engines_loop = pytest.mark.asyncio(loop_scope="module")


class Parts(NamedTuple):
    """What `serve` attaches to its service once loaded."""

    pipeline: CompletionPipeline
    engine: Engine
    target: LoadedModel
    draft: LoadedModel | None


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def parts():
    """The embedded target and drafter, their pipeline, and the engine started on the module's event loop."""
    m = CONFIG.model
    target, draft = run_in_passing_thread(load_models, m.target, m.draft, m.precision)
    async with LocalCompleter(target, draft, CONFIG) as local:
        yield Parts(local.pipeline, local.engine, target, draft)


SERVICES = []  # the test's, stopped after it


@pytest_asyncio.fixture(autouse=True, loop_scope="module")
async def idle_after(parts):
    """Every test ends every request it started (each service stopped, should
    the test have failed midway): the next one finds the engine empty."""
    yield
    while SERVICES:
        SERVICES.pop().stop()
    await until(lambda: alive(parts) == 0)


def alive(parts) -> int:
    live = parts.engine.live()
    return live.running + live.waiting


async def until(condition, timeout_s: float = WAIT_S) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "not within the wait"
        await asyncio.sleep(0.01)


def service(parts, *settings, ready=True):
    s = CompletionService(load_config(None, [*ENGINE, *settings]), Metrics())
    SERVICES.append(s)
    if ready:
        s.attach(*parts)
    return s


def submit(client, request_id, uri="a", supersede=True, prefix=PREFIX, options=LONG):
    state, _ = client.document(uri)
    return client.submit(request_id, Document(uri=uri, prefix=prefix, suffix=""), [], options, state,
                         time.perf_counter(), supersede=uri, ends_others=supersede)


async def reasons(*flights):
    return [(await asyncio.wait_for(f.stream.finished(), WAIT_S)).reason for f in flights]


@on_the_engines_loop
async def test_a_keystroke_is_admitted_where_the_ones_it_supersedes_held_the_slots(parts):
    s = service(parts, "server.max_inflight_per_connection=2")
    c = s.client("c1")
    one = submit(c, "1", "a")
    two = submit(c, "2", "a", supersede=False)  # beside the first: both hold slots
    await until(lambda: alive(parts) == 2)  # neither ended the other
    with pytest.raises(Refused) as refused:
        c.admit("3", 10, "b")
    assert (refused.value.kind, refused.value.count, refused.value.limit) == ("busy", 2, 2)
    c.admit("3", 10, "a")  # it ends both
    three = submit(c, "3", "a")
    c.admit("4", 10, "b")  # the two superseded ones no longer count, though the engine may not have ended them
    assert await reasons(one, two) == ["cancelled", "cancelled"]
    # The document's key is the client's: another client's keystroke in its "a" ends none of c1's
    # (had it ended the third, the engine would hold one request, not two).
    other = s.client("c2")
    elsewhere = submit(other, "c2-1", "a")
    await until(lambda: alive(parts) == 2)
    c.cancel_all()
    other.cancel_all()
    assert await reasons(three, elsewhere) == ["cancelled", "cancelled"]
    for request_id in ("1", "2", "3"):
        c.release(request_id)
    assert (len(c.inflight), c.inflight.current, c.inflight.superseded) == (0, {}, set())


@on_the_engines_loop
async def test_admission_says_what_can_never_be_served_first(parts):
    s = service(parts, "server.max_document_chars=10", "server.max_inflight_per_connection=1")
    c = s.client("c1")
    flight = submit(c, "1")
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
    c.cancel("1")
    assert await reasons(flight) == ["cancelled"]
    c.release("1")
    c.admit("2", 10, "b")  # its slot is free again
    with pytest.raises(Refused) as loading:
        service(parts, ready=False).check_open()
    assert loading.value.kind == "loading"
    assert Refused("too_large", 11, 10).words({"too_large": (413, "{count} > {limit} ({id})")}, "r") == \
        (413, "11 > 10 (r)")


def test_the_size_counts_document_context_and_stop_strings():
    document = Document(uri="u", prefix="ab", suffix="c")
    assert request_chars(document, [ContextItem(uri="f", text="xyz")], ["\n\n"]) == 1 + 3 + 4 + 2


@on_the_engines_loop
async def test_a_client_keeps_its_recent_documents_and_salts_its_requests_by_its_scope(parts):
    s = service(parts, "server.max_documents_per_connection=2", 'server.prefix_cache_scope="connection"')
    c = s.client("c1")
    states = {}
    firsts = []
    for uri in ("a", "b", "a", "c", "b"):
        state, first = c.document(uri)
        firsts.append(first)
        assert first or state is states[uri]  # the prompt state it kept
        states[uri] = state
    assert firsts == [True, True, False, True, True]
    assert list(c.documents) == ["c", "b"]
    assert c.document("d", retrieval=False)[0].retriever is None
    assert c.document("e")[0].retriever is not None  # model.retrieval's default
    salted = submit(c, "1", "d", options=SHORT)
    plain = submit(service(parts).client("c2"), "2", options=SHORT)
    assert (salted.request.cache_salt, plain.request.cache_salt) == ("c1", "")
    assert await reasons(salted, plain) == ["length", "length"]


@on_the_engines_loop
async def test_senders_share_their_clients_documents_and_limit_with_salts_of_their_own(parts, monkeypatch):
    affinities = []
    real_submit = parts.engine.submit

    def submitting(request, supersede=None, ends_others=True, affinity=""):  # the real engine's, recorded
        affinities.append((request.id, supersede, affinity))
        return real_submit(request, supersede, ends_others, affinity)

    monkeypatch.setattr(parts.engine, "submit", submitting)
    s = service(parts, 'server.prefix_cache_scope="connection"')
    door = s.client("compat", limit=2)
    one, two = door.sender("10.0.0.1/0"), door.sender("10.0.0.2/0")
    one.document(("10.0.0.1/0", False))
    state, _ = two.document(("10.0.0.2/0", False))
    assert list(door.documents) == [("10.0.0.1/0", False), ("10.0.0.2/0", False)]
    document = Document(uri="", prefix=PREFIX, suffix="")
    flights = [two.submit(request_id, document, [], LONG, state, time.perf_counter(), route="infill")
               for request_id in ("http1", "http2")]
    await until(lambda: alive(parts) == 2)  # no supersede key: the second ended not the first
    assert [f.request.cache_salt for f in flights] == ["10.0.0.2/0", "10.0.0.2/0"]
    assert affinities == [("http1", None, "10.0.0.2/0"), ("http2", None, "10.0.0.2/0")]
    with pytest.raises(Refused):
        one.admit("http3", 1)
    assert s.in_flight == 2
    s.stop()
    assert s.stopping and await reasons(*flights) == ["cancelled", "cancelled"]


@on_the_engines_loop
async def test_a_pipeline_failure_is_an_internal_error_naming_it(parts):
    """A lone surrogate: the doors' JSON decoders refuse one, the pipeline's tokenizer cannot encode it."""
    c = service(parts).client("c1")
    bad = "x = '\ud800'"
    with pytest.raises(Exception) as raised:
        parts.pipeline.request("probe", Document(uri="a", prefix=bad, suffix=""))
    with pytest.raises(EngineError) as e:
        submit(c, "1", prefix=bad)
    assert (e.value.code, str(e.value)) == ("internal", f"{type(raised.value).__name__}: {raised.value}")
    assert len(c.inflight) == 0
    assert await reasons(submit(c, "1", "b", options=SHORT)) == ["length"]  # the id was never in the engine


@on_the_engines_loop
async def test_a_followed_request_frees_its_slot_and_is_cancelled_unless_it_finished(parts):
    s = service(parts)
    c = s.client("c1")
    seen = []

    async def keep(text):
        seen.append(text)
        return False

    finished = await asyncio.wait_for(c.follow(submit(c, "done", options=SHORT), keep), WAIT_S)
    assert (finished.reason, finished.text) == ("length", "".join(seen)) and len(c.inflight) == 0

    async def cut(text):
        seen.append(text)
        return True

    seen.clear()
    finished = await asyncio.wait_for(c.follow(submit(c, "cut"), cut), WAIT_S)
    assert finished.reason == "cancelled" and finished.text.startswith(seen[0]) and len(c.inflight) == 0

    # The engine refuses a third waiting request of the client that holds the queue (overloaded; another
    # client's would take the place of its newest): the error is raised, the slot freed.
    other = s.client("c2")
    holding = [submit(other, "hold0", "h0")]
    await until(lambda: parts.engine.live().running == 1)
    holding += [submit(other, f"hold{i}", f"h{i}") for i in (1, 2)]
    await until(lambda: parts.engine.live().waiting == 2)
    with pytest.raises(EngineError) as e:
        await asyncio.wait_for(other.follow(submit(other, "left", "h3"), keep), WAIT_S)
    assert e.value.code == "overloaded" and len(other.inflight) == 3
    other.cancel_all()
    assert await reasons(*holding) == ["cancelled"] * 3

    flight = submit(c, "gone")
    streaming = asyncio.Event()

    async def reading(text):
        streaming.set()
        return False

    following = asyncio.create_task(c.follow(flight, reading))
    await asyncio.wait_for(streaming.wait(), WAIT_S)
    following.cancel()  # the client disconnected
    with pytest.raises(asyncio.CancelledError):
        await following
    assert len(c.inflight) == 0 and await reasons(flight) == ["cancelled"]
    c.close()
    other.close()
    assert s.clients == set()


@on_the_engines_loop
async def test_a_clients_documents_share_one_cut_of_each_context_file_and_clients_do_not(parts):
    """Each document once cut every context file into windows of its own: a
    connection's 1M characters of context were ~19 MB in each of up to 256
    documents (issue #31's soak held 177,000 windows)."""
    import gc

    from completer.prompt import Snippet
    from completer.retrieval import Window, windows

    def live_windows() -> int:
        # type(), not isinstance(): a dead weakref proxy among the objects raises on __class__
        return sum(type(o) is Window for o in gc.get_objects())

    files = [ContextItem(f"file:///proj/lib{i}.py", "\n".join(f"def helper_{i}_{j}(x):\n    return x + {j}"
                                                                for j in range(200))) for i in range(3)]
    one_cut = sum(len(windows(Snippet(f.uri, f.text))) for f in files)
    s = service(parts)
    c = s.client("c1")
    before = live_windows()
    for n in range(20):
        state, _ = c.document(f"file:///proj/doc{n}.py")
        s.pipeline.request(f"r{n}", Document(f"file:///proj/doc{n}.py", PREFIX + f" helper_{n % 3}_", ""), files,
                           state=state)
    held = live_windows() - before
    assert one_cut <= held < 2 * one_cut, (held, one_cut)
    assert s.client("c2").windows is not c.windows  # what one client sent is never another's
