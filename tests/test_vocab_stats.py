"""A step's reductions over the vocabulary on the CPU (`mtp_jax.cpu_extension.vocab_stats`, the `mtp_vocab_stats`
FFI call of `extensions/onednn`): each row's argmax exactly as XLA's `vocab_argmax` (ties to the lowest id, the
first NaN above every number), and its log-softmax's max and log-sum-exp as `jax.nn.log_softmax` has them (the
max exactly, the log-sum-exp to within float32 rounding), whatever the row's neighbours, inside jit and vmap;
where it is used (`reads_vocab`), and that a model's greedy tokens and logprobs do not change with it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_onednn import built

import mtp_jax
from mtp_jax import cpu_extension, sharding
from mtp_jax.cpu_extension import reads_vocab, vocab_stats


def xla_stats(processed, raw):
    """The XLA path's numbers (`MTP_JAX_ONEDNN=0` routes nothing): argmax, max and log-sum-exp."""
    r = raw.astype(jnp.float32)
    peak = jnp.max(r, axis=-1, keepdims=True)
    return sharding.vocab_argmax(processed), peak, jnp.log(jnp.sum(jnp.exp(r - peak), axis=-1, keepdims=True))


def rows_with_special_values(vocab: int, rng) -> np.ndarray:
    """[8, vocab] float32: random rows, one with a clear maximum at its last id, a tie of the maximum (ids 2 and
    vocab - 1), all -inf, -inf but one, a NaN (twice), a +inf, and a maximum inside the last partial block."""
    x = rng.normal(0, 3, (8, vocab)).astype(np.float32)
    x[0, -1] = 40.0
    x[1, [min(2, vocab - 1), vocab - 1]] = 30.0
    x[2] = -np.inf
    x[3] = -np.inf
    x[3, vocab // 2] = -5.0
    x[4, [vocab // 3, vocab - 1]] = np.nan
    x[5, vocab - 2] = np.inf
    x[6, vocab - 1 - vocab % 16] = 35.0
    return x


@built
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 4096, 4099])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_vocab_stats_equal_xla_on_special_rows(monkeypatch, vocab, dtype):
    rng = np.random.default_rng(vocab)
    x = rows_with_special_values(vocab, rng)
    raw = jnp.asarray(x).astype(dtype)
    processed = raw.astype(jnp.float32) + 1.0  # the processed logits differ from the raw ones
    argmax, peak, log_sum = jax.jit(vocab_stats)(processed, raw)
    monkeypatch.setenv("MTP_JAX_ONEDNN", "0")
    want_argmax, want_peak, want_log_sum = jax.jit(xla_stats)(processed, raw)
    np.testing.assert_array_equal(argmax, want_argmax)
    np.testing.assert_array_equal(argmax, np.argmax(np.where(np.isnan(x), np.inf, x.astype(np.float64)), -1))
    has_nan = np.isnan(x).any(-1)
    np.testing.assert_array_equal(np.asarray(peak)[~has_nan], np.asarray(want_peak)[~has_nan])
    assert np.isnan(np.asarray(peak)[has_nan]).all() and np.isnan(np.asarray(log_sum)[has_nan]).all()
    np.testing.assert_allclose(np.asarray(log_sum)[~has_nan], np.asarray(want_log_sum)[~has_nan], rtol=1e-6, atol=1e-6)
    if vocab > 1:  # all -inf and a +inf: NaN, as jax.nn.log_softmax's (raw - max) has them
        assert np.isnan(np.asarray(log_sum)[[2, 5]]).all()


def test_xlas_argmax_takes_the_first_nan_of_a_long_row(monkeypatch):
    """XLA:CPU's max drops NaN from rows of 4096 or more: `vocab_argmax` looks for a row's NaNs apart, so a NaN
    after the maximum, or after a -inf, still wins (as `jnp.argmax`), with or without the extension."""
    x = np.zeros((3, 4096), np.float32)
    x[0, 3], x[0, 4000] = 99.0, np.nan
    x[1, 0], x[1, -1] = -np.inf, np.nan
    x[2, 5] = 7.0
    for setting in ("0", "1"):
        monkeypatch.setenv("MTP_JAX_ONEDNN", setting)
        argmax = jax.jit(lambda v: sharding.vocab_argmax(v))(jnp.asarray(x))  # traced anew for each setting
        np.testing.assert_array_equal(argmax, [4000, 4095, 5])


@built
def test_a_rows_numbers_do_not_depend_on_its_neighbours():
    """Rows are split over the cores from 64 Ki logits: each row's results equal, bit for bit, the row alone;
    under vmap the same; only the argmax without raw logits."""
    rng = np.random.default_rng(1)
    raw = jnp.asarray(rng.normal(0, 4, (3, 24, 4096)), jnp.bfloat16)
    processed = raw.astype(jnp.float32) - 0.5
    together = jax.jit(vocab_stats)(processed, raw)
    alone = [
        jax.jit(vocab_stats)(processed[i : i + 1, j : j + 1], raw[i : i + 1, j : j + 1]) for i, j in [(0, 0), (2, 23)]
    ]
    for (i, j), one in zip([(0, 0), (2, 23)], alone, strict=True):
        for a, b in zip(together, one, strict=True):
            np.testing.assert_array_equal(np.asarray(a)[i, j], np.asarray(b)[0, 0])
    mapped = jax.jit(jax.vmap(vocab_stats))(processed, raw)
    for a, b in zip(together, mapped, strict=True):
        np.testing.assert_array_equal(a, b)
    (argmax,) = jax.jit(vocab_stats)(processed)
    np.testing.assert_array_equal(argmax, together[0])


@built
def test_vocab_stats_names_a_shape_mismatch():
    with pytest.raises(ValueError, match=r"raw \[2, 5\] must have processed's shape \[2, 6\]"):
        vocab_stats(jnp.zeros((2, 6)), jnp.zeros((2, 5)))


@built
def test_the_vocabulary_goes_to_the_extension_only_on_the_cpu_without_a_mesh(monkeypatch):
    assert reads_vocab()
    with jax.set_mesh(jax.make_mesh((1,), ("tensor",))):
        assert not reads_vocab()  # the call is opaque to GSPMD
    monkeypatch.setenv("MTP_JAX_ONEDNN", "0")
    assert not reads_vocab()
    monkeypatch.setattr(cpu_extension, "_extension", lambda: None)
    monkeypatch.delenv("MTP_JAX_ONEDNN")
    assert not reads_vocab()


@built
def test_greedy_tokens_and_logprobs_are_the_same_with_and_without_it(monkeypatch):
    """A float32 model's plain and eagle greedy generations: the same tokens with the extension's reductions and
    with XLA's, and logprobs within float32 rounding of the log-sum-exp."""
    from speculative_helpers import CFG, PROMPTS, make_model

    model = make_model(CFG, 5, 0.3)
    spec = mtp_jax.SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    runs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("MTP_JAX_ONEDNN", setting)
        jax.clear_caches()
        runs[setting] = [
            mtp_jax.generate(model, PROMPTS, max_new_tokens=12, max_length=40, speculative=sp) for sp in (None, spec)
        ]
    for on, off in zip(runs["1"], runs["0"], strict=True):
        assert on.tokens == off.tokens
        np.testing.assert_allclose(np.concatenate(on.logprobs), np.concatenate(off.logprobs), rtol=1e-5, atol=1e-6)
