"""Attention over the paged pool: one metadata object per pass, two backends.

`AttentionMetadata` says where a pass's new K/V go and what each new token
reads: built once per pass by the model runner, shared by every layer. Rows
bring different numbers of new tokens and are padded to the longest; a
padding token repeats its row's last position and writes to scratch block 0,
which no real token reads.

Backends implement `model.AttentionBackend`: `attend` writes the layer's new
K/V (`write_kv`), then reads.
- `TorchAttention`: fp32 SDPA over each row's context: a slice of the pool
  when every row sits on consecutive blocks (the block manager allocates
  that way where it can), else a gathered copy (CPU, any width).
- `TritonAttention`: the paged kernel reads K/V through the block tables in
  place (no gather copy), one query per new token reading its table up to its
  own position (causal among the new tokens). At verify widths (k + 1 <= 9)
  the re-read blocks stay in cache, where a gather copies the whole context.
"""

from __future__ import annotations

from typing import Callable

import torch

from completer.engine.paged_kv import KVPool
from completer.model import attention_fp32, causal_mask


class AttentionMetadata:
    __slots__ = ("positions", "slot_mapping", "block_tables", "context_lens", "query_lens", "max_context",
                 "row_slices")

    def __init__(self, positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, query_lens: list[int], max_context: int,
                 row_slices: list[tuple[int, int]] | None = None):
        self.positions = positions  # [B, T] long
        self.slot_mapping = slot_mapping  # [B * T] long: where each new token's K/V goes
        self.block_tables = block_tables  # [B, W] int32
        self.context_lens = context_lens  # [B * T] int32: tokens each new token attends to
        self.query_lens = query_lens  # new tokens per row (host)
        self.max_context = max_context
        # (first slot, length) of each row's context when every row sits on
        # consecutive blocks (host); None otherwise.
        self.row_slices = row_slices

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], query_lens: list[int], block_size: int,
              device: torch.device | str = "cpu", width: int | None = None) -> "AttentionMetadata":
        """Rows continuing at `starts` with `query_lens` new tokens; `tables`
        already hold their blocks. `width`: block-table columns (default: the
        fewest that cover every row)."""
        B, T = len(starts), max(query_lens)
        start = torch.tensor(starts)[:, None]
        lens = torch.tensor(query_lens)[:, None]
        offsets = torch.arange(T)[None, :]
        positions = start + offsets.clamp(max=lens - 1)
        max_context = int((start + lens).max())
        width = width or -(-max_context // block_size)
        table = torch.zeros(B, width, dtype=torch.long)
        for b, row in enumerate(tables):
            row = row[:width]
            table[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        slots = table.gather(1, positions // block_size) * block_size + positions % block_size
        slots[offsets >= lens] = 0  # padding: scratch
        return cls(positions.to(device), slots.flatten().to(device), table.int().to(device),
                   (positions + 1).flatten().int().to(device), list(query_lens), max_context,
                   _row_slices(tables, starts, query_lens, block_size))

    def copy_(self, other: "AttentionMetadata") -> None:
        """Fill these (static, larger) buffers from `other`; rows past it point at scratch."""
        B, W = other.block_tables.shape
        for mine, theirs in ((self.positions, other.positions), (self.slot_mapping, other.slot_mapping),
                             (self.context_lens, other.context_lens)):
            mine.zero_()
            mine[: theirs.shape[0]].copy_(theirs, non_blocking=True)
        self.context_lens[other.context_lens.shape[0]:] = 1
        self.block_tables.zero_()
        self.block_tables[:B, :W].copy_(other.block_tables, non_blocking=True)


def _row_slices(tables: list[list[int]], starts: list[int], query_lens: list[int],
                block_size: int) -> list[tuple[int, int]] | None:
    slices = []
    for row, start, n in zip(tables, starts, query_lens):
        length = start + n
        used = row[: -(-length // block_size)]
        if used[-1] - used[0] != len(used) - 1 or any(b - a != 1 for a, b in zip(used, used[1:])):
            return None
        slices.append((used[0] * block_size, length))
    return slices


class PassInterrupted(Exception):
    """A pass given up between layers: every sequence in it was cancelled."""


class PagedAttention:
    def __init__(self, pool: KVPool, meta: AttentionMetadata, layer_written: Callable[[int], None] | None = None,
                 interrupted: Callable[[], bool] | None = None):
        """interrupted: asked before each layer; True gives the pass up
        (PassInterrupted), its K/V past each row's `computed` left unwritten or stale."""
        self.pool, self.meta = pool, meta
        self.layer_written = layer_written
        self.interrupted = interrupted

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This pass's K/V ([B, Hkv, T, D]) into their slots; returns the layer's
        pools. (index_copy_: several times faster than [] assignment on CPU.)"""
        if self.interrupted is not None and self.interrupted():
            raise PassInterrupted
        kp, vp = self.pool.k[layer], self.pool.v[layer]
        slots = self.meta.slot_mapping
        kp.index_copy_(0, slots, k.transpose(1, 2).reshape(slots.shape[0], *kp.shape[1:]).to(kp.dtype))
        vp.index_copy_(0, slots, v.transpose(1, 2).reshape(slots.shape[0], *vp.shape[1:]).to(vp.dtype))
        if self.layer_written is not None:
            self.layer_written(layer)
        return kp, vp


class TorchAttention(PagedAttention):
    def __init__(self, pool: KVPool, meta: AttentionMetadata, layer_written: Callable[[int], None] | None = None,
                 interrupted: Callable[[], bool] | None = None):
        super().__init__(pool, meta, layer_written, interrupted)
        bs, span = pool.block_size, meta.max_context
        tables = meta.block_tables.long()
        B, T = meta.positions.shape
        if meta.row_slices is None:  # slot of every position each row reads; past a row's end, masked
            offsets = torch.arange(bs, device=tables.device)
            self.read_slots = (tables[:, :, None] * bs + offsets).flatten(1)[:, :span].contiguous()
        # One row needs no mask to decode one token (it sees everything), and none
        # to prefill from position 0 (plain causal: SDPA's fast kernel).
        causal = B == 1 and T == span and T > 1
        mask = None if B == 1 and (T == 1 or causal) else causal_mask(meta.positions, span)  # [B, 1, T, S]
        self.masks: dict[int, tuple[torch.Tensor | None, bool]] = {0: (mask, causal)}  # by window

    def masking(self, window: int) -> tuple[torch.Tensor | None, bool]:
        """(mask, causal) for a layer reading `window` keys back (0: all)."""
        if window >= self.meta.max_context:
            window = 0  # no query reaches past it
        if window not in self.masks:
            self.masks[window] = (causal_mask(self.meta.positions, self.meta.max_context, window), False)
        return self.masks[window]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        kp, vp = self.write_kv(layer, k, v)
        mask, causal = self.masking(window)
        if self.meta.row_slices is not None:
            return self._attend_slices(q, kp, vp, mask, causal, softcap)
        B, S = self.read_slots.shape  # index_select: faster than [] indexing on CPU
        flat = self.read_slots.flatten()
        keys = kp.index_select(0, flat).view(B, S, *kp.shape[1:]).transpose(1, 2)  # [B, Hkv, S, D]
        values = vp.index_select(0, flat).view(B, S, *vp.shape[1:]).transpose(1, 2)
        return attention_fp32(q, keys, values, mask, causal, softcap)

    def _attend_slices(self, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, mask: torch.Tensor | None,
                       causal: bool, softcap: float) -> torch.Tensor:
        """Each row over its context read in place: a view of the pool, no copy."""
        outs = []
        for b, (first, length) in enumerate(self.meta.row_slices):
            keys = kp[first: first + length].unsqueeze(0).transpose(1, 2)  # [1, Hkv, S, D]
            values = vp[first: first + length].unsqueeze(0).transpose(1, 2)
            row_mask = None if mask is None else mask[b: b + 1, :, :, :length]
            outs.append(attention_fp32(q[b: b + 1], keys, values, row_mask, causal, softcap))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class TritonAttention(PagedAttention):
    MAX_NEW = 16  # new tokens per row it takes (one kernel query each)

    def __init__(self, pool: KVPool, meta: AttentionMetadata, layer_written: Callable[[int], None] | None = None,
                 interrupted: Callable[[], bool] | None = None):
        super().__init__(pool, meta, layer_written, interrupted)
        T = meta.positions.shape[1]
        self.query_tables = meta.block_tables if T == 1 else meta.block_tables.repeat_interleave(T, 0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        from completer_kernels.paged_attention import paged_decode_attention

        kp, vp = self.write_kv(layer, k, v)
        B, H, T, D = q.shape
        queries = q.transpose(1, 2).reshape(B * T, H, D).float().contiguous()
        out = paged_decode_attention(queries, kp, vp, self.query_tables, self.meta.context_lens,
                                     self.pool.block_size, window=window, softcap=softcap)
        return out.view(B, T, H, D).transpose(1, 2).to(q.dtype)
