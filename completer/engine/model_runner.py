"""Runs one model over its paged K/V pool (the target has one, the drafter another).

`execute` takes B rows of new tokens, each continuing its sequence from what
the pool holds (the KV cache manager has already given the rows their
blocks), builds the pass's `AttentionMetadata` once, runs the model through
the chosen attention backend and returns the logits. It does not advance a
sequence's `computed`: whoever applies the pass's output does
(`kv_cache_manager.advance`). Plain decode steps go through CUDA graphs where enabled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Callable, Literal

import torch

from completer.engine.attention import AttentionMetadata, TorchAttention, TritonAttention
from completer.engine.cuda_graphs import DecodeGraphs
from completer.engine.fused_cpu import FusedCpuLayers
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState
from completer.model import Transformer, apply_rope


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's CPU threads for this thread meanwhile (n 0: unchanged)."""
    before = torch.get_num_threads()
    if n and n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n and n != before:
            torch.set_num_threads(before)


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool, attention: Literal["torch", "triton"] = "torch",
                 cuda_graphs: bool = False, fused: FusedCpuLayers | None = None, torch_threads: int = 0):
        """attention "triton": passes of up to TritonAttention.MAX_NEW new tokens
        per row read K/V through the paged kernel; plain decode steps replay
        CUDA graphs if `cuda_graphs` (on CUDA). `fused`: passes it fits run
        through the fused CPU layer. `torch_threads`: torch's CPU threads for a
        pass through torch's ops (0: as the caller set them)."""
        self.fused = fused
        self.torch_threads = torch_threads
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.block_size = pool.block_size
        self.attention = attention
        self.graphs = None
        if attention == "triton":
            max_blocks = min(-(-model.config.max_position_embeddings // self.block_size), pool.num_blocks - 1)
            self.graphs = DecodeGraphs(model, pool, max_blocks, cuda_graphs)

    @torch.inference_mode()
    def copy_moved(self, src_slots: list[int], dst_slots: list[int], shift: int) -> None:
        """K/V of the tokens in `src_slots` into `dst_slots`, `shift` positions
        later (or earlier): keys turned by the rotation of `shift` positions
        (without YaRN's scale, which they already carry), values as they are."""
        src = torch.tensor(src_slots, device=self.device)
        dst = torch.tensor(dst_slots, device=self.device)
        layers = range(self.pool.k.shape[0])  # each layer turned by its own frequencies (Gemma 3's differ)
        angles = shift * torch.stack([self.model.layer_inv_freq(layer).float() for layer in layers])
        angles = torch.cat((angles, angles), -1)[:, None, None, :]  # [layers, 1, 1, head dim]
        k = self.pool.k.index_select(1, src).float()  # [layers, n, kv heads, head dim]
        self.pool.k.index_copy_(1, dst, apply_rope(k, angles.cos(), angles.sin()).to(self.pool.k.dtype))
        self.pool.v.index_copy_(1, dst, self.pool.v.index_select(1, src))

    def execute(self, states: list[CacheState], rows: list[list[int]], last_only: bool = False,
                layer_written: Callable[[int], None] | None = None, last: int = 0,
                interrupted: Callable[[], bool] | None = None, starts: list[int] | None = None) -> torch.Tensor:
        """Run each row's tokens at positions `starts` (default: state.computed)
        onward. Returns logits [B, T, V] (rows padded to the longest), [B, V]
        for each row's last token with `last_only`, or [B, last, V] for each
        row's `last` last tokens. `layer_written(l)` is called once layer
        l's new K/V are in the pool (a prefill worker ships them while the
        next layers run). `interrupted()`, asked before each layer, may give
        the pass up (`attention.PassInterrupted`)."""
        return self.start(states, rows, last_only, layer_written, last, interrupted, starts).run()

    @torch.inference_mode()
    def start(self, states: list[CacheState], rows: list[list[int]], last_only: bool = False,
              layer_written: Callable[[int], None] | None = None, last: int = 0,
              interrupted: Callable[[], bool] | None = None, starts: list[int] | None = None) -> "Pass":
        """`execute`'s pass, not yet run: `Pass.run` runs it, and may stop it
        between layers to go on later (bulk work making way for a keystroke)."""
        lens = [len(r) for r in rows]
        width = max(lens)
        plain = (self.graphs is not None and width == 1 and self.graphs.fits(len(rows)) and layer_written is None
                 and last <= 1)
        starts = [s.computed for s in states] if starts is None else starts
        meta = AttentionMetadata.build([s.table for s in states], starts, lens,
                                       self.block_size, "cpu" if plain else self.device)
        if plain:
            def graph() -> Iterator[torch.Tensor]:
                logits = self.graphs.run([r[0] for r in rows], meta)
                yield logits if last_only else logits[:, None]
            return Pass(graph(), lambda logits: logits, contextlib.nullcontext)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for b, row in enumerate(rows):
            tokens[b, : len(row)] = torch.tensor(row)
        if self.fused is not None and self.fused.fits(len(rows), width):
            layers = self.fused.hidden_state_layers(tokens, meta, self.pool, layer_written, interrupted)
            head, context = self.fused.head, self.fused.alone
        else:
            triton = self.attention == "triton" and width <= TritonAttention.MAX_NEW
            backend = (TritonAttention if triton else TorchAttention)(self.pool, meta, layer_written, interrupted)
            layers = self.model.hidden_state_layers(tokens.to(self.device), meta.positions, backend)
            head, context = None, lambda: torch_threads(self.torch_threads)
        return Pass(layers,
                    lambda hidden: self.model.logits(self._last(hidden, lens, last_only, last), head), context)

    def _last(self, hidden: torch.Tensor, lens: list[int], last_only: bool, last: int) -> torch.Tensor:
        """The hidden states whose logits `execute` returns."""
        if last_only:
            ends = torch.tensor([n - 1 for n in lens], device=self.device)
            return hidden[torch.arange(len(lens), device=self.device), ends]
        if last:
            at = torch.tensor([[max(0, n - last + j) for j in range(last)] for n in lens], device=self.device)
            return hidden[torch.arange(len(lens), device=self.device)[:, None], at]
        return hidden


class Pass:
    """One model pass over the pool, run a layer at a time. `run` may stop it
    before a layer (its K/V so far written past each row's `computed`, into
    blocks only its sequences hold) and a later `run` goes on from there."""

    def __init__(self, layers: Iterator[torch.Tensor | None],
                 finish: Callable[[torch.Tensor], torch.Tensor], context: Callable[[], contextlib.AbstractContextManager]):
        self.layers = layers  # None before each layer, then the final hidden states (or logits)
        self.finish = finish
        self.context = context  # entered around each run: the threads the pass computes with
        self.layers_run = 0  # by the last `run`

    @torch.inference_mode()
    def run(self, pause: Callable[[], bool] | None = None) -> torch.Tensor | None:
        """The pass's logits; or None if `pause()`, asked before each layer, said to stop."""
        self.layers_run = 0
        with self.context():
            for hidden in self.layers:
                if hidden is not None:
                    break
                if pause is not None and pause():
                    return None
                self.layers_run += 1
            return self.finish(hidden)
