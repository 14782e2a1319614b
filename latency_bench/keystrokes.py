"""Keystroke traces: what simulated editors type, key by key, into real code.

An editor opens a file of the corpus (by default pip's sources, held out from
anything trained here), jumps to a site, takes out the next 1-4 lines there
and types them back as a person would: one key at a time with lognormal gaps,
a pause at each line start (reading, thinking), the indentation inserted by
the editor on Enter, now and then a wrong key and a backspace. Then it moves
to another site of the same file or opens another file; files it opened stay
open with their edits. Every key is one `Key`; the replayer sends a
`complete` after each, as the plugins do.

A trace is a function of (corpus, seed, editor index) only, so every server
of a comparison gets the same keystrokes at the same times.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import msgspec

from completer.training.corpus import pip_sources

KEY_GAP_S = 0.16  # median gap between keys of a word (~75 words a minute)
LINE_PAUSE_S = (0.4, 2.0)  # thinking before a new line, uniform
TYPO_P = 0.02  # a wrong key, seen and erased with a backspace
OTHER_FILE_P = 0.3  # after a site: another file rather than another site here


class Document(msgspec.Struct, frozen=True):
    uri: str
    text: str  # as opened: the file with the lines to type taken out at its sites


class Key(msgspec.Struct, frozen=True, array_like=True):
    """One keystroke: after `gap_s`, `delete` chars before `at` go and `insert`
    comes in; the cursor ends after it. `expect` is the rest of the real line
    from there (what a suggestion should say); "" when the key is a typo."""

    gap_s: float
    doc: int
    at: int
    delete: int
    insert: str
    expect: str


class Trace(msgspec.Struct, frozen=True):
    editor: int
    documents: list[Document]
    keys: list[Key]


def corpus_files(root: Path | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(description, [(path, text)]) of Python files of 2-60 KB under `root`;
    by default the installed pip's sources."""
    if root is None:
        root, version = pip_sources()
        name = f"pip {version} sources"
    else:
        name = str(root)
    files = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if 2_000 <= len(text) <= 60_000:
            files.append((path.relative_to(root).as_posix(), text))
    if not files:
        raise SystemExit(f"error: no Python files of 2-60 KB under {root}")
    return name, files


def typing_sites(text: str, rng: random.Random, count: int) -> list[tuple[int, int]]:
    """Up to `count` (start, end) char ranges of 1-4 whole lines to type, each
    starting at an indented line with code (a body, where completions are
    asked for), not overlapping, in file order."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    candidates = [i for i, line in enumerate(lines)
                  if line.startswith((" ", "\t")) and len(line.strip()) >= 8 and i > 5]
    rng.shuffle(candidates)
    taken: list[tuple[int, int]] = []
    for i in candidates:
        n = rng.randint(1, 4)
        j = min(i + n, len(lines))
        if all(j <= a or i >= b for a, b in taken):
            taken.append((i, j))
        if len(taken) == count:
            break
    return sorted((starts[a], starts[b]) for a, b in taken)


def type_lines(lines: str, at: int, doc: int, rng: random.Random):
    """Keys that type `lines` (whole lines, each ending in a newline) at `at`:
    one per character, but Enter brings the next line's indentation with it,
    as editors auto-indent, and comes after a pause to think."""
    def rest_of_line(i: int) -> str:
        end = lines.find("\n", i)
        return lines[i: end if end >= 0 else len(lines)]

    first = len(lines) - len(lines.lstrip(" \t"))
    i = 0
    if first:  # opening a new line there (`o`, End+Enter): indented already
        yield Key(rng.uniform(*LINE_PAUSE_S), doc, at, 0, lines[:first], rest_of_line(first))
        i = first
    while i < len(lines):
        ch = lines[i]
        gap = rng.lognormvariate(math.log(KEY_GAP_S), 0.45)
        if ch == "\n" and i + 1 < len(lines):
            nxt = lines[i + 1:]
            insert = "\n" + nxt[: len(nxt) - len(nxt.lstrip(" \t"))]
            yield Key(rng.uniform(*LINE_PAUSE_S), doc, at + i, 0, insert, rest_of_line(i + len(insert)))
            i += len(insert)
            continue
        if ch != "\n" and rng.random() < TYPO_P:
            yield Key(gap, doc, at + i, 0, rng.choice("abcdefghijklmnopqrstuvwxyz_.("), "")
            yield Key(rng.lognormvariate(math.log(0.3), 0.3), doc, at + i + 1, 1, "", rest_of_line(i))
            gap = rng.lognormvariate(math.log(KEY_GAP_S), 0.45)
        yield Key(gap, doc, at + i, 0, ch, rest_of_line(i + 1) if ch != "\n" else "")
        i += 1


def make_trace(files: list[tuple[str, str]], seed: int, editor: int, keys: int,
               run: str = "replay") -> Trace:
    """`keys` keystrokes of one editor. `run` names the documents' URIs, so
    runs that must not share cached prompts (one editor count after another
    on the same server) do not."""
    rng = random.Random(f"{seed}:{editor}")
    documents: list[Document] = []
    out: list[Key] = []
    open_files: list[tuple[int, list[tuple[int, int]]]] = []  # (doc index, sites left: (start, text))
    while len(out) < keys:
        if not open_files or rng.random() < OTHER_FILE_P:
            path, text = rng.choice(files)
            sites = typing_sites(text, rng, rng.randint(2, 5))
            if not sites:
                continue
            # Take the lines out; each site is then where its lines go back in.
            opened, left, cut = [], [], 0
            last = 0
            for a, b in sites:
                opened.append(text[last:a])
                left.append((a - cut, text[a:b]))
                cut += b - a
                last = b
            opened.append(text[last:])
            documents.append(Document(f"file:///bench/{run}/e{editor}/{len(documents)}/{path}", "".join(opened)))
            open_files.append((len(documents) - 1, left))
        doc, left = rng.choice(open_files)
        if not left:
            open_files.remove((doc, left))
            continue
        at, lines = left.pop(0)
        out.extend(type_lines(lines, at, doc, rng))
        # Later sites of this document moved by what was typed here.
        left[:] = [(s + len(lines), t) for s, t in left]
    return Trace(editor, documents, out[:keys])


class EditorState:
    """The documents as the editor has them while a trace is replayed."""

    def __init__(self, trace: Trace):
        self.texts = [d.text for d in trace.documents]

    def press(self, key: Key) -> tuple[str, str]:
        """Apply the key; (prefix, suffix) around the cursor after it."""
        text = self.texts[key.doc]
        text = text[: key.at - key.delete] + key.insert + text[key.at:]
        self.texts[key.doc] = text
        cursor = key.at - key.delete + len(key.insert)
        return text[:cursor], text[cursor:]
