"""Inverse frequencies of the text RoPE for the `rope_type`s Qwen2.5-VL checkpoints use: default ("mrope"),
"linear" and "yarn", as transformers' `modeling_rope_utils` computes them (same formulas, same float32 order of
operations), so the multimodal sections then pick bands of the same frequencies.

Types whose frequencies depend on the current sequence length ("dynamic", "longrope") or that no Qwen release
uses are refused when the config is read (see hf_config.py), never approximated here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


@dataclass
class RopeScaling:
    """The scaling part of `rope_parameters` (rope_theta and mrope_section live on TextArgs).

    For yarn, None fields take transformers' defaults: original_max_position_embeddings the model's
    max_position_embeddings, attention_factor from `factor` (and mscale/mscale_all_dim when both are set).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(s: RopeScaling) -> float:
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


def _yarn_inv_freq(s: RopeScaling, base: float, dim: int, max_position_embeddings: int,
                   device) -> torch.Tensor:
    """YaRN (Peng et al. 2023, arXiv:2309.00071): frequencies that rotate fewer than beta_slow times over the
    original context are interpolated (divided by factor), those rotating more than beta_fast times are kept,
    with a linear ramp over the dimensions in between."""
    original = s.original_max_position_embeddings or max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device).float() / dim)
    return (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight


def text_inv_freq(scaling: RopeScaling, base: float, head_dim: int, max_position_embeddings: int,
                  device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,), attention_scaling): cos and sin are multiplied by attention_scaling."""
    if scaling.rope_type == "yarn":
        return (_yarn_inv_freq(scaling, base, head_dim, max_position_embeddings, device),
                yarn_attention_factor(scaling))
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float) / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    return inv_freq, 1.0
