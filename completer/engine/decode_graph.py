"""Decode steps on the GPU path: the Triton paged-attention kernel reads K/V
through the block tables in place (no gather copy). Plain steps (one new token
per sequence) are captured on CUDA as one CUDA graph per padded batch size and
replayed, so a step costs one launch instead of hundreds; passes of a few new
tokens per sequence (speculative verify, short warm prefills) run eagerly
through `KernelBatch`.

Everything a step reads lives in static buffers that `run` fills first: the
new tokens and their positions, the block tables, context lengths and the
slot each new K/V goes to. Rows past the real batch point at scratch block 0.
Without CUDA (tests on CPU under TRITON_INTERPRET=1) the same body runs
eagerly, so all but the capture itself is tested here.
"""

from __future__ import annotations

import torch

from completer.engine.paged_kv import KVPool, write_new_kv
from completer.model import Transformer

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32)


class StaticDecodeBackend:
    """`model.AttentionBackend` over static tables: writes each row's new K/V
    at its slot, then attends with the Triton kernel."""

    def __init__(self, pool: KVPool, batch: int, max_blocks: int):
        device = pool.k.device
        self.pool = pool
        self.tables = torch.zeros(batch, max_blocks, dtype=torch.int32, device=device)
        self.lens = torch.ones(batch, dtype=torch.int32, device=device)
        self.slots = torch.zeros(batch, dtype=torch.long, device=device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        from completer_kernels.paged_attention import paged_decode_attention

        kp, vp = self.pool.k[layer], self.pool.v[layer]
        kp.index_copy_(0, self.slots, k[:, :, 0].to(kp.dtype))
        vp.index_copy_(0, self.slots, v[:, :, 0].to(vp.dtype))
        out = paged_decode_attention(q[:, :, 0].float().contiguous(), kp, vp, self.tables, self.lens,
                                     self.pool.block_size)
        return out[:, :, None].to(q.dtype)


class KernelBatch:
    """`model.AttentionBackend` for a few new tokens per row (up to MAX_NEW):
    each new token is one query of the paged kernel, reading its row's block
    table up to its own position, which makes it causal among the new tokens.
    The same K/V blocks are read once per query; at verify widths (k + 1 <= 9)
    that stays in cache, where a gather would copy the whole context."""

    MAX_NEW = 16

    def __init__(self, pool: KVPool, tables: list[list[int]], positions: torch.Tensor, num_new: list[int]):
        """positions: [B, T] of the new tokens (padding past num_new[b] repeats the last one)."""
        device, bs = pool.k.device, pool.block_size
        B, T = positions.shape
        width = -(-(int(positions.max()) + 1) // bs)
        table = torch.zeros(B, width, dtype=torch.long)
        for b, row in enumerate(tables):
            row = row[:width]
            table[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        valid = torch.arange(T)[None, :] < torch.tensor(num_new)[:, None]
        slots = table.gather(1, positions // bs) * bs + positions % bs
        self.pool = pool
        self.write_slots = slots[valid].to(device)
        self.valid = valid.to(device)
        self.tables = table.int().repeat_interleave(T, 0).to(device)  # one row per query
        self.lens = (positions + 1).flatten().int().to(device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        from completer_kernels.paged_attention import paged_decode_attention

        kp, vp = write_new_kv(self.pool, layer, k, v, self.write_slots, self.valid)
        B, H, T, D = q.shape
        queries = q.transpose(1, 2).reshape(B * T, H, D).float().contiguous()
        out = paged_decode_attention(queries, kp, vp, self.tables, self.lens, self.pool.block_size)
        return out.view(B, T, H, D).transpose(1, 2).to(q.dtype)


class _Bucket:
    """Static inputs and output of one padded batch size, and its graph."""

    def __init__(self, model: Transformer, pool: KVPool, batch: int, max_blocks: int):
        device = pool.k.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.backend = StaticDecodeBackend(pool, batch, max_blocks)
        self.model = model
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def body(self) -> None:
        hidden = self.model.hidden_states(self.tokens, self.positions, self.backend)
        self.logits = self.model.logits(hidden[:, 0])

    def capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, FP8 GEMMs are chosen
            for _ in range(2):
                self.body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.body()


class DecodeGraphs:
    def __init__(self, model: Transformer, pool: KVPool, max_blocks: int, capture: bool):
        self.model, self.pool, self.max_blocks = model, pool, max_blocks
        self.capture = capture and pool.k.device.type == "cuda"
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def fits(batch: int) -> bool:
        return batch <= GRAPH_BATCHES[-1]

    @torch.inference_mode()
    def run(self, tables: list[list[int]], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """One new token per row at `positions` (block tables already grown).
        Returns logits [B, V] (fp32)."""
        n, bs = len(tokens), self.pool.block_size
        size = next(b for b in GRAPH_BATCHES if b >= n)
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = _Bucket(self.model, self.pool, size, self.max_blocks)
        table = torch.zeros(size, self.max_blocks, dtype=torch.int32)
        for b, row in enumerate(tables):
            table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        pos = torch.zeros(size, dtype=torch.long)
        pos[:n] = torch.tensor(positions)
        slots = torch.zeros(size, dtype=torch.long)  # padding rows: scratch block 0
        slots[:n] = torch.tensor([row[p // bs] * bs + p % bs for row, p in zip(tables, positions)])
        ids = torch.zeros(size, dtype=torch.long)
        ids[:n] = torch.tensor(tokens)
        be = bucket.backend
        be.tables.copy_(table, non_blocking=True)
        be.lens.copy_((pos + 1).int(), non_blocking=True)
        be.slots.copy_(slots, non_blocking=True)
        bucket.positions.copy_(pos[:, None], non_blocking=True)
        bucket.tokens.copy_(ids[:, None], non_blocking=True)
        if self.capture and bucket.graph is None:
            bucket.capture()
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.body()
        return bucket.logits[:n]
