"""MTP speculative decoding in one jitted, fixed-shape step: draft, verify, accept, commit, roll back.

The design of TensorRT-LLM's MTP (its tech blog "DeepSeek R1 MTP Implementation and Optimization")
with the semantics of `docs/MTP_SPEC.md`:

- **Verify**: row b feeds `[t_{L-1}, d_1, ..., d_K]` at positions `L-1 .. L-1+K` through the main
  model in one forward; output j is the target distribution p_j for position L + j.
- **Accept** (`accept`): draft d_j is accepted when `u_j * q_j(d_j) < p_{j-1}(d_j)`, u_j uniform in
  [0, 1) (Leviathan et al. 2023, Chen et al. 2023): with greedy targets and drafts this is exactly
  `d_j == argmax p_{j-1}` (strict acceptance), and a zero-probability draft is never accepted. At the
  first rejection the row emits a sample of `norm(max(0, p - q))`, after K acceptances a bonus
  sample of p_K; greedy rows take the argmax. Optionally TensorRT-LLM's relaxed acceptance in a
  reasoning model's thinking phase (greedy rows only; lossy by design).
- **Commit** (`engine.commit_tokens`): the accepted prefix plus the correction/bonus token, cut at
  the first stop token, `max_new_tokens` and the capacity.
- **Roll back**: nothing to do: caches keep no lengths, and every cache of a row holds the
  positions before its last committed token; rejected entries stay
  behind as stale data, masked out and overwritten later.
- **Draft** the next K tokens with the MTP modules (`draft`):
  * `eagle`: module 1 reused K times over one cache: one pass over the verify window, then K - 1
    one-token passes chaining its own hidden state (the TRT-LLM "MTP Eagle" path);
  * `vanilla`: modules 1..K in turn, each with its own cache, each over a window of the last 2K
    positions (TRT-LLM's "MTP Vanilla", which re-runs a window of past tokens and hidden states
    because module k's entries for the last k - 1 positions were computed from drafts);
  * `parallel`: Gloeckle et al. heads 1..K, each over the main hidden states only.

State at a step boundary: L_b committed tokens; the main cache holds positions 0 .. L_b - 2 and
every MTP cache 0 .. L_b - 2 as well; `draft_tokens` holds the K drafts for positions L_b ..
L_b + K - 1.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Generator, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mtp_jax.cache import KVCache
from mtp_jax.engine import (
    DecodeState,
    GenerationResult,
    commit_tokens,
    init_state,
    results_from_state,
    token_logprobs,
)
from mtp_jax.model import Transformer, sequence_positions, static_split, take_rows
from mtp_jax.mtp import initial_hidden
from mtp_jax.sampling import (
    SamplingParams,
    SamplingState,
    all_greedy,
    is_int,
    is_real,
    row_keys,
    sample_from,
    target_probs,
)

METHODS = ("vanilla", "eagle", "parallel")
MAX_SPECULATIVE_TOKENS = 16  # the largest K a SpeculativeConfig accepts (see its docstring)
_STREAM_ACCEPT, _STREAM_RESIDUAL, _STREAM_DRAFT = 1, 2, 3  # random streams (plain sampling uses 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to speculate. Hashable: it is a static argument of the jitted step.

    method: "vanilla" (D distinct modules, K <= D), "eagle" (module 1 reused, any K) or
      "parallel" (Gloeckle et al. heads, K <= D).
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
        if self.relaxed and (self.think_start_token_id is None or self.think_end_token_id is None):
            raise ValueError("relaxed acceptance needs think_start_token_id and think_end_token_id")

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_n > 0

    def check_model(self, model: Transformer, vocab_size: int) -> None:
        """Raises ValueError when the model cannot serve this configuration."""
        c, k = model.config, self.num_speculative_tokens
        depth = c.num_nextn_predict_layers
        if depth == 0:
            raise ValueError("the model has no MTP modules (num_nextn_predict_layers = 0): cannot speculate")
        if self.method == "parallel" and c.mtp_style != "parallel":
            raise ValueError(f"method 'parallel' needs parallel heads, the model has mtp_style={c.mtp_style!r}")
        if self.method != "parallel" and c.mtp_style != "deepseek":
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
        return 1 if self.method == "eagle" else self.num_speculative_tokens

    @property
    def hidden_window(self) -> int:
        """Positions of main hidden states kept between steps (vanilla only)."""
        return 2 * self.num_speculative_tokens if self.method == "vanilla" else 0


@struct.dataclass
class SpecMetrics:
    """Per-row counters (device arrays); pooled over rows on the host (`docs/MTP_SPEC.md`, "Metrics")."""

    num_steps: jax.Array  # int32 [B]: verify steps the row took part in
    num_drafts: jax.Array  # int32 [B]: drafts proposed
    num_accepted: jax.Array  # int32 [B]: drafts accepted and committed
    accepted_per_position: jax.Array  # int32 [B, K]: steps in which draft j was accepted
    accepted_length_histogram: jax.Array  # int32 [B, K + 1]: steps that accepted exactly n drafts


@struct.dataclass
class SpecState:
    """The decode state plus what speculation carries between steps."""

    decode: DecodeState
    mtp_caches: tuple[KVCache, ...]
    draft_tokens: jax.Array  # int32 [B, K]: drafts for positions L .. L + K - 1
    draft_probs: jax.Array  # float32 [B, K, V] (draft_sampling="sample") or [B, K, 0]: q
    hidden_window: jax.Array  # [B, W, E]: h^0 at positions L-1-W .. L-2 (vanilla), W = 0 otherwise
    thinking: jax.Array  # bool [B]: the row is in its thinking phase after its last committed token
    metrics: SpecMetrics


@dataclasses.dataclass(frozen=True)
class SpeculativeMetrics:
    """Pooled over rows and steps, as vLLM defines them.

    mean_acceptance_length: 1 + accepted / verify steps (tokens committed per verify step, before
      stop cuts). acceptance_rate_per_position[j]: steps whose draft j + 1 was accepted / steps.
    accepted_length_histogram[n]: verify steps that accepted exactly n drafts.
    """

    num_steps: int
    num_drafts: int
    num_accepted: int
    accepted_per_position: list[int]
    accepted_length_histogram: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.num_steps if self.num_steps else float("nan") for n in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

    @classmethod
    def from_counters(cls, metrics: SpecMetrics) -> SpeculativeMetrics:
        m = jax.device_get(metrics)
        return cls(num_steps=int(m.num_steps.sum()), num_drafts=int(m.num_drafts.sum()),
                   num_accepted=int(m.num_accepted.sum()),
                   accepted_per_position=m.accepted_per_position.sum(0).tolist(),
                   accepted_length_histogram=m.accepted_length_histogram.sum(0).tolist())

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (f"mean acceptance length {self.mean_acceptance_length:.2f} over {self.num_steps} verify steps; "
                f"draft acceptance rate {self.draft_acceptance_rate:.2f}; per-position acceptance [{rates}]")


# ----------------------------------------------------------------------------------------------
# Acceptance


def _after(thinking: jax.Array, token: jax.Array, spec: SpeculativeConfig) -> jax.Array:
    """The thinking phase after `token` (bool [B]) given the phase before it."""
    thinking = jnp.where(token == spec.think_start_token_id, True, thinking)
    return jnp.where(token == spec.think_end_token_id, False, thinking)


@jax.named_scope("accept")
def accept(spec: SpeculativeConfig, logits: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array,
           sampling: SamplingState, lengths: jax.Array, thinking: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative acceptance for a batch.

    Args:
      logits: float32 [B, K+1, V] from the verify forward (row j is the target for position L + j).
      draft_tokens: int32 [B, K]. draft_probs: q, float32 [B, K, V], or [B, K, 0] for greedy drafts
        (q one-hot at the draft).
      sampling: the rows' sampling parameters (the target p is `target_probs` of the logits).
      lengths: L, int32 [B]. thinking: bool [B], the phase after token L - 1 (relaxed acceptance).

    Returns:
      num_accepted a (int32 [B], 0..K) and the token emitted after the accepted prefix (int32 [B]):
      a sample of norm(max(0, p_a - q_{a+1})) after a rejection, of p_K after full acceptance;
      the argmax for greedy rows.
    """
    batch, num_drafts = draft_tokens.shape
    greedy_drafts = draft_probs.shape[-1] == 0
    p = target_probs(logits, sampling)  # [B, K+1, V]
    p_draft = jnp.take_along_axis(p[:, :num_drafts], draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
    q_draft = (jnp.ones_like(p_draft) if greedy_drafts
               else jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0])  # [B, K]
    positions = lengths[:, None] + jnp.arange(num_drafts)[None, :]  # [B, K]

    def draw_uniforms(positions):  # one per draft; all-greedy batches need none (p, q are one-hot)
        keys = jax.vmap(lambda pos: row_keys(sampling, pos, _STREAM_ACCEPT), in_axes=1, out_axes=1)(positions)
        return jax.vmap(jax.vmap(jax.random.uniform))(keys)  # [B, K]

    uniforms = jax.lax.cond(all_greedy(sampling), lambda p: jnp.zeros(p.shape, jnp.float32), draw_uniforms,
                            positions)
    accepted = uniforms * q_draft < p_draft  # [B, K]; p = 0 is never accepted, even for u = 0
    if spec.relaxed:
        probs = jax.nn.softmax(logits[:, :num_drafts].astype(jnp.float32), axis=-1)  # [B, K, V]
        top = jax.lax.top_k(probs, spec.relaxed_top_n)[0]  # [B, K, N]
        prob_draft = jnp.take_along_axis(probs, draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
        relaxed_ok = (prob_draft >= top[..., -1]) & (prob_draft >= top[..., 0] - spec.relaxed_delta)
        phase, in_phase = thinking, []
        for j in range(num_drafts):  # a </think> accepted at j makes drafts after it strict
            in_phase.append(phase)
            phase = _after(phase, draft_tokens[:, j], spec)
        relaxed_ok &= jnp.stack(in_phase, axis=1) & (sampling.temperature == 0)[:, None]
        accepted |= relaxed_ok
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)  # [B]
    # The emitted token: residual after a rejection at num_accepted, p_K after full acceptance.
    p_at = jnp.take_along_axis(p, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    logits_at = jnp.take_along_axis(logits, num_accepted[:, None, None], axis=1)[:, 0]  # [B, V]
    rejected = num_accepted < num_drafts
    index = jnp.minimum(num_accepted, num_drafts - 1)
    if greedy_drafts:
        q_at = jax.nn.one_hot(jnp.take_along_axis(draft_tokens, index[:, None], axis=1)[:, 0], p.shape[-1])
    else:
        q_at = jnp.take_along_axis(draft_probs, index[:, None, None], axis=1)[:, 0]  # [B, V]
    residual = jnp.maximum(p_at - jnp.where(rejected[:, None], q_at, 0.0), 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_at)
    token = sample_from(residual, logits_at, sampling, lengths + num_accepted, _STREAM_RESIDUAL)
    return num_accepted.astype(jnp.int32), token


# ----------------------------------------------------------------------------------------------
# Drafting


def _pick_draft(spec: SpeculativeConfig, logits: jax.Array, sampling: SamplingState,
                positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A draft token per row from MTP logits [B, V] for `positions`, and q ([B, V], or [B, 0] if greedy)."""
    if spec.draft_sampling == "greedy":
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), jnp.zeros((logits.shape[0], 0), jnp.float32)
    q = target_probs(logits, sampling)
    return sample_from(q, logits, sampling, positions, _STREAM_DRAFT), q


def _at(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[b, index[b]] for x of shape [B, T, ...]."""
    return take_rows(x, index)[:, 0]


@jax.named_scope("draft")
def draft(model: Transformer, spec: SpeculativeConfig, sampling: SamplingState, tokens: jax.Array,
          caches: tuple[KVCache, ...], hidden: jax.Array, start: jax.Array,
          lengths: jax.Array) -> tuple[jax.Array, jax.Array, tuple[KVCache, ...]]:
    """Drafts K tokens per row with the MTP modules.

    Args:
      tokens: int32 [B, S], committed tokens (`lengths` of them per row).
      caches: the MTP caches (`spec.num_caches` one-layer caches); their entries before `start` are final.
      hidden: h^0 (after `initial_hidden`) of shape [B, W, E] at positions `start .. start + W - 1`,
        covering position `lengths - 2` (the last one with a committed next token).
      start: int32 [B], position of hidden[:, 0] (may be negative: such positions are ignored).
      lengths: int32 [B], committed tokens L.

    Returns:
      draft_tokens int32 [B, K] for positions L .. L+K-1, draft_probs ([B, K, V] or [B, K, 0]), and
      the caches with the window and draft passes written (live: positions 0 .. L - 2).
    """
    k_max = spec.num_speculative_tokens
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
        for j in range(k_max):
            token, q = _pick_draft(spec, logits[:, 0], sampling, lengths + j)
            drafts.append(token)
            probs.append(q)
            if j + 1 < k_max:  # one more pass at position L - 1 + j, chaining the module's own hidden
                logits, chained, cache = module(chained, token[:, None], (lengths - 1 + j)[:, None], cache, **call)
        new_caches.append(cache)
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
            ext = ext.at[jnp.arange(ext.shape[0]), lengths + j].set(token, mode="drop")
            drafts.append(token)
            probs.append(q)
            new_caches.append(cache)
    return jnp.stack(drafts, axis=1), jnp.stack(probs, axis=1), tuple(new_caches)


# ----------------------------------------------------------------------------------------------
# Prefill and step


def _update_phase(spec: SpeculativeConfig, thinking: jax.Array, candidates: jax.Array, num: jax.Array) -> jax.Array:
    """The thinking phase after committing `candidates[:, :num]`."""
    if not spec.relaxed:
        return thinking
    for j in range(candidates.shape[1]):
        thinking = jnp.where(j < num, _after(thinking, candidates[:, j], spec), thinking)
    return thinking


def speculative_prefill(model: Transformer, spec: SpeculativeConfig, state: SpecState,
                        padded_prompts: jax.Array) -> SpecState:
    """Prompts [B, P] through the main model, the first token committed, the first K drafts made."""
    d = state.decode
    positions = sequence_positions(*padded_prompts.shape)  # padding past a prompt is stale from the start
    logits, hidden, cache = model(padded_prompts, positions, d.cache, logits_at=d.prompt_lengths - 1)
    last_logits = logits[:, 0]  # [B, V]
    d = d.replace(cache=cache)
    token = sample_from(target_probs(last_logits, d.sampling), last_logits, d.sampling, d.lengths)
    d, num = commit_tokens(d, token[:, None], jnp.ones_like(token), token_logprobs(last_logits, token)[:, None])
    thinking = _update_phase(spec, state.thinking, token[:, None], num)
    h0 = initial_hidden(model, hidden)  # [B, P, E]
    zero = jnp.zeros_like(d.lengths)
    drafts, q, caches = draft(model, spec, d.sampling, d.tokens, state.mtp_caches, h0, zero, d.lengths)
    window = state.hidden_window.shape[1]
    if window:  # h^0 at positions L-1-W .. L-2 for the next step's vanilla window
        positions = d.lengths[:, None] - 1 - window + jnp.arange(window)[None, :]
        gathered = jnp.take_along_axis(h0, jnp.clip(positions, 0, h0.shape[1] - 1)[..., None], axis=1)
        state = state.replace(hidden_window=gathered.astype(state.hidden_window.dtype))
    return state.replace(decode=d, mtp_caches=caches, draft_tokens=drafts, draft_probs=q, thinking=thinking)


def verify_and_commit(model: Transformer, spec: SpeculativeConfig,
                      state: SpecState) -> tuple[SpecState, jax.Array, jax.Array]:
    """Verify the K drafts of every row in one forward, accept, commit, roll back, count.

    Returns the state with the committed tokens, the written main cache, thinking phase, metrics
    and (vanilla) hidden window updated, but `draft_tokens` / `draft_probs` / `mtp_caches` still
    the old ones; and the inputs of `draft`: h^0 [B, W, E] and the position of its first row [B].
    Finished rows commit nothing.
    """
    d = state.decode
    k_max = spec.num_speculative_tokens
    active = ~d.done
    lengths = d.lengths
    last = _at(d.tokens, jnp.maximum(lengths - 1, 0))  # t_{L-1}, [B]
    verify_tokens = jnp.concatenate([last[:, None], state.draft_tokens], axis=1)  # [B, K+1]
    with jax.named_scope("verify_forward"):  # named scopes: `benchmarks/profile_step.py` groups time by them
        logits, hidden, cache = model(verify_tokens, sequence_positions(*verify_tokens.shape, lengths - 1), d.cache)
    num_accepted, token = accept(spec, logits, state.draft_tokens, state.draft_probs, d.sampling, lengths,
                                 state.thinking)
    index = jnp.arange(k_max + 1)[None, :]
    candidates = jnp.where(index < num_accepted[:, None], jnp.pad(state.draft_tokens, ((0, 0), (0, 1))),
                           token[:, None])  # [B, K+1]: accepted drafts, then the emitted token
    # Commit; rolling back is nothing more: with L' committed tokens the main cache holds 0 .. L' - 2,
    # and the entries written for rejected drafts are past that, stale.
    d, num = commit_tokens(d.replace(cache=cache), candidates, num_accepted + 1, token_logprobs(logits, candidates))
    thinking = _update_phase(spec, state.thinking, candidates, num)

    h0 = initial_hidden(model, hidden)  # [B, K+1, E] at positions L-1 .. L-1+K
    window = state.hidden_window.shape[1]
    if window:  # vanilla: slide the window of h^0 to end at L' - 2
        joined = jnp.concatenate([state.hidden_window, h0.astype(state.hidden_window.dtype)], axis=1)
        offsets = num[:, None] + jnp.arange(window)[None, :]  # [B, W]
        h0 = jnp.take_along_axis(joined, offsets[..., None], axis=1)
        start = d.lengths - 1 - window
        hidden_window = h0
    else:
        start, hidden_window = lengths - 1, state.hidden_window

    counted = jnp.where(active, jnp.minimum(num_accepted, num), 0)  # drafts accepted and committed
    m = state.metrics
    metrics = SpecMetrics(
        num_steps=m.num_steps + active, num_drafts=m.num_drafts + k_max * active,
        num_accepted=m.num_accepted + counted,
        accepted_per_position=m.accepted_per_position + (jnp.arange(k_max)[None, :] < counted[:, None]),
        accepted_length_histogram=m.accepted_length_histogram
        + (active[:, None] & (jnp.arange(k_max + 1)[None, :] == counted[:, None])))
    state = state.replace(decode=d, hidden_window=hidden_window, thinking=thinking, metrics=metrics)
    return state, h0, start


def speculative_step(model: Transformer, spec: SpeculativeConfig, state: SpecState) -> SpecState:
    """One verify-accept-commit-rollback-draft step for every row (finished rows change nothing)."""
    state, h0, start = verify_and_commit(model, spec, state)
    d = state.decode
    drafts, q, caches = draft(model, spec, d.sampling, d.tokens, state.mtp_caches, h0, start, d.lengths)
    return state.replace(mtp_caches=caches, draft_tokens=drafts, draft_probs=q)


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _prefill_jit(graph, params, spec, state, padded_prompts):
    return speculative_prefill(graph.merge(params), spec, state, padded_prompts)


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _step_jit(graph, params, spec, state):
    return speculative_step(graph.merge(params), spec, state)


@functools.partial(jax.jit, static_argnames=("graph", "spec"), donate_argnames=("state",))
def _loop_jit(graph, params, spec, state):
    model = graph.merge(params)
    return jax.lax.while_loop(lambda s: ~jnp.all(s.decode.done), lambda s: speculative_step(model, spec, s), state)


# ----------------------------------------------------------------------------------------------
# Host API


def _initial_phase(prompt: Sequence[int], spec: SpeculativeConfig) -> bool:
    phase = False
    for token in prompt:
        phase = True if token == spec.think_start_token_id else False if token == spec.think_end_token_id else phase
    return phase


def init_spec_state(model: Transformer, spec: SpeculativeConfig, prompts: Sequence[Sequence[int]],
                    **kwargs) -> tuple[SpecState, jax.Array]:
    """The initial speculative state and padded prompts; raises ValueError on impossible requests."""
    spec.check_model(model, model.config.vocab_size)
    decode, padded = init_state(model, prompts, **kwargs)
    config, batch, k_max = model.config, decode.tokens.shape[0], spec.num_speculative_tokens
    capacity = decode.tokens.shape[1]
    vocab = config.vocab_size if spec.draft_sampling == "sample" else 0
    zeros = functools.partial(jnp.zeros, dtype=jnp.int32)
    return SpecState(
        decode=decode,
        mtp_caches=tuple(model.mtp[j].init_cache(batch, capacity) for j in range(spec.num_caches)),
        draft_tokens=zeros((batch, k_max)), draft_probs=jnp.zeros((batch, k_max, vocab), jnp.float32),
        hidden_window=jnp.zeros((batch, spec.hidden_window, config.hidden_size), config.compute_dtype),
        thinking=jnp.asarray([spec.relaxed and _initial_phase(p, spec) for p in prompts], bool),
        metrics=SpecMetrics(num_steps=zeros((batch,)), num_drafts=zeros((batch,)), num_accepted=zeros((batch,)),
                            accepted_per_position=zeros((batch, k_max)),
                            accepted_length_histogram=zeros((batch, k_max + 1)))), padded


@dataclasses.dataclass(frozen=True)
class SpeculativeResult(GenerationResult):
    """A `GenerationResult` with the pooled speculative metrics; `num_steps` counts verify steps."""

    metrics: SpeculativeMetrics | None = None


def speculative_generate(model: Transformer, prompts: Sequence[Sequence[int]], spec: SpeculativeConfig, *,
                         max_new_tokens: int | Sequence[int] = 64,
                         sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                         max_length: int | None = None, stop_tokens: Iterable[int] | None = None) -> SpeculativeResult:
    """Generates with MTP speculative decoding, the whole loop on device (see `generate.generate`).

    Greedy rows produce exactly the tokens of plain greedy decoding; sampled rows are distributed
    exactly as plain sampling (relaxed acceptance, when on, trades that for speed in thinking phases).
    Raises ValueError for impossible requests (no MTP modules, vanilla/parallel with K > D, ...).
    """
    state, padded = init_spec_state(model, spec, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    max_length=max_length, stop_tokens=stop_tokens)
    graph, params = static_split(model)
    begin = time.perf_counter()
    state = _prefill_jit(graph, params, spec, state, padded)
    state = _loop_jit(graph, params, spec, state)
    jax.block_until_ready(state.decode.lengths)
    return _result(state, time.perf_counter() - begin)


def _result(state: SpecState, seconds: float) -> SpeculativeResult:
    """Host-side view of a finished speculative state; `num_steps` counts the verify steps."""
    base = results_from_state(state.decode, int(np.max(jax.device_get(state.metrics.num_steps))), seconds)
    return SpeculativeResult(**vars(base), metrics=SpeculativeMetrics.from_counters(state.metrics))


def speculative_stream(model: Transformer, prompts: Sequence[Sequence[int]], spec: SpeculativeConfig, *,
                       max_new_tokens: int | Sequence[int] = 64,
                       sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                       max_length: int | None = None,
                       stop_tokens: Iterable[int] | None = None) -> Generator[list[list[int]], None, SpeculativeResult]:
    """Like `speculative_generate`, one step per iteration: yields the tokens each row just committed.

    Returns (as `StopIteration.value`) the `SpeculativeResult` that `speculative_generate` would, its
    `seconds` the wall time from the prefill to the last step, the consumer's time between steps included.
    """
    state, padded = init_spec_state(model, spec, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                                    max_length=max_length, stop_tokens=stop_tokens)
    graph, params = static_split(model)
    before = np.asarray(state.decode.lengths)
    begin = time.perf_counter()
    state = _prefill_jit(graph, params, spec, state, padded)
    while True:
        tokens, lengths, done = jax.device_get((state.decode.tokens, state.decode.lengths, state.decode.done))
        yield [tokens[b, before[b]: lengths[b]].tolist() for b in range(len(before))]
        if done.all():
            return _result(state, time.perf_counter() - begin)
        before = lengths
        state = _step_jit(graph, params, spec, state)
