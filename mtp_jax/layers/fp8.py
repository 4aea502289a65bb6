"""The FP8 linear layer: DeepSeek-V3's block-scaled float8_e4m3fn weights kept in FP8 on the device.

A quantized kernel [.., in, out] is float8_e4m3fn with float32 block scales `scale_inv`
[.., ceil(in / b_in), N], N = sum_p ceil(out_p / b_out): the checkpoint's `weight_scale_inv`
[ceil(out_p / b_out), ceil(in / b_in)] of each piece p of the kernel's output axis (the HF modules a fused
projection holds, `mtp_jax.layers.fused`), transposed and laid side by side in piece order. The weight is

    w[.., i, c] = float32(kernel[.., i, c]) * scale_inv[.., i // b_in, columns[c]]

with `columns = block_columns(layout, b_out)` [out], a static index: fused column c is column j of piece p,
in scale column (blocks of the pieces before p) + j // b_out. `dequantize` runs inside every forward (inside
the caller's jit, where XLA can fuse the gather and the product into the matmul's operand), so device memory
holds 1 byte per weight plus 4 bytes per (b_out x b_in) block, as the checkpoint does: 0.17 GB of scales for
all of DeepSeek-V3 (`mtp_jax.memory_plan`). The scales are replicated (their output axis is not the
kernel's, so a shard of the kernel's columns gathers its blocks' scales from the whole); the routed experts'
split over `expert` as their kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from mtp_jax.layers.fused import FusedLayout, block_columns
from mtp_jax.quantization import FP8_MAX

FP8 = jnp.float8_e4m3fn


def _per_weight(scale_inv: jax.Array, rows: int, block: tuple[int, int], layout: FusedLayout) -> jax.Array:
    """`scale_inv` [.., ceil(rows / b_in), N] -> each weight's scale [.., rows, out] (static gathers)."""
    b_in = block[1]
    columns = jnp.take(scale_inv, block_columns(layout, block[0]), axis=-1)  # [.., ceil(rows / b_in), out]
    repeated = jnp.repeat(columns, b_in, axis=-2, total_repeat_length=columns.shape[-2] * b_in)
    return repeated[..., :rows, :]  # [.., rows, out]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int], layout: FusedLayout) -> tuple[int, ...]:
    """The block scales' shape [.., ceil(in / b_in), sum_p ceil(out_p / b_out)] of a kernel `shape` [.., in, out]."""
    *lead, rows, _ = shape
    return (*lead, -(-rows // block[1]), layout.blocks(block[0]).width)


def dequantize(
    kernel: jax.Array, scale_inv: jax.Array, block: tuple[int, int], layout: FusedLayout, dtype: Any
) -> jax.Array:
    """The weight [.., in, out] in `dtype`: `float32(kernel[.., i, c]) * scale_inv[.., i // b_in, columns[c]]`
    (module docstring), then cast.

    Args:
      kernel: float8_e4m3fn [.., in, out].
      scale_inv: float32 [.., ceil(in / b_in), sum_p ceil(out_p / b_out)], the pieces' block scales.
      block: (b_out, b_in), the checkpoint's `weight_block_size`.
      layout: the kernel's output layout (its pieces; `FusedLayout((out,))` for an unfused kernel).
      dtype: the result's dtype (the compute dtype).

    Raises ValueError when the layout's width is not the kernel's or `scale_inv`'s shape is not its block grid.
    """
    if kernel.shape[-1] != layout.width:
        raise ValueError(f"a kernel {kernel.shape} has {kernel.shape[-1]} output columns, its layout {layout.width}")
    grid = scale_shape(kernel.shape, block, layout)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale_inv must have shape {grid} for a kernel {kernel.shape} in blocks {block}")
    return (kernel.astype(jnp.float32) * _per_weight(scale_inv, kernel.shape[-2], block, layout)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("block", "layout"))  # one program per shape (eager init)
def quantize(weight: jax.Array, block: tuple[int, int], layout: FusedLayout) -> tuple[jax.Array, jax.Array]:
    """A fresh model's FP8 kernel: `weight` [.., in, out] as (float8_e4m3fn [.., in, out], float32 scale_inv
    [.., ceil(in / b_in), sum_p ceil(out_p / b_out)]), DeepSeek-V3's block quantization
    (`mtp_jax.quantization.quantize_fp8_blocks`) of each piece of `layout`: per (b_out x b_in) block of a
    piece, edge blocks partial, `scale = amax(|block|) / FP8_MAX` (1 for an all-zero block), the values
    divided by it and rounded to float8_e4m3fn. Traceable (jit, `nnx.eval_shape`).
    """
    *lead, rows, cols = weight.shape
    b_out, b_in = block
    row_blocks = -(-rows // b_in)
    w = weight.astype(jnp.float32)
    padded = jnp.pad(jnp.abs(w), [(0, 0)] * len(lead) + [(0, row_blocks * b_in - rows), (0, 0)])  # [.., rb b_in, out]
    column_amax = padded.reshape(*lead, row_blocks, b_in, cols).max(axis=-2)  # [.., rb, out]
    amax = jnp.zeros(scale_shape(weight.shape, block, layout), jnp.float32)  # [.., rb, N]
    amax = amax.at[..., block_columns(layout, b_out)].max(column_amax)  # each block's amax over its columns
    scale_inv = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)
    kernel = jnp.clip(w / _per_weight(scale_inv, rows, block, layout), -FP8_MAX, FP8_MAX).astype(FP8)
    return kernel, scale_inv


class Fp8Linear(nnx.Module):
    """`nnx.Linear`'s contract with a block-scaled FP8 kernel: `__call__(x [.., in]) -> [.., out]` in `dtype`.

    Parameters: `kernel` float8_e4m3fn [in, out], `kernel_scale_inv` float32 [ceil(in / b_in),
    sum_p ceil(out_p / b_out)] (the pieces' block scales, see the module docstring) and, with `use_bias`,
    `bias` [out] in `param_dtype`. The call dequantizes the kernel to `dtype` (`weight`) and computes
    `dot_general(x, w) + bias`, as `nnx.Linear` with that kernel would.

    Args:
      in_features, out_features: the kernel's shape.
      block: (b_out, b_in), the checkpoint's `weight_block_size`.
      layout: the output axis' pieces (`mtp_jax.layers.fused`; default one piece of `out_features`).
      use_bias: add a bias (zeros at init).
      dtype: compute dtype; param_dtype: the bias's dtype.
      kernel_init: the initializer of the float32 weight that a fresh layer quantizes (`quantize`).
      dot_general: the contraction (`mtp_jax.layers.linear.dot_general`).
      axes: the kernel's logical axes (input, output) (`mtp_jax.sharding`); the scale takes (None, None),
        replicated, the bias (output,).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block: tuple[int, int],
        layout: FusedLayout | None = None,
        use_bias: bool,
        dtype: Any,
        param_dtype: Any,
        kernel_init: Callable,
        dot_general: Callable,
        axes: tuple,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.layout = FusedLayout((out_features,)) if layout is None else layout
        if self.layout.width != out_features:
            raise ValueError(f"layout {self.layout} has {self.layout.width} columns, out_features {out_features}")
        self.dtype, self.dot_general = dtype, dot_general
        weight = kernel_init(rngs.params(), (in_features, out_features), jnp.float32)
        kernel, scale_inv = quantize(weight, self.block, self.layout)
        self.kernel = nnx.Param(kernel, logical_axes=axes)
        self.kernel_scale_inv = nnx.Param(scale_inv, logical_axes=(None, None))
        self.bias = nnx.data(None)
        if use_bias:  # a key drawn as nnx.Linear draws it, so the layers after this one get the same weights
            bias = nnx.initializers.zeros(rngs.params(), (out_features,), param_dtype)
            self.bias = nnx.Param(bias, logical_axes=axes[1:])

    def weight(self, dtype: Any = None) -> Float[Array, "in out"]:
        """The dequantized kernel [in, out] in `dtype` (default the compute dtype)."""
        dtype = self.dtype if dtype is None else dtype
        return dequantize(self.kernel[...], self.kernel_scale_inv[...], self.block, self.layout, dtype)

    def __call__(self, x: Float[Array, "... in"]) -> Float[Array, "... out"]:
        x = x.astype(self.dtype)
        y = self.dot_general(x, self.weight(), (((x.ndim - 1,), (0,)), ((), ())))  # [.., out]
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y
