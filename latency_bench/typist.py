"""The simulated typist (issue #44): how much less a user types, and how
often what is shown is right.

    python -m latency_bench typist                      # -> docs/results/typist.json
    python -m latency_bench typist --sites 20 --rows defaults --out /tmp/t.json

A typist jumps to line starts of held-out code (an installed package's
sources that nothing here was tuned on; `websockets` by default, not pip's,
on which the window and the jump work were measured), finds `--lines` lines
(2 by default) taken out but the first one's indentation, and types them back
at a steady pace (`--key-ms`, 120 by default; Enter is one key, the editor
indenting the next line as the file has it) through a client that behaves as
ours do: a `complete` per key at once, the next key superseding it, `block`
mode on a blank line and `line` elsewhere (the clients' rule); the streamed
text shown as it comes; a ghost text kept, without a request, while the keys
typed are what it says. Before each key it looks at what is shown:

- `tab` policy: when the ghost text is right as far as it goes (all of it is
  what comes next: the rest of the line, a line cut where the model was
  unsure, or a block's lines), Tab takes it (one key); otherwise it types the
  next character;
- `word` policy: as `tab`, and when the ghost's next word (the Neovim
  plugin's rule: spaces then a word, or a run of punctuation) is what comes
  next, accept-word takes it (one key).

Per row and policy: keystrokes saved (1 - keys pressed / keys typing it all
takes), suggestions shown (a request's text seen at a key, counted once),
acceptance of shown (right as far as it goes when first seen), of those the
ones that also reach the end of the line (the whole rest of the line right),
the characters taken with Tab or accept-word, and the first text's latency
from its key. Rows are server settings, each on a fresh server, and `llama_cpp`:
llama.cpp's llama-server on the default model's own GGUF (built by `python -m
latency_bench llama-peer build`), asked through its `/completion` with the
very token ids our pipeline builds for each place (its `/infill` refuses this
model: no FIM tokens it knows), a line at a time (its best here: a wrong later
line would make a right first one untakable by Tab), the request before
abandoned: the same client, the same prompts, the same weights.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
from pathlib import Path

import msgspec
import websockets
from rich.console import Console
from rich.table import Table

from completer.evaluate import heldout_files
from completer.model_store import pull
from latency_bench import llama_peer
from latency_bench.editors import percentile_ms
from latency_bench.harness import ROOT, RULES_OFF, TOKEN, running_server
from latency_bench.keystroke_bench import free_port
from latency_bench.replay import prompt_states
from latency_bench.run_results import machine, now, write_result
from latency_bench.typist_clients import CompleterClient, LlamaClient

# Each row: its server settings (`--set`), on a fresh server. `before_confidence` is the defaults before
# the confidence rules (issue #44); the others turn one feature off each.
ROWS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "before_confidence": RULES_OFF,
    "no_line_rule": ("request.min_line_prob=0",),  # blocks as long as the block, however unsure
    "no_healing": ("model.token_healing=false",),
    "no_retrieval": ("model.retrieval=false",),
    "line_grid": ("model.window_grid=lines",),  # window starts on line numbers, not content (issue #42)
}
LLAMA_ROW = "llama_cpp"  # llama.cpp's llama-server on the same weights (its /completion: /infill refuses them)
CONTEXT_TOKENS, MAX_TOKENS = 1024, 64  # completer's defaults: the peer gets the same window and budget
POLICIES = ("tab", "word")
MIN_LINE = 8  # characters of a line worth typing (after its indentation)
console = Console(width=140)

_WORD = re.compile(r"\n[ \t]*|[ \t]*[\w\x80-\U0010ffff]+|[ \t]*[^\w\s\x80-\U0010ffff]+|[ \t]+", re.UNICODE)


def next_word(text: str) -> str:
    """What accept-word takes of `text` (the Neovim plugin's `text.next_word`)."""
    m = _WORD.match(text)
    return m.group(0) if m else text[:1]


def right(ghost: str, rest: str) -> bool:
    """Whether a ghost text is right as far as it goes, with `rest` still to type."""
    ghost = ghost.rstrip()
    return bool(ghost) and rest.startswith(ghost)


def to_line_end(ghost: str, rest: str) -> bool:
    """Whether it is right and reaches the end of the line being typed (the whole rest of the line)."""
    ghost, line_end = ghost.rstrip(), rest.find("\n", 1)  # (a rest that begins with Enter: the next line's end)
    return right(ghost, rest) and len(ghost) >= (len(rest) if line_end < 0 else line_end)


def key_size(rest: str) -> int:
    """Characters the next typed key puts in: one, or Enter's newline and the indentation after it."""
    if rest.startswith("\n"):
        return len(rest) - len(rest[1:].lstrip(" \t"))
    return 1


def action(rest: str, ghost: str, policy: str) -> tuple[str, int]:
    """The typist's next key with `rest` still to type and `ghost` shown:
    ("tab" | "word" | "type", characters it puts in)."""
    if right(ghost, rest):
        return "tab", len(ghost.rstrip())
    if policy == "word" and ghost:
        word = next_word(ghost)
        if word.strip(" \t") and rest.startswith(word):
            return "word", len(word)
    return "type", key_size(rest)


def typing_keys(text: str) -> int:
    """Keys typing `text` takes without help: a key a character, Enter and its indentation one."""
    return len(text) - sum(len(ln) - len(ln.lstrip(" \t")) for ln in text.split("\n")[1:])


class Site(msgspec.Struct, frozen=True):
    path: str
    prefix: str  # the file up to the first line, and that line's indentation
    suffix: str  # from the last line's end (its newline) on
    line: str  # what the typist types: the lines, the first without its indentation


def code_line(ln: str) -> bool:
    return len(ln.strip()) >= MIN_LINE and not ln.lstrip().startswith("#")


def sites(files, count: int, seed: int, lines: int = 2) -> list[Site]:
    """`count` runs of `lines` code lines, one file after another in a seeded order."""
    rng = random.Random(seed)
    out: list[Site] = []
    files = sorted(files, key=lambda f: f.path)
    rng.shuffle(files)
    for f in files:
        text_lines = f.text.split("\n")
        offsets = [0]
        for ln in text_lines:
            offsets.append(offsets[-1] + len(ln) + 1)
        good = [i for i in range(6, len(text_lines) - lines + 1)
                if all(code_line(ln) for ln in text_lines[i: i + lines])]
        for i in rng.sample(good, min(2, len(good))):
            indent = len(text_lines[i]) - len(text_lines[i].lstrip())
            start, end = offsets[i] + indent, offsets[i + lines] - 1
            out.append(Site(f.path, f.text[:start], f.text[end:], f.text[start:end]))
            if len(out) == count:
                return out
    return out


class SiteResult(msgspec.Struct):
    path: str
    chars: int  # keys typing the lines takes without help (`typing_keys`)
    keys: int
    tabs: int = 0  # Tab presses (each took a whole ghost text)
    words: int = 0  # accept-word presses
    tab_chars: int = 0  # of `chars`, the keys the Tabs' text would have taken
    word_chars: int = 0
    shown: int = 0
    # Shown ones right as far as they go (the whole text the server sent, from where it was first seen; a
    # request superseded while it streamed: what came of it) ...
    shown_right: int = 0
    shown_line: int = 0  # ... and reaching the end of the line (the whole rest of the line right)
    shown_lines: int = 0  # shown ones seen with more than one line (a block)
    blocks_taken: int = 0  # Tabs that took more than one line
    first_text_ms: list[float] = []


async def type_site(client, site: Site, policy: str, key_s: float) -> SiteResult:
    """Type `site.line` back through `client`, as our editors show what it streams."""
    out = SiteResult(site.path, typing_keys(site.line), 0)

    def shown(rid: str, typed: str) -> str:
        """What the client shows now: the request's text past what was typed since it was asked, if it agrees."""
        s = client.by_id[rid]
        since = typed[len(s["origin"]):]
        return s["text"][len(since):] if s["text"].startswith(since) and len(s["text"]) > len(since) else ""

    typed, current = "", await client.ask("")
    next_key = time.perf_counter() + key_s
    try:
        while typed != site.line:
            await asyncio.sleep(max(0.0, next_key - time.perf_counter()))
            next_key += key_s
            ghost = shown(current, typed)
            rest = site.line[len(typed):]
            s = client.by_id[current]
            if ghost and "seen" not in s:  # where it was first seen: judged once all of it came (below)
                s["seen"] = (len(typed) - len(s["origin"]), rest)
            if "\n" in ghost.strip() and not s.get("block"):
                s["block"] = True
                out.shown_lines += 1
            kind, n = action(rest, ghost, policy)
            typed += rest[:n]
            out.keys += 1
            if kind == "tab":
                out.tabs, out.tab_chars = out.tabs + 1, out.tab_chars + typing_keys(rest[:n])
                out.blocks_taken += "\n" in rest[:n].strip()
            elif kind == "word":
                out.words, out.word_chars = out.words + 1, out.word_chars + typing_keys(rest[:n])
            if typed != site.line and not shown(current, typed):  # nothing left to show: ask again
                current = await client.ask(typed)
        await asyncio.sleep(key_s)  # the last texts come in
    finally:
        await client.close()
    for s in client.by_id.values():  # each suggestion shown, as the server sent it, from where it was first seen
        if "seen" in s:
            since, rest = s["seen"]
            out.shown += 1
            out.shown_right += right(s["text"][since:], rest)
            out.shown_line += to_line_end(s["text"][since:], rest)
    out.first_text_ms = client.first_text_ms
    return out


async def run_policy(chosen: list[Site], policy: str, key_s: float, run: str, *, url: str = "", llama: str = "",
                     builder_for=None, max_tokens: int = 64) -> list[SiteResult]:
    import aiohttp

    results = []
    async with (websockets.connect(url, additional_headers={"Authorization": f"Bearer {TOKEN}"}, max_size=None)
                if url else aiohttp.ClientSession()) as conn:
        for n, site in enumerate(chosen):
            uri = f"file:///typist/{run}/{policy}/{n}/{site.path}"
            client = (LlamaClient(conn, llama, builder_for(), site, uri, max_tokens, str(n)) if llama
                      else CompleterClient(conn, site, uri, str(n)))
            results.append(await type_site(client, site, policy, key_s))
            await asyncio.sleep(0.3)  # between sites: the last answers drain
    return results


def summarize(results: list[SiteResult]) -> dict:
    chars, keys = sum(r.chars for r in results), sum(r.keys for r in results)
    shown, taken = sum(r.shown for r in results), sum(r.shown_right for r in results)
    to_end = sum(r.shown_line for r in results)
    firsts = sorted(ms / 1000 for r in results for ms in r.first_text_ms)
    return {"sites": len(results), "chars": chars, "keys": keys, "saved": round(1 - keys / chars, 4) if chars else None,
            "shown": shown, "acceptance_of_shown": round(taken / shown, 4) if shown else None,
            "whole_line_of_shown": round(to_end / shown, 4) if shown else None,
            "blocks_shown": sum(r.shown_lines for r in results), "blocks_taken": sum(r.blocks_taken for r in results),
            "tab_chars": sum(r.tab_chars for r in results), "word_chars": sum(r.word_chars for r in results),
            "first_text_p50_ms": percentile_ms(firsts, 0.5), "first_text_p90_ms": percentile_ms(firsts, 0.9),
            "first_text_n": len(firsts)}


def run_row(name: str, chosen: list[Site], args) -> dict:
    key_s = args.key_ms / 1000
    if name == LLAMA_ROW:  # llama-server on the default model's own GGUF, a slot and our window
        console.print(f"[bold]{name}[/]: llama-server {llama_peer.DEFAULT_VERSION}, {pull().name}")
        out: dict = {"settings": [f"llama-server {llama_peer.DEFAULT_VERSION}", pull().name]}
        builder_for = prompt_states(args.model, CONTEXT_TOKENS, MAX_TOKENS)
        with llama_peer.llama_server(pull(), port=free_port(), threads=os.cpu_count() or 1, parallel=1,
                                     ctx_per_slot=CONTEXT_TOKENS) as url:
            for policy in args.policies:
                results = asyncio.run(run_policy(chosen, policy, key_s, name, llama=url, builder_for=builder_for,
                                                 max_tokens=MAX_TOKENS))
                out[policy] = {"summary": summarize(results), "sites": [msgspec.to_builtins(r) for r in results]}
        return out
    console.print(f"[bold]{name}[/]: " + " ".join(f"--set {s}" for s in ROWS[name]))
    out = {"settings": list(ROWS[name])}
    with running_server(*ROWS[name], model=args.model, timeout=600) as server:
        for policy in args.policies:
            results = asyncio.run(run_policy(chosen, policy, key_s, name, url=server.ws_url))
            out[policy] = {"summary": summarize(results), "sites": [msgspec.to_builtins(r) for r in results]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=[*ROWS, LLAMA_ROW], default=["defaults", "before_confidence", LLAMA_ROW])
    p.add_argument("--row", action="append", default=[], metavar="NAME:SECTION.KEY=VALUE[,...]",
                   help="a row of your own: its name and server settings (e.g. t2:request.min_token_prob=0.2)")
    p.add_argument("--sites", type=int, default=40)
    p.add_argument("--lines", type=int, default=2, help="lines typed at each site")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--package", default="websockets", help="the installed package whose sources are typed")
    p.add_argument("--key-ms", type=float, default=120.0)
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/typist.json")
    args = p.parse_args()
    if LLAMA_ROW in args.rows:
        llama_peer.server_binary()  # fail now, not after the other rows
    corpus, files = heldout_files(args.package)
    chosen = sites(files, args.sites, args.seed, args.lines)
    for spec in args.row:
        name, _, settings = spec.partition(":")
        ROWS[name] = tuple(s for s in settings.split(",") if s)
        args.rows.append(name)
    results = {name: run_row(name, chosen, args) for name in args.rows}
    t = Table(title=f"the typist ({corpus}, {len(chosen)} sites of {args.lines} lines, {args.key_ms:g} ms a key)")
    for c in ("row", "policy", "keystrokes saved", "shown (blocks / taken)", "acceptance of shown", "whole line right",
              "keys by Tab / word", "first text p50 / p90 (n)"):
        t.add_column(c, justify="right")
    for name, r in results.items():
        for policy in args.policies:
            s = r[policy]["summary"]
            t.add_row(name, policy, f"{s['saved']:.1%}", f"{s['shown']} ({s['blocks_shown']} / {s['blocks_taken']})",
                      "-" if s["acceptance_of_shown"] is None else f"{s['acceptance_of_shown']:.1%}",
                      "-" if s["whole_line_of_shown"] is None else f"{s['whole_line_of_shown']:.1%}",
                      f"{s['tab_chars']} / {s['word_chars']}",
                      f"{s['first_text_p50_ms']} / {s['first_text_p90_ms']} ({s['first_text_n']})")
    console.print(t)
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "corpus": corpus, "args": vars(args) | {"out": str(args.out)},
                            "sites": [msgspec.to_builtins(s) | {"prefix": None, "suffix": None} for s in chosen],
                            "rows": results})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
