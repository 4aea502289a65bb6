"""Structured output, device side: applying per-position token bitmasks to logits (pure jnp, jit-able).

The host (`mtp_jax.serving.grammar`, not imported here) fills one int32 bitmask per verify position and row;
this module only reads them. Layout (xgrammar's and llguidance's): int32 [..., W], W = ceil(V / 32); bit i of
word w (`(mask[w] >> i) & 1`) set means token 32*w + i is allowed; bits past V in the last word are ignored.
A row without a grammar passes an all-ones mask (every word -1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def bitmask_width(vocab_size: int) -> int:
    """W = ceil(vocab_size / 32): the int32 words of one token bitmask."""
    return (int(vocab_size) + 31) // 32


def unpack_token_bitmask(bitmask: Int[Array, "... W"], vocab_size: int) -> jax.Array:
    """bool [..., vocab_size]: True where the bitmask allows the token.

    Shifts each word by 0..31 and keeps the low bit (an arithmetic shift on int32 keeps bit i at position 0,
    so negative words need no cast), then trims the 32*W columns to vocab_size. Raises ValueError (at trace
    time) if W != ceil(vocab_size / 32).
    """
    if bitmask.shape[-1] != bitmask_width(vocab_size):
        raise ValueError(
            f"bitmask has {bitmask.shape[-1]} words per row; vocab_size {vocab_size} needs {bitmask_width(vocab_size)}"
        )
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask.astype(jnp.int32)[..., :, None] >> shifts) & 1  # [..., W, 32]
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].astype(bool)


def apply_token_bitmask(logits: Float[Array, "B T V"], bitmask: Int[Array, "B T W"]) -> Float[Array, "B T V"]:
    """Returns `logits` with -inf wherever `bitmask` disallows the token (same shape and dtype).

    logits: float [..., V] (typically [B, T, V]: B rows, T = K+1 verify positions); V need not be a multiple
    of 32. bitmask: int32 [..., W] with the same leading shape, W = ceil(V / 32). Raises ValueError (at trace
    time) on mismatched leading shapes or W. A position whose mask allows nothing gets all -inf (NaN after a
    softmax): the host never produces one, its stop tokens being allowed once a grammar is finished.
    """
    if bitmask.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"bitmask shape {bitmask.shape} does not match logits {logits.shape} before the last axis")
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, dtype=logits.dtype))
