"""The run dir: where one training run keeps everything it writes, and what it guarantees.

A run dir holds:
  run.json          model config, train config, corpus fingerprint (written at the start, last, so
                    that its presence marks a run dir; a resume that changes settings rewrites it)
  train.lock        locked (`fcntl.flock`) by the one trainer working in the dir
  checkpoints/<n>/  orbax: the training state and JSON metadata after step n
  log.jsonl         one JSON line per logged training step and per evaluation
  tokenizer.json    the corpus tokenizer
  export/           the final model (`save_pretrained`: safetensors + config.json + tokenizer.json)
  corrupt_checkpoints/<n>/  checkpoints that could not be restored, moved aside on resume

Guarantees:
  - A fresh run refuses a non-empty dir unless `overwrite`, and `overwrite` deletes only a run dir
    (one holding a run.json written here), and there only the entries listed above (`RUN_ENTRIES`):
    other files stay.
  - One trainer per run dir (`locked`): the lock is a `flock`, released by the kernel when the
    process ends, so a killed trainer leaves no stale lock.
  - run.json and the rewritten log are replaced atomically (a temporary sibling, then a rename).
  - A resume from checkpoint n drops the log records that it writes again (`truncate_log`).
  - Restoring falls back past checkpoints that cannot be read (`restore_latest`), names them in a
    `CheckpointFallbackWarning`, and on resume moves them to corrupt_checkpoints/ so that new saves
    do not meet them.

What a checkpoint's state is (a pytree), and which settings a resume may change, is the trainer's
(`mtp_jax.training.trainer`); this module stores and restores it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
import warnings
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp

from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.quantization import Fp8Config

RUN_FILE = "run.json"
LOCK_FILE = "train.lock"
LOG_FILE = "log.jsonl"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINTS_DIR = "checkpoints"
EXPORT_DIR = "export"
CORRUPT_DIR = "corrupt_checkpoints"
# What the trainer writes in a run dir: all that `overwrite` may delete.
RUN_ENTRIES = (
    RUN_FILE,
    LOG_FILE,
    TOKENIZER_FILE,
    CHECKPOINTS_DIR,
    EXPORT_DIR,
    CORRUPT_DIR,
    f"{RUN_FILE}.tmp",
    f"{LOG_FILE}.tmp",
)


class RunDirInUseError(RuntimeError):
    """Another trainer holds the run dir's lock (`train.lock`)."""


class NoUsableCheckpointError(FileNotFoundError):
    """No checkpoint of the run (or not the one asked for) can be restored."""


class CheckpointFallbackWarning(UserWarning):
    """The latest checkpoint cannot be restored; an earlier one is used instead."""


# ----------------------------------------------------------------------------------------------
# run.json


def config_to_dict(config) -> dict:
    """A config dataclass (`ModelConfig`, `TrainConfig`) as the JSON-ready dict run.json stores."""
    return dataclasses.asdict(config)


def model_config_from_dict(d: dict) -> ModelConfig:
    """The `ModelConfig` of run.json's "model_config" dict (`config_to_dict` inverted; an FP8 model's
    `quantization` dict back to its `Fp8Config`, `quantize_mtp` included)."""
    d = dict(d, rope_scaling=RopeScaling(**d["rope_scaling"]))
    if isinstance(d.get("quantization"), dict):
        d["quantization"] = Fp8Config(**d["quantization"])
    if isinstance(d.get("eos_token_id"), list):
        d["eos_token_id"] = tuple(d["eos_token_id"])
    return ModelConfig(**d)


def is_run_dir(path: str | os.PathLike) -> bool:
    """Whether `path` holds a run this module made: a run.json with a model config, a train config and a corpus."""
    try:
        run = json.loads((pathlib.Path(path) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(run, dict) and {"model_config", "train_config", "corpus"} <= run.keys()


def read_run(run_dir: pathlib.Path) -> dict:
    """The run.json dict of `run_dir`."""
    return json.loads((run_dir / RUN_FILE).read_text())


def write_run(run_dir: pathlib.Path, run: dict) -> None:
    """Replaces run_dir/run.json with `run`, atomically."""
    _write_atomic(run_dir / RUN_FILE, json.dumps(run, indent=1))


def _write_atomic(path: pathlib.Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# Fresh runs: the overwrite check, the lock, clearing.


def _entries(run_dir: pathlib.Path) -> list[pathlib.Path]:
    return [e for e in run_dir.iterdir() if e.name != LOCK_FILE] if run_dir.is_dir() else []


def check_run_dir(run_dir: str | os.PathLike, *, resume: bool = False, overwrite: bool = False) -> None:
    """Raises what `train` would raise for `run_dir` in this mode, without changing anything there.

    Raises:
      FileNotFoundError: `resume` and run_dir holds no run (no run.json).
      FileExistsError: a fresh run where run_dir is not a directory, or is a non-empty directory and
        `overwrite` is not set, or `overwrite` is set but it is not a run dir (nothing is deleted there).
      RunDirInUseError: another trainer holds run_dir's lock.
    """
    run_dir = pathlib.Path(run_dir)
    if resume:
        if not is_run_dir(run_dir):
            raise FileNotFoundError(f"no run to resume in {run_dir} ({RUN_FILE} is missing or not a run file)")
    elif run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"run dir {run_dir} exists and is not a directory")
    elif _entries(run_dir):
        if not overwrite:
            raise FileExistsError(
                f"run dir {run_dir} is not empty: pass resume=True (--resume) to continue "
                "its run or overwrite=True (--overwrite) to delete it and start again"
            )
        if not is_run_dir(run_dir):
            raise FileExistsError(
                f"{run_dir} is not a run dir (it has no {RUN_FILE} written by "
                "mtp_jax.training.trainer): "
                "overwrite (--overwrite) deletes only a run dir, so nothing was deleted; "
                "pick an empty or new directory"
            )
    if (run_dir / LOCK_FILE).is_file():
        with locked(run_dir):
            pass


@contextlib.contextmanager
def locked(
    run_dir: pathlib.Path,
    name: str = LOCK_FILE,
    *,
    what: str = "run dir",
    user: str = "trainer",
    error: type[Exception] = RunDirInUseError,
) -> Iterator[None]:
    """Holds an exclusive `fcntl.flock` on run_dir/train.lock for the block (the kernel drops it if we die).

    Raises RunDirInUseError, naming the holder's process id, if another process holds it. Other directories
    one process at a time use it too: the lock file `name`, the directory called `what` and the holder a
    `user` in the message, and `error` raised (e.g. `distill`'s out/distill.lock, a ValueError).
    """
    fd = os.open(run_dir / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise error(
                f"{what} {run_dir} is in use by another {user} (process {holder} holds "
                f"{run_dir / name}); wait for it to end or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # for the message above; the lock is the flock
        yield
    finally:
        os.close(fd)  # releases the flock


def _clear_run_dir(run_dir: pathlib.Path, overwrite: bool) -> None:
    """Deletes the entries the trainer wrote in a run dir (RUN_ENTRIES); other files stay. Call under the lock."""
    if not _entries(run_dir):
        return
    if not overwrite or not is_run_dir(run_dir):  # checked again under the lock: the dir may have changed
        raise FileExistsError(
            f"run dir {run_dir} is not empty" + (" and not a run dir" if overwrite else "") + ": nothing was deleted"
        )
    for name in RUN_ENTRIES:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def start_run(run_dir: pathlib.Path, run: dict, tokenizer: pathlib.Path, *, overwrite: bool) -> None:
    """Makes run_dir a fresh run dir: clears the previous run (`overwrite`), copies the tokenizer, writes run.json.

    Call under the lock. run.json comes last: it marks a run dir. Raises FileExistsError (nothing
    deleted) if run_dir is not empty and `overwrite` is not set or it is not a run dir.
    """
    _clear_run_dir(run_dir, overwrite)
    shutil.copyfile(tokenizer, run_dir / TOKENIZER_FILE)
    write_run(run_dir, run)


# ----------------------------------------------------------------------------------------------
# log.jsonl


def append_log(run_dir: pathlib.Path, record: dict) -> None:
    """Appends `record` as one JSON line to run_dir/log.jsonl."""
    with open(run_dir / LOG_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(run_dir: pathlib.Path, step: int, num_steps: int) -> int:
    """Drops the log records that a resume from checkpoint `step` writes again (those of later steps, and
    the final evaluation if `step` is the last) and lines cut short by a kill; returns how many."""
    path = run_dir / LOG_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            final_eval = record["kind"] == "eval" and step >= num_steps  # written again after the resume
            redone = record["step"] > step or (record["step"] == step and final_eval)
        except (ValueError, KeyError, TypeError):
            redone = True
        if redone:
            dropped += 1
        else:
            kept.append(line + "\n")
    if dropped:
        _write_atomic(path, "".join(kept))
    return dropped


# ----------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_manager(run_dir: pathlib.Path, *, max_to_keep: int) -> ocp.CheckpointManager:
    """The orbax manager of run_dir/checkpoints (synchronous saves, the latest `max_to_keep` kept)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
    )  # the state is donated next step
    return ocp.CheckpointManager((run_dir / CHECKPOINTS_DIR).resolve(), options=options)


def save_checkpoint(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict) -> None:
    """Saves the pytree `state` and JSON `meta` (plus "step") as checkpoint `step`, unless it is the latest."""
    if manager.latest_step() == step:
        return
    manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({**meta, "step": step})),
        force=True,
    )
    manager.wait_until_finished()


def _restore(manager: ocp.CheckpointManager, step: int, target: Any) -> Any:
    return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))).state


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error)[:160]}"


def restore_checkpoint(manager: ocp.CheckpointManager, run_dir: pathlib.Path, step: int, target: Any) -> Any:
    """The state of checkpoint `step`, restored into the abstract pytree `target` (shapes and dtypes).

    Raises FileNotFoundError if there is no such checkpoint, NoUsableCheckpointError if it cannot
    be restored.
    """
    if step not in manager.all_steps():
        raise FileNotFoundError(f"no checkpoint {step} in {run_dir / CHECKPOINTS_DIR}")
    try:
        return _restore(manager, step, target)
    except Exception as error:  # as in restore_latest
        raise NoUsableCheckpointError(
            f"checkpoint step {step} in {run_dir / CHECKPOINTS_DIR} cannot be restored ({_describe(error)})"
        ) from error


def restore_latest(
    manager: ocp.CheckpointManager, run_dir: pathlib.Path, target: Any, *, move_unreadable: bool
) -> tuple[int, Any]:
    """(step, state) of the latest checkpoint that can be restored into the abstract pytree `target`.

    Later checkpoints that cannot be restored are named in a CheckpointFallbackWarning and, with
    `move_unreadable`, moved to run_dir/corrupt_checkpoints (so that new saves do not meet them).
    Raises FileNotFoundError without checkpoints, NoUsableCheckpointError if none can be restored.
    """
    checkpoints = run_dir / CHECKPOINTS_DIR
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {checkpoints}")
    unreadable: dict[int, str] = {}
    for step in steps:
        try:
            restored = _restore(manager, step, target)
        except Exception as error:  # orbax and tensorstore raise many kinds (a bare Exception too) on damaged files
            unreadable[step] = _describe(error)
            continue
        if unreadable:
            moved = ""
            if move_unreadable:
                aside = run_dir / CORRUPT_DIR
                aside.mkdir(exist_ok=True)
                for bad in unreadable:
                    moved_to, n = aside / str(bad), 1
                    while moved_to.exists():
                        moved_to, n = aside / f"{bad}-{n}", n + 1
                    shutil.move(pathlib.Path(manager.directory) / str(bad), moved_to)
                manager.reload()
                moved = f"; moved to {aside}"
            warnings.warn(
                f"checkpoint step {', '.join(map(str, unreadable))} in {checkpoints} cannot "
                f"be restored ({'; '.join(unreadable.values())}); falling back to step {step}{moved}",
                CheckpointFallbackWarning,
                stacklevel=3,
            )
        return step, restored
    raise NoUsableCheckpointError(
        f"no checkpoint in {checkpoints} can be restored: " + "; ".join(f"step {s}: {e}" for s, e in unreadable.items())
    )
