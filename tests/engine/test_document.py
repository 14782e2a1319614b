"""Per-document prompts: a keystroke re-tokenizes only what changed, whatever
the file's size, and the prompt spells the same window a fresh build picks."""

import random

import pytest

from completer.document import DocumentPrompt, common_prefix_length, outside_window
from completer.prompt import PromptBuilder, Snippet, get_template
from completer.tokenizer import train_bpe
from completer.training.corpus import read_python_files, stdlib_root


@pytest.fixture(scope="module")
def source():
    files = read_python_files(stdlib_root() / "json") + read_python_files(stdlib_root() / "email")
    return files


@pytest.fixture(scope="module")
def tok(source, tmp_path_factory):
    return train_bpe([f.text for f in source[:8]], 800, tmp_path_factory.mktemp("tok"))


def test_common_prefix_length():
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("same", "same") == 4


def typed(text: str, n: int):
    """Keystroke states: typing `text[:n]` one char at a time."""
    for i in range(1, n + 1):
        yield text[:i]


@pytest.mark.parametrize("file_chars", [4_000, 60_000])
def test_typing_retokenizes_a_bounded_tail(tok, source, file_chars):
    body = "".join(f.text for f in source)[:file_chars]
    cut = body.rfind("\n", 0, len(body) // 2) + 1
    prefix, suffix = body[:cut], body[cut:]
    doc = DocumentPrompt(PromptBuilder(tok, get_template("default"), budget=512))
    fresh = PromptBuilder(tok, get_template("default"), budget=512)
    first = doc.update(prefix, suffix, "mod.py")
    assert first == fresh.build(prefix, suffix, "mod.py")
    new_line = "    result = self.parse_header(value, strict=True)\n"
    worst, starts = 0, {first.window.prefix_start}
    for state in typed(new_line, len(new_line)):
        text = prefix + state
        prompt = doc.update(text, suffix, "mod.py")
        worst = max(worst, doc.retokenized_chars)
        starts.add(prompt.window.prefix_start)
        assert len(prompt.tokens) <= 512
        window = text[prompt.window.prefix_start:]
        assert tok.decode(prompt.tokens).endswith(window)
        assert suffix[: prompt.window.suffix_end] in tok.decode(prompt.tokens)
    assert len(starts) <= 2  # typing a line moves the start at most once
    # Each keystroke re-tokenizes about two lines, not the window or the file.
    assert worst < 400, worst


def test_edit_before_the_window_and_suffix_change(tok, source):
    body = source[3].text
    doc = DocumentPrompt(PromptBuilder(tok, get_template("default"), budget=256))
    fresh = PromptBuilder(tok, get_template("default"), budget=256)
    rng = random.Random(0)
    prefix, suffix = body[: len(body) // 2], body[len(body) // 2:]
    for _ in range(60):
        kind = rng.random()
        if kind < 0.5:
            prefix += rng.choice("abc (),.:\n    ")
        elif kind < 0.7:
            prefix = prefix[:-1]
        elif kind < 0.85:
            i = rng.randrange(len(prefix))
            prefix = prefix[:i] + "x" + prefix[i:]
        else:
            suffix = "y" + suffix
        prompt = doc.update(prefix, suffix, "m.py")
        want = fresh.build(prefix, suffix, "m.py")
        window = prefix[prompt.window.prefix_start:]
        assert tok.decode(prompt.tokens).endswith(window)
        assert len(prompt.tokens) <= 256
        assert prompt.window.suffix_end == want.window.suffix_end


def test_a_jump_with_a_new_snippet_of_the_code_around_it_keeps_the_context_block(tok, source):
    """An editor sends a snippet of the code it just edited with every request
    (llama.vim's ring, our plugins' "edit" items); that code is in the
    window already, and the context block, which the prompt starts with,
    stays as it was. A snippet of this file beyond the window's reach, and
    other files', are kept."""
    body = "".join(f.text for f in source)[:60_000]
    cut = body.rfind("\n", 0, 30_000) + 1
    lines = body[:cut].split("\n")
    other = Snippet("pkg/other.py", "\n".join(lines[-6:-1]), "open")  # names the cursor's code shares: placed
    doc = DocumentPrompt(PromptBuilder(tok, get_template("default"), budget=2048), retrieval=True)
    doc.update(body[:cut], body[cut:], "pkg/mod.py", [other])
    before = doc.context_key
    near = body.rfind("\n", 0, cut - 400) + 1  # a jump a few lines up, the lines edited there sent back
    edit = Snippet("pkg/mod.py", body[near - 300: near + 300], "edit")
    doc.update(body[:near], body[near:], "pkg/mod.py", [edit, other])
    assert doc.context_key == before and before[1] != ()
    far = Snippet("pkg/mod.py", body[1_000:1_600], "edit")  # 28 KB away: beyond any window
    assert outside_window([edit, far, other], "pkg/mod.py", body[:near], body[near:], 2048) == [far, other]


def test_a_client_that_sends_the_lines_above_the_cursor_keeps_its_window_across_a_jump(tok, source):
    """llama.vim sends the 256 lines before the cursor: a jump moves where the
    text starts. The window keeps its text (so its cached K/V), as it does
    for a client that sends the whole file; and a window refit after a jump
    out of it starts where a whole-file client's refit starts (the grid is
    drawn by content, not by line number)."""
    lines = "".join(f.text for f in source)[:80_000].split("\n")
    builder = PromptBuilder(tok, get_template("default"), budget=512)
    sent_above = DocumentPrompt(builder)
    whole_file = DocumentPrompt(builder)

    def at(row: int, doc: DocumentPrompt, above: int | None) -> str:
        first = 0 if above is None else max(0, row - above)
        prompt = doc.update("\n".join(lines[first:row]) + "\n", "\n".join(lines[row:row + 64]), "m.py")
        return ("\n".join(lines[first:row]) + "\n")[prompt.window.prefix_start:]

    row = 900
    window = at(row, sent_above, 256)
    assert at(row, whole_file, None) == window
    for jump in (-12, -5, 3, 9):  # within the window: the same first line, the window text up to the cursor
        moved = at(row + jump, sent_above, 256)
        assert moved == ("\n".join(lines[:row + jump]) + "\n")[-len(moved):]
        assert moved[:200] == window[:200], jump
    for far in (700, 1_200, 1_240):  # out of it: refit where a whole-file client refits
        assert at(far, sent_above, 256) == at(far, whole_file, None)
        assert at(far, sent_above, 200) == at(far, whole_file, None)


def test_lines_inserted_above_the_window_do_not_move_its_text(tok, source):
    body = "".join(f.text for f in source)[:60_000]
    cut = body.rfind("\n", 0, 40_000) + 1
    builder = PromptBuilder(tok, get_template("default"), budget=512)
    doc = DocumentPrompt(builder)
    first = doc.update(body[:cut], body[cut:], "m.py")
    window = body[first.window.prefix_start:cut]
    edited = body[:5_000] + "import os\nimport sys\n\n" + body[5_000:cut]
    again = doc.update(edited, body[cut:], "m.py")
    assert edited[again.window.prefix_start:] == window and doc.retokenized_chars < 400
    fresh = PromptBuilder(tok, get_template("default"), budget=512).build(edited, body[cut:], "m.py")
    assert fresh.window.prefix_start == again.window.prefix_start  # a fresh fit starts there too
