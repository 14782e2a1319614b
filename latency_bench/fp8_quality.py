"""A quantized precision against its full-precision baseline on held-out code
(pip's sources), for the default target and drafter: top-1 agreement, bits
per byte, drafter acceptance, first-line exact match. By default FP8 against
bf16; on CPU the FP8 path is the emulation (same numerics as the GPU kernels:
per-channel weight scales, per-token activation scales).

    python -m latency_bench fp8-quality --out bench-results/fp8_quality.json
    python -m latency_bench fp8-quality --baseline fp32 --quantized int8   # the CPU precisions
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch import nn

from completer.evaluate import (bits_per_byte, draft_acceptance, exact_match, heldout_files,
                                line_starts)
from completer.fp8 import LINEAR_NAMES, quantize_linears, quantize_rows
from completer.loading import LoadedModel, load, load_models
from latency_bench.harness import model_arguments
from latency_bench.run_results import write_result


@torch.inference_mode()
def top1_agreement(a: LoadedModel, b: LoadedModel, files, chunks: int, length: int, seed: int) -> float:
    """Share of positions where both models' most likely next token agree."""
    rng = random.Random(seed)
    same = total = 0
    for _ in range(chunks):
        f = rng.choices(files, weights=[len(x.text) for x in files])[0]
        start = f.text.rfind("\n", 0, rng.randrange(len(f.text))) + 1
        ids = torch.tensor([a.tokenizer.encode(f.text[start: start + length * 6])[:length]])
        same += int((a.model(ids).argmax(-1) == b.model(ids).argmax(-1)).sum())
        total += ids.numel()
    return same / total


def with_fp8(loaded: LoadedModel, name: str) -> LoadedModel:
    quantize_linears(loaded.model, (name,))
    return loaded


def dequantized(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 round trip the FP8 path applies (per-row scales), in fp32."""
    q, s = quantize_rows(x)
    return q.float() * s[..., None]


def mantissa_rounded(bits: int):
    """Round fp32 to `bits` mantissa bits, nearest even, with fp32's range: a
    float format like e4m3 (bits = 3) but without its range limits."""
    drop = 23 - bits

    def round_(x: torch.Tensor) -> torch.Tensor:
        b = x.float().contiguous().view(torch.int32)
        b = (b + (1 << (drop - 1)) - 1 + ((b >> drop) & 1)) & ~((1 << drop) - 1)
        return b.view(torch.float32)
    return round_


class WhatIfLinear(nn.Module):
    """A projection that rounds its input and its weight each its own way, then
    multiplies in fp32: to see which operand, and how many bits, the model's
    decisions are sensitive to."""

    def __init__(self, linear: nn.Linear, round_input, round_weight):
        super().__init__()
        self.round_input = round_input
        self.weight = round_weight(linear.weight.detach().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.round_input(x.float()) @ self.weight.T).to(x.dtype)


def what_if(directory: Path, round_input, round_weight) -> LoadedModel:
    loaded = load(directory, "bf16", fuse=False)  # HF's seven projections, each rounded its own way
    for module in list(loaded.model.modules()):
        for name in LINEAR_NAMES:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, WhatIfLinear(child, round_input, round_weight))
    return loaded


WHAT_IF = {  # name -> (input rounding, weight rounding)
    "weights only in e4m3": (lambda x: x, dequantized),
    "activations only in e4m3": (dequantized, lambda w: w),
    **{f"{bits}-bit mantissa, both": (mantissa_rounded(bits),) * 2 for bits in (3, 4, 5)},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(p)
    p.add_argument("--lines", type=int, default=200)
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--accept-prompts", type=int, default=50)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--by-projection", action="store_true",
                   help="also: the target's agreement with only one projection type in FP8")
    p.add_argument("--what-if", action="store_true",
                   help="also: the target's agreement with only weights or only activations in e4m3, "
                        "and with 3, 4 and 5 mantissa bits in both")
    p.add_argument("--baseline", default="bf16", help="the precision compared against")
    p.add_argument("--quantized", default="fp8", help="fp8, or on CPU int8 / int4")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    base, quant = args.baseline, args.quantized

    _, files = heldout_files()
    picks = line_starts(files, args.lines, args.seed)
    report: dict = {}
    models = {}
    for precision in (base, quant):
        target, draft = load_models(args.target, args.draft, precision)
        models[precision] = (target, draft)
        report |= {"target": target.name, "draft": draft.name if draft else None}
        report[precision] = {
            "target_bits_per_byte": bits_per_byte(target, files, args.chunks, args.context_tokens, args.seed),
            "exact_match": exact_match(target, picks, args.context_tokens),
        }
        if draft is not None:
            report[precision] |= {
                "draft_bits_per_byte": bits_per_byte(draft, files, args.chunks, args.context_tokens, args.seed),
                "draft_acceptance": draft_acceptance(target, draft, picks[: args.accept_prompts],
                                                     args.context_tokens, 4)[0]}
    args.target = models[base][0].directory  # the resolved path, for the loads below
    for i, name in enumerate(("target", "draft")[: 2 if models[base][1] else 1]):
        report[f"{name}_top1_agreement"] = top1_agreement(models[base][i], models[quant][i], files,
                                                          args.chunks, args.context_tokens, args.seed)
    # The metric's floor on these models: one bf16 rounding alone (fp32 vs bf16).
    fp32 = models["fp32"][0] if "fp32" in models else load(args.target, "fp32")
    bf16 = models["bf16"][0] if "bf16" in models else load(args.target, "bf16")
    report["target_top1_agreement_fp32_vs_bf16"] = top1_agreement(
        fp32, bf16, files, args.chunks, args.context_tokens, args.seed)
    if args.by_projection:  # where the disagreement comes from
        report["target_top1_agreement_one_projection"] = {
            name: top1_agreement(models[base][0], with_fp8(load(args.target, "bf16", fuse=False), name), files,
                                 args.chunks, args.context_tokens, args.seed) for name in LINEAR_NAMES}
    if args.what_if:  # which operand, and how many mantissa bits the bar would take
        report["target_top1_agreement_what_if"] = {
            name: top1_agreement(models[base][0], what_if(args.target, *rounding), files,
                                 args.chunks, args.context_tokens, args.seed)
            for name, rounding in WHAT_IF.items()}
    b, f = report[base], report[quant]
    print(f"{'':24}{base:>10}{quant:>10}")
    for key in ("target_bits_per_byte", "draft_bits_per_byte"):
        if key in b:
            print(f"{key:24}{b[key]:>10.3f}{f[key]:>10.3f}")
    for key in ("exact_match", "draft_acceptance"):
        if key in b:
            print(f"{key:24}{b[key]:>10.1%}{f[key]:>10.1%}")
    drafter = f", draft {report['draft_top1_agreement']:.2%}" if report["draft"] else ""
    print(f"top-1 agreement {quant} vs {base}: target {report['target_top1_agreement']:.2%}{drafter} "
          f"(for scale, bf16 vs fp32 on the target: {report['target_top1_agreement_fp32_vs_bf16']:.2%})")
    for name, agreement in report.get("target_top1_agreement_one_projection", {}).items():
        print(f"top-1 agreement with only {name} in FP8: {agreement:.2%}")
    for name, agreement in report.get("target_top1_agreement_what_if", {}).items():
        print(f"top-1 agreement, {name}: {agreement:.2%}")
    print(f"exact-match change: {(f['exact_match'] - b['exact_match']) * 100:+.1f} points")
    if args.out:
        write_result(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
