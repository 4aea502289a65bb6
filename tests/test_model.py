"""The main model: cached decode equals a full forward; batching and stale cache entries change nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.cache import SELECT_WRITES, fill_stale, write_at
from mtp_jax.config import ModelConfig
from mtp_jax.layers import onednn
from mtp_jax.model import init_model, sequence_positions


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.from_name("tiny"), seed=1)


@nnx.jit
def _step(model, tokens, start, cache):
    """T = tokens.shape[1] tokens per row at positions start[b] .. start[b] + T - 1."""
    return model(tokens, sequence_positions(*tokens.shape, start), cache)


@nnx.jit
def _full(model, tokens):
    return model.forward_full(tokens)


def _tokens(shape, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, 128, shape), jnp.int32)


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_cached_decode_equals_full_forward(model, step):
    """Rows of different lengths, fed T = step tokens per call, give the full forward's logits."""
    seqs = _tokens((3, 20), seed=step)
    full, _ = _full(model, seqs)
    prompt_lengths = jnp.asarray([3, 7, 1], jnp.int32)
    # Prefill the three rows to different lengths (right-padded), then step.
    _, _, cache = _step(model, seqs[:, :7], 0, model.init_cache(3, 32))  # live: each row's prompt only
    lengths = np.asarray(prompt_lengths)
    for _ in range(2):
        chunk = jnp.stack([seqs[b, lengths[b] : lengths[b] + step] for b in range(3)])  # [B, T]
        logits, _, cache = _step(model, chunk, jnp.asarray(lengths), cache)
        for b in range(3):
            np.testing.assert_allclose(logits[b], full[b, lengths[b] : lengths[b] + step], atol=1e-5, rtol=1e-5)
        lengths = lengths + step


def test_batch_equals_rows_alone(model):
    seqs = _tokens((3, 9), seed=3)
    batch_logits, batch_hidden = _full(model, seqs)
    for b in range(3):
        logits, hidden = _full(model, seqs[b : b + 1])
        np.testing.assert_allclose(batch_logits[b], logits[0], atol=1e-6)
        np.testing.assert_allclose(batch_hidden[b], hidden[0], atol=1e-6)


def test_logits_at_one_row_equal_that_row_of_all_logits(model):
    """`logits_at` (prefill, drafting) gives row b's logits at logits_at[b], for the model and an MTP module."""
    tiny = init_model(ModelConfig.from_name("tiny", num_nextn_predict_layers=1), seed=2)
    seqs, index = _tokens((3, 9), seed=4), jnp.asarray([8, 0, 5], jnp.int32)
    cache, positions = tiny.init_cache(3, 16), sequence_positions(3, 9)
    logits, hidden, _ = tiny(seqs, positions, cache)
    one, hidden_one, _ = tiny(seqs, positions, cache, logits_at=index)
    assert one.shape == (3, 1, tiny.config.vocab_size)
    np.testing.assert_array_equal(hidden_one, hidden)
    np.testing.assert_allclose(one[:, 0], logits[jnp.arange(3), index], atol=1e-6)
    module = tiny.mtp[0]
    mtp_cache = module.init_cache(3, 16)
    logits, _, _ = module(hidden, seqs, positions, mtp_cache, embed=tiny.embed, head=tiny.head)
    one, _, _ = module(hidden, seqs, positions, mtp_cache, embed=tiny.embed, head=tiny.head, logits_at=index)
    np.testing.assert_allclose(one[:, 0], logits[jnp.arange(3), index], atol=1e-6)


def test_nan_past_lengths_changes_nothing(model):
    seqs = _tokens((2, 12), seed=4)
    _, _, cache = _step(model, seqs[:, :8], 0, model.init_cache(2, 24))
    lengths = jnp.asarray([5, 8], jnp.int32)  # row 0 rolled back by 3
    chunk = jnp.stack([seqs[0, 5:8], seqs[1, 8:11]])
    clean, _, _ = _step(model, chunk, lengths, cache)
    poisoned, _, _ = _step(model, chunk, lengths, fill_stale(cache, lengths, jnp.nan))
    assert np.isfinite(np.asarray(poisoned)).all()
    np.testing.assert_array_equal(clean, poisoned)


def test_write_at_never_lands_outside_the_cache():
    cache = jnp.zeros((2, 4, 1, 1))
    new = jnp.ones((2, 3, 1, 1))
    out = write_at(cache, new, sequence_positions(2, 3, jnp.asarray([2, -2], jnp.int32)))
    # Row 0: positions 2, 3 written, 4 dropped (not clamped back onto 1..3). Row 1: -2, -1 dropped, 0 written.
    np.testing.assert_array_equal(out[:, :, 0, 0], [[0, 0, 1, 1], [1, 0, 0, 0]])


@pytest.mark.parametrize("path", ["xla", "in_place"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_write_at_in_narrow_floats_is_the_scatter(dtype, path, monkeypatch):
    # On the CPU backend narrow float caches are written in place by the oneDNN extension's `write_rows`
    # ("in_place") or, without it, with one select, not a scatter ("xla"): the same writes, in order (a
    # position written twice keeps the later token: the select's rule; a scatter leaves it undefined),
    # outside [0, S) dropped (INT32_MIN too), values kept (NaN stays NaN; XLA:CPU's select may canonicalise
    # a bf16 or e5m2 NaN's payload, as its scatter does).
    if jax.default_backend() != "cpu":
        pytest.skip(
            "write_at uses selects on the CPU backend only; elsewhere a scatter, "
            "whose order for a position written twice XLA leaves undefined"
        )
    if path == "xla":
        monkeypatch.setenv(onednn.ENV, "0")
    elif not onednn.moves_rows(jnp.zeros((1,), dtype)):
        pytest.skip("the optional oneDNN extension is not built here (pip install ./extensions/onednn)")
    routine = "ffi_call" if path == "in_place" else "scatter"  # past SELECT_WRITES (a new lambda: traced afresh)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((3, 6, 2, 3)), dtype)
    new = jnp.asarray(rng.standard_normal((3, 4, 2, 3)), dtype).at[1, 2, 0, 1].set(jnp.nan)
    positions = jnp.asarray([[-(2**31), 5, 6, 2], [-1, 3, 4, 9], [1, 1, 4, 1]], jnp.int32)

    def written(positions):
        expected = np.array(cache.astype(jnp.float32))
        for b, row in enumerate(np.asarray(positions)):
            for t, p in enumerate(row):
                if 0 <= p < 6:
                    expected[b, p] = np.asarray(new[b, t].astype(jnp.float32))
        return expected

    expected = written(positions)
    out = write_at(cache, new, positions)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected)
    one = write_at(cache, new[:, :1], positions[:, :1])  # a decode step's one token: its own path
    np.testing.assert_array_equal(np.asarray(one.astype(jnp.float32)), written(positions[:, :1]))
    jaxpr = str(jax.make_jaxpr(lambda *a: write_at(*a))(cache, new, positions))
    assert "ffi_call" in jaxpr if path == "in_place" else "scatter" not in jaxpr  # the in-place call, or a select
    # MLA's latent cache has no head axis: [B, S, D].
    flat = write_at(cache[:, :, 0], new[:, :, 0], positions)
    np.testing.assert_array_equal(np.asarray(flat.astype(jnp.float32)), expected[:, :, 0])
    # More tokens than SELECT_WRITES (a prefill) take XLA's scatter, or the in-place call: the same cache.
    long = jnp.zeros((2, SELECT_WRITES + 4, 1, 1), dtype)
    exact = np.concatenate([1 + np.arange(8) / 8, 2 + np.arange(8) / 4, [4.0]])  # 17 values exact in fp8 too
    ramp = jnp.asarray(exact[: SELECT_WRITES + 1], dtype)[None, :, None, None]
    args = long, jnp.concatenate([ramp, ramp]), sequence_positions(2, SELECT_WRITES + 1, jnp.asarray([4, -1]))
    out = write_at(*args)
    assert out.dtype == dtype and routine in str(jax.make_jaxpr(lambda *a: write_at(*a))(*args))
    values = np.asarray(ramp[0, :, 0, 0].astype(jnp.float32))
    got = np.asarray(out[..., 0, 0].astype(jnp.float32))
    np.testing.assert_array_equal(got[0], np.concatenate([np.zeros(4), values[:-1]]))  # position 20 dropped
    np.testing.assert_array_equal(got[1], np.concatenate([values[1:], np.zeros(4)]))  # position -1 dropped


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_embed_is_the_tables_rows_and_copies_no_table_in_a_loop(dtype):
    """`Transformer.embed` returns exactly `nnx.Embed`'s rows (bits compared: NaN, inf and -0.0 included),
    and a loop of lookups (as `DecodeEngine.run`'s) carries no float32 copy of a bf16 table (XLA:CPU's
    gather converts the table; hoisted out of the loop, that conversion copied all of it every run)."""
    config = ModelConfig.from_name("tiny").replace(dtype=dtype, param_dtype=dtype)
    model = init_model(config, seed=2)
    table = model.embed_tokens.embedding[...]
    model.embed_tokens.embedding.set_value(table.at[3, 0].set(jnp.nan).at[3, 1].set(jnp.inf).at[4, 2].set(-0.0))
    tokens = jnp.asarray([[3, 4, 0, config.vocab_size - 1], [4, 4, 1, 3]], jnp.int32)
    got = np.asarray(model.embed(tokens))
    expected = np.asarray(nnx.Embed.__call__(model.embed_tokens, tokens))
    assert got.dtype == expected.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), expected.view(f"u{got.itemsize}"))

    graph, state = nnx.split(model)

    def loop(state, tokens):
        def body(i, total):
            return total + nnx.merge(graph, state).embed((tokens + i) % config.vocab_size).astype(jnp.float32).sum()

        return jax.lax.fori_loop(0, 3, body, jnp.float32(0))

    text = jax.jit(loop).lower(state, tokens).compile().as_text()
    full = f"f32[{config.vocab_size},{config.hidden_size}]"
    carried = [line for line in text.splitlines() if "tuple(" in line and full in line]
    assert not carried if dtype == "bfloat16" else carried  # a bf16 table's float32 copy: none (fp32: the table)
    rows = jnp.asarray([[5, 6]], jnp.int32)  # rows 5 .. 8 over the loop: finite
    reference = sum(
        float(expected_rows.astype(jnp.float32).sum()) for expected_rows in (table[5:7], table[6:8], table[7:9])
    )
    assert float(jax.jit(loop)(state, rows)) == pytest.approx(reference, rel=1e-5)


def test_config_rejects_bad_fields():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_name("tiny", num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_name("tiny", hidden_size=0)
    with pytest.raises(ValueError, match="eos_token_id"):
        ModelConfig.from_name("tiny", eos_token_id=128)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.from_name("huge")
