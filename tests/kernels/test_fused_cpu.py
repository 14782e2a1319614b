"""The fused CPU layer (kernels/cpu_decode.cpp, engine/fused_cpu.py): its 4-bit
GEMM and its paged attention equal their plain-torch references, the engine
decodes through it the same greedy text as the fp32 reference path, and every
family model.py serves (Qwen3, Gemma 1/2/3, StarCoder2, Granite) gives through
it the torch path's logits on the same quantized weights.

The layer's builds by feature level (kernels/cpu_levels.py: scalar, avx2,
avx512): the kernel and per-family comparisons run against every level this
machine runs (`level`, each build compiled once per cache); the engine-level
tests against the level it runs by default."""

import logging
import os
import subprocess
import sys

import pytest
import torch

import msgspec
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                          Starcoder2Config, Starcoder2ForCausalLM)

from completer.checkpoint import load_model
from completer.cpu_quant import Int4Linear, Int8Linear, int4_groups, q8_product_int8, quantize_cpu_linears
from completer.engine.attention import AttentionMetadata, PassInterrupted, TorchAttention
from completer.config import EngineConfig, SpecConfig
from completer.engine.fused_cpu import FusedCpuLayers, FusedUnsupported, fused_layers_for
from completer.engine.kv_cache_manager import advance
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState
from completer.loading import load
from completer.model import ModelConfig, Transformer
from completer.model_store import EMBEDDED_TARGET
from completer_kernels import cpu_decode, cpu_levels, cpu_packing
from completer_kernels.cpu_levels import BY_NAME, CpuLevel, runnable_levels
from support.engine_harness import served_greedy_text
from support.hf_models import random_hf_model

PROMPT = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f"


@pytest.fixture(scope="module")
def ext():
    return cpu_decode.extension()  # a compiler is part of the test machine (.ci/run)


@pytest.fixture(scope="module", params=[level.name for level in runnable_levels()])
def level(request) -> CpuLevel:
    """Each level this machine runs (CI's AVX512-VNNI machine: all three)."""
    return BY_NAME[request.param]


@pytest.fixture(scope="module")
def level_ext(level):
    """The level's build."""
    return cpu_decode.extension(level=level)


@pytest.fixture(scope="module")
def int4():
    return load(EMBEDDED_TARGET, "int4")


def torch_reference(model: Transformer, q8_activations: bool) -> Transformer:
    """`model` (in place) with its int4 (or int8) projections and int8 head multiplied in
    fp32 by torch's ops (activations rounded to 8 bits per block of 32 as llama.cpp does,
    or not rounded)."""
    for m in model.modules():
        if isinstance(m, Int4Linear):
            m.compute_dtype = torch.float32
            m.keep_dense(1)
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.q8_activations = q8_activations
    weight, scale = model.lm_head.int8_weight()
    model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    model.lm_head.weight.data = weight.float() * scale[:, None]
    return model


def reference_model(q8_activations: bool, precision: str = "int4"):
    """The embedded target's reference (`torch_reference`)."""
    ref = load(EMBEDDED_TARGET, precision)
    torch_reference(ref.model, q8_activations)
    return ref


@pytest.fixture(scope="module")
def reference():
    return reference_model(q8_activations=False)


@pytest.fixture(scope="module")
def reference_q8():
    return reference_model(q8_activations=True)


def vnni_only(ext):
    if not ext.tiles_available():
        pytest.skip(f"the tiled kernels are AVX512-VNNI's; this build is {ext.simd()}")


def packed_both_ways(pack, unpack, q, scale, low):
    """The 4-bit groups packed; unpacking gives them back exactly."""
    packed = pack(q, scale, low)
    back = unpack(packed)
    assert torch.equal(back[0], q.float()) and torch.equal(back[1], scale) and torch.equal(back[2], low)
    return packed


def assert_q8_reference(ext, x, packed, bias):
    """The extension's product with 8-bit activations equals the torch reference's; returns it."""
    got = ext.q4_linear(x, packed, bias, True)
    torch.testing.assert_close(got, cpu_packing.q4_linear_reference(x, packed, bias), atol=1e-4, rtol=1e-5)
    return got


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_4bit_gemm_equals_its_torch_reference_with_q8_and_fp32_activations(level_ext, rows):
    ext = level_ext
    torch.manual_seed(rows)
    w = torch.randn(200, 320) * 0.05
    q, scale, low = int4_groups(w)
    pairs = packed_both_ways(cpu_packing.pack_q4, cpu_packing.unpack_q4, q, scale, low)
    x, bias = torch.randn(rows, 320), torch.randn(200)
    assert_q8_reference(ext, x, pairs, bias)
    dense = (q.float().view(200, -1, 32) * scale[..., None] + low[..., None]).view(200, 320)
    torch.testing.assert_close(ext.q4_linear(x, pairs, bias, False), x @ dense.T + bias, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_packing.pack_q4(*int4_groups(torch.randn(8, 96)))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_tiled_vnni_gemms_equal_the_pairs_kernel_and_the_torch_references(level_ext, rows):
    ext = level_ext
    vnni_only(ext)
    torch.manual_seed(rows)
    q, scale, low = int4_groups(torch.randn(208, 320) * 0.05)
    tiles = packed_both_ways(cpu_packing.pack_q4_tiles, cpu_packing.unpack_q4_tiles, q, scale, low)
    x, bias = torch.randn(rows, 320), torch.randn(208)
    got = assert_q8_reference(ext, x, tiles, bias)
    torch.testing.assert_close(got, ext.q4_linear(x, cpu_packing.pack_q4(q, scale, low), bias, True),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="8-bit activations"):
        ext.q4_linear(x, tiles, bias, False)
    with pytest.raises(ValueError, match="multiple of 16 x 32"):
        cpu_packing.pack_q4_tiles(*int4_groups(torch.randn(24, 64)))
    # The int8 model's weights in the same tiles, a byte each.
    linear = Int8Linear(torch.randn(208, 320) * 0.05, bias)
    q8, scale8 = linear.int8_weight()
    torch.testing.assert_close(ext.q4_linear(x, cpu_packing.pack_i8_tiles(q8, scale8), bias, True),
                               q8_product_int8(x, q8, scale8) + bias, atol=1e-4, rtol=1e-5)


def test_each_levels_build_is_its_own_module_saying_its_levels_simd_and_tiles(level, level_ext):
    """The Python side packs tiles by what the build says (`tiles_available()`, COMPLETER_TILES
    in cpu_gemm.h), and decides before building by the level's table (`int8_fused_here`): the
    two agree, per level, and each level has its own module and cache folder."""
    assert (level_ext.simd(), level_ext.tiles_available()) == (level.simd, level.tiles)
    assert level.tiles == (level.name == "avx512")
    assert level_ext.__file__ == str(cpu_decode.build_directory(level) / cpu_decode.so_name(level))
    assert level_ext.__name__ == f"completer_cpu_decode_{level.name}"


def test_each_level_packs_the_layout_its_build_reads(level, level_ext, int4):
    """With 8-bit activations the layer packs tiles exactly where the build multiplies them;
    a build without them refuses tiled weights, and an int8 model (tiles only) is refused."""
    assert FusedCpuLayers(int4.model, q8=True, level=level).tiles == level.tiles
    assert not FusedCpuLayers(int4.model, q8=False, level=level).tiles
    if level.tiles:
        return
    q, scale, low = int4_groups(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match="tiled weights need AVX512-VNNI"):
        level_ext.q4_linear(torch.randn(1, 64), cpu_packing.pack_q4_tiles(q, scale, low), None, True)
    with pytest.raises(FusedUnsupported, match="int8 projections run .* only with 8-bit activations in VNNI tiles"):
        FusedCpuLayers(load(EMBEDDED_TARGET, "int8").model, q8=True, level=level)


def test_the_level_is_the_highest_this_cpu_runs_unless_the_environment_names_one(monkeypatch):
    from completer.cpu_quant import int8_fused_here

    monkeypatch.delenv(cpu_levels.ENV, raising=False)
    here = runnable_levels()
    assert cpu_levels.selected_level() == here[-1]
    for level in here:
        monkeypatch.setenv(cpu_levels.ENV, level.name.upper())  # (any case)
        assert cpu_levels.selected_level() == level
        assert cpu_decode.extension().__name__ == f"completer_cpu_decode_{level.name}"
        assert cpu_decode.built()
        assert int8_fused_here() == level.tiles


def test_a_level_this_cpu_cannot_run_or_no_level_is_refused_in_one_line_naming_it(monkeypatch):
    from completer.cpu_quant import int8_fused_here

    monkeypatch.setattr(cpu_levels, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))  # an AVX2 CPU
    if runnable_levels()[-1] != cpu_levels.AVX2:
        pytest.skip("not an x86-64 machine")
    assert cpu_levels.selected_level() == cpu_levels.AVX2
    monkeypatch.setenv(cpu_levels.ENV, "avx512")
    with pytest.raises(cpu_decode.FusedUnavailable) as refused:
        cpu_decode.extension()
    assert str(refused.value) == (
        "$COMPLETER_CPU_LEVEL=avx512: this CPU cannot run the avx512 build of the fused CPU layer "
        "(it lacks avx512_vnni avx512bw avx512dq avx512f avx512vl; it runs scalar, avx2)")
    assert not cpu_decode.built() and not int8_fused_here()
    with pytest.raises(cpu_decode.FusedUnavailable, match="this CPU cannot run the avx512 build"):
        cpu_decode.extension(level=cpu_levels.AVX512)  # asked for by name too
    monkeypatch.setenv(cpu_levels.ENV, "avx9")
    with pytest.raises(cpu_decode.FusedUnavailable) as unknown:
        cpu_decode.extension()
    assert str(unknown.value) == \
        "$COMPLETER_CPU_LEVEL='avx9' is not a level of the fused CPU layer (scalar, avx2, avx512)"
    assert not cpu_decode.built() and not int8_fused_here()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,new,start", [(1, 1, 700), (1, 4, 37), (3, 3, 130), (2, 1, 0)])
def test_paged_attention_equals_sdpa_over_scattered_blocks(level_ext, dtype, rows, new, start):
    ext = level_ext
    torch.manual_seed(start + rows)
    cfg = ModelConfig("LlamaForCausalLM", 16, 576, 1536, 1, 9, 3, 64, 2048)
    pool = KVPool(cfg, 700, 4)
    pool.k, pool.v = pool.k.normal_().to(dtype), pool.v.normal_().to(dtype)
    tables = [torch.randperm(699)[:230].add(1).tolist() for _ in range(rows)]  # blocks anywhere, any order
    meta = AttentionMetadata.build(tables, [start + 5 * r for r in range(rows)], [new] * rows, 4)
    q, k, v = torch.randn(rows, 9, new, 64) * 2, torch.randn(rows, 3, new, 64), torch.randn(rows, 3, new, 64)
    want = TorchAttention(pool, meta).attend(0, q, k, v, meta.positions)  # writes this pass's K/V too
    got = ext.paged_attention(q.transpose(1, 2).reshape(rows * new, 9, 64), pool.k[0], pool.v[0],
                              meta.block_tables, meta.context_lens, new, 4)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(rows * new, 9, 64), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (0, 1.5), (24, 1.5)], ids=["window", "softcap", "both"])
@pytest.mark.parametrize("rows,new,start", [(1, 1, 700), (1, 4, 37), (3, 3, 130), (2, 6, 0)])
def test_windowed_and_soft_capped_paged_attention_equals_torchs(level_ext, window, softcap, rows, new, start):
    ext = level_ext
    torch.manual_seed(start + rows + window)
    cfg = ModelConfig("Gemma2ForCausalLM", 16, 576, 1536, 1, 8, 2, 64, 2048)
    pool = KVPool(cfg, 400, 4)
    pool.k, pool.v = pool.k.normal_(), pool.v.normal_()
    tables = [torch.randperm(399)[:200].add(1).tolist() for _ in range(rows)]
    meta = AttentionMetadata.build(tables, [start + 5 * r for r in range(rows)], [new] * rows, 4)
    q, k, v = torch.randn(rows, 8, new, 64) * 2, torch.randn(rows, 2, new, 64), torch.randn(rows, 2, new, 64)
    want = TorchAttention(pool, meta).attend(0, q, k, v, meta.positions, window, softcap)
    got = ext.paged_attention(q.transpose(1, 2).reshape(rows * new, 8, 64), pool.k[0], pool.v[0],
                              meta.block_tables, meta.context_lens, new, 4, window=window, softcap=softcap)
    torch.testing.assert_close(got, want.transpose(1, 2).reshape(rows * new, 8, 64), atol=1e-5, rtol=1e-5)


def test_a_fused_pass_writes_the_same_kv_hidden_states_and_logits_as_the_reference(int4, reference):
    ref = reference
    fused = FusedCpuLayers(int4.model)
    h = torch.randn(3, 512)
    with torch.inference_mode():
        torch.testing.assert_close(fused.head(h), ref.model.lm_head(h), atol=1e-4, rtol=1e-4)
    tokens = torch.tensor([int4.tokenizer.encode(PROMPT)[:12]] * 2)
    tokens[1] = tokens[1].flip(0)
    tables = [[3, 9, 1], [7, 2, 8]]
    meta = AttentionMetadata.build(tables, [0, 0], [12, 12], 4)
    pools = [KVPool(int4.model.config, 10, 4) for _ in range(2)]
    with torch.inference_mode():
        want = ref.model.hidden_states(tokens, meta.positions, TorchAttention(pools[0], meta))
        got = fused.hidden_states(tokens, meta, pools[1])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(pools[1].k, pools[0].k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pools[1].v, pools[0].v, atol=1e-4, rtol=1e-4)


def greedy_text(loaded, fused: bool, speculation: bool, n: int = 40, q8: bool = False) -> str:
    return served_greedy_text(loaded, PROMPT, EngineConfig(kv_cache_mb=16, fused_cpu=fused, fused_cpu_q8=q8),
                              SpecConfig(ngram=speculation, draft_model=False, adaptive=False, k_init=4), n)


@pytest.mark.parametrize("speculation", [False, True], ids=["decode", "n-gram verify"])
def test_the_engine_decodes_through_the_fused_layer_what_the_fp32_reference_decodes(int4, reference,
                                                                                    speculation):
    assert fused_layers_for(int4.model) is not None
    want = greedy_text(reference, fused=False, speculation=speculation)
    assert greedy_text(int4, fused=True, speculation=speculation) == want


@pytest.mark.parametrize("speculation", [False, True], ids=["decode", "n-gram verify"])
def test_with_8bit_activations_the_engine_decodes_what_the_q8_reference_decodes(int4, reference_q8, speculation):
    assert fused_layers_for(int4.model, q8=True) is not None
    want = greedy_text(reference_q8, fused=False, speculation=speculation)
    assert greedy_text(int4, fused=True, speculation=speculation, q8=True) == want


def test_an_int8_model_decodes_through_the_fused_layer_what_its_q8_reference_decodes(ext):
    vnni_only(ext)
    int8 = load(EMBEDDED_TARGET, "int8")
    assert fused_layers_for(int8.model, q8=True) is not None
    want = greedy_text(reference_model(q8_activations=True, precision="int8"), fused=False, speculation=False)
    assert greedy_text(int8, fused=True, speculation=False, q8=True) == want


def test_an_interrupted_fused_pass_gives_up_and_leaves_the_sequence_where_it_was(int4):
    runner = ModelRunner(int4.model, KVPool(int4.model.config, 16, 4), fused=FusedCpuLayers(int4.model))
    state = CacheState()
    state.table, state.computed = [1, 2, 3], 0
    asked = []
    with pytest.raises(PassInterrupted):
        runner.execute([state], [[5, 6, 7]], interrupted=lambda: asked.append(1) or len(asked) > 2)
    assert state.computed == 0 and len(asked) == 3


def test_a_model_the_fused_layer_cannot_run_serves_through_torch(caplog):
    fp32 = load(EMBEDDED_TARGET, "fp32")
    with pytest.raises(FusedUnsupported, match="int4"):
        FusedCpuLayers(fp32.model)
    with caplog.at_level(logging.INFO, logger="completer.engine"):
        assert fused_layers_for(fp32.model) is None
    assert "passes run through torch's ops" in caplog.text
    assert greedy_text(fp32, fused=True, speculation=False, n=8)  # and it still serves


def test_no_compiler_means_the_torch_path_with_one_line_saying_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_decode, "_built", {cpu_levels.selected_level().name:
                                               "the fused CPU layer could not be built (no c++)"})
    model = load(EMBEDDED_TARGET, "int4").model
    with caplog.at_level(logging.INFO, logger="completer.engine"):
        assert fused_layers_for(model) is None
    assert "could not be built (no c++)" in caplog.text


# Run in a child process: a destructor that hangs holds the GIL, so only a
# process that is waited for with a timeout can fail the test instead of hanging it.
THREADS_START_AND_STOP = """
import os, sys, time
from completer_kernels import cpu_decode
ext = cpu_decode.extension()
threads = lambda: len(os.listdir("/proc/self/task"))
for i in range(200):
    before = threads()
    layers = ext.FusedLayers(1, 1, 64, 1e-6, False, 2)
    started = threads()
    del layers  # joins its helper
    deadline = time.monotonic() + 5  # a joined thread leaves /proc a moment after the join returns
    while threads() != before and time.monotonic() < deadline:
        time.sleep(0.001)
    if started != before + 1 or threads() != before:
        sys.exit(f"layer {i}: {before} threads, {started} with the layer, {threads()} after it")
print("ok")
"""


def test_the_layer_threads_start_and_stop_at_once_however_short_their_life(ext):
    """A layer built and dropped at once (a model it cannot run) stops its helper
    threads even when they had not yet started waiting (this hung once): each of
    200 layers starts its one helper thread, and dropping the layer ends it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        done = subprocess.run([sys.executable, "-c", THREADS_START_AND_STOP], env=env, capture_output=True,
                              text=True, timeout=300)  # seconds when it works, even on a loaded machine
    except subprocess.TimeoutExpired:
        pytest.fail("dropping a layer hung (a helper thread that never saw the stop)")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def test_a_mixed_int4_int8_gguf_model_runs_in_the_fused_layer_as_its_reference(ext, tmp_path):
    """A Q4_K_M-like file at int4+int8 (Q4_K projections int4 from the file's
    groups, those with a Q6_K part int8): the fused layer packs each by its own
    type and computes what torch's reference does with 8-bit activations and
    the int4 scales and minimums as fp16 (the layer's packing)."""
    from gguf import GGMLQuantizationType as Q

    from completer.cpu_quant import MIXED
    from support.gguf_files import write_pair

    vnni_only(ext)
    path, _ = write_pair(tmp_path, "qwen2", Q.Q4_K, tensor_types={"blk.0.attn_v": Q.Q6_K, "blk.1.ffn_down": Q.Q6_K})
    mixed, ref = load(path, MIXED).model, load(path, MIXED).model
    kinds = [type(m).__name__ for layer in mixed.model.layers
             for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert kinds == ["Int8Linear", "Int4Linear", "Int4Linear", "Int4Linear"] + \
                    ["Int4Linear", "Int4Linear", "Int4Linear", "Int8Linear"]
    for m in ref.modules():
        if isinstance(m, Int4Linear):
            m.scale.copy_(m.scale.half().float())
            m.low.copy_(m.low.half().float())
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.q8_activations = True
    fused = FusedCpuLayers(mixed, q8=True)
    tokens = torch.tensor([[5, 17, 300, 4000, 9, 12, 77, 1000]])
    meta = AttentionMetadata.build([[3, 1]], [0], [8], 4)
    pools = [KVPool(mixed.config, 4, 4) for _ in range(2)]
    with torch.inference_mode():
        want = ref.hidden_states(tokens, meta.positions, TorchAttention(pools[0], meta))
        got = fused.hidden_states(tokens, meta, pools[1])
    # An activation rounded to the other side of a step now and then moves a few values by ~1e-3; with
    # fp32 scales in the reference instead the mean error is ~7x this bound, with fp32 activations ~50x.
    assert want.std() > 0.5
    assert (got - want).abs().mean() < 2e-4 and (got - want).abs().max() < 1e-2


# Each family's random model (support/hf_models.py's weights) at widths the layer's
# 4-bit kernels take; sliding layers read back 8 keys, well inside the passes below.
SMALL = dict(vocab_size=211, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
WINDOW = 8
FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL)),  # q/k norms
    # Seven layers: five sliding, one global, one sliding, each with its own RoPE base; q/k norms,
    # sandwich norms, GELU (tanh), an attention scale folded into q_norm.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**{**SMALL, "num_hidden_layers": 7}, sliding_window=WINDOW,
                                                   query_pre_attn_scalar=40)),
    # LayerNorms with biases, a plain MLP with biases, GELU (tanh), every layer sliding.
    "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config(**SMALL, sliding_window=WINDOW)),
    "gemma": (GemmaForCausalLM, GemmaConfig(**SMALL)),  # GELU (tanh)
    # Soft-capped attention scores (low enough to bite), every other layer sliding.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SMALL, sliding_window=WINDOW, query_pre_attn_scalar=32,
                                               attn_logit_softcapping=0.5, final_logit_softcapping=2.0)),
    "granite": (GraniteForCausalLM, GraniteConfig(**SMALL, attention_bias=True, embedding_multiplier=12.0,
                                                  attention_multiplier=0.05, residual_multiplier=0.22,
                                                  logits_scaling=8.0)),
}
# Tokens each of two rows brings per pass: a prefill of 40 through torch's ops (too wide
# for the layer) then verify and decode passes through it, reading past the window; or
# every pass through the layer, rows of different lengths (padding), chunks wider than
# the window.
SCHEDULES = {"torch-prefill": [(40, 41), (4, 2), (1, 1), (1, 1)],
             "fused-prefill": [(16, 12), (16, 16), (8, 12), (3, 4), (1, 1), (1, 1)]}


def family_passes(model: Transformer, fused: FusedCpuLayers | None, schedule, seed: int = 0) -> list[torch.Tensor]:
    """Logits of each pass of `schedule` over two rows on scattered blocks (the same for every call)."""
    gen = torch.Generator().manual_seed(seed)
    pool = KVPool(model.config, 40, 4)
    runner = ModelRunner(model, pool, fused=fused)
    blocks = torch.randperm(39, generator=gen).add(1).tolist()
    states = [CacheState(), CacheState()]
    states[0].table, states[1].table = blocks[:13], blocks[13:26]
    logits = []
    for lens in schedule:
        rows = [torch.randint(0, model.config.vocab_size, (n,), generator=gen).tolist() for n in lens]
        logits.append(runner.execute(states, rows))
        advance(states, lens)  # (the next pass continues both rows)
    return [*logits, pool.k, pool.v]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    """(family, the directory its random HF checkpoint is saved in)."""
    directory = tmp_path_factory.mktemp(request.param)
    random_hf_model(request.param, FAMILIES).save_pretrained(directory)
    return request.param, directory


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_family_runs_fused_with_the_torch_paths_logits_and_kv(level, family_model, schedule):
    family, directory = family_model
    model = load_model(directory, "int4", fuse=True)
    fused = FusedCpuLayers(model, level=level)
    # The fused layer holds its own packed copy of the weights: the model's torch path
    # (the reference, and the passes too wide for the layer) made exact meanwhile.
    torch_reference(model, q8_activations=False)
    with torch.inference_mode():
        want = family_passes(model, None, SCHEDULES[schedule])
        got = family_passes(model, fused, SCHEDULES[schedule])
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=2e-4, rtol=1e-4, msg=lambda m: f"{family}, pass {i}: {m}")


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_each_family_with_8bit_activations_gives_its_q8_references_logits(level, level_ext, family_model, precision):
    """8-bit activations (the tiled kernels where the build has them, else the pairs'): the
    same math as the q8 reference, but rounding activations to 8 bits amplifies the last
    bit's differences (the reference itself moves ~1e-3 of its hidden states under 1e-7
    noise on its input), so the bound is relative: measured <= 0.065 at int4, 0.011 at
    int8, where a layer without its window, q/k norms or soft cap is off by 0.3 to 1.2."""
    if precision == "int8":
        vnni_only(level_ext)  # (int8 runs only in tiles: test_a_build_without_tiles_...)
    family, directory = family_model
    model = load_model(directory, precision, fuse=True)
    fused = FusedCpuLayers(model, q8=True, level=level)
    assert fused.tiles == level.tiles, family
    torch_reference(model, q8_activations=True)
    with torch.inference_mode():
        want = family_passes(model, None, SCHEDULES["fused-prefill"])
        got = family_passes(model, fused, SCHEDULES["fused-prefill"])
    for i, (g, w) in enumerate(zip(got, want)):
        off = ((g - w).norm() / w.norm()).item()
        assert off < (0.12 if precision == "int4" else 0.03), f"{family}, pass {i}: {off:.3f} off"


def test_what_the_fused_layer_cannot_run_is_said_once_at_warning_with_why(caplog):
    # An MLP 96 wide: the 4-bit pairs (fp32 activations) take widths of 64s.
    cfg = ModelConfig("Qwen3ForCausalLM", 211, 128, 96, 2, 4, 2, 32, 256, qk_norm=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    model = quantize_cpu_linears(model.fuse_projections(), "int4")
    with caplog.at_level(logging.INFO, logger="completer.engine"):
        assert fused_layers_for(model) is None
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "not used" in caplog.text and "input width 96 is not a multiple of 64" in caplog.text
    # A norm, an activation or an MLP the layer has no code for: the layer itself says so.
    model.config = msgspec.structs.replace(cfg, activation="relu", intermediate_size=128)
    with pytest.raises(FusedUnsupported, match="no relu activation .* \\(Qwen3ForCausalLM\\)"):
        FusedCpuLayers(model)
