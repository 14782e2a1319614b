"""Retrieval of the context block (completer/retrieval.py) and the imports
that name context files (completer/imports.py)."""

from completer.imports import imported_files, imported_modules
from completer.prompt import Snippet
from completer.retrieval import (HOLD_GAIN, HOLD_MARGIN, SWITCH_MARGIN, WINDOW_LINES, Retriever, WindowCache,
                                 query_of, score, windows)

MODELS = "\n".join([
    "class Invoice:",
    "    def __init__(self, customer, lines):",
    "        self.customer = customer",
    "        self.lines = lines",
    "",
    "    def total_amount(self):",
    "        return sum(line.price * line.quantity for line in self.lines)",
] + [f"# filler {i}" for i in range(30)] + [
    "class Shipment:",
    "    def tracking_number(self):",
    "        return self.carrier.code + self.reference",
])
UTILS = "\n".join(f"def helper_{i}(x):\n    return x + {i}" for i in range(20))


def retriever(budget: int = 10_000) -> Retriever:
    return Retriever(lambda snip: len(snip.text.split()), budget)


def test_the_window_that_shares_the_cursors_names_is_chosen_best_last():
    prefix = "def bill(invoice):\n    amount = invoice.total_amount()\n    for line in invoice.lines:\n        line."
    chosen = retriever(budget=40).select(prefix, [Snippet("app/utils.py", UTILS), Snippet("app/models.py", MODELS)])
    assert chosen and chosen[-1].uri == "app/models.py" and "total_amount" in chosen[-1].text
    assert all("tracking_number" not in c.text for c in chosen)


def test_the_block_stays_put_while_typing_and_moves_when_the_code_does():
    r = retriever(budget=30)
    files = [Snippet("app/models.py", MODELS), Snippet("app/utils.py", UTILS)]
    first = r.select("invoice.total_amount()\nline.price", files)
    for typed in ("invoice.total_amount()\nline.price * ", "invoice.total_amount()\nline.price * line.q"):
        assert r.select(typed, files) == first  # the same block: the prefix cache still hits
    moved = r.select("shipment.carrier.code\nself.reference\nshipment.tracking_number()", files)
    assert moved != first and "tracking_number" in moved[-1].text


def test_while_the_window_holds_a_jump_keeps_the_block_unless_the_new_one_is_far_better():
    """At a jump within the window the query changes wholesale; a new block
    would recompute the whole cached window behind it. It takes HOLD_MARGIN
    and HOLD_GAIN then, SWITCH_MARGIN at a refit."""
    files = [Snippet("app/models.py", MODELS), Snippet("app/utils.py", UTILS)]
    near = "total = invoice.total_amount()\nline.price"
    mixed = "line.price\nself.reference\nshipment.x"  # a jump: a better block, not far better
    for holds, switched in ((True, False), (False, True)):
        r = retriever(budget=60)
        first = r.select(near, files)
        assert first
        best = score(query_of(mixed), r._best(query_of(mixed), [w for f in files for w in r.cache.windows(f)]))
        kept = score(query_of(mixed), r.chosen)
        assert HOLD_MARGIN * kept + HOLD_GAIN > best > SWITCH_MARGIN * kept  # the case in between
        assert (r.select(mixed, files, window_holds=holds) != first) == switched
    r = retriever(budget=60)
    r.select(near, files)
    far = r.select("shipment.carrier.code\nself.reference\nshipment.tracking_number()", files, window_holds=True)
    assert "tracking_number" in far[-1].text  # far better: taken even so


def test_a_kept_window_whose_file_changed_is_dropped_and_the_budget_holds():
    r = retriever(budget=25)
    r.select("invoice.total_amount()", [Snippet("app/models.py", MODELS)])
    changed = MODELS.replace("total_amount", "grand_total")
    chosen = r.select("invoice.total_amount()", [Snippet("app/models.py", changed)])
    assert all("total_amount" not in c.text for c in chosen)
    assert sum(len(c.text.split()) for c in chosen) <= 25


def test_a_clients_documents_count_a_windows_tokens_once_and_forget_them_with_its_file():
    counted = []

    def count(snip: Snippet) -> int:
        counted.append(snip.text)
        return len(snip.text.split())

    cache = WindowCache(max_chars=len(MODELS) + len(UTILS))
    prefix = "invoice.total_amount()\nline.price"
    files = [Snippet("app/models.py", MODELS), Snippet("app/utils.py", UTILS)]
    first = Retriever(count, 40, cache).select(prefix, files)
    once = len(counted)
    assert first and once > 0
    for _ in range(20):  # other documents of the same client, the same files
        assert Retriever(count, 40, cache).select(prefix, files) == first
    assert len(counted) == once
    cache.windows(Snippet("app/other.py", UTILS))  # past max_chars: models.py, least recent, goes
    held = {text for (_, text) in cache._tokens}
    assert not any("total_amount" in text for text in held)


def test_nothing_in_common_places_nothing_and_windows_cover_the_file():
    assert retriever().select("zzz_unrelated", [Snippet("a.py", UTILS)]) == []
    lines = UTILS.split("\n")
    covered = set()
    for w in windows(Snippet("a.py", UTILS)):
        covered |= set(range(w.first_line, min(len(lines), w.first_line + WINDOW_LINES)))
    assert covered == set(range(len(lines)))


def test_imports_name_the_package_files_relative_and_absolute():
    text = "import os\nfrom . import utils\nfrom .models import Invoice\nimport app.billing.tax\n" \
           "from ..core.db import session\n"
    assert "app.billing.models" in imported_modules(text, "app/billing/views.py")
    known = {"app/billing/models.py", "app/billing/utils.py", "app/billing/tax.py", "app/core/db/__init__.py",
             "app/billing/views.py"}
    assert imported_files(text, "app/billing/views.py", known) == [
        "app/billing/utils.py", "app/billing/models.py", "app/billing/tax.py", "app/core/db/__init__.py"]
    # An installed package's files are relative to it; its absolute imports carry its name.
    assert imported_files("from pip._internal.req import req_file", "_internal/cli/main.py",
                          {"_internal/req/req_file.py"}, ("", "pip/")) == ["_internal/req/req_file.py"]
    assert imported_files("this is not python (", "x.py", {"y.py"}) == []


def test_the_query_holds_still_within_a_word():
    from completer.retrieval import query_of

    assert query_of("x = invoice.total_am") == query_of("x = invoice.total_amo") == query_of("x = invoice.")
    assert "invoice" in query_of("x = invoice.t")


def test_the_store_keeps_a_connections_other_files_newest_first_within_its_budget():
    from completer.context_store import ContextStore
    from completer.protocol import ContextItem, Document

    store = ContextStore(max_chars=100)
    assert store.candidates(Document("a.py", "x" * 30, "y" * 10), []) == []
    got = store.candidates(Document("b.py", "b", ""), [ContextItem("c.py", "c" * 20)])
    assert [i.uri for i in got] == ["c.py", "a.py"] and got[1].text == "x" * 30 + "y" * 10
    got = store.candidates(Document("a.py", "z", ""), [])  # its own document is never its context
    assert [i.uri for i in got] == ["b.py", "c.py"]
    store.candidates(Document("d.py", "d" * 90, ""), [])  # over the budget: the oldest go (c.py)
    assert [i.uri for i in store.candidates(Document("e.py", "", ""), [])] == ["d.py", "a.py", "b.py"]
    assert ContextStore(0).candidates(Document("a.py", "", ""), [ContextItem("c.py", "c")]) == [
        ContextItem("c.py", "c")]


async def test_a_file_completed_in_earlier_is_context_for_the_next_on_the_real_server():
    from latency_bench.harness import collect, complete_msg, connect, running_server

    models = MODELS + "\n"
    with running_server() as server:
        async def prompt_tokens(ws, rid: str, uri: str, prefix: str) -> int:
            await ws.send(complete_msg(rid, prefix, uri=uri, max_tokens=1))
            _, done = await collect(ws, rid)
            assert done["type"] == "done", done
            return done["timings"]["prompt_tokens"]

        query = "def bill(invoice):\n    amount = invoice.total_amount()\n    for line in invoice.lines:\n"
        async with connect(server) as ws:
            alone = await prompt_tokens(ws, "1", "file:///app/billing.py", query)
        async with connect(server) as ws:  # a new connection: its store is empty again
            await prompt_tokens(ws, "1", "file:///app/models.py", models)
            with_models = await prompt_tokens(ws, "2", "file:///app/billing.py", query)
            assert with_models > alone + 20  # models.py's windows at the start of the prompt
        async with connect(server) as ws:
            assert await prompt_tokens(ws, "1", "file:///app/billing.py", query) == alone
