"""What a connection's client has shown the server of its other files, kept
as retrieval candidates for its later requests (as Tabby indexes a
repository and llama.vim keeps a ring of chunks): the context items it sent
and the documents it completed in, newest first, within a character budget.
Nothing is read from disk; it all goes when the connection closes.

Kept per workspace (the request's `workspace`): one editor may hold several
projects, and a file of one is never context for a document of another.

Bounded twice: per connection (`server.context_store_chars`), and across all
of them (`server.context_chars_total`, the `LEDGER`, which the connections'
retrieval window caches share): 64 connections each holding its full store
and window cache once took 2.9 GB.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from typing import Protocol

from completer.protocol import ContextItem, Document


class Holder(Protocol):
    def forget(self, key: Hashable) -> None:
        """Drop `key` (the ledger no longer counts it)."""


class ContextLedger:
    """The characters that every connection's context holds together (their
    ContextStores' texts, their WindowCaches' files cut), within one bound,
    `server.context_chars_total`: past it, the least recently used entry of
    any connection goes first (a connection's files in use are touched on
    each request, so an idle connection's go before an active one's).

    A holder joins (a serial), then says what it holds (`hold`), uses
    (`touch`) and drops itself (`release`); the ledger calls its `forget(key)`
    to drop an entry for another's room. Holders are referenced weakly: a
    closed connection's entries stop counting once it is collected. Used from
    the event loop's thread (the pipeline builds prompts there)."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.chars = 0
        self._lru: OrderedDict[tuple[int, Hashable], int] = OrderedDict()  # (serial, key) -> chars, oldest first
        self._holders: dict[int, weakref.ref] = {}
        self._keys: dict[int, set[Hashable]] = {}
        self._gone: list[int] = []  # holders collected, their entries not yet taken out (appended by the GC)
        self._serials = itertools.count(1)

    def join(self, holder: Holder) -> int:
        serial = next(self._serials)
        gone = self._gone
        self._holders[serial] = weakref.ref(holder, lambda _, serial=serial: gone.append(serial))
        self._keys[serial] = set()
        return serial

    def hold(self, serial: int, key: Hashable, chars: int) -> bool:
        """`key` of holder `serial` holds `chars` now, used last; others' (and
        its own) least recently used entries go past the bound. False, and
        not counted, when it alone is over the bound (the holder drops it)."""
        self._take_out_gone()
        entry = (serial, key)
        self.chars -= self._lru.pop(entry, 0)
        if chars > self.max_chars:
            self._keys[serial].discard(key)
            return False
        self._lru[entry] = chars
        self._keys[serial].add(key)
        self.chars += chars
        self._shrink()
        return True

    def touch(self, serial: int, key: Hashable) -> None:
        """`key` was used: the last to go."""
        if (serial, key) in self._lru:
            self._lru.move_to_end((serial, key))

    def release(self, serial: int, key: Hashable) -> None:
        """The holder dropped `key` itself."""
        self.chars -= self._lru.pop((serial, key), 0)
        if (keys := self._keys.get(serial)) is not None:
            keys.discard(key)

    def bound(self, max_chars: int) -> None:
        """The server's bound (`server.context_chars_total`), set at its start."""
        self.max_chars = max_chars
        self._take_out_gone()
        self._shrink()

    def _shrink(self) -> None:
        while self.chars > self.max_chars and self._lru:
            (serial, key), n = self._lru.popitem(last=False)
            self.chars -= n
            self._keys[serial].discard(key)
            if (holder := self._holders[serial]()) is not None:
                holder.forget(key)

    def _take_out_gone(self) -> None:
        while self._gone:
            serial = self._gone.pop()
            self._holders.pop(serial, None)
            for key in self._keys.pop(serial, ()):
                self.chars -= self._lru.pop((serial, key), 0)


# The server's: every ContextStore and WindowCache not given another. Its bound is
# server.context_chars_total's default until the server sets its own (App).
LEDGER = ContextLedger(32_000_000)


class ContextStore:
    def __init__(self, max_chars: int, ledger: ContextLedger | None = None):
        self.max_chars = max_chars
        # (workspace, uri) -> its kind and its text in parts, oldest first
        self._texts: OrderedDict[tuple[str, str], tuple[str, tuple[str, ...]]] = OrderedDict()
        self._chars = 0
        self.ledger = LEDGER if ledger is None else ledger
        self._serial = self.ledger.join(self)

    def __len__(self) -> int:
        return len(self._texts)

    def forget(self, key: tuple[str, str]) -> None:
        if (old := self._texts.pop(key, None)) is not None:
            self._chars -= sum(map(len, old[1]))

    def _put(self, key: tuple[str, str], kind: str, parts: tuple[str, ...]) -> None:
        self.forget(key)
        size = sum(map(len, parts))
        if size > self.max_chars:
            self.ledger.release(self._serial, key)
            return
        self._texts[key] = (kind, parts)
        self._chars += size
        while self._chars > self.max_chars:
            gone, (_, parts_gone) = self._texts.popitem(last=False)
            self._chars -= sum(map(len, parts_gone))
            self.ledger.release(self._serial, gone)
        if not self.ledger.hold(self._serial, key, size):  # over the server's bound by itself
            self.forget(key)

    def candidates(self, document: Document, sent: Iterable[ContextItem], workspace: str = "",
                   found: Iterable[ContextItem] = ()) -> list[ContextItem]:
        """The request's own context items, then `found` (what the server found
        for it, not kept), then what the store holds of other files of the same
        workspace (newest first); then the store takes in this request's items
        and its document (kept as prefix and suffix: joined only if used)."""
        sent = list(sent)
        named = {item.uri for item in sent} | {document.uri}
        found = [item for item in found if item.uri not in named]
        if self.max_chars <= 0:
            return (sent + found)[:MAX_ITEMS]
        named |= {item.uri for item in found}
        kept = []
        for key, (kind, parts) in reversed(self._texts.items()):
            if key[0] != workspace or key[1] in named:
                continue
            if len(parts) > 1:  # joined once, where it stands
                parts = ("".join(parts),)
                self._texts[key] = (kind, parts)
            kept.append(ContextItem(key[1], parts[0], kind))
        used = max(0, MAX_ITEMS - len(sent) - len(found))
        for item in reversed(kept[:used]):  # in use: the last of all connections' context to go
            self.ledger.touch(self._serial, (workspace, item.uri))
        for item in sent:
            self._put((workspace, item.uri), item.kind, (item.text,))
        # The document the user types in: an open buffer, by definition.
        self._put((workspace, document.uri), "open", (document.prefix, document.suffix))
        return (sent + found + kept)[:MAX_ITEMS]


MAX_ITEMS = 64  # the protocol's own bound on `context`
