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

A serving engine keeps its attention caches in pages instead (`PagedCache`; docs/MTP_SPEC.md "Paged caches"):
per layer a pool of `num_pages` pages of `page_size` positions shared by all rows, and per row a block table
(int32 [B, W]) naming the page that holds each run of `page_size` positions, one table for all of a row's
caches (the main model's and every MTP module's). The table is not part of the state: the host allocates
pages and binds the table it chose for a call (`bind_pages`), whose width W (in pages) is also how much of
each row a call reads. Recurrent caches stay per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from mtp_jax import cpu_extension
from mtp_jax.config import ModelConfig
from pallas_kernels.attention_reference import gather_pages


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


@struct.dataclass
class PagedCache:
    """One attention layer's cache in pages: `pool` is the layer's cache class (`KVCache`, `MLACache`) whose
    arrays are pools [N, P, ...] (N pages of P positions, no row axis), and `block_table` (int32 [B, W], bound
    for a call by `bind_pages`, else None) gives row b's position s in page `block_table[b, s // P]`, offset
    `s % P`. Unused table entries hold a sentinel id >= N: writes there are dropped and reads give zeros, so a
    row never touches a page it does not own; reads past a row's length are masked by the attention, as in a
    dense cache. `write` and `view` give the layers the dense cache's interface."""

    pool: Any
    block_table: jax.Array | None = None

    @property
    def page_size(self) -> int:
        return jax.tree.leaves(self.pool)[0].shape[1]

    def write(self, positions: Int[Array, "B T"], *new: jax.Array) -> PagedCache:
        """The cache with `new` (the pool class's `write` arguments, each [B, T, ...]) at `positions` (int32
        [B, T]) of each row, through the block table; positions outside the table's W x P, or in a sentinel
        entry, are dropped. A bf16 / fp16 / fp8 pool on the CPU is written in place (`cpu_extension.write_rows`, as
        `write_at`): XLA:CPU's scatter would convert all of it, every layer and step (a serving step grew with
        max_batch x max_length: 29-33 ms against 2.9 at 1024 positions, demo bf16, 8 rows; docs/benchmarks.md)."""
        table, size = self.block_table, self.page_size
        num_pages = jax.tree.leaves(self.pool)[0].shape[0]
        positions = _widened(positions)
        index = jnp.clip(positions // size, 0, table.shape[1] - 1)
        page = jnp.take_along_axis(table, index, axis=1)  # [B, T]
        outside = (positions < 0) | (positions >= table.shape[1] * size) | (page >= num_pages) | (page < 0)
        flat = jnp.where(outside, num_pages * size, page * size + positions % size).reshape(-1)  # [B T]

        def scatter(pool: jax.Array, values: jax.Array) -> jax.Array:
            values = values.reshape(flat.shape[0], *values.shape[2:]).astype(pool.dtype)
            if cpu_extension.moves_rows(pool):  # in place (XLA:CPU would convert the whole pool to float32 and back)
                return cpu_extension.write_rows(pool, flat, values)
            rows = pool.reshape(num_pages * size, *pool.shape[2:])
            return rows.at[flat].set(values, mode="drop").reshape(pool.shape)

        fields = [f.name for f in dataclasses.fields(self.pool)]
        arrays = {name: scatter(getattr(self.pool, name), value) for name, value in zip(fields, new, strict=True)}
        return self.replace(pool=type(self.pool)(**arrays))

    def view(self):
        """The pool class's dense cache of the bound rows: arrays [B, W x P, ...], row b's pages in table order
        (sentinel pages read as zeros): what the layer's attention reads."""
        return jax.tree.map(self._gather, self.pool)

    def _gather(self, pool: jax.Array) -> jax.Array:
        if not cpu_extension.moves_rows(pool):
            return gather_pages(pool, self.block_table)
        batch, width = self.block_table.shape  # a page per row: one memcpy each (XLA:CPU: element by element)
        pages = cpu_extension.gather_rows(pool, self.block_table.reshape(-1))  # [B W, P, ...]
        return pages.reshape(batch, width * pool.shape[1], *pool.shape[2:])


def _is_paged(node) -> bool:
    return isinstance(node, PagedCache) or (_is_stacked(node) and isinstance(node.layers, PagedCache))


def dense_view(cache):
    """What an attention layer reads of its cache: a dense cache as it is, a `PagedCache` as its bound rows'
    `view` (arrays [B, W x P, ...])."""
    return cache.view() if isinstance(cache, PagedCache) else cache


@dataclasses.dataclass(frozen=True)
class PageLayout:
    """How a state's attention caches are paged: `num_pages` pages of `page_size` positions per layer;
    `pools` False builds a row state's caches without pools (None), to borrow the engine's (`share_pools`)."""

    num_pages: int
    page_size: int
    pools: bool = True


def init_cache(init: Callable[[int, int], Any], batch_size: int, max_length: int, pages: PageLayout | None):
    """`init(batch_size, max_length)` (a model's or an MTP module's `init_cache`), or with `pages` the same
    layers paged (`init_paged`)."""
    return init(batch_size, max_length) if pages is None else init_paged(init, batch_size, pages)


def init_paged(init: Callable[[int, int], Any], batch_size: int, pages: PageLayout):
    """A cache pytree in pages: `init(batch_size, max_length)` is the dense cache's builder; every attention
    layer's cache becomes a `PagedCache` of zero pools [N, P, ...] (unbound; no pools without `pages.pools`),
    every recurrent one stays per row, [B, ...]. Nothing of the dense shapes is allocated."""
    check_shape(pages.num_pages, pages.page_size)
    pools = jax.eval_shape(lambda: init(pages.num_pages, pages.page_size))
    rows = jax.eval_shape(lambda: init(batch_size, 1))
    zeros = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, x.dtype))

    def pick(pool, row):
        inner = pool.layers if _is_stacked(pool) else pool
        if _is_recurrent(inner):
            return zeros(row)
        paged = PagedCache(pool=zeros(inner) if pages.pools else None)
        return StackedCache(paged) if _is_stacked(pool) else paged

    is_node = lambda x: _is_stacked(x) or hasattr(x, "LOGICAL_AXES")  # noqa: E731
    return jax.tree.map(pick, pools, rows, is_leaf=is_node)


def bind_pages(cache, block_table: jax.Array | None):
    """`cache` with every `PagedCache` bound to `block_table` (int32 [B, W]; None unbinds): before a forward
    reads or writes it. A `StackedCache`'s layers each get the same table."""

    def bind(node):
        if _is_stacked(node):
            layers = node.layers
            table = (
                None
                if block_table is None
                else jnp.broadcast_to(block_table, (_num_layers(layers), *block_table.shape))
            )
            return StackedCache(layers.replace(block_table=table))
        return node.replace(block_table=block_table)

    return jax.tree.map(lambda n: bind(n) if _is_paged(n) else n, cache, is_leaf=_is_paged)


def _num_layers(paged: PagedCache) -> int:
    return jax.tree.leaves(paged.pool)[0].shape[0]


def share_pools(cache, source):
    """`cache` with each `PagedCache`'s pool taken from the same node of `source` (a cache pytree of the same
    layers; `cache`'s own pools may be None): how a row state borrows the engine's pools for a prefill and
    gives them back. Other nodes are `cache`'s."""

    def take(node, other):
        if not _is_paged(node):
            return node
        if _is_stacked(node):
            return StackedCache(node.layers.replace(pool=other.layers.pool))
        return node.replace(pool=other.pool)

    return jax.tree.map(take, cache, source, is_leaf=_is_paged)


def without_pools(cache):
    """`cache` with every `PagedCache`'s pool dropped (None): a row state that holds no pages itself."""

    def drop(node):
        if _is_stacked(node):
            return StackedCache(node.layers.replace(pool=None))
        return node.replace(pool=None)

    return jax.tree.map(lambda n: drop(n) if _is_paged(n) else n, cache, is_leaf=_is_paged)


def check_shape(batch_size: int, max_length: int) -> None:
    """Raises ValueError unless both are ints >= 1 (a cache's batch size and capacity S)."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


SELECT_WRITES = 16  # `write_at` on the CPU backend: narrow floats written with one select up to this many tokens


def _select_write(cache: jax.Array, new: jax.Array, positions: jax.Array) -> jax.Array:
    """`write_at` as one select over the cache (CPU backend without the extension's in-place write, narrow
    floats, T <= SELECT_WRITES).

    XLA:CPU scatters a half-precision or FP8 array by converting all of it to float32 and back (two
    float32 copies of the layer's cache per write; measured 2026-12-03: with the attention's own copies,
    half of a bf16 decode step's non-matmul time at batch 8); one select, fused into one pass in the
    cache's own dtype, costs less for a decode or verify step's few tokens. One select, not one per token:
    XLA:CPU runs a chain of T selects at up to 14x the time of one (T = 4 into a [8, 2048, 8, 128] cache:
    9.8 vs 0.7 ms; `docs/benchmarks.md`, 2026-12-06).
    """
    batch, num_new = positions.shape
    trailing = (1,) * (cache.ndim - 2)
    if num_new == 1:  # a decode step: the token broadcast along S, no gather
        hit = (jnp.arange(cache.shape[1])[None, :] == positions).reshape(batch, -1, *trailing)
        return jnp.where(hit, new, cache)
    hit = jnp.arange(cache.shape[1])[None, None, :] == positions[:, :, None]  # [B, T, S]
    # the last token written at each position (a position written twice keeps the later one), -1: none
    source = jnp.max(jnp.where(hit, jnp.arange(num_new)[None, :, None], -1), axis=1).reshape(batch, -1, *trailing)
    # `new` is computed before the select, behind a conditional (XLA fuses nothing across one; XLA:CPU
    # drops optimization barriers before fusing): fused into the gather, new's producers (the rotary
    # embedding's sin and cos) would run once per element of the cache, 3-7x the write's time. The
    # predicate is always true (whatever the positions, INT32_MIN included), but not known to be at
    # compile time. On a mesh it costs one scalar all-reduce (the predicate is replicated).
    always = jnp.maximum(positions[0, 0], -1) > jnp.iinfo(jnp.int32).min
    new = jax.lax.cond(always, lambda x: x, jnp.zeros_like, new)
    taken = jnp.take_along_axis(new, jnp.maximum(source, 0), axis=1, mode="clip")  # [B, S, ...]
    return jnp.where(source >= 0, taken, cache)


def _widened(positions: jax.Array) -> jax.Array:
    """Positions of an integer type narrower than int32 as int32: compared with a capacity that type cannot
    hold (int8 against 200), jnp would cast the capacity into the narrow type instead."""
    return positions.astype(jnp.int32) if jnp.iinfo(positions.dtype).bits < 32 else positions


def write_at(cache: Float[Array, "B S ..."], new: Float[Array, "B T ..."], positions: Int[Array, "B T"]) -> jax.Array:
    """`cache` with `new[b, t]` written at position `positions[b, t]` of row b (a position written twice
    keeps the later token).

    Positions outside [0, S) are dropped, never clamped or wrapped. A bf16 / fp16 / fp8 cache on the CPU
    is written in place by the extension's `cpu_extension.write_rows` where `cpu_extension.moves_rows` says so (XLA:CPU
    would convert the whole cache to float32 and back); else by one select (`_select_write`) or XLA's scatter.
    """
    new = new.astype(cache.dtype)
    batch, length = cache.shape[:2]
    positions = _widened(positions)
    if positions.shape[1] == 0:  # no new tokens (XLA's select below would reduce over none)
        return cache
    positions = jnp.where(positions < 0, length, positions)  # negative would wrap: send past the end
    if cpu_extension.moves_rows(cache):  # in place: position p of row b is row b S + p of the cache's B x S
        flat = jnp.where(positions < length, jnp.arange(batch)[:, None] * length + positions, batch * length)
        rows = jnp.broadcast_to(new, (batch, positions.shape[1], *cache.shape[2:]))  # as XLA's paths broadcast it
        return cpu_extension.write_rows(cache, flat.reshape(-1), rows.reshape(flat.size, *cache.shape[2:]))
    narrow = jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize < 4
    if narrow and new.shape[1] <= SELECT_WRITES and jax.default_backend() == "cpu":
        return _select_write(cache, new, positions)
    # Per row (vmap: the scatter's batch dimension), so a batch sharded over devices scatters locally.
    return jax.vmap(lambda c, n, p: c.at[p].set(n, mode="drop"))(cache, new, positions)


def logical_axes(cache):
    """The cache pytree's logical axes (`mtp_jax.sharding`): the same tree with a `PartitionSpec` of
    axis names per array, from each cache class's `LOGICAL_AXES`; a `StackedCache` prefixes "layers"."""

    def axes(node):
        if _is_stacked(node):
            return StackedCache(jax.tree.map(lambda spec: P("layers", *spec), logical_axes(node.layers)))
        if isinstance(node, PagedCache):  # pools have no rows: whole on every row's device, heads as the layer's
            pool = None if node.pool is None else jax.tree.map(lambda spec: P(None, None, *spec[2:]), axes(node.pool))
            return PagedCache(pool=pool, block_table=None if node.block_table is None else P("batch", None))
        return type(node)(**{f.name: node.LOGICAL_AXES[f.name] for f in dataclasses.fields(node)})

    return jax.tree.map(axes, cache, is_leaf=lambda x: _is_stacked(x) or _is_paged(x) or hasattr(x, "LOGICAL_AXES"))


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
