"""Acceptance: which drafts a verify pass keeps, and the token emitted after them (`docs/MTP_SPEC.md`).

Draft d_j is accepted when `u_j * q_j(d_j) < p_{j-1}(d_j)`, u_j uniform in [0, 1) (Leviathan et
al. 2023, Chen et al. 2023): with greedy targets and drafts this is exactly `d_j == argmax p_{j-1}`
(strict acceptance), and a zero-probability draft is never accepted. At the first rejection the
row emits a sample of `norm(max(0, p - q))`, after K acceptances a bonus sample of p_K; greedy
rows take the argmax. With no drafts (K = 0, plain decoding) that is a sample of p_0, drawn with
the very key plain sampling uses. Optionally TensorRT-LLM's relaxed acceptance in a reasoning
model's thinking phase (greedy rows only; lossy by design).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from mtp_jax.cpu_extension import reads_vocab, vocab_stats
from mtp_jax.decode.grammar_mask import apply_token_bitmask
from mtp_jax.decode.sampling import (
    STREAM_ACCEPT,
    STREAM_TARGET,
    SamplingMetadata,
    SamplingState,
    all_greedy,
    process_logits,
    row_keys,
    sample_from,
    target_probs,
)
from mtp_jax.sharding import vocab_argmax

if TYPE_CHECKING:
    from mtp_jax.decode.speculative import SpeculativeConfig


@struct.dataclass
class Target:
    """The target distributions of a forward's T outputs, with what every step reads of them computed once.

    raw: [B, T, V], the model's logits (its dtype). logits: float32 [B, T, V], the processed ones
    (`process_logits`: logit bias, min_tokens, penalties; a grammar's mask). argmax: int32 [B, T],
    `vocab_argmax(logits)`, a greedy row's token. peak, log_sum: float32 [B, T, 1], the raw log-softmax's
    max and log-sum-exp: `log_softmax(raw) = (raw - peak) - log_sum`, bit for bit `jax.nn.log_softmax`'s on
    XLA (on the CPU with the extension, `cpu_extension.vocab_stats`: the sum in another order).
    sampling: the rows' parameters, for `probs`.

    The raw log-softmax is what results report (vLLM's `raw_logprobs`) and relaxed acceptance compares;
    a step reads it only at the committed tokens (`logprobs_at`), so the [B, T, V] array is never built
    unless top logprobs or relaxed acceptance ask for it (`log_softmax`); likewise `probs`, which
    all-greedy batches never need.
    """

    raw: jax.Array
    logits: jax.Array
    argmax: jax.Array
    peak: jax.Array
    log_sum: jax.Array
    sampling: SamplingState

    @classmethod
    def from_logits(
        cls,
        logits: jax.Array,
        metadata: SamplingMetadata,
        drafts: jax.Array | None = None,
        token_bitmask: jax.Array | None = None,
    ) -> Target:
        """The targets of raw `logits` [B, T, V] at positions L .. L + T - 1, preceded by the committed tokens
        (`metadata`) and `drafts[:, :t]` (int32 [B, T - 1], the verify window's; None for T = 1); tokens a
        grammar forbids at position t (`token_bitmask`, int32 [B, T, ceil(V / 32)], structured output) at -inf."""
        processed = process_logits(logits, metadata, drafts)
        if token_bitmask is not None:
            processed = apply_token_bitmask(processed, token_bitmask)
        if reads_vocab():  # on the CPU with the extension: one pass over each row for the three
            return cls(logits, processed, *vocab_stats(processed, logits), metadata.sampling)
        raw = logits.astype(jnp.float32)
        peak = jnp.max(raw, axis=-1, keepdims=True)
        log_sum = jnp.log(jnp.sum(jnp.exp(raw - peak), axis=-1, keepdims=True))
        return cls(logits, processed, vocab_argmax(processed), peak, log_sum, metadata.sampling)

    def probs(self, any_sampled: bool = False) -> jax.Array:
        """`target_probs(logits)` (temperature, min-p, top-k, top-p; one-hot for greedy rows): float32 [B, T, V],
        what acceptance and sampling draw from (`any_sampled`: as `target_probs`'s)."""
        return target_probs(self.logits, self.sampling, any_sampled=any_sampled)

    def log_softmax(self) -> jax.Array:
        """The raw log-softmax, float32 [B, T, V]."""
        return (self.raw.astype(jnp.float32) - self.peak) - self.log_sum

    def logprobs_at(self, tokens: jax.Array) -> jax.Array:
        """Raw log-probability of `tokens` (int32 [B, T]) under output t: float32 [B, T]."""
        at = jnp.take_along_axis(self.raw, tokens[..., None], axis=-1).astype(jnp.float32)
        return ((at - self.peak) - self.log_sum)[..., 0]


def phase_after(thinking: jax.Array, token: jax.Array, speculative: SpeculativeConfig) -> jax.Array:
    """The thinking phase after `token` (bool [B]) given the phase before it."""
    thinking = jnp.where(token == speculative.think_start_token_id, True, thinking)
    return jnp.where(token == speculative.think_end_token_id, False, thinking)


def update_phase(
    speculative: SpeculativeConfig | None, thinking: jax.Array, tokens: jax.Array, num: jax.Array
) -> jax.Array:
    """The thinking phase (bool [B]) after committing `tokens[:, :num]` (int32 [B, N], num int32 [B]).
    Tracked only under relaxed acceptance; unchanged otherwise."""
    if speculative is None or not speculative.relaxed:
        return thinking
    for j in range(tokens.shape[1]):
        thinking = jnp.where(j < num, phase_after(thinking, tokens[:, j], speculative), thinking)
    return thinking


def initial_phase(prompt: Sequence[int], speculative: SpeculativeConfig | None) -> bool:
    """Whether a prompt ends inside a thinking phase (only tracked under relaxed acceptance)."""
    phase = False
    if speculative is not None and speculative.relaxed:
        for token in prompt:
            if token in (speculative.think_start_token_id, speculative.think_end_token_id):
                phase = token == speculative.think_start_token_id
    return phase


@jax.named_scope("accept")
def accept(
    speculative: SpeculativeConfig | None,
    target: Target,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    sampling: SamplingState,
    lengths: jax.Array,
    thinking: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Speculative acceptance for a batch.

    Args:
      speculative: the speculative configuration (relaxed acceptance), or None (K = 0).
      target: the verify forward's K+1 outputs (output j is the target for position L + j).
      draft_tokens: int32 [B, K] in [0, V), K >= 0. draft_probs: q, float32 [B, K, V], or [B, K, 0] for
        greedy drafts (q one-hot at the draft).
      sampling: the rows' sampling parameters. lengths: L, int32 [B].
      thinking: bool [B], the phase after token L - 1 (relaxed acceptance).

    Returns:
      num_accepted a (int32 [B], 0..K) and the token emitted after the accepted prefix (int32 [B],
      for position L + a, drawn with `row_keys(sampling, L + a, STREAM_TARGET)`): a sample of
      norm(max(0, p_a - q_{a+1})) after a rejection, of p_K after full acceptance; the argmax of
      the processed logits for greedy rows.
    """
    batch, num_drafts = draft_tokens.shape
    greedy_batch = all_greedy(sampling)  # then p is one-hot at the argmax and nothing over the vocabulary is needed
    if num_drafts == 0:
        zero = jnp.zeros((batch,), jnp.int32)
        return zero, jax.lax.cond(
            greedy_batch,
            lambda: target.argmax[:, 0],
            lambda: sample_from(
                target.probs(any_sampled=True)[:, 0],
                target.logits[:, 0],
                sampling,
                lengths,
                STREAM_TARGET,
                any_sampled=True,
            ),
        )
    relaxed_ok = _relaxed(speculative, target, draft_tokens, sampling, thinking) if speculative.relaxed else None

    def prefix(accepted):  # [B, K] -> int32 [B]: the drafts accepted before the first rejection
        accepted = accepted if relaxed_ok is None else accepted | relaxed_ok
        return jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)

    def greedy(_):  # u = 0, q = 1, p one-hot: a draft is accepted when it is the argmax, the token is the argmax
        num_accepted = prefix(draft_tokens == target.argmax[:, :num_drafts])
        return num_accepted, jnp.take_along_axis(target.argmax, num_accepted[:, None], axis=1)[:, 0]

    def general(_):
        return _accept_sampled(target, draft_tokens, draft_probs, sampling, lengths, prefix)

    num_accepted, token = jax.lax.cond(greedy_batch, greedy, general, None)
    return num_accepted.astype(jnp.int32), token


def _relaxed(
    speculative: SpeculativeConfig,
    target: Target,
    draft_tokens: jax.Array,
    sampling: SamplingState,
    thinking: jax.Array,
) -> jax.Array:
    """TensorRT-LLM's relaxed acceptance (bool [B, K]): draft j is in the top N of the raw softmax and within
    delta of its top probability, in a thinking phase, on a greedy row."""
    num_drafts = draft_tokens.shape[1]
    probs = jnp.exp(target.log_softmax()[:, :num_drafts])  # [B, K, V], softmax of the raw logits
    top = jax.lax.top_k(probs, speculative.relaxed_top_n)[0]  # [B, K, N]
    prob_draft = jnp.take_along_axis(probs, draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
    relaxed_ok = (prob_draft >= top[..., -1]) & (prob_draft >= top[..., 0] - speculative.relaxed_delta)
    phase, in_phase = thinking, []
    for j in range(num_drafts):  # a </think> accepted at j makes drafts after it strict
        in_phase.append(phase)
        phase = phase_after(phase, draft_tokens[:, j], speculative)
    return relaxed_ok & jnp.stack(in_phase, axis=1) & (sampling.temperature == 0)[:, None]


def _accept_sampled(target, draft_tokens, draft_probs, sampling, lengths, prefix) -> tuple[jax.Array, jax.Array]:
    """`accept` for a batch with a sampled row: the test `u_j * q_j(d_j) < p_{j-1}(d_j)`, then the token after
    the accepted prefix (`prefix`: [B, K] accepted -> int32 [B]) from the residual or p_K."""
    num_drafts = draft_tokens.shape[1]
    p, logits = target.probs(any_sampled=True), target.logits  # [B, K+1, V]; the batch has a sampled row
    greedy_drafts = draft_probs.shape[-1] == 0
    p_draft = jnp.take_along_axis(p[:, :num_drafts], draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
    q_draft = (
        jnp.ones_like(p_draft)
        if greedy_drafts
        else jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    )  # [B, K]
    positions = lengths[:, None] + jnp.arange(num_drafts)[None, :]  # [B, K]
    keys = jax.vmap(lambda pos: row_keys(sampling, pos, STREAM_ACCEPT), in_axes=1, out_axes=1)(positions)
    uniforms = jax.vmap(jax.vmap(jax.random.uniform))(keys)  # [B, K], one per draft
    num_accepted = prefix(uniforms * q_draft < p_draft)  # [B]; p = 0 is never accepted, even for u = 0
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
    token = sample_from(residual, logits_at, sampling, lengths + num_accepted, STREAM_TARGET, any_sampled=True)
    return num_accepted, token
