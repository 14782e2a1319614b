"""CPU decode against llama.cpp (issue #16): completer's engine and llama.cpp's
`llama-server` on the same weights (the default SmolLM2-135M) at matched
precision, side by side in one run. Prints a table; writes JSON.

    python -m latency_bench llama-peer build   # once: llama-server (and llama-quantize) from source (cached)
    python -m latency_bench cpu-decode         # ~15 min on 2 cores -> docs/results/cpu_decode_bench.json
    python -m latency_bench cpu-decode --rows fp32 int4 llama_q4_1 --reps 1 --tokens 8 --cases 2 --out /tmp/c.json

Rows: completer at fp32 and bf16 (fused q/k/v and gate/up; `*_unfused`;
`*_compiled` with `engine.compile`, the others without), int8, int4 (the
fused CPU layer, 8-bit activations; `int4_fp32_acts` with fp32 ones, `int4_torch` without
it, torch's ops as before), each a
fresh load of the default Q4_1 GGUF; llama.cpp on the F32, BF16 and Q8_0 GGUFs
llama_peer writes from it (`matched_gguf`) and on the Q4_1 file itself. By
default the unquantized rows are those of the precision `auto` picks on this
CPU (bf16 where native, else fp32). Each at batch 1 and 4
(4 concurrent requests, 4 prompts), one after the other (never two at once),
`--threads` each.

- decode: `--prompt-tokens` of held-out code (pip's sources), `--tokens`
  greedy, never stopping early (completer: no stop ids, `free` mode; llama.cpp:
  `ignore_eos`), no speculation, nothing cached (a new prompt each of `--reps`,
  prefix cache / `cache_prompt` off); medians. Per request, prefill tok/s =
  prompt tokens / time to the first token, decode tok/s = tokens after the
  first / (last token - first token), llama.cpp's own `timings` the same way.
  At batch 4: prompt tokens over the slowest prefill, and the requests'
  decode rates summed.
- floor: the bytes of the projections and head one decode step streams
  (GGUF tensor sizes for llama.cpp) over the memory bandwidth measured at the
  start (summing a `--bandwidth-mib` fp32 tensor on `--threads`), per token
  (at batch 4 a step streams them once for 4 tokens); ratio = measured / floor.
- keystroke line (batch-1 rows): for `--cases` held-out cursors, the prompt
  of one char less is sent first (warm), then the full one, `line` mode,
  timed from send to its last token; completer with speculation as shipped
  (drafter + n-gram), llama.cpp plain (`cache_prompt`, stop at "\\n").
  completer's requests come through its pipeline as every caller's do (the
  same window and template, token healing); llama.cpp gets that window's
  token ids; one extra case first as warm-up.

Past 300 lines: every row (ours and llama.cpp's, at each precision) shares
one run and one table, so its ratios are side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
from pathlib import Path

import msgspec
import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from completer.cpu_quant import Int4Linear, Int8Linear
from completer.config import Config, EngineConfig, SpecConfig
from completer.engine.core import EngineCore
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.request import Request, SamplingParams, Timings
from completer.evaluate import heldout_files, line_starts
from completer.loading import load
from completer.checkpoint import resolve_precision
from completer.model_store import resolve_draft, resolve_target
from completer.pipeline import CompletionPipeline, RequestOptions, display_path
from completer.protocol import Document
from latency_bench import llama_peer
from latency_bench.engine_bench import median
from latency_bench.harness import ROOT
from latency_bench.replay import prompt_states
from latency_bench.run_results import machine, now, write_result

COMPLETER_ROWS = {  # name: (precision, fuse, engine settings beside the defaults)
    "fp32": ("fp32", True, {}), "fp32_unfused": ("fp32", False, {}),
    "fp32_compiled": ("fp32", True, {"compile": True}),
    "bf16": ("bf16", True, {}), "bf16_unfused": ("bf16", False, {}),
    "bf16_compiled": ("bf16", True, {"compile": True}),
    "int8": ("int8", True, {}), "int8_compiled": ("int8", True, {"compile": True}),
    # _kv_fp16: K/V stored as fp16, as llama.cpp's cache is by default (attention's math stays fp32)
    "int8_kv_fp16": ("int8", True, {"kv_dtype": "fp16"}), "int4_kv_fp16": ("int4", True, {"kv_dtype": "fp16"}),
    # int4: the fused CPU layer (engine.fused_cpu, 8-bit activations); _fp32_acts: with fp32 activations;
    # _torch: torch's ops, as before the fused layer; _compiled: those through torch.compile
    "int4": ("int4", True, {}), "int4_fp32_acts": ("int4", True, {"fused_cpu_q8": False}),
    "int4_torch": ("int4", True, {"fused_cpu": False}),
    "int4_compiled": ("int4", True, {"fused_cpu": False, "compile": True})}
LLAMA_ROWS = {  # name: (completer's precision it matches, its GGUF)
    "llama_f32": ("fp32", lambda: llama_peer.matched_gguf("fp32")),
    "llama_bf16": ("bf16", lambda: llama_peer.matched_gguf("bf16")),
    "llama_q8_0": ("int8", lambda: llama_peer.matched_gguf("int8")),
    "llama_q4_1": ("int4", lambda: resolve_target("default"))}
BATCHES = (1, 4)
CONTEXT = 1024  # completer's default window; a llama.cpp slot's context
say = Console(stderr=True, log_path=False).log


class Sample(msgspec.Struct):
    prompt_tokens: int
    prefill_ms: float
    decode_tok_s: float


class Row(msgspec.Struct):
    row: str
    precision: str
    batch: int
    prefill_tok_s: float
    decode_tok_s: float
    ms_per_token: float
    floor_ms: float
    ratio_to_floor: float
    weight_bytes: int
    decode_reps: list[float]
    line_ms: float | None = None  # keystroke line, batch-1 rows
    line_tokens: float | None = None


def bandwidth_gbs(mib: int, threads: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - started)
    return x.numel() * 4 / best / 1e9


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the projections and head, what one decode step streams."""
    total = 0
    for m in model.modules():
        if isinstance(m, (nn.Linear, Int8Linear, Int4Linear)):
            total += sum(t.numel() * t.element_size() for t in (*m.parameters(False), *m.buffers(False)))
            if isinstance(m, Int8Linear):  # fbgemm's packed weight is no buffer
                total += m.out_features * m.in_features
    return total


def gguf_weight_bytes(path: Path) -> int:
    import gguf
    mats = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1}
    embed = mats.pop("token_embd.weight")
    return sum(mats.values()) + (0 if "output.weight" in mats else embed)  # tied: the embedding is the head


def aggregate(reps: list[list[Sample]]) -> tuple[float, float, list[float]]:
    """Median prefill and decode tok/s over repetitions of concurrent requests."""
    prefill = [sum(s.prompt_tokens for s in r) / max(s.prefill_ms for s in r) * 1000 for r in reps]
    decode = [sum(s.decode_tok_s for s in r) for r in reps]
    return median(prefill), median(decode), decode


def make_row(name: str, precision: str, batch: int, reps: list[list[Sample]], nbytes: int, gbs: float) -> Row:
    prefill, decode, per_rep = aggregate(reps)
    floor = nbytes / (gbs * 1e9) * 1000 / batch
    return Row(name, precision, batch, prefill, decode, 1000 / decode, floor, 1000 / decode / floor, nbytes, per_rep)


# -- completer ------------------------------------------------------------------

async def ask(engine: Engine, rid: str, ids: list[int], max_tokens: int, mode: str = "free", **kw) -> Timings:
    started = time.perf_counter()
    request = Request(rid, ids, SamplingParams(max_tokens=max_tokens, mode=mode), arrival=started, **kw)
    return (await engine.submit(request).finished()).timings


def completer_sample(ids: list[int], t: Timings) -> Sample:
    return Sample(len(ids), t.ttft_ms, (t.generated_tokens - 1) / (t.total_ms - t.ttft_ms) * 1000)


async def completer_row(name: str, args, prompts, keys) -> tuple[list[Row], dict]:
    precision, fuse, settings = COMPLETER_ROWS[name]
    path = resolve_target("default")
    target = run_in_passing_thread(lambda: load(path, precision, fuse=fuse))
    draft_path = resolve_draft("default", path)
    draft = draft_path and run_in_passing_thread(lambda: load(draft_path, precision, target=target, fuse=fuse))
    nbytes, threads = weight_bytes(target.model), dict(threads=args.threads, decode_threads=args.threads)
    extra = {"compile": False, **settings}
    # No stop ids: decode runs to max_tokens whatever it writes (`free` mode ends nowhere else).
    config = EngineConfig(prefix_cache=False, kv_cache_mb=512, max_running=8, prefill_chunk=max(BATCHES) *
                          args.prompt_tokens, **threads, **extra)
    engine = Engine(EngineCore.build(target.model, None, target.tokenizer, [], config,
                                     SpecConfig(draft_model=False, ngram=False)))
    engine.start()
    rows = []
    try:
        for b in BATCHES:  # warm-up (compiles, if on; full-length: the first row measured slower), then the measures
            await asyncio.gather(*(ask(engine, f"w{b}-{i}", p, args.tokens) for i, p in enumerate(prompts["warm"][:b])))
            reps = []
            for r, group in enumerate(prompts[b]):
                timings = await asyncio.gather(*(ask(engine, f"{b}-{r}-{i}", p, args.tokens)
                                                 for i, p in enumerate(group)))
                reps.append([completer_sample(p, t) for p, t in zip(group, timings)])
            rows.append(make_row(name, precision, b, reps, nbytes, args.gbs))
            say(f"{name} batch {b}: decode {rows[-1].decode_tok_s:.1f} tok/s")
    finally:
        engine.stop()
    engine = Engine.build(target, draft, EngineConfig(**threads, **extra), SpecConfig())
    engine.start()
    times, tokens = [], []
    pipeline = CompletionPipeline(target, Config())
    line = RequestOptions(mode="line", max_tokens=64)
    try:
        for i, (_, _, before, after) in enumerate(keys):
            state = pipeline.document()
            await engine.submit(pipeline.request(f"prev{i}", before, (), RequestOptions(mode="line", max_tokens=1),
                                                 state)).finished()
            t = (await engine.submit(pipeline.request(f"key{i}", after, (), line, state)).finished()).timings
            if i:  # the first is a warm-up
                times.append(t.total_ms)
                tokens.append(t.generated_tokens)
    finally:
        engine.stop()
    rows[0].line_ms, rows[0].line_tokens = median(times), median(tokens)
    say(f"{name} keystroke line: {rows[0].line_ms:.1f} ms")
    return rows, {"model": target.describe_precision(), "drafter": draft.name if draft else None}


# -- llama.cpp --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def post(session, url: str, ids: list[int], **body) -> dict:
    async with session.post(f"{url}/completion", json={"prompt": ids, "temperature": 0.0, "stream": False,
                                                        **body}) as resp:
        resp.raise_for_status()
        return await resp.json()


async def llama_row(name: str, args, prompts, keys) -> tuple[list[Row], dict]:
    import aiohttp

    precision, gguf = LLAMA_ROWS[name][0], LLAMA_ROWS[name][1]()
    nbytes, rows = gguf_weight_bytes(gguf), []
    decode = dict(n_predict=args.tokens, ignore_eos=True, cache_prompt=False)
    for b in BATCHES:
        with llama_peer.llama_server(gguf, port=free_port(), threads=args.threads, parallel=b,
                                     ctx_per_slot=max(CONTEXT, args.prompt_tokens + args.tokens)) as url:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                await asyncio.gather(*(post(session, url, p, **decode) for p in prompts["warm"][:b]))  # as ours
                reps = []
                for group in prompts[b]:
                    done = await asyncio.gather(*(post(session, url, p, **decode) for p in group))
                    reps.append([Sample(d["timings"]["prompt_n"], d["timings"]["prompt_ms"],
                                        d["timings"]["predicted_per_second"]) for d in done])
                rows.append(make_row(name, precision, b, reps, nbytes, args.gbs))
                say(f"{name} batch {b}: decode {rows[-1].decode_tok_s:.1f} tok/s")
                if b != 1:
                    continue
                times, tokens = [], []
                for i, (before, after, *_) in enumerate(keys):
                    await post(session, url, before, n_predict=1, cache_prompt=True)
                    started = time.perf_counter()
                    d = await post(session, url, after, n_predict=64, cache_prompt=True, stop=["\n"])
                    if i:
                        times.append((time.perf_counter() - started) * 1000)
                        tokens.append(d["timings"]["predicted_n"])
                rows[0].line_ms, rows[0].line_tokens = median(times), median(tokens)
                say(f"{name} keystroke line: {rows[0].line_ms:.1f} ms")
    return rows, {"gguf": gguf.name, "version": llama_peer.DEFAULT_VERSION,
                  "repack": gguf not in llama_peer.STARTED_WITHOUT_REPACK}


# -- the run ------------------------------------------------------------------------

def inputs(args) -> tuple[dict, list]:
    """Decode prompts (`warm`, then per batch a group of that many per repetition:
    consecutive, disjoint slices of pip's sources) and keystroke cases as
    (prompt before the last char, prompt, the cursor's line, suffix)."""
    builder, files = prompt_states("default", CONTEXT, 64)().builder, heldout_files()[1]
    need = (max(BATCHES) + args.reps * sum(BATCHES)) * args.prompt_tokens
    ids = builder.tok.encode("".join(f.text for f in files)[: 8 * need])  # code: ~4 chars a token
    chunks = iter(ids[i: i + args.prompt_tokens] for i in range(0, need, args.prompt_tokens))
    prompts = {"warm": [next(chunks) for _ in range(max(BATCHES))]}
    for b in BATCHES:
        prompts[b] = [[next(chunks) for _ in range(b)] for _ in range(args.reps)]
    keys = []
    # Cursors inside a line's text (the rest of the line to write): a line start's
    # prompt ends in indentation, after which llama.cpp's "\n" stop often ends at once.
    # Per case: llama.cpp's prompts (before the last char, then with it) and the same two
    # documents, which completer's rows send through its pipeline (healing included).
    for f, cursor, end in line_starts(files, args.cases + 1, args.seed, mid_line=True):
        prefix, suffix, uri = f.text[:cursor], f.text[end:], Path("/", f.path).as_uri()
        path = display_path(uri)
        keys.append((builder.build(prefix[:-1], suffix, path).tokens, builder.build(prefix, suffix, path).tokens,
                     Document(uri, prefix[:-1], suffix), Document(uri, prefix, suffix)))
    return prompts, keys


def default_rows() -> list[str]:
    """The unquantized rows at the precision `auto` picks here (bf16 where the
    CPU computes in it natively, else fp32), the quantized ones, llama.cpp's."""
    wide = resolve_precision("auto")
    return ([n for n, (p, _, _) in COMPLETER_ROWS.items() if p in (wide, "int8", "int4")] +
            [n for n, (p, _) in LLAMA_ROWS.items() if p in (wide, "int8", "int4")])


def aims(rows: list[Row]) -> list[str]:
    by = {(r.row, r.batch): r for r in rows}
    out = []
    for ours, theirs in (("int8", "llama_q8_0"), ("int4", "llama_q4_1"), ("bf16", "llama_bf16"),
                         ("fp32", "llama_f32")):
        for name in (ours, f"{ours}_q8", f"{ours}_torch", f"{ours}_compiled"):
            if (name, 1) in by and (theirs, 1) in by:
                a, b = by[name, 1].decode_tok_s, by[theirs, 1].decode_tok_s
                out.append(f"decode tok/s batch 1: {name} {a:.1f} vs {theirs} {b:.1f} ({a / b:.2f}x; "
                           f"aim >= 1: {'met' if a >= b else 'missed'})")
    for name in ("bf16", "bf16_compiled"):
        if (name, 1) in by:
            r = by[name, 1]
            out.append(f"{name} batch 1: {r.ms_per_token:.1f} ms/token, {r.ratio_to_floor:.2f}x its weight-streaming "
                       f"floor of {r.floor_ms:.1f} ms (aim <= 1.5x: {'met' if r.ratio_to_floor <= 1.5 else 'missed'})")
    lines = {r.row: r.line_ms for r in rows if r.line_ms is not None}
    ours = {k: v for k, v in lines.items() if k in COMPLETER_ROWS and "unfused" not in k}
    theirs = {k: v for k, v in lines.items() if k.startswith("llama")}
    if ours and theirs:
        best = min(theirs, key=theirs.get)
        out.append("keystroke line: completer " + ", ".join(f"{k} {v:.1f} ms" for k, v in ours.items()) +
                   f" (speculation on) vs llama.cpp {theirs[best]:.1f} ms (best: {best}, plain)")
    return out


async def main_async(args) -> dict:
    llama_peer.server_binary()  # fail now, not after the completer rows
    args.gbs = run_in_passing_thread(bandwidth_gbs, args.bandwidth_mib, args.threads)
    say(f"memory bandwidth (sum over {args.bandwidth_mib} MiB, {args.threads} threads): {args.gbs:.1f} GB/s")
    prompts, keys = inputs(args)
    rows, about, skipped = [], {}, {}
    if first := next((n for n in args.rows if n in COMPLETER_ROWS), None):
        # The first row of a run measured ~35% slower in decode and prefill whichever it was
        # (int4 then int4_q8, 2026-12-03): one unrecorded pass of it first.
        say(f"warm-up: {first}, not recorded ...")
        await completer_row(first, args, {"warm": prompts["warm"], **{b: prompts[b][:1] for b in BATCHES}}, keys[:1])
    for name in args.rows:
        say(f"{name} ...")
        try:
            made, about[name] = await (completer_row if name in COMPLETER_ROWS else llama_row)(name, args, prompts,
                                                                                              keys)
            rows += made
        except Exception as e:  # noqa: BLE001 - one row failing (a GGUF type llama_peer lacks) leaves the others
            skipped[name] = f"{type(e).__name__}: {e}"
            say(f"{name}: FAILED ({skipped[name]})")
    settings = {k: getattr(args, k) for k in ("threads", "prompt_tokens", "tokens", "reps", "cases", "seed")}
    return {"date": now(), "machine": msgspec.to_builtins(machine()), "command": " ".join(sys.argv),
            "settings": settings, "bandwidth_gbs": args.gbs, "rows": msgspec.to_builtins(rows),
            "about": about, "skipped": skipped, "aims": aims(rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", choices=[*COMPLETER_ROWS, *LLAMA_ROWS], default=default_rows(),
                   help="default: the rows of this CPU's `auto` precision (bf16 or fp32), int8, int4, llama.cpp's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=860)
    p.add_argument("--tokens", type=int, default=64, help="generated per decode request")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cases", type=int, default=10, help="keystroke lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-mib", type=int, default=512)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "cpu_decode_bench.json")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    table = Table(title=f"CPU decode, {args.threads} threads: {args.prompt_tokens}-token prompts, {args.tokens} "
                        f"tokens, medians of {args.reps}; floor at {results['bandwidth_gbs']:.1f} GB/s")
    for col in ("row", "precision", "batch", "prefill tok/s", "decode tok/s", "ms/token", "floor ms/token",
                "ratio to floor", "keystroke line ms (tokens)"):
        table.add_column(col, justify="left" if col in ("row", "precision") else "right")
    for r in results["rows"]:
        line = f"{r['line_ms']:.1f} ({r['line_tokens']:.0f})" if r["line_ms"] is not None else ""
        table.add_row(r["row"], r["precision"], str(r["batch"]), f"{r['prefill_tok_s']:.0f}",
                      f"{r['decode_tok_s']:.1f}", f"{r['ms_per_token']:.1f}", f"{r['floor_ms']:.2f}",
                      f"{r['ratio_to_floor']:.2f}", line)
    console = Console(width=140)
    console.print(table)
    for line in results["aims"]:
        console.print(line)
    for name, why in results["skipped"].items():
        console.print(f"skipped {name}: {why}")
    write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
