"""The before/after table of issue #47's round from the JSON run.sh wrote: `python table.py DIR`."""
import json
import sys
from pathlib import Path

D = Path(sys.argv[1] if len(sys.argv) > 1 else ".")


def load(name, side):
    try:
        return json.loads((D / f"{name}_{side}.json").read_text())
    except (OSError, ValueError):
        return None


def ks(d, row, editors, key):
    return d["rows"][row]["runs"][str(editors)][key]


def cpu(d, row, batch, key):
    return next(r[key] for r in d["rows"] if r["row"] == row and r["batch"] == batch)


def ms(r):
    return r["median_ms"]


RATIOS = [
    ("keystroke", "served before the next key, 1 editor: completer / llama.cpp (Q4_1)",
     lambda d: f"{ks(d, 'all_on', 1, 'served_before_next_key'):.1%} / {ks(d, 'llama_q4_1', 1, 'served_before_next_key'):.1%}"),
    ("keystroke", "TTFT p50 completer / llama.cpp, 1 editor (n)",
     lambda d: f"{ks(d, 'all_on', 1, 'ttft_p50_ms') / ks(d, 'llama_q4_1', 1, 'ttft_p50_ms'):.2f}x "
               f"({ks(d, 'all_on', 1, 'ttft_n')} / {ks(d, 'llama_q4_1', 1, 'ttft_n')})"),
    ("keystroke", "TTFT p99, same",
     lambda d: f"{ks(d, 'all_on', 1, 'ttft_p99_ms') / ks(d, 'llama_q4_1', 1, 'ttft_p99_ms'):.2f}x"),
    ("keystroke", "line (end to end) p50, same",
     lambda d: f"{ks(d, 'all_on', 1, 'e2e_p50_ms') / ks(d, 'llama_q4_1', 1, 'e2e_p50_ms'):.2f}x"),
    ("keystroke", "served before the next key, 8 editors: completer / llama.cpp",
     lambda d: f"{ks(d, 'all_on', 8, 'served_before_next_key'):.1%} / {ks(d, 'llama_q4_1', 8, 'served_before_next_key'):.1%}"),
    ("cpu", "batch-1 decode int4 / Q4_1 (tok/s)",
     lambda d: f"{cpu(d, 'int4', 1, 'decode_tok_s') / cpu(d, 'llama_q4_1', 1, 'decode_tok_s'):.2f}x "
               f"({cpu(d, 'int4', 1, 'decode_tok_s'):.0f} / {cpu(d, 'llama_q4_1', 1, 'decode_tok_s'):.0f})"),
    ("cpu", "batch-4 decode int4 / Q4_1",
     lambda d: f"{cpu(d, 'int4', 4, 'decode_tok_s') / cpu(d, 'llama_q4_1', 4, 'decode_tok_s'):.2f}x"),
    ("cpu", "keystroke line ms int4 / Q4_1",
     lambda d: f"{cpu(d, 'int4', 1, 'line_ms') / cpu(d, 'llama_q4_1', 1, 'line_ms'):.2f}x "
               f"({cpu(d, 'int4', 1, 'line_ms'):.1f} / {cpu(d, 'llama_q4_1', 1, 'line_ms'):.1f} ms)"),
    ("engine", "decode batch 1, speculation on / off (pairs)",
     lambda d: f"{d['decode_b1_spec']['tok_per_s'] / d['decode_b1_nospec']['tok_per_s']:.2f}x "
               f"({'-'.join(f'{a / b:.2f}' for a, b in zip(d['decode_b1_spec']['repeats'], d['decode_b1_nospec']['repeats']))})"),
    ("engine", "decode batch 4, same",
     lambda d: f"{d['decode_b4_spec']['tok_per_s'] / d['decode_b4_nospec']['tok_per_s']:.2f}x "
               f"({'-'.join(f'{a / b:.2f}' for a, b in zip(d['decode_b4_spec']['repeats'], d['decode_b4_nospec']['repeats']))})"),
    ("engine", "cold line, median ms: HF generate / engine (drafter + n-gram)",
     lambda d: f"{ms(d['hf_plain_line']) / ms(d['engine_draft_ngram_line']):.2f}x"),
    ("engine", "keystroke line, same",
     lambda d: f"{ms(d['hf_plain_keystroke']) / ms(d['engine_draft_ngram_keystroke']):.2f}x"),
    ("engine", "cold block, same",
     lambda d: f"{ms(d['hf_plain_block']) / ms(d['engine_draft_ngram_block']):.2f}x"),
    ("engine", "keystroke TTFT, 4096- / 1024-token file",
     lambda d: f"{d['keystroke_4096']['median_ms'] / d['keystroke_1024']['median_ms']:.2f}x"),
    ("critical", "p50 keystroke to first text (ms)",
     lambda d: f"{d['critical_path']['rows']['p50 keystroke']['ttft']} ms"),
    ("compat", "/infill client p50 / WebSocket's",
     lambda d: f"{d['infill']['client_p50_ms'] / d['websocket']['client_p50_ms']:.2f}x"),
    ("disagg", "short p99 TTFT off / on (`--quick`)",
     lambda d: f"{d['ratios']['short_p99_ttft_off_over_on']:.2f}x"),
    ("cluster", "served before the next key, single / affinity_2",
     lambda d: " / ".join(f"{d['rows'][r]['runs']['2']['served_before_next_key']:.1%}" for r in ("single", "affinity_2"))),
    ("stats", "/v1/stats sorting / histograms at 61,000 requests",
     lambda d: stats(d)),
    ("fairness", "p99 time-to-done, 32 editors / 1",
     lambda d: f"{d['p99_ratio']:.1f}x"),
    ("bulk", "keystrokes served before the next key beside long opens: fifo / interactive first",
     lambda d: bulk(d)),
    ("jump", "Neovim key to ghost after near jumps p50 (n) / server TTFT p50",
     lambda d: jump(d)),
]


def stats(d):
    row = next(r for r in d["rows"] if r["requests"] == 61000)
    return f"{row['sorting_over_histograms']:.1f}x"


def bulk(d):
    return " / ".join(f"{d['rows'][r]['typing']['served_before_next_key']:.1%}" for r in ("fifo", "interactive")) + \
        f" (interactive TTFT p50 {d['rows']['interactive']['typing']['ttft_p50_ms']} ms, n {d['rows']['interactive']['typing']['ttft_n']})"


def jump(d):
    return json.dumps({k: v for k, v in d.items() if k not in ("jumps", "samples")})[:200]


print("| benchmark | ratio | before | after |")
print("|---|---|---|---|")
for bench, label, f in RATIOS:
    cells = []
    for side in ("before", "after"):
        d = load(bench, side)
        try:
            cells.append(f(d) if d is not None else "(no run)")
        except Exception as e:  # a figure a run lacks
            cells.append(f"(missing: {type(e).__name__} {e})"[:80])
    print(f"| {bench} | {label} | {cells[0]} | {cells[1]} |")
