"""The dense feed-forward block: SwiGLU (Shazeer 2020), Llama / DeepSeek-V3 names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from mtp_jax.config import ModelConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.fused import gate_up_layout
from mtp_jax.layers.linear import linear


def split_gate_up(gate_up: Float[Array, "... 2I"]) -> tuple[Float[Array, "... I"], Float[Array, "... I"]]:
    """The gate and up activations [..., I] of an interleaved `gate_up_proj` output [..., 2I] (column 2i is
    gate unit i, column 2i + 1 up unit i: `MLP`, `mtp_jax.layers.moe.Experts`). A reshape: a contiguous
    shard of the 2I axis is whole (gate, up) pairs, so it stays on its device."""
    pairs = gate_up.reshape(*gate_up.shape[:-1], -1, 2)  # [..., I, 2]
    return pairs[..., 0], pairs[..., 1]


def swiglu(gate_up: Float[Array, "... 2I"]) -> Float[Array, "... I"]:
    """`silu(gate) * up` [..., I] of an interleaved `gate_up_proj` output [..., 2I] (`split_gate_up`), in its
    dtype, as torch computes HF's `act_fn(gate_proj(x)) * up_proj(x)` in half precision: silu in float32
    rounded once, then the product rounded once. (`jax.nn.silu` on bfloat16 rounds each of its five ops: off
    torch by a rounding now and then, and 1.4-2.5x slower on XLA:CPU.) float32 is unchanged."""
    gate, up = split_gate_up(gate_up)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype) * up


class MLP(nnx.Module):
    """`down_proj(silu(gate) * up)` with `gate, up = split_gate_up(gate_up_proj(x))`: [..., E] -> [..., E] through
    I = `intermediate_size` (default `config.intermediate_size`; DeepSeek-V3's shared experts pass their own).

    Parameters (kernels [in, out] in `config.weight_dtype`, no biases): `gate_up_proj` [E, 2I], HF's
    `gate_proj` and `up_proj` in one matmul, interleaved along the output axis ([E, I, 2] flattened:
    column 2i is gate unit i, column 2i + 1 up unit i), so that a contiguous chunk of it holds matching
    gate and up units and tensor parallelism over it (any degree that divides I, `mtp_jax.sharding`)
    needs no exchange before `down_proj`; `mtp_jax.checkpoints` interleaves HF's tensors on load and
    separates them on export. `down_proj` [I, E]. `name`: the MLP's path in its layer ("mlp", DeepSeek-V3's
    "mlp.shared_experts"), which decides with `config.quantization` whether its linears are FP8 (`linear`).
    In a CPU engine's copy whose gate_up goes to oneDNN, the matmul and `swiglu` are one call
    (`mtp_jax.layers.onednn.packed_swiglu`).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs, intermediate_size: int | None = None, *, name: str = "mlp"):
        width = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = linear(
            config,
            config.hidden_size,
            2 * width,
            rngs,
            axes=("embed", ("mlp", 2)),
            name=f"{name}.gate_up_proj",
            layout=gate_up_layout(width),
        )  # splits between (gate, up) pairs
        self.down_proj = linear(
            config, width, config.hidden_size, rngs, axes=("mlp", "embed"), name=f"{name}.down_proj"
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        fused = onednn.packed_swiglu(self.gate_up_proj, x)  # an engine's CPU copy: matmul and SwiGLU in one call
        return self.down_proj(swiglu(self.gate_up_proj(x)) if fused is None else fused)
