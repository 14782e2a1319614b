"""A cursor in a file, as the command line names it (torch-free: the client uses it too)."""

from __future__ import annotations

from pathlib import Path


def split_cursor(spec: str) -> tuple[Path, int, int]:
    """`path/to/file.py:LINE:COL` (1-based, COL counts characters)."""
    try:
        path, line, col = spec.rsplit(":", 2)
        return Path(path), int(line), int(col)
    except ValueError:
        raise SystemExit(f"error: expected FILE:LINE:COL, got {spec!r}") from None


def document_at(path: Path, line: int, col: int) -> tuple[str, str]:
    """The file's text before and after the cursor."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"error: cannot read {path}: {e}") from None
    lines = text.split("\n")
    if not 1 <= line <= len(lines) or not 1 <= col <= len(lines[line - 1]) + 1:
        raise SystemExit(f"error: {path}:{line}:{col} is outside the file "
                         f"({len(lines)} lines; line {min(line, len(lines))} has "
                         f"{len(lines[min(line, len(lines)) - 1])} characters)")
    offset = sum(len(s) + 1 for s in lines[: line - 1]) + col - 1
    return text[:offset], text[offset:]
