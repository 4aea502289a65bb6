"""Triton backend of `verify_attention`: one split-K pass of flash-decoding over the KV cache.

One program per (row b, KV head g, split): it loads the [M, D] query tile of KV head g (all T new
tokens x group query heads, padded to M rows), then streams its share of row b's cache in
[block_s, D] blocks of K and V, each read once from HBM, with an online softmax in float32. It
writes unnormalised partials (acc [M, D], running max [M], running sum of exp [M]) that
`verify_attention._combine` merges across splits (Dao et al., "Flash-Decoding", 2023).

Lowered through Pallas' Triton backend (`jax.experimental.pallas.triton`): runs on recent NVIDIA
GPUs and, with `interpret=True`, on any backend (the tests run it on CPU). The Mosaic GPU backend
would be a sibling module with the same `partials` signature.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int


def _kernel(
    lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    acc_ref,
    max_ref,
    sum_ref,
    *,
    scale: float,
    block_s: int,
    num_queries: int,
    group: int,
    num_splits: int,
    precision,
):
    """Refs: lengths [] int32, q [M, D], k and v [S, D]; outputs acc [M, D], max [M], sum [M] float32.

    Query row r of the tile is new token t = r // group; it sees cache positions
    `< min(length - T + t + 1, S)`. Rows past T * group are padding and see nothing. `length` may
    exceed S (a verify window that reaches past the capacity: its writes there were dropped): the
    causal limit is aligned to the unclamped length, only the reads stop at S.
    """
    rows = q_ref.shape[0]
    split = pl.program_id(2)
    length = lengths_ref[...]  # valid entries of this row including the T new ones; may be < 0 or > S
    stored = jnp.clip(length, 0, k_ref.shape[0])  # entries that exist in the cache
    num_blocks = pl.cdiv(stored, block_s)
    blocks_per_split = pl.cdiv(num_blocks, num_splits)
    first = split * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, num_blocks)

    row = jnp.arange(rows, dtype=jnp.int32)  # [M]
    causal = length - num_queries + lax.div(row, group) + 1  # [M]
    limit = jnp.where(row < num_queries * group, jnp.minimum(causal, stored), 0)  # [M]
    q = q_ref[...]  # [M, D]

    def body(block, carry):
        acc, row_max, row_sum = carry  # [M, D], [M], [M]
        pos = block * block_s + jnp.arange(block_s, dtype=jnp.int32)  # [block_s]
        live = (pos < stored)[:, None]  # [block_s, 1]: never read stale or out-of-range slots
        k = pltriton.load(k_ref.at[pl.ds(block * block_s, block_s), :], mask=live, other=0)  # [block_s, D]
        v = pltriton.load(v_ref.at[pl.ds(block * block_s, block_s), :], mask=live, other=0)  # [block_s, D]
        s = pltriton.dot(q, k, trans_b=True, precision=precision) * scale  # [M, block_s] float32
        s = jnp.where(pos[None, :] < limit[:, None], s, -jnp.inf)
        return online_softmax_step(s, v, acc, row_max, row_sum, precision)

    accumulate_blocks(first, last, body, acc_ref, max_ref, sum_ref)


def accumulate_blocks(first, last, body, acc_ref, max_ref, sum_ref) -> None:
    """`body(block, (acc, row_max, row_sum))` (returning them updated, `online_softmax_step`) over the blocks
    first .. last - 1 from an empty softmax; the partials go to `acc_ref` [M, Dv], `max_ref` and `sum_ref` [M]."""
    rows = acc_ref.shape[0]
    init = (
        jnp.zeros(acc_ref.shape, jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, row_max, row_sum = lax.fori_loop(first, last, body, init)
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def online_softmax_step(s, v, acc, row_max, row_sum, precision):
    """One block of the online softmax: scores `s` [M, n] (float32, masked entries -inf) against values
    `v` [n, Dv] folded into the running `acc` [M, Dv], `row_max` [M] and `row_sum` [M]; returns all three."""
    next_max = jnp.maximum(row_max, jnp.max(s, axis=1))  # [M]; -inf while a row has seen nothing
    shift = jnp.where(next_max == -jnp.inf, 0.0, next_max)  # keeps exp() away from -inf - -inf
    p = jnp.exp(s - shift[:, None])  # [M, n]; masked entries are exactly 0
    correction = jnp.exp(row_max - shift)  # [M]
    row_sum = correction * row_sum + jnp.sum(p, axis=1)
    acc = correction[:, None] * acc + pltriton.dot(p.astype(v.dtype), v, precision=precision)  # [M, Dv]
    return acc, next_max, row_sum


def partials(
    q_tiles: Float[Array, "B G M D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G D"],
    lengths: Int[Array, " B"],
    *,
    num_queries: int,
    group: int,
    scale: float,
    block_s: int,
    num_splits: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split-K partials: acc [B, G, splits, M, D], row max and row sum [B, G, splits, M], all float32.

    `q_tiles[b, g]` holds row b's queries of KV head g, row r = t * group + j (query head
    g * group + j of new token t), zero-padded to M rows (a power of two >= 16, as `tl.dot` needs).
    Row b's blocks `[0, cdiv(lengths[b], block_s))` are dealt out evenly to the splits, so the work
    per program follows the row's length, not S. K and V are read in place from their [B, S, G, D]
    layout (no transpose): each [block_s, D] block is read once per KV head.
    """
    batch, kv_heads, rows, head_dim = q_tiles.shape
    cache_len = k.shape[1]
    kernel = functools.partial(
        _kernel,
        scale=scale,
        block_s=block_s,
        num_queries=num_queries,
        group=group,
        num_splits=num_splits,
        precision=lax.Precision.HIGHEST if q_tiles.dtype == jnp.float32 else None,
    )
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, g, s: (b,)),  # lengths -> []
            pl.BlockSpec((None, None, rows, head_dim), lambda b, g, s: (b, g, 0, 0)),  # q -> [M, D]
            pl.BlockSpec((None, cache_len, None, head_dim), lambda b, g, s: (b, 0, g, 0)),  # k -> [S, D]
            pl.BlockSpec((None, cache_len, None, head_dim), lambda b, g, s: (b, 0, g, 0)),  # v -> [S, D]
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, head_dim), lambda b, g, s: (b, g, s, 0, 0)),  # acc -> [M, D]
            pl.BlockSpec((None, None, None, rows), lambda b, g, s: (b, g, s, 0)),  # max -> [M]
            pl.BlockSpec((None, None, None, rows), lambda b, g, s: (b, g, s, 0)),  # sum -> [M]
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, head_dim), f32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), f32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), f32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="verify_attention",
    )(lengths, q_tiles, k, v)
