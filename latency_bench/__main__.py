"""`python -m latency_bench COMMAND [ARGS]`: one benchmark's main with ARGS
(`python -m latency_bench COMMAND --help`: its options). `python -m
latency_bench --help` lists the commands; each is also `python -m
latency_bench.MODULE [ARGS]`."""

from __future__ import annotations

import importlib
import sys

# command: (module, what it does in a line). latency_bench/README.md says more (tests/docs/test_layout.py keeps the two
# in step). Run from the repository root, or anywhere once completer is installed (`pip install -e .`).
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("engine_bench", "the engine against HF transformers' generate, same weights and prompts"),
    "decode-profile": ("decode_profile", "where a pass's time goes (torch profiler), the calibrated pass costs"),
    "fp8-quality": ("fp8_quality", "a quantized precision (FP8 by default) against its full-precision baseline"),
    "gpu-check": ("gpu_check", "the prepared GPU check (--dry-run: on CPU at small shapes)"),
    "llama-peer": ("llama_peer", "llama.cpp's llama-server from source (`build`), GGUFs at our precision (`gguf`)"),
    "keystroke": ("keystroke_bench", "the keystroke replay matrix: speed features off and on, llama.cpp beside"),
    "replay": ("replay", "the keystroke replay alone, against a server already running"),
    "keystroke-report": ("keystroke_report", "the keystroke replay's table, plots and pages from a saved run"),
    "cpu-decode": ("cpu_decode_bench", "CPU decode and prefill per precision, llama.cpp at matched precision"),
    "real-sizes": ("real_sizes", "Qwen2.5-Coder 0.5B/1.5B/3B shapes (random weights): speed and memory vs llama.cpp"),
    "critical-path": ("critical_path", "where one editor's keystroke milliseconds go, p50/p90/p99"),
    "fused-quality": ("fused_quality", "first-line exact match with the fused CPU layer and with torch's ops"),
    "kquant-quality": ("kquant_quality", "K-quant and Q8_0 GGUFs on the int4/int8 paths: the loss against the file"),
    "compat": ("compat_bench", "a keystroke over llama.cpp's /infill against the same over the WebSocket"),
    "disagg": ("disagg_bench", "typing editors beside cold long-file opens, disaggregation off and on"),
    "window": ("window_bench", "first-line exact match by prompt window size, same sites, and a cold prompt's cost"),
    "jump-quality": ("jump_quality", "first-line exact match after a jump: K/V reused, moved and warmed, or recomputed"),
    "llama-vim": ("llama_vim", "the same jumps with the real llama.vim on our /infill (--llama-vim PATH: a checkout)"),
    "neovim-jump": ("neovim_jump", "keystroke to ghost text after jumps in a real Neovim, plugin defaults, edits kept"),
    "typist": ("typist", "a simulated typist types held-out lines back: keystrokes saved, acceptance of shown"),
    "bulk": ("bulk_bench", "one typing editor beside another's long file opens: keystrokes before bulk work or not"),
    "cluster-replay": ("cluster_replay", "the keystroke replay through one process and Ray Serve replicas"),
    "stats": ("stats_bench", "what a /v1/stats call costs the event loop, by requests kept"),
    "fuzz": ("fuzz", "fuzzed protocol frames against the real server"),
    "fuzz-http": ("fuzz_http", "fuzzed bodies and headers against the compatible HTTP routes"),
    "soak": ("soak", "the soak: typing editors, disconnects, faults, loads beside; --fairness: 32 vs 1"),
    "reliability": ("reliability", "the long fuzz, the soak and the fairness run, then RELIABILITY.md"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: python -m latency_bench COMMAND [ARGS]   (python -m latency_bench COMMAND --help)",
                      "", "commands:", *(f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()), "",
                      "Each is also `python -m latency_bench.MODULE [ARGS]`; latency_bench/README.md says more."])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"latency_bench: no command {command!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # Before the import: a module may read its arguments when imported (gpu_check.py's --dry-run), and each main
    # parses sys.argv, whose first item argparse shows as the program and some benchmarks record as the command.
    sys.argv = [f"python -m latency_bench {command}", *args]
    module = importlib.import_module(f"latency_bench.{COMMANDS[command][0]}")
    return module.main() or 0


if __name__ == "__main__":
    sys.exit(main())
