"""Per-row sampling: temperature, top-k, top-p (nucleus), greedy; reproducible per-row seeds.

One function, `target_probs`, turns logits into the distribution a row samples from. The plain
sampler draws from it and the speculative acceptance uses the very same function for its target p,
which is what makes rejection sampling lossless (`docs/MTP_SPEC.md`, "Acceptance").

Order, as in Hugging Face's and vLLM's samplers: the logit bias (`apply_logit_bias`, added to the raw
logits before anything else), temperature, then top-k, then top-p. Greedy rows (temperature 0) get a
one-hot distribution at the argmax (lowest index on ties).
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

from mtp_jax.validation import is_int, is_real

MAX_SEED = 2**32 - 1  # seeds are uint32 on device
MAX_TOP_K = 2**31 - 1  # top_k is int32 on device
MAX_LOGIT_BIAS = 300  # entries of one row's logit bias, as OpenAI's API
LOGIT_BIAS_RANGE = 100.0  # |bias| at most this, as OpenAI's API
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

    Python or NumPy numbers are accepted; a bool is not a number here. Raises TypeError for a
    value of the wrong type and ValueError for one out of range, naming the field.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()

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
        for name in ("temperature", "top_p"):
            if not is_real(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
        for name in ("top_k", "seed"):
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@struct.dataclass
class SamplingState:
    """Device arrays of per-row sampling parameters, each of shape [B]."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32, 0 = off
    top_p: jax.Array  # float32, 1 = off
    seed: jax.Array  # uint32
    bias_tokens: jax.Array  # int32 [B, MAX_LOGIT_BIAS]: the logit bias's token ids, -1 = unused
    bias_values: jax.Array  # float32 [B, MAX_LOGIT_BIAS]

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


def apply_logit_bias(logits: Float[Array, "B *T V"], sampling: SamplingState) -> Float[Array, "B *T V"]:
    """`logits` (float32) with each row's logit bias added at every position. Built per row (vmap: a batch
    sharded over devices scatters locally) and always (a condition on any row's bias would be one more
    collective per step on a mesh; the add is small beside the head's matmul)."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape[0], logits.shape[-1]
    ids = jnp.where(sampling.bias_tokens >= 0, sampling.bias_tokens, vocab)  # unused: past the end, dropped

    def row(ids, values):
        return jnp.zeros((vocab,), jnp.float32).at[ids].add(values, mode="drop")

    bias = jax.vmap(row)(ids, sampling.bias_values)  # [B, V]
    return logits + bias.reshape(batch, *([1] * (logits.ndim - 2)), vocab)


def all_greedy(sampling: SamplingState) -> jax.Array:
    """True (a bool scalar) when every row decodes greedily: the cheap paths apply."""
    return jnp.all(sampling.temperature == 0)


def target_probs(logits: Float[Array, "B *T V"], sampling: SamplingState) -> Float[Array, "B *T V"]:
    """The distribution each row samples from: float32 probabilities, same shape as `logits`.

    Temperature, then top-k, then top-p; greedy rows (temperature 0) are one-hot at the argmax.
    The logits are shifted by their row max before the division, so any temperature > 0, however
    small, gives a distribution (as it tends to 0: uniform over the tied maxima).
    Tokens outside the top-k / top-p set have probability exactly 0. The sort that top-k / top-p
    need runs only when some row uses them (`lax.cond`; shapes stay fixed).
    """
    logits = logits.astype(jnp.float32)
    ndim = logits.ndim
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)

    def sampled(logits):
        temperature = _expand(sampling.temperature, ndim)
        greedy = temperature == 0
        # Shift by the row max before scaling: every value is <= 0, so a tiny temperature overflows
        # only to -inf (probability 0), never to inf - inf = NaN; the argmax (ties split) keeps 0.
        # The divisor is at least float32's smallest normal number, which no device flushes to zero.
        shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
        scaled = shifted / jnp.where(greedy, 1.0, jnp.maximum(temperature, jnp.finfo(jnp.float32).tiny))
        filtering = jnp.any(sampling.top_k > 0) | jnp.any(sampling.top_p < 1)
        scaled = jax.lax.cond(filtering, _filter_top_k_top_p, lambda x, _: x, scaled, sampling)
        return jnp.where(greedy, one_hot, jax.nn.softmax(scaled, axis=-1))

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
) -> jax.Array:
    """Draw one token per row (int32 [B]) from `probs`; greedy rows take `argmax(logits)` exactly."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(probs):
        keys = row_keys(sampling, positions, stream)
        drawn = jax.vmap(lambda k, p: jax.random.categorical(k, jnp.log(p)))(keys, probs)
        return jnp.where(sampling.temperature == 0, greedy, drawn).astype(jnp.int32)

    return jax.lax.cond(all_greedy(sampling), lambda _: greedy, draw, probs)


def sample(
    logits: Float[Array, "B V"], sampling: SamplingState, positions: Int[Array, " B"], stream: int = 0
) -> jax.Array:
    """Draw one token per row (int32 [B]) from `target_probs(logits)`; greedy rows take the argmax exactly.

    `positions[b]` is the absolute position of the token drawn (it selects the random key, with
    `stream` separating independent uses at the same position)."""
    return sample_from(target_probs(logits, sampling), logits, sampling, positions, stream)
