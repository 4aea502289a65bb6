"""The MTP training objective: next-token loss plus the averaged loss of the D MTP depths.

    L = L_main + lambda * (1/D) * sum_{k=1..D} L_MTP_k

(DeepSeek-V3, arXiv 2412.19437 §2.2; Megatron-Core's `mtp_loss_scaling_factor` and MaxText use
lambda = 0.1 by default). Depth 0 is the main model: row i predicts t_{i+1}; depth k's row i
predicts t_{i+k+1}. Each L is a token-mean cross-entropy over the rows that have a label:

- tail: rows with i + k + 1 >= T have no label;
- padding: rows with segment id 0 are dropped (and so are labels at padding);
- document boundaries: packed rows hold documents 1, 2, ... one after another; a row whose label
  lies in another document than the row itself is dropped.

Attention in packed rows does not cross documents: both the main model and the MTP modules run
with a segment-aware causal mask (`attention.segment_attention_reference`), so a packed row gives
the same losses as its documents in separate rows (RoPE is relative, so the documents' offsets in
the row do not matter).

Training only the MTP modules (frozen main model): take gradients or build the optimizer with
`mtp.MTP_PARAMS` (e.g. `nnx.Optimizer(model, tx, wrt=MTP_PARAMS)`); `L_main` then contributes
no gradient and stays a useful metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from mtp_jax.model import Transformer
from mtp_jax.mtp import mtp_forward_full, shift_left


def label_mask(segment_ids: Int[Array, "B T"], shift: int) -> jax.Array:
    """bool [B, T]: row i has a label t_{i+shift} in its own document (i + shift < T, not padding)."""
    return (segment_ids != 0) & (shift_left(segment_ids, shift, fill=0) == segment_ids)


def cross_entropy(logits: Float[Array, "B T V"], labels: Int[Array, "B T"]) -> Float[Array, "B T"]:
    """Per-row cross-entropy `logsumexp(logits) - logits[label]` in float32, in nats."""
    logits = logits.astype(jnp.float32)
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # [B, T]
    return jax.nn.logsumexp(logits, axis=-1) - label_logits


def _masked_mean(values: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of `values` over `mask` (0 when the mask is empty), float32."""
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1).astype(jnp.float32)


def loss_from_logits(
    logits: Sequence[Float[Array, "B T V"]],
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"],
    *,
    mtp_lambda: float = 0.1,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective from precomputed logits: `logits[0]` the main model's, `logits[k]` depth k's.

    Args:
      logits: 1 + D arrays float32 [B, T, V]; `logits[k]` row i predicts t_{i+k+1}.
      tokens: int32 [B, T].
      segment_ids: int32 [B, T]; 0 = padding, packed documents numbered 1, 2, ... within a row.
      mtp_lambda: weight of the mean MTP loss (ignored when D = 0).

    Returns:
      (loss, metrics): the scalar float32 loss and a dict of scalars: "loss", "main_loss",
      f"mtp_loss_{k}" and f"mtp_agreement_{k}" for k = 1..D (the fraction of depth k's rows
      whose argmax equals the main model's argmax at row i + k, which predicts the same token,
      over depth k's labelled rows), and "num_tokens" (int32, the main loss's labelled rows).
      A depth with no labelled rows has loss and agreement 0.
    """
    main_mask = label_mask(segment_ids, 1)
    main_loss = _masked_mean(cross_entropy(logits[0], shift_left(tokens, 1)), main_mask)
    main_pred = jnp.argmax(logits[0], axis=-1)  # [B, T]
    metrics = {"main_loss": main_loss, "num_tokens": jnp.sum(main_mask).astype(jnp.int32)}
    mtp_losses = []
    for k, depth_logits in enumerate(logits[1:], start=1):
        mask = label_mask(segment_ids, k + 1)
        mtp_losses.append(_masked_mean(cross_entropy(depth_logits, shift_left(tokens, k + 1)), mask))
        agree = jnp.argmax(depth_logits, axis=-1) == shift_left(main_pred, k)  # depth k at i vs main at i + k
        metrics[f"mtp_loss_{k}"] = mtp_losses[-1]
        metrics[f"mtp_agreement_{k}"] = _masked_mean(agree.astype(jnp.float32), mask)
    loss = main_loss + mtp_lambda * jnp.mean(jnp.stack(mtp_losses)) if mtp_losses else main_loss
    metrics["loss"] = loss
    return loss, metrics


def compute_loss(
    model: Transformer, tokens: Int[Array, "B T"], segment_ids: Int[Array, "B T"], *, mtp_lambda: float = 0.1
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L = L_main + mtp_lambda * mean_k L_MTP_k over a batch of (packed) sequences.

    Runs the main model and its `model.mtp` modules with no cache and segment-aware attention,
    then `loss_from_logits` (see there for the masks and metrics).

    Args:
      model: the `Transformer` (D = `config.num_nextn_predict_layers` modules in `model.mtp`).
      tokens: int32 [B, T], ids in [0, V); token ids at padding are ignored.
      segment_ids: int32 [B, T]; 0 = padding, packed documents numbered 1, 2, ... within a row.
      mtp_lambda: weight of the mean MTP loss; 0.1 as in Megatron-Core and MaxText.

    Returns:
      (loss float32 scalar, metrics dict), as `loss_from_logits`.
    """
    logits, hidden = model.forward_full(tokens, segment_ids)
    mtp_logits = mtp_forward_full(model, hidden, tokens, segment_ids)
    return loss_from_logits([logits, *mtp_logits], tokens, segment_ids, mtp_lambda=mtp_lambda)
