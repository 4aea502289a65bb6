"""Sampling filters on hand examples, and the sampler's empirical distribution."""

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.decode.sampling import SamplingParams, SamplingState, row_keys, sample, target_probs

LOGITS = jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.3]]))


def _state(**kwargs):
    return SamplingState.from_params([SamplingParams(**kwargs)])


def test_greedy_is_one_hot_at_argmax():
    np.testing.assert_array_equal(target_probs(LOGITS, _state()), [[0, 1, 0, 0]])


def test_temperature_one_is_softmax():
    np.testing.assert_allclose(target_probs(LOGITS, _state(temperature=1.0)), [[0.1, 0.4, 0.2, 0.3]], rtol=1e-6)


def test_temperature_sharpens():
    probs = np.array([0.1, 0.4, 0.2, 0.3]) ** 2
    np.testing.assert_allclose(target_probs(LOGITS, _state(temperature=0.5)), [probs / probs.sum()], rtol=1e-5)


def test_top_k_keeps_k_most_likely():
    np.testing.assert_allclose(
        target_probs(LOGITS, _state(temperature=1.0, top_k=2)), [[0, 4 / 7, 0, 3 / 7]], rtol=1e-6
    )


def test_top_p_keeps_smallest_set_reaching_p():
    # Sorted: 0.4, 0.3, 0.2, 0.1; mass before each: 0, 0.4, 0.7, 0.9. top_p = 0.65 keeps 0.4 and 0.3.
    np.testing.assert_allclose(
        target_probs(LOGITS, _state(temperature=1.0, top_p=0.65)), [[0, 4 / 7, 0, 3 / 7]], rtol=1e-6
    )
    # top_p below the first token's mass keeps exactly one token.
    np.testing.assert_allclose(target_probs(LOGITS, _state(temperature=1.0, top_p=0.1)), [[0, 1, 0, 0]])


def test_top_k_then_top_p():
    # top_k = 3 leaves 0.4, 0.3, 0.2 (renormalised 4/9, 3/9, 2/9); top_p = 0.5 then keeps 4/9 and 3/9.
    np.testing.assert_allclose(
        target_probs(LOGITS, _state(temperature=1.0, top_k=3, top_p=0.5)), [[0, 4 / 7, 0, 3 / 7]], rtol=1e-6
    )


def test_empirical_distribution_matches_target():
    """20,000 draws at distinct positions: every frequency within 4.5 standard errors of its probability."""
    n = 20_000
    state = SamplingState.from_params([SamplingParams(temperature=1.0, seed=7)] * n)
    logits = jnp.broadcast_to(LOGITS, (n, 4))
    draws = np.asarray(jax.jit(sample)(logits, state, jnp.arange(n, dtype=jnp.int32)))
    freq = np.bincount(draws, minlength=4) / n
    p = np.array([0.1, 0.4, 0.2, 0.3])
    assert np.all(np.abs(freq - p) < 4.5 * np.sqrt(p * (1 - p) / n)), freq


def test_every_seed_in_range_has_its_own_key():
    """Seeds are uint32: s and s + 2**31 (which an int32 would wrap together) draw different keys, up to 2**32 - 1."""
    seeds = [5, 5 + 2**31, 2**31 - 1, 2**31, 2**32 - 1, 0]
    state = SamplingState.from_params([SamplingParams(seed=s) for s in seeds])
    keys = jax.random.key_data(row_keys(state, jnp.zeros(len(seeds), jnp.int32)))
    assert len({tuple(k) for k in np.asarray(keys).tolist()}) == len(seeds)
    expected = jax.random.key_data(jax.random.fold_in(jax.random.fold_in(jax.random.key(np.uint32(2**32 - 1)), 0), 0))
    np.testing.assert_array_equal(keys[4], expected)


def test_tiny_temperature_is_the_argmax_not_nan():
    """logits / 1e-37 overflows float32 (inf - inf = NaN); the shifted logits only reach -inf."""
    logits = jnp.asarray([[-2.0, 1.0, 50.0, 49.0], [50.0, 50.0, 1.0, -2.0]])
    for extra in ({}, {"top_k": 3}, {"top_p": 0.9}):
        state = SamplingState.from_params([SamplingParams(temperature=1e-37, **extra)] * 2)
        np.testing.assert_array_equal(target_probs(logits, state), [[0, 0, 1, 0], [0.5, 0.5, 0, 0]])  # ties split
    n = 256
    state = SamplingState.from_params([SamplingParams(temperature=1e-37, seed=s) for s in range(n)])
    draws = np.asarray(jax.jit(sample)(jnp.broadcast_to(logits[0], (n, 4)), state, jnp.arange(n, dtype=jnp.int32)))
    np.testing.assert_array_equal(draws, np.full(n, 2))


def test_shifting_by_the_row_max_leaves_ordinary_temperatures_unchanged():
    """softmax(logits / t), the formula before the shift, for a batch of mixed temperatures (greedy row included)."""
    logits = jax.random.normal(jax.random.key(0), (5, 3, 50)) * 4
    temperatures = [0.3, 0.7, 1.0, 1.5, 0.0]
    probs = target_probs(logits, SamplingState.from_params([SamplingParams(temperature=t) for t in temperatures]))
    for b, t in enumerate(temperatures):
        expected = jax.nn.one_hot(jnp.argmax(logits[b], -1), 50) if t == 0 else jax.nn.softmax(logits[b] / t, -1)
        np.testing.assert_allclose(probs[b], expected, rtol=1e-5, atol=1e-7)
