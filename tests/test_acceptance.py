"""Acceptance (`mtp_jax.decode.acceptance`, `docs/MTP_SPEC.md`): lossless sampling (the emitted tokens follow
the target distribution, directly and through whole generations), zero-probability drafts never accepted, no
NaN, and relaxed acceptance in thinking phases (per row and draft position, and through generation).

Models and shared setup: `speculative_helpers` and the `models` fixture (`conftest.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import CFG, END_THINK, THINK, S, V, W, add, main_twin, scripted, spec

from mtp_jax.decode.acceptance import Target, accept
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.decode.sampling import SamplingMetadata, SamplingParams, SamplingState, target_probs
from mtp_jax.decode.speculative import SpeculativeConfig


@nnx.jit
def _main_logits(model, tokens):
    return model.forward_full(tokens)[0]


# ---------------------------------------------------------------------------------------------
# Acceptance: lossless sampling, zero-probability drafts, no NaN


def _log(p):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(p, np.float64)).astype(np.float32)


def chi_square_ok(counts: np.ndarray, probs: np.ndarray, z: float = 4.5) -> tuple[bool, str]:
    """Pearson's chi-square of `counts` against `probs`: no count where the probability is 0, and the
    statistic below the upper quantile at normal deviate z (Wilson-Hilferty; z = 4.5 is about 3e-6).
    Cells expected below 5 are pooled."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    if counts[probs == 0].sum():
        return False, f"{counts[probs == 0].sum()} samples where the target has probability 0"
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat, df = float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1
    bound = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < bound, f"chi-square {stat:.1f} vs bound {bound:.1f} (df {df}, n {n:.0f})"


def emitted(num_accepted: np.ndarray, token: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    """The tokens a step emits, [B, K + 1], -1 past the a + 1 emitted."""
    k_max = drafts.shape[1]
    index = np.arange(k_max + 1)[None, :]
    padded = np.concatenate([drafts, np.zeros_like(drafts[:, :1])], axis=1)
    out = np.where(index < num_accepted[:, None], padded, token[:, None])
    return np.where(index <= num_accepted[:, None], out, -1)


@functools.cache
def jit_accept(sp: SpeculativeConfig):
    """`accept` jitted once per config (and shapes)."""
    return jax.jit(
        lambda logits, drafts, q, sampling, *rest: accept(
            sp,
            Target.from_logits(logits, SamplingMetadata.build(sampling, logits.shape[-1])),
            drafts,
            q,
            sampling,
            *rest,
        )
    )


def with_uniform(monkeypatch, value: float, sp: SpeculativeConfig):
    """`accept` under a fresh jit with every uniform draw of the acceptance test forced to `value`."""
    monkeypatch.setattr(jax.random, "uniform", lambda key, *args, **kwargs: jnp.full((), value, jnp.float32))
    return jax.jit(
        lambda logits, drafts, q, sampling, *rest: accept(
            sp,
            Target.from_logits(logits, SamplingMetadata.build(sampling, logits.shape[-1])),
            drafts,
            q,
            sampling,
            *rest,
        )
    )


N_ROWS, SAMPLE_SPEC = 20000, spec("eagle", 2, draft_sampling="sample")  # one compile of `accept` for both tests
P = np.array([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.0, 0.3, 0.3, 0.3], [0.25, 0.25, 0.0, 0.25, 0.25]])  # p_0..p_2
Q = np.array([[0.1, 0.6, 0.0, 0.2, 0.1], [0.3, 0.3, 0.3, 0.1, 0.0]])  # q_1, q_2: zeros where p has mass


def _rows(**kwargs) -> SamplingState:
    return SamplingState.from_params([SamplingParams(seed=s, **kwargs) for s in range(N_ROWS)])


def _draw(probs: np.ndarray, rng) -> np.ndarray:
    """One token per row from probs [B, V] (inverse CDF)."""
    cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    return np.minimum((rng.random((len(probs), 1)) > cdf).sum(-1), probs.shape[-1] - 1).astype(np.int32)


@pytest.mark.parametrize("draft_sampling", ["sample", "greedy"])
def test_accept_emits_the_target_distribution(draft_sampling):
    """20000 rows with distinct seeds, drafts drawn from q (or fixed greedy drafts, q one-hot): the first
    emitted token follows p_0, the second (rows that accepted d_1) p_1, the bonus (rows that accepted both)
    p_2; d_1 is accepted at the rate sum(min(p_0, q_1)); drafts with p = 0 are never accepted."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(np.broadcast_to(_log(P), (N_ROWS, 3, 5)))
    if draft_sampling == "sample":
        drafts = np.stack([_draw(np.broadcast_to(q, (N_ROWS, 5)), rng) for q in Q], axis=1)
        q, sp = jnp.asarray(np.broadcast_to(Q, (N_ROWS, 2, 5)), jnp.float32), SAMPLE_SPEC
        rate = np.minimum(P[0], Q[0]).sum()
    else:  # half the rows draft (0, 2), half (0, 1), and p_1(1) = 0
        drafts = np.where(np.arange(N_ROWS)[:, None] % 2, np.int32([0, 2]), np.int32([0, 1]))
        q, sp = jnp.zeros((N_ROWS, 2, 0), jnp.float32), spec("eagle", 2)
        rate = P[0, 0]
    num_accepted, token = jax.device_get(
        jit_accept(sp)(
            logits,
            jnp.asarray(drafts),
            q,
            _rows(temperature=1.0),
            jnp.full((N_ROWS,), 5, jnp.int32),
            jnp.zeros((N_ROWS,), bool),
        )
    )
    out = emitted(num_accepted, token, drafts)
    for j, rows in enumerate([num_accepted >= 0, num_accepted >= 1, num_accepted == 2]):
        ok, message = chi_square_ok(np.bincount(out[rows, j], minlength=5), P[j])
        assert ok, f"emitted token {j}: {message}"
    accepted = (num_accepted >= 1).mean()
    assert abs(accepted - rate) < 4.5 * math.sqrt(rate * (1 - rate) / N_ROWS), (accepted, rate)
    zero = np.concatenate([P[0][drafts[:, :1]] == 0, P[1][drafts[:, 1:]] == 0], axis=1)  # [B, K]: p(d_j) = 0
    assert zero.any() and not np.any(zero & (np.arange(2)[None, :] < num_accepted[:, None]))


def test_zero_probability_draft_is_never_accepted_even_for_a_zero_uniform(monkeypatch):
    """Every uniform draw forced to exactly 0 (so `u * q < p` holds for any p > 0): drafts with target
    probability 0 (outside top-k, not the greedy argmax) are rejected whatever q(d), a draft with
    probability ~1e-6 is accepted."""
    logits = jnp.asarray(np.tile(np.float32([4.0, 3.0, 2.0, 1.0, -10.0]), (4, 2, 1)))  # [B, K + 1, V]
    sampling = SamplingState.from_params(
        [
            SamplingParams(temperature=1.0, top_k=2),
            SamplingParams(),
            SamplingParams(temperature=1.0, top_k=4),
            SamplingParams(temperature=1.0),
        ]
    )
    drafts = jnp.int32([[2], [1], [4], [4]])  # outside top-2; not the argmax; outside top-4; p ~ 1e-6
    q = jnp.asarray(
        np.float32([[0, 0, 1, 0, 0], [0, 0.5, 0, 0, 0.5], [0.1, 0.1, 0.1, 0.4, 0.3], [0, 0, 0, 0, 1]])[:, None, :]
    )
    accept_zero = with_uniform(monkeypatch, 0.0, spec("eagle", 1, draft_sampling="sample"))
    num_accepted, token = accept_zero(logits, drafts, q, sampling, jnp.full((4,), 3), jnp.zeros((4,), bool))
    np.testing.assert_array_equal(num_accepted, [0, 0, 0, 1])
    token = np.asarray(token)
    assert token[0] in (0, 1) and token[1] == 0 and token[2] in (0, 1, 2, 3)


def test_p_equal_to_q_with_zeros_gives_no_nan(monkeypatch):
    """q = p (temperature 0.7 and top-3 leave zeros in both): every draft is accepted and the bonus is a
    token of p_K. A rejection forced by u = 1 leaves max(0, p - q) = 0 everywhere: the row still emits a
    token of p, never NaN or a division by zero."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (N_ROWS, 3, 5)), jnp.float32)
    sampling = _rows(temperature=0.7, top_k=3)
    p = np.asarray(jax.jit(target_probs)(logits, sampling), np.float64)  # [B, K + 1, V]
    drafts = np.stack([_draw(p[:, j], rng) for j in range(2)], axis=1)
    args = (
        logits,
        jnp.asarray(drafts),
        jnp.asarray(p[:, :2], jnp.float32),
        sampling,
        jnp.zeros((N_ROWS,), jnp.int32),
        jnp.zeros((N_ROWS,), bool),
    )
    for forced, expected_accepted in [(None, 2), (1.0, 0)]:
        fn = jit_accept(SAMPLE_SPEC) if forced is None else with_uniform(monkeypatch, forced, SAMPLE_SPEC)
        num_accepted, token = (np.asarray(x) for x in fn(*args))
        assert np.all(num_accepted == expected_accepted)
        assert np.all(p[np.arange(N_ROWS), num_accepted, token] > 0)


def processed_reference(logits, prompt, output, params: SamplingParams, stop=()) -> np.ndarray:
    """vLLM's logits processing in numpy (float64) for one position of a row whose prompt is `prompt` and
    output so far `output`: logit bias, min_tokens (the `stop` ids at -inf), repetition penalty (prompt and
    output), frequency and presence penalties (output)."""
    x = np.array(logits, np.float64)
    for token, value in params.logit_bias:
        x[..., token] += value
    if len(output) < params.min_tokens:
        x[..., list(stop)] = -np.inf
    for token in set(prompt) | set(output):
        x[..., token] = np.where(
            x[..., token] > 0, x[..., token] / params.repetition_penalty, x[..., token] * params.repetition_penalty
        )
    counts = np.bincount(np.asarray(output, np.int64), minlength=x.shape[-1])
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def check_sampled_generation(
    model, sp: SpeculativeConfig, n: int = 4096, top_k: int = 6, decode=generate, **processing
):
    """n rows of one prompt with distinct seeds, temperature 1 and top-k, two greedy rows first: the first
    three generated tokens (one from prefill, then accepted drafts, residual samples and bonuses of
    speculative steps) follow the model's distribution, enumerated exactly; the greedy rows are greedy.
    `decode`: `generate`, or another loop with its signature. `processing`: every row's (greedy ones too)
    logit bias and penalties (`SamplingParams` fields), applied to the expected distribution's logits by
    `processed_reference`, each position after the tokens before it."""
    prompt = [3, 1, 4]
    greedy = SamplingParams(**processing)
    sampling = [greedy] * 2 + [SamplingParams(temperature=1.0, top_k=top_k, seed=s, **processing) for s in range(n - 2)]
    result = decode(
        model, [prompt] * n, speculative=sp, max_new_tokens=3, max_length=S, stop_tokens=[], sampling=sampling
    )
    tokens = np.asarray(result.tokens)  # [n, 3]
    assert 0 < result.metrics.num_accepted < result.metrics.num_drafts

    def target(logits):  # temperature 1 and top-k, in numpy (the logits are processed already)
        logits = np.asarray(logits, np.float64)
        kth = np.sort(logits, axis=-1)[..., -top_k][..., None]
        p = np.where(logits >= kth, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
        return p / p.sum(-1, keepdims=True)

    seqs = np.zeros((V * V + 2, W), np.int32)  # every (t_1, t_2) after the prompt, 3 rows per oracle call
    for i in range(V * V):
        seqs[i, : len(prompt) + 2] = prompt + [i // V, i % V]
    logits = np.concatenate([np.asarray(_main_logits(model, jnp.asarray(seqs[i : i + 3]))) for i in range(0, V * V, 3)])
    at1 = processed_reference(logits[0, len(prompt) - 1], prompt, [], greedy)
    at2 = np.stack([processed_reference(logits[t * V, len(prompt)], prompt, [t], greedy) for t in range(V)])
    at3 = np.stack(
        [processed_reference(logits[i, len(prompt) + 1], prompt, [i // V, i % V], greedy) for i in range(V * V)]
    )
    greedy1 = at1.argmax()
    greedy2 = at2[greedy1].argmax()
    np.testing.assert_array_equal(tokens[:2], [[greedy1, greedy2, at3[greedy1 * V + greedy2].argmax()]] * 2)
    joint12 = target(at1)[:, None] * target(at2)  # [t_1, t_2]
    joint123 = joint12[..., None] * target(at3).reshape(V, V, V)  # [t_1, t_2, t_3]
    sampled = tokens[2:]
    ok, message = chi_square_ok(np.bincount(sampled[:, 0] * V + sampled[:, 1], minlength=V * V), joint12)
    assert ok, f"(t_1, t_2): {message}"
    ok, message = chi_square_ok(
        np.bincount((sampled[:, 0] * V + sampled[:, 1]) * V + sampled[:, 2], minlength=V**3), joint123
    )
    assert ok, f"(t_1, t_2, t_3): {message}"
    return tokens


def test_sampled_generation_follows_the_target_distribution(models):
    """Drafts sampled from the MTP distribution (q carried from the draft step to the next verify)."""
    check_sampled_generation(models["deepseek"]["random"], spec("eagle", 2, draft_sampling="sample"))


def test_sampled_and_greedy_generation_with_a_logit_bias_follow_the_biased_target(models):
    """A logit bias on every row (raising one token, lowering another, a third to -100): greedy rows take the
    biased argmax and sampled rows with sampled drafts follow the biased distribution (the drafter sees the
    bias too; verification keeps the output lossless either way)."""
    check_sampled_generation(
        models["deepseek"]["random"], spec("eagle", 2, draft_sampling="sample"), logit_bias={0: 1.5, 5: -2.0, 7: -100}
    )


def test_greedy_speculation_with_a_logit_bias_equals_plain_greedy_with_it(models):
    """Forbidding each row's first plain greedy token and raising another: eagle K = 3 on the scripted model
    (drafts accepted, some rejected) gives plain greedy's tokens under the same bias, which never holds the
    forbidden token; +100 on a token makes it the whole output; ids outside the vocabulary are refused."""
    model = models["deepseek"]["scripted"]
    prompts, max_new = [[1, 2, 3, 1, 4], [6, 7, 0, 6]], 20
    plain = generate(main_twin(model), prompts, max_new_tokens=max_new, max_length=S, stop_tokens=[])
    sampling = [SamplingParams(logit_bias={row[0]: -100, (row[0] + 3) % V: 0.5}) for row in plain.tokens]
    biased = generate(
        main_twin(model), prompts, max_new_tokens=max_new, max_length=S, stop_tokens=[], sampling=sampling
    )
    assert biased.tokens != plain.tokens and all(
        row[0] not in b for row, b in zip(plain.tokens, biased.tokens, strict=True)
    )
    fast = generate(
        model,
        prompts,
        max_new_tokens=max_new,
        max_length=S,
        stop_tokens=[],
        sampling=sampling,
        speculative=spec("eagle", 3),
    )
    assert fast.tokens == biased.tokens and fast.metrics.num_accepted > 0
    np.testing.assert_allclose(fast.logprobs, biased.logprobs, atol=2e-5)  # raw logprobs: without the bias
    forced = generate(
        model, prompts, max_new_tokens=8, max_length=S, stop_tokens=[], speculative=spec("eagle", 3),
        sampling=SamplingParams(logit_bias={2: 100}),
    )  # fmt: skip
    assert forced.tokens == [[2] * 8] * 2
    with pytest.raises(ValueError, match="logit_bias token ids must be < vocab_size=8, got 8"):
        generate(model, prompts, max_new_tokens=2, max_length=S, sampling=SamplingParams(logit_bias={8: 1}))
    for bad, message in (
        ({1: 101}, r"in \[-100, 100\]"),
        ({-1: 1}, "token ids"),
        (dict.fromkeys(range(301), 1), "300"),
    ):
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=bad)


PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={5: -1.0})


def test_sampled_generation_with_penalties_follows_the_penalized_target(models):
    """Repetition, frequency and presence penalties and a logit bias on every row: greedy rows take the
    processed argmax and sampled rows with sampled drafts follow the processed distribution, position 3's
    after tokens 1 and 2, which are often one block's accepted drafts (the target at draft 2's position counts
    draft 1; t_2 = t_3 in some rows: the second draft repeated the first)."""
    tokens = check_sampled_generation(
        models["deepseek"]["random"], spec("eagle", 2, draft_sampling="sample"), **PENALTIES
    )
    assert np.sum(tokens[2:, 1] == tokens[2:, 2]) > 50


def _greedy_reference(model, prompt, max_new, params: SamplingParams, stop=()) -> list[int]:
    """Greedy decoding without a cache: the main model over the whole sequence each token, its last logits
    processed by `processed_reference`, stopping after a `stop` token."""
    out = []
    while len(out) < max_new:
        seq = np.zeros((1, W), np.int32)
        seq[0, : len(prompt) + len(out)] = prompt + out
        logits = np.asarray(_main_logits(model, jnp.asarray(seq)))[0, len(prompt) + len(out) - 1]
        out.append(int(processed_reference(logits, prompt, out, params, stop).argmax()))
        if out[-1] in stop:
            break
    return out


@pytest.mark.parametrize("method", ["eagle", "vanilla"])
def test_greedy_speculation_with_penalties_and_min_tokens_equals_plain_greedy_and_a_reference(models, method):
    """Penalties, a logit bias and min_tokens under eagle K = 3 / vanilla K = 2 on the random model (16 prompts;
    drafts accepted and rejected, accepted drafts that change the penalties of the positions after them in
    their block): the output equals plain greedy with them, and both equal a cache-free reference that applies
    them in numpy. The stop token is one the unpenalized output takes early, forbidden until min_tokens = 6."""
    model = models["deepseek"]["random"]
    prompts, max_new = [list(map(int, p)) for p in np.random.default_rng(0).integers(0, V, (16, 5))], 12
    unpenalized = generate(main_twin(model), prompts, max_new_tokens=max_new, max_length=S, stop_tokens=[])
    stop = [unpenalized.tokens[0][1]]
    params = SamplingParams(min_tokens=6, **PENALTIES)
    request = dict(max_new_tokens=max_new, max_length=S, stop_tokens=stop, sampling=params)
    plain = generate(main_twin(model), prompts, **request)
    assert plain.tokens == [_greedy_reference(main_twin(model), p, max_new, params, stop) for p in prompts]
    assert plain.tokens != unpenalized.tokens and all(stop[0] not in row[:6] for row in plain.tokens)
    assert any(stop[0] in row for row in plain.tokens)  # (allowed after min_tokens)
    fast = generate(model, prompts, speculative=spec(method, 3 if method == "eagle" else 2), **request)
    assert fast.tokens == plain.tokens and fast.metrics.num_accepted > 0
    for fast_row, plain_row in zip(fast.logprobs, plain.logprobs, strict=True):
        np.testing.assert_allclose(fast_row, plain_row, atol=2e-5)  # raw logprobs, nothing processed


def test_a_resumed_row_counts_its_earlier_output_as_output(models):
    """A row resumed after a preemption (the serving engine re-prefills what it had generated as prompt,
    `init_state(num_generated=g)`) continues exactly as the uninterrupted one under penalties and min_tokens:
    its first g tokens count as output, not prompt (the frequency and presence penalties) and as generated
    (min_tokens: row stops after 6 tokens in all, not 6 after resuming). Without num_generated (and min_tokens,
    which would then exceed some rows' max_new_tokens) the penalties give another output."""
    model = models["deepseek"]["random"]
    prompts = [list(map(int, p)) for p in np.random.default_rng(1).integers(0, V, (8, 5))]
    params = SamplingParams(min_tokens=6, frequency_penalty=1.5, presence_penalty=1.0)
    first = generate(main_twin(model), prompts, max_new_tokens=12, max_length=S, stop_tokens=[1], sampling=params)
    engine, g = DecodeEngine(model, spec("eagle", 3)), 3
    assert any(1 in row[6:] for row in first.tokens)
    resumed = {}
    for generated in ([g] * len(prompts), None):
        state, padded = engine.init_state(
            [p + row[:g] for p, row in zip(prompts, first.tokens, strict=True)],
            max_new_tokens=[len(row) - g for row in first.tokens],
            max_length=S,
            stop_tokens=[1],
            sampling=params if generated else dataclasses.replace(params, min_tokens=0),
            num_generated=generated,
        )
        resumed[generated is None] = engine.result(engine.run(engine.prefill(state, padded)), 0.0).tokens
    assert resumed[False] == [row[g:] for row in first.tokens] != resumed[True]
    with pytest.raises(ValueError, match="num_generated must be in 0 .. len"):
        engine.init_state([[1, 2]], max_new_tokens=2, max_length=S, num_generated=[2])
    with pytest.raises(ValueError, match="min_tokens=6 must be at most max_tokens"):
        engine.init_state([[1, 2, 3]], max_new_tokens=3, max_length=S, sampling=params, num_generated=[2])


def _cycling_drafts(model, prompts, *, speculative, sampling, **request):
    """`generate`, with steps verifying 2, 0 (drafting nothing), 0, 1, 2, ... of the K = 2 drafts (adaptive
    speculation's variants, `DecodeEngine.step_with_output(num_drafts=k, draft_next=...)`)."""
    engine = DecodeEngine(model, speculative)
    state, padded = engine.init_state(prompts, sampling=sampling, **request)
    state = engine.prefill(state, padded)
    for k, draft_next in itertools.cycle([(2, True), (0, False), (0, True), (1, True)]):
        if bool(np.all(np.asarray(state.done))):
            return engine.result(state, 0.0)
        state, _ = engine.step_with_output(state, num_drafts=k, draft_next=draft_next)


def test_sampled_generation_with_varying_numbers_of_drafts_follows_the_target(models):
    """Steps that verify only some of the sampled drafts (2, a plain step drafting none, one drafting, then 1)
    still emit the target distribution: the drafts not verified are drafted again for the next step."""
    check_sampled_generation(
        models["deepseek"]["random"], spec("eagle", 2, draft_sampling="sample"), decode=_cycling_drafts
    )


# ---------------------------------------------------------------------------------------------
# Relaxed acceptance


def _relaxed_spec(delta: float = 0.2, k: int = 4) -> SpeculativeConfig:
    return spec("eagle", k, relaxed_top_n=3, relaxed_delta=delta)


def test_relaxed_acceptance_is_judged_per_row_and_per_draft_position():
    """Target at every position: p(1) = 0.4 (argmax), p(2) = 0.3 (top-3, within delta 0.2), p(3) = 0.15
    (top-3, not within delta), p(7 = </think>) = 0.1 (within delta only at position 1, where p(7) = 0.3)."""
    base = np.array([0.02, 0.4, 0.3, 0.15, 0.01, 0.01, 0.01, 0.1])
    think_end_close = np.array([0.02, 0.4, 0.15, 0.1, 0.01, 0.01, 0.01, 0.3])
    think_start_top = np.array([0.02, 0.1, 0.05, 0.01, 0.01, 0.01, 0.7, 0.1])
    end_top = np.array([0.02, 0.1, 0.05, 0.01, 0.01, 0.01, 0.1, 0.7])
    cases = [  # (thinking, temperature, drafts, target per position 0..3, expected num_accepted)
        (True, 0.0, [2, 2, 2, 2], [base] * 4, 4),  # thinking: relaxed all the way
        (False, 0.0, [2, 2, 2, 2], [base] * 4, 0),  # not thinking: strict
        (True, 0.0, [2, 7, 2, 2], [base, think_end_close, base, base], 2),  # </think> accepted: strict after
        (True, 0.0, [1, 3, 2, 2], [base] * 4, 1),  # 3 is in the top 3 but not within delta
        (True, 0.01, [2, 2, 2, 2], [base] * 4, 0),  # sampled rows never relax (p(2) ~ 0 at T = 0.01)
        (False, 0.0, [6, 2, 2, 2], [think_start_top, base, base, base], 4),  # <think> accepted: relaxed after
        (True, 0.0, [7, 2, 2, 2], [end_top, base, base, base], 1),  # </think> first: the rest strict
        (True, 0.0, [7, 2, 2, 2], [base] * 4, 0),  # </think> outside the top 3 and below 0.4 - 0.2
    ]
    thinking = jnp.asarray([c[0] for c in cases])
    sampling = SamplingState.from_params([SamplingParams(temperature=c[1]) for c in cases])
    drafts = jnp.asarray([c[2] for c in cases], jnp.int32)
    logits = jnp.asarray(np.stack([_log(np.stack(c[3] + [base])) for c in cases]))  # [B, K + 1, V]
    n = len(cases)
    num_accepted, token = jit_accept(_relaxed_spec())(
        logits, drafts, jnp.zeros((n, 4, 0)), sampling, jnp.full((n,), 10), thinking
    )
    np.testing.assert_array_equal(num_accepted, [c[4] for c in cases])
    np.testing.assert_array_equal(np.asarray(token)[[0, 1, 2, 3, 5, 6, 7]], [1, 1, 1, 1, 1, 1, 1])


def test_all_greedy_batches_accept_as_batches_with_a_sampled_row_do():
    """An all-greedy batch takes `accept`'s greedy branch (argmax only, nothing over the vocabulary); with one
    sampled row added the same greedy rows go through the general test `u * q < p` on one-hot targets. Both
    give the constructed outcome: drafts accepted up to the first that is not the processed argmax (a logit
    bias moving it, a tie taking the lower id), then that argmax; with relaxed acceptance too."""
    peaks = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 0, 6], [1, 2, 3, 4]]  # argmax per position
    logits = np.zeros((5, 4, 8), np.float32)
    for row, ids in enumerate(peaks):
        for j, i in enumerate(ids):
            logits[row, j, i] = 2.0
    logits[3, 0, 6] = 2.0  # row 3, position 0: tied with 5, 5 wins (the lower id)
    logits[4, 1, 7] = 1.5  # row 4, position 1: 7 wins once biased by +1
    params = [SamplingParams()] * 4 + [SamplingParams(logit_bias={7: 1.0})]
    drafts = np.int32([[1, 2, 3], [1, 0, 3], [0, 2, 3], [5, 5, 0], [1, 2, 3]])
    expected_accepted, expected_token = [3, 1, 0, 3, 1], [4, 2, 1, 6, 7]
    sampled = SamplingParams(temperature=1.0, seed=3)
    for sp in (spec("eagle", 3), _relaxed_spec(k=3)):  # relaxed: no row thinking, so strict
        for extra in ([], [sampled]):
            n = 5 + len(extra)
            num_accepted, token = jit_accept(sp)(
                jnp.asarray(np.concatenate([logits, logits[:1]][: 1 + len(extra)])),
                jnp.asarray(np.concatenate([drafts, drafts[:1]][: 1 + len(extra)])),
                jnp.zeros((n, 3, 0)),
                SamplingState.from_params(params + extra),
                jnp.full((n,), 10),
                jnp.zeros((n,), bool),
            )
            np.testing.assert_array_equal(np.asarray(num_accepted)[:5], expected_accepted)
            np.testing.assert_array_equal(np.asarray(token)[:5], expected_token)


def test_target_logprobs_are_the_raw_log_softmax_bit_for_bit(monkeypatch):
    """`Target` keeps the raw log-softmax as its max and log-sum-exp: on XLA's path its values at given tokens and
    in full equal `jax.nn.log_softmax` of the float32 logits, bit for bit (bf16 and float32 logits, a logit bias
    not counted). The CPU extension's path (`cpu_extension.vocab_stats`) sums in another order:
    `test_vocab_stats.py`."""
    monkeypatch.setenv("MTP_JAX_ONEDNN", "0")
    rng = np.random.default_rng(2)
    for dtype in (jnp.float32, jnp.bfloat16):
        logits = jnp.asarray(rng.normal(0, 4, (3, 4, 50)), dtype)
        tokens = jnp.asarray(rng.integers(0, 50, (3, 4)), jnp.int32)
        sampling = SamplingState.from_params([SamplingParams(logit_bias={3: 5.0})] * 3)

        @jax.jit
        def both(logits, tokens, sampling):
            target = Target.from_logits(logits, SamplingMetadata.build(sampling, logits.shape[-1]))
            return target.logprobs_at(tokens), target.log_softmax(), jax.nn.log_softmax(logits.astype(jnp.float32))

        at, full, reference = both(logits, tokens, sampling)
        np.testing.assert_array_equal(full, reference)
        np.testing.assert_array_equal(
            at, np.take_along_axis(np.asarray(reference), np.asarray(tokens)[..., None], -1)[..., 0]
        )


def _phases(tokens: list[int]) -> list[bool]:
    """phase[i]: thinking after tokens[:i]."""
    phase, out = False, []
    for t in tokens:
        out.append(phase)
        phase = True if t == THINK else False if t == END_THINK else phase
    return out + [phase]


def near_tie() -> object:
    """The scripted DeepSeek-style model with a near-tie after token 1: the main model puts p ~ 0.55 on its
    successor 2 and p ~ 0.43 on 3 (head weight 0.9 beside 1), and MTP module 1 drafts 3 there (it acts on
    2 where it stands for 1). Strict decoding continues 1 with 2; relaxed acceptance (top-3, delta 0.3)
    takes the draft 3 inside a thinking phase."""
    model = scripted(CFG, 2)
    root = CFG.hidden_size**0.5
    add(model.lm_head.kernel, (1, 3), 0.9)
    add(model.mtp[0].eh_proj.kernel, (1, 1), -4 / root)
    add(model.mtp[0].eh_proj.kernel, (1, 2), 4 / root)
    return model


def test_relaxed_generation_relaxes_only_thinking_positions():
    """Rows in and out of the thinking phase in one batch (row 0 thinks throughout, row 1 never, row 2's
    prompt closes its phase). Each generated token, checked against a no-cache recompute: where the row
    was thinking it is among the top-3 and within delta of the top probability, elsewhere it is the
    argmax; row 0 takes relaxed tokens (the near-tie is built in); rows that never think equal strict
    greedy."""
    model, sp = near_tie(), _relaxed_spec(0.3, k=2)
    prompts = [[THINK, 1, 2], [3, 4], [THINK, 5, END_THINK, 2]]
    result = generate(model, prompts, speculative=sp, max_new_tokens=30, max_length=S, stop_tokens=[])
    strict = generate(model, prompts, max_new_tokens=30, max_length=S, stop_tokens=[])
    seqs = np.zeros((3, W), np.int32)
    for b, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        seqs[b, : len(prompt) + len(tokens)] = prompt + tokens
    probs = np.asarray(jax.nn.softmax(_main_logits(model, jnp.asarray(seqs)), axis=-1))
    relaxed_tokens = in_phase = out_of_phase = 0
    for b, (prompt, tokens) in enumerate(zip(prompts, result.tokens, strict=True)):
        phases = _phases(prompt + tokens)
        for i in range(len(prompt), len(prompt) + len(tokens)):
            p, t = probs[b, i - 1], seqs[b, i]
            if phases[i]:
                assert t in np.argsort(-p)[:3] and p[t] >= p.max() - 0.3 - 1e-5, (b, i)
                relaxed_tokens += int(t != p.argmax())
            else:
                assert t == p.argmax(), (b, i)
        if not any(phases[len(prompt) :]):
            assert tokens == strict.tokens[b]
        in_phase += sum(phases[len(prompt) : len(prompt) + len(tokens)])
        out_of_phase += len(tokens) - sum(phases[len(prompt) : len(prompt) + len(tokens)])
    assert relaxed_tokens > 0 and in_phase > 0 and out_of_phase > 0, (relaxed_tokens, in_phase, out_of_phase)
    assert result.tokens[0][:5] == [3, 4, 5, 1, 3] and strict.tokens[0][:5] == [3, 4, 5, 1, 2]
