"""Hugging Face `config.json` <-> `ModelConfig`: the model half of a checkpoint's format.

Reads and writes the `config.json` of the checkpoints `mtp_jax.checkpoint` loads and saves:
  - model types: `LlamaConfig` ("llama"), `Qwen2Config` ("qwen2") and `MistralConfig` ("mistral")
    as transformers' `save_pretrained` writes them;
  - RoPE in both spellings: transformers 4.x's `rope_theta` + `rope_scaling` (with "type" or
    "rope_type") and transformers 5.x's `rope_parameters` dict (which holds `rope_theta`), rope types
    default / linear / llama3 / yarn; both spellings are written, and they agree. Reading follows
    5.x: `rope_scaling`, when present, is the RoPE dict, else `rope_parameters`. 4.x reads the
    top-level `rope_theta` and 5.x the dict's, so where both are given they must be equal (an
    error naming both otherwise), and likewise `partial_rotary_factor`;
  - sliding windows: read only to refuse one that binds (Mistral's `sliding_window`, Qwen2's
    `use_sliding_window` / `max_window_layers` / `layer_types`);
  - MTP: DeepSeek-V3's `num_nextn_predict_layers` (README_WEIGHTS.md), plus mtp_jax's conventions
    (`MTP_CONVENTION_FIELDS`), which DeepSeek's own files lack.

Every field that is read is type-checked as JSON (no coercion: "64" is not an int, 64.0 is not an
int, "false" is not a bool; NaN and Infinity, which Python's json accepts, are not numbers; null
means absent, and only absent fields take defaults), and anything this model cannot reproduce
raises a ValueError naming the field. `config_to_hf` inverts `config_from_hf`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mtp_jax.config import ModelConfig, RopeScaling

# mtp_jax's MTP convention fields, stored in config.json beside DeepSeek's num_nextn_predict_layers
# (absent in DeepSeek's own files: the defaults follow DeepSeek-V3 as serving engines load it).
MTP_CONVENTION_FIELDS = ("mtp_style", "mtp_concat_order", "mtp_hidden_after_norm", "mtp_chain_after_shared_head_norm")

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen2": 32768, "mistral": 131072}  # the HF config classes' defaults
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # the dtypes config.json may name
# RoPE keys per type, besides "rope_type"/"type", "rope_theta" and "partial_rotary_factor".
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"),
}

_KINDS = {"int": "an int", "number": "a number", "bool": "a bool (true or false)", "str": "a string",
          "object": "an object", "list": "a list"}


def _read(hf: Mapping[str, Any], name: str, kind: str, default: Any = None, *, where: str = "") -> Any:
    """hf[name], checked to be JSON of `kind` (see `_KINDS`); `default` when absent or null.

    No coercion: an int is not a bool, a float or a string is not an int; "number" accepts ints
    and returns a float, and refuses NaN and +-Infinity. `where` prefixes the field name in the
    error ("rope_scaling.").
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
    if kind != "number":
        return value
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{where}{name} must be a finite number, got {value!r}")
    return number


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


def _agreed(sources: list[tuple[str, Mapping[str, Any]]], name: str, default: float) -> float:
    """The number `name` from whichever of `sources` ((field prefix, dict) pairs) give it; `default` if none.

    Two sources with different values are an error naming both fields.
    """
    found = [(prefix + name, value) for prefix, source in sources
             if (value := _read(source, name, "number", where=prefix)) is not None]
    for field, value in found[1:]:
        if value != found[0][1]:
            raise ValueError(f"{found[0][0]}={found[0][1]!r} and {field}={value!r} differ (transformers 4.x "
                             "reads the top-level field, 5.x the one in the RoPE dict): make them equal")
    return found[0][1] if found else default


def _rope_from_hf(hf: Mapping[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    """(rope_theta, RopeScaling) from either RoPE spelling, with transformers 5's precedence rules.

    `rope_scaling` wins over `rope_parameters` (as in 4.x, which knows only the former, and 5.x's
    `convert_rope_params_to_dict`); a `rope_theta` or `partial_rotary_factor` given in more than
    one of the top level, `rope_scaling` and `rope_parameters` must be equal in all of them.
    """
    scaling, parameters = _read(hf, "rope_scaling", "object"), _read(hf, "rope_parameters", "object")
    field = "rope_scaling" if scaling else "rope_parameters"
    params, where = dict(scaling or parameters or {}), f"{field}."
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{field}: per-layer-type RoPE parameters are not supported")
    sources = [("", hf), *((f"{key}.", d) for key, d in (("rope_scaling", scaling), ("rope_parameters", parameters))
                           if d)]
    theta = _agreed(sources, "rope_theta", 10000.0)
    rope_type = _read(params, "rope_type", "str", where=where)
    rope_type = _or(_or(rope_type, _read(params, "type", "str", where=where)), "default")
    partial = _agreed(sources, "partial_rotary_factor", 1.0)
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
        original_max_position_embeddings=original, beta_fast=_or(numbers["beta_fast"], 32.0),
        beta_slow=_or(numbers["beta_slow"], 1.0), truncate=_read(params, "truncate", "bool", True, where=where),
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
      or a float where an int is expected, a string where a bool is, a list where an object is),
      a number that is NaN or infinite, a size that is 0 or negative, and a `rope_theta` or
      `partial_rotary_factor` given twice (top level, `rope_scaling`, `rope_parameters`) with
      different values. Values `ModelConfig` / `RopeScaling` refuse (a yarn `beta_fast` of 0, ...)
      raise their ValueError naming the field.
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
    dtype = _or(_or(_read(hf, "dtype", "str"), _read(hf, "torch_dtype", "str")), "float32")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}")
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
    if config.attention_type != "gqa" or config.ffn_type != "dense":
        raise ValueError(f"config_to_hf writes Llama / Qwen2 / Mistral configs: attention_type="
                         f"{config.attention_type!r} with ffn_type={config.ffn_type!r} has no mapping yet")
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

