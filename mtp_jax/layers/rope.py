"""Rotary position embeddings (Su et al. 2021, arXiv 2104.09864) in Hugging Face's rotate-half layout.

Frequencies follow `transformers`' `ROPE_INIT_FUNCTIONS` for the types in `RopeScaling`, so that a
checkpoint imported from the Hub gets the same cos/sin table as in `transformers`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from mtp_jax.config import ModelConfig, RopeScaling


def _yarn_inv_freq(inv_freq: np.ndarray, dim: int, base: float, s: RopeScaling) -> tuple[np.ndarray, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if s.attention_factor is not None:
        attention_factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention_factor = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim)
    else:
        attention_factor = mscale(s.factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    inv = (inv_freq / s.factor) * (1 - extrapolation) + inv_freq * extrapolation
    return inv.astype(np.float32), attention_factor


def _llama3_inv_freq(inv_freq: np.ndarray, s: RopeScaling) -> np.ndarray:
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def inverse_frequencies(config: ModelConfig, dim: int | None = None) -> tuple[np.ndarray, float]:
    """Per-pair inverse frequencies, float32 of shape [dim/2], and the cos/sin scale (YaRN's attention factor).

    dim: the rotated size, default `config.resolved_head_dim` (MLA passes `qk_rope_head_dim`).
    """
    dim = config.resolved_head_dim if dim is None else dim
    base, s = config.rope_theta, config.rope_scaling
    inv_freq = (1.0 / base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim)).astype(np.float32)
    if s.rope_type == "linear":
        return (inv_freq / s.factor).astype(np.float32), 1.0
    if s.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, s), 1.0
    if s.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, s)
    return inv_freq, 1.0


def apply_rope(
    x: Float[Array, "B T N D"], positions: Int[Array, "B T"], config: ModelConfig, dim: int | None = None
) -> Float[Array, "B T N D"]:
    """Rotate q or k of shape [B, T, N, D] by their absolute positions [B, T] (int32).

    Computed in float32 and cast back to x's dtype; rotate-half layout (first half pairs with
    second half), as in Hugging Face's Llama. dim: the frequencies' size (see `inverse_frequencies`),
    default `config.resolved_head_dim`; it must equal D, x's last axis.
    """
    inv_freq, scale = inverse_frequencies(config, dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    # cos and sin once per position and frequency: fused into the rotation, XLA evaluates them for every
    # element, 2N times over (the costliest part of RoPE in a CPU decode step).
    cos, sin = jax.lax.optimization_barrier((jnp.cos(angles) * scale, jnp.sin(angles) * scale))
    cos = jnp.concatenate([cos, cos], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    sin = jnp.concatenate([sin, sin], axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)  # [B, T, N, D/2] each
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # [B, T, N, D]
    return (xf * cos + rotated * sin).astype(x.dtype)
