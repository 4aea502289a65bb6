"""Baseline generation: greedy equals a no-cache oracle, stops, streaming, compile counts, input errors."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.generate import generate, stream
from mtp_jax.model import init_model
from mtp_jax.sampling import SamplingParams

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13]]


@pytest.fixture(scope="module")
def model():
    return init_model(ModelConfig.from_name("tiny"), seed=2)


@nnx.jit
def _full_logits(model, tokens):
    return model.forward_full(tokens)[0]


def _greedy_oracle(model, prompt, n, width=48):
    """No-cache greedy: the whole sequence re-run each token (right-padded to one shape; causal)."""
    seq = list(prompt)
    for _ in range(n):
        logits = _full_logits(model, jnp.asarray([seq + [0] * (width - len(seq))], jnp.int32))
        seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    return seq[len(prompt):]


def test_greedy_equals_full_recompute(model):
    result = generate(model, PROMPTS, max_new_tokens=[6, 9, 4], max_length=48)
    for prompt, tokens, n in zip(PROMPTS, result.tokens, [6, 9, 4], strict=True):
        assert tokens == _greedy_oracle(model, prompt, n)
    assert result.finish_reasons == ["length"] * 3
    assert result.num_steps == 8  # 9 tokens for the longest row: one from prefill, 8 steps


def test_logprobs_are_log_softmax_at_emitted_tokens(model):
    result = generate(model, PROMPTS[:1], max_new_tokens=3, max_length=48)
    seq = PROMPTS[0] + result.tokens[0]
    logits = _full_logits(model, jnp.asarray([seq[:-1] + [0] * (48 - len(seq) + 1)], jnp.int32))
    expected = jax.nn.log_softmax(logits[0], axis=-1)[jnp.arange(2, 5), jnp.asarray(result.tokens[0])]
    np.testing.assert_allclose(result.logprobs[0], expected, atol=1e-5)


def test_stop_token_kept_and_rows_continue(model):
    free = generate(model, PROMPTS, max_new_tokens=8, max_length=48)
    stop = free.tokens[1][2]  # row 1 stops at its third token; other rows go on unless they emit it too
    result = generate(model, PROMPTS, max_new_tokens=8, max_length=48, stop_tokens=[stop])
    for free_row, row, reason in zip(free.tokens, result.tokens, result.finish_reasons, strict=True):
        cut = free_row.index(stop) + 1 if stop in free_row else len(free_row)
        assert row == free_row[:cut]
        assert reason == ("stop" if stop in free_row else "length")


def test_capacity_bounds_generation(model):
    prompt = list(range(1, 46))
    result = generate(model, [prompt], max_new_tokens=100, max_length=48)
    assert len(result.tokens[0]) == 3 and result.finish_reasons == ["capacity"]
    assert result.tokens[0] == _greedy_oracle(model, prompt, 3)


def test_stream_equals_generate(model):
    kwargs = dict(max_new_tokens=[5, 2, 7], max_length=48,
                  sampling=[SamplingParams(), SamplingParams(temperature=0.8, top_k=10, seed=5),
                            SamplingParams(temperature=1.2, top_p=0.9, seed=6)])
    pieces = list(stream(model, PROMPTS, **kwargs))
    streamed = [sum((step[b] for step in pieces), []) for b in range(3)]
    assert streamed == generate(model, PROMPTS, **kwargs).tokens


def test_sampled_row_does_not_depend_on_its_batch(model):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    alone = generate(model, PROMPTS[1:2], max_new_tokens=6, max_length=48, sampling=params)
    batched = generate(model, PROMPTS, max_new_tokens=6, max_length=48,
                       sampling=[SamplingParams(temperature=1.0, seed=1), params, SamplingParams()])
    assert batched.tokens[1] == alone.tokens[0]


def test_no_recompilation_across_lengths_and_steps(model):
    compiles = []

    def listener(name, _duration, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        generate(model, PROMPTS, max_new_tokens=3, max_length=48)  # warm-up
        list(stream(model, PROMPTS, max_new_tokens=3, max_length=48))
        warm = len(compiles)
        for n in (1, 7, 12):
            generate(model, [[5, 6], [7] * 11, [9, 9, 9]], max_new_tokens=n, max_length=48,
                     sampling=SamplingParams(temperature=0.7, seed=n))
            list(stream(model, PROMPTS, max_new_tokens=n, max_length=48, stop_tokens=[3, 4]))
        assert len(compiles) == warm
    finally:
        jax.monitoring.clear_event_listeners()


@pytest.mark.parametrize("prompts, kwargs, message", [
    ([], {}, "non-empty"),
    ([[1, 2], []], {}, "prompt 1 is empty"),
    ([[1] * 40], {"max_length": 40}, "capacity"),
    ([[1, 128]], {}, "token id 128"),
    ([[1, -1]], {}, "token id -1"),
    ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
    ([[1]], {"max_new_tokens": [1, 2]}, "max_new_tokens has 2 entries"),
    ([[1]], {"stop_tokens": [500]}, "stop token 500"),
])
def test_bad_input_raises(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"seed": -1}, "seed"),
])
def test_bad_sampling_params_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
