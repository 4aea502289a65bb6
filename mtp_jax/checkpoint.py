"""Hugging Face checkpoint import and export: `config.json` plus safetensors weights.

Format (what `transformers`' `save_pretrained` writes and `from_pretrained` reads):
  - `config.json`: a `LlamaConfig` / `Qwen2Config` / `MistralConfig` as JSON. Both RoPE spellings
    are read: transformers 4.x's `rope_theta` + `rope_scaling`, and transformers 5's
    `rope_parameters` dict (which holds `rope_theta`); both are written.
  - `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.

Names: our parameter paths are HF's module names (see `mtp_jax.model`), so `hf_name` is the one
place that maps them: `layers.3.mlp.up_proj.kernel` is `model.layers.3.mlp.up_proj.weight`.
Linear kernels are stored [in, out] here and [out, in] (torch's layout) in the files. MTP modules
are imported and exported in DeepSeek-V3's layout (README_WEIGHTS.md): module j's `mtp.j.<name>`
is `model.layers.{L + j}.<name>`, and `num_nextn_predict_layers` plus mtp_jax's conventions
(`MTP_CONVENTION_FIELDS`) sit in config.json.

Loading is strict: every tensor in the files must fill a parameter and every parameter must be
filled, with the stored shape; otherwise a `CheckpointError` lists what is missing, unexpected or
mis-shaped. Two documented exceptions: `*.rotary_emb.inv_freq` buffers (old exports) are
ignored, and with tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
accepted as a redundant copy (a *different* one is an error: the checkpoint is not tied).
Every field of config.json that is read is type-checked (no coercion: "64" is not an int, 64.0
is not an int, "false" is not a bool), and a corrupt file (invalid JSON, a truncated or garbage
safetensors file, an index without `weight_map` or with a shard name that is not a plain file
name) raises a `CheckpointError` naming the file.

Saving is atomic (`mtp_jax.atomic_dir`): the checkpoint is written to a temporary sibling
directory and swapped in, so a kill at any point leaves the old or the new checkpoint at `path`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtp_jax import atomic_dir
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.model import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The tokenizer files of a model directory (`tokenizers` and `transformers` names): an overwriting
# save drops them with the old weights (`is_model_file`), so no stale tokenizer sits beside new ones.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
DEFAULT_MAX_SHARD_SIZE_BYTES = 5_000_000_000  # transformers 4.x's default "5GB"

# mtp_jax's MTP convention fields, stored in config.json beside DeepSeek's num_nextn_predict_layers
# (absent in DeepSeek's own files: the defaults follow DeepSeek-V3 as serving engines load it).
MTP_CONVENTION_FIELDS = ("mtp_style", "mtp_concat_order", "mtp_hidden_after_norm", "mtp_chain_after_shared_head_norm")

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072}  # the HF config classes' defaults
_DTYPE_NAMES = ("float32", "bfloat16", "float16")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-parameter buffers some exports contain
# RoPE keys per type, besides "rope_type"/"type", "rope_theta" and "partial_rotary_factor".
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
}
_MAX_LISTED = 20  # names shown per category in a CheckpointError message


class CheckpointError(ValueError):
    """A checkpoint file is corrupt or its tensors do not match the model.

    The message names the file; for tensors, `missing`, `unexpected` and `mismatched` list them.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = list(missing), list(unexpected), list(mismatched)
        parts = [message]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mismatched", self.mismatched)):
            if names:
                shown = ", ".join(names[:_MAX_LISTED])
                more = f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
                parts.append(f"{label} ({len(names)}): {shown}{more}")
        super().__init__("; ".join(parts))


# ----------------------------------------------------------------------------------------------
# Config


_KINDS = {"int": "an int", "number": "a number", "bool": "a bool (true or false)", "str": "a string",
          "object": "an object", "list": "a list"}


def _read(hf: Mapping[str, Any], name: str, kind: str, default: Any = None, *, where: str = "") -> Any:
    """hf[name], checked to be JSON of `kind` (see `_KINDS`); `default` when absent or null.

    No coercion: an int is not a bool, a float or a string is not an int; "number" accepts ints
    and returns a float. `where` prefixes the field name in the error ("rope_scaling.").
    """
    value = hf.get(name)
    if value is None:
        return default
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str),
          "object": isinstance(value, Mapping), "list": isinstance(value, list)}[kind]
    if not ok:
        raise ValueError(f"{where}{name} must be {_KINDS[kind]}, got {value!r}")
    return float(value) if kind == "number" else value


def _read_positive(hf: Mapping[str, Any], name: str, default: int | None = None, *, where: str = "") -> int | None:
    """hf[name] as an int >= 1 (`default` when absent or null); 0 and negatives are errors."""
    value = _read(hf, name, "int", where=where)
    if value is not None and value < 1:
        raise ValueError(f"{where}{name} must be >= 1, got {value}")
    return default if value is None else value


def _read_token_ids(hf: Mapping[str, Any], name: str) -> int | tuple[int, ...] | None:
    """A token id, or a list of them (returned as a tuple)."""
    value = hf.get(name)
    if not isinstance(value, list):
        return _read(hf, name, "int")
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{name}[{i}] must be an int, got {token!r}")
    return tuple(value)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from either RoPE spelling, with transformers 5's precedence rules."""
    scaling, parameters = _read(hf, "rope_scaling", "object"), _read(hf, "rope_parameters", "object")
    field = "rope_scaling" if scaling else "rope_parameters"
    params, where = dict(scaling or parameters or {}), f"{field}."
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{field}: per-layer-type RoPE parameters are not supported")
    theta = _read(params, "rope_theta", "number", where=where)
    theta = _or(theta, _read(hf, "rope_theta", "number", 10000.0))
    rope_type = _read(params, "rope_type", "str", where=where) or _read(params, "type", "str", where=where)
    rope_type = rope_type or "default"
    partial = _read(params, "partial_rotary_factor", "number", where=where)
    partial = _or(partial, _read(hf, "partial_rotary_factor", "number", 1.0))
    for key in ("rope_theta", "rope_type", "type", "partial_rotary_factor"):
        params.pop(key, None)
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0 (RoPE on every dim), got {partial!r}")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"{field}.rope_type {rope_type!r} is not supported (supported: {tuple(_ROPE_KEYS)})")
    unknown = sorted(set(params) - set(_ROPE_KEYS[rope_type]))
    if unknown:
        raise ValueError(f"{field}.{unknown[0]} is not supported for rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, RopeScaling()
    numbers = {key: _read(params, key, "number", where=where)
               for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                           "beta_slow", "mscale", "mscale_all_dim")}
    factor = numbers["factor"]
    if rope_type in ("linear", "llama3") and factor is None:
        raise ValueError(f"{field}.factor is required for rope_type {rope_type!r}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor)
    # transformers 5: a top-level original_max_position_embeddings (Phi-3 style) wins, then the
    # dict's, then max_position_embeddings.
    original = (_read_positive(hf, "original_max_position_embeddings")
                or _read_positive(params, "original_max_position_embeddings", where=where) or max_positions)
    if rope_type == "llama3":
        return theta, RopeScaling(rope_type="llama3", factor=factor, original_max_position_embeddings=original,
                                  low_freq_factor=_or(numbers["low_freq_factor"], 1.0),
                                  high_freq_factor=_or(numbers["high_freq_factor"], 4.0))
    return theta, RopeScaling(
        rope_type="yarn", factor=max_positions / original if factor is None else factor,
        original_max_position_embeddings=original, beta_fast=numbers["beta_fast"] or 32.0,
        beta_slow=numbers["beta_slow"] or 1.0, truncate=_read(params, "truncate", "bool", True, where=where),
        **{key: numbers[key] for key in ("attention_factor", "mscale", "mscale_all_dim")})


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_positions: int, num_layers: int) -> None:
    window = _read_positive(hf, "sliding_window")
    layer_types = _read(hf, "layer_types", "list")
    use_sliding_window = _read(hf, "use_sliding_window", "bool", False)
    max_window_layers = _read(hf, "max_window_layers", "int", 28)
    if window is None or window >= max_positions:
        return  # no window, or one that never binds
    if model_type == "mistral":
        raise ValueError(f"sliding_window={window} < max_position_embeddings={max_positions}: "
                         "sliding-window attention is not supported")
    if model_type == "qwen2" and use_sliding_window:
        in_use = "sliding_attention" in layer_types if layer_types is not None else max_window_layers < num_layers
        if in_use:
            raise ValueError(f"use_sliding_window=True with sliding_window={window}: "
                             "sliding-window attention is not supported")


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` dict (model_type llama, qwen2 or mistral).

    Reads transformers 4.x (`rope_theta`, `rope_scaling` with "type" or "rope_type") and 5.x
    (`rope_parameters`) RoPE fields, rope types default / linear / llama3 / yarn. The stored
    `dtype` (or 4.x `torch_dtype`) becomes both `dtype` and `param_dtype` (float32 when absent).
    Fields with no effect on the forward pass (dropout, use_cache, pad_token_id, ...) are ignored.
    Every field read is type-checked as JSON, without coercion (see `_read`); null means absent.

    Raises:
      ValueError naming the field for anything this model cannot reproduce: another model_type,
      hidden_act != "silu", an unsupported rope type or RoPE key, partial rotary embeddings, a
      sliding window that binds, Llama's attention_bias (it adds an o_proj bias) or mlp_bias,
      quantization_config, a missing size field; and for a field of the wrong JSON type (a string
      or a float where an int is expected, a string where a bool is, a list where an object is)
      or a size that is 0 or negative.
    """
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"the config must be a JSON object, got {type(hf_config).__name__}")
    hf = dict(hf_config)
    model_type = _read(hf, "model_type", "str")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {tuple(_ARCHITECTURES)}, got {model_type!r}")
    sizes = {}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        sizes[name] = _read_positive(hf, name)
        if sizes[name] is None:
            raise ValueError(f"{name} is missing from the config")
    if hf.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantized checkpoints are not supported")
    if _read(hf, "mlp_bias", "bool", False):
        raise ValueError("mlp_bias=True is not supported (the MLP projections have no bias)")
    if _read(hf, "attention_bias", "bool", False) and model_type in ("llama", "mistral"):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it adds an o_proj bias)")
    max_positions = _read_positive(hf, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type])
    _check_sliding_window(hf, model_type, max_positions, sizes["num_hidden_layers"])
    theta, scaling = _rope_from_hf(hf, max_positions)
    dtype = _read(hf, "dtype", "str") or _read(hf, "torch_dtype", "str") or "float32"
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {_DTYPE_NAMES}, got {dtype!r}")
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    head_dim = _read_positive(hf, "head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the derived default: keep configs canonical
    mtp_kinds = {"mtp_style": "str", "mtp_concat_order": "str", "mtp_hidden_after_norm": "bool",
                 "mtp_chain_after_shared_head_norm": "bool"}
    mtp_conventions = {name: _read(hf, name, mtp_kinds[name]) for name in MTP_CONVENTION_FIELDS}
    return ModelConfig(
        **sizes, num_key_value_heads=_read_positive(hf, "num_key_value_heads", heads), head_dim=head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=_read(hf, "rms_norm_eps", "number", 1e-6),
        rope_theta=theta, rope_scaling=scaling, attention_bias=model_type == "qwen2",
        tie_word_embeddings=_read(hf, "tie_word_embeddings", "bool", False),
        hidden_act=_read(hf, "hidden_act", "str", "silu"), dtype=dtype, param_dtype=dtype,
        initializer_range=_read(hf, "initializer_range", "number", 0.02),
        bos_token_id=_read(hf, "bos_token_id", "int"), eos_token_id=_read_token_ids(hf, "eos_token_id"),
        num_nextn_predict_layers=_read(hf, "num_nextn_predict_layers", "int", 0),
        **{name: value for name, value in mtp_conventions.items() if value is not None})


def _rope_to_hf(s: RopeScaling) -> dict[str, Any] | None:
    """The `rope_scaling` dict (without rope_theta) for `s`, None for the default."""
    if s.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
                   original_max_position_embeddings=s.original_max_position_embeddings)
    elif s.rope_type == "yarn":
        out.update(original_max_position_embeddings=s.original_max_position_embeddings,
                   beta_fast=s.beta_fast, beta_slow=s.beta_slow)
        out.update({k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if getattr(s, k) is not None})
        if not s.truncate:
            out["truncate"] = False
    return out


def config_to_hf(config: ModelConfig, *, model_type: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for `config`; `config_from_hf` inverts it.

    model_type: "llama", "qwen2" or "mistral"; default "qwen2" when `attention_bias` (Qwen2's
    q/k/v bias without an o_proj bias) else "llama". RoPE is written both ways, and they agree:
    `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling` (4.x). `dtype` is
    written as `param_dtype`, the weights' storage dtype: config.json holds one dtype, so a
    mixed-precision compute dtype is not recorded and the inverse is exact when
    `dtype == param_dtype`.

    Raises:
      ValueError when the chosen model_type cannot express the config (attention_bias must be True
      for qwen2 and False otherwise).
    """
    model_type = model_type or ("qwen2" if config.attention_bias else "llama")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {tuple(_ARCHITECTURES)}, got {model_type!r}")
    if config.attention_bias != (model_type == "qwen2"):
        raise ValueError(f"attention_bias={config.attention_bias} cannot be expressed as model_type {model_type!r}")
    scaling = _rope_to_hf(config.rope_scaling)
    eos = config.eos_token_id
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.resolved_head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "dtype": config.param_dtype,
    }
    if config.num_nextn_predict_layers:  # DeepSeek-V3's field, plus mtp_jax's conventions (others ignore them)
        hf["num_nextn_predict_layers"] = config.num_nextn_predict_layers
        hf.update({name: getattr(config, name) for name in MTP_CONVENTION_FIELDS})
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    else:
        hf.update(sliding_window=None)
    return hf


# ----------------------------------------------------------------------------------------------
# Names


def hf_name(path: tuple[str | int, ...], config: ModelConfig) -> tuple[str, bool]:
    """The HF tensor name of one parameter path (as `nnx.state` gives it) and whether it is transposed.

    The whole mapping: `lm_head.*` stays at top level, main-model paths get the `model.` prefix,
    MTP module j's paths `mtp.j.<name>` become `model.layers.{L + j}.<name>` (DeepSeek-V3); leaf
    `kernel` [in, out] is `weight` [out, in], `embedding` is `weight`, others keep their name.
    """
    *modules, leaf = (str(p) for p in path)
    if modules[0] == "lm_head":
        prefix = []
    elif modules[0] == "mtp":
        prefix, modules = ["model", "layers", str(config.num_hidden_layers + int(modules[1]))], modules[2:]
    else:
        prefix = ["model"]
    name = "weight" if leaf in ("kernel", "embedding") else leaf
    return ".".join([*prefix, *modules, name]), leaf == "kernel"


def _layout(params: nnx.State, config: ModelConfig) -> dict[str, tuple[tuple, bool, tuple[int, ...]]]:
    """HF name -> (our path, transposed, HF shape) for every parameter, in model order."""
    layout = {}
    for path, variable in nnx.to_flat_state(params):
        name, transposed = hf_name(path, config)
        shape = tuple(variable.get_value().shape)
        layout[name] = (path, transposed, shape[::-1] if transposed else shape)
    return layout


# ----------------------------------------------------------------------------------------------
# Load


def _read_json(file: Path) -> Any:
    """The parsed contents of a JSON file; CheckpointError naming it when it is not valid JSON."""
    try:
        return json.loads(file.read_bytes())
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error


def _read_config(path: Path) -> ModelConfig:
    """The config of checkpoint directory `path`; errors name config.json."""
    file = path / CONFIG_FILE
    hf = _read_json(file)
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(hf).__name__}")
    try:
        return config_from_hf(hf)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from error


def _is_plain_file_name(name: Any) -> bool:
    """A file name with no directory part: not absolute, no separator, not "." or ".."."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and not os.path.isabs(name))


def _weight_files(path: Path) -> dict[str, list[str] | None]:
    """File name -> the tensor names the index places there (None: a single file, no index)."""
    if (path / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: None}
    index_file = path / INDEX_FILE
    if not index_file.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path}")
    index = _read_json(index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file} has no weight_map object (tensor name -> shard file name)")
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not _is_plain_file_name(file):
            raise CheckpointError(f"{index_file}: the shard {file!r} of {name} is not a plain file name in {path}")
        files.setdefault(file, []).append(name)
    return files


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator[Any]:
    """`safe_open(file)`; a file that is not valid safetensors raises a CheckpointError naming it."""
    try:
        with safe_open(file, framework="np") as f:
            yield f
    except SafetensorError as error:
        raise CheckpointError(f"{file} is not a valid safetensors file: {error}") from error


def _scan(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> file, name -> shape, name -> safetensors dtype) over every tensor in the files."""
    where, shapes, dtypes = {}, {}, {}
    for file, listed in _weight_files(path).items():
        if not (path / file).is_file():
            raise CheckpointError(f"{path / INDEX_FILE} names {file}, which does not exist", missing=listed)
        with _open_safetensors(path / file) as f:
            keys = list(f.keys())
            absent = sorted(set(listed or ()) - set(keys))
            if absent:
                raise CheckpointError(f"{path / INDEX_FILE} places tensors in {file} that it lacks", missing=absent)
            for name in keys:
                if name in where:
                    raise CheckpointError(f"{name} is stored in both {where[name]} and {file}")
                tensor = f.get_slice(name)
                where[name], shapes[name], dtypes[name] = file, tuple(tensor.get_shape()), tensor.get_dtype()
    return where, shapes, dtypes


def _shared_copies(config: ModelConfig) -> dict[str, str]:
    """Tensors a checkpoint may carry as copies of shared ones: copy name -> the name it must equal.

    Tied models may still store `lm_head.weight`; DeepSeek-V3 stores each MTP layer's
    `embed_tokens` and `shared_head.head` (README_WEIGHTS.md), which here are the main model's.
    """
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    copies = {"lm_head.weight": head} if config.tie_word_embeddings else {}
    for j in range(config.num_nextn_predict_layers):
        layer = f"model.layers.{config.num_hidden_layers + j}"
        copies[f"{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        copies[f"{layer}.shared_head.head.weight"] = head
    return copies


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: str | None = None) -> Transformer:
    """A `Transformer` from a Hugging Face checkpoint directory (config.json + safetensors).

    Args:
      path: a directory holding `config.json` and `model.safetensors`, or shards listed in
        `model.safetensors.index.json` (the format `save_pretrained` writes).
      dtype: "float32", "bfloat16" or "float16" for the model's weights and compute; default the
        checkpoint's stored dtype (`config.json` `dtype` / `torch_dtype`, else float32). Tensors are
        cast on load.

    Returns:
      The model; Linear kernels [in, out] are the files' weights [out, in] transposed.

    Raises:
      FileNotFoundError: no config.json or no weights file.
      CheckpointError (a ValueError) naming the file: config.json that is not a JSON object or that
        `config_from_hf` refuses (an unsupported or ill-typed field); an index that is not JSON,
        has no `weight_map`, or names a shard that is not a plain file name in `path` (`..`,
        absolute paths and subdirectories are refused); a safetensors file that is empty,
        truncated or not safetensors at all; missing tensors, unexpected tensors, shapes [out, in] other than the
        config's, non-float tensors, an index inconsistent with its shards, or (tied embeddings) a
        `lm_head.weight` that differs from `model.embed_tokens.weight` (likewise DeepSeek's
        per-MTP-layer `embed_tokens` / `shared_head.head` copies, see `_shared_copies`).

    MTP modules (`num_nextn_predict_layers` > 0) load from DeepSeek-V3's layout:
    `model.layers.{L + j}.{enorm,hnorm,eh_proj,shared_head.norm,<block>}` for module j.

    A save that a kill interrupted between its two renames (`mtp_jax.atomic_dir`) is finished
    first, so `path` holds the new checkpoint.
    """
    path = Path(path)
    atomic_dir.recover(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    config = _read_config(path)
    if dtype is not None:
        try:
            dtype = jnp.dtype(dtype).name
        except TypeError:
            pass  # not a dtype at all: reported below
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {_DTYPE_NAMES}, got {dtype!r}")
        config = config.replace(dtype=dtype, param_dtype=dtype)
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    layout = _layout(params, config)
    where, shapes, dtypes = _scan(path)

    copies = {name: source for name, source in _shared_copies(config).items() if name in where}
    found = set(where) - set(copies)
    missing = [name for name in layout if name not in found]
    unexpected = sorted(n for n in found - set(layout) if not n.endswith(_IGNORED_SUFFIXES))
    mismatched = [f"{name} (expected shape {list(layout[name][2])}, found {list(shapes[name])})"
                  for name in layout if name in found and shapes[name] != layout[name][2]]
    mismatched += [f"{name} (dtype {dtypes[name]} is not a float type)"
                   for name in layout if name in found and dtypes[name] not in ("F32", "BF16", "F16", "F64")]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"checkpoint {path} does not match the config", missing=missing,
                              unexpected=unexpected, mismatched=mismatched)

    weight_dtype = config.weight_dtype
    values, copy_values = {}, {}
    for file in sorted(set(where.values())):
        with _open_safetensors(path / file) as f:
            for name in (n for n in layout if where[n] == file):
                array = f.get_tensor(name)
                values[name] = jnp.asarray(array.T if layout[name][1] else array, dtype=weight_dtype)
            copy_values.update({name: f.get_tensor(name) for name in copies if where[name] == file})
    for name, copy in copy_values.items():  # after all files: the shared tensor may sit in a later shard
        source = values[copies[name]].T if layout[copies[name]][1] else values[copies[name]]
        if copy.shape != source.shape or not np.array_equal(np.asarray(jnp.asarray(copy, weight_dtype)),
                                                            np.asarray(source)):
            raise CheckpointError(f"{name} must be a copy of the shared {copies[name]} but differs",
                                  unexpected=[name])
    flat = [(path_, variable.replace(values[hf_name(path_, config)[0]]))
            for path_, variable in nnx.to_flat_state(params)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ----------------------------------------------------------------------------------------------
# Save


_MODEL_FILE_PATTERNS = (CONFIG_FILE, "generation_config.json", WEIGHTS_FILE, INDEX_FILE, "model-*-of-*.safetensors",
                        "pytorch_model*.bin", "pytorch_model.bin.index.json", *TOKENIZER_FILES)


def is_model_file(name: str) -> bool:
    """Whether a file name in a model directory belongs to the model or its tokenizer.

    These are the files an overwriting save replaces or drops (config.json, generation_config.json,
    safetensors weights and index, torch `pytorch_model*.bin` weights, `TOKENIZER_FILES`); any
    other plain file (a README, ...) is carried over into the new directory.
    """
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in _MODEL_FILE_PATTERNS)


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names in order, split greedily into shards of at most max_bytes (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_files(model: Transformer, directory: str | os.PathLike, *,
                   max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES, model_type: str | None = None) -> None:
    """Writes `model`'s checkpoint files into the existing `directory`, in place (not atomic).

    The files and arguments are `save_hf_checkpoint`'s, which wraps this in an atomic directory
    swap; `mtp_jax.pretrained.save_pretrained` adds the tokenizer inside the same swap.

    Raises:
      ValueError: the config cannot be expressed as `model_type`, or max_shard_size_bytes < 1.
    """
    if max_shard_size_bytes < 1:
        raise ValueError(f"max_shard_size_bytes must be >= 1, got {max_shard_size_bytes}")
    directory = Path(directory)
    config = model.config
    hf_config = config_to_hf(config, model_type=model_type)
    tensors = {}
    for param_path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = hf_name(param_path, config)
        array = np.asarray(jax.device_get(variable.get_value()))
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    shards = _shards({name: t.nbytes for name, t in tensors.items()}, max_shard_size_bytes)
    metadata = {"format": "pt"}  # as save_pretrained writes it (transformers 4.x checks this field)
    if len(shards) == 1:
        save_file(tensors, directory / WEIGHTS_FILE, metadata=metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({name: tensors[name] for name in names}, directory / file, metadata=metadata)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike, *,
                       max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES, overwrite: bool = False,
                       model_type: str | None = None) -> None:
    """Writes `model` as a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

    Writes `config.json` (`config_to_hf`) and the weights in `param_dtype`: one
    `model.safetensors` when they fit in `max_shard_size_bytes` (bytes of tensor data), else
    shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Linear kernels
    [in, out] are written as torch's [out, in]; tied models write no `lm_head.weight`.

    The save is atomic (`mtp_jax.atomic_dir.replace_dir`): the files go to a temporary sibling
    directory `.{name}.tmp-*`, fsynced, which then replaces `path`; a kill at any point leaves
    the old or the new checkpoint at `path`, and an exception leaves `path` as it was and no
    temporary files.

    Args:
      model: the model to save.
      path: the directory; created if needed (with its parents).
      max_shard_size_bytes: shard size limit (a single larger tensor gets a shard of its own).
      overwrite: replace the checkpoint in a non-empty directory. The old model and tokenizer
        files (`is_model_file`: weights, config.json, tokenizer.json, ...) are all dropped, so no
        stale tokenizer is left beside the new weights; other plain files are carried over.
      model_type: see `config_to_hf`.

    Raises:
      FileExistsError: `path` is a file, a non-empty directory and `overwrite` is False, or a
        directory holding a subdirectory or symlink (which the swap would lose).
      ValueError: the config cannot be expressed as `model_type`, or max_shard_size_bytes < 1.
    """
    with atomic_dir.replace_dir(path, overwrite=overwrite, owned=is_model_file) as new:
        write_hf_files(model, new, max_shard_size_bytes=max_shard_size_bytes, model_type=model_type)
