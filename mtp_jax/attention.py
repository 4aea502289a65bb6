"""Attention of T new queries per row against a KV cache with per-row lengths.

`attention_reference` is the plain-jnp oracle: the Pallas kernel in `pallas_kernels` is tested
against this same function, and the model uses it wherever the kernel is not selected. `attend`
picks between them (`ModelConfig.attention_impl`).

Convention (shared with the kernel): `lengths[b]` counts the valid cache entries of row b
*including* the T new tokens already written, so new query t of row b sits at absolute position
`lengths[b] - T + t` and sees cache positions `< lengths[b] - T + t + 1` (the causal mask is
aligned to the end of each row). Entries at or past `lengths[b]` are stale: they are masked in the
scores and zeroed in the values, so even NaN there cannot leak. A query with nothing to attend to
returns zeros.

`segment_attention_reference` is the training variant: whole packed sequences with no cache, each
token attending only to earlier tokens of its own segment (document).
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


def attention_reference(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G D"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T H D"]:
    """Causal grouped-query attention of T new queries against a cache.

    Args:
      q: queries of shape [B, T, H, D].
      k, v: caches of shape [B, S, G, D], H a multiple of G (query head h reads KV head h // (H/G)).
      lengths: int32 [B], valid entries per row including the T new tokens.
      scale: softmax scale, default 1/sqrt(D).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and the weighted sum in float32.
    """
    cache_len = k.shape[1]
    mask = attention_mask(lengths, q.shape[1], cache_len)  # [B, T, S]
    # Stale values are zeroed (their weights are exactly 0, but 0 * NaN is NaN); stale keys need no
    # such pass: their scores are replaced by -inf before anything reads them.
    valid = (jnp.arange(cache_len)[None, :] < lengths[:, None])[:, :, None, None]  # [B, S, 1, 1]
    return _masked_attention(q, k, jnp.where(valid, v, 0), mask, scale)


def _masked_attention(q: Float[Array, "B T H D"], k: Float[Array, "B S G D"], v: Float[Array, "B S G D"],
                      mask: Bool[Array, "B T S"], scale: float | None) -> Float[Array, "B T H D"]:
    """Grouped-query attention under a boolean mask; a query with nothing unmasked gets zeros."""
    batch, num_queries, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    qg = q.astype(jnp.float32).reshape(batch, num_queries, num_kv_heads, group, head_dim)  # [B, T, G, H/G, D]
    scores = jnp.einsum("btgjd,bsgd->bgjts", qg, k.astype(jnp.float32)) * scale  # [B, G, H/G, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    peak = jnp.max(scores, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    weights = jnp.exp(scores - peak)  # masked entries are exactly 0
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("bgjts,bsgd->btgjd", weights, v.astype(jnp.float32))  # [B, T, G, H/G, D]
    return out.reshape(batch, num_queries, num_heads, head_dim).astype(q.dtype)


ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def attend(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G D"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "B T H D"]:
    """`attention_reference`'s attention, computed by the implementation `impl` names.

    impl: "reference" (plain jnp, any backend); "pallas" (`pallas_kernels.verify_attention`, the
    Triton kernel, GPU only); "pallas_interpret" (the same kernel in Pallas' interpreter, any
    backend: tests); "auto" (the kernel when `jax.default_backend()` is "gpu" and it supports the
    shapes and dtypes, else the reference). With "pallas" or "pallas_interpret", calls with more
    query rows than one kernel program holds (T x H/G > `pallas_kernels.verify_attention.
    MAX_QUERY_ROWS`: a long prefill, not a verify pass) take the reference too. Raises ValueError
    for an unknown `impl`, or for operands the kernel does not support (dtype, head dim) when
    "pallas" or "pallas_interpret" is asked for explicitly.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl != "reference" and (impl != "auto" or jax.default_backend() == "gpu"):
        # Lazily: Pallas is only needed here.
        from pallas_kernels.verify_attention import MAX_QUERY_ROWS, supports, verify_attention

        if impl == "auto":
            impl = "pallas" if supports(q, k, v, lengths) else "reference"
        elif q.shape[1] * (q.shape[2] // k.shape[2]) > MAX_QUERY_ROWS:
            impl = "reference"
        if impl != "reference":
            return verify_attention(q, k, v, lengths, scale=scale, interpret=impl == "pallas_interpret")
    return attention_reference(q, k, v, lengths, scale=scale)


def segment_attention_reference(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T G D"],
    v: Float[Array, "B T G D"],
    segment_ids: Int[Array, "B T"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T H D"]:
    """Causal attention within packed segments, over whole sequences with no cache (training).

    Query t of row b attends key s iff `s <= t` and `segment_ids[b, s] == segment_ids[b, t]`, so
    documents packed into one row never see each other (padding, segment 0, attends only to
    padding, which keeps it finite). Every query sees at least itself, so no row is empty.

    Args:
      q: queries of shape [B, T, H, D].
      k, v: keys and values of the same T tokens, shape [B, T, G, D], H a multiple of G.
      segment_ids: int32 [B, T], equal ids for tokens of one document.
      scale: softmax scale, default 1/sqrt(D).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and the weighted sum in float32.
    """
    t = jnp.arange(q.shape[1])
    causal = t[None, :, None] >= t[None, None, :]  # [1, T, T]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    return _masked_attention(q, k, v, causal & same_segment, scale)
