"""Per-row sampling: logit bias, penalties, min_tokens, temperature, min-p, top-k, top-p (nucleus), greedy;
reproducible per-row seeds.

Two functions turn a row's raw logits into the distribution it samples from: `process_logits` (what the
row's history changes: the logit bias, `min_tokens`, the repetition, frequency and presence penalties; vLLM's
logits processors and penalties, in its order) and `target_probs` (temperature, min-p, top-k, top-p). The
plain sampler draws from them and the speculative acceptance uses the very same functions for its target p,
the history of verify position j including the drafts before it, which is what makes rejection sampling
lossless (`docs/MTP_SPEC.md`, "Acceptance"). Greedy rows (temperature 0) get a one-hot distribution at the
argmax of the processed logits (lowest index on ties).
Randomness: row b's draw for the token at absolute position i uses
`fold_in(fold_in(key(seed_b), i), stream)`, so a row's output does not depend on which other rows
share its batch; the streams below separate the independent draws at one position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Float, Int

from mtp_jax.sharding import vocab_argmax
from mtp_jax.validation import is_int, is_real

MAX_SEED = 2**32 - 1  # seeds are uint32 on device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on device
MAX_LOGIT_BIAS = 300  # entries of one row's logit bias, as OpenAI's API
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI's API
PENALTY_RANGE = 2.0  # |presence_penalty|, |frequency_penalty| at most this, as OpenAI's API
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # vLLM takes any > 0; 1e-40 would send logits to inf (NaN after softmax)
STREAM_TARGET = 0  # the committed token drawn from the target (plain sampling, residual, bonus)
STREAM_ACCEPT = 1  # the acceptance uniforms u_j
STREAM_DRAFT = 3  # draft tokens sampled from the MTP distribution


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one row samples.

    temperature: 0 for greedy decoding, else > 0 (logits are divided by it).
    top_k: keep the k most likely tokens; 0 disables (an int in [0, 2**31); k >= V keeps all).
    top_p: keep the smallest set of most likely tokens whose mass reaches top_p; 1.0 disables.
    seed: the row's random seed, an int in [0, 2**32) (`MAX_SEED` + 1): it is stored as uint32 and
      `jax.random.key` maps every such value to its own key, losslessly.
    logit_bias: token id -> a number in [-100, 100] added to its raw logit before everything else (greedy
      rows too; OpenAI's `logit_bias`, at most 300 entries); stored as sorted (id, bias) pairs. Token ids
      are checked against the vocabulary where the model is known (`check_request`).
    min_tokens: the row's stop tokens (EOS included) are forbidden until it has generated this many tokens
      (vLLM's; at most `max_new_tokens`, checked with the request).
    repetition_penalty: in [1e-6, 1e6], 1 = off (CTRL, Keskar et al. 2019, as vLLM and Hugging Face): the logit of
      every token in the prompt or the output so far is divided by it where positive, multiplied where not.
    frequency_penalty, presence_penalty: in [-2, 2], 0 = off (OpenAI's): each token's logit is lowered by
      frequency_penalty x its count in the output so far, and by presence_penalty if that count is > 0.
    min_p: in [0, 1], 0 = off (vLLM's): after temperature, tokens less likely than min_p x the most likely
      one's probability are dropped (greedy rows: no effect).

    Python or NumPy numbers are accepted; a bool is not a number here. Raises TypeError for a
    value of the wrong type and ValueError for one out of range, naming the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self):
        bias = self.logit_bias
        pairs = list(bias.items()) if isinstance(bias, Mapping) else bias
        if not isinstance(pairs, (list, tuple)) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            raise TypeError(f"logit_bias must be a mapping of token id -> bias, got {bias!r}")
        if len(pairs) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(pairs)}")
        for token, value in pairs:
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not is_real(value) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in pairs)))
        for name in ("temperature", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p"):
            if not is_real(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "seed", "min_tokens"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {getattr(self, name)!r}")
        if not (np.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, 2**31) (0 = disabled), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")
        if not 0 <= self.min_tokens <= 2**31 - 1:
            raise ValueError(f"min_tokens must be an int >= 0 (0 = off), got {self.min_tokens!r}")
        if not REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            raise ValueError(
                f"repetition_penalty must be in [1e-6, 1e6] (1 = off; float32 logits divided by less overflow), "
                f"got {self.repetition_penalty!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)!r}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the row's history (repetition, frequency or presence)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


@struct.dataclass
class SamplingState:
    """Device arrays of per-row sampling parameters, each of shape [B]."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    seed: jax.Array  # uint32
    bias_tokens: jax.Array  # int32 [B, MAX_LOGIT_BIAS]: the logit bias's token ids, -1 = unused
    bias_values: jax.Array  # float32 [B, MAX_LOGIT_BIAS]
    min_tokens: jax.Array  # int32, 0 = off
    repetition_penalty: jax.Array  # float32, 1 = off
    frequency_penalty: jax.Array  # float32, 0 = off
    presence_penalty: jax.Array  # float32, 0 = off
    min_p: jax.Array  # float32, 0 = off

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> SamplingState:
        tokens = np.full((len(params), MAX_LOGIT_BIAS), -1, np.int32)
        values = np.zeros((len(params), MAX_LOGIT_BIAS), np.float32)
        for b, p in enumerate(params):
            for j, (token, value) in enumerate(p.logit_bias):
                tokens[b, j], values[b, j] = token, value
        return cls(
            **jax.device_put(
                dict(
                    temperature=np.asarray([p.temperature for p in params], np.float32),
                    top_k=np.asarray([p.top_k for p in params], np.int32),
                    top_p=np.asarray([p.top_p for p in params], np.float32),
                    seed=np.asarray([p.seed for p in params], np.uint32),
                    bias_tokens=tokens,
                    bias_values=values,
                    min_tokens=np.asarray([p.min_tokens for p in params], np.int32),
                    **{
                        name: np.asarray([getattr(p, name) for p in params], np.float32)
                        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
                    },
                )
            )
        )


def _expand(x: jax.Array, ndim: int) -> jax.Array:
    """Per-row values [B] broadcast against [B, ..., V]."""
    return x.reshape(x.shape + (1,) * (ndim - 1))


def _filter_top_k_top_p(scaled: jax.Array, sampling: SamplingState) -> jax.Array:
    """`scaled` logits with tokens outside each row's top-k, then top-p, set set to -inf."""
    ndim, vocab = scaled.ndim, scaled.shape[-1]
    ordered = jnp.sort(scaled, axis=-1)[..., ::-1]  # descending [B, *T, V]
    # top-k: threshold at the k-th largest value (ties with it are kept).
    k = _expand(jnp.where(sampling.top_k > 0, jnp.minimum(sampling.top_k, vocab), vocab), ndim)
    kth = jnp.take_along_axis(ordered, k - 1, axis=-1)  # [B, *T, 1]
    scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    ordered = jnp.where(jnp.arange(vocab) < k, ordered, -jnp.inf)
    # top-p on what top-k left: keep the sorted prefix whose mass before it is < top_p.
    sorted_probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    top_p = _expand(sampling.top_p, ndim)
    keep = (mass_before < top_p) | (top_p >= 1)  # top_p = 1 keeps all, even where the cumsum rounds to 1
    num_keep = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True), 1)
    pth = jnp.take_along_axis(ordered, num_keep - 1, axis=-1)
    return jnp.where(scaled >= pth, scaled, -jnp.inf)


@struct.dataclass
class SamplingMetadata:
    """The rows' sampling parameters and what their logits processing reads of their history (vLLM's name):
    built once per step (`build`), advanced past the tokens the step commits (`after`), read by
    `process_logits` at every verify and draft position."""

    sampling: SamplingState
    bias: jax.Array  # float32 [B, V]: the logit bias, dense
    stop_mask: jax.Array  # bool [B, V]: the row's stop tokens (what min_tokens forbids)
    prompt_mask: jax.Array  # bool [B, V]: tokens in the prompt (all False when no row is penalized)
    output_bin_counts: jax.Array  # int32 [B, V]: each token's count in the output so far (likewise)
    num_generated: jax.Array  # int32 [B]: output tokens so far
    penalized: jax.Array  # bool scalar: some row has a penalty (`any_penalized`; on a mesh one all-reduce a step)

    @classmethod
    def build(
        cls,
        sampling: SamplingState,
        vocab_size: int,
        tokens: Int[Array, "B S"] | None = None,
        output_start: Int[Array, " B"] | None = None,
        lengths: Int[Array, " B"] | None = None,
        stop_tokens: Int[Array, "B M"] | None = None,
    ) -> SamplingMetadata:
        """The metadata of rows whose committed tokens are `tokens[b, :lengths[b]]`, the output from
        `output_start[b]` on, with `stop_tokens` (-1 = unused). Without `tokens`: rows with no history.
        Built per row (vmap: a batch sharded over devices scatters locally); the prompt mask and output
        counts only when some row is penalized (`lax.cond`: they cost a scatter of all S positions)."""
        batch = sampling.temperature.shape[0]

        def scatter(ids, values, dtype):  # [B, N] ids (out of range: dropped) -> [B, V]
            row = lambda i, v: jnp.zeros((vocab_size,), dtype).at[i].add(v.astype(dtype), mode="drop")  # noqa: E731
            return jax.vmap(row)(jnp.where(ids >= 0, ids, vocab_size), values)

        bias = scatter(sampling.bias_tokens, sampling.bias_values, jnp.float32)
        stop_mask = jnp.zeros((batch, vocab_size), bool)
        if stop_tokens is not None:
            stop_mask = scatter(stop_tokens, jnp.ones(stop_tokens.shape, jnp.int32), jnp.int32) > 0
        prompt_mask, counts = jnp.zeros((batch, vocab_size), bool), jnp.zeros((batch, vocab_size), jnp.int32)
        num_generated, penalized = jnp.zeros((batch,), jnp.int32), any_penalized(sampling)
        if tokens is not None:
            num_generated = jnp.maximum(lengths - output_start, 0)

            def history(_):
                position = jnp.arange(tokens.shape[1])[None, :]
                in_prompt = (position < output_start[:, None]).astype(jnp.int32)
                in_output = ((position >= output_start[:, None]) & (position < lengths[:, None])).astype(jnp.int32)
                return scatter(tokens, in_prompt, jnp.int32) > 0, scatter(tokens, in_output, jnp.int32)

            prompt_mask, counts = jax.lax.cond(penalized, history, lambda _: (prompt_mask, counts), None)
        return cls(sampling, bias, stop_mask, prompt_mask, counts, num_generated, penalized)

    def after(self, tokens: Int[Array, "B S"], lengths: Int[Array, " B"], num: Int[Array, " B"], width: int):
        """The metadata once `num[b]` <= `width` (static) more tokens are committed, at positions
        `lengths[b]` .. of `tokens`."""
        index = jnp.arange(width)[None, :]
        new = jnp.take_along_axis(tokens, jnp.minimum(lengths[:, None] + index, tokens.shape[1] - 1), axis=1)
        vocab = self.output_bin_counts.shape[1]
        ids = jnp.where(index < num[:, None], new, vocab)  # past the committed: dropped
        counts = jax.vmap(lambda c, i: c.at[i].add(1, mode="drop"))(self.output_bin_counts, ids)
        return self.replace(output_bin_counts=counts, num_generated=self.num_generated + num)


def any_penalized(sampling: SamplingState) -> jax.Array:
    """True (a bool scalar) when some row has a repetition, frequency or presence penalty."""
    return jnp.any(
        (sampling.repetition_penalty != 1) | (sampling.frequency_penalty != 0) | (sampling.presence_penalty != 0)
    )


def process_logits(
    logits: Float[Array, "B T V"],
    metadata: SamplingMetadata,
    ahead: Int[Array, "B A"] | None = None,
    start: int | jax.Array = 0,
) -> Float[Array, "B T V"]:
    """The raw `logits` (of T consecutive positions) after what the rows' history changes, in vLLM's order:
    the logit bias added; the stop tokens at -inf where fewer than `min_tokens` tokens precede; then the
    repetition penalty (prompt and output tokens), the frequency and presence penalties (output tokens).

    Position t's history is the metadata's (the committed tokens) plus `ahead[:, :start + t]` (int32
    [B, A], tokens not yet committed that precede it: the verify window's drafts, start = 0, or the drafts
    an MTP chain made before its j-th, start = j, traced or not). The penalties run only when some row is
    penalized (`lax.cond`). Returns float32 [B, T, V]."""
    m, sampling = metadata, metadata.sampling
    logits = logits.astype(jnp.float32) + m.bias[:, None, :]
    num_ahead = start + jnp.arange(logits.shape[1])  # [T]: tokens of `ahead` before each position
    early = (m.num_generated[:, None] + num_ahead[None, :]) < sampling.min_tokens[:, None]  # [B, T]
    logits = jnp.where(early[..., None] & m.stop_mask[:, None, :], -jnp.inf, logits)

    def penalize(logits):
        counts = jnp.broadcast_to(m.output_bin_counts[:, None, :], logits.shape)
        if ahead is not None and ahead.shape[1]:  # counts after the first i tokens ahead, i = 0 .. A
            seen = jnp.cumsum(jax.nn.one_hot(ahead, logits.shape[-1], dtype=jnp.int32), axis=1)
            seen = jnp.pad(seen, ((0, 0), (1, 0), (0, 0)))  # [B, A + 1, V]
            counts = counts + jnp.take(seen, jnp.clip(num_ahead, 0, ahead.shape[1]), axis=1)
        present = counts > 0
        repetition = sampling.repetition_penalty[:, None, None]
        repeated = jnp.where(logits > 0, logits / repetition, logits * repetition)
        logits = jnp.where(present | m.prompt_mask[:, None, :], repeated, logits)
        return (
            logits
            - sampling.frequency_penalty[:, None, None] * counts
            - sampling.presence_penalty[:, None, None] * present
        )

    return jax.lax.cond(m.penalized, penalize, lambda x: x, logits)


def all_greedy(sampling: SamplingState) -> jax.Array:
    """True (a bool scalar) when every row decodes greedily: the cheap paths apply."""
    return jnp.all(sampling.temperature == 0)


def target_probs(
    logits: Float[Array, "B *T V"], sampling: SamplingState, *, any_sampled: bool = False
) -> Float[Array, "B *T V"]:
    """The distribution each row samples from: float32 probabilities, same shape as `logits`.

    Temperature, then min-p, then top-k, then top-p (vLLM's order); greedy rows (temperature 0) are one-hot
    at the argmax. `logits` are the processed ones (`process_logits`).
    The logits are shifted by their row max before the division, so any temperature > 0, however
    small, gives a distribution (as it tends to 0: uniform over the tied maxima).
    Tokens outside the top-k / top-p set have probability exactly 0. The sort that top-k / top-p
    need runs only when some row uses them (`lax.cond`; shapes stay fixed). `any_sampled` (static): the
    caller already knows some row samples (it runs in the false branch of `all_greedy`), so that test, a
    collective on a data-parallel mesh, is not made again.
    """
    logits = logits.astype(jnp.float32)
    ndim = logits.ndim
    one_hot = jax.nn.one_hot(vocab_argmax(logits), logits.shape[-1], dtype=jnp.float32)

    def sampled(logits):
        temperature = _expand(sampling.temperature, ndim)
        greedy = temperature == 0
        # Shift by the row max before scaling: every value is <= 0, so a tiny temperature overflows
        # only to -inf (probability 0), never to inf - inf = NaN; the argmax (ties split) keeps 0.
        # The divisor is at least float32's smallest normal number, which no device flushes to zero.
        shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
        scaled = shifted / jnp.where(greedy, 1.0, jnp.maximum(temperature, jnp.finfo(jnp.float32).tiny))
        # min-p: the most likely token's scaled logit is 0, so p_i >= min_p * p_max is scaled_i >= log(min_p).
        scaled = jnp.where(scaled >= jnp.log(_expand(sampling.min_p, ndim)), scaled, -jnp.inf)
        filtering = jnp.any(sampling.top_k > 0) | jnp.any(sampling.top_p < 1)
        scaled = jax.lax.cond(filtering, _filter_top_k_top_p, lambda x, _: x, scaled, sampling)
        return jnp.where(greedy, one_hot, jax.nn.softmax(scaled, axis=-1))

    if any_sampled:
        return sampled(logits)
    return jax.lax.cond(all_greedy(sampling), lambda _: one_hot, sampled, logits)


def row_keys(sampling: SamplingState, positions: Int[Array, " B"], stream: int = 0) -> jax.Array:
    """One PRNG key per row for the token at absolute position `positions[b]`."""

    def key(seed, position):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), position), stream)

    return jax.vmap(key)(sampling.seed, positions)


def sample_from(
    probs: Float[Array, "B V"],
    logits: Float[Array, "B V"],
    sampling: SamplingState,
    positions: Int[Array, " B"],
    stream: int = 0,
    *,
    any_sampled: bool = False,
) -> jax.Array:
    """Draw one token per row (int32 [B]) from `probs`; greedy rows take `argmax(logits)` exactly.
    `any_sampled` (static): as `target_probs`'s."""
    greedy = vocab_argmax(logits)

    def draw(probs):
        keys = row_keys(sampling, positions, stream)
        drawn = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs)
        return jnp.where(sampling.temperature == 0, greedy, drawn).astype(jnp.int32)

    if any_sampled:
        return draw(probs)
    return jax.lax.cond(all_greedy(sampling), lambda _: greedy, draw, probs)


def sample(
    logits: Float[Array, "B V"], sampling: SamplingState, positions: Int[Array, " B"], stream: int = 0
) -> jax.Array:
    """Draw one token per row (int32 [B]) from `target_probs(logits)`; greedy rows take the argmax exactly.

    `positions[b]` is the absolute position of the token drawn (it selects the random key, with
    `stream` separating independent uses at the same position)."""
    return sample_from(target_probs(logits, sampling), logits, sampling, positions, stream)
