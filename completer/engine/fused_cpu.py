"""Passes of a few new tokens on CPU through the fused C++ layer
(kernels/cpu_decode.cpp): one call per decoder layer instead of ~15 torch ops.

A decode, verify or warm-keystroke pass on a CPU is bound by streaming the
weights, but through torch's ops its time went to dispatch: per layer ~530 us
of which the 4-bit GEMMs took ~230 (BENCHMARKS.md, 2026-12-03 07:06). The
fused layer reads the same paged K/V pool and block tables as
`TorchAttention`, so the model runner switches per pass: up to `MAX_TOKENS`
rows x tokens here, longer prefills through torch (its bf16 GEMMs win there).

Every family model.py serves runs here (the layer takes their norms, MLPs,
activations, q/k norms, sandwich norms, soft caps and sliding windows as
options); embedding and logit scales stay in Python (`Transformer.embed`,
`Transformer.logits`).

Int4 targets (`model.precision = "int4"`, the CPU default): the layer's
GEMMs are Q4_1 x Q8, llama.cpp's CPU math (`engine.fused_cpu_q8`, default;
where the build takes tiles, its `tiles_available()`: the avx512 level, the
weights are packed in tiles of 16 rows for it), or Q4_1 x fp32 activations.
Int8 targets too where those tiles run (8-bit weights with a scale per row x
Q8 activations); elsewhere int8 runs torch's ops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

import torch

from completer.cpu_quant import Int4Linear, Int8Linear
from completer.engine.attention import AttentionMetadata, PassInterrupted
from completer.engine.paged_kv import KVPool
from completer.model import Transformer

if TYPE_CHECKING:
    from completer_kernels.cpu_levels import CpuLevel


log = logging.getLogger("completer.engine")
_warned: set[str] = set()  # fallbacks said at WARNING (once each per process)


class FusedUnsupported(ValueError):
    """This model cannot run through the fused layer (one line: why)."""


class FusedCpuLayers:
    MAX_TOKENS = 32  # new tokens in a pass (all rows); more go through torch

    def __init__(self, model: Transformer, q8: bool = False, threads: int = 0, level: CpuLevel | None = None):
        """q8: activations quantized to 8 bits per block of 32 for the GEMMs
        (llama.cpp's math; its reference is `q8_activations` on the int4 and
        int8 linears); else fp32 activations. level: the build's (tests; by
        default the one this machine runs, completer_kernels.cpu_levels)."""
        from completer_kernels.cpu_decode import extension
        from completer_kernels.cpu_packing import pack_i8_tiles, pack_q4, pack_q4_tiles

        cfg = model.config
        if model.inv_freq.device.type != "cpu":
            raise FusedUnsupported("the fused layer runs on CPU only")
        if not any(isinstance(m, (Int4Linear, Int8Linear)) for m in model.modules()):  # (before building it)
            raise FusedUnsupported("the fused layer takes int4 or int8 projections, not a float model")
        ext = extension(level=level)  # FusedUnavailable: no compiler here, or a level this CPU lacks
        self.model = model
        try:  # (the layer names a norm, an activation or an MLP it has no code for)
            self.impl = ext.FusedLayers(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.rms_norm_eps, q8, threads or torch.get_num_threads(), norm=cfg.norm,
                                        activation=cfg.activation, mlp=cfg.mlp, softcap=cfg.attn_softcap)
        except RuntimeError as e:
            raise FusedUnsupported(f"the fused layer has {e} ({cfg.architecture})") from None

        # The layout VNNI multiplies without reductions, where the build has it (the build says).
        self.tiles = tiles = q8 and ext.tiles_available()

        def packed(linear) -> tuple[torch.Tensor, torch.Tensor | None]:
            bias = None if linear.bias is None else linear.bias.float().contiguous()
            if isinstance(linear, Int8Linear):
                if not tiles:
                    raise FusedUnsupported("int8 projections run through the fused layer only with 8-bit "
                                           f"activations in VNNI tiles (this build: {ext.simd()}, q8 {q8})")
                try:
                    return pack_i8_tiles(*linear.int8_weight()), bias
                except ValueError as e:
                    raise FusedUnsupported(str(e)) from None
            if not isinstance(linear, Int4Linear):
                raise FusedUnsupported(f"the fused layer takes int4 or int8 projections, not {type(linear).__name__}")
            groups = linear.groups()
            if tiles and groups[0].shape[0] % 16 == 0:
                return pack_q4_tiles(*groups), bias
            try:
                return pack_q4(*groups), bias
            except ValueError as e:  # a width that is not a multiple of 64
                raise FusedUnsupported(str(e)) from None

        def norm(module: torch.nn.Module | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
            """A norm's weight and bias (LayerNorm's), fp32; None for none."""
            if module is None:
                return None
            bias = getattr(module, "bias", None)
            return module.weight.detach().float(), None if bias is None else bias.detach().float()

        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            up = mlp.gate_up_proj if mlp.gated else mlp.up_proj  # gated: gate and up side by side
            if attn.qkv_proj is None or up is None:
                raise FusedUnsupported("the fused layer needs fused projections (model.fuse_projections)")
            # HF's names: with sandwich norms post_attention_layernorm norms attention's output and
            # pre_feedforward_layernorm the MLP's input; without, post_attention_layernorm is the latter.
            sandwich = layer.sandwich
            self.impl.add_layer(
                norm(layer.input_layernorm), packed(attn.qkv_proj), packed(attn.o_proj),
                norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
                packed(up), packed(mlp.down_proj),
                q_norm=None if attn.q_norm is None else attn.q_norm.weight.detach().float(),
                k_norm=None if attn.k_norm is None else attn.k_norm.weight.detach().float(),
                attn_out_norm=norm(layer.post_attention_layernorm if sandwich else None),
                mlp_out_norm=norm(layer.post_feedforward_layernorm if sandwich else None),
                window=attn.window)

        if not isinstance(model.lm_head, Int8Linear):
            raise FusedUnsupported(f"the fused layer takes an int8 output head, not {type(model.lm_head).__name__}")
        self.impl.set_head(*model.lm_head.int8_weight())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head's product (int8 weights, fp32 activations): [..., vocab]."""
        return self.impl.head(hidden.reshape(-1, hidden.shape[-1]).float()).view(*hidden.shape[:-1], -1)

    @staticmethod
    @contextlib.contextmanager
    def alone() -> Iterator[None]:
        """torch on one thread meanwhile: the layer's own threads do the parallel
        work, and an OpenMP team spinning beside them would take their cores."""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def fits(self, rows: int, width: int) -> bool:
        return rows * width <= self.MAX_TOKENS

    def hidden_states(self, tokens: torch.Tensor, meta: AttentionMetadata, pool: KVPool) -> torch.Tensor:
        """As `Transformer.hidden_states` over the paged pool (the whole pass at once)."""
        *_, hidden = self.hidden_state_layers(tokens, meta, pool)
        return hidden

    def hidden_state_layers(self, tokens: torch.Tensor, meta: AttentionMetadata, pool: KVPool,
                            layer_written: Callable[[int], None] | None = None,
                            interrupted: Callable[[], bool] | None = None) -> Iterator[torch.Tensor | None]:
        """As `Transformer.hidden_state_layers` over the paged pool: tokens [B, T]
        at meta.positions; None before each layer, then [B, T, d], final norm applied."""
        model = self.model
        B, T = tokens.shape
        x = model.embed(tokens).float().contiguous()
        ropes = {local: tuple(c.view(B * T, -1).contiguous() for c in rope)
                 for local, rope in model.ropes(meta.positions).items()}
        for layer in range(len(model.model.layers)):
            yield None
            if interrupted is not None and interrupted():
                raise PassInterrupted
            cos, sin = ropes[model.model.layers[layer].self_attn.local_rope]
            self.impl.forward(layer, x, cos, sin, meta.slot_mapping, meta.block_tables, meta.context_lens, T,
                              pool.k[layer], pool.v[layer], pool.block_size)
            if layer_written is not None:
                layer_written(layer)
        yield model.model.norm(x).view(B, T, -1)


def fused_layers_for(model: Transformer, q8: bool = False, threads: int = 0) -> FusedCpuLayers | None:
    """The model's fused layers (built once per model and setting, shared by
    its engines), or None where they cannot run: the reason is logged once."""
    built = model.__dict__.setdefault("fused_cpu_layers", {})
    key = (q8, threads)
    if key not in built:
        from completer_kernels.cpu_decode import FusedUnavailable

        try:
            built[key] = FusedCpuLayers(model, q8, threads)
        except (FusedUnsupported, FusedUnavailable) as e:
            # The layer not built, or an int4 model (the CPU default) it cannot run: keystrokes ~10x slower
            # (issue #43: 33 -> 362 ms a line), said once at WARNING (the console's level) and in /metrics
            # (completer_fused_cpu_active 0). Float models (and int8 off VNNI) run through torch by design.
            expected = isinstance(e, FusedUnavailable) or any(isinstance(m, Int4Linear) for m in model.modules())
            if not expected:
                log.info("engine: passes run through torch's ops: %s", e)
            elif str(e) not in _warned:
                _warned.add(str(e))
                log.warning("engine: the fused CPU layer is not used, passes run through torch's ops "
                            "(slower): %s", e)
            built[key] = None
    return built[key]
