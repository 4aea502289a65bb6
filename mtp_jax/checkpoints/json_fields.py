"""Fields of a JSON config read with their JSON type checked: no coercion ("64" is not an int, 64.0 is not
an int, "false" is not a bool; NaN and Infinity, which Python's json accepts, are not numbers; null
means absent, and only absent fields take defaults). Errors are ValueErrors naming the field."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mtp_jax.validation import is_int, is_real

_KINDS = {
    "int": "an int",
    "number": "a number",
    "bool": "a bool (true or false)",
    "str": "a string",
    "object": "an object",
    "list": "a list",
}


def read_field(hf: Mapping[str, Any], name: str, kind: str, default: Any = None, *, where: str = "") -> Any:
    """hf[name], checked to be JSON of `kind` (see `_KINDS`); `default` when absent or null.

    No coercion: an int is not a bool, a float or a string is not an int; "number" accepts ints
    and returns a float, and refuses NaN and +-Infinity. `where` prefixes the field name in the
    error ("rope_scaling.").
    """
    value = hf.get(name)
    if value is None:
        return default
    ok = {
        "int": is_int(value),
        "number": is_real(value),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "object": isinstance(value, Mapping),
        "list": isinstance(value, list),
    }[kind]
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


def read_positive(hf: Mapping[str, Any], name: str, default: int | None = None, *, where: str = "") -> int | None:
    """hf[name] as an int >= 1 (`default` when absent or null); 0 and negatives are errors."""
    value = read_field(hf, name, "int", where=where)
    if value is not None and value < 1:
        raise ValueError(f"{where}{name} must be >= 1, got {value}")
    return default if value is None else value


def read_token_ids(hf: Mapping[str, Any], name: str) -> int | tuple[int, ...] | None:
    """A token id, or a list of them (returned as a tuple)."""
    value = hf.get(name)
    if not isinstance(value, list):
        return read_field(hf, name, "int")
    for i, token in enumerate(value):
        if not is_int(token):
            raise ValueError(f"{name}[{i}] must be an int, got {token!r}")
    return tuple(value)


def read_kind(hf: Mapping[str, Any], name: str, kind: str, default: Any) -> Any:
    """`read_field`, with kind "positive" meaning an int >= 1 (`read_positive`)."""
    return read_positive(hf, name, default) if kind == "positive" else read_field(hf, name, kind, default)


def or_default(value: Any, default: Any) -> Any:
    """`value`, or `default` when it is None (a field absent or null)."""
    return default if value is None else value
