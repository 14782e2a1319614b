"""Which parts of the other files a client sent go into the prompt.

RepoCoder's sparse retriever, kept warm: the files are cut into windows of
`WINDOW_LINES` lines every `STRIDE_LINES`; the query is the last
`WINDOW_LINES` lines before the cursor; a window's score is the Jaccard
similarity of its identifiers and the query's (RepoCoder found it as good as
BM25 for code at this size, and it needs no index: a request holds at most
the protocol's 64 context items). The best windows that fit the context
budget, near-duplicates dropped, become the prompt's context block.

Kept warm: the block sits at the start of the prompt, so a different choice
recomputes the whole prompt. A document keeps its chosen windows until a
new choice scores `SWITCH_MARGIN` times better (or a chosen window's text is
gone); while typing within a function the query changes a little on each
keystroke and the block stays put. While the prompt's window keeps its start
(a jump within the screen), by much more (`HOLD_MARGIN`, `HOLD_GAIN`): the
query changes wholesale at a jump, and a switch would recompute the window
too.

A context item's kind is a prior: a window of a definition or of a recent
edit that shares any names with the query gets a small bonus, so that on a
tie (or nearly one) it ranks ahead of a window of some open buffer. The
bonus is small against the switch margin: it orders, it does not churn.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from completer.context_store import LEDGER, ContextLedger
from completer.prompt import Snippet

WINDOW_LINES = 12
STRIDE_LINES = 6
SWITCH_MARGIN = 1.25  # a new choice must score this much better to replace the kept one
# ... and while the window keeps its start (a jump within it): the whole
# window after the context is cached, a switch recomputes it all (~1 s for a
# 1024-token prompt on 2 cores), and a jump's new query scores the kept
# windows near 0. Twice as good and by a whole related window's similarity.
HOLD_MARGIN, HOLD_GAIN = 2.0, 0.2
NEAR_DUPLICATE = 0.8  # windows this similar to a chosen one add nothing
IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PARTIAL = re.compile(r"[A-Za-z0-9_]*$")
# Added to a window's similarity (when it has any): what the editor knows a
# completion most often needs. Jaccard similarities of related code run 0.1-0.5.
KIND_BONUS = {"definition": 0.03, "edit": 0.02}


class Window(msgspec.Struct, frozen=True):
    uri: str
    first_line: int
    text: str
    names: frozenset[str]
    kind: str = ""


def identifiers(text: str) -> frozenset[str]:
    return frozenset(IDENTIFIER.findall(text))


def windows(snippet: Snippet) -> list[Window]:
    lines = snippet.text.split("\n")
    starts = range(0, max(1, len(lines) - WINDOW_LINES + STRIDE_LINES), STRIDE_LINES)
    out = []
    for first in starts:
        text = "\n".join(lines[first: first + WINDOW_LINES])
        if text.strip():
            out.append(Window(snippet.uri, first, text, identifiers(text), snippet.kind))
    return out


def jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def similarity(query: frozenset[str], w: Window) -> float:
    """Shared names, plus the window's kind bonus when it shares any (a
    definition with nothing in common with the cursor is still not placed)."""
    shared = jaccard(query, w.names)
    return shared + KIND_BONUS.get(w.kind, 0.0) if shared else 0.0


def query_of(prefix: str) -> frozenset[str]:
    """The identifiers of the last WINDOW_LINES lines before the cursor, but
    for the one being typed at the cursor: the query holds still within a
    word, and so does the choice."""
    tail = "\n".join(prefix.split("\n")[-WINDOW_LINES:])
    return identifiers(tail[: len(tail) - len(PARTIAL.search(tail).group())])


class WindowCache:
    """Files cut into windows, and the windows' token counts, shared by the
    documents of one client: cut per document, a connection's 1M characters
    of context cost ~19 MB in each of up to 256 documents. A client's
    documents share one prompt builder, so a window counts alike in all of
    them. Least recently used files go past `max_chars` of their text, their
    counts with them, and past the server's bound on all connections' context
    (`ledger`, server.context_chars_total), whoever's are least recently used."""

    def __init__(self, max_chars: int = 2_000_000, ledger: ContextLedger | None = None):
        self.max_chars = max_chars
        self._cut: OrderedDict[tuple[str, str, str], list[Window]] = OrderedDict()
        self._chars = 0
        self._tokens: dict[tuple[str, str], int] = {}
        self.ledger = LEDGER if ledger is None else ledger
        self._serial = self.ledger.join(self)

    def windows(self, snippet: Snippet) -> list[Window]:
        key = (snippet.uri, snippet.text, snippet.kind)
        cut = self._cut.pop(key, None)
        new = cut is None
        if new:
            cut = windows(snippet)
            self._chars += len(snippet.text)
        self._cut[key] = cut
        while self._chars > self.max_chars and len(self._cut) > 1:
            gone = next(iter(self._cut))
            self.forget(gone)
            self.ledger.release(self._serial, gone)
        if not new:
            self.ledger.touch(self._serial, key)
        elif not self.ledger.hold(self._serial, key, len(snippet.text)):  # over the server's bound by itself
            self.forget(key)
        return cut

    def forget(self, key: tuple[str, str, str]) -> None:
        if (gone := self._cut.pop(key, None)) is not None:
            self._chars -= len(key[1])
            for w in gone:
                self._tokens.pop((w.uri, w.text), None)

    def tokens(self, w: Window, count: Callable[[Snippet], int]) -> int:
        key = (w.uri, w.text)
        if (n := self._tokens.get(key)) is None:
            n = self._tokens[key] = count(Snippet(w.uri, w.text))
        return n


class Retriever:
    """One document's choice of windows, kept across its keystrokes.
    `count(snippet)`: its tokens in the prompt; `budget`: the context's tokens."""

    def __init__(self, count: Callable[[Snippet], int], budget: int, cache: WindowCache | None = None):
        self.count = count
        self.budget = budget
        self.chosen: list[Window] = []
        self.cache = WindowCache() if cache is None else cache  # the files sent, cut (the client's)
        self._asked: tuple | None = None  # the last query and files

    def select(self, prefix: str, snippets: list[Snippet], window_holds: bool = False) -> list[Snippet]:
        """The windows to place, as snippets (path and text), best last (nearest the code).
        `window_holds`: the prompt's window keeps its start (a keystroke, a
        jump within it), so its K/V is cached after the context: a new choice
        must then be better by HOLD_MARGIN and HOLD_GAIN."""
        query = query_of(prefix)
        asked = (query, tuple((s.uri, s.text, s.kind) for s in snippets))
        if asked == self._asked:  # within a word, the same files: the same choice, no scoring
            return [Snippet(w.uri, w.text) for w in self.chosen]
        self._asked = asked
        files = {(s.uri, s.text, s.kind): s for s in snippets}.values()  # a file sent twice counts once
        candidates = [w for s in files for w in self.cache.windows(s)]
        best = self._best(query, candidates)
        available = {(w.uri, w.first_line, w.text) for w in candidates}
        kept = bool(self.chosen) and all((w.uri, w.first_line, w.text) in available for w in self.chosen)
        margin, gain = (HOLD_MARGIN, HOLD_GAIN) if window_holds else (SWITCH_MARGIN, 0.0)
        if not kept or score(query, best) > margin * score(query, self.chosen) + gain:
            self.chosen = best
        return [Snippet(w.uri, w.text) for w in self.chosen]

    def _best(self, query: frozenset[str], candidates: list[Window]) -> list[Window]:
        ranked = sorted(((similarity(query, w), w) for w in candidates), key=lambda sw: sw[0], reverse=True)
        chosen: list[Window] = []
        used = 0
        for s, w in ranked:
            if s == 0:
                break
            if any(jaccard(w.names, c.names) >= NEAR_DUPLICATE for c in chosen):
                continue
            if used + (n := self.cache.tokens(w, self.count)) <= self.budget:
                chosen.append(w)
                used += n
        return chosen[::-1]


def score(query: frozenset[str], chosen: list[Window]) -> float:
    return sum(similarity(query, w) for w in chosen)
