"""Keystroke to ghost text after a jump with the real llama.vim on our
`/infill` (issue #42): the same files, jumps and typing as `neovim-jump`, in
a real Neovim with ggml-org/llama.vim at its defaults (only the endpoint
and the API key set: its ring buffer of context chunks, its speculative
requests and cache as it ships them). llama.vim is not on a package
registry: pass a checkout of it (`--llama-vim PATH`). The time is the
driver's: from sending the last typed key until llama.vim's ghost text (an
extmark in its `vt_fim` namespace) is on the cursor's line, polled every
5 ms over Neovim's RPC.

    python -m latency_bench llama-vim --llama-vim ~/src/llama.vim        # -> docs/results/llama_vim.json
    python -m latency_bench llama-vim --llama-vim PATH --rows warming --jumps 24 --out /tmp/lv.json
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from latency_bench.harness import ROOT, TOKEN, running_server
from latency_bench.neovim_jump import TYPED, files, jumps, ranks, timelines
from latency_bench.nvim_editor import Editor, keys, nvim_build, wait_until
from latency_bench.run_results import machine, now, write_result

ROWS = {"warming": ("server.warm_windows=3",), "no_warming": ("server.warm_windows=0",),
        "line_grid": ("server.warm_windows=3", "model.window_grid=lines")}  # the window grid by line number
console = Console(width=140)


class LlamaVim(Editor):
    """`nvim --headless` with llama.vim on its runtimepath, talking to `endpoint`."""

    def __init__(self, workdir: Path, plugin: Path, endpoint: str):
        config = f"let g:llama_config = {{'endpoint_fim': '{endpoint}', 'api_key': '{TOKEN}'}}"
        super().__init__(workdir, nvim_build("modern"), plugin=[f"set rtp^={plugin} noswapfile shortmess+=I", config,
                                                                f"source {plugin}/plugin/llama.vim"])

    def ghost_on(self, row: int) -> bool:
        ns = self.nvim.api.get_namespaces().get("vt_fim")
        if ns is None:
            return False
        marks = self.nvim.api.buf_get_extmarks(0, ns, [row, 0], [row, -1], {"details": True})
        return any("".join(c[0] for c in m[3].get("virt_text", [])).strip() for m in marks)

    def retype_after_jump(self, row: int, count: int, pause) -> float | None:
        """As `Editor.retype_after_jump`; the ms from the last key sent to its ghost text (None: none in 5 s)."""
        line = self.nvim.current.buffer[row]
        indent = len(line) - len(line.lstrip())
        self.jumped = time.time()
        self.nvim.input("<Esc>")
        self.nvim.command(f"call cursor({row + 1}, 1)")
        self.nvim.input("cc" + " " * indent)
        sent = 0.0
        for n, ch in enumerate(line.strip()[:count]):
            tick0, sent, self.key_sent = self.tick(), time.perf_counter(), time.time()
            self.nvim.input(keys(ch))
            wait_until(lambda: self.tick() != tick0, 5, 0.005, "the keystroke")
            if n < count - 1:
                pause()
        try:
            wait_until(lambda: self.ghost_on(row), 5, 0.005, "ghost text")
        except AssertionError:
            return None
        return (time.perf_counter() - sent) * 1000


def run_row(name: str, args, chosen: list[tuple[str, str]]) -> dict:
    console.print(f"[bold]{name}[/]: " + " ".join(f"--set {s}" for s in ROWS[name]))
    rng, shown = random.Random(args.seed), []
    think = args.think_ms / 1000
    with tempfile.TemporaryDirectory() as tmp, \
            running_server(*ROWS[name], f"server.request_log={tmp}/requests.jsonl", model=args.model,
                           timeout=600) as server:
        work = Path(tmp)
        ed = LlamaVim(work, args.llama_vim, f"http://127.0.0.1:{server.compat}/infill")
        try:
            paths = []
            for rel, text in chosen:  # three buffers open, as a user has them
                path = work / Path(rel).name
                path.write_text(text)
                ed.nvim.command(f"edit {path}")
                paths.append(path)
                time.sleep(think)
            for path in paths:
                ed.nvim.command(f"buffer {path}")  # a file switch
                time.sleep(think)
                for row, kind in jumps(ed.nvim.current.buffer[:], args.jumps // len(paths), rng):
                    row = min(row, len(ed.nvim.current.buffer) - 1)
                    ms = ed.retype_after_jump(row, TYPED, lambda: time.sleep(rng.uniform(0.1, 0.2)))
                    shown.append({"file": path.name, "row": row + 1, "jump": kind, "shown": ms is not None,
                                  "key_to_shown_ms": ms, "jumped": ed.jumped, "key_sent": ed.key_sent,
                                  "until": ed.key_sent + (ms or 5000) / 1000})
                    ed.nvim.input("<Esc>")  # the edit stays
                    time.sleep(think)
        finally:
            ed.close()
        timelines(shown, work / "requests.jsonl")
    got = [r for r in shown if r["shown"]]
    return {"settings": list(ROWS[name]), "jumps": len(shown), "with_ghost_text": len(got),
            "keystroke_to_ghost_ms": ranks(got),
            "by_jump": {k: ranks([r for r in got if r["jump"] == k]) for k in ("near", "far")}, "records": shown}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-vim", type=Path, required=True, help="a checkout of github.com/ggml-org/llama.vim")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--jumps", type=int, default=48, help="over the three files, a third in each")
    p.add_argument("--think-ms", type=float, default=600.0, help="a pause after each jump's keys and file switch")
    p.add_argument("--model", default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/llama_vim.json")
    args = p.parse_args()
    if not (args.llama_vim / "autoload" / "llama.vim").exists():
        p.error(f"--llama-vim {args.llama_vim}: not a checkout of llama.vim (no autoload/llama.vim)")
    chosen = files(3, args.seed)
    results = {name: run_row(name, args, chosen) for name in args.rows}
    t = Table(title="keystroke to ghost text after a jump (real Neovim, llama.vim's defaults, our /infill)")
    for c in ("row", "shown", "all p50 / p90", "near p50 / p90", "far p50 / p90"):
        t.add_column(c, justify="right")
    fmt = lambda r: f"{r['p50']} / {r['p90']} (n {r['n']})"  # noqa: E731
    for name, r in results.items():
        t.add_row(name, f"{r['with_ghost_text']}/{r['jumps']}", fmt(r["keystroke_to_ghost_ms"]),
                  fmt(r["by_jump"]["near"]), fmt(r["by_jump"]["far"]))
    console.print(t)
    commit = subprocess.run(["git", "-C", str(args.llama_vim), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    write_result(args.out, {"command": " ".join(sys.argv), "date": now(), "machine": msgspec.to_builtins(machine()),
                            "llama_vim": {"path": str(args.llama_vim), "commit": commit},
                            "files": [rel for rel, _ in chosen], "args": vars(args) | {"out": str(args.out),
                                                                                         "llama_vim": str(args.llama_vim)},
                            "rows": results})
    console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
