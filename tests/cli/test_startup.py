"""`completer serve` start-up: a start that cannot succeed ends before the port
is announced, with one `error:` line naming the problem (and the key, and
where it was set) and a nonzero exit; no traceback, no "listening" line."""

import shutil

import pytest

from latency_bench.harness import ROOT, TOKEN
from support.serve import refused


def test_max_tokens_that_leave_no_prompt_stop_the_start():
    """With max_tokens above context_tokens the prompt budget was negative and
    the first request spun at 100% CPU; now the start refuses it."""
    error = refused("--model", "embedded", "--token", TOKEN, "--set", "request.max_tokens=1100")
    assert error.startswith("error: --set request.max_tokens=1100: ")
    assert "request.max_tokens" in error and "model.context_tokens" in error


@pytest.mark.parametrize("size", ["0.01", "4"])
def test_a_kv_cache_that_cannot_hold_one_full_window_stops_the_start(size):
    """0.01 MB printed a traceback (a pool under 2 blocks); 4 MB started, and
    then refused every prompt near the window's length."""
    error = refused("--model", "embedded", "--token", TOKEN, "--set", f"engine.kv_cache_mb={size}")
    assert "engine.kv_cache_mb" in error and "at least" in error


def test_an_unknown_set_key_is_named_as_the_sets():
    error = refused("--model", "embedded", "--token", TOKEN, "--set", "engine.warp=1")
    assert error.startswith("error: --set engine.warp=1: ") and "default.toml" not in error


def test_an_unknown_key_in_the_file_names_the_file(tmp_path):
    config = tmp_path / "mine.toml"
    config.write_text("[engine]\nwarp = 1\n")
    error = refused("--config", str(config), "--model", "embedded", "--token", TOKEN)
    assert error.startswith(f"error: {config}: ") and "warp" in error


def test_a_missing_model_fails_before_listening(tmp_path):
    error = refused("--model", str(tmp_path / "nope"), "--token", TOKEN)
    assert str(tmp_path / "nope") in error and "model.target" in error


def test_a_model_that_fails_to_load_fails_before_listening(tmp_path):
    """A checkpoint whose config reads but whose weights do not: the check
    before binding passes, the load fails, and that error is all it says."""
    model = tmp_path / "broken"
    shutil.copytree(ROOT / "completer" / "models" / "target", model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    error = refused("--model", str(model), "--set", "model.draft=\"\"", "--token", TOKEN)
    assert str(model) in error


def test_models_that_do_not_fit_the_memory_given_stop_the_start():
    """model.max_memory_gb: the weights (estimated from the shapes, at the
    precision the start resolves) and the K/V pool against the budget, before
    any weight is read."""
    error = refused("--model", "embedded", "--token", TOKEN, "--set", "model.max_memory_gb=0.5")
    assert error.startswith("error: model.max_memory_gb: the models need about "), error
    assert "K/V pool 0.27" in error and "more than the 0.5 GB model.max_memory_gb" in error, error


def test_the_memory_estimate_counts_what_each_precision_holds():
    from completer.memory import model_bytes, projection_weights
    from completer.model import ModelConfig

    # Qwen2.5-Coder-3B's shape (tied embeddings): 2.77e9 projection weights, 151,936 x 2048 rows
    cfg = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                      num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, head_dim=128,
                      max_position_embeddings=32768, tie_word_embeddings=True)
    assert projection_weights(cfg) == 36 * (2048 * (2048 + 512) + 2048 * 2048 + 3 * 2048 * 11008)
    assert model_bytes(cfg, "fp32") == 4 * (projection_weights(cfg) + 151936 * 2048)  # the head is the embedding
    lean, served = model_bytes(cfg, "int4", 0, fused_cpu=False), model_bytes(cfg, "int4", 32, fused_cpu=True)
    assert 5e9 < lean < 6e9 and served > lean + 2 * projection_weights(cfg)  # + the dense copy and the fused blocks
    # int4+int8 (a mixed GGUF): each projection one or the other, bounded by the larger
    assert model_bytes(cfg, "int4+int8") == max(model_bytes(cfg, p) for p in ("int4", "int8"))
