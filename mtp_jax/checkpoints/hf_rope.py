"""RoPE in a Hugging Face config.json, in both spellings: transformers 4.x's `rope_theta` + `rope_scaling`
(with "type" or "rope_type") and transformers 5.x's `rope_parameters` dict (which holds `rope_theta`);
rope types default / linear / llama3 / yarn. Reading follows 5.x: `rope_scaling`, when present, is the
RoPE dict, else `rope_parameters`; where both give `rope_theta` (or `partial_rotary_factor`) they must
agree. Writing gives both spellings (`mtp_jax.checkpoints.hf_config` writes them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mtp_jax.checkpoints.json_fields import or_default, read_field, read_positive
from mtp_jax.config import RopeScaling

# RoPE keys per type, besides "rope_type"/"type", "rope_theta" and "partial_rotary_factor".
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}


def _agreed(sources: list[tuple[str, Mapping[str, Any]]], name: str, default: float) -> float:
    """The number `name` from whichever of `sources` ((field prefix, dict) pairs) give it; `default` if none.

    Two sources with different values are an error naming both fields.
    """
    found = [
        (prefix + name, value)
        for prefix, source in sources
        if (value := read_field(source, name, "number", where=prefix)) is not None
    ]
    for field, value in found[1:]:
        if value != found[0][1]:
            raise ValueError(
                f"{found[0][0]}={found[0][1]!r} and {field}={value!r} differ (transformers 4.x "
                "reads the top-level field, 5.x the one in the RoPE dict): make them equal"
            )
    return found[0][1] if found else default


def rope_from_hf(
    hf: Mapping[str, Any], max_positions: int, *, partial_default: float = 1.0
) -> tuple[float, RopeScaling, float]:
    """(rope_theta, RopeScaling, partial_rotary_factor) from either RoPE spelling, with transformers 5's precedence.

    `rope_scaling` wins over `rope_parameters` (as in 4.x, which knows only the former, and 5.x's
    `convert_rope_params_to_dict`); a `rope_theta` or `partial_rotary_factor` given in more than
    one of the top level, `rope_scaling` and `rope_parameters` must be equal in all of them.
    """
    scaling, parameters = read_field(hf, "rope_scaling", "object"), read_field(hf, "rope_parameters", "object")
    field = "rope_scaling" if scaling else "rope_parameters"
    params, where = dict(scaling or parameters or {}), f"{field}."
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{field}: per-layer-type RoPE parameters are not supported")
    sources = [
        ("", hf),
        *((f"{key}.", d) for key, d in (("rope_scaling", scaling), ("rope_parameters", parameters)) if d),
    ]
    theta = _agreed(sources, "rope_theta", 10000.0)
    rope_type = read_field(params, "rope_type", "str", where=where)
    rope_type = or_default(or_default(rope_type, read_field(params, "type", "str", where=where)), "default")
    partial = _agreed(sources, "partial_rotary_factor", partial_default)
    for key in ("rope_theta", "rope_type", "type", "partial_rotary_factor"):
        params.pop(key, None)
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"{field}.rope_type {rope_type!r} is not supported (supported: {tuple(_ROPE_KEYS)})")
    unknown = sorted(set(params) - set(_ROPE_KEYS[rope_type]))
    if unknown:
        raise ValueError(f"{field}.{unknown[0]} is not supported for rope_type {rope_type!r}")
    if rope_type == "default":
        return theta, RopeScaling(), partial
    numbers = {
        key: read_field(params, key, "number", where=where)
        for key in (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        )
    }
    factor = numbers["factor"]
    if rope_type in ("linear", "llama3") and factor is None:
        raise ValueError(f"{field}.factor is required for rope_type {rope_type!r}")
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=factor), partial
    # transformers 5: a top-level original_max_position_embeddings (Phi-3 style) wins, then the
    # dict's, then max_position_embeddings.
    original = (
        read_positive(hf, "original_max_position_embeddings")
        or read_positive(params, "original_max_position_embeddings", where=where)
        or max_positions
    )
    if rope_type == "llama3":
        return (
            theta,
            RopeScaling(
                rope_type="llama3",
                factor=factor,
                original_max_position_embeddings=original,
                low_freq_factor=or_default(numbers["low_freq_factor"], 1.0),
                high_freq_factor=or_default(numbers["high_freq_factor"], 4.0),
            ),
            partial,
        )
    return (
        theta,
        RopeScaling(
            rope_type="yarn",
            factor=max_positions / original if factor is None else factor,
            original_max_position_embeddings=original,
            beta_fast=or_default(numbers["beta_fast"], 32.0),
            beta_slow=or_default(numbers["beta_slow"], 1.0),
            truncate=read_field(params, "truncate", "bool", True, where=where),
            **{key: numbers[key] for key in ("attention_factor", "mscale", "mscale_all_dim")},
        ),
        partial,
    )


def rope_to_hf(s: RopeScaling) -> dict[str, Any] | None:
    """The `rope_scaling` dict (without rope_theta) for `s`, None for the default."""
    if s.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        out.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    elif s.rope_type == "yarn":
        out.update(
            original_max_position_embeddings=s.original_max_position_embeddings,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
        )
        out.update(
            {k: getattr(s, k) for k in ("attention_factor", "mscale", "mscale_all_dim") if getattr(s, k) is not None}
        )
        if not s.truncate:
            out["truncate"] = False
    return out
