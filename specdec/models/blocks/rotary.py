"""Rotary position embeddings: the inverse frequencies of every scaling the families use (linear, Llama-3,
LongRoPE's short factors, YaRN), their cos and sin tables over every position, and the rotation itself."""
from __future__ import annotations

import math

import torch

from specdec.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies over the rotated dimensions, with Llama-3, linear and LongRoPE scaling; `local`: a
    sliding layer's own unscaled base (Gemma 3's rope_local_theta)."""
    dim = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = None if local else cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind in ("longrope", "su"):  # the short factors: positions within the original context (see `rope_tables`)
        return inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, cfg, theta)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_medium, smoothed, out)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, longrope, yarn")


def yarn_factor(scaling: dict, cfg: ModelConfig) -> float:
    """YaRN's context growth: `factor`, else the context over the original one."""
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    return float(scaling.get("factor") or cfg.max_position_embeddings / original)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for no growth)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, scaling: dict, cfg: ModelConfig, theta: float) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated by the
    factor, those that turn more than beta_fast times are kept, a linear ramp between (transformers' rule, with its
    integer-truncated ramp ends unless `truncate` is false)."""
    dim, factor = 2 * inv_freq.numel(), yarn_factor(scaling, cfg)
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings

    def turns(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns(scaling.get("beta_fast") or 32), turns(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    kept = 1 - ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def rope_attention_factor(cfg: ModelConfig, local: bool = False) -> float:
    """What LongRoPE multiplies cos and sin by: sqrt(1 + ln(factor) / ln(original context)), factor the context's
    growth, unless the config names it (transformers' rule); YaRN: its mscale ratio."""
    scaling = None if local else cfg.rope_scaling
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor, mscale, mscale_all = yarn_factor(scaling, cfg), scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        return yarn_mscale(factor)
    if kind not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, local: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [max_position_embeddings, rotary_dim] for `rotate`, for every position at once (the
    target and the draft heads index them by position). LongRoPE uses its short factors at every position, as
    llama.cpp does for a context within the original one (transformers switches to the long factors for a sequence
    past it, re-rotating nothing already cached)."""
    freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), rope_inv_freq(cfg, local))
    emb = torch.cat((freqs, freqs), dim=-1)
    half = emb.shape[-1] // 2
    scale = rope_attention_factor(cfg, local)
    signed_sin = torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1) * scale
    return (emb.cos() * scale).to(dtype=dtype, device=device), signed_sin.to(dtype=dtype, device=device)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF 'rotate_half' RoPE in four ops: rotate_half(x) * sin == roll(x, D/2) * [-sin1, sin2]; with tables
    narrower than the heads (a partial rotary factor) the first R dimensions rotate and the rest pass.

    x: [T, H, D]; cos, signed_sin: [T, 1, R], R <= D.
    """
    R = cos.shape[-1]
    if R < x.shape[-1]:
        return torch.cat((rotate(x[..., :R], cos, signed_sin), x[..., R:]), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
