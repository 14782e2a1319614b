"""`completer train ...`: tokenizer, target, drafter (each seeded and resumable)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import msgspec

from completer.training.trainer import DRAFT, TARGET, TrainSpec, train


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the embedded models (tokenizer, target, draft), or a drafter "
                                     "cut from a pretrained target (draft-from-target)")
    p.add_argument("what", choices=["tokenizer", "target", "draft", "draft-from-target"])
    p.add_argument("--run-dir", type=Path, default=Path("runs"),
                   help="where state, logs and exports go (default: runs/)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: 1300 target, 1200 draft)")
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=8192, help="tokenizer vocabulary size")
    p.add_argument("--teacher", type=Path, help="HF dir to distil the drafter from "
                   "(default: RUN_DIR/target/hf)")
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: RUN_DIR/tokenizer)")
    p.add_argument("--init-from", type=Path, help="HF dir whose weights start the run (continue "
                                                    "training with a fresh schedule; pick a new --seed "
                                                    "for new examples)")
    p.add_argument("--target", default="default",
                   help="draft-from-target: the target to cut and distil from (a GGUF, a directory, "
                        "'default' = SmolLM2-135M)")
    p.add_argument("--layers", type=int, default=2, help="draft-from-target: the target's first N layers")
    p.add_argument("--head-vocab", type=int, default=8192,
                   help="draft-from-target: tokens the drafter proposes (the corpus' most frequent)")
    p.add_argument("--export", type=Path, help="copy the finished HF directory here")
    p.add_argument("--checkpoint-minutes", type=float, default=10)
    p.set_defaults(func=run)


def draft_from_target(args: argparse.Namespace) -> TrainSpec:
    """A drafter that shares the target's vocabulary and embeddings: its first
    layers, distilled on the corpus with the target's prompt layout."""
    from completer.checkpoint import load_checkpoint
    from completer.loading import detect_template
    from completer.model_store import resolve_target

    teacher = resolve_target(args.target)
    model, tokenizer = load_checkpoint(teacher, "fp32")
    cfg = msgspec.structs.replace(model.config, num_hidden_layers=args.layers, head_vocab_size=args.head_vocab,
                                  embedding_from_target=True, tie_word_embeddings=False)
    return TrainSpec(model=cfg, steps=args.steps or 600, rows=args.rows, seq_len=args.seq_len,
                     lr=args.lr or 5e-4, warmup=20, seed=args.seed, teacher=str(teacher),
                     template=detect_template(tokenizer), from_teacher=True)


def run(args: argparse.Namespace) -> int:
    if args.what == "draft-from-target":
        spec = draft_from_target(args)
        return train_and_export(args, spec, Path(spec.teacher))  # the target's file holds its tokenizer
    tokenizer_dir = args.tokenizer or args.run_dir / "tokenizer"
    if args.what == "tokenizer":
        from completer.tokenizer import train_bpe
        from completer.training.corpus import stdlib_corpus
        tok = train_bpe((f.text for f in stdlib_corpus()), args.vocab_size, tokenizer_dir)
        print(f"wrote {tok.path} ({tok.vocab_size} tokens)")
        return 0
    if not (tokenizer_dir / "tokenizer.json").exists():
        print(f"error: {tokenizer_dir}/tokenizer.json not found; run `completer train tokenizer` first",
              file=sys.stderr)
        return 2
    if args.what == "target":
        spec = TrainSpec(model=TARGET, steps=args.steps or 1300, rows=args.rows,
                         seq_len=args.seq_len, lr=args.lr or 2e-3, seed=args.seed)
    else:
        teacher = args.teacher or args.run_dir / "target" / "hf"
        if not (teacher / "config.json").exists():
            print(f"error: teacher {teacher} not found; train the target first", file=sys.stderr)
            return 2
        spec = TrainSpec(model=DRAFT, steps=args.steps or 1200, rows=args.rows,
                         seq_len=args.seq_len, lr=args.lr or 3e-3, seed=args.seed,
                         teacher=str(teacher))
    if args.init_from:
        spec = msgspec.structs.replace(spec, init_from=str(args.init_from))
    tokenizer = msgspec.json.decode((tokenizer_dir / "tokenizer.json").read_bytes())
    vocab = len(tokenizer["model"]["vocab"])
    if vocab != spec.model.vocab_size:
        spec = msgspec.structs.replace(spec, model=msgspec.structs.replace(spec.model, vocab_size=vocab))
    return train_and_export(args, spec, tokenizer_dir)


def train_and_export(args: argparse.Namespace, spec: TrainSpec, tokenizer_dir: Path) -> int:
    out = train(args.run_dir / args.what, spec, tokenizer_dir, args.checkpoint_minutes,
                log=lambda line: print(line, flush=True))
    if args.export:
        shutil.copytree(out, args.export, dirs_exist_ok=True)
        print(f"exported to {args.export}")
    return 0
