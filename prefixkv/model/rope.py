"""Rotary position embeddings: inverse frequencies for each scaling variant, and the rotation itself.

Computed the same way as Hugging Face (fp32, rotate_half layout) so fp32 outputs match token for token.
"""

from __future__ import annotations

import math

import torch

from prefixkv.model.config import ModelConfig


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    factor = s["factor"]
    low_freq_factor = s.get("low_freq_factor", 1.0)
    high_freq_factor = s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, and scale attention by mscale."""
    old_len = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / old_len
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin for a step's positions; built once per step and shared by all layers."""

    def __init__(self, config: ModelConfig) -> None:
        dim, base = config.head_dim, config.rope_theta
        s = config.rope_scaling or {}
        kind = s.get("rope_type", s.get("type", "default"))
        self.attention_scaling = 1.0
        if kind == "default":
            inv_freq = _default_inv_freq(base, dim)
        elif kind == "linear":
            inv_freq = _default_inv_freq(base, dim) / s["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(_default_inv_freq(base, dim), s)
        elif kind == "freq_factors":  # GGUF rope_freqs tensor
            inv_freq = _default_inv_freq(base, dim) / torch.tensor(s["factors"], dtype=torch.float32, device="cpu")
        elif kind == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(base, dim, s, config.max_position_embeddings)
        else:
            raise ValueError(f"rope scaling {kind!r} is not supported (default, linear, llama3, yarn)")
        self.inv_freq = inv_freq  # always built on CPU (explicit device), even under a meta-device context

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] positions -> cos, sin each [T, 1, head_dim] (broadcast over heads)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        inv_freq = self.inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated in the rotate_half layout (first half pairs with second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin
