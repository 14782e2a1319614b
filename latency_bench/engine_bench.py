"""Engine benchmark: our engine against HF transformers on the same weights and
the same held-out prompts (pip's sources, not the stdlib the models saw),
everything measured side by side in one run. Prints a table; writes JSON.

    python latency_bench/engine_bench.py --out bench-results/engine.json

Ratios are what count here (the machine is shared and noisy); absolute times
mean something only on a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

from completer.document import DocumentPrompt
from completer.engine.config import EngineConfig, SpecConfig
from completer.engine.core import Request
from completer.engine.engine import Engine
from completer.engine.sequence import SamplingParams
from completer.evaluate import heldout_files, line_starts
from completer.loading import DEFAULT_DRAFT, DEFAULT_TARGET, LoadedModel, load


class Case(msgspec.Struct, frozen=True):
    prefix: str
    suffix: str
    path: str
    cursor_line: str


def cases(n: int, seed: int) -> list[Case]:
    _, files = heldout_files()
    out = []
    for f, cursor, end in line_starts(files, n, seed):
        prefix = f.text[:cursor]
        out.append(Case(prefix, f.text[end:], f.path, prefix[prefix.rfind("\n") + 1:]))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- HF transformers ------------------------------------------------------------

def hf_runner(target_dir: Path, draft_dir: Path):
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()

    class EndOfLine(StoppingCriteria):
        def __init__(self, tokenizer, start: int):
            self.tokenizer, self.start = tokenizer, start

        def __call__(self, input_ids, scores, **kwargs):
            text = self.tokenizer.decode(input_ids[0, self.start:].tolist())
            return torch.tensor([bool(text.strip()) and "\n" in text.lstrip()])

    def run(prompt: list[int], tokenizer, max_new: int, line: bool, variant: str, eos: list[int]):
        ids = torch.tensor([prompt])
        kwargs = dict(max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        if line:
            kwargs["stopping_criteria"] = StoppingCriteriaList([EndOfLine(tokenizer, len(prompt))])
        if variant == "assisted":
            kwargs["assistant_model"] = assistant
        elif variant == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = 4
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, **kwargs)
        return time.perf_counter() - started, out.shape[1] - len(prompt)

    return run


# -- our engine ----------------------------------------------------------------

class EngineRun(msgspec.Struct):
    seconds: float
    ttft_ms: float
    generated: int
    proposed: int
    accepted: int


async def engine_requests(engine: Engine, prompts: list[tuple[list[int], Case]], params: SamplingParams,
                          concurrent: bool, tag: str) -> list[EngineRun]:
    async def one(i: int, prompt: list[int], case: Case) -> EngineRun:
        started = time.perf_counter()
        stream = engine.submit(Request(f"{tag}-{i}", prompt, params, case.cursor_line, case.suffix))
        done = await stream.finished()
        t = done.timings
        return EngineRun(time.perf_counter() - started, t.ttft_ms, t.generated_tokens,
                         t.draft_proposed, t.draft_accepted)

    if concurrent:
        return list(await asyncio.gather(*(one(i, p, c) for i, (p, c) in enumerate(prompts))))
    return [await one(i, p, c) for i, (p, c) in enumerate(prompts)]


def engine_for(target: LoadedModel, draft: LoadedModel, draft_on: bool, ngram: bool,
               prefix_cache: bool = True) -> Engine:
    spec = SpecConfig(draft_model=draft_on, ngram=ngram, max_batch=64)
    config = EngineConfig(prefix_cache=prefix_cache, kv_cache_mb=512, max_running=64,
                          prefill_chunk=16384, deadline_ms=600_000)
    return Engine.build(target, draft if draft_on else None, config, spec)


async def main_async(args) -> dict:
    target, draft = load(args.target), load(args.draft)
    torch.set_num_threads(args.threads)
    builder = target.prompt_builder(args.context - 64)
    eos = builder.stop_ids
    picked = cases(args.prompts, args.seed)
    prompts = [(builder.build(c.prefix, c.suffix, c.path).tokens, c) for c in picked]
    results: dict = {"prompts": len(prompts), "context_tokens": args.context}
    rows: list[tuple[str, str, str]] = []

    # 1. Line / block completions at batch 1: HF generate variants vs our engine.
    hf = hf_runner(args.target, args.draft)
    for mode, max_new in (("line", 48), ("block", 96)):
        line = mode == "line"
        for variant in ("plain", "assisted", "prompt_lookup"):
            times, tokens = [], 0
            for prompt, _ in prompts:
                seconds, n = hf(prompt, target.tokenizer, max_new, line, variant, eos)
                times.append(seconds)
                tokens += n
            results[f"hf_{variant}_{mode}"] = {"median_ms": median(times) * 1000, "tokens": tokens}
        for name, draft_on, ngram in (("engine_nospec", False, False), ("engine_draft", True, False),
                                      ("engine_draft_ngram", True, True)):
            engine = engine_for(target, draft, draft_on, ngram, prefix_cache=False)
            engine.start()
            params = SamplingParams(max_tokens=max_new, mode=mode)
            runs = await engine_requests(engine, prompts, params, False, f"{name}-{mode}")
            engine.stop()
            proposed = sum(r.proposed for r in runs)
            results[f"{name}_{mode}"] = {
                "median_ms": median([r.seconds for r in runs]) * 1000,
                "tokens": sum(r.generated for r in runs),
                "acceptance": sum(r.accepted for r in runs) / proposed if proposed else None}
        base = results[f"hf_plain_{mode}"]["median_ms"]
        for key in [k for k in results if k.endswith(f"_{mode}") and isinstance(results[k], dict)]:
            r = results[key]
            rows.append((f"{mode}: {key.removesuffix('_' + mode)}", f"{r['median_ms']:.1f} ms",
                         f"{base / r['median_ms']:.2f}x vs HF generate"))

    # 2. Decode tok/s at batch 1, 4, 16, 32: speculation off / on (free mode).
    for batch in args.batches:
        for name, draft_on, ngram in (("nospec", False, False), ("spec", True, True)):
            engine = engine_for(target, draft, draft_on, ngram, prefix_cache=False)
            engine.start()
            chosen = (prompts * (batch // len(prompts) + 1))[:batch]
            params = SamplingParams(max_tokens=64, mode="free")
            started = time.perf_counter()
            runs = await engine_requests(engine, chosen, params, True, f"tp{batch}{name}")
            wall = time.perf_counter() - started
            engine.stop()
            decode_s = max(wall - median([r.ttft_ms for r in runs]) / 1000, 1e-9)
            proposed = sum(r.proposed for r in runs)
            results[f"decode_b{batch}_{name}"] = {
                "tok_per_s": sum(r.generated for r in runs) / decode_s,
                "acceptance": sum(r.accepted for r in runs) / proposed if proposed else None}
        on, off = results[f"decode_b{batch}_spec"], results[f"decode_b{batch}_nospec"]
        rows.append((f"decode tok/s, batch {batch}", f"{off['tok_per_s']:.0f} -> {on['tok_per_s']:.0f}",
                     f"{on['tok_per_s'] / off['tok_per_s']:.2f}x with speculation"
                     + (f" (acceptance {on['acceptance']:.0%})" if on["acceptance"] is not None else "")))

    # 3. Warm keystroke vs cold prefill at 512 / 2k / 8k-token prompts.
    text = "".join(f.text for f in heldout_files()[1])
    for size in args.ttft_sizes:
        doc = DocumentPrompt(target.prompt_builder(size))
        cut = len(text) // 2
        cut = text.rfind("\n", 0, cut) + 1
        engine = engine_for(target, draft, False, False)
        engine.start()
        one = SamplingParams(max_tokens=1, mode="free")
        cold, warm = [], []
        for rep in range(args.repeats):
            prefix = text[: cut + 40 * rep]
            base = doc.update(prefix, text[cut + 40 * rep:], "big.py").tokens
            r = (await engine_requests(engine, [(base, picked[0])], one, False, f"cold{size}-{rep}"))[0]
            cold.append(r.seconds)
            typed = doc.update(prefix + "x", text[cut + 40 * rep:], "big.py").tokens
            r = (await engine_requests(engine, [(typed, picked[0])], one, False, f"warm{size}-{rep}"))[0]
            warm.append(r.seconds)
        engine.stop()
        results[f"ttft_{size}"] = {"cold_ms": median(cold) * 1000, "warm_ms": median(warm) * 1000}
        rows.append((f"TTFT at {size} tokens", f"cold {median(cold) * 1000:.1f} / warm {median(warm) * 1000:.1f} ms",
                     f"{median(cold) / median(warm):.1f}x warm"))

    # 4. Keystroke TTFT at 1k / 4k / 16k-token files (window of --context tokens).
    ids = target.tokenizer.encode(text)
    per_size = {}
    for size in args.file_sizes:
        file_text = target.tokenizer.decode(ids[:size])
        cursor = file_text.rfind("\n", 0, len(file_text) * 3 // 4) + 1
        doc = DocumentPrompt(target.prompt_builder(args.context - 64))
        engine = engine_for(target, draft, False, False)
        engine.start()
        times = []
        one = SamplingParams(max_tokens=1, mode="free")
        prefix, suffix = file_text[:cursor], file_text[cursor:]
        first = doc.update(prefix, suffix, "f.py").tokens
        await engine_requests(engine, [(first, picked[0])], one, False, f"ks{size}-0")
        for i, ch in enumerate("    value = compute(x)"):
            prefix += ch
            started = time.perf_counter()
            tokens = doc.update(prefix, suffix, "f.py").tokens
            await engine_requests(engine, [(tokens, picked[0])], one, False, f"ks{size}-{i + 1}")
            times.append(time.perf_counter() - started)
        engine.stop()
        per_size[size] = median(times) * 1000
        results[f"keystroke_{size}"] = {"median_ms": per_size[size]}
    small, large = min(per_size), max(per_size)
    rows.append((f"keystroke TTFT, files of {' / '.join(map(str, per_size))} tokens",
                 " / ".join(f"{v:.1f}" for v in per_size.values()) + " ms",
                 f"{large} is {per_size[large] / per_size[small]:.2f}x of {small}"))
    results["rows"] = rows
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=DEFAULT_TARGET)
    p.add_argument("--draft", type=Path, default=DEFAULT_DRAFT)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--ttft-sizes", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--file-sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"engine bench: {results['prompts']} held-out prompts, batch 1 unless noted")
    for col in ("measure", "figure", "ratio"):
        table.add_column(col)
    for row in results["rows"]:
        table.add_row(*row)
    Console().print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
