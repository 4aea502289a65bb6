"""The checkpoint families whose MTP layers are not DeepSeek-V3's `model.layers.{L + j}`: Qwen3.5 and MiMo.

config.json (`config_from_hf` / `config_to_hf` in `mtp_jax.checkpoints.hf_config` delegate here):
  - Qwen3.5 (transformers 5.24's `Qwen3_5TextConfig` "qwen3_5_text" / `Qwen3_5MoeTextConfig` "qwen3_5_moe_text",
    and the multimodal wrappers "qwen3_5" / "qwen3_5_moe", whose `text_config` is the model: `unwrap`, the
    vision tower is ignored with a warning): hybrid layers (`layer_types`, or every `full_attention_interval`-th
    layer full attention, default 4), gated attention with q/k norm and partial rotary (default 0.25, inside
    `rope_parameters`, whose `mrope_section` / `mrope_interleaved` are checked and ignored: text positions are
    the same on the three M-RoPE axes), zero-centred RMSNorms, head_dim default 256; the MoE's softmax router
    over `num_experts`, top-k renormalised, one sigmoid-gated shared expert. D is `mtp_num_hidden_layers`
    (Qwen3-Next's name `num_nextn_predict_layers` is read too), at most 1;
  - MiMo (XiaomiMiMo/MiMo-7B's "mimo": `Qwen2Config`'s fields plus `num_nextn_predict_layers`).
Each family fixes its MTP conventions (`FAMILY_CONVENTIONS`); a config.json field of mtp_jax's
(`hf_config.MTP_CONVENTION_FIELDS`) overrides one, and export writes only those that differ.

Tensor names (`mtp_name`, used by `mtp_jax.checkpoints.names.hf_name`), MTP module j = `mtp.j.<name>`:
  - "qwen3_5": `eh_proj` -> `mtp.fc`, `enorm` -> `mtp.pre_fc_norm_embedding`, `hnorm` -> `mtp.pre_fc_norm_hidden`,
    `shared_head.norm` -> `mtp.norm`, the block's `<name>` -> `mtp.layers.0.<name>` (j = 0 only);
  - "mimo": `model.mtp_layers.{j}.` + `input_proj`, `token_layernorm`, `hidden_layernorm`, `final_layernorm`,
    the block's names as they are (a Qwen2 layer, q/k/v bias).
Neither stores copies of the embedding or head.

Loading also reads names that are not the ones `names.hf_names` gives (`tensor_views`, `ViewFile`):
  - the multimodal wrapper's `model.language_model.<name>` is `model.<name>` (detected from the names in the
    files), and its vision tower `model.visual.*` is ignored, as transformers' `Qwen3_5ForCausalLM` does;
  - Qwen3.5-MoE's fused routed experts, as Qwen's own checkpoints and transformers' modules hold them:
    `...mlp.experts.gate_up_proj` [R, 2I, E] (each expert's gate rows, then its up rows) stands for the
    `...mlp.experts.{r}.gate_proj.weight` / `up_proj.weight` [I, E], and `...mlp.experts.down_proj` [R, E, I]
    for `...mlp.experts.{r}.down_proj.weight` [E, I]. transformers 5.24's `save_pretrained` writes the
    per-expert tensors (its conversion mapping splits them), and so does export.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from mtp_jax.checkpoints.json_fields import read_field, read_positive
from mtp_jax.config import LAYER_TYPES, ModelConfig

# model_type -> (architecture, ffn_type) for the Qwen3.5 text models; the wrappers' model_type -> their text model's.
QWEN3_5_TYPES = {"qwen3_5_text": ("Qwen3_5ForCausalLM", "dense"), "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "moe")}
WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MIMO_ARCHITECTURE = "MiMoForCausalLM"  # XiaomiMiMo's remote code; transformers has no "mimo" (Qwen2ForCausalLM
# loads the main model)
FAMILY_TYPES = (*QWEN3_5_TYPES, "mimo")  # the text model types `config_from_hf` reads here (after `unwrap`)
DEFAULT_MAX_POSITIONS = 32768  # Qwen3_5TextConfig's, Qwen3_5MoeTextConfig's and Qwen2Config's (MiMo's)
# The MTP conventions each layout fixes: h^0 after the final norm, the chained hidden after the head's norm.
FAMILY_CONVENTIONS = {
    "qwen3_5": {
        "mtp_style": "deepseek",
        "mtp_concat_order": "embedding_first",
        "mtp_hidden_after_norm": True,
        "mtp_chain_after_shared_head_norm": True,
        "mtp_zero_embedding_at_start": False,
    },
    "mimo": {
        "mtp_style": "deepseek",
        "mtp_concat_order": "hidden_first",
        "mtp_hidden_after_norm": True,
        "mtp_chain_after_shared_head_norm": True,
        "mtp_zero_embedding_at_start": True,
    },
}
# Qwen3_5TextConfig's defaults (Qwen3_5MoeTextConfig's are the same but num_key_value_heads 2).
DEFAULT_KV_HEADS = {"qwen3_5_text": 4, "qwen3_5_moe_text": 2}
_LINEAR_FIELDS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
# Qwen3_5MoeTextConfig's MoE fields and defaults, by our name: (its name, default).
_QWEN_MOE_FIELDS = {
    "n_routed_experts": ("num_experts", 256),
    "num_experts_per_tok": ("num_experts_per_tok", 8),
    "moe_intermediate_size": ("moe_intermediate_size", 512),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size", 512),
}
# What Qwen3_5MoeSparseMoeBlock computes, in ModelConfig's fields.
_QWEN_MOE_FIXED = {
    "ffn_type": "moe",
    "scoring_func": "softmax",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "shared_expert_gate": True,
}
_QWEN_FIXED = {"use_qk_norm": True, "attn_output_gate": True, "rms_norm_unit_offset": True, "attention_type": "gqa"}
_MROPE_KEYS = {"mrope_section": "list", "mrope_interleaved": "bool"}  # text-irrelevant M-RoPE keys


def layout_of(model_type: str) -> str | None:
    """The `mtp_layout` of a family model_type ("qwen3_5" or "mimo"), None for the others."""
    return "qwen3_5" if model_type in QWEN3_5_TYPES else ("mimo" if model_type == "mimo" else None)


def default_model_type(config: ModelConfig) -> str | None:
    """The model_type `config_to_hf` writes for `config.mtp_layout` "qwen3_5" ("qwen3_5_text" or
    "qwen3_5_moe_text", by `ffn_type`) or "mimo"; None for "deepseek" (the other model types)."""
    if config.mtp_layout == "qwen3_5":
        return "qwen3_5_moe_text" if config.ffn_type == "moe" else "qwen3_5_text"
    return "mimo" if config.mtp_layout == "mimo" else None


def unwrap(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The text model's config of a multimodal wrapper ("qwen3_5" / "qwen3_5_moe"): its `text_config`, with
    model_type the text model's and, where `text_config` lacks them, the wrapper's `dtype` / `torch_dtype`,
    token ids and `quantization_config`. `tie_word_embeddings` is the wrapper's (transformers ties by the
    top-level config), else `text_config`'s. A `vision_config` is ignored with a warning.

    Raises ValueError: no `text_config` object, a `text_config.model_type` of another model, or
    `tie_word_embeddings` given at both levels with different values.
    """
    text = read_field(hf, "text_config", "object")
    if text is None:
        raise ValueError(f"text_config is missing from the {model_type} config (it holds the language model)")
    expected = WRAPPERS[model_type]
    inner = read_field(text, "model_type", "str", where="text_config.")
    if inner is not None and inner != expected:
        raise ValueError(f"text_config.model_type must be {expected!r} in a {model_type!r} config, got {inner!r}")
    if read_field(hf, "vision_config", "object") is not None:
        warnings.warn(f"{model_type}: the vision tower (vision_config, model.visual.*) is ignored", stacklevel=3)
    out = {**text, "model_type": expected}
    for name in ("dtype", "torch_dtype", "bos_token_id", "eos_token_id", "quantization_config"):
        if out.get(name) is None and hf.get(name) is not None:
            out[name] = hf[name]
    outer_tie = read_field(hf, "tie_word_embeddings", "bool")
    inner_tie = read_field(text, "tie_word_embeddings", "bool", where="text_config.")
    if outer_tie is not None and inner_tie is not None and outer_tie != inner_tie:
        raise ValueError(f"tie_word_embeddings={outer_tie} and text_config.tie_word_embeddings={inner_tie} differ")
    out["tie_word_embeddings"] = inner_tie if outer_tie is None else outer_tie
    return out


def without_mrope(hf: Mapping[str, Any]) -> dict[str, Any]:
    """`hf` with `mrope_section` (a list) and `mrope_interleaved` (a bool) type-checked and dropped from its
    RoPE dicts (`rope_parameters`, `rope_scaling`): Qwen3.5's M-RoPE rotates text positions as plain RoPE."""
    out = dict(hf)
    for field in ("rope_parameters", "rope_scaling"):
        params = read_field(hf, field, "object")
        if params:
            for key, kind in _MROPE_KEYS.items():
                read_field(params, key, kind, where=f"{field}.")
            out[field] = {k: v for k, v in params.items() if k not in _MROPE_KEYS}
    return out


def _layer_types(hf: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types` (checked), else every `full_attention_interval`-th layer (default 4) full attention."""
    interval = read_positive(hf, "full_attention_interval", 4)
    kinds = read_field(hf, "layer_types", "list")
    if kinds is None:
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
    for i, kind in enumerate(kinds):
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {kind!r}")
    if len(kinds) != num_layers:
        raise ValueError(f"layer_types has {len(kinds)} entries, but num_hidden_layers is {num_layers}")
    return tuple(kinds)


def _qwen_mtp_layers(hf: Mapping[str, Any]) -> int:
    """D of a Qwen3.5 config: `mtp_num_hidden_layers` (or Qwen3-Next's `num_nextn_predict_layers`), 0 or 1."""
    found = [
        (name, value)
        for name in ("mtp_num_hidden_layers", "num_nextn_predict_layers")
        if (value := read_field(hf, name, "int")) is not None
    ]
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise ValueError(f"mtp_num_hidden_layers={found[0][1]} and num_nextn_predict_layers={found[1][1]} differ")
    name, layers = found[0] if found else ("mtp_num_hidden_layers", 0)
    if layers < 0:
        raise ValueError(f"{name} must be >= 0, got {layers}")
    if layers > 1:
        raise ValueError(
            f"{name}={layers} is not supported: Qwen3.5's MTP layers (mtp.layers.{{k}}) are the blocks of one "
            "MTP module, run one after another in a single step, not separate depths; mtp_jax's module has "
            "one block (1, as Qwen3.5 ships)"
        )
    if read_field(hf, "mtp_use_dedicated_embeddings", "bool", False):
        raise ValueError("mtp_use_dedicated_embeddings=True is not supported (the MTP module shares the embedding)")
    return layers


def family_from_hf(hf: Mapping[str, Any], model_type: str, sizes: Mapping[str, int], partial: float) -> dict:
    """The ModelConfig fields of a family model_type (`FAMILY_TYPES`) that `hf_config` does not read itself:
    attention, head_dim, hybrid layers, MoE, D and the MTP conventions (the family's, `FAMILY_CONVENTIONS`;
    config.json's `MTP_CONVENTION_FIELDS` override them in `hf_config`).

    Raises ValueError naming the field: `attention_bias` for Qwen3.5 (it adds an o_proj bias) or partial
    rotary for MiMo; bad `layer_types`; `mtp_num_hidden_layers` > 1 (`_qwen_mtp_layers`).
    """
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    layout = layout_of(model_type)
    head_dim = read_positive(hf, "head_dim", 256 if layout == "qwen3_5" else None)
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the derived default: keep configs canonical
    out: dict[str, Any] = {"head_dim": head_dim, "mtp_layout": layout, **FAMILY_CONVENTIONS[layout]}
    if layout == "mimo":
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor must be 1.0 for mimo (RoPE on every dim), got {partial!r}")
        return {**out, "attention_bias": True}
    if read_field(hf, "attention_bias", "bool", False):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it adds an o_proj bias)")
    out.update(
        _QWEN_FIXED,
        partial_rotary_factor=partial,
        layer_types=_layer_types(hf, sizes["num_hidden_layers"]),
        num_nextn_predict_layers=_qwen_mtp_layers(hf),
        **{name: read_positive(hf, name, default) for name, default in _LINEAR_FIELDS.items()},
    )
    if QWEN3_5_TYPES[model_type][1] == "moe":
        out.update(_QWEN_MOE_FIXED)
        out.update({ours: read_positive(hf, theirs, default) for ours, (theirs, default) in _QWEN_MOE_FIELDS.items()})
    return out


def check_expressible(config: ModelConfig, model_type: str) -> None:
    """Raises ValueError naming the first field of `config` that `model_type` (a family's) cannot express."""
    layout = layout_of(model_type)
    want: dict[str, Any] = {"mtp_layout": layout}
    if layout == "mimo":
        want.update(
            attention_type="gqa",
            ffn_type="dense",
            attention_bias=True,
            partial_rotary_factor=1.0,
            use_qk_norm=False,
            attn_output_gate=False,
            rms_norm_unit_offset=False,
        )
        if config.is_hybrid:
            raise ValueError(f"layer_types {config.layer_types} cannot be expressed as model_type 'mimo'")
    else:
        want.update(_QWEN_FIXED, attention_bias=False, ffn_type=QWEN3_5_TYPES[model_type][1])
        if config.ffn_type == "moe":
            want.update(_QWEN_MOE_FIXED)
        if config.num_nextn_predict_layers > 1:
            raise ValueError(f"num_nextn_predict_layers={config.num_nextn_predict_layers} > 1 cannot be {model_type}")
    for name, value in want.items():
        if getattr(config, name) != value:
            raise ValueError(f"{name}={getattr(config, name)!r} cannot be expressed as model_type {model_type!r}")
    if layout == "qwen3_5" and config.ffn_type == "moe" and config.shared_expert_intermediate_size is None:
        raise ValueError(f"shared_expert_intermediate_size=None cannot be expressed as model_type {model_type!r}")


def family_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields of a family model_type beyond the common ones (`hf_config.config_to_hf` writes
    those): architecture, Qwen3.5's hybrid, gating and MoE fields and `mtp_num_hidden_layers`, MiMo's Qwen2
    fields and `num_nextn_predict_layers`, and the MTP conventions that differ from the family's. The caller
    has checked `check_expressible`."""
    layout = layout_of(model_type)
    conventions = {name: getattr(config, name) for name in FAMILY_CONVENTIONS[layout]}
    hf = {name: value for name, value in conventions.items() if value != FAMILY_CONVENTIONS[layout][name]}
    if layout == "mimo":
        hf.update(
            architectures=[MIMO_ARCHITECTURE],
            num_nextn_predict_layers=config.num_nextn_predict_layers,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_hidden_layers,
        )
        return hf
    hf.update(
        architectures=[QWEN3_5_TYPES[model_type][0]],
        attention_bias=False,
        layer_types=list(config.layer_types or ("full_attention",) * config.num_hidden_layers),
        mtp_num_hidden_layers=config.num_nextn_predict_layers,
        **{name: getattr(config, name) for name in _LINEAR_FIELDS},
    )
    if config.ffn_type == "moe":
        hf.update({theirs: getattr(config, ours) for ours, (theirs, _) in _QWEN_MOE_FIELDS.items()})
    return hf


# Tensor names.

_QWEN_MTP_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden"}
_MIMO_MTP_NAMES = {"eh_proj": "input_proj", "enorm": "token_layernorm", "hnorm": "hidden_layernorm"}


def mtp_name(modules: list[str], j: int, config: ModelConfig) -> list[str]:
    """The HF name parts (before the leaf) of MTP module j's module path `modules` (after `mtp.j`), by
    `config.mtp_layout` ("qwen3_5" or "mimo"; the module docstring gives the names)."""
    if config.mtp_layout == "qwen3_5":
        if j != 0:
            raise ValueError(f"the qwen3_5 layout holds one MTP module, not module {j}")
        prefix, renames = ["mtp"], _QWEN_MTP_NAMES
        head_norm, block = ["norm"], ["mtp", "layers", "0"]
    else:
        prefix, renames = ["model", "mtp_layers", str(j)], _MIMO_MTP_NAMES
        head_norm, block = ["final_layernorm"], prefix
    if modules[0] in renames:
        return [*prefix, renames[modules[0]], *modules[1:]]
    if modules[:2] == ["shared_head", "norm"]:
        return [*prefix, *head_norm, *modules[2:]]
    return [*block, *modules]


def mtp_layers_present(names: Iterable[str], config: ModelConfig) -> int:
    """How many MTP modules the tensor `names` hold in `config.mtp_layout` ("qwen3_5": 1 if any `mtp.*`, or the
    number of `mtp.layers.{k}` blocks if more; "mimo": distinct `model.mtp_layers.{j}`, max j + 1)."""
    if config.mtp_layout == "qwen3_5":
        names = [name for name in names if name.startswith("mtp.")]
        blocks = {int(m.group(1)) for name in names if (m := re.match(r"mtp\.layers\.(\d+)\.", name))}
        return max(max(blocks, default=0) + 1, 1) if names else 0
    found = {int(m.group(1)) for name in names if (m := re.match(r"model\.mtp_layers\.(\d+)\.", name))}
    return max(found) + 1 if found else 0


def mtp_field(config: ModelConfig) -> tuple[str, str]:
    """(config.json's name for D, where the MTP tensors are) for `config.mtp_layout`, for error messages."""
    return {
        "deepseek": ("num_nextn_predict_layers", f"model.layers.{config.num_hidden_layers} on"),
        "qwen3_5": ("mtp_num_hidden_layers", "mtp.*"),
        "mimo": ("num_nextn_predict_layers", "model.mtp_layers.*"),
    }[config.mtp_layout]


@dataclasses.dataclass(frozen=True)
class TensorView:
    """A tensor the loader reads under another name: the stored tensor `stored`, or (`expert` not None) rows
    [start, start + shape[0]) of its slice `expert` (a fused routed-expert tensor [R, rows, in])."""

    stored: str
    shape: tuple[int, ...]
    expert: int | None = None
    start: int = 0


_WRAPPER_PREFIX = "model.language_model."
_FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def tensor_views(shapes: Mapping[str, tuple[int, ...]], config: ModelConfig) -> tuple[dict[str, TensorView], set[str]]:
    """(name -> `TensorView` for every tensor the loader sees under another name than the files', the stored
    names it ignores) for the tensors `shapes` (name -> shape) of `config`'s checkpoint. Only the "qwen3_5"
    layout has any (the module docstring): the wrapper's prefix, its vision tower, fused routed experts. A
    name that is both stored and a view's (the same tensor twice) is left for the loader to report."""
    if config.mtp_layout != "qwen3_5":
        return {}, set()
    ignored = {name for name in shapes if name.startswith("model.visual.")}
    views: dict[str, TensorView] = {}
    for stored, shape in shapes.items():
        name = "model." + stored.removeprefix(_WRAPPER_PREFIX) if stored.startswith(_WRAPPER_PREFIX) else stored
        fused = _FUSED_EXPERTS.match(name)
        if fused and len(shape) == 3 and (fused.group(2) == "down_proj" or shape[1] % 2 == 0):
            base, rows = fused.group(1), shape[1] // (2 if fused.group(2) == "gate_up_proj" else 1)
            pieces = ("gate_proj", "up_proj") if fused.group(2) == "gate_up_proj" else ("down_proj",)
            for r in range(shape[0]):
                for k, piece in enumerate(pieces):
                    views[f"{base}.{r}.{piece}.weight"] = TensorView(stored, (rows, shape[2]), r, k * rows)
        elif name != stored:
            views[name] = TensorView(stored, tuple(shape))
    return views, ignored


class ViewFile:
    """A `TensorFile` (`mtp_jax.checkpoints.tensor_reads`) that also reads `views` (name -> `TensorView` of a
    tensor in it) by their names: `entries` and `read(name, index)` as `TensorFile`'s, for stored and view
    names alike (a view's `entries` offset is None). Reads only the bytes a slice covers, as `TensorFile`."""

    def __init__(self, file, views: Mapping[str, TensorView]):
        self.file, self.views, self.shown = file, dict(views), file.shown
        self.entries = dict(file.entries)
        for name, view in self.views.items():
            self.entries[name] = (file.entries[view.stored][0], view.shape, None)

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        view = self.views.get(name)
        if view is None:
            return self.file.read(name, index)
        if view.expert is None:
            return self.file.read(view.stored, index)
        index = (*index, *(slice(None),) * (len(view.shape) - len(index)))
        start, stop, _ = index[0].indices(view.shape[0])
        rows = slice(view.start + start, view.start + max(start, stop))
        return self.file.read(view.stored, (slice(view.expert, view.expert + 1), rows, *index[1:]))[0]

    def close(self) -> None:
        self.file.close()
