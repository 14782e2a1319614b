"""Tiny GGUF files written here with ggml-org's `gguf` writer, as llama.cpp's
converter lays them out (Q/K rows of `llama` models permuted), next to an HF
directory holding the very weights the GGUF decodes to."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

from completer.model_store import EMBEDDED_TARGET

SHIPPED_TOKENIZER = EMBEDDED_TARGET / "tokenizer.json"
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # rows a multiple of 256: K-quants fit
K_QUANTS = {Q.Q4_K: ((0, 2), (2, 4)), Q.Q5_K: ((0, 2), (2, 4)), Q.Q6_K: ((208, 210),)}  # fp16 scale fields

HF_NAMES = {  # HF name (after "model.layers.N.") -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def shipped_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """tokens (by id), token types (3 = control), merges of the embedded model's BPE."""
    spec = json.loads(SHIPPED_TOKENIZER.read_text())
    vocab = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    types = [3 if i in special else 1 for i in range(len(tokens))]
    merges = [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    return tokens, types, merges


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows of a `llama` model."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """The bytes of `w` in `qtype`. K-quants (no quantizer in gguf-py): random
    blocks of the right shape with sane fp16 scales, `w` ignored."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16)
    if qtype in K_QUANTS or qtype == Q.Q8_1:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        scale_fields = K_QUANTS.get(qtype, ((0, 2), (2, 4)))
        for lo, hi in scale_fields:
            raw[..., lo:hi] = rng.uniform(0.001, 0.01, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def decode(raw: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.Q8_1:  # written to test the error; no reference weights exist
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((raw.shape[0], raw.shape[1] // size * block), np.float32)
    if qtype in (Q.F32, Q.F16):
        return raw.astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


def config(arch: str, vocab: int) -> dict:
    qwen = arch == "qwen2"
    return {"architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": arch, "vocab_size": vocab, "hidden_size": HIDDEN, "intermediate_size": FFN,
            "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": not qwen, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": 0, "eos_token_id": 0}


def write_pair(root: Path, arch: str, qtype: Q, seed: int = 0, pre: str = "default",
               gguf_arch: str | None = None, tokenizer_model: str = "gpt2",
               tensor_types: dict[str, Q] | None = None) -> tuple[Path, Path]:
    """A random model as `root/model.gguf` (2-D weights in `qtype`, norms and
    biases in F32) and `root/hf/` (config.json, model.safetensors and
    tokenizer.json with the weights the GGUF decodes to). Returns both paths.
    `tensor_types`: other types for the 2-D tensors whose GGUF name starts with a
    key ({"blk.0.attn_v": Q.Q6_K}: a mixed file, as Q4_K_M is)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = shipped_vocabulary()
    cfg = config(arch, len(tokens))
    hd = HIDDEN // HEADS
    shapes = {"input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
              "self_attn.q_proj.weight": (HEADS * hd, HIDDEN), "self_attn.k_proj.weight": (KV_HEADS * hd, HIDDEN),
              "self_attn.v_proj.weight": (KV_HEADS * hd, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HEADS * hd),
              "mlp.gate_proj.weight": (FFN, HIDDEN), "mlp.up_proj.weight": (FFN, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, FFN)}
    if arch == "qwen2":
        shapes |= {"self_attn.q_proj.bias": (HEADS * hd,), "self_attn.k_proj.bias": (KV_HEADS * hd,),
                   "self_attn.v_proj.bias": (KV_HEADS * hd,)}
    tensors = {f"model.layers.{i}.{name}": (f"blk.{i}.{HF_NAMES[name]}", shape)
               for i in range(LAYERS) for name, shape in shapes.items()}
    tensors["model.embed_tokens.weight"] = ("token_embd.weight", (len(tokens), HIDDEN))
    tensors["model.norm.weight"] = ("output_norm.weight", (HIDDEN,))
    if not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = ("output.weight", (len(tokens), HIDDEN))

    writer = gguf.GGUFWriter(str(root / "model.gguf"), gguf_arch or arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    state = {}
    for hf_name, (gguf_name, shape) in tensors.items():
        w = rng.normal(0, 1.0 if hf_name.endswith(("norm.weight", "bias")) else 0.05, shape).astype(np.float32)
        if hf_name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        kind = next((t for prefix, t in (tensor_types or {}).items() if gguf_name.startswith(prefix)), qtype) \
            if len(shape) == 2 else Q.F32
        heads = {"q_proj.weight": HEADS, "k_proj.weight": KV_HEADS, "q_proj.bias": HEADS, "k_proj.bias": KV_HEADS}
        permuted = arch == "llama" and hf_name.endswith(tuple(heads))
        head_count = next((n for k, n in heads.items() if hf_name.endswith(k)), 1)
        stored = llama_cpp_permute(w, head_count) if permuted else w
        raw = encode(stored, kind, rng)
        writer.add_tensor(gguf_name, raw, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        decoded = decode(raw, kind).reshape(shape)
        if permuted:  # back to HF order by the inverse of the permutation's index
            index = llama_cpp_permute(np.arange(shape[0]), head_count)
            decoded = decoded[np.argsort(index)]
        state[hf_name] = torch.from_numpy(np.ascontiguousarray(decoded))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    hf = root / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text(json.dumps(cfg))
    save_file(state, str(hf / "model.safetensors"))
    shutil.copy(SHIPPED_TOKENIZER, hf / "tokenizer.json")
    return root / "model.gguf", hf


def write_from_transformers(model, path: Path) -> None:
    """`model` (a transformers causal LM of a family completer serves) as an
    F32 GGUF laid out as llama.cpp's converter writes that family: its tensor
    names, Q/K rows permuted for `llama` / `granite`, Gemma's norms stored as
    1 + w, the family's metadata. No tokenizer (the model alone loads)."""
    from completer import architectures

    cfg = model.config
    family = architectures.FAMILIES[type(model).__name__]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    to_gguf = {ours: theirs for theirs, ours in architectures.gguf_layer_tensors(family).items()}
    if family == "starcoder2":
        to_gguf |= {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    globals_ = {ours: theirs for theirs, ours in architectures.GGUF_GLOBAL_TENSORS.items()}

    writer = gguf.GGUFWriter(str(path), family)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = architectures.hf_rope(family, cfg.to_dict())
    writer.add_rope_freq_base(rope["rope_theta"])
    if family == "starcoder2":
        writer.add_layer_norm_eps(cfg.norm_epsilon)
    else:
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if family in ("gemma2", "gemma3") or getattr(cfg, "sliding_window", None) and family == "starcoder2":
        writer.add_sliding_window(cfg.sliding_window)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if family == "granite":
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_attention_scale(cfg.attention_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)

    tied = cfg.tie_word_embeddings
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        w = tensor.detach().float().numpy()
        module, _, suffix = name.rpartition(".")
        if module.startswith("model.layers."):
            _, _, layer, local = module.split(".", 3)
            gguf_name = f"blk.{layer}.{to_gguf[local]}.{suffix}"
            proj = local.rpartition(".")[2]
            if family in architectures.PERMUTED_QK and proj in heads:
                w = llama_cpp_permute(w, heads[proj])
        else:
            gguf_name = f"{globals_[module]}.{suffix}"
        if family.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        writer.add_tensor(gguf_name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
