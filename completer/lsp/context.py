"""The `context` `completer lsp` sends with a request, chosen as the Neovim
plugin chooses it (lua/completer/context.lua): snippets around the ranges
recently edited and the cursor's last lines of the documents the user left,
newest first (`edit`, `visited`), then the text around the last known spot
of other open documents of the same language (`open`).

The server puts the context first in the prompt, so a list that changes
re-prefills everything after it. The list is therefore kept still while the
user types in one document: snippets are picked when a request comes from
another document than the last one (the user left it), each a snapshot of
its text then, and the list built for a request is reused until the next
switch, open or close."""

from __future__ import annotations

import msgspec

from completer.protocol import MAX_CONTEXT_ITEMS, ContextItem
from completer.lsp.settings import ContextSettings


class OpenDocument(msgspec.Struct):
    """What the ring needs of an open document: its text now, its language."""
    uri: str
    source: str
    language: str

    def lines(self) -> list[str]:
        return self.source.splitlines(keepends=True)  # split only when a chunk is cut: on a switch


class Chunk(msgspec.Struct, frozen=True):
    uri: str
    first: int  # its lines [first, last), 0-based
    last: int
    text: str
    kind: str


def cap(text: str, max_chars: int) -> str:
    """At most `max_chars` of `text`, cut at a line end when there is one."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    newline = cut.rfind("\n")
    return cut[:newline] if newline > 0 else cut


def chunk(doc: OpenDocument, first: int, last: int, kind: str, cfg: ContextSettings) -> Chunk:
    """The lines [first, last) of `doc`, widened or narrowed to chunk_lines around their middle."""
    lines = doc.lines()
    mid = (first + last) // 2
    first = max(0, mid - cfg.chunk_lines // 2)
    last = min(len(lines), first + cfg.chunk_lines)
    text = cap("".join(lines[first:last]).rstrip("\n"), max(1, cfg.max_chars // 2))
    return Chunk(doc.uri, first, last, text, kind)


def overlaps(a: Chunk, uri: str, first: int, last: int) -> bool:
    return a.uri == uri and a.first < last and first < a.last


class ContextRing:
    def __init__(self) -> None:
        self.ring: list[Chunk] = []  # newest first
        self.edited: dict[str, tuple[int, int]] = {}  # uri -> the lines its last edits touched
        self.cursor: dict[str, int] = {}  # uri -> the row of its last request
        self.used: dict[str, int] = {}  # uri -> when it was last used (a counter), for "most recent first"
        self.clock = 0
        self.current: str | None = None  # the document of the last request
        self.built: tuple[tuple, list[ContextItem]] | None = None

    def changed(self) -> None:
        self.built = None

    def edit(self, uri: str, first: int, last: int) -> None:
        """Lines [first, last) of `uri` were just changed."""
        old = self.edited.get(uri)
        # Edits next to each other (typing) grow one range; an edit elsewhere starts another.
        if old and first <= old[1] + 1 and last >= old[0] - 1:
            first, last = min(first, old[0]), max(last, old[1])
        self.edited[uri] = (first, last)
        self.touch(uri)

    def touch(self, uri: str) -> None:
        self.clock += 1
        self.used[uri] = self.clock

    def close(self, uri: str) -> None:
        for table in (self.edited, self.cursor, self.used):
            table.pop(uri, None)
        self.ring = [c for c in self.ring if c.uri != uri]
        self.changed()

    def pick(self, c: Chunk, max_chunks: int) -> None:
        if not c.text.strip() or any(o.uri == c.uri and o.text == c.text for o in self.ring):
            return
        self.ring = [c] + [o for o in self.ring if not overlaps(o, c.uri, c.first, c.last)]
        del self.ring[max_chunks:]
        self.changed()

    def request(self, uri: str, row: int, docs: dict[str, OpenDocument], cfg: ContextSettings) -> None:
        """A request at `row` of `uri`: when it comes from another document
        than the last, the one left gives its edited range and its cursor's lines."""
        left = self.current
        if left is not None and left != uri and left in docs:
            doc = docs[left]
            if left in self.cursor:
                self.pick(chunk(doc, self.cursor[left], self.cursor[left] + 1, "visited", cfg), cfg.max_chunks)
            if left in self.edited:
                self.pick(chunk(doc, *self.edited[left], "edit", cfg), cfg.max_chunks)
        self.current = uri
        self.cursor[uri] = row
        self.touch(uri)

    def items(self, uri: str, first: int, last: int, docs: dict[str, OpenDocument],
              cfg: ContextSettings) -> list[ContextItem]:
        """The context of a request in `uri` whose document holds lines [first, last):
        the ring's chunks (less those inside that window, which the server gets
        anyway), then other open documents of the same language; within
        max_chunks and max_chars, and not a blocked document (`docs` holds only
        those that may be sent). The same list until something changes."""
        if not cfg.enabled or cfg.max_chunks <= 0 or uri not in docs:
            return []
        key = (uri, first, last, tuple(sorted(docs)), msgspec.json.encode(cfg))
        if self.built and self.built[0] == key:
            return self.built[1]
        chosen: list[Chunk] = []
        size, limit = 0, min(cfg.max_chunks, MAX_CONTEXT_ITEMS)

        def add(c: Chunk) -> None:
            nonlocal size
            if (len(chosen) >= limit or size + len(c.text) > cfg.max_chars or c.uri not in docs
                    or overlaps(c, uri, first, last) or any(overlaps(o, c.uri, c.first, c.last) for o in chosen)):
                return
            chosen.append(c)
            size += len(c.text)

        for c in self.ring:
            add(c)
        language = docs[uri].language
        others = sorted((d for d in docs.values() if d.uri != uri and d.language == language),
                        key=lambda d: -self.used.get(d.uri, 0))
        for doc in others[:cfg.buffers]:
            row = self.cursor.get(doc.uri, self.edited.get(doc.uri, (0, 0))[0])
            c = chunk(doc, row, row + 1, "open", cfg)
            if c.text.strip():
                add(c)
        items = [ContextItem(uri=c.uri, text=c.text, kind=c.kind) for c in chosen]
        self.built = (key, items)
        return items
