"""A decoder-only transformer in plain torch: Llama, Qwen2/3, StarCoder2,
Gemma 1/2/3 and Granite checkpoints, their differences switched by
`ModelConfig` fields (completer/architectures.py sets them from a checkpoint).

The parameter names match Hugging Face's, so a checkpoint's state dict loads
1:1 (after architectures.py renames StarCoder2's MLP and moves constant
factors into the weights they multiply). The forward pass takes explicit positions and hands K/V to an attention
backend the model does not own (`engine/attention.py`: the paged pool), so
the engine decides where K/V live; without one (training, scoring) attention
is plain causal. Attention math is fp32.

One module past ~300 lines, as gpt-fast keeps its model: config, RoPE
variants, layers and the forward pass read top to bottom.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Protocol

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from completer.rope import (RopeScaling, apply_rope, local_inverse_frequencies, rope_attention_scale,
                            rope_inverse_frequencies)

__all__ = ["CheckpointError", "ModelConfig", "RopeScaling", "Transformer", "apply_rope", "attention_fp32",
           "rope_inverse_frequencies"]


class CheckpointError(ValueError):
    """A checkpoint (an HF directory or a GGUF file) that cannot give a model;
    the message names the file. (checkpoint.py re-exports it.)"""


class ModelConfig(msgspec.Struct, frozen=True):
    """The fields of an HF `config.json` that the runtime needs."""

    architecture: str  # the checkpoint's, e.g. "LlamaForCausalLM" (architectures.py lists them)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v
    o_bias: bool = False  # Llama `attention_bias` also biases o_proj
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # A drafter's output layer may cover only the `head_vocab_size` tokens it
    # proposes (EAGLE-3's reduced vocabulary): its rows map to full-vocabulary
    # ids through the `head_token_ids` buffer; logits are over the full
    # vocabulary, -inf for tokens it never proposes. 0 = the whole vocabulary.
    head_vocab_size: int = 0
    # A drafter that reads its token embeddings from its target's (the same
    # vocabulary and width): its checkpoint leaves them out.
    embedding_from_target: bool = False
    # What differs between families (the defaults are Llama's).
    norm: str = "rms"  # "layer": LayerNorm with a bias (StarCoder2)
    mlp: str = "gated"  # "plain": up, activation, down (StarCoder2's c_fc, c_proj)
    activation: str = "silu"  # "gelu_tanh": GELU's tanh approximation (Gemma, StarCoder2)
    qk_norm: bool = False  # q and k RMS-normed per head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # attention's and the MLP's outputs normed too (Gemma 2, 3)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite's multiplier)
    logits_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    attn_softcap: float = 0.0  # scores s -> c * tanh(s / c) before the softmax (Gemma 2); 0: none
    final_softcap: float = 0.0  # the same on the logits (Gemma 2)
    sliding_window: int = 0  # keys a sliding layer reads back from a query, its own included
    layer_types: tuple[str, ...] = ()  # "sliding" / "full" per layer; () with a window: all slide
    rope_local_theta: float = 0.0  # sliding layers' RoPE base, unscaled (Gemma 3); 0: rope_theta's

    def window(self, layer: int) -> int:
        """Keys layer `layer` reads back from each query, its own included (0: all before it)."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding"):
            return 0
        return self.sliding_window

    def num_parameters(self) -> int:
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        layer = attn + (3 if self.mlp == "gated" else 2) * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else (self.head_vocab_size or self.vocab_size) * d
        return self.num_hidden_layers * layer + self.vocab_size * d + head + d


class AttentionBackend(Protocol):
    """Where K/V live. `attend` stores this step's K/V, then attends q over them."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
        """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] (RoPE applied); positions: [B, T].
        A query at p reads keys (p - window, p] (window 0: [0, p]); softcap:
        `ModelConfig.attn_softcap`. Returns [B, Hq, T, D] in q's dtype."""
        ...


def attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   mask: torch.Tensor | None, causal: bool = False, softcap: float = 0.0) -> torch.Tensor:
    """Grouped-query SDPA computed in fp32 whatever the weights' dtype (the
    K/V heads are shared in place, not copied per query group). mask: bool,
    True where a query reads a key. Soft-capped scores are computed by hand
    (SDPA has no cap)."""
    if not softcap:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                             is_causal=causal and mask is None,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.to(q.dtype)
    group = q.shape[1] // k.shape[1]
    keys, values = (x.float().repeat_interleave(group, 1) for x in (k, v))
    scores = q.float() @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril(scores.shape[-1] - scores.shape[-2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ values).to(q.dtype)


def causal_mask(positions: torch.Tensor, keys: int, window: int = 0) -> torch.Tensor:
    """[B, 1, T, keys] bool: the query at each position reads keys at or before
    it, and with a window only the `window` last of them."""
    key = torch.arange(keys, device=positions.device)[None, None, None, :]
    query = positions[:, None, :, None]
    mask = key <= query
    return mask & (key > query - window) if window else mask


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh"), "gelu": F.gelu}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def make_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return nn.LayerNorm(dim, cfg.rms_norm_eps) if cfg.norm == "layer" else RMSNorm(dim, cfg.rms_norm_eps)


def concat_linears(linears: list[nn.Module]) -> nn.Module:
    """One projection computing `linears`' outputs side by side (one GEMM
    instead of several over the same input): an nn.Linear, or the linears'
    own type where it can `concat` (Fp8Linear)."""
    first = linears[0]
    if type(first) is not nn.Linear:
        return type(first).concat(linears)
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))
    return fused.requires_grad_(False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=cfg.o_bias)
        self.qkv_proj: nn.Module | None = None  # set by fuse()
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps), RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.window, self.softcap = cfg.window(layer), cfg.attn_softcap
        self.local_rope = bool(self.window and cfg.rope_local_theta)  # rotates with the local frequencies

    def fuse(self) -> None:
        """q, k and v as one projection (serving; checkpoints keep HF's names)."""
        self.qkv_proj = concat_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [N, d] normed tokens; cos/sin [N, 1, D]. Returns q [N, Hq, D] and
        k, v [N, Hkv, D], RoPE applied."""
        heads = self.n_heads + 2 * self.n_kv
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), -1)
        qkv = qkv.view(-1, heads, self.head_dim)
        qk = qkv[:, : self.n_heads + self.n_kv]
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.n_heads]), self.k_norm(qk[:, self.n_heads:])), 1)
        qk = apply_rope(qk, cos, sin)  # q and k heads in one rotation
        return qk[:, : self.n_heads], qk[:, self.n_heads:], qkv[:, self.n_heads + self.n_kv:]

    def attend(self, q, k, v, shape: tuple[int, int], positions, backend: AttentionBackend | None):
        """[N, H, D] in, [N, Hq * D] out; rows [B, T] = `shape` for the backend."""
        b, t = shape
        q, k, v = (x.view(b, t, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
        if backend is None:  # training / stateless scoring: causal over this batch
            mask = causal_mask(positions - positions[:, :1], t, self.window) if self.window else None
            out = attention_fp32(q, k, v, mask, causal=True, softcap=self.softcap)
        else:
            out = backend.attend(self.layer, q, k, v, positions, self.window, self.softcap)
        return out.transpose(1, 2).reshape(b * t, -1)


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)); a "plain" MLP has no gate: down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.activation]
        self.gated = cfg.mlp == "gated"
        if self.gated:
            self.gate_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None  # set by fuse()

    def fuse(self) -> None:
        if self.gated:
            self.gate_up_proj = concat_linears([self.gate_proj, self.up_proj])
            del self.gate_proj, self.up_proj

    def forward(self, x):
        if not self.gated:
            return self.down_proj(self.act(self.up_proj(x)))
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, layer)
        # HF's names: Llama's `post_attention_layernorm` comes before the MLP;
        # with sandwich norms it norms attention's output and two more wrap the MLP.
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.mlp = MLP(cfg)

    # A layer is two dense halves around attention (tokens flattened to
    # [N, d]): what torch.compile fuses, while attention reads the paged pool.
    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn.o_proj(attended))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn.o_proj(attended)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = make_norm(cfg, cfg.hidden_size)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.head_vocab_size or cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.head_vocab_size:
            self.register_buffer("head_token_ids", torch.arange(cfg.head_vocab_size))
        self.register_buffer("inv_freq", rope_inverse_frequencies(cfg), persistent=False)
        self.register_buffer("inv_freq_local", local_inverse_frequencies(cfg), persistent=False)
        self.rope_scale = rope_attention_scale(cfg)
        self.eager_layers()

    def reset_rope(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> None:
        """The RoPE frequencies computed afresh on `device` (after a build on meta),
        in `dtype` (as `Transformer.to(dtype)` casts every float buffer)."""
        self.inv_freq = rope_inverse_frequencies(self.config).to(device=device, dtype=dtype)
        local = local_inverse_frequencies(self.config)
        self.inv_freq_local = None if local is None else local.to(device=device, dtype=dtype)

    def layer_inv_freq(self, layer: int) -> torch.Tensor:
        return self.inv_freq_local if self.model.layers[layer].self_attn.local_rope else self.inv_freq

    def compile_layers(self) -> "Transformer":
        """Each layer's dense halves through torch.compile (inductor): one
        graph serves every layer (their weights are graph inputs) and every
        token count above 1 (dynamic shapes); attention stays eager."""
        if self.compiled:  # a model shared by several engines
            return self
        self.compiled = True
        self.layer_halves = tuple(torch.compile(f, dynamic=True) for f in
                                  (DecoderLayer.attention_inputs, DecoderLayer.after_attention))
        return self

    def eager_layers(self) -> "Transformer":
        self.layer_halves = (DecoderLayer.attention_inputs, DecoderLayer.after_attention)
        self.compiled = False
        return self

    def fuse_projections(self) -> "Transformer":
        """Each layer's q/k/v and gate/up as one GEMM each (for serving). In place."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        return self

    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights for training (loaded checkpoints skip this): N(0, std),
        output projections scaled down by depth as in GPT-2, zero biases."""
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.num_hidden_layers))
            else:
                nn.init.normal_(p, std=std)

    def rope(self, positions: torch.Tensor, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, D] at `positions` (`local`: the sliding layers' own frequencies)."""
        inv_freq = self.inv_freq_local if local else self.inv_freq
        angles = positions.float()[..., None] * inv_freq.float()  # [B, T, D/2]
        angles = torch.cat((angles, angles), dim=-1).view(-1, 1, angles.shape[-1] * 2)  # [N, 1, D]
        return angles.cos() * self.rope_scale, angles.sin() * self.rope_scale

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor,
                      backend: AttentionBackend | None = None) -> torch.Tensor:
        """tokens, positions: [B, T] int64. Returns the final-normed hidden states."""
        *_, hidden = self.hidden_state_layers(tokens, positions, backend)
        return hidden

    def hidden_state_layers(self, tokens: torch.Tensor, positions: torch.Tensor,
                            backend: AttentionBackend | None = None) -> Iterator[torch.Tensor | None]:
        """`hidden_states` a layer at a time: None before each layer, then the
        final-normed hidden states (a pass that can stop between layers)."""
        ropes = self.ropes(positions)
        x = self.embed(tokens)
        inputs, after = self.layer_halves
        for layer in self.model.layers:
            yield None
            q, k, v = inputs(layer, x, *ropes[layer.self_attn.local_rope])
            x = after(layer, x, layer.self_attn.attend(q, k, v, tokens.shape, positions, backend))
        yield self.model.norm(x).view(*tokens.shape, -1)

    def ropes(self, positions: torch.Tensor) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin by `Attention.local_rope`: what each layer rotates with."""
        ropes = {False: self.rope(positions)}
        if self.inv_freq_local is not None:
            ropes[True] = self.rope(positions, local=True)
        return ropes

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, d] embeddings of tokens [B, T], scaled as the family does (in their dtype, as HF)."""
        x = self.model.embed_tokens(tokens.flatten())
        if self.config.embed_scale != 1.0:
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        return x

    def logits(self, hidden: torch.Tensor, head=None) -> torch.Tensor:
        """fp32 logits over the full vocabulary from final hidden states [..., D]
        (`head`: another implementation of lm_head's product)."""
        cfg = self.config
        out = (head or self.lm_head)(hidden).float()
        if cfg.logits_scale != 1.0:
            out = out * cfg.logits_scale
        if cfg.final_softcap:
            out = cfg.final_softcap * torch.tanh(out / cfg.final_softcap)
        if not cfg.head_vocab_size:
            return out
        full = out.new_full((*out.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_token_ids, out)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                backend: AttentionBackend | None = None) -> torch.Tensor:
        """Logits [B, T, V] (fp32). Without a backend: causal over `tokens` alone."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.logits(self.hidden_states(tokens, positions, backend))
