"""Training: AdamW with warm-up and cosine decay, orbax checkpoints, exact resume, held-out evaluation.

The objective is `mtp_jax.training.loss.compute_loss` (main next-token loss + `mtp_lambda` times the mean
MTP loss). The step itself (settings, optimizer, `TrainState`, its placement on a mesh, the jitted
train and eval steps) is `mtp_jax.training.step`, whose names this module re-exports; here is the run
around it. On a device mesh (`train(..., mesh=)`, `mtp_jax.sharding`) the step runs sharded and
checkpoints restore onto whatever mesh the run continues on.

Two modes (`trainable_filter`; neither trains the MoE routers' `ScoreCorrectionBias`, DeepSeek-V3's
`e_score_correction_bias`, which a load-balancing rule sets, not a gradient: it travels in `frozen`, or,
with `bias_update_speed > 0`, in the `TrainState`, which the step moves by that rule after every step
(`mtp_jax.training.balance`; with `mtp_only` the MTP modules' biases only); checkpoints and the export
hold it as updated):
  - full training: every other `nnx.Param` is trained;
  - `mtp_only`: the main model is frozen and only the MTP modules (`mtp.MTP_PARAMS`) are trained.
    The main parameters travel in `frozen`, get no gradient and no optimizer state, and come out
    bit-identical (for adding MTP heads to an existing model, e.g. one imported from Hugging Face).

A run lives in a run dir (`mtp_jax.training.run_dir`: its layout, the lock, the overwrite rules, the log
and checkpoint fallback). A checkpoint holds {"train": TrainState, "frozen": the frozen state}
and the JSON metadata {"tokens_per_step", "step"}.

Resume is exact: the batch of step n is a pure function of (corpus, seed, n) (`batches.PackedBatches`)
and the checkpoint holds the whole optimizer state, so 2N steps in one go equal N steps, a restart
and N more. Checkpoints are written every `checkpoint_every` steps, at the end, and when the run is
stopped by SIGINT (Ctrl-C) or SIGTERM: the signal ends the loop after the current step (a second
Ctrl-C aborts at once).

Safety of what is saved:
  - A fresh run refuses a non-empty dir unless `overwrite`, and `overwrite` deletes only a run dir
    the trainer made (one holding its run.json), and there only its entries (`run_dir.RUN_ENTRIES`).
  - One trainer per run dir: the lock is held for the whole of `train` and released by the kernel
    when the process ends, so a killed trainer leaves no stale lock.
  - A step whose loss or gradient norm is not finite stops the run before anything is saved
    (`NonFiniteError`), so the latest checkpoint is always finite and never rotated away.
  - Resume restores the latest checkpoint that can be read (an unreadable one is reported with a
    `CheckpointFallbackWarning` and moved aside) and drops the log records of the steps after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import pathlib
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from mtp_jax.checkpoints.heads_only import export_mtp_heads, source_fingerprint
from mtp_jax.checkpoints.pretrained import init_from_pretrained, save_pretrained  # noqa: F401  (re-exported)
from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer, init_model
from mtp_jax.sharding import on_mesh, place, resolve, to_host
from mtp_jax.training import data
from mtp_jax.training.batches import PackedBatches
from mtp_jax.training.guards import (  # NonFiniteError re-exported
    NonFiniteError,  # noqa: F401
    all_finite,
    non_finite_error,
    stop_requests,
)
from mtp_jax.training.resume import check_compatible, record_resume, resume_settings
from mtp_jax.training.run_checkpoints import (  # load_run re-exported: part of this module's interface
    abstract_train_state,
    load_run,  # noqa: F401
    run_checkpoint_manager,
    save_train_state,
    train_shardings,
)
from mtp_jax.training.run_dir import (
    EXPORT_DIR,
    RUN_ENTRIES,  # noqa: F401  (re-exported: part of this module's interface)
    TOKENIZER_FILE,
    CheckpointFallbackWarning,  # noqa: F401  (re-exported)
    NoUsableCheckpointError,  # noqa: F401  (re-exported)
    RunDirInUseError,  # noqa: F401  (re-exported)
    append_log,
    config_to_dict,
    locked,
    restore_latest,
    start_run,
    truncate_log,
)
from mtp_jax.training.run_dir import check_run_dir as check_run_dir_here
from mtp_jax.training.step import (  # re-exported: part of this module's interface
    RESUMABLE_FIELDS,  # noqa: F401  (re-exported)
    StaticOptimizer,
    TrainConfig,
    TrainState,
    _train_step,
    evaluate,
    learning_rate_schedule,
    make_optimizer,
    merge_model,
    place_batch,
    split_bias,
    split_model,
    train_state_logical_axes,  # noqa: F401  (re-exported)
    train_state_shardings,  # noqa: F401  (re-exported)
    train_step,  # noqa: F401  (re-exported)
    trainable_filter,  # noqa: F401  (re-exported)
)


@dataclasses.dataclass
class TrainResult:
    """The model after the run, the steps done, whether it stopped early, the last metrics, and for a MoE
    model the last logged step's per-expert loads: {router: int [R] or, for a scanned stack, [n, R]}
    (`balance.routing_terms`; tokens routed to each expert; None without MoE layers or steps)."""

    model: Transformer
    step: int
    stopped_early: bool
    train_metrics: dict[str, float]
    eval_metrics: dict[str, float] | None
    expert_load: dict[str, np.ndarray] | None = None


def train(
    run_dir: str | os.PathLike,
    corpus: data.Corpus,
    *,
    model_config: ModelConfig | None = None,
    train_config: TrainConfig | None = None,
    model: Transformer | None = None,
    resume: bool = False,
    overwrite: bool = False,
    stop_at_step: int | None = None,
    progress: bool = True,
    export: bool = True,
    mesh: Mesh | None = None,
    init_from: str | os.PathLike | None = None,
) -> TrainResult:
    """Trains (or resumes) the run in `run_dir` on `corpus` and returns the model.

    The run dir is locked for the whole call (one trainer per run dir). Every step's loss and
    gradient norm are checked: the first non-finite one ends the run with `NonFiniteError` before
    anything of that step is saved.

    With `mesh` (`sharding.make_mesh`) the run is sharded: the parameters, the frozen state and the
    optimizer state are placed by their logical axes (`train_state_logical_axes`: on `data=N`
    replicated, data parallelism; on `fsdp=N` split along "embed", FSDP / ZeRO-3; `tensor` splits
    heads, FFN width and vocabulary), each batch's rows are split over data x fsdp, and the step
    keeps that placement. A checkpoint saved on one mesh resumes on any other (or on one device):
    it is restored straight onto the shardings of the mesh given now. Under `jax.distributed` every
    process calls `train` with the same arguments; process 0 alone locks the run dir and writes its
    files, all of them take part in the orbax saves and restores.

    Args:
      run_dir: the run's directory (layout in the module docstring).
      corpus: from `data.prepare_corpus`; on resume it must be the one the run started with.
      model_config: the model to initialise (seed `train_config.seed`) for a fresh run without
        `model`; on resume it must equal the saved one if given.
      train_config: the settings. On resume they default to the saved ones and may differ from them
        only in `RESUMABLE_FIELDS`: a new `num_steps` continues the run to that total (the cosine
        schedule is redrawn to end there); the new settings are written to run.json.
      model: a fresh run's initial model instead of a random one (e.g. a Hugging Face import with
        MTP modules added, for `mtp_only`).
      resume: continue from the latest checkpoint in run_dir that can be restored (an unreadable
        later one is moved to run_dir/corrupt_checkpoints, with a `CheckpointFallbackWarning`).
      overwrite: for a fresh run, delete the previous run in run_dir first; only a run dir (one
        holding this module's run.json), and there only `RUN_ENTRIES` (other files are kept).
      stop_at_step: stop (and checkpoint) after this step, as an interruption would; resume later.
      progress: show a tqdm bar (loss, tokens/s, ETA).
      export: after the last step, write `run_dir/export` with `save_pretrained` (heads only for an
        `mtp_only` run from `init_from`, see there).
      mesh: the device mesh to train on; None: one device.
      init_from: the Hugging Face-format directory `model` was loaded from (a fresh run). run.json
        records it with its `heads_only.source_fingerprint`, and an `mtp_only` run (resumed ones too)
        exports with `heads_only.export_mtp_heads` from it: the source's trunk tensors byte for byte,
        the trained MTP modules in the source's dtypes. If the source is gone or has changed by then,
        the export falls back to `save_pretrained` with a warning.

    Raises:
      FileExistsError: a fresh run in a non-empty run_dir without `overwrite`, or with `overwrite`
        in a directory that is not a run dir (nothing is deleted).
      FileNotFoundError: `resume` without a run or a checkpoint in run_dir
        (`NoUsableCheckpointError` if no checkpoint can be restored).
      RunDirInUseError: another trainer holds run_dir's lock.
      NonFiniteError: a non-finite loss, gradient norm or updated state; the latest checkpoint is
        the last finite one.
      ValueError: settings that differ from the saved run's outside `RESUMABLE_FIELDS` (each field
        named with its saved and given value), a `num_steps` below the restored step, a corpus
        other than the run's, a vocabulary that does not fit the model, `mtp_only` with no MTP
        modules, or a batch_size that is not a multiple of the mesh's data x fsdp.
    """
    run_dir = pathlib.Path(run_dir)
    if not resume:
        if model is not None:
            if model_config is not None and model_config != model.config:
                raise ValueError("model_config differs from model.config; pass one of them")
            model_config = model.config
        if model_config is None or train_config is None:
            raise ValueError("a fresh run needs model_config (or model) and train_config")
        check_compatible(model_config, train_config, corpus)
        _check_mesh(train_config, mesh)
    check_run_dir(run_dir, resume=resume, overwrite=overwrite)
    primary = jax.process_index() == 0
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
    with locked(run_dir) if primary else contextlib.nullcontext():
        if resume:
            run, model_config, saved_train, train_config = resume_settings(
                run_dir, corpus, model_config, train_config, model
            )
            _check_mesh(train_config, mesh)
        else:
            corpus_keys = (
                "fingerprint",
                "source",
                "python_version",
                "vocab_size",
                "heldout_fraction",
                "tokenizer_source",
            )
            run = {
                "model_config": config_to_dict(model_config),
                "train_config": config_to_dict(train_config),
                "corpus": {
                    "work_dir": str(corpus.work_dir.resolve()),
                    **{k: corpus.metadata.get(k) for k in corpus_keys},
                },
            }
            if init_from is not None:
                source = pathlib.Path(init_from).resolve()
                run["init_from"] = {"path": str(source), "fingerprint": source_fingerprint(source)}
            if primary:
                start_run(run_dir, run, corpus.tokenizer_path, overwrite=overwrite)
        _sync("mtp_jax.train: run dir ready")

        manager = run_checkpoint_manager(run_dir, train_config)
        try:
            if resume:  # restored straight onto `mesh` (or one device), whatever mesh saved it
                graphdef, target = abstract_train_state(model_config, train_config, mesh)
                step, restored = restore_latest(manager, run_dir, target, move_unreadable=primary)
                state, frozen = restored["train"], restored["frozen"]
                if primary:
                    record_resume(run_dir, run, saved_train, train_config, step)
                    truncate_log(run_dir, step, train_config.num_steps)
            else:
                model = model if model is not None else init_model(model_config, train_config.seed)
                graphdef, params, frozen = split_model(model, train_config)
                bias, frozen = split_bias(frozen, train_config)  # the routers' biases the step updates, if any
                # the state is donated: leave the caller's model intact
                params, bias = jax.tree.map(jnp.copy, (params, bias))
                state = TrainState(
                    step=jnp.zeros((), jnp.int32),
                    params=params,
                    opt_state=make_optimizer(train_config).init(params),
                    bias=bias,
                )
                if mesh is not None:
                    placed = place({"train": state, "frozen": frozen}, train_shardings(state, frozen, mesh))
                    state, frozen = placed["train"], placed["frozen"]
            end = train_config.num_steps if stop_at_step is None else min(stop_at_step, train_config.num_steps)
            state, train_metrics, eval_metrics, expert_load = _fit(
                run_dir,
                corpus,
                manager,
                graphdef,
                state,
                frozen,
                train_config,
                end=end,
                progress=progress and primary,
                mesh=mesh,
            )
        finally:
            manager.close()
        step = int(to_host(state.step))
        model = merge_model(graphdef, state, frozen)
        stopped_early = step < train_config.num_steps
        if not stopped_early:
            eval_metrics = _evaluate_and_log(run_dir, model, corpus, train_config, step, mesh)
            if export:
                weights = state.replace(opt_state=None)  # what the model needs, not the optimizer state
                host = model if jax.process_count() == 1 else merge_model(graphdef, to_host(weights), to_host(frozen))
                if primary:
                    _export(host, run_dir, run, train_config)
    _sync("mtp_jax.train: done")  # the lock is released: a next call on any process finds the run dir free
    return TrainResult(
        model=model,
        step=step,
        stopped_early=stopped_early,
        train_metrics=train_metrics,
        eval_metrics=eval_metrics,
        expert_load=expert_load,
    )


def _export(model: Transformer, run_dir: pathlib.Path, run: dict, config: TrainConfig) -> None:
    """run_dir/export: heads only (`export_mtp_heads`) over the run's unchanged `init_from` source for an
    `mtp_only` run, else `save_pretrained` (with a warning when the source is gone or changed)."""
    source = run.get("init_from") if config.mtp_only else None
    if source is not None:
        path = pathlib.Path(str(source.get("path"))) if isinstance(source, dict) else None
        try:
            same = path is not None and source_fingerprint(path) == source.get("fingerprint")
        except OSError:
            same = False
        if same:
            export_mtp_heads(model, path, run_dir / EXPORT_DIR, overwrite=True)
            return
        warnings.warn(
            f"{path}, the checkpoint this run started from, is gone or has changed since: exporting the whole "
            "model with save_pretrained (the trunk rewritten from the model, not copied byte for byte)",
            stacklevel=3,
        )
    save_pretrained(model, run_dir / EXPORT_DIR, tokenizer=run_dir / TOKENIZER_FILE, overwrite=True)


def _check_mesh(config: TrainConfig, mesh: Mesh | None) -> None:
    """Raises ValueError when `mesh` cannot split `config`'s batch rows (naming batch_size)."""
    if mesh is not None:
        try:
            resolve(P("batch"), (config.batch_size,), mesh)
        except ValueError as error:
            raise ValueError(f"batch_size {config.batch_size} does not fit the mesh: {error}") from None


def check_run_dir(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False) -> None:
    """`mtp_jax.training.run_dir.check_run_dir` (raises what `train` would raise for `run_dir`, changing nothing),
    in a `jax.distributed` run by process 0 alone, the one that locks and writes the run dir: the others
    wait for its verdict and raise RuntimeError when it refused."""
    if jax.process_count() == 1:
        return check_run_dir_here(run_dir, resume=resume, overwrite=overwrite)
    from jax.experimental import multihost_utils

    error = None
    if jax.process_index() == 0:
        try:
            check_run_dir_here(run_dir, resume=resume, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001  (raised below, after the others have heard of it)
            error = e
    if multihost_utils.broadcast_one_to_all(np.asarray(error is not None)):
        raise error or RuntimeError(f"process 0 refused run dir {run_dir} (its error says why)")


def _sync(name: str) -> None:
    """A barrier across the processes of a `jax.distributed` run (nothing with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _log(run_dir: pathlib.Path, record: dict) -> None:
    if jax.process_index() == 0:
        append_log(run_dir, record)


def _evaluate_and_log(
    run_dir: pathlib.Path, model: Transformer, corpus: data.Corpus, config: TrainConfig, step: int, mesh: Mesh | None
) -> dict[str, float]:
    result = evaluate(
        model,
        corpus.heldout,
        data.token_byte_lengths(corpus.tokenizer),
        batch_size=config.batch_size,
        seq_len=config.seq_len,
        mtp_lambda=config.mtp_lambda,
        mtp_weights=config.depth_weights(model.config.num_nextn_predict_layers),
        mtp_targets=config.mtp_targets,
        max_batches=config.eval_batches,
        mesh=mesh,
    )
    _log(run_dir, {"kind": "eval", "step": step, "tokens": step * config.tokens_per_step, **result})
    if jax.process_index() == 0:
        tqdm.write(f"step {step} held-out: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()), file=sys.stderr)
    return result


def _fit(
    run_dir: pathlib.Path,
    corpus: data.Corpus,
    manager: ocp.CheckpointManager,
    graphdef: nnx.GraphDef,
    state: TrainState,
    frozen: nnx.State,
    config: TrainConfig,
    *,
    end: int,
    progress: bool,
    mesh: Mesh | None,
) -> tuple[TrainState, dict[str, float], dict[str, float] | None, dict[str, np.ndarray] | None]:
    """The training loop from `state.step` to step `end` (or a stop request): (state, train metrics, eval
    metrics, the last logged step's expert loads or None), the metrics of the last logged step.

    With `mesh`, `state` and `frozen` are on it already; each batch is placed (`place_batch`) and every
    step runs under `jax.set_mesh(mesh)`. Whatever is read back (losses, metrics, the finiteness check)
    goes through `sharding.to_host`, which also works on arrays spread over several processes.

    Raises NonFiniteError at the first step whose loss or gradient norm (or, at a checkpoint, whose
    updated state) is not finite, before saving anything of it.
    """
    optimizer = StaticOptimizer(config)
    batches = PackedBatches(corpus.train, config.batch_size, config.seq_len, config.seed)
    schedule = learning_rate_schedule(config)
    meta = {"tokens_per_step": config.tokens_per_step}
    train_metrics: dict[str, float] = {}
    eval_metrics = expert_load = None
    step = int(to_host(state.step))
    bar = tqdm(total=config.num_steps, initial=step, unit="step", disable=not progress, dynamic_ncols=True)
    with stop_requests() as stop, bar:
        last_time, last_step = time.perf_counter(), step
        while step < end:
            tokens, segment_ids = place_batch(*batches.batch(step), mesh)
            with on_mesh(mesh):
                state, metrics = _train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, optimizer=optimizer)
            step += 1
            bar.update(1)
            loss, grad_norm = (float(x) for x in to_host((metrics["loss"], metrics["grad_norm"])))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                what = f"the loss ({loss}) or the gradient norm ({grad_norm}) is"
                raise non_finite_error(run_dir, manager, step, what)
            if step % config.log_every == 0 or step == end:
                host = to_host(metrics)
                expert_load = host.pop("expert_load", None)  # MoE: {router: load vector(s)}
                train_metrics = {k: float(v) for k, v in host.items()}
                now = time.perf_counter()
                tokens_per_s = (step - last_step) * config.tokens_per_step / (now - last_time)
                last_time, last_step = now, step
                train_metrics.update(lr=float(schedule(step - 1)), tokens_per_s=tokens_per_s)
                _log(run_dir, {"kind": "train", "step": step, "tokens": step * config.tokens_per_step, **train_metrics})
                bar.set_postfix(
                    loss=f"{train_metrics['loss']:.3f}",
                    main=f"{train_metrics['main_loss']:.3f}",
                    tok_s=f"{tokens_per_s:.0f}",
                )
            if config.eval_every and step % config.eval_every == 0 and step < config.num_steps:
                eval_metrics = _evaluate_and_log(
                    run_dir, merge_model(graphdef, state, frozen), corpus, config, step, mesh
                )
                last_time = time.perf_counter()  # keep evaluation out of tokens/s
            if step % config.checkpoint_every == 0 or step == end or stop.is_set():
                with on_mesh(mesh):
                    finite = bool(to_host(all_finite((state.params, state.opt_state))))
                if not finite:
                    raise non_finite_error(run_dir, manager, step, "the updated parameters or optimizer state are")
                save_train_state(manager, state, frozen, meta)
            if stop.is_set():
                break
    return state, train_metrics, eval_metrics, expert_load
