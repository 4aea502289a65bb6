"""The MTP training objective: next-token loss plus the weighted loss of the D MTP depths.

    L = L_main + lambda * sum_{k=1..D} w_k L_MTP_k,   w_k = 1/D by default

(DeepSeek-V3, arXiv 2412.19437 §2.2, with the mean over depths; Megatron-Core's `mtp_loss_scaling_factor`
and MaxText use lambda = 0.1 by default; FastMTP's decaying weights w_k ~ beta^(k-1): `depth_weights`).
Depth k's labels are the data's tokens, or (self-distillation, `mtp_targets="self"`) the main head's own
greedy tokens, so the heads learn what a strict-greedy verify accepts. The metrics include the
simulated acceptance of each depth (NeMo's: depth k's predictions scored against the main head's
greedy tokens, chained over depths 1..k, from the same forward).

Depth 0 is the main model: row i predicts t_{i+1}; depth k's row i predicts t_{i+k+1}. Each L is a
token-mean cross-entropy over the rows that have a label:

- tail: rows with i + k + 1 >= T have no label;
- padding: rows with segment id 0 are dropped (and so are labels at padding);
- document boundaries: packed rows hold documents 1, 2, ... one after another; a row whose label
  lies in another document than the row itself is dropped.

Attention in packed rows does not cross documents: both the main model and the MTP modules run
with a segment-aware causal mask (`attention.segment_mask`, GQA and MLA alike), so a packed row gives
the same losses as its documents in separate rows (RoPE is relative, so the documents' offsets in
the row do not matter).

Training only the MTP modules (frozen main model): take gradients or build the optimizer with
`mtp.MTP_PARAMS` (e.g. `nnx.Optimizer(model, tx, wrt=MTP_PARAMS)`); `L_main` then contributes
no gradient and stays a useful metric.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from mtp_jax.model import Transformer
from mtp_jax.mtp import mtp_forward_full, shift_left
from mtp_jax.training.balance import capture_routing, routing_terms


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


MTP_TARGETS = ("data", "self")  # what depth k's rows are trained to predict: the data's tokens, or the main head's


def depth_weights(
    num_depths: int, weights: Sequence[float] | None = None, decay: float | None = None
) -> tuple[float, ...]:
    """The weight w_k of each MTP depth k = 1..D in `L_main + lambda * sum_k w_k L_MTP_k`.

    Default 1/D each (DeepSeek-V3's mean). `weights`: the D weights as given (not normalised).
    `decay` (FastMTP, 2025): w_k = beta^(k-1) / sum_j beta^(j-1), e.g. beta = 0.6 and D = 3
    give [0.51, 0.31, 0.18]. Raises ValueError for both given, a weights list whose length is not D,
    a negative weight or weights summing to 0, or a decay outside (0, 1].
    """
    if weights is not None and decay is not None:
        raise ValueError("give mtp_depth_weights or mtp_depth_decay, not both")
    if weights is not None:
        weights = tuple(float(w) for w in weights)
        if len(weights) != num_depths:
            raise ValueError(f"mtp_depth_weights has {len(weights)} weights; the model has {num_depths} MTP depths")
        if not weights:  # no MTP depths
            return ()
        if any(not w >= 0 for w in weights) or not sum(weights) > 0:
            raise ValueError(f"mtp_depth_weights must be >= 0 and not all 0, got {list(weights)}")
        return weights
    if decay is not None:
        if not 0 < decay <= 1:
            raise ValueError(f"mtp_depth_decay must be in (0, 1], got {decay}")
        powers = [decay**k for k in range(num_depths)]
        return tuple(p / sum(powers) for p in powers)
    return (1.0 / num_depths,) * num_depths if num_depths else ()


def loss_from_logits(
    logits: Sequence[Float[Array, "B T V"]],
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"],
    *,
    mtp_lambda: float = 0.1,
    mtp_weights: Sequence[float] | None = None,
    mtp_targets: str = "data",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The objective from precomputed logits: `logits[0]` the main model's, `logits[k]` depth k's.

    Args:
      logits: 1 + D arrays float32 [B, T, V]; `logits[k]` row i predicts t_{i+k+1}.
      tokens: int32 [B, T].
      segment_ids: int32 [B, T]; 0 = padding, packed documents numbered 1, 2, ... within a row.
      mtp_lambda: weight of the weighted MTP loss (ignored when D = 0).
      mtp_weights: D per-depth weights w_k (`depth_weights`); None: 1/D each.
      mtp_targets: "data": depth k's row i is trained on the data's t_{i+k+1}; "self"
        (self-distillation): on the main head's own greedy token for that position, the argmax of
        `logits[0]` at row i + k: what a strict-greedy verify accepts. Same rows either way.

    Returns:
      (loss, metrics): the scalar float32 loss and a dict of scalars: "loss", "main_loss",
      and for k = 1..D: f"mtp_loss_{k}" (against `mtp_targets`), f"mtp_agreement_{k}" (the
      fraction of depth k's rows whose argmax equals the main model's argmax at row i + k, which
      predicts the same token) and f"mtp_acceptance_{k}" (simulated acceptance: the fraction of
      depth k's rows where depths 1..k all agree, i.e. the chance that a strict-greedy MTP Vanilla
      step starting there accepts k drafts; NeMo's training metric), each over depth k's labelled
      rows; and "num_tokens" (int32, the main loss's labelled rows). A depth with no labelled rows
      has 0s. `simulated_acceptance_length` turns the acceptances into a mean acceptance length.
    """
    if mtp_targets not in MTP_TARGETS:
        raise ValueError(f"mtp_targets must be one of {MTP_TARGETS}, got {mtp_targets!r}")
    num_depths = len(logits) - 1
    weights = depth_weights(num_depths, mtp_weights)
    main_mask = label_mask(segment_ids, 1)
    main_loss = _masked_mean(cross_entropy(logits[0], shift_left(tokens, 1)), main_mask)
    main_pred = jax.lax.stop_gradient(jnp.argmax(logits[0], axis=-1).astype(tokens.dtype))  # [B, T]
    metrics = {"main_loss": main_loss, "num_tokens": jnp.sum(main_mask).astype(jnp.int32)}
    mtp_loss = jnp.float32(0.0)
    for k, depth_logits in enumerate(logits[1:], start=1):
        mask = label_mask(segment_ids, k + 1)
        target = shift_left(main_pred if mtp_targets == "self" else tokens, k if mtp_targets == "self" else k + 1)
        metrics[f"mtp_loss_{k}"] = _masked_mean(cross_entropy(depth_logits, target), mask)
        mtp_loss = mtp_loss + weights[k - 1] * metrics[f"mtp_loss_{k}"]
    metrics.update(simulated_acceptance(main_pred, logits[1:], segment_ids))
    loss = main_loss + mtp_lambda * mtp_loss if num_depths else main_loss
    metrics["loss"] = loss
    return loss, metrics


def simulated_acceptance(
    main_pred: Int[Array, "B T"],
    draft_logits: Sequence[Float[Array, "B T V"]],
    segment_ids: Int[Array, "B T"],
    prefix: str = "mtp",
) -> dict[str, jax.Array]:
    """Per-depth agreement and simulated acceptance of drafts against the main head's greedy tokens.

    Args:
      main_pred: int [B, T], the main head's argmax at each row (row i's predicts t_{i+1}).
      draft_logits: K arrays float [B, T, V]; `draft_logits[k - 1]` row i drafts t_{i+k+1} (MTP depth
        k, or the k-th pass of the MTP Eagle chain), teacher-forced on the sequence's tokens.
      segment_ids: int32 [B, T] (`label_mask`: draft k counts over rows with a label k + 1 ahead).
      prefix: the metrics' prefix.

    Returns float32 scalars, for k = 1..K: f"{prefix}_agreement_{k}" (draft k == main_pred at row i + k)
    and f"{prefix}_acceptance_{k}" (drafts 1..k all agree: a strict-greedy step that starts at row i,
    where the main head commits main_pred[i] and verifies the drafts, accepts k or more of them), each
    the mean over draft k's rows. On the model's own greedy output (tokens = main_pred shifted) this is
    exactly what live drafting sees; on other text the drafts read the text's tokens (NeMo's metric,
    no extra forward).
    """
    out = {}
    agreements = _agreements(main_pred, draft_logits)
    for k, (agree, chain) in enumerate(zip(agreements, _chained(agreements), strict=True), start=1):
        mask = label_mask(segment_ids, k + 1)
        out[f"{prefix}_agreement_{k}"] = _masked_mean(agree.astype(jnp.float32), mask)
        out[f"{prefix}_acceptance_{k}"] = _masked_mean(chain.astype(jnp.float32), mask)
    return out


def acceptance_chains(
    main_pred: Int[Array, "B T"], draft_logits: Sequence[Float[Array, "B T V"]]
) -> list[Bool[Array, "B T"]]:
    """bool [B, T] per draft k = 1..K: at row i, drafts 1..k all equal the main head's argmax at rows
    i + 1 .. i + k (draft j at row i predicts t_{i+j+1}, which main_pred[i + j] predicts too), i.e. a
    strict-greedy step starting at row i accepts at least k drafts. Unmasked: rows near the end of a
    sequence or document compare against what follows it."""
    return _chained(_agreements(main_pred, draft_logits))


def _agreements(
    main_pred: Int[Array, "B T"], draft_logits: Sequence[Float[Array, "B T V"]]
) -> list[Bool[Array, "B T"]]:
    """bool [B, T] per draft k = 1..K: draft k's argmax at row i equals main_pred at row i + k."""
    return [jnp.argmax(logits, axis=-1) == shift_left(main_pred, k) for k, logits in enumerate(draft_logits, start=1)]


def _chained(agreements: Sequence[Bool[Array, "B T"]]) -> list[Bool[Array, "B T"]]:
    """The running AND of `agreements`: entry k is True where agreements 1..k all are."""
    return list(itertools.accumulate(agreements, operator.and_))


def simulated_acceptance_length(metrics: dict, num_drafts: int, prefix: str = "mtp") -> float:
    """The mean acceptance length (tokens committed per step, the bonus token included) that the
    simulated acceptances `metrics[f"{prefix}_acceptance_{k}"]` imply for K = `num_drafts` drafts:
    1 + sum_{k <= K} acceptance_k. Raises KeyError when a depth <= K is missing."""
    return 1.0 + sum(float(metrics[f"{prefix}_acceptance_{k}"]) for k in range(1, num_drafts + 1))


def compute_loss(
    model: Transformer,
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"],
    *,
    mtp_lambda: float = 0.1,
    mtp_weights: Sequence[float] | None = None,
    mtp_targets: str = "data",
    balance_alpha: float = 0.0,
    routing_metrics: bool = False,
    mtp_only: bool = False,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """L = L_main + mtp_lambda * sum_k w_k L_MTP_k over a batch of (packed) sequences.

    Runs the main model and its `model.mtp` modules with no cache and segment-aware attention,
    then `loss_from_logits` (see there for the masks and metrics).

    Args:
      model: the `Transformer` (D = `config.num_nextn_predict_layers` modules in `model.mtp`).
      tokens: int32 [B, T], ids in [0, V); token ids at padding are ignored.
      segment_ids: int32 [B, T]; 0 = padding, packed documents numbered 1, 2, ... within a row.
      mtp_lambda: weight of the weighted MTP loss; 0.1 as in Megatron-Core and MaxText.
      mtp_weights, mtp_targets: as `loss_from_logits` (default: the mean over depths, the data's tokens).
      balance_alpha: alpha of DeepSeek-V3's sequence-wise balance loss (§2.1.2, eq. 17): adds
        alpha * `balance.routing_terms`'s mean over the MoE layers (0: none; V3 used 0.0001).
      routing_metrics: add the MoE routers' load metrics (`balance.routing_terms`:
        "expert_load_max_over_mean", "expert_load" {router: int32 [R] or [n, R]}, and with
        balance_alpha > 0 "balance_loss", sum_i f_i P_i unweighted); a model without MoE layers adds
        none. Implied by balance_alpha > 0.
      mtp_only: the balance loss averages over the MTP modules' MoE layers only (the ones trained).

    Returns:
      (loss float32 scalar, metrics dict), as `loss_from_logits` ("loss" with the balance term).
    """

    def forward(model: Transformer) -> list[jax.Array]:
        logits, hidden = model.forward_full(tokens, segment_ids)
        return [logits, *mtp_forward_full(model, hidden, tokens, segment_ids)]

    routing = None
    if routing_metrics or balance_alpha:  # every MoE router records its choice (`balance.capture_routing`)
        all_logits, routing = capture_routing(forward)(model)
    else:
        all_logits = forward(model)
    loss, metrics = loss_from_logits(
        all_logits,
        tokens,
        segment_ids,
        mtp_lambda=mtp_lambda,
        mtp_weights=mtp_weights,
        mtp_targets=mtp_targets,
    )
    if routing is None:
        return loss, metrics
    balance, balance_metrics = routing_terms(routing, segment_ids, with_loss=balance_alpha > 0, mtp_only=mtp_only)
    if balance is not None:
        loss = loss + balance_alpha * balance
    return loss, {**metrics, **balance_metrics, "loss": loss}
