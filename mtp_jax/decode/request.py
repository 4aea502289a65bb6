"""A generation request checked on the host, before anything reaches a device.

`check_request` turns what a caller of `generate` / `stream` passes (prompts, max_new_tokens,
sampling, max_length, stop_tokens) into a `Request` of plain Python values, or raises TypeError /
ValueError naming the argument. `mtp_jax.decode.engine.init_state` builds the decode state from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from mtp_jax.config import MAX_STOP_TOKENS, ModelConfig
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.validation import is_integer

_TEXT = (str, bytes, bytearray, memoryview)  # sequences of characters or bytes, never of token ids


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request: B prompts and one value per row for the rest."""

    prompts: list[list[int]]  # B lists of token ids, each in [1, max_length) tokens
    max_new_tokens: list[int]  # per row, >= 1 (capped at 2**31 - 1)
    sampling: list[SamplingParams]  # per row
    max_length: int  # S, the cache capacity in tokens
    stop_tokens: list[int]  # sorted distinct ids, at most MAX_STOP_TOKENS


def _prompt_ids(prompt, i: int, vocab_size: int, max_length: int) -> list[int]:
    """Prompt i as a list of Python ints, checked (see `validate_prompts`)."""
    if isinstance(prompt, _TEXT):
        raise TypeError(
            f"prompt {i} is a {type(prompt).__name__}: prompts are token ids "
            "(e.g. tokenizer.encode(text).ids), not text"
        )
    if isinstance(prompt, (np.ndarray, jax.Array)):
        if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(
                f"prompt {i} is an array of shape {prompt.shape} and dtype {prompt.dtype}: "
                "a prompt array must be 1-D with an integer dtype"
            )
        ids = np.asarray(prompt).tolist()
    elif isinstance(prompt, Sequence):
        for j, t in enumerate(prompt):
            if not is_integer(t):
                raise TypeError(
                    f"prompt {i} has {t!r} ({type(t).__name__}) at index {j}: token ids must be "
                    "ints (floats and bools are rejected, not truncated)"
                )
        ids = [int(t) for t in prompt]
    else:
        raise TypeError(
            f"prompt {i} is {prompt!r} ({type(prompt).__name__}), not a list of token ids: prompts "
            "is a batch (wrap a single prompt in a list: [ids])"
        )
    if not ids:
        raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    if len(ids) >= max_length:
        raise ValueError(
            f"prompt {i} has {len(ids)} tokens: the cache capacity max_length={max_length} "
            "must exceed the prompt length to leave room for generated tokens"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt {i} has token id {bad[0]} outside [0, vocab_size={vocab_size})")
    return ids


def validate_prompts(
    prompts: Sequence[Sequence[int]] | np.ndarray, vocab_size: int, max_length: int
) -> list[list[int]]:
    """Checks a batch of prompts on the host; returns it as B lists of Python ints.

    `prompts`: B prompts, each a sequence of Python or NumPy ints or a 1-D integer array; or one
    2-D integer array [B, P]. Raises TypeError (naming the prompt and the index) for text instead
    of ids (str, bytes, bytearray, memoryview), float or bool ids, or a flat list of ids (one prompt
    not wrapped in a batch); raises ValueError for an empty batch or prompt, a prompt of >=
    `max_length` tokens, or an id outside [0, vocab_size).
    """
    if isinstance(prompts, _TEXT):
        raise TypeError(
            f"prompts is a {type(prompts).__name__}: pass token ids (e.g. [tokenizer.encode(text).ids]), not text"
        )
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise TypeError(f"prompts as an array must be 2-D [B, P], got shape {prompts.shape}")
        prompts = list(prompts)  # rows; each is checked as a 1-D array
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    return [_prompt_ids(p, i, vocab_size, max_length) for i, p in enumerate(prompts)]


def per_row(value, num_rows: int, name: str) -> list:
    """`value` as one entry per row: a list, tuple or 1-D array of `num_rows` entries, else `value` for each
    row (a 0-d array is one value). Raises ValueError, naming `name`, for a wrong number of entries."""
    if isinstance(value, (list, tuple)) or (isinstance(value, (np.ndarray, jax.Array)) and value.ndim > 0):
        if len(value) != num_rows:
            raise ValueError(f"{name} has {len(value)} entries for {num_rows} prompts")
        return list(value)
    return [value] * num_rows


def _stop_ids(stop_tokens, vocab_size: int) -> list[int]:
    """Any collection of token ids (a list, tuple, set or 1-D array; order and repeats do not matter),
    sorted and distinct."""
    if isinstance(stop_tokens, _TEXT) or not isinstance(stop_tokens, Iterable) or getattr(stop_tokens, "ndim", 1) == 0:
        raise TypeError(
            f"stop_tokens must be a collection of token ids (a list, tuple, set or 1-D array), got {stop_tokens!r}"
        )
    stop_tokens = list(stop_tokens)  # an iterator is read once
    for t in stop_tokens:
        if not is_integer(t):
            raise TypeError(f"stop_tokens has {t!r} ({type(t).__name__}): stop tokens must be int token ids")
    stop = sorted(set(int(t) for t in stop_tokens))
    if len(stop) > MAX_STOP_TOKENS:
        raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens are supported, got {len(stop)}")
    for t in stop:
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token {t} is outside [0, vocab_size={vocab_size})")
    return stop


def check_min_tokens(sampling: SamplingParams, max_new_tokens: int) -> None:
    """Raises ValueError when `sampling.min_tokens` exceeds the row's `max_new_tokens` (as vLLM does)."""
    if sampling.min_tokens > max_new_tokens:
        raise ValueError(
            f"min_tokens={sampling.min_tokens} must be at most max_tokens (max_new_tokens)={max_new_tokens}"
        )


def check_request(
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_length: int | None = None,
    stop_tokens: Iterable[int] | None = None,
) -> Request:
    """Checks a generation request against the model's config.

    Integers may be Python or NumPy ints or 0-d integer arrays (NumPy or JAX); stop_tokens may be
    any non-text collection of them (a list, tuple, set or 1-D array); default the config's EOS ids.
    Raises TypeError for arguments of the wrong type (text or float/bool ids as prompts, a float or
    bool max_length / max_new_tokens, non-int stop tokens, sampling that is not `SamplingParams`)
    and ValueError for values out of range: see `validate_prompts`; max_length outside
    [2, config.max_position_embeddings]; max_new_tokens < 1; more than `MAX_STOP_TOKENS` stop
    tokens or one outside the vocabulary. Every message names the argument.
    """
    max_length = config.max_position_embeddings if max_length is None else max_length
    if not is_integer(max_length):
        raise TypeError(f"max_length must be an int (tokens), got {max_length!r}")
    max_length = int(max_length)
    if not 2 <= max_length <= config.max_position_embeddings:
        raise ValueError(
            f"max_length={max_length} must be in [2, {config.max_position_embeddings}]: the cache "
            "capacity cannot exceed the model's positions (config.max_position_embeddings="
            f"{config.max_position_embeddings})"
        )
    prompts = validate_prompts(prompts, config.vocab_size, max_length)
    new_tokens = per_row(max_new_tokens, len(prompts), "max_new_tokens")
    for n in new_tokens:
        if not is_integer(n):
            raise TypeError(f"max_new_tokens must be an int (tokens), got {n!r}")
        if n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {n!r}")
    params = per_row(SamplingParams() if sampling is None else sampling, len(prompts), "sampling")
    for p in params:
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(p).__name__}")
        outside = [token for token, _ in p.logit_bias if token >= config.vocab_size]
        if outside:
            raise ValueError(f"logit_bias token ids must be < vocab_size={config.vocab_size}, got {outside[0]}")
    stop = _stop_ids(config.eos_token_ids if stop_tokens is None else stop_tokens, config.vocab_size)
    return Request(
        prompts=prompts,
        max_new_tokens=[min(int(n), 2**31 - 1) for n in new_tokens],
        sampling=params,
        max_length=max_length,
        stop_tokens=stop,
    )
