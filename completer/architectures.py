"""What differs between model families, in one place: how a Hugging Face
`config.json` and a GGUF file's metadata describe each (as `ModelConfig`
fields), llama.cpp's tensor names, and the rewrites that bring a
checkpoint's weights to the form `completer.model` computes with:

- Gemma's HF norms scale by 1 + w: held as 1 + w (llama.cpp's converter
  already stores it so), so every norm is the plain one.
- Constant factors fold into the weights they multiply, so no backend (the
  fused CPU layer, the GPU kernel) needs a case for them: a family's
  attention scale other than 1/sqrt(head_dim) into the queries (q_norm's
  weight, or q_proj's rows), Granite's residual multiplier into o_proj and
  down_proj. Embedding and logit scales stay explicit (a tied embedding is
  also the output layer).
- StarCoder2's ungated MLP (c_fc, c_proj) is `mlp.up_proj` / `mlp.down_proj`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import msgspec
import torch

# HF class name -> family (llama.cpp's `general.architecture` for the same models).
FAMILIES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "Starcoder2ForCausalLM": "starcoder2", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "GraniteForCausalLM": "granite",
}
HF_CLASSES = {family: cls for cls, family in FAMILIES.items()}
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}
# Families whose config.json leaves tie_word_embeddings out when true (transformers' default for them).
TIED_BY_DEFAULT = {"gemma", "gemma2", "gemma3", "starcoder2"}
# llama.cpp's converter permutes Q/K rows of these (its RoPE rotates adjacent pairs).
PERMUTED_QK = {"llama", "granite"}


class Rewrite(msgspec.Struct, frozen=True):
    """How a checkpoint's weights differ from ours (applied once, at load)."""

    norm_offset: float = 0.0  # norms scale by offset + w (Gemma's HF checkpoints: 1)
    q_scale: float = 1.0  # queries times this: the family's attention scale x sqrt(head_dim)
    residual_scale: float = 1.0  # attention's and the MLP's outputs times this (Granite)


def family_of(architecture: str) -> str:
    return FAMILIES[architecture]


def supported() -> str:
    return ", ".join(FAMILIES)


# --- Hugging Face config.json -------------------------------------------------

def hf_fields(family: str, raw: dict) -> tuple[dict, Rewrite]:
    """ModelConfig fields beyond Llama's, and the weight rewrite, of an HF config."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if family == "starcoder2":
        bias = raw.get("use_bias", True)
        return dict(norm="layer", mlp="plain", activation=_activation(raw.get("hidden_act", "gelu_pytorch_tanh")),
                    rms_norm_eps=raw.get("norm_epsilon", 1e-5), qkv_bias=bias, o_bias=bias, mlp_bias=bias,
                    sliding_window=raw.get("sliding_window") or 0), Rewrite()
    if family == "qwen3":
        return dict(qk_norm=True, qkv_bias=raw.get("attention_bias", False),
                    o_bias=raw.get("attention_bias", False)), Rewrite()
    if family == "granite":
        return (dict(embed_scale=raw.get("embedding_multiplier", 1.0), logits_scale=1 / raw.get("logits_scaling", 1.0)),
                Rewrite(q_scale=raw.get("attention_multiplier", head_dim ** -0.5) * math.sqrt(head_dim),
                        residual_scale=raw.get("residual_multiplier", 1.0)))
    if family.startswith("gemma"):
        fields = dict(embed_scale=math.sqrt(raw["hidden_size"]),
                      activation=_activation(raw.get("hidden_act" if family == "gemma" else "hidden_activation")
                                             or "gelu_pytorch_tanh"),
                      qkv_bias=raw.get("attention_bias", False), o_bias=raw.get("attention_bias", False))
        q_scale = 1.0
        if family != "gemma":
            q_scale = raw.get("query_pre_attn_scalar", head_dim) ** -0.5 * math.sqrt(head_dim)
            types = raw.get("layer_types") or []
            fields |= dict(sandwich_norms=True, attn_softcap=raw.get("attn_logit_softcapping") or 0.0,
                           final_softcap=raw.get("final_logit_softcapping") or 0.0,
                           sliding_window=raw.get("sliding_window") or 0,
                           layer_types=tuple("sliding" if t == "sliding_attention" else "full" for t in types))
        if family == "gemma3":
            fields |= dict(qk_norm=True, rope_local_theta=_rope_params(raw, "sliding_attention").get("rope_theta", 10000.0))
        return fields, Rewrite(norm_offset=1.0, q_scale=q_scale)
    return {}, Rewrite()


def hf_rope(family: str, raw: dict) -> dict:
    """The global layers' RoPE parameters (`rope_theta`, `rope_type`, scaling fields)."""
    if family == "gemma3":
        return _rope_params(raw, "full_attention")
    # transformers < 5 writes rope_theta + rope_scaling; 5 writes rope_parameters.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def _rope_params(raw: dict, layer_type: str) -> dict:
    nested = raw.get("rope_parameters") or {}
    if layer_type in nested:  # transformers 5: per layer type
        return dict(nested[layer_type] or {})
    if layer_type == "sliding_attention":  # transformers < 5: rope_local_base_freq
        return {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    return {**(raw.get("rope_scaling") or {}), "rope_theta": raw.get("rope_theta", 1000000.0)}


def hf_rename(family: str, name: str) -> str:
    """A checkpoint tensor's name in our model."""
    if family == "starcoder2":
        return name.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(".mlp.c_proj.", ".mlp.down_proj.")
    return name


def hf_unsupported(family: str, raw: dict) -> str | None:
    """Why an HF config of a known family cannot be served, or None."""
    if family in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        return "sliding-window attention (use_sliding_window) is not supported for qwen2/qwen3"
    return None


def _activation(name: str) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


# --- GGUF ---------------------------------------------------------------------

# llama.cpp's per-layer tensor names to ours; `ffn_norm` is the norm before the
# MLP, which sandwich-norm families call pre_feedforward_layernorm.
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_SANDWICH = {**GGUF_LAYER_TENSORS, "ffn_norm": "pre_feedforward_layernorm"}
GGUF_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_layer_tensors(family: str) -> dict[str, str]:
    return GGUF_SANDWICH if family in ("gemma2", "gemma3") else GGUF_LAYER_TENSORS


def gguf_fields(family: str, get, hidden: int, head_dim: int, layers: int) -> tuple[dict, Rewrite]:
    """ModelConfig fields beyond Llama's, and the rewrite, of a GGUF's metadata
    (`get(key, default)` reads `{family}.{key}`). llama.cpp's converter already
    stores Gemma's norms as 1 + w; the attention scale is 1/sqrt(head_dim)
    where llama.cpp computes so (every size but Gemma 2/3's 27B)."""
    if family == "starcoder2":
        # llama.cpp's converter leaves StarCoder2's window (4,096) out, and llama.cpp attends
        # to everything: so do we, unless the file names one.
        return dict(norm="layer", mlp="plain", activation="gelu_tanh",
                    rms_norm_eps=get("attention.layer_norm_epsilon", 1e-5),
                    sliding_window=get("attention.sliding_window", 0) or 0), Rewrite()
    if family == "qwen3":
        return dict(qk_norm=True), Rewrite()
    if family == "granite":
        return (dict(embed_scale=get("embedding_scale", 1.0), logits_scale=1 / get("logit_scale", 1.0)),
                Rewrite(q_scale=get("attention.scale", head_dim ** -0.5) * math.sqrt(head_dim),
                        residual_scale=get("residual_scale", 1.0)))
    if family.startswith("gemma"):
        fields = dict(embed_scale=math.sqrt(hidden), activation="gelu_tanh")
        if family != "gemma":
            pattern = get("attention.sliding_window_pattern", 2 if family == "gemma2" else 6)
            fields |= dict(sandwich_norms=True, attn_softcap=get("attn_logit_softcapping", 0.0) or 0.0,
                           final_softcap=get("final_logit_softcapping", 0.0) or 0.0,
                           sliding_window=get("attention.sliding_window", 0) or 0,
                           layer_types=tuple("sliding" if i % pattern < pattern - 1 else "full"
                                             for i in range(layers)))
        if family == "gemma3":
            fields |= dict(qk_norm=True, rope_local_theta=get("rope.freq_base_swa", 10000.0))
        return fields, Rewrite()
    return {}, Rewrite()


# --- the rewrite --------------------------------------------------------------

def tensor_rewrite(name: str, rewrite: Rewrite, qk_norm: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What turns checkpoint tensor `name` (our name) into our model's, or None: as it is."""
    steps = []
    if rewrite.norm_offset and name.endswith("norm.weight"):
        steps.append(lambda t: t.float() + rewrite.norm_offset)
    if rewrite.q_scale != 1.0 and name.endswith("self_attn.q_norm.weight" if qk_norm else
                                                ("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        steps.append(functools.partial(_scaled, name, factor=rewrite.q_scale))
    if rewrite.residual_scale != 1.0 and name.endswith(("o_proj.weight", "o_proj.bias",
                                                        "down_proj.weight", "down_proj.bias")):
        steps.append(functools.partial(_scaled, name, factor=rewrite.residual_scale))
    if not steps:
        return None
    return functools.reduce(lambda f, g: lambda t: g(f(t)), steps)


@torch.no_grad()
def _scaled(name: str, t: torch.Tensor, factor: float) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise ValueError(f"tensor {name!r} ({t.dtype}) cannot take this family's constant factor")
    return (t.float() * factor).to(t.dtype)
