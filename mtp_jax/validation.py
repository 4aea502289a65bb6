"""The type predicates every argument check in mtp_jax uses: one meaning of "an int" and "a number".

A bool is neither (Python's `True` is an int, a user's `True` is not a count); NumPy scalars are
both where their kind says so. Each check that raises composes these with its own message, which
names the argument.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np


def is_int(value: Any) -> bool:
    """A Python or NumPy integer; not a bool, a float or anything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_integer(value: Any) -> bool:
    """`is_int`, or a 0-d integer array (an element of a NumPy or JAX array, `jnp.int32(3)`).

    Token ids, max_new_tokens and max_length all accept exactly these."""
    if isinstance(value, (np.ndarray, jax.Array)):
        return value.ndim == 0 and np.issubdtype(value.dtype, np.integer)
    return is_int(value)


def is_real(value: Any) -> bool:
    """A Python or NumPy int or float; not a bool or anything else."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def is_finite_positive(value: Any) -> bool:
    """A real number in (0, inf): NaN, infinities, 0, negatives and non-numbers are not."""
    return is_real(value) and math.isfinite(value) and value > 0


def check_int(name: str, value: Any, minimum: int) -> int:
    """`value` as a Python int; ValueError naming `name` unless it is an int (not a bool) >= minimum."""
    if not is_int(value) or value < minimum:
        expected = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)
