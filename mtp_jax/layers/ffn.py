"""The dense feed-forward block: SwiGLU (Shazeer 2020), Llama / DeepSeek-V3 names."""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.layers.linear import linear


class MLP(nnx.Module):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))`: [..., E] -> [..., E] through `intermediate_size`
    (default `config.intermediate_size`; DeepSeek-V3's experts and shared experts pass their own)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, intermediate_size: int | None = None):
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = linear(config, config.hidden_size, width, rngs)
        self.up_proj = linear(config, config.hidden_size, width, rngs)
        self.down_proj = linear(config, width, config.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
