"""Hugging Face `config.json` <-> `ModelConfig`: the model half of a checkpoint's format.

Reads and writes the `config.json` of the checkpoints `mtp_jax.checkpoints` loads and saves:
  - model types: `LlamaConfig` ("llama"), `Qwen2Config` ("qwen2") and `MistralConfig` ("mistral")
    as transformers' `save_pretrained` writes them; `DeepseekV3Config` ("deepseek_v3": MLA + MoE,
    also DeepSeek's own files with `scoring_func` / `topk_method`) and `Glm4MoeConfig` ("glm4_moe":
    partial rotary, q/k norm, q/k/v bias, MoE), with the HF config classes' defaults;
  - RoPE in both spellings: transformers 4.x's `rope_theta` + `rope_scaling` (with "type" or
    "rope_type") and transformers 5.x's `rope_parameters` dict (which holds `rope_theta`), rope types
    default / linear / llama3 / yarn; both spellings are written, and they agree. Reading follows
    5.x: `rope_scaling`, when present, is the RoPE dict, else `rope_parameters`. 4.x reads the
    top-level `rope_theta` and 5.x the dict's, so where both are given they must be equal (an
    error naming both otherwise), and likewise `partial_rotary_factor`;
  - sliding windows: read only to refuse one that binds (Mistral's `sliding_window`, Qwen2's
    `use_sliding_window` / `max_window_layers` / `layer_types`);
  - MTP: DeepSeek-V3's `num_nextn_predict_layers` (README_WEIGHTS.md), plus mtp_jax's conventions
    (`MTP_CONVENTION_FIELDS`), which DeepSeek's own files lack;
  - the families whose MTP layers are named otherwise, `mtp_jax.checkpoints.families`: Qwen3.5 ("qwen3_5_text",
    "qwen3_5_moe_text" and their multimodal wrappers "qwen3_5" / "qwen3_5_moe") and MiMo ("mimo");
  - quantization: DeepSeek-V3's block-scaled FP8 `quantization_config` (`quant_method` "fp8", `fmt`
    "e4m3", `activation_scheme` "dynamic", `weight_block_size` [b_out, b_in], optional
    `modules_to_not_convert`) <-> `ModelConfig.quantization` (`mtp_jax.quantization.Fp8Config`); every
    other quantization method is refused.

Every field that is read is type-checked as JSON (no coercion: "64" is not an int, 64.0 is not an
int, "false" is not a bool; NaN and Infinity, which Python's json accepts, are not numbers; null
means absent, and only absent fields take defaults), and anything this model cannot reproduce
raises a ValueError naming the field. `config_to_hf` inverts `config_from_hf`.

How a model runs rather than what it computes is not in config.json: `attention_impl` and the layer
layout `scan_layers` are left out on export and take `ModelConfig`'s defaults on import
(`mtp_jax.checkpoints.reading.load_hf_checkpoint(..., scan_layers=)` chooses the layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtp_jax.checkpoints import families
from mtp_jax.checkpoints.hf_rope import rope_from_hf, rope_to_hf
from mtp_jax.checkpoints.json_fields import or_default, read_field, read_kind, read_positive, read_token_ids
from mtp_jax.config import ModelConfig
from mtp_jax.quantization import Fp8Config
from mtp_jax.validation import is_int

# mtp_jax's MTP convention fields, stored in config.json beside DeepSeek's num_nextn_predict_layers
# (absent in DeepSeek's own files: the defaults follow DeepSeek-V3 as serving engines load it).
_MTP_CONVENTION_KINDS = {
    "mtp_style": "str",
    "mtp_concat_order": "str",
    "mtp_hidden_after_norm": "bool",
    "mtp_chain_after_shared_head_norm": "bool",
    "mtp_zero_embedding_at_start": "bool",
}
MTP_CONVENTION_FIELDS = tuple(_MTP_CONVENTION_KINDS)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
_MOE_TYPES = ("deepseek_v3", "glm4_moe")
# The HF config classes' defaults.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072, "deepseek_v3": 4096, "glm4_moe": 131072}
_DEFAULT_RMS_NORM_EPS = {"glm4_moe": 1e-5}  # else 1e-6
# MoE fields: (JSON kind, DeepseekV3Config default, Glm4MoeConfig default).
_MOE_FIELDS = {
    "moe_intermediate_size": ("positive", 2048, 1408),
    "n_routed_experts": ("positive", 256, 128),
    "n_shared_experts": ("int", 1, 1),
    "num_experts_per_tok": ("positive", 8, 8),
    "n_group": ("positive", 8, 1),
    "topk_group": ("positive", 4, 1),
    "routed_scaling_factor": ("number", 2.5, 1.0),
    "norm_topk_prob": ("bool", True, True),
    "first_k_dense_replace": ("int", 3, 1),
}
# MLA fields (deepseek_v3): (JSON kind, DeepseekV3Config default); q_lora_rank null = a full-rank q_proj.
_MLA_FIELDS = {
    "kv_lora_rank": ("positive", 512),
    "qk_nope_head_dim": ("positive", 128),
    "qk_rope_head_dim": ("positive", 64),
    "v_head_dim": ("positive", 128),
    "rope_interleave": ("bool", True),
}
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes config.json may name


def _check_sliding_window(hf: Mapping[str, Any], model_type: str, max_positions: int, num_layers: int) -> None:
    window = read_positive(hf, "sliding_window")
    layer_types = read_field(hf, "layer_types", "list")
    use_sliding_window = read_field(hf, "use_sliding_window", "bool", False)
    max_window_layers = read_field(hf, "max_window_layers", "int", 28)
    if window is None or window >= max_positions:
        return  # no window, or one that never binds
    if model_type == "mistral":
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_positions}: "
            "sliding-window attention is not supported"
        )
    if model_type == "qwen2" and use_sliding_window:
        in_use = "sliding_attention" in layer_types if layer_types is not None else max_window_layers < num_layers
        if in_use:
            raise ValueError(
                f"use_sliding_window=True with sliding_window={window}: sliding-window attention is not supported"
            )


def _moe_from_hf(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The MoE fields of a deepseek_v3 / glm4_moe config, with its config class's defaults.

    Both route by sigmoid scores with DeepSeek-V3's bias-corrected group-limited top-k
    ("noaux_tc"); DeepSeek's own files say so in `scoring_func` / `topk_method`, which must then be
    those, and `moe_layer_freq`, when given, must be 1 (every layer from first_k_dense_replace on).
    """
    column = 1 if model_type == "deepseek_v3" else 2
    out = {name: read_kind(hf, name, spec[0], spec[column]) for name, spec in _MOE_FIELDS.items()}
    for name in ("n_shared_experts", "first_k_dense_replace"):
        if out[name] < 0:
            raise ValueError(f"{name} must be >= 0, got {out[name]}")
    for name, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = read_field(hf, name, "str")
        if value is not None and value != supported:
            raise ValueError(f"{name}={value!r} is not supported (only {supported!r}, as {model_type} routes)")
    freq = read_field(hf, "moe_layer_freq", "int")
    if freq is not None and freq != 1:
        raise ValueError(f"moe_layer_freq={freq} is not supported (only 1: every layer from first_k_dense_replace on)")
    return {"ffn_type": "moe", **out}


def _family_from_hf(hf: Mapping[str, Any], model_type: str, sizes: Mapping[str, int], partial: float) -> dict[str, Any]:
    """The ModelConfig fields that depend on the model type: attention, biases, head_dim, MoE (the Qwen3.5 and
    MiMo families: `families.family_from_hf`, with D and their MTP conventions)."""
    if model_type in families.FAMILY_TYPES:
        return families.family_from_hf(hf, model_type, sizes, partial)
    heads, hidden = sizes["num_attention_heads"], sizes["hidden_size"]
    attention_bias = read_field(hf, "attention_bias", "bool", False)
    if model_type in _MOE_TYPES and read_field(hf, "use_sliding_window", "bool", False):
        raise ValueError("use_sliding_window=True: sliding-window attention is not supported")
    if model_type == "deepseek_v3":
        if partial != 1.0:
            raise ValueError(
                f"partial_rotary_factor must be 1.0 for deepseek_v3 (qk_rope_head_dim is the rotary "
                f"part), got {partial!r}"
            )
        read_field(hf, "head_dim", "int")  # transformers writes qk_rope_head_dim here; MLA has no use for it
        read_field(hf, "qk_head_dim", "int")
        mla = {name: read_kind(hf, name, kind, default) for name, (kind, default) in _MLA_FIELDS.items()}
        return {
            "attention_type": "mla",
            "attention_bias": attention_bias,
            "q_lora_rank": read_positive(hf, "q_lora_rank"),
            **mla,
            **_moe_from_hf(hf, model_type),
        }
    head_dim = read_positive(hf, "head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # the derived default: keep configs canonical
    if model_type == "glm4_moe":
        return {
            "head_dim": head_dim,
            "attention_bias": attention_bias,
            "partial_rotary_factor": partial,
            "use_qk_norm": read_field(hf, "use_qk_norm", "bool", False),
            **_moe_from_hf(hf, model_type),
        }
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0 (RoPE on every dim), got {partial!r}")
    if attention_bias and model_type in ("llama", "mistral"):
        raise ValueError(f"attention_bias=True is not supported for {model_type} (it adds an o_proj bias)")
    return {"head_dim": head_dim, "attention_bias": model_type == "qwen2"}


def _quantization_from_hf(hf: Mapping[str, Any]) -> Fp8Config | None:
    """`quantization_config` as an `Fp8Config` (None when absent): DeepSeek-V3's block-scaled FP8 only.

    `quant_method` "fp8" with `fmt` "e4m3" and `activation_scheme` "dynamic" (each may be absent),
    `weight_block_size` [b_out, b_in] (required: per-tensor FP8 has no block scales), optional
    `modules_to_not_convert` (strings). Other keys (transformers' `dequantize`, ...) are ignored.
    """
    where = "quantization_config."
    quant = read_field(hf, "quantization_config", "object")
    if quant is None:
        return None
    method = read_field(quant, "quant_method", "str", where=where)
    if method != "fp8":
        raise ValueError(
            f"{where}quant_method={method!r} is not supported: only block-scaled 'fp8' (DeepSeek-V3's format: "
            "float8_e4m3fn weights with a float32 weight_scale_inv per block) is"
        )
    for name, supported in (("fmt", "e4m3"), ("activation_scheme", "dynamic")):
        value = read_field(quant, name, "str", where=where)
        if value is not None and value != supported:
            raise ValueError(f"{where}{name}={value!r} is not supported (only {supported!r}, DeepSeek-V3's)")
    block = read_field(quant, "weight_block_size", "list", where=where)
    if block is None:
        raise ValueError(f"{where}weight_block_size is missing: only block-scaled fp8 (DeepSeek-V3's) is supported")
    if len(block) != 2 or not all(is_int(b) and b >= 1 for b in block):
        raise ValueError(f"{where}weight_block_size must be a list of two ints >= 1 [b_out, b_in], got {block!r}")
    modules = read_field(quant, "modules_to_not_convert", "list", [], where=where)
    for k, module in enumerate(modules):
        if not isinstance(module, str):
            raise ValueError(f"{where}modules_to_not_convert[{k}] must be a string, got {module!r}")
    return Fp8Config(weight_block_size=tuple(block), modules_to_not_convert=tuple(modules))


def _quantization_to_hf(fp8: Fp8Config) -> dict[str, Any]:
    """`_quantization_from_hf`'s inverse: DeepSeek-V3's `quantization_config` (`modules_to_not_convert` when any)."""
    quant: dict[str, Any] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(fp8.weight_block_size),
    }
    if fp8.modules_to_not_convert:
        quant["modules_to_not_convert"] = list(fp8.modules_to_not_convert)
    return quant


def _mtp_layers_from_hf(hf: Mapping[str, Any]) -> int:
    """D: `num_nextn_predict_layers` (DeepSeek's name) or transformers 5's alias `num_mtp_layers`; equal if both."""
    found = [
        (name, value)
        for name in ("num_nextn_predict_layers", "num_mtp_layers")
        if (value := read_field(hf, name, "int")) is not None
    ]
    if len(found) == 2 and found[0][1] != found[1][1]:
        raise ValueError(f"num_nextn_predict_layers={found[0][1]} and num_mtp_layers={found[1][1]} differ")
    return found[0][1] if found else 0


def config_from_hf(hf_config: Mapping[str, Any]) -> ModelConfig:
    """A `ModelConfig` from a Hugging Face `config.json` dict (model_type llama, qwen2, mistral,
    deepseek_v3, glm4_moe, or the families of `mtp_jax.checkpoints.families`: qwen3_5_text, qwen3_5_moe_text,
    their multimodal wrappers qwen3_5 / qwen3_5_moe (`text_config`; the vision tower is ignored), mimo).

    Reads transformers 4.x (`rope_theta`, `rope_scaling` with "type" or "rope_type") and 5.x
    (`rope_parameters`) RoPE fields, rope types default / linear / llama3 / yarn. The stored
    `dtype` (or 4.x `torch_dtype`) becomes both `dtype` and `param_dtype` (float32 when absent); a
    DeepSeek-V3 FP8 `quantization_config` becomes `quantization` (`_quantization_from_hf`), the stored
    dtype then being that of the unquantized weights. Fields with no effect on the forward pass
    (dropout, use_cache, pad_token_id, ...) are ignored.
    Every field read is type-checked as JSON, without coercion (see `read_field`); null means absent.
    deepseek_v3 and glm4_moe fields absent from the file take their HF config class's defaults
    (GLM's partial_rotary_factor 0.5 included). `num_nextn_predict_layers` (or transformers 5's
    `num_mtp_layers`; Qwen3.5: `mtp_num_hidden_layers`) is D; `mtp_jax.checkpoints` checks that the weights
    hold exactly D MTP layers. mtp_jax's `MTP_CONVENTION_FIELDS`, when present, override the defaults (the
    families': `families.FAMILY_CONVENTIONS`).

    Raises:
      ValueError naming the field for anything this model cannot reproduce: another model_type,
      hidden_act != "silu", an unsupported rope type or RoPE key, partial rotary embeddings (except
      glm4_moe), a sliding window that binds, Llama's attention_bias (it adds an o_proj bias) or
      mlp_bias, a `scoring_func` other than "sigmoid" or `topk_method` other than "noaux_tc",
      `moe_layer_freq` other than 1, a `quantization_config` other than DeepSeek-V3's block-scaled fp8
      (another `quant_method`, `fmt` or `activation_scheme`, no `weight_block_size`), a missing size
      field; and for a field of
      the wrong JSON type (a string or a float where an int is expected, a string where a bool is,
      a list where an object is), a number that is NaN or infinite, a size that is 0 or negative,
      and a `rope_theta` or `partial_rotary_factor` given twice (top level, `rope_scaling`,
      `rope_parameters`) with different values. Values `ModelConfig` / `RopeScaling` refuse (a yarn
      `beta_fast` of 0, topk_group > n_group, ...) raise their ValueError naming the field. The
      families' own errors: `families.unwrap`, `families.family_from_hf` (e.g. `mtp_num_hidden_layers` > 1,
      a `layer_types` entry of an unknown kind or a `layer_types` of the wrong length).
    """
    if not isinstance(hf_config, Mapping):
        raise ValueError(f"the config must be a JSON object, got {type(hf_config).__name__}")
    hf = dict(hf_config)
    model_type = read_field(hf, "model_type", "str")
    if model_type in families.WRAPPERS:
        hf = families.unwrap(hf, model_type)
        model_type = hf["model_type"]
    if model_type not in _ARCHITECTURES and model_type not in families.FAMILY_TYPES:
        supported = (*_ARCHITECTURES, *families.FAMILY_TYPES, *families.WRAPPERS)
        raise ValueError(f"model_type must be one of {supported}, got {model_type!r}")
    sizes = {}
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        sizes[name] = read_positive(hf, name)
        if sizes[name] is None and name == "intermediate_size" and model_type == "qwen3_5_moe_text":
            sizes[name] = read_positive(hf, "moe_intermediate_size", 512)  # every layer is MoE: unused
        if sizes[name] is None:
            raise ValueError(f"{name} is missing from the config")
    quantization = _quantization_from_hf(hf)
    if read_field(hf, "mlp_bias", "bool", False):
        raise ValueError("mlp_bias=True is not supported (the MLP projections have no bias)")
    default_positions = _DEFAULT_MAX_POSITIONS.get(model_type, families.DEFAULT_MAX_POSITIONS)
    max_positions = read_positive(hf, "max_position_embeddings", default_positions)
    window_type = "qwen2" if model_type == "mimo" else model_type
    _check_sliding_window(hf, window_type, max_positions, sizes["num_hidden_layers"])
    qwen3_5 = model_type in families.QWEN3_5_TYPES
    partial_default = {"glm4_moe": 0.5}.get(model_type, 0.25 if qwen3_5 else 1.0)
    rope_hf = families.without_mrope(hf) if qwen3_5 else hf
    theta, scaling, partial = rope_from_hf(rope_hf, max_positions, partial_default=partial_default)
    family = _family_from_hf(hf, model_type, sizes, partial)
    dtype = or_default(or_default(read_field(hf, "dtype", "str"), read_field(hf, "torch_dtype", "str")), "float32")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
    for name, kind in _MTP_CONVENTION_KINDS.items():
        if (value := read_field(hf, name, kind)) is not None:
            family[name] = value
    family.setdefault("num_nextn_predict_layers", _mtp_layers_from_hf(hf))
    default_kv_heads = families.DEFAULT_KV_HEADS.get(model_type, sizes["num_attention_heads"])
    return ModelConfig(
        **sizes,
        **family,
        num_key_value_heads=read_positive(hf, "num_key_value_heads", default_kv_heads),
        max_position_embeddings=max_positions,
        rms_norm_eps=read_field(hf, "rms_norm_eps", "number", _DEFAULT_RMS_NORM_EPS.get(model_type, 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=read_field(hf, "tie_word_embeddings", "bool", False),
        hidden_act=read_field(hf, "hidden_act", "str", "silu"),
        dtype=dtype,
        param_dtype=dtype,
        initializer_range=read_field(hf, "initializer_range", "number", 0.02),
        bos_token_id=read_field(hf, "bos_token_id", "int"),
        eos_token_id=read_token_ids(hf, "eos_token_id"),
        quantization=quantization,
    )


def config_to_hf(config: ModelConfig, *, model_type: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` dict for `config`; `config_from_hf` inverts it.

    model_type: "llama", "qwen2", "mistral", "deepseek_v3", "glm4_moe", "qwen3_5_text", "qwen3_5_moe_text" or
    "mimo"; default by `mtp_layout`: "qwen3_5" -> "qwen3_5_moe_text" / "qwen3_5_text" by `ffn_type`, "mimo" ->
    "mimo" (`families.family_to_hf`), else "deepseek_v3" for MLA + MoE, "glm4_moe" for GQA + MoE, else "qwen2"
    when `attention_bias` (Qwen2's q/k/v bias without an o_proj bias) else "llama". RoPE is written both ways,
    and they agree:
    `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling` (4.x). `dtype` is
    written as `param_dtype`, the weights' storage dtype: config.json holds one dtype, so a
    mixed-precision compute dtype is not recorded and the inverse is exact when
    `dtype == param_dtype`. `quantization` is written as DeepSeek-V3's `quantization_config`.

    Raises:
      ValueError when the chosen model_type cannot express the config: attention_bias must be True
      for qwen2 and False for llama / mistral; those three take GQA with a dense MLP and full
      rotary; deepseek_v3 takes MLA + MoE, glm4_moe GQA + MoE, both with sigmoid routing, and
      deepseek_v3 neither q/k norm nor partial rotary; none of them takes another `mtp_layout`, hybrid
      layers, gated attention, zero-centred norms or a gated shared expert; the families'
      (`families.check_expressible`) take what they fix.
    """
    default = (
        {"mla": "deepseek_v3", "gqa": "glm4_moe"}.get(config.attention_type)
        if config.ffn_type == "moe"
        else ("qwen2" if config.attention_bias else "llama")
    )
    model_type = model_type or families.default_model_type(config) or default
    if model_type in families.FAMILY_TYPES:
        families.check_expressible(config, model_type)
        return _common_to_hf(config, model_type) | families.family_to_hf(config, model_type)
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {(*_ARCHITECTURES, *families.FAMILY_TYPES)}, got {model_type!r}")
    for name in ("attn_output_gate", "rms_norm_unit_offset", "shared_expert_gate"):
        if getattr(config, name):
            raise ValueError(f"{name}=True cannot be expressed as model_type {model_type!r}")
    if config.is_hybrid:
        raise ValueError(f"layer_types {config.layer_types} cannot be expressed as model_type {model_type!r}")
    if config.mtp_layout != "deepseek":
        raise ValueError(f"mtp_layout={config.mtp_layout!r} cannot be expressed as model_type {model_type!r}")
    expected = {"deepseek_v3": ("mla", "moe"), "glm4_moe": ("gqa", "moe")}.get(model_type, ("gqa", "dense"))
    if (config.attention_type, config.ffn_type) != expected:
        raise ValueError(
            f"attention_type={config.attention_type!r} with ffn_type={config.ffn_type!r} cannot be "
            f"expressed as model_type {model_type!r} (it takes {expected[0]!r} with {expected[1]!r})"
        )
    if model_type in _MOE_TYPES and config.scoring_func != "sigmoid":
        raise ValueError(
            f"scoring_func={config.scoring_func!r} cannot be expressed as model_type {model_type!r} "
            "(it routes by sigmoid)"
        )
    if model_type not in ("glm4_moe",) and (config.partial_rotary_factor != 1.0 or config.use_qk_norm):
        raise ValueError(
            f"partial_rotary_factor={config.partial_rotary_factor} / use_qk_norm={config.use_qk_norm} "
            f"cannot be expressed as model_type {model_type!r} (glm4_moe has them)"
        )
    if model_type in ("llama", "qwen2", "mistral") and config.attention_bias != (model_type == "qwen2"):
        raise ValueError(f"attention_bias={config.attention_bias} cannot be expressed as model_type {model_type!r}")
    hf = _common_to_hf(config, model_type)
    if model_type in _MOE_TYPES:
        hf.update(
            {name: getattr(config, name) for name in _MOE_FIELDS},
            attention_bias=config.attention_bias,
            num_nextn_predict_layers=config.num_nextn_predict_layers,
        )
    if model_type == "deepseek_v3":
        hf.update(
            {name: getattr(config, name) for name in ("q_lora_rank", *_MLA_FIELDS)},
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        )
    elif model_type == "glm4_moe":
        hf.update(use_qk_norm=config.use_qk_norm, partial_rotary_factor=config.partial_rotary_factor)
    if config.num_nextn_predict_layers:  # DeepSeek-V3's field, plus mtp_jax's conventions (others ignore them)
        hf["num_nextn_predict_layers"] = config.num_nextn_predict_layers
        hf.update({name: getattr(config, name) for name in MTP_CONVENTION_FIELDS})
    if model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    elif model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_hidden_layers)
    elif model_type == "mistral":
        hf.update(sliding_window=None)
    return hf


def _common_to_hf(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields every model_type writes: architecture, sizes, RoPE (both spellings; the partial
    rotary factor in `rope_parameters` for glm4_moe and Qwen3.5), embeddings, token ids, dtype, quantization."""
    scaling = rope_to_hf(config.rope_scaling)
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    if model_type == "glm4_moe" or model_type in families.QWEN3_5_TYPES:
        rope_parameters["partial_rotary_factor"] = config.partial_rotary_factor
    eos = config.eos_token_id
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES.get(model_type)],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.qk_rope_head_dim if model_type == "deepseek_v3" else config.resolved_head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": rope_parameters,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": config.initializer_range,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": list(eos) if isinstance(eos, tuple) else eos,
        "dtype": config.param_dtype,
    }
    if config.quantization is not None:
        hf["quantization_config"] = _quantization_to_hf(config.quantization)
    return hf
