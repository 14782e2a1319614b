"""The README's fenced shell blocks and how each is marked: an HTML comment
on the line before the fence, `<!-- readme-test: MARK (why) -->`, where MARK is

    run             run as written in bash (the venv's bin first on PATH, as after `source .venv/bin/activate`)
    check           not run (it installs, trains, needs another host); its syntax
                    and every `completer` command's flags are checked with the real parsers
    client-example  the client example: tests/cli/test_first_start.py runs it against a fresh server
    skip (why)      needs what CI has not (an editor, Node); the reason is required
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKS = ("run", "check", "client-example", "skip")
SHELLS = ("bash", "sh", "shell", "console")
SEPARATORS = (";", "&&", "||", "|", "&")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARK = re.compile(r"<!-- readme-test: ([\w-]+)(?: \((.+)\))? -->\s*$")


class Block:
    def __init__(self, mark: str | None, reason: str, body: str, line: int):
        self.mark, self.reason, self.body, self.line = mark, reason, body, line

    def __repr__(self) -> str:
        return f"README.md:{self.line} ({self.mark}): {self.body.splitlines()[0]!r}"


def shell_blocks(text: str | None = None) -> list[Block]:
    text = README.read_text() if text is None else text
    blocks = []
    for fence in FENCE.finditer(text):
        if fence.group(1) not in SHELLS:
            continue
        before = text[:fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        blocks.append(Block(mark.group(1) if mark else None, (mark.group(2) or "") if mark else "",
                            fence.group(2), text[:fence.start()].count("\n") + 1))
    return blocks


def commands(body: str) -> list[list[str]]:
    """Each simple command of a block as its words (continued lines joined,
    comments dropped, split at newlines, `&&`, `||`, `|`, `;`, `&`), leading
    VAR=value assignments left out."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for word in [*lexer, ";"]:
            if word not in SEPARATORS:
                current.append(word)
                continue
            while current and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", current[0]):
                current.pop(0)
            if current:
                out.append(current)
            current = []
    return out


def parse_with_our_parsers(words: list[str]) -> str | None:
    """None if `words` is a command of ours that its parser accepts (or not
    one of ours); else what the parser said."""
    from completer import cli, client

    if Path(words[0]).name == "completer":
        parser, argv = cli.build_parser(), words[1:]
    elif Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "completer.client"]:
        parser, argv = client.build_parser(), words[3:]
    elif Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "completer.cli"]:
        parser, argv = cli.build_parser(), words[3:]
    else:
        return None
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else said.getvalue().strip()
    return None
