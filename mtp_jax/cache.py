"""Preallocated, fixed-shape KV cache with per-row lengths.

Semantics (`docs/MTP_SPEC.md`, "The main model's cache"): row b's cache holds positions
`0 .. lengths[b] - 1`; a forward of T new tokens writes them at `lengths[b] .. lengths[b] + T - 1`
and advances `lengths` by the number of tokens the caller commits. Rollback is a length update,
never a copy: entries past `lengths[b]` are stale, invisible to attention and overwritten later.
Writes are scatters with out-of-range indices dropped, so no write can land outside `[0, S)` or
clobber a live entry (JAX would clamp a `dynamic_update_slice` start instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from mtp_jax.config import ModelConfig


@struct.dataclass
class KVCache:
    """Per-layer caches `k[i]`, `v[i]` of shape [B, S, G, D] and `lengths` int32 [B]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        """S, the capacity in tokens."""
        return self.k[0].shape[1]

    @classmethod
    def init(
        cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None, num_layers: int | None = None
    ) -> KVCache:
        """An empty cache (all lengths 0) of capacity `max_length` tokens for `num_layers` layers."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        num_layers = config.num_hidden_layers if num_layers is None else num_layers
        dtype = config.compute_dtype if dtype is None else dtype
        shape = (batch_size, max_length, config.num_key_value_heads, config.resolved_head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(
            k=zeros,
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch_size,), jnp.int32),
        )

    def fill_stale(self, value: float) -> KVCache:
        """Every entry at or past a row's length set to `value` (tests: NaN there must change nothing)."""
        stale = (jnp.arange(self.max_length)[None, :] >= self.lengths[:, None])[:, :, None, None]  # [B, S, 1, 1]
        return self.replace(
            k=tuple(jnp.where(stale, value, x) for x in self.k), v=tuple(jnp.where(stale, value, x) for x in self.v)
        )


def write_at(cache: Float[Array, "B S G D"], new: Float[Array, "B T G D"], start: Int[Array, " B"]) -> jax.Array:
    """`cache` with row b's new entries written at positions start[b] .. start[b] + T - 1.

    Positions outside [0, S) are dropped, never clamped or wrapped.
    """
    batch, num_new = new.shape[:2]
    positions = start[:, None] + jnp.arange(num_new)[None, :]  # [B, T]
    positions = jnp.where(positions < 0, cache.shape[1], positions)  # negative would wrap: send past the end
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], positions.shape)  # [B, T]
    return cache.at[rows, positions].set(new.astype(cache.dtype), mode="drop")
