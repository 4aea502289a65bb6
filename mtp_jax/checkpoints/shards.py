"""One device's shard of a parameter, read from the HF tensors it stands for: shard-streamed loading.

`reading.load_hf_checkpoint(..., mesh=)` builds every parameter as a global `jax.Array` on its sharding
(`mtp_jax.sharding`): for each of the process's devices (`Sharding.addressable_devices_indices_map`) it
reads that device's index of the parameter straight from the files (`ShardReader.read`), puts it on the
device and drops the host copy, so a tensor is never whole on the host or on one device unless a device
holds it whole. Devices with the same index (replicas) share one read.

A parameter index maps to the files through `names` (`hf_names`, `piece_widths`, `fuse`): its leading
`tensor_axes` (a stacked layer group's layers, a MoE's routed experts) pick tensor sets, and its last axis,
the output axis of a fused projection, is a fixed permutation of its pieces' output columns
(`fuse` applied to column numbers: `_column_map`), so a contiguous shard of it is a few column runs of
each piece, read as rows of the HF [out, in] tensor (columns of a 1-D/untransposed one). An FP8 scale
(`*_scale_inv` [..., ceil(in/b_in), sum_p ceil(out_p/b_out)]) holds its pieces' block columns side by side,
each one row of its piece's HF `weight_scale_inv` [ceil(out_p/b_out), ceil(in/b_in)].

Every block read is checked while streaming (`_checked`): finite (NaN or inf anywhere is refused, naming
the tensor and its file: e.g. DeepSeek's `e_score_correction_bias`), and finite again after the cast to the
parameter's dtype (a float32 file loaded as float16 that overflows is refused likewise).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from mtp_jax.checkpoints.format import CheckpointError
from mtp_jax.checkpoints.names import fuse, hf_names, is_scale, piece_widths, tensor_axes
from mtp_jax.checkpoints.tensor_reads import TensorFile
from mtp_jax.config import ModelConfig
from mtp_jax.quantization import FP8_MAX


class ShardReader:
    """Reads any index of any parameter of `config`'s model from the open files.

    Args:
      files: file name -> its open `TensorFile`.
      where: HF tensor name -> the file name holding it.
      layout: `names.tensor_layout` of the model's parameters (HF name -> (path, transposed, HF shape, dtype)).
      config: the model's config (fused widths, FP8 block sizes).
      dequantize: FP8 weights the model holds dequantized (`load_hf_checkpoint(..., dequantize=True)`):
        HF weight name -> its `weight_scale_inv`'s name; read as `float32(weight) * scale` of its block.
      block: the files' FP8 block (b_out, b_in) for `dequantize`.
    """

    def __init__(
        self,
        files: dict[str, TensorFile],
        where: dict[str, str],
        layout: dict,
        config: ModelConfig,
        dequantize: dict[str, str] | None = None,
        block: tuple[int, int] | None = None,
    ):
        self.files, self.where, self.layout, self.config = files, where, layout, config
        self.dequantize, self.block = dequantize or {}, block

    def read(self, path: tuple, shape: tuple[int, ...], dtype, index: tuple[slice, ...]) -> np.ndarray:
        """`param[index]` for the parameter at `path` (global `shape`, `dtype`), as a NumPy array in `dtype`.

        Raises CheckpointError naming the tensor and its file when a value read is NaN or infinite,
        or overflows `dtype`."""
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
        axes = tensor_axes(path)
        names = [name for name, _ in hf_names(path, self.config)]
        per_slice = len(names) // math.prod(shape[:axes])
        out = np.empty(tuple(len(r) for r in ranges), dtype)
        for position in np.ndindex(*out.shape[:axes]):
            lead = tuple(r[p] for r, p in zip(ranges, position, strict=False))
            first = int(np.ravel_multi_index(lead, shape[:axes])) * per_slice if axes else 0
            pieces = names[first : first + per_slice]
            out[position] = self._slice(path, pieces, shape[axes:], ranges[axes:], dtype)
            if is_scale(path) and np.dtype(self.config.compute_dtype) == np.float16 and out[position].size:
                _check_float16_dequantization(out[position], pieces, self.files, self.where)
        return out

    def _slice(self, path: tuple, pieces: list[str], shape: tuple[int, ...], ranges: list[range], dtype) -> np.ndarray:
        """One tensor set's part `ranges` (per axis of the slice `shape`: [..., out]) in `dtype`."""
        columns = _column_map(path, shape[-1], self.config)[ranges[-1].start : ranges[-1].stop]
        offsets = np.cumsum([0, *piece_widths(path, shape[-1], self.config)])
        piece_of = np.searchsorted(offsets, columns, side="right") - 1
        out = np.empty(tuple(len(r) for r in ranges), dtype)
        lead = tuple(slice(r.start, r.stop) for r in ranges[:-1])
        for k, name in enumerate(pieces):
            mask = piece_of == k
            if mask.any():
                out[..., _as_slice(mask)] = self._piece(name, columns[mask] - offsets[k], lead, dtype)
        return out

    def _piece(self, name: str, columns: np.ndarray, lead: tuple[slice, ...], dtype) -> np.ndarray:
        """Columns `columns` (of our [..., out] layout) of the HF tensor `name`, other axes `lead`."""
        _, transposed, _, _ = self.layout[name]
        low, high = int(columns.min()), int(columns.max()) + 1
        file = self.files[self.where[name]]
        contiguous = high - low == len(columns) and bool((np.diff(columns) == 1).all())
        pick = slice(None) if contiguous else columns - low  # a view, not a gathered copy, when it can
        if transposed:  # HF [out, in]: our columns are its rows
            block = file.read(name, (slice(low, high), *lead))[pick]
            if name in self.dequantize:
                block = self._dequantized(block, self.dequantize[name], columns, lead[0] if lead else slice(None))
            block = block.T
        else:
            block = file.read(name, (*lead, slice(low, high)))[..., pick]
        return _checked(block, dtype, name, file)

    def _dequantized(self, weight: np.ndarray, scale_name: str, rows: np.ndarray, inputs: slice) -> np.ndarray:
        """FP8 `weight` [len(rows), in'] (HF rows `rows`, input columns `inputs`) times its block scales, float32."""
        (b_out, b_in), first = self.block, inputs.start or 0
        scale_file = self.files[self.where[scale_name]]
        blocks = rows // b_out
        columns = np.arange(first, first + weight.shape[1]) // b_in
        scale = scale_file.read(
            scale_name, (slice(int(blocks.min()), int(blocks.max()) + 1), slice(int(columns[0]), int(columns[-1]) + 1))
        )
        if not np.isfinite(scale).all():
            raise CheckpointError(
                f"{scale_name} in {scale_file.shown} holds NaN or infinite values; refusing to load it",
                mismatched=[scale_name],
            )
        scale = scale[blocks - blocks.min()][:, columns - columns[0]]  # [len(rows), in']
        weight = weight.astype(np.float32)
        with np.errstate(over="ignore"):
            product = weight * scale
        if np.isfinite(weight).all() and not np.isfinite(product).all():
            raise CheckpointError(
                f"{scale_name} in {scale_file.shown}: its scales overflow float32 when they dequantize the weight",
                mismatched=[scale_name],
            )
        return product


def _check_float16_dequantization(scales: np.ndarray, names: list[str], files: dict, where: dict) -> None:
    """Refuses FP8 block scales whose dequantized weights can leave float16's range (an FP8 model computing in
    float16): a block's largest weight is at most `FP8_MAX` times its scale (exactly that for DeepSeek-V3's
    quantization, which maps each block's largest magnitude to `FP8_MAX`)."""
    peak = float(np.abs(scales).max()) * FP8_MAX
    if peak > float(np.finfo(np.float16).max):
        shown = ", ".join(f"{name} in {files[where[name]].shown}" for name in names)
        raise CheckpointError(
            f"{shown}: the FP8 weights these scales dequantize reach {peak:.4g}, beyond float16's range; "
            "load with dtype bfloat16 or float32",
            mismatched=names,
        )


def _as_slice(mask: np.ndarray) -> slice | np.ndarray:
    """The positions `mask` selects as a slice when they are evenly spaced (a piece's columns in a fused
    parameter's shard always are: a run, or every other column for `gate_up_proj`), so that numpy assigns
    through a strided view instead of a boolean-index scatter; else `mask` itself."""
    positions = np.flatnonzero(mask)
    step = int(positions[1] - positions[0]) if len(positions) > 1 else 1
    if (np.diff(positions) == step).all():
        return slice(int(positions[0]), int(positions[-1]) + 1, step)
    return mask


@functools.lru_cache(maxsize=64)
def _column_map_cached(path: tuple, width: int, config: ModelConfig) -> np.ndarray:
    widths = piece_widths(path, width, config)
    if len(widths) == 1:
        return np.arange(width)
    starts = np.cumsum([0, *widths[:-1]])
    return np.asarray(fuse(path, [np.arange(w) + s for w, s in zip(widths, starts, strict=True)], config))


def _column_map(path: tuple, width: int, config: ModelConfig) -> np.ndarray:
    """For each column of one slice of the parameter at `path` (last axis `width`), its column in the
    pieces laid side by side (piece k's columns offset by the widths before it): `fuse` of column numbers."""
    return _column_map_cached(tuple(str(p) for p in path), width, config)


def _checked(block: np.ndarray, dtype, name: str, file: TensorFile) -> np.ndarray:
    """`block` cast to `dtype`; CheckpointError naming `name` and its file for NaN/inf values or an overflowing cast."""
    if not np.isfinite(block).all():
        bad = "NaN" if np.isnan(block).any() else "infinite"
        raise CheckpointError(f"{name} in {file.shown} holds {bad} values; refusing to load it", mismatched=[name])
    with np.errstate(over="ignore"):  # an overflow is reported below, by name
        cast = block.astype(dtype)
    if not np.isfinite(cast).all():
        peak = float(np.abs(block.astype(np.float64)).max())
        raise CheckpointError(
            f"{name} in {file.shown} does not fit {np.dtype(dtype).name}: a value of magnitude {peak:.4g} "
            "overflows it; load it in a wider dtype",
            mismatched=[name],
        )
    return cast
