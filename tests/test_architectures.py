"""DeepSeek-V3-shaped (MLA + MoE) and GLM-4.5-shaped (partial rotary, q/k norm, MoE) models on the one decode
engine: cached decode equals a full forward, NaN in every stale cache slot (MLA's latent caches included)
changes nothing, and speculative greedy equals plain greedy for eagle and vanilla with mixed prompt lengths.

Random weights at a scale where attention and routing matter; the oracles hold for any weights.
"""

from __future__ import annotations

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import TINY_MOE, drive, oracle_drafts  # the speculative suite's draft oracle and step driver

from mtp_jax.cache import fill_stale
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.mla import MLACache
from mtp_jax.layers.moe import MoE
from mtp_jax.model import init_model, sequence_positions

_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    num_nextn_predict_layers=2,
    initializer_range=0.2,
    **TINY_MOE,
)
CONFIGS = {
    "deepseek_v3": ModelConfig(
        **_COMMON,
        num_key_value_heads=4,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "glm4_moe": ModelConfig(
        **_COMMON,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        routed_scaling_factor=1.0,
    ),
}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3], [2]]  # mixed lengths, one prompt bucket
S = 40


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model(request):
    model = init_model(CONFIGS[request.param], seed=1)
    for path, var in nnx.iter_graph(model):  # a nonzero score-correction bias: it must change selections
        if isinstance(var, nnx.Param) and path[-1] == "e_score_correction_bias":
            var.set_value(
                jnp.asarray(np.random.default_rng(len(path)).normal(0, 0.1, var.get_value().shape), jnp.float32)
            )
    return model


@nnx.jit
def _step(model, tokens, start, cache):
    return model(tokens, sequence_positions(*tokens.shape, start), cache)


def test_layers_are_what_the_config_asks(model):
    c = model.config
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [False, True, True]
    assert all(isinstance(m.mlp, MoE) for m in model.mtp)  # DeepSeek-V3's MTP layers are MoE layers
    cache = model.init_cache(2, 8)
    if c.attention_type == "mla":
        assert all(isinstance(x, MLACache) for x in cache)
        assert cache[0].latent.shape == (2, 8, c.kv_lora_rank) and cache[0].k_rope.shape == (2, 8, c.qk_rope_head_dim)


@pytest.mark.parametrize("step", [1, 4])
def test_cached_decode_equals_full_forward_and_stale_nan_changes_nothing(model, step):
    """Rows prefilled to different lengths, then T = step tokens per call (the absorbed MLA form), with every
    cache slot past each row's length NaN before each call: the logits equal the full forward's (the
    decompressed MLA form over the whole sequence)."""
    seqs = jnp.asarray(np.random.default_rng(step).integers(0, 64, (3, 20)), jnp.int32)
    full = np.asarray(nnx.jit(lambda m, t: m.forward_full(t)[0])(model, seqs))
    _, _, cache = _step(model, seqs[:, :7], 0, model.init_cache(3, 32))
    lengths = np.array([3, 7, 1])
    for _ in range(2):
        cache = fill_stale(cache, jnp.asarray(lengths), jnp.nan)
        chunk = jnp.stack([seqs[b, lengths[b] : lengths[b] + step] for b in range(3)])
        logits, _, cache = _step(model, chunk, jnp.asarray(lengths), cache)
        assert np.isfinite(np.asarray(logits)).all()
        for b in range(3):
            np.testing.assert_allclose(logits[b], full[b, lengths[b] : lengths[b] + step], rtol=2e-4, atol=2e-4)
        lengths = lengths + step


@pytest.mark.parametrize("method, k", [("eagle", 3), ("vanilla", 2)])
def test_speculative_greedy_equals_plain_greedy(model, method, k):
    kwargs = dict(max_new_tokens=[12, 9, 16], max_length=S, stop_tokens=[])
    plain = generate(model, PROMPTS, **kwargs)
    fast = generate(model, PROMPTS, speculative=SpeculativeConfig(method=method, num_speculative_tokens=k), **kwargs)
    assert fast.tokens == plain.tokens
    assert [len(t) for t in fast.tokens] == [12, 9, 16]
    assert fast.metrics.num_steps < sum([12, 9, 16])
    np.testing.assert_allclose(np.concatenate(fast.logprobs), np.concatenate(plain.logprobs), atol=1e-4)


@pytest.mark.parametrize("method, k", [("eagle", 3), ("vanilla", 2)])
def test_cached_drafts_equal_the_no_cache_oracle_and_nothing_recompiles(model, method, k):
    """The speculative suite's oracle on these architectures: at every step boundary the drafts equal a
    no-cache recompute of the MTP modules over the committed tokens, with every stale cache slot NaN before
    each step (MLA latent caches included); a second generation with other lengths compiles nothing."""
    sp = SpeculativeConfig(method=method, num_speculative_tokens=k)
    state, trace = drive(model, sp, PROMPTS, [12, 9, 16], poison=True)
    for step, snap in enumerate(trace):
        active = ~snap["done"]
        want = oracle_drafts(model, method, snap["tokens"], snap["lengths"], snap["drafts"])
        np.testing.assert_array_equal(snap["drafts"][active], want[active], err_msg=f"step {step}")
    kwargs = dict(max_length=S, stop_tokens=[], speculative=sp)
    generate(model, PROMPTS, max_new_tokens=4, **kwargs)  # warm-up
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, _duration, **_: (
            compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None
        )
    )
    try:
        generate(model, [[5, 4], [1] * 9, [7]], max_new_tokens=[3, 11, 6], **kwargs)
    finally:
        jax.monitoring.clear_event_listeners()
    assert not compiles, f"{len(compiles)} compiles after warm-up"
