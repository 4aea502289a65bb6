"""Heads-only export: a source checkpoint whose MTP modules are replaced by a model's, every other byte kept.

`export_mtp_heads(model, source_dir, out_dir)` is the export of heads-only fine-tuning (`mtp-jax train
--init-from DIR --mtp-only`): the trunk was frozen, so its tensors are copied from the source's files
byte for byte (same name, safetensors dtype, shape and data: FP8 weights and their `weight_scale_inv`,
DeepSeek's per-MTP-layer copies of the embedding and head, `names.shared_copies`, included) instead of
being rewritten from the model, and only the MTP modules' tensors are the model's, in the family's own
names and layout (`names.hf_names`, `writing.param_tensors`; a Qwen3.5 source's fused routed experts
are written fused again, `families.tensor_views`).

Which stored tensors are MTP tensors is derived from parameters, never from name patterns: the HF
names of the model's `mtp.MTP_PARAMS` and of the source config's (an abstract model of it), and the
stored tensors that hold them.

Dtypes: an MTP tensor the source stores keeps the source's safetensors dtype (float32 master weights
of training are cast to it; a float weight the source holds in FP8 is block-quantized again,
`quantization.quantize_fp8_blocks`, with its `weight_scale_inv`); one the source lacks (heads added)
takes the dtype `save_pretrained` gives that parameter (`abstract_model(writing.stored_config(model.config))`'s: for a
model holding its MTP modules unquantized beside an FP8 trunk, `Fp8Config.quantize_mtp` False, FP8 with its
scales where the trunk's rule quantizes, as the family stores them), and in
DeepSeek's layout a new MTP layer gets the copies of the embedding and head that the source's MTP layers carry (all of
them when the source had none, as `save_pretrained` writes). config.json is the source's, byte for byte,
unless D changed (heads added: `families.mtp_field`'s `num_nextn_predict_layers` or Qwen3.5's
`mtp_num_hidden_layers` then says the new D) or the model's MTP conventions (`MTP_CONVENTION_FIELDS`)
differ from what the source's config reads as (those fields are then written). Tokenizer files and
every other file or folder of the source are copied as they are; other
weights formats (`pytorch_model*.bin`) are not (they would hold the old MTP modules).

`source_fingerprint` identifies a source's weights (config.json, each weights file's name, size,
modification time and safetensors header), so that a run can tell at export whether the source it
started from is still the same.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
from flax import nnx

from mtp_jax.checkpoints import atomic_dir, families
from mtp_jax.checkpoints.format import CONFIG_FILE, INDEX_FILE, TOKENIZER_FILES, WEIGHTS_FILE, CheckpointError
from mtp_jax.checkpoints.hf_config import MTP_CONVENTION_FIELDS, config_from_hf
from mtp_jax.checkpoints.names import hf_names, shared_copies
from mtp_jax.checkpoints.reading import open_weights, read_json
from mtp_jax.checkpoints.tensor_reads import DTYPES, TensorFile
from mtp_jax.checkpoints.writing import is_model_file, param_tensors, save_safetensors, stored_config
from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer, abstract_model
from mtp_jax.mtp import MTP_PARAMS
from mtp_jax.quantization import FP8_DTYPE, quantize_fp8_blocks

_SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_KEPT_MODEL_FILES = ("generation_config.json", *TOKENIZER_FILES)  # model files copied as they are
# Fields that may differ between the model and its source: dtypes, layout, FP8 dequantized on load, D.
_FREE_FIELDS = ("dtype", "param_dtype", "scan_layers", "attention_impl", "quantization", "num_nextn_predict_layers")


def export_mtp_heads(
    model: Transformer, source_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> None:
    """Writes `out_dir`: the checkpoint in `source_dir` with its MTP modules' tensors taken from `model`.

    Every stored tensor that is not an MTP module's is copied byte for byte; the MTP modules' are
    `model`'s (module docstring: names, dtypes, config.json). In a sharded source
    (`model.safetensors.index.json`) each tensor stays in its file, the tensors of added heads go to the
    file that held the source's first MTP tensor (else the last shard), and the index is rewritten to
    match (its `total_size` recomputed). The write is atomic (`atomic_dir.replace_dir`, as `save_pretrained`);
    the source is only read (pinned against a concurrent save, `atomic_dir.read_dir`).

    Args:
      model: the model whose MTP modules are written; its main model must be the source's (the same
        config but for dtypes, layer layout, FP8 dequantization and D).
      source_dir: the Hugging Face-format directory `model` was loaded from.
      out_dir: the new directory; created if needed.
      overwrite: replace a non-empty `out_dir` (its old model and tokenizer files dropped, other
        plain files kept, as `save_pretrained`).

    Raises:
      FileExistsError: `out_dir` is a file, or a non-empty directory and `overwrite` is False.
      ValueError: `out_dir` is `source_dir` or one holds the other; `model`'s config differs from the
        source's beyond the fields above; a source MTP tensor has another shape than the model's, is
        stored in a float dtype where the model holds it in FP8, or is part of a fused tensor the source
        holds in FP8; a value overflows the source's dtype (e.g. float16); a `CheckpointError` for a
        source that is not a readable checkpoint.
      FileNotFoundError: no config.json or weights in `source_dir`.
    """
    source, out = Path(source_dir).resolve(), Path(out_dir).resolve()
    if out == source or source in out.parents or out in source.parents:
        raise ValueError(f"out_dir {out} must be outside the source {source} (and not hold it)")
    if not (source / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {source}")
    with atomic_dir.replace_dir(out, overwrite=overwrite, owned=is_model_file) as new:
        atomic_dir.read_dir(source, lambda root: _write_heads(model, root, source, new))


def source_fingerprint(source_dir: str | os.PathLike) -> str:
    """A sha256 (hex) of what a checkpoint directory's weights are: config.json's bytes, and for each
    safetensors file and the index, its name, size, modification time (ns) and, for safetensors, its
    header (tensor names, dtypes, shapes and offsets). Cheap: reads headers only. Raises OSError for a
    missing or unreadable directory."""
    root = Path(source_dir)
    digest = hashlib.sha256((root / CONFIG_FILE).read_bytes())
    for file in sorted(root.iterdir()):
        if file.name != INDEX_FILE and not file.name.endswith(".safetensors"):
            continue
        stat = file.stat()
        digest.update(f"\0{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
        with open(file, "rb") as f:
            if file.name == INDEX_FILE:
                digest.update(f.read())
            elif len(head := f.read(8)) == 8:
                digest.update(f.read(struct.unpack("<Q", head)[0]))
    return digest.hexdigest()


def mtp_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """HF name -> array (as the files hold it, in the parameter's dtype) of every tensor of `model`'s MTP
    modules (`mtp.MTP_PARAMS`), in model order; no shared copies (those are the main model's)."""
    tensors = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, MTP_PARAMS)):
        tensors.update(param_tensors(path, variable.get_value(), model.config))
    return tensors


def _mtp_dtypes(config: ModelConfig) -> dict[str, np.dtype]:
    """HF name -> the dtype `save_pretrained` writes, for every MTP tensor of a model of `config`."""
    dtypes = {}
    for path, variable in nnx.to_flat_state(nnx.state(abstract_model(config), MTP_PARAMS)):
        dtypes.update(dict.fromkeys((name for name, _ in hf_names(path, config)), np.dtype(variable.get_value().dtype)))
    return dtypes


def _check_same_trunk(config: ModelConfig, source: ModelConfig, shown: Path) -> None:
    """Raises ValueError naming the fields where `config` and the source's differ beyond `_FREE_FIELDS`."""
    differ = [
        f"{f.name} (source {getattr(source, f.name)!r}, model {getattr(config, f.name)!r})"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(source, f.name) != getattr(config, f.name)
    ]
    if differ:
        raise ValueError(f"the model is not the one in {shown}: " + "; ".join(differ))


def _stored_form(ours: np.ndarray, stored_dtype: str, name: str, block) -> dict[str, np.ndarray]:
    """`ours` (the tensor `name`) as the source stores it (safetensors dtype `stored_dtype`): cast, or
    block-quantized to FP8 with its `{name}_scale_inv` (float32) when the source holds it so."""
    target = DTYPES.get(stored_dtype)
    if target is None:
        raise ValueError(f"{name}: the source stores it as {stored_dtype}, which mtp_jax cannot write")
    if ours.dtype == target:
        return {name: ours}
    if ours.dtype == FP8_DTYPE:
        raise ValueError(f"{name}: the model holds it in FP8, the source as {stored_dtype}")
    if target == FP8_DTYPE:
        weight, scale = quantize_fp8_blocks(ours, block)
        return {name: weight, f"{name}_scale_inv": scale}
    cast = ours.astype(target)
    if not np.isfinite(cast).all() and np.isfinite(ours).all():
        raise ValueError(f"{name}: its values overflow the source's dtype {stored_dtype}")
    return {name: cast}


def _with_mtp_fields(hf: dict, config: ModelConfig, source: ModelConfig) -> dict | None:
    """Source config.json `hf` (read as `source`) with D (`families.mtp_field`, and Qwen3-Next's alias
    where present) and mtp_jax's `MTP_CONVENTION_FIELDS` set to `config`'s where they differ (in a Qwen3.5
    wrapper's `text_config`); None when nothing differs."""
    differ = [key for key in MTP_CONVENTION_FIELDS if getattr(config, key) != getattr(source, key)]
    if not differ and config.num_nextn_predict_layers == source.num_nextn_predict_layers:
        return None
    hf = copy.deepcopy(hf)
    target = hf["text_config"] if hf.get("model_type") in families.WRAPPERS else hf
    field, _ = families.mtp_field(config)
    for key in {field} | ({"num_nextn_predict_layers"} & set(target)):
        target[key] = config.num_nextn_predict_layers
    target.update({key: getattr(config, key) for key in differ})
    return hf


def _write_heads(model: Transformer, root: Path, shown: Path, new: Path) -> None:
    """`export_mtp_heads`'s work: reads the source in `root` (named `shown`), fills the empty-or-partial `new`."""
    for entry in new.iterdir():  # a repeated `read_dir` attempt starts from nothing
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    config = model.config
    hf = read_json(root / CONFIG_FILE, shown / CONFIG_FILE)
    try:
        source_config = config_from_hf(hf)
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{shown / CONFIG_FILE}: {error}") from error
    _check_same_trunk(config, source_config, shown)
    quantization = source_config.quantization or config.quantization
    block = quantization.weight_block_size if quantization is not None else None
    with contextlib.ExitStack() as stack:
        handles = open_weights(root, shown, stack)
        files = {}
        for file in handles:
            files[file] = TensorFile(root / file, shown / file)
            stack.callback(files[file].close)
        where = {name: file for file, f in files.items() for name in f.entries}
        dtypes = {name: files[file].entries[name][0] for name, file in where.items()}
        shapes = {name: files[file].entries[name][1] for name, file in where.items()}
        views, _ = families.tensor_views(shapes, config)

        ours = mtp_tensors(model)
        new_dtypes = _mtp_dtypes(stored_config(config))
        source_mtp = set(_mtp_dtypes(source_config)) if source_config.num_nextn_predict_layers else set()
        mtp_names = source_mtp | set(ours)
        mtp_names |= {f"{name}_scale_inv" for name in mtp_names}
        stored_mtp = {name for name in where if name in mtp_names}
        stored_mtp |= {view.stored for name, view in views.items() if name in mtp_names}

        # Our tensors as the files will hold them: stored name -> array.
        written: dict[str, np.ndarray] = {}
        fused: dict[str, np.ndarray] = {}  # a stored tensor that several of ours fill (Qwen3.5's fused experts)
        for name, tensor in ours.items():
            view = views.get(name)
            if view is not None:  # all or part of a tensor stored under another name
                stored = view.stored
                part = _stored_form(tensor, dtypes[stored], name, block)
                if len(part) != 1 or tensor.shape != view.shape:
                    raise ValueError(f"{name}: stored as part of {stored}, which this export cannot refill")
                if stored not in fused:
                    fused[stored] = np.zeros(shapes[stored], DTYPES[dtypes[stored]])
                slot = fused[stored] if view.expert is None else fused[stored][view.expert]
                slot[view.start : view.start + view.shape[0]] = part[name]
                continue
            if name in where and shapes[name] != tensor.shape:
                raise ValueError(
                    f"{name}: the source stores shape {list(shapes[name])}, the model {list(tensor.shape)}"
                )
            stored_dtype = dtypes.get(name) or _SAFETENSORS_NAMES[new_dtypes[name]]
            written.update(_stored_form(tensor, stored_dtype, name, block))
        written.update(fused)

        copies = {c: s for c, s in shared_copies(config).items() if c.startswith("model.layers.")}
        source_copies = {c for c in shared_copies(source_config) if c.startswith("model.layers.") and c in where}
        if source_copies or not source_config.num_nextn_predict_layers:  # the files carry them: new heads too
            copies_added = {c: s for c, s in copies.items() if c not in where and s in where}
        else:
            copies_added = {}
        dropped = (stored_mtp - set(written)) | (source_copies - set(copies))

        shard = sorted(files)[-1] if len(files) > 1 else next(iter(files))
        first_mtp = next((where[name] for name in where if name in stored_mtp), None)
        home = first_mtp or shard  # where the tensors the source lacks go
        weight_map, total = {}, 0
        for file, f in files.items():
            out = {}
            for name in f.entries:
                if name in dropped:
                    continue
                out[name] = written[name] if name in written else f.read(name)
            if file == home:
                out.update({name: t for name, t in written.items() if name not in where})
                out.update({c: files[where[s]].read(s) for c, s in copies_added.items()})
            if out:
                save_safetensors(out, new / file, handles[file].metadata() or {})
                weight_map.update(dict.fromkeys(out, file))
                total += sum(t.nbytes for t in out.values())
        if not (root / WEIGHTS_FILE).is_file():  # `open_weights` read the index
            index = read_json(root / INDEX_FILE, shown / INDEX_FILE)
            index = {**index, "metadata": {**index.get("metadata", {}), "total_size": total}}
            index["weight_map"] = dict(sorted(weight_map.items()))
            (new / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    hf = _with_mtp_fields(hf, config, source_config)
    if hf is None:
        shutil.copyfile(root / CONFIG_FILE, new / CONFIG_FILE)
    else:
        (new / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    for entry in root.iterdir():
        if entry.name == CONFIG_FILE or (is_model_file(entry.name) and entry.name not in _KEPT_MODEL_FILES):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True)
        else:
            shutil.copy2(entry, new / entry.name, follow_symlinks=False)
