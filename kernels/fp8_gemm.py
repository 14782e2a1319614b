"""W8A8 FP8 GEMMs with fp32 accumulation and bf16 output, beside torch references.

Row-wise: y = (xq @ wq.T) * xs[:, None] * ws[None, :] (+ bias), with xq [M, K]
and wq [N, K] float8_e4m3fn, xs [M] per token, ws [N] per output channel.
Block-scaled: xs [M, ceil(K/128)] per 1x128 group, ws [ceil(N/128), ceil(K/128)]
per 128x128 tile; each 128-deep partial product is scaled before it is summed.

wq is read as stored ([N, K], K contiguous), which is the K-major B operand
that Hopper's fp8 MMA wants. Configs are (BLOCK_M, BLOCK_N, BLOCK_K, warps,
stages); `gemm_configs` lists candidates that completer.fp8 times per shape.
Under TRITON_INTERPRET=1 the bf16 store truncates (the GPU rounds to nearest),
so interpreter results may sit one bf16 ulp from the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCALE_BLOCK = 128


@triton.jit
def _fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
                     stride_am, stride_bn, stride_cm, stride_as, stride_bs,
                     BLOCK_SCALED: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    # Grouped program order: GROUP_M row-tiles share their B tiles while in L2.
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn[None, :].to(tl.int64) * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if BLOCK_SCALED:  # BLOCK_K == SCALE_BLOCK: one scale column per iteration
            kb = k0 // BLOCK_K
            sa = tl.load(as_ptr + rm * stride_as + kb, mask=m_ok, other=0.0)
            sb = tl.load(bs_ptr + (rn // BLOCK_K) * stride_bs + kb, mask=n_ok, other=0.0)
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALED:
        sa = tl.load(as_ptr + rm, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def gemm_configs(M: int) -> list[tuple[int, int, int, int, int]]:
    """Candidate tiles for an M (the first is the default); all have BLOCK_K 128."""
    if M <= 16:
        return [(16, 64, 128, 4, 4), (64, 64, 128, 4, 4), (16, 32, 128, 4, 5)]
    if M <= 256:
        return [(64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (128, 64, 128, 4, 3)]
    return [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 128, 4, 4)]


def _launch(xq, wq, xs, ws, bias, out, block_scaled, config):
    M, K = xq.shape
    N = wq.shape[0]
    assert wq.shape[1] == K and xq.stride(1) == 1 and wq.stride(1) == 1
    out = torch.empty((M, N), dtype=torch.bfloat16, device=xq.device) if out is None else out
    bm, bn, bk, warps, stages = config or gemm_configs(M)[0]
    if block_scaled:
        assert bk == SCALE_BLOCK, "block-scaled tiles are 128 deep"
    if M and N:
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _fp8_gemm_kernel[grid](
            xq, wq, out, xs, ws, bias if bias is not None else xs, M, N, K,
            xq.stride(0), wq.stride(0), out.stride(0),
            xs.stride(0) if block_scaled else 0, ws.stride(0) if block_scaled else 0,
            BLOCK_SCALED=block_scaled, HAS_BIAS=bias is not None,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def fp8_gemm_rowwise(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                     bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     config: tuple | None = None) -> torch.Tensor:
    """xq [M, K], wq [N, K] fp8; xs [M], ws [N] fp32; bias [N] -> y [M, N] bf16."""
    return _launch(xq, wq, xs, ws, bias, out, False, config)


def fp8_gemm_rowwise_torch(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                           bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                           config: tuple | None = None) -> torch.Tensor:
    y = (xq.float() @ wq.float().T) * xs.float()[:, None] * ws.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16) if out is None else out.copy_(y)


def fp8_gemm_blockwise(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                       bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                       config: tuple | None = None) -> torch.Tensor:
    """xq [M, K], wq [N, K] fp8; xs [M, ceil(K/128)], ws [ceil(N/128), ceil(K/128)] fp32."""
    return _launch(xq, wq, xs, ws, bias, out, True, config)


def expand_block_scales(s: torch.Tensor, rows: int, cols: int, rows_block: int) -> torch.Tensor:
    """Scales per (rows_block x 128) tile -> one per element of a [rows, cols] matrix."""
    return s.repeat_interleave(rows_block, 0)[:rows].repeat_interleave(SCALE_BLOCK, 1)[:, :cols]


def fp8_gemm_blockwise_torch(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                             bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             config: tuple | None = None) -> torch.Tensor:
    (M, K), N = xq.shape, wq.shape[0]
    x = xq.float() * expand_block_scales(xs.float(), M, K, 1)
    w = wq.float() * expand_block_scales(ws.float(), N, K, SCALE_BLOCK)
    y = x @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(torch.bfloat16) if out is None else out.copy_(y)
