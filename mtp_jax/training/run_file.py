"""A run's run.json read for a resume with every field it needs checked: a damaged file is a ValueError
naming the file and the key (a string where a number belongs, an unknown setting, a missing section),
never a TypeError from deep inside. `mtp-jax train --resume` reads it through here before any corpus work."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
import typing

from mtp_jax.config import ModelConfig
from mtp_jax.training.run_dir import model_config_from_dict
from mtp_jax.training.step import TrainConfig


def read_run_file(run_dir: pathlib.Path) -> dict:
    """run_dir's run.json as far as a resume reads it; ValueError naming the file (and the key) otherwise."""
    file = run_dir / "run.json"
    try:
        run = json.loads(file.read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{file}: {error.strerror or error}") from None
    except ValueError as error:  # not UTF-8, not JSON
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(run, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {_json_kind(run)}")
    for key in ("train_config", "model_config", "corpus"):
        if not isinstance(run.get(key), dict):
            raise ValueError(f"{file}: {key!r} must be a JSON object, got {_json_kind(run.get(key))}")
    corpus = run["corpus"]
    keys = {
        "stdlib": (("work_dir", str), ("vocab_size", int), ("heldout_fraction", (int, float))),
        "data_dir": (("work_dir", str), ("fingerprint", str)),  # `train --data DIR`
    }
    if corpus.get("source") in keys:
        for key, kinds in keys[corpus["source"]]:
            if not isinstance(corpus.get(key), kinds) or isinstance(corpus.get(key), bool):
                raise ValueError(
                    f"{file}: corpus.{key} must be {_TYPE_NAMES[kinds]}, got {_json_kind(corpus.get(key))}"
                )
    return run


_TYPE_NAMES = {
    int: "an integer",
    float: "a number",
    (int, float): "a number",
    bool: "true or false",
    str: "a string",
    type(None): "null",
}


def _json_kind(value) -> str:
    """`value` (from JSON) and its JSON type, for messages: "'4' (a string)", "nothing" when missing."""
    if value is None:
        return "null or nothing"
    kind = {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }.get(type(value), type(value).__name__)
    return f"{json.dumps(value)[:60]} ({kind})"


def _fits(value, hint) -> bool:
    """Whether the JSON value `value` is of the annotated type `hint` (int, float, bool, str, a union of them)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if typing.get_origin(hint) is tuple:  # tuple[X, ...]: a JSON array of X
        (item, *_) = typing.get_args(hint)
        return isinstance(value, list | tuple) and all(_fits(v, item) for v in value)
    return isinstance(value, hint)


def _hint_name(hint) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_hint_name(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is tuple:
        return f"an array of {_hint_name(typing.get_args(hint)[0])}s"
    return _TYPE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def saved_train_config(run_dir: pathlib.Path, run: dict) -> TrainConfig:
    """The TrainConfig of run.json's "train_config"; ValueError naming the file and the key it cannot take."""
    file, saved = run_dir / "run.json", run["train_config"]
    hints = typing.get_type_hints(TrainConfig)
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.init]
    for key, value in saved.items():
        if key not in fields:
            raise ValueError(f"{file}: train_config has an unknown key {key!r} (the keys are {', '.join(fields)})")
        if not _fits(value, hints[key]):
            raise ValueError(f"{file}: train_config.{key} must be {_hint_name(hints[key])}, got {_json_kind(value)}")
    try:
        return TrainConfig(**saved)
    except ValueError as error:
        raise ValueError(f"{file}: train_config: {error}") from None


def saved_model_config(run_dir: pathlib.Path, run: dict) -> ModelConfig:
    """The ModelConfig of run.json's "model_config"; ValueError naming the file when it cannot be one."""
    try:
        return model_config_from_dict(run["model_config"])
    except KeyError as error:
        raise ValueError(f"{run_dir / 'run.json'}: model_config has no key {error}") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{run_dir / 'run.json'}: model_config: {error}") from None
