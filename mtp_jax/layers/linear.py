"""The one linear layer of the models: `nnx.Linear` in the config's dtypes with N(0, initializer_range) init."""

from __future__ import annotations

from flax import nnx

from mtp_jax.config import ModelConfig


def linear(config: ModelConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs, bias: bool = False) -> nnx.Linear:
    """`nnx.Linear(fan_in, fan_out)`: kernel [fan_in, fan_out] in `config.weight_dtype`, computing in
    `config.compute_dtype`; an optional bias (zeros)."""
    return nnx.Linear(
        fan_in,
        fan_out,
        use_bias=bias,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
    )
