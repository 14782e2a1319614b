"""The CPU decode path: fused projections and compiled layers leave greedy
output as eager's; int8 and int4 linears stay within their quantization error,
give a row the same result whatever its batch, and int4 reproduces Q4_1
weights exactly."""

import os

import pytest
import torch
import torch.nn.functional as F

from completer.checkpoint import CheckpointError
from completer.cpu_quant import INT4_GROUP, Int4Linear, Int8Linear
from completer.config import EngineConfig, SpecConfig
from completer.loading import load
from completer.model_store import EMBEDDED_TARGET
from support.engine_harness import served_greedy_text

PROMPT = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f"


def greedy_text(loaded, compile: bool, n: int = 32) -> str:
    """Greedy text through the engine as the server runs it (Engine.start
    compiles when `compile`), without speculation."""
    return served_greedy_text(loaded, PROMPT, EngineConfig(compile=compile, kv_cache_mb=16),
                              SpecConfig(ngram=False, draft_model=False), n)


@pytest.fixture(scope="module")
def eager_unfused():
    return load(EMBEDDED_TARGET, "fp32", fuse=False)


def test_fused_projections_give_the_same_logits(eager_unfused):
    fused = load(EMBEDDED_TARGET, "fp32")
    assert fused.model.model.layers[0].self_attn.qkv_proj is not None
    ids = torch.tensor([fused.tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        torch.testing.assert_close(fused.model(ids), eager_unfused.model(ids), atol=1e-4, rtol=1e-4)


def test_compiled_fused_passes_decode_as_eager(eager_unfused):
    with torch.inference_mode():
        ids = torch.tensor([eager_unfused.tokenizer.encode(PROMPT)])
        reference = eager_unfused.model(ids)
    compiled = load(EMBEDDED_TARGET, "fp32").model.compile_layers()
    with torch.inference_mode():
        torch.testing.assert_close(compiled(ids), reference, atol=1e-4, rtol=1e-4)  # a prefill pass
        torch.testing.assert_close(compiled(ids[:, :1]), reference[:, :1], atol=1e-4, rtol=1e-4)  # one token


def test_engine_greedy_output_is_the_same_fused_and_compiled_as_eager(eager_unfused):
    want = greedy_text(eager_unfused, compile=False)
    fast = load(EMBEDDED_TARGET, "fp32")
    assert greedy_text(fast, compile=True) == want
    assert fast.model.compiled
    int8 = load(EMBEDDED_TARGET, "int8")
    assert greedy_text(int8, compile=True) == greedy_text(int8, compile=False)


def test_int8_linear_is_close_and_gives_a_row_the_same_result_in_any_batch():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64), torch.randn(96)
    layer = Int8Linear(w, b)
    x = torch.randn(5, 64) * torch.logspace(-2, 2, 5)[:, None]  # rows of very different sizes
    y = layer(x)
    exact = F.linear(x, w, b)
    assert ((y - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.03
    for i in range(5):
        assert torch.equal(layer(x[i: i + 1]), y[i: i + 1])


def test_int4_linear_reproduces_q4_1_weights_and_refuses_other_widths():
    torch.manual_seed(0)
    N, K = 64, 96
    q = torch.randint(0, 16, (N, K // INT4_GROUP, INT4_GROUP)).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as Q4_1's quantizer makes it
    # Q4_1 stores each group's scale and minimum as fp16
    scale = (torch.rand(N, K // INT4_GROUP, 1) * 0.1).half().float()
    low = torch.randn(N, K // INT4_GROUP, 1).half().float()
    w = (q * scale + low).view(N, K)
    layer = Int4Linear(w, None)
    torch.testing.assert_close(layer.dequantized(), w, atol=1e-5, rtol=1e-5)
    # torch's int4 kernel, and for prefill one GEMM on the unpacked weights: both in bf16 where
    # the CPU has native bf16, else fp32
    tol = 1e-4 if layer.compute_dtype == torch.float32 else 2e-2
    for rows in (3, Int4Linear.GEMV_ROWS + 1):
        x = torch.randn(rows, K)
        y = F.linear(x, w)
        torch.testing.assert_close(layer(x), y, atol=tol * y.abs().max().item(), rtol=tol)
    # a resident unpacked copy for passes of 8 rows and more; fewer stay on the int4 kernel
    assert layer.keep_dense(8) == N * K * layer.compute_dtype.itemsize
    x = torch.randn(8, K)
    torch.testing.assert_close(layer(x), F.linear(x, w), atol=tol * F.linear(x, w).abs().max().item(), rtol=tol)
    assert torch.equal(layer(x[:7]), torch._weight_int4pack_mm_for_cpu(
        x[:7].to(layer.compute_dtype), layer.packed, INT4_GROUP, layer.scales_and_zeros).float())
    assert layer.keep_dense(0) == 0 and layer.dense is None
    with pytest.raises(ValueError, match="multiple of the group"):
        Int4Linear(torch.randn(8, 40), None)


def test_int8_and_int4_models_mostly_agree_with_fp32(eager_unfused):
    ids = torch.tensor([eager_unfused.tokenizer.encode(PROMPT * 3)])
    with torch.inference_mode():
        reference = eager_unfused.model(ids).argmax(-1)
        for precision in ("int8", "int4"):
            quantized = load(EMBEDDED_TARGET, precision)
            assert (quantized.model(ids).argmax(-1) == reference).float().mean() > 0.8, precision


def test_int8_on_cuda_fails_at_load_naming_the_precision():
    with pytest.raises(CheckpointError, match="int8.*CPU only"):
        load(EMBEDDED_TARGET, "int8", device="cuda")


def test_a_failing_compile_leaves_the_engine_eager_and_serving(eager_unfused, monkeypatch, caplog):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(torch, "compile", no_compiler)
    fast = load(EMBEDDED_TARGET, "fp32")
    assert greedy_text(fast, compile=True) == greedy_text(eager_unfused, compile=False)
    assert not fast.model.compiled
    assert "torch.compile failed, passes run eager: no C++ compiler" in caplog.text


def test_reading_the_held_out_code_leaves_torch_compile_able_to_build():
    """Finding pip through the import system turns setuptools' distutils shim
    off, and inductor's C++ build imports setuptools."""
    import subprocess
    import sys
    code = ("from completer.evaluate import heldout_files; heldout_files(); "
            "import torch.utils.cpp_extension")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


KERNEL_CACHE_PROBE = """
import ctypes, sys, torch
from completer.cpu_quant import Int4Linear, bound_kernel_caches
bound_kernel_caches(int(sys.argv[1]))  # as load_models does, from model.kernel_cache_entries
torch.manual_seed(0)
layers = [Int4Linear(torch.randn(n, k) * 0.02, None) for n, k in ((3072, 576), (576, 1536))]
for layer in layers:
    layer.keep_dense(32)
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def passes(rows):
    for m in rows:
        for layer in layers:
            layer(torch.randn(m, layer.in_features))
passes([40] * 3)  # the pool warm
start = rss()
passes(range(32, 32 + 400))  # prompts of ever new lengths
print(rss() - start)
"""


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="the int4 path runs bf16 only here")
def test_int4_prefill_of_ever_new_row_counts_holds_bounded_memory():
    """Each new row count of the int4 path's bf16 matmul left a oneDNN
    primitive in two caches of 1,024 entries: ~1.2 MB per row count for these two
    projections, never returned (496 MB here; with 128 entries 81 MB)."""
    import subprocess
    import sys

    from completer.config import Config

    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    run = subprocess.run([sys.executable, "-c", KERNEL_CACHE_PROBE, str(Config().model.kernel_cache_entries)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    grown_mb = float(run.stdout.split()[-1])
    assert grown_mb < 160, f"{grown_mb:.0f} MB kept after 400 new row counts"
