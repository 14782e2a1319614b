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
