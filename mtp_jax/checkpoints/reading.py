"""Hugging Face checkpoint import and export: `config.json` plus safetensors weights.

Format (what `transformers`' `save_pretrained` writes and `from_pretrained` reads):
  - `config.json`: a `LlamaConfig` / `Qwen2Config` / `MistralConfig` as JSON, mapped to and from
    `ModelConfig` by `mtp_jax.hf_config` (`config_from_hf`, `config_to_hf`, re-exported here).
  - `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
    `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.

Names: our parameter paths are HF's module names (see `mtp_jax.model`), so `hf_name` is the one
place that maps them: `layers.3.mlp.down_proj.kernel` is `model.layers.3.mlp.down_proj.weight`.
Linear kernels are stored [in, out] here and [out, in] (torch's layout) in the files. A fused
projection (`FUSED_MODULES`: `self_attn.qkv_proj`, `mlp.gate_up_proj`, MLA's `fused_qkv_a_proj`) holds
the HF modules it stands for in its output axis, one tensor each in the files (`_fuse`, `_unfuse`):
`qkv_proj.kernel` [E, (H + 2G) D] is `q_proj.weight` [H D, E], `k_proj.weight` and `v_proj.weight`
[G D, E] group-major ([E, G, H/G + 2, D]: KV head g's H/G query heads, k_g, v_g), `gate_up_proj`
[E, 2I] is `gate_proj.weight` and `up_proj.weight` [I, E] interleaved ([E, I, 2]), so that a
contiguous shard of the output axis (tensor parallelism, `mtp_jax.sharding`) is self-contained;
`fused_qkv_a_proj` is `q_a_proj` then `kv_a_proj_with_mqa` side by side. The MoE's stacked routed
experts [R, in, out] are R tensor sets `mlp.experts.{r}.<proj>.weight` [out, in] there (`hf_names`),
and a scanned model's stacked layer groups (`ModelConfig.scan_layers`, `layer_groups.{g}.layer.<path>`
[n, ...]) one tensor set per layer, under the unrolled layout's names: both layouts read and write
the same files. The router `mlp.gate.weight` [R, E] and `mlp.gate.e_score_correction_bias` [R] are
as they are (float32, whatever the dtype of the rest). MTP modules are imported and exported in
DeepSeek-V3's layout (README_WEIGHTS.md): module j's `mtp.j.<name>` is `model.layers.{L + j}.<name>`,
and `num_nextn_predict_layers` plus mtp_jax's conventions (`MTP_CONVENTION_FIELDS`) sit in config.json.

Loading is strict: every tensor in the files must fill a parameter (or its piece of a fused one) and
every parameter must be filled, each tensor with its own shape; otherwise a `CheckpointError` lists
what is missing, unexpected or mis-shaped, tensor by tensor (a fused parameter's pieces each under
its HF name). Two documented exceptions: `*.rotary_emb.inv_freq` buffers (old exports) are
ignored, and with tied embeddings a `lm_head.weight` equal to `model.embed_tokens.weight` is
accepted as a redundant copy (a *different* one is an error: the checkpoint is not tied).
Every field of config.json that is read is type-checked (`mtp_jax.hf_config`), and a corrupt
file (invalid JSON, a truncated or garbage safetensors file, an index without `weight_map` or
with a shard name that is not a plain file name) raises a `CheckpointError` naming the file.

Saving is atomic (`mtp_jax.atomic_dir`): the checkpoint is written to a temporary sibling
directory and swapped in, so a kill at any point leaves the old or the new checkpoint at `path`.
Loading reads every file from one save even while another process overwrites `path`
(`atomic_dir.read_dir`: pinned to the directory on Linux, repeated after a swap elsewhere).
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mtp_jax.checkpoints import atomic_dir
from mtp_jax.checkpoints.hf_config import (
    DTYPE_NAMES,
    MTP_CONVENTION_FIELDS,  # noqa: F401  (re-exported)
    config_from_hf,
    config_to_hf,
)
from mtp_jax.config import ModelConfig
from mtp_jax.decode.request import MAX_STOP_TOKENS
from mtp_jax.model import Transformer, per_layer_path

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# The tokenizer files of a model directory (`tokenizers` and `transformers` names): an overwriting
# save drops them with the old weights (`is_model_file`), so no stale tokenizer sits beside new ones.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")
DEFAULT_MAX_SHARD_SIZE_BYTES = 5_000_000_000  # transformers 4.x's default "5GB"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-parameter buffers some exports contain
_MAX_LISTED = 20  # names shown per category in a CheckpointError message


class CheckpointError(ValueError):
    """A checkpoint file is corrupt or its tensors do not match the model.

    The message names the file; for tensors, `missing`, `unexpected` and `mismatched` list them.
    """

    def __init__(self, message: str, *, missing=(), unexpected=(), mismatched=()):
        self.missing, self.unexpected, self.mismatched = (list(names or ()) for names in (missing, unexpected,
                                                                                            mismatched))
        parts = [message]
        for label, names in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mismatched", self.mismatched)):
            if names:
                shown = ", ".join(names[:_MAX_LISTED])
                more = f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
                parts.append(f"{label} ({len(names)}): {shown}{more}")
        super().__init__("; ".join(parts))


# ----------------------------------------------------------------------------------------------
# Names


# A fused module (several HF modules that read the same input, computed as one matmul) -> the HF
# modules it holds in its output (last) axis, in this order (`_fuse` gives the layout).
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # `mtp_jax.layers.attention.Attention`
    "gate_up_proj": ("gate_proj", "up_proj"),  # `mtp_jax.layers.ffn.MLP`, `mtp_jax.layers.moe.Experts`
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # `mtp_jax.layers.mla.MLAttention`
}


def hf_name(path: tuple[str | int, ...], config: ModelConfig) -> tuple[str, bool]:
    """The HF tensor name of one unfused, unstacked parameter path and whether it is transposed.

    The whole mapping: `lm_head.*` stays at top level, main-model paths get the `model.` prefix,
    MTP module j's paths `mtp.j.<name>` become `model.layers.{L + j}.<name>` (DeepSeek-V3); leaf
    `kernel` [in, out] is `weight` [out, in], `embedding` is `weight`, others keep their name.
    Fused and stacked parameters are several tensors: `hf_names`.
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


def _is_experts(path: tuple[str | int, ...]) -> bool:
    """Whether `path` is a stacked routed-expert tensor (`...mlp.experts.{gate_up,down}_proj`, [R, in, out])."""
    return len(path) >= 2 and str(path[-2]) == "experts" and str(path[-1]) in ("gate_up_proj", "down_proj")


def _tensor_axes(path: tuple[str | int, ...]) -> int:
    """How many leading axes of the parameter at `path` enumerate separate tensors of the files (0, 1 or 2):
    a stacked layer group's layer axis (`ModelConfig.scan_layers`), then the routed experts' axis."""
    return (str(path[0]) == "layer_groups") + _is_experts(path)


def _module_at(path: tuple[str | int, ...]) -> int:
    """The index in `path` of its module's name: the last entry for stacked experts, else the one before the leaf."""
    return len(path) - (1 if _is_experts(path) else 2)


def _pieces(path: tuple[str | int, ...]) -> list[tuple[str | int, ...]]:
    """The unfused paths a (per-layer) parameter path stands for: itself, or a fused module's (`FUSED_MODULES`)
    paths with each of its HF modules in its place, in order."""
    at = _module_at(path)
    return [(*path[:at], module, *path[at + 1:]) for module in FUSED_MODULES.get(str(path[at]), (path[at],))]


def _piece_widths(path: tuple[str | int, ...], width: int, config: ModelConfig) -> list[int]:
    """The output widths of the HF tensors that one slice of the parameter at `path` (last axis of size
    `width`) holds (`_pieces`, `_fuse`): `[width]` unfused; `qkv_proj` H D, G D, G D; `gate_up_proj` I, I;
    `fused_qkv_a_proj` q_lora_rank, C + R."""
    module = str(path[_module_at(path)])
    if module == "qkv_proj":
        q = config.num_attention_heads * config.resolved_head_dim
        return [q, (width - q) // 2, (width - q) // 2]
    if module == "gate_up_proj":
        return [width // 2, width // 2]
    if module == "fused_qkv_a_proj":
        return [config.q_lora_rank, width - config.q_lora_rank]
    return [width]


def _fuse(path: tuple[str | int, ...], pieces: list[jax.Array], config: ModelConfig) -> jax.Array:
    """One slice of the parameter at `path` from the HF tensors it holds (`_pieces` order, ours [..., out]
    each, e.g. a kernel [E, out] or a bias [out]); `_unfuse` inverts it.

      - `qkv_proj`: q [..., H D], k, v [..., G D] -> [..., G (H/G + 2) D], group-major: for each KV head g
        its H/G query heads g * (H/G) .. (g + 1) * (H/G) - 1 (those that read it, HF's GQA), then k_g, v_g;
      - `gate_up_proj`: gate, up [..., I] -> [..., 2I] interleaved: column 2i is gate_i, 2i + 1 is up_i;
      - `fused_qkv_a_proj` (replicated over `tensor`, so never split): its two tensors side by side;
      - anything else: its one tensor as is.
    """
    module = str(path[_module_at(path)])
    if module == "qkv_proj":
        q, k, v = pieces
        g, d, lead = config.num_key_value_heads, config.resolved_head_dim, q.shape[:-1]
        q = q.reshape(*lead, g, -1, d)  # [..., G, H/G, D]
        k, v = k.reshape(*lead, g, 1, d), v.reshape(*lead, g, 1, d)  # [..., G, 1, D] each
        return jnp.concatenate([q, k, v], axis=-2).reshape(*lead, -1)  # [..., G, H/G + 2, D] -> [..., G (H/G + 2) D]
    if module == "gate_up_proj":
        gate, up = pieces
        return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)  # [..., I, 2] -> [..., 2I]
    return jnp.concatenate(pieces, axis=-1) if len(pieces) > 1 else pieces[0]


def _unfuse(path: tuple[str | int, ...], array: np.ndarray, config: ModelConfig) -> list[np.ndarray]:
    """The HF tensors (ours [..., out] each, `_pieces` order) that one slice `array` of the parameter at
    `path` holds: `_fuse`'s inverse, by reshapes and slices only (bit-exact)."""
    module, lead = str(path[_module_at(path)]), array.shape[:-1]
    if module == "qkv_proj":
        grouped = array.reshape(*lead, config.num_key_value_heads, -1, config.resolved_head_dim)  # [..., G, H/G + 2, D]
        return [grouped[..., :-2, :].reshape(*lead, -1),  # [..., H D]
                grouped[..., -2, :].reshape(*lead, -1), grouped[..., -1, :].reshape(*lead, -1)]  # [..., G D] each
    if module == "gate_up_proj":
        pairs = array.reshape(*lead, -1, 2)  # [..., I, 2]
        return [pairs[..., 0], pairs[..., 1]]  # [..., I] each
    bounds = np.cumsum(_piece_widths(path, array.shape[-1], config))[:-1]
    return np.split(array, bounds, axis=-1)


def hf_names(path: tuple[str | int, ...], config: ModelConfig) -> list[tuple[str, bool]]:
    """The HF tensors of one parameter path: [(name, transposed)], one per tensor in the files.

    `hf_name`'s single tensor, except for stacked and fused parameters. Stacked ones are one tensor set
    per slice of their `_tensor_axes` leading axes, in row-major order, and a fused one (`FUSED_MODULES`)
    is, per slice, one tensor per HF module it holds in its last axis, in `FUSED_MODULES` order
    (`_pieces`, `_piece_widths`, `_fuse`):
      - the MoE's routed experts (`mtp_jax.layers.moe`): `...mlp.experts.gate_up_proj` [R, E, 2I] is
        the 2R tensors `...mlp.experts.{r}.gate_proj.weight`, `...mlp.experts.{r}.up_proj.weight` [I, E]
        (the transposes of slice r's even and odd columns, interleaved), `down_proj` [R, I, E] the R tensors
        `...mlp.experts.{r}.down_proj.weight` [E, I]; this is DeepSeek-V3's and GLM-4.5's layout,
        which transformers 5 stacks on load and splits on save;
      - a layer group's parameters (`layer_groups.{g}.layer.<path>`, [n, ...], `ModelConfig.scan_layers`):
        slice i is layer `start + i`'s `<path>` (`mtp_jax.model.per_layer_path`), so both layouts
        read and write the same files. A stacked layer's experts are n x R tensor sets, layer-major.
    """
    names = []
    for layer_path in per_layer_path(path, config):
        pieces = _pieces(layer_path)
        if not _is_experts(layer_path):
            names += [hf_name(piece, config) for piece in pieces]
            continue
        base, _ = hf_name((*layer_path[:-1], "kernel"), config)  # "...mlp.experts.weight"
        stem = base[: -len(".weight")]
        names += [(f"{stem}.{r}.{piece[-1]}.weight", True) for r in range(config.n_routed_experts) for piece in pieces]
    return names


def _layout(params: nnx.State, config: ModelConfig) -> dict[str, tuple[tuple, bool, tuple[int, ...], Any]]:
    """HF name -> (our path, transposed, HF shape, our dtype) for every tensor in the files, in model order."""
    layout = {}
    for path, variable in nnx.to_flat_state(params):
        shape, dtype = tuple(variable.get_value().shape), variable.get_value().dtype
        shape = shape[_tensor_axes(path):]  # one slice's: e.g. one expert's [in, out]
        widths = _piece_widths(path, shape[-1], config)
        for k, (name, transposed) in enumerate(hf_names(path, config)):
            piece = (*shape[:-1], widths[k % len(widths)])  # one tensor's: a fused slice's piece
            layout[name] = (path, transposed, piece[::-1] if transposed else piece, dtype)
    return layout


def _mtp_layers_present(names: Iterator[str], config: ModelConfig) -> int:
    """How many MTP layers the tensor `names` hold: distinct `model.layers.{n}` with n >= L (max n + 1 - L)."""
    layers = {int(m.group(1)) for name in names if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    extra = [n for n in layers if n >= config.num_hidden_layers]
    return max(extra) + 1 - config.num_hidden_layers if extra else 0


# ----------------------------------------------------------------------------------------------
# Load


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
        raise CheckpointError(f"{file}: eos_token_id lists {len(set(config.eos_token_ids))} distinct token ids; "
                              f"generation stops at most at {MAX_STOP_TOKENS} (mtp_jax.decode.request.MAX_STOP_TOKENS)")
    return config


def _is_plain_file_name(name: Any) -> bool:
    """A file name with no directory part: not absolute, no separator, not "." or ".."."""
    return (isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and not os.path.isabs(name))


def _weight_files(root: Path, shown: Path) -> dict[str, list[str] | None]:
    """File name -> the tensor names the index places there (None: a single file, no index).

    With both a `model.safetensors` and an index, the single file is loaded (transformers'
    precedence, `modeling_utils._get_resolved_checkpoint_files`), with a warning naming both.
    """
    index_file = shown / INDEX_FILE
    if (root / WEIGHTS_FILE).is_file():
        if (root / INDEX_FILE).is_file():
            warnings.warn(f"{shown} holds both {WEIGHTS_FILE} and {INDEX_FILE}: loading {WEIGHTS_FILE} and "
                          "ignoring the index and its shards (as transformers does); delete the one that does "
                          "not belong", stacklevel=2)
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


def stored_dtype(path: str | os.PathLike) -> str:
    """The dtype a checkpoint directory's config.json says its weights are in ("float32", "bfloat16"
    or "float16"; `dtype` / `torch_dtype`, else float32): what `load_hf_checkpoint` loads by default.

    Raises FileNotFoundError without config.json, CheckpointError for one `load_hf_checkpoint` refuses.
    """
    root = Path(path)
    if not (root / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {root}")
    return _read_config(root, root).dtype


def load_hf_checkpoint(path: str | os.PathLike, *, dtype: str | None = None,
                       scan_layers: bool | None = None) -> Transformer:
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
        than generation can stop at (`mtp_jax.decode.request.MAX_STOP_TOKENS`); an index that has no
        `weight_map`, or names a shard that is not a plain file name in `path` (`..`, absolute
        paths and subdirectories are refused); a safetensors file that is empty, truncated or not
        safetensors at all; missing tensors, unexpected tensors, shapes [out, in] other than the
        config's, non-float tensors, an index inconsistent with its shards, or (tied embeddings) a
        `lm_head.weight` that differs from `model.embed_tokens.weight` (likewise DeepSeek's
        per-MTP-layer `embed_tokens` / `shared_head.head` copies, see `_shared_copies`); weights
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
    return atomic_dir.read_dir(path, lambda root: read_hf_files(root, dtype=dtype, scan_layers=scan_layers,
                                                                shown=path))


def read_hf_files(directory: str | os.PathLike, *, dtype: str | None = None, scan_layers: bool | None = None,
                  shown: str | os.PathLike | None = None) -> Transformer:
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
    layout = _layout(params, config)
    where, shapes, dtypes = _scan(handles, shown)

    present = _mtp_layers_present(iter(where), config)
    if present != config.num_nextn_predict_layers:
        raise CheckpointError(
            f"checkpoint {shown}: config.json says num_nextn_predict_layers={config.num_nextn_predict_layers} but "
            f"the weights hold {present} MTP layers (model.layers.{config.num_hidden_layers} on); set "
            f"num_nextn_predict_layers={present} in config.json or add/remove the MTP layers' tensors")
    copies = {name: source for name, source in _shared_copies(config).items() if name in where}
    found = set(where) - set(copies)
    missing = [name for name in layout if name not in found]
    unexpected = sorted(n for n in found - set(layout) if not n.endswith(_IGNORED_SUFFIXES))
    mismatched = [f"{name} (expected shape {list(layout[name][2])}, found {list(shapes[name])})"
                  for name in layout if name in found and shapes[name] != layout[name][2]]
    mismatched += [f"{name} (dtype {dtypes[name]} is not a float type)"
                   for name in layout if name in found and dtypes[name] not in ("F32", "BF16", "F16", "F64")]
    if missing or unexpected or mismatched:
        raise CheckpointError(f"checkpoint {shown} does not match the config", missing=missing,
                              unexpected=unexpected, mismatched=mismatched)

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
        if copy.shape != source.shape or not np.array_equal(np.asarray(jnp.asarray(copy, weight_dtype)),
                                                            np.asarray(source)):
            raise CheckpointError(f"{name} must be a copy of the shared {copies[name]} but differs",
                                  unexpected=[name])
    flat = []
    for path_, variable in nnx.to_flat_state(params):
        shape = variable.get_value().shape
        names = [name for name, _ in hf_names(path_, config)]
        pieces = len(_piece_widths(path_, shape[-1], config))  # a fused slice's tensors
        slices = [_fuse(path_, [values[n] for n in names[i:i + pieces]], config) for i in range(0, len(names), pieces)]
        value = jnp.stack(slices).reshape(shape) if _tensor_axes(path_) else slices[0]  # [n?, R?, ...]
        flat.append((path_, variable.replace(value)))
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


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    """HF tensor name -> the numpy array the files hold (torch's [out, in] for kernels), in model order.

    What `write_hf_files` writes. Both layer layouts (`ModelConfig.scan_layers`) give the same dict
    for the same weights, in the same order (a layer group's tensors layer by layer, as the unrolled
    layout orders them), so they shard and save alike.
    """
    keyed = []  # ((position of the path or of its layer group's first path, layer within the group, path), ...)
    group_position: dict[tuple, int] = {}
    for position, (param_path, variable) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        array = np.asarray(jax.device_get(variable.get_value()))
        names = hf_names(param_path, model.config)
        axes = _tensor_axes(param_path)  # stacked layers / experts: one tensor set per slice
        slices = list(array.reshape(-1, *array.shape[axes:])) if axes else [array]
        parts = [part for one in slices for part in _unfuse(param_path, one, model.config)]  # a slice's HF tensors
        grouped = str(param_path[0]) == "layer_groups"
        where = group_position.setdefault(tuple(param_path[:2]), position) if grouped else position
        per_layer = len(names) // (array.shape[0] if grouped else 1)
        for k, ((name, transposed), part) in enumerate(zip(names, parts, strict=True)):
            tensor = np.ascontiguousarray(part.T if transposed else part)
            keyed.append(((where, k // per_layer, position), name, tensor))
    return {name: tensor for _, name, tensor in sorted(keyed, key=lambda entry: entry[0])}


def write_hf_files(model: Transformer, directory: str | os.PathLike, *,
                   max_shard_size_bytes: int = DEFAULT_MAX_SHARD_SIZE_BYTES, model_type: str | None = None) -> None:
    """Writes `model`'s checkpoint files into the existing `directory`, in place (not atomic).

    The files and arguments are `save_hf_checkpoint`'s, which wraps this in an atomic directory
    swap; `mtp_jax.checkpoints.pretrained.save_pretrained` adds the tokenizer inside the same swap.

    Raises:
      ValueError: the config cannot be expressed as `model_type`, or max_shard_size_bytes < 1.
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
      ValueError: the config cannot be expressed as `model_type`, or max_shard_size_bytes < 1.
    """
    with atomic_dir.replace_dir(path, overwrite=overwrite, owned=is_model_file) as new:
        write_hf_files(model, new, max_shard_size_bytes=max_shard_size_bytes, model_type=model_type)
