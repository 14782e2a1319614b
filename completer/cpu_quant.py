"""Int8 and int4 weights for CPU decode: the CPU counterpart of fp8.py.

A decode step on a CPU streams every weight once per token, so its time is
bytes moved: int8 moves a quarter of fp32's, int4 an eighth.

- `Int8Linear`: 8-bit weights (7 bits of magnitude), one scale per output
  channel, times activations quantized to 8 bits per token, run by fbgemm's
  dynamic-quantized GEMM (`quantized.linear_dynamic`): integer products with
  AVX2/AVX512 kernels, rescaled to fp32. (torch's weight-only
  `_weight_int8pack_mm` has no vectorized AVX2 path: measured 6-17x slower
  than fp32 here.)
- `Int4Linear`: 4-bit weights in groups of 32 along the input, each group
  with a scale and a minimum: GGUF's Q4_1 layout, so a Q4_1 file's weights
  come back exactly. Run by torch's packed CPU kernel
  (`_weight_int4pack_mm_for_cpu`) with bf16 activations where the CPU has
  native bf16 (its AVX512 path: measured 20-60x faster than with fp32
  activations on a Xeon with AMX), fp32 elsewhere.

Embeddings, norms, attention and the KV cache stay fp32. The output head is
int8 in both (a fifth of a small model's bytes; a Q4_1 GGUF keeps it Q8_0
too).

A GGUF's matrices stored as 4-bit groups (Q4_0, Q4_1, Q4_K) become Int4Linear
from the file's own groups (`GgufFile.int4_groups`): the weights as shipped,
bit for bit. "int4+int8" (what "auto" picks for a GGUF that mixes them with
5- to 8-bit types, docs/models.md) serves those as int4 and every other
projection as int8.
"""

from __future__ import annotations

import itertools
import os
import warnings
import weakref

import torch
from torch import nn

from completer.fp8 import FUSED_NAMES, LINEAR_NAMES

MIXED = "int4+int8"  # projections stored as 4-bit groups as int4, the others int8
CPU_PRECISIONS = ("int8", "int4", MIXED)
INT4_GROUP = 32  # Q4_1's block
# Transformer.fuse_projections' concatenations, in its order (rows: outputs).
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}



def bound_kernel_caches(entries: int) -> None:
    """A bf16 matmul on oneDNN builds and keeps a primitive per shape, in two
    caches of 1,024 entries each (oneDNN's own and ideep's): a server
    prefilling prompts of ever new lengths kept ~1.2 MB more per new row count
    and never gave it back (issue #31's soak). Both read their capacity once,
    at the process's first primitive, so this runs before any model does; a
    value already in the environment wins. `model.kernel_cache_entries`."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


# fbgemm's packed weights are a TorchScript object, which torch.compile cannot
# trace: the GEMM is a custom op that finds them through a tensor handle (an
# int argument would be a constant, one graph per layer).
_PACKED: dict[int, object] = {}  # handle -> packed weights, while their layer lives
_handles = itertools.count()


@torch.library.custom_op("completer::int8_linear", mutates_args=())
def int8_linear(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic-quantized GEMM of x [M, K] with the packed weights
    numbered handle[0]; [M, N] fp32, N = handle's length."""
    return torch.ops.quantized.linear_dynamic(x, _PACKED[int(handle[0])], False)


@int8_linear.register_fake
def _(x: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], handle.shape[0])


class Int8Linear(nn.Module):
    """y = x @ (w_q * scale).T + bias with x quantized to 8 bits per token,
    fp32 in and out. fbgemm quantizes a call's activations with one scale, so
    each row is first divided by its largest magnitude (per-token scales, as
    the FP8 path has) and the output rows multiplied back. Weights keep 7 bits
    (|q| <= 63): without VNNI, AVX2 sums pairs of u8 x s8 products in int16,
    which 255 x 127 x 2 would overflow; 255 x 63 x 2 does not, so activations
    keep all 8 bits (measured on SmolLM2: 7-bit activations instead lose 7
    points of top-1 agreement)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.detach().float()
        scale = (w.abs().amax(1).clamp(min=1e-8) / 63).double()
        with warnings.catch_warnings():  # quantized tensors are deprecated; their fbgemm kernels are not
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        self.index = next(_handles)
        _PACKED[self.index] = torch.ops.quantized.linear_prepack(qw, None)
        weakref.finalize(self, _PACKED.pop, self.index, None)
        self.register_buffer("handle", torch.full((self.out_features,), self.index, dtype=torch.int32))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # A last row holding -1 and 1 pins fbgemm's range to [-1, 1] whatever
        # the other rows hold: a row's result never depends on its batch.
        span = torch.zeros(1, self.in_features)
        span[0, :2] = torch.tensor([-1.0, 1.0])
        self.register_buffer("span_row", span)
        self.q8_activations = False  # q8_product_int8's math (a reference for the fused layer's int8 tiles)

    def int8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights as int8 [N, K] and their scale per output channel (fp32 [N])."""
        qw, _ = torch.ops.quantized.linear_unpack(_PACKED[self.index])
        return qw.int_repr(), qw.q_per_channel_scales().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        if self.q8_activations:
            y = q8_product_int8(x2, *self.int8_weight())
            return (y if self.bias is None else y + self.bias).view(*x.shape[:-1], self.out_features)
        rows = x2.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        x2 = torch.cat((x2 / rows, self.span_row))
        if torch.compiler.is_compiling():
            y = int8_linear(x2, self.handle)
        else:  # the op itself: a custom op's dispatch costs microseconds a call
            y = torch.ops.quantized.linear_dynamic(x2, _PACKED[self.index], False)
        y = y[:-1] * rows
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def int4_groups(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups along the input: (q in 0..15 [N, K], scale
    [N, K/g], minimum [N, K/g]) with weight ~= q * scale + minimum. Scale and
    minimum are fp16 values, as in GGUF's Q4_1 (the fused CPU layer stores them so)."""
    N, K = weight.shape
    w = weight.detach().float().view(N, K // group, group)
    low, high = w.amin(-1).half().float(), w.amax(-1)
    scale = ((high - low) / 15).half().float()
    q = torch.where(scale[..., None] > 0, (w - low[..., None]) / scale[..., None], 0).round().clamp(0, 15)
    return q.view(N, K).to(torch.int32), scale, low


def q8_blocks(x: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] as int8 values per block of `group` with one scale
    each (largest magnitude -> 127): (qx [M, K / group, group], scale [M, K / group, 1])."""
    blocks = x.float().reshape(x.shape[0], -1, group)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return torch.where(scale > 0, blocks / scale, torch.zeros_like(blocks)).round(), scale


def q8_product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """x [M, K] times 4-bit groups (q [N, K], scale and minimum [N, K / g]) with
    the activations rounded to 8 bits per group, llama.cpp's CPU math and the
    fused layer's VNNI kernel's: per group, scale * dx * sum(q * qx) + minimum * sum(x)."""
    N, G = scale.shape
    qx, dx = q8_blocks(x, q.shape[1] // G)
    dots = torch.einsum("mgj,ngj->mng", qx, q.float().view(N, G, -1))  # exact integer sums
    sums = x.float().view(x.shape[0], G, -1).sum(-1)
    return (dots * dx[..., 0][:, None, :] * scale).sum(-1) + sums @ low.T


def q8_product_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] times int8 weights q [N, K] with a scale per row [N], the
    activations rounded to 8 bits per block of 32 (the fused layer's VNNI
    kernel at int8): scale * sum over blocks of dx * sum(q * qx)."""
    N, K = q.shape
    qx, dx = q8_blocks(x, INT4_GROUP)
    dots = torch.einsum("mgj,ngj->mng", qx, q.float().view(N, K // INT4_GROUP, INT4_GROUP))  # exact integer sums
    return (dots * dx[..., 0][:, None, :]).sum(-1) * scale


class Int4Linear(nn.Module):
    """y = x @ (q * scale + minimum).T + bias, from packed 4-bit weights.
    torch's int4 kernel is a GEMV loop: its time grows with the rows. From
    `dense_rows` rows on, a pass multiplies by a resident copy of the weights
    in the compute dtype (`keep_dense`); without one, past `GEMV_ROWS` rows the
    weights are unpacked for the pass. Measured on a Zen 4 (2 cores), the 4
    GEMMs of all 30 SmolLM2 layers, weights streamed from memory as in a pass:
    int4 6.4 / 29 / 56 / 104 / 209 ms at 1 / 16 / 32 / 64 / 128 rows; bf16
    29 / 41 / 53 / 78 / 121 ms; unpacking alone ~145 ms."""

    GEMV_ROWS = 128

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: int = INT4_GROUP,
                 groups: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """`groups`: (q in 0..15 [N, K], scale, minimum [N, K / group]) to take
        as they are (a GGUF's own, `GgufFile.int4_groups`) instead of
        `int4_groups(weight)`; `weight` then only gives the shape."""
        super().__init__()
        self.compute_dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
        self.out_features, self.in_features = weight.shape
        if self.in_features % group:
            raise ValueError(f"int4: input width {self.in_features} is not a multiple of the group {group}")
        if groups is None:
            q, scale, low = int4_groups(weight, group)
        else:
            q, scale, low = groups[0].to(torch.int32), groups[1].float(), groups[2].float()
            if tuple(q.shape) != tuple(weight.shape) or tuple(scale.shape) != (q.shape[0], q.shape[1] // group):
                raise ValueError(f"int4: groups {tuple(q.shape)} / {tuple(scale.shape)} do not fit "
                                 f"a {tuple(weight.shape)} weight in groups of {group}")
        self.group = group
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1))
        # torch's kernel computes (q - 8) * scale + zero: zero is the group's middle.
        zero = low + 8 * scale
        self.register_buffer("scales_and_zeros",
                             torch.stack((scale, zero), -1).transpose(0, 1).contiguous().to(self.compute_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # The same weights as plain nibbles (the kernel's packing is its own): for prefill.
        self.register_buffer("nibbles", (q[:, 1::2] << 4 | q[:, ::2]).to(torch.uint8))
        self.register_buffer("scale", scale)
        self.register_buffer("low", low)
        self.dense: torch.Tensor | None = None
        self.dense_rows = 0
        self.q8_activations = False  # q8_product's math (a reference for the fused layer's 8-bit kernel)

    def keep_dense(self, rows: int) -> int:
        """Passes of `rows` rows or more multiply by a resident unpacked copy
        (0: none). Returns the bytes it holds."""
        self.dense_rows = rows
        self.dense = self.dequantized(self.compute_dtype).contiguous() if rows > 0 else None
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()

    def groups(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q in 0..15 [N, K], scale, minimum [N, K / group]), as `int4_groups` made them."""
        q = torch.stack((self.nibbles & 15, self.nibbles >> 4), -1).view(self.out_features, self.in_features)
        return q, self.scale, self.low

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.groups()[0].view(self.out_features, -1, self.group)
        return (q.to(dtype) * self.scale.to(dtype)[..., None] + self.low.to(dtype)[..., None]).view(
            self.out_features, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).float()
        if self.q8_activations:
            y = q8_product(x2, *self.groups())
        elif self.dense is not None and x2.shape[0] >= self.dense_rows:
            y = (x2.to(self.compute_dtype) @ self.dense.T).float()
        elif x2.shape[0] > self.GEMV_ROWS:
            # In the kernel's activation dtype: bf16 where native (measured on a Zen 4 at 545 rows:
            # 7.9 ms against 17.0 for fp32 on the gate/up weights, unpacking included).
            y = (x2.to(self.compute_dtype) @ self.dequantized(self.compute_dtype).T).float()
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2.to(self.compute_dtype), self.packed, self.group,
                                                  self.scales_and_zeros).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {self.group}"


def keep_dense_int4(model: nn.Module, rows: int) -> int:
    """`Int4Linear.keep_dense(rows)` on every int4 projection; the bytes added."""
    return sum(m.keep_dense(rows) for m in model.modules() if isinstance(m, Int4Linear))


def quantize_cpu_linears(model: nn.Module, precision: str,
                         groups: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
    """Every projection (fused or not) as `precision` linears ("int8",
    "int4", or MIXED: int4 where `groups` has every part, else int8) and the
    output head as int8, in place; returns the model. `groups`: a module's
    name in `model` before fusing (in a layer: "self_attn.q_proj") -> its stored
    4-bit groups (q, scale, minimum) in the model's row order: an int4
    projection takes the rows of its parts that have them as they are (the
    file's weights exactly), the others' groups from their weights."""
    if precision not in CPU_PRECISIONS:
        raise KeyError(precision)
    groups = groups or {}
    for path, module in list(model.named_modules()):
        for name in LINEAR_NAMES + FUSED_NAMES + ("lm_head",):
            child = getattr(module, name, None)
            if not isinstance(child, nn.Linear):
                continue
            if name == "lm_head":
                setattr(module, name, Int8Linear(child.weight, child.bias))
                continue
            parts = [groups.get(f"{path}.{part}" if path else part) for part in FUSED_PARTS.get(name, (name,))]
            int4 = precision == "int4" or (precision == MIXED and None not in parts)
            stored = None
            if int4 and any(g is not None for g in parts):
                pieces, start = [], 0
                for g, rows in zip(parts, _part_rows(module, name, child.out_features)):
                    pieces.append(int4_groups(child.weight[start:start + rows]) if g is None else g)
                    start += rows
                stored = tuple(torch.cat([p[i].to(torch.float32 if i else torch.int32) for p in pieces])
                               for i in range(3))
            setattr(module, name, Int4Linear(child.weight, child.bias, groups=stored) if int4
                    else Int8Linear(child.weight, child.bias))
    return model


def _part_rows(module: nn.Module, name: str, rows: int) -> tuple[int, ...]:
    """The rows of each part of a projection, in FUSED_PARTS' order."""
    if name == "qkv_proj":
        kv = module.n_kv * module.head_dim
        return rows - 2 * kv, kv, kv
    if name == "gate_up_proj":
        return rows // 2, rows // 2
    return (rows,)


def int8_fused_here() -> bool:
    """Whether this machine runs int8 projections in the fused layer: its 8-bit
    tiles need a build that takes tiles, and the level it runs (the highest this
    CPU allows, or $COMPLETER_CPU_LEVEL's) says so without building it;
    elsewhere int8 runs torch's fbgemm ops."""
    from completer_kernels.cpu_levels import tiles_here

    return tiles_here()
