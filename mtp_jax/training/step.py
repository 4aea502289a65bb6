"""The optimisation step of training: settings (`TrainConfig`), AdamW with warm-up and cosine decay,
the state one step updates (`TrainState`) and its placement on a mesh, and the jitted train and eval
steps. `mtp_jax.training.trainer` runs them in its loop (run dir, checkpoints, resume, logging).

One jitted step takes the trainable parameters and the optimizer state (and the MoE routers' biases, when
the step updates them: `split_bias`) as a donated `TrainState`, the
rest of the model (`frozen`) as a plain argument, and merges them with the static graph definition
inside (`nnx.split` outside jit, `nnx.merge` inside, as in flax's `examples/gemma`). On a device mesh
(`mtp_jax.sharding`) the parameters and the optimizer state are placed by the parameters' logical axes
(`train_state_logical_axes`: data parallel on `data`, FSDP on `fsdp`, Megatron-style on `tensor`), the
batch rows are split over data x fsdp, and the step returns the state on the shardings it got.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.layers.moe import ScoreCorrectionBias
from mtp_jax.model import Transformer
from mtp_jax.mtp import MTP_PARAMS, mtp_eagle_forward_full, shift_left
from mtp_jax.sharding import (
    constrain_tree,
    named_shardings,
    on_mesh,
    param_logical_axes,
    place,
    resolve,
    to_host,
    trim_specs,
)
from mtp_jax.training import data
from mtp_jax.training.balance import update_biases
from mtp_jax.training.batches import heldout_batches
from mtp_jax.training.loss import (
    MTP_TARGETS,
    compute_loss,
    depth_weights,
    label_mask,
    loss_from_logits,
    simulated_acceptance,
    simulated_acceptance_length,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping settings of a run (sizes in tokens, steps and rows).

    The learning rate warms up linearly from 0 to `learning_rate` over `warmup_steps`, then
    decays along a cosine to `learning_rate * min_lr_ratio` at `num_steps`. AdamW decays only
    matrices (kernels, embeddings), not norms or biases. Gradients are clipped to global norm
    `grad_clip_norm` (0: no clipping). `eps` is Adam's epsilon (added to the root of the second
    moment; Kingma & Ba 2015).

    MoE load balancing (DeepSeek-V3, arXiv 2412.19437 §2.1.2; `mtp_jax.training.balance`): after each step
    every sigmoid router's `e_score_correction_bias` moves by `bias_update_speed` (gamma; V3: 0.001) against
    its expert's load in that step's batch (with `mtp_only` the MTP modules' routers only, the trained ones);
    `balance_alpha` (V3: 0.0001) weighs the sequence-wise balance loss added to the objective. 0: off.
    """

    batch_size: int = 16
    seq_len: int = 256
    num_steps: int = 1000
    learning_rate: float = 3e-3
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip_norm: float = 1.0
    mtp_lambda: float = 0.1
    mtp_depth_weights: tuple[float, ...] | None = None  # w_k of each depth (`loss.depth_weights`); None: 1/D
    mtp_depth_decay: float | None = None  # FastMTP's beta: w_k ~ beta^(k-1), normalised (not with weights)
    mtp_targets: str = "data"  # "self": depth k learns the main head's greedy tokens (self-distillation)
    mtp_only: bool = False  # freeze the main model, train the MTP modules only
    bias_update_speed: float = 0.0  # gamma of the MoE routers' bias update (`balance.update_bias`); 0: off
    balance_alpha: float = 0.0  # alpha of the sequence-wise balance loss (`balance.sequence_balance_loss`)
    seed: int = 0  # model initialisation and data order
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: evaluate at the end only
    eval_batches: int | None = None  # None: the whole held-out split
    log_every: int = 10

    def __post_init__(self):
        for name in ("batch_size", "num_steps", "checkpoint_every", "keep_checkpoints", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {self.seq_len}")
        if not 0 <= self.warmup_steps <= self.num_steps:
            raise ValueError(f"warmup_steps must be in [0, num_steps={self.num_steps}], got {self.warmup_steps}")
        if not self.learning_rate > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"need learning_rate > 0 and min_lr_ratio in [0, 1], got {self.learning_rate}, {self.min_lr_ratio}"
            )
        for name in ("weight_decay", "grad_clip_norm", "mtp_lambda", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"eval_batches must be >= 1 or None, got {self.eval_batches}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        for name in ("bias_update_speed", "balance_alpha"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")
        if self.mtp_depth_weights is not None:
            object.__setattr__(self, "mtp_depth_weights", tuple(float(w) for w in self.mtp_depth_weights))
            depth_weights(len(self.mtp_depth_weights), self.mtp_depth_weights, self.mtp_depth_decay)
        elif self.mtp_depth_decay is not None:
            depth_weights(1, decay=self.mtp_depth_decay)
        if self.mtp_targets not in MTP_TARGETS:
            raise ValueError(f"mtp_targets must be one of {MTP_TARGETS}, got {self.mtp_targets!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def depth_weights(self, num_depths: int) -> tuple[float, ...]:
        """w_k for a model with `num_depths` MTP depths (`loss.depth_weights`; ValueError for a
        `mtp_depth_weights` of another length)."""
        return depth_weights(num_depths, self.mtp_depth_weights, self.mtp_depth_decay)


# The settings a resume may change: the step count (the run continues to the new total) and bookkeeping.
RESUMABLE_FIELDS = ("num_steps", "checkpoint_every", "keep_checkpoints", "eval_every", "eval_batches", "log_every")


# ----------------------------------------------------------------------------------------------
# Optimizer, state and the jitted steps.


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio * learning_rate`."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=config.warmup_steps,
        decay_steps=config.num_steps,
        end_value=config.learning_rate * config.min_lr_ratio,
    )


class StaticOptimizer:
    """A hashable handle on an optax transformation, so that equal configs share one jit cache entry."""

    def __init__(self, config: TrainConfig):
        self.config = config
        clip = [optax.clip_by_global_norm(config.grad_clip_norm)] if config.grad_clip_norm > 0 else []
        self.tx = optax.chain(
            *clip,
            optax.adamw(
                learning_rate_schedule(config),
                b1=config.b1,
                b2=config.b2,
                eps=config.eps,
                weight_decay=config.weight_decay,
                mask=_decayed,
            ),
        )

    def _key(self) -> tuple:
        c = self.config
        return (
            c.learning_rate,
            c.warmup_steps,
            c.num_steps,
            c.min_lr_ratio,
            c.weight_decay,
            c.b1,
            c.b2,
            c.eps,
            c.grad_clip_norm,
            c.mtp_lambda,
            c.mtp_depth_weights,
            c.mtp_depth_decay,
            c.mtp_targets,
            c.mtp_only,
            c.bias_update_speed,
            c.balance_alpha,
        )

    def __hash__(self):
        return hash(self._key())

    def __eq__(self, other):
        return isinstance(other, StaticOptimizer) and other._key() == self._key()


def _decayed(params: nnx.State) -> nnx.State:
    """AdamW's weight-decay mask: True for the matrices (kernels, embeddings, routers, experts), False for norms
    and biases, by the rank of one layer's parameter (a stacked layer group's layer axis does not count)."""

    def is_matrix(path, p):
        layer_axes = 1 if getattr(path[0], "key", None) == "layer_groups" else 0  # `ModelConfig.scan_layers`
        return p.ndim - layer_axes >= 2

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on `learning_rate_schedule(config)`; weight decay on matrices only."""
    return StaticOptimizer(config).tx


def trainable_filter(config: TrainConfig):
    """The nnx filter of the trained parameters: the MTP modules' (`mtp_only`) or all `nnx.Param`s, less the
    MoE routers' `ScoreCorrectionBias` (not trained by gradient; it stays in the frozen state)."""
    return nnx.All(MTP_PARAMS if config.mtp_only else nnx.Param, nnx.Not(ScoreCorrectionBias))


@struct.dataclass
class TrainState:
    """What one step updates: `step` (int32 scalar, steps done), trainable `params`, `opt_state`, and with
    `bias_update_speed > 0` `bias`: the MoE routers' `ScoreCorrectionBias` leaves the step updates
    (`split_bias`: taken out of the frozen state; None otherwise, or for a model without them)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    bias: nnx.State | None = None


def balanced_filter(config: TrainConfig):
    """The nnx filter of the routers' biases the step updates (`bias_update_speed > 0`): every
    `ScoreCorrectionBias`, or with `mtp_only` the MTP modules' only (the main model stays as it is)."""
    return nnx.All(ScoreCorrectionBias, nnx.PathContains("mtp")) if config.mtp_only else ScoreCorrectionBias


def split_bias(frozen: nnx.State, config: TrainConfig) -> tuple[nnx.State | None, nnx.State]:
    """(`TrainState.bias`, the rest of `frozen`): with `bias_update_speed > 0` the `balanced_filter` leaves of
    `frozen` (`split_model`'s) and the others; else, or when there are none, (None, frozen)."""
    if not config.bias_update_speed:
        return None, frozen
    bias, rest = nnx.split_state(frozen, balanced_filter(config), ...)
    return (bias, rest) if jax.tree.leaves(bias) else (None, frozen)


def merge_model(graphdef: nnx.GraphDef, state: TrainState, frozen: nnx.State) -> Transformer:
    """The model of a `TrainState` and the frozen rest (`split_model`, `split_bias`)."""
    return nnx.merge(graphdef, state.params, frozen, *([] if state.bias is None else [state.bias]))


def split_model(model: Transformer, config: TrainConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, trainable params, frozen rest of the state) of `model` for `config`'s mode.

    With `mtp_only` the trained MTP parameters are float32 master weights: half-precision ones (bfloat16,
    float16) are cast up, while the frozen main model stays in its dtype (a bfloat16 trunk keeps half
    the memory). The layers compute in `ModelConfig.dtype` whatever their weights' dtype. `model` may
    be abstract (`nnx.eval_shape`: `jax.ShapeDtypeStruct` leaves, cast likewise)."""
    graphdef, params, frozen = nnx.split(model, trainable_filter(config), ...)
    if config.mtp_only:
        params = jax.tree.map(_float32_master, params)
    return graphdef, params, frozen


def _float32_master(x):
    """A half-precision array (or `jax.ShapeDtypeStruct`) as float32; anything else as it is."""
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding)
    return x.astype(jnp.float32)


def train_state_logical_axes(state: TrainState) -> TrainState:
    """The logical `PartitionSpec` of every array of `state` (concrete or abstract): the params' from their
    `logical_axes` metadata (`sharding.param_logical_axes`); each optimizer-state subtree that mirrors the
    params tree (AdamW's `mu` and `nu`) the params'; every other leaf (the step, optax's counts) P().

    On a `fsdp` mesh the moments are therefore sharded exactly as their parameters (ZeRO-3 style);
    on a `data` mesh everything is replicated. The routers' `bias` (if any): replicated.
    """
    params = param_logical_axes(state.params)
    params_def = jax.tree.structure(state.params)

    def mirrors_params(x) -> bool:
        return jax.tree.structure(x) == params_def

    opt_state = jax.tree.map(lambda x: params if mirrors_params(x) else P(), state.opt_state, is_leaf=mirrors_params)
    bias = None if state.bias is None else param_logical_axes(state.bias)
    return TrainState(step=P(), params=params, opt_state=opt_state, bias=bias)


def train_state_shardings(state: TrainState, mesh: Mesh) -> TrainState:
    """The `NamedSharding` on `mesh` of every array of `state` (`train_state_logical_axes` resolved), its
    spec without trailing Nones: as the jitted step returns them, so the step's input and output
    shardings compare equal and it compiles once."""
    return trim_specs(named_shardings(state, train_state_logical_axes(state), mesh))


def place_batch(tokens: np.ndarray, segment_ids: np.ndarray, mesh: Mesh | None) -> tuple[jax.Array, jax.Array]:
    """A batch (int32 [B, T] each, the same on every process) with its rows split over `mesh`'s batch axes
    (`P("batch", None)`: data x fsdp); without a mesh, as given. Raises ValueError when B is not a multiple
    of data x fsdp."""
    if mesh is None:
        return tokens, segment_ids
    batch = (tokens, segment_ids)
    return place(batch, named_shardings(batch, (P("batch", None),) * 2, mesh))


@partial(jax.jit, static_argnames=("graphdef", "optimizer"), donate_argnames=("state",))
def _train_step(
    state: TrainState,
    frozen: nnx.State,
    tokens: jax.Array,
    segment_ids: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    optimizer: StaticOptimizer,
) -> tuple[TrainState, dict[str, jax.Array]]:
    config = optimizer.config

    if config.bias_update_speed and state.bias is None and jax.tree.leaves(split_bias(frozen, config)[0]):
        raise ValueError("bias_update_speed > 0 needs the routers' biases in TrainState.bias (`split_bias`)")

    def loss_fn(params):
        model = merge_model(graphdef, state.replace(params=params), frozen)
        return compute_loss(
            model,
            tokens,
            segment_ids,
            mtp_lambda=config.mtp_lambda,
            mtp_weights=config.depth_weights(model.config.num_nextn_predict_layers),
            mtp_targets=config.mtp_targets,
            balance_alpha=config.balance_alpha,
            # The MoE routers' loads: the bias update's input, and logged. Every step, in one program: only
            # logging steps would need a second compiled step (or a `lax.cond`, whose predicate XLA:GPU reads
            # back to the host mid-step) to skip a bincount per MoE layer, noise next to the forward.
            routing_metrics=True,
            mtp_only=config.mtp_only,
        )

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    bias = state.bias
    if bias is not None:  # DeepSeek-V3's auxiliary-loss-free balancing, by this step's loads
        bias = update_biases(bias, metrics["expert_load"], config.bias_update_speed)
    state = TrainState(
        step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state, bias=bias
    )
    # On a mesh (the context's) the new state keeps the placement of the old: no recompile at the next step.
    return constrain_tree(state, train_state_logical_axes(state)), metrics


def train_step(
    state: TrainState,
    frozen: nnx.State,
    tokens: jax.Array,
    segment_ids: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    config: TrainConfig,
    mesh: Mesh | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on a batch (tokens, segment_ids int32 [B, T]); `state` is donated.

    With `mesh`, `state` and `frozen` must already be on it (`sharding.place(state,
    train_state_shardings(state, mesh))`, `sharding.shard_params(frozen, mesh)`); the batch is
    placed here (`place_batch`) and the step runs under `jax.set_mesh(mesh)`, the new state on the
    same shardings as the old.

    Returns the new state and `compute_loss`'s metrics (before the update) plus "grad_norm"
    (global norm before clipping); for a MoE model also the routers' loads ("expert_load" {router:
    int32 [R] or [n, R]}, "expert_load_max_over_mean", with balance_alpha > 0 "balance_loss":
    `balance.routing_terms`), which with `bias_update_speed > 0` moved `state.bias` (DeepSeek-V3's bias
    update, `balance.update_biases`).
    """
    tokens, segment_ids = place_batch(tokens, segment_ids, mesh)
    with on_mesh(mesh):
        return _train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, optimizer=StaticOptimizer(config))


@partial(jax.jit, static_argnames=("graphdef", "mtp_lambda", "mtp_weights", "mtp_targets", "eagle_steps"))
def _eval_step(
    params: nnx.State,
    tokens: jax.Array,
    segment_ids: jax.Array,
    token_bytes: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    mtp_lambda: float,
    mtp_weights: tuple[float, ...] | None,
    mtp_targets: str,
    eagle_steps: int,
) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    logits, hidden = model.forward_full(tokens, segment_ids)
    mtp_logits, eagle = mtp_eagle_forward_full(model, hidden, tokens, segment_ids, eagle_steps=eagle_steps)
    _, metrics = loss_from_logits(
        [logits, *mtp_logits],
        tokens,
        segment_ids,
        mtp_lambda=mtp_lambda,
        mtp_weights=mtp_weights,
        mtp_targets=mtp_targets,
    )
    if eagle_steps:  # pass 1 is depth 1; the chained passes are module 1's over its own hidden states
        main_pred = jnp.argmax(logits, axis=-1).astype(tokens.dtype)
        metrics.update(simulated_acceptance(main_pred, eagle, segment_ids, prefix="eagle"))
    counts = {
        "num_tokens": jnp.sum(label_mask(segment_ids, 1)),
        "num_bytes": jnp.sum(jnp.where(label_mask(segment_ids, 1), token_bytes[shift_left(tokens, 1)], 0)),
    }
    for k in range(1, max(model.config.num_nextn_predict_layers, eagle_steps) + 1):
        counts[f"num_tokens_{k}"] = jnp.sum(label_mask(segment_ids, k + 1))
    return {**metrics, **counts}


def evaluate(
    model: Transformer,
    split: data.TokenizedSplit,
    token_bytes: np.ndarray,
    *,
    batch_size: int,
    seq_len: int,
    mtp_lambda: float = 0.1,
    mtp_weights: tuple[float, ...] | None = None,
    mtp_targets: str = "data",
    eagle_steps: int | None = None,
    max_batches: int | None = None,
    mesh: Mesh | None = None,
) -> dict[str, float]:
    """Held-out metrics over `split` (one pass, `batches.heldout_batches`), pooled over tokens; with `mesh`,
    the model's parameters placed on it by their logical axes and each batch's rows split over data x fsdp.

    Returns floats: "main_loss" (nats per predicted token), "bits_per_byte" (the main loss summed
    over predicted tokens, in bits, over the UTF-8 bytes of those tokens; `<|endoftext|>` counts
    0 bytes), "loss" (main + mtp_lambda * sum_k w_k MTP loss_k, `mtp_weights` w, default 1/D), per
    depth k "mtp_loss_{k}" (nats, against `mtp_targets`: the data's tokens or the main head's own),
    "mtp_agreement_{k}" (fraction of depth k's predictions whose argmax equals the main model's
    argmax for the same token) and "mtp_acceptance_{k}" (simulated acceptance of MTP Vanilla:
    depths 1..k all agree, `loss.simulated_acceptance`), per K = 1..D "mtp_acceptance_length_{K}"
    (1 + the sum of the first K acceptances), the same "eagle_*" metrics for MTP Eagle's K =
    `eagle_steps` chained passes of module 1 (default 3; 0 or a model without a DeepSeek-style
    module: none), "num_tokens" and "num_bytes".

    Raises ValueError if batch_size < 1, seq_len < 2 or max_batches < 1, or batch_size is not a
    multiple of the mesh's data x fsdp.
    """
    depth_count = model.config.num_nextn_predict_layers
    if eagle_steps is None:
        eagle_steps = 3
    if depth_count == 0 or model.config.mtp_style != "deepseek":
        eagle_steps = 0
    if batch_size < 1 or seq_len < 2 or (max_batches is not None and max_batches < 1):
        raise ValueError(
            f"need batch_size >= 1, seq_len >= 2 and max_batches >= 1 (or None), got batch_size "
            f"{batch_size}, seq_len {seq_len}, max_batches {max_batches}"
        )
    graphdef, params = nnx.split(model)
    token_bytes = np.asarray(token_bytes)
    if mesh is not None:
        resolve(P("batch"), (batch_size,), mesh)  # raises for a batch the mesh cannot split
        params = place(params, named_shardings(params, param_logical_axes(params), mesh))
        token_bytes = place(token_bytes, NamedSharding(mesh, P()))
    weights = depth_weights(depth_count, mtp_weights)
    sums: dict[str, float] = {}
    depths = range(1, depth_count + 1)
    # (metric, the count of rows it is a mean over) for every pooled metric
    pooled = [("main_loss", "num_tokens")]
    pooled += [(f"mtp_{name}_{k}", f"num_tokens_{k}") for k in depths for name in ("loss", "agreement", "acceptance")]
    pooled += [
        (f"eagle_{name}_{k}", f"num_tokens_{k}")
        for k in range(1, eagle_steps + 1)
        for name in ("agreement", "acceptance")
    ]
    counts = {"num_tokens", "num_bytes", *(count for _, count in pooled)}
    for tokens, segment_ids in heldout_batches(split, batch_size, seq_len, max_batches=max_batches):
        tokens, segment_ids = place_batch(tokens, segment_ids, mesh)
        with on_mesh(mesh):
            m = to_host(
                _eval_step(
                    params,
                    tokens,
                    segment_ids,
                    token_bytes,
                    graphdef=graphdef,
                    mtp_lambda=mtp_lambda,
                    mtp_weights=weights,
                    mtp_targets=mtp_targets,
                    eagle_steps=eagle_steps,
                )
            )
        for name, count in pooled:
            sums[name] = sums.get(name, 0.0) + float(m[name]) * float(m[count])
        for name in counts:
            sums[name] = sums.get(name, 0.0) + float(m[name])
    out = {name: sums[name] / max(sums[count], 1) for name, count in pooled}
    out["bits_per_byte"] = sums["main_loss"] / math.log(2) / max(sums["num_bytes"], 1)
    for prefix, steps in (("mtp", depth_count), ("eagle", eagle_steps)):
        for k in range(1, steps + 1):
            out[f"{prefix}_acceptance_length_{k}"] = simulated_acceptance_length(out, k, prefix)
    out["loss"] = out["main_loss"] + mtp_lambda * sum(
        w * out[f"mtp_loss_{k}"] for k, w in zip(depths, weights, strict=True)
    )
    out["num_tokens"], out["num_bytes"] = int(sums["num_tokens"]), int(sums["num_bytes"])
    return out
