"""A model with its own paged KV cache (the target has one, the drafter another).

`forward` runs B rows of new tokens, each continuing its sequence from what
the cache holds, writes their K/V and advances the sequence's `computed`;
`rollback` takes back K/V of rejected drafts; `publish` offers the full blocks
of accepted tokens to the prefix cache.
"""

from __future__ import annotations

import time

import torch

from completer.engine.block_manager import BlockManager, chain_hashes
from completer.engine.decode_graph import DecodeGraphs, KernelBatch
from completer.engine.paged_kv import KVPool, PagedBatch
from completer.engine.sequence import CacheState
from completer.model import Transformer


class CachedModel:
    def __init__(self, model: Transformer, num_blocks: int, block_size: int,
                 prefix_cache: bool = True, kv_dtype: torch.dtype = torch.float32,
                 paged_kernel: bool = False, cuda_graphs: bool = False):
        """paged_kernel: passes of up to KernelBatch.MAX_NEW new tokens per row
        through the Triton paged-attention kernel (decode_graph.py); plain
        decode steps captured as CUDA graphs if `cuda_graphs`."""
        self.model = model
        self.device = next(model.parameters()).device
        self.pool = KVPool(model.config, num_blocks, block_size, kv_dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache)
        self.block_size = block_size
        self.graphs = None
        if paged_kernel:
            max_blocks = min(-(-model.config.max_position_embeddings // block_size), num_blocks - 1)
            self.graphs = DecodeGraphs(model, self.pool, max_blocks, cuda_graphs)

    def attach(self, state: CacheState, tokens: list[int]) -> int:
        """Start a sequence: reuse cached blocks of its prompt; returns the number
        of prompt tokens whose K/V came from cache."""
        state.table = self.blocks.match_prefix(tokens)
        state.computed = len(state.table) * self.block_size
        state.hashes = chain_hashes(tokens[: state.computed], self.block_size)
        return state.computed

    def release(self, state: CacheState) -> None:
        self.blocks.release(state.table)
        state.table, state.computed, state.hashes = [], 0, []

    @torch.inference_mode()
    def forward(self, states: list[CacheState], rows: list[list[int]],
                last_only: bool = False) -> torch.Tensor:
        """Run each row's tokens at positions state.computed onward. Returns
        logits [B, T, V] (rows padded to the longest), or [B, V] for each row's
        last token with `last_only`. Grows block tables; advances `computed`."""
        if self.graphs is not None and self.graphs.fits(len(rows)) and all(len(r) == 1 for r in rows):
            return self._plain_decode(states, rows, last_only)
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (state, row) in enumerate(zip(states, rows)):
            self.blocks.grow(state.table, state.computed + len(row))
            tokens[b, : len(row)] = torch.tensor(row)
            # Padding repeats the last real position: harmless, never written.
            span = torch.arange(state.computed, state.computed + width)
            positions[b] = span.clamp(max=state.computed + len(row) - 1)
        backend = KernelBatch if self.graphs is not None and width <= KernelBatch.MAX_NEW else PagedBatch
        batch = backend(self.pool, [s.table for s in states], positions, [len(r) for r in rows])
        hidden = self.model.hidden_states(tokens.to(self.device), positions.to(self.device), batch)
        for state, row in zip(states, rows):
            state.computed += len(row)
        if last_only:
            last = torch.tensor([len(r) - 1 for r in rows], device=self.device)
            hidden = hidden[torch.arange(len(rows), device=self.device), last]
        return self.model.logits(hidden)

    def _plain_decode(self, states: list[CacheState], rows: list[list[int]], last_only: bool) -> torch.Tensor:
        for state in states:
            self.blocks.grow(state.table, state.computed + 1)
        logits = self.graphs.run([s.table for s in states], [s.computed for s in states], [r[0] for r in rows])
        for state in states:
            state.computed += 1
        return logits if last_only else logits[:, None]

    def time_passes(self, batch: int, widths: list[int], context: int, reps: int) -> dict[int, float]:
        """Median seconds of a pass adding `width` tokens to each of `batch`
        dummy sequences of `context` tokens (nothing if the pool is too small)."""
        need = batch * -(-(context + max(widths)) // self.block_size)
        if need > self.blocks.num_free:
            return {}
        states = [CacheState() for _ in range(batch)]
        self.forward(states, [[1] * context] * batch, last_only=True)
        timed = {}
        for width in widths:
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                int(self.forward(states, [[1] * width] * batch).argmax())  # waits for the result
                times.append(time.perf_counter() - started)
                for state in states:
                    self.rollback(state, context)
            timed[width] = sorted(times)[len(times) // 2]
        for state in states:
            self.release(state)
        return timed

    def publish(self, state: CacheState, tokens: list[int]) -> None:
        """tokens[:state.computed] are accepted: offer their newly full blocks to
        the prefix cache."""
        bs = self.block_size
        full = state.computed // bs
        if len(state.hashes) < full:
            parent = state.hashes[-1] if state.hashes else None
            start = len(state.hashes) * bs
            state.hashes += chain_hashes(tokens[start: full * bs], bs, parent)
            self.blocks.register_hashes(state.table, state.hashes)

    def rollback(self, state: CacheState, computed: int) -> None:
        """Forget K/V past `computed` tokens (rejected drafts) and their blocks."""
        state.computed = min(state.computed, computed)
        self.blocks.truncate(state.table, state.computed)
