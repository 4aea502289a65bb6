"""Per-layer, preallocated, fixed-shape caches: the model's only state between forwards.

The model contract (`docs/MTP_SPEC.md`, "The main model's cache"; STYLE point 14): a forward takes
tokens, their absolute positions and a per-layer cache pytree, writes the new entries at those
positions and returns the new cache. It never decides lengths. Lengths live in the decode state
(`engine.DecodeState.lengths`, the committed tokens L_b) and nowhere else: at a step boundary
every cache of row b holds positions `0 .. L_b - 2`, so advancing is committing tokens and rolling
back is nothing at all (for KV entries; a recurrent state is selected, see below). Entries past a row's
positions are stale: invisible to attention (a query at position p sees cache positions <= p),
overwritten later, and NaN there changes nothing.

Writes are scatters with out-of-range indices dropped, so no write can land outside `[0, S)` or
clobber a live entry (JAX would clamp a `dynamic_update_slice` start instead).

`KVCache` is the grouped-query attention layer's cache (keys and values); other attention types
bring their own (`mtp_jax.layers.mla.MLACache`: compressed latent and rope key). A model's cache is
the tuple of its layers' caches (`Transformer.init_cache`), every array [B, S, ...]; with
`ModelConfig.scan_layers` it holds one `StackedCache` per run of layers of one kind instead, its
arrays [n, B, S, ...] with a leading layer axis. `fill_stale` and `capacity` work on any of them.

A recurrent layer (Qwen3.5's Gated DeltaNet, `mtp_jax.layers.gated_deltanet`) keeps no positions but a
per-row state summarising them, `RecurrentCache`: at a step boundary the state after positions 0 .. L_b - 2,
like the KV entries. A state that absorbed a rejected draft cannot be hidden by a length, so a verify
forward returns `RecurrentCandidates` instead, the state after each of its T new tokens, and the commit
keeps per row the one after its last committed token (`settle`, a gather inside the step; docs/MTP_SPEC.md
"Recurrent layers").
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
class RecurrentCache:
    """One Gated DeltaNet layer's cache: `state` [B, Hv, Dk, Dv] float32 (the delta rule's memory) and `conv`
    [B, W-1, C] (the causal conv's last W-1 inputs), both after the row's positions 0 .. L_b - 2."""

    state: jax.Array
    conv: jax.Array

    LOGICAL_AXES: ClassVar[dict[str, P]] = {
        "state": P("batch", "heads", None, None),  # value heads, split like the layer's (tensor parallelism)
        "conv": P("batch", None, None),
    }

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, dtype=None) -> RecurrentCache:
        """The state of an empty prefix: zeros. Raises ValueError for a batch size below 1."""
        check_shape(batch_size, 1)
        c = config
        dtype = c.compute_dtype if dtype is None else dtype
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        channels = 2 * hk * dk + hv * dv  # the conv runs over in_proj_qkv's output
        state = (batch_size, hv, dk, dv)
        return cls(
            state=jnp.zeros(state, jnp.float32),
            conv=jnp.zeros((batch_size, c.linear_conv_kernel_dim - 1, channels), dtype),
        )


@struct.dataclass
class RecurrentCandidates:
    """What a forward of T tokens with `keep_candidates` leaves of a Gated DeltaNet layer: `states`
    [B, T+1, Hv, Dk, Dv] (index n: the state after the first n new tokens, 0 the one before) and `conv`
    [B, W-1+T, C] (the old window, then the T new conv inputs). `select(n)` is the `RecurrentCache` after
    n of them."""

    states: jax.Array
    conv: jax.Array

    LOGICAL_AXES: ClassVar[dict[str, P]] = {
        "states": P("batch", None, "heads", None, None),
        "conv": P("batch", None, None),
    }

    def select(self, num: Int[Array, " B"]) -> RecurrentCache:
        """The cache after row b's first `num[b]` new tokens (int32 [B] in [0, T]), by gathers."""
        width = self.conv.shape[1] - (self.states.shape[1] - 1)  # W - 1
        state = jnp.take_along_axis(self.states, num[:, None, None, None, None], axis=1)[:, 0]
        return RecurrentCache(state=state, conv=window_after(self.conv, num, width))


def window_after(full: Float[Array, "B L C"], n: Int[Array, " B"], size: int) -> Float[Array, "B size C"]:
    """full[b, n[b] : n[b] + size] per row: a causal conv's window after the first n[b] new tokens when `full` is
    the old window followed by the new inputs (L = size + T, n in [0, T], size = W - 1). Indices are clamped."""
    return jax.vmap(lambda row, i: jax.lax.dynamic_slice_in_dim(row, i, size, axis=0))(full, n)


def _is_recurrent(node) -> bool:
    return isinstance(node, RecurrentCache | RecurrentCandidates)


def settle(cache, num: Int[Array, " B"]):
    """`cache` (any cache pytree) with every `RecurrentCandidates` replaced by its state after row b's first
    `num[b]` new tokens (int32 [B]); every other cache as it is (its length is the caller's). The commit of a
    speculative step: `num` is what each row committed (0 for a finished row keeps its state)."""

    def one(node):
        if _is_stacked(node):
            return StackedCache(jax.vmap(lambda layer: settle(layer, num))(node.layers))
        return node.select(num) if isinstance(node, RecurrentCandidates) else node

    return jax.tree.map(one, cache, is_leaf=lambda x: _is_stacked(x) or _is_recurrent(x))


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
    """S, the capacity in tokens of a cache pytree (arrays [B, S, ...], in a `StackedCache` [n, B, S, ...]);
    recurrent caches hold no positions and do not count. Raises ValueError when only they are left."""
    for node in jax.tree.leaves(cache, is_leaf=lambda x: _is_stacked(x) or _is_recurrent(x)):
        if _is_stacked(node):
            if not _is_recurrent(node.layers):
                return jax.tree.leaves(node.layers)[0].shape[2]
        elif not _is_recurrent(node):
            return node.shape[1]
    raise ValueError("the cache holds no positions (recurrent states only): it has no capacity")


def fill_stale(cache, lengths: Int[Array, " B"], value: float):
    """`cache` (any cache pytree, `StackedCache`s included) with every entry at or past row b's
    `lengths[b]` (int32 [B]) set to `value`.

    Tests: NaN there must change nothing.
    """

    def fill(x):
        if _is_stacked(x):  # every layer of the stack alike
            return StackedCache(jax.vmap(lambda layer: fill_stale(layer, lengths, value))(x.layers))
        if _is_recurrent(x):  # a state of positions, none of them stale
            return x
        stale = jnp.arange(x.shape[1])[None, :] >= lengths[:, None]  # [B, S]
        return jnp.where(stale.reshape(stale.shape + (1,) * (x.ndim - 2)), value, x)

    return jax.tree.map(fill, cache, is_leaf=lambda x: _is_stacked(x) or _is_recurrent(x))
