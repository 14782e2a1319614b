"""`completer evaluate`: a target (and drafter) on Python code outside the stdlib.

The held-out set is the source of `pip` in the running interpreter's
environment (third-party code the models never saw). Figures:
- bits per byte of target and drafter on plain file chunks;
- greedy first-line exact match at seeded random line starts (cursor after
  the line's indentation, rest of the file as suffix) and mid-line (cursor
  inside the line's text), as served: through the engine, with the served
  template, token healing and line-mode stop logic;
- the drafter's per-token greedy acceptance against the target at draft
  length k, measured along the target's own greedy continuations.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from completer.engine.config import EngineConfig, SpecConfig
from completer.engine.core import request_for
from completer.engine.engine import Engine, run_in_passing_thread
from completer.engine.sequence import SamplingParams
from completer.kv import StaticKVCache
from completer.loading import LoadedModel, load
from completer.model_store import resolve_draft, resolve_target
from completer.training.corpus import SourceFile, read_python_files


class EvalReport(msgspec.Struct):
    corpus: str
    files: int
    target: str
    template: str
    target_bits_per_byte: float
    exact_match: float  # at line starts
    exact_match_n: int
    exact_match_mid_line: float
    target_params: int
    draft: str | None = None
    draft_bits_per_byte: float | None = None
    draft_acceptance: float | None = None  # accepted / proposed draft tokens (all k of every round)
    draft_token_acceptance: float | None = None  # accepted / (accepted + rejected)
    draft_tokens_per_step: float | None = None  # tokens produced per target verification
    draft_k: int | None = None
    draft_params: int | None = None


def heldout_files() -> tuple[str, list[SourceFile]]:
    """Held-out code: the installed pip's sources (training reads only the
    standard library). Named by pip's version, which the figures depend on."""
    import pip

    root = Path(pip.__file__).parent
    return f"pip {pip.__version__} sources", read_python_files(root, exclude_dirs=("__pycache__",))


@torch.inference_mode()
def bits_per_byte(lm: LoadedModel, files: list[SourceFile], chunks: int, length: int,
                  seed: int) -> float:
    rng = random.Random(seed)
    builder = lm.prompt_builder(length)
    nll, nbytes = 0.0, 0
    for _ in range(chunks):
        f = rng.choices(files, weights=[len(x.text) for x in files])[0]
        start = f.text.rfind("\n", 0, rng.randrange(len(f.text))) + 1
        header = builder.header(f.path)
        text_ids = lm.tokenizer.encode(f.text[start: start + length * 6])[: length - len(header)]
        ids = header + text_ids
        logits = lm.model(torch.tensor([ids[:-1]]))[0]
        n = min(len(text_ids), len(ids) - 1)  # score the text, not the header
        targets = torch.tensor(ids[-n:])
        nll += F.cross_entropy(logits[-n:].float(), targets, reduction="sum").item()
        nbytes += len(lm.tokenizer.decode_bytes(targets.tolist()))
    return nll / math.log(2) / nbytes


def line_starts(files: list[SourceFile], n: int, seed: int,
                mid_line: bool = False) -> list[tuple[SourceFile, int, int]]:
    """n (file, cursor offset, line end) triples at non-blank lines: the cursor
    after the indentation, or (mid_line) at a random char inside the line's text."""
    rng = random.Random(seed)
    picks = []
    while len(picks) < n:
        f = rng.choice(files)
        lines = f.text.split("\n")
        i = rng.randrange(len(lines))
        text = lines[i].strip()
        if not text or (mid_line and len(text) < 4):
            continue
        offset = sum(len(s) + 1 for s in lines[:i])
        indent = len(lines[i]) - len(lines[i].lstrip())
        cursor = indent + (rng.randrange(1, len(text) - 1) if mid_line else 0)
        picks.append((f, offset + cursor, offset + len(lines[i].rstrip())))
    return picks


async def _served(lm: LoadedModel, draft: LoadedModel | None, picks, budget: int) -> list[str]:
    engine = Engine.build(lm, draft, EngineConfig(deadline_ms=600_000), SpecConfig(draft_model=draft is not None))
    builder = lm.prompt_builder(budget - 48)
    engine.start()
    try:
        texts = []
        for i, (f, cursor, end) in enumerate(picks):
            prefix, suffix = f.text[:cursor], f.text[end:]
            request = request_for(f"eval-{i}", builder.build(prefix, suffix, f.path), prefix, suffix,
                                  SamplingParams(max_tokens=48, mode="line"), engine.core.healer,
                                  builder.template.order)
            texts.append((await engine.submit(request).finished()).text)
        return texts
    finally:
        engine.stop()


def exact_match(lm: LoadedModel, picks, budget: int, draft: LoadedModel | None = None) -> float:
    """Share of picks whose served completion is the rest of the line."""
    import asyncio

    texts = asyncio.run(_served(lm, draft, picks, budget))
    hits = sum(text.rstrip() == f.text[cursor:end].rstrip() for text, (f, cursor, end) in zip(texts, picks))
    return hits / len(picks)


@torch.inference_mode()
def greedy_tokens(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    cache = StaticKVCache(lm.model.config, 1, len(prompt) + n)
    logits = lm.model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)[:, -1]
    out: list[int] = []
    for i in range(n):
        out.append(int(logits.argmax(-1)))
        logits = lm.model(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i]]), cache)[:, -1]
    return out


@torch.inference_mode()
def draft_acceptance(target: LoadedModel, draft: LoadedModel, picks, budget: int, k: int,
                     length: int = 32) -> tuple[float, float, float]:
    """Speculative rounds along the target's greedy continuation: the drafter
    proposes k tokens greedily, the longest prefix that matches the target's is
    accepted, and the target's next token comes free with each round."""
    builder = target.prompt_builder(budget - length - k)
    proposed = accepted = rounds = produced = rejected = 0
    for f, cursor, end in picks:
        prompt = builder.build(f.text[:cursor], f.text[end:], f.path).tokens
        reference = greedy_tokens(target, prompt, length)
        cache = StaticKVCache(draft.model.config, 1, len(prompt) + length + k)
        seq = list(prompt)
        fed = 0  # tokens of seq whose K/V the drafter's cache holds
        i = 0
        while i < length:
            # Feed what the drafter has not seen, then draft k tokens.
            logits = draft.model(torch.tensor([seq[fed:]]), torch.arange(fed, len(seq))[None], cache)[:, -1]
            proposal = []
            for j in range(k):
                proposal.append(int(logits.argmax(-1)))
                if j + 1 < k:
                    pos = len(seq) + j
                    logits = draft.model(torch.tensor([[proposal[-1]]]), torch.tensor([[pos]]), cache)[:, -1]
            truth = reference[i: i + k]
            n_ok = 0
            while n_ok < len(truth) and proposal[n_ok] == truth[n_ok]:
                n_ok += 1
            proposed += min(k, len(truth))
            accepted += n_ok
            rejected += n_ok < len(truth)
            step = min(n_ok + 1, length - i)
            seq += reference[i: i + step]
            fed = len(seq) - step  # the last `step` tokens must be (re)fed
            i += step
            rounds += 1
            produced += step
    return (accepted / max(proposed, 1), produced / max(rounds, 1),
            accepted / max(accepted + rejected, 1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default",
                   help="a GGUF file, an HF directory, 'default' (SmolLM2-135M) or 'embedded'")
    p.add_argument("--draft", default="default", help="as `completer serve`'s model.draft ('' for none)")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp8"])
    p.add_argument("--template", help="prompt template (default: detected from the tokenizer)")
    p.add_argument("--lines", type=int, default=200, help="line starts for exact match")
    p.add_argument("--chunks", type=int, default=64, help="file chunks for bits per byte")
    p.add_argument("--accept-prompts", type=int, default=50, help="prompts for draft acceptance")
    p.add_argument("--draft-k", type=int, default=4)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the report here")


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    root, files = heldout_files()
    target_path = resolve_target(args.target)
    draft_path = resolve_draft(args.draft, target_path)
    target = run_in_passing_thread(load, target_path, args.precision, args.template)
    draft = run_in_passing_thread(load, draft_path, args.precision, args.template) if draft_path else None
    picks = line_starts(files, args.lines, args.seed)
    mid = line_starts(files, args.lines, args.seed + 1, mid_line=True)
    report = EvalReport(
        corpus=root, files=len(files), target=target.name, template=target.template.name,
        target_bits_per_byte=bits_per_byte(target, files, args.chunks, args.context_tokens, args.seed),
        exact_match=exact_match(target, picks, args.context_tokens, draft), exact_match_n=len(picks),
        exact_match_mid_line=exact_match(target, mid, args.context_tokens, draft),
        target_params=target.model.config.num_parameters())
    print(f"held-out corpus: {report.corpus} ({report.files} files)")
    print(f"target: {target.name}, {report.target_params / 1e6:.2f}M params, template {report.template}, "
          f"{report.target_bits_per_byte:.3f} bits/byte")
    print(f"first-line exact match, as served (greedy): {report.exact_match:.1%} at line starts, "
          f"{report.exact_match_mid_line:.1%} mid-line, of {report.exact_match_n} each")
    if draft is not None:
        acceptance, per_step, per_token = draft_acceptance(target, draft, picks[: args.accept_prompts],
                                                           args.context_tokens, args.draft_k)
        report.draft, report.draft_k = draft.name, args.draft_k
        report.draft_bits_per_byte = bits_per_byte(draft, files, args.chunks, args.context_tokens, args.seed)
        report.draft_acceptance, report.draft_tokens_per_step = acceptance, per_step
        report.draft_token_acceptance = per_token
        report.draft_params = draft.model.config.num_parameters()
        print(f"draft:  {draft.name}, {report.draft_params / 1e6:.2f}M params, "
              f"{report.draft_bits_per_byte:.3f} bits/byte ({report.draft_params / report.target_params:.3f} "
              f"of the target)")
        print(f"draft acceptance at k={report.draft_k}: {per_token:.1%} per token "
              f"(accepted / (accepted + rejected)), {acceptance:.1%} of all proposed, "
              f"{per_step:.2f} tokens per target step")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    return 0
