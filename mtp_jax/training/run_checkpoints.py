"""A run's checkpoints: the training state as orbax saves and restores it, on one device or a mesh.

A checkpoint holds {"train": TrainState (with the routers' biases when the step updates them),
"frozen": the parameters not trained} and the JSON metadata
{"tokens_per_step", "step"}. Restoring reads every array straight onto its target sharding
(`abstract_train_state`), whatever mesh the checkpoint was saved from.
"""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding

from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer, init_model
from mtp_jax.sharding import named_shardings, param_logical_axes, to_host
from mtp_jax.training.run_dir import (
    RUN_FILE,
    checkpoint_manager,
    is_run_dir,
    model_config_from_dict,
    read_run,
    restore_checkpoint,
    restore_latest,
    save_checkpoint,
)
from mtp_jax.training.step import (
    StaticOptimizer,
    TrainConfig,
    TrainState,
    merge_model,
    split_bias,
    split_model,
    train_state_shardings,
)


def run_checkpoint_manager(run_dir: pathlib.Path, config: TrainConfig) -> ocp.CheckpointManager:
    """The orbax manager of a run dir's checkpoints, keeping `config.keep_checkpoints`."""
    return checkpoint_manager(run_dir, max_to_keep=config.keep_checkpoints)


def save_train_state(manager: ocp.CheckpointManager, state: TrainState, frozen: nnx.State, meta: dict) -> None:
    """Checkpoint {"train": state, "frozen": frozen} at `state.step`, with the JSON `meta`."""
    save_checkpoint(manager, int(to_host(state.step)), {"train": state, "frozen": frozen}, meta)


def train_shardings(state: TrainState, frozen: nnx.State, mesh: Mesh | None) -> dict:
    """The shardings of {"train": state, "frozen": frozen} (arrays or abstract): by the logical axes on
    `mesh`; without one, all on this process's first device."""
    if mesh is None:
        device = SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: device, {"train": state, "frozen": frozen})
    return {
        "train": train_state_shardings(state, mesh),
        "frozen": named_shardings(frozen, param_logical_axes(frozen), mesh),
    }


def abstract_train_state(
    model_config: ModelConfig, train_config: TrainConfig, mesh: Mesh | None = None
) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, the abstract {"train": TrainState, "frozen": ...} that a checkpoint restores into).

    Each leaf is a `jax.ShapeDtypeStruct` carrying its target sharding (`train_shardings`), so orbax reads
    every array straight onto `mesh` (or one device), whatever mesh the checkpoint was saved from.
    """
    abstract = nnx.eval_shape(lambda: init_model(model_config, train_config.seed))
    graphdef, params, frozen = split_model(abstract, train_config)
    bias, frozen = split_bias(frozen, train_config)
    state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=params,
        opt_state=jax.eval_shape(StaticOptimizer(train_config).tx.init, params),
        bias=bias,
    )
    target = {"train": state, "frozen": frozen}
    target = jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        target,
        train_shardings(state, frozen, mesh),
    )
    return graphdef, target


def load_run(
    run_dir: str | os.PathLike, step: int | None = None, *, mesh: Mesh | None = None
) -> tuple[Transformer, dict]:
    """The model at checkpoint `step` of a run, and the run's `run.json` dict.

    Without `step`, the latest checkpoint that can be restored (falling back past unreadable ones
    with a `CheckpointFallbackWarning`; nothing is moved). The parameters are restored straight onto
    `mesh` by their logical axes (default: one device), whatever mesh the checkpoint was saved from.
    Raises FileNotFoundError if run_dir holds no run or no such checkpoint, NoUsableCheckpointError if
    it (or every one) cannot be restored.
    """
    run_dir = pathlib.Path(run_dir)
    if not is_run_dir(run_dir):
        raise FileNotFoundError(f"no run in {run_dir} ({RUN_FILE} is missing or not a run file)")
    run = read_run(run_dir)
    train_config = TrainConfig(**run["train_config"])
    graphdef, target = abstract_train_state(model_config_from_dict(run["model_config"]), train_config, mesh)
    manager = run_checkpoint_manager(run_dir, train_config)
    try:
        if step is None:
            _, restored = restore_latest(manager, run_dir, target, move_unreadable=False)
        else:
            restored = restore_checkpoint(manager, run_dir, step, target)
    finally:
        manager.close()
    return merge_model(graphdef, restored["train"], restored["frozen"]), run
