"""Paged decode attention in fp32, reading K/V through block tables (no gather
copy), beside a plain-torch reference with the same semantics.

One new token per sequence: q [B, Hq, D]; k_pool, v_pool [num_blocks *
block_size, Hkv, D]; token t of sequence b sits at slot
`block_tables[b, t // block_size] * block_size + t % block_size`, for t <
context_lens[b] (the new token's K/V already written). Query head h reads KV
head h // (Hq // Hkv). Scale 1/sqrt(D), as SDPA's default. A sliding layer
(`window` > 0) reads only the last `window` tokens; `softcap` > 0 caps each
score s as softcap * tanh(s / softcap) (Gemma 2).

Flash-decoding split: the grid is (B, Hq, partitions of PARTITION tokens), so
a few long sequences still fill the GPU; a second kernel merges partitions by
their log-sum-exp. The partition count comes from block_tables' width, not
from context_lens, so no host sync and the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, o_ptr,
                         scale, block_size, num_parts, head_dim, window, softcap,
                         stride_qb, stride_qh, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                         GROUP: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr,
                         PARTITION: tl.constexpr, SINGLE: tl.constexpr, CAPPED: tl.constexpr):
    b, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = h // GROUP
    ctx = tl.load(lens_ptr + b)
    start = part * PARTITION
    if window > 0:  # a sliding layer: keys before ctx - window are out of sight
        start = tl.maximum(start, ctx - window)
    end = tl.minimum(part * PARTITION + PARTITION, ctx)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32) * scale
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t0 in range(start, end, TILE):  # online softmax over this partition
        t = t0 + tl.arange(0, TILE)
        t_ok = t < end
        blk = tl.load(tables_ptr + b * stride_tb + t // block_size, mask=t_ok, other=0)
        slot = blk.to(tl.int64) * block_size + t % block_size
        kv_off = slot[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1)
        if CAPPED:  # tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2 * tl.sigmoid(2 * s / softcap) - 1)
        s = tl.where(t_ok, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(v_ptr + kv_off, mask=kv_ok, other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m = m_new
    if SINGLE:
        tl.store(o_ptr + b * stride_ob + h * stride_oh + d, (acc / l).to(o_ptr.dtype.element_ty), mask=d_ok)
    else:  # partials; an empty partition leaves m = -inf, l = 0, acc = 0
        row = (b * tl.num_programs(1) + h) * num_parts + part
        tl.store(m_ptr + row, m)
        tl.store(l_ptr + row, l)
        tl.store(acc_ptr + row * BLOCK_D + d, acc)


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, num_parts, head_dim, stride_ob, stride_oh,
                  BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr):
    b, h = tl.program_id(0), tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_parts
    p = tl.arange(0, BLOCK_P)
    p_ok = p < num_parts
    d = tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row0 + p, mask=p_ok, other=float("-inf"))
    l = tl.load(l_ptr + row0 + p, mask=p_ok, other=0.0)
    acc = tl.load(acc_ptr + (row0 + p[:, None]) * BLOCK_D + d[None, :], mask=p_ok[:, None], other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # the query's own partition is never empty, so the max is finite
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                           out: torch.Tensor | None = None, partition: int = 512,
                           tile: int = 64, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Returns [B, Hq, D] in q's dtype (fp32 math). `partition` is a multiple of `tile`."""
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    assert Hq % Hkv == 0 and partition % tile == 0
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1 and q.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    block_d = triton.next_power_of_2(D)
    parts = triton.cdiv(block_tables.shape[1] * block_size, partition)
    if parts > 1:
        m = torch.empty((B, Hq, parts), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty((B, Hq, parts, block_d), dtype=torch.float32, device=q.device)
    else:
        m = l = acc = out  # unused
    _paged_decode_kernel[(B, Hq, parts)](
        q, k_pool, v_pool, block_tables, context_lens, m, l, acc, out,
        1.0 / math.sqrt(D), block_size, parts, D, window, float(softcap),
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=Hq // Hkv, BLOCK_D=block_d, TILE=tile, PARTITION=partition, SINGLE=parts == 1,
        CAPPED=softcap > 0)
    if parts > 1:
        _merge_kernel[(B, Hq)](m, l, acc, out, parts, D, out.stride(0), out.stride(1),
                               BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(parts))
    return out


def paged_decode_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                 block_tables: torch.Tensor, context_lens: torch.Tensor,
                                 block_size: int, out: torch.Tensor | None = None,
                                 partition: int = 512, tile: int = 64, window: int = 0,
                                 softcap: float = 0.0) -> torch.Tensor:
    """Gathers each sequence's slots, then fp32 attention (the K/V heads shared by query groups)."""
    rows = []
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        blocks = block_tables[b, : -(-n // block_size)].long()
        slots = (blocks[:, None] * block_size + torch.arange(block_size, device=q.device)).flatten()[:n]
        slots = slots[max(0, n - window):] if window else slots
        keys = k_pool[slots].transpose(0, 1)[None].float()  # [1, Hkv, n, D]
        values = v_pool[slots].transpose(0, 1)[None].float()
        query = q[b][None, :, None].float()
        if softcap:
            keys, values = (x.repeat_interleave(query.shape[1] // keys.shape[1], 1) for x in (keys, values))
            scores = softcap * torch.tanh(query @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) / softcap)
            rows.append((scores.softmax(-1) @ values)[0, :, 0].to(q.dtype))
            continue
        rows.append(F.scaled_dot_product_attention(query, keys, values,
                                                   enable_gqa=query.shape[1] != keys.shape[1])[0, :, 0].to(q.dtype))
    result = torch.stack(rows)
    return result if out is None else out.copy_(result)
