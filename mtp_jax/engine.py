"""The decode state every decoding path carries, and the verbs on it that need no model forward.

`init_state` checks a request and builds a `DecodeState` (the committed-token buffer, per-row
lengths and limits, sampling parameters, stop tokens and the main model's cache);
`commit_tokens` appends a block of candidate tokens per row and applies the stop conditions;
`results_from_state` reads a finished state back to the host. Plain decoding (`mtp_jax.generate`)
and speculative decoding (`mtp_jax.speculative`) both run on it.

State at every step boundary (`docs/MTP_SPEC.md`): `lengths[b]` = L_b committed tokens in
`tokens[b, :L_b]`; the main cache holds positions 0 .. L_b - 2. Committing advances `lengths`,
the only length there is (caches keep none, `mtp_jax.cache`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax.cache import KVCache
from mtp_jax.model import Transformer
from mtp_jax.sampling import SamplingParams, SamplingState, is_int

MAX_STOP_TOKENS = 16  # stop-token slots in the state (fixed shape); unused slots hold -1
_PROMPT_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer prefill compiles)
_TEXT = (str, bytes, bytearray, memoryview)  # sequences of characters or bytes, never of token ids


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, all device arrays (B rows, capacity S tokens)."""

    tokens: jax.Array  # int32 [B, S]: committed tokens, prompt first
    lengths: jax.Array  # int32 [B]: L_b, committed tokens per row
    prompt_lengths: jax.Array  # int32 [B]
    max_new_tokens: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    cache: tuple[KVCache, ...]  # the main model's per-layer caches, holding positions 0 .. lengths - 2
    sampling: SamplingState
    stop_tokens: jax.Array  # int32 [MAX_STOP_TOKENS], -1 = unused slot
    logprobs: jax.Array  # float32 [B, S]: log-softmax of the raw logits at each generated token


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What `generate` returns.

    tokens: per prompt, the generated token ids (prompt excluded; a stop token that ended the
      row is kept as its last token).
    logprobs: per prompt, the model's log-softmax (raw logits, before temperature) at each
      generated token.
    finish_reasons: per prompt, "stop" (EOS or a stop token), "length" (max_new_tokens) or
      "capacity" (the cache was full).
    num_steps: decode steps run, prefill excluded.
    seconds: wall time of prefill plus decode, compile excluded only if already warm.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    num_steps: int
    seconds: float

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


def _is_integer(value) -> bool:
    """A Python or NumPy int, or a 0-d integer array (an element of a NumPy or JAX array, `jnp.int32(3)`);
    not a bool. Token ids, max_new_tokens and max_length all accept exactly these."""
    if isinstance(value, (np.ndarray, jax.Array)):
        return value.ndim == 0 and np.issubdtype(value.dtype, np.integer)
    return is_int(value)


def _prompt_ids(prompt, i: int, vocab_size: int, max_length: int) -> list[int]:
    """Prompt i as a list of Python ints, checked (see `validate_prompts`)."""
    if isinstance(prompt, _TEXT):
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}: prompts are token ids "
                        "(e.g. tokenizer.encode(text).ids), not text")
    if isinstance(prompt, (np.ndarray, jax.Array)):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"prompt {i} is an array of shape {prompt.shape} and dtype {prompt.dtype}: "
                            "a prompt array must be 1-D with an integer dtype")
        ids = np.asarray(prompt).tolist()
    elif isinstance(prompt, Sequence):
        for j, t in enumerate(prompt):
            if not _is_integer(t):
                raise TypeError(f"prompt {i} has {t!r} ({type(t).__name__}) at index {j}: token ids must be "
                                "ints (floats and bools are rejected, not truncated)")
        ids = [int(t) for t in prompt]
    else:
        raise TypeError(f"prompt {i} is {prompt!r} ({type(prompt).__name__}), not a list of token ids: prompts "
                        "is a batch (wrap a single prompt in a list: [ids])")
    if not ids:
        raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if len(ids) >= max_length:
        raise ValueError(f"prompt {i} has {len(ids)} tokens: the cache capacity max_length={max_length} "
                         "must exceed the prompt length to leave room for generated tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {i} has token id {bad[0]} outside [0, vocab_size={vocab_size})")
    return ids


def validate_prompts(prompts: Sequence[Sequence[int]] | np.ndarray, vocab_size: int,
                     max_length: int) -> list[list[int]]:
    """Checks a batch of prompts on the host; returns it as B lists of Python ints.

    `prompts`: B prompts, each a sequence of Python or NumPy ints or a 1-D integer array; or one
    2-D integer array [B, P]. Raises TypeError (naming the prompt and the index) for text instead
    of ids (str, bytes, bytearray, memoryview), float or bool ids, or a flat list of ids (one prompt
    not wrapped in a batch); raises ValueError for an empty batch or prompt, a prompt of >=
    `max_length` tokens, or an id outside [0, vocab_size).
    """
    if isinstance(prompts, _TEXT):
        raise TypeError(f"prompts is a {type(prompts).__name__}: pass token ids "
                        "(e.g. [tokenizer.encode(text).ids]), not text")
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise TypeError(f"prompts as an array must be 2-D [B, P], got shape {prompts.shape}")
        prompts = list(prompts)  # rows; each is checked as a 1-D array
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    return [_prompt_ids(p, i, vocab_size, max_length) for i, p in enumerate(prompts)]


def _per_row(value, num_rows: int, name: str) -> list:
    """`value` as one entry per row: a list, tuple or 1-D array of `num_rows` entries, else `value` for each
    row (a 0-d array is one value)."""
    if isinstance(value, (list, tuple)) or (isinstance(value, (np.ndarray, jax.Array)) and value.ndim > 0):
        if len(value) != num_rows:
            raise ValueError(f"{name} has {len(value)} entries for {num_rows} prompts")
        return list(value)
    return [value] * num_rows


def _stop_array(stop_tokens, vocab_size: int) -> jax.Array:
    """Any collection of token ids (a list, tuple, set or 1-D array; order and repeats do not matter) as the
    state's int32 [MAX_STOP_TOKENS] slots, sorted, -1 for unused ones."""
    if (isinstance(stop_tokens, _TEXT) or not isinstance(stop_tokens, Iterable)
            or getattr(stop_tokens, "ndim", 1) == 0):
        raise TypeError(f"stop_tokens must be a collection of token ids (a list, tuple, set or 1-D array), "
                        f"got {stop_tokens!r}")
    stop_tokens = list(stop_tokens)  # an iterator is read once
    for t in stop_tokens:
        if not _is_integer(t):
            raise TypeError(f"stop_tokens has {t!r} ({type(t).__name__}): stop tokens must be int token ids")
    stop = sorted(set(int(t) for t in stop_tokens))
    if len(stop) > MAX_STOP_TOKENS:
        raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens are supported, got {len(stop)}")
    for t in stop:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t} is outside [0, vocab_size={vocab_size})")
    return jnp.asarray(stop + [-1] * (MAX_STOP_TOKENS - len(stop)), jnp.int32)


@jax.named_scope("commit")
def commit_tokens(state: DecodeState, candidates: jax.Array, num_candidates: jax.Array,
                  candidate_logprobs: jax.Array) -> tuple[DecodeState, jax.Array]:
    """Appends up to N candidate tokens per unfinished row and applies the stop conditions.

    Row b offers `candidates[b, :num_candidates[b]]` (int32 [B, N]). The block is cut after the
    first stop token (kept), at `max_new_tokens` and at the capacity S; finished rows take nothing.
    Returns the new state and the number of tokens each row committed (int32 [B]).
    """
    batch, capacity = state.tokens.shape
    index = jnp.arange(candidates.shape[1])[None, :]  # [1, N]
    offered = index < num_candidates[:, None]  # [B, N]
    is_stop = offered & jnp.any(candidates[:, :, None] == state.stop_tokens[None, None, :], axis=-1)  # [B, N]
    through_stop = jnp.where(jnp.any(is_stop, axis=-1), jnp.argmax(is_stop, axis=-1) + 1, num_candidates)
    room = jnp.minimum(state.max_new_tokens - (state.lengths - state.prompt_lengths), capacity - state.lengths)
    num = jnp.where(state.done, 0, jnp.clip(jnp.minimum(through_stop, room), 0, None))  # [B]
    taken = index < num[:, None]  # [B, N]
    positions = jnp.where(taken, state.lengths[:, None] + index, capacity)  # untaken: past the end, dropped
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], positions.shape)
    tokens = state.tokens.at[rows, positions].set(candidates, mode="drop")
    logprobs = state.logprobs.at[rows, positions].set(candidate_logprobs, mode="drop")
    lengths = state.lengths + num
    done = (state.done | jnp.any(is_stop & taken, axis=-1) | (lengths - state.prompt_lengths >= state.max_new_tokens)
            | (lengths >= capacity))
    return state.replace(tokens=tokens, logprobs=logprobs, lengths=lengths, done=done), num


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log-softmax of `logits` [..., V] at `tokens` [...] (float32 [...])."""
    return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), tokens[..., None],
                               axis=-1)[..., 0]


def init_state(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
               sampling: SamplingParams | Sequence[SamplingParams] | None = None, max_length: int | None = None,
               stop_tokens: Iterable[int] | None = None) -> tuple[DecodeState, jax.Array]:
    """Validates the request and builds the initial state and the padded prompt array [B, P].

    Integers may be Python or NumPy ints or 0-d integer arrays (NumPy or JAX); stop_tokens may be
    any non-text collection of them (a list, tuple, set or 1-D array).
    Raises TypeError for arguments of the wrong type (text or float/bool ids as prompts, a float or
    bool max_length / max_new_tokens, non-int stop tokens, sampling that is not `SamplingParams`)
    and ValueError for values out of range: see `validate_prompts`; max_length outside
    [2, config.max_position_embeddings]; max_new_tokens < 1; more than `MAX_STOP_TOKENS` stop
    tokens or one outside the vocabulary. Every message names the argument.
    """
    config = model.config
    max_length = config.max_position_embeddings if max_length is None else max_length
    if not _is_integer(max_length):
        raise TypeError(f"max_length must be an int (tokens), got {max_length!r}")
    max_length = int(max_length)
    if not 2 <= max_length <= config.max_position_embeddings:
        raise ValueError(f"max_length={max_length} must be in [2, {config.max_position_embeddings}]: the cache "
                         "capacity cannot exceed the model's positions (config.max_position_embeddings="
                         f"{config.max_position_embeddings})")
    prompts = validate_prompts(prompts, config.vocab_size, max_length)
    batch = len(prompts)
    new_tokens = _per_row(max_new_tokens, batch, "max_new_tokens")
    for n in new_tokens:
        if not _is_integer(n):
            raise TypeError(f"max_new_tokens must be an int (tokens), got {n!r}")
        if n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
    params = _per_row(SamplingParams() if sampling is None else sampling, batch, "sampling")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(p).__name__}")
    stop = config.eos_token_ids if stop_tokens is None else stop_tokens
    prompt_lengths = np.asarray([len(p) for p in prompts], np.int32)
    bucket = min(-(-int(prompt_lengths.max()) // _PROMPT_BUCKET) * _PROMPT_BUCKET, max_length)
    padded = np.zeros((batch, bucket), np.int32)
    tokens = np.zeros((batch, max_length), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
        tokens[b, : len(p)] = p
    state = DecodeState(
        tokens=jnp.asarray(tokens), lengths=jnp.asarray(prompt_lengths), prompt_lengths=jnp.asarray(prompt_lengths),
        max_new_tokens=jnp.asarray([min(int(n), 2**31 - 1) for n in new_tokens], jnp.int32),
        done=jnp.zeros((batch,), bool), cache=model.init_cache(batch, max_length),
        sampling=SamplingState.from_params(params), stop_tokens=_stop_array(stop, config.vocab_size),
        logprobs=jnp.zeros((batch, max_length), jnp.float32))
    return state, jnp.asarray(padded)


def _finish_reason(state_row_tokens: np.ndarray, length: int, prompt_length: int, max_new: int,
                   capacity: int, stop: set[int]) -> str:
    if length > prompt_length and int(state_row_tokens[length - 1]) in stop:
        return "stop"
    if length - prompt_length >= max_new:
        return "length"
    return "capacity" if length >= capacity else "length"


def results_from_state(state: DecodeState, num_steps: int, seconds: float) -> GenerationResult:
    """Host-side view of a finished state."""
    tokens, lengths, prompt_lengths, logprobs, max_new, stop = jax.device_get(
        (state.tokens, state.lengths, state.prompt_lengths, state.logprobs, state.max_new_tokens, state.stop_tokens))
    stop_set = {int(t) for t in stop if t >= 0}
    capacity = tokens.shape[1]
    rows = range(tokens.shape[0])
    return GenerationResult(
        tokens=[tokens[b, prompt_lengths[b]: lengths[b]].tolist() for b in rows],
        logprobs=[logprobs[b, prompt_lengths[b]: lengths[b]].tolist() for b in rows],
        finish_reasons=[_finish_reason(tokens[b], int(lengths[b]), int(prompt_lengths[b]), int(max_new[b]),
                                       capacity, stop_set) for b in rows],
        num_steps=num_steps, seconds=seconds)


