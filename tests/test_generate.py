"""Baseline generation: greedy equals a no-cache oracle, stops, streaming, compile counts, input validation."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate, stream
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.speculative import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from mtp_jax.decode.state import init_state
from mtp_jax.model import init_model

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
    return seq[len(prompt) :]


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
    kwargs = dict(
        max_new_tokens=[5, 2, 7],
        max_length=48,
        sampling=[
            SamplingParams(),
            SamplingParams(temperature=0.8, top_k=10, seed=5),
            SamplingParams(temperature=1.2, top_p=0.9, seed=6),
        ],
    )
    pieces = list(stream(model, PROMPTS, **kwargs))
    streamed = [sum((step[b] for step in pieces), []) for b in range(3)]
    assert streamed == generate(model, PROMPTS, **kwargs).tokens


def test_stream_returns_the_generation_result(model):
    steps, pieces = stream(model, PROMPTS, max_new_tokens=[4, 2, 3], max_length=48), []
    with pytest.raises(StopIteration) as end:
        while True:
            pieces.append(next(steps))
    result, expected = end.value.value, generate(model, PROMPTS, max_new_tokens=[4, 2, 3], max_length=48)
    assert result.tokens == expected.tokens == [sum((p[b] for p in pieces), []) for b in range(3)]
    assert result.num_steps == expected.num_steps == 3 and result.finish_reasons == ["length"] * 3
    assert result.logprobs == expected.logprobs


def test_sampled_row_does_not_depend_on_its_batch(model):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=11)
    alone = generate(model, PROMPTS[1:2], max_new_tokens=6, max_length=48, sampling=params)
    batched = generate(
        model,
        PROMPTS,
        max_new_tokens=6,
        max_length=48,
        sampling=[SamplingParams(temperature=1.0, seed=1), params, SamplingParams()],
    )
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
            generate(
                model,
                [[5, 6], [7] * 11, [9, 9, 9]],
                max_new_tokens=n,
                max_length=48,
                sampling=SamplingParams(temperature=0.7, seed=n),
            )
            list(stream(model, PROMPTS, max_new_tokens=n, max_length=48, stop_tokens=[3, 4]))
        assert len(compiles) == warm
    finally:
        jax.monitoring.clear_event_listeners()


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([], {}, "non-empty"),
        ([[1, 2], []], {}, "prompt 1 is empty"),
        ([[1] * 40], {"max_length": 40}, "capacity"),
        ([[1, 128]], {}, "token id 128"),
        ([[1, -1]], {}, "token id -1"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens"),
        ([[1]], {"max_new_tokens": [1, 2]}, "max_new_tokens has 2 entries"),
        ([[1]], {"stop_tokens": [500]}, "stop token 500"),
    ],
)
def test_bad_input_raises(model, prompts, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, **kwargs)


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ("import os", {}, "prompts is a str"),
        (["import os"], {}, "prompt 0 is a str"),
        ([1, 2, 3], {}, "prompt 0 is 1 .int., not a list"),
        ([[1, 3.7]], {}, r"prompt 0 has 3.7 \(float\) at index 1"),
        ([[1, 2], [4, True]], {}, r"prompt 1 has True \(bool\) at index 1"),
        ([[1, np.float32(2.0)]], {}, r"prompt 0 has np.float32\(2.0\) \(float32\)"),
        (np.array([[1.0, 2.0]]), {}, "dtype float64"),
        (np.array([1, 2, 3]), {}, "must be 2-D"),
        ([[1, jnp.float32(2.0)]], {}, "prompt 0 has"),
        ([jnp.asarray([1.0, 2.0])], {}, "dtype float32"),
        ([[1]], {"stop_tokens": [2.5]}, "stop_tokens has 2.5"),
        ([[1]], {"stop_tokens": [True]}, "stop_tokens has True"),
        ([[1]], {"stop_tokens": 3}, "stop_tokens must be a collection of token ids"),
        ([[1]], {"max_length": 40.0}, "max_length must be an int"),
        ([[1]], {"max_length": True}, "max_length must be an int"),
        ([[1]], {"max_new_tokens": 2.5}, "max_new_tokens must be an int"),
        ([[1]], {"max_new_tokens": [True]}, "max_new_tokens must be an int"),
        ([[1]], {"sampling": {"temperature": 1.0}}, "sampling must be SamplingParams"),
        ([bytearray(b"hi")], {}, "prompt 0 is a bytearray: prompts are token ids"),
        ([[1], memoryview(b"hi")], {}, "prompt 1 is a memoryview: prompts are token ids"),
        (bytearray(b"hi"), {}, "prompts is a bytearray"),
        ([[1]], {"stop_tokens": bytearray(b"hi")}, "stop_tokens must be a collection of token ids"),
        ([[1]], {"stop_tokens": np.array(3)}, "stop_tokens must be a collection of token ids"),
        ([[1]], {"stop_tokens": "ab"}, "stop_tokens must be a collection of token ids"),
        ([[1]], {"max_new_tokens": np.array(3.0)}, "max_new_tokens must be an int"),
        ([[1]], {"max_new_tokens": jnp.asarray(True)}, "max_new_tokens must be an int"),
    ],
)
def test_wrong_types_raise_instead_of_being_truncated(model, prompts, kwargs, message):
    with pytest.raises(TypeError, match=message):
        generate(model, prompts, **kwargs)


@pytest.mark.parametrize(
    "max_length, message",
    [
        (257, r"max_length=257 must be in \[2, 256\].*max_position_embeddings=256"),
        (1, "max_length=1"),
    ],
)
def test_max_length_is_bounded_by_the_model_positions(model, max_length, message):
    with pytest.raises(ValueError, match=message):
        generate(model, [[1]], max_length=max_length)
    state, _ = init_state(model, [[1]], max_new_tokens=1, max_length=256)  # the bound itself is fine
    assert state.tokens.shape == (1, 256)


def test_numpy_prompts_give_the_same_tokens_as_lists(model):
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8]]
    kwargs = dict(max_length=48, sampling=SamplingParams(temperature=0.9, seed=3))
    expected = generate(model, prompts, max_new_tokens=5, stop_tokens=[9], **kwargs).tokens
    as_arrays = [
        np.asarray(prompts, np.int32),
        np.asarray(prompts, np.int64),
        [np.asarray(p) for p in prompts],
        [[np.int64(t) for t in p] for p in prompts],
        jnp.asarray(prompts),
        list(jnp.asarray(prompts)),
        [list(jnp.asarray(p)) for p in prompts],
    ]
    for p in as_arrays:
        result = generate(model, p, max_new_tokens=np.int64(5), stop_tokens=np.asarray([9]), **kwargs)
        assert result.tokens == expected, type(p)


def test_zero_d_integer_arrays_and_any_collection_of_stop_tokens_are_accepted(model):
    """0-d NumPy / JAX integers count as ints; stop tokens are a set, so any non-text collection will do."""
    state, _ = init_state(model, [[1, 2]], max_new_tokens=3, max_length=48, stop_tokens=[9, 4])
    expected = generate(model, [[1, 2]], max_new_tokens=3, max_length=48, stop_tokens=[9, 4]).tokens
    for n in (np.array(3), jnp.int32(3), np.int64(3), [np.array(3)], jnp.asarray([3])):
        other, _ = init_state(model, [[1, 2]], max_new_tokens=n, max_length=np.array(48), stop_tokens=[9, 4])
        assert other.max_new_tokens.tolist() == [3] and other.tokens.shape == (1, 48), n
    for stop in (
        {4, 9},
        (9, 4),
        np.array([9, 4]),
        jnp.asarray([4, 9]),
        [np.array(9), jnp.int32(4)],
        iter([9, 4]),
        [4, 9, 9],
    ):
        other, _ = init_state(model, [[1, 2]], max_new_tokens=3, max_length=48, stop_tokens=stop)
        np.testing.assert_array_equal(other.stop_tokens, state.stop_tokens)
    np.testing.assert_array_equal(state.stop_tokens[0, :3], [4, 9, -1])  # per row
    assert (
        generate(model, [[1, 2]], max_new_tokens=jnp.int32(3), max_length=jnp.int32(48), stop_tokens={4, 9}).tokens
        == expected
    )


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"temperature": True}, TypeError, "temperature"),
        ({"temperature": "0.5"}, TypeError, "temperature"),
        ({"temperature": -1.0}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_k": 2.0}, TypeError, "top_k"),
        ({"top_k": True}, TypeError, "top_k"),
        ({"top_k": 2**31}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_p": float("nan")}, ValueError, "top_p"),
        ({"top_p": False}, TypeError, "top_p"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 2**32}, ValueError, r"seed must be in \[0, 2\*\*32\)"),
        ({"seed": 1.0}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
    ],
)
def test_bad_sampling_params_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_numbers():
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(4), top_p=np.float64(0.9), seed=np.uint32(2**32 - 1)
    )
    assert params.seed == 2**32 - 1 and params.top_k == 4


@pytest.fixture(scope="module")
def mtp_model():
    return init_model(ModelConfig.from_name("tiny", num_nextn_predict_layers=1), seed=4)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_speculative_tokens": 17}, ValueError, r"num_speculative_tokens must be in \[1, 16\], got 17"),
        ({"num_speculative_tokens": 0}, ValueError, r"num_speculative_tokens must be in \[1, 16\]"),
        ({"num_speculative_tokens": True}, TypeError, "num_speculative_tokens must be an int"),
        ({"num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens must be an int"),
        ({"relaxed_top_n": 1.5}, TypeError, "relaxed_top_n must be an int"),
        ({"relaxed_top_n": -1}, ValueError, "relaxed_top_n must be >= 0"),
        ({"relaxed_delta": float("nan")}, ValueError, "relaxed_delta"),
        ({"relaxed_delta": "0.1"}, TypeError, "relaxed_delta"),
        ({"relaxed_top_n": 2, "think_start_token_id": 1.0, "think_end_token_id": 2}, TypeError, "think_start_token_id"),
    ],
)
def test_bad_speculative_config_raises(kwargs, error, message):
    with pytest.raises(error, match=message):
        SpeculativeConfig(**kwargs)


def test_speculative_config_bounds_and_numpy_ints():
    assert SpeculativeConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS).num_speculative_tokens == 16
    from_numpy = SpeculativeConfig(num_speculative_tokens=np.int64(3))
    assert type(from_numpy.num_speculative_tokens) is int and from_numpy == SpeculativeConfig(num_speculative_tokens=3)
    assert hash(from_numpy) == hash(SpeculativeConfig(num_speculative_tokens=3))  # one compile for both


def test_prompt_within_k_tokens_of_capacity_is_served(mtp_model):
    """K = 3 drafts with 1 or 2 free slots left: the engine cuts at the capacity, as plain decoding does."""
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
    prompts = [list(range(1, 47)), list(range(1, 46)), [7, 8]]  # S - 2, S - 3 and a short prompt
    plain = generate(mtp_model, prompts, max_new_tokens=6, max_length=48, stop_tokens=[])
    fast = generate(mtp_model, prompts, max_new_tokens=6, max_length=48, stop_tokens=[], speculative=spec)
    assert fast.tokens == plain.tokens and [len(t) for t in fast.tokens] == [2, 3, 6]
    assert fast.finish_reasons == ["capacity", "capacity", "length"]
