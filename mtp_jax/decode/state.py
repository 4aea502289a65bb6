"""The decode state: everything one decode loop carries between steps, and how it starts and ends.

`init_state` checks a request (`mtp_jax.decode.request`) and builds the state of B rows with a cache
capacity of S tokens; `results_from_state` reads a state back into a `GenerationResult` on the host.
At every step boundary (`docs/MTP_SPEC.md`): `lengths[b]` = L_b committed tokens in `tokens[b, :L_b]`;
the main cache and every MTP cache hold positions 0 .. L_b - 2; `draft.tokens` holds the drafts for
positions L_b .. L_b + K - 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import KVCache, PageLayout
from mtp_jax.cache import init_cache as build_cache
from mtp_jax.cache import logical_axes as cache_axes
from mtp_jax.config import MAX_STOP_TOKENS
from mtp_jax.decode.acceptance import initial_phase
from mtp_jax.decode.drafters import DraftState, init_draft_state
from mtp_jax.decode.metrics import SpeculativeCounters, SpeculativeMetrics
from mtp_jax.decode.request import check_min_tokens, check_request
from mtp_jax.decode.sampling import SamplingParams, SamplingState
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import Transformer
from mtp_jax.sharding import to_host
from mtp_jax.validation import is_integer

PROMPT_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer prefill compiles)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, all device arrays (B rows, capacity S tokens, K drafts)."""

    tokens: jax.Array  # int32 [B, S]: committed tokens, prompt first
    lengths: jax.Array  # int32 [B]: L_b, committed tokens per row
    prompt_lengths: jax.Array  # int32 [B]
    output_start: jax.Array  # int32 [B]: where the output begins (< prompt_lengths: a resumed row, `init_state`)
    max_new_tokens: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    cache: tuple[KVCache, ...]  # the main model's cache (`Transformer.init_cache`), positions 0 .. lengths - 2
    sampling: SamplingState
    stop_tokens: jax.Array  # int32 [B, MAX_STOP_TOKENS]: each row's stop tokens, -1 = unused slot
    logprobs: jax.Array  # float32 [B, S]: log-softmax of the raw logits at each generated token
    thinking: jax.Array  # bool [B]: in a thinking phase after the last committed token (relaxed acceptance)
    # The N = max_logprobs most likely tokens (raw log-softmax, descending) at each position the last call
    # (a final prefill chunk: 1, a step: up to K+1) committed; N = 0: not computed.
    top_logprobs: jax.Array  # float32 [B, K+1, N]
    top_tokens: jax.Array  # int32 [B, K+1, N]
    draft: DraftState  # the drafter's state (empty arrays when not speculating)
    metrics: SpeculativeCounters  # per-row step and acceptance counters

    def logical_axes(self) -> DecodeState:
        """The same tree with each array's logical axes (`mtp_jax.sharding`): rows over "batch"
        everywhere, the caches as `mtp_jax.cache.logical_axes` names them, the draft distributions'
        vocabulary over "vocab"."""
        axes = jax.tree.map(lambda x: P("batch", *([None] * (x.ndim - 1))), self)
        return axes.replace(
            cache=cache_axes(self.cache),
            draft=axes.draft.replace(probs=P("batch", None, "vocab"), caches=cache_axes(self.draft.caches)),
        )


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """What `generate` returns.

    tokens: per prompt, the generated token ids (prompt excluded; a stop token that ended the
      row is kept as its last token).
    logprobs: per prompt, the model's log-softmax (raw logits, before temperature) at each
      generated token.
    finish_reasons: per prompt, "stop" (EOS or a stop token), "length" (max_new_tokens) or
      "capacity" (the cache was full).
    num_steps: decode (verify) steps run, prefill excluded.
    seconds: wall time of prefill plus decode, compile excluded only if already warm.
    metrics: the pooled speculative metrics when speculating, else None.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    num_steps: int
    seconds: float
    metrics: SpeculativeMetrics | None = None

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.seconds if self.seconds > 0 else float("nan")


def init_state(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    max_length: int | None = None,
    stop_tokens: Iterable[int] | None = None,
    speculative: SpeculativeConfig | None = None,
    oracle_tokens: np.ndarray | None = None,
    pages: PageLayout | None = None,
    max_logprobs: int = 0,
    num_generated: Sequence[int] | None = None,
) -> tuple[DecodeState, jax.Array]:
    """Checks the request and builds the initial state and the padded prompt array int32 [B, P]; with `pages`
    its attention caches (main and MTP) are paged (`mtp_jax.cache.PagedCache`; the serving engine's); with
    `max_logprobs` N > 0 every call also keeps the N most likely tokens at the positions it committed
    (`DecodeState.top_logprobs`, vLLM's `max_logprobs`; ValueError unless 0 <= N <= vocab size).
    `num_generated[b]`: the last tokens of prompt b that are output the row generated before (a request
    resumed after a preemption): the penalties count them as output and `min_tokens` as generated
    (ValueError unless in 0 .. len(prompt) - 1).

    The request's arguments are `generate`'s (checked by `mtp_jax.decode.request.check_request`, which
    lists the TypeError / ValueError raised); `speculative` is checked against the model
    (ValueError: no MTP modules, vanilla/parallel with K > D, ...); `oracle_tokens` (int [B, R]) is
    method "oracle"'s replayed sequences, prompt first.
    """
    config = model.config
    if speculative is not None:
        speculative.check_model(model, config.vocab_size)
    if not is_integer(max_logprobs) or not 0 <= max_logprobs <= config.vocab_size:
        raise ValueError(
            f"max_logprobs must be an int in 0 .. {config.vocab_size} (the vocabulary), got {max_logprobs!r}"
        )
    request = check_request(
        config,
        prompts,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        max_length=max_length,
        stop_tokens=stop_tokens,
    )
    prompts, capacity, batch = request.prompts, request.max_length, len(request.prompts)
    prompt_lengths = np.asarray([len(p) for p in prompts], np.int32)
    generated = np.zeros(batch, np.int32) if num_generated is None else np.asarray(num_generated)
    if generated.shape != (batch,) or not np.issubdtype(generated.dtype, np.integer):
        raise ValueError(f"num_generated must be one int per prompt ({batch}), got {num_generated!r}")
    if np.any(generated < 0) or np.any(generated >= prompt_lengths):
        raise ValueError(f"num_generated must be in 0 .. len(prompt) - 1 per prompt, got {generated.tolist()}")
    for params, new, done in zip(request.sampling, request.max_new_tokens, generated.tolist(), strict=True):
        check_min_tokens(params, new + done)
    bucket = min(-(-int(prompt_lengths.max()) // PROMPT_BUCKET) * PROMPT_BUCKET, capacity)
    padded = np.zeros((batch, bucket), np.int32)
    tokens = np.zeros((batch, capacity), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
        tokens[b, : len(p)] = p
    stop = request.stop_tokens + [-1] * (MAX_STOP_TOKENS - len(request.stop_tokens))
    k_max = 0 if speculative is None else speculative.num_speculative_tokens
    # Host arrays go to the device with `device_put`: `jnp.asarray` / `jnp.zeros` would compile a small
    # program for each (the first call of a process paid ~0.3 s for them).
    host = dict(
        tokens=tokens,
        lengths=prompt_lengths,
        prompt_lengths=prompt_lengths.copy(),
        output_start=(prompt_lengths - generated).astype(np.int32),
        max_new_tokens=np.asarray(request.max_new_tokens, np.int32),
        done=np.zeros((batch,), bool),
        stop_tokens=np.asarray([stop] * batch, np.int32),
        logprobs=np.zeros((batch, capacity), np.float32),
        thinking=np.asarray([initial_phase(p, speculative) for p in prompts], bool),
        top_logprobs=np.zeros((batch, k_max + 1, max_logprobs), np.float32),
        top_tokens=np.zeros((batch, k_max + 1, max_logprobs), np.int32),
    )
    state = DecodeState(
        **jax.device_put(host),
        cache=build_cache(model.init_cache, batch, capacity, pages),
        sampling=SamplingState.from_params(request.sampling),
        draft=init_draft_state(model, speculative, batch, capacity, oracle_tokens, pages),
        metrics=SpeculativeCounters.zeros(batch, k_max),
    )
    return state, jax.device_put(padded)


def _finish_reason(
    row_tokens: np.ndarray, length: int, prompt_length: int, max_new: int, capacity: int, stop: set[int]
) -> str:
    if length > prompt_length and int(row_tokens[length - 1]) in stop:
        return "stop"
    if length - prompt_length >= max_new:
        return "length"
    return "capacity" if length >= capacity else "length"


def results_from_state(state: DecodeState, seconds: float, *, speculating: bool) -> GenerationResult:
    """Host-side view of a state; `num_steps` counts the decode (verify) steps, metrics only when speculating."""
    tokens, lengths, prompt_lengths, logprobs, max_new, stop, steps = to_host(
        (
            state.tokens,
            state.lengths,
            state.prompt_lengths,
            state.logprobs,
            state.max_new_tokens,
            state.stop_tokens,
            state.metrics.num_steps,
        )
    )
    capacity = tokens.shape[1]
    rows = range(tokens.shape[0])
    return GenerationResult(
        tokens=[tokens[b, prompt_lengths[b] : lengths[b]].tolist() for b in rows],
        logprobs=[logprobs[b, prompt_lengths[b] : lengths[b]].tolist() for b in rows],
        finish_reasons=[
            _finish_reason(
                tokens[b],
                int(lengths[b]),
                int(prompt_lengths[b]),
                int(max_new[b]),
                capacity,
                {int(t) for t in stop[b] if t >= 0},
            )
            for b in rows
        ],
        num_steps=int(steps.max()),
        seconds=seconds,
        metrics=SpeculativeMetrics.from_counters(to_host(state.metrics)) if speculating else None,
    )
