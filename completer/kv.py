"""A static, contiguous KV cache (gpt-fast style): one slot per position.

It implements `model.AttentionBackend`. The engine replaces it with a paged
block pool; this one serves one-shot completions, evaluation and tests.
"""

from __future__ import annotations

import torch

from completer.model import ModelConfig, attention_fp32


class StaticKVCache:
    """K/V for `batch` sequences of up to `max_len` positions, slot == position."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        if int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} beyond the cache's {self.max_len} slots")
        rows = torch.arange(q.shape[0], device=q.device)[:, None]
        # [B, T, H, D] views so that (row, position) pairs index the write.
        self.k[layer].transpose(1, 2)[rows, positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer].transpose(1, 2)[rows, positions] = v.transpose(1, 2).to(self.v.dtype)
        # Attend over slots [0, last position]; each query sees slots <= its position.
        span = int(positions.max()) + 1
        slots = torch.arange(span, device=q.device)
        mask = slots[None, None, None, :] <= positions[:, None, :, None]
        return attention_fp32(q, self.k[layer, :, :, :span], self.v[layer, :, :, :span], mask)
