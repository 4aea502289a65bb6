"""The drafters of MTP speculative decoding: one function per method, each proposing K tokens.

The design of TensorRT-LLM's MTP (its tech blog "DeepSeek R1 MTP Implementation and Optimization")
with the semantics of `docs/MTP_SPEC.md`. The step that verifies, accepts and commits the drafts is
`mtp_jax.decode.step`; `SpeculativeConfig.method` picks the drafter here:

- `draft_eagle`: module 1 reused K times over one cache: one pass over the window, then K - 1
  one-token passes chaining its own hidden state (the TRT-LLM "MTP Eagle" path);
- `draft_vanilla`: modules 1..K in turn, each with its own cache, each over a window of the last 2K
  positions (TRT-LLM's "MTP Vanilla", which re-runs a window of past tokens and hidden states
  because module k's entries for the last k - 1 positions were computed from drafts);
- `draft_parallel`: Gloeckle et al. heads 1..K, each over the main hidden states only;
- `draft_oracle` (benchmarks): the tokens given in advance, e.g. the plain greedy output.

Every drafter takes the same arguments (`draft` documents them) and returns the new `DraftState`.
State at a step boundary: L_b committed tokens; every MTP cache holds positions 0 .. L_b - 2 (as
the main cache does); `DraftState.tokens` holds the K drafts for positions L_b .. L_b + K - 1.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import KVCache, PageLayout, init_cache, write_at
from mtp_jax.decode.draft_vocab import draft_head
from mtp_jax.decode.sampling import STREAM_DRAFT, SamplingMetadata, process_logits, sample_from, target_probs
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.indexing import take_rows
from mtp_jax.model import Transformer
from mtp_jax.sharding import argmax_last


@struct.dataclass
class DraftState:
    """What the drafter carries between steps (B rows, K drafts; empty arrays when not speculating)."""

    tokens: jax.Array  # int32 [B, K]: drafts for positions L .. L + K - 1
    probs: jax.Array  # float32 [B, K, V] (draft_sampling="sample") or [B, K, 0]: q
    caches: tuple[KVCache, ...]  # the MTP modules' caches (`SpeculativeConfig.num_caches`)
    hidden_window: jax.Array  # [B, W, E]: h^0 at positions L-1-W .. L-2 (vanilla), W = 0 otherwise
    oracle_tokens: jax.Array  # int32 [B, R]: the sequences the oracle replays (otherwise [B, 1], unused)


def init_draft_state(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    batch_size: int,
    max_length: int,
    oracle_tokens: np.ndarray | None = None,
    pages: PageLayout | None = None,
) -> DraftState:
    """The drafter's empty state for B rows of capacity S (`speculative` None: no drafts, K = 0), its caches
    paged with `pages`.

    `oracle_tokens`: int [B, R] for method "oracle" (row b's full sequence, prompt first; positions
    past R draft token 0), required there and refused elsewhere (ValueError).
    """
    config = model.config
    k_max = 0 if speculative is None else speculative.num_speculative_tokens
    oracle = speculative is not None and speculative.method == "oracle"
    if oracle != (oracle_tokens is not None):
        raise ValueError("oracle_tokens is required with method='oracle' and only there")
    if oracle:
        oracle_tokens = np.asarray(oracle_tokens)
        if (
            oracle_tokens.ndim != 2
            or oracle_tokens.shape[0] != batch_size
            or not np.issubdtype(oracle_tokens.dtype, np.integer)
        ):
            raise ValueError(
                f"oracle_tokens must be an int array [B={batch_size}, R], got shape "
                f"{oracle_tokens.shape} and dtype {oracle_tokens.dtype}"
            )
    vocab = config.vocab_size if speculative is not None and speculative.draft_sampling == "sample" else 0
    window = 0 if speculative is None else speculative.hidden_window
    host = dict(
        tokens=np.zeros((batch_size, k_max), np.int32),
        probs=np.zeros((batch_size, k_max, vocab), np.float32),
        hidden_window=np.zeros((batch_size, window, config.hidden_size), config.compute_dtype),
        oracle_tokens=np.asarray(oracle_tokens if oracle else np.zeros((batch_size, 1)), np.int32),
    )
    return DraftState(
        **jax.device_put(host),  # (jnp.zeros would compile a small program per array)
        caches=()
        if speculative is None
        else tuple(
            init_cache(model.mtp[j].init_cache, batch_size, max_length, pages) for j in range(speculative.num_caches)
        ),
    )
    # (not [B, 0]: on a mesh jitted calls return that empty array with varying specs, and recompile)


def _pick_draft(
    speculative: SpeculativeConfig,
    logits: jax.Array,
    metadata: SamplingMetadata,
    positions: jax.Array,
    ahead: jax.Array | None = None,
    j: int | jax.Array = 0,
) -> tuple[jax.Array, jax.Array]:
    """A draft token per row from MTP logits [B, V] for `positions` (draft j of the chain, after `ahead[:, :j]`,
    int32 [B, A]), and q ([B, V], or [B, 0] if greedy). The logits are processed as the target's are (logit
    bias, min_tokens, penalties, the chain's earlier drafts counted): drafts the target could not take would
    only be rejected."""
    logits = process_logits(logits[:, None], metadata, ahead, j)[:, 0]
    if speculative.draft_vocab is not None:  # every token of the set masked (e.g. min_tokens, all stop tokens):
        dead = jnp.all(logits == -jnp.inf, axis=-1, keepdims=True)  # draft the set's first (q one-hot: exact)
        first = jnp.arange(logits.shape[-1]) == speculative.draft_vocab[0]
        logits = jnp.where(dead, jnp.where(first, 0.0, -jnp.inf), logits)
    sampling = metadata.sampling
    if speculative.draft_sampling == "greedy":  # on a mesh: a per-device max over the vocabulary shards, combined
        return argmax_last(logits, P("batch", "vocab")), jnp.zeros((logits.shape[0], 0), jnp.float32)
    q = target_probs(logits, sampling)
    return sample_from(q, logits, sampling, positions, STREAM_DRAFT), q


def _so_far(drafts: list[jax.Array]) -> jax.Array | None:
    """The drafts an unrolled chain made so far (each int32 [B]) as int32 [B, j], None before the first."""
    return jnp.stack(drafts, axis=1) if drafts else None


def _window(hidden: jax.Array, start: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The absolute positions int32 [B, W] of a window of W hidden states starting at `start` (int32
    [B]), and the index in it of position L - 2 (int32 [B]), whose logits draft position L."""
    positions = start[:, None] + jnp.arange(hidden.shape[1])[None, :]
    return positions, lengths - 2 - start


def _tokens_at(tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """`tokens` (int32 [B, S]) at `positions` (int32 [B, T]), clamped into the buffer."""
    return jnp.take_along_axis(tokens, jnp.clip(positions, 0, tokens.shape[1] - 1), axis=1)


def draft_oracle(
    model: Transformer,
    speculative: SpeculativeConfig,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """Drafts the oracle's tokens at positions L .. L + K - 1 (token 0 past its end); runs no module."""
    positions = lengths[:, None] + jnp.arange(speculative.num_speculative_tokens)[None, :]  # [B, K]
    reference = jnp.pad(state.oracle_tokens, ((0, 0), (0, speculative.num_speculative_tokens)))  # past R: token 0
    return state.replace(tokens=_tokens_at(reference, positions))


def draft_eagle(
    model: Transformer,
    speculative: SpeculativeConfig,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """MTP Eagle: module 1 over the window drafts position L; then K - 1 one-token passes of the same
    module, each over its own last hidden state and the token it just drafted, draft L + 1 .. L + K - 1."""
    k_max, module = speculative.num_speculative_tokens, model.mtp[0]
    call = dict(embed=model.embed, head=draft_head(model, speculative))
    window, last = _window(hidden, start, lengths)
    logits, chained, cache = module(
        hidden, _tokens_at(tokens, window + 1), window, state.caches[0], logits_at=last, **call
    )
    token, q = _pick_draft(speculative, logits[:, 0], metadata, lengths)
    drafts = jnp.zeros((token.shape[0], k_max), token.dtype).at[:, 0].set(token)  # [B, K]
    probs = jnp.zeros((q.shape[0], k_max, q.shape[1]), q.dtype).at[:, 0].set(q)  # [B, K, V] or [B, K, 0]

    def chain(j, carry):  # draft j: one more pass at position L - 2 + j, chaining the module's own hidden
        drafts, probs, token, chained, cache = carry
        logits, chained, cache = module(chained, token[:, None], (lengths - 2 + j)[:, None], cache, **call)
        token, q = _pick_draft(speculative, logits[:, 0], metadata, lengths + j, drafts, j)
        return drafts.at[:, j].set(token), probs.at[:, j].set(q), token, chained, cache

    # a loop, not K - 1 unrolled copies of the module: compile time stays flat in K
    carry = (drafts, probs, token, take_rows(chained, last), cache)  # chained: [B, 1, E] at position L - 2
    drafts, probs, _, _, cache = jax.lax.fori_loop(1, k_max, chain, carry)
    return state.replace(tokens=drafts, probs=probs, caches=(cache,))


def draft_vanilla(
    model: Transformer,
    speculative: SpeculativeConfig,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """MTP Vanilla: module k = 1..K over the window, each reading the hidden states module k - 1 wrote
    (h^0 for k = 1) and the tokens k positions ahead, drafts included; module k drafts position L + k - 1."""
    window, last = _window(hidden, start, lengths)
    drafts, probs, caches = [], [], []
    for j in range(speculative.num_speculative_tokens):  # D distinct modules: unrolled
        # module j + 1 at position i reads t_{i+j+1}, a draft where i + j + 1 >= L
        logits, hidden, cache = model.mtp[j](
            hidden,
            _tokens_at(tokens, window + j + 1),
            window,
            state.caches[j],
            logits_at=last,
            embed=model.embed,
            head=draft_head(model, speculative),
        )
        token, q = _pick_draft(speculative, logits[:, 0], metadata, lengths + j, _so_far(drafts), j)
        tokens = write_at(tokens, token[:, None], (lengths + j)[:, None])  # the next module reads it
        drafts.append(token)
        probs.append(q)
        caches.append(cache)
    return state.replace(tokens=jnp.stack(drafts, axis=1), probs=jnp.stack(probs, axis=1), caches=tuple(caches))


def draft_parallel(
    model: Transformer,
    speculative: SpeculativeConfig,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """Gloeckle et al.'s heads: head k = 1..K over the main model's h^0 alone drafts position L + k - 1."""
    window, last = _window(hidden, start, lengths)
    drafts, probs, caches = [], [], []
    head = draft_head(model, speculative)
    for j in range(speculative.num_speculative_tokens):
        logits, _, cache = model.mtp[j](
            hidden, window, window, state.caches[j], logits_at=last, embed=model.embed, head=head
        )  # (the heads read no tokens)
        token, q = _pick_draft(speculative, logits[:, 0], metadata, lengths + j, _so_far(drafts), j)
        drafts.append(token)
        probs.append(q)
        caches.append(cache)
    return state.replace(tokens=jnp.stack(drafts, axis=1), probs=jnp.stack(probs, axis=1), caches=tuple(caches))


Drafter = Callable[..., DraftState]
DRAFTERS: dict[str, Drafter] = {
    "eagle": draft_eagle,
    "vanilla": draft_vanilla,
    "parallel": draft_parallel,
    "oracle": draft_oracle,
}


@jax.named_scope("draft")
def draft(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """Drafts K tokens per row with the drafter of `speculative.method` (`speculative` None: none).

    Args:
      tokens: int32 [B, S], committed tokens (`lengths` of them per row).
      state: the drafter's state; its caches' entries before `start` are final.
      hidden: h^0 (after `initial_hidden`) of shape [B, W, E] at positions `start .. start + W - 1`,
        covering position `lengths - 2` (the last one with a committed next token).
      start: int32 [B], position of hidden[:, 0] (may be negative: such positions are ignored).
      lengths: int32 [B], committed tokens L.

    Returns:
      The state with `tokens` int32 [B, K] for positions L .. L+K-1, `probs` ([B, K, V] or [B, K, 0])
      and the caches with the window and draft passes written (live: positions 0 .. L - 2).
    """
    if speculative is None:
        return state
    return DRAFTERS[speculative.method](model, speculative, metadata, tokens, state, hidden, start, lengths)


def fill_caches(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    hidden: jax.Array,
    start: jax.Array,
    lengths: jax.Array,
) -> DraftState:
    """`draft` without the drafts: the modules' passes over the window only (no draft head, no eagle chain),
    so every cache entry `draft` makes final (positions up to L - 2) is written, the same, and the state's
    drafts stay those of an earlier step (stale: a step that drafts must come before one that verifies them).
    Adaptive speculation's plain step (`decode_step(draft_next=False)`). Same arguments as `draft`."""
    if speculative is None or speculative.method == "oracle":
        return state
    window, last = _window(hidden, start, lengths)
    caches = []
    for j in range(speculative.num_caches):  # eagle: module 1 once; vanilla: modules 1..K chained; parallel
        inputs = window if speculative.method == "parallel" else _tokens_at(tokens, window + j + 1)
        _, chained, cache = model.mtp[j](
            hidden, inputs, window, state.caches[j], logits_at=last, embed=model.embed, head=model.head
        )  # (the logits are unused: XLA drops the head)
        if speculative.method == "vanilla":
            hidden = chained
        caches.append(cache)
    return state.replace(caches=tuple(caches))


def _last_hidden(h0: jax.Array, first: jax.Array, lengths: jax.Array, width: int) -> jax.Array:
    """Vanilla's window slid to the committed lengths: h^0 at positions L - 1 - W .. L - 2 ([B, W, E])
    out of `h0` [B, T, E], whose column 0 sits at position `first` (int32 [B]); L = `lengths` (int32
    [B]). Positions before `first` (a prompt shorter than W) are clamped: no drafter reads them."""
    index = (lengths - 1 - width - first)[:, None] + jnp.arange(width)[None, :]  # [B, W]
    return jnp.take_along_axis(h0, jnp.clip(index, 0, h0.shape[1] - 1)[..., None], axis=1)


def draft_after_prefill(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    h0: jax.Array,
    lengths: jax.Array,
    start: jax.Array | None = None,
) -> DraftState:
    """The first drafts, from the prefill's h^0 [B, P, E] at positions 0 .. P - 1 (L committed tokens,
    int32 [B]); vanilla keeps h^0 at positions L-1-W .. L-2 for its next window.

    A chunk of a prompt prefilled in pieces: h^0 [B, C, E] at positions `start` .. start + C - 1
    (int32 [B]); the modules run over the chunk (vanilla: over its window of earlier h^0 and the
    chunk, re-running the positions whose entries the previous chunk computed from drafts). For a
    chunk before the last, `lengths` = start + C + 1, as if its next token were committed: its
    drafts are discarded, and what they wrote past the chunk is stale.
    """
    width = state.hidden_window.shape[1]
    if start is None:
        start = jnp.zeros_like(lengths)
    elif width:  # chunked vanilla: run over the kept window too (needs C >= K - 1: see `serving`)
        h0 = jnp.concatenate([state.hidden_window, h0.astype(state.hidden_window.dtype)], axis=1)
        start = start - width
    state = draft(model, speculative, metadata, tokens, state, h0, start, lengths)
    if width:
        state = state.replace(hidden_window=_last_hidden(h0, start, lengths, width).astype(state.hidden_window.dtype))
    return state


def draft_after_verify(
    model: Transformer,
    speculative: SpeculativeConfig | None,
    metadata: SamplingMetadata,
    tokens: jax.Array,
    state: DraftState,
    h0: jax.Array,
    lengths: jax.Array,
    num_committed: jax.Array,
    *,
    drafts: bool = True,
) -> DraftState:
    """The next drafts after a verify pass whose h^0 [B, k+1, E] sits at positions L-1 .. L-1+k, L the
    lengths before the step (int32 [B]) and `num_committed` (int32 [B]) the tokens the step committed.

    Eagle and parallel run over the verify window; vanilla slides its window of h^0 by the tokens
    committed, to end at position L' - 2, and runs over that. `drafts=False` (static): only the caches
    are written (`fill_caches`), the drafts stay stale.
    """
    run = draft if drafts else fill_caches
    width = state.hidden_window.shape[1]
    new_lengths = lengths + num_committed
    if not width:
        return run(model, speculative, metadata, tokens, state, h0, lengths - 1, new_lengths)
    joined = jnp.concatenate([state.hidden_window, h0.astype(state.hidden_window.dtype)], axis=1)  # [B, W+k+1, E]
    window = _last_hidden(joined, lengths - 1 - width, new_lengths, width)
    state = run(model, speculative, metadata, tokens, state, window, new_lengths - 1 - width, new_lengths)
    return state.replace(hidden_window=window)
