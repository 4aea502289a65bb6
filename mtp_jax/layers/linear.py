"""The one linear layer of the models: `nnx.Linear` in the config's dtypes with N(0, initializer_range) init,
its kernel named by logical axes (`mtp_jax.sharding`)."""

from __future__ import annotations

from flax import nnx

from mtp_jax.config import ModelConfig


def linear(config: ModelConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs, bias: bool = False, *,
           axes: tuple[str | tuple[str, int] | None, str | tuple[str, int] | None]) -> nnx.Linear:
    """`nnx.Linear(fan_in, fan_out)`: kernel [fan_in, fan_out] in `config.weight_dtype`, computing in
    `config.compute_dtype`; an optional bias (zeros).

    `axes`: the kernel's logical axes (input, output) for `mtp_jax.sharding` (`LOGICAL_RULES`): a name,
    None, or `(name, block)` for an axis that may split only at multiples of `block` (between heads);
    the bias takes the output's.
    """
    return nnx.Linear(
        fan_in,
        fan_out,
        use_bias=bias,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": axes[1:]},
    )
