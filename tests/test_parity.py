"""Our runtime against transformers on random-weight Llama and Qwen2 checkpoints:
prefill, then one-token decode steps through the engine's paged KV pool and
model runner, fp32 logits."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from completer.checkpoint import load_model
from completer.engine.block_manager import BlockManager
from completer.engine.model_runner import ModelRunner
from completer.engine.paged_kv import KVPool
from completer.engine.sequence import CacheState

SMALL = dict(vocab_size=211, hidden_size=64, intermediate_size=136, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)

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
}


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case, tmp_path):
    cls, config = CASES[case]
    torch.manual_seed(hash(case) % 1000)
    reference = cls(config).eval()
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in reference.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
    # Small shards exercise the sharded-index path as well.
    reference.save_pretrained(tmp_path, max_shard_size="100KB" if "qwen2" == case else "50MB")
    ours = load_model(tmp_path, "fp32")

    prompt = torch.randint(0, SMALL["vocab_size"], (2, 37))
    steps = torch.randint(0, SMALL["vocab_size"], (2, 5))
    with torch.no_grad():
        full = torch.cat([prompt, steps], dim=1)
        expected = reference(full).logits

        runner = ModelRunner(ours, KVPool(ours.config, 32, 4))
        blocks, states = BlockManager(32, 4), [CacheState(), CacheState()]
        for state in states:
            blocks.grow(state.table, full.shape[1])
        got = [runner.execute(states, prompt.tolist())]
        for i in range(steps.shape[1]):
            got.append(runner.execute(states, steps[:, i:i + 1].tolist()))
        got = torch.cat(got, dim=1)
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= 1e-4, f"{case}: max abs diff {diff}"
    # And without a cache (training path), in one pass.
    with torch.no_grad():
        assert (ours(full) - expected).abs().max().item() <= 1e-4
