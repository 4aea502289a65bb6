"""The decode engine (`DecodeEngine`: prefill, step, run; `docs/MTP_SPEC.md`): a stop token or a cap met inside
a block, fixed shapes (nothing recompiles across lengths, acceptance and sampling), streaming, plain decoding
as the step with no drafter, and one normalisation of the verify logits per step. (Lossless greedy under
NaN-poisoned stale cache slots, per drafter, and the capacity: `test_drafters`.)

Models and the step driver: `speculative_helpers` and the `models` / `plain` fixtures (`conftest.py`).
"""

from __future__ import annotations

import jax
import jax.monitoring
import numpy as np
import pytest
from speculative_helpers import (
    MAX_NEW,
    PROMPTS,
    THINK,
    S,
    drive,
    generated,
    main_twin,
    spec,
)

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.metrics import SpeculativeMetrics
from mtp_jax.decode.sampling import SamplingParams

# ---------------------------------------------------------------------------------------------
# Stops inside a block


def test_stop_token_accepted_as_a_draft_ends_its_row_there(models, plain):
    """Scripted model, eagle K = 3. Row 0 runs on the cycle 7 -> 0 -> 6, where module 1 is always right,
    so its first step accepts the drafts [0, 6, 7]; rows 1, 2 run on 1..5 and never emit 6. Stop token 6,
    the second accepted draft of that block, ends row 0 right after it (no third draft, no bonus) while
    the others go on. Row 1 meanwhile meets max_new_tokens inside a block (no bonus: a + 1 > the cut)."""
    model, sp, k = models["deepseek"]["scripted"], spec("eagle", 3), 3
    free = plain("deepseek", "scripted").tokens
    stop = 6
    assert free[0][:5] == [7, 0, 6, 7, 0] and stop not in free[1] + free[2]  # the construction
    state, trace = drive(model, sp, PROMPTS, MAX_NEW)
    m = jax.device_get(state.metrics)
    assert trace[1]["lengths"][0] - trace[0]["lengths"][0] == k + 1 and list(trace[0]["drafts"][0]) == [0, 6, 7]
    assert MAX_NEW[1] == m.num_steps[1] + m.num_accepted[1], (m.num_steps, m.num_accepted)
    state, trace = drive(model, sp, PROMPTS, MAX_NEW, stop_tokens=[stop])
    cut = free[0].index(stop) + 1
    assert generated(state, PROMPTS) == [free[0][:cut], free[1], free[2]]
    # The step that ended row 0 committed the stop token as an accepted draft, and no bonus after it.
    last = next(s for s in range(len(trace) - 1) if trace[s + 1]["done"][0])
    num = trace[last + 1]["lengths"][0] - trace[last]["lengths"][0]
    assert (last, num) == (0, 2) and trace[0]["drafts"][0, num - 1] == stop
    assert not trace[last + 1]["done"][1:].any()
    result = generate(model, PROMPTS, speculative=sp, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[stop])
    assert result.tokens == [free[0][:cut], free[1], free[2]]
    assert result.finish_reasons == ["stop", "length", "length"]
    assert result.metrics == SpeculativeMetrics.from_counters(state.metrics)  # the loop counts as the steps do
    assert result.num_steps == len(trace) - 1


# ---------------------------------------------------------------------------------------------
# Fixed shapes, streaming, mixed greedy and sampled rows


def test_no_recompilation_across_lengths_acceptance_and_sampling(models):
    """After one warm-up, generations and streams with other weights (other acceptance patterns), lengths,
    stop tokens and greedy / sampled rows compile nothing. Streaming yields what generation returns, and
    the greedy row of a mixed batch equals plain greedy."""
    sp = spec("eagle", 3)
    by_name = models["deepseek"]
    kwargs = dict(max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])
    generate(by_name["scripted"], PROMPTS, speculative=sp, **kwargs)  # warm-up
    list(stream(by_name["scripted"], PROMPTS, speculative=sp, **kwargs))
    compiles = []

    def listener(name, _duration, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    mixed = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=5, seed=3),
        SamplingParams(temperature=1.2, top_p=0.9, seed=4),
    ]
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        runs = []
        for name, n, stop in [("random", 1, [0]), ("scripted", 7, [3, 4]), ("random", 25, []), ("scripted", 2, [])]:
            prompts = [[2, 3], [1] * 11, [THINK, 7, 7]]
            runs.append(
                generate(
                    by_name[name],
                    prompts,
                    speculative=sp,
                    max_new_tokens=n,
                    max_length=S,
                    stop_tokens=stop,
                    sampling=mixed,
                )
            )
            pieces = list(
                stream(by_name[name], PROMPTS, speculative=sp, max_new_tokens=[n, 3, 9], max_length=S, stop_tokens=stop)
            )
        assert not compiles, f"{len(compiles)} compiles after warm-up"
    finally:
        jax.monitoring.clear_event_listeners()
    streamed = [sum((step[b] for step in pieces), []) for b in range(3)]
    assert (
        streamed
        == generate(
            by_name["scripted"], PROMPTS, speculative=sp, max_new_tokens=[2, 3, 9], max_length=S, stop_tokens=[]
        ).tokens
    )
    # The greedy row of a mixed batch still equals plain greedy.
    greedy = generate(
        by_name["random"], [[2, 3], [1] * 11, [THINK, 7, 7]], max_new_tokens=25, max_length=S, stop_tokens=[]
    )
    assert runs[2].tokens[0] == greedy.tokens[0]
    assert [len(t) for t in runs[2].tokens] == [25] * 3


def test_stream_returns_the_result_of_generate(models):
    """The stream's return value (StopIteration.value) carries the tokens, finish reasons, verify steps and
    metrics that `generate` returns for the same request."""
    model, sp = models["deepseek"]["scripted"], spec("eagle", 3)
    kwargs = dict(max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[6])
    steps = stream(model, PROMPTS, speculative=sp, **kwargs)
    pieces = []
    while True:
        try:
            pieces.append(next(steps))
        except StopIteration as end:
            streamed = end.value
            break
    expected = generate(model, PROMPTS, speculative=sp, **kwargs)
    assert streamed.tokens == expected.tokens == [sum((p[b] for p in pieces), []) for b in range(3)]
    assert streamed.finish_reasons == expected.finish_reasons == ["stop", "length", "length"]
    assert streamed.metrics == expected.metrics and streamed.num_steps == expected.num_steps == len(pieces) - 1


# ---------------------------------------------------------------------------------------------
# One engine: plain decoding is the step with no drafter; one normalisation


def test_plain_decoding_is_the_step_with_no_drafts(models, plain):
    """`DecodeEngine(model)` (no drafter) commits exactly one token per active row per step, the plain
    greedy tokens, and counts steps with no drafts: K = 0 in every shape."""
    model = main_twin(models["deepseek"]["scripted"])
    engine = DecodeEngine(model)
    state, padded = engine.init_state(PROMPTS, max_new_tokens=MAX_NEW, max_length=S, stop_tokens=[])
    assert state.draft.tokens.shape == (3, 0) and state.draft.caches == ()
    state = engine.prefill(state, padded)
    np.testing.assert_array_equal(state.lengths, [len(p) + 1 for p in PROMPTS])
    while not bool(np.all(state.done)):
        before = np.asarray(state.lengths) + 0  # a copy: the state is donated
        active = ~np.asarray(state.done)
        state = engine.step(state)
        np.testing.assert_array_equal(np.asarray(state.lengths) - before, active.astype(int))
    assert generated(state, PROMPTS) == plain("deepseek", "scripted").tokens
    m = jax.device_get(state.metrics)
    np.testing.assert_array_equal(m.num_steps, np.asarray(MAX_NEW) - 1)
    assert m.num_drafts.sum() == 0 and m.accepted_length_histogram.shape == (3, 1)
    assert engine.result(state, 0.0).metrics is None


@pytest.mark.parametrize("relaxed", [False, True])
def test_a_step_normalises_the_verify_logits_once(models, monkeypatch, relaxed):
    """At most one normalisation of the verify logits of each kind per step, counted while tracing it: one
    `target_probs` (acceptance's branch for batches with a sampled row; an all-greedy batch runs none) and the
    full raw log-softmax only for relaxed acceptance (the committed tokens' logprobs need only its max and
    log-sum-exp)."""
    import mtp_jax.decode.acceptance as acceptance
    from mtp_jax.decode.step import decode_step

    calls = {"log_softmax": 0, "target_probs": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(acceptance.Target, "log_softmax", counted("log_softmax", acceptance.Target.log_softmax))
    monkeypatch.setattr(acceptance, "target_probs", counted("target_probs", acceptance.target_probs))
    sp = spec("eagle", 2, relaxed_top_n=2, relaxed_delta=0.1) if relaxed else spec("eagle", 2)
    model = models["deepseek"]["random"]
    state, _ = DecodeEngine(model, sp).init_state(PROMPTS, max_new_tokens=3, max_length=S)
    jax.make_jaxpr(lambda s: decode_step(model, sp, s))(state)
    assert calls == {"log_softmax": int(relaxed), "target_probs": 1}
