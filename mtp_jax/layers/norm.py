"""RMSNorm (Zhang & Sennrich 2019), as Hugging Face's Llama and DeepSeek-V3 compute it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """`weight * x / rms(x)` over the last axis: normalised in float32, then scaled in x's dtype (as in HF).

    Parameter `weight` of shape [dim] (ones at init), stored in `param_dtype`.
    """

    def __init__(self, dim: int, eps: float, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(x.dtype) * xf.astype(x.dtype)
