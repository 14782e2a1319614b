"""Triton kernels under TRITON_INTERPRET=1 on CPU against their torch references:
small odd shapes (not multiples of the tiles), fresh random inputs, outputs
poisoned with NaN beforehand so that every element must be written."""

import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import pytest
import torch

from completer.engine.attention import AttentionMetadata, TorchAttention, TritonAttention
from completer.engine.paged_kv import KVPool
from support.tiny import tiny_config
from completer_kernels.fp8_gemm import (expand_block_scales, fp8_gemm_blockwise,
                                        fp8_gemm_blockwise_torch, fp8_gemm_rowwise, fp8_gemm_rowwise_torch)
from completer_kernels.fp8_quant import (FP8, quantize_fp8_blockwise_weight,
                                         quantize_fp8_groupwise, quantize_fp8_groupwise_torch,
                                         quantize_fp8_rowwise, quantize_fp8_rowwise_torch)
from completer_kernels.paged_attention import (paged_decode_attention,
                                               paged_decode_attention_torch)

FP8_NAN = 0x7F  # e4m3fn's NaN byte


def poisoned_fp8(*shape):
    return torch.full(shape, FP8_NAN, dtype=torch.uint8).view(FP8)


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (5, 300), (2, 3, 1100)])  # 1100 > the 1024 inner block
def test_rowwise_quant_matches_reference_bitwise(dtype, shape):
    x = (torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 30).to(dtype)
    x.view(-1, shape[-1])[0] = 0  # an all-zero row
    q, s = poisoned_fp8(*shape), nan(*shape[:-1])
    quantize_fp8_rowwise(x, out=q, scales=s)
    q_ref, s_ref = quantize_fp8_rowwise_torch(x)
    assert not q.float().isnan().any() and not s.isnan().any()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)
    # Round-to-nearest e4m3: half an ulp (2^-4 relative), subnormal spacing 2^-9 * scale.
    xf, deq = x.float(), q.float() * s[..., None]
    assert ((deq - xf).abs() <= xf.abs() * 2**-4 + s[..., None] * 2**-10).all()
    assert (q.float().abs().amax(-1)[s > 1e-12] == 448).all()  # the full range is used


def test_rounding_ties_and_carries_match_torch():
    """Every e4m3 value and every midpoint between neighbours (ties to even,
    carries into the exponent, subnormals): one row with scale 1."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    q, s = quantize_fp8_rowwise(values[None])
    assert float(s) == 1.0
    assert torch.equal(q.view(torch.uint8), values[None].to(FP8).view(torch.uint8))


def test_groupwise_quant_matches_reference_bitwise():
    x = torch.randn(3, 300, dtype=torch.bfloat16) * 7
    x[1, 128:256] = 0  # a zero group
    q, s = poisoned_fp8(3, 300), nan(3, 3)
    quantize_fp8_groupwise(x, 128, out=q, scales=s)
    q_ref, s_ref = quantize_fp8_groupwise_torch(x, 128)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref)


def exact_product(xq, wq, xs, ws):
    return (xq.double() * xs.double()) @ (wq.double() * ws.double()).T


# The interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest):
# one bf16 ulp (2^-7 relative) under it, half an ulp (2^-8) for torch.
KERNEL_BF16_RTOL, TORCH_BF16_RTOL = 2**-7, 2**-8


def assert_bf16_of_exact(y, exact, x_deq, w_deq, rtol=KERNEL_BF16_RTOL):
    """The only material error is the bf16 rounding of the output plus fp32
    accumulation (tiny against sum |x||w|)."""
    assert not y.float().isnan().any()
    bound = exact.abs() * rtol + 1e-5 * (x_deq.abs() @ w_deq.abs().T)
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("M,N,K", [(1, 40, 300), (17, 72, 200), (33, 24, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_rowwise_gemm(M, N, K, bias):
    xq, xs = quantize_fp8_rowwise_torch(torch.randn(M, K) * 4)
    wq, ws = quantize_fp8_rowwise_torch(torch.randn(N, K) * 0.05)
    b = torch.randn(N, dtype=torch.bfloat16) if bias else None
    y = nan(M, N, dtype=torch.bfloat16)
    fp8_gemm_rowwise(xq, wq, xs, ws, b, out=y, config=(16, 32, 128, 4, 2))
    ref = fp8_gemm_rowwise_torch(xq, wq, xs, ws, b)
    exact = exact_product(xq, wq, xs[:, None], ws[:, None]) + (b.double() if bias else 0)
    assert_bf16_of_exact(y, exact, xq.float() * xs[:, None], wq.float() * ws[:, None])
    assert_bf16_of_exact(ref, exact, xq.float() * xs[:, None], wq.float() * ws[:, None],
                         TORCH_BF16_RTOL)


@pytest.mark.parametrize("M,N,K", [(5, 140, 300), (20, 33, 128)])
def test_blockwise_gemm(M, N, K):
    x, w = torch.randn(M, K) * 4, torch.randn(N, K) * 0.05
    w[:, :128] *= 20  # tiles with different scales
    xq, xs = quantize_fp8_groupwise_torch(x)
    wq, ws = quantize_fp8_blockwise_weight(w)
    assert ws.shape == (-(-N // 128), -(-K // 128))
    y = nan(M, N, dtype=torch.bfloat16)
    fp8_gemm_blockwise(xq, wq, xs, ws, out=y, config=(16, 32, 128, 4, 2))
    ref = fp8_gemm_blockwise_torch(xq, wq, xs, ws)
    x_deq = xq.float() * expand_block_scales(xs, M, K, 1)
    w_deq = wq.float() * expand_block_scales(ws, N, K, 128)
    exact = x_deq.double() @ w_deq.double().T
    assert_bf16_of_exact(y, exact, x_deq, w_deq)
    assert_bf16_of_exact(ref, exact, x_deq, w_deq, TORCH_BF16_RTOL)
    # and fp8 stays close to the unquantized product (a few percent of its scale)
    assert (y.float() - x @ w.T).norm() <= 0.08 * (x @ w.T).norm()


ATTN_ATOL = 2e-5  # fp32 both ways; only summation order and exp differ


@pytest.mark.parametrize("partition,tile", [(512, 64), (8, 4), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (10, 0.0), (0, 1.5)], ids=["full", "sliding", "softcap"])
def test_paged_decode_attention(partition, tile, dtype, window, softcap):
    B, Hq, Hkv, D, bs, blocks = 4, 6, 2, 24, 4, 40
    k_pool, v_pool = torch.randn(blocks * bs, Hkv, D), torch.randn(blocks * bs, Hkv, D)
    lens = torch.tensor([1, 4, 13, 29], dtype=torch.int32)  # 1 token, a full block, odd ones
    tables = torch.randperm(blocks)[: B * 8].view(B, 8).int()
    q = torch.randn(B, Hq, D).to(dtype)
    out = nan(B, Hq, D, dtype=dtype)
    paged_decode_attention(q, k_pool, v_pool, tables, lens, bs, out=out, partition=partition, tile=tile,
                           window=window, softcap=softcap)
    ref = paged_decode_attention_torch(q, k_pool, v_pool, tables, lens, bs, window=window, softcap=softcap)
    if window or softcap:  # the reference does what the option says: it differs from attending to all
        plain = paged_decode_attention_torch(q, k_pool, v_pool, tables, lens, bs)
        assert (plain.float() - ref.float()).abs().max() > 1e-2
    assert out.dtype == dtype and not out.isnan().any()
    rtol = 0 if dtype == torch.float32 else 2**-7  # bf16 output: one ulp of rounding
    torch.testing.assert_close(out.float(), ref.float(), atol=ATTN_ATOL, rtol=rtol)


def test_paged_attention_matches_the_torch_backend_decode_step():
    """One decode step through the engine's TorchAttention: the kernel over the
    pool it wrote gives the same attention output."""
    cfg = tiny_config(vocab_size=10, intermediate_size=8, num_hidden_layers=1, num_key_value_heads=1)
    bs = 4
    pool = KVPool(cfg, 16, bs)
    pool.k.normal_()
    pool.v.normal_()
    tables = [[3, 7, 1], [5, 2, 9, 11], [0, 4]]  # block 0 is the scratch block elsewhere
    positions = torch.tensor([[9], [14], [4]])  # the new token of each row
    q, k, v = torch.randn(3, 4, 1, 8), torch.randn(3, 1, 1, 8), torch.randn(3, 1, 1, 8)
    meta = AttentionMetadata.build(tables, positions[:, 0].tolist(), [1, 1, 1], bs)
    assert torch.equal(meta.positions, positions)
    expected = TorchAttention(pool, meta).attend(0, q, k, v, positions)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = (positions[:, 0] + 1).int()
    got = paged_decode_attention(q[:, :, 0], pool.k[0], pool.v[0], table, lens, bs, partition=8, tile=4)
    torch.testing.assert_close(got, expected[:, :, 0], atol=ATTN_ATOL, rtol=0)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (6, 0.0), (4, 0.7)], ids=["full", "sliding", "both"])
def test_triton_backend_matches_torch_backend_for_several_new_tokens(window, softcap):
    """A verify-like pass (rows of 3, 1 and 5 new tokens, padded to 5): the
    Triton backend writes the same K/V slots and attends causally among the
    new tokens as the torch backend's gather + SDPA does (a sliding layer's
    window, soft-capped scores too)."""
    cfg = tiny_config(vocab_size=10, intermediate_size=8, num_hidden_layers=1)
    bs = 4
    tables = [[3, 7, 1, 12], [5, 2, 9, 11], [6, 4, 8]]
    num_new = [3, 1, 5]
    last = [11, 14, 9]  # position of each row's last new token
    positions = torch.stack([torch.arange(p - n + 1, p - n + 6).clamp(max=p) for p, n in zip(last, num_new)])
    q, k, v = torch.randn(3, 4, 5, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    pools = [KVPool(cfg, 16, bs), KVPool(cfg, 16, bs)]
    for pool in pools:
        torch.manual_seed(1)
        pool.k.normal_()
        pool.v.normal_()
    meta = AttentionMetadata.build(tables, [p - n + 1 for p, n in zip(last, num_new)], num_new, bs)
    assert torch.equal(meta.positions, positions)
    expected = TorchAttention(pools[0], meta).attend(0, q, k, v, positions, window, softcap)
    got = TritonAttention(pools[1], meta).attend(0, q, k, v, positions, window, softcap)
    valid = torch.arange(5)[None, :] < torch.tensor(num_new)[:, None]  # padding queries are ignored
    torch.testing.assert_close(got.transpose(1, 2)[valid], expected.transpose(1, 2)[valid], atol=ATTN_ATOL, rtol=0)
    torch.testing.assert_close(pools[1].k, pools[0].k, atol=0, rtol=0)  # same slots written
    torch.testing.assert_close(pools[1].v, pools[0].v, atol=0, rtol=0)


# The interpreter runs Python, so it misses what only the compiler rejects (a
# non-constexpr global, an op with no GPU lowering). Compile every kernel for
# sm90 ahead of time: no GPU needed, triton ships ptxas. Aligned pointers and
# strides, as the JIT specializes them at real shapes.
AOT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from completer_kernels import fp8_gemm, fp8_quant, paged_attention as pa

    def build(fn, sig, consts, **options):
        full = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                   if n not in consts and (sig[n][0] == "*" or n.startswith("stride") or n in "KN")}
        k = triton.compile(ASTSource(fn, full, consts, aligned), target=GPUTarget("cuda", 90, 32),
                           options=options)
        return k.asm["ptx"]

    i32 = lambda *names: dict.fromkeys(names, "i32")
    build(fp8_quant._quant_kernel, dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32",
          **i32("K", "group", "stride_x", "stride_q", "stride_s")), {"BLOCK": 1024})
    sig = dict(a_ptr="*fp8e4nv", b_ptr="*fp8e4nv", c_ptr="*bf16", as_ptr="*fp32", bs_ptr="*fp32",
               bias_ptr="*bf16", **i32("M", "N", "K", "stride_am", "stride_bn", "stride_cm",
                                       "stride_as", "stride_bs"))
    for (bm, bn, bk, warps, stages), scaled in ((fp8_gemm.gemm_configs(1)[0], False),
                                                (fp8_gemm.gemm_configs(256)[0], True)):
        ptx = build(fp8_gemm._fp8_gemm_kernel, sig, dict(BLOCK_SCALED=scaled, HAS_BIAS=True, BLOCK_M=bm,
                    BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8), num_warps=warps, num_stages=stages)
        assert "e4m3" in ptx and (bm < 64 or "wgmma" in ptx), "no fp8 tensor-core MMA"
    sig = dict(q_ptr="*bf16", k_ptr="*fp32", v_ptr="*fp32", tables_ptr="*i32", lens_ptr="*i32",
               m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", o_ptr="*bf16", scale="fp32", softcap="fp32",
               **i32("block_size", "num_parts", "head_dim", "window", "stride_qb", "stride_qh", "stride_kt",
                     "stride_kh", "stride_tb", "stride_ob", "stride_oh"))
    for single, capped in ((True, False), (False, True)):
        build(pa._paged_decode_kernel, sig, dict(GROUP=6, BLOCK_D=128, TILE=64, PARTITION=512, SINGLE=single,
                                                 CAPPED=capped))
    build(pa._merge_kernel, dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", o_ptr="*bf16",
          **i32("num_parts", "head_dim", "stride_ob", "stride_oh")), dict(BLOCK_D=128, BLOCK_P=8))
    print("compiled")
""")


def test_kernels_compile_for_hopper():
    from triton.backends import backends
    if "nvidia" not in backends:
        pytest.skip("triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences 3.9's notice; fusion is the default
    r = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
