"""The output layout of a fused projection: the columns of several HF modules held by one kernel.

A fused projection computes several HF modules that read the same input as one matmul, their output
columns in one axis (`FusedLayout`): each piece's w_p columns split into `groups` equal contiguous runs,
and the fused axis is, group by group, the pieces' runs in order ([..., groups, sum_p w_p / groups]
flattened). Every projection of the models is one such layout:

  - `qkv_layout(H, G, D)`: q [H D], k, v [G D] in G groups: KV head g's H/G query heads, then k_g, v_g
    (`mtp_jax.layers.attention.Attention.qkv_proj`, group-major; with Qwen3.5's output gate q is [H 2D]);
  - `gate_up_layout(I)`: gate, up [I] in I groups: column 2i is gate_i, 2i + 1 up_i (`ffn.MLP`,
    `moe.Experts`, interleaved);
  - `FusedLayout((w_0, w_1))`: side by side (MLA's `fused_qkv_a_proj`: q_a_proj, then kv_a_proj_with_mqa);
  - `FusedLayout((w,))`: an unfused linear.

A contiguous shard of whole groups holds whole heads (GQA groups) or whole (gate, up) pairs, which is what
tensor parallelism splits (`mtp_jax.sharding`). `mtp_jax.checkpoints.names` joins and splits the checkpoint's
tensors with it (`fuse`, `unfuse`), and `mtp_jax.layers.fp8` finds each column's FP8 block scale with it
(`block_columns`): one implementation of each layout for both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


@dataclasses.dataclass(frozen=True)
class FusedLayout:
    """The pieces' output widths (in order) and the number of runs each is split into (hashable: a static
    attribute of the layers). Raises ValueError when a width is not a multiple of `groups` or is < 1."""

    widths: tuple[int, ...]
    groups: int = 1

    def __post_init__(self):
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        if not self.widths or self.groups < 1 or any(w < 1 or w % self.groups for w in self.widths):
            raise ValueError(f"widths {self.widths} must be >= 1 and multiples of groups={self.groups}")

    @property
    def width(self) -> int:
        """The fused axis' size, sum_p w_p."""
        return sum(self.widths)

    def fuse(self, pieces: Sequence[np.ndarray]) -> np.ndarray:
        """The fused [..., sum_p w_p] of the pieces [..., w_p] (NumPy; reshapes and a concatenation: bit-exact)."""
        lead = np.shape(pieces[0])[:-1]
        runs = [np.asarray(p).reshape(*lead, self.groups, -1) for p in pieces]  # [..., groups, w_p / groups] each
        return np.concatenate(runs, axis=-1).reshape(*lead, -1)  # [..., groups, sum runs] -> [..., sum w_p]

    def unfuse(self, array: np.ndarray) -> list[np.ndarray]:
        """`fuse`'s inverse: the pieces [..., w_p] of a fused `array` [..., sum_p w_p] (NumPy, bit-exact)."""
        array = np.asarray(array)
        lead = array.shape[:-1]
        grouped = array.reshape(*lead, self.groups, -1)  # [..., groups, sum_p w_p / groups]
        bounds = np.cumsum([w // self.groups for w in self.widths])[:-1]
        return [run.reshape(*lead, -1) for run in np.split(grouped, bounds, axis=-1)]  # [..., w_p] each

    def blocks(self, b: int) -> FusedLayout:
        """The layout of the pieces' blocks of `b` columns laid side by side (a block-scaled FP8 kernel's
        scale columns, `mtp_jax.layers.fp8`): widths ceil(w_p / b), one group."""
        return FusedLayout(tuple(_blocks(w, b) for w in self.widths))


@functools.lru_cache(maxsize=256)
def block_columns(layout: FusedLayout, b: int) -> np.ndarray:
    """For each fused column c, the index of its block in `layout.blocks(b)`: int32 [sum_p w_p], piece p's
    column j -> (blocks of the pieces before p) + j // b. `layout.fuse` of the pieces' block indices, so the
    same layout the checkpoint's tensors are joined by. Read-only (cached)."""
    offsets = np.cumsum([0, *layout.blocks(b).widths[:-1]])
    columns = layout.fuse([np.arange(w) // b + o for w, o in zip(layout.widths, offsets, strict=True)])
    columns = columns.astype(np.int32)
    columns.flags.writeable = False
    return columns


def qkv_layout(heads: int, kv_heads: int, head_dim: int, *, gated: bool = False) -> FusedLayout:
    """Grouped-query attention's q [H D], k [G D], v [G D], group-major: G groups of H/G query heads, k_g, v_g.

    `gated` (Qwen3.5's gated attention): q_proj is [H 2D], each head's query then its output gate, so each
    group holds H/G heads of 2D entries, then k_g, v_g."""
    q_width = heads * head_dim * (2 if gated else 1)
    return FusedLayout((q_width, kv_heads * head_dim, kv_heads * head_dim), groups=kv_heads)


def gate_up_layout(intermediate: int) -> FusedLayout:
    """SwiGLU's gate [I] and up [I], interleaved: column 2i is gate_i, column 2i + 1 up_i."""
    return FusedLayout((intermediate, intermediate), groups=intermediate)
