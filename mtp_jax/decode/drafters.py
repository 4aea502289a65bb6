"""The drafter of MTP speculative decoding: its configuration, its state, and `draft`.

The design of TensorRT-LLM's MTP (its tech blog "DeepSeek R1 MTP Implementation and Optimization")
with the semantics of `docs/MTP_SPEC.md`. The decode step that verifies, accepts and commits the
drafts is `mtp_jax.engine`'s; this module proposes them:

- `eagle`: module 1 reused K times over one cache: one pass over the verify window, then K - 1
  one-token passes chaining its own hidden state (the TRT-LLM "MTP Eagle" path);
- `vanilla`: modules 1..K in turn, each with its own cache, each over a window of the last 2K
  positions (TRT-LLM's "MTP Vanilla", which re-runs a window of past tokens and hidden states
  because module k's entries for the last k - 1 positions were computed from drafts);
- `parallel`: Gloeckle et al. heads 1..K, each over the main hidden states only;
- `oracle` (benchmarks): the tokens given in advance, e.g. the plain greedy output.

State at a step boundary: L_b committed tokens; every MTP cache holds positions 0 .. L_b - 2 (as
the main cache does); `DraftState.tokens` holds the K drafts for positions L_b .. L_b + K - 1.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from mtp_jax.cache import KVCache, write_at
from mtp_jax.decode.sampling import STREAM_DRAFT, SamplingState, is_int, is_real, sample_from, target_probs
from mtp_jax.layers.indexing import take_rows
from mtp_jax.model import Transformer
from mtp_jax.sharding import argmax_last

METHODS = ("vanilla", "eagle", "parallel", "oracle")
MAX_SPECULATIVE_TOKENS = 16  # the largest K a SpeculativeConfig accepts (see its docstring)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to speculate. Hashable: it is a static argument of the jitted step.

    method: "vanilla" (D distinct modules, K <= D), "eagle" (module 1 reused, any K),
      "parallel" (Gloeckle et al. heads, K <= D), or "oracle" (benchmarks: drafts replay the
      `oracle_tokens` given to `mtp_jax.decode.engine.init_state`, e.g. plain greedy output, so every
      draft is accepted; needs no MTP modules, greedy drafts only).
    num_speculative_tokens: K, drafts per step, an int in [1, MAX_SPECULATIVE_TOKENS = 16]. Every
      step verifies K + 1 tokens whatever is accepted, and draft j is kept only if drafts 1..j all
      are, so acceptance decays geometrically with j: with the per-position rates measured here
      (0.5-0.9) a 16th draft is almost never committed, while its cost (a wider verify forward,
      K MTP passes, draft_probs of [B, K, V]) is paid every step. The benchmarks use K <= 8.
    draft_sampling: "greedy" (drafts are the MTP argmax; q is one-hot) or "sample" (drafts drawn
      from the MTP distribution after the row's temperature/top-k/top-p; q is that distribution).
    relaxed_top_n, relaxed_delta: TensorRT-LLM's relaxed acceptance, on when relaxed_top_n > 0:
      in a row's thinking phase a draft is accepted if it is among the top-N target tokens and its
      probability is >= p(top1) - delta (softmax of the raw logits). Greedy rows only.
    think_start_token_id, think_end_token_id: the ids of `<think>` and `</think>`; required with
      relaxed acceptance (take them from the tokenizer; nothing is hard-coded).

    Integer fields take Python or NumPy ints (a bool is not an int). Raises TypeError for a field
    of the wrong type and ValueError for one out of range, naming the field.
    """

    method: str = "eagle"
    num_speculative_tokens: int = 3
    draft_sampling: str = "greedy"
    relaxed_top_n: int = 0
    relaxed_delta: float = 0.0
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "relaxed_top_n", "think_start_token_id", "think_end_token_id"):
            value = getattr(self, name)
            if value is None and name.startswith("think"):
                continue
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # NumPy ints become ints: the config is a static arg
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens!r}")
        if self.draft_sampling not in ("greedy", "sample"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {self.draft_sampling!r}")
        if self.relaxed_top_n < 0:
            raise ValueError(f"relaxed_top_n must be >= 0 (0 = relaxed acceptance off), got {self.relaxed_top_n}")
        if not is_real(self.relaxed_delta):
            raise TypeError(f"relaxed_delta must be a number, got {self.relaxed_delta!r}")
        if not (np.isfinite(self.relaxed_delta) and self.relaxed_delta >= 0):
            raise ValueError(f"relaxed_delta must be a finite number >= 0, got {self.relaxed_delta!r}")
        if self.method == "oracle" and self.draft_sampling != "greedy":
            raise ValueError("method 'oracle' replays given tokens: draft_sampling must be 'greedy'")
        if self.relaxed and (self.think_start_token_id is None or self.think_end_token_id is None):
            raise ValueError("relaxed acceptance needs think_start_token_id and think_end_token_id")

    @classmethod
    def from_flags(cls, method: str, num_speculative_tokens: int | None,
                   model: Transformer) -> SpeculativeConfig | None:
        """The CLI's `--speculative METHOD --num-speculative-tokens K`: None for method "none"; K
        defaults to 3 for eagle, else to the model's MTP modules (at least 1)."""
        if method == "none":
            return None
        k = num_speculative_tokens
        if k is None:
            k = 3 if method == "eagle" else max(model.config.num_nextn_predict_layers, 1)
        return cls(method=method, num_speculative_tokens=k)

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_n > 0

    def check_model(self, model: Transformer, vocab_size: int) -> None:
        """Raises ValueError when the model cannot serve this configuration."""
        c, k = model.config, self.num_speculative_tokens
        depth = c.num_nextn_predict_layers
        if self.method != "oracle" and depth == 0:
            raise ValueError("the model has no MTP modules (num_nextn_predict_layers = 0): cannot speculate")
        if self.method == "parallel" and c.mtp_style != "parallel":
            raise ValueError(f"method 'parallel' needs parallel heads, the model has mtp_style={c.mtp_style!r}")
        if self.method in ("vanilla", "eagle") and c.mtp_style != "deepseek":
            raise ValueError(f"method {self.method!r} needs DeepSeek-style MTP modules, the model has "
                             f"mtp_style={c.mtp_style!r}; use method='parallel'")
        if self.method in ("vanilla", "parallel") and k > depth:
            raise ValueError(f"method {self.method!r} drafts one token per module: num_speculative_tokens={k} "
                             f"exceeds the model's {depth} MTP modules (use method='eagle' for K > D)")
        if self.relaxed_top_n > vocab_size:
            raise ValueError(f"relaxed_top_n={self.relaxed_top_n} exceeds vocab_size={vocab_size}")
        for name in ("think_start_token_id", "think_end_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < vocab_size:
                raise ValueError(f"{name}={value} is outside [0, vocab_size={vocab_size})")

    @property
    def num_caches(self) -> int:
        """MTP caches the drafter keeps: one (eagle), one per module (vanilla, parallel), none (oracle)."""
        return {"eagle": 1, "oracle": 0}.get(self.method, self.num_speculative_tokens)

    @property
    def hidden_window(self) -> int:
        """Positions of main hidden states kept between steps (vanilla only)."""
        return 2 * self.num_speculative_tokens if self.method == "vanilla" else 0


@struct.dataclass
class DraftState:
    """What the drafter carries between steps (B rows, K drafts; empty arrays when not speculating)."""

    tokens: jax.Array  # int32 [B, K]: drafts for positions L .. L + K - 1
    probs: jax.Array  # float32 [B, K, V] (draft_sampling="sample") or [B, K, 0]: q
    caches: tuple[KVCache, ...]  # the MTP modules' caches (`SpeculativeConfig.num_caches`)
    hidden_window: jax.Array  # [B, W, E]: h^0 at positions L-1-W .. L-2 (vanilla), W = 0 otherwise
    oracle_tokens: jax.Array  # int32 [B, R]: the sequences the oracle replays (otherwise [B, 1], unused)


def init_draft_state(model: Transformer, spec: SpeculativeConfig | None, batch_size: int, max_length: int,
                     oracle_tokens: np.ndarray | None = None) -> DraftState:
    """The drafter's empty state for B rows of capacity S (`spec` None: no drafts, K = 0).

    `oracle_tokens`: int [B, R] for method "oracle" (row b's full sequence, prompt first; positions
    past R draft token 0), required there and refused elsewhere (ValueError).
    """
    config = model.config
    k_max = 0 if spec is None else spec.num_speculative_tokens
    oracle = spec is not None and spec.method == "oracle"
    if oracle != (oracle_tokens is not None):
        raise ValueError("oracle_tokens is required with method='oracle' and only there")
    if oracle:
        oracle_tokens = np.asarray(oracle_tokens)
        if oracle_tokens.ndim != 2 or oracle_tokens.shape[0] != batch_size or not np.issubdtype(
                oracle_tokens.dtype, np.integer):
            raise ValueError(f"oracle_tokens must be an int array [B={batch_size}, R], got shape "
                             f"{oracle_tokens.shape} and dtype {oracle_tokens.dtype}")
    vocab = config.vocab_size if spec is not None and spec.draft_sampling == "sample" else 0
    window = 0 if spec is None else spec.hidden_window
    host = dict(tokens=np.zeros((batch_size, k_max), np.int32), probs=np.zeros((batch_size, k_max, vocab), np.float32),
                hidden_window=np.zeros((batch_size, window, config.hidden_size), config.compute_dtype),
                oracle_tokens=np.asarray(oracle_tokens if oracle else np.zeros((batch_size, 1)), np.int32))
    return DraftState(**jax.device_put(host),  # (jnp.zeros would compile a small program per array)
                      caches=() if spec is None else tuple(model.mtp[j].init_cache(batch_size, max_length)
                                                           for j in range(spec.num_caches)))
    # (not [B, 0]: on a mesh jitted calls return that empty array with varying specs, and recompile)


def _pick_draft(spec: SpeculativeConfig, logits: jax.Array, sampling: SamplingState,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A draft token per row from MTP logits [B, V] for `positions`, and q ([B, V], or [B, 0] if greedy)."""
    if spec.draft_sampling == "greedy":  # on a mesh: a per-device max over the vocabulary shards, combined
        return argmax_last(logits, P("batch", "vocab")), jnp.zeros((logits.shape[0], 0), jnp.float32)
    q = target_probs(logits, sampling)
    return sample_from(q, logits, sampling, positions, STREAM_DRAFT), q


@jax.named_scope("draft")
def draft(model: Transformer, spec: SpeculativeConfig | None, sampling: SamplingState, tokens: jax.Array,
          state: DraftState, hidden: jax.Array, start: jax.Array, lengths: jax.Array) -> DraftState:
    """Drafts K tokens per row (`spec` None: none).

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
    if spec is None:
        return state
    k_max = spec.num_speculative_tokens
    if spec.method == "oracle":
        positions = lengths[:, None] + jnp.arange(k_max)[None, :]
        reference = jnp.pad(state.oracle_tokens, ((0, 0), (0, k_max)))  # past R: token 0
        return state.replace(tokens=jnp.take_along_axis(reference, jnp.minimum(positions, reference.shape[1] - 1),
                                                        axis=1))
    caches = state.caches
    width = hidden.shape[1]
    last = lengths - 2 - start  # index of position L - 2 in the window, [B]
    window = start[:, None] + jnp.arange(width)[None, :]  # absolute positions [B, W]

    def token_at(positions):  # t at positions (drafts included), clamped into the buffer
        return jnp.take_along_axis(ext, jnp.clip(positions, 0, ext.shape[1] - 1), axis=1)

    ext = tokens
    drafts, probs, new_caches = [], [], []
    call = dict(embed=model.embed, head=model.head)
    if spec.method == "eagle":
        module = model.mtp[0]
        logits, chained, cache = module(hidden, token_at(window + 1), window, caches[0], logits_at=last, **call)
        chained = take_rows(chained, last)  # [B, 1, E]
        token, q = _pick_draft(spec, logits[:, 0], sampling, lengths)
        drafts = jnp.zeros((token.shape[0], k_max), token.dtype).at[:, 0].set(token)
        probs = jnp.zeros((q.shape[0], k_max, q.shape[1]), q.dtype).at[:, 0].set(q)

        def chain(j, carry):  # draft j: one more pass at position L - 2 + j, chaining the module's own hidden
            drafts, probs, token, chained, cache = carry
            logits, chained, cache = module(chained, token[:, None], (lengths - 2 + j)[:, None], cache, **call)
            token, q = _pick_draft(spec, logits[:, 0], sampling, lengths + j)
            return drafts.at[:, j].set(token), probs.at[:, j].set(q), token, chained, cache

        # a loop, not K-1 unrolled copies of the module: compile time stays flat in K
        drafts, probs, _, _, cache = jax.lax.fori_loop(1, k_max, chain, (drafts, probs, token, chained, cache))
        return state.replace(tokens=drafts, probs=probs, caches=(cache,))
    else:
        depth_hidden = hidden
        for j in range(k_max):
            module = model.mtp[j]
            if spec.method == "parallel":
                logits, _, cache = module(hidden, window, window, caches[j], logits_at=last, **call)
            else:  # module j+1 at position i reads t_{i+j+1}, a draft where i + j + 1 >= L
                logits, depth_hidden, cache = module(depth_hidden, token_at(window + j + 1), window, caches[j],
                                                     logits_at=last, **call)
            token, q = _pick_draft(spec, logits[:, 0], sampling, lengths + j)
            ext = write_at(ext, token[:, None], (lengths + j)[:, None])
            drafts.append(token)
            probs.append(q)
            new_caches.append(cache)
    return state.replace(tokens=jnp.stack(drafts, axis=1), probs=jnp.stack(probs, axis=1), caches=tuple(new_caches))


def draft_after_prefill(model: Transformer, spec: SpeculativeConfig | None, sampling: SamplingState,
                        tokens: jax.Array, state: DraftState, h0: jax.Array, lengths: jax.Array,
                        start: jax.Array | None = None) -> DraftState:
    """The first drafts, from the prefill's h^0 [B, P, E] at positions 0 .. P - 1 (L committed tokens,
    int32 [B]); vanilla keeps h^0 at positions L-1-W .. L-2 for its next window.

    A chunk of a prompt prefilled in pieces: h^0 [B, C, E] at positions `start` .. start + C - 1
    (int32 [B]); the modules run over the chunk (vanilla: over its window of earlier h^0 and the
    chunk, re-running the positions whose entries the previous chunk computed from drafts). For a
    chunk before the last, `lengths` = start + C + 1, as if its next token were committed: its
    drafts are discarded, and what they wrote past the chunk is stale.
    """
    window = state.hidden_window.shape[1]
    if start is None:
        start = jnp.zeros_like(lengths)
    elif window:  # chunked vanilla: run over the kept window too (needs C >= K - 1: see `serving`)
        h0 = jnp.concatenate([state.hidden_window, h0.astype(state.hidden_window.dtype)], axis=1)
        start = start - window
    state = draft(model, spec, sampling, tokens, state, h0, start, lengths)
    if window:
        index = lengths[:, None] - 1 - window + jnp.arange(window)[None, :] - start[:, None]
        gathered = jnp.take_along_axis(h0, jnp.clip(index, 0, h0.shape[1] - 1)[..., None], axis=1)
        state = state.replace(hidden_window=gathered.astype(state.hidden_window.dtype))
    return state


def draft_after_verify(model: Transformer, spec: SpeculativeConfig | None, sampling: SamplingState,
                       tokens: jax.Array, state: DraftState, h0: jax.Array, lengths: jax.Array,
                       num_committed: jax.Array) -> DraftState:
    """The next drafts after a verify pass whose h^0 [B, K+1, E] sits at positions L-1 .. L-1+K, L the
    lengths before the step (int32 [B]) and `num_committed` (int32 [B]) the tokens the step committed.

    Eagle and parallel run over the verify window; vanilla slides its window of h^0 by the tokens
    committed, to end at position L' - 2, and runs over that.
    """
    window = state.hidden_window.shape[1]
    if not window:
        return draft(model, spec, sampling, tokens, state, h0, lengths - 1, lengths + num_committed)
    joined = jnp.concatenate([state.hidden_window, h0.astype(state.hidden_window.dtype)], axis=1)
    offsets = num_committed[:, None] + jnp.arange(window)[None, :]  # [B, W]
    h0 = jnp.take_along_axis(joined, offsets[..., None], axis=1)
    new_lengths = lengths + num_committed
    state = draft(model, spec, sampling, tokens, state, h0, new_lengths - 1 - window, new_lengths)
    return state.replace(hidden_window=h0)
