"""The verify-pass attention kernel (`pallas_kernels.verify_attention`) against a float64 oracle.

On CPU the kernel runs in Pallas' interpreter (`interpret=True`); `test_lowers_for_cuda` lowers the
real Triton kernel for CUDA without a GPU, so a lowering error fails here rather than on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

from mtp_jax.cache import KVCache, fill_stale
from mtp_jax.config import ATTENTION_IMPLS, ModelConfig
from mtp_jax.layers.attention import attend, attention_reference, segment_attention_reference
from mtp_jax.model import init_model, sequence_positions
from pallas_kernels import PRESETS, VerifyAttentionConfig, supports, verify_attention

TOLERANCES = {jnp.float32: 2e-5, jnp.float16: 3e-3, jnp.bfloat16: 2.5e-2}  # atol = rtol, per input dtype
kernel = functools.partial(verify_attention, config="interpret", interpret=True)


def reference_f64(q, k, v, lengths, scale: float, weights_dtype=None) -> np.ndarray:
    """The attention of `pallas_kernels.attention_reference`'s docstring, query by query in numpy float64;
    with `weights_dtype`, the normalised softmax weights rounded to it before the weighted sum."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, num_queries, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros(q.shape)
    for b in range(batch):
        for t in range(num_queries):
            seen = min(int(lengths[b]) - num_queries + t + 1, int(lengths[b]), k.shape[1])
            for h in range(heads if seen > 0 else 0):
                scores = k[b, :seen, h // group] @ q[b, t, h] * scale  # [seen]
                weights = np.exp(scores - scores.max())
                weights = weights / weights.sum()
                if weights_dtype is not None:
                    weights = np.asarray(weights.astype(weights_dtype)).astype(np.float64)
                out[b, t, h] = weights @ v[b, :seen, h // group]
    return out


def make_inputs(seed, batch, num_queries, heads, kv_heads, head_dim, cache_len, lengths, dtype):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, num_queries, heads, head_dim)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, cache_len, kv_heads, head_dim)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, cache_len, kv_heads, head_dim)), dtype)
    return q, k, v, jnp.asarray(lengths, jnp.int32)


# (B, T, group, G, D, S, dtype): every T in 1..8, B in {1, 3}, group in {1, 4, 8}, every dtype, S never a
# multiple of the interpret preset's block_s = 16, without the full cartesian product.
CASES = [
    (1, 1, 4, 2, 16, 37, jnp.float32),
    (3, 2, 1, 2, 32, 50, jnp.bfloat16),
    (1, 3, 8, 1, 16, 61, jnp.float16),
    (3, 4, 4, 2, 16, 45, jnp.float32),
    (3, 5, 8, 2, 16, 33, jnp.bfloat16),
    (1, 6, 1, 4, 32, 70, jnp.float32),
    (3, 7, 4, 1, 16, 29, jnp.float16),
    (1, 8, 8, 2, 16, 53, jnp.bfloat16),
    (3, 8, 1, 2, 16, 40, jnp.float32),
    (3, 1, 8, 2, 32, 66, jnp.float16),
]


@pytest.mark.parametrize("batch,num_queries,group,kv_heads,head_dim,cache_len,dtype", CASES)
def test_matches_float64_reference(batch, num_queries, group, kv_heads, head_dim, cache_len, dtype):
    rng = np.random.default_rng(cache_len)
    # Lengths include T (only the new tokens), S (a full cache) and random values in between.
    choices = [num_queries, cache_len, int(rng.integers(num_queries, cache_len))]
    lengths = choices if batch == 3 else [choices[(num_queries + 1) % 3]]
    q, k, v, lengths = make_inputs(
        num_queries, batch, num_queries, group * kv_heads, kv_heads, head_dim, cache_len, lengths, dtype
    )
    scale = 0.7 / np.sqrt(head_dim) if num_queries % 2 else None
    out = kernel(q, k, v, lengths, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = reference_f64(q, k, v, lengths, head_dim**-0.5 if scale is None else scale)
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, atol=tol, rtol=tol)
    # The plain-jnp reference the model uses elsewhere agrees with the same oracle.
    ref = attention_reference(q, k, v, lengths, scale=scale)
    np.testing.assert_allclose(np.asarray(ref).astype(np.float64), expected, atol=tol, rtol=tol)


def _dots(jaxpr) -> list:
    """Every dot_general equation of a jaxpr, nested jaxprs (einsum's jit) included."""
    found = []
    for eqn in jaxpr.eqns:
        found += [eqn] if eqn.primitive.name == "dot_general" else []
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            found += _dots(inner) if hasattr(inner, "eqns") else []
    return found


def test_half_precision_operands_match_the_oracle_and_ignore_stale_nan():
    # bf16 q, k, v: both products on the bf16 operands accumulated in float32 (no float32 copy of the cache),
    # the weights rounded to bf16 before the weighted sum; stale NaN still changes nothing.
    q, k, v, lengths = make_inputs(5, 2, 3, 8, 2, 16, 40, [40, 17], jnp.bfloat16)
    out = attention_reference(q, k, v, lengths)
    assert out.dtype == jnp.bfloat16
    dots = _dots(jax.make_jaxpr(attention_reference)(q, k, v, lengths).jaxpr)
    assert len(dots) == 2
    for dot in dots:
        assert [x.aval.dtype for x in dot.invars] == [jnp.bfloat16] * 2
        assert dot.params["preferred_element_type"] == jnp.float32
    # Training's attention keeps float32 operands (weights and their gradients unrounded).
    segments = jnp.zeros(q.shape[:2], jnp.int32)
    training = _dots(jax.make_jaxpr(segment_attention_reference)(q, k[:, :3], v[:, :3], segments).jaxpr)
    assert [x.aval.dtype for dot in training for x in dot.invars] == [jnp.float32] * 4
    expected = reference_f64(q, k, v, lengths, 16**-0.5, weights_dtype=jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, atol=8e-3, rtol=8e-3)
    nan = fill_stale(KVCache(k=k, v=v), lengths, jnp.nan)
    np.testing.assert_array_equal(np.asarray(attention_reference(q, nan.k, nan.v, lengths)), np.asarray(out))


def test_stale_nan_changes_nothing():
    q, k, v, lengths = make_inputs(1, 3, 4, 8, 2, 16, 45, [4, 45, 19], jnp.float32)
    nan = fill_stale(KVCache(k=k, v=v), lengths, jnp.nan)
    out = kernel(q, nan.k, nan.v, lengths)
    assert bool(jnp.isnan(nan.k).any())
    np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel(q, k, v, lengths)))
    np.testing.assert_allclose(np.asarray(out), reference_f64(q, k, v, lengths, 16**-0.5), atol=2e-5, rtol=2e-5)


def test_nothing_to_attend_gives_zeros():
    # Row 0 holds no entries at all; in row 1 (length 1 < T = 3) only the last query sees anything.
    q, k, v, lengths = make_inputs(2, 2, 3, 4, 2, 16, 10, [0, 1], jnp.bfloat16)  # S = 10 < block_s
    k, v = k.at[:, 1:].set(jnp.nan), v.at[:, 1:].set(jnp.nan)
    out = np.asarray(kernel(q, k, v, lengths)).astype(np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[1, :2], 0.0)
    np.testing.assert_allclose(out[1, 2], np.repeat(np.asarray(v[1, 0]).astype(np.float32), 2, axis=0), atol=1e-2)


@pytest.mark.parametrize("group", [1, 4])
def test_lengths_past_capacity_and_negative_match_the_reference(group):
    """A verify window that reaches past the capacity (lengths[b] > S: its writes there were dropped) keeps
    the causal alignment to the end of the row: query t sees min(L - T + t + 1, S) entries, as the
    reference and the float64 oracle do; a negative length sees nothing. S = 24 is not a multiple of
    block_s = 16, so the last block reaches past S."""
    q, k, v, _ = make_inputs(3, 5, 4, 2 * group, 2, 16, 24, [0] * 5, jnp.float32)
    lengths = jnp.array([25, 27, 99, -3, 24], jnp.int32)  # T = 4: L = 27 is the last length with a visible query
    out = np.asarray(kernel(q, k, v, lengths))
    expected = reference_f64(q, k, v, lengths, 16**-0.5)
    np.testing.assert_allclose(out, expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(attention_reference(q, k, v, lengths)), expected, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(out[3], 0.0)
    assert not np.allclose(out[0], np.asarray(kernel(q, k, v, jnp.array([24] * 5)))[0])  # not clamped to S


def test_every_split_count_agrees():
    q, k, v, lengths = make_inputs(4, 1, 3, 4, 1, 16, 100, [77], jnp.float32)
    expected = reference_f64(q, k, v, lengths, 0.25)
    for splits in (1, 7):  # 7 splits of 5 blocks: two splits see nothing
        config = VerifyAttentionConfig(block_s=16, max_splits=splits, target_programs=64, min_split_len=16)
        assert config.num_splits(1, 1, 100) == splits
        out = verify_attention(q, k, v, lengths, config=config, interpret=True)
        np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5, rtol=2e-5)


def _abstract_gpu_mesh() -> AbstractMesh:
    # jax 0.11 reads the target GPU (and so the compute capability) from the abstract mesh when no GPU
    # is attached; jax 0.10 ignores it and lowers for sm_90.
    gpu = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    return AbstractMesh((1,), ("x",), abstract_device=gpu)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_lowers_for_cuda(preset, dtype):
    """The Triton kernel lowers to a CUDA custom call without a GPU, for every preset and dtype."""
    shapes = [((2, 4, 32, 128), dtype), ((2, 1000, 8, 128), dtype), ((2, 1000, 8, 128), dtype), ((2,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    fn = jax.jit(functools.partial(verify_attention, config=preset))
    # The Triton call is not in jax.export's list of stable custom calls: allow it explicitly.
    allow = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with use_abstract_mesh(_abstract_gpu_mesh()):
        exported = export.export(fn, platforms=["cuda"], disabled_checks=allow)(*args)
    assert exported.platforms == ("cuda",)
    assert exported.out_avals[0].shape == (2, 4, 32, 128) and exported.out_avals[0].dtype == dtype
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


def test_config_validation_and_presets():
    for name, config in PRESETS.items():
        assert VerifyAttentionConfig.from_name(name) == config
        assert hash(config)
    with pytest.raises(ValueError, match="block_s"):
        VerifyAttentionConfig(block_s=48)
    with pytest.raises(ValueError, match="min_split_len"):
        VerifyAttentionConfig(block_s=64, min_split_len=100)
    with pytest.raises(ValueError, match="num_warps"):
        VerifyAttentionConfig(num_warps=3)
    with pytest.raises(ValueError, match="unknown preset"):
        VerifyAttentionConfig.from_name("nope")
    # Split-K: enough programs for the GPU, never more than the cache allows.
    config = PRESETS["default"]
    assert config.num_splits(1, 8, 32768) == config.max_splits
    assert config.num_splits(32, 8, 32768) == 4
    assert config.num_splits(1, 8, 100) == 1
    assert dataclasses.replace(config, max_splits=1).num_splits(1, 1, 1 << 20) == 1
    # Pipeline depth: lowered where the K and V blocks of every stage would not fit in shared memory.
    hopper = PRESETS["hopper"]
    assert hopper.pipeline_stages(128, 2) == 3 and hopper.pipeline_stages(128, 4) == 2
    assert hopper.pipeline_stages(256, 4) == 1


def test_unsupported_operands_raise():
    q, k, v, lengths = make_inputs(5, 1, 2, 4, 2, 24, 20, [20], jnp.float32)
    assert not supports(q, k, v, lengths)
    with pytest.raises(ValueError, match="power of two"):
        kernel(q, k, v, lengths)
    q, k, v, lengths = make_inputs(5, 1, 2, 4, 2, 16, 20, [20], jnp.float32)
    assert supports(q, k, v, lengths)
    with pytest.raises(ValueError, match="dtype"):
        kernel(q, k.astype(jnp.bfloat16), v, lengths)
    with pytest.raises(ValueError, match="backend"):
        verify_attention(q, k, v, lengths, backend="cuda", interpret=True)


def test_attend_dispatch():
    q, k, v, lengths = make_inputs(6, 2, 3, 4, 2, 16, 30, [3, 25], jnp.float32)
    expected = attention_reference(q, k, v, lengths, scale=0.3)
    if jax.default_backend() != "gpu":  # "auto" means the reference here (on a GPU, the kernel: checked below)
        np.testing.assert_array_equal(np.asarray(attend(q, k, v, lengths, scale=0.3)), np.asarray(expected))
    else:
        np.testing.assert_allclose(
            np.asarray(attend(q, k, v, lengths, scale=0.3)), np.asarray(expected), atol=2e-5, rtol=2e-5
        )
    out = attend(q, k, v, lengths, scale=0.3, impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="impl"):
        attend(q, k, v, lengths, impl="flash")
    assert set(ATTENTION_IMPLS) == {"auto", "reference", "pallas", "pallas_interpret"}


def test_model_config_attention_impl():
    assert ModelConfig.from_name("tiny").attention_impl == "auto"
    with pytest.raises(ValueError, match="attention_impl"):
        ModelConfig.from_name("tiny", attention_impl="flash")


def test_model_logits_match_reference():
    """A T = 4 verify step over a filled cache (rows of different lengths): kernel logits == reference logits."""
    config = ModelConfig.from_name("tiny")
    shape = (2, 24, config.num_key_value_heads, config.resolved_head_dim)  # [B, S, G, D]
    keys = jax.random.split(jax.random.key(0), 2 * config.num_hidden_layers + 1)
    kv = [jax.random.normal(key, shape) for key in keys[1:]]
    cache = tuple(KVCache(k=k, v=v) for k, v in zip(kv[::2], kv[1::2], strict=True))
    tokens = jax.random.randint(keys[0], (2, 4), 0, config.vocab_size)
    positions = sequence_positions(2, 4, jnp.array([7, 0], jnp.int32))  # rows of 11 and 4 entries
    forward = nnx.jit(lambda model, tokens, cache: model(tokens, positions, cache)[0])
    logits = {
        impl: np.asarray(forward(init_model(config.replace(attention_impl=impl)), tokens, cache))
        for impl in ("reference", "pallas_interpret")
    }
    np.testing.assert_allclose(logits["pallas_interpret"], logits["reference"], atol=1e-5, rtol=1e-5)


def test_supports_is_bounded_by_what_one_program_holds():
    """T x H/G query rows beyond MAX_QUERY_ROWS (a long prefill) and head dims past MAX_HEAD_DIM are not
    supported; `attend` with an explicit kernel impl gives a long prefill to the reference."""
    from pallas_kernels.verify_attention import MAX_HEAD_DIM, MAX_QUERY_ROWS

    q, k, v, lengths = make_inputs(7, 1, MAX_QUERY_ROWS // 4, 8, 2, 16, 40, [40], jnp.float32)  # 32 x 4 rows
    assert supports(q, k, v, lengths)
    long_q = jnp.concatenate([q, q[:, :1]], axis=1)  # 33 x 4 rows
    assert not supports(long_q, k, v, lengths)
    with pytest.raises(ValueError, match="query rows"):
        kernel(long_q, k, v, lengths)
    out = attend(long_q, k, v, lengths, impl="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(attention_reference(long_q, k, v, lengths)))
    wide = jax.ShapeDtypeStruct((1, 2, 4, 2 * MAX_HEAD_DIM), jnp.float32)
    wide_kv = jax.ShapeDtypeStruct((1, 40, 2, 2 * MAX_HEAD_DIM), jnp.float32)
    assert not supports(wide, wide_kv, wide_kv, lengths)
