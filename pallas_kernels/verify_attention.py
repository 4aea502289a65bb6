"""Attention of the verify pass: T = K + 1 new queries per row against a long KV cache.

`verify_attention` computes exactly what `verify_attention_reference` (`pallas_kernels.
attention_reference`) computes, as a GPU kernel: grouped-query attention with per-row lengths
that include the T new tokens and a causal mask aligned to the end of each row (query t of row b
sees cache positions `< lengths[b] - T + t + 1`). Stale entries at or past `lengths[b]` are never
read, so NaN there cannot leak, and a query with nothing to attend to returns zeros.

The work is memory-bound: each row's K and V are read once, at full bandwidth. All T x group
queries of one KV head share one [M, D] tile, so a [block_s, D] block of K or V is loaded once per
KV head, not once per query head or per new token. The cache is cut into splits
(flash-decoding, Dao et al. 2023) so that small batches still fill the GPU; the per-split
partials are merged by a log-sum-exp combine in float32.

The kernel is written against a backend-neutral `partials` signature (see
`verify_attention_triton.partials`): "triton" (Pallas' Triton lowering, jax 0.10 and 0.11) today;
a Mosaic GPU variant for Hopper can register under another name and share this wrapper and its
tests.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import verify_attention_triton
from pallas_kernels.attention_reference import verify_attention_reference

__all__ = ["PRESETS", "VerifyAttentionConfig", "supports", "verify_attention", "verify_attention_reference"]

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
BACKENDS = {"triton": verify_attention_triton.partials}
# Bytes of pipelined K/V blocks per program: leaves room for the query tile within the 164 KiB
# (A100) to 227 KiB (H100/H200) of shared memory a thread block may use.
SHARED_MEMORY_BUDGET = 128 * 1024
# Query rows of one program's tile (T new tokens x the H/G query heads of one KV head): the [M, D]
# float32 accumulator and the [M, block_s] scores live in registers, which hold 128 x 128 at most
# without spilling. A verify pass (T = K + 1 <= 17) fits for groups up to 7 and K <= 15 at group 8;
# a long prefill does not, and `attend` gives it to the reference.
MAX_QUERY_ROWS = 128
MAX_HEAD_DIM = 256  # the [M, D] query tile and two [block_s, D] K/V blocks in shared memory


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class VerifyAttentionConfig:
    """Static tuning parameters of `verify_attention` (hashable, so usable as a jit static arg).

    block_s: cache positions per K/V block (a power of two >= 16, as `tl.dot` needs).
    max_splits: most splits of one row's cache (split-K); the grid is (B, G, splits).
    target_programs: split until B * G * splits reaches this many programs (enough to fill the
      GPU several times over), within `max_splits` and `min_split_len`.
    min_split_len: never give a split fewer than this many cache positions (a multiple of
      block_s), since each split costs an extra [M, D] partial in HBM.
    num_warps, num_stages: Triton launch parameters (warps per program, software pipeline depth;
      `pipeline_stages` lowers the depth where the K and V blocks would overflow shared memory).
    """

    block_s: int = 64
    max_splits: int = 64
    target_programs: int = 1024
    min_split_len: int = 256
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if not isinstance(self.block_s, int) or not _is_power_of_two(self.block_s) or self.block_s < 16:
            raise ValueError(f"block_s must be a power of two >= 16, got {self.block_s!r}")
        for name in ("max_splits", "target_programs", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if (
            not isinstance(self.min_split_len, int)
            or self.min_split_len < self.block_s
            or self.min_split_len % self.block_s
        ):
            raise ValueError(
                f"min_split_len must be a positive multiple of block_s={self.block_s}, got {self.min_split_len!r}"
            )
        if not isinstance(self.num_warps, int) or not _is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"num_warps must be a power of two in [1, 32], got {self.num_warps!r}")

    def num_splits(self, batch: int, kv_heads: int, cache_len: int) -> int:
        """Splits per (row, KV head) for a [B, S, G, D] cache: >= 1, <= max_splits."""
        wanted = -(-self.target_programs // (batch * kv_heads))
        useful = -(-cache_len // self.min_split_len)
        return max(1, min(self.max_splits, wanted, useful))

    def pipeline_stages(self, head_dim: int, itemsize: int) -> int:
        """num_stages, lowered until every stage's K and V blocks fit in `SHARED_MEMORY_BUDGET` bytes."""
        per_stage = 2 * self.block_s * head_dim * itemsize  # one K and one V block
        return max(1, min(self.num_stages, SHARED_MEMORY_BUDGET // per_stage))

    @classmethod
    def from_name(cls, name: str, **overrides) -> VerifyAttentionConfig:
        """A named preset (see `PRESETS`), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, VerifyAttentionConfig] = {
    # Any recent NVIDIA GPU: 2 x 16 KiB K/V blocks in flight per stage at D = 128, bf16.
    "default": VerifyAttentionConfig(),
    # Hopper (H100/H200, 132 SMs, 227 KiB shared memory): a deeper pipeline, 8 x 132 programs.
    "hopper": VerifyAttentionConfig(
        block_s=64, max_splits=64, target_programs=1056, min_split_len=256, num_warps=4, num_stages=3
    ),
    # Bigger blocks, 8 warps: fewer loop trips on long caches.
    "large_blocks": VerifyAttentionConfig(
        block_s=128, max_splits=32, target_programs=528, min_split_len=512, num_warps=8, num_stages=2
    ),
    # Smaller blocks and more programs: short caches or large D.
    "small_blocks": VerifyAttentionConfig(
        block_s=32, max_splits=128, target_programs=2048, min_split_len=128, num_warps=4, num_stages=3
    ),
    # CPU tests in interpret mode: tiny blocks so that short caches still take several blocks and splits.
    "interpret": VerifyAttentionConfig(
        block_s=16, max_splits=4, target_programs=8, min_split_len=16, num_warps=4, num_stages=1
    ),
}


def unsupported_reason(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> str | None:
    """Why the kernel cannot take these operands (shapes and dtypes only), or None if it can."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        return f"expected q [B, T, H, D] and k, v [B, S, G, D], got {q.shape}, {k.shape}, {v.shape}"
    batch, _, heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[3] != head_dim or lengths.shape != (batch,):
        return f"q {q.shape}, k/v {k.shape} and lengths {lengths.shape} disagree on B or D"
    if heads % k.shape[2]:
        return f"H = {heads} is not a multiple of G = {k.shape[2]}"
    if not _is_power_of_two(head_dim) or not 16 <= head_dim <= MAX_HEAD_DIM:
        return f"D = {head_dim} is not a power of two in [16, {MAX_HEAD_DIM}]"
    if q.shape[1] * (heads // k.shape[2]) > MAX_QUERY_ROWS:
        return (
            f"T x H/G = {q.shape[1]} x {heads // k.shape[2]} query rows exceed the {MAX_QUERY_ROWS} "
            "one program holds (a long prefill: use the reference)"
        )
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        return f"q, k, v must share one dtype among bfloat16, float16, float32, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        return f"lengths must be integers, got {lengths.dtype}"
    return None


def supports(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> bool:
    """True when `verify_attention` accepts these operands (so callers can fall back otherwise)."""
    return unsupported_reason(q, k, v, lengths) is None


def _combine(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """Merge split partials acc [B, G, splits, M, D], row max and sum [B, G, splits, M] into [B, G, M, D] float32."""
    peak = jnp.max(row_max, axis=2, keepdims=True)  # [B, G, 1, M]
    peak = jnp.where(peak == -jnp.inf, 0.0, peak)
    weight = jnp.exp(row_max - peak)  # [B, G, splits, M]; 0 for splits that saw nothing
    denom = jnp.sum(weight * row_sum, axis=2)  # [B, G, M]
    out = jnp.sum(weight[..., None] * acc, axis=2)  # [B, G, M, D]
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


@functools.partial(jax.jit, static_argnames=("scale", "config", "backend", "interpret"))
def verify_attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G D"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
    config: VerifyAttentionConfig | str = "default",
    backend: str = "triton",
    interpret: bool = False,
) -> Float[Array, "B T H D"]:
    """Causal grouped-query attention of T new queries per row against a KV cache, as a GPU kernel.

    Same contract as `verify_attention_reference`.

    Args:
      q: queries of shape [B, T, H, D]; bfloat16, float16 or float32.
      k, v: caches of shape [B, S, G, D] in q's dtype, H a multiple of G (query head h reads KV
        head h // (H / G)); D a power of two >= 16.
      lengths: int [B], valid entries per row including the T new tokens. A length past S (a
        verify window reaching past the capacity, whose writes there were dropped) keeps the causal
        alignment to the end of the row: query t sees `min(lengths[b] - T + t + 1, S)` entries,
        exactly as the reference.
      scale: softmax scale, default 1/sqrt(D).
      config: a `VerifyAttentionConfig` or the name of one of `PRESETS`.
      backend: "triton" (the only one so far).
      interpret: run the kernel in Pallas' interpreter (any backend, e.g. CPU tests).

    Returns:
      [B, T, H, D] in q's dtype; scores, softmax and the weighted sum accumulate in float32.

    Raises:
      ValueError: unsupported shapes or dtypes (see `supports`), an unknown preset or backend.
    """
    if (reason := unsupported_reason(q, k, v, lengths)) is not None:
        raise ValueError(f"verify_attention: {reason}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {backend!r}")
    if isinstance(config, str):
        config = VerifyAttentionConfig.from_name(config)
    batch, num_queries, heads, head_dim = q.shape
    cache_len, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = max(16, 1 << (num_queries * group - 1).bit_length())  # M: T * group padded to a power of two
    scale = head_dim**-0.5 if scale is None else scale

    q_tiles = q.reshape(batch, num_queries, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)  # [B, G, T, H/G, D]
    q_tiles = q_tiles.reshape(batch, kv_heads, num_queries * group, head_dim)  # [B, G, T*H/G, D]
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, rows - num_queries * group), (0, 0)))  # [B, G, M, D]
    acc, row_max, row_sum = BACKENDS[backend](
        q_tiles,
        k,
        v,
        lengths.astype(jnp.int32),
        num_queries=num_queries,
        group=group,
        scale=float(scale),
        block_s=config.block_s,
        num_splits=config.num_splits(batch, kv_heads, cache_len),
        num_warps=config.num_warps,
        num_stages=config.pipeline_stages(head_dim, q.dtype.itemsize),
        interpret=interpret,
    )
    out = _combine(acc, row_max, row_sum)[:, :, : num_queries * group]  # [B, G, T*H/G, D]
    out = out.reshape(batch, kv_heads, num_queries, group, head_dim).transpose(0, 2, 1, 3, 4)  # [B, T, G, H/G, D]
    return out.reshape(batch, num_queries, heads, head_dim).astype(q.dtype)  # [B, T, H, D]
