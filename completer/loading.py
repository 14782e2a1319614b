"""Find and load a model directory with its tokenizer and FIM template."""

from __future__ import annotations

from pathlib import Path

import msgspec

import torch

from completer.checkpoint import CheckpointError, load_model, load_tokenizer, resolve_precision
from completer.fp8 import has_fp8_tensor_cores
from completer.model import Transformer
from completer.prompt import FimTemplate, PromptBuilder, get_template, marker_id
from completer.tokenizer import TextTokenizer

# The embedded default models ship inside the package.
PACKAGED_MODELS = Path(__file__).parent / "models"
DEFAULT_TARGET = PACKAGED_MODELS / "target"
DEFAULT_DRAFT = PACKAGED_MODELS / "draft"


class LoadedModel(msgspec.Struct):
    name: str
    directory: Path
    model: Transformer
    tokenizer: TextTokenizer
    template: FimTemplate
    precision: str = "fp32"  # as resolved ("auto" is never stored)
    device: str = "cpu"

    def describe_precision(self) -> str:
        if self.precision == "fp8" and not has_fp8_tensor_cores(torch.device(self.device)):
            return f"fp8 (emulated: no FP8 tensor cores on {self.device}; quantize, dequantize, fp32 matmul)"
        return self.precision

    def prompt_builder(self, budget: int) -> PromptBuilder:
        return PromptBuilder(self.tokenizer, self.template, budget)


def detect_template(tokenizer: TextTokenizer) -> str:
    """The FIM family whose special tokens the tokenizer has."""
    if tokenizer.token_id("<|repo_name|>") is not None:
        return "qwen2.5-coder"
    if tokenizer.token_id("<|fim_prefix|>") is not None:
        return "default"
    if tokenizer.token_id("<fim_prefix>") is not None:
        return "starcoder"
    if marker_id(tokenizer, "<PRE>") is not None:
        return "codellama"
    raise CheckpointError(f"{tokenizer.path}: no fill-in-the-middle tokens; name a template in the config")


def load(directory: str | Path, precision: str = "fp32", template: str | None = None,
         order: str | None = None, device: str = "cpu") -> LoadedModel:
    directory = Path(directory)
    precision = resolve_precision(precision, device)
    model = load_model(directory, precision, device)
    tokenizer = load_tokenizer(directory)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(f"{directory / 'tokenizer.json'}: {tokenizer.vocab_size} tokens, "
                              f"but config.json declares vocab_size {model.config.vocab_size}")
    fim = get_template(template or detect_template(tokenizer), order)
    name = directory.name if directory.parent != PACKAGED_MODELS else f"completer-default-{directory.name}"
    return LoadedModel(name, directory, model, tokenizer, fim, precision, str(device))
