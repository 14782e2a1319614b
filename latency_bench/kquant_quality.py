"""K-quants and Q8_0 on completer's CPU fast paths: what repacking a GGUF's
matrices into int4 / int8 loses against the file's own dequantized weights
(what llama.cpp computes with). docs/models.md's "K-quants and Q8_0".

    python -m latency_bench kquant-quality prepare [--jobs 2]
    python -m latency_bench kquant-quality measure [--sources smollm2 wide] [--types Q4_K_M Q5_K_M Q6_K Q8_0]
                                                   [--out docs/results/kquant_quality.json]
    python -m latency_bench kquant-quality speed [--sources ...] [--types ...] [--out docs/results/kquant_speed.json]
    python -m latency_bench kquant-quality report [QUALITY_JSON [SPEED_JSON]]   # docs/models.md's tables

`prepare` builds llama.cpp's `llama-quantize` (in llama-peer's build tree,
`latency_bench/llama_peer.py`: configured and built there first if missing)
and writes, under ~/.cache/completer/kquant/, each source as F32 and
quantized by llama-quantize to each type:
- `smollm2`: the default model's weights (its Q4_1 file, dequantized). Its
  inputs 576 wide are no multiple of 256, which K-quants need: llama.cpp falls
  back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0) for all but ffn_down. What
  a user quantizing our default model gets.
- `wide`: the same model widened to 768 with zeros (heads 9 -> 12, K/V heads
  3 -> 4, norm weights and epsilon rescaled: the same function), so that
  every matrix takes the K-quant, its Q4_1 weights first moved off Q4_1's
  grid (each plus uniform noise of one step, seeded): weights on a 4-bit grid
  would flatter requantizing to int4.

`measure`, per file and per precision (`auto` as resolved here, and the
alternative: int4 for a file that auto serves as int8 or int4+int8):
- per stored type, the served weights against the file's
  (||W_ours - W_file|| / ||W_file||, max |W_ours - W_file|), each fused
  projection's rows by the part they come from; for int4 also as the fused
  layer holds them (fp16 scale and minimum);
- logits of the served weights (fp32 math: the repacking alone) and of the
  served math (8-bit activations per block of 32, the fused layer's and
  llama.cpp's, fp16 int4 scales; on the first `--served-sequences` runs: its
  torch reference is slow) against the file's weights in fp32: max |diff|,
  top-1 agreement, mean KL(file || ours), next-token NLL, on real code
  (pip's sources, as `completer evaluate`);
`speed`: batch-1 decode tok/s through the engine (fused layer, defaults, no
speculation) at the same precisions, one file after the other.
The default model's own file (Q4_1, int4) comes first in both, as the baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from completer.model_store import cache_dir, pull
from latency_bench import llama_peer

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
SOURCES = ("smollm2", "wide")
ROOT = Path(__file__).resolve().parents[1]


def folder() -> Path:
    return cache_dir() / "kquant"


def quantize_binary(version: str = llama_peer.DEFAULT_VERSION) -> Path:
    return llama_peer.build_root(version) / "build" / "bin" / "llama-quantize"


def build_quantize(jobs: int = 2, version: str = llama_peer.DEFAULT_VERSION) -> Path:
    """llama-quantize in llama-peer's build tree (configured by building llama-server first)."""
    binary = quantize_binary(version)
    if not binary.is_file():
        llama_peer.build(version, jobs)
        build = llama_peer.build_root(version) / "build"
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(jobs)], check=True)
    return binary


# ---------------------------------------------------------------- sources

def write_source(name: str, out: Path, seed: int = 0, dither: bool = True) -> Path:
    """The default model's weights as an F32 GGUF: as they are (`smollm2`), or
    widened to multiples of 256 and (`dither`) moved off the Q4_1 grid (`wide`)."""
    import gguf

    from completer.gguf_checkpoint import GgufFile

    source = GgufFile(pull())
    reader = source.reader
    arch = reader.fields["general.architecture"].contents()
    hidden = source.require(f"{arch}.embedding_length")
    heads = source.require(f"{arch}.attention.head_count")
    kv = source.require(f"{arch}.attention.head_count_kv")
    hd = hidden // heads
    wide = name == "wide"
    new_hidden = -(-hidden // 256) * 256 if wide else hidden
    new_heads = new_hidden // hd
    if new_hidden % hd or new_heads % (heads // kv):
        raise SystemExit(f"cannot widen {hidden} ({heads} heads of {hd}, {kv} K/V heads) to {new_hidden}")
    new_kv = new_heads // (heads // kv)
    norm = float(np.sqrt(hidden / new_hidden))  # RMS over the zero-padded width: rescaled back
    overrides = {f"{arch}.embedding_length": new_hidden, f"{arch}.attention.head_count": new_heads,
                 f"{arch}.attention.head_count_kv": new_kv,
                 f"{arch}.attention.layer_norm_rms_epsilon": source.require(f"{arch}.attention.layer_norm_rms_epsilon")
                 * hidden / new_hidden}
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(tmp, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "general.file_type":
            writer.add_file_type(gguf.LlamaFileType.ALL_F32)
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = overrides.get(key, field.contents()) if wide else field.contents()
        writer.add_key_value(key, value, field.types[0], sub)
    for t in reader.tensors:
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        groups = source.int4_groups(t.name)
        if wide and dither and groups is not None:  # off the grid: plus U(-step/2, step/2) of its group's step
            step = np.repeat(groups[1].numpy(), 32, axis=-1).reshape(w.shape)
            w = w + (rng.random(w.shape, dtype=np.float32) - 0.5) * step
        if wide:
            w = widen(t.name.split(".")[-2], w, hidden, new_hidden, heads, kv, new_heads, new_kv, hd, norm)
        writer.add_tensor(t.name, np.ascontiguousarray(w), raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def widen(kind: str, w: np.ndarray, hidden: int, new_hidden: int, heads: int, kv: int, new_heads: int,
          new_kv: int, hd: int, norm: float) -> np.ndarray:
    """One tensor (numpy's order: rows, then columns) of the widened model:
    inputs and outputs of the residual width padded with zeros, new heads all
    zero (attention over zero keys and values adds nothing), norm weights
    times sqrt(old / new width). Q/K rows stay per head as llama.cpp stores them."""
    def pad(a, rows=None, cols=None):
        out = np.zeros((rows or a.shape[0], cols or a.shape[-1]) if a.ndim == 2 else (cols,), np.float32)
        out[tuple(slice(0, s) for s in a.shape)] = a
        return out

    if w.ndim == 1:  # attn_norm, ffn_norm, output_norm
        return pad(w * norm, cols=new_hidden)
    if kind in ("token_embd", "output", "ffn_gate", "ffn_up"):
        return pad(w, cols=new_hidden)
    if kind == "attn_q":
        return pad(w, rows=new_heads * hd, cols=new_hidden)
    if kind in ("attn_k", "attn_v"):
        return pad(w, rows=new_kv * hd, cols=new_hidden)
    if kind == "attn_output":
        return pad(w, rows=new_hidden, cols=new_heads * hd)
    if kind == "ffn_down":
        return pad(w, rows=new_hidden)
    raise SystemExit(f"widen: unexpected tensor kind {kind!r}")


def quantized_path(source: str, kind: str) -> Path:
    return folder() / f"{source}.{kind}.gguf"


def prepare(sources: list[str], types: list[str], jobs: int) -> None:
    binary = build_quantize(jobs)
    folder().mkdir(parents=True, exist_ok=True)
    for source in sources:
        f32 = folder() / f"{source}.F32.gguf"
        if not f32.is_file():
            write_source(source, f32)
            print(f"wrote {f32}", flush=True)
        for kind in types:
            out = quantized_path(source, kind)
            if out.is_file() and out.stat().st_mtime > f32.stat().st_mtime:
                continue
            log = out.with_suffix(".log")
            with log.open("w") as f:
                subprocess.run([str(binary), str(f32), str(out), kind, "2"], stdout=f, stderr=subprocess.STDOUT,
                               check=True)
            print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB)", flush=True)


# ---------------------------------------------------------------- weights

def part_rows(cfg) -> dict[str, list[tuple[str, int]]]:
    """Each fused projection's parts and their rows, in fuse_projections' order."""
    hd = cfg.head_dim
    return {"qkv_proj": [("q_proj", cfg.num_attention_heads * hd), ("k_proj", cfg.num_key_value_heads * hd),
                         ("v_proj", cfg.num_key_value_heads * hd)],
            "gate_up_proj": [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]}


GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def served_weight(linear, fp16_scales: bool = False):
    """The weights a quantized linear multiplies by (fp32 [N, K]); `fp16_scales`:
    an int4 one's as the fused layer holds them (scale and minimum as fp16)."""
    import torch

    from completer.cpu_quant import Int4Linear, Int8Linear

    if isinstance(linear, Int4Linear):
        q, scale, low = linear.groups()
        if fp16_scales:
            scale, low = scale.half().float(), low.half().float()
        N = q.shape[0]
        return (q.float().view(N, -1, linear.group) * scale[..., None] + low[..., None]).view(N, -1)
    if isinstance(linear, Int8Linear):
        q, scale = linear.int8_weight()
        return q.float() * scale[:, None]
    if isinstance(linear, torch.nn.Linear):
        return linear.weight.detach().float()
    raise TypeError(type(linear).__name__)


def weight_errors(gguf, reference, served) -> dict[str, dict]:
    """Per stored type and what its rows are served as ("Q4_K as int4"):
    relative Frobenius error and max abs error of the served weights against
    the file's, also with int4 scales as the fused layer holds them (fp16)."""
    from completer.cpu_quant import Int4Linear

    sums: dict[str, dict] = {}
    parts = part_rows(reference.config)
    for i, (ref_layer, layer) in enumerate(zip(reference.model.layers, served.model.layers)):
        for owner, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            ref_w = getattr(getattr(ref_layer, owner), name).weight.detach().float()
            linear = getattr(getattr(layer, owner), name)
            ours = served_weight(linear)
            fused16 = served_weight(linear, fp16_scales=True) if isinstance(linear, Int4Linear) else ours
            start = 0
            for part, rows in parts.get(name, [(name, ref_w.shape[0])]):
                kind = gguf.tensor_type(f"blk.{i}.{GGUF_NAMES[part]}.weight")
                a, b, c = ref_w[start:start + rows], ours[start:start + rows], fused16[start:start + rows]
                start += rows
                as_ = "int4" if isinstance(linear, Int4Linear) else "int8"
                s = sums.setdefault(f"{kind} as {as_}", {"stored": kind, "served_as": as_, "ref2": 0.0, "err2": 0.0,
                                                         "max": 0.0, "fused_err2": 0.0, "fused_max": 0.0,
                                                         "matrices": 0})
                s["ref2"] += float((a.double() ** 2).sum())
                s["err2"] += float(((b - a).double() ** 2).sum())
                s["max"] = max(s["max"], float((b - a).abs().max()))
                s["fused_err2"] += float(((c - a).double() ** 2).sum())
                s["fused_max"] = max(s["fused_max"], float((c - a).abs().max()))
                s["matrices"] += 1
    head = {"ref2": float((reference.lm_head.weight.detach().double() ** 2).sum())}
    diff = served_weight(served.lm_head) - reference.lm_head.weight.detach().float()
    head |= {"err2": float((diff.double() ** 2).sum()), "max": float(diff.abs().max())}
    out = {key: {"stored": s["stored"], "served_as": s["served_as"], "matrices": s["matrices"],
                  "rel": (s["err2"] / s["ref2"]) ** 0.5, "max_abs": s["max"],
                  "fused_rel": (s["fused_err2"] / s["ref2"]) ** 0.5, "fused_max_abs": s["fused_max"]}
           for key, s in sums.items()}
    out["lm_head"] = {"served_as": "int8", "matrices": 1, "rel": (head["err2"] / head["ref2"]) ** 0.5,
                      "max_abs": head["max"], "stored": gguf.tensor_type("output.weight" if "output.weight"
                                                                         in gguf.tensors else "token_embd.weight")}
    return out


def requantized_errors(gguf) -> dict[str, dict]:
    """Per stored type, the alternatives on the file's dequantized layer
    weights: int8 (7 bits, a scale per row) and int4 (min/max groups of 32)."""
    from completer.cpu_quant import int4_groups

    acc: dict[str, list[float]] = {}
    for name in gguf.tensors:
        if not name.startswith("blk.") or len(gguf.tensors[name].shape) != 2:
            continue
        w = gguf.tensor(name)
        scale = w.abs().amax(1, keepdim=True).clamp(min=1e-8) / 63
        int8 = (w / scale).round().clamp(-63, 63) * scale
        q, s, low = int4_groups(w)
        int4 = (q.float().view(w.shape[0], -1, 32) * s[..., None] + low[..., None]).view(w.shape)
        a = acc.setdefault(gguf.tensor_type(name), [0.0, 0.0, 0.0, 0.0, 0.0])
        a[0] += float((w.double() ** 2).sum())
        a[1] += float(((int8 - w).double() ** 2).sum())
        a[2] += float(((int4 - w).double() ** 2).sum())
        a[3] = max(a[3], float((int8 - w).abs().max()))
        a[4] = max(a[4], float((int4 - w).abs().max()))
    return {kind: {"int8_rel": (a[1] / a[0]) ** 0.5, "int8_max_abs": a[3],
                   "int4_rel": (a[2] / a[0]) ** 0.5, "int4_max_abs": a[4]} for kind, a in acc.items()}


# ---------------------------------------------------------------- logits

def code_tokens(tokenizer, sequences: int, length: int):
    """`sequences` disjoint runs of `length` tokens of pip's sources (held-out code)."""
    import torch

    from completer.evaluate import heldout_files

    files = heldout_files()[1]
    text = "".join(f.text for f in files)[: sequences * length * 8]
    ids = tokenizer.encode(text)[: sequences * length]
    if len(ids) < sequences * length:
        raise SystemExit("not enough held-out code")
    return torch.tensor(ids).view(sequences, length)


def dequantized_model(model):
    """A copy whose quantized linears are nn.Linear of the weights they serve (fp32 math)."""
    import copy

    import torch

    from completer.cpu_quant import Int4Linear, Int8Linear

    out = copy.deepcopy(model)
    for module in list(out.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (Int4Linear, Int8Linear)):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                linear.weight.data = served_weight(child)
                if child.bias is not None:
                    linear.bias.data = child.bias.float()
                setattr(module, name, linear)
    return out


def compare_logits(reference_logits, logits, tokens) -> dict:
    import torch.nn.functional as F

    ref = reference_logits.float().flatten(0, 1)
    ours = logits.float().flatten(0, 1)
    logp_ref, logp = F.log_softmax(ref, -1), F.log_softmax(ours, -1)
    target = tokens[:, 1:].flatten()
    keep = (tokens.new_ones(tokens.shape, dtype=bool).clone())
    keep[:, -1] = False
    keep = keep.flatten()
    return {"max_abs_diff": float((ours - ref).abs().max()),
            "top1_agreement": float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
            "kl": float((logp_ref.exp() * (logp_ref - logp)).sum(-1).mean()),
            "nll_file": float(-logp_ref[keep].gather(-1, target[:, None]).mean()),
            "nll_ours": float(-logp[keep].gather(-1, target[:, None]).mean())}


def forward(model, tokens):
    import torch

    with torch.no_grad():
        return torch.cat([model(tokens[i:i + 1]) for i in range(tokens.shape[0])])


def as_fused_layer(model) -> None:
    """The fused CPU layer's math in torch, in place: 8-bit activations per
    block of 32 (`q8_activations`, the kernels' reference) and int4 scales and
    minimums rounded to fp16, as the layer packs them."""
    from completer.cpu_quant import Int4Linear, Int8Linear

    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.scale.copy_(m.scale.half().float())
            m.low.copy_(m.low.half().float())
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.q8_activations = True


# ---------------------------------------------------------------- speed

def decode_speed(path: Path, precision: str, tokens: list[list[int]], max_tokens: int) -> dict:
    """Batch-1 decode tok/s through the engine (defaults: fused layer, 8-bit
    activations), median of the prompts after a warm-up."""
    from completer.config import EngineConfig, SpecConfig
    from completer.engine.core import EngineCore
    from completer.engine.engine import Engine, run_in_passing_thread
    from completer.loading import load
    from latency_bench.cpu_decode_bench import ask, completer_sample
    from latency_bench.engine_bench import median

    target = run_in_passing_thread(lambda: load(path, precision))
    config = EngineConfig(prefix_cache=False, kv_cache_mb=256, max_running=2, threads=2, decode_threads=2)
    engine = Engine(EngineCore.build(target.model, None, target.tokenizer, [], config,
                                     SpecConfig(draft_model=False, ngram=False)))

    async def run() -> list[float]:
        engine.start()
        try:
            rates = []
            for i, ids in enumerate(tokens):
                t = await ask(engine, f"s{i}", ids, max_tokens)
                if i:
                    rates.append(completer_sample(ids, t).decode_tok_s)
            return rates
        finally:
            engine.stop()

    rates = asyncio.run(run())
    return {"precision": target.describe_precision(), "decode_tok_s": median(rates), "reps": rates}


# ---------------------------------------------------------------- the run

def measure(args) -> dict:
    import torch

    from completer.checkpoint import load_model, resolve_precision
    from completer.cpu_quant import MIXED, int8_fused_here
    from completer.gguf_checkpoint import GgufFile

    torch.set_num_threads(args.threads)
    results = {"machine": {"int8_fused": int8_fused_here(), "threads": args.threads},
               "command": " ".join(sys.argv), "files": []}
    tokens = None
    files = [("default", "Q4_1", pull())] + [(s, t, quantized_path(s, t)) for s in args.sources for t in args.types]
    for source, kind, path in files:
        if not path.is_file():
            raise SystemExit(f"{path} missing: run `python -m latency_bench kquant-quality prepare`")
        gguf = GgufFile(path)
        auto = resolve_precision("auto", "cpu", path)
        precisions = [auto] + (["int4"] if auto in ("int8", MIXED) else [])
        reference = load_model(path, "fp32", fuse=True)
        if tokens is None:
            tokens = code_tokens(gguf.tokenizer(), args.sequences, args.length)
        ref_logits = forward(reference, tokens)
        entry = {"file": path.name, "source": source, "type": kind, "auto": auto,
                 "stored": gguf.layer_weights_types(), "size_mib": path.stat().st_size / 2**20,
                 "requantized": requantized_errors(gguf), "served": {}}
        for precision in precisions:
            started = time.perf_counter()
            served = load_model(path, precision, fuse=True)
            load_s = time.perf_counter() - started
            row = {"load_s": load_s, "weights": weight_errors(gguf, reference, served),
                   "logits_weights": compare_logits(ref_logits, forward(dequantized_model(served), tokens), tokens)}
            if precision == auto:  # (torch's reference of the fused layer is slow: auto's, on the first runs only)
                as_fused_layer(served)
                few = slice(0, args.served_sequences)
                row["logits_served"] = compare_logits(ref_logits[few], forward(served, tokens[few]), tokens[few])
            entry["served"][precision] = row
            say(f"{path.name} {precision}: top-1 {row['logits_weights']['top1_agreement']:.4f} (weights), "
                f"{row.get('logits_served', {}).get('top1_agreement', float('nan')):.4f} (8-bit activations)")
            del served
        results["files"].append(entry)
    return results


def speed(args) -> dict:
    from completer.checkpoint import resolve_precision
    from completer.cpu_quant import MIXED, int8_fused_here
    from completer.gguf_checkpoint import GgufFile

    results = {"machine": {"int8_fused": int8_fused_here(), "threads": 2}, "command": " ".join(sys.argv),
               "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, "files": []}
    files = [("default", "Q4_1", pull())] + [(s, t, quantized_path(s, t)) for s in args.sources for t in args.types]
    tokens = code_tokens(GgufFile(files[0][2]).tokenizer(), args.prompts + 1, args.prompt_tokens)
    ids = [t.tolist() for t in tokens]
    for source, kind, path in files:
        auto = resolve_precision("auto", "cpu", path)
        for precision in [auto] + (["int4"] if auto in ("int8", MIXED) else []):
            row = {"file": path.name, "source": source, "type": kind, "auto": auto,
                   **decode_speed(path, precision, ids, args.decode_tokens)}
            say(f"{path.name} {precision}: decode {row['decode_tok_s']:.1f} tok/s")
            results["files"].append(row)
    return results


def report(quality: dict, speed_rows: dict | None) -> str:
    """docs/models.md's tables from the saved runs: per file and precision;
    per source and stored type, at auto, with the alternatives beside."""
    def stored(types: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))

    rates = {(r["file"], r["precision"]): r["decode_tok_s"] for r in (speed_rows or {}).get("files", [])}
    out = ["| file | layers' matrices stored as | served as | MiB | top-1 agreement | KL (nats) | max abs logit diff | "
           "NLL file / ours | top-1 agreement, as served | decode tok/s |", "|---" * 10 + "|"]
    for f in quality["files"]:
        for precision, row in f["served"].items():
            w, v = row["logits_weights"], row.get("logits_served")
            rate = rates.get((f["file"], precision))
            served = "" if v is None else f"{100 * v['top1_agreement']:.1f}%"
            out.append(f"| {f['file']} | {stored(f['stored'])} | {precision}{' (auto)' if precision == f['auto'] else ''}"
                       f" | {f['size_mib']:.0f} | {100 * w['top1_agreement']:.1f}% | {w['kl']:.4f} | "
                       f"{w['max_abs_diff']:.2f} | {w['nll_file']:.3f} / {w['nll_ours']:.3f} | "
                       f"{served} | "
                       f"{'' if rate is None else f'{rate:.1f}'} |")
    out += ["", "| source | stored type | at auto served as | matrices | rel. error | max abs error | "
            "rel. error in the fused layer (fp16 scales) | requantized to int8: rel. / max | "
            "requantized to int4: rel. / max |", "|---" * 9 + "|"]
    best: dict[tuple, tuple] = {}  # (source, stored, served as) -> (matrices, error row, requantized)
    for f in quality["files"]:
        for name, e in f["served"][f["auto"]]["weights"].items():
            head = name == "lm_head"
            key = (f["source"], f"{e['stored']}, output head" if head else e["stored"], e["served_as"])
            if key not in best or e["matrices"] > best[key][0]:
                best[key] = (e["matrices"], e, {} if head else f["requantized"].get(e["stored"], {}))
    for (source, kind, as_), (n, e, r) in best.items():
        alt = (f"{r['int8_rel']:.4f} / {r['int8_max_abs']:.4f} | {r['int4_rel']:.4f} / {r['int4_max_abs']:.4f}"
               if r else " | ")
        fused = f"{e['fused_rel']:.4f}" if "fused_rel" in e else ""
        out.append(f"| {source} | {kind} | {as_} | {n} | {e['rel']:.4f} | {e['max_abs']:.4f} | {fused} | {alt} |")
    return "\n".join(out)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build llama-quantize, write the sources and their quantized files")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--types", nargs="+", default=list(TYPES), help="llama-quantize's type names")
    p.add_argument("--jobs", type=int, default=2)
    m = sub.add_parser("measure", help="the repacking loss and (--speed) decode speed per file")
    m.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    m.add_argument("--types", nargs="+", default=list(TYPES))
    m.add_argument("--sequences", type=int, default=8, help="runs of held-out code for the logits")
    m.add_argument("--length", type=int, default=256, help="tokens a run")
    m.add_argument("--served-sequences", type=int, default=2,
                   help="of those, runs for the logits with the fused layer's math (slow in torch)")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "kquant_quality.json")
    v = sub.add_parser("speed", help="batch-1 decode tok/s per file through the engine")
    v.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    v.add_argument("--types", nargs="+", default=list(TYPES))
    v.add_argument("--prompts", type=int, default=3, help="measured (after one warm-up)")
    v.add_argument("--prompt-tokens", type=int, default=256)
    v.add_argument("--decode-tokens", type=int, default=64)
    v.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "kquant_speed.json")
    r = sub.add_parser("report", help="the tables of docs/models.md from saved runs")
    r.add_argument("quality", type=Path, nargs="?", default=ROOT / "docs" / "results" / "kquant_quality.json")
    r.add_argument("speed", type=Path, nargs="?", default=ROOT / "docs" / "results" / "kquant_speed.json")
    args = parser.parse_args(argv)
    if args.command == "report":
        print(report(json.loads(args.quality.read_text()),
                     json.loads(args.speed.read_text()) if args.speed.is_file() else None))
        return 0
    if args.command == "prepare":
        prepare(args.sources, args.types, args.jobs)
        return 0
    results = measure(args) if args.command == "measure" else speed(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
