"""The one linear layer of the models: `nnx.Linear` in the config's dtypes with N(0, initializer_range) init,
or its block-scaled FP8 twin `mtp_jax.layers.fp8.Fp8Linear` where `ModelConfig.quantization` asks for it; its
kernel named by logical axes (`mtp_jax.sharding`); `dot_general`, the contraction it computes; and
`compute_kernel`, the kernel as the matmul sees it (for code that reads a layer's weights directly)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.layers.fp8 import Fp8Linear
from mtp_jax.layers.fused import FusedLayout


def dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
) -> jax.Array:
    """`jax.lax.dot_general`, with half-precision operands on the CPU backend accumulated in float32:
    the result is `preferred_element_type` when given, else float32 cast back to the operands' dtype.

    The same numbers XLA computes for a bfloat16 x bfloat16 -> bfloat16 dot (each product of two
    bfloat16 values is exact in float32, the sum is taken in float32, the result rounded once), but
    XLA:CPU then runs its native bfloat16 matmul (YNNPACK) instead of converting both operands to
    float32 in memory before every call: on this project's AVX512-BF16 CPU mostly faster than float32
    at 4-64 rows (up to 2x on the medium preset's projections), where the plain bfloat16 dot was
    3-15x slower than float32 (`benchmarks/bench_gemm.py`). A
    one-row left operand is padded to two rows (XLA:CPU computes a one-row dot as a float32
    matrix-vector product after converting the whole right operand to float32, ~10x slower). Other
    backends (GPU, TPU: their bfloat16 matmuls accumulate in float32 already) and float32 operands
    go to `jax.lax.dot_general` unchanged.
    """
    half = lhs.dtype in (jnp.bfloat16, jnp.float16) and rhs.dtype == lhs.dtype
    if not half or jax.default_backend() != "cpu":
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type, **kwargs
        )
    out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type
    (lhs_contract, _), (lhs_batch, _) = dimension_numbers
    free = [axis for axis in range(lhs.ndim) if axis not in (*lhs_contract, *lhs_batch)]
    pad = not lhs_batch and bool(free) and all(lhs.shape[axis] == 1 for axis in free)
    if pad:  # one row: [.., 1, ..] -> [.., 2, ..] on its first free axis, the second row zeros
        lhs = jnp.pad(lhs, [(0, 1 if axis == free[0] else 0) for axis in range(lhs.ndim)])
    out = jax.lax.dot_general(
        lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=jnp.float32, **kwargs
    )
    if pad:  # the result's leading axes are lhs's free axes, in order: row 0 of the first is the real one
        out = jax.lax.slice_in_dim(out, 0, 1, axis=0)
    return out.astype(out_dtype)


def linear(
    config: ModelConfig,
    fan_in: int,
    fan_out: int,
    rngs: nnx.Rngs,
    bias: bool = False,
    *,
    axes: tuple[str | tuple[str, int] | None, str | tuple[str, int] | None],
    name: str,
    layout: FusedLayout | None = None,
) -> nnx.Linear | Fp8Linear:
    """`nnx.Linear(fan_in, fan_out)`: kernel [fan_in, fan_out] in `config.weight_dtype`, computing in
    `config.compute_dtype` (through `dot_general`: on a CPU, half precision accumulated in float32);
    an optional bias (zeros).

    With `config.quantization` set and its `Fp8Config.quantizes(name)` true, an `Fp8Linear` instead: the
    same contract, its kernel float8_e4m3fn with float32 block scales (`kernel_scale_inv`), dequantized
    to the compute dtype in each call; the bias stays in `config.weight_dtype`. Both draw the same
    N(0, initializer_range) weight from `rngs` (a fresh FP8 layer holds it quantized).

    `axes`: the kernel's logical axes (input, output) for `mtp_jax.sharding` (`LOGICAL_RULES`): a name,
    None, or `(name, block)` for an axis that may split only at multiples of `block` (between heads);
    the bias takes the output's. `name`: the module's HF path inside its decoder layer
    ("self_attn.o_proj", "mlp.shared_experts.down_proj", MTP's "eh_proj"), or "lm_head". `layout`: a fused
    projection's output layout (`mtp_jax.layers.fused`), which places an FP8 kernel's block scales; default
    one piece of `fan_out`.
    """
    init = nnx.initializers.normal(config.initializer_range)
    if config.quantization is not None and config.quantization.quantizes(name):
        return Fp8Linear(
            fan_in,
            fan_out,
            block=config.quantization.weight_block_size,
            layout=layout,
            use_bias=bias,
            dtype=config.compute_dtype,
            param_dtype=config.weight_dtype,
            kernel_init=init,
            dot_general=dot_general,
            axes=axes,
            rngs=rngs,
        )
    return nnx.Linear(
        fan_in,
        fan_out,
        use_bias=bias,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        kernel_init=init,
        dot_general=dot_general,
        rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": axes[1:]},
    )


def compute_kernel(layer: nnx.Linear | Fp8Linear, dtype=None) -> jax.Array:
    """`layer`'s kernel [in, out] as its matmul uses it, in `dtype` (default its compute dtype): an
    `Fp8Linear`'s dequantized (`Fp8Linear.weight`), an `nnx.Linear`'s cast. A layer read here must not
    be packed for oneDNN by `DecodeEngine` (`mtp_jax.layers.onednn._packable` skips MLA's kv_b_proj)."""
    if isinstance(layer, Fp8Linear):
        return layer.weight(dtype)
    return layer.kernel[...].astype(layer.dtype if dtype is None else dtype)
