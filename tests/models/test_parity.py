"""Our runtime against transformers on random-weight checkpoints of every
family completer serves (Llama, Qwen2, Qwen3, StarCoder2, Gemma 1/2/3,
Granite), each saved as an HF directory and written as a GGUF the way
llama.cpp's converter lays it out: prefill, then one-token decode steps
through the engine's paged KV pool and model runner, fp32 logits and greedy
tokens."""

import pytest
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GemmaConfig,
                          GemmaForCausalLM, GraniteConfig, GraniteForCausalLM, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM, Starcoder2Config,
                          Starcoder2ForCausalLM)

from completer.checkpoint import CheckpointError, load_model
from completer.engine.block_manager import BlockManager
from completer.engine.kv_cache_manager import advance
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState
from support.gguf_files import write_from_transformers
from support.hf_models import random_hf_model

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=136, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
WINDOW = 8  # sliding layers' window: well inside the 42 tokens each case runs
GEMMA = dict(SMALL, head_dim=16, sliding_window=WINDOW)

CASES = {
    "llama": (LlamaForCausalLM, LlamaConfig(**SMALL)),
    "llama-tied-mha": (LlamaForCausalLM, LlamaConfig(
        **{**SMALL, "num_key_value_heads": 8}, tie_word_embeddings=True)),
    "llama3-rope-scaling": (LlamaForCausalLM, LlamaConfig(
        **SMALL, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear-rope-bias": (LlamaForCausalLM, LlamaConfig(
        **SMALL, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SMALL, rope_theta=1000000.0)),
    "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**SMALL, head_dim=16)),
    "starcoder2": (Starcoder2ForCausalLM, Starcoder2Config(**SMALL, sliding_window=WINDOW)),
    "gemma": (GemmaForCausalLM, GemmaConfig(**{**SMALL, "head_dim": 16})),
    # Soft caps low enough to bite on random weights.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**GEMMA, query_pre_attn_scalar=16, attn_logit_softcapping=0.5,
                                               final_logit_softcapping=2.0)),
    # Seven layers: five sliding, one global, one sliding (the 5:1 pattern), each with its RoPE base.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig(**{**GEMMA, "num_hidden_layers": 7}, query_pre_attn_scalar=16)),
    "granite": (GraniteForCausalLM, GraniteConfig(
        **SMALL, attention_bias=True, embedding_multiplier=12.0, attention_multiplier=0.05,
        residual_multiplier=0.22, logits_scaling=8.0)),
}
# An attention scale other than 1/sqrt(head_dim): HF directories carry it
# (query_pre_attn_scalar), llama.cpp's GGUF does not (it uses 1/sqrt(head_dim)).
HF_ONLY = {
    "gemma2-query-scalar": (Gemma2ForCausalLM, Gemma2Config(**GEMMA, query_pre_attn_scalar=40)),
    "gemma3-query-scalar": (Gemma3ForCausalLM, Gemma3TextConfig(**{**GEMMA, "num_hidden_layers": 7},
                                                                query_pre_attn_scalar=40)),
}


def engine_logits(ours, prompt: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Logits of `prompt` then each of `steps` a token at a time, through the paged pool."""
    runner = ModelRunner(ours, KVPool(ours.config, 32, 4))
    blocks, states = BlockManager(32, 4), [CacheState() for _ in range(prompt.shape[0])]
    for state in states:
        blocks.grow(state.table, prompt.shape[1] + steps.shape[1])
    got = [runner.execute(states, prompt.tolist())]
    advance(states, [prompt.shape[1]] * len(states))
    for i in range(steps.shape[1]):
        got.append(runner.execute(states, steps[:, i:i + 1].tolist()))
        advance(states, [1] * len(states))
    return torch.cat(got, dim=1)


def assert_parity(case: str, reference, ours) -> None:
    vocab = reference.config.vocab_size
    prompt = torch.randint(0, vocab, (2, 37))
    steps = torch.randint(0, vocab, (2, 5))
    with torch.no_grad():
        full = torch.cat([prompt, steps], dim=1)
        expected = reference(full).logits
        got = engine_logits(ours, prompt, steps)
        assert got.shape == expected.shape
        bound = 1e-4 * max(1.0, expected.abs().max().item())
        diff = (got - expected).abs().max().item()
        assert diff <= bound, f"{case}: max abs diff {diff} (logits up to {expected.abs().max().item():.2f})"
        # And without a cache (training path), in one pass.
        assert (ours(full) - expected).abs().max().item() <= bound

        # Greedy: transformers' generate against our runner feeding back its own argmax.
        theirs = reference.generate(prompt[:1], attention_mask=torch.ones_like(prompt[:1]), max_new_tokens=6,
                                    do_sample=False, pad_token_id=0)[0, 37:].tolist()
        mine = [engine_logits(ours, prompt[:1], prompt[:1, :0])[0, -1].argmax().item()]
        while len(mine) < 6:
            mine.append(engine_logits(ours, prompt[:1], torch.tensor([mine]))[0, -1].argmax().item())
        assert mine == theirs, f"{case}: greedy {mine} != transformers' {theirs}"


@pytest.mark.parametrize("case", [*CASES, *HF_ONLY])
def test_logits_match_transformers(case, tmp_path):
    cases = {**CASES, **HF_ONLY}
    reference = random_hf_model(case, cases)
    # Small shards exercise the sharded-index path as well.
    reference.save_pretrained(tmp_path, max_shard_size="100KB" if "qwen2" == case else "50MB")
    assert_parity(case, reference, load_model(tmp_path, "fp32"))


@pytest.mark.parametrize("case", [c for c in CASES if c in ("llama", "qwen2") or "-" not in c])
def test_gguf_of_each_family_matches_transformers(case, tmp_path):
    reference = random_hf_model(case, CASES)
    write_from_transformers(reference, tmp_path / "model.gguf")
    assert_parity(case, reference, load_model(tmp_path / "model.gguf", "fp32"))


def test_an_unsupported_architecture_fails_in_one_line(tmp_path):
    reference = random_hf_model("llama", CASES)
    reference.save_pretrained(tmp_path)
    config = (tmp_path / "config.json").read_text().replace("LlamaForCausalLM", "MambaForCausalLM")
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert "unsupported architecture 'MambaForCausalLM'" in str(e.value) and "\n" not in str(e.value)
    assert "Gemma3ForCausalLM" in str(e.value)  # the message lists what is supported
