"""What a connection's client has shown the server of its other files, kept
as retrieval candidates for its later requests (as Tabby indexes a
repository and llama.vim keeps a ring of chunks): the context items it sent
and the documents it completed in, newest first, within a character budget.
Nothing is read from disk; it all goes when the connection closes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from completer.protocol import ContextItem, Document


class ContextStore:
    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self._texts: OrderedDict[str, tuple[str, ...]] = OrderedDict()  # uri -> its text in parts, oldest first
        self._chars = 0

    def __len__(self) -> int:
        return len(self._texts)

    def _put(self, uri: str, parts: tuple[str, ...]) -> None:
        old = self._texts.pop(uri, None)
        if old is not None:
            self._chars -= sum(map(len, old))
        size = sum(map(len, parts))
        if size > self.max_chars:
            return
        self._texts[uri] = parts
        self._chars += size
        while self._chars > self.max_chars:
            _, gone = self._texts.popitem(last=False)
            self._chars -= sum(map(len, gone))

    def candidates(self, document: Document, sent: Iterable[ContextItem]) -> list[ContextItem]:
        """The request's own context items, then what the store holds of other
        files (newest first); then the store takes in this request's items and
        its document (kept as prefix and suffix: joined only if used)."""
        sent = list(sent)
        if self.max_chars <= 0:
            return sent
        named = {item.uri for item in sent} | {document.uri}
        kept = []
        for uri, parts in reversed(self._texts.items()):
            if uri in named:
                continue
            if len(parts) > 1:  # joined once, where it stands
                parts = self._texts[uri] = ("".join(parts),)
            kept.append(ContextItem(uri, parts[0]))
        for item in sent:
            self._put(item.uri, (item.text,))
        self._put(document.uri, (document.prefix, document.suffix))
        return (sent + kept)[:MAX_ITEMS]


MAX_ITEMS = 64  # the protocol's own bound on `context`
