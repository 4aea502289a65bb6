"""DeepSeek-V3's MoE load balancing in training (arXiv 2412.19437 §2.1.2): the bias update of
auxiliary-loss-free balancing, the complementary sequence-wise balance loss, and the per-expert load.

Every MoE router records its choice when the forward runs under `nnx.capture(fn, RoutingStats)`
(`mtp_jax.layers.moe.Routing`: unbiased scores s [N, R] and chosen experts [N, k]; a scanned layer stack
records its layers' stacked, [n, N, R] and [n, N, k]). From those and the batch's segment ids:

- load: `expert_load`, the number of the batch's non-padding tokens (segment id != 0) routed to each expert,
  counted over the k choices of each token;
- bias update (after eq. 16: "at the end of each step, we decrease the bias term by gamma if its
  corresponding expert is overloaded and increase it by gamma if its corresponding expert is underloaded"):
  `update_bias`, b_i <- b_i - gamma * sign(load_i - mean_j load_j); an expert at the mean keeps its bias;
- sequence-wise balance loss (eqs. 17-20): `sequence_balance_loss`, per sequence (one packed document: a
  maximal run of one non-zero segment id in a row; padding excluded) with T its tokens,

      f_i = R / (k T) * sum_t 1[expert i chosen for token t]          (eq. 18; no gradient)
      s'_{i,t} = s_{i,t} / sum_j s_{j,t}                               (eq. 19; unbiased scores)
      P_i = (1/T) sum_t s'_{i,t}                                       (eq. 20)
      L_Bal = alpha * sum_i f_i P_i                                    (eq. 17)

  "chosen" is the router's actual choice (bias and group limit applied: eq. 17's Topk as the routing made
  it, as Megatron-Core's `seq_aux_loss` does). `sequence_balance_loss` is sum_i f_i P_i averaged over the
  sequences (each counts once, whatever its length), 1 for a perfectly balanced sequence; `routing_terms`
  averages it over the MoE layers (each router call once) and the training loss adds alpha times that: a
  mean, so alpha does not scale with depth (Megatron-Core adds each layer's term, a sum over layers); with
  `mtp_only` over the MTP modules' layers only (the main model's routers are not trained).

Letters: B rows, T positions per row, N = B * T tokens (row-major, as `MoE` flattens them), R routed experts,
k experts per token.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.layers.moe import Routing, RoutingStats


def expert_load(indices: Int[Array, "... N k"], segment_ids: Int[Array, "B T"], num_experts: int) -> jax.Array:
    """int32 [..., R]: how many of the non-padding tokens (segment id != 0) chose each expert, over the k
    choices of each token (so the R counts sum to k times the non-padding tokens). `indices` are the router's
    choices [..., N, k] for the N = B * T tokens of `segment_ids` (row-major), any leading (layer) axes kept."""
    valid = (segment_ids != 0).reshape(-1)  # [N]
    chosen = jnp.where(valid[:, None], indices, num_experts)  # [..., N, k], padding -> the extra bin R
    flat = chosen.reshape(-1, chosen.shape[-2] * chosen.shape[-1])  # [L, N*k]
    counts = jax.vmap(lambda x: jnp.bincount(x, length=num_experts + 1)[:num_experts])(flat)  # [L, R]
    return counts.reshape(*indices.shape[:-2], num_experts).astype(jnp.int32)


def update_bias(bias: Float[Array, "... R"], load: Int[Array, "... R"], speed: float) -> jax.Array:
    """DeepSeek-V3's bias update (§2.1.2, after eq. 16): `bias - speed * sign(load - mean(load))` over the
    last axis (R experts; any leading axes are layers, each with its own mean), in bias's dtype.

    An expert above the mean load goes down by exactly `speed`, one below up by `speed`, one at the mean
    is unchanged. The comparison is exact integer arithmetic (load_i > total / R without dividing).
    """
    num_experts = load.shape[-1]
    load = load.astype(jnp.int32)
    total = load.sum(-1, keepdims=True)  # [..., 1]
    quotient, remainder = total // num_experts, total % num_experts  # mean = quotient + remainder / R
    above = load > quotient
    below = (load < quotient) | ((load == quotient) & (remainder > 0))
    direction = above.astype(jnp.int32) - below.astype(jnp.int32)  # [..., R], sign(load - mean)
    return bias - jnp.asarray(speed, bias.dtype) * direction.astype(bias.dtype)


def documents(segment_ids: Int[Array, "B T"]) -> Int[Array, " N"]:
    """int32 [N]: the index of each token's sequence in the batch, a new one wherever a row starts or its
    segment id changes (packed documents are runs of one id; padding forms runs of its own)."""
    batch = segment_ids.shape[0]
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )  # [B, T]
    return jnp.cumsum(starts.reshape(-1)).astype(jnp.int32) - 1


def sequence_balance_loss(
    scores: Float[Array, "N R"], indices: Int[Array, "N k"], segment_ids: Int[Array, "B T"]
) -> jax.Array:
    """sum_i f_i P_i of DeepSeek-V3's sequence-wise balance loss (eqs. 17-20, without alpha), float32 scalar,
    averaged over the batch's sequences (`documents`: packed documents each count once; padding is left out;
    0 for a batch of padding only).

    Args:
      scores: the router's unbiased affinities s [N, R] (`moe.affinities`; normalised here, eq. 19).
      indices: the chosen experts [N, k] (the router's choice: bias and group limit applied).
      segment_ids: int32 [B, T] with N = B * T (row-major); 0 = padding.

    The gradient flows through P (the scores) only: f counts choices.
    """
    num_experts, top_k = scores.shape[-1], indices.shape[-1]
    num_tokens = scores.shape[0]
    valid = (segment_ids != 0).reshape(-1, 1)  # [N, 1]
    doc = documents(segment_ids)  # [N]
    chosen = jax.nn.one_hot(indices, num_experts, dtype=jnp.float32).sum(-2)  # [N, R], 1 where chosen
    normed = scores / scores.sum(-1, keepdims=True)  # [N, R], s'
    counts = jax.ops.segment_sum(jnp.where(valid, chosen, 0.0), doc, num_tokens)  # [N docs at most, R]
    affinity = jax.ops.segment_sum(jnp.where(valid, normed, 0.0), doc, num_tokens)  # [N, R]
    length = jax.ops.segment_sum(valid[:, 0].astype(jnp.float32), doc, num_tokens)  # [N], tokens per sequence
    per_token = 1.0 / jnp.maximum(length, 1.0)[:, None]  # [N, 1]
    f = jax.lax.stop_gradient(counts * per_token * (num_experts / top_k))  # [N, R], eq. 18
    p = affinity * per_token  # [N, R], eq. 20
    is_sequence = length > 0  # [N]
    per_sequence = jnp.where(is_sequence, (f * p).sum(-1), 0.0)  # [N]
    return per_sequence.sum() / jnp.maximum(is_sequence.sum(), 1).astype(jnp.float32)


def router_name(path: tuple) -> str:
    """A router's name in `expert_load` dicts: its module path joined by "/", e.g. "layers/3/mlp/gate",
    "layer_groups/1/layer/mlp/gate" (a stack: loads [n, R]) or "mtp/0/mlp/gate"."""
    return "/".join(str(part) for part in path)


def routing_records(routing: nnx.State) -> list[tuple[str, Routing]]:
    """(router name, `Routing`) of every call recorded in a `nnx.capture(fn, RoutingStats)` state, in path order."""
    return [
        (router_name(path[:-1]), record)
        for path, variable in nnx.to_flat_state(routing)
        for record in variable.get_value()
    ]


def routing_terms(
    routing: nnx.State, segment_ids: Int[Array, "B T"], *, with_loss: bool = True, mtp_only: bool = False
) -> tuple[jax.Array | None, dict]:
    """The balance loss and the load metrics of the router calls recorded in `routing`.

    Returns (balance, metrics): balance is `sequence_balance_loss` averaged over the recorded MoE layers (a
    stack's n layers count n times; with `mtp_only` over the MTP modules' layers only, the ones trained),
    float32, None when there is none or without `with_loss` (the loads alone need only the choices, not
    the [N, R] scores); metrics {"balance_loss": balance (when not None),
    "expert_load_max_over_mean": float32, the largest over all layers of max_i load_i / mean_i load_i (1 is
    perfect balance, R / k the worst), "expert_load": {router name: int32 [R] or, for a stack, [n, R]}}
    ({} without records).
    """
    records = routing_records(routing)
    if not records:
        return None, {}
    loads: dict[str, jax.Array] = {}
    ratios, balances = [], []
    for name, record in records:
        num_experts = record.scores.shape[-1]
        load = expert_load(record.indices, segment_ids, num_experts)  # [..., R]
        loads[name] = loads[name] + load if name in loads else load
        mean = load.sum(-1).astype(jnp.float32) / num_experts  # [...]
        ratios.append(jnp.ravel(load.max(-1) / jnp.maximum(mean, 1e-9)))
        if not with_loss or (mtp_only and not name.startswith("mtp/")):
            continue
        scores = record.scores.reshape(-1, *record.scores.shape[-2:])  # [L, N, R]
        indices = record.indices.reshape(-1, *record.indices.shape[-2:])  # [L, N, k]
        balances.append(jax.vmap(sequence_balance_loss, in_axes=(0, 0, None))(scores, indices, segment_ids))
    metrics = {"expert_load_max_over_mean": jnp.concatenate(ratios).max(), "expert_load": loads}
    if not balances:
        return None, metrics
    balance = jnp.concatenate(balances).mean()
    return balance, {"balance_loss": balance, **metrics}


def update_biases(bias: nnx.State, loads: Mapping[str, jax.Array], speed: float) -> nnx.State:
    """`update_bias` of every `ScoreCorrectionBias` in `bias` (a state of them, e.g. `nnx.state(model,
    ScoreCorrectionBias)`; [R], or [n, R] in a stack) by its router's load in `loads` (`routing_terms`'s
    "expert_load", keyed by `router_name`); a bias whose router has no load is returned unchanged."""
    updated = []
    for path, variable in nnx.to_flat_state(bias):
        load = loads.get(router_name(path[:-1]))
        value = variable.get_value()
        updated.append((path, variable.replace(value if load is None else update_bias(value, load, speed))))
    return nnx.from_flat_state(updated)


def capture_routing(fn):
    """`nnx.capture(fn, RoutingStats)`: `fn(model, ...)` (or a bound method of a module) run with every MoE
    router recording; returns (fn's result, the records as an `nnx.State`)."""
    return nnx.capture(fn, RoutingStats)
