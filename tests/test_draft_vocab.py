"""A reduced draft vocabulary (`SpeculativeConfig.draft_vocab`, `mtp_jax.decode.draft_vocab`): drafts come
from the set only, greedy decoding stays lossless for eagle, vanilla and parallel, the whole vocabulary as
the set drafts exactly as no set (on the scripted model, whose drafts are right most of the time and
include tokens the set leaves out), sampled drafts have q = 0 outside
the set, and bad sets are refused with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from speculative_helpers import MAX_NEW, PROMPTS, S, V, drive, generated, spec, style

from mtp_jax.decode.draft_vocab import draft_head, frequent_tokens
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import SpeculativeConfig

SUBSET = (0, 1, 2, 3, 6)  # leaves out 4, 5 and 7, which the scripted cycles produce


def drafted(trace) -> set[int]:
    return {int(t) for snap in trace for t in snap["drafts"][~snap["done"]].ravel()}


@pytest.mark.parametrize("method", ["eagle", "vanilla", "parallel"])
def test_drafts_come_from_the_set_and_greedy_stays_lossless(models, plain, method):
    model = models[style(method)]["scripted"]
    full_state, full_trace = drive(model, spec(method, 3), PROMPTS, MAX_NEW)
    state, trace = drive(model, spec(method, 3, draft_vocab=SUBSET), PROMPTS, MAX_NEW)
    assert generated(state, PROMPTS) == plain(style(method), "scripted").tokens
    assert drafted(trace) <= set(SUBSET)
    assert drafted(full_trace) - set(SUBSET)  # without the set the drafter does propose 4, 5 or 7
    full_accepted = int(jax.device_get(full_state.metrics.num_accepted).sum())

    whole_state, whole_trace = drive(model, spec(method, 3, draft_vocab=range(V)), PROMPTS, MAX_NEW)
    assert [s["drafts"].tolist() for s in whole_trace] == [s["drafts"].tolist() for s in full_trace]
    assert int(jax.device_get(whole_state.metrics.num_accepted).sum()) == full_accepted


def test_sampled_drafts_have_no_probability_outside_the_set(models):
    model = models["deepseek"]["random"]
    sp = spec("eagle", 3, draft_sampling="sample", draft_vocab=SUBSET)
    engine = DecodeEngine(model, sp)
    sampling = [SamplingParams(temperature=1.0, seed=b) for b in range(len(PROMPTS))]
    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=40, sampling=sampling)
    state = engine.prefill(state, padded)
    for _ in range(4):
        state = engine.step(state)
        probs = np.asarray(state.draft.probs)  # [B, K, V]
        outside = [t for t in range(V) if t not in SUBSET]
        assert (probs[..., outside] == 0).all()
        np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
        assert set(np.asarray(state.draft.tokens).ravel().tolist()) <= set(SUBSET)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(draft_vocab=[]), ValueError, "draft_vocab is empty"),
        (dict(draft_vocab=[3, 1, 3]), ValueError, r"draft_vocab repeats token ids \[3\]"),
        (dict(draft_vocab=[-1, 2]), ValueError, "draft_vocab holds -1"),
        (dict(draft_vocab=[1, 2.0]), TypeError, "draft_vocab must hold ints"),
        (dict(draft_vocab="01"), TypeError, "draft_vocab must be a sequence of token ids"),
        (dict(method="oracle", draft_vocab=[1]), ValueError, "draft_vocab does not apply"),
    ],
)
def test_bad_draft_vocabularies_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig(**kwargs)


def test_a_set_past_the_vocabulary_is_refused_and_the_set_is_stored_sorted(models):
    sp = SpeculativeConfig(draft_vocab=np.array([5, 0, 2]))
    assert sp.draft_vocab == (0, 2, 5) and hash(sp) == hash(SpeculativeConfig(draft_vocab=[2, 5, 0]))
    with pytest.raises(ValueError, match=rf"draft_vocab holds token {V}, outside \[0, vocab_size={V}\)"):
        DecodeEngine(models["deepseek"]["random"], SpeculativeConfig(draft_vocab=[1, V]))


def test_a_set_whose_every_token_is_masked_drafts_its_first_token_and_stays_lossless(models):
    """min_tokens forbids the stop tokens 6 and 7, the whole set: each draft is then 6, the set's first."""
    model, sp = models["deepseek"]["scripted"], spec("eagle", 2, draft_vocab=(7, 6))
    sampling = SamplingParams(min_tokens=12)
    kwargs = dict(max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[6, 7], sampling=sampling)
    engine = DecodeEngine(model, sp)
    state, padded = engine.init_state(PROMPTS, **kwargs)
    state = engine.prefill(state, padded)
    assert np.asarray(state.draft.tokens).tolist() == [[6, 6]] * len(PROMPTS)
    assert generate(model, PROMPTS, speculative=sp, **kwargs).tokens == generate(model, PROMPTS, **kwargs).tokens


def test_the_set_needs_the_engine_and_speculation(models):
    model = models["deepseek"]["random"]
    with pytest.raises(ValueError, match="carries no draft head"):
        draft_head(model, SpeculativeConfig(draft_vocab=[1, 2]))
    assert draft_head(model, SpeculativeConfig()) == model.head
    with pytest.raises(ValueError, match="--speculative is none"):
        SpeculativeConfig.from_flags("none", None, model, [1, 2])


def test_arrays_of_ids_and_frequent_tokens():
    assert SpeculativeConfig(draft_vocab=jnp.array([4, 2], jnp.int32)).draft_vocab == (2, 4)
    with pytest.raises(TypeError, match=r"1-D array of int token ids, got int64\[2, 2\]"):
        SpeculativeConfig(draft_vocab=np.zeros((2, 2), np.int64))
    with pytest.raises(TypeError, match="1-D array of int token ids, got float32"):
        SpeculativeConfig(draft_vocab=np.ones(3, np.float32))
    assert frequent_tokens(np.array([[5, 5, 3], [3, 5, 9]]), 2) == (3, 5)
    assert frequent_tokens([[1, 1], [2]], 4) == (0, 1, 2, 3)  # unseen ids fill up, lowest first
    assert frequent_tokens([[7, 7], [], [2]], 1) == (7,)  # an empty document (a tokenized "") counts nothing
    assert frequent_tokens([[], []], 2) == (0, 1)
    with pytest.raises(ValueError, match="ints >= 0"):
        frequent_tokens([[1.5], []], 2)
    with pytest.raises(ValueError, match="ints >= 0"):
        frequent_tokens([[1, -1]], 2)
