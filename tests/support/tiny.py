"""Tiny random models and a small code tokenizer, shared by the tests (the
fixtures in conftest.py build on these)."""

from __future__ import annotations

from pathlib import Path

import torch

from completer.model import ModelConfig, Transformer
from completer.tokenizer import TextTokenizer, train_bpe

CODE = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n"


def tiny_config(**overrides) -> ModelConfig:
    """A two-layer Llama with grouped-query attention; any field overridden."""
    fields = dict(architecture="LlamaForCausalLM", vocab_size=320, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=512)
    return ModelConfig(**{**fields, **overrides})


def tiny_model(cfg: ModelConfig, seed: int = 0, scale: float | None = None) -> Transformer:
    """Random weights, seeded; `scale` > the default makes distributions peaky."""
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    if scale is None:
        model.init_weights()
    else:
        model.init_weights(scale)
    return model


def code_tokenizer(directory: Path, vocab_size: int = 320, text: str = CODE * 30) -> TextTokenizer:
    return train_bpe([text], vocab_size, directory)
