"""Speed and memory at the sizes users bring: random weights at the shapes of
Qwen2.5-Coder 0.5B, 1.5B and 3B, completer against llama.cpp's `llama-server`
on the same GGUF files, one run.

    python -m latency_bench llama-peer build   # once: llama-server and llama-quantize (cached)
    python -m latency_bench real-sizes         # the files (once, cached), then the table -> docs/results/real_sizes.{json,md}
    python -m latency_bench real-sizes --shapes tiny --reps 1 --cases 2 --spec tiny:tiny --out /tmp/r.json  # smoke

A pass's time does not depend on the weights' values, so random weights at a
model's real shapes measure its speed (never its quality, nor speculation's
acceptance). The shapes are the models' `config.json` (SHAPES; `tiny` is a
test shape). Files (`files`; ~/.cache/completer/bench/real_sizes/, written
once): an F16 GGUF of N(0, 0.02) matrices (norms 1, biases 0), architecture
`qwen2`, tied embeddings as the three models have, and the vocabulary of
completer's default model (SmolLM2's 49,152-token BPE, a real tokenizer)
padded with unused tokens to the models' 151,936 rows, so the embedding and
the head cost what they really cost; then llama.cpp's `llama-quantize` makes
the Q8_0 and Q4_K_M files from it (its k-quant mixture: rows whose width is no
multiple of 256 fall back, Q5_0 for the 0.5B's 896; the F16 file is then
deleted unless `--keep-f16`).

Rows, each a fresh process (completer: a worker that loads the file as
`completer serve` does, `load_models` with the server's settings, and builds
its engine; llama.cpp: `llama_peer.llama_server`, one slot), on the same file,
the same token ids (pip's sources, the default model's tokenizer),
`--threads` each, one after the other:

- completer `int4` and `int8` (its own 4-bit groups / 8-bit rows, from the
  dequantized weights) on the Q4_K_M and Q8_0 files; llama.cpp on both.
- prefill: time to the first token of a `--prompt-tokens` prompt (1,000) that
  nothing cached; decode: tokens/s after it, `--tokens` greedy, never
  stopping (no stop ids / `ignore_eos`), no speculation; medians of `--reps`.
- keystroke: a window primed (untimed), then `--cases` keys, each one token
  more than the one before (the previous prompt cached, as a typist's), to
  its first token (TTFT) and to `--line-tokens` tokens (a line of code:
  random weights end no line where a real model would). completer's figures
  are the engine's (`Timings`: arrival to first / last token), llama.cpp's its
  own (`timings`: prompt_ms, + predicted_ms).
- memory: RSS of the process after load and engine start (anon and file
  pages apart: llama.cpp maps the file), K/V bytes per token (layers x 2 x
  kv_heads x head_dim x bytes: completer's pool is fp32 by default, llama.cpp's
  cache f16), each K/V pool as allocated, and completer's own estimate (what
  its start checks against `model.max_memory_gb`).
- streamed: the bytes a decode step reads (llama.cpp: the file's matrices;
  completer: the fused layer's blocks and the int8 head); load s: completer's
  load (dequantize, requantize, pack), llama.cpp maps the file.
- fused: whether completer's fused C++ CPU layer runs the model (else why not).
- speculation (`--spec 3b:0.5b`, int4, a worker of its own): the engine's
  calibrated pass costs (a target pass of k+1 tokens over a 1-token one, a
  drafter step), and the per-token acceptance at which drafting k tokens
  breaks even in its cost model (engine/spec_policy.py). Random weights
  cannot measure acceptance itself.

One file past 300 lines: the files, both servers' rows and the table are one
benchmark whose rows share one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from completer.model_store import cache_dir, pull, resolve_target
from latency_bench import llama_peer
from latency_bench.harness import ROOT

GGUF_TYPES = {"int8": "Q8_0", "int4": "Q4_K_M"}  # completer's precision: the llama.cpp file it loads too


class Shape(msgspec.Struct, frozen=True):
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    source: str
    rope_theta: float = 1e6
    context: int = 32768
    head_width: int = 0  # 0: hidden / heads (Gemma's differ)

    @property
    def head_dim(self) -> int:
        return self.head_width or self.hidden // self.heads

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * itemsize


# config.json of each (Qwen/Qwen2.5-Coder-*B on Hugging Face; all three tie their embeddings, qkv biases on).
_HF = "huggingface.co/Qwen/Qwen2.5-Coder-{}/blob/main/config.json"
SHAPES = {
    "tiny": Shape(256, 512, 2, 4, 2, 49152, "a test shape (widths a multiple of 256: every k-quant fits)"),
    "0.5b": Shape(896, 4864, 24, 14, 2, 151936, _HF.format("0.5B")),
    "1.5b": Shape(1536, 8960, 28, 12, 2, 151936, _HF.format("1.5B")),
    "3b": Shape(2048, 11008, 36, 16, 2, 151936, _HF.format("3B")),
}
UNUSED = 5  # llama.cpp's token type for padding rows


def shape_of(path: Path) -> Shape:
    """A real model file's shape (a `--models` row), from its metadata."""
    from completer.gguf_checkpoint import open_gguf

    cfg = open_gguf(path).config()
    return Shape(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                 cfg.num_key_value_heads, cfg.vocab_size, f"the real file {path.name} ({cfg.architecture})",
                 cfg.rope_theta, cfg.max_position_embeddings, head_width=cfg.head_dim)


def files_dir() -> Path:
    return cache_dir() / "bench" / "real_sizes"


def gguf_path(name: str, type_: str) -> Path:
    return files_dir() / f"qwen2.5-coder-{name}-random.{type_}.gguf"


# -- the files -------------------------------------------------------------------

def write_f16(name: str, out: Path, seed: int = 0) -> Path:
    """Random weights at SHAPES[name] as an F16 GGUF, a tensor at a time
    (the largest, the embedding, is the memory it takes)."""
    import gguf
    import numpy as np

    shape, source = SHAPES[name], gguf.GGUFReader(pull())
    tokens = list(source.fields["tokenizer.ggml.tokens"].contents())
    types = list(source.fields["tokenizer.ggml.token_type"].contents())
    if shape.vocab < len(tokens):
        raise ValueError(f"{name}: {shape.vocab} rows, but the vocabulary has {len(tokens)} tokens")
    pad = shape.vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [UNUSED] * pad
    writer = gguf.GGUFWriter(out, "qwen2")
    writer.add_name(f"Qwen2.5-Coder-{name.upper()} shape, random weights")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in source.fields.items():
        if not key.startswith("tokenizer.") or key == "tokenizer.chat_template":
            continue
        value = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}.get(key, field.contents())
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    d, hd = shape.hidden, shape.head_dim
    per_layer = {"attn_norm.weight": (d,), "attn_q.weight": (shape.heads * hd, d), "attn_q.bias": (shape.heads * hd,),
                 "attn_k.weight": (shape.kv_heads * hd, d), "attn_k.bias": (shape.kv_heads * hd,),
                 "attn_v.weight": (shape.kv_heads * hd, d), "attn_v.bias": (shape.kv_heads * hd,),
                 "attn_output.weight": (d, shape.heads * hd), "ffn_norm.weight": (d,),
                 "ffn_gate.weight": (shape.ffn, d), "ffn_up.weight": (shape.ffn, d), "ffn_down.weight": (d, shape.ffn)}
    tensors = {"token_embd.weight": (shape.vocab, d), "output_norm.weight": (d,)}  # tied: no output.weight
    tensors |= {f"blk.{i}.{k}": v for i in range(shape.layers) for k, v in per_layer.items()}
    for tensor, dims in tensors.items():  # numpy's (row-major) shape; 1-D tensors stay F32, as converters keep them
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(tensor, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for tensor, dims in tensors.items():
        if len(dims) == 1:
            w = np.full(dims, 1.0 if tensor.endswith("norm.weight") else 0.0, np.float32)
        else:
            w = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)
        writer.write_tensor_data(w)
    writer.close()
    return out


def ensure_files(name: str, threads: int, keep_f16: bool = False) -> dict[str, Path]:
    """The Q8_0 and Q4_K_M files of a shape (written once: F16, then llama-quantize)."""
    wanted = {t: gguf_path(name, t) for t in GGUF_TYPES.values()}
    missing = {t: p for t, p in wanted.items() if not p.is_file()}
    if not missing:
        return wanted
    files_dir().mkdir(parents=True, exist_ok=True)
    f16 = gguf_path(name, "F16")
    if not f16.is_file():
        started = time.monotonic()
        write_f16(name, f16.with_name(f16.name + ".part")).replace(f16)  # a half-written file must not count
        say(f"{f16.name}: {f16.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s")
    quantize = llama_peer.quantize_binary()
    for type_, path in missing.items():
        started, part = time.monotonic(), path.with_name(path.name + ".part")
        run = subprocess.run([str(quantize), str(f16), str(part), type_, str(threads)], capture_output=True,
                             text=True)
        if run.returncode != 0:
            raise RuntimeError(f"llama-quantize {type_} failed ({run.returncode}): {run.stderr[-2000:]}")
        part.replace(path)
        say(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB in {time.monotonic() - started:.0f} s")
    if not keep_f16:
        f16.unlink()
    return wanted


def tensor_types(path: Path) -> dict[str, int]:
    """How many of the file's matrices are stored in each type (Q4_K_M is a mixture)."""
    import gguf
    from collections import Counter

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) > 1))




# -- what a row measures --------------------------------------------------------------

class Inputs(msgspec.Struct):
    """Token ids (pip's sources, the default model's tokenizer: the files' own vocabulary)."""

    warm: list[int]  # a warm-up request's prompt
    prompts: list[list[int]]  # one cold prompt per repetition
    window: list[int]  # the keystrokes' window, primed first
    typed: list[int]  # what the keystrokes add, a token each


class Job(msgspec.Struct):
    """One completer row, run by a worker process."""

    path: str
    precision: str
    threads: int
    tokens: int
    line_tokens: int
    draft: str = ""  # a drafter: only its pass costs are measured (`spec`)


class Measured(msgspec.Struct):
    prefill_ms: float  # medians
    decode_tok_s: float
    key_ttft_ms: float
    key_line_ms: float
    prompt_tokens: int
    key_prompt_computed: float  # prompt tokens a keystroke computed (the rest came from the cache)
    decode_reps: list[float]


def memory_of(pid: int | str = "self") -> dict[str, float]:
    """RSS and its anonymous and file-backed parts, MB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[{"VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssFile": "file_mb"}[key]] = int(value.split()[0]) / 1024
    return fields


def reduce(samples: list, keys: list[tuple[float, float, int]]) -> Measured:
    """cpu_decode_bench's Samples, one per repetition; (TTFT, line ms, prompt tokens computed) per key."""
    from latency_bench.engine_bench import median

    decode = [s.decode_tok_s for s in samples]
    return Measured(median([s.prefill_ms for s in samples]), median(decode), median([k[0] for k in keys]),
                    median([k[1] for k in keys]), samples[0].prompt_tokens, median([k[2] for k in keys]), decode)


# -- completer: a worker process per row ------------------------------------------------

async def completer_worker(job: Job, inputs: Inputs) -> dict:
    """Load as `completer serve` does, start the engine, measure; what the row reports."""
    from completer.config import Config, EngineConfig, SpecConfig
    from completer.engine.core import EngineCore
    from completer.engine.engine import Engine, run_in_passing_thread
    from completer.loading import load_models
    from completer.memory import PROCESS_BYTES, model_bytes, projection_weights
    from latency_bench.cpu_decode_bench import weight_bytes

    refusals: list[str] = []  # the fused layer's, as the engine logs them

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "fused CPU layer" in record.getMessage() or "torch's ops" in record.getMessage():
                refusals.append(record.getMessage())

    logging.getLogger("completer.engine").addHandler(Said())
    m, started = Config().model, time.monotonic()
    target, draft = run_in_passing_thread(load_models, job.path, job.draft, job.precision, None, None, "cpu", True,
                                          m.int4_dense_rows, m.kernel_cache_entries)
    load_s = time.monotonic() - started
    config = EngineConfig(threads=job.threads, decode_threads=job.threads)  # the rest as served
    spec = SpecConfig(draft_model=draft is not None, ngram=False)
    # No stop ids: decode runs to max_tokens whatever random weights write.
    engine = run_in_passing_thread(lambda: Engine(EngineCore.build(target.model, draft.model if draft else None,
                                                                   target.tokenizer, [], config, spec)))
    engine.start()  # the fused layer, calibration (with a drafter)
    fused = any(v is not None for v in target.model.__dict__.get("fused_cpu_layers", {}).values())
    weights = sum(model_bytes(x.model.config, x.precision, m.int4_dense_rows, True) for x in (target, draft) if x)
    cfg = target.model.config
    # What a decode step reads: through the fused layer its Q4_1 blocks (20 bytes a group of 32) or int8 tiles
    # and the int8 head; through torch's ops every buffer of the projections and head.
    streamed = projection_weights(cfg) * (0.625 if target.precision == "int4" else 1) + \
        (cfg.head_vocab_size or cfg.vocab_size) * cfg.hidden_size if fused else weight_bytes(target.model)
    row = {"load_s": load_s, "memory": memory_of(), "kv_pool_mb": config.kv_cache_mb,
           # What the start checks against model.max_memory_gb: the weights, the K/V pool, the process.
           "estimate_mb": (weights + config.kv_cache_mb * 2**20 + PROCESS_BYTES) / 2**20,
           "estimate_weights_mb": weights / 2**20,
           "weight_bytes": streamed, "fused": fused,
           "fused_refusals": refusals}
    try:
        if draft is not None:
            row["spec"] = pass_costs(engine, draft.model)
        else:
            row["measured"] = msgspec.to_builtins(await completer_measure(engine, job, inputs))
    finally:
        engine.stop()
    row["memory_after"] = memory_of()
    return row


async def completer_measure(engine, job: Job, inputs: Inputs) -> Measured:
    from latency_bench.cpu_decode_bench import ask, completer_sample

    await ask(engine, "warm", inputs.warm, 8)
    samples, keys = [], []
    for i, prompt in enumerate(inputs.prompts):
        samples.append(completer_sample(prompt, await ask(engine, f"cold{i}", prompt, job.tokens)))
    await ask(engine, "prime", inputs.window, 1)
    for i in range(len(inputs.typed)):
        ids = inputs.window + inputs.typed[: i + 1]
        t = await ask(engine, f"key{i}", ids, job.line_tokens)
        keys.append((t.ttft_ms, t.total_ms, len(ids) - t.cached_tokens))
    return reduce(samples, keys)


def pass_costs(engine, draft) -> dict:
    """The engine's calibrated costs at batch 1 and where drafting k tokens breaks even."""
    from completer.engine.spec_policy import expected_tokens

    policy = engine.core.policy
    costs = policy.costs
    plain = costs.target[(1, 1)]
    k_max = max(w for b, w in costs.target if b == 1) - 1
    verify = {k: costs.verify_ratio(1, k + 1) for k in range(1, k_max + 1)}
    drafter = costs.draft_ratio(1)

    def break_even(k: int) -> float | None:
        """The acceptance a at which expected_tokens(a, k) equals the pass's cost (gain 1.0)."""
        cost = verify[k] + k * drafter
        if expected_tokens(1.0, k) <= cost:
            return None  # never pays, even if every draft were accepted
        lo, hi = 0.0, 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if expected_tokens(mid, k) < cost else (lo, mid)
        return hi

    even = {k: break_even(k) for k in verify}
    paying = [a for a in even.values() if a is not None]
    return {"plain_ms": plain * 1000, "verify_ratio": verify, "draft_step_ms": drafter * plain * 1000,
            "draft_ratio": drafter, "break_even": even, "break_even_min": min(paying) if paying else None,
            "calibrated_context": 256, "drafter_layers": draft.config.num_hidden_layers}


def run_completer(job: Job, inputs_path: Path) -> dict:
    """A worker process (a fresh load, its memory its own); its row."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as out:
        pass
    cmd = [sys.executable, "-m", "latency_bench.real_sizes", "--worker", msgspec.json.encode(job).decode(),
           "--inputs", str(inputs_path), "--out", out.name]
    run = subprocess.run(cmd, cwd=ROOT)
    result = Path(out.name).read_text()
    Path(out.name).unlink()
    if run.returncode != 0 or not result:
        raise RuntimeError(f"the completer worker failed ({run.returncode}): {' '.join(cmd[:4])} ...")
    return json.loads(result)


# -- llama.cpp ------------------------------------------------------------------------

async def llama_measure(url: str, job: Job, inputs: Inputs) -> Measured:
    import aiohttp

    from latency_bench.cpu_decode_bench import Sample, post

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await post(session, url, inputs.warm, n_predict=8, ignore_eos=True, cache_prompt=False)
        samples, keys = [], []
        for prompt in inputs.prompts:
            t = (await post(session, url, prompt, n_predict=job.tokens, ignore_eos=True, cache_prompt=False))["timings"]
            samples.append(Sample(t["prompt_n"], t["prompt_ms"], t["predicted_per_second"]))
        await post(session, url, inputs.window, n_predict=1, cache_prompt=True)
        for i in range(len(inputs.typed)):
            t = (await post(session, url, inputs.window + inputs.typed[: i + 1], n_predict=job.line_tokens,
                            ignore_eos=True, cache_prompt=True))["timings"]
            keys.append((t["prompt_ms"], t["prompt_ms"] + t["predicted_ms"], t["prompt_n"]))
    return reduce(samples, keys)


def run_llama(job: Job, inputs: Inputs, context: int) -> dict:
    from latency_bench.cpu_decode_bench import free_port, gguf_weight_bytes

    path = Path(job.path)
    with llama_peer.llama_server(path, port=free_port(), threads=job.threads, parallel=1,
                                 ctx_per_slot=context) as url:
        after_load = memory_of(llama_peer.PIDS[url])
        measured = asyncio.run(llama_measure(url, job, inputs))
        after = memory_of(llama_peer.PIDS[url])
    return {"memory": after_load, "memory_after": after, "weight_bytes": gguf_weight_bytes(path),
            "kv_cache_tokens": context, "measured": msgspec.to_builtins(measured),
            "repack": path not in llama_peer.STARTED_WITHOUT_REPACK}


# -- the run ----------------------------------------------------------------------------

def make_inputs(args) -> Inputs:
    from completer.checkpoint import load_tokenizer
    from completer.evaluate import heldout_files

    P = args.prompt_tokens
    need = P // 4 + (args.reps + 1) * P + args.cases
    ids = load_tokenizer(pull()).encode("".join(f.text for f in heldout_files()[1])[: 8 * need])  # ~4 chars a token
    chunks = iter(ids[P // 4 + i * P: P // 4 + (i + 1) * P] for i in range(args.reps + 1))
    prompts = [next(chunks) for _ in range(args.reps)]
    window = next(chunks)
    end = P // 4 + (args.reps + 1) * P
    return Inputs(ids[: P // 4], prompts, window, ids[end: end + args.cases])


def spec_row(args, inputs_path: Path) -> dict:
    target, draft = args.spec.split(":")
    paths = {n: ensure_files(n, args.threads, args.keep_f16)[GGUF_TYPES["int4"]] for n in (target, draft)}
    job = Job(str(paths[target]), "int4", args.threads, args.tokens, args.line_tokens, draft=str(paths[draft]))
    row = run_completer(job, inputs_path)
    return {"target": target, "draft": draft, "precision": "int4", **row}


def run(args) -> dict:
    from latency_bench.run_results import machine, now

    llama_peer.server_binary()  # fail now, not after the first rows
    inputs = make_inputs(args)
    context = -(-(args.prompt_tokens + max(args.tokens, args.cases + args.line_tokens) + 16) // 256) * 256
    rows, files, skipped = [], {}, {}
    with tempfile.NamedTemporaryFile("wb", suffix=".json") as inputs_file:
        inputs_file.write(msgspec.json.encode(inputs))
        inputs_file.flush()
        inputs_path = Path(inputs_file.name)

        def measure(name: str, precision: str, path: Path) -> None:
            job = Job(str(path), precision, args.threads, args.tokens, args.line_tokens)
            for server in args.servers:
                say(f"{name} {precision}: {server} on {path.name} ...")
                try:
                    made = run_completer(job, inputs_path) if server == "completer" else \
                        run_llama(job, inputs, context)
                except Exception as e:  # noqa: BLE001 - one row failing leaves the others
                    skipped[f"{name} {precision} {server}"] = f"{type(e).__name__}: {e}"
                    say(f"FAILED: {skipped[f'{name} {precision} {server}']}")
                    continue
                rows.append({"shape": name, "precision": precision, "server": server, "file": path.name, **made})
                say(line_of(rows[-1]))

        for name in args.shapes:
            paths = ensure_files(name, args.threads, args.keep_f16)
            files[name] = {t: {"path": str(p), "mb": p.stat().st_size / 2**20, "types": tensor_types(p)}
                           for t, p in paths.items()}
            for precision in args.precisions:
                measure(name, precision, paths[GGUF_TYPES[precision]])
        for name in args.models:  # real files, at the precision `auto` picks for them
            path = resolve_target(name)
            files[name] = {"file": {"path": str(path), "mb": path.stat().st_size / 2**20, "types": tensor_types(path)}}
            measure(name, "auto", path)
        spec = None
        if args.spec:
            say(f"speculation: {args.spec} (target:drafter) ...")
            try:
                spec = spec_row(args, inputs_path)
            except Exception as e:  # noqa: BLE001
                skipped["spec"] = f"{type(e).__name__}: {e}"
    known = {**{n: SHAPES[n] for n in {*args.shapes, *(args.spec.split(":") if args.spec else ())}},
             **{n: shape_of(Path(files[n]["file"]["path"])) for n in args.models}}
    shapes = {n: {**msgspec.to_builtins(s), "head_dim": s.head_dim,
                  "kv_bytes_per_token": {"completer (fp32)": s.kv_bytes_per_token(4),
                                         "llama.cpp (f16)": s.kv_bytes_per_token(2)}}
              for n, s in known.items()}
    settings = {k: getattr(args, k) for k in ("threads", "prompt_tokens", "tokens", "line_tokens", "reps", "cases")}
    return {"date": now(), "machine": msgspec.to_builtins(machine()), "command": " ".join(sys.argv),
            "settings": {**settings, "llama_context": context, "llama_version": llama_peer.DEFAULT_VERSION},
            "shapes": shapes, "files": files, "rows": rows, "spec": spec, "skipped": skipped}


def line_of(row: dict) -> str:
    m = row["measured"]
    return (f"{row['shape']} {row['precision']} {row['server']}: prefill {m['prefill_ms']:.0f} ms, decode "
            f"{m['decode_tok_s']:.1f} tok/s, key {m['key_ttft_ms']:.0f}/{m['key_line_ms']:.0f} ms, "
            f"RSS {row['memory']['rss_mb']:.0f} MB")


COLUMNS = ("shape", "precision", "server", "file", "streamed MB", "load s", "prefill ms", "decode tok/s",
           "key TTFT ms", "key line ms", "RSS MB (anon)", "estimate MB", "K/V B/token", "fused")


def title(results: dict) -> str:
    s = results["settings"]
    return (f"Random weights at Qwen2.5-Coder's shapes, {s['threads']} threads: prefill of {s['prompt_tokens']} "
            f"tokens, decode of {s['tokens']}, a keystroke to its first token and to {s['line_tokens']} (medians)")


def cells(results: dict) -> list[list[str]]:
    out = []
    for r in results["rows"]:
        m, mem, shape = r["measured"], r["memory"], results["shapes"][r["shape"]]
        ours = r["server"] == "completer"
        kv = shape["kv_bytes_per_token"]["completer (fp32)" if ours else "llama.cpp (f16)"]
        out.append([r["shape"], r["precision"], r["server"], r["file"].split("-random.")[-1].removesuffix(".gguf"),
                    f"{r['weight_bytes'] / 2**20:.0f}", f"{r['load_s']:.0f}" if ours else "",
                    f"{m['prefill_ms']:.0f}", f"{m['decode_tok_s']:.1f}", f"{m['key_ttft_ms']:.0f}",
                    f"{m['key_line_ms']:.0f}", f"{mem['rss_mb']:.0f} ({mem['anon_mb']:.0f})",
                    f"{r['estimate_mb']:.0f}" if ours else "", f"{kv:,}",
                    ("yes" if r["fused"] else "no: " + "; ".join(r["fused_refusals"])) if ours else ""])
    return out


def table(results: dict):
    from rich.table import Table

    t = Table(title=title(results))
    for col in COLUMNS:
        t.add_column(col, justify="left" if col in ("shape", "precision", "server", "file", "fused") else "right")
    for row in cells(results):
        t.add_row(*row)
    return t


def markdown(results: dict) -> str:
    """The table and the speculation lines as markdown (beside the JSON)."""
    lines = [f"{title(results)}; {results['date']}, {results['machine']['cpu']}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in cells(results)]
    lines += [""] + [f"- {n}: hidden {s['hidden']}, ffn {s['ffn']}, {s['layers']} layers, {s['heads']} heads "
                     f"({s['kv_heads']} K/V) of {s['head_dim']}, {s['vocab']:,} rows, tied embeddings; {s['source']}"
                     for n, s in sorted(results["shapes"].items())]
    return "\n".join(lines + [""] + (spec_lines(results["spec"]) if results["spec"] else [])) + "\n"


def spec_lines(spec: dict) -> list[str]:
    c = spec["spec"]
    widths = " ".join(f"{int(k) + 1}:{v:.2f}" for k, v in c["verify_ratio"].items())
    even = " ".join(f"k={k}:{'never' if a is None else f'{a:.2f}'}" for k, a in c["break_even"].items())
    return [f"speculation, {spec['target']} target (int4) with a {spec['draft']} drafter (int4): a 1-token target "
            f"pass {c['plain_ms']:.1f} ms; a pass of width w over it {widths}; a drafter step {c['draft_step_ms']:.1f} ms "
            f"({c['draft_ratio']:.2f} of a target pass); RSS with both {spec['memory']['rss_mb']:.0f} MB",
            f"break-even per-token acceptance (engine/spec_policy.py's cost model, passes calibrated over "
            f"{c['calibrated_context']} tokens): {even}"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["0.5b", "1.5b", "3b"])
    p.add_argument("--precisions", nargs="+", choices=list(GGUF_TYPES), default=["int4", "int8"])
    p.add_argument("--models", nargs="*", default=[], help="real model files too, by name or path "
                   "(e.g. gemma3-270m), at the precision `auto` picks, beside llama.cpp on the same file")
    p.add_argument("--servers", nargs="+", choices=["completer", "llama.cpp"], default=["completer", "llama.cpp"])
    p.add_argument("--spec", default="3b:0.5b", help="TARGET:DRAFTER shapes for the speculation costs ('' for none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=64, help="decoded per cold request")
    p.add_argument("--line-tokens", type=int, default=12, help="a keystroke's line, in tokens")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cases", type=int, default=5, help="keystrokes")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 files the quantized ones are made from")
    p.add_argument("--files-only", action="store_true", help="write the files, measure nothing")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "real_sizes.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a completer row's process: its Job as JSON
    p.add_argument("--inputs", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        job = msgspec.json.decode(args.worker, type=Job)
        inputs = msgspec.json.decode(args.inputs.read_bytes(), type=Inputs)
        args.out.write_text(json.dumps(asyncio.run(completer_worker(job, inputs))))
        return 0
    if args.files_only:
        for name in {*args.shapes, *(args.spec.split(":") if args.spec else ())}:
            for type_, path in ensure_files(name, args.threads, args.keep_f16).items():
                say(f"{path} ({tensor_types(path)})")
        return 0
    from rich.console import Console

    from latency_bench.run_results import write_result

    results = run(args)
    console = Console(width=180)
    console.print(table(results))
    for line in spec_lines(results["spec"]) if results["spec"] else []:
        console.print(line)
    for name, why in results["skipped"].items():
        console.print(f"skipped {name}: {why}")
    write_result(args.out, results)
    write_result(args.out.with_suffix(".md"), markdown(results))
    return 0


def say(message: str) -> None:
    print(f"[real-sizes] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
