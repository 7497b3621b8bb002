"""Rotary position embeddings (half-split "NeoX" layout, as Hugging Face checkpoints store q and k)."""
import math

import torch

from fastdecode.errors import ModelFileError


def inverse_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    if kind == "yarn":
        return yarn_inverse_frequencies(head_dim, base, scaling)
    if kind == "freq_factors":  # llama.cpp stores llama3 scaling as a `rope_freqs` tensor of divisors
        factors = scaling["factors"].float()
        if factors.shape != inv_freq.shape or not (factors.isfinite() & (factors > 0)).all():
            raise ModelFileError(f"GGUF rope_freqs.weight must be {len(inv_freq)} finite divisors above 0")
        return inv_freq / factors
    raise ValueError(f"unsupported rope scaling {kind!r}")


def yarn_inverse_frequencies(head_dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: dimensions that turn more than beta_fast times over the
    original context keep their frequency, those under beta_slow are divided by `factor`, a linear ramp between."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations):
        return (head_dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(scaling: dict | None) -> float:
    """YaRN scales cos and sin (so q.k by its square) to keep attention's entropy as the context stretches."""
    if ((scaling or {}).get("rope_type") or (scaling or {}).get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]
    mscale = lambda scale, m=1: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0  # noqa: E731
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rope_cache(head_dim: int, max_positions: int, base: float, scaling: dict | None) -> torch.Tensor:
    """(max_positions, head_dim) cos table and sin table stacked: (2, max_positions, head_dim), float32."""
    inv_freq = inverse_frequencies(head_dim, base, scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()]) * attention_factor(scaling)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, head_dim); cos, sin: (T, head_dim)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
