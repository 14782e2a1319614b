"""The keystroke replay matrix: every speed feature off and on, at 1, 8 and 32
editors, and llama.cpp's server on the same weights, in one run.

    python -m latency_bench llama-peer build   # once: llama-server from source (minutes; cached)
    python -m latency_bench keystroke          # ~25 min on 2 cores -> docs/results/keystroke_bench.json,
                                               #   plots, the dashboard's screenshot, BENCHMARKS.md
    python -m latency_bench keystroke --rows all_on llama_q4_1 --editors 1 --seconds 20 --out /tmp/k.json --no-docs

Every row replays the same traces (`keystrokes.py`: pip's sources typed key
by key; `replay.py`). Each completer row is a fresh `completer serve` on the
default model with one setting changed from the default (`all_on`: prefix
cache, the drafter and n-gram proposals on, as shipped; all with a KV cache of
2 GB, see KV); the editor counts run
one after the other against it, on documents of their own (so no run starts
warm from the one before). Each llama.cpp row is a fresh `llama-server` per
editor count, with a slot per editor (`-np`, each slot as long as completer's
window), prompt caching, and the same token ids completer's pipeline builds:
`llama_matched` on a GGUF of the weights at the precision completer runs here
(F32 where `auto` is fp32, BF16 where it is bf16), `llama_q4_1` on the file as
shipped (what its users run); `llama_q4_1_ngram` (not in the default run) adds
its n-gram speculation (`llama_peer.SPECULATIVE_FLAGS`), which did not help it
here: at 1 editor for 20 s, TTFT p50 34 vs 20 ms and line p50 90 vs 66 ms
without. Both servers get every core. Row `lsp` (not in the default run)
is `all_on` through a `completer lsp` per editor (lsp_replay.py): run it
beside `all_on` (`--rows lsp all_on --editors 1 --no-screenshot`) for the
bridge's cost.

Ratios are against `all_on` at the same editor count. Run it alone: a second
process on a 2-core machine moves every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families
from rich.progress import Progress

from completer.model_store import pull
from latency_bench import llama_peer
from latency_bench.editors import keep_reading_log
from latency_bench.harness import ROOT, TOKEN, running_server
from latency_bench.keystrokes import corpus_files
from latency_bench.replay import ReplayOptions, prompt_states, replay, summarize, traces
from latency_bench.run_results import machine, now

RESULTS = ROOT / "docs" / "results"
CONTEXT_TOKENS = 1024  # completer's default model.context_tokens: llama.cpp's slots get the same

# Every completer row holds each editor's window in its prefix cache, as llama.cpp's
# slots do (-np editors, a window each): the default 256 MB holds ~5 windows of
# SmolLM2 in fp32 (46 KB of K/V a token), so 8 or 32 editors would evict each other.
KV = "engine.kv_cache_mb=2048"
COMPLETER_ROWS: dict[str, tuple[str, ...]] = {
    "all_on": (KV,),
    "no_prefix_cache": (KV, "engine.prefix_cache=false"),
    "no_drafter": (KV, "model.draft="),
    "no_ngram": (KV, "spec.ngram=false"),
    "no_speculation": (KV, "model.draft=", "spec.ngram=false"),
    "no_between_passes": (KV, "engine.between_passes=false"),
    "no_yield_to_loop": (KV, "engine.yield_to_loop_ms=0"),
    "fp8": (KV, "model.precision=fp8"),  # on a CPU, an emulation (quality, not speed)
    # The keystroke path's switches (#25), each off alone, and all off at the precision
    # `auto` chose before (bf16 where native): the path as it was.
    "no_heal_in_prefill": (KV, "engine.heal_in_prefill=false"),
    "eager_draft_prefill": (KV, "spec.defer_draft_prefill=false"),
    "no_interrupt": (KV, "engine.interrupt_superseded=false"),
    "no_moved_kv": (KV, "engine.reuse_moved_kv=false"),
    "block_16": (KV, "engine.block_size=16"),
    "block_4": (KV, "engine.block_size=4"),
    "block_2": (KV, "engine.block_size=2"),
    "block_1": (KV, "engine.block_size=1"),  # the block size before: a keystroke recomputed ~11 tokens, not ~3
    "no_int4_dense": (KV, "model.int4_dense_rows=0"),
    "kernel_cache_1024": (KV, "model.kernel_cache_entries=1024"),  # oneDNN's own bound (#31 set 128)
    # The fused CPU layer (#25): off (torch's ops), on with fp32 activations, and with fp16 K/V.
    "no_fused_cpu": (KV, "engine.fused_cpu=false"),
    "fused_fp32_acts": (KV, "engine.fused_cpu_q8=false"),
    "kv_fp16": (KV, "engine.kv_dtype=fp16"),
    # Context (#27): each keystroke sends the editor's 3 most recent other files, as the clients send
    # open buffers; retrieved windows (the default) or the files whole in order.
    "context": (KV,),
    "context_whole": (KV, "model.retrieval=false"),
    "path_before_bf16": (KV, "model.precision=bf16", "engine.heal_in_prefill=false", "spec.defer_draft_prefill=false",
                         "engine.interrupt_superseded=false", "engine.reuse_moved_kv=false", "engine.block_size=16"),
    # Interactive work first (#42): off, first come, first served (primes and cold files beside keystrokes).
    "fifo": (KV, "engine.interactive_first=false"),
    # Warming (#42): the windows a document's next jump may take, prefilled while idle; off.
    "no_warming": (KV, "server.warm_windows=0"),
    # The clients' wait after a key (#48; client_wait.py): every row but these follows the plugins' rule
    # (at once unless the server holds them back or is slower than the typing); the rule before (the typing
    # rhythm), and every key at once with the server's hold off.
    "client_rhythm": (KV,),
    "client_every_key": (KV, "server.client_hold=false"),
    # Opening a file (up to ~960 uncached tokens) goes to a prefill worker on the
    # other core; the engine keeps one. The threshold is below the window so it can.
    "disagg": (KV, "disagg.enabled=true", "disagg.workers=1", "disagg.engine_cpus=[0]",
               "disagg.worker_cpus=[[1]]", "disagg.threshold_tokens=256"),
}
# Rows whose editors go through `completer lsp` (issue #46; lsp_replay.py), each with its server's settings:
# the same server and frames as `all_on` (no context, no prime), so the difference is the bridge's.
# Not in the default run: each editor is a process of its own (32 of them on 2 cores measure the processes).
LSP_ROWS: dict[str, tuple[str, ...]] = {"lsp": (KV,)}
CONTEXT_FILES = {"context": 3, "context_whole": 3}  # rows whose editors send context
CLIENT_WAIT = {"client_rhythm": "rhythm", "client_every_key": "none"}  # rows whose editors wait otherwise
LLAMA_ROWS = ("llama_matched", "llama_q4_1", "llama_q4_1_ngram")
KEYS = ("completer_spec_decode_num_draft_tokens", "completer_spec_decode_num_accepted_tokens")


def scrape(http: str) -> dict[str, float]:
    req = urllib.request.Request(f"{http}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name in KEYS:
            out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def screenshot(url: str, out: Path) -> bool:
    """The page as headless Chromium draws it (the dashboard reads its series from the server).
    Taken near the end of a run: Chromium's few seconds of CPU land on its last keystrokes."""
    import shutil
    import tempfile
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return False
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                        "--no-first-run", "--disable-background-networking", "--disable-component-update",
                        "--disable-sync", f"--user-data-dir={profile}", "--window-size=1280,1100",
                        "--virtual-time-budget=4000", "--hide-scrollbars", f"--screenshot={out}", url],
                       capture_output=True, timeout=60)
    return out.is_file()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(opts: ReplayOptions, files, progress, **where) -> dict:
    task = progress.add_task(f"{opts.run}", total=None)
    samples = asyncio.run(replay(traces(files, opts), opts, progress=lambda: progress.advance(task), **where))
    progress.remove_task(task)
    summary = summarize(samples)
    summary["ttft_ms"] = sorted(round(s.ttft_s * 1000, 1) for s in samples if s.ttft_s is not None)
    summary["e2e_ms"] = sorted(round(s.answer_s * 1000, 1) for s in samples
                               if s.answer_s is not None and s.outcome.startswith("done:")
                               and s.outcome != "done:cancelled")
    return summary


def completer_row(name: str, settings: tuple[str, ...], editors: list[int], args, files, progress,
                  shot: Path | None) -> dict:
    runs = {}
    with running_server(*settings, model=args.model, timeout=300) as server:
        tail = keep_reading_log(server)
        for n in editors:
            before = scrape(server.http)
            opts = ReplayOptions(editors=n, seconds=args.seconds, seed=args.seed, run=f"{name}-{n}",
                                 context_files=CONTEXT_FILES.get(name, 0),
                                 client_wait=CLIENT_WAIT.get(name, "server"),
                                 via="lsp" if name in LSP_ROWS else "websocket")
            shooting = None
            if shot is not None and n == max(editors):  # the dashboard while the most editors type
                shooting = threading.Timer(args.seconds * 0.85, screenshot,
                                           (f"{server.http}/dashboard?token={TOKEN}", shot))
                shooting.start()
            runs[str(n)] = run_one(opts, files, progress, url=server.ws_url, token=TOKEN)
            if shooting is not None:
                shooting.join()
                runs[str(n)]["dashboard"] = shot.is_file()
            after = scrape(server.http)
            proposed = after.get(KEYS[0], 0) - before.get(KEYS[0], 0)
            runs[str(n)]["draft_acceptance"] = (
                round((after.get(KEYS[1], 0) - before.get(KEYS[1], 0)) / proposed, 4) if proposed else None)
            runs[str(n)]["load_average"] = machine().load_average
        log = [line.rstrip() for line in tail if "Traceback" in line or "ERROR" in line]
    return {"kind": "completer", "settings": list(settings), "via": "lsp" if name in LSP_ROWS else "websocket",
            "runs": runs, "server_trouble": log[-10:]}


def llama_row(name: str, editors: list[int], args, files, progress, precision: str) -> dict:
    gguf = llama_peer.matched_gguf(precision) if name == "llama_matched" else pull()
    flags = llama_peer.SPECULATIVE_FLAGS if name.endswith("_ngram") else ()
    builder_for = prompt_states(args.model, CONTEXT_TOKENS, ReplayOptions().max_tokens)
    runs = {}
    for n in editors:
        port = free_port()
        with llama_peer.llama_server(gguf, port=port, threads=args.threads, parallel=n,
                                     ctx_per_slot=CONTEXT_TOKENS, extra=flags) as url:
            opts = ReplayOptions(editors=n, seconds=args.seconds, seed=args.seed, run=f"{name}-{n}")
            runs[str(n)] = run_one(opts, files, progress, llama=url, builder_for=builder_for)
            runs[str(n)]["load_average"] = machine().load_average
    # The peer's configuration as it ran (its command line at 1 editor; -np and -c follow the editor count).
    command = llama_peer.server_command(llama_peer.server_binary(), gguf, port=0, threads=args.threads, parallel=1,
                                        ctx_per_slot=CONTEXT_TOKENS, extra=flags)
    return {"kind": "llama.cpp", "gguf": gguf.name, "version": llama_peer.DEFAULT_VERSION,
            "flags": list(flags), "command": command[1:],
            "weights_repacked": gguf not in llama_peer.STARTED_WITHOUT_REPACK, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=[*COMPLETER_ROWS, "llama_matched", "llama_q4_1"],
                    choices=[*COMPLETER_ROWS, *LSP_ROWS, *LLAMA_ROWS])
    ap.add_argument("--editors", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--seconds", type=float, default=40.0, help="replay per editor count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (completer: torch's default)")
    ap.add_argument("--corpus", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "keystroke_bench.json")
    ap.add_argument("--no-docs", action="store_true", help="do not rewrite BENCHMARKS.md")
    ap.add_argument("--no-screenshot", action="store_true",
                    help="no dashboard screenshot (Chromium's CPU lands on all_on's last keystrokes: leave it out "
                         "where all_on is the baseline of a comparison, as for the lsp row)")
    args = ap.parse_args()

    from completer.checkpoint import resolve_precision
    from completer.loading import model_name
    from completer.model_store import resolve_target
    served = resolve_target(args.model)  # what `auto` picks for the model served, not for the default one
    precision = resolve_precision("auto", source=served)
    if any(r in LLAMA_ROWS for r in args.rows):
        llama_peer.server_binary()  # fail now, not after the completer rows
    corpus, files = corpus_files(args.corpus)
    assets = args.out.with_suffix("")  # plots and screenshot beside the JSON
    assets.mkdir(parents=True, exist_ok=True)
    result = {"date": now(), "machine": msgspec.to_builtins(machine()), "command": sys.argv,
              "corpus": corpus, "seconds": args.seconds, "editors": args.editors, "precision": precision,
              "model": args.model, "model_name": model_name(served),
              "context_tokens": CONTEXT_TOKENS, "rows": {}}
    started = time.perf_counter()
    with Progress(transient=True) as progress:
        for name in args.rows:
            progress.console.print(f"{name} ...")
            if name in COMPLETER_ROWS or name in LSP_ROWS:
                shot = assets / "dashboard.png" if name == "all_on" and not args.no_screenshot else None
                settings = COMPLETER_ROWS.get(name) or LSP_ROWS[name]
                result["rows"][name] = completer_row(name, settings, args.editors, args, files, progress, shot)
            else:
                result["rows"][name] = llama_row(name, args.editors, args, files, progress, precision)
            args.out.write_text(json.dumps(result))  # what is done survives a later failure
    result["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(result))

    from latency_bench import keystroke_report
    keystroke_report.render(args.out, write_docs=not args.no_docs)


if __name__ == "__main__":
    main()
