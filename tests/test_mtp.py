"""MTP modules: the DeepSeek-V3 equations by hand in numpy, cached == no-cache, D = 0, parallel heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.cache import fill_stale
from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer, init_model, sequence_positions
from mtp_jax.mtp import (
    MAIN_PARAMS,
    MTP_PARAMS,
    MTPModule,
    ParallelMTPHead,
    initial_hidden,
    mtp_forward_full,
    shift_left,
)

TINY = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    num_nextn_predict_layers=2,
)
B, T = 2, 7


def randomize(model: Transformer, seed: int) -> Transformer:
    """Every weight redrawn large enough to matter: matrices ~ N(0, 0.3^2), norm weights ~ U(0.5, 1.5)."""
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param):
            shape = var[...].shape
            value = rng.uniform(0.5, 1.5, shape) if path[-1] == "weight" else rng.normal(0.0, 0.3, shape)
            var[...] = jnp.asarray(value, jnp.float32)
    return model


def make_model(seed: int = 0, **overrides) -> Transformer:
    return randomize(init_model(TINY.replace(**overrides), seed=seed), seed + 1)


# ---- A numpy transcription of the equations (docs/MTP_SPEC.md "MTP modules"). ----


def np_rms(x, w, eps=TINY.rms_norm_eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def np_rope(x, theta=TINY.rope_theta):
    """Rotate-half RoPE of x [B, T, N, D] at positions 0 .. T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)  # [D/2]
    ang = np.arange(x.shape[1])[:, None] * inv  # [T, D/2]
    ang = np.concatenate([ang, ang], axis=-1)[None, :, None, :]  # [1, T, 1, D]
    x1, x2 = np.split(x, 2, axis=-1)
    return x * np.cos(ang) + np.concatenate([-x2, x1], axis=-1) * np.sin(ang)


def np_block(layer, x):
    """Pre-norm causal GQA block + SwiGLU, weights read from `layer` (a DecoderLayer)."""
    w = lambda p: np.asarray(p[...])  # noqa: E731
    c, (b, t, _) = TINY, x.shape
    h, g, d = c.num_attention_heads, c.num_key_value_heads, c.resolved_head_dim
    a = layer.self_attn
    y = np_rms(x, w(layer.input_layernorm.weight))
    qkv = (y @ w(a.qkv_proj.kernel)).reshape(b, t, g, h // g + 2, d)  # per KV head: its H/G query heads, k, v
    q = np_rope(qkv[:, :, :, :-2].reshape(b, t, h, d))
    k = np.repeat(np_rope(qkv[:, :, :, -2]), h // g, axis=2)  # head j reads kv j // (H/G)
    v = np.repeat(qkv[:, :, :, -1], h // g, axis=2)
    scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    x = x + np.einsum("bhts,bshd->bthd", p, v).reshape(b, t, h * d) @ w(a.o_proj.kernel)
    y = np_rms(x, w(layer.post_attention_layernorm.weight))
    m = layer.mlp
    gate_up = y @ w(m.gate_up_proj.kernel)  # gate_proj, up_proj interleaved
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    return x + ((gate / (1 + np.exp(-gate))) * up) @ w(m.down_proj.kernel)


def np_mtp(model, main_hidden, tokens, *, enorm, hnorm, head_norm, embedding_first, after_norm, chain_after):
    """Depth-by-depth logits from the equations, with the norm weights and conventions passed explicitly
    (lists over depths), so the test can also evaluate wrong wirings."""
    w = lambda p: np.asarray(p[...])  # noqa: E731
    emb, lm_head = w(model.embed_tokens.embedding), w(model.lm_head.kernel)
    hidden = np_rms(main_hidden, w(model.norm.weight)) if after_norm else main_hidden
    out = []
    for k, module in enumerate(model.mtp, start=1):
        shifted = np.concatenate([tokens[:, k:], np.zeros((tokens.shape[0], k), tokens.dtype)], axis=1)  # t_{i+k}
        e, h = np_rms(emb[shifted], enorm[k - 1]), np_rms(hidden, hnorm[k - 1])
        x = np.concatenate([e, h] if embedding_first else [h, e], axis=-1) @ w(module.eh_proj.kernel)
        o = np_block(module, x)
        normed = np_rms(o, head_norm[k - 1])
        out.append(normed @ lm_head)
        hidden = normed if chain_after else o
    return out


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (B, T, TINY.hidden_size)).astype(np.float32), rng.integers(0, 32, (B, T), np.int32)


@pytest.mark.parametrize(
    "concat_order, after_norm, chain_after",
    [
        ("embedding_first", True, True),  # DeepSeek-V3 as TRT-LLM / SGLang load it (the defaults)
        ("hidden_first", True, True),  # MiMo
        ("embedding_first", False, True),  # h^0 before the main final norm
        ("embedding_first", True, False),  # vLLM: chain the block output, before shared_head.norm
    ],
)
def test_deepseek_modules_follow_the_equations(concat_order, after_norm, chain_after):
    model = make_model(
        mtp_concat_order=concat_order, mtp_hidden_after_norm=after_norm, mtp_chain_after_shared_head_norm=chain_after
    )
    main_hidden, tokens = _inputs()
    got = [np.asarray(x) for x in mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens))]
    w = lambda p: np.asarray(p[...])  # noqa: E731
    norms = {name: [w(getattr(m, name).weight) for m in model.mtp] for name in ("enorm", "hnorm")}
    norms["head_norm"] = [w(m.shared_head.norm.weight) for m in model.mtp]
    right = dict(embedding_first=concat_order == "embedding_first", after_norm=after_norm, chain_after=chain_after)
    expected = np_mtp(model, main_hidden, tokens, **norms, **right)
    assert len(got) == 2 and got[0].shape == (B, T, 32) and got[0].dtype == np.float32
    for k in range(2):
        np.testing.assert_allclose(got[k], expected[k], rtol=2e-4, atol=2e-4)

    # The test can tell every wiring apart: each swap moves the output far beyond the tolerance.
    wrong = {
        "enorm<->hnorm": dict(norms, enorm=norms["hnorm"], hnorm=norms["enorm"]),
        "enorm<->shared_head.norm": dict(norms, enorm=norms["head_norm"], head_norm=norms["enorm"]),
        "hnorm<->shared_head.norm": dict(norms, hnorm=norms["head_norm"], head_norm=norms["hnorm"]),
    }
    for flag in right:
        wrong[f"flip {flag}"] = dict(norms)
    for name, kwargs in wrong.items():
        conventions = dict(right, **({name[5:]: not right[name[5:]]} if name.startswith("flip") else {}))
        alt = np_mtp(model, main_hidden, tokens, **kwargs, **conventions)
        depth = 1 if name == "flip chain_after" else 0  # chaining shows from depth 2 on
        assert np.abs(alt[depth] - got[depth]).max() > 0.05, name


def test_eh_proj_halves_are_not_interchangeable():
    """Swapping eh_proj's input halves is the concat-order swap: it must change the output."""
    model = make_model()
    main_hidden, tokens = _inputs(1)
    before = mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens))[0]
    kernel = model.mtp[0].eh_proj.kernel
    e = TINY.hidden_size
    kernel[...] = jnp.concatenate([kernel[...][e:], kernel[...][:e]], axis=0)  # [2E, E]
    after = mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens))[0]
    assert float(jnp.abs(after - before).max()) > 0.05
    flipped = model.config.replace(mtp_concat_order="hidden_first")
    for m in model.mtp:
        m.config = flipped
    model.config = flipped
    np.testing.assert_allclose(
        mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens))[0], before, rtol=1e-5, atol=1e-5
    )


def test_parallel_heads_follow_the_equations():
    """Gloeckle et al.: head k = head(shared_head.norm(Block_k(h^0))), every head from the same h^0."""
    model = make_model(mtp_style="parallel")
    assert all(isinstance(m, ParallelMTPHead) for m in model.mtp)
    main_hidden, tokens = _inputs(2)
    got = mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens))
    w = lambda p: np.asarray(p[...])  # noqa: E731
    h0 = np_rms(main_hidden, w(model.norm.weight))
    for k, module in enumerate(model.mtp):
        expected = np_rms(np_block(module, h0), w(module.shared_head.norm.weight)) @ w(model.lm_head.kernel)
        np.testing.assert_allclose(got[k], expected, rtol=2e-4, atol=2e-4)
    # No token input: the heads ignore the tokens.
    other = mtp_forward_full(model, jnp.asarray(main_hidden), jnp.asarray(tokens[:, ::-1].copy()))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(other[1]))


@nnx.jit
def decode_chunk(model, tokens, start, shifted, main_cache, caches):
    """One step of a decoder: the main model, then every depth on the same n rows against its own
    cache, each after a 2-token junk step at the same positions whose entries are then poisoned with NaN
    (as rejected drafts are). tokens int32 [B, n] at positions start .. start + n - 1;
    shifted[k - 1] = t_{i+k}, int32 [B, n]."""
    positions = sequence_positions(*tokens.shape, start)
    _, h_main, main_cache = model(tokens, positions, main_cache)
    h0 = hidden = initial_hidden(model, h_main)
    all_logits, new_caches = [], []
    for module, depth_tokens, cache in zip(model.mtp, shifted, caches, strict=True):
        _, _, junk = module(
            jnp.ones((B, 2, TINY.hidden_size)),
            jnp.full((B, 2), 5, jnp.int32),
            positions[:, :2],
            cache,
            embed=model.embed,
            head=model.head,
        )
        rolled = fill_stale(junk, jnp.full((B,), start), jnp.nan)
        source = h0 if model.config.mtp_style == "parallel" else hidden
        logits, hidden, cache = module(source, depth_tokens, positions, rolled, embed=model.embed, head=model.head)
        all_logits.append(logits)
        new_caches.append(cache)
    return all_logits, main_cache, new_caches


@pytest.mark.parametrize("style", ["deepseek", "parallel"])
def test_cached_steps_equal_full_forward(style):
    """The decoding oracle: chunk by chunk with per-module caches == `mtp_forward_full` at once."""
    model = make_model(mtp_style=style)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 32, (B, T), np.int32))
    _, hidden = model.forward_full(tokens)
    full = mtp_forward_full(model, hidden, tokens)

    main_cache = model.init_cache(B, T)
    caches = [module.init_cache(B, T) for module in model.mtp]
    for a, b in [(0, 3), (3, 5), (5, 7)]:  # a prefill, then two steps
        shifted = [shift_left(tokens, k)[:, a:b] for k in (1, 2)]
        logits, main_cache, caches = decode_chunk(model, tokens[:, a:b], a, shifted, main_cache, caches)
        for k in range(2):
            np.testing.assert_allclose(logits[k], full[k][:, a:b], rtol=1e-4, atol=1e-4)


def test_parameter_names_follow_the_deepseek_layout():
    model = init_model(TINY)
    names = {path[2] for path, _ in nnx.to_flat_state(nnx.state(model, MTP_PARAMS))}
    assert names == {
        "enorm",
        "hnorm",
        "eh_proj",
        "shared_head",
        "self_attn",
        "mlp",
        "input_layernorm",
        "post_attention_layernorm",
    }
    paths = {path for path, _ in nnx.to_flat_state(nnx.state(model, MTP_PARAMS))}
    assert ("mtp", 1, "shared_head", "norm", "weight") in paths
    assert ("mtp", 0, "self_attn", "qkv_proj", "kernel") in paths
    assert model.mtp[0].eh_proj.kernel[...].shape == (2 * TINY.hidden_size, TINY.hidden_size)  # [2E, E]
    assert isinstance(model.mtp[0], MTPModule)
    parallel = init_model(TINY.replace(mtp_style="parallel"))
    assert {path[2] for path, _ in nnx.to_flat_state(nnx.state(parallel, MTP_PARAMS))} == {
        "shared_head",
        "self_attn",
        "mlp",
        "input_layernorm",
        "post_attention_layernorm",
    }


def test_no_modules_when_d_is_zero_and_main_weights_do_not_depend_on_d():
    plain = init_model(TINY.replace(num_nextn_predict_layers=0))
    assert len(plain.mtp) == 0
    assert len(nnx.to_flat_state(nnx.state(plain, MTP_PARAMS))) == 0
    tokens = jnp.asarray(np.arange(B * T, dtype=np.int32).reshape(B, T) % 32)
    logits, hidden = plain.forward_full(tokens)
    assert mtp_forward_full(plain, hidden, tokens) == []
    with_mtp = init_model(TINY)
    main = jax.tree.leaves(nnx.state(with_mtp, MAIN_PARAMS))
    assert len(main) == len(jax.tree.leaves(nnx.state(plain, nnx.Param)))
    for x, y in zip(main, jax.tree.leaves(nnx.state(plain, nnx.Param)), strict=True):
        np.testing.assert_array_equal(x, y)


def test_config_validation():
    for bad in (
        dict(num_nextn_predict_layers=-1),
        dict(num_nextn_predict_layers=True),
        dict(mtp_style="medusa"),
        dict(mtp_concat_order="hidden_last"),
        dict(mtp_hidden_after_norm=1),
        dict(mtp_chain_after_shared_head_norm="yes"),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            TINY.replace(**bad)
    defaults = ModelConfig.from_name("tiny")
    assert (
        defaults.num_nextn_predict_layers,
        defaults.mtp_style,
        defaults.mtp_concat_order,
        defaults.mtp_hidden_after_norm,
        defaults.mtp_chain_after_shared_head_norm,
    ) == (0, "deepseek", "embedding_first", True, True)


def test_shift_left():
    x = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    np.testing.assert_array_equal(shift_left(x, 1), [[2, 3, 4, 0]])
    np.testing.assert_array_equal(shift_left(x, 3, fill=9), [[4, 9, 9, 9]])
    np.testing.assert_array_equal(shift_left(x, 6), [[0, 0, 0, 0]])
