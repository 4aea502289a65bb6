"""Hugging Face checkpoint export: `save_hf_checkpoint` (config.json plus safetensors weights).

FP8 models (`ModelConfig.quantization`) are written in DeepSeek-V3's format: each quantized kernel as
`<module>.weight` F8_E4M3 [out, in] beside `<module>.weight_scale_inv` F32 [ceil(out/b_out), ceil(in/b_in)]
(`safetensors.numpy.save_file` writes an `ml_dtypes.float8_e4m3fn` array as F8_E4M3; its NumPy reader
cannot return one, torch's can). A model holding its MTP modules unquantized beside the FP8 trunk
(`Fp8Config.quantize_mtp` False, heads-only training) has them block-quantized on write where the trunk's
rule quantizes (`stored_config`), so the files are the format config.json's `quantization_config` describes.
DeepSeek's MTP layers also carry copies of the shared embedding and head
(`names.shared_copies`), written as the official checkpoints hold them. Qwen3.5 and MiMo models
(`ModelConfig.mtp_layout`) are written in their own layouts (`mtp_jax.checkpoints.families`): the
text model's `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` names with `mtp.*` (routed experts one tensor per
expert, as transformers' `save_pretrained` writes them), and MiMo's `model.mtp_layers.{j}.*`.

Saving is atomic (`mtp_jax.checkpoints.atomic_dir`): the checkpoint is written to a temporary sibling
directory and swapped in, so a kill at any point leaves the old or the new checkpoint at `path`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from mtp_jax.checkpoints import atomic_dir
from mtp_jax.checkpoints.format import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE_BYTES,
    INDEX_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
)
from mtp_jax.checkpoints.hf_config import config_to_hf
from mtp_jax.checkpoints.names import hf_names, shared_copies, tensor_axes, unfuse
from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer, abstract_model
from mtp_jax.mtp import MTP_PARAMS
from mtp_jax.quantization import quantize_fp8_blocks

_MODEL_FILE_PATTERNS = (
    CONFIG_FILE,
    "generation_config.json",
    WEIGHTS_FILE,
    INDEX_FILE,
    "model-*-of-*.safetensors",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
    *TOKENIZER_FILES,
)


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


def save_safetensors(tensors: dict[str, np.ndarray], file: Path, metadata: dict[str, str]) -> None:
    """`safetensors.numpy.save_file`, the file then given the mode an ordinary new file gets (0666 less the
    umask, as config.json): safetensors creates it 0600, unreadable to the other users of a shared model."""
    save_file(tensors, file, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    file.chmod(0o666 & ~umask)


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """HF tensor name -> the numpy array the files hold (torch's [out, in] for kernels), in model order.

    What `write_hf_files` writes. Both layer layouts (`ModelConfig.scan_layers`) give the same dict
    for the same weights, in the same order (a layer group's tensors layer by layer, as the unrolled
    layout orders them), so they shard and save alike. FP8 kernels are float8_e4m3fn (`ml_dtypes`)
    [out, in] and their scales float32 [ceil(out/b_out), ceil(in/b_in)] (each piece's block columns of
    the scale parameter, transposed: bit-exact). Each DeepSeek MTP layer's `embed_tokens` and
    `shared_head.head` copies (`names.shared_copies`; the same arrays as the shared tensors) follow its
    own tensors.
    """
    config = model.config
    keyed = []  # ((position of the path or of its layer group's first path, layer within the group, path), ...)
    group_position: dict[tuple, int] = {}
    for position, (param_path, variable) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        tensors = param_tensors(param_path, variable.get_value(), config)
        grouped = str(param_path[0]) == "layer_groups"
        where = group_position.setdefault(tuple(param_path[:2]), position) if grouped else position
        per_layer = len(tensors) // (variable.get_value().shape[0] if grouped else 1)
        for k, (name, tensor) in enumerate(tensors):
            keyed.append(((where, k // per_layer, position), name, tensor))
    tensors = {name: tensor for _, name, tensor in sorted(keyed, key=lambda entry: entry[0])}
    return _with_mtp_copies(_quantized_mtp(tensors, config), config)


def stored_config(config: ModelConfig) -> ModelConfig:
    """`config` as the files store its model: with `Fp8Config.quantize_mtp` False (MTP modules held
    unquantized beside an FP8 trunk) the same config quantizing them too; else `config` itself."""
    fp8 = config.quantization
    if fp8 is None or fp8.quantize_mtp:
        return config
    return config.replace(quantization=dataclasses.replace(fp8, quantize_mtp=True))


def _quantized_mtp(tensors: dict[str, np.ndarray], config: ModelConfig) -> dict[str, np.ndarray]:
    """`tensors` with the float MTP weights that `stored_config(config)` holds in FP8 block-quantized
    (`quantize_fp8_blocks`: float8_e4m3fn [out, in], each followed by its float32 `weight_scale_inv`)."""
    stored = stored_config(config)
    if stored is config:
        return tensors
    fp8_names = {
        name
        for path, variable in nnx.to_flat_state(nnx.state(abstract_model(stored), MTP_PARAMS))
        if variable.get_value().dtype == np.dtype(jax.numpy.float8_e4m3fn)
        for name, _ in hf_names(path, stored)
    }
    out = {}
    for name, tensor in tensors.items():
        if name in fp8_names:
            out[name], out[f"{name}_scale_inv"] = quantize_fp8_blocks(tensor, stored.quantization.weight_block_size)
        else:
            out[name] = tensor
    return out


def param_tensors(param_path: tuple[str | int, ...], value, config) -> list[tuple[str, np.ndarray]]:
    """The HF tensors [(name, numpy array as the files hold it)] of one parameter (`value`, on device or
    host, at `param_path` of a model of `config`), in `names.hf_names` order: each slice of its stacked
    axes (`tensor_axes`) unfused into its HF pieces (`unfuse`, bit-exact), kernels transposed to [out, in]."""
    array = np.asarray(jax.device_get(value))
    axes = tensor_axes(param_path)  # stacked layers / experts: one tensor set per slice
    slices = list(array.reshape(-1, *array.shape[axes:])) if axes else [array]
    parts = [part for one in slices for part in unfuse(param_path, one, config)]  # a slice's HF tensors
    return [
        (name, np.ascontiguousarray(part.T if transposed else part))
        for (name, transposed), part in zip(hf_names(param_path, config), parts, strict=True)
    ]


def _with_mtp_copies(tensors: dict[str, np.ndarray], config) -> dict[str, np.ndarray]:
    """`tensors` with each MTP layer's copies of the shared tensors (`shared_copies`: `embed_tokens`,
    `shared_head.head`) right after that layer's last tensor."""
    copies = {name: source for name, source in shared_copies(config).items() if name.startswith("model.layers.")}
    if not copies:
        return tensors
    out = {}
    names = list(tensors)
    for k, name in enumerate(names):
        out[name] = tensors[name]
        layer = ".".join(name.split(".")[:3]) + "."  # "model.layers.{n}." (other names: no copy starts so)
        if k + 1 == len(names) or not names[k + 1].startswith(layer):
            out.update({copy: tensors[source] for copy, source in copies.items() if copy.startswith(layer)})
    return out


def write_hf_files(
    model: Transformer,
    directory: str | os.PathLike,
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    model_type: str | None = None,
) -> None:
    """Writes `model`'s checkpoint files into the existing `directory`, in place (not atomic).

    The files and arguments are `save_hf_checkpoint`'s, which wraps this in an atomic directory
    swap; `mtp_jax.checkpoints.pretrained.save_pretrained` adds the tokenizer inside the same swap.

    Raises:
      ValueError: the config cannot be expressed as `model_type` or max_shard_size_bytes < 1.
    """
    if max_shard_size_bytes < 1:
        raise ValueError(f"max_shard_size_bytes must be >= 1, got {max_shard_size_bytes}")
    directory = Path(directory)
    config = model.config
    hf_config = config_to_hf(config, model_type=model_type)
    tensors = hf_tensors(model)
    shards = _shards({name: t.nbytes for name, t in tensors.items()}, max_shard_size_bytes)
    metadata = {"format": "pt"}  # as save_pretrained writes it (transformers 4.x checks this field)
    if len(shards) == 1:
        save_safetensors(tensors, directory / WEIGHTS_FILE, metadata)
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_safetensors({name: tensors[name] for name in names}, directory / file, metadata)
            weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")


def save_hf_checkpoint(
    model: Transformer,
    path: str | os.PathLike,
    *,
    max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES,
    overwrite: bool = False,
    model_type: str | None = None,
) -> None:
    """Writes `model` as a Hugging Face checkpoint that `AutoModelForCausalLM.from_pretrained` loads.

    Writes `config.json` (`config_to_hf`) and the weights in `param_dtype` (FP8 kernels as F8_E4M3 with
    their F32 `weight_scale_inv`, DeepSeek-V3's format; `hf_tensors`): one
    `model.safetensors` when they fit in `max_shard_size_bytes` (bytes of tensor data), else
    shards `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. Linear kernels
    [in, out] are written as torch's [out, in]; tied models write no `lm_head.weight`; DeepSeek MTP
    layers carry copies of the embedding and head (`model.layers.{L + j}.embed_tokens.weight`,
    `.shared_head.head.weight`), as DeepSeek-V3's files do. Qwen3.5 and MiMo models are written as
    "qwen3_5_text" / "qwen3_5_moe_text" (transformers' `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` load them
    and ignore `mtp.*`) and "mimo" (XiaomiMiMo's remote code; transformers' `Qwen2ForCausalLM` loads its main
    model), their MTP layers in their own names (`mtp_jax.checkpoints.families`).

    The save is atomic (`mtp_jax.checkpoints.atomic_dir.replace_dir`): the files go to a temporary sibling
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
      ValueError: the config cannot be expressed as `model_type` or max_shard_size_bytes < 1.
    """
    with atomic_dir.replace_dir(path, overwrite=overwrite, owned=is_model_file) as new:
        write_hf_files(model, new, max_shard_size_bytes=max_shard_size_bytes, model_type=model_type)
