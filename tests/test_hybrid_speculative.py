"""Speculative decoding on Qwen3.5-shaped hybrid models (`ModelConfig.layer_types`: Gated DeltaNet layers whose
cache is a per-row recurrent state, `mtp_jax.cache.RecurrentCache`), dense and MoE (`speculative_helpers.HYBRID`,
`HYBRID_MOE`): greedy eagle decoding equals plain greedy decoding through steps that reject the first draft,
the last one or none, rows of different prompt lengths, finishing at different steps, one at the capacity; the
recurrent states at every step boundary equal a non-speculative computation over the committed tokens
(`docs/MTP_SPEC.md`, "Recurrent layers"), and stay put once a row is done; right padding in a batch changes
nothing; sampled speculation is distributed as plain sampling; chunked prefill continues the states exactly.

One capacity S and batch of 3 serve every test of a model kind, so each (K, prompt width) program compiles once
for the module. Models: the `hybrid_models` fixture (`conftest.py`); scripted weights fix the acceptance
pattern, random ones (std 0.3) make the recurrent memory decide tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import PROMPTS, S, memoryless, recurrent_states, spec
from test_acceptance import check_sampled_generation
from test_drafters import has_zero_partial_full, observed_accepts

from mtp_jax.cache import RecurrentCache
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.layers.gated_deltanet import RECURRENT_MAX_TOKENS
from mtp_jax.model import sequence_positions

KINDS = ["dense", "moe"]
MAX_NEW = [25, 20, 100]  # rows end at different steps; row 2 (a 1-token prompt) runs into the capacity S
KS = [1, 2, 3, 4]
RTOL, ATOL = 1e-4, 1e-5  # states: see `assert_states_close`


# ---------------------------------------------------------------------------------------------
# Driving the jitted step, recording the recurrent states; the non-speculative state oracle


def _snapshot(state) -> dict:
    host = jax.device_get(dict(tokens=state.tokens, lengths=state.lengths, done=state.done, drafts=state.draft.tokens))
    snap = {k: np.array(v) for k, v in host.items()}
    snap["recurrent"] = recurrent_states(state.cache)
    return snap


def drive_recording(model, sp, prompts, max_new):
    """Prefill (whole), then `DecodeEngine.step` until every row is done; returns the final state and a snapshot
    (tokens, lengths, done, drafts and every recurrent layer's (state, conv)) per step boundary."""
    engine = DecodeEngine(model, sp)
    state, padded = engine.init_state(prompts, max_new_tokens=max_new, max_length=S, stop_tokens=[])
    state = engine.prefill(state, padded)
    trace = [_snapshot(state)]
    while not trace[-1]["done"].all():
        state = engine.step(state)
        trace.append(_snapshot(state))
    return state, trace


@nnx.jit
def _oracle_states(model, tokens, lengths):
    """The recurrent layers' caches of one plain forward from an empty cache over row b's first lengths[b] - 1
    tokens of `tokens` [B, W] (`advance`: the rest is padding): what a non-speculative run has absorbed when it
    has committed lengths[b] tokens. One width for every call, so it compiles once per model kind."""
    batch, width = tokens.shape
    _, _, cache = model(
        tokens, sequence_positions(batch, width), model.init_cache(batch, width), with_logits=False, advance=lengths - 1
    )
    return tuple(c for c in cache if isinstance(c, RecurrentCache))


def oracle_states(model, tokens: np.ndarray, lengths: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(state, conv) per recurrent layer after rows' committed tokens `tokens[b, :lengths[b] - 1]` ([B, S])."""
    return recurrent_states(_oracle_states(model, jnp.asarray(tokens), jnp.asarray(lengths, jnp.int32)))


def assert_states_close(got, want, rows, message: str) -> None:
    """Each recurrent layer's (state, conv) of rows `b_got` of `got` equal rows `b_want` of `want`, for (b_got,
    b_want) in `rows`, to float32 rounding: rtol 1e-4 and atol 1e-5 times the array's largest magnitude (at
    least 1). Measured: the random-weight models' second-layer states differ from the oracle's by up to 1.5e-5
    of their largest entry (~4), for plain decoding as for speculation, whichever Gated DeltaNet form the oracle
    takes (the rounding of differently shaped matmuls, amplified through the layers by std-0.3 weights); the
    scripted models' by < 1.2e-6. A state that absorbed one token too many or too few is off by 0.2 or more of
    its largest entry."""
    assert len(got) == len(want) == 2  # the two Gated DeltaNet layers
    for layer, ((state, conv), (want_state, want_conv)) in enumerate(zip(got, want, strict=True)):
        for b_got, b_want in rows:
            where = f"{message}, layer {layer}, row {b_got}"
            for name, a, b in (("state", state[b_got], want_state[b_want]), ("conv", conv[b_got], want_conv[b_want])):
                atol = ATOL * max(1.0, float(np.abs(b).max()))
                np.testing.assert_allclose(a, b, rtol=RTOL, atol=atol, err_msg=f"{where}, {name}")


@pytest.fixture(scope="module")
def runs(hybrid_models):
    """runs(kind, weights, k): eagle-K greedy decoding of PROMPTS by `drive_recording` (computed once each)."""

    @functools.cache
    def run(kind: str, weights: str, k: int):
        return drive_recording(hybrid_models[kind][weights], spec("eagle", k), PROMPTS, MAX_NEW)

    return run


@pytest.fixture(scope="module")
def plain_greedy(hybrid_models):
    """plain_greedy(kind, weights): `generate` with no speculative config, the reference (computed once each)."""

    @functools.cache
    def run(kind: str, weights: str):
        model = hybrid_models[kind][weights]
        return generate(model, PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])

    return run


# ---------------------------------------------------------------------------------------------
# 1. Lossless greedy


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_greedy_equals_plain_greedy(runs, plain_greedy, kind, k):
    """Eagle K greedy equals plain greedy (tokens and logprobs) for scripted and random weights. The scripted
    runs contain steps rejecting the first draft, steps rejecting the last draft only (K >= 2), and steps
    accepting all; rows of prompt lengths 4, 9 and 1 end at different steps, by max_new (25, 20) and by the
    capacity (row 2: S - 1 tokens, its last verify windows reaching past S). Logprobs to 1e-4: the verify
    pass computes the random MoE model's logits ~3e-5 away from plain decoding's (float32 rounding)."""
    for weights in ("scripted", "random"):
        state, trace = runs(kind, weights, k)
        expected = plain_greedy(kind, weights)
        assert expected.finish_reasons == ["length", "length", "capacity"]
        assert [len(t) for t in expected.tokens] == [25, 20, S - 1]
        got = [np.asarray(state.tokens)[b, len(p) : int(state.lengths[b])].tolist() for b, p in enumerate(PROMPTS)]
        assert got == expected.tokens, weights
        logprobs = np.asarray(state.logprobs)
        for b, prompt in enumerate(PROMPTS):
            np.testing.assert_allclose(
                logprobs[b, len(prompt) : int(state.lengths[b])], expected.logprobs[b], atol=1e-4, err_msg=weights
            )
        finished_at = [next(i for i, snap in enumerate(trace) if snap["done"][b]) for b in range(3)]
        assert len(set(finished_at)) > 1, finished_at  # a row done while others step
        if weights == "scripted":
            histogram = np.bincount([n for _, _, n in observed_accepts(trace, k)], minlength=k + 1)
            assert has_zero_partial_full(histogram, k), histogram
            assert k == 1 or histogram[k - 1] > 0, histogram  # all drafts but the last accepted
            assert len(trace) - 1 < S - 2  # fewer steps than row 2's tokens: speculation accepted drafts


@pytest.mark.parametrize("kind", KINDS)
def test_random_weights_tokens_depend_on_the_recurrent_memory(hybrid_models, plain_greedy, kind):
    """The random-weight runs above test the recurrent state only if it decides tokens: the same model with
    Gated DeltaNets that forget everything at each token (`memoryless`) decodes every prompt differently."""
    expected = plain_greedy(kind, "random")
    forgetful = generate(
        memoryless(hybrid_models[kind]["random"]), PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[]
    )
    for b in range(len(PROMPTS)):
        assert forgetful.tokens[b] != expected.tokens[b], b


# ---------------------------------------------------------------------------------------------
# 2. The state oracle


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", KINDS)
def test_recurrent_states_equal_a_non_speculative_run_over_the_committed_tokens(hybrid_models, runs, kind, k):
    """After prefill and after every step, each Gated DeltaNet layer's state and conv window of every row equal
    those of one plain forward over the row's committed tokens but the last (positions 0 .. L_b - 2), computed
    from an empty cache: the speculative steps kept exactly the state after each row's last committed token,
    whatever was rejected. A row that is done keeps its state bit for bit through the later steps."""
    for weights in ("scripted", "random"):
        model = hybrid_models[kind][weights]
        _, trace = runs(kind, weights, k)
        rows = [(b, b) for b in range(3)]
        for step, snap in enumerate(trace):
            want = oracle_states(model, snap["tokens"], snap["lengths"])
            assert_states_close(snap["recurrent"], want, rows, f"{weights}, step {step}")
        finished_at = [next(i for i, snap in enumerate(trace) if snap["done"][b]) for b in range(3)]
        assert min(finished_at) < len(trace) - 1  # some row is done while another still steps
        for b, finished in enumerate(finished_at):
            for later in trace[finished + 1 :]:
                assert later["lengths"][b] == trace[finished]["lengths"][b]
                for (state, conv), (state_then, conv_then) in zip(
                    later["recurrent"], trace[finished]["recurrent"], strict=True
                ):
                    np.testing.assert_array_equal(state[b], state_then[b])
                    np.testing.assert_array_equal(conv[b], conv_then[b])


# ---------------------------------------------------------------------------------------------
# 3. Right padding


def _prompts(lengths, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 8, n).tolist() for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
def test_padding_in_a_batch_changes_no_row(hybrid_models, kind):
    """Prompts of 1, 12 and 33 tokens in one batch: the prompt array is 40 wide (33 rounded up to the prompt
    bucket, capped at S), so the shortest prompt is followed by 39 padding tokens, and the prefill takes the
    Gated DeltaNet's chunked form (> RECURRENT_MAX_TOKENS tokens) where the short prompts alone take the
    recurrent one. Each row's tokens, lengths, drafts and recurrent states at every step boundary equal those of
    a batch holding only copies of its prompt (padded to its own bucket, 16 or 40), random weights, eagle K=2."""
    model, sp = hybrid_models[kind]["random"], spec("eagle", 2)
    prompts, max_new = _prompts([1, 12, 33], seed=5), [30, 20, 6]
    _, padded = DecodeEngine(model, sp).init_state(prompts, max_new_tokens=max_new, max_length=S)
    assert padded.shape[1] == S == 40 > RECURRENT_MAX_TOKENS
    _, mixed = drive_recording(model, sp, prompts, max_new)
    for b, prompt in enumerate(prompts):
        _, alone = drive_recording(model, sp, [prompt] * 3, [max_new[b]] * 3)
        assert len(alone) <= len(mixed)
        for step, (snap, ref) in enumerate(zip(mixed[: len(alone)], alone, strict=True)):
            where = f"prompt {b}, step {step}"
            length = int(ref["lengths"][0])
            assert snap["lengths"][b] == length and snap["done"][b] == ref["done"][0], where
            np.testing.assert_array_equal(snap["tokens"][b, :length], ref["tokens"][0, :length], err_msg=where)
            if not ref["done"][0]:
                np.testing.assert_array_equal(snap["drafts"][b], ref["drafts"][0], err_msg=where)
            assert_states_close(snap["recurrent"], ref["recurrent"], [(b, 0)], where)
        assert_states_close(mixed[-1]["recurrent"], alone[-1]["recurrent"], [(b, 0)], f"prompt {b}, final")
        assert alone[-1]["lengths"][0] == len(prompt) + max_new[b]


# ---------------------------------------------------------------------------------------------
# 4. Sampling


def test_sampled_speculation_is_distributed_as_plain_sampling(hybrid_models):
    """Drafts sampled from the MTP distribution, eagle K=2, on the dense hybrid with random weights: the first
    three tokens of 4094 seeded rows follow the model's distribution (chi-square against the exact joint
    distribution, `test_acceptance.check_sampled_generation`). Token 3 comes after a step that committed 1, 2
    or 3 tokens, so it is drawn from a state selected by each of those commit counts."""
    check_sampled_generation(hybrid_models["dense"]["random"], spec("eagle", 2, draft_sampling="sample"))


# ---------------------------------------------------------------------------------------------
# 5. Chunked prefill


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_continues_the_states_exactly(hybrid_models, kind):
    """Three prompts of 38-39 tokens prefilled in chunks (`prefill` with `start`): 33 tokens (the chunked
    form), 4 (the recurrent form), both `final=False`, then a final chunk of 4 padded past each prompt. After
    each earlier chunk the recurrent states equal the oracle's over the tokens so far; after the last, the
    committed tokens, drafts, recurrent states, attention KV and MTP caches equal one whole prefill's."""
    model, sp = hybrid_models[kind]["random"], spec("eagle", 2)
    prompts = _prompts([38, 39, 38], seed=7)
    engine = DecodeEngine(model, sp)
    whole, padded = engine.init_state(prompts, max_new_tokens=1, max_length=S, stop_tokens=[])
    assert padded.shape[1] == S
    whole = engine.prefill(whole, padded)
    chunked, _ = engine.init_state(prompts, max_new_tokens=1, max_length=S, stop_tokens=[])
    full = np.zeros((3, S + 8), np.int32)
    for b, p in enumerate(prompts):
        full[b, : len(p)] = p
    for start, size, final in [(0, 33, False), (33, 4, False), (37, 4, True)]:
        assert (size > RECURRENT_MAX_TOKENS) == (start == 0)
        chunk = jnp.asarray(full[:, start : start + size])
        chunked = engine.prefill(chunked, chunk, jnp.full((3,), start, jnp.int32), final=final)
        if not final:
            want = oracle_states(model, full[:, :S], np.full(3, start + size + 1))
            assert_states_close(recurrent_states(chunked.cache), want, [(b, b) for b in range(3)], f"after {start}")
    lengths = np.asarray([len(p) + 1 for p in prompts])
    np.testing.assert_array_equal(chunked.lengths, lengths)
    np.testing.assert_array_equal(whole.lengths, lengths)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_array_equal(chunked.draft.tokens, whole.draft.tokens)
    rows = [(b, b) for b in range(3)]
    assert_states_close(recurrent_states(chunked.cache), recurrent_states(whole.cache), rows, "final")
    assert_states_close(
        recurrent_states(whole.cache), oracle_states(model, np.asarray(whole.tokens), lengths), rows, "whole"
    )
    for got, want in zip(chunked.cache, whole.cache, strict=True):
        if not isinstance(got, RecurrentCache):  # attention: entries at positions 0 .. P - 1
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                for row, p in enumerate(prompts):
                    assert_entries_close(a[row, : len(p)], b[row, : len(p)])
    for a, b in zip(jax.tree.leaves(chunked.draft.caches), jax.tree.leaves(whole.draft.caches), strict=True):
        for row, p in enumerate(prompts):
            assert_entries_close(a[row, : len(p)], b[row, : len(p)])


def assert_entries_close(a, b):
    """Cache entries of two prefills over different chunks: float32 matmuls over other row counts (another
    kernel: XLA's, or oneDNN's from 8 rows) sum in another order, within 1e-5 of the entries' scale."""
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(b).max())))


@nnx.jit
def _forward_full_logits(model, tokens):
    return model.forward_full(tokens)[0]


@nnx.jit
def _forward_cached(model, tokens, positions, cache):
    logits, _, cache = model(tokens, positions, cache)
    return logits, cache


@pytest.mark.parametrize("kind", KINDS)
def test_cached_decode_equals_a_full_forward_at_every_step(hybrid_models, kind):
    """A prefill of 12 tokens, then one token at a time through the caches (recurrent states and KV), gives at
    every step the logits of one cache-free forward over the whole sequence (40 tokens: the chunked form), to
    5e-5 of the largest logit: the two forms and the differently shaped matmuls round differently, and the
    random weights (std 0.3) amplify it to ~2e-5; a state that missed or absorbed one token is off by O(1)."""
    model = hybrid_models[kind]["random"]
    tokens = jnp.asarray(np.random.default_rng(7).integers(0, model.config.vocab_size, (2, 40)), jnp.int32)
    assert tokens.shape[1] > RECURRENT_MAX_TOKENS  # the full forward takes the chunked form, the steps the recurrent
    full = np.asarray(_forward_full_logits(model, tokens))
    scale = np.abs(full).max()
    logits, cache = _forward_cached(model, tokens[:, :12], sequence_positions(2, 12), model.init_cache(2, S))
    np.testing.assert_allclose(np.asarray(logits), full[:, :12], rtol=0, atol=5e-5 * scale)
    for t in range(12, 40):
        logits, cache = _forward_cached(model, tokens[:, t : t + 1], sequence_positions(2, 1, jnp.full((2,), t)), cache)
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, t], rtol=0, atol=5e-5 * scale, err_msg=f"t={t}")
