"""Rotary position embeddings: the frequencies (with a checkpoint's scaling)
and the rotation, in HF's rotate-half layout."""

from __future__ import annotations

import math
from typing import Protocol

import msgspec
import torch


class RopeScaling(msgspec.Struct, frozen=True):
    """`rope_scaling` as a checkpoint declares it (types: linear, llama3, yarn)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None  # None: the model's max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0


class RopeConfig(Protocol):
    """What RoPE reads of a model's config (`completer.model.ModelConfig`)."""

    head_dim: int
    rope_theta: float
    rope_scaling: RopeScaling | None
    rope_local_theta: float
    max_position_embeddings: int


def inverse_frequencies(dim: int, theta: float, s: RopeScaling | None, max_positions: int) -> torch.Tensor:
    """Per-dimension-pair rotation frequencies for base `theta`, scaled as `s` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if s is None or s.rope_type == "default":
        return inv_freq.float()
    if s.rope_type == "linear":
        return (inv_freq / s.factor).float()
    old_len = s.original_max_position_embeddings or max_positions
    if s.rope_type == "llama3":
        low_wavelen = old_len / s.low_freq_factor
        high_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled).float()
    if s.rope_type == "yarn":

        def dim_for_rotations(n: float) -> float:
            return dim * math.log(old_len / (n * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_for_rotations(s.beta_fast)), 0)
        high = min(math.ceil(dim_for_rotations(s.beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
        extrapolate = 1 - ramp.clamp(0, 1)
        return (inv_freq / s.factor * (1 - extrapolate) + inv_freq * extrapolate).float()
    raise ValueError(f"unsupported rope_scaling type {s.rope_type!r}")


def rope_inverse_frequencies(cfg: RopeConfig) -> torch.Tensor:
    """The model's frequencies (a model with local layers: its global layers')."""
    return inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


def local_inverse_frequencies(cfg: RopeConfig) -> torch.Tensor | None:
    """Gemma 3's sliding layers rotate with a base of their own, unscaled; None: as the others."""
    if not cfg.rope_local_theta:
        return None
    return inverse_frequencies(cfg.head_dim, cfg.rope_local_theta, None, cfg.max_position_embeddings)


def rope_attention_scale(cfg: RopeConfig) -> float:
    """YaRN scales cos/sin (and so the logits) by a length-dependent factor."""
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "yarn" and s.factor > 1:
        return 0.1 * math.log(s.factor) + 1.0
    return 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (HF layout). x: [N, H, D]; cos/sin: [N, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
