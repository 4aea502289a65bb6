"""Attention: the grouped-query attention layer, and the choice of implementation under it.

`attend` computes `pallas_kernels.verify_attention_reference`'s attention (T new queries per row
against a cache) by the implementation `ModelConfig.attention_impl` names: the plain-jnp reference
or the Pallas kernel. `segment_attention_reference` is the training variant: whole packed
sequences with no cache. `Attention` is the GQA layer (Llama / Qwen2 / Mistral names) that writes
its `KVCache` at the positions it is given.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from mtp_jax.cache import KVCache, PagedCache, dense_view
from mtp_jax.config import ATTENTION_IMPLS, ModelConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.fused import qkv_layout
from mtp_jax.layers.linear import linear
from mtp_jax.layers.norm import RMSNorm
from mtp_jax.layers.rope import apply_rope
from mtp_jax.sharding import context_spec
from pallas_kernels.attention_reference import masked_attention
from pallas_kernels.attention_reference import verify_attention_reference as attention_reference


def attend(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G D"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "B T H D"]:
    """`attention_reference`'s attention (`pallas_kernels.verify_attention_reference`), computed by the
    implementation `impl` names.

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
            kernel = functools.partial(verify_attention, scale=scale, interpret=impl == "pallas_interpret")
            return _per_shard(kernel, q, k, v, lengths)
    return attention_reference(q, k, v, lengths, scale=scale)


def attend_paged(
    q: Float[Array, "B T H D"],
    cache: PagedCache,
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    impl: str = "auto",
) -> Float[Array, "B T H D"]:
    """`attend` over a bound paged `KVCache` (`mtp_jax.cache.PagedCache`, pools [N, P, G, D]).

    Where `use_paged_kernel` says so (impl "pallas" / "pallas_interpret", or "auto" on a GPU; no mesh
    sharding rows or heads; operands the kernel supports), `pallas_kernels.paged_verify_attention` reads
    the rows' pages through the block table; otherwise the rows' pages are gathered (`PagedCache.view`)
    and `attend` takes them with `impl`.
    """
    pool, table = cache.pool, cache.block_table
    if use_paged_kernel(impl, q, pool.k, pool.v, table, lengths):
        from pallas_kernels.paged_attention import paged_verify_attention

        return paged_verify_attention(
            q, pool.k, pool.v, table, lengths, scale=scale, interpret=impl == "pallas_interpret"
        )
    view = cache.view()
    return attend(q, view.k, view.v, lengths, scale=scale, impl=impl)


def use_paged_kernel(
    impl: str,
    q: Float[Array, "B T H Dq"],
    k_pages: Float[Array, "N P G D"],
    v_pages: Float[Array, "N P G Dv"] | None,
    block_table: Int[Array, "B W"],
    lengths: Int[Array, " B"],
    *,
    k_rope_pages: Float[Array, "N P G R"] | None = None,
) -> bool:
    """Whether attention over a paged cache runs `pallas_kernels.paged_verify_attention` on these operands
    (the GQA layer's `attend_paged` and MLA's absorbed path alike) rather than gathering the rows' pages.

    True when `impl` asks for the kernel ("pallas", "pallas_interpret", or "auto" with
    `jax.default_backend()` "gpu"), no context mesh shards q's rows or heads (the kernel is not wrapped
    in `shard_map`), and `pallas_kernels.supports_paged` accepts the operands (shapes and dtypes: a page
    size a power of two >= 16, head dims, query rows). Raises ValueError for an unknown `impl`.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if impl == "reference" or (impl == "auto" and jax.default_backend() != "gpu"):
        return False
    sharded = context_spec(P("batch", None, "heads", None), q.shape)
    if sharded is not None and any(axis is not None for axis in sharded):
        return False
    from pallas_kernels.paged_attention import supports_paged  # lazily: Pallas is only needed here

    return supports_paged(q, k_pages, v_pages, block_table, lengths, k_rope_pages=k_rope_pages)


def _per_shard(kernel, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
    """`kernel(q, k, v, lengths)` on each device's rows and heads under `shard_map` when a context mesh
    shards them (`mtp_jax.sharding`: rows over the batch axes, heads over `tensor`); a Pallas call is
    opaque to GSPMD, which would otherwise gather its operands onto every device. Query heads are split
    over `tensor` only together with the KV heads (each device keeps whole GQA groups), else only rows."""
    q_spec = context_spec(P("batch", None, "heads", None), q.shape)
    if q_spec is None or all(axis is None for axis in q_spec):
        return kernel(q, k, v, lengths)
    kv_spec = context_spec(P("batch", None, "kv_heads", None), k.shape)
    if q_spec[2] != kv_spec[2]:  # the KV heads are not split like the query heads: split rows only
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(q_spec[0], None, None, None)
    return jax.shard_map(kernel, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0])), out_specs=q_spec, check_vma=False)(
        q, k, v, lengths
    )


def segment_mask(segment_ids: Int[Array, "B T"]) -> Bool[Array, "B T T"]:
    """Which key s each query t of a whole packed row may see: `s <= t` and `segment_ids[b, s] ==
    segment_ids[b, t]` (causal within a document; padding, segment 0, sees padding only). Every query
    sees at least itself, so no row of the mask is empty. Shared by GQA and MLA (`mtp_jax.layers.mla`)."""
    t = jnp.arange(segment_ids.shape[1])
    causal = t[None, :, None] >= t[None, None, :]  # [1, T, T]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, T]
    return causal & same_segment


def segment_attention_reference(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B T G D"],
    v: Float[Array, "B T G D"],
    segment_ids: Int[Array, "B T"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T H D"]:
    """Causal attention within packed segments, over whole sequences with no cache (training).

    Query t of row b attends the keys `segment_mask` allows (s <= t in its own segment), so
    documents packed into one row never see each other.

    Args:
      q: queries of shape [B, T, H, D].
      k, v: keys and values of the same T tokens, shape [B, T, G, D], H a multiple of G.
      segment_ids: int32 [B, T], equal ids for tokens of one document.
      scale: softmax scale, default 1/sqrt(D).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and the weighted sum in float32.
    """
    return masked_attention(q, k, v, segment_mask(segment_ids), scale)


class Attention(nnx.Module):
    """Grouped-query self-attention with RoPE, reading and writing one layer of the KV cache.

    Llama / Qwen2 / Mistral, and GLM-4.5's variant (`Glm4MoeAttention`): RoPE on the first
    `config.rotary_dim` entries of each head only (`partial_rotary_factor`), and with `use_qk_norm`
    an RMSNorm over each query and key head (`q_norm`, `k_norm`) before RoPE.

    Parameters (kernels [in, out] in `config.weight_dtype`): `qkv_proj` [E, (H + 2G) D] (+ bias
    [(H + 2G) D] when `attention_bias`), HF's `q_proj`, `k_proj` and `v_proj` in one matmul, its output
    axis group-major: [G, H/G + 2, D] flattened, KV head g's H/G query heads (query head
    h = g * (H/G) + j, which reads KV head h // (H/G) as in HF's GQA), then k_g, then v_g. A contiguous
    chunk of the output axis is then whole GQA groups, so tensor parallelism over it (any degree that
    divides G, `mtp_jax.sharding`) keeps each device's q, k and v local. `mtp_jax.checkpoints` builds
    it from HF's tensors on load and takes them back out on export. `o_proj` [H D, E]; with
    `use_qk_norm`, `q_norm` and `k_norm` [D].

    Qwen3.5's gated attention (`attn_output_gate`, HF `Qwen3_5Attention`): q_proj is [H 2D], each head's query
    then its output gate (`qkv_layout(..., gated=True)`: each group holds its heads' 2D entries), and the
    attention output is multiplied by sigmoid(gate) before `o_proj`.
    """

    onednn_attention = False  # `onednn.ATTENTION`: a CPU engine's copy computes `attend` by `onednn.attention`

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        self.config = config
        d, h, g = config.resolved_head_dim, config.num_attention_heads, config.num_key_value_heads
        layout = qkv_layout(h, g, d, gated=config.attn_output_gate)
        self.qkv_proj = linear(
            config,
            config.hidden_size,
            layout.width,
            rngs,
            config.attention_bias,
            axes=("embed", ("heads", layout.width // g)),
            name="self_attn.qkv_proj",
            layout=layout,
        )  # splits between KV groups
        self.o_proj = linear(
            config, h * d, config.hidden_size, rngs, axes=(("heads", d), "embed"), name="self_attn.o_proj"
        )
        if config.use_qk_norm:
            self.q_norm = RMSNorm.of(config, d)
            self.k_norm = RMSNorm.of(config, d)

    def _rope(self, x: Float[Array, "B T N D"], positions: Int[Array, "B T"]) -> Float[Array, "B T N D"]:
        """RoPE over the first `rotary_dim` entries of each head; the rest pass through."""
        c, rotary = self.config, self.config.rotary_dim
        if rotary == c.resolved_head_dim:
            return apply_rope(x, positions, c)
        rotated = apply_rope(x[..., :rotary], positions, c, dim=rotary)  # [B, T, N, rotary]
        return jnp.concatenate([rotated, x[..., rotary:]], axis=-1)  # [B, T, N, D]

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        cache: KVCache | PagedCache,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> tuple[Float[Array, "B T E"], KVCache | PagedCache]:
        """Attention of T new tokens at contiguous `positions` (int32 [B, T]) over `cache` and themselves.

        The new keys and values are written at `positions`; query t sees cache positions
        <= positions[b, t]. With `segment_ids` (training, from an empty cache) it attends within its
        own segment only. Returns the output [B, T, E] and the written cache.
        """
        c = self.config
        batch, num_new, _ = x.shape
        d, h, g = c.resolved_head_dim, c.num_attention_heads, c.num_key_value_heads
        qkv = self.qkv_proj(x).reshape(batch, num_new, g, -1, d)  # [B, T, G, H/G (x2 gated) + 2, D], group-major
        q = qkv[:, :, :, :-2].reshape(batch, num_new, h, -1, d)  # [B, T, H, 1 or 2, D], head h = g * (H/G) + j
        q, gate = q[:, :, :, 0], q[:, :, :, -1]  # [B, T, H, D] each (gate: the query itself when not gated)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]  # [B, T, G, D] each
        if c.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, positions), self._rope(k, positions)
        cache = cache.write(positions, k, v)
        if segment_ids is None:  # `attend` counts each row's entries including the T new ones
            lengths, scale, impl = positions[:, -1] + 1, c.attention_scale, c.attention_impl
            read = cache.pool if isinstance(cache, PagedCache) else cache
            if impl == "auto" and onednn.attends(self, q, read.k, read.v):  # a CPU engine's copy
                read = dense_view(cache)  # a paged cache's rows gathered (no paged kernel on the CPU)
                out = onednn.attention(q, read.k, read.v, lengths, scale=scale)  # [B, T, H, D]
            elif isinstance(cache, PagedCache):
                out = attend_paged(q, cache, lengths, scale=scale, impl=impl)  # [B, T, H, D]
            else:
                out = attend(q, cache.k, cache.v, lengths, scale=scale, impl=impl)  # [B, T, H, D]
        else:  # whole packed sequences from an empty cache (training): attend within each segment only
            out = segment_attention_reference(q, k, v, segment_ids, scale=c.attention_scale)  # [B, T, H, D]
        if c.attn_output_gate:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
        return self.o_proj(out.reshape(batch, num_new, h * d)), cache
