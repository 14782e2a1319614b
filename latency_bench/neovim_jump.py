"""Keystroke to ghost text after a jump, in a real Neovim as a user drives it
(issue #42): the plugin with its defaults (only the server's address and
token set), three held-out files of 8 KB or more open as buffers, jumps near
(3-60 lines up or down) and far (anywhere in the file; every fourth jump),
then the line there cleared and its first two characters typed again; the
edits stay in the buffers (no undo), and each file is worked on in turn (a
file switch between them). Per row (a fresh `completer serve` each, the same
jumps): the keystroke-to-ghost-text time of the last typed key as the plugin
measures it (`require('completer').latency()`), p50/p90 with counts, by
jump kind, and the server's TTFT of those keystrokes.

    python -m latency_bench neovim-jump                       # every row; 48 jumps -> docs/results/neovim_jump.json
    python -m latency_bench neovim-jump --rows warming --jumps 24 --out /tmp/jump.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from completer.evaluate import heldout_files
from completer.server.request_log import RequestRecord
from latency_bench.harness import ROOT, TOKEN, running_server
from latency_bench.nvim_editor import Editor, nvim_build, wait_until
from latency_bench.run_results import machine, now, write_result

ROWS = {"warming": ("server.warm_windows=3",),  # the defaults
        "warming_5": ("server.warm_windows=5",),
        # The window grid and context of before 2026-12-05 evening: line numbers, typing's switch margin.
        "line_grid": ("server.warm_windows=3", "model.window_grid=lines", "model.retrieval_hold=false"),
        "no_warming": ("server.warm_windows=0",),
        "fifo": ("engine.interactive_first=false", "server.warm_windows=0")}
TYPED = 2
console = Console(width=160)


def files(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` held-out Python files of 8 KB or more (pip's own code)."""
    _, found = heldout_files(own_code_only=True)
    big = sorted((f.path, f.text) for f in found if len(f.text) >= 8_000)
    return random.Random(seed).sample(big, count)


def jumps(lines: list[str], count: int, rng: random.Random) -> list[tuple[int, str]]:
    """Rows of code a user jumps to: near ones (3-60 lines away), every fourth far."""
    code = [i for i, line in enumerate(lines) if len(line.strip()) >= 8 and 20 <= i < len(lines) - 5]
    row, out = rng.choice(code), []
    for n in range(count):
        near = [i for i in code if 3 <= abs(i - row) <= 60]
        if n % 4 == 3 or not near:
            row, kind = rng.choice(code), "far"
        else:
            row, kind = rng.choice(near), "near"
        out.append((row, kind))
    return out


def drive(ed: Editor, paths: list[Path], texts: list[str], per_file: int, think_s: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    shown: list[dict] = []
    for path, text in zip(paths, texts):
        ed.lua("vim.cmd('buffer ' .. vim.fn.fnameescape(...))", str(path))  # a file switch
        time.sleep(think_s)
        lines = ed.nvim.current.buffer[:]
        for row, kind in jumps(lines, per_file, rng):
            row = min(row, len(ed.nvim.current.buffer) - 1)  # (as edited so far)
            records = ed.retype_after_jump(row, TYPED, lambda: time.sleep(rng.uniform(0.1, 0.2)))  # a person's pace
            last = [r for r in records if r.get("key_to_shown_ms") is not None]
            entry = {"file": path.name, "row": row + 1, "jump": kind, "shown": bool(last), "jumped": ed.jumped,
                     "key_sent": ed.key_sent, "until": ed.key_sent + 5}
            if last:
                entry |= last[-1]
                entry["until"] = ed.key_sent + entry["key_to_shown_ms"] / 1000
                result = ed.lua("return require('completer').last_result()") or {}
                entry["timings"] = result.get("timings")  # the server's timeline (done.timings)
            shown.append(entry)
            ed.nvim.input("<Esc>")  # the edit stays
            time.sleep(think_s)
    return shown


def timelines(shown: list[dict], log: Path) -> None:
    """Each jump's `requests`: those the server's request log has arriving
    from the jump (`jumped`) until its ghost text (`until`; 5 s after its last
    key when none came), in ms from its last key (`key_sent`): where the time
    between key and ghost text went (primes, warming, the keys before)."""
    records = [msgspec.json.decode(line, type=RequestRecord) for line in log.read_bytes().splitlines()]
    for r in shown:
        key, jumped, until = r.pop("key_sent"), r.pop("jumped"), r.pop("until")
        r["requests"] = [{"at_ms": round((q.arrived - key) * 1000, 1),
                          "end_ms": round((q.arrived - key) * 1000 + q.timings.total_ms, 1), "reason": q.reason,
                          "priming": q.priming, "prompt_tokens": q.timings.prompt_tokens,
                          "cached_tokens": q.timings.cached_tokens, "moved_tokens": q.timings.moved_tokens,
                          "wait_ms": round(q.timings.wait_ms + q.timings.queue_ms, 1),
                          "prefill_ms": round(q.timings.prefill_ms, 1), "decode_ms": round(q.timings.decode_ms, 1),
                          "generated_tokens": q.timings.generated_tokens}
                         for q in records if jumped <= q.arrived <= until]


def ranks(rows: list[dict], field: str = "key_to_shown_ms") -> dict:
    ms = sorted(round(r[field], 1) for r in rows if r.get(field) is not None)
    at = lambda q: ms[min(len(ms) - 1, max(0, -(-q * len(ms) // 100) - 1))] if ms else None  # noqa: E731
    return {"p50": at(50), "p90": at(90), "n": len(ms)}


def run_row(name: str, args, chosen: list[tuple[str, str]]) -> dict:
    console.print(f"[bold]{name}[/]: " + " ".join(f"--set {s}" for s in ROWS[name]))
    with tempfile.TemporaryDirectory() as tmp, \
            running_server(*ROWS[name], f"server.request_log={tmp}/requests.jsonl", model=args.model,
                           timeout=600) as server:
        work = Path(tmp)
        ed = Editor(work, nvim_build("modern"), env={"COMPLETER_TOKEN": "", "XDG_CONFIG_HOME": str(work / "cfg")})
        try:
            ed.setup(url=server.ws_url, token=TOKEN)  # the plugin's defaults otherwise
            wait_until(ed.connected, 15, what="connection to the server")
            paths = []
            for rel, text in chosen:  # three buffers open, as a user has them
                path = work / Path(rel).name
                ed.open_python(path, text)
                paths.append(path)
                time.sleep(args.think_ms / 1000)
            shown = drive(ed, paths, [t for _, t in chosen], args.jumps // len(chosen), args.think_ms / 1000,
                          args.seed)
        finally:
            ed.close()
        timelines(shown, work / "requests.jsonl")
    got = [r for r in shown if r["shown"]]
    return {"settings": list(ROWS[name]), "jumps": len(shown), "with_ghost_text": len(got),
            "keystroke_to_ghost_ms": ranks(got), "server_ttft_ms": ranks(got, "ttft_ms"),
            "by_jump": {k: {"keystroke_to_ghost_ms": ranks([r for r in got if r["jump"] == k]),
                            "server_ttft_ms": ranks([r for r in got if r["jump"] == k], "ttft_ms")}
                        for k in ("near", "far")},
            "records": shown}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--jumps", type=int, default=48, help="over the three files, a third in each")
    p.add_argument("--think-ms", type=float, default=600.0, help="a pause after each jump's keys and file switch")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/neovim_jump.json")
    args = p.parse_args()
    chosen = files(3, args.seed)
    results = {name: run_row(name, args, chosen) for name in args.rows}
    t = Table(title="keystroke to ghost text after a jump (real Neovim, plugin defaults)")
    for c in ("row", "shown", "all p50 / p90", "near p50 / p90", "far p50 / p90", "server TTFT p50 near / far"):
        t.add_column(c, justify="right")
    for name, r in results.items():
        near, far = r["by_jump"]["near"], r["by_jump"]["far"]
        fmt = lambda d: f"{d['p50']} / {d['p90']} (n {d['n']})"  # noqa: E731
        t.add_row(name, f"{r['with_ghost_text']}/{r['jumps']}", fmt(r["keystroke_to_ghost_ms"]),
                  fmt(near["keystroke_to_ghost_ms"]), fmt(far["keystroke_to_ghost_ms"]),
                  f"{near['server_ttft_ms']['p50']} / {far['server_ttft_ms']['p50']}")
    console.print(t)
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "files": [rel for rel, _ in chosen], "args": vars(args) | {"out": str(args.out)},
                            "rows": results})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
