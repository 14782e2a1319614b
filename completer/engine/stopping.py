"""From accepted tokens to streamed text: incremental UTF-8 decoding, the
modes' ends, stop strings, and trimming (text that repeats what follows the
cursor, a line that repeats the file's next line, degenerate repetition).

Text that might still be trimmed (a possible start of a stop string, a tail
that duplicates the suffix, a line that may yet equal the next line) is held
back, so a delta once sent is never retracted and the deltas always
concatenate to the final text.
"""

from __future__ import annotations

import codecs
import re
from typing import Callable

from completer.engine.request import Confidence
from completer.healing import consume


def line_mode_end(text: str) -> int | None:
    """Where a `line` completion ends: the first newline after some visible text
    (a completion at the end of `def f():` may begin with a newline and indent)."""
    seen_text = False
    for i, ch in enumerate(text):
        if ch == "\n" and seen_text:
            return i
        if not ch.isspace():
            seen_text = True
    return None


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def block_end(text: str, cursor_line: str) -> int | None:
    """Where a `block` completion ends: before the first later non-empty line
    indented less than the block. `cursor_line` is the prefix's last line:
    blank (the cursor sits in an indented empty line: the block is that
    indentation) or code (the block is what gets indented under it)."""
    base = indent_of(cursor_line)
    inside = base if not cursor_line.strip() else base + 1
    lines = text.split("\n")
    offset = len(lines[0]) + 1
    for line in lines[1:]:  # a partial last line counts once it shows code
        if line.strip() and indent_of(line) < inside:
            return offset - 1
        offset += len(line) + 1
    return None


def repetition_start(text: str, min_repeats: int = 6, max_period: int = 16) -> int | None:
    """If `text` ends in a short pattern repeated `min_repeats` times, where the
    first copy ends (the rest is degenerate)."""
    for period in range(1, max_period + 1):
        span = period * min_repeats
        if len(text) < span or not text[-period:].strip():
            continue
        unit = text[-period:]
        if text[-span:] == unit * min_repeats:
            start = len(text) - span
            while start >= period and text[start - period: start] == unit:
                start -= period
            return start + period
    return None


def next_nonblank_line(suffix: str) -> str:
    """The first non-blank line after the cursor's (the suffix's first line is
    the rest of the cursor's), stripped; "" when there is none. Reads only as
    far as that line, however long the suffix."""
    newline = suffix.find("\n")
    while newline >= 0:
        after = suffix.find("\n", newline + 1)
        line = suffix[newline + 1: after if after >= 0 else len(suffix)].strip()
        if line:
            return line
        newline = after
    return ""


def overlap_with_suffix(text: str, suffix_line: str) -> int:
    """Length of the longest tail of `text` that begins `suffix_line` (a closing
    bracket the editor already has, say)."""
    for n in range(min(len(text), len(suffix_line)), 0, -1):
        if text.endswith(suffix_line[:n]):
            return n
    return 0


class OutputText:
    """Accumulates a request's text token by token; says what may be sent."""

    def __init__(self, token_bytes: Callable[[int], bytes], mode: str, stop: tuple[str, ...],
                 cursor_line: str = "", suffix: str = "", heal: bytes = b"", next_line: str = "",
                 confidence: Confidence = Confidence(), report_probs: bool = False):
        """next_line: the file's first non-blank line below the cursor's
        (`next_nonblank_line`); in `line` and `block` modes a completed line
        equal to it (whitespace stripped) ends the text before that line, as
        llama.vim and Tabby drop suggestions that repeat the code below.
        confidence: where the text ends because the model is unsure (`unsure`);
        report_probs: keep each token's text and probability (`pieces`)."""
        self.token_bytes = token_bytes
        self.heal = heal  # bytes the first tokens must re-spell (token healing); not output
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.mode = mode
        self.stop = tuple(s for s in stop if s)
        # One pass per token over only the text a stop string could newly
        # start in; the held-back tail is looked up among the strings' heads.
        self.stop_pattern = re.compile("|".join(map(re.escape, self.stop))) if self.stop else None
        self.stop_heads = {s[:n] for s in self.stop for n in range(1, len(s))}
        self.longest_head = max(map(len, self.stop_heads), default=0)
        self.unscanned = 0  # no stop string starts before this offset of `text`
        self.cursor_line = cursor_line
        nl = suffix.find("\n")
        self.suffix_line = (suffix if nl < 0 else suffix[:nl]).rstrip()
        self.next_line = next_line.strip() if mode != "free" else ""
        self.unchecked_line = 0  # offset in `text` of the first line not yet compared with next_line
        self.confidence = confidence if mode != "free" else Confidence()
        # Block mode's later lines are sent only once complete and sure (`_holdback`).
        self.hold_lines = mode == "block" and self.confidence.line > 0
        self.cut = ""  # the rule that ended the text, if one did
        self.past_first = False  # (`_past_first_line`)
        self.pieces: list[tuple[str, float]] | None = [] if report_probs else None
        self.text = ""
        self.emitted = 0  # chars of `text` already sent

    def _end(self) -> int | None:
        """Where the text ends by mode or stop string, if it has ended."""
        ends = []
        if self.mode == "line":
            ends.append(line_mode_end(self.text))
        elif self.mode == "block":
            ends.append(block_end(self.text, self.cursor_line))
        if self.stop_pattern is not None:
            if (match := self.stop_pattern.search(self.text, self.unscanned)) is not None:
                ends.append(match.start())
            self.unscanned = max(0, len(self.text) - self.longest_head)
        if self.next_line:
            ends.append(self._repeated_line_end())
        found = [e for e in ends if e is not None]
        return min(found) if found else None

    def _repeats_next_line(self, line: str, first: bool) -> bool:
        """Whether a line of the text, once complete, equals the file's next
        line. The first line continues the cursor's, so the two are compared
        together, and only once the completion wrote something on it (one
        that begins with a newline keeps the cursor's line as it is)."""
        if first:
            if not line.strip():
                return False
            line = self.cursor_line + line
        return line.strip() == self.next_line

    def _repeated_line_end(self) -> int | None:
        """Where the text ends because a line completed since the last call
        repeats the next line: before that line and the newline opening it."""
        while (newline := self.text.find("\n", self.unchecked_line)) >= 0:
            start, self.unchecked_line = self.unchecked_line, newline + 1
            cut = max(0, start - 1)
            # (A repeated line was held back whole; `cut >= emitted` keeps that promise regardless.)
            if cut >= self.emitted and self._repeats_next_line(self.text[start:newline], start == 0):
                return cut
        return None

    def _next_line_holdback(self) -> int:
        """Chars held while the line being written may still turn out to be
        the next line: all of it, from the newline that opens it."""
        start = self.text.rfind("\n") + 1
        line = self.text[start:] if start else self.cursor_line + self.text
        return len(self.text) - max(0, start - 1) if self.next_line.startswith(line.strip()) else 0

    def _past_first_line(self) -> bool:
        """Whether the text has gone past its first line (found once: the text only grows until it ends)."""
        self.past_first = self.past_first or line_mode_end(self.text) is not None
        return self.past_first

    def unsure(self, prob: float) -> bool:
        """Whether the text ends before a token the model gives `prob`, by the
        confidence rules; if so, `text` is cut to what stays. Up to the first
        visible token the `first` rule holds (below it: nothing is shown); on
        the first line after it, `token` (the text ends before the token); in
        block mode on a later line, `line` (the block ends before that line)."""
        c = self.confidence
        if not c.on:
            return False
        if not self.text.strip():
            if prob >= max(c.first, c.token):
                return False
            self.text, self.cut = self.text[: self.emitted], "first"  # (whitespace, all held back: nothing sent)
            return True
        later_line = self.mode == "block" and self._past_first_line()
        if prob >= (c.line if later_line else c.token):
            return False
        self.cut = "line" if later_line else "token"
        if later_line:  # (the line in progress and the newline before it were held back)
            self.text = self.text[: max(self.text.rfind("\n"), self.emitted)]
        return True

    def _holdback(self) -> int:
        """Chars at the end that might yet be trimmed."""
        hold = overlap_with_suffix(self.text, self.suffix_line) if self.suffix_line else 0
        if self.hold_lines and self._past_first_line():  # a later line, until it is complete
            hold = max(hold, len(self.text) - self.text.rfind("\n"))
        if self.next_line:
            hold = max(hold, self._next_line_holdback())
        for n in range(min(self.longest_head, len(self.text)), hold, -1):
            if self.text[-n:] in self.stop_heads:
                hold = n
                break
        if self.mode != "free":  # the end of a line may still be cut
            hold = max(hold, len(self.text) - len(self.text.rstrip()))
        return hold

    def add(self, token_id: int, prob: float | None = None) -> tuple[str, bool]:
        """Append a token (`prob`: its probability, kept in `pieces` if they are);
        returns (text that may be sent now, whether it ended)."""
        new = self.token_bytes(token_id)
        if self.heal:
            self.heal, new = consume(self.heal, new)
        piece = self.decoder.decode(new)
        self.text += piece
        if self.pieces is not None and prob is not None:
            self.pieces.append((piece, round(prob, 6)))
        end = self._end()
        if end is not None:
            self.text = self.text[:end]
            return "", True
        # `free` mode ends only at max_tokens, stop strings and end of text.
        if self.mode != "free" and (rep := repetition_start(self.text)) is not None:
            self.text = self.text[: max(rep, self.emitted)]
            return "", True
        safe = max(len(self.text) - self._holdback(), self.emitted)
        delta, self.emitted = self.text[self.emitted: safe], safe
        return delta, False

    def finish(self) -> str:
        """Final trim; returns the last delta (what was held back and survives)."""
        self.text += self.decoder.decode(b"", final=True)
        trimmed = self.text
        if self.next_line:  # the last line is complete now
            start = trimmed.rfind("\n") + 1
            if max(0, start - 1) >= self.emitted and self._repeats_next_line(trimmed[start:], start == 0):
                trimmed = trimmed[: max(0, start - 1)]
        if self.mode != "free":
            trimmed = trimmed.rstrip()
        if self.suffix_line:
            trimmed = trimmed[: len(trimmed) - overlap_with_suffix(trimmed, self.suffix_line)]
        # Both are prefixes of the text: never retract what was already sent.
        self.text = trimmed if len(trimmed) >= self.emitted else self.text[: self.emitted]
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
