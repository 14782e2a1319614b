"""Engine benchmark: our engine against HF transformers on the same weights and
the same held-out prompts (pip's sources, not the stdlib the models saw),
everything measured side by side in one run. Prints a table; writes JSON.

    python -m latency_bench engine --out bench-results/engine.json

Ratios are what count here (the machine is shared and noisy); absolute times
mean something only on a GPU.

One file past 300 lines on purpose: its five measures share the loaded models
and one run, so every ratio compares runs made side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch

from completer.checkpoint import is_gguf, resolve_precision
from completer.config import Config, EngineConfig, ModelSection, RequestSection, SpecConfig
from completer.document import DocumentPrompt
from completer.engine.engine import Engine, run_in_passing_thread
from completer.evaluate import heldout_files, line_starts
from completer.loading import LoadedModel, load_models
from completer.pipeline import CompletionPipeline, RequestOptions, display_path
from completer.protocol import Document
from latency_bench.harness import model_arguments
from latency_bench.run_results import write_result


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cases(n: int, seed: int) -> list[Document]:
    _, files = heldout_files()
    return [Document(Path("/", f.path).as_uri(), f.text[:cursor], f.text[end:])
            for f, cursor, end in line_starts(files, n, seed)]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- HF transformers ------------------------------------------------------------

def hf_runner(target_path: Path, draft_path: Path | None, dtype: torch.dtype, threads: int):
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    def hf_model(path: Path):  # transformers dequantizes a GGUF itself
        kwargs = {"gguf_file": path.name} if is_gguf(path) else {}
        return AutoModelForCausalLM.from_pretrained(path.parent if kwargs else path, dtype=dtype, **kwargs).eval()

    model = hf_model(target_path)
    assistant = hf_model(draft_path) if draft_path else None

    class EndOfLine(StoppingCriteria):
        def __init__(self, tokenizer, start: int):
            self.tokenizer, self.start = tokenizer, start

        def __call__(self, input_ids, scores, **kwargs):
            text = self.tokenizer.decode(input_ids[0, self.start:].tolist())
            return torch.tensor([bool(text.strip()) and "\n" in text.lstrip()])

    def run(prompt: list[int], tokenizer, max_new: int, line: bool, variant: str, eos: list[int]):
        torch.set_num_threads(threads)  # per thread; each call runs on a new one
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
    rounds: int


class Served:
    """An engine and the pipeline in front of it, as `completer serve` builds them."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, draft_on: bool, ngram: bool,
                 prefix_cache: bool = True, context: int | None = None):
        self.config = Config(
            model=ModelSection(context_tokens=context or THREADS_AND_CONTEXT.context),
            request=RequestSection(deadline_ms=600_000),
            spec=SpecConfig(draft_model=draft_on, ngram=ngram, max_batch=64),
            engine=EngineConfig(prefix_cache=prefix_cache, kv_cache_mb=512, max_running=64, prefill_chunk=16384,
                                threads=THREADS_AND_CONTEXT.threads, decode_threads=THREADS_AND_CONTEXT.decode_threads))
        self.pipeline = CompletionPipeline(target, self.config)
        self.engine = Engine.build(target, draft if draft_on else None, self.config.engine, self.config.spec)
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

    async def run(self, documents: list[tuple[Document, DocumentPrompt | None]], options: RequestOptions,
                  concurrent: bool, tag: str) -> list[EngineRun]:
        """Each document's completion; the request is built at submission, as a session builds it."""
        async def one(i: int, document: Document, state: DocumentPrompt | None) -> EngineRun:
            started = time.perf_counter()
            request = self.pipeline.request(f"{tag}-{i}", document, (), options, state, arrival=started)
            done = await self.engine.submit(request).finished()
            t = done.timings
            return EngineRun(time.perf_counter() - started, t.ttft_ms, t.generated_tokens,
                             t.draft_proposed, t.draft_accepted, t.draft_rounds)

        if concurrent:
            return list(await asyncio.gather(*(one(i, d, s) for i, (d, s) in enumerate(documents))))
        return [await one(i, d, s) for i, (d, s) in enumerate(documents)]


class BenchSettings(msgspec.Struct):
    threads: int = 0
    decode_threads: int = 0
    context: int = 1024


THREADS_AND_CONTEXT = BenchSettings()  # set in main_async


SPEC_VARIANTS = (("engine_nospec", False, False), ("engine_draft", True, False),
                 ("engine_draft_ngram", True, True))


def speculation(runs: list[EngineRun]) -> dict:
    """Acceptance (accepted / proposed) and mean tokens per verifying pass
    (the accepted drafts plus the target's own token)."""
    proposed, accepted, rounds = (sum(getattr(r, f) for r in runs) for f in ("proposed", "accepted", "rounds"))
    return {"acceptance": accepted / proposed if proposed else None,
            "tokens_per_round": (accepted + rounds) / rounds if rounds else None}


def spec_note(r: dict) -> str:
    if r.get("acceptance") is None:
        return ""
    return f" (acceptance {r['acceptance']:.0%}, {r['tokens_per_round']:.2f} tok/round)"


async def main_async(args) -> dict:
    global THREADS_AND_CONTEXT
    args.precision = resolve_precision(args.precision)
    THREADS_AND_CONTEXT = BenchSettings(args.threads, args.decode_threads, args.context)
    # Torch work off the engine's thread runs on threads that end (run_in_passing_thread):
    # a live second OpenMP team would slow the engine's.
    target, draft = run_in_passing_thread(load_models, args.target, args.draft, args.precision)
    variants = [v for v in SPEC_VARIANTS if draft is not None or v[0] != "engine_draft"]
    # HF's assisted generation needs a drafter transformers can load on its own.
    hf_draft = draft.directory if draft is not None and not draft.model.config.embedding_from_target else None
    hf_variants = ("plain", "assisted", "prompt_lookup") if hf_draft else ("plain", "prompt_lookup")
    torch.set_num_threads(args.threads)
    builder = CompletionPipeline(target, Config(model=ModelSection(context_tokens=args.context))).document().builder
    eos = builder.stop_ids
    picked = cases(args.prompts, args.seed)
    # HF gets the prompt the pipeline builds, whole (it has no token healing).
    hf_prompts = [builder.build(d.prefix, d.suffix, display_path(d.uri)).tokens for d in picked]
    fresh = [(d, None) for d in picked]
    results: dict = {"prompts": len(picked), "context_tokens": args.context, "precision": args.precision,
                     "threads": args.threads,
                     "decode_threads": args.decode_threads or args.threads}  # as EngineCore resolves it
    rows: list[tuple[str, str, str]] = []
    hf = run_in_passing_thread(hf_runner, target.directory, hf_draft, PRECISION_DTYPES[args.precision],
                               args.threads)

    def hf_rows(key: str, case_prompts: list[list[int]], line: bool, max_new: int, variant: str) -> None:
        times, tokens = [], 0
        for prompt in case_prompts:
            seconds, n = run_in_passing_thread(hf, prompt, target.tokenizer, max_new, line, variant, eos)
            times.append(seconds)
            tokens += n
        results[key] = {"median_ms": median(times) * 1000, "tokens": tokens}

    def ratio_rows(suffix: str, base_key: str, label: str) -> None:
        base = results[base_key]["median_ms"]
        for key in [k for k in results if k.endswith(suffix) and isinstance(results[k], dict)]:
            r = results[key]
            rows.append((f"{label}: {key.removesuffix(suffix)}", f"{r['median_ms']:.1f} ms",
                         f"{base / r['median_ms']:.2f}x vs HF generate" + spec_note(r)))

    # 1. Cold line / block completions at batch 1 (every prompt new to every
    #    cache): HF generate variants vs our engine, the same work on both.
    for mode, max_new in (("line", 48), ("block", 96)):
        for variant in hf_variants:
            hf_rows(f"hf_{variant}_{mode}", hf_prompts, mode == "line", max_new, variant)
        for name, draft_on, ngram in variants:
            served = Served(target, draft, draft_on, ngram, prefix_cache=False)
            runs = await served.run(fresh, RequestOptions(max_tokens=max_new, mode=mode), False, f"{name}-{mode}")
            served.stop()
            results[f"{name}_{mode}"] = {"median_ms": median([r.seconds for r in runs]) * 1000,
                                         "tokens": sum(r.generated for r in runs), **speculation(runs)}
        ratio_rows(f"_{mode}", f"hf_plain_{mode}", f"cold {mode}")

    # 2. Keystroke line completion, the editor's case: the prompt of the previous
    #    keystroke is cached (as the engine keeps it when serving), then one more
    #    typed character asks for the rest of the line. HF generate has no
    #    cache across calls, so it prefills the whole prompt again.
    for variant in ("plain", "prompt_lookup"):
        hf_rows(f"hf_{variant}_keystroke", hf_prompts, True, 48, variant)
    for name, draft_on, ngram in variants:
        served = Served(target, draft, draft_on, ngram, prefix_cache=True)
        runs = []
        for i, d in enumerate(picked):
            state = served.pipeline.document()
            before = msgspec.structs.replace(d, prefix=d.prefix[:-1])
            await served.run([(before, state)], RequestOptions(max_tokens=1), False, f"{name}-prev{i}")
            runs += await served.run([(d, state)], RequestOptions(max_tokens=48), False, f"{name}-key{i}")
        served.stop()
        results[f"{name}_keystroke"] = {"median_ms": median([r.seconds for r in runs]) * 1000,
                                        "tokens": sum(r.generated for r in runs), **speculation(runs)}
    ratio_rows("_keystroke", "hf_plain_keystroke", "keystroke line")

    # 3. Decode tok/s at batch 1, 4, 16, 32: speculation off / on (free mode),
    # alternating off and on `repeats` times (the machine's speed drifts), medians.
    # One engine alive at a time: two engine threads are two OpenMP teams, and
    # with more team threads than cores libgomp slows every parallel region.
    spec_flags = {"nospec": (False, False), "spec": (True, True)}
    free64 = RequestOptions(max_tokens=64, mode="free")
    for batch in args.batches:
        # Every prompt at least once, in groups of `batch` running together.
        groups = max(1, len(fresh) // batch)
        cycled = fresh * (groups * batch // len(fresh) + 1)
        rates: dict[str, list[float]] = {name: [] for name in spec_flags}
        runs: dict[str, list[EngineRun]] = {name: [] for name in spec_flags}
        for rep in range(args.repeats):
            for name, flags in spec_flags.items():
                served = Served(target, draft, *flags, prefix_cache=False)
                tokens, decode_s = 0, 0.0
                for g in range(groups):
                    started = time.perf_counter()
                    group = await served.run(cycled[g * batch: (g + 1) * batch], free64, True,
                                             f"tp{batch}{name}{rep}-{g}")
                    wall = time.perf_counter() - started
                    decode_s += max(wall - median([r.ttft_ms for r in group]) / 1000, 1e-9)
                    tokens += sum(r.generated for r in group)
                    runs[name] += group
                served.stop()
                rates[name].append(tokens / decode_s)
        for name in spec_flags:
            results[f"decode_b{batch}_{name}"] = {"tok_per_s": median(rates[name]), "repeats": rates[name],
                                                  **speculation(runs[name])}
        on, off = results[f"decode_b{batch}_spec"], results[f"decode_b{batch}_nospec"]
        ratios = sorted(a / b for a, b in zip(rates["spec"], rates["nospec"]))
        rows.append((f"decode tok/s, batch {batch}", f"{off['tok_per_s']:.0f} -> {on['tok_per_s']:.0f}",
                     f"{on['tok_per_s'] / off['tok_per_s']:.2f}x with speculation (pairs "
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f}x)" + spec_note(on)))

    # 4. Warm keystroke vs cold prefill at 512 / 2k / 8k-token prompts.
    text = "".join(f.text for f in heldout_files()[1])
    one = RequestOptions(max_tokens=1, mode="free")
    for size in args.ttft_sizes:
        served = Served(target, draft, False, False, context=size + RequestSection().max_tokens)
        state = served.pipeline.document()
        cold, warm = [], []
        for rep in range(args.repeats):
            # Each repeat's cursor far from the others': nothing of its window is
            # cached (a prompt without the suffix, as the prefix template's, would
            # otherwise find the previous repeat's prefix).
            cut = text.rfind("\n", 0, len(text) * (rep + 1) // (args.repeats + 1)) + 1
            prefix = text[:cut]
            base = Document("file:///big.py", prefix, text[cut:])
            cold.append((await served.run([(base, state)], one, False, f"cold{size}-{rep}"))[0].seconds)
            typed = msgspec.structs.replace(base, prefix=prefix + "x")
            warm.append((await served.run([(typed, state)], one, False, f"warm{size}-{rep}"))[0].seconds)
        served.stop()
        results[f"ttft_{size}"] = {"cold_ms": median(cold) * 1000, "warm_ms": median(warm) * 1000}
        rows.append((f"TTFT at {size} tokens", f"cold {median(cold) * 1000:.1f} / warm {median(warm) * 1000:.1f} ms",
                     f"{median(cold) / median(warm):.1f}x warm"))

    # 5. Keystroke TTFT at 1k / 4k / 16k-token files (window of --context tokens).
    ids = target.tokenizer.encode(text)
    per_size = {}
    for size in args.file_sizes:
        file_text = target.tokenizer.decode(ids[:size])
        cursor = file_text.rfind("\n", 0, len(file_text) * 3 // 4) + 1
        served = Served(target, draft, False, False)
        state = served.pipeline.document()
        times = []
        prefix, suffix = file_text[:cursor], file_text[cursor:]
        await served.run([(Document("file:///f.py", prefix, suffix), state)], one, False, f"ks{size}-0")
        for i, ch in enumerate("    value = compute(x)"):
            prefix += ch
            r = await served.run([(Document("file:///f.py", prefix, suffix), state)], one, False, f"ks{size}-{i + 1}")
            times.append(r[0].seconds)
        served.stop()
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
    model_arguments(p)
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts (pip's sources)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of each")
    p.add_argument("--repeats", type=int, default=5, help="alternating off/on pairs of each decode row")
    p.add_argument("--precision", choices=["auto", *PRECISION_DTYPES], default="auto",
                   help="weights precision of both HF and the engine (auto: as `completer serve`)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--decode-threads", type=int, default=0,
                   help="the engine's decode threads (0: as --threads)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--ttft-sizes", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--file-sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = p.parse_args()
    results = asyncio.run(main_async(args))
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"engine bench: {results['prompts']} held-out prompts, {args.precision}, "
                        f"{args.threads} threads (decode {results['decode_threads']}), batch 1 unless noted")
    for col in ("measure", "figure", "ratio"):
        table.add_column(col)
    for row in results["rows"]:
        table.add_row(*row)
    Console(width=120).print(table)
    if args.out:
        write_result(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
