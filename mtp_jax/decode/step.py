"""The decode step in verbs that each read on their own: plain and speculative decoding alike (plain
decoding is speculation with no drafter, K = 0).

A step, for every unfinished row (`docs/MTP_SPEC.md`):

- **verify** (`verify`): feed `[t_{L-1}, d_1, ..., d_K]` at positions `L-1 .. L-1+K` through the main
  model in one forward; output j is the target distribution p_j for position L + j, normalised
  once (`acceptance.Target`).
- **accept** (`acceptance.accept`): the accepted prefix of the drafts and the token after it.
- **commit** (`commit`): append them, cut at the first stop token, `max_new_tokens` and the capacity.
  Committing advances `lengths`, the only length there is; that is also the **roll back**: caches
  keep no lengths, every cache of a row holds the positions before its last committed token, and
  what a verify pass wrote for rejected drafts lies past that, stale, masked out and overwritten
  later. A recurrent layer's state (Qwen3.5's Gated DeltaNet) cannot be rolled back by a length: verify
  keeps its state after each of the K+1 tokens and the commit selects, per row, the one after its last
  committed token (`mtp_jax.cache.settle`).
- **draft** (`drafters.draft_after_verify`): the next K drafts (none when not speculating).

`prefill` starts a state (its first token through `commit_first_token`), `decode_step` advances it,
`run` loops it on device; `step_with_output`, `insert_row` and `release_rows` serve continuous
batching (`mtp_jax.serving`). All are traceable; `mtp_jax.decode.engine` jits them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.cache import KVCache, bind_pages, settle, share_pools, without_pools, write_at
from mtp_jax.decode.acceptance import Target, accept, update_phase
from mtp_jax.decode.drafters import DraftState, draft_after_prefill, draft_after_verify
from mtp_jax.decode.sampling import SamplingMetadata
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.decode.state import DecodeState
from mtp_jax.layers.indexing import sequence_positions, take_rows
from mtp_jax.model import Transformer
from mtp_jax.mtp import initial_hidden
from mtp_jax.sharding import constrain_tree


@jax.named_scope("verify_forward")  # named scopes: `benchmarks/profile_step.py` groups time by them
def verify(
    model: Transformer,
    state: DecodeState,
    metadata: SamplingMetadata,
    num_drafts: int | None = None,
    token_bitmask: jax.Array | None = None,
) -> tuple[Target, jax.Array, tuple[KVCache, ...]]:
    """The main model over `[t_{L-1}, d_1 .. d_k]` at positions L-1 .. L-1+k (int32 [B, k+1]), k = `num_drafts`
    (static, default all K drafts); target j's logits are processed with the history `metadata` and d_1 .. d_j,
    and masked by `token_bitmask[:, j]` (int32 [B, >= k+1, W], structured output; None: no mask).

    Returns the K+1 targets, h^0 [B, K+1, E] for the drafter (`mtp.initial_hidden`; the final norm
    runs once for it and the logits) and the main cache with the K+1 entries written (a finished
    row's writes land past its length, stale), its recurrent layers' states as candidates for `commit`.
    """
    last = take_rows(state.tokens, jnp.maximum(state.lengths - 1, 0))  # t_{L-1}, [B, 1]
    window = jnp.concatenate([last, state.draft.tokens[:, :num_drafts]], axis=1)  # [B, k+1]
    positions = sequence_positions(*window.shape, state.lengths - 1)
    _, hidden, cache = model(window, positions, state.cache, with_logits=False, keep_candidates=True)
    normed = model.norm(hidden)
    mask = None if token_bitmask is None else token_bitmask[:, : window.shape[1]]
    target = Target.from_logits(model.head(normed), metadata, window[:, 1:], mask)
    return target, initial_hidden(model, hidden, normed), cache


@jax.named_scope("commit")
def commit(
    state: DecodeState, candidates: jax.Array, num_candidates: jax.Array, candidate_logprobs: jax.Array
) -> tuple[DecodeState, jax.Array]:
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
    done = (
        state.done
        | jnp.any(is_stop & taken, axis=-1)
        | (lengths - state.prompt_lengths >= state.max_new_tokens)
        | (lengths >= capacity)
    )
    return state.replace(tokens=tokens, logprobs=logprobs, lengths=lengths, done=done), num


def accept_and_commit(
    speculative: SpeculativeConfig | None,
    state: DecodeState,
    target: Target,
    drafts: jax.Array,
    draft_probs: jax.Array,
    top_logprobs: bool = True,
) -> tuple[DecodeState, jax.Array, jax.Array]:
    """Accepts `drafts` (int32 [B, K], their q in `draft_probs`) against `target` (K+1 outputs), commits
    the accepted ones and the emitted token (and, if `top_logprobs`, keeps the most likely tokens at their
    positions: `keep_top_logprobs`). Returns the state and, per row (int32 [B]), the tokens committed and
    the drafts accepted."""
    num_accepted, token = accept(
        speculative, target, drafts, draft_probs, state.sampling, state.lengths, state.thinking
    )
    index = jnp.arange(drafts.shape[1] + 1)[None, :]
    candidates = jnp.where(
        index < num_accepted[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), token[:, None]
    )  # [B, K+1]: accepted drafts, then the emitted token
    new, num = commit(state, candidates, num_accepted + 1, target.logprobs_at(candidates))
    if top_logprobs:
        new = keep_top_logprobs(new, target)
    return new.replace(thinking=update_phase(speculative, state.thinking, candidates, num)), num, num_accepted


def keep_top_logprobs(state: DecodeState, target: Target) -> DecodeState:
    """`state` with the N most likely tokens of each of `target`'s T outputs (the positions a call committed,
    T <= K+1) in `top_logprobs` / `top_tokens` [B, K+1, N]; nothing computed when N = 0."""
    width, n = state.top_logprobs.shape[1:]
    if n == 0:
        return state
    values, ids = jax.lax.top_k(target.log_softmax(), n)  # [B, T, N], descending
    pad = ((0, 0), (0, width - values.shape[1]), (0, 0))
    return state.replace(top_logprobs=jnp.pad(values, pad), top_tokens=jnp.pad(ids.astype(jnp.int32), pad))


def commit_first_token(speculative: SpeculativeConfig | None, state: DecodeState, target: Target) -> DecodeState:
    """The prefill's token at position L: accepted and committed as a step with no drafts (K = 0) would,
    from the prefill's target (one output, [B, 1, V]); the drafter's state is untouched."""
    no_drafts = state.draft.tokens[:, :0], state.draft.probs[:, :0]  # [B, 0], [B, 0, V or 0]
    return accept_and_commit(speculative, state, target, *no_drafts)[0]


def prefill(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    state: DecodeState,
    padded_prompts: jax.Array,
    start: jax.Array | None = None,
    token_bitmask: jax.Array | None = None,
    *,
    final: bool = True,
) -> DecodeState:
    """Prompts int32 [B, C] (right-padded) through the main model, the first token committed (as a
    step with no drafts commits it; masked by `token_bitmask[:, 0]`, int32 [B, >= 1, W], if given), the
    first drafts made. Not a step: the metrics count none.

    Chunked prefill (`mtp_jax.serving`): `start` (int32 [B]) puts the chunk at positions start ..
    start + C - 1 of prompts already prefilled before `start`. A `final` chunk holds each prompt's
    last token (start <= prompt_lengths - 1 < start + C) and commits as above; an earlier chunk
    (`final=False`, static; start + C < prompt_lengths) only fills the caches, the MTP modules'
    included (`drafters.draft_after_prefill`), and commits nothing.
    """
    offset = jnp.zeros_like(state.lengths) if start is None else start
    positions = sequence_positions(*padded_prompts.shape, offset)  # padding past a prompt is stale from the start
    # Recurrent states absorb each row's prompt tokens only, not the padding after them.
    advance = jnp.clip(state.prompt_lengths - offset, 0, padded_prompts.shape[1])
    history = sampling_metadata(model, state)
    if final:
        logits, hidden, cache = model(
            padded_prompts, positions, state.cache, logits_at=state.prompt_lengths - 1 - offset, advance=advance
        )
        mask = None if token_bitmask is None else token_bitmask[:, :1]
        target = Target.from_logits(logits, history, None, mask)  # [B, 1, V]: the target at position L
        before = state.lengths
        state = commit_first_token(speculative, state.replace(cache=cache), target)
        lengths = state.lengths
        history = history.after(state.tokens, before, lengths - before, 1)
    else:
        _, hidden, cache = model(padded_prompts, positions, state.cache, with_logits=False, advance=advance)
        state = state.replace(cache=cache)
        lengths = offset + padded_prompts.shape[1] + 1  # as if the chunk's next token were committed too
    state = state.replace(
        draft=draft_after_prefill(
            model,
            speculative,
            history,
            state.tokens,
            state.draft,
            initial_hidden(model, hidden),
            lengths,
            start,
        )
    )
    return constrain_tree(state, state.logical_axes())  # on a mesh: the state keeps its placement


def decode_step(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    state: DecodeState,
    num_drafts: int | None = None,
    draft_next: bool = True,
    top_logprobs: bool = True,
    token_bitmask: jax.Array | None = None,
    drafts: jax.Array | None = None,
) -> DecodeState:
    """One verify-accept-commit-draft step for every row (finished rows change nothing).

    `num_drafts` (static, 0 .. K, default K): verify only the first k of the K drafts (adaptive speculation,
    `mtp_jax.serving.speculation`; k = 0 is a plain step). The drafter still drafts K for the next step, so
    its caches hold every committed position whatever k a step uses. `draft_next=False` (static, with k = 0
    only): the MTP modules only write their caches (`drafters.fill_caches`), no draft head, no chain; the
    drafts left in the state are stale, so a step that drafts must come before the next one that verifies.
    `top_logprobs=False` (static): `DecodeState.top_logprobs` is left as it was (stale; serving skips the
    top-N when no running request asked for it). `token_bitmask` (int32 [B, K+1, ceil(V / 32)]): the tokens a
    grammar allows at each verify position (structured output; `verify`), None: all. `drafts` (int32 [B, K]):
    drafts the host proposes instead of the drafter's where >= 0 (a grammar's forced tokens), verified as
    drafts with a one-hot q, a deterministic proposal: lossless."""
    if not draft_next and num_drafts != 0:
        raise ValueError(f"draft_next=False needs num_drafts=0 (stale drafts cannot be verified), got {num_drafts!r}")
    if drafts is not None:
        state = state.replace(draft=replace_drafts(state.draft, drafts))
    k = state.draft.tokens.shape[1] if num_drafts is None else num_drafts
    history = sampling_metadata(model, state)
    target, h0, cache = verify(model, state, history, k, token_bitmask)  # h0: [B, k+1, E] at L-1 .. L-1+k
    before = state
    state, num, num_accepted = accept_and_commit(
        speculative,
        state.replace(cache=cache),
        target,
        state.draft.tokens[:, :k],
        state.draft.probs[:, :k],
        top_logprobs,
    )
    state = state.replace(cache=settle(state.cache, num))  # recurrent states: after the last committed token
    state = state.replace(metrics=state.metrics.count_step(~before.done, jnp.minimum(num_accepted, num), k))
    state = state.replace(
        draft=draft_after_verify(
            model,
            speculative,
            history.after(state.tokens, before.lengths, num, k + 1),
            state.tokens,
            state.draft,
            h0,
            before.lengths,
            num,
            drafts=draft_next,
        )
    )
    return constrain_tree(state, state.logical_axes())  # on a mesh: the state keeps its placement


def replace_drafts(draft: DraftState, drafts: jax.Array) -> DraftState:
    """`draft` with its tokens replaced where `drafts` (int32 [B, K]) is >= 0, their q one-hot (sampled drafts)."""
    replaced = drafts >= 0
    probs = draft.probs
    if probs.shape[-1]:
        probs = jnp.where(replaced[..., None], jax.nn.one_hot(drafts, probs.shape[-1], dtype=probs.dtype), probs)
    return draft.replace(tokens=jnp.where(replaced, drafts, draft.tokens), probs=probs)


def sampling_metadata(model: Transformer, state: DecodeState) -> SamplingMetadata:
    """The rows' `SamplingMetadata` at a step boundary: their parameters, stop tokens and committed tokens."""
    return SamplingMetadata.build(
        state.sampling,
        model.config.vocab_size,
        state.tokens,
        state.output_start,
        state.lengths,
        state.stop_tokens,
    )


def prompt_logprobs(model: Transformer, tokens: jax.Array, num: int) -> tuple[jax.Array, ...]:
    """Each token of `tokens` (int32 [1, T]) after the first: its raw logprob given the tokens before it
    (float32 [T - 1]), its rank there (int32 [T - 1], 1 = the most likely) and the `num` (static) most likely
    tokens there (int32 ids and float32 logprobs [T - 1, num]); one forward from position 0, no cache kept."""
    logits = model.forward_full(tokens)[0][0, :-1].astype(jnp.float32)  # [T - 1, V]: predicting tokens 1 ..
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[0, 1:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num)
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


def run(model: Transformer, speculative: SpeculativeConfig | None, state: DecodeState) -> DecodeState:
    """`decode_step` until every row is done, as one `lax.while_loop` (traceable: jit it, or pmap it)."""
    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), lambda s: decode_step(model, speculative, s), state)


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
    top_logprobs: jax.Array  # float32 [B, K+1, N]: the N most likely tokens at each committed position
    top_tokens: jax.Array  # int32 [B, K+1, N] (`DecodeState.top_logprobs`; N = 0 unless asked for)
    drafts: jax.Array  # int32 [B, K]: the drafts the next step verifies (stale after `draft_next=False`)


def step_with_output(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    state: DecodeState,
    block_table: jax.Array | None = None,
    num_drafts: int | None = None,
    draft_next: bool = True,
    top_logprobs: bool = True,
    token_bitmask: jax.Array | None = None,
    drafts: jax.Array | None = None,
) -> tuple[DecodeState, StepOutput]:
    """`decode_step` (verifying `num_drafts` drafts; drafting the next unless `draft_next` is False), and what
    it committed (`StepOutput`), gathered on device so the host reads [B, K+1].

    A paged state (`mtp_jax.cache.PagedCache`) runs with `block_table` (int32 [B, W]) bound: every running row
    must own pages for positions up to L + K (W pages of P positions: what the attention reads)."""
    stepped = decode_step(
        model, speculative, with_pages(state, block_table), num_drafts, draft_next, top_logprobs, token_bitmask, drafts
    )
    new = with_pages(stepped, None)
    positions = jnp.minimum(
        state.lengths[:, None] + jnp.arange(state.draft.tokens.shape[1] + 1)[None, :], state.tokens.shape[1] - 1
    )  # [B, K+1]
    return new, StepOutput(
        num_committed=new.lengths - state.lengths,
        tokens=jnp.take_along_axis(new.tokens, positions, axis=1),
        logprobs=jnp.take_along_axis(new.logprobs, positions, axis=1),
        num_accepted=new.metrics.num_accepted - state.metrics.num_accepted,
        done=new.done,
        top_logprobs=new.top_logprobs,
        top_tokens=new.top_tokens,
        drafts=new.draft.tokens,
    )


def with_pages(state: DecodeState, block_table: jax.Array | None) -> DecodeState:
    """`state` with its paged caches, main and MTP, bound to `block_table` (int32 [B, W]; None: unbound)."""
    return state.replace(
        cache=bind_pages(state.cache, block_table),
        draft=state.draft.replace(caches=bind_pages(state.draft.caches, block_table)),
    )


def _pools_from(rows: DecodeState, state: DecodeState) -> DecodeState:
    """`rows` with its paged caches' pools taken from `state` (`mtp_jax.cache.share_pools`)."""
    return rows.replace(
        cache=share_pools(rows.cache, state.cache),
        draft=rows.draft.replace(caches=share_pools(rows.draft.caches, state.draft.caches)),
    )


def prefill_rows(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    state: DecodeState,
    rows: DecodeState,
    padded_prompts: jax.Array,
    start: jax.Array,
    block_table: jax.Array,
    token_bitmask: jax.Array | None = None,
    *,
    final: bool,
) -> tuple[DecodeState, DecodeState]:
    """`prefill` of a paged row state `rows` (built without pools, `PageLayout(pools=False)`) into the pages
    `block_table` (int32 [R, W]) gives its rows in the pools of the engine's state `state`: the serving
    engine's prefill, whose KV lands where the row's decode steps read it (no copy at `insert_row`).
    Returns both states (`rows` again without pools)."""
    rows = with_pages(_pools_from(rows, state), block_table)
    rows = with_pages(prefill(model, speculative, rows, padded_prompts, start, token_bitmask, final=final), None)
    state = _pools_from(state, rows)
    return state, rows.replace(
        cache=without_pools(rows.cache), draft=rows.draft.replace(caches=without_pools(rows.draft.caches))
    )


def insert_row(state: DecodeState, rows: DecodeState, slot: jax.Array) -> DecodeState:
    """`state` with row `slot` (an int32 scalar, traced) replaced by row 0 of `rows` (a state of the
    same capacity and drafter, any batch size): how a prefilled request enters a running batch. Paged
    caches' pools stay `state`'s (the row's KV is already in its pages, `prefill_rows`)."""
    rows = _pools_from(rows, state)

    def put(x, new, pspec):
        if "batch" not in pspec:  # a page pool: no row of it to copy
            return x
        axis = list(pspec).index("batch")
        row = jax.lax.slice_in_dim(new, 0, 1, axis=axis).astype(x.dtype)
        return jax.lax.dynamic_update_slice_in_dim(x, row, slot, axis)

    state = jax.tree.map(put, state, rows, state.logical_axes())
    return constrain_tree(state, state.logical_axes())


def release_rows(state: DecodeState, rows: jax.Array) -> DecodeState:
    """`state` with the `rows` (bool [B]) marked done: steps no longer commit for them (their slots are free)."""
    return constrain_tree(state.replace(done=state.done | rows), state.logical_axes())
