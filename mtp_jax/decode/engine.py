"""The decode engine: one state, one prefill, one jitted step, one on-device loop, for plain and
speculative decoding alike (plain decoding is speculation with no drafter, K = 0).

A step, for every unfinished row (`docs/MTP_SPEC.md`), in verbs that each read on their own:

- **verify** (`verify`): feed `[t_{L-1}, d_1, ..., d_K]` at positions `L-1 .. L-1+K` through the main
  model in one forward; output j is the target distribution p_j for position L + j, normalised
  once (`acceptance.Target`).
- **accept** (`acceptance.accept`): the accepted prefix of the drafts and the token after it.
- **commit** (`commit`): append them, cut at the first stop token, `max_new_tokens` and the capacity.
  Committing advances `lengths`, the only length there is; that is also the **roll back**: caches
  keep no lengths, every cache of a row holds the positions before its last committed token, and
  what a verify pass wrote for rejected drafts lies past that, stale, masked out and overwritten
  later.
- **draft** (`speculative.draft_after_verify`): the next K drafts (none when not speculating).

State at every step boundary: `lengths[b]` = L_b committed tokens in `tokens[b, :L_b]`; the main
cache and every MTP cache hold positions 0 .. L_b - 2; `draft.tokens` holds the drafts for positions
L_b .. L_b + K - 1.

`DecodeEngine` is the public step API: `init_state`, `prefill`, `step`, `run` (the whole loop on
device), `result`; each of its jitted calls compiles once per (B, S, prompt bucket, model, drafter):
generation length, sampling parameters, stop tokens and prompt contents are data, never shapes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import KVCache, write_at
from mtp_jax.cache import logical_axes as cache_axes
from mtp_jax.decode.acceptance import Target, accept, initial_phase, update_phase
from mtp_jax.decode.drafters import (
    DraftState,
    SpeculativeConfig,
    draft_after_prefill,
    draft_after_verify,
    init_draft_state,
)
from mtp_jax.decode.metrics import SpecMetrics, SpeculativeMetrics
from mtp_jax.decode.request import MAX_STOP_TOKENS, check_request
from mtp_jax.decode.sampling import SamplingParams, SamplingState
from mtp_jax.layers.indexing import sequence_positions, take_rows
from mtp_jax.model import Transformer, static_split
from mtp_jax.mtp import initial_hidden
from mtp_jax.sharding import constrain_tree, named_shardings, place, shard_params, to_host

_PROMPT_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer prefill compiles)


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, all device arrays (B rows, capacity S tokens, K drafts)."""

    tokens: jax.Array  # int32 [B, S]: committed tokens, prompt first
    lengths: jax.Array  # int32 [B]: L_b, committed tokens per row
    prompt_lengths: jax.Array  # int32 [B]
    max_new_tokens: jax.Array  # int32 [B]
    done: jax.Array  # bool [B]
    cache: tuple[KVCache, ...]  # the main model's cache (`Transformer.init_cache`), positions 0 .. lengths - 2
    sampling: SamplingState
    stop_tokens: jax.Array  # int32 [B, MAX_STOP_TOKENS]: each row's stop tokens, -1 = unused slot
    logprobs: jax.Array  # float32 [B, S]: log-softmax of the raw logits at each generated token
    thinking: jax.Array  # bool [B]: in a thinking phase after the last committed token (relaxed acceptance)
    draft: DraftState  # the drafter's state (empty arrays when not speculating)
    metrics: SpecMetrics  # per-row step and acceptance counters

    def logical_axes(self) -> DecodeState:
        """The same tree with each array's logical axes (`mtp_jax.sharding`): rows over "batch"
        everywhere, the caches as `mtp_jax.cache.logical_axes` names them, the draft distributions'
        vocabulary over "vocab"."""
        axes = jax.tree.map(lambda x: P("batch", *([None] * (x.ndim - 1))), self)
        return axes.replace(cache=cache_axes(self.cache), draft=axes.draft.replace(
            probs=P("batch", None, "vocab"), caches=cache_axes(self.draft.caches)))


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


def init_state(model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
               sampling: SamplingParams | Sequence[SamplingParams] | None = None, max_length: int | None = None,
               stop_tokens: Iterable[int] | None = None, speculative: SpeculativeConfig | None = None,
               oracle_tokens: np.ndarray | None = None) -> tuple[DecodeState, jax.Array]:
    """Checks the request and builds the initial state and the padded prompt array int32 [B, P].

    The request's arguments are `generate`'s (checked by `mtp_jax.decode.request.check_request`, which
    lists the TypeError / ValueError raised); `speculative` is checked against the model
    (ValueError: no MTP modules, vanilla/parallel with K > D, ...); `oracle_tokens` (int [B, R]) is
    method "oracle"'s replayed sequences, prompt first.
    """
    config = model.config
    if speculative is not None:
        speculative.check_model(model, config.vocab_size)
    request = check_request(config, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                            max_length=max_length, stop_tokens=stop_tokens)
    prompts, capacity, batch = request.prompts, request.max_length, len(request.prompts)
    prompt_lengths = np.asarray([len(p) for p in prompts], np.int32)
    bucket = min(-(-int(prompt_lengths.max()) // _PROMPT_BUCKET) * _PROMPT_BUCKET, capacity)
    padded = np.zeros((batch, bucket), np.int32)
    tokens = np.zeros((batch, capacity), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
        tokens[b, : len(p)] = p
    stop = request.stop_tokens + [-1] * (MAX_STOP_TOKENS - len(request.stop_tokens))
    k_max = 0 if speculative is None else speculative.num_speculative_tokens
    # Host arrays go to the device with `device_put`: `jnp.asarray` / `jnp.zeros` would compile a small
    # program for each (the first call of a process paid ~0.3 s for them).
    host = dict(tokens=tokens, lengths=prompt_lengths, prompt_lengths=prompt_lengths.copy(),
                max_new_tokens=np.asarray(request.max_new_tokens, np.int32), done=np.zeros((batch,), bool),
                stop_tokens=np.asarray([stop] * batch, np.int32), logprobs=np.zeros((batch, capacity), np.float32),
                thinking=np.asarray([initial_phase(p, speculative) for p in prompts], bool))
    state = DecodeState(**jax.device_put(host), cache=model.init_cache(batch, capacity),
                        sampling=SamplingState.from_params(request.sampling),
                        draft=init_draft_state(model, speculative, batch, capacity, oracle_tokens),
                        metrics=SpecMetrics.zeros(batch, k_max))
    return state, jax.device_put(padded)


# ----------------------------------------------------------------------------------------------
# The verbs


@jax.named_scope("verify_forward")  # named scopes: `benchmarks/profile_step.py` groups time by them
def verify(model: Transformer, state: DecodeState) -> tuple[Target, jax.Array, tuple[KVCache, ...]]:
    """The main model over `[t_{L-1}, d_1 .. d_K]` at positions L-1 .. L-1+K (int32 [B, K+1]).

    Returns the K+1 targets, h^0 [B, K+1, E] for the drafter (`mtp.initial_hidden`; the final norm
    runs once for it and the logits) and the main cache with the K+1 entries written (a finished
    row's writes land past its length, stale).
    """
    last = take_rows(state.tokens, jnp.maximum(state.lengths - 1, 0))  # t_{L-1}, [B, 1]
    window = jnp.concatenate([last, state.draft.tokens], axis=1)  # [B, K+1]
    _, hidden, cache = model(window, sequence_positions(*window.shape, state.lengths - 1), state.cache,
                             with_logits=False)
    normed = model.norm(hidden)
    target = Target.from_logits(model.head(normed), state.sampling)
    return target, initial_hidden(model, hidden, normed), cache


@jax.named_scope("commit")
def commit(state: DecodeState, candidates: jax.Array, num_candidates: jax.Array,
           candidate_logprobs: jax.Array) -> tuple[DecodeState, jax.Array]:
    """Appends up to N candidate tokens per unfinished row and applies the stop conditions.

    Row b offers `candidates[b, :num_candidates[b]]` (int32 [B, N]) with their raw logprobs (float32
    [B, N]). The block is cut after the first stop token (kept), at `max_new_tokens` and at the
    capacity S; finished rows take nothing. Returns the new state and the number of tokens each row
    committed (int32 [B]).
    """
    capacity = state.tokens.shape[1]
    index = jnp.arange(candidates.shape[1])[None, :]  # [1, N]
    offered = index < num_candidates[:, None]  # [B, N]
    is_stop = offered & jnp.any(candidates[:, :, None] == state.stop_tokens[:, None, :], axis=-1)  # [B, N]
    through_stop = jnp.where(jnp.any(is_stop, axis=-1), jnp.argmax(is_stop, axis=-1) + 1, num_candidates)
    room = jnp.minimum(state.max_new_tokens - (state.lengths - state.prompt_lengths), capacity - state.lengths)
    num = jnp.where(state.done, 0, jnp.clip(jnp.minimum(through_stop, room), 0, None))  # [B]
    taken = index < num[:, None]  # [B, N]
    positions = jnp.where(taken, state.lengths[:, None] + index, capacity)  # untaken: past the end, dropped
    tokens = write_at(state.tokens, candidates, positions)
    logprobs = write_at(state.logprobs, candidate_logprobs, positions)
    lengths = state.lengths + num
    done = (state.done | jnp.any(is_stop & taken, axis=-1) | (lengths - state.prompt_lengths >= state.max_new_tokens)
            | (lengths >= capacity))
    return state.replace(tokens=tokens, logprobs=logprobs, lengths=lengths, done=done), num


def _accept_and_commit(spec: SpeculativeConfig | None, state: DecodeState,
                       target: Target) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Accept the drafts against `target` (K+1 outputs), commit the accepted ones and the emitted token.
    Returns the state and, per row (int32 [B]), the tokens committed and the drafts accepted."""
    drafts = state.draft.tokens  # [B, K]
    num_accepted, token = accept(spec, target, drafts, state.draft.probs, state.sampling, state.lengths,
                                 state.thinking)
    index = jnp.arange(drafts.shape[1] + 1)[None, :]
    candidates = jnp.where(index < num_accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))),
                           token[:, None])  # [B, K+1]: accepted drafts, then the emitted token
    new, num = commit(state, candidates, num_accepted + 1, target.logprobs_at(candidates))
    return new.replace(thinking=update_phase(spec, state.thinking, candidates, num)), num, num_accepted


def prefill(model: Transformer, spec: SpeculativeConfig | None, state: DecodeState, padded_prompts: jax.Array,
            start: jax.Array | None = None, *, final: bool = True) -> DecodeState:
    """Prompts int32 [B, C] (right-padded) through the main model, the first token committed (as a
    step with no drafts commits it), the first drafts made. Not a step: the metrics count none.

    Chunked prefill (`mtp_jax.serving`): `start` (int32 [B]) puts the chunk at positions start ..
    start + C - 1 of prompts already prefilled before `start`. A `final` chunk holds each prompt's
    last token (start <= prompt_lengths - 1 < start + C) and commits as above; an earlier chunk
    (`final=False`, static; start + C < prompt_lengths) only fills the caches, the MTP modules'
    included (`speculative.draft_after_prefill`), and commits nothing.
    """
    offset = jnp.zeros_like(state.lengths) if start is None else start
    positions = sequence_positions(*padded_prompts.shape, offset)  # padding past a prompt is stale from the start
    if final:
        logits, hidden, cache = model(padded_prompts, positions, state.cache,
                                      logits_at=state.prompt_lengths - 1 - offset)
        target = Target.from_logits(logits, state.sampling)  # [B, 1, V]: the target at position L
        no_drafts = state.draft.replace(tokens=state.draft.tokens[:, :0], probs=state.draft.probs[:, :0])
        state = _accept_and_commit(spec, state.replace(cache=cache, draft=no_drafts), target)[0].replace(
            draft=state.draft)
        lengths = state.lengths
    else:
        _, hidden, cache = model(padded_prompts, positions, state.cache, with_logits=False)
        state = state.replace(cache=cache)
        lengths = offset + padded_prompts.shape[1] + 1  # as if the chunk's next token were committed too
    state = state.replace(draft=draft_after_prefill(model, spec, state.sampling, state.tokens, state.draft,
                                                    initial_hidden(model, hidden), lengths, start))
    return constrain_tree(state, state.logical_axes())  # on a mesh: the state keeps its placement


def step(model: Transformer, spec: SpeculativeConfig | None, state: DecodeState) -> DecodeState:
    """One verify-accept-commit-draft step for every row (finished rows change nothing)."""
    target, h0, cache = verify(model, state)  # h0: [B, K+1, E] at positions L-1 .. L-1+K
    before = state
    state, num, num_accepted = _accept_and_commit(spec, state.replace(cache=cache), target)
    state = state.replace(metrics=state.metrics.count_step(~before.done, jnp.minimum(num_accepted, num)))
    state = state.replace(draft=draft_after_verify(model, spec, state.sampling, state.tokens, state.draft, h0,
                                                   before.lengths, num))
    return constrain_tree(state, state.logical_axes())  # on a mesh: the state keeps its placement


def run(model: Transformer, spec: SpeculativeConfig | None, state: DecodeState) -> DecodeState:
    """`step` until every row is done, as one `lax.while_loop` (traceable: jit it, or pmap it)."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: step(model, spec, s), state)


@struct.dataclass
class StepOutput:
    """What one step committed, per row, for a host that streams it (`mtp_jax.serving`).

    The first `num_committed[b]` entries of `tokens[b]` / `logprobs[b]` are row b's new tokens and
    their raw logprobs (the rest is padding); `num_accepted[b]` of them were accepted drafts.
    """

    num_committed: jax.Array  # int32 [B], 0 for a finished row
    tokens: jax.Array  # int32 [B, K+1]
    logprobs: jax.Array  # float32 [B, K+1]
    num_accepted: jax.Array  # int32 [B]
    done: jax.Array  # bool [B], after the step


def step_with_output(model: Transformer, spec: SpeculativeConfig | None,
                     state: DecodeState) -> tuple[DecodeState, StepOutput]:
    """`step`, and what it committed (`StepOutput`), gathered on device so the host reads [B, K+1]."""
    new = step(model, spec, state)
    positions = jnp.minimum(state.lengths[:, None] + jnp.arange(state.draft.tokens.shape[1] + 1)[None, :],
                            state.tokens.shape[1] - 1)  # [B, K+1]
    return new, StepOutput(num_committed=new.lengths - state.lengths,
                           tokens=jnp.take_along_axis(new.tokens, positions, axis=1),
                           logprobs=jnp.take_along_axis(new.logprobs, positions, axis=1),
                           num_accepted=new.metrics.num_accepted - state.metrics.num_accepted, done=new.done)


def _batch_axis(spec: P) -> int:
    return list(spec).index("batch")


def insert_row(state: DecodeState, rows: DecodeState, slot: jax.Array) -> DecodeState:
    """`state` with row `slot` (an int32 scalar, traced) replaced by row 0 of `rows` (a state of the
    same capacity and drafter, any batch size): how a prefilled request enters a running batch."""

    def put(x, new, spec):
        axis = _batch_axis(spec)
        row = jax.lax.slice_in_dim(new, 0, 1, axis=axis).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(x, row, slot, axis)

    state = jax.tree.map(put, state, rows, state.logical_axes())
    return constrain_tree(state, state.logical_axes())


def release_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """`state` with the `rows` (bool [B]) marked done: steps no longer commit for them (their slots are free)."""
    return constrain_tree(state.replace(done=state.done | rows), state.logical_axes())


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _step_with_output_jit(graph, params, spec, state):
    return step_with_output(graph.merge(params), spec, state)


_insert_jit = jax.jit(insert_row, donate_argnames=("state",))
_release_jit = jax.jit(release_rows, donate_argnames=("state",))


@functools.partial(jax.jit, static_argnames=("graph", "spec", "final"), donate_argnames=("state",))
def _prefill_jit(graph, params, spec, state, padded_prompts, start=None, final=True):
    return prefill(graph.merge(params), spec, state, padded_prompts, start, final=final)


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _step_jit(graph, params, spec, state):
    return step(graph.merge(params), spec, state)


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _run_jit(graph, params, spec, state):
    return run(graph.merge(params), spec, state)


# ----------------------------------------------------------------------------------------------
# The public step API


class DecodeEngine:
    """Plain or speculative decoding of one model, step by step, jitted (the public step API).

    `speculative`: a `SpeculativeConfig`, or None for plain decoding. The model's weights are read
    once, here: build a new engine after changing them. Every call that takes a state donates it
    (its buffers are reused; do not read a state after passing it in).

    `mesh` (`mtp_jax.sharding.make_mesh`): the weights are placed on it by their logical axes, the
    states `init_state` builds by `DecodeState.logical_axes` (rows over `data` x `fsdp`: the batch
    must be a multiple of their product, else ValueError), and every jitted call runs under it
    (GSPMD; the step keeps the state's placement, so nothing recompiles). With `jax.distributed`,
    every process builds the same engine and state, and owns its devices' shards.

        engine = DecodeEngine(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
        state, padded = engine.init_state(prompts, max_new_tokens=64)
        state = engine.prefill(state, padded)
        state = engine.step(state)   # or engine.run(state): every step until all rows are done
        result = engine.result(state, seconds=0.0)

    Raises ValueError at construction when the model cannot serve `speculative`.
    """

    def __init__(self, model: Transformer, speculative: SpeculativeConfig | None = None, *, mesh: Mesh | None = None):
        if speculative is not None:
            speculative.check_model(model, model.config.vocab_size)
        self.model, self.speculative, self.mesh = model, speculative, mesh
        self._graph, self._params = static_split(model)
        if mesh is not None:
            self._params = shard_params(self._params, mesh)

    def _on_mesh(self):
        return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

    def init_state(self, prompts: Sequence[Sequence[int]], **request) -> tuple[DecodeState, jax.Array]:
        """The initial state and padded prompts (int32 [B, P]), placed on the engine's mesh if any;
        keyword arguments as `init_state`'s (max_new_tokens, sampling, max_length, stop_tokens,
        oracle_tokens)."""
        state, padded = init_state(self.model, prompts, speculative=self.speculative, **request)
        if self.mesh is not None:
            state = place(state, named_shardings(state, state.logical_axes(), self.mesh))
            padded = place(padded, named_shardings(padded, P("batch", None), self.mesh))
        return state, padded

    def prefill(self, state: DecodeState, padded_prompts: jax.Array, start: jax.Array | None = None, *,
                final: bool = True) -> DecodeState:
        """The prompts through the model, the first token committed, the first drafts made; or one
        chunk of them at positions `start` .. (int32 [B]; see `prefill`)."""
        with self._on_mesh():
            return _prefill_jit(self._graph, self._params, self.speculative, state, padded_prompts, start, final=final)

    def step(self, state: DecodeState) -> DecodeState:
        """One decode step for every row (`step`)."""
        with self._on_mesh():
            return _step_jit(self._graph, self._params, self.speculative, state)

    def run(self, state: DecodeState) -> DecodeState:
        """Steps until every row is done, as one `lax.while_loop` on device."""
        with self._on_mesh():
            return _run_jit(self._graph, self._params, self.speculative, state)

    def step_with_output(self, state: DecodeState) -> tuple[DecodeState, StepOutput]:
        """One decode step and what each row committed (`step_with_output`)."""
        with self._on_mesh():
            return _step_with_output_jit(self._graph, self._params, self.speculative, state)

    def insert(self, state: DecodeState, rows: DecodeState, slot: int) -> DecodeState:
        """Row 0 of `rows` into row `slot` of `state` (`insert_row`; `rows` is not donated)."""
        with self._on_mesh():
            return _insert_jit(state, rows, jnp.int32(slot))

    def release(self, state: DecodeState, rows: np.ndarray) -> DecodeState:
        """`state` with `rows` (bool [B]) done (`release_rows`)."""
        with self._on_mesh():
            return _release_jit(state, jnp.asarray(rows, bool))

    def lower_run(self, state: DecodeState) -> jax.stages.Lowered:
        """`run` lowered for this state's shapes (`.compile().as_text()` is the HLO a profile reads)."""
        with self._on_mesh():
            return _run_jit.lower(self._graph, self._params, self.speculative, state)

    def result(self, state: DecodeState, seconds: float) -> GenerationResult:
        """The host-side view of a state (`seconds`: the wall time to report)."""
        return results_from_state(state, seconds, speculating=self.speculative is not None)


def _finish_reason(row_tokens: np.ndarray, length: int, prompt_length: int, max_new: int, capacity: int,
                   stop: set[int]) -> str:
    if length > prompt_length and int(row_tokens[length - 1]) in stop:
        return "stop"
    if length - prompt_length >= max_new:
        return "length"
    return "capacity" if length >= capacity else "length"


def results_from_state(state: DecodeState, seconds: float, *, speculating: bool) -> GenerationResult:
    """Host-side view of a state; `num_steps` counts the decode (verify) steps, metrics only when speculating."""
    tokens, lengths, prompt_lengths, logprobs, max_new, stop, steps = to_host(
        (state.tokens, state.lengths, state.prompt_lengths, state.logprobs, state.max_new_tokens, state.stop_tokens,
         state.metrics.num_steps))
    capacity = tokens.shape[1]
    rows = range(tokens.shape[0])
    return GenerationResult(
        tokens=[tokens[b, prompt_lengths[b]: lengths[b]].tolist() for b in rows],
        logprobs=[logprobs[b, prompt_lengths[b]: lengths[b]].tolist() for b in rows],
        finish_reasons=[_finish_reason(tokens[b], int(lengths[b]), int(prompt_lengths[b]), int(max_new[b]),
                                       capacity, {int(t) for t in stop[b] if t >= 0}) for b in rows],
        num_steps=int(steps.max()), seconds=seconds,
        metrics=SpeculativeMetrics.from_counters(to_host(state.metrics)) if speculating else None)
