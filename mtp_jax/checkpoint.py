"""Hugging Face checkpoint import and export: `config.json` plus safetensors weights.

Format (what `transformers`' `save_pretrained` writes and `from_pretrained` reads):
  - `config.json`: a `LlamaConfig` / `Qwen2Config` / `MistralConfig` as JSON. Both RoPE spellings
    are read: transformers 4.x's `rope_theta` + `rope_scaling`, and transformers 5's
    `rope_parameters` dict (which holds `rope_theta`); both are written.
  - `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.

Names: our parameter paths are HF's module names (see `mtp_jax.model`), so `hf_name` is the one
place that maps them: `layers.3.mlp.up_proj.kernel` is `model.layers.3.mlp.up_proj.weight`.
Linear kernels are stored [in, out] here and [out, in] (torch's layout) in the files. The MTP
modules' rule (`mtp.j.<name>` <-> `model.layers.{L + j}.<name>`, DeepSeek-V3's README_WEIGHTS.md)
is in the table, but MTP import/export is not supported yet: configs with MTP modules are refused.

Loading is strict: every tensor in the files must fill a parameter and every parameter must be
filled, with the stored shape; otherwise a `CheckpointError` lists what is missing, unexpected or
mis-shaped. Two documented exceptions: `*.rotary_emb.inv_freq` buffers (old exports) are
ignored, and with tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
accepted as a redundant copy (a *different* one is an error: the checkpoint is not tied).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.model import Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
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
    """Checkpoint tensors do not match the model: `missing`, `unexpected` and `mismatched` list them."""

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


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from either RoPE spelling, with transformers 5's precedence rules."""
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{field}: per-layer-type RoPE parameters are not supported")
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor must be 1.0 (RoPE on every dim), got {partial!r}")
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"{field}.rope_type {rope_type!r} is not supported (supported: {tuple(_ROPE_KEYS)})")
    unknown = sorted(set(params) - set(_ROPE_KEYS[rope_type]))
    if unknown:
        raise ValueError(f"{field}.{unknown[0]} is not supported for rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type in ("linear", "llama3") and params.get("factor") is None:
        raise ValueError(f"{field}.factor is required for rope_type {rope_type!r}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    # transformers 5: a top-level original_max_position_embeddings (Phi-3 style) wins, then the
    # dict's, then max_position_embeddings.
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = int(original or max_positions)
    if rope_type == "llama3":
        return theta, RopeScaling(rope_type="llama3", factor=float(params["factor"]),
                                  original_max_position_embeddings=original,
                                  low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                                  high_freq_factor=float(params.get("high_freq_factor", 4.0)))
    factor = params.get("factor")
    optional = {k: (None if params.get(k) is None else float(params[k]))
                for k in ("attention_factor", "mscale", "mscale_all_dim")}
    return theta, RopeScaling(
        rope_type="yarn", factor=float(max_positions / original if factor is None else factor),
        original_max_position_embeddings=original, beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0), truncate=bool(params.get("truncate", True)), **optional)


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_positions: int, num_layers: int) -> None:
    window = hf.get("sliding_window")
    if window is None or window >= max_positions:
        return  # no window, or one that never binds
    if model_type == "mistral":
        raise ValueError(f"sliding_window={window} < max_position_embeddings={max_positions}: "
                         "sliding-window attention is not supported")
    if model_type == "qwen2" and hf.get("use_sliding_window", False):
        layer_types = hf.get("layer_types")
        if layer_types is not None:
            in_use = "sliding_attention" in layer_types
        else:
            in_use = hf.get("max_window_layers", 28) < num_layers
        if in_use:
            raise ValueError(f"use_sliding_window=True with sliding_window={window}: "
                             "sliding-window attention is not supported")


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` dict (model_type llama, qwen2 or mistral).

    Reads transformers 4.x (`rope_theta`, `rope_scaling` with "type" or "rope_type") and 5.x
    (`rope_parameters`) RoPE fields, rope types default / linear / llama3 / yarn. The stored
    `dtype` (or 4.x `torch_dtype`) becomes both `dtype` and `param_dtype` (float32 when absent).
    Fields with no effect on the forward pass (dropout, use_cache, pad_token_id, ...) are ignored.

    Raises:
      ValueError naming the field for anything this model cannot reproduce: another model_type,
      hidden_act != "silu", an unsupported rope type or RoPE key, partial rotary embeddings, a
      sliding window that binds, Llama's attention_bias (it adds an o_proj bias) or mlp_bias,
      quantization_config, a missing size field.
    """
    hf = dict(hf_config)
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {tuple(_ARCHITECTURES)}, got {model_type!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if hf.get(name) is None:
            raise ValueError(f"{name} is missing from the config")
    if hf.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantized checkpoints are not supported")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (the MLP projections have no bias)")
    if model_type in ("llama", "mistral") and hf.get("attention_bias", False):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it adds an o_proj bias)")
    max_positions = int(hf.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[model_type])
    _check_sliding_window(hf, model_type, max_positions, hf["num_hidden_layers"])
    theta, scaling = _rope_from_hf(hf, max_positions)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {_DTYPE_NAMES}, got {dtype!r}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim is not None and hf["hidden_size"] % heads == 0 and head_dim == hf["hidden_size"] // heads:
        head_dim = None  # the derived default: keep configs canonical
    eos = hf.get("eos_token_id")
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"], num_attention_heads=heads,
        num_key_value_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling, attention_bias=model_type == "qwen2",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), hidden_act=hf.get("hidden_act", "silu"),
        dtype=dtype, param_dtype=dtype, initializer_range=float(hf.get("initializer_range", 0.02)),
        bos_token_id=hf.get("bos_token_id"), eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
        **{name: hf[name] for name in MTP_CONVENTION_FIELDS if name in hf})


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


def _weight_files(path: Path) -> dict[str, list[str] | None]:
    """File name -> the tensor names the index places there (None: a single file, no index)."""
    if (path / WEIGHTS_FILE).is_file():
        return {WEIGHTS_FILE: None}
    if not (path / INDEX_FILE).is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {path}")
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    files: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        files.setdefault(file, []).append(name)
    return files


def _scan(path: Path) -> tuple[dict[str, str], dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> file, name -> shape, name -> safetensors dtype) over every tensor in the files."""
    where, shapes, dtypes = {}, {}, {}
    for file, listed in _weight_files(path).items():
        if not (path / file).is_file():
            raise CheckpointError(f"{INDEX_FILE} names {file}, which does not exist", missing=listed)
        with safe_open(path / file, framework="np") as f:
            keys = list(f.keys())
            absent = sorted(set(listed or ()) - set(keys))
            if absent:
                raise CheckpointError(f"{INDEX_FILE} places tensors in {file} that it lacks", missing=absent)
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
      ValueError: an unsupported config (see `config_from_hf`).
      CheckpointError: missing tensors, unexpected tensors, shapes [out, in] other than the
        config's, non-float tensors, an index inconsistent with its shards, or (tied embeddings) a
        `lm_head.weight` that differs from `model.embed_tokens.weight` (likewise DeepSeek's
        per-MTP-layer `embed_tokens` / `shared_head.head` copies, see `_shared_copies`).

    MTP modules (`num_nextn_predict_layers` > 0) load from DeepSeek-V3's layout:
    `model.layers.{L + j}.{enorm,hnorm,eh_proj,shared_head.norm,<block>}` for module j.
    """
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    config = config_from_hf(json.loads((path / CONFIG_FILE).read_text()))
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
    values = {}
    for file in sorted(set(where.values())):
        with safe_open(path / file, framework="np") as f:
            for name in (n for n in layout if where[n] == file):
                array = f.get_tensor(name)
                values[name] = jnp.asarray(array.T if layout[name][1] else array, dtype=weight_dtype)
            for name in (n for n in copies if where[n] == file):
                copy = f.get_tensor(name)
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


def _prepare_dir(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{path} is not empty; pass overwrite=True to replace its checkpoint")
        # Replace the checkpoint's own files (stale shards would confuse loaders); keep the rest
        # (tokenizer files, README, ...).
        for old in [path / CONFIG_FILE, path / INDEX_FILE, path / WEIGHTS_FILE, *path.glob("model-*-of-*.safetensors")]:
            if old.is_file():
                old.unlink()
    path.mkdir(parents=True, exist_ok=True)


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


def save_hf_checkpoint(model: Transformer, path: str | os.PathLike, *,
                       max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES, overwrite: bool = False,
                       model_type: str | None = None) -> None:
    """Writes `model` as a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

    Writes `config.json` (`config_to_hf`) and the weights in `param_dtype`: one
    `model.safetensors` when they fit in `max_shard_size_bytes` (bytes of tensor data), else
    shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Linear kernels
    [in, out] are written as torch's [out, in]; tied models write no `lm_head.weight`.

    Args:
      model: the model to save.
      path: the directory; created if needed.
      max_shard_size_bytes: shard size limit (a single larger tensor gets a shard of its own).
      overwrite: replace the checkpoint files (config.json, model*.safetensors, the index) of a
        non-empty directory; other files there are kept.
      model_type: see `config_to_hf`.

    Raises:
      FileExistsError: `path` is a file, or a non-empty directory and `overwrite` is False.
      ValueError: the config cannot be expressed as `model_type`, or max_shard_size_bytes < 1.
    """
    if max_shard_size_bytes < 1:
        raise ValueError(f"max_shard_size_bytes must be >= 1, got {max_shard_size_bytes}")
    path = Path(path)
    config = model.config
    hf_config = config_to_hf(config, model_type=model_type)
    _prepare_dir(path, overwrite)
    tensors = {}
    for param_path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name, transposed = hf_name(param_path, config)
        array = np.asarray(jax.device_get(variable.get_value()))
        tensors[name] = np.ascontiguousarray(array.T if transposed else array)
    shards = _shards({name: t.nbytes for name, t in tensors.items()}, max_shard_size_bytes)
    metadata = {"format": "pt"}  # as save_pretrained writes it (transformers 4.x checks this field)
    if len(shards) == 1:
        save_file(tensors, path / WEIGHTS_FILE, metadata=metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({name: tensors[name] for name in names}, path / file, metadata=metadata)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
