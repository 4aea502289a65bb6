"""The optimisation step of training: settings (`TrainConfig`), AdamW with warm-up and cosine decay,
the state one step updates (`TrainState`) and its placement on a mesh, and the jitted train and eval
steps. `mtp_jax.training.trainer` runs them in its loop (run dir, checkpoints, resume, logging).

One jitted step takes the trainable parameters and the optimizer state as a donated `TrainState`, the
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
from mtp_jax.mtp import MTP_PARAMS, shift_left
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
from mtp_jax.training.batches import heldout_batches
from mtp_jax.training.loss import compute_loss, label_mask


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimisation and bookkeeping settings of a run (sizes in tokens, steps and rows).

    The learning rate warms up linearly from 0 to `learning_rate` over `warmup_steps`, then
    decays along a cosine to `learning_rate * min_lr_ratio` at `num_steps`. AdamW decays only
    matrices (kernels, embeddings), not norms or biases. Gradients are clipped to global norm
    `grad_clip_norm` (0: no clipping). `eps` is Adam's epsilon (added to the root of the second
    moment; Kingma & Ba 2015).
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
    mtp_only: bool = False  # freeze the main model, train the MTP modules only
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

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)


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
    """What one step updates: `step` (int32 scalar, steps done), trainable `params`, `opt_state`."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def split_model(model: Transformer, config: TrainConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, trainable params, frozen rest of the state) of `model` for `config`'s mode."""
    return nnx.split(model, trainable_filter(config), ...)


def train_state_logical_axes(state: TrainState) -> TrainState:
    """The logical `PartitionSpec` of every array of `state` (concrete or abstract): the params' from their
    `logical_axes` metadata (`sharding.param_logical_axes`); each optimizer-state subtree that mirrors the
    params tree (AdamW's `mu` and `nu`) the params'; every other leaf (the step, optax's counts) P().

    On a `fsdp` mesh the moments are therefore sharded exactly as their parameters (ZeRO-3 style);
    on a `data` mesh everything is replicated.
    """
    params = param_logical_axes(state.params)
    params_def = jax.tree.structure(state.params)

    def mirrors_params(x) -> bool:
        return jax.tree.structure(x) == params_def

    opt_state = jax.tree.map(lambda x: params if mirrors_params(x) else P(), state.opt_state, is_leaf=mirrors_params)
    return TrainState(step=P(), params=params, opt_state=opt_state)


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
    def loss_fn(params):
        return compute_loss(
            nnx.merge(graphdef, params, frozen), tokens, segment_ids, mtp_lambda=optimizer.config.mtp_lambda
        )

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
    metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
    state = TrainState(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
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
    (global norm before clipping).
    """
    tokens, segment_ids = place_batch(tokens, segment_ids, mesh)
    with on_mesh(mesh):
        return _train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, optimizer=StaticOptimizer(config))


@partial(jax.jit, static_argnames=("graphdef", "mtp_lambda"))
def _eval_step(
    params: nnx.State,
    tokens: jax.Array,
    segment_ids: jax.Array,
    token_bytes: jax.Array,
    *,
    graphdef: nnx.GraphDef,
    mtp_lambda: float,
) -> dict[str, jax.Array]:
    model = nnx.merge(graphdef, params)
    _, metrics = compute_loss(model, tokens, segment_ids, mtp_lambda=mtp_lambda)
    counts = {
        "num_tokens": jnp.sum(label_mask(segment_ids, 1)),
        "num_bytes": jnp.sum(jnp.where(label_mask(segment_ids, 1), token_bytes[shift_left(tokens, 1)], 0)),
    }
    for k in range(1, model.config.num_nextn_predict_layers + 1):
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
    max_batches: int | None = None,
    mesh: Mesh | None = None,
) -> dict[str, float]:
    """Held-out metrics over `split` (one pass, `batches.heldout_batches`), pooled over tokens; with `mesh`,
    the model's parameters placed on it by their logical axes and each batch's rows split over data x fsdp.

    Returns floats: "main_loss" (nats per predicted token), "bits_per_byte" (the main loss summed
    over predicted tokens, in bits, over the UTF-8 bytes of those tokens; `<|endoftext|>` counts
    0 bytes), "loss" (main + mtp_lambda * mean MTP loss), per depth k "mtp_loss_{k}" (nats) and
    "mtp_agreement_{k}" (fraction of depth k's predictions whose argmax equals the main model's
    argmax for the same token), "num_tokens" and "num_bytes".

    Raises ValueError if batch_size < 1, seq_len < 2 or max_batches < 1, or batch_size is not a
    multiple of the mesh's data x fsdp.
    """
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
    sums: dict[str, float] = {}
    depths = range(1, model.config.num_nextn_predict_layers + 1)
    for tokens, segment_ids in heldout_batches(split, batch_size, seq_len, max_batches=max_batches):
        tokens, segment_ids = place_batch(tokens, segment_ids, mesh)
        with on_mesh(mesh):
            m = to_host(_eval_step(params, tokens, segment_ids, token_bytes, graphdef=graphdef, mtp_lambda=mtp_lambda))
        weights = {"main_loss": m["num_tokens"]}
        weights.update({f"{name}_{k}": m[f"num_tokens_{k}"] for k in depths for name in ("mtp_loss", "mtp_agreement")})
        for name, weight in weights.items():
            sums[name] = sums.get(name, 0.0) + float(m[name]) * float(weight)
        for name in ("num_tokens", "num_bytes", *(f"num_tokens_{k}" for k in depths)):
            sums[name] = sums.get(name, 0.0) + float(m[name])
    out = {"main_loss": sums["main_loss"] / max(sums["num_tokens"], 1)}
    out["bits_per_byte"] = sums["main_loss"] / math.log(2) / max(sums["num_bytes"], 1)
    for k in depths:
        for name in ("mtp_loss", "mtp_agreement"):
            out[f"{name}_{k}"] = sums[f"{name}_{k}"] / max(sums[f"num_tokens_{k}"], 1)
    mtp = [out[f"mtp_loss_{k}"] for k in depths]
    out["loss"] = out["main_loss"] + (mtp_lambda * sum(mtp) / len(mtp) if mtp else 0.0)
    out["num_tokens"], out["num_bytes"] = int(sums["num_tokens"]), int(sums["num_bytes"])
    return out
