"""The fused CPU layer (kernels/cpu_decode.cpp, engine/fused_cpu.py): its 4-bit
GEMM and its paged attention equal their plain-torch references, and the engine
decodes through it the same greedy text as the fp32 reference path."""

import logging

import pytest
import torch

from completer.cpu_quant import Int4Linear, Int8Linear, int4_groups, q8_product_int8
from completer.engine.attention import AttentionMetadata, PassInterrupted, TorchAttention
from completer.engine.config import EngineConfig, SpecConfig
from completer.engine.fused_cpu import FusedCpuLayers, FusedUnsupported, fused_layers_for
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState
from completer.loading import load
from completer.model import ModelConfig
from completer.model_store import EMBEDDED_TARGET
from completer_kernels import cpu_decode
from engine_harness import served_greedy_text

PROMPT = "import os\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return [line.rstrip() for line in f"


@pytest.fixture(scope="module")
def ext():
    return cpu_decode.extension()  # a compiler is part of the test machine (.ci/run)


@pytest.fixture(scope="module")
def int4():
    return load(EMBEDDED_TARGET, "int4")


def reference_model(q8_activations: bool, precision: str = "int4"):
    """The same int4 (or int8) projections and int8 head multiplied in fp32 by torch's
    ops (activations rounded to 8 bits per block of 32 as llama.cpp does, or not rounded)."""
    ref = load(EMBEDDED_TARGET, precision)
    for m in ref.model.modules():
        if isinstance(m, Int4Linear):
            m.compute_dtype = torch.float32
            m.keep_dense(1)
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.q8_activations = q8_activations
    weight, scale = ref.model.lm_head.int8_weight()
    ref.model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    ref.model.lm_head.weight.data = weight.float() * scale[:, None]
    return ref


@pytest.fixture(scope="module")
def reference():
    return reference_model(q8_activations=False)


@pytest.fixture(scope="module")
def reference_q8():
    return reference_model(q8_activations=True)


def vnni_only(ext):
    if ext.simd() != "avx512-vnni":
        pytest.skip(f"the tiled kernels are AVX512-VNNI's; this machine's build is {ext.simd()}")


def packed_both_ways(pack, unpack, q, scale, low):
    """The 4-bit groups packed; unpacking gives them back exactly."""
    packed = pack(q, scale, low)
    back = unpack(packed)
    assert torch.equal(back[0], q.float()) and torch.equal(back[1], scale) and torch.equal(back[2], low)
    return packed


def assert_q8_reference(ext, x, packed, bias):
    """The extension's product with 8-bit activations equals the torch reference's; returns it."""
    got = ext.q4_linear(x, packed, bias, True)
    torch.testing.assert_close(got, cpu_decode.q4_linear_reference(x, packed, bias), atol=1e-4, rtol=1e-5)
    return got


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_4bit_gemm_equals_its_torch_reference_with_q8_and_fp32_activations(ext, rows):
    torch.manual_seed(rows)
    w = torch.randn(200, 320) * 0.05
    q, scale, low = int4_groups(w)
    pairs = packed_both_ways(cpu_decode.pack_q4, cpu_decode.unpack_q4, q, scale, low)
    x, bias = torch.randn(rows, 320), torch.randn(200)
    assert_q8_reference(ext, x, pairs, bias)
    dense = (q.float().view(200, -1, 32) * scale[..., None] + low[..., None]).view(200, 320)
    torch.testing.assert_close(ext.q4_linear(x, pairs, bias, False), x @ dense.T + bias, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        cpu_decode.pack_q4(*int4_groups(torch.randn(8, 96)))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_the_tiled_vnni_gemms_equal_the_pairs_kernel_and_the_torch_references(ext, rows):
    vnni_only(ext)
    torch.manual_seed(rows)
    q, scale, low = int4_groups(torch.randn(208, 320) * 0.05)
    tiles = packed_both_ways(cpu_decode.pack_q4_tiles, cpu_decode.unpack_q4_tiles, q, scale, low)
    x, bias = torch.randn(rows, 320), torch.randn(208)
    got = assert_q8_reference(ext, x, tiles, bias)
    torch.testing.assert_close(got, ext.q4_linear(x, cpu_decode.pack_q4(q, scale, low), bias, True),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="8-bit activations"):
        ext.q4_linear(x, tiles, bias, False)
    with pytest.raises(ValueError, match="multiple of 16 x 32"):
        cpu_decode.pack_q4_tiles(*int4_groups(torch.randn(24, 64)))
    # The int8 model's weights in the same tiles, a byte each.
    linear = Int8Linear(torch.randn(208, 320) * 0.05, bias)
    q8, scale8 = linear.int8_weight()
    torch.testing.assert_close(ext.q4_linear(x, cpu_decode.pack_i8_tiles(q8, scale8), bias, True),
                               q8_product_int8(x, q8, scale8) + bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,new,start", [(1, 1, 700), (1, 4, 37), (3, 3, 130), (2, 1, 0)])
def test_paged_attention_equals_sdpa_over_scattered_blocks(ext, dtype, rows, new, start):
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
    monkeypatch.setattr(cpu_decode, "_built", {"error": "the fused CPU layer could not be built (no c++)"})
    model = load(EMBEDDED_TARGET, "int4").model
    with caplog.at_level(logging.INFO, logger="completer.engine"):
        assert fused_layers_for(model) is None
    assert "could not be built (no c++)" in caplog.text


def test_the_layer_threads_start_and_stop_at_once_however_short_their_life(ext):
    """A layer built and dropped at once (a model it cannot run) stops its helper
    threads even when they had not yet started waiting (this hung once)."""
    for _ in range(200):
        layers = ext.FusedLayers(1, 1, 64, 1e-6, False, 2)
        del layers


def test_a_mixed_int4_int8_gguf_model_runs_in_the_fused_layer_as_its_reference(ext, tmp_path):
    """A Q4_K_M-like file at int4+int8 (Q4_K projections int4 from the file's
    groups, those with a Q6_K part int8): the fused layer packs each by its own
    type and computes what torch's reference does with 8-bit activations and
    the int4 scales and minimums as fp16 (the layer's packing)."""
    from gguf import GGMLQuantizationType as Q

    from completer.cpu_quant import MIXED
    from gguf_files import write_pair

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
