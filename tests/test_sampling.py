"""Sampling filters on hand examples, the sampler's empirical distribution, and the logits processing
(logit bias, min_tokens, penalties) against a numpy reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_acceptance import processed_reference

from mtp_jax.decode.sampling import (
    SamplingMetadata,
    SamplingParams,
    SamplingState,
    process_logits,
    row_keys,
    sample,
    target_probs,
)

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


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely():
    # p = 0.1, 0.4, 0.2, 0.3; min_p = 0.45 keeps p >= 0.18, renormalised.
    np.testing.assert_allclose(
        target_probs(LOGITS, _state(temperature=1.0, min_p=0.45)), [[0, 4 / 9, 2 / 9, 3 / 9]], rtol=1e-6
    )
    # after temperature 0.5 (p ~ 1, 16, 4, 9): 0.5 keeps 16 and 9
    np.testing.assert_allclose(
        target_probs(LOGITS, _state(temperature=0.5, min_p=0.5)), [[0, 16 / 25, 0, 9 / 25]], rtol=1e-5
    )
    np.testing.assert_array_equal(target_probs(LOGITS, _state(min_p=0.9)), [[0, 1, 0, 0]])  # greedy: unchanged


def test_processed_logits_count_the_committed_output_and_the_tokens_ahead():
    """`process_logits` at T = 4 positions of rows with a prompt, a committed output and 3 tokens ahead
    (drafts), equals the numpy reference
    position by position: the history of position t is the committed tokens and the first t tokens ahead;
    with `start` = j (an MTP chain's draft j) the first j + t. Penalties off: only the bias and min_tokens."""
    V, rng = 11, np.random.default_rng(0)
    rows = [
        (
            SamplingParams(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4, min_tokens=4),
            [2, 3, 9],
            [4, 4, 2, 7],
        ),
        (SamplingParams(repetition_penalty=0.8, logit_bias={1: 3.0, 4: -2.5}, min_tokens=1), [5, 5, 1], [8]),
        (SamplingParams(logit_bias={0: 1.0}, min_tokens=9), [6, 0], []),  # (no penalty: this row unchanged)
    ]  # (params, prompt, output)
    stops = [[7, 4], [1], [0, 10]]
    tokens = np.zeros((3, 16), np.int32)
    for b, (_, prompt, output) in enumerate(rows):
        tokens[b, : len(prompt) + len(output)] = prompt + output
    lengths = np.asarray([len(p) + len(o) for _, p, o in rows], np.int32)
    output_start = np.asarray([len(p) for _, p, _ in rows], np.int32)
    stop_tokens = np.full((3, 4), -1, np.int32)
    for b, s in enumerate(stops):
        stop_tokens[b, : len(s)] = s
    ahead = np.asarray([[4, 4, 1], [8, 3, 8], [2, 2, 2]], np.int32)
    logits = rng.normal(size=(3, 4, V)).astype(np.float32) * 3
    sampling = SamplingState.from_params([r[0] for r in rows])
    for penalized in (True, False):
        if not penalized:  # the penalties' cond off: every row as if penalty-free
            rows = [
                (dataclasses.replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0), *r)
                for p, *r in rows
            ]
            sampling = SamplingState.from_params([r[0] for r in rows])
        metadata = SamplingMetadata.build(
            sampling, V, jnp.asarray(tokens), jnp.asarray(output_start), jnp.asarray(lengths), jnp.asarray(stop_tokens)
        )
        for start in (0, 1):
            out = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), metadata, jnp.asarray(ahead), start))
            for b, (params, prompt, output) in enumerate(rows):
                for t in range(4):
                    seen = output + ahead[b, : min(start + t, 3)].tolist()
                    expected = processed_reference(logits[b, t], prompt, seen, params, stops[b])
                    np.testing.assert_allclose(out[b, t], expected, rtol=1e-5, err_msg=f"row {b} position {t}")
        after = metadata.after(jnp.asarray(tokens), jnp.asarray(lengths - 2), jnp.asarray([2, 1, 0]), 4)
        np.testing.assert_array_equal(np.asarray(after.num_generated), np.asarray(metadata.num_generated) + [2, 1, 0])
        if penalized:  # the last 2 / 1 / 0 tokens counted again, as a step that committed them
            again = np.asarray(after.output_bin_counts) - np.asarray(metadata.output_bin_counts)
            assert again[0].tolist() == np.bincount([2, 7], minlength=V).tolist()
            assert again[1].tolist() == np.bincount([1], minlength=V).tolist() and not again[2].any()


def test_penalty_and_min_p_fields_are_checked():
    for bad, message in (
        (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), r"repetition_penalty must be in \[1e-6, 1e6\]"),
        (dict(repetition_penalty=1e-40), "repetition_penalty"),  # (1e-40 overflowed logits to inf)
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (dict(min_tokens=-1), "min_tokens must be an int >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(**bad)
    for bad, message in (
        (dict(min_tokens=1.5), "min_tokens must be an int"),
        (dict(min_p="0.1"), "min_p must be a number"),
    ):
        with pytest.raises(TypeError, match=message):
            SamplingParams(**bad)
    assert SamplingParams(frequency_penalty=0.1).penalized and not SamplingParams(min_p=0.2, min_tokens=3).penalized
