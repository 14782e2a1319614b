"""The paged K/V tensors of one model, stored in `engine.kv_dtype` (fp32 by
default, or fp16 / bf16: half the bytes); attention's math is fp32 whatever
the storage.

Layout: `k[layer]` is [num_blocks * block_size, kv_heads, head_dim], so the
K/V of token t of a sequence sit at slot `table[t // bs] * bs + t % bs`. A
block is a contiguous [block_size, kv_heads, head_dim] slab, simple to fill
from another process (a KV connector's prefill worker).
"""

from __future__ import annotations

import torch

from completer.model import ModelConfig


KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pool_blocks(cfg: ModelConfig, budget_mb: float, block_size: int, dtype: torch.dtype = torch.float32) -> int:
    """How many blocks of K and V fit in `budget_mb`."""
    per_block = 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * dtype.itemsize
    return int(budget_mb * 2**20 // per_block)


class KVPool:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32):
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
        self.device = self.k.device
