"""The plain-jnp reference of the verify attention: T new queries per row against a KV cache.

`verify_attention_reference` is the oracle the Pallas kernel (`verify_attention`) is tested against,
and what a model computes wherever the kernel is not selected (`mtp_jax.layers.attention.attend`).
Plain jax only, so CPUs run it and nothing here depends on mtp_jax.

Convention (shared with the kernel): `lengths[b]` counts the valid cache entries of row b
*including* the T new tokens already written, so new query t of row b sits at absolute position
`lengths[b] - T + t` and sees cache positions `< lengths[b] - T + t + 1` (the causal mask is
aligned to the end of each row; a length past S, a verify window reaching past the capacity,
keeps that alignment). Entries at or past `lengths[b]` are stale: they are masked in the scores
and zeroed in the values, so even NaN there cannot leak. A query with nothing to attend to
returns zeros. `masked_attention` is the core under any boolean mask (training's segment mask too).
Values may have another head dim Dv than queries and keys (D): DeepSeek MLA's absorbed attention,
whose keys are [latent, rope key] and whose values are the latent alone.

Precision: scores, softmax and the weighted sum accumulate in float32. In `verify_attention_reference`,
when q, k and v share one half-precision dtype (bfloat16 / float16), the two products take those
operands as they are (their products are exact in float32, so the scores are the float32 scores up
to summation order) and the softmax weights are rounded to that dtype before the weighted sum
(normalised first; the Triton kernels here round each block's unnormalised weights, FlashAttention-
style, and transformers' eager attention the normalised ones); converting the cache to float32
instead costs a float32 copy of K and V per layer and step (2-3x this attention's time on XLA:CPU at
batch 8). Training's `masked_attention` (no `half_operands`) stays in float32, gradients included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def attention_mask(lengths: Int[Array, " B"], num_queries: int, cache_len: int) -> jax.Array:
    """Boolean mask of shape [B, T, S]: query t of row b may attend to cache position s."""
    t = jnp.arange(num_queries)[None, :, None]  # [1, T, 1]
    s = jnp.arange(cache_len)[None, None, :]  # [1, 1, S]
    limit = lengths[:, None, None] - num_queries + t + 1  # [B, T, 1]
    return s < limit


def verify_attention_reference(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G Dv"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T H Dv"]:
    """Causal grouped-query attention of T new queries against a cache.

    Args:
      q: queries of shape [B, T, H, D].
      k: key cache of shape [B, S, G, D], H a multiple of G (query head h reads KV head h // (H/G)).
      v: value cache of shape [B, S, G, Dv] (Dv is usually D).
      lengths: int32 [B], valid entries per row including the T new tokens.
      scale: softmax scale, default 1/sqrt(D).

    Returns:
      [B, T, H, Dv] in q's dtype; scores, softmax and the weighted sum accumulate in float32 (in
      half precision the weights are rounded to it first: the module docstring's "Precision").
    """
    cache_len = k.shape[1]
    mask = attention_mask(lengths, q.shape[1], cache_len)  # [B, T, S]
    # Stale values are zeroed (their weights are exactly 0, but 0 * NaN is NaN); stale keys need no
    # such pass: their scores are replaced by -inf before anything reads them.
    valid = (jnp.arange(cache_len)[None, :] < lengths[:, None])[:, :, None, None]  # [B, S, 1, 1]
    return masked_attention(q, k, jnp.where(valid, v, 0), mask, scale, half_operands=True)


def masked_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G Dv"],
    mask: Bool[Array, "B T S"],
    scale: float | None,
    *,
    half_operands: bool = False,
) -> Float[Array, "B T H Dv"]:
    """Grouped-query attention under a boolean mask; a query with nothing unmasked gets zeros.

    Everything in float32 unless `half_operands` and q, k, v share a half-precision dtype (the module
    docstring's "Precision": inference only; training keeps float32 weights and their gradients).
    """
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    half = half_operands and q.dtype == k.dtype == v.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
    operand = q.dtype if half else jnp.float32  # see the module docstring's "Precision"
    qg = q.astype(operand).reshape(batch, num_queries, num_kv_heads, group, head_dim)  # [B, T, G, H/G, D]
    scores = jnp.einsum("btgjd,bsgd->bgjts", qg, k.astype(operand), preferred_element_type=jnp.float32)
    weights = masked_softmax(scores * scale, mask[:, None, None])  # [B, G, H/G, T, S] float32
    # The values head-major first ([B, G, S, Dv], whole Dv rows moved): left to itself XLA:CPU computes
    # this product transposed, out^T = v^T w^T, through a [B, G, Dv, S] copy of the cache 2-3x slower.
    v_heads = jnp.swapaxes(v.astype(operand), 1, 2)
    out = jnp.einsum("bgjts,bgse->bgjte", weights.astype(operand), v_heads, preferred_element_type=jnp.float32)
    out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [B, T, G, H/G, Dv]
    return out.reshape(batch, num_queries, num_heads, v.shape[-1]).astype(q.dtype)  # [B, T, H, Dv]


def masked_softmax(scores: Float[Array, "... S"], mask: Bool[Array, "... S"]) -> Float[Array, "... S"]:
    """Softmax over the last axis of float32 `scores` where `mask` (broadcast to them) holds, exactly 0 where
    it does not (even for NaN scores); a row with nothing unmasked is all zeros."""
    scores = jnp.where(mask, scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)  # masked entries are exactly 0
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(denom > 0, denom, 1.0)


def gather_pages(pages: Float[Array, "N P ..."], block_table: Int[Array, "B W"]) -> Float[Array, "B S ..."]:
    """Row b's pages in table order, [B, W * P, ...]; an id outside [0, N) (a sentinel) reads as zeros."""
    num_pages, page_size = pages.shape[:2]
    batch, width = block_table.shape
    owned = (block_table >= 0) & (block_table < num_pages)  # [B, W]
    rows = pages[jnp.clip(block_table, 0, num_pages - 1)]  # [B, W, P, ...]
    owned = owned.reshape(batch, width, *([1] * (pages.ndim - 1)))
    rows = jnp.where(owned, rows, 0)  # a sentinel's clamped read is dropped, NaN too
    return rows.reshape(batch, width * page_size, *pages.shape[2:])  # [B, W * P, ...]
