"""Generation, the host API: `generate` and `stream`, plain or speculative (`speculative=`).

Plain decoding runs the prompt through the model, then one token per step, on device: `generate`
runs the whole decode loop as one jitted `lax.while_loop` with the state donated; `stream` runs
the same jitted step once per call and yields the tokens each row committed. Both compile once
per (B, S, prompt bucket, model): generation length, sampling parameters, stop tokens and prompt
contents are data, never shapes. The state and its commit rule are `mtp_jax.engine`'s.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Generator, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.engine import (  # noqa: F401  (re-exported: the request checks and results are generation's API)
    MAX_STOP_TOKENS,
    DecodeState,
    GenerationResult,
    commit_tokens,
    init_state,
    results_from_state,
    token_logprobs,
    validate_prompts,
)
from mtp_jax.model import Transformer, sequence_positions, static_split, take_rows
from mtp_jax.sampling import SamplingParams, sample
from mtp_jax.speculative import SpeculativeConfig, speculative_generate, speculative_stream


def _commit_sampled(state: DecodeState, logits: jax.Array) -> DecodeState:
    """Samples the token at position `state.lengths` from logits [B, V] and commits it."""
    token = sample(logits, state.sampling, state.lengths)
    ones = jnp.ones_like(token)
    return commit_tokens(state, token[:, None], ones, token_logprobs(logits, token)[:, None])[0]


def prefill(model: Transformer, state: DecodeState, padded_prompts: jax.Array) -> DecodeState:
    """Runs the prompts [B, P] (right-padded) through the model and commits the first token."""
    positions = sequence_positions(*padded_prompts.shape)  # padding past a prompt is stale from the start
    logits, _, cache = model(padded_prompts, positions, state.cache, logits_at=state.prompt_lengths - 1)
    last_logits = logits[:, 0]  # [B, V]
    state = state.replace(cache=cache)
    return _commit_sampled(state, last_logits)


def decode_step(model: Transformer, state: DecodeState) -> DecodeState:
    """One token for every unfinished row: forward the last committed token, sample, commit."""
    batch = state.tokens.shape[0]
    last = take_rows(state.tokens, jnp.maximum(state.lengths - 1, 0))  # [B, 1]
    with jax.named_scope("forward"):  # t_{L-1} at position L - 1 (a finished row's write there stays stale)
        logits, _, cache = model(last, (state.lengths - 1)[:, None], state.cache)
    return _commit_sampled(state.replace(cache=cache), logits.reshape(batch, -1))


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("state",))
def _prefill_jit(graph, params, state, padded_prompts):
    return prefill(graph.merge(params), state, padded_prompts)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("state",))
def _step_jit(graph, params, state):
    return decode_step(graph.merge(params), state)


@functools.partial(jax.jit, static_argnames=("graph",), donate_argnames=("state",))
def _loop_jit(graph, params, state):
    model = graph.merge(params)

    def body(carry):
        state, steps = carry
        return decode_step(model, state), steps + 1

    return jax.lax.while_loop(lambda c: ~jnp.all(c[0].done), body, (state, jnp.int32(0)))


def generate(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 64,
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, max_length: int | None = None,
             stop_tokens: Iterable[int] | None = None,
             speculative: SpeculativeConfig | None = None) -> GenerationResult:
    """Generates up to `max_new_tokens` tokens for each prompt, the whole loop on device.

    Args:
      model: the main model.
      prompts: B lists of int token ids (Python or NumPy ints; different lengths allowed), B 1-D
        integer arrays, or one 2-D integer array [B, P]. Text is rejected: encode it first.
      max_new_tokens: one int >= 1 for all rows, or one per row.
      sampling: `SamplingParams` for all rows or one per row; default greedy.
      max_length: S, the cache capacity in tokens (prompt + generated), in
        [2, config.max_position_embeddings]; default `config.max_position_embeddings`.
      stop_tokens: up to `MAX_STOP_TOKENS` int token ids that end a row (kept in its output);
        default the config's EOS ids.
      speculative: a `mtp_jax.speculative.SpeculativeConfig` to decode with the model's MTP
        modules (`speculative_generate`); None for plain decoding.

    Returns:
      A `GenerationResult` (a `SpeculativeResult`, with metrics, when speculating). Raises
      TypeError / ValueError, naming the argument, on invalid input (see `init_state`).
    """
    if speculative is not None:
        return speculative_generate(model, prompts, speculative, max_new_tokens=max_new_tokens, sampling=sampling,
                                    max_length=max_length, stop_tokens=stop_tokens)
    state, padded = init_state(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                               max_length=max_length, stop_tokens=stop_tokens)
    graph, params = static_split(model)
    start = time.perf_counter()
    state = _prefill_jit(graph, params, state, padded)
    state, steps = _loop_jit(graph, params, state)
    jax.block_until_ready(state.lengths)
    seconds = time.perf_counter() - start
    return results_from_state(state, int(steps), seconds)


def stream(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 64,
           sampling: SamplingParams | Sequence[SamplingParams] | None = None, max_length: int | None = None,
           stop_tokens: Iterable[int] | None = None,
           speculative: SpeculativeConfig | None = None) -> Generator[list[list[int]], None, GenerationResult]:
    """Like `generate`, one step at a time: yields, per step, the tokens each row just committed.

    A finished row yields empty lists. The concatenation of everything yielded for a row equals
    `generate(...).tokens` for that row with the same arguments. The generator's return value
    (`StopIteration.value`) is a `GenerationResult` (a `SpeculativeResult`, with metrics, when
    speculating) whose `seconds` is the wall time from the prefill to the last step,
    the consumer's time between steps included. Raises as `generate`.
    """
    if speculative is not None:
        return (yield from speculative_stream(model, prompts, speculative, max_new_tokens=max_new_tokens,
                                              sampling=sampling, max_length=max_length, stop_tokens=stop_tokens))
    state, padded = init_state(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                               max_length=max_length, stop_tokens=stop_tokens)
    graph, params = static_split(model)
    before = np.asarray(state.lengths)
    start = time.perf_counter()
    state = _prefill_jit(graph, params, state, padded)
    for num_steps in itertools.count():
        tokens, lengths, done = jax.device_get((state.tokens, state.lengths, state.done))
        yield [tokens[b, before[b]: lengths[b]].tolist() for b in range(len(before))]
        if done.all():
            return results_from_state(state, num_steps, time.perf_counter() - start)
        before = lengths
        state = _step_jit(graph, params, state)
