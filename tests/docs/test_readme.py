"""Every shell block of the README runs as written in bash, or is checked:
each is marked (tests/support/readme_blocks.py says how); `run` blocks run, `check`
blocks parse in bash and their `completer` commands parse with the real
argument parsers; the client example runs in tests/cli/test_first_start.py."""

import os
import subprocess
from shlex import quote
import sys
from pathlib import Path

import pytest

from support.readme_blocks import MARKS, ROOT, commands, parse_with_our_parsers, shell_blocks

BLOCKS = shell_blocks()


def activated_env() -> dict:
    """As after `source .venv/bin/activate`: this interpreter's bin dir (its
    `completer`, its `python`) first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "VIRTUAL_ENV": str(Path(sys.executable).parents[1])}


def test_every_shell_block_is_marked():
    assert len(BLOCKS) >= 8
    for block in BLOCKS:
        assert block.mark in MARKS, f"{block}: mark it <!-- readme-test: {'|'.join(MARKS)} -->"
        if block.mark == "skip":
            assert block.reason, f"{block}: a skipped block says why"
    assert [b.mark for b in BLOCKS].count("client-example") == 1


def test_the_readme_says_what_its_commands_need():
    text = (ROOT / "README.md").read_text()
    assert "Python 3.11" in text
    assert "source .venv/bin/activate" in text  # later sections call `completer` bare
    assert "$XDG_CONFIG_HOME/completer/token" in text
    assert "## Connect your editor" in text
    assert "echo -n" not in text  # bash's echo -n sends a backslash-n, not a newline: printf does
    for block in BLOCKS:  # what a block pipes into a completion is the text meant, newlines included
        for words in commands(block.body):
            if words[0] == "printf":
                sent = subprocess.run(["bash", "-c", " ".join(map(quote, words))], capture_output=True).stdout
                assert b"\\n" not in sent and sent.count(b"\n") == words[1].count("\\n"), (block, sent)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark in ("check", "run", "client-example")], ids=repr)
def test_a_block_parses_in_bash_and_its_completer_commands_parse(block):
    syntax = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block}: {syntax.stderr}"
    ours = 0
    for words in commands(block.body):
        if Path(words[0]).name == "completer" or "completer." in " ".join(words[1:3]):
            ours += 1
        problem = parse_with_our_parsers(words)
        assert problem is None, f"{block}: {' '.join(words)}: {problem}"
    assert ours or block.mark == "check", block


def test_the_parser_check_can_fail():
    assert parse_with_our_parsers(["completer", "complete", "--no-such-flag"]) is not None
    assert parse_with_our_parsers(["completer", "models", "fetch"]) is not None
    assert parse_with_our_parsers(["completer", "models", "pull"]) is None


@pytest.mark.timeout(1200)  # the block itself may take up to 900 s
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.mark == "run"], ids=repr)
def test_a_run_block_runs_as_written(block, default_model):
    """In bash with -e and pipefail, from the repository root, the venv
    activated; each completion command prints a suggestion."""
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.body], cwd=ROOT, env=activated_env(),
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{block}: {done.stderr}"
    completions = sum(1 for words in commands(block.body) if words[:2] == ["completer", "complete"])
    summaries = [line for line in done.stderr.splitlines() if "| ttft" in line]
    assert len(summaries) == completions, done.stderr
    assert all(not line.endswith("deadline") for line in summaries), done.stderr
    assert len([line for line in done.stdout.splitlines() if line.strip()]) >= completions, done.stdout
