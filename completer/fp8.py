"""FP8 (e4m3) W8A8 linear layers for the transformer's projections.

Weights carry one fp32 scale per output channel (computed at load time, or
taken from an FP8 checkpoint); activations are quantized per token at run
time; products accumulate in fp32 and come out in bf16. Embeddings, norms,
lm_head, attention math and the KV cache stay in full precision.

On CUDA with FP8 tensor cores (capability >= 8.9) each shape runs on the
faster of torch._scaled_mm (row-wise scales) and our Triton GEMM, timed once
at first use. Elsewhere an emulation with the same numerics (quantize,
dequantize, fp32 matmul) runs instead. Triton is imported only on the GPU path.
"""

from __future__ import annotations

import logging
import statistics

import torch
from torch import nn

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_NAMES = ("qkv_proj", "gate_up_proj")  # Transformer.fuse_projections' concatenations
_emulation_logged = False
_choices: dict[tuple, object] = {}  # (M bucket, N, K, device) -> the fastest GEMM
_quantize_kernel = None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: scales amax/448 (zero rows get a tiny scale).
    Bit-identical to completer_kernels.fp8_quant.quantize_fp8_rowwise_torch."""
    xf = x.float()
    s = xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (xf * (1.0 / s)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (one launch), or torch where triton is not installed."""
    global _quantize_kernel
    if _quantize_kernel is None:
        try:
            from completer_kernels.fp8_quant import quantize_fp8_rowwise as _quantize_kernel
        except ImportError:
            _quantize_kernel = quantize_rows
    return _quantize_kernel(x)


def _scaled_mm(xq, xs, layer):
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs.view(-1, 1), scale_b=layer.weight_scale.view(1, -1),
                            bias=layer.bias, out_dtype=torch.bfloat16)


def _triton(config):
    def run(xq, xs, layer):
        from completer_kernels.fp8_gemm import fp8_gemm_rowwise
        return fp8_gemm_rowwise(xq, layer.weight, xs, layer.weight_scale, layer.bias, config=config)
    run.config = config
    return run


def _candidates(M: int) -> list:
    try:
        from completer_kernels.fp8_gemm import gemm_configs
        tiles = [_triton(c) for c in gemm_configs(M)]
    except ImportError:  # no triton: cuBLAS only
        tiles = []
    return [_scaled_mm, *tiles]


def _fastest(xq, xs, layer):
    """Time every candidate a few times with CUDA events; those that fail drop out."""
    timings = []
    for impl in _candidates(xq.shape[0]):
        try:
            impl(xq, xs, layer)  # compiles, warms up
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                impl(xq, xs, layer)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            timings.append((statistics.median(times), impl))
        except Exception as e:  # a shape or tile the backend does not take
            log.debug("fp8 GEMM candidate %s failed: %s", getattr(impl, "config", "scaled_mm"), e)
    if not timings:
        raise RuntimeError(f"no FP8 GEMM runs shape {tuple(xq.shape)} x {tuple(layer.weight.shape)}")
    best = min(timings, key=lambda t: t[0])[1]
    log.debug("fp8 GEMM M=%d N=%d K=%d: %s", xq.shape[0], *layer.weight.shape,
              getattr(best, "config", "scaled_mm"))
    return best


class Fp8Linear(nn.Module):
    """y = (q(x) @ w_q.T) * x_scale * w_scale + bias, in bf16. Buffers: `weight`
    [N, K] e4m3, `weight_scale` [N] fp32, `bias` [N] bf16 or None."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.to(FP8).contiguous())
        self.register_buffer("weight_scale", weight_scale.float().reshape(-1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(torch.bfloat16))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        q, s = quantize_rows(linear.weight.detach())
        return cls(q, s, None if linear.bias is None else linear.bias.detach())

    @classmethod
    def from_fp8(cls, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Fp8Linear":
        """Stored e4m3 weights with a per-tensor or per-channel scale; 128x128
        block scales are re-quantized per channel (a second rounding)."""
        if _scale_layout(weight, scale) != "block":
            return cls(weight, scale.float().reshape(-1).expand(weight.shape[0]), bias)
        return cls(*quantize_rows(dequantize(weight, scale)), bias)

    @classmethod
    def concat(cls, layers: list["Fp8Linear"]) -> "Fp8Linear":
        """Outputs side by side: per-channel scales concatenate exactly."""
        biases = [m.bias for m in layers]
        bias = None if biases[0] is None else torch.cat(biases)
        return cls(torch.cat([m.weight for m in layers]), torch.cat([m.weight_scale for m in layers]), bias)

    def _apply(self, fn, recurse=True):
        # model.to(dtype) / .half() would cast the e4m3 weight and fp32 scales:
        # follow only the device that `fn` moves tensors to.
        for name, buf in self._buffers.items():
            if buf is not None:
                self._buffers[name] = buf.to(fn(buf.new_empty(0)).device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if has_fp8_tensor_cores(x.device):
            xq, xs = _quantize_activations(x2)
            key = (m_bucket(x2.shape[0]), self.out_features, self.in_features, x.device)
            impl = _choices.get(key)
            if impl is None and torch.cuda.is_current_stream_capturing():
                impl = _scaled_mm  # no timing inside a CUDA graph capture; warm up first
            elif impl is None:
                impl = _choices[key] = _fastest(xq, xs, self)
            y = impl(xq, xs, self)
        else:
            y = self._emulate(x2)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def _emulate(self, x2: torch.Tensor) -> torch.Tensor:
        global _emulation_logged
        if not _emulation_logged:
            _emulation_logged = True
            log.warning("fp8 emulation: no FP8 tensor cores on %s; quantize, dequantize, fp32 matmul",
                        x2.device)
        xq, xs = quantize_rows(x2)
        y = (xq.float() @ self.weight.float().T) * xs[:, None] * self.weight_scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(torch.bfloat16)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def m_bucket(m: int) -> int:
    """Shapes share a GEMM choice per power-of-two M."""
    return 1 << max(m - 1, 0).bit_length()


def _scale_layout(weight: torch.Tensor, scale: torch.Tensor) -> str:
    N, K = weight.shape
    if scale.numel() == 1:
        return "tensor"
    if tuple(scale.shape) in ((N,), (N, 1)):
        return "channel"
    if tuple(scale.shape) == (-(-N // 128), -(-K // 128)):
        return "block"
    raise ValueError(f"weight_scale of shape {tuple(scale.shape)} fits no layout for a weight {N}x{K}")


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weights from e4m3 and a per-tensor, per-channel or 128x128 block scale."""
    (N, K), w, s = weight.shape, weight.float(), scale.float()
    layout = _scale_layout(weight, scale)
    if layout == "block":
        return w * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return w * (s.reshape(()) if layout == "tensor" else s.reshape(N, 1))


def quantize_linears(model: nn.Module, names: tuple[str, ...] = LINEAR_NAMES + FUSED_NAMES) -> nn.Module:
    """Replace every transformer projection (q, k, v, o, gate, up, down; or
    only those in `names`) that is still an nn.Linear by an Fp8Linear, in
    place; returns the model."""
    for module in list(model.modules()):
        for name in names:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, Fp8Linear.from_linear(child))
    return model


def load_fp8_weights(model: nn.Module, weights: dict[str, torch.Tensor],
                     scales: dict[str, torch.Tensor], keep_fp8: bool) -> None:
    """Install e4m3 checkpoint tensors (`x.weight` with `x.weight_scale` or
    `x.weight_scale_inv`): as Fp8Linear for the projections when keep_fp8,
    otherwise dequantized into the model's own weights (lm_head always)."""
    for name, weight in weights.items():
        path = name.removesuffix(".weight")
        scale = scales.get(f"{path}.weight_scale", scales.get(f"{path}.weight_scale_inv"))
        if scale is None:
            raise ValueError(f"FP8 tensor {name!r} has no {path}.weight_scale")
        parent, _, attr = path.rpartition(".")
        linear = model.get_submodule(path)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"FP8 tensor {name!r} is not a linear layer's weight")
        if keep_fp8 and attr in LINEAR_NAMES:
            bias = None if linear.bias is None else linear.bias.detach()
            layer = Fp8Linear.from_fp8(weight, scale, bias).to(linear.weight.device)
            setattr(model.get_submodule(parent), attr, layer)
        else:
            with torch.no_grad():
                linear.weight.copy_(dequantize(weight, scale))
