"""Verify attention over a paged KV cache: T new queries per row against pages listed in a block table.

Layout (vLLM's PagedAttention, Kwon et al., SOSP 2023): a layer's cache is one pool of pages shared
by all rows, `k_pages` [N, P, G, D] and `v_pages` [N, P, G, Dv] (N pages of P tokens), and row b
owns the pages listed in `block_table[b]` (int32 [B, W]): logical position s of row b lives in page
`block_table[b, s // P]` at offset `s % P`, so a row holds at most W * P positions. Unused table
entries hold a sentinel page id >= N. `lengths` follows `verify_attention_reference`'s convention
(the T new tokens included; query t of row b sees positions `< lengths[b] - T + t + 1`). Nothing at
or past `lengths[b]` is trusted: pages a row does not own, and its own pages past its length, may
hold anything, NaN included. Values may have another head dim than keys, and keys may come in two
pools read side by side (`k_rope_pages` [N, P, G, R], q then [B, T, H, D + R]: the score is
`q[..., :D] . k + q[..., D:] . k_rope`), and the values may be the key pages themselves (`v_pages`
None): DeepSeek MLA's absorbed attention (arXiv 2405.04434 §2.1.2) is G = 1, queries [q_nope W_UK,
q_rope] of C + R, the latent pool [N, P, 1, C] as keys and values, the rope-key pool [N, P, 1, R] as
the second key pool, read in place (no concatenated copy of the pools) and each latent page loaded
once for both its scores and its values.

`paged_attention_reference` gathers each row's pages into a dense [B, W * P, G, D] cache and applies
`verify_attention_reference`. `paged_verify_attention` is the GPU kernel (Pallas, Triton lowering):
one page is one K/V block, its id loaded from the block table inside the kernel, so only the pages
of a row up to its length are read; all T x H/G queries of one KV head share one tile, and a row's
pages are dealt out to splits (flash-decoding) merged by `verify_attention`'s log-sum-exp combine.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from pallas_kernels.attention_reference import gather_pages, verify_attention_reference
from pallas_kernels.verify_attention import (
    DTYPES,
    MAX_HEAD_DIM,
    MAX_QUERY_ROWS,
    SHARED_MEMORY_BUDGET,
    _combine,
    _is_power_of_two,
)
from pallas_kernels.verify_attention_triton import accumulate_blocks, online_softmax_step

__all__ = ["PagedAttentionConfig", "paged_attention_reference", "paged_verify_attention", "supports_paged"]

MIN_PAGE_SIZE = 16  # a page is one block of `tl.dot`, whose operands need >= 16 rows
# The dense kernel's largest tile (MAX_QUERY_ROWS x MAX_HEAD_DIM): the [M, D] query tile and the
# [M, Dv] float32 accumulator must each fit in it.
MAX_TILE_ELEMENTS = MAX_QUERY_ROWS * MAX_HEAD_DIM


def _check_operands(q, k_pages, v_pages, block_table, lengths, k_rope_pages=None) -> None:
    """Raise ValueError, naming the argument, unless the operands have the documented shapes and dtypes."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
    if k_pages.ndim != 4 or min(k_pages.shape[:3]) < 1:
        raise ValueError(f"k_pages must be [N, P, G, D] with N, P, G >= 1, got shape {k_pages.shape}")
    if k_rope_pages is None:
        if k_pages.shape[3] != q.shape[3]:
            raise ValueError(f"k_pages' head dim must be q's D = {q.shape[3]}, got shape {k_pages.shape}")
    elif k_rope_pages.ndim != 4 or k_rope_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"k_rope_pages must be [N, P, G, R] with k_pages' N, P, G, got shape {k_rope_pages.shape}")
    elif k_pages.shape[3] + k_rope_pages.shape[3] != q.shape[3]:
        dims = f"{k_pages.shape[3]} + {k_rope_pages.shape[3]}"
        raise ValueError(f"q's head dim must be k_pages' D + k_rope_pages' R = {dims}, got shape {q.shape}")
    if v_pages is not None and (v_pages.ndim != 4 or v_pages.shape[:3] != k_pages.shape[:3]):
        raise ValueError(f"v_pages must be [N, P, G, Dv] with k_pages' N, P, G, got shape {v_pages.shape}")
    batch, _, heads, _ = q.shape
    if heads % k_pages.shape[2]:
        raise ValueError(f"q's H = {heads} is not a multiple of k_pages' G = {k_pages.shape[2]}")
    if block_table.ndim != 2 or block_table.dtype != jnp.int32 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be int32 [B, W] with q's B = {batch}, got {block_table.dtype} {block_table.shape}"
        )
    if block_table.shape[1] < 1:
        raise ValueError(f"block_table must list at least one page per row, got shape {block_table.shape}")
    if lengths.shape != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [B] with q's B = {batch}, got {lengths.dtype} {lengths.shape}")


def paged_attention_reference(
    q: Float[Array, "B T H Dq"],
    k_pages: Float[Array, "N P G D"],
    v_pages: Float[Array, "N P G Dv"] | None,
    block_table: Int[Array, "B W"],
    lengths: Int[Array, " B"],
    *,
    k_rope_pages: Float[Array, "N P G R"] | None = None,
    scale: float | None = None,
) -> Float[Array, "B T H Dv"]:
    """Causal grouped-query attention of T new queries per row against a paged cache, in plain jnp.

    Equals `verify_attention_reference` on the dense cache [B, W * P, G, Dq] that row b's pages form
    in table order (sentinel ids read as zeros; positions at or past `lengths[b]` are masked, so
    whatever they hold, NaN included, cannot leak), its keys `[k_pages, k_rope_pages]` joined along
    the head dim and its values `v_pages` (or `k_pages` when `v_pages` is None).

    Args:
      q: queries of shape [B, T, H, Dq], Dq = D (+ R with `k_rope_pages`).
      k_pages: key pages of shape [N, P, G, D], H a multiple of G.
      v_pages: value pages of shape [N, P, G, Dv]; None: the values are `k_pages` (Dv = D; MLA's latent).
      block_table: int32 [B, W], row b's page ids in order; unused entries a sentinel id >= N.
      lengths: int [B], valid entries per row including the T new tokens.
      k_rope_pages: optional second key pool [N, P, G, R] (MLA's rope keys), scored against q[..., D:].
      scale: softmax scale, default 1/sqrt(Dq).

    Returns:
      [B, T, H, Dv] in q's dtype; scores, softmax and the weighted sum accumulate in float32 (half
      precision: `pallas_kernels.attention_reference`'s "Precision").

    Raises:
      ValueError: an operand of the wrong rank, shape or dtype (the message names it).
    """
    _check_operands(q, k_pages, v_pages, block_table, lengths, k_rope_pages)
    k = gather_pages(k_pages, block_table)  # [B, W * P, G, D]
    v = k if v_pages is None else gather_pages(v_pages, block_table)  # [B, W * P, G, Dv]
    if k_rope_pages is not None:
        k = jnp.concatenate([k, gather_pages(k_rope_pages, block_table)], axis=-1)  # [B, W * P, G, D + R]
    return verify_attention_reference(q, k, v, lengths, scale=scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedAttentionConfig:
    """Static tuning parameters of `paged_verify_attention` (hashable, so usable as a jit static arg).

    A K/V block is one page, so there is no block size. The fields mean what they mean in
    `VerifyAttentionConfig`: max_splits (most splits of one row's pages; the grid is (B, G,
    splits)), target_programs (split until B * G * splits reaches this many programs),
    min_split_len (never give a split fewer than this many positions, rounded up to whole pages),
    num_warps and num_stages (Triton launch parameters; `pipeline_stages` lowers the depth where the
    K and V pages would overflow shared memory).
    """

    max_splits: int = 64
    target_programs: int = 1024
    min_split_len: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("max_splits", "target_programs", "min_split_len", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.num_warps, int) or not _is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {self.num_warps!r}")

    def num_splits(self, batch: int, kv_heads: int, table_width: int, page_size: int) -> int:
        """Splits per (row, KV head) for rows of at most `table_width` pages: >= 1, <= max_splits."""
        wanted = -(-self.target_programs // (batch * kv_heads))
        min_pages = -(-self.min_split_len // page_size)
        useful = -(-table_width // min_pages)
        return max(1, min(self.max_splits, wanted, useful))

    def pipeline_stages(self, page_size: int, key_dim: int, value_dim: int, itemsize: int) -> int:
        """num_stages, lowered until every stage's K and V pages fit in `SHARED_MEMORY_BUDGET` bytes
        (key_dim: D + R of both key pools; value_dim: 0 when the values are the key pages)."""
        per_stage = page_size * (key_dim + value_dim) * itemsize  # one K (+ rope K) and one V page
        return max(1, min(self.num_stages, SHARED_MEMORY_BUDGET // per_stage))


def _tile_rows(num_queries: int, group: int) -> int:
    """M: the T * group query rows of one KV head padded to a power of two >= 16 (as `tl.dot` needs)."""
    return max(16, 1 << (num_queries * group - 1).bit_length())


def _key_chunks(key_dim: int) -> tuple[tuple[int, int], ...]:
    """(start, size) slices of D in powers of two >= 16, largest first: 576 -> (0, 512), (512, 64)."""
    sizes = [1 << bit for bit in reversed(range(key_dim.bit_length())) if key_dim >> bit & 1]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(zip(starts, sizes, strict=True))


def _unsupported_reason(q, k_pages, v_pages, k_rope_pages) -> str | None:
    """Why the kernel cannot take operands that passed `_check_operands`, or None if it can."""
    num_queries, heads, query_dim = q.shape[1:]
    page_size, kv_heads, key_dim = k_pages.shape[1:]
    value_dim = key_dim if v_pages is None else v_pages.shape[3]
    pools = [pages for pages in (k_pages, v_pages, k_rope_pages) if pages is not None]
    if any(pages.dtype != q.dtype for pages in pools) or q.dtype not in DTYPES:
        dtypes = ", ".join(str(x.dtype) for x in (q, *pools))
        return f"q and the pages must share one dtype among bfloat16, float16, float32, got {dtypes}"
    if not _is_power_of_two(page_size) or page_size < MIN_PAGE_SIZE:
        return f"page size P = {page_size} is not a power of two >= {MIN_PAGE_SIZE} (one page is one tl.dot block)"
    if key_dim % 16:
        return f"D = {key_dim} is not a multiple of 16 (keys are read in power-of-two slices >= 16)"
    if (query_dim - key_dim) % 16:
        return f"R = {query_dim - key_dim} is not a multiple of 16 (keys are read in power-of-two slices >= 16)"
    if not _is_power_of_two(value_dim) or value_dim < 16:
        return f"Dv = {value_dim} is not a power of two >= 16"
    rows = num_queries * (heads // kv_heads)
    if rows > MAX_QUERY_ROWS:
        return f"T x H/G = {rows} query rows exceed the {MAX_QUERY_ROWS} one program holds (use the reference)"
    if _tile_rows(num_queries, heads // kv_heads) * max(query_dim, value_dim) > MAX_TILE_ELEMENTS:
        return (
            f"the [M, D] query tile or [M, Dv] accumulator ({rows} rows padded, D = {query_dim}, Dv = {value_dim}) "
            f"exceeds {MAX_TILE_ELEMENTS} elements"
        )
    stage_dim = query_dim + (0 if v_pages is None else value_dim)  # a stage's key pages (+ value page)
    if page_size * stage_dim * q.dtype.itemsize > SHARED_MEMORY_BUDGET:
        dims = f"P = {page_size}, {stage_dim} entries per position"
        return f"one stage's pages ({dims}) exceed the {SHARED_MEMORY_BUDGET} bytes of shared memory"
    return None


def supports_paged(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array | None,
    block_table: jax.Array,
    lengths: jax.Array,
    *,
    k_rope_pages: jax.Array | None = None,
) -> bool:
    """True when `paged_verify_attention` accepts these operands (shapes and dtypes only; arrays or
    `jax.ShapeDtypeStruct`s), so callers can fall back to the reference otherwise."""
    try:
        _check_operands(q, k_pages, v_pages, block_table, lengths, k_rope_pages)
    except ValueError:
        return False
    return _unsupported_reason(q, k_pages, v_pages, k_rope_pages) is None


def _kernel(
    lengths_ref,
    table_ref,
    q_ref,
    k_ref,
    *refs,
    scale: float,
    key_chunks: tuple[tuple[int, int], ...],
    rope_chunks: tuple[tuple[int, int], ...],
    values_are_keys: bool,
    num_queries: int,
    group: int,
    num_splits: int,
    precision,
):
    """Refs: lengths [] int32, table [W] int32, q [M, D + R], k [N, P, D], then k_rope [N, P, R] when
    `rope_chunks`, then v [N, P, Dv] unless `values_are_keys` (KV head g); outputs acc [M, Dv], max [M],
    sum [M] float32.

    Query row r of the tile is new token t = r // group; it sees positions `< min(length - T + t + 1,
    W * P)`; rows past T * group are padding and see nothing. Page j of the row (block j) is read
    only if j < cdiv(length, P), and only its positions below the length; a page id outside [0, N)
    is never read and counts as zeros, as in the reference. With `values_are_keys` (D = Dv a power of
    two: one key slice) the [P, D] key page just loaded is the value page too.
    """
    *inputs, acc_ref, max_ref, sum_ref = refs
    rope_ref = inputs[0] if rope_chunks else None
    v_ref = None if values_are_keys else inputs[-1]
    rows = q_ref.shape[0]
    num_pages, page_size, key_dim = k_ref.shape
    length = lengths_ref[...]  # valid entries of this row including the T new ones; may be < 0 or > W * P
    stored = jnp.clip(length, 0, table_ref.shape[0] * page_size)  # positions the row's pages can hold
    used = pl.cdiv(stored, page_size)  # pages holding them
    per_split = pl.cdiv(used, num_splits)
    first = pl.program_id(2) * per_split
    last = jnp.minimum(first + per_split, used)

    row = jnp.arange(rows, dtype=jnp.int32)  # [M]
    causal = length - num_queries + lax.div(row, group) + 1  # [M]
    limit = jnp.where(row < num_queries * group, jnp.minimum(causal, stored), 0)  # [M]
    # (key pool, slice start in q, slice start in the pool, size): q's D entries score k, its R k_rope.
    slices = [(k_ref, start, start, size) for start, size in key_chunks]
    slices += [(rope_ref, key_dim + start, start, size) for start, size in rope_chunks]
    q_chunks = [q_ref[:, pl.ds(q_start, size)] for _, q_start, _, size in slices]  # [M, size] each

    def body(block, carry):
        acc, row_max, row_sum = carry  # [M, Dv], [M], [M]
        page = table_ref[block]  # []
        owned = (page >= 0) & (page < num_pages)
        page = jnp.clip(page, 0, num_pages - 1)  # keeps the address in range; the load is masked anyway
        pos = block * page_size + jnp.arange(page_size, dtype=jnp.int32)  # [P]
        live = ((pos < stored) & owned)[:, None]  # [P, 1]: never read stale positions or foreign pages
        s = jnp.zeros((rows, page_size), jnp.float32)
        keys = []
        for q_chunk, (pool, _, start, size) in zip(q_chunks, slices, strict=True):
            k = pltriton.load(pool.at[page, :, pl.ds(start, size)], mask=live, other=0)  # [P, size]
            s += pltriton.dot(q_chunk, k, trans_b=True, precision=precision)  # [M, P]
            keys.append(k)
        v = keys[0] if values_are_keys else pltriton.load(v_ref.at[page], mask=live, other=0)  # [P, Dv]
        s = jnp.where(pos[None, :] < limit[:, None], s * scale, -jnp.inf)
        return online_softmax_step(s, v, acc, row_max, row_sum, precision)

    accumulate_blocks(first, last, body, acc_ref, max_ref, sum_ref)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def paged_verify_attention(
    q: Float[Array, "B T H Dq"],
    k_pages: Float[Array, "N P G D"],
    v_pages: Float[Array, "N P G Dv"] | None,
    block_table: Int[Array, "B W"],
    lengths: Int[Array, " B"],
    *,
    k_rope_pages: Float[Array, "N P G R"] | None = None,
    scale: float | None = None,
    config: PagedAttentionConfig | None = None,
    interpret: bool = False,
) -> Float[Array, "B T H Dv"]:
    """Causal grouped-query attention of T new queries per row against a paged cache, as a GPU kernel.

    Same contract as `paged_attention_reference`. Each program (row b, KV head g, split) reads its
    share of row b's first `cdiv(lengths[b], P)` pages, one [P, D] key (and [P, R] rope key) and
    [P, Dv] value page at a time, each once per KV head; work follows the row's length, not W. With
    `v_pages` None the key page is the value page (loaded once): MLA's absorbed attention passes the
    latent pool as `k_pages` and the rope-key pool as `k_rope_pages`, both read in place.

    Args:
      q: queries of shape [B, T, H, Dq] (Dq = D, or D + R with `k_rope_pages`); bfloat16, float16 or
        float32. T x H/G <= MAX_QUERY_ROWS, and the [M, Dq] tile (M: T x H/G padded to a power of two
        >= 16) at most MAX_TILE_ELEMENTS.
      k_pages: key pages [N, P, G, D] in q's dtype; P a power of two >= 16, D a multiple of 16.
      v_pages: value pages [N, P, G, Dv] in q's dtype, Dv a power of two >= 16; or None: the values
        are `k_pages` (Dv = D, then a power of two).
      block_table: int32 [B, W], row b's page ids in order; unused entries a sentinel id >= N.
      lengths: int [B], valid entries per row including the T new tokens (past W * P: the causal
        alignment is kept, as in the reference).
      k_rope_pages: optional rope-key pages [N, P, G, R] in q's dtype, R a multiple of 16, scored
        against q[..., D:] (added to q[..., :D] . k).
      scale: softmax scale, default 1/sqrt(Dq).
      config: a `PagedAttentionConfig`, default `PagedAttentionConfig()`.
      interpret: run the kernel in Pallas' interpreter (any backend, e.g. CPU tests).

    Returns:
      [B, T, H, Dv] in q's dtype; scores, softmax and the weighted sum accumulate in float32.

    Raises:
      ValueError: an operand of the wrong rank, shape or dtype (naming it), or operands the kernel
        does not support (see `supports_paged`: page size, head dims, dtypes, query rows).
    """
    _check_operands(q, k_pages, v_pages, block_table, lengths, k_rope_pages)
    if (reason := _unsupported_reason(q, k_pages, v_pages, k_rope_pages)) is not None:
        raise ValueError(f"paged_verify_attention: {reason}")
    config = PagedAttentionConfig() if config is None else config
    batch, num_queries, heads, query_dim = q.shape
    num_pages, page_size, kv_heads, key_dim = k_pages.shape
    value_dim = key_dim if v_pages is None else v_pages.shape[3]
    rope_dim = query_dim - key_dim
    group = heads // kv_heads
    rows = _tile_rows(num_queries, group)
    num_splits = config.num_splits(batch, kv_heads, block_table.shape[1], page_size)

    q_tiles = q.reshape(batch, num_queries, kv_heads, group, query_dim).transpose(0, 2, 1, 3, 4)  # [B, G, T, H/G, Dq]
    q_tiles = q_tiles.reshape(batch, kv_heads, num_queries * group, query_dim)  # [B, G, T*H/G, Dq]
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - num_queries * group), (0, 0)))  # [B, G, M, Dq]
    kernel = functools.partial(
        _kernel,
        scale=float(query_dim**-0.5 if scale is None else scale),
        key_chunks=_key_chunks(key_dim),
        rope_chunks=_key_chunks(rope_dim),
        values_are_keys=v_pages is None,
        num_queries=num_queries,
        group=group,
        num_splits=num_splits,
        precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
    )
    table_width = block_table.shape[1]

    def pool_spec(dim: int) -> pl.BlockSpec:  # a pool [N, P, G, dim] -> KV head g's [N, P, dim]
        return pl.BlockSpec((num_pages, page_size, None, dim), lambda b, g, s: (0, 0, g, 0))

    pools = [pages for pages in (k_pages, k_rope_pages, v_pages) if pages is not None]
    f32 = jnp.float32
    acc, row_max, row_sum = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, num_splits),
        in_specs=[
            pl.BlockSpec((None,), lambda b, g, s: (b,)),  # lengths -> []
            pl.BlockSpec((None, table_width), lambda b, g, s: (b, 0)),  # block_table -> [W]
            pl.BlockSpec((None, None, rows, query_dim), lambda b, g, s: (b, g, 0, 0)),  # q -> [M, Dq]
            *[pool_spec(pages.shape[3]) for pages in pools],  # k [N, P, D], k_rope [N, P, R], v [N, P, Dv]
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, value_dim), lambda b, g, s: (b, g, s, 0, 0)),  # acc -> [M, Dv]
            pl.BlockSpec((None, None, None, rows), lambda b, g, s: (b, g, s, 0)),  # max -> [M]
            pl.BlockSpec((None, None, None, rows), lambda b, g, s: (b, g, s, 0)),  # sum -> [M]
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows, value_dim), f32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), f32),
            jax.ShapeDtypeStruct((batch, kv_heads, num_splits, rows), f32),
        ],
        compiler_params=pltriton.CompilerParams(
            num_warps=config.num_warps,
            num_stages=config.pipeline_stages(
                page_size, query_dim, 0 if v_pages is None else value_dim, q.dtype.itemsize
            ),
        ),
        interpret=interpret,
        name="paged_verify_attention",
    )(lengths.astype(jnp.int32), block_table, q_tiles, *pools)
    out = _combine(acc, row_max, row_sum)[:, :, : num_queries * group]  # [B, G, T*H/G, Dv]
    out = out.reshape(batch, kv_heads, num_queries, group, value_dim).transpose(0, 2, 1, 3, 4)  # [B, T, G, H/G, Dv]
    return out.reshape(batch, num_queries, heads, value_dim).astype(q.dtype)  # [B, T, H, Dv]
