"""Multi-head latent attention (MLA): DeepSeek-V2 (arXiv 2405.04434 §2.1) as DeepSeek-V3 configures it.

Each token's keys and values are compressed into one latent vector
`c = kv_a_layernorm(x W_DKV)` of size C = `kv_lora_rank`, shared by all heads, plus one decoupled
rope key `k_rope = RoPE(x W_KR)` of size R = `qk_rope_head_dim`, also shared by all heads. Only these
two are cached (`MLACache`): C + R entries per token instead of H x (N + R + V). Head h's key is
`[c W_UK_h, k_rope]` and its value `c W_UV_h`, where `kv_b_proj` holds W_UK and W_UV side by side.

Two equal ways to attend (`MLAttention.__call__`'s `absorbed`):
  - decompressed: run the cache through `kv_b_proj` into per-head keys and values, then ordinary
    attention (the paper's §2.1.2-2.1.3 formulas, in full in its Appendix C); cost and memory grow
    with S x H x (N + V);
  - absorbed (§2.1.2: at inference W_UK can be absorbed into the query projection and W_UV into
    the output one): `q_nope . (c W_UK_h)` = `(q_nope W_UK_h^T) . c`, so the scores read the latent
    cache directly; the weighted sum is taken over the latents and W_UV applied once per query
    afterwards. Nothing per head and cache position is materialised beyond the H x T x S scores:
    the form for decode and verify (T small). Over a paged cache it is the Pallas paged kernel's
    attention with one KV head (`absorbed_attention`: the latent pool as keys and values, the
    rope-key pool as a second key pool), as FlashMLA computes it.

Training's packed rows (`segment_ids`, from an empty cache) attend, in either form, the new entries
only, causally within each document (`mtp_jax.layers.attention.segment_mask`, as grouped-query attention).

Weight names are DeepSeek-V3's (`model.layers.N.self_attn.<name>.weight` in its checkpoints and in
`transformers`' `DeepseekV3Attention`), nnx kernels being those weights transposed ([in, out]).
Dimension letters: B batch, T new tokens, S cache length, E hidden size, H heads, C kv_lora_rank,
R qk_rope_head_dim, N qk_nope_head_dim, V v_head_dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from mtp_jax.cache import PagedCache, check_shape, dense_view, write_at
from mtp_jax.config import ModelConfig
from mtp_jax.layers.attention import segment_mask, use_paged_kernel
from mtp_jax.layers.fused import FusedLayout
from mtp_jax.layers.linear import compute_kernel, linear
from mtp_jax.layers.norm import RMSNorm
from mtp_jax.layers.rope import apply_rope
from pallas_kernels.attention_reference import masked_softmax

# DeepSeek-V3 (its reference code and `transformers`) builds q_a_layernorm and kv_a_layernorm with
# RMSNorm's default epsilon, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@struct.dataclass
class MLACache:
    """One layer's MLA cache: `latent` [B, S, C] (kv_a_layernorm-ed) and `k_rope` [B, S, R] (rotated).

    Both in the compute dtype. The cache carries no lengths: the caller's positions say what is
    live (docs/MTP_SPEC.md, "The main model's cache"; `mtp_jax.cache`); entries past a row's last
    position are stale (`mtp_jax.cache.fill_stale` works on it).
    """

    latent: jax.Array
    k_rope: jax.Array

    # `mtp_jax.sharding` names (`mtp_jax.cache.logical_axes`): no head axis, so whole over `tensor`.
    LOGICAL_AXES: ClassVar[dict[str, P]] = {
        "latent": P("batch", "cache_sequence", "latent"),
        "k_rope": P("batch", "cache_sequence", None),
    }

    @property
    def max_length(self) -> int:
        """S, the capacity in tokens."""
        return self.latent.shape[1]

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> MLACache:
        """Zeros of shapes [batch_size, max_length, C] and [batch_size, max_length, R] in `dtype`
        (default `config.compute_dtype`). Raises ValueError for a batch size or capacity below 1."""
        check_shape(batch_size, max_length)
        dtype = config.compute_dtype if dtype is None else dtype
        return cls(
            latent=jnp.zeros((batch_size, max_length, config.kv_lora_rank), dtype),
            k_rope=jnp.zeros((batch_size, max_length, config.qk_rope_head_dim), dtype),
        )

    def write(
        self, positions: Int[Array, "B T"], latent: Float[Array, "B T C"], k_rope: Float[Array, "B T R"]
    ) -> MLACache:
        """The cache with the new entries at `positions` (outside [0, S): dropped, never clamped)."""
        return MLACache(
            latent=write_at(self.latent, latent, positions), k_rope=write_at(self.k_rope, k_rope, positions)
        )


def softmax_scale(config: ModelConfig) -> float:
    """`(N + R)^-1/2`, times mscale(factor, mscale_all_dim)^2 under scaled RoPE, as DeepSeek-V3 does.

    DeepSeek's YaRN puts mscale(factor, mscale) / mscale(factor, mscale_all_dim) into cos/sin
    (`mtp_jax.layers.rope`) and the square of mscale(factor, mscale_all_dim) = 0.1 mscale_all_dim ln(factor) + 1
    (1 when factor <= 1) into the softmax scale; `transformers`' DeepseekV3Attention applies the latter
    for any rope_type other than "default" whose `mscale_all_dim` is set and nonzero.
    """
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling
    if s.rope_type != "default" and s.mscale_all_dim:
        mscale = 1.0 if s.factor <= 1 else 0.1 * s.mscale_all_dim * math.log(s.factor) + 1.0
        scale *= mscale * mscale
    return scale


class MLAttention(nnx.Module):
    """DeepSeek-V3 multi-head latent attention over an `MLACache` (arXiv 2405.04434 §2.1).

    Parameters (DeepSeek-V3 names; kernels [in, out] in `config.weight_dtype`):
      when `q_lora_rank` is set: fused_qkv_a_proj [E, q_lora_rank + C + R] (+ bias if attention_bias),
      DeepSeek-V3's q_a_proj [E, q_lora_rank] and kv_a_proj_with_mqa [E, C + R] side by side in that order
      along the output axis (both read x: one matmul; `mtp_jax.checkpoints` splits and joins them),
      q_a_layernorm [q_lora_rank], q_b_proj [q_lora_rank, H (N + R)]; else q_proj [E, H (N + R)] and
      kv_a_proj_with_mqa [E, C + R] (+ bias);
      kv_a_layernorm [C], kv_b_proj [C, H (N + V)] (per head: N key columns, then V value columns),
      o_proj [H V, E] (+ bias).
    """

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.attention_type != "mla":
            raise ValueError(f"MLAttention needs attention_type='mla', got {config.attention_type!r}")
        c = config
        self.config = c
        heads, qk_dim = c.num_attention_heads, c.qk_nope_head_dim + c.qk_rope_head_dim
        kv_a_dim = c.kv_lora_rank + c.qk_rope_head_dim
        if c.q_lora_rank is None:
            self.q_proj = linear(
                c, c.hidden_size, heads * qk_dim, rngs, axes=("embed", ("heads", qk_dim)), name="self_attn.q_proj"
            )
            self.kv_a_proj_with_mqa = linear(
                c,
                c.hidden_size,
                kv_a_dim,
                rngs,
                bias=c.attention_bias,
                axes=("embed", None),
                name="self_attn.kv_a_proj_with_mqa",
            )
        else:
            self.fused_qkv_a_proj = linear(
                c,
                c.hidden_size,
                c.q_lora_rank + kv_a_dim,
                rngs,
                bias=c.attention_bias,
                axes=("embed", None),
                name="self_attn.fused_qkv_a_proj",
                layout=FusedLayout((c.q_lora_rank, kv_a_dim)),
            )
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, c.weight_dtype)
            self.q_b_proj = linear(
                c, c.q_lora_rank, heads * qk_dim, rngs, axes=("q_lora", ("heads", qk_dim)), name="self_attn.q_b_proj"
            )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, c.weight_dtype)
        self.kv_b_proj = linear(
            c,
            c.kv_lora_rank,
            heads * (c.qk_nope_head_dim + c.v_head_dim),
            rngs,
            axes=("latent", ("heads", c.qk_nope_head_dim + c.v_head_dim)),
            name="self_attn.kv_b_proj",
        )
        self.o_proj = linear(
            c,
            heads * c.v_head_dim,
            c.hidden_size,
            rngs,
            bias=c.attention_bias,
            axes=(("heads", c.v_head_dim), "embed"),
            name="self_attn.o_proj",
        )

    def __call__(
        self,
        x: Float[Array, "B T E"],
        positions: Int[Array, "B T"],
        cache: MLACache | PagedCache,
        segment_ids: Int[Array, "B T"] | None = None,
        *,
        absorbed: bool = True,
    ) -> tuple[Float[Array, "B T E"], MLACache | PagedCache]:
        """Attend T new tokens per row to themselves and the cache; return the output and the new cache.

        Args:
          x: hidden states [B, T, E] in the compute dtype.
          positions: int32 [B, T], absolute and contiguous within a row (positions[b, t] =
            positions[b, 0] + t). Row b's new latent / rope key entries are written at these
            positions; one outside [0, S) is dropped, never clamped onto a live entry.
          cache: the layer's `MLACache`, or one in pages (a bound `mtp_jax.cache.PagedCache`, pools
            [N, P, C] and [N, P, R]); entries of row b past positions[b, -1] are stale (never read:
            masked or zeroed before any matmul, so NaN there cannot leak).
          segment_ids: optional int32 [B, T] document ids of whole packed rows (training: an empty
            cache, positions 0 .. T-1). Queries then attend the T new entries only, where
            `mtp_jax.layers.attention.segment_mask` allows (s <= t in the query's own document), in
            either form; the cache is still written.
          absorbed: True folds W_UK into the query and W_UV after the weighted sum (decode, verify;
            `absorbed_attention`: over pages, the Pallas paged kernel where `config.attention_impl`
            selects it); False decompresses the cache into per-head keys and values (the paper's form).

        Returns:
          ([B, T, E] in x's dtype, the cache with the new entries written). Query t of row b sees
          cache positions s <= positions[b, t] (with `segment_ids`, as above); one that sees nothing gets
          zeros before o_proj.
          Scores, softmax and the weighted sum in float32 (or wider, if x is); the paged kernel takes
          the absorbed queries in the pools' dtype.
        """
        c = self.config
        batch, num_new, _ = x.shape
        heads, nope, rope, v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        if c.q_lora_rank is None:
            q, kv = self.q_proj(x), self.kv_a_proj_with_mqa(x)  # [B, T, H (N + R)], [B, T, C + R]
        else:
            qkv_a = self.fused_qkv_a_proj(x)  # [B, T, q_lora_rank + C + R]
            q_a, kv = qkv_a[..., : c.q_lora_rank], qkv_a[..., c.q_lora_rank :]  # [B, T, q_lora_rank], [B, T, C + R]
            q = self.q_b_proj(self.q_a_layernorm(q_a))  # [B, T, H (N + R)]
        q = q.reshape(batch, num_new, heads, nope + rope)  # [B, T, H, N + R]
        q_nope, q_rope = q[..., :nope], self._rope(q[..., nope:], positions)  # [B, T, H, N], [B, T, H, R]
        latent = self.kv_a_layernorm(kv[..., : c.kv_lora_rank])  # [B, T, C]
        k_rope = self._rope(kv[..., None, c.kv_lora_rank :], positions)[:, :, 0]  # [B, T, 1, R] -> [B, T, R]

        cache = cache.write(positions, latent, k_rope)
        acc = jnp.promote_types(x.dtype, jnp.float32)
        q_nope, q_rope = q_nope.astype(acc), q_rope.astype(acc)
        # The entries attended (latents [B, S, C], rope keys [B, S, R]) and what each query sees [B, T, S].
        if segment_ids is not None:  # whole packed rows from an empty cache: the T new entries are all there is
            entries = (latent, k_rope, segment_mask(segment_ids))  # S = T
        elif not absorbed:  # the dense cache (a paged one: its rows' pages in order), stale entries zeroed
            entries = _live_entries(dense_view(cache), positions)
        else:
            entries = None  # `absorbed_attention` reads the cache itself (pages in place, where it can)
        if absorbed:
            w_uk, w_uv = self._absorbed_weights(acc)  # [C, H, N], [C, H, V]
            q_latent = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)  # [B, T, H, C]
            scale, impl = softmax_scale(c), c.attention_impl
            if entries is None:
                out_latent = absorbed_attention(q_latent, q_rope, positions, cache, scale=scale, impl=impl)
            else:
                out_latent = _latent_weighted_sum(q_latent, q_rope, *entries, scale=scale)  # [B, T, H, C]
            out = jnp.einsum("bthc,chv->bthv", out_latent.astype(acc), w_uv)  # [B, T, H, V]
        else:
            live_latent, cached_rope, visible = entries
            kv_heads = self.kv_b_proj(live_latent).astype(acc)  # [B, S, H (N + V)]
            kv_heads = kv_heads.reshape(batch, live_latent.shape[1], heads, nope + v_dim)  # [B, S, H, N + V]
            k_nope, v = kv_heads[..., :nope], kv_heads[..., nope:]  # [B, S, H, N], [B, S, H, V]
            scores = jnp.einsum("bthn,bshn->bhts", q_nope, k_nope)  # [B, H, T, S]
            scores += jnp.einsum("bthr,bsr->bhts", q_rope, cached_rope.astype(acc))  # [B, H, T, S]
            weights = masked_softmax(scores * softmax_scale(c), visible[:, None])  # [B, H, T, S]
            out = jnp.einsum("bhts,bshv->bthv", weights, v)  # [B, T, H, V]
        out = out.reshape(batch, num_new, heads * v_dim).astype(x.dtype)  # [B, T, H V]
        return self.o_proj(out), cache

    def _rope(self, x: Float[Array, "B T M R"], positions: Int[Array, "B T"]) -> Float[Array, "B T M R"]:
        """RoPE on the rope part [B, T, M, R]; interleaved pairs (x0, x1), (x2, x3), ... are first
        permuted to rotate-half order [x0, x2, ..., x1, x3, ...], as `transformers` does when
        `rope_interleave` (the result stays in that order, for queries and keys alike)."""
        if self.config.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)  # [B, T, M, R]
        return apply_rope(x, positions, self.config, dim=self.config.qk_rope_head_dim)

    def _absorbed_weights(self, dtype) -> tuple[Float[Array, "C H N"], Float[Array, "C H V"]]:
        """kv_b_proj's kernel (dequantized when FP8) split per head into W_UK [C, H, N] and W_UV [C, H, V],
        in `dtype`."""
        c = self.config
        nope = c.qk_nope_head_dim
        kernel = compute_kernel(self.kv_b_proj, dtype)  # [C, H (N + V)]
        kernel = kernel.reshape(c.kv_lora_rank, c.num_attention_heads, nope + c.v_head_dim)  # [C, H, N + V]
        return kernel[..., :nope], kernel[..., nope:]


def absorbed_attention(
    q_latent: Float[Array, "B T H C"],
    q_rope: Float[Array, "B T H R"],
    positions: Int[Array, "B T"],
    cache: MLACache | PagedCache,
    *,
    scale: float,
    impl: str,
) -> Float[Array, "B T H C"]:
    """Absorbed MLA attention's weighted sum of latents (arXiv 2405.04434 §2.1.2): query t of row b weighs
    cache position s <= positions[b, t] by softmax_s(scale (q_latent . latent_s + q_rope . k_rope_s)) and
    sums the latents; a query that sees nothing gets zeros.

    `cache` is written already (its new entries at `positions`, int32 [B, T], contiguous per row). A bound
    `PagedCache` whose operands `mtp_jax.layers.attention.use_paged_kernel` takes (`impl` "pallas" /
    "pallas_interpret", or "auto" on a GPU; no sharded mesh; page size a power of two >= 16, C a power of
    two >= 16, R a multiple of 16, the T x H query rows within one kernel tile: `supports_paged`) runs
    `pallas_kernels.paged_verify_attention` with one KV head: queries `[q_latent, q_rope]` cast to the
    pools' dtype, the latent pool [N, P, 1, C] as keys and values, the rope-key pool [N, P, 1, R] as the
    second key pool, both read in place through the block table; the result is in the pools' dtype,
    accumulated in float32. Otherwise plain jnp over the cache (a paged one gathered, `dense_view`), in
    the queries' dtype (float32 or wider). Raises ValueError for an unknown `impl`.
    """
    if isinstance(cache, PagedCache):
        pool, table = cache.pool, cache.block_table
        q = jnp.concatenate([q_latent, q_rope], axis=-1).astype(pool.latent.dtype)  # [B, T, H, C + R]
        latent_pages, rope_pages = pool.latent[:, :, None], pool.k_rope[:, :, None]  # [N, P, 1, C], [N, P, 1, R]
        lengths = positions[:, -1] + 1  # entries per row, the T new ones included
        if use_paged_kernel(impl, q, latent_pages, None, table, lengths, k_rope_pages=rope_pages):
            from pallas_kernels.paged_attention import paged_verify_attention

            interpret = impl == "pallas_interpret"
            return paged_verify_attention(
                q, latent_pages, None, table, lengths, k_rope_pages=rope_pages, scale=scale, interpret=interpret
            )  # [B, T, H, C]
    live_latent, cached_rope, visible = _live_entries(dense_view(cache), positions)  # [B, S, C], [B, S, R], [B, T, S]
    return _latent_weighted_sum(q_latent, q_rope, live_latent, cached_rope, visible, scale=scale)  # [B, T, H, C]


def _latent_weighted_sum(
    q_latent: Float[Array, "B T H C"],
    q_rope: Float[Array, "B T H R"],
    latent: Float[Array, "B S C"],
    k_rope: Float[Array, "B S R"],
    visible: Bool[Array, "B T S"],
    *,
    scale: float,
) -> Float[Array, "B T H C"]:
    """Plain-jnp absorbed attention over given entries: softmax_s(scale (q_latent . latent_s + q_rope .
    k_rope_s)) where `visible` (a query that sees nothing gets zeros), weighting the latents; in the
    queries' dtype. Entries must be finite (stale ones zeroed: `_live_entries`)."""
    latent, k_rope = latent.astype(q_latent.dtype), k_rope.astype(q_rope.dtype)
    scores = jnp.einsum("bthc,bsc->bhts", q_latent, latent)  # [B, H, T, S]
    scores += jnp.einsum("bthr,bsr->bhts", q_rope, k_rope)  # [B, H, T, S]
    weights = masked_softmax(scores * scale, visible[:, None])  # [B, H, T, S]
    return jnp.einsum("bhts,bsc->bthc", weights, latent)  # [B, T, H, C]


def _live_entries(
    view: MLACache, positions: Int[Array, "B T"]
) -> tuple[Float[Array, "B S C"], Float[Array, "B S R"], Bool[Array, "B T S"]]:
    """The dense cache's latents and rope keys with row b's entries past positions[b, -1] zeroed (stale, NaN
    there included: zeroed before any matmul), and the causal mask: query t sees s <= positions[b, t]."""
    s = jnp.arange(view.max_length)
    live = (s[None, :] <= positions[:, -1:])[:, :, None]  # [B, S, 1]
    visible = s[None, None, :] <= positions[:, :, None]  # [B, T, S]
    return jnp.where(live, view.latent, 0), jnp.where(live, view.k_rope, 0), visible
