"""Find and load a model directory with its tokenizer and FIM template."""

from __future__ import annotations

import ctypes
from pathlib import Path

import msgspec

import torch

from completer.checkpoint import CheckpointError, load_checkpoint, load_tokenizer, resolve_precision
from completer.cpu_quant import CPU_PRECISIONS, bound_kernel_caches, keep_dense_int4
from completer.fp8 import has_fp8_tensor_cores
from completer.gguf_checkpoint import forget_opened
from completer.model import Transformer
from completer.model_store import PACKAGED_MODELS, resolve_draft, resolve_target
from completer.prompt import FimTemplate, PromptBuilder, get_template, marker_id
from completer.tokenizer import TextTokenizer



# glibc's: hands freed heap back to the system (engine.py trims so when idle).
_malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)


class LoadedModel(msgspec.Struct):
    name: str
    directory: Path
    model: Transformer | None  # None: a cluster's front door (names, tokenizer and template; no weights)
    tokenizer: TextTokenizer
    template: FimTemplate
    precision: str = "fp32"  # as resolved ("auto" is never stored)
    device: str = "cpu"

    def describe_precision(self) -> str:
        if self.precision == "fp8" and not has_fp8_tensor_cores(torch.device(self.device)):
            return f"fp8 (emulated: no FP8 tensor cores on {self.device}; quantize, dequantize, fp32 matmul)"
        return self.precision

    def prompt_builder(self, budget: int, grid: str = "content") -> PromptBuilder:
        return PromptBuilder(self.tokenizer, self.template, budget, grid=grid)


def model_name(directory: Path) -> str:
    """The name clients see (`ready.model`)."""
    return directory.name if directory.parent != PACKAGED_MODELS else f"completer-embedded-{directory.name}"


def detect_template(tokenizer: TextTokenizer) -> str:
    """The FIM family whose special tokens the tokenizer has; `prefix` (the
    prefix alone, no markers) when it has none."""
    if tokenizer.token_id("<|repo_name|>") is not None:
        return "qwen2.5-coder"
    if tokenizer.token_id("<｜fim▁begin｜>") is not None:
        return "deepseek-coder"
    if tokenizer.token_id("<|fim_prefix|>") is not None:
        return "codegemma" if tokenizer.token_id("<|file_separator|>") is not None else "default"
    if tokenizer.token_id("<fim_prefix>") is not None:
        return "starcoder"  # StarCoder 1/2, Granite Code, SmolLM
    if marker_id(tokenizer, "<PRE>") is not None:
        return "codellama"
    return "prefix"


def load(directory: str | Path, precision: str = "fp32", template: str | None = None,
         order: str | None = None, device: str = "cpu", target: LoadedModel | None = None,
         fuse: bool = True) -> LoadedModel:
    """A model with its tokenizer and template, ready to serve (`fuse`: one
    GEMM for q/k/v and one for gate/up); `target` for a drafter that reads
    its target's embeddings."""
    directory = Path(directory)
    precision = resolve_precision(precision, device, directory)
    model, tokenizer = load_checkpoint(directory, precision, device, target.model if target else None, fuse)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{tokenizer.path}: {tokenizer.vocab_size} tokens, "
                              f"but the model's vocabulary has {model.config.vocab_size}")
    fim = get_template(template or detect_template(tokenizer), order)
    return LoadedModel(model_name(directory), directory, model, tokenizer, fim, precision, str(device))


def load_models(target: str | Path = "default", draft: str | Path = "default", precision: str = "auto",
                template: str | None = None, order: str | None = None, device: str = "cpu",
                fuse: bool = True, int4_dense_rows: int = 0,
                kernel_cache_entries: int = 128) -> tuple[LoadedModel, LoadedModel | None]:
    """Target and drafter from their settings ("default", "embedded", a path;
    a drafter "" is none), as `completer serve` loads them. `int4_dense_rows`:
    at int4, passes of that many rows or more multiply by a resident bf16
    copy of the weights (`model.int4_dense_rows`); `kernel_cache_entries`:
    `bound_kernel_caches`."""
    bound_kernel_caches(kernel_cache_entries)
    target_path = resolve_target(target)
    draft_path = resolve_draft(str(draft), target_path)
    loaded = load(target_path, precision, template, order, device, fuse=fuse)
    drafter = load(draft_path, precision, template, order, device, loaded, fuse) if draft_path else None
    for model in (loaded, drafter):
        if model is not None and model.precision in CPU_PRECISIONS:
            keep_dense_int4(model.model, int4_dense_rows)
    forget_opened()
    if _malloc_trim is not None:  # the layers' fp32 weights, freed while loading: ~450 MB back at 0.5B's shape
        _malloc_trim(0)
    return loaded, drafter


def load_faces(target: str | Path = "default", draft: str | Path = "default", precision: str = "auto",
               template: str | None = None, order: str | None = None,
               device: str = "cpu") -> tuple[LoadedModel, LoadedModel | None]:
    """What a cluster's front door needs of the models it serves through its
    replicas: names, the tokenizer and the FIM template (prompts are built
    there), no weights."""
    def face(directory: Path) -> LoadedModel:
        tokenizer = load_tokenizer(directory)
        fim = get_template(template or detect_template(tokenizer), order)
        return LoadedModel(model_name(directory), directory, None, tokenizer, fim, resolve_precision(precision, device, directory),
                           str(device))

    target_path = resolve_target(target)
    draft_path = resolve_draft(str(draft), target_path)
    return face(target_path), face(draft_path) if draft_path else None
