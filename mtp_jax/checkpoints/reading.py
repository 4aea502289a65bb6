"""Hugging Face checkpoint import: `load_hf_checkpoint` (config.json plus safetensors weights).

Loading is strict: every tensor in the files must fill a parameter (or its piece of a fused one) and
every parameter must be filled, each tensor with its own shape; otherwise a `CheckpointError` lists
what is missing, unexpected or mis-shaped, tensor by tensor (a fused parameter's pieces each under
its HF name). Two documented exceptions: `*.rotary_emb.inv_freq` buffers (old exports) are
ignored, and with tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
accepted as a redundant copy (a *different* one is an error: the checkpoint is not tied).
Every field of config.json that is read is type-checked (`mtp_jax.checkpoints.hf_config`), and a corrupt
file (invalid JSON, a truncated or garbage safetensors file, an index without `weight_map` or
with a shard name that is not a plain file name) raises a `CheckpointError` naming the file.
Loading reads every file from one save even while another process overwrites `path`
(`atomic_dir.read_dir`: pinned to the directory on Linux, repeated after a swap elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from mtp_jax.checkpoints import atomic_dir
from mtp_jax.checkpoints.format import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError
from mtp_jax.checkpoints.hf_config import DTYPE_NAMES, config_from_hf
from mtp_jax.checkpoints.names import (
    fuse,
    hf_names,
    mtp_layers_present,
    piece_widths,
    shared_copies,
    tensor_axes,
    tensor_layout,
)
from mtp_jax.config import MAX_STOP_TOKENS, ModelConfig
from mtp_jax.model import Transformer

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-parameter buffers some exports contain


def _read_json(file: Path, shown: Path) -> Any:
    """The parsed contents of the JSON file `file`; a CheckpointError naming it (as `shown`) when it is not JSON."""
    data = file.read_bytes()
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, not UTF-8/16/32, nested too deeply
        reason = "nests too deeply" if isinstance(error, RecursionError) else str(error)
        raise CheckpointError(f"{shown} is not valid JSON: {reason}") from error


def _read_config(root: Path, shown: Path) -> ModelConfig:
    """The config of checkpoint directory `root` (named `shown` in errors); errors name config.json."""
    file = shown / CONFIG_FILE
    hf = _read_json(root / CONFIG_FILE, file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(hf).__name__}")
    try:
        config = config_from_hf(hf)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from error
    if len(set(config.eos_token_ids)) > MAX_STOP_TOKENS:
        raise CheckpointError(
            f"{file}: eos_token_id lists {len(set(config.eos_token_ids))} distinct token ids; "
            f"generation stops at most at {MAX_STOP_TOKENS} (mtp_jax.config.MAX_STOP_TOKENS)"
        )
    return config


def _is_plain_file_name(name: Any) -> bool:
    """A file name with no directory part: not absolute, no separator, not "." or ".."."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and not os.path.isabs(name)
    )


def _weight_files(root: Path, shown: Path) -> dict[str, list[str] | None]:
    """File name -> the tensor names the index places there (None: a single file, no index).

    With both a `model.safetensors` and an index, the single file is loaded (transformers'
    precedence, `modeling_utils._get_resolved_checkpoint_files`), with a warning naming both.
    """
    index_file = shown / INDEX_FILE
    if (root / WEIGHTS_FILE).is_file():
        if (root / INDEX_FILE).is_file():
            warnings.warn(
                f"{shown} holds both {WEIGHTS_FILE} and {INDEX_FILE}: loading {WEIGHTS_FILE} and "
                "ignoring the index and its shards (as transformers does); delete the one that does "
                "not belong",
                stacklevel=2,
            )
        return {WEIGHTS_FILE: None}
    if not (root / INDEX_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {shown}")
    index = _read_json(root / INDEX_FILE, index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file} has no weight_map object (tensor name -> shard file name)")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not _is_plain_file_name(file):
            raise CheckpointError(f"{index_file}: the shard {file!r} of {name} is not a plain file name in {shown}")
        files.setdefault(file, []).append(name)
    return files


@contextlib.contextmanager
def _safetensors_errors(file: Path) -> Iterator[None]:
    """Turns a SafetensorError (a file that is not valid safetensors) into a CheckpointError naming `file`."""
    try:
        yield
    except SafetensorError as error:
        raise CheckpointError(f"{file} is not a valid safetensors file: {error}") from error


def _open_weights(root: Path, shown: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """File name -> its open safetensors handle (closed with `stack`), for every weights file."""
    handles = {}
    for file, listed in _weight_files(root, shown).items():
        if not (root / file).is_file():
            if listed is None:  # deleted since `_weight_files` looked (a concurrent save's cleanup)
                raise FileNotFoundError(f"no {WEIGHTS_FILE} in {shown}")
            raise CheckpointError(f"{shown / INDEX_FILE} names {file}, which does not exist", missing=listed)
        with _safetensors_errors(shown / file):
            handles[file] = stack.enter_context(safe_open(root / file, framework="np"))
        absent = sorted(set(listed or ()) - set(handles[file].keys()))
        if absent:
            raise CheckpointError(f"{shown / INDEX_FILE} places tensors in {file} that it lacks", missing=absent)
    return handles


def _scan(handles: dict[str, Any], shown: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> file, name -> shape, name -> safetensors dtype) over every tensor in the files."""
    where, shapes, dtypes = {}, {}, {}
    for file, f in handles.items():
        with _safetensors_errors(shown / file):
            for name in f.keys():
                if name in where:
                    raise CheckpointError(f"{name} is stored in both {where[name]} and {file}")
                tensor = f.get_slice(name)
                where[name], shapes[name], dtypes[name] = file, tuple(tensor.get_shape()), tensor.get_dtype()
    return where, shapes, dtypes


def stored_dtype(path: str | os.PathLike) -> str:
    """The dtype a checkpoint directory's config.json says its weights are in ("float32", "bfloat16"
    or "float16"; `dtype` / `torch_dtype`, else float32): what `load_hf_checkpoint` loads by default.

    Raises FileNotFoundError without config.json, CheckpointError for one `load_hf_checkpoint` refuses.
    """
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {root}")
    return _read_config(root, root).dtype


def load_hf_checkpoint(
    path: str | os.PathLike, *, dtype: str | None = None, scan_layers: bool | None = None
) -> Transformer:
    """A `Transformer` from a Hugging Face checkpoint directory (config.json + safetensors).

    Args:
      path: a directory holding `config.json` and `model.safetensors`, or shards listed in
        `model.safetensors.index.json` (the format `save_pretrained` writes). With both, the
        single file is loaded and a warning names both (transformers' precedence).
      dtype: "float32", "bfloat16" or "float16" for the model's weights and compute; default the
        checkpoint's stored dtype (`config.json` `dtype` / `torch_dtype`, else float32; see
        `stored_dtype`, and `pretrained.inference_dtype` for decoding on a CPU). Tensors are cast on
        load.
      scan_layers: the returned model's layer layout (`ModelConfig.scan_layers`; config.json does
        not hold it); default `ModelConfig`'s. Either layout reads the same files.

    Returns:
      The model; Linear kernels [in, out] are the files' weights [out, in] transposed.

    Raises:
      FileNotFoundError: no config.json or no weights file.
      CheckpointError (a ValueError) naming the file: config.json or an index that is not JSON
        (nesting too deep included); config.json that is not a JSON object, that `config_from_hf`
        refuses (an unsupported or ill-typed field), or whose eos_token_id lists more distinct ids
        than generation can stop at (`mtp_jax.config.MAX_STOP_TOKENS`); an index that has no
        `weight_map`, or names a shard that is not a plain file name in `path` (`..`, absolute
        paths and subdirectories are refused); a safetensors file that is empty, truncated or not
        safetensors at all; missing tensors, unexpected tensors, shapes [out, in] other than the
        config's, non-float tensors, an index inconsistent with its shards, or (tied embeddings) a
        `lm_head.weight` that differs from `model.embed_tokens.weight` (likewise DeepSeek's
        per-MTP-layer `embed_tokens` / `shared_head.head` copies, see `shared_copies`); weights
        holding more or fewer MTP layers (`model.layers.{L + j}`) than config.json's
        `num_nextn_predict_layers` (the error names both numbers).
      OSError: `path` was replaced by concurrent saves during each attempt to read it (`atomic_dir.read_dir`).

    MTP modules (`num_nextn_predict_layers` > 0) load from DeepSeek-V3's layout:
    `model.layers.{L + j}.{enorm,hnorm,eh_proj,shared_head.norm,<block>}` for module j.

    Every file comes from one save even while another process overwrites `path`
    (`mtp_jax.checkpoints.atomic_dir.read_dir`), and a save that a kill interrupted between its two renames
    is finished first, so `path` holds the new checkpoint.
    """
    path = Path(path)
    return atomic_dir.read_dir(path, lambda root: read_hf_files(root, dtype=dtype, scan_layers=scan_layers, shown=path))


def read_hf_files(
    directory: str | os.PathLike,
    *,
    dtype: str | None = None,
    scan_layers: bool | None = None,
    shown: str | os.PathLike | None = None,
) -> Transformer:
    """The model in `directory`'s checkpoint files, read in place (not pinned against a concurrent save).

    Arguments, result and errors are `load_hf_checkpoint`'s, which wraps this in
    `atomic_dir.read_dir`; `shown` is the directory as error messages name it (default
    `directory`). config.json, the index and every weights file are opened before the slow work,
    so a concurrent save's clean-up rarely catches a read half way.
    """
    root = Path(directory)
    shown = root if shown is None else Path(shown)
    if not (root / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {shown}")
    config = _read_config(root, shown)
    if dtype is not None:
        try:
            dtype = jnp.dtype(dtype).name
        except TypeError:
            pass  # not a dtype at all: reported below
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
        config = config.replace(dtype=dtype, param_dtype=dtype)
    if scan_layers is not None:
        config = config.replace(scan_layers=scan_layers)
    with contextlib.ExitStack() as stack:
        handles = _open_weights(root, shown, stack)
        return _read_weights(handles, config, shown)


def _read_weights(handles: dict[str, Any], config: ModelConfig, shown: Path) -> Transformer:
    """The model of `config` with the tensors of the open weights files `handles` (file name -> handle)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    layout = tensor_layout(params, config)
    where, shapes, dtypes = _scan(handles, shown)

    present = mtp_layers_present(iter(where), config)
    if present != config.num_nextn_predict_layers:
        raise CheckpointError(
            f"checkpoint {shown}: config.json says num_nextn_predict_layers={config.num_nextn_predict_layers} but "
            f"the weights hold {present} MTP layers (model.layers.{config.num_hidden_layers} on); set "
            f"num_nextn_predict_layers={present} in config.json or add/remove the MTP layers' tensors"
        )
    copies = {name: source for name, source in shared_copies(config).items() if name in where}
    found = set(where) - set(copies)
    missing = [name for name in layout if name not in found]
    unexpected = sorted(n for n in found - set(layout) if not n.endswith(_IGNORED_SUFFIXES))
    mismatched = [
        f"{name} (expected shape {list(layout[name][2])}, found {list(shapes[name])})"
        for name in layout
        if name in found and shapes[name] != layout[name][2]
    ]
    mismatched += [
        f"{name} (dtype {dtypes[name]} is not a float type)"
        for name in layout
        if name in found and dtypes[name] not in ("F32", "BF16", "F16", "F64")
    ]
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"checkpoint {shown} does not match the config",
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
        )

    weight_dtype = config.weight_dtype
    values, copy_values = {}, {}
    for file in sorted(set(where.values())):
        f = handles[file]
        with _safetensors_errors(shown / file):
            for name in (n for n in layout if where[n] == file):
                array = f.get_tensor(name)  # the router stays float32 (`layers.moe.Router`): each param's dtype
                values[name] = jnp.asarray(array.T if layout[name][1] else array, dtype=layout[name][3])
            copy_values.update({name: f.get_tensor(name) for name in copies if where[name] == file})
    for name, copy in copy_values.items():  # after all files: the shared tensor may sit in a later shard
        source = values[copies[name]].T if layout[copies[name]][1] else values[copies[name]]
        if copy.shape != source.shape or not np.array_equal(
            np.asarray(jnp.asarray(copy, weight_dtype)), np.asarray(source)
        ):
            raise CheckpointError(f"{name} must be a copy of the shared {copies[name]} but differs", unexpected=[name])
    flat = []
    for path_, variable in nnx.to_flat_state(params):
        shape = variable.get_value().shape
        names = [name for name, _ in hf_names(path_, config)]
        pieces = len(piece_widths(path_, shape[-1], config))  # a fused slice's tensors
        slices = [fuse(path_, [values[n] for n in names[i : i + pieces]], config) for i in range(0, len(names), pieces)]
        value = jnp.stack(slices).reshape(shape) if tensor_axes(path_) else slices[0]  # [n?, R?, ...]
        flat.append((path_, variable.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))
