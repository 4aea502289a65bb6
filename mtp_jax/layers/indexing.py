"""Per-row positions and gathers along the token axis (every row of a batch sits at its own position)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def take_rows(x: Float[Array, "B T ..."], index: Int[Array, " B"]) -> Float[Array, "B 1 ..."]:
    """`x[b, index[b]]` for each row b, keeping a length-1 T axis."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


def sequence_positions(batch_size: int, num: int, start: Int[Array, " B"] | int = 0) -> Int[Array, "B T"]:
    """int32 [B, num]: row b's positions start[b] .. start[b] + num - 1."""
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (batch_size,))
    return start[:, None] + jnp.arange(num, dtype=jnp.int32)[None, :]
