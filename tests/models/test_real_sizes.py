"""latency_bench/real_sizes.py: the shapes are the models', a random file at a
shape loads as that model (the vocabulary padded, the fused CPU layer taking
it), and the benchmark runs end to end at the tiny test shape."""

import json
import subprocess
import sys

import pytest

from latency_bench import llama_peer
from latency_bench.harness import ROOT
from latency_bench.real_sizes import SHAPES, write_f16


def test_the_shapes_have_the_models_published_sizes():
    """Parameters as the model cards give them (tied embeddings counted once)."""
    published = {"0.5b": 0.49e9, "1.5b": 1.54e9, "3b": 3.09e9}
    for name, params in published.items():
        s = SHAPES[name]
        layer = s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden \
            + 3 * s.hidden * s.ffn
        assert abs(s.layers * layer + s.vocab * s.hidden - params) / params < 0.01, name
    assert {SHAPES[n].head_dim for n in published} == {64, 128}


def test_a_random_file_at_a_shape_loads_as_that_model_through_the_fused_layer(tmp_path, default_model, caplog):
    from completer.checkpoint import load_tokenizer
    from completer.engine.fused_cpu import fused_layers_for
    from completer.loading import load_models

    path = write_f16("tiny", tmp_path / "tiny.F16.gguf")
    target, _ = load_models(path, "", "int4")
    cfg = target.model.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.tie_word_embeddings) == \
        ("Qwen2ForCausalLM", 256, 2, True)
    text = "def main():\n    return 0\n"
    assert target.tokenizer.encode(text) == load_tokenizer(default_model).encode(text)  # the real vocabulary
    assert fused_layers_for(target.model, True) is not None, caplog.text


@pytest.mark.skipif(not llama_peer.quantize_binary(must_exist=False).is_file(),
                    reason="llama-quantize not built (python -m latency_bench llama-peer build)")
@pytest.mark.timeout(1200)  # the benchmark's run: up to 900 s
def test_the_benchmark_runs_end_to_end_at_the_tiny_shape(tmp_path, default_model):
    servers = ["completer"] + (["llama.cpp"] if llama_peer.server_binary(must_exist=False).is_file() else [])
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "latency_bench", "real-sizes", "--shapes", "tiny", "--reps", "1",
                           "--cases", "2", "--spec", "tiny:tiny", "--servers", *servers, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert not result["skipped"], result["skipped"]
    assert {(r["precision"], r["server"]) for r in result["rows"]} == \
        {(p, s) for p in ("int4", "int8") for s in servers}
    for row in result["rows"]:
        m = row["measured"]
        assert m["prefill_ms"] > 0 and m["decode_tok_s"] > 0 and 0 < m["key_ttft_ms"] <= m["key_line_ms"]
        assert m["prompt_tokens"] == 1000 and m["key_prompt_computed"] <= 2  # the rest came from the cache
        assert row["memory"]["rss_mb"] > 0
        if row["server"] == "completer":
            assert row["fused"] and not row["fused_refusals"]
    assert result["shapes"]["tiny"]["kv_bytes_per_token"] == {"completer (fp32)": 2048, "llama.cpp (f16)": 1024}
    assert result["spec"]["spec"]["plain_ms"] > 0 and "break-even" in done.stdout


@pytest.mark.parametrize("name", ["0.5b", "1.5b", "3b"])
@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_the_fused_cpu_layer_takes_each_shape_and_computes_what_torch_does(name, precision):
    """A layer at each model's widths (heads of 64 and 128, 7, 6 and 8 query
    heads a K/V head): the fused layer builds, as served (8-bit activations),
    and writes the hidden states torch's ops write from the same quantized
    weights with the activations rounded alike."""
    import copy

    import torch

    from completer.cpu_quant import Int4Linear, Int8Linear, quantize_cpu_linears
    from completer.engine.attention import AttentionMetadata, TorchAttention
    from completer.engine.fused_cpu import FusedCpuLayers, FusedUnsupported
    from completer.engine.paged_kv import KVPool
    from completer.model import ModelConfig, Transformer
    from completer_kernels import cpu_decode

    s = SHAPES[name]
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=512, hidden_size=s.hidden, intermediate_size=s.ffn,
                      num_hidden_layers=1, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, max_position_embeddings=s.context, rope_theta=s.rope_theta,
                      tie_word_embeddings=True, qkv_bias=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    model.lm_head.weight = model.model.embed_tokens.weight
    model = quantize_cpu_linears(model.fuse_projections().eval(), precision)
    try:
        fused = FusedCpuLayers(model, q8=True)
    except FusedUnsupported as e:
        if precision == "int8" and cpu_decode.extension().simd() != "avx512-vnni":
            pytest.skip(f"int8 runs through the fused layer on AVX512-VNNI only: {e}")
        raise
    reference = copy.deepcopy(model)
    for m in reference.modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            m.q8_activations = True
    tokens = torch.randint(0, 512, (1, 12))
    meta = AttentionMetadata.build([[3, 1, 2]], [0], [12], 4)
    pools = [KVPool(cfg, 4, 4) for _ in range(2)]
    with torch.inference_mode():
        want = reference.hidden_states(tokens, meta.positions, TorchAttention(pools[0], meta))
        got = fused.hidden_states(tokens, meta, pools[1])
    # Rounding each activation to 8 bits moves a value across a step now and then (sums in another order):
    # under 1% here at int4; a head or group laid out wrong would be of the order of the states themselves.
    assert ((got - want).norm() / want.norm()).item() < 0.02
