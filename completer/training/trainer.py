"""Seeded, resumable training of the default target and (by distillation) drafter.

`run_dir/state.pt` holds weights, optimizer and step; it is rewritten every
`checkpoint_minutes`, and so is the HF-format export in `run_dir/hf`. Running
the same command again resumes from it; the data of step n is a pure function
of (seed, n), so a resumed run trains on exactly what an unbroken one would.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import msgspec
import torch
import torch.nn.functional as F

from completer.checkpoint import load_model, load_tokenizer, save_model
from completer.model import ModelConfig, Transformer
from completer.prompt import PromptBuilder, get_template
from completer.tokenizer import END_OF_TEXT, TextTokenizer
from completer.training.corpus import stdlib_corpus
from completer.training.examples import ExampleMaker

# The default models. Target: ~21M parameters, 42 MB in bf16 (more than the
# 32 MiB L3 of the CPUs we serve on, so its decode is bound by memory traffic).
# Drafter: at most 1/8 of that, so it sits in cache and drafts cheaply.
TARGET = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=8192, hidden_size=512, intermediate_size=1408,
    num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
    bos_token_id=None, eos_token_id=0)
DRAFT = msgspec.structs.replace(
    TARGET, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=3, num_key_value_heads=1)


class TrainSpec(msgspec.Struct, frozen=True):
    model: ModelConfig
    steps: int
    rows: int = 8
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    teacher: str | None = None  # HF dir or GGUF of the model to distil from
    distill_weight: float = 0.9  # share of KL(teacher || student) in the loss
    init_from: str | None = None  # HF dir whose weights start the run (continued training)
    template: str = "default"  # the prompt layout of the examples ("prefix": plain text, no FIM)
    # A drafter cut from the teacher: its embeddings (shared, frozen), its first
    # `model.num_hidden_layers` layers and final norm, and an output layer over
    # the `model.head_vocab_size` tokens most frequent in the corpus.
    from_teacher: bool = False


def learning_rate(spec: TrainSpec, step: int) -> float:
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * cosine)


def make_examples(tokenizer: TextTokenizer, seq_len: int, template: str = "default") -> ExampleMaker:
    builder = PromptBuilder(tokenizer, get_template(template), budget=seq_len)
    fim_rate = 0.0 if builder.template.order == "prefix" else 0.8
    return ExampleMaker(stdlib_corpus(), builder, eot_id=tokenizer.token_id(END_OF_TEXT), fim_rate=fim_rate)


def loss_for(model: Transformer, batch: torch.Tensor, spec: TrainSpec,
             teacher: Transformer | None) -> torch.Tensor:
    """Cross-entropy, mixed with KL(teacher || student) when distilling. A
    student whose output layer covers part of the vocabulary is scored there:
    the teacher's distribution renormalized over those tokens, and labels
    outside them ignored."""
    inputs, labels = batch[:, :-1], batch[:, 1:]
    subset = model.head_token_ids if model.config.head_vocab_size else None
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.lm_head(model.hidden_states(inputs, positions)).float()
    if subset is not None:
        index = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
        index[subset] = torch.arange(len(subset))
        labels = index[labels]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    if teacher is None:
        return ce
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        teacher_logits = teacher(inputs)
        target_logp = F.log_softmax(teacher_logits if subset is None else teacher_logits[..., subset], dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1), target_logp, log_target=True, reduction="batchmean")
    return spec.distill_weight * kl / inputs.shape[1] + (1 - spec.distill_weight) * ce


def frequent_tokens(tokenizer: TextTokenizer, n: int, chars: int = 8_000_000) -> torch.Tensor:
    """The `n` token ids most frequent in the corpus (its first `chars`
    characters, files in sorted order), sorted by id."""
    texts, total = [], 0
    for f in stdlib_corpus():
        texts.append(f.text)
        total += len(f.text)
        if total >= chars:
            break
    counts = torch.zeros(tokenizer.vocab_size, dtype=torch.long)
    for ids in tokenizer.encode_batch(texts):
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=tokenizer.vocab_size)
    return counts.topk(n).indices.sort().values


def drafter_from_teacher(model: Transformer, teacher: Transformer, head_ids: torch.Tensor) -> None:
    """Start `model` (a drafter config) from the teacher: embeddings (frozen),
    first layers, final norm; output rows from the teacher's for `head_ids`."""
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
        for mine, theirs in zip(model.model.layers, teacher.model.layers):
            mine.load_state_dict(theirs.state_dict())
        model.model.norm.load_state_dict(teacher.model.norm.state_dict())
        model.lm_head.weight.copy_(teacher.lm_head.weight[head_ids])
        if model.config.head_vocab_size:
            model.head_token_ids.copy_(head_ids)
    model.model.embed_tokens.weight.requires_grad_(False)


def train(run_dir: Path, spec: TrainSpec, tokenizer_dir: Path, checkpoint_minutes: float = 10,
          log=print, stop_after: int | None = None) -> Path:
    """Train (or resume) until `spec.steps`; returns the HF export directory.
    `stop_after` ends this run early (with a checkpoint) after that many steps."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    tokenizer = load_tokenizer(tokenizer_dir)
    teacher = load_model(spec.teacher, "fp32") if spec.teacher else None
    model = Transformer(spec.model)
    model.init_weights()
    if spec.from_teacher:
        n = spec.model.head_vocab_size
        drafter_from_teacher(model, teacher, frequent_tokens(tokenizer, n) if n else torch.arange(spec.model.vocab_size))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.lr, betas=(0.9, 0.95),
                            weight_decay=spec.weight_decay)
    step = 0
    state_path = run_dir / "state.pt"
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["spec"] != msgspec.to_builtins(spec):
            raise SystemExit(f"{state_path}: was written for other settings; use another --run-dir")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step = state["step"]
        log(f"resumed {state_path} at step {step}")
    elif spec.init_from:
        model.load_state_dict(load_model(spec.init_from, "fp32", target=teacher).state_dict())
        log(f"starting from the weights of {spec.init_from}")
    examples = make_examples(tokenizer, spec.seq_len, spec.template)
    log(f"{spec.model.num_parameters() / 1e6:.2f}M parameters, {spec.steps} steps of "
        f"{spec.rows}x{spec.seq_len} tokens" + (f", distilling {spec.teacher}" if teacher else ""))

    def checkpoint() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"spec": msgspec.to_builtins(spec), "model": model.state_dict(),
                    "optimizer": opt.state_dict(), "step": step}, tmp)
        tmp.replace(state_path)
        save_model(model, run_dir / "hf", tokenizer)

    started, last_save, first_step, smooth = time.time(), time.time(), step, None
    model.train()
    last_step = spec.steps if stop_after is None else min(spec.steps, step + stop_after)
    while step < last_step:
        for group in opt.param_groups:
            group["lr"] = learning_rate(spec, step)
        batch = examples.batch(spec.seed, step, spec.rows, spec.seq_len)
        loss = loss_for(model, batch, spec, teacher)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % 10 == 0 or step == spec.steps:
            elapsed = time.time() - started
            per_step = elapsed / (step - first_step)
            log(f"step {step}/{spec.steps}  loss {smooth:.3f}  "
                f"{spec.rows * spec.seq_len / per_step:,.0f} tok/s  "
                f"lr {learning_rate(spec, step):.2e}  ETA {(spec.steps - step) * per_step / 60:.1f} min")
        if time.time() - last_save > checkpoint_minutes * 60:
            checkpoint()
            last_save = time.time()
            log(f"checkpoint at step {step}")
    checkpoint()
    log(f"{'done' if step == spec.steps else 'paused'} at step {step}: {run_dir / 'hf'}")
    return run_dir / "hf"
