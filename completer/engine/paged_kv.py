"""The paged K/V tensors of one model, stored in `engine.kv_dtype` (fp32 by
default, or fp16 / bf16: half the bytes); attention's math is fp32 whatever
the storage.

Layout: `k[layer]` is [num_blocks * block_size, kv_heads, head_dim], so the
K/V of token t of a sequence sit at slot `table[t // bs] * bs + t % bs`. A
block is a contiguous [block_size, kv_heads, head_dim] slab, simple to fill
from another process (a KV connector's prefill worker).

`kv_cache_problem` checks at start, from the models' shapes, that the pools
`engine.kv_cache_mb` gives hold one request over the whole window.
"""

from __future__ import annotations

import math

import torch

from completer.config import ConfigProblem, EngineConfig, SpecConfig
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


# Budget, in MB, over which pool_blocks' rounding down is negligible: MB per
# block measured on it is exact to a millionth for any model (no memory is taken).
_PROBE_MB = 2.0 ** 20


def kv_cache_problem(engine: EngineConfig, spec: SpecConfig, context_tokens: int,
                     models: dict[str, ModelConfig]) -> ConfigProblem | None:
    """Whether one request over the whole window fits each KV pool.

    models: role ("target", and "draft" when the drafter runs) -> its shape.
    The engine refuses a request whose worst case exceeds a pool
    (`KVCacheManager.too_large`); when not even a full-window request fits,
    every long prompt would be refused, so the start stops instead."""
    dtype = KV_DTYPES[engine.kv_dtype]

    # As EngineCore.build splits the budget between the pools.
    share = {"target": 1 - spec.draft_share, "draft": spec.draft_share} if "draft" in models else {"target": 1.0}
    # KVCacheManager.worst_case of a full window: prompt + completion = context_tokens,
    # plus a last verify pass of k_max + 1 tokens; and block 0, the scratch block.
    need = -(-(context_tokens + spec.k_max + 1) // engine.block_size) + 1
    for role, cfg in models.items():
        have = pool_blocks(cfg, engine.kv_cache_mb * share[role], engine.block_size, dtype)
        if have >= need:
            continue
        mb_per_block = _PROBE_MB / pool_blocks(cfg, _PROBE_MB, engine.block_size, dtype)
        enough = math.ceil(need * mb_per_block / share[role] * 10) / 10
        while pool_blocks(cfg, enough * share[role], engine.block_size, dtype) < need:  # float rounding: a step or two
            enough = round(enough + 0.1, 1)
        share_hint = " (or raise spec.draft_share)" if role == "draft" else ""
        return ConfigProblem(
            ("engine.kv_cache_mb", "spec.draft_share", "model.context_tokens"),
            f"engine.kv_cache_mb = {engine.kv_cache_mb} gives the {role} model {have} KV blocks of "
            f"{engine.block_size} tokens; one request over the whole window (model.context_tokens = "
            f"{context_tokens}, plus {spec.k_max + 1} tokens of a last verify pass) needs {need} with the "
            f"scratch block: set engine.kv_cache_mb to at least {enough}{share_hint}")
    return None
