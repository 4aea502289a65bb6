"""The drafters (`mtp_jax.decode.drafters`, `docs/MTP_SPEC.md`) and `SpeculativeConfig`: for eagle, vanilla and
parallel, with the reference attention and the Pallas kernel, cached drafts equal a no-cache oracle at every
step boundary with NaN in every stale slot, greedy stays lossless and the counters match the acceptances; at
the capacity, with draft and verify windows past it, rows end exactly and live cache entries stay intact; the
oracle drafter replays given tokens; impossible requests and bad configs raise.

The lossless and capacity tests drive the engine's step by hand with every drafter: they share one module so
that each (method, K, attention) step compiles once (`conftest.py` clears JAX's caches after each module).

Models, the draft oracle and the step driver: `speculative_helpers` and the `models` / `plain` fixtures
(`conftest.py`).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import (
    CFG,
    CYCLES,
    END_THINK,
    IMPLS,
    MAX_NEW,
    PROMPTS,
    THINK,
    D,
    S,
    drive,
    generated,
    make_model,
    oracle_drafts,
    spec,
    style,
    with_impl,
)

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import sequence_positions
from mtp_jax.mtp import MAIN_PARAMS, initial_hidden, shift_left

GRID = (
    [("eagle", k) for k in range(1, 5)]
    + [("vanilla", k) for k in range(1, D + 1)]
    + [("parallel", k) for k in range(1, D + 1)]
)


def observed_accepts(trace, k_max: int) -> list[tuple[int, int, int]]:
    """(step, row, drafts accepted and committed) for each row active in each step, read off the trace:
    greedy acceptance is the run of leading drafts equal to the committed block."""
    out = []
    for step, (before, after) in enumerate(zip(trace[:-1], trace[1:], strict=True)):
        for b in np.flatnonzero(~before["done"]):
            start, num = before["lengths"][b], after["lengths"][b] - before["lengths"][b]
            block = after["tokens"][b, start : start + num]
            matches = block[:k_max] == before["drafts"][b, : len(block[:k_max])]
            out.append((step, int(b), int(np.cumprod(matches).sum())))
    return out


def has_zero_partial_full(histogram, k_max: int) -> bool:
    return histogram[0] > 0 and histogram[k_max] > 0 and (k_max == 1 or sum(histogram[1:k_max]) > 0)


@nnx.jit
def _fresh_caches(model, tokens):
    """The main cache and eagle's module cache recomputed from scratch over committed tokens [B, S]."""
    batch, module = tokens.shape[0], model.mtp[0]
    positions = sequence_positions(batch, S)
    _, hidden, main = model(tokens, positions, model.init_cache(batch, S))
    _, _, module_cache = module(
        initial_hidden(model, hidden),
        shift_left(tokens, 1),
        positions,
        module.init_cache(batch, S),
        embed=model.embed,
        head=model.head,
    )
    return main, module_cache


# ---------------------------------------------------------------------------------------------
# Lossless greedy; cached drafts == no-cache oracle; NaN in stale slots changes nothing; counters


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method, k", GRID)
def test_greedy_is_lossless_and_drafts_equal_the_no_cache_oracle(models, plain, method, k, impl):
    """Both models, with the reference attention and with the kernel, stale cache slots NaN before every
    step: the tokens and logprobs equal plain greedy decoding, the drafts at every step boundary equal the
    no-cache oracle, and the counters equal the acceptances read off the committed blocks. On the scripted
    model steps accepting 0, some and all drafts all occur. The think tokens are named with relaxed
    acceptance off, and row 0's prompt ends in `<think>`: nothing changes."""
    sp = spec(method, k)
    for name, model in models[style(method)].items():
        state, trace = drive(with_impl(model, impl), sp, PROMPTS, MAX_NEW, poison=True)
        expected = plain(style(method), name, impl)
        assert generated(state, PROMPTS) == expected.tokens, name
        assert [len(t) for t in expected.tokens] == MAX_NEW
        logprobs = np.asarray(state.logprobs)
        for b, prompt in enumerate(PROMPTS):
            np.testing.assert_allclose(
                logprobs[b, len(prompt) : len(prompt) + MAX_NEW[b]], expected.logprobs[b], atol=2e-5
            )
        for step, snap in enumerate(trace):
            active = ~snap["done"]
            want = oracle_drafts(model, method, snap["tokens"], snap["lengths"], snap["drafts"])
            np.testing.assert_array_equal(snap["drafts"][active], want[active], err_msg=f"{name}, step {step}")

        histogram = np.zeros((3, k + 1), int)
        for _, b, n in observed_accepts(trace, k):
            histogram[b, n] += 1
        m = jax.device_get(state.metrics)
        np.testing.assert_array_equal(m.accepted_length_histogram, histogram)
        np.testing.assert_array_equal(m.num_steps, histogram.sum(1))
        np.testing.assert_array_equal(m.num_drafts, k * histogram.sum(1))
        np.testing.assert_array_equal(m.num_accepted, (histogram * np.arange(k + 1)).sum(1))
        np.testing.assert_array_equal(
            m.accepted_per_position, [[histogram[b, j + 1 :].sum() for j in range(k)] for b in range(3)]
        )
        # Tokens: 1 from prefill, then a + 1 per step, except a last step cut by max_new_tokens.
        full = 1 + m.num_steps + m.num_accepted
        assert np.all((np.asarray(MAX_NEW) == full) | (np.asarray(MAX_NEW) == full - 1)), full
        if name == "scripted":  # by construction: steps accept none, some and all drafts; speculation pays off
            assert has_zero_partial_full(histogram.sum(0), k), histogram
            assert len(trace) - 1 < max(MAX_NEW) - 1


# ---------------------------------------------------------------------------------------------
# Capacity


@pytest.mark.parametrize("method", ["eagle", "vanilla", "parallel"])
def test_plain_steps_that_skip_drafting_keep_the_mtp_caches(models, plain, method):
    """Adaptive speculation's cheapest plain step (`draft_next=False`: the MTP modules only write their caches)
    between steps that draft and verify, stale slots NaN before each: greedy output unchanged, and the drafts
    made after any run of such steps equal the no-cache oracle (the caches they left are the full steps')."""
    sp, model = spec(method, 3), models[style(method)]["scripted"]
    schedule = [(0, False), (0, False), (0, True), (3, True), (0, False), (0, True), (1, True), (2, True)]
    state, trace = drive(model, sp, PROMPTS, MAX_NEW, poison=True, schedule=schedule)
    assert generated(state, PROMPTS) == plain(style(method), "scripted").tokens
    drafted = [0] + [i + 1 for i in range(len(trace) - 1) if schedule[i % len(schedule)][1]]  # after prefill too
    assert len(drafted) > 6
    for step in drafted:
        snap = trace[step]
        want = oracle_drafts(model, method, snap["tokens"], snap["lengths"], snap["drafts"])
        np.testing.assert_array_equal(snap["drafts"][~snap["done"]], want[~snap["done"]], err_msg=f"step {step}")
    engine = DecodeEngine(model, sp)
    with pytest.raises(ValueError, match="draft_next=False needs num_drafts=0"):
        engine.step_with_output(state, num_drafts=1, draft_next=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("method, k", [("eagle", 1), ("eagle", 4), ("eagle", 8), ("vanilla", 3)])
def test_capacity_ends_rows_exactly_and_live_cache_entries_stay_intact(models, method, k, impl):
    """Prompts K and 1 tokens short of S get exactly K and 1 tokens, == plain greedy, with the reference
    attention and with the kernel. Every row runs to the capacity while the verify and draft windows reach
    past S (the verify attention then sees lengths beyond S; stale slots NaN before each step); the live
    cache entries then equal a recompute from scratch, so no write was clamped onto them."""
    model, sp = with_impl(models["deepseek"]["scripted"], impl), spec(method, k)
    prompts = [(CYCLES[0] * 5)[: S - k], (CYCLES[1] * 7)[: S - 1], [5]]
    expected = generate(model, prompts, max_new_tokens=100, max_length=S, stop_tokens=[])
    assert [len(t) for t in expected.tokens] == [k, 1, S - 1] and expected.finish_reasons == ["capacity"] * 3
    state, _ = drive(model, sp, prompts, 100, poison=True)
    assert generated(state, prompts) == expected.tokens
    np.testing.assert_array_equal(state.lengths, [S] * 3)  # the caches hold positions 0 .. S - 2
    main, module = _fresh_caches(model, state.tokens)
    fresh = [(main, state.cache)] + ([(module, state.draft.caches[0])] if method == "eagle" else [])
    for want, got in fresh:
        for leaf_want, leaf_got in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(leaf_got)[:, : S - 1], np.asarray(leaf_want)[:, : S - 1], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Impossible requests


@pytest.mark.parametrize(
    "style_, kwargs, message",
    [
        ("deepseek", dict(method="vanilla", num_speculative_tokens=4), "exceeds the model's 3 MTP modules"),
        ("parallel", dict(method="parallel", num_speculative_tokens=4), "exceeds the model's 3 MTP modules"),
        ("deepseek", dict(method="parallel", num_speculative_tokens=2), "parallel heads"),
        ("parallel", dict(method="eagle", num_speculative_tokens=2), "DeepSeek-style"),
        ("none", dict(method="eagle", num_speculative_tokens=2), "no MTP modules"),
        (
            "deepseek",
            dict(
                method="eagle",
                num_speculative_tokens=2,
                relaxed_top_n=9,
                think_start_token_id=THINK,
                think_end_token_id=END_THINK,
            ),
            "relaxed_top_n",
        ),
        ("deepseek", dict(method="eagle", num_speculative_tokens=2, think_start_token_id=8), "think_start_token_id"),
    ],
)
def test_impossible_requests_raise(models, style_, kwargs, message):
    no_mtp = CFG.replace(num_nextn_predict_layers=0)
    model = make_model(no_mtp, 0, 0.02) if style_ == "none" else models[style_]["random"]
    with pytest.raises(ValueError, match=message):
        generate(model, PROMPTS, speculative=SpeculativeConfig(**kwargs), max_new_tokens=3, max_length=S)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(method="medusa"), "method"),
        (dict(draft_sampling="typical"), "draft_sampling"),
        (dict(relaxed_top_n=3), "think_start_token_id"),
        (dict(relaxed_top_n=3, relaxed_delta=-0.1, think_start_token_id=1, think_end_token_id=2), "relaxed_delta"),
    ],
)
def test_bad_speculative_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


# ---------------------------------------------------------------------------------------------
# The oracle drafter


@pytest.mark.parametrize("k", [1, 4])
def test_oracle_drafter_replays_given_tokens_and_accepts_them_all(models, k):
    """Method "oracle" drafts the given sequences (plain greedy's, by the random model's main weights in a
    model with no MTP modules: the oracle needs none): every draft is accepted except where a row's cap
    cuts the block, and the tokens equal plain greedy."""
    model = make_model(CFG.replace(num_nextn_predict_layers=0), 0, 0.0)
    nnx.update(model, nnx.state(models["deepseek"]["random"], MAIN_PARAMS))
    expected = generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[]).tokens
    reference = np.zeros((3, S), np.int32)
    for b, (p, t) in enumerate(zip(PROMPTS, expected, strict=True)):
        reference[b, : len(p) + len(t)] = p + t
    engine = DecodeEngine(model, spec("oracle", k))
    state, padded = engine.init_state(
        PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[], oracle_tokens=reference
    )
    result = engine.result(engine.run(engine.prefill(state, padded)), 0.0)
    assert result.tokens == expected
    steps = [-(-(n - 1) // (k + 1)) for n in MAX_NEW]  # after the prefill's token, K + 1 per step
    assert result.num_steps == max(steps) and result.metrics.num_steps == sum(steps)
    # Every committed token is an accepted draft but the bonus of each full block (a block cut short by
    # max_new_tokens commits drafts only).
    assert result.metrics.num_accepted == sum(n - 1 - (n - 1) // (k + 1) for n in MAX_NEW)


def test_oracle_tokens_are_checked(models):
    model = models["deepseek"]["random"]
    with pytest.raises(ValueError, match="oracle_tokens is required"):
        generate(model, PROMPTS, speculative=spec("oracle", 2), max_new_tokens=3, max_length=S)
    with pytest.raises(ValueError, match="oracle_tokens is required with method='oracle' and only there"):
        DecodeEngine(model, spec("eagle", 2)).init_state(
            PROMPTS, max_new_tokens=3, max_length=S, oracle_tokens=np.zeros((3, S), np.int32)
        )
    with pytest.raises(ValueError, match=r"oracle_tokens must be an int array \[B=3, R\]"):
        DecodeEngine(model, spec("oracle", 2)).init_state(
            PROMPTS, max_new_tokens=3, max_length=S, oracle_tokens=np.zeros((2, S), np.int32)
        )
    with pytest.raises(ValueError, match="draft_sampling must be 'greedy'"):
        SpeculativeConfig(method="oracle", draft_sampling="sample")
