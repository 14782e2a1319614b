"""A document's text around the cursor, as the Neovim plugin cuts it
(lua/completer/text.lua): the lines sent, a window of at least `max_lines`
each side whose edges snap outwards to a grid, so the prompt's start (and
the server's cached K/V) stays put while the cursor moves within a step; and
the mode `auto` asks for."""

from __future__ import annotations


def window_step(max_lines: int) -> int:
    """The grid the window's edges snap to: a multiple of 32 (half the window)."""
    if max_lines >= 64:
        return max_lines // 64 * 32
    return max(1, max_lines // 2)


def window(row: int, n: int, max_lines: int) -> tuple[int, int]:
    """The first and last (exclusive) lines sent for a cursor on `row` of `n` lines (0: all)."""
    if max_lines <= 0:
        return 0, n
    step = window_step(max_lines)
    first = max(0, (row - max_lines) // step * step)
    last = min(n, -(-(row + 1 + max_lines) // step) * step)
    return first, last


def unix(text: str) -> str:
    return text.replace("\r\n", "\n")


def around(lines: list[str], row: int, col: int, max_lines: int) -> tuple[str, str, int, int]:
    """prefix, suffix, and the window's first and last line, for a cursor at
    `row`, `col` (code points) of `lines` (each with its line ending)."""
    n = len(lines)
    first, last = window(row, max(n, row + 1), max_lines)
    line = lines[row] if row < n else ""
    prefix = "".join(lines[first:row]) + line[:col]
    suffix = line[col:] + "".join(lines[row + 1:last])
    return unix(prefix), unix(suffix), first, last


def mode(setting: str, before: str, after: str) -> str:
    """`auto`: `block` on a blank line (a new statement may follow), else `line`
    (code after the cursor is the rest of a statement)."""
    if setting != "auto":
        return setting
    return "block" if not before.strip() and not after.strip() else "line"


def changed_lines(start_line: int, text: str) -> tuple[int, int]:
    """The lines [first, last) an edit that inserted `text` at `start_line` now covers."""
    return start_line, start_line + text.count("\n") + 1
