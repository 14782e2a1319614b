"""Plain decode steps (one new token per row) captured as CUDA graphs, one
per padded batch size, and replayed: a step costs one launch instead of
hundreds. A graph reads its inputs from static buffers (tokens, and an
`AttentionMetadata` of static tensors) that each step fills first; rows past
the real batch point at scratch block 0. Without CUDA (tests on CPU under
TRITON_INTERPRET=1) the same body runs eagerly, so all but the capture is
tested on CPU.
"""

from __future__ import annotations

import torch

from completer.engine.attention import AttentionMetadata, TritonAttention
from completer.engine.paged_kv import KVPool
from completer.model import Transformer

GRAPH_BATCHES = (1, 2, 4, 8, 16, 32)


class _Bucket:
    """Static inputs and output of one padded batch size, and its graph."""

    def __init__(self, model: Transformer, pool: KVPool, batch: int, max_blocks: int):
        device = pool.device
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.meta = AttentionMetadata(
            positions=torch.zeros(batch, 1, dtype=torch.long, device=device),
            slot_mapping=torch.zeros(batch, dtype=torch.long, device=device),
            block_tables=torch.zeros(batch, max_blocks, dtype=torch.int32, device=device),
            context_lens=torch.ones(batch, dtype=torch.int32, device=device),
            query_lens=[1] * batch, max_context=max_blocks * pool.block_size)
        self.backend = TritonAttention(pool, self.meta)
        self.model = model
        self.logits: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def body(self) -> None:
        hidden = self.model.hidden_states(self.tokens, self.meta.positions, self.backend)
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
        self.capture = capture and pool.device.type == "cuda"
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def fits(batch: int) -> bool:
        return batch <= GRAPH_BATCHES[-1]

    @torch.inference_mode()
    def run(self, tokens: list[int], meta: AttentionMetadata) -> torch.Tensor:
        """One new token per row (`meta` built on the host). Returns logits [B, V]."""
        n = len(tokens)
        size = next(b for b in GRAPH_BATCHES if b >= n)
        bucket = self.buckets.get(size)
        if bucket is None:
            bucket = self.buckets[size] = _Bucket(self.model, self.pool, size, self.max_blocks)
        bucket.meta.copy_(meta)
        bucket.tokens.zero_()
        bucket.tokens[:n, 0].copy_(torch.tensor(tokens), non_blocking=True)
        if self.capture and bucket.graph is None:
            bucket.capture()
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.body()
        return bucket.logits[:n]
