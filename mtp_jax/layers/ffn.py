"""The dense feed-forward block: SwiGLU (Shazeer 2020), Llama / DeepSeek-V3 names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.layers.linear import linear


class MLP(nnx.Module):
    """`down_proj(silu(gate) * up)` with `[gate, up] = gate_up_proj(x)`: [..., E] -> [..., E] through
    I = `intermediate_size` (default `config.intermediate_size`; DeepSeek-V3's shared experts pass their own).

    Parameters (kernels [in, out] in `config.weight_dtype`, no biases): `gate_up_proj` [E, 2I], HF's
    `gate_proj` then `up_proj` side by side along the output axis (one matmul; `mtp_jax.checkpoint`
    splits and joins them), and `down_proj` [I, E].
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, intermediate_size: int | None = None):
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = linear(config, config.hidden_size, 2 * width, rngs, axes=("embed", "mlp"))
        self.down_proj = linear(config, width, config.hidden_size, rngs, axes=("mlp", "embed"))

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = jnp.split(self.gate_up_proj(x), 2, axis=-1)  # [..., I] each
        return self.down_proj(jax.nn.silu(gate) * up)
