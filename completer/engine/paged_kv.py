"""The paged K/V tensors and the attention backend that reads them through
block tables (a torch gather + fp32 SDPA; the GPU path swaps in a Triton
paged-attention kernel that needs no gather copy).

Layout: `k[layer]` is [num_blocks * block_size, kv_heads, head_dim], so the
K/V of token t of a sequence sit at slot `table[t // bs] * bs + t % bs`. A
block is a contiguous [block_size, kv_heads, head_dim] slab, simple to fill
from another process (disaggregated prefill).
"""

from __future__ import annotations

import torch

from completer.model import ModelConfig, attention_fp32


def pool_blocks(cfg: ModelConfig, budget_mb: float, block_size: int, dtype: torch.dtype) -> int:
    """How many blocks of K and V fit in `budget_mb`."""
    per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * \
        torch.tensor([], dtype=dtype).element_size()
    return int(budget_mb * 2**20 // per_block)


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (cfg.num_hidden_layers, num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Zeroed on one thread: a parallel fill would give the building thread an
        # OpenMP team for good (see engine.run_in_passing_thread).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        finally:
            torch.set_num_threads(threads)
        self.block_size = block_size
        self.num_blocks = num_blocks


def write_new_kv(pool: KVPool, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                 valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of the real new tokens ([B, Hkv, T, D]; `valid` [B, T] marks them)
    into their `slots`; returns the layer's K and V pools.
    (index_copy_: several times faster than [] assignment on CPU.)"""
    kp, vp = pool.k[layer], pool.v[layer]
    kp.index_copy_(0, slots, k.transpose(1, 2)[valid].to(kp.dtype))
    vp.index_copy_(0, slots, v.transpose(1, 2)[valid].to(vp.dtype))
    return kp, vp


class PagedBatch:
    """One forward pass over B sequences, each bringing new tokens at given
    positions (padded to the longest). Implements `model.AttentionBackend`."""

    def __init__(self, pool: KVPool, tables: list[list[int]], positions: torch.Tensor,
                 num_new: list[int]):
        """positions: [B, T] of the new tokens (padding past num_new[b] is ignored)."""
        bs = pool.block_size
        self.pool = pool
        device = pool.k.device
        B, T = positions.shape
        context = [int(positions[b, n - 1]) + 1 for b, n in enumerate(num_new)]
        span = max(context)
        # Slot of every cached position each row reads (scratch block 0 past its end).
        read = torch.zeros(B, span, dtype=torch.long)
        for b, table in enumerate(tables):
            blocks = torch.tensor(table[: -(-context[b] // bs)], dtype=torch.long)
            slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[: context[b]]
            read[b, : context[b]] = slots
        valid = torch.arange(T)[None, :] < torch.tensor(num_new)[:, None]
        write = read.gather(1, positions.clamp(max=span - 1))
        self.write_slots = write[valid].to(device)  # only real tokens are written
        self.valid = valid.to(device)
        self.read_slots = read.to(device)
        self.read_flat = self.read_slots.flatten()
        # One sequence needs no mask to decode one token (it sees everything), and
        # none to prefill from position 0 (plain causal: SDPA's fast kernel).
        self.causal = B == 1 and T == span and T > 1
        self.mask = None
        if not (B == 1 and (T == 1 or self.causal)):
            keys = torch.arange(span)[None, None, None, :]
            self.mask = (keys <= positions[:, None, :, None]).to(device)  # [B, 1, T, S]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        kp, vp = write_new_kv(self.pool, layer, k, v, self.write_slots, self.valid)
        B, S = self.read_slots.shape  # index_select: faster than [] indexing on CPU
        keys = kp.index_select(0, self.read_flat).view(B, S, *kp.shape[1:]).transpose(1, 2)  # [B, Hkv, S, D]
        values = vp.index_select(0, self.read_flat).view(B, S, *vp.shape[1:]).transpose(1, 2)
        return attention_fp32(q, keys, values, self.mask, causal=self.causal)
