"""What a connection's client has shown the server of its other files, kept
as retrieval candidates for its later requests (as Tabby indexes a
repository and llama.vim keeps a ring of chunks): the context items it sent
and the documents it completed in, newest first, within a character budget.
Nothing is read from disk; it all goes when the connection closes.

Kept per workspace (the request's `workspace`): one editor may hold several
projects, and a file of one is never context for a document of another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from completer.protocol import ContextItem, Document


class ContextStore:
    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        # (workspace, uri) -> its kind and its text in parts, oldest first
        self._texts: OrderedDict[tuple[str, str], tuple[str, tuple[str, ...]]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._texts)

    def _put(self, key: tuple[str, str], kind: str, parts: tuple[str, ...]) -> None:
        old = self._texts.pop(key, None)
        if old is not None:
            self._chars -= sum(map(len, old[1]))
        size = sum(map(len, parts))
        if size > self.max_chars:
            return
        self._texts[key] = (kind, parts)
        self._chars += size
        while self._chars > self.max_chars:
            _, (_, gone) = self._texts.popitem(last=False)
            self._chars -= sum(map(len, gone))

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
        for item in sent:
            self._put((workspace, item.uri), item.kind, (item.text,))
        # The document the user types in: an open buffer, by definition.
        self._put((workspace, document.uri), "open", (document.prefix, document.suffix))
        return (sent + found + kept)[:MAX_ITEMS]


MAX_ITEMS = 64  # the protocol's own bound on `context`
