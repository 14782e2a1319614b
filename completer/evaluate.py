"""`completer evaluate`: a target (and drafter) on Python code outside the stdlib.

The held-out set is the source of `pip` in the running interpreter's
environment (third-party code the models never saw). Figures:
- bits per byte of target and drafter on plain file chunks;
- greedy first-line exact match at seeded random line starts (cursor after
  the line's indentation, rest of the file as suffix) and mid-line (cursor
  inside the line's text), as served: through the engine, with the served
  template, token healing and line-mode stop logic, the confidence rules off
  (the model's own line);
- the confidence rules' trade at the same line starts, with the server's
  `[request]` defaults: the share of places with a suggestion shown, of
  those the share right as far as it goes and the share that is the whole
  line, and the line's characters a right suggestion covers (all places);
- the drafter's acceptance through the engine: drafter proposals only, at a
  fixed draft length k, greedy, 32 tokens from each prompt: accepted / proposed
  draft tokens, and tokens per verifying pass.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import math
import random
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from completer.config import Config, EngineConfig, ModelSection, RequestSection, SpecConfig
from completer.engine.engine import run_in_passing_thread
from completer.engine.request import Finished
from completer.loading import LoadedModel, load_models
from completer.pipeline import CompletionPipeline, LocalCompleter, RequestOptions, display_path
from completer.imports import imported_files
from completer.prompt import Snippet
from completer.protocol import ContextItem, Document
from completer.training.corpus import SourceFile, pip_sources, read_python_files


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
    # The confidence rules (the `[request]` defaults) at the line starts: shown / places, right (as far as it
    # goes) / shown, whole line / shown, and the characters of the lines that right suggestions cover.
    confident_shown: float | None = None
    confident_right_of_shown: float | None = None
    confident_whole_of_shown: float | None = None
    confident_chars_covered: float | None = None
    draft: str | None = None
    draft_bits_per_byte: float | None = None
    draft_acceptance: float | None = None  # accepted / proposed draft tokens (all k of every round)
    draft_tokens_per_step: float | None = None  # tokens produced per target verification
    draft_k: int | None = None
    draft_params: int | None = None


def heldout_files(package: str = "pip", own_code_only: bool = False) -> tuple[str, list[SourceFile]]:
    """Held-out code: an installed package's sources (training reads only the
    standard library); pip's by default. Named by the package's version,
    which the figures depend on. `own_code_only`: without the packages it
    vendors (another project's code, which its files do not import as theirs)."""
    if package == "pip":
        root, version = pip_sources()
    else:
        try:
            dist = importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"error: --package {package}: not installed") from None
        root, version = Path(dist.locate_file(package)), dist.version
    excluded = ("__pycache__", "_vendor") if own_code_only else ("__pycache__",)
    return f"{package} {version} sources", read_python_files(root, exclude_dirs=excluded)


def repo_context(f: SourceFile, by_path: dict[str, SourceFile], package: str, seed: int,
                 neighbours: int = 2) -> list[ContextItem]:
    """What an editor would send beside `f`: the package files it imports,
    then `neighbours` other files of its directory (recently opened), as
    context items (at most the protocol's 64)."""
    imported = imported_files(f.text, f.path, set(by_path), ("", f"{package}/"))
    directory = str(Path(f.path).parent)
    siblings = sorted(p for p in by_path if str(Path(p).parent) == directory and p != f.path and p not in imported)
    random.Random(f"{seed}/{f.path}").shuffle(siblings)
    chosen = (imported + siblings[:neighbours])[:64]
    return [ContextItem(Path("/", p).as_uri(), by_path[p].text) for p in chosen]



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


async def served(lm: LoadedModel, draft: LoadedModel | None, picks, context_tokens: int,
                 options: RequestOptions, spec: SpecConfig, contexts: list[list[ContextItem]] | None = None,
                 retrieval: bool = True, engine: EngineConfig = EngineConfig()) -> list[Finished]:
    """Each pick's completion as the server makes it (the pipeline, then the
    engine), one at a time; `contexts`: each pick's context items."""
    # Without the confidence rules unless `options` has them: a line as the model ends it.
    config = Config(model=ModelSection(context_tokens=context_tokens, retrieval=retrieval), spec=spec,
                    request=RequestSection(deadline_ms=600_000, min_first_prob=0, min_token_prob=0, min_line_prob=0),
                    engine=engine)
    async with LocalCompleter(lm, draft, config) as completer:
        done = []
        for i, (f, cursor, end) in enumerate(picks):
            document = Document(Path("/", f.path).as_uri(), f.text[:cursor], f.text[end:])
            context = contexts[i] if contexts is not None else ()
            done.append(await completer.stream(document, context, options=options).finished())
        return done


def completions(lm: LoadedModel, picks, context_tokens: int, draft: LoadedModel | None = None,
                contexts: list[list[ContextItem]] | None = None, retrieval: bool = True,
                engine: EngineConfig = EngineConfig(), options: RequestOptions | None = None) -> list[str]:
    """Each pick's served first line (line mode, the default speculation; `options`: others)."""
    options = options or RequestOptions(max_tokens=48, mode="line")
    done = asyncio.run(served(lm, draft, picks, context_tokens, options,
                              SpecConfig(draft_model=draft is not None), contexts, retrieval, engine))
    return [d.text.rstrip() for d in done]


def confidence_trade(lm: LoadedModel, picks, context_tokens: int, draft: LoadedModel | None = None,
                     rules: RequestSection = RequestSection()) -> dict[str, float]:
    """The confidence rules of `rules` at `picks`: what is shown and how often it is right."""
    options = RequestOptions(max_tokens=48, mode="line", min_first_prob=rules.min_first_prob,
                             min_token_prob=rules.min_token_prob, min_line_prob=rules.min_line_prob)
    texts = completions(lm, picks, context_tokens, draft, options=options)
    truths = [f.text[cursor:end].rstrip() for f, cursor, end in picks]
    shown = [(t, truth) for t, truth in zip(texts, truths) if t.strip()]
    right = [(t, truth) for t, truth in shown if truth.startswith(t)]
    return {"shown": len(shown) / len(picks), "right_of_shown": len(right) / max(1, len(shown)),
            "whole_of_shown": sum(t == truth for t, truth in right) / max(1, len(shown)),
            "chars_covered": sum(len(t) for t, _ in right) / max(1, sum(map(len, truths)))}


def hits(texts: list[str], picks) -> list[bool]:
    return [t == f.text[cursor:end].rstrip() for t, (f, cursor, end) in zip(texts, picks)]


def exact_match(lm: LoadedModel, picks, context_tokens: int, draft: LoadedModel | None = None,
                contexts: list[list[ContextItem]] | None = None, retrieval: bool = True,
                engine: EngineConfig = EngineConfig()) -> float:
    """Share of picks whose served completion is the rest of the line."""
    return sum(hits(completions(lm, picks, context_tokens, draft, contexts, retrieval, engine), picks)) / len(picks)


def draft_acceptance(target: LoadedModel, draft: LoadedModel, picks, context_tokens: int, k: int,
                     length: int = 32) -> tuple[float, float]:
    """(accepted / proposed, tokens per verifying pass) of the drafter's
    proposals through the engine: drafter only, k tokens every round, greedy."""
    spec = SpecConfig(ngram=False, adaptive=False, k_init=k, k_max=k)
    done = asyncio.run(served(target, draft, picks, context_tokens, RequestOptions(max_tokens=length, mode="free"), spec))
    proposed, accepted, rounds = (sum(getattr(d.timings, f) for d in done)
                                  for f in ("draft_proposed", "draft_accepted", "draft_rounds"))
    return accepted / max(proposed, 1), (accepted + rounds) / max(rounds, 1)


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
    p.add_argument("--sites-json", type=Path,
                   help="with --context repo: each site's expected line, the three completions, its context files "
                        "and the retrieved windows (for reading misses)")
    p.add_argument("--context", choices=["none", "repo"], default="none",
                   help="repo: first-line exact match at line starts without and with the context an editor "
                        "would send (the files imported, two of the directory's), whole and retrieved")
    p.add_argument("--package", action="append",
                   help="held-out installed package (repeatable; default pip)")


class ContextRow(msgspec.Struct):
    corpus: str
    sites: int
    with_context: int  # sites with at least one context file
    exact_match_none: float
    exact_match_whole: float  # the files whole, in order, while they fit (model.retrieval = false)
    exact_match_retrieved: float  # retrieved windows (model.retrieval = true)


class ContextSite(msgspec.Struct):
    """One site of `--context repo`, for reading misses (`--sites-json`)."""
    package: str
    path: str
    line: int  # 1-based
    expected: str
    none: str
    whole: str
    retrieved: str
    context_files: list[str]
    windows: list[str]  # the retrieved windows placed, "path:first line", best last


def retrieved_windows(lm: LoadedModel, context_tokens: int, f: SourceFile, cursor: int,
                      context: list[ContextItem]) -> list[str]:
    """The windows retrieval places for this site (a fresh document's choice, as served)."""
    state = CompletionPipeline(lm, Config(model=ModelSection(context_tokens=context_tokens))).document(True)
    state.update(f.text[:cursor], "", f.path, [Snippet(display_path(c.uri) or "", c.text, c.kind) for c in context])
    return [f"{w.uri}:{w.first_line}" for w in state.retriever.chosen]


def context_rows(args: argparse.Namespace, target: LoadedModel,
                 draft: LoadedModel | None) -> tuple[list[ContextRow], list[ContextSite]]:
    rows, sites = [], []
    for package in args.package or ["pip"]:
        corpus, files = heldout_files(package, own_code_only=True)
        by_path = {f.path: f for f in files}
        picks = line_starts(files, args.lines, args.seed)
        contexts = [repo_context(f, by_path, package, args.seed) for f, _, _ in picks]
        n = args.context_tokens
        texts = (completions(target, picks, n, draft),
                 completions(target, picks, n, draft, contexts, retrieval=False),
                 completions(target, picks, n, draft, contexts, retrieval=True))
        none, whole, retrieved = (sum(hits(t, picks)) / len(picks) for t in texts)
        row = ContextRow(corpus, len(picks), sum(bool(c) for c in contexts), none, whole, retrieved)
        print(f"{row.corpus}: first-line exact match at {row.sites} line starts ({row.with_context} with context "
              f"files): no context {row.exact_match_none:.1%}; files whole {row.exact_match_whole:.1%}; "
              f"retrieved windows {row.exact_match_retrieved:.1%}", flush=True)
        rows.append(row)
        for (f, cursor, end), context, a, b, c in zip(picks, contexts, *texts):
            sites.append(ContextSite(package, f.path, f.text.count("\n", 0, cursor) + 1, f.text[cursor:end].rstrip(),
                                     a, b, c, [display_path(item.uri) or item.uri for item in context],
                                     retrieved_windows(target, n, f, cursor, context)))
    return rows, sites


def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    target, draft = run_in_passing_thread(load_models, args.target, args.draft, args.precision, args.template)
    if args.context == "repo":
        rows, sites = context_rows(args, target, draft)
        if args.json:
            args.json.write_bytes(msgspec.json.format(msgspec.json.encode(rows)) + b"\n")
        if args.sites_json:
            args.sites_json.write_bytes(msgspec.json.format(msgspec.json.encode(sites)) + b"\n")
        return 0
    root, files = heldout_files((args.package or ["pip"])[0])
    picks = line_starts(files, args.lines, args.seed)
    mid = line_starts(files, args.lines, args.seed + 1, mid_line=True)
    report = EvalReport(
        corpus=root, files=len(files), target=target.name, template=target.template.name,
        target_bits_per_byte=bits_per_byte(target, files, args.chunks, args.context_tokens, args.seed),
        exact_match=exact_match(target, picks, args.context_tokens, draft), exact_match_n=len(picks),
        exact_match_mid_line=exact_match(target, mid, args.context_tokens, draft),
        target_params=target.model.config.num_parameters())
    rules = RequestSection()
    if rules.min_first_prob or rules.min_token_prob:
        trade = confidence_trade(target, picks, args.context_tokens, draft, rules)
        report.confident_shown, report.confident_right_of_shown = trade["shown"], trade["right_of_shown"]
        report.confident_whole_of_shown, report.confident_chars_covered = trade["whole_of_shown"], trade["chars_covered"]
    print(f"held-out corpus: {report.corpus} ({report.files} files)")
    print(f"target: {target.name}, {report.target_params / 1e6:.2f}M params, template {report.template}, "
          f"{report.target_bits_per_byte:.3f} bits/byte")
    print(f"first-line exact match, as served (greedy): {report.exact_match:.1%} at line starts, "
          f"{report.exact_match_mid_line:.1%} mid-line, of {report.exact_match_n} each")
    if report.confident_shown is not None:
        print(f"with the confidence rules (min_first_prob {rules.min_first_prob}, min_token_prob "
              f"{rules.min_token_prob}), at the line starts: shown at {report.confident_shown:.1%}, right as far "
              f"as it goes {report.confident_right_of_shown:.1%} of shown ({report.confident_whole_of_shown:.1%} "
              f"the whole line), {report.confident_chars_covered:.1%} of the lines' characters covered")
    if draft is not None:
        report.draft, report.draft_k = draft.name, args.draft_k
        if not draft.model.config.head_vocab_size:  # a reduced head cannot spell every token
            report.draft_bits_per_byte = bits_per_byte(draft, files, args.chunks, args.context_tokens, args.seed)
        report.draft_params = draft.model.config.num_parameters()
        bpb = "" if report.draft_bits_per_byte is None else f"{report.draft_bits_per_byte:.3f} bits/byte, "
        print(f"draft:  {draft.name}, {report.draft_params / 1e6:.2f}M params ({bpb}"
              f"{report.draft_params / report.target_params:.3f} of the target's)")
        if args.accept_prompts > 0:  # 0: not measured
            acceptance, per_step = draft_acceptance(target, draft, picks[: args.accept_prompts],
                                                    args.context_tokens, args.draft_k)
            report.draft_acceptance, report.draft_tokens_per_step = acceptance, per_step
            print(f"draft acceptance at k={report.draft_k}, through the engine: {acceptance:.1%} of proposed "
                  f"tokens, {per_step:.2f} tokens per verifying pass")
    if args.json:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    return 0
