"""Dynamic FP8 (e4m3fn) quantization of activations: per token (row-wise) and
per 1x128 group (for the block-scaled GEMM), each beside a torch reference.

scale = amax / 448 per row (or group), q = round_to_nearest_even(x * (1/scale)).
The kernel and the reference make the same fp32 operations in the same order
(IEEE division for the scale and its reciprocal), so they agree bit for bit.

Triton's interpreter (TRITON_INTERPRET=1, triton 3.9) loads fp8 correctly and
tl.dot takes fp8 operands, but its fp32 -> fp8 cast drops the carry when
rounding up overflows the mantissa (31.6 becomes 16, not 32). So the kernel
never casts to fp8: `e4m3_bits` rounds in integer arithmetic and the kernel
stores the byte through a uint8 view of the fp8 output. The same code runs on
the GPU, where it costs a few integer ops in a memory-bound kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # all-zero rows get a tiny scale, so q == 0 and dequantizes to 0
# Compiled kernels may read globals only as constexprs (the interpreter does not check).
_MAX, _MIN_AMAX = tl.constexpr(FP8_MAX), tl.constexpr(MIN_AMAX)


@triton.jit
def e4m3_bits(x):
    """fp32 with |x| <= 448 -> the e4m3fn bit pattern (int32), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range (>= 2^-6): drop 20 of 23 mantissa bits, ties to even; a carry
    # out of the mantissa ripples into the exponent. 120 = 127 - 7 rebiases.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormals are multiples of 2^-9: adding and removing 2^23 rounds |x|*512 to even.
    sub = ((mag.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(mag >= 0x3C800000, normal, sub) | sign  # 0x3C800000 == 2^-6


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, group, stride_x, stride_q, stride_s,
                  BLOCK: tl.constexpr):
    """One program per (row, group of columns): amax pass, then quantize pass."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), _MIN_AMAX), _MAX)
    inv = tl.math.div_rn(1.0, scale)
    tl.store(s_ptr + row * stride_s + g, scale)
    for off in range(start, end, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * inv, -_MAX), _MAX)
        tl.store(q_ptr + row * stride_q + cols, e4m3_bits(y).to(tl.uint8), mask=cols < end)


def _quantize(x: torch.Tensor, group: int, out: torch.Tensor | None,
              scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, groups = x2.shape[0], triton.cdiv(K, group)
    q = torch.empty((M, K), dtype=FP8, device=x.device) if out is None else out.view(M, K)
    s = torch.empty((M, groups), dtype=torch.float32, device=x.device) if scales is None \
        else scales.view(M, groups)
    if M:
        block = min(triton.next_power_of_2(group), 1024)
        _quant_kernel[(M, groups)](x2, q.view(torch.uint8), s, K, group,
                                   x2.stride(0), q.stride(0), s.stride(0), BLOCK=block)
    return q, s


def quantize_fp8_rowwise(x: torch.Tensor, out: torch.Tensor | None = None,
                         scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype) -> q [..., K] float8_e4m3fn, scales [...] fp32."""
    q, s = _quantize(x, x.shape[-1], out, scales)
    return q.view(x.shape), s.view(x.shape[:-1])


def quantize_fp8_rowwise_torch(x: torch.Tensor, out: torch.Tensor | None = None,
                               scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    s = xf.abs().amax(-1).clamp(min=MIN_AMAX) / FP8_MAX
    q = (xf * (1.0 / s)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    if out is not None:
        q = out.copy_(q)
    if scales is not None:
        s = scales.copy_(s)
    return q, s


def quantize_fp8_groupwise(x: torch.Tensor, group: int = 128, out: torch.Tensor | None = None,
                           scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> q [M, K] fp8, scales [M, ceil(K / group)] fp32 (one per 1 x group tile)."""
    return _quantize(x, group, out, scales)


def quantize_fp8_groupwise_torch(x: torch.Tensor, group: int = 128, out: torch.Tensor | None = None,
                                 scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x.shape
    groups = -(-K // group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - K)).view(M, groups, group)
    q, s = quantize_fp8_rowwise_torch(xf)
    q = q.view(M, groups * group)[:, :K]
    if out is not None:
        q = out.copy_(q)
    if scales is not None:
        s = scales.copy_(s)
    return q, s


def quantize_fp8_blockwise_weight(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> q [N, K] fp8, scales [ceil(N/block), ceil(K/block)] (load time, torch)."""
    N, K = w.shape
    nb, kb = -(-N // block), -(-K // block)
    wf = torch.nn.functional.pad(w.float(), (0, kb * block - K, 0, nb * block - N))
    tiles = wf.view(nb, block, kb, block).transpose(1, 2)  # [nb, kb, block, block]
    s = tiles.abs().amax((-1, -2)).clamp(min=MIN_AMAX) / FP8_MAX
    q = (tiles * (1.0 / s)[..., None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.transpose(1, 2).reshape(nb * block, kb * block)[:N, :K].contiguous(), s
