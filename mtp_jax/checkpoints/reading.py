"""Hugging Face checkpoint import: `load_hf_checkpoint` (config.json plus safetensors weights).

Loading is strict: every tensor in the files must fill a parameter (or its piece of a fused one) and
every parameter must be filled, each tensor with its own shape; otherwise a `CheckpointError` lists
what is missing, unexpected or mis-shaped, tensor by tensor (a fused parameter's pieces each under
its HF name). Documented exceptions: `*.rotary_emb.inv_freq` buffers (old exports) are
ignored, and with tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
accepted as a redundant copy (a *different* one is an error: the checkpoint is not tied). Qwen3.5
checkpoints may also hold their tensors in the multimodal wrapper's names (`model.language_model.*`,
whose vision tower `model.visual.*` is ignored) and their routed experts fused (`experts.gate_up_proj`
[R, 2I, E], `experts.down_proj` [R, E, I]): those are read as the names `names.hf_names` gives
(`mtp_jax.checkpoints.families.tensor_views`), and errors name them so.
Every field of config.json that is read is type-checked (`mtp_jax.checkpoints.hf_config`), and a corrupt
file (invalid JSON, a truncated or garbage safetensors file, an index without `weight_map` or
with a shard name that is not a plain file name) raises a `CheckpointError` naming the file.
Loading reads every file from one save even while another process overwrites `path`
(`atomic_dir.read_dir`: pinned to the directory on Linux, repeated after a swap elsewhere).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from safetensors import SafetensorError, safe_open

from mtp_jax.checkpoints import atomic_dir, families
from mtp_jax.checkpoints.format import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, CheckpointError
from mtp_jax.checkpoints.hf_config import DTYPE_NAMES, config_from_hf
from mtp_jax.checkpoints.names import (
    check_quantized_modules,
    hf_names,
    is_scale,
    mtp_layers_present,
    shared_copies,
    tensor_layout,
)
from mtp_jax.checkpoints.shards import (
    ShardReader,
    agree_on,
    build_param,
    check_copies,
    check_device_memory,
    param_sharding,
)
from mtp_jax.checkpoints.tensor_reads import FLOAT_DTYPES, TensorFile
from mtp_jax.config import MAX_STOP_TOKENS, ModelConfig
from mtp_jax.model import Transformer, abstract_model

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-parameter buffers some exports contain


def read_json(file: Path, shown: Path) -> Any:
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
    hf = read_json(root / CONFIG_FILE, file)
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
    index = read_json(root / INDEX_FILE, index_file)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_file} has no weight_map object (tensor name -> shard file name)")
    if not weight_map:
        raise CheckpointError(f"{index_file}: its weight_map is empty (it places no tensor in any file)")
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


def open_weights(root: Path, shown: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
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
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    scan_layers: bool | None = None,
    mesh: Mesh | None = None,
    dequantize: bool = False,
    dequantize_mtp: bool = False,
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
      mesh: a device mesh (`mtp_jax.sharding.make_mesh`): every parameter is built directly as a global
        array on its sharding (`mtp_jax.sharding`'s rules, as `shard_model` places it), each device's
        shard read from the files with byte-range reads of exactly what it holds
        (`mtp_jax.checkpoints.shards`); under `jax.distributed` each process reads only its own devices'
        shards. Host memory stays at about one device's shard of one parameter. Default: one device
        (the default device), each tensor read once.
      dequantize: for a block-scaled FP8 checkpoint (DeepSeek-V3's `quantization_config`, see
        `mtp_jax.quantization`): False (default) keeps the quantized weights in float8_e4m3fn on device
        with their scales, dequantized block by block inside each jitted matmul; True dequantizes them
        once while loading (`float32(weight) * scale`, cast to `dtype`), for a plain model. Linears the
        files keep unquantized (no `weight_scale_inv`, the same module in every layer: e.g. DeepSeek's
        MTP `eh_proj`) load unquantized either way. No effect on an unquantized checkpoint.
      dequantize_mtp: for an FP8 checkpoint, the MTP modules only dequantized on load (into `param_dtype`,
        `Fp8Config.quantize_mtp=False`, what heads-only training over a frozen FP8 trunk needs) while the
        trunk stays FP8. No effect with `dequantize` or on an unquantized checkpoint.

    Returns:
      The model; Linear kernels [in, out] are the files' weights [out, in] transposed.

    Raises:
      FileNotFoundError: no config.json or no weights file.
      CheckpointError (a ValueError) naming the file: config.json or an index that is not JSON
        (nesting too deep included); config.json that is not a JSON object, that `config_from_hf`
        refuses (an unsupported or ill-typed field), or whose eos_token_id lists more distinct ids
        than generation can stop at (`mtp_jax.config.MAX_STOP_TOKENS`); an index that has no
        `weight_map` or an empty one, or names a shard that is not a plain file name in `path` (`..`,
        absolute paths and subdirectories are refused); a safetensors file that is empty, truncated or
        not safetensors at all; missing tensors, unexpected tensors, shapes [out, in] other than the
        config's, non-float tensors, an index inconsistent with its shards, or (tied embeddings) a
        `lm_head.weight` that differs from `model.embed_tokens.weight` (likewise DeepSeek's
        per-MTP-layer `embed_tokens` / `shared_head.head` copies, see `shared_copies`); weights
        holding more or fewer MTP layers (`model.layers.{L + j}`) than config.json's
        `num_nextn_predict_layers` (the error names both numbers); a tensor holding NaN or infinite
        values, or one whose values overflow `dtype` (e.g. a float32 file loaded as float16): the
        error names the tensor and its file. The key, shape and dtype checks read only the files'
        headers, before any tensor data.
      CheckpointError for FP8 files: a quantized weight that is not float8_e4m3fn or lacks its
        `weight_scale_inv`, a module quantized in some layers only, or `modules_to_not_convert` entries
        that split a module this model quantizes as one (`names.check_quantized_modules`).
      ValueError: the mesh's devices report their memory (GPUs) and one device's share of the weights
        exceeds what is free on it (before any tensor is read; `mtp-jax plan` sizes a mesh).
      OSError: `path` was replaced by concurrent saves during each attempt to read it (`atomic_dir.read_dir`).

    MTP modules (`num_nextn_predict_layers` > 0) load from DeepSeek-V3's layout,
    `model.layers.{L + j}.{enorm,hnorm,eh_proj,shared_head.norm,<block>}` for module j, or from Qwen3.5's
    `mtp.*` / MiMo's `model.mtp_layers.{j}.*` (`ModelConfig.mtp_layout`, `mtp_jax.checkpoints.families`); the
    weights/config mismatch error then names `mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers`.

    Every file comes from one save even while another process overwrites `path`
    (`mtp_jax.checkpoints.atomic_dir.read_dir`), and a save that a kill interrupted between its two renames
    is finished first, so `path` holds the new checkpoint.
    """
    path = Path(path)
    return atomic_dir.read_dir(
        path,
        lambda root: read_hf_files(
            root,
            dtype=dtype,
            scan_layers=scan_layers,
            mesh=mesh,
            dequantize=dequantize,
            dequantize_mtp=dequantize_mtp,
            shown=path,
        ),
    )


def read_hf_files(
    directory: str | os.PathLike,
    *,
    dtype: str | None = None,
    scan_layers: bool | None = None,
    mesh: Mesh | None = None,
    dequantize: bool = False,
    dequantize_mtp: bool = False,
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
    block = None
    if dequantize and config.quantization is not None:
        block, config = config.quantization.weight_block_size, config.replace(quantization=None)
    elif dequantize_mtp and config.quantization is not None:
        block = config.quantization.weight_block_size
        config = config.replace(quantization=dataclasses.replace(config.quantization, quantize_mtp=False))
    with contextlib.ExitStack() as stack:
        handles = open_weights(root, shown, stack)
        files = {}
        for file in handles:
            files[file] = TensorFile(root / file, shown / file)
            stack.callback(files[file].close)
        return _read_weights(handles, files, config, shown, mesh, block)


def _abstract(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(abstract_model(config), nnx.Param)


def _read_weights(
    handles: dict[str, Any],
    files: dict[str, TensorFile],
    config: ModelConfig,
    shown: Path,
    mesh: Mesh | None,
    block: tuple[int, int] | None,
) -> Transformer:
    """The model of `config` from the weights files (file name -> its `safe_open` handle, which listed
    its tensors, and its `TensorFile`, which reads them), its parameters on `mesh` (None: one device);
    `block`: the files' FP8 block when quantized weights are dequantized on load (all of them, or with
    `Fp8Config.quantize_mtp` False the MTP modules')."""
    where, shapes, dtypes = _scan(handles, shown)
    files = _with_views(files, where, shapes, dtypes, config)
    graphdef, params = _abstract(config)
    if config.quantization is not None:
        kept = _unquantized_in_files(params, config, dtypes)
        if kept:
            fp8 = config.quantization
            fp8 = dataclasses.replace(fp8, modules_to_not_convert=(*fp8.modules_to_not_convert, *kept))
            config = config.replace(quantization=fp8)
            graphdef, params = _abstract(config)
        try:
            check_quantized_modules(params, config)
        except ValueError as error:
            raise CheckpointError(f"{shown / CONFIG_FILE}: {error}") from error
    layout = tensor_layout(params, config)
    dequantized = {}  # FP8 weight -> its scale, for a model that holds them dequantized
    if block is not None:
        dequantized = {
            name: f"{name}_scale_inv"
            for name in layout
            if name.endswith(".weight")
            and layout[name][3] != jnp.float8_e4m3fn  # held unquantized: all, or the MTP modules'
            and dtypes.get(name) == "F8_E4M3"
            and f"{name}_scale_inv" in where
        }

    present = mtp_layers_present(iter(where), config)
    if present != config.num_nextn_predict_layers:
        field, location = families.mtp_field(config)
        raise CheckpointError(
            f"checkpoint {shown}: config.json says {field}={config.num_nextn_predict_layers} but "
            f"the weights hold {present} MTP layers ({location}); set "
            f"{field}={present} in config.json or add/remove the MTP layers' tensors"
        )
    copies = {name: source for name, source in shared_copies(config).items() if name in where}
    found = set(where) - set(copies) - set(dequantized.values())
    missing = [name for name in layout if name not in found]
    unexpected = sorted(n for n in found - set(layout) if not n.endswith(_IGNORED_SUFFIXES))
    mismatched = [
        f"{name} in {where[name]} (expected shape {list(layout[name][2])}, found {list(shapes[name])})"
        for name in layout
        if name in found and shapes[name] != layout[name][2]
    ]
    mismatched += [
        f"{name} in {where[name]} (dtype {dtypes[name]}, expected {expected})"
        for name in layout
        if name in found and dtypes[name] not in (expected := _stored_dtypes(name, layout[name], dequantized))
    ]
    mismatched += [
        f"{name} in {where[name]} (shape {list(shapes[name])}, a copy of {source} {list(shapes[source])})"
        for name, source in copies.items()
        if source in shapes and shapes[name] != shapes[source]
    ]
    for weight, scale in dequantized.items():  # the scales a dequantizing load reads besides the model's tensors
        out, n_in = layout[weight][2]
        grid = [-(-out // block[0]), -(-n_in // block[1])]
        if list(shapes[scale]) != grid or dtypes[scale] != "F32":
            mismatched.append(
                f"{scale} in {where[scale]} (expected F32 {grid}: blocks of {list(block)} over {weight} "
                f"[{out}, {n_in}], found {dtypes[scale]} {list(shapes[scale])})"
            )
    if missing or unexpected or mismatched:
        raise CheckpointError(
            f"checkpoint {shown} does not match the config",
            missing=missing,
            unexpected=unexpected,
            mismatched=mismatched,
        )

    flat_params = nnx.to_flat_state(params)
    shardings = [param_sharding(variable, mesh) for _, variable in flat_params]
    check_device_memory(flat_params, shardings)
    reader = ShardReader(files, where, layout, config, dequantized, block)
    error = None
    try:
        flat = [
            (path_, variable.replace(build_param(reader, path_, variable.get_value(), sharding)))
            for (path_, variable), sharding in zip(flat_params, shardings, strict=True)
        ]
        check_copies(files, where, copies, layout)
    except CheckpointError as raised:  # a bad value in this process's shards: every process must hear of it
        error = raised
    agree_on(error)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _with_views(
    files: dict[str, TensorFile], where: dict[str, str], shapes: dict, dtypes: dict, config: ModelConfig
) -> dict[str, TensorFile | families.ViewFile]:
    """`files` wrapped to read the tensors the files hold under other names (`families.tensor_views`: the
    Qwen3.5 wrapper's `model.language_model.*`, fused routed experts), `where` / `shapes` / `dtypes` updated
    in place to those names, the stored names they replace and the ignored ones (`model.visual.*`) dropped.

    Raises CheckpointError naming both for a tensor stored under its own name and in another form too."""
    views, ignored = families.tensor_views(shapes, config)
    twice = sorted(name for name in views if name in where)
    if twice:
        raise CheckpointError(
            f"{twice[0]} is stored both as itself and as {views[twice[0]].stored}", unexpected=[views[twice[0]].stored]
        )
    by_file: dict[str, dict[str, families.TensorView]] = {}
    for name, view in views.items():
        where[name], shapes[name], dtypes[name] = where[view.stored], view.shape, dtypes[view.stored]
        by_file.setdefault(where[name], {})[name] = view
    for stored in {view.stored for view in views.values()} | ignored:
        del where[stored], shapes[stored], dtypes[stored]
    return {file: families.ViewFile(f, by_file[file]) if file in by_file else f for file, f in files.items()}


def _stored_dtypes(name: str, entry: tuple, dequantized: dict[str, str]) -> tuple[str, ...]:
    """The safetensors dtypes the tensor `name` (its `tensor_layout` entry) may be stored in."""
    path, _, _, dtype = entry
    if dtype == jnp.float8_e4m3fn:
        return ("F8_E4M3",)
    if is_scale(path):
        return ("F32",)
    return (*FLOAT_DTYPES, "F8_E4M3") if name in dequantized else FLOAT_DTYPES


def _unquantized_in_files(params: nnx.State, config: ModelConfig, dtypes: dict[str, str]) -> tuple[str, ...]:
    """The modules (names within a layer, as `Fp8Config.quantizes` takes them) that the config quantizes
    but the files keep in a float type without scales in every layer (e.g. DeepSeek's `eh_proj`)."""
    kept, quantized = set(), set()
    for path, variable in nnx.to_flat_state(params):
        if variable.get_value().dtype != jnp.float8_e4m3fn:
            continue
        start = 3 if str(path[0]) == "layer_groups" else 2  # past `layers.{i}` / `mtp.{j}` / `layer_groups.{g}.layer`
        module = ".".join(str(p) for p in path[start:-1])  # "self_attn.o_proj", the routed experts' "mlp.experts"
        for name, _ in hf_names(path, config):
            stored_float = dtypes.get(name) in FLOAT_DTYPES and f"{name}_scale_inv" not in dtypes
            (kept if stored_float else quantized).add(module)
    return tuple(sorted(kept - quantized))
