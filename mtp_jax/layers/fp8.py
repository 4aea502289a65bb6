"""The FP8 linear layer: DeepSeek-V3's block-scaled float8_e4m3fn weights kept in FP8 on the device.

A quantized kernel [.., in, out] is float8_e4m3fn with *column-expanded* float32 scales
`scale_inv` [.., ceil(in / b_in), out] (`mtp_jax.quantization`): the weight is

    w[.., i, o] = float32(kernel[.., i, o]) * scale_inv[.., i // b_in, o]

and the checkpoint's scale [ceil(out / b_out), ceil(in / b_in)] is `scale_inv` transposed with its columns
collapsed to their blocks (`mtp_jax.checkpoints` converts both ways). Each output column carries its own
scale, so fused projections and output-axis shards keep their scales with their columns. `dequantize`
runs inside every forward (inside the caller's jit, where XLA can fuse it into the matmul's operand),
so the weights stay 1 byte per value in device memory, plus 4 bytes per scale entry.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from mtp_jax.quantization import FP8_MAX

FP8 = jnp.float8_e4m3fn


def _expand_rows(scale_inv: jax.Array, rows: int, block_in: int) -> jax.Array:
    """`scale_inv` [.., ceil(rows/b), out] -> [.., rows, out]: each block row repeated `block_in` times, cut."""
    repeated = jnp.repeat(scale_inv, block_in, axis=-2, total_repeat_length=scale_inv.shape[-2] * block_in)
    return repeated[..., :rows, :]  # [.., rows, out]


def dequantize(kernel: jax.Array, scale_inv: jax.Array, block_in: int, dtype: Any) -> jax.Array:
    """The weight [.., in, out] in `dtype`: `float32(kernel) * scale_inv[.., i // block_in, :]`, then cast.

    Args:
      kernel: float8_e4m3fn [.., in, out].
      scale_inv: float32 [.., ceil(in / block_in), out], column-expanded.
      block_in: b_in, the input rows one scale covers.
      dtype: the result's dtype (the compute dtype).

    Raises ValueError when `scale_inv`'s shape is not the kernel's block grid.
    """
    *lead, rows, cols = kernel.shape
    grid = (*lead, -(-rows // block_in), cols)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale_inv must have shape {grid} for a kernel {kernel.shape} in blocks of {block_in} rows")
    return (kernel.astype(jnp.float32) * _expand_rows(scale_inv, rows, block_in)).astype(dtype)


@functools.partial(jax.jit, static_argnames="block_in")  # one program per shape (eager init: not ~10 per op)
def quantize(weight: jax.Array, block_in: int) -> tuple[jax.Array, jax.Array]:
    """A fresh model's FP8 kernel: `weight` [.., in, out] as (float8_e4m3fn [.., in, out], float32 scale_inv
    [.., ceil(in / block_in), out]).

    One scale per block of `block_in` input rows, the same for every output column (amax of the block's
    rows over all columns / FP8_MAX; 1 for an all-zero block): a valid block scaling for any block width
    and any split of the output axis into checkpoint tensors (fused projections included). Loaded
    checkpoints bring their own per-block scales. Traceable (jit, `nnx.eval_shape`).
    """
    *lead, rows, cols = weight.shape
    blocks = -(-rows // block_in)
    w = weight.astype(jnp.float32)
    padded = jnp.pad(w, [(0, 0)] * len(lead) + [(0, blocks * block_in - rows), (0, 0)])  # [.., blocks b_in, out]
    amax = jnp.abs(padded.reshape(*lead, blocks, block_in * cols)).max(axis=-1)  # [.., blocks]
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    scale_inv = jnp.broadcast_to(scale[..., None], (*lead, blocks, cols))  # [.., blocks, out]
    kernel = jnp.clip(w / _expand_rows(scale_inv, rows, block_in), -FP8_MAX, FP8_MAX).astype(FP8)
    return kernel, scale_inv


class Fp8Linear(nnx.Module):
    """`nnx.Linear`'s contract with a block-scaled FP8 kernel: `__call__(x [.., in]) -> [.., out]` in `dtype`.

    Parameters: `kernel` float8_e4m3fn [in, out], `kernel_scale_inv` float32 [ceil(in / block_in), out]
    (column-expanded, see the module docstring) and, with `use_bias`, `bias` [out] in `param_dtype`. The
    call dequantizes the kernel to `dtype` (`weight`) and computes `dot_general(x, w) + bias`, as
    `nnx.Linear` with that kernel would.

    Args:
      in_features, out_features: the kernel's shape.
      block_in: b_in, input rows per scale (the checkpoint's `weight_block_size[1]`).
      use_bias: add a bias (zeros at init).
      dtype: compute dtype; param_dtype: the bias's dtype.
      kernel_init: the initializer of the float32 weight that a fresh layer quantizes (`quantize`).
      dot_general: the contraction (`mtp_jax.layers.linear.dot_general`).
      axes: the kernel's logical axes (input, output) (`mtp_jax.sharding`); the scale takes (None, output),
        the bias (output,).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block_in: int,
        use_bias: bool,
        dtype: Any,
        param_dtype: Any,
        kernel_init: Callable,
        dot_general: Callable,
        axes: tuple,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features, self.block_in = in_features, out_features, block_in
        self.dtype, self.dot_general = dtype, dot_general
        kernel, scale_inv = quantize(kernel_init(rngs.params(), (in_features, out_features), jnp.float32), block_in)
        self.kernel = nnx.Param(kernel, logical_axes=axes)
        self.kernel_scale_inv = nnx.Param(scale_inv, logical_axes=(None, axes[1]))
        self.bias = nnx.data(None)
        if use_bias:  # a key drawn as nnx.Linear draws it, so the layers after this one get the same weights
            bias = nnx.initializers.zeros(rngs.params(), (out_features,), param_dtype)
            self.bias = nnx.Param(bias, logical_axes=axes[1:])

    def weight(self, dtype: Any = None) -> Float[Array, "in out"]:
        """The dequantized kernel [in, out] in `dtype` (default the compute dtype)."""
        dtype = self.dtype if dtype is None else dtype
        return dequantize(self.kernel[...], self.kernel_scale_inv[...], self.block_in, dtype)

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        x = x.astype(self.dtype)
        y = self.dot_general(x, self.weight(), (((x.ndim - 1,), (0,)), ((), ())))  # [.., out]
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
