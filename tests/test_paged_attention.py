"""The paged verify attention (`pallas_kernels.paged_attention`) against dense attention on the same cache.

A dense cache [B, S, G, D] is cut into pages of P positions, dealt to shuffled page ids of a pool
whose every other slot (unowned pages, owned pages past a row's length) holds NaN, with sentinel ids
in each table's unused tail; reference and kernel must equal `verify_attention_reference` on the
dense cache (for MLA's two pools, latent and rope key: on keys [latent, rope], values the latent). The
kernel runs in Pallas' interpreter on CPU; `test_lowers_for_cuda` lowers it for CUDA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from pallas_kernels import PagedAttentionConfig, paged_attention_reference, paged_verify_attention, supports_paged
from pallas_kernels import verify_attention_reference as dense_reference

PAGE = 16  # the smallest page the kernel takes
# Jitted: one compile per shape rather than one per op.
verify_attention_reference = jax.jit(dense_reference, static_argnames="scale")
paged_reference = jax.jit(paged_attention_reference, static_argnames="scale")
# Three splits of a row's pages, whatever B and G: rows of 1 to 4 pages leave some splits empty.
kernel = functools.partial(
    paged_verify_attention,
    config=PagedAttentionConfig(max_splits=3, target_programs=1024, min_split_len=PAGE, num_stages=1),
    interpret=True,
)


def paginate(rng, dense: np.ndarray, lengths: list[int], spare: int):
    """Cut a dense cache [B, S, G, E] (S = W * PAGE) into a pool [N, PAGE, G, E] and a table int32 [B, W].

    Row b owns cdiv(lengths[b], PAGE) pages at shuffled ids among N = (owned pages + spare); positions
    past its length in them, and the spare pages, hold NaN; table entries past the owned pages hold
    sentinel ids >= N (N itself, or N + 1000).
    """
    batch, cache_len, kv_heads, dim = dense.shape
    width = cache_len // PAGE
    owned = [-(-length // PAGE) for length in lengths]
    ids = rng.permutation(sum(owned) + spare)
    pool = np.full((len(ids), PAGE, kv_heads, dim), np.nan, dense.dtype)
    table = np.full((batch, width), len(ids) + 1000 * (np.arange(batch)[:, None] % 2), np.int32)
    start = 0
    for b, length in enumerate(lengths):
        table[b, : owned[b]] = ids[start : start + owned[b]]
        start += owned[b]
        for s in range(length):
            pool[table[b, s // PAGE], s % PAGE] = dense[b, s]
    return pool, table


def make_case(seed, num_queries, group, kv_heads, key_dim, value_dim, lengths, dtype):
    """q [B, T, H, D], dense k, v [B, S, G, D / Dv] (S = 4 pages) and their paged form (k and v pages
    share ids), all in `dtype`."""
    rng = np.random.default_rng(seed)
    batch, cache_len = len(lengths), 4 * PAGE
    q = rng.standard_normal((batch, num_queries, group * kv_heads, key_dim)).astype(np.float32)
    k = rng.standard_normal((batch, cache_len, kv_heads, key_dim)).astype(np.float32)
    v = rng.standard_normal((batch, cache_len, kv_heads, value_dim)).astype(np.float32)
    k_pages, table = paginate(np.random.default_rng(seed + 1), k, lengths, spare=3)
    v_pages, same_table = paginate(np.random.default_rng(seed + 1), v, lengths, spare=3)
    assert (table == same_table).all()
    dense = [jnp.asarray(x, dtype) for x in (q, k, v)]
    paged = [jnp.asarray(x, dtype) for x in (k_pages, v_pages)]
    return dense, paged, jnp.asarray(table), jnp.asarray(lengths, jnp.int32)


# Lengths cross page boundaries (P - 1, P, P + 1, 3P + 2) and one row holds only its T new tokens.
LENGTHS = [PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 2]


@pytest.mark.parametrize(
    "num_queries,group,dtype,tol",
    [(1, 1, jnp.float32, 2e-5), (4, 4, jnp.float32, 2e-5), (4, 1, jnp.bfloat16, 2.5e-2)],
)
def test_matches_dense_attention(num_queries, group, dtype, tol):
    lengths = [*LENGTHS, num_queries]
    (q, k, v), (k_pages, v_pages), table, lengths = make_case(
        num_queries, num_queries, group, 2, 16, 16, lengths, dtype
    )
    assert bool(jnp.isnan(k_pages).any()) and bool(jnp.isnan(v_pages).any())
    scale = 0.3 if num_queries == 4 else None
    expected = np.asarray(verify_attention_reference(q, k, v, lengths, scale=scale)).astype(np.float32)
    ref = paged_reference(q, k_pages, v_pages, table, lengths, scale=scale)
    assert ref.shape == q.shape and ref.dtype == dtype
    np.testing.assert_allclose(np.asarray(ref).astype(np.float32), expected, atol=1e-6, rtol=1e-6)
    assert supports_paged(q, k_pages, v_pages, table, lengths)
    out = np.asarray(kernel(q, k_pages, v_pages, table, lengths, scale=scale)).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, atol=tol, rtol=tol)


def test_mla_absorbed_value_dim():
    """DeepSeek MLA's absorbed attention: G = 1, keys [latent C, rope R] of D = C + R = 48 (read in
    slices of 32 and 16), values the latent of Dv = C = 32."""
    (q, k, v), (k_pages, v_pages), table, lengths = make_case(7, 2, 8, 1, 48, 32, [2, *LENGTHS], jnp.float32)
    v = k[..., :32]  # the values are the keys' latent part
    v_pages = k_pages[..., :32]
    expected = np.asarray(verify_attention_reference(q, k, v, lengths, scale=0.2))
    assert expected.shape == (5, 2, 8, 32)
    ref = paged_reference(q, k_pages, v_pages, table, lengths, scale=0.2)
    np.testing.assert_allclose(np.asarray(ref), expected, atol=1e-6, rtol=1e-6)
    out = kernel(q, k_pages, v_pages, table, lengths, scale=0.2)
    assert out.shape == (5, 2, 8, 32) and bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "num_queries,heads,latent_dim,dtype,tol",
    [(1, 8, 64, jnp.float32, 2e-5), (4, 4, 32, jnp.bfloat16, 2.5e-2)],
)
def test_mla_latent_and_rope_pools(num_queries, heads, latent_dim, dtype, tol):
    """DeepSeek MLA's absorbed attention with its two pools read in place: G = 1, keys the latent pool
    [N, P, 1, C] (also the values: `v_pages` None) and the rope-key pool [N, P, 1, R = 16] as
    `k_rope_pages`, queries [q_latent, q_rope] of C + R; equals dense attention with keys [latent, rope]."""
    rope_dim, lengths = 16, [num_queries, *LENGTHS]
    (q, k, _), (k_pages, _), table, lengths = make_case(
        11 + num_queries, num_queries, heads, 1, latent_dim + rope_dim, 16, lengths, dtype
    )
    latent_pages, rope_pages = k_pages[..., :latent_dim], k_pages[..., latent_dim:]  # two pools, as MLACache's
    assert bool(jnp.isnan(latent_pages).any()) and bool(jnp.isnan(rope_pages).any())
    expected = verify_attention_reference(q, k, k[..., :latent_dim], lengths, scale=0.15)
    expected = np.asarray(expected).astype(np.float32)
    assert expected.shape == (5, num_queries, heads, latent_dim)
    ref = paged_reference(q, latent_pages, None, table, lengths, k_rope_pages=rope_pages, scale=0.15)
    np.testing.assert_allclose(np.asarray(ref).astype(np.float32), expected, atol=1e-6, rtol=1e-6)
    assert supports_paged(q, latent_pages, None, table, lengths, k_rope_pages=rope_pages)
    out = kernel(q, latent_pages, None, table, lengths, k_rope_pages=rope_pages, scale=0.15)
    assert out.shape == expected.shape and out.dtype == dtype and bool(jnp.isfinite(out).all())
    np.testing.assert_allclose(np.asarray(out).astype(np.float32), expected, atol=tol, rtol=tol)


def test_edge_lengths_and_foreign_pages():
    """Lengths past W * P keep the causal alignment, as the dense reference does; lengths <= 0 see
    nothing; a sentinel id inside a row's length reads as zeros and never clamps onto page N - 1."""
    (q, k, v), (k_pages, v_pages), table, _ = make_case(3, 4, 1, 2, 16, 16, [4 * PAGE] * 3, jnp.float32)
    k_pages = jnp.concatenate([k_pages, jnp.full_like(k_pages[:1], jnp.nan)])  # page N - 1: NaN, owned by nobody
    v_pages = jnp.concatenate([v_pages, jnp.full_like(v_pages[:1], jnp.nan)])
    lengths = jnp.array([4 * PAGE + 2, -5, 3 * PAGE], jnp.int32)
    expected = np.asarray(verify_attention_reference(q, k, v, lengths))
    out = np.asarray(kernel(q, k_pages, v_pages, table, lengths))
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[1], 0.0)
    holes = table.at[2, 1].set(k_pages.shape[0] + 5)  # row 2 loses its second page to a sentinel
    zeroed_k, zeroed_v = k.at[2, PAGE : 2 * PAGE].set(0), v.at[2, PAGE : 2 * PAGE].set(0)
    expected = np.asarray(verify_attention_reference(q, zeroed_k, zeroed_v, lengths))
    ref = np.asarray(paged_reference(q, k_pages, v_pages, holes, lengths))
    np.testing.assert_allclose(ref, expected, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(kernel(q, k_pages, v_pages, holes, lengths)), expected, atol=2e-5, rtol=2e-5)


def _abstract_gpu_mesh() -> AbstractMesh:
    # jax 0.11 reads the target GPU from the abstract mesh when no GPU is attached; jax 0.10 lowers for sm_90.
    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=gpu)


@pytest.mark.parametrize(
    "q_shape,page_shape,value_dim,rope_dim,dtype",
    [
        ((2, 4, 32, 128), (64, 16, 8, 128), 128, 0, jnp.bfloat16),  # GQA, group 4, fp32 below
        ((2, 4, 32, 128), (64, 16, 8, 128), 128, 0, jnp.float32),
        ((2, 2, 16, 576), (64, 32, 1, 576), 512, 0, jnp.bfloat16),  # MLA absorbed, one pool: D = 512 + 64, Dv = 512
        ((2, 2, 16, 576), (64, 32, 1, 512), None, 64, jnp.bfloat16),  # MLA's latent pool (keys, values) + rope pool
    ],
)
def test_lowers_for_cuda(q_shape, page_shape, value_dim, rope_dim, dtype):
    """The Triton kernel lowers to a CUDA custom call without a GPU."""
    pages = lambda dim: jax.ShapeDtypeStruct((*page_shape[:3], dim), dtype)  # noqa: E731
    q, k_pages = jax.ShapeDtypeStruct(q_shape, dtype), pages(page_shape[3])
    v_pages = None if value_dim is None else pages(value_dim)
    k_rope_pages = pages(rope_dim) if rope_dim else None
    table, lengths = jax.ShapeDtypeStruct((2, 8), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32)
    assert supports_paged(q, k_pages, v_pages, table, lengths, k_rope_pages=k_rope_pages)
    # The Triton call is not in jax.export's list of stable custom calls: allow it explicitly.
    allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with use_abstract_mesh(_abstract_gpu_mesh()):
        exported = export.export(jax.jit(paged_verify_attention), platforms=["cuda"], disabled_checks=allow)(
            q, k_pages, v_pages, table, lengths, k_rope_pages=k_rope_pages
        )
    value_dim = page_shape[3] if value_dim is None else value_dim
    assert exported.out_avals[0].shape == (*q_shape[:3], value_dim) and exported.out_avals[0].dtype == dtype
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_bad_arguments_raise():
    (q, _, _), (k_pages, v_pages), table, lengths = make_case(5, 1, 2, 2, 16, 16, [5, 20], jnp.float32)
    bad = {
        "q": (q[0], k_pages, v_pages, table, lengths),
        "k_pages": (q, k_pages[0], v_pages, table, lengths),
        "v_pages": (q, k_pages, v_pages[:, :8], table, lengths),
        "H = 4 is not a multiple": (q, k_pages[:, :, :1].repeat(3, 2), v_pages[:, :, :1].repeat(3, 2), table, lengths),
        "block_table": (q, k_pages, v_pages, table.astype(jnp.int16), lengths),
        "block_table must be int32": (q, k_pages, v_pages, table[:1], lengths),
        "lengths": (q, k_pages, v_pages, table, lengths[:1]),
    }
    for name, args in bad.items():
        assert not supports_paged(*args)
        for fn in (paged_attention_reference, kernel):
            with pytest.raises(ValueError, match=name):
                fn(*args)
    # Valid operands the kernel does not take: pages of 8, D not a multiple of 16, mixed dtypes.
    unsupported = {
        "page size": (q, k_pages[:, :8], v_pages[:, :8], table, lengths),
        "D = 24": (q[..., :8].repeat(3, -1), k_pages[..., :8].repeat(3, -1), v_pages, table, lengths),
        "dtype": (q, k_pages.astype(jnp.bfloat16), v_pages, table, lengths),
    }
    for reason, args in unsupported.items():
        assert not supports_paged(*args)
        with pytest.raises(ValueError, match=reason):
            kernel(*args)
        assert jax.eval_shape(paged_attention_reference, *args).shape == (*q.shape[:3], 16)  # the reference takes them
    # A rope-key pool: its N, P, G must be k_pages', and q's head dim D + R.
    rope = k_pages[..., :16]
    for name, args in {
        "k_rope_pages": (q, k_pages, v_pages, table, lengths, rope[:, :8]),
        "k_pages' D \\+ k_rope_pages' R": (q, k_pages, v_pages, table, lengths, rope),
    }.items():
        assert not supports_paged(*args[:5], k_rope_pages=args[5])
        for fn in (paged_attention_reference, kernel):
            with pytest.raises(ValueError, match=name):
                fn(*args[:5], k_rope_pages=args[5])
    q_rope = jnp.concatenate([q, q[..., :8]], axis=-1)  # [B, T, H, 16 + 8]
    assert not supports_paged(q_rope, k_pages, None, table, lengths, k_rope_pages=rope[..., :8])
    with pytest.raises(ValueError, match="R = 8"):
        kernel(q_rope, k_pages, None, table, lengths, k_rope_pages=rope[..., :8])
    with pytest.raises(ValueError, match="num_warps"):
        PagedAttentionConfig(num_warps=3)
    with pytest.raises(ValueError, match="max_splits"):
        PagedAttentionConfig(max_splits=0)
