"""The windows an open document's next jump will take, as prompt heads to
warm while the engine is idle (issue #42).

A prompt's window keeps its start while the cursor moves within its budget
(`DocumentPrompt._extend_prefix`), and a jump out of it refits the start on a
line grid (`PromptBuilder.fit_prefix`): so the prompts of every cursor
position within a screen or two of the current one start with one of a few
*heads*, the context block and the window's prefix text from its start. A
head prefilled ahead of time (a `warm` request: bulk work, the last of it)
leaves a jump only the tokens near the new cursor to compute. Exact, not
approximate: a warm head is the very prompt the jump builds, up to the
cursor, tokenized the same way.

The heads, nearest first: the current window run on to its full budget (a
jump forward within it), then the windows that cursors up to REACH_LINES
lines above and below would refit to, by the distance of the nearest. SPM prompts put the suffix first, so no head
is shared: none there.
"""

from __future__ import annotations

import bisect

from completer.document import DocumentPrompt

# Cursors every LINE_STEP lines up and down, out to REACH_LINES, are asked
# which window they would take, nearest first: an editor's near jumps stay
# within a screen or two.
LINE_STEP, REACH_LINES = 4, 64


def warm_heads(state: DocumentPrompt, count: int, prefix: str, suffix: str) -> list[list[int]]:
    """Up to `count` prompt heads for the document's last update (`prefix`
    and `suffix`: the text it was given), nearest first."""
    b = state.builder
    if count <= 0 or state.prefix_start < 0 or b.head([], []) is None:
        return []
    full, budget, start = prefix + suffix, state.prefix_budget, state.prefix_start
    encode = b.tok.tokenizer.encode
    # The window as it stands, on to its budget: its tokens up to the last
    # settled line kept as the next keystroke keeps them, the rest encoded on.
    keep, restart = state.settled(state.prefix_text, len(state.prefix_text))
    more = encode(full[start + restart: start + restart + 8 * budget], add_special_tokens=False)
    ids = (state.prefix_ids[:keep] + more.ids)[:budget]
    taken = len(ids) - keep
    reach = start + restart + (more.offsets[taken - 1][1] if taken > 0 else 0)  # its last char, exclusive
    heads, starts = [b.head(state.context, ids)], {start}
    cursor_line = prefix.count("\n")
    lines = _line_starts(full, cursor_line, REACH_LINES)
    # Where the candidates' windows would start: counted on one encoding of
    # the stretch they can reach (a substring's own encoding may differ by a
    # token at its ends: a miss there costs a warm window, never a wrong
    # prompt), the heads themselves encoded as the jump will encode them.
    low = max(0, min(lines.values()) - 8 * budget)
    offsets = [low + a for a, _ in encode(full[low: max(lines.values())], add_special_tokens=False).offsets]

    def tokens(begin: int, end: int) -> int:
        return bisect.bisect_left(offsets, end) - bisect.bisect_left(offsets, begin)

    for jump in range(LINE_STEP, REACH_LINES + 1, LINE_STEP):
        for line in (cursor_line - jump, cursor_line + jump):
            at = lines.get(line)
            if at is None or start <= at <= reach:  # beyond the file, or this window holds it
                continue
            fit, _ = b.fit_prefix(full[:at], budget, tokens)
            if fit in starts:
                continue
            starts.add(fit)
            window = encode(full[fit: fit + 8 * budget], add_special_tokens=False).ids[:budget]
            heads.append(b.head(state.context, window))
            if len(heads) >= count:
                return heads
    return heads


def _line_starts(text: str, line: int, reach: int) -> dict[int, int]:
    """Char offsets of the starts of lines `line - reach` .. `line + reach` that exist."""
    first = max(0, line - reach)
    at = 0
    for _ in range(first):
        at = text.find("\n", at) + 1
    found = {first: at}
    for n in range(first + 1, line + reach + 1):
        nl = text.find("\n", at)
        if nl < 0:
            break
        at = found[n] = nl + 1
    return found
