"""Streamed text: modes' ends, stop strings, suffix and repetition trimming,
UTF-8 never split, and deltas that always concatenate to the final text."""

import pytest

from completer.engine.stopping import (OutputText, block_end, line_mode_end, next_nonblank_line,
                                       repetition_start)


def stream(pieces: list[bytes], mode="line", stop=(), cursor_line="", suffix="", next_line=""):
    """Feed byte pieces as tokens; returns (deltas, final text, ended early)."""
    out = OutputText(lambda i: pieces[i], mode, stop, cursor_line, suffix, next_line=next_line)
    deltas, ended = [], False
    for i in range(len(pieces)):
        delta, ended = out.add(i)
        deltas.append(delta)
        if ended:
            break
    deltas.append(out.finish())
    assert "".join(deltas) == out.text
    return [d for d in deltas if d], out.text, ended


def b(*texts):
    return [t.encode() for t in texts]


def test_line_mode_stops_at_end_of_line():
    _, text, ended = stream(b("return", " self", "._items", "\n", "    x"))
    assert text == "return self._items" and ended


def test_line_mode_after_an_opener_takes_the_next_line():
    _, text, _ = stream(b("\n", "    ", "return", " 1", "\n", "x"))
    assert text == "\n    return 1"


def test_utf8_is_never_split():
    pieces = [b"caf", b"\xc3", b"\xa9", b" ok"]
    deltas, text, _ = stream(pieces, mode="free")
    assert text == "café ok"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_is_held_back_and_cut():
    deltas, text, ended = stream(b("foo", " #", " EN", "D more"), mode="free", stop=("# END",))
    assert text == "foo " and ended
    assert all("#" not in d for d in deltas)


@pytest.mark.parametrize("many", [0, 1000])
def test_the_earliest_of_many_stop_strings_ends_the_text(many):
    """Stop strings are matched in one pass over the new text (100k of them once
    cost ~270 ms a token); regex metacharacters in them are plain text."""
    stop = tuple(f"never{i}" for i in range(many)) + ("a.b", "])", "# EN")
    deltas, text, ended = stream(b("x = [1", "]", " # ", "E", "N", "D"), mode="free", stop=stop)
    assert text == "x = [1] " and ended
    deltas, text, ended = stream(b("axb", " a.", "b c"), mode="free", stop=stop)
    assert text == "axb " and ended and "a." not in "".join(deltas[:-1])


def test_suffix_overlap_is_trimmed():
    _, text, _ = stream(b("foo", "(x", ")"), suffix="):\n    pass")
    assert text == "foo(x"


def test_block_mode_ends_at_dedent():
    cursor_line = "def f(x):"
    _, text, ended = stream(b("\n    y = x\n", "    return y\n", "\n", "def g():\n"),
                            mode="block", cursor_line=cursor_line)
    assert text == "\n    y = x\n    return y" and ended


def test_block_mode_from_an_indented_blank_line():
    assert block_end("if a:\n        b()\n    c()\nd", "    ") == len("if a:\n        b()\n    c()")


def test_repetition_is_trimmed_in_line_mode_not_in_free_mode():
    pieces = b("x = [", *(["1, "] * 12))
    _, text, ended = stream(pieces)
    # Stopped at the sixth copy; what was already sent stays (never retracted).
    assert ended and text == "x = [1, 1, 1, 1, 1,"
    _, text, _ = stream(pieces, mode="free")
    assert text.count("1, ") == 12


@pytest.mark.parametrize("text, start", [("abcabcabcabcabcabc", 3), ("no repeat here", None)])
def test_repetition_start(text, start):
    assert repetition_start(text) == start


def test_token_healing_bytes_are_not_output():
    # The prompt gave back "\n    " (healing); the model re-spells it in two tokens.
    out = OutputText(lambda i: [b"\n  ", b"  return", b" x"][i], "line", (), heal=b"\n    ")
    assert out.add(0) == ("", False) and out.heal == b"  "
    delta, _ = out.add(1)
    assert out.heal == b"" and delta == "return"
    out.add(2)
    out.finish()
    assert out.text == "return x"


@pytest.mark.parametrize("text, end", [
    ("return x\n    y", 8), ("\n    return 1\nfoo", 13), ("  \n\n", None), ("abc", None)])
def test_line_mode_end(text, end):
    assert line_mode_end(text) == end


# -- a completion that repeats the file's next line ------------------------------------

@pytest.mark.parametrize("suffix, line", [
    ("rest of the cursor's line\n\n   \n    return x  \nmore", "return x"),
    ("\n\tfoo()", "foo()"), ("only the cursor's line", ""), ("", ""), ("x\n\n \n", ""),
])
def test_next_nonblank_line(suffix, line):
    assert next_nonblank_line(suffix) == line


def test_a_line_equal_to_the_next_line_is_dropped_with_its_newline():
    deltas, text, ended = stream(b("\n    y = 1", "\n    ", "return", " x", "\n", "    z"), mode="block",
                                 cursor_line="def f(x):", next_line="return x")
    assert text == "\n    y = 1" and ended
    assert "return" not in "".join(deltas)  # held back while it could still be the next line, never sent


def test_the_first_line_counts_the_text_before_the_cursor():
    # The user typed "    ret" on a blank line above `return x`: "urn x" would repeat it.
    deltas, text, ended = stream(b("urn", " x", "\n"), cursor_line="    ret", next_line="return x")
    assert text == "" and deltas == [] and ended


def test_a_last_line_ended_by_the_model_is_compared_too():
    _, text, _ = stream(b("return", " x"), cursor_line="    ", next_line="return x")  # no newline: eos
    assert text == ""


def test_a_line_that_only_begins_like_the_next_line_is_sent_once_it_differs():
    deltas, text, _ = stream(b("return", " y", "\n"), cursor_line="    ", next_line="return x")
    assert text == "return y" and deltas == ["return y"]


def test_a_completion_that_opens_a_new_line_keeps_the_cursor_line_as_it_is():
    # The cursor ends a line equal to the next one: the empty first line repeats nothing.
    _, text, _ = stream(b("\n", "y = 2", "\n"), cursor_line="x = compute()", next_line="x = compute()")
    assert text == "\ny = 2"


def test_free_mode_keeps_lines_that_repeat_the_next_line():
    _, text, _ = stream(b("return x", "\n", "foo"), mode="free", cursor_line="    ", next_line="return x")
    assert text == "return x\nfoo"


def confident(pieces: list[tuple[str, float]], mode="line", cursor_line="    ", **rules):
    """Feed (text, probability) tokens under the confidence rules as the engine does (`unsure` before
    `add`); returns (deltas, final text)."""
    from completer.engine.request import Confidence

    out = OutputText(lambda i: pieces[i][0].encode(), mode, (), cursor_line, confidence=Confidence(**rules))
    deltas = []
    for i, (_, prob) in enumerate(pieces):
        if out.unsure(prob):
            break
        delta, ended = out.add(i)
        deltas.append(delta)
        if ended:
            break
    deltas.append(out.finish())
    assert "".join(deltas) == out.text  # nothing sent is taken back
    return [d for d in deltas if d], out.text


def test_no_suggestion_when_a_token_up_to_the_first_visible_one_is_unsure():
    assert confident([("x", 0.2), (" = 1", 0.9)], first=0.3)[1] == ""
    assert confident([("\n", 0.2), ("    x", 0.9)], first=0.3)[1] == ""  # a blank start counts too
    assert confident([("x", 0.4), (" = 1", 0.9)], first=0.3)[1] == "x = 1"


def test_a_line_ends_before_its_first_unsure_token():
    _, text = confident([("return", 0.9), (" self", 0.8), (".x", 0.1), (" + 1", 0.9)], token=0.3)
    assert text == "return self"
    # the first token answers to the stricter of the two rules
    assert confident([("return", 0.25), (" self", 0.8)], first=0.2, token=0.3)[1] == ""


def test_a_block_ends_before_its_first_unsure_line_and_sends_a_line_only_once_it_is_sure():
    pieces = [("x = 1", 0.9), ("\n    ", 0.9), ("y", 0.9), (" = 2", 0.8), ("\n    ", 0.9), ("z", 0.9),
              (" = g", 0.2), ("()", 0.9)]
    deltas, text = confident(pieces, mode="block", line=0.5)
    assert text == "x = 1\n    y = 2"
    assert "z" not in "".join(deltas)
    # the first line answers to the token rule alone; unsure later lines go whole
    _, text = confident([("x", 0.9), (" = 1", 0.4), ("\n    ", 0.9), ("y", 0.4)], mode="block", line=0.5)
    assert text == "x = 1"
    _, text = confident([("x", 0.9), (" = 1", 0.4), ("\n    ", 0.9), ("y", 0.4)], mode="block", token=0.5)
    assert text == "x"


def test_free_mode_has_no_confidence_rules():
    assert confident([("x", 0.01), (" = 1", 0.01)], mode="free", first=0.5, token=0.5)[1] == "x = 1"
