"""RMSNorm (Zhang & Sennrich 2019), as Hugging Face's Llama, DeepSeek-V3 and Qwen3.5 compute it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _normalized(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in float32."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """`weight * x / rms(x)` over the last axis: normalised in float32, then scaled in x's dtype (as in HF).

    Parameter `weight` of shape [dim], stored in `param_dtype`. With `unit_offset` (Qwen3.5's zero-centred
    `Qwen3_5RMSNorm`) the weight is stored around 0 (zeros at init) and applied as `(1 + weight)`, the
    product taken in float32 and then cast to x's dtype, as HF does.
    """

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32, *, unit_offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), param_dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    @classmethod
    def of(cls, config, dim: int | None = None) -> RMSNorm:
        """The model's RMSNorm over `dim` entries (default `config.hidden_size`): its eps, weight dtype and
        `rms_norm_unit_offset`."""
        dim = config.hidden_size if dim is None else dim
        return cls(dim, config.rms_norm_eps, config.weight_dtype, unit_offset=config.rms_norm_unit_offset)

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = _normalized(x, self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """The Gated DeltaNet's output norm (HF `Qwen3_5RMSNormGated`): `weight * x / rms(x) * silu(gate)` over the
    last axis (a head's values), `weight` [dim] (ones at init, not zero-centred); returned in x's dtype."""

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        scaled = self.weight[...].astype(x.dtype) * _normalized(x, self.eps).astype(x.dtype)
        return (scaled * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
