"""Per-document prompt state, so a keystroke re-tokenizes only what changed.

An editor session sends the whole prefix and suffix on every keystroke. This
keeps the last window and its tokens: while the window's start holds (it moves
only when the window overflows, see `PromptBuilder.fit_prefix`), the prefix
tokens are reused up to a token boundary a line or so before the first changed
character, and only the rest is tokenized. Context snippets and the suffix are
reused while their text is unchanged. The cost of a keystroke thus follows the
size of the edit and of the window, not of the file.

The reused tokens plus the new ones always spell the new text exactly; they may
differ from a from-scratch tokenization only at the seam, a line back, which the
model (trained on separately tokenized segments) takes in stride.
"""

from __future__ import annotations

import bisect

from completer.prompt import Prompt, PromptBuilder, Snippet, Window
from completer.retrieval import Retriever, WindowCache


# A window's start holds while the BEFORE_CHARS before it are unchanged; a
# window whose start moved is looked for by its first two lines, when they
# are at least HEAD_CHARS long (shorter ones, "}\n\n", are everywhere).
BEFORE_CHARS, HEAD_CHARS = 64, 24


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix, by bisection over C-speed compares."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def outside_window(snippets: list[Snippet], path: str, prefix: str, suffix: str, budget: int,
                   suffix_budget: int | None = None) -> list[Snippet]:
    """The snippets but those of this document whose text is around the
    cursor, within what the prompt's window holds (its prefix at most
    `budget` tokens, its suffix `suffix_budget`, code ~3 chars a token): the
    window shows that text already, and a client's snippets of the code it
    just edited change with every edit and jump, so the context block, which
    the prompt starts with, would change with them (recomputing the whole
    prompt) to add nothing."""
    if not any(s.uri == path for s in snippets):  # (most keystrokes: nothing to cut)
        return snippets
    around = prefix[-3 * budget:] + suffix[: 3 * (budget if suffix_budget is None else suffix_budget)]
    return [s for s in snippets if not (s.uri == path and s.text in around)]


class DocumentPrompt:
    def __init__(self, builder: PromptBuilder, retrieval: bool = False, windows: WindowCache | None = None,
                 hold_context: bool = True):
        self.builder = builder
        self.hold_context = hold_context  # a jump within the window keeps the context (Retriever.select)
        # With retrieval, the context is the best-matching windows of the files sent (kept
        # across keystrokes; `windows`: the files cut, shared with the client's other documents);
        # without, the files in the client's order, whole, while they fit.
        self.retriever = Retriever(lambda snip: len(builder.snippet_tokens(snip)),
                                   builder.context_budget, windows) if retrieval else None
        self.context_key: tuple | None = None
        self.context: list[int] = []
        self.suffix_head: str | None = None  # the suffix text fit_suffix looked at
        self.suffix_end = 0
        self.suffix_ids: list[int] = []
        self.prefix_start = -1
        self.before_start = ""  # the text right before the window's start: while it is there, the start holds
        self.prefix_text = ""  # prefix[prefix_start:]
        self.prefix_ids: list[int] = []
        self.prefix_offsets: list[int] = []  # char offset in prefix_text where each token starts
        self.retokenized_chars = 0  # chars tokenized by the last update (for tests and metrics)
        self.prefix_budget = 0  # the last update's tokens for the prefix

    def _encode(self, text: str, base: int = 0) -> tuple[list[int], list[int]]:
        enc = self.builder.tok.tokenizer.encode(text, add_special_tokens=False)
        self.retokenized_chars += len(text)
        return enc.ids, [base + start for start, _ in enc.offsets]

    def update(self, prefix: str, suffix: str, path: str | None = None,
               snippets: list[Snippet] | None = None) -> Prompt:
        b = self.builder
        self.retokenized_chars = 0
        if snippets and path is not None:
            snippets = outside_window(snippets, path, prefix, suffix, b.budget, b.suffix_budget)
        start = self._window_start_in(prefix) if self.prefix_ids else None  # where the window is now, if kept
        if self.retriever is not None and snippets:
            snippets = self.retriever.select(prefix, snippets, window_holds=self.hold_context and start is not None)
        key = (path, tuple((s.uri, s.text) for s in snippets or ()))
        if key != self.context_key:
            self.context_key = key
            self.context = b.context_tokens(list(snippets or ())) + b.header(path)

        head = suffix[: b.suffix_budget * 8]  # all that fit_suffix reads
        if head != self.suffix_head:
            self.suffix_head = head
            self.suffix_end, self.suffix_ids = b.fit_suffix(suffix)
            self.retokenized_chars += len(head)

        overhead = len(b.assemble([], [], []))
        budget = b.budget - len(self.context) - len(self.suffix_ids) - overhead
        self.prefix_budget = budget
        if start is None or not self._extend_prefix(prefix, start, budget):
            self.prefix_start, _ = b.fit_prefix(prefix, budget)
            self.before_start = prefix[max(0, self.prefix_start - BEFORE_CHARS): self.prefix_start]
            self.prefix_text = prefix[self.prefix_start:]
            self.prefix_ids, self.prefix_offsets = self._encode(self.prefix_text)
        tokens = b.assemble(self.context, self.prefix_ids, self.suffix_ids)
        return Prompt(tokens=tokens, window=Window(self.prefix_start, self.suffix_end),
                      prefix_tokens=len(self.prefix_ids))

    def _extend_prefix(self, prefix: str, start: int, budget: int) -> bool:
        """Re-tokenize only the changed tail, keeping the window's start (now at
        `start`); False when it no longer holds (an edit at it, or an overflow)."""
        text = prefix[start:]
        same = common_prefix_length(self.prefix_text, text)
        if same == 0:
            return False
        self.prefix_start, self.before_start = start, prefix[max(0, start - BEFORE_CHARS): start]
        keep, restart = self.settled(text, same)
        ids, offsets = self._encode(text[restart:], base=restart)
        new_ids = self.prefix_ids[:keep] + ids
        if len(new_ids) > budget:
            return False
        self.prefix_text, self.prefix_ids = text, new_ids
        self.prefix_offsets = self.prefix_offsets[:keep] + offsets
        return True

    def _window_start_in(self, prefix: str) -> int | None:
        """Where the window starts in a new `prefix`: where it did, if the
        same text comes before it; or else where its first two lines are
        found, once. A client that sends the lines around the cursor
        (llama.vim: the 256 before it), or an edit above the window that
        added or removed lines, moves the window's text within the prefix it
        is sent; the window keeps its text (and its cached K/V)."""
        at, before = self.prefix_start, self.before_start
        if len(before) <= at <= len(prefix) and prefix.startswith(before, at - len(before)):
            return at
        line = self.prefix_text.find("\n")
        head = self.prefix_text[: self.prefix_text.find("\n", line + 1) + 1] if line >= 0 else ""
        if len(head) < HEAD_CHARS:  # too common to be found (also: a window of less than two lines)
            return None
        at = prefix.find(head)
        if at < 0 or prefix.find(head, at + 1) >= 0 or (at > 0 and prefix[at - 1] != "\n"):
            return None
        return at

    def settled(self, text: str, same: int) -> tuple[int, int]:
        """(tokens kept, char offset re-tokenized from) for a window text
        whose first `same` chars are the last one's: the restart is at the
        token that holds the newline ending the line before the edit's line,
        far enough back that the tokens before it are settled."""
        line = text.rfind("\n", 0, same)
        cut = text.rfind("\n", 0, line) if line > 0 else -1
        keep = 0
        if cut > 0:  # the first token starting where the one holding `cut` starts
            j = max(bisect.bisect_right(self.prefix_offsets, cut) - 1, 0)
            keep = bisect.bisect_left(self.prefix_offsets, self.prefix_offsets[j])
        return keep, self.prefix_offsets[keep] if keep < len(self.prefix_offsets) else len(text)
