"""The typist (latency_bench/typist.py): its keys as a user presses them
(Tab only on a ghost text right as far as it goes, accept-word on a right
next word, else the next character or Enter with the indentation), its sites
(runs of code lines of held-out files, taken out but the first one's
indentation), the mode it asks as our clients do, a short run through the
real server that types every line back and counts what it saved, and the
token healing switch its `no_healing` row turns off."""

from __future__ import annotations

import asyncio

from completer.evaluate import heldout_files
from latency_bench.harness import running_server
from latency_bench.typist import MIN_LINE, action, next_word, run_policy, sites, summarize, to_line_end, typing_keys
from latency_bench.typist_clients import mode_at


def test_the_typist_takes_a_suggestion_only_where_it_is_right():
    assert action("return self.x", "return self.x", "tab") == ("tab", 13)
    assert action("return self.x", "return self.x  ", "tab") == ("tab", 13)  # trailing blanks do not matter
    assert action("return self.x", "return self", "tab") == ("tab", 11)  # cut where unsure, right: taken
    assert action("return self.x", "return self.y", "tab") == ("type", 1)  # wrong at the end: typed
    assert action("return self.x", "return self.y", "word") == ("word", 6)  # ... but its first word is right
    assert action("return self.x", "ret", "word") == ("tab", 3)  # right as far as it goes
    assert action("return self.x", "", "word") == action("return self.x", "retry", "word") == ("type", 1)
    assert [next_word(t) for t in (" self.x", ".x)", "\n    y", "x")] == [" self", ".", "\n    ", "x"]


def test_a_block_is_taken_as_its_lines_and_enter_indents():
    rest = "x = 1\n    y = 2\n    z"
    assert action(rest, "x = 1\n    y = 2", "tab") == ("tab", 15)
    assert action(rest, "x = 1\n    y = 3", "tab") == ("type", 1)  # one wrong line: not a Tab
    assert action(rest[5:], "", "tab") == ("type", 5)  # Enter: the newline and the indentation, one key
    assert typing_keys(rest) == 5 + 1 + 5 + 1 + 1
    assert to_line_end("x = 1", rest) and not to_line_end("x = ", rest) and to_line_end("x = 1\n    y", rest)
    # our clients' mode: block on a blank line, line elsewhere
    assert mode_at("    ", "\n    return") == "block" and mode_at("    x", "\n") == "line"
    assert mode_at("", ")\n") == "line"


def test_sites_are_code_lines_taken_out_but_the_first_ones_indentation():
    _, files = heldout_files("websockets")
    chosen = sites(files, 12, seed=1)
    assert len(chosen) == 12 and chosen == sites(files, 12, seed=1)
    by_path = {f.path: f.text for f in files}
    for s in chosen:
        lines = s.line.split("\n")
        assert len(lines) == 2 and s.line == s.line.lstrip()
        assert all(len(ln.strip()) >= MIN_LINE and not ln.lstrip().startswith("#") for ln in lines)
        line_start = s.prefix.rfind("\n") + 1
        assert s.prefix[line_start:].strip() == ""  # the indentation is left
        assert s.prefix + s.line + s.suffix == by_path[s.path]


def test_a_short_run_types_every_line_back_and_counts_what_it_saved():
    _, files = heldout_files("websockets")
    chosen = sites(files, 3, seed=2)
    with running_server() as server:
        results = asyncio.run(run_policy(chosen, "word", 0.05, "ci", url=server.ws_url))
    summary = summarize(results)
    assert summary["chars"] == sum(typing_keys(s.line) for s in chosen)
    assert 0 < summary["keys"] <= summary["chars"]  # every line typed back, never more keys than typing it
    for r in results:  # a key is a character typed (or Enter), a Tab or an accept-word
        assert r.keys == (r.chars - r.tab_chars - r.word_chars) + r.tabs + r.words, r
        assert r.shown_line <= r.shown_right <= r.shown
    assert summary["saved"] == round(1 - summary["keys"] / summary["chars"], 4)


async def test_token_healing_has_a_switch_the_typist_rows_use():
    """`model.token_healing = false` (the typist's `no_healing` row): the prompt's last token is not taken
    back, so the engine gets one token more of the same prompt."""
    from latency_bench.harness import collect, complete_msg, connect

    prefix = "import os\n\n\ndef here():\n    return os.path.dirn"
    tokens = {}
    for healing in ("true", "false"):
        with running_server(f"model.token_healing={healing}", "request.max_tokens=4") as server:
            async with connect(server) as ws:
                await ws.send(complete_msg("h", prefix, "\n", mode="free"))
                _, done = await collect(ws, "h")
        assert done["type"] == "done", done
        tokens[healing] = done["timings"]["prompt_tokens"]
    assert tokens["true"] < tokens["false"], tokens
