"""The memory that connections' context holds, bounded across all of them
(issue #43 item 7): each connection's ContextStore (server.context_store_chars)
and retrieval WindowCache were bounded only per connection, so 64
connections each holding its full share took 2.9 GB. One server-wide
ledger (server.context_chars_total) counts them all together and drops the
least recently used first, whichever connection's."""

from __future__ import annotations

import gc

from completer import context_store
from completer.config import load_config
from completer.context_store import ContextLedger, ContextStore
from completer.prompt import Snippet
from completer.protocol import ContextItem, Document
from completer.retrieval import WindowCache


def code(name: str, chars: int) -> str:
    """Python-looking text of about `chars` characters (windows to cut)."""
    line = f"    value_{name} = compute_{name}(value_{name}, index)\n"
    return (line * (chars // len(line) + 1))[:chars]


def held(stores: list[ContextStore], caches: list[WindowCache]) -> int:
    """The characters they really hold, counted from their contents (not the ledger's count)."""
    return sum(len(p) for s in stores for _, parts in s._texts.values() for p in parts) \
        + sum(len(text) for c in caches for (_, text, _) in c._cut)


def uris(store: ContextStore) -> set[str]:
    return {uri for _, uri in store._texts}


def test_all_connections_context_together_never_exceeds_the_server_wide_bound():
    ledger = ContextLedger(50_000)
    stores, caches = [], []
    for n in range(30):  # each connection well within its own budgets: 30 of them are 9x the bound
        store, cache = ContextStore(20_000, ledger), WindowCache(30_000, ledger)
        stores.append(store)
        caches.append(cache)
        items = [ContextItem(f"lib{i}.py", code(f"c{n}_{i}", 2_000)) for i in range(3)]
        for keystroke in range(3):
            document = Document("main.py", code(f"d{n}", 3_000 + keystroke), "\n")
            for item in store.candidates(document, items):
                cache.windows(Snippet(item.uri, item.text, item.kind))
            assert held(stores, caches) <= 50_000
            assert ledger.chars == held(stores, caches)
    assert held(stores, caches) > 40_000  # the bound is used, not emptied
    # Closed connections' context stops counting (once collected), and makes room.
    del stores[-10:], caches[-10:], store, cache
    gc.collect()
    ContextStore(20_000, ledger).candidates(Document("x.py", "", ""), [ContextItem("y.py", "y")])
    assert ledger.chars == held(stores, caches) + 1


def test_the_least_recently_used_context_goes_first_and_an_active_connections_own_files_stay():
    ledger = ContextLedger(10_000)
    a, b, c, d = (ContextStore(8_000, ledger) for _ in range(4))
    a.candidates(Document("a1.py", "a" * 1_000, ""), [ContextItem("a2.py", "A" * 1_000)])
    b.candidates(Document("b1.py", "b" * 1_000, ""), [ContextItem("b2.py", "B" * 1_000)])
    b_windows = WindowCache(8_000, ledger)
    b_windows.windows(Snippet("b2.py", code("b", 1_000)))
    c.candidates(Document("c1.py", "c" * 2_000, ""), [ContextItem("c2.py", "C" * 2_000)])
    # A types on: the files its request used are used again, the newest of all with its document.
    got = a.candidates(Document("a3.py", "x" * 500, ""), [])
    assert [i.uri for i in got] == ["a1.py", "a2.py"]
    assert ledger.chars == 9_500
    d.candidates(Document("d1.py", "d" * 3_000, ""), [])  # 12,500: the oldest 3,000 go
    assert len(b) == 0 and not b_windows._cut and not b_windows._tokens  # B's, idle the longest: all gone
    assert uris(a) == {"a1.py", "a2.py", "a3.py"}  # older than C's, but in use
    assert uris(c) == {"c1.py", "c2.py"} and uris(d) == {"d1.py"}
    assert ledger.chars == held([a, b, c, d], [b_windows]) <= 10_000
    # The next to go is C's (idle since), not A's: A's recent files stay while it types.
    a.candidates(Document("a3.py", "x" * 600, ""), [])
    d.candidates(Document("d2.py", "d" * 1_500, ""), [])
    assert uris(a) == {"a1.py", "a2.py", "a3.py"} and uris(c) == {"c1.py"}
    assert ledger.chars == held([a, b, c, d], [b_windows]) <= 10_000


def test_a_file_over_the_server_wide_bound_by_itself_is_used_but_not_kept():
    ledger = ContextLedger(1_000)
    store, cache = ContextStore(5_000, ledger), WindowCache(5_000, ledger)
    store.candidates(Document("small.py", "s" * 400, ""), [])
    assert store.candidates(Document("big.py", "b" * 2_000, ""), []) == [ContextItem("small.py", "s" * 400, "open")]
    assert uris(store) == {"small.py"}  # big.py was not kept, and took nothing with it
    assert cache.windows(Snippet("big.py", code("big", 2_000)))  # cut for this request all the same
    assert not cache._cut and ledger.chars == 400


def test_the_server_takes_its_bound_from_server_context_chars_total():
    from completer.server.app import App

    default = context_store.LEDGER.max_chars
    assert default == load_config(None, []).server.context_chars_total
    try:
        App(load_config(None, ["server.context_chars_total=12345"]), "t" * 32)
        assert context_store.LEDGER.max_chars == 12_345
    finally:
        context_store.LEDGER.bound(default)
