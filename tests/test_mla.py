"""MLA (`mtp_jax.layers.mla`): parity with transformers' DeepseekV3Attention, absorbed == decompressed,
cached == full, and the cache rules (stale NaN invisible, out-of-range writes dropped)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import hf_config, torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from mtp_jax.cache import fill_stale
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.layers.mla import MLACache, MLAttention, softmax_scale

# DeepSeek-V3's rope_scaling (max_position_embeddings 256 = factor x 64); its ramp bends the tiny head's bands.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# mscale != mscale_all_dim: YaRN's cos/sin factor is no longer 1 as well.
YARN_UNEVEN = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}


def _config(**overrides) -> ModelConfig:
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    )
    return ModelConfig(**{**fields, **overrides})


def _random_mla(config: ModelConfig, seed: int = 0) -> MLAttention:
    """An MLAttention with O(1)-scale random weights (drawn in numpy: no per-shape compiles).

    Kernels N(0, 1/fan_in), norm weights 1 + N(0, 0.2^2), biases N(0, 0.1^2).
    """
    module = nnx.eval_shape(lambda: MLAttention(config, nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "kernel" in name:
            return jnp.asarray(noise / math.sqrt(leaf.shape[0]))
        return jnp.asarray(0.1 * noise if "bias" in name else 1.0 + 0.2 * noise)

    nnx.update(module, jax.tree_util.tree_map_with_path(draw, nnx.state(module, nnx.Param)))
    return module


@nnx.jit(static_argnames="absorbed")
def _forward(module: MLAttention, x, positions, cache: MLACache, absorbed: bool):
    """One jitted forward (a compile per shape instead of one per eager op)."""
    return module(x, positions, cache, absorbed=absorbed)


def _to_float64(module: MLAttention) -> MLAttention:
    """The module computing and storing in float64 (call inside `jax.enable_x64()`)."""
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, nnx.Linear):
            sub.dtype = jnp.float64
    nnx.update(module, jax.tree.map(lambda a: a.astype(jnp.float64), nnx.state(module, nnx.Param)))
    return module


def _hf_attention(config: ModelConfig, module: MLAttention, rope: dict | None) -> tuple:
    """transformers' DeepseekV3Attention and rotary embedding holding `module`'s weights (its q_a_proj and
    kv_a_proj_with_mqa are our fused_qkv_a_proj's first q_lora_rank and remaining output columns)."""
    deepseek = hf_config(
        "DeepseekV3Config",
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleave=config.rope_interleave,
        attention_bias=config.attention_bias,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": config.rope_theta},
    )
    hf = DeepseekV3Attention(deepseek, layer_idx=0).eval()
    fused = {"q_a_proj": slice(None, config.q_lora_rank), "kv_a_proj_with_mqa": slice(config.q_lora_rank, None)}
    for name, sub in hf.named_children():
        fuses = config.q_lora_rank is not None and name in fused
        ours, columns = (module.fused_qkv_a_proj, fused[name]) if fuses else (getattr(module, name), slice(None))
        with torch.no_grad():
            if isinstance(ours, nnx.Linear):
                sub.weight.copy_(torch.from_numpy(np.asarray(ours.kernel[...])[:, columns].T.copy()))
                if ours.bias is not None:
                    sub.bias.copy_(torch.from_numpy(np.array(ours.bias[...])[columns]))
            else:
                sub.weight.copy_(torch.from_numpy(np.array(ours.weight[...])))
    return hf, DeepseekV3RotaryEmbedding(deepseek)


def _rel_err(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize(
    "q_lora_rank, interleave, bias, rope",
    [
        (24, True, False, None),
        (None, True, True, None),
        (24, False, False, None),
        (24, True, False, YARN),
        (None, False, False, YARN_UNEVEN),
    ],
    ids=["lora-interleave", "q_proj-bias", "lora-rotate-half", "yarn", "yarn-uneven-mscale"],
)
def test_matches_transformers(q_lora_rank, interleave, bias, rope):
    """Full causal sequence from an empty cache, both forms, against DeepseekV3Attention (eager, fp32)."""
    scaling = RopeScaling(**rope) if rope else RopeScaling()
    config = _config(q_lora_rank=q_lora_rank, rope_interleave=interleave, attention_bias=bias, rope_scaling=scaling)
    module = _random_mla(config)
    hf, rotary = _hf_attention(config, module, rope)
    assert softmax_scale(config) == pytest.approx(hf.scaling, rel=1e-12)

    batch, length = 2, 12
    x = np.random.default_rng(0).standard_normal((batch, length, config.hidden_size)).astype(np.float32)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    with torch.no_grad():
        xt, pt = torch.from_numpy(x), torch.from_numpy(positions.astype(np.int64))
        mask = torch.full((length, length), -torch.inf).triu(1)[None, None]  # [1, 1, T, T]
        expected = hf(xt, rotary(xt, pt), mask)[0].numpy()

    cache = MLACache.init(config, batch, 16)
    for absorbed in (True, False):
        out, new_cache = _forward(module, jnp.asarray(x), jnp.asarray(positions), cache, absorbed)
        assert _rel_err(out, expected) <= 1e-5, absorbed
        assert new_cache.latent.shape == (batch, 16, 32) and new_cache.k_rope.shape == (batch, 16, 8)
        assert np.all(np.asarray(new_cache.latent[:, length:]) == 0)  # nothing written past the sequence


def test_softmax_scale_yarn_correction():
    """(N + R)^-1/2 times (0.1 mscale_all_dim ln factor + 1)^2; plain 1/sqrt(24) without scaling."""
    assert softmax_scale(_config()) == pytest.approx(24**-0.5, rel=1e-15)
    yarn = _config(rope_scaling=RopeScaling(**YARN))
    assert softmax_scale(yarn) == pytest.approx(24**-0.5 * (0.1 * math.log(4.0) + 1) ** 2, rel=1e-15)


def _prefill_then_step(module, config, x, prefix, starts, step, cache_len, *, absorbed, dtype=None, nan=False):
    """Prefill x[:, :prefix] at 0..prefix-1, then `step` new tokens per row at starts[b] + 0..step-1."""
    batch = x.shape[0]
    cache = MLACache.init(config, batch, cache_len, dtype)
    prefix_positions = jnp.broadcast_to(jnp.arange(prefix, dtype=jnp.int32), (batch, prefix))
    _, cache = _forward(module, x[:, :prefix], prefix_positions, cache, absorbed)
    if nan:
        cache = fill_stale(cache, jnp.asarray(starts), jnp.nan)
    positions = jnp.asarray(starts, jnp.int32)[:, None] + jnp.arange(step, dtype=jnp.int32)  # [B, step]
    x_new = jnp.take_along_axis(x, positions[:, :, None], axis=1)  # [B, step, E]
    out, cache = _forward(module, x_new, positions, cache, absorbed)
    return out, cache, positions


def test_absorbed_equals_decompressed_float64():
    """A cached T = 4 step after a prefix, rows of different lengths: the two forms agree to ~1e-12."""
    with jax.enable_x64(True):
        config = _config()
        module = _to_float64(_random_mla(config, seed=3))
        x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 13, config.hidden_size)))  # float64
        prefix = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (3, 9))
        _, cache = _forward(module, x[:, :9], prefix, MLACache.init(config, 3, 20, jnp.float64), False)
        positions = jnp.asarray([[3], [9], [6]], jnp.int32) + jnp.arange(4, dtype=jnp.int32)  # [B, 4]
        x_new = jnp.take_along_axis(x, positions[:, :, None], axis=1)  # [B, 4, E]
        absorbed, absorbed_cache = _forward(module, x_new, positions, cache, True)
        decompressed, decompressed_cache = _forward(module, x_new, positions, cache, False)
        assert absorbed.dtype == jnp.float64
        assert _rel_err(absorbed, decompressed) <= 1e-12
        assert float(jnp.abs(absorbed).mean()) > 0.1  # a real output, not zeros
        np.testing.assert_array_equal(absorbed_cache.latent, decompressed_cache.latent)


@pytest.mark.parametrize("absorbed", [True, False])
def test_cached_equals_full(absorbed):
    """Prefill, then K + 1 = 4 tokens at later (per-row different) positions == the full forward there."""
    config = _config()
    module = _random_mla(config, seed=5)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 12, config.hidden_size)), jnp.float32)
    full_positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    full, full_cache = _forward(module, x, full_positions, MLACache.init(config, 2, 16), absorbed)

    out, cache, positions = _prefill_then_step(module, config, x, 7, [5, 7], 4, 16, absorbed=absorbed)
    expected = jnp.take_along_axis(full, positions[:, :, None], axis=1)  # [B, 4, E]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for b, last in enumerate([8, 10]):  # every live entry equals the full forward's
        np.testing.assert_allclose(cache.latent[b, : last + 1], full_cache.latent[b, : last + 1], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(cache.k_rope[b, : last + 1], full_cache.k_rope[b, : last + 1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("absorbed", [True, False])
def test_stale_nan_changes_nothing(absorbed):
    """NaN in every slot at or past each row's step start: the output is bit-identical and finite."""
    config = _config()
    module = _random_mla(config, seed=7)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 12, config.hidden_size)), jnp.float32)
    clean, clean_cache, _ = _prefill_then_step(module, config, x, 8, [4, 8], 4, 16, absorbed=absorbed)
    dirty, dirty_cache, _ = _prefill_then_step(module, config, x, 8, [4, 8], 4, 16, absorbed=absorbed, nan=True)
    assert np.all(np.isfinite(dirty))
    np.testing.assert_array_equal(dirty, clean)
    np.testing.assert_array_equal(dirty_cache.latent[0, :8], clean_cache.latent[0, :8])
    assert np.all(np.isnan(dirty_cache.latent[0, 8:])) and np.all(np.isnan(dirty_cache.k_rope[1, 12:]))


@pytest.mark.parametrize("absorbed", [True, False])
def test_out_of_range_writes_dropped(absorbed):
    """Positions past S are dropped (never clamped onto live entries); a row that sees nothing gets zeros."""
    config = _config()
    module = _random_mla(config, seed=9)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 12, config.hidden_size)), jnp.float32)
    prefix = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    _, small = _forward(module, x[:, :8], prefix, MLACache.init(config, 2, 10), absorbed)
    _, large = _forward(module, x[:, :8], prefix, MLACache.init(config, 2, 16), absorbed)
    positions = jnp.asarray([[8, 9, 10, 11], [-4, -3, -2, -1]], jnp.int32)
    out_small, small_after = _forward(module, x[:, 8:], positions, small, absorbed)
    out_large, large_after = _forward(module, x[:, 8:], positions, large, absorbed)
    # Row 0: 0..7 untouched (a clamped write would land at 6..9), 8 and 9 written, 10 and 11 dropped.
    np.testing.assert_array_equal(small_after.latent[0, :8], small.latent[0, :8])
    np.testing.assert_array_equal(small_after.k_rope[0, :8], small.k_rope[0, :8])
    np.testing.assert_allclose(small_after.latent[0, 8:10], large_after.latent[0, 8:10], rtol=1e-6, atol=1e-6)
    assert not np.allclose(small_after.latent[0, 8:10], 0)
    np.testing.assert_array_equal(large_after.latent[0, 12:], 0)
    # The queries at positions 8 and 9 see the same entries in both caches.
    np.testing.assert_allclose(out_small[0, :2], out_large[0, :2], rtol=1e-5, atol=1e-6)
    # Row 1 (negative positions): nothing written, nothing visible, output o_proj(0) = 0 (no bias).
    np.testing.assert_array_equal(small_after.latent[1], small.latent[1])
    np.testing.assert_array_equal(out_small[1], 0)
