"""Per-layer, preallocated, fixed-shape caches: the model's only state between forwards.

The model contract (`docs/MTP_SPEC.md`, "The main model's cache"; STYLE point 14): a forward takes
tokens, their absolute positions and a per-layer cache pytree, writes the new entries at those
positions and returns the new cache. It never decides lengths. Lengths live in the decode state
(`engine.DecodeState.lengths`, the committed tokens L_b) and nowhere else: at a step boundary
every cache of row b holds positions `0 .. L_b - 2`, so advancing is committing tokens and rolling
back is nothing at all. Entries past a row's positions are stale: invisible to attention (a query
at position p sees cache positions <= p), overwritten later, and NaN there changes nothing.

Writes are scatters with out-of-range indices dropped, so no write can land outside `[0, S)` or
clobber a live entry (JAX would clamp a `dynamic_update_slice` start instead).

`KVCache` is the grouped-query attention layer's cache (keys and values); other attention types
bring their own (`mtp_jax.layers.mla.MLACache`: compressed latent and rope key). A model's cache is
the tuple of its layers' caches (`Transformer.init_cache`), every array [B, S, ...]; with
`ModelConfig.scan_layers` it holds one `StackedCache` per run of layers of one kind instead, its
arrays [n, B, S, ...] with a leading layer axis. `fill_stale` and `capacity` work on any of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from mtp_jax.config import ModelConfig


@struct.dataclass
class KVCache:
    """One grouped-query attention layer's cache: `k`, `v` of shape [B, S, G, D]."""

    k: jax.Array
    v: jax.Array

    # `mtp_jax.sharding` names of each array's axes (see `logical_axes`).
    LOGICAL_AXES: ClassVar[dict[str, P]] = {
        "k": P("batch", "cache_sequence", "kv_heads", "head_dim"),
        "v": P("batch", "cache_sequence", "kv_heads", "head_dim"),
    }

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
        """Zeros of shape [batch_size, max_length, G, D] in `dtype` (default the compute dtype).

        Raises ValueError for a batch size or capacity below 1.
        """
        check_shape(batch_size, max_length)
        dtype = config.compute_dtype if dtype is None else dtype
        shape = (batch_size, max_length, config.num_key_value_heads, config.resolved_head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def write(self, positions: Int[Array, "B T"], k: Float[Array, "B T G D"], v: Float[Array, "B T G D"]) -> KVCache:
        """The cache with the new keys and values at `positions` (out of range: dropped)."""
        return KVCache(k=write_at(self.k, k, positions), v=write_at(self.v, v, positions))


@struct.dataclass
class StackedCache:
    """The caches of n consecutive layers of one kind (`mtp_jax.layers.decoder.DecoderStack`), stacked.

    `layers` is one layer's cache (`KVCache`, `MLACache`) whose every array has a leading layer axis,
    [n, B, S, ...]; slice i is the stack's layer i's cache.
    """

    layers: Any


def _is_stacked(node) -> bool:
    return isinstance(node, StackedCache)


def check_shape(batch_size: int, max_length: int) -> None:
    """Raises ValueError unless both are ints >= 1 (a cache's batch size and capacity S)."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def write_at(cache: Float[Array, "B S ..."], new: Float[Array, "B T ..."], positions: Int[Array, "B T"]) -> jax.Array:
    """`cache` with `new[b, t]` written at position `positions[b, t]` of row b.

    Positions outside [0, S) are dropped, never clamped or wrapped.
    """
    positions = jnp.where(positions < 0, cache.shape[1], positions)  # negative would wrap: send past the end
    # Per row (vmap: the scatter's batch dimension), so a batch sharded over devices scatters locally.
    return jax.vmap(lambda c, n, p: c.at[p].set(n, mode="drop"))(cache, new.astype(cache.dtype), positions)


def logical_axes(cache):
    """The cache pytree's logical axes (`mtp_jax.sharding`): the same tree with a `PartitionSpec` of
    axis names per array, from each cache class's `LOGICAL_AXES`; a `StackedCache` prefixes "layers"."""

    def axes(node):
        if _is_stacked(node):
            return StackedCache(jax.tree.map(lambda spec: P("layers", *spec), logical_axes(node.layers)))
        return type(node)(**{f.name: node.LOGICAL_AXES[f.name] for f in dataclasses.fields(node)})

    return jax.tree.map(axes, cache, is_leaf=lambda x: _is_stacked(x) or hasattr(x, "LOGICAL_AXES"))


def capacity(cache) -> int:
    """S, the capacity in tokens of a cache pytree (arrays [B, S, ...], in a `StackedCache` [n, B, S, ...])."""
    first = jax.tree.leaves(cache, is_leaf=_is_stacked)[0]
    return jax.tree.leaves(first.layers)[0].shape[2] if _is_stacked(first) else first.shape[1]


def fill_stale(cache, lengths: Int[Array, " B"], value: float):
    """`cache` (any cache pytree, `StackedCache`s included) with every entry at or past row b's
    `lengths[b]` (int32 [B]) set to `value`.

    Tests: NaN there must change nothing.
    """

    def fill(x):
        if _is_stacked(x):  # every layer of the stack alike
            return StackedCache(jax.vmap(lambda layer: fill_stale(layer, lengths, value))(x.layers))
        stale = jnp.arange(x.shape[1])[None, :] >= lengths[:, None]  # [B, S]
        return jnp.where(stale.reshape(stale.shape + (1,) * (x.ndim - 2)), value, x)

    return jax.tree.map(fill, cache, is_leaf=_is_stacked)
