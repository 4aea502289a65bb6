"""One device's shard of a parameter, read from the HF tensors it stands for: shard-streamed loading.

`reading.load_hf_checkpoint(..., mesh=)` builds every parameter as a global `jax.Array` on its sharding
(`param_sharding`, `mtp_jax.sharding`'s rules): for each of the process's devices
(`Sharding.addressable_devices_indices_map`) `build_param` reads that device's index of the parameter
straight from the files (`ShardReader.read`), puts it on the device and drops the host copy, so a tensor is
never whole on the host or on one device unless a device holds it whole. Devices with the same index
(replicas) share one read. Around it: `check_device_memory` (before any read), `check_copies` (stored copies
of shared tensors, row block by row block) and `agree_on` (under `jax.distributed`, every process raises
the first failing process's error).

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.checkpoints.format import CheckpointError
from mtp_jax.checkpoints.names import fuse, hf_names, is_scale, piece_widths, tensor_axes
from mtp_jax.checkpoints.tensor_reads import TensorFile
from mtp_jax.config import ModelConfig
from mtp_jax.quantization import FP8_MAX
from mtp_jax.sharding import resolve


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


def agree_on(error: CheckpointError | None) -> None:
    """Raises `error`, or, under `jax.distributed`, the first failing process's error in every process.

    Each process checks only the values it reads (its own devices' shards, its share of a copy's rows), so a
    NaN in one process's shard would otherwise leave the others returning a model and waiting at their first
    collective for ever. Every process reaches this point once per load (one gather of a flag, then one
    broadcast of the failing process's message)."""
    if jax.process_count() == 1:
        if error is not None:
            raise error
        return
    from jax.experimental import multihost_utils

    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1)
    if not failed.any():
        return
    source = int(np.flatnonzero(failed)[0])
    text = np.zeros(2048, np.uint8)
    if jax.process_index() == source:
        encoded = str(error).encode()[: len(text)]
        text[: len(encoded)] = np.frombuffer(encoded, np.uint8)
    message = bytes(multihost_utils.broadcast_one_to_all(text, is_source=jax.process_index() == source))
    message = message.rstrip(b"\0").decode(errors="replace")
    if error is not None:
        raise error
    raise CheckpointError(f"process {source} refused the checkpoint: {message}")


def param_sharding(variable: nnx.Variable, mesh: Mesh | None) -> NamedSharding | None:
    """The parameter's `NamedSharding` on `mesh` by its logical axes (`sharding.shard_params`'), None without a mesh."""
    if mesh is None:
        return None
    logical = P(*variable.get_metadata().get("logical_axes", ()))
    return NamedSharding(mesh, resolve(logical, variable.get_value().shape, mesh))


def build_param(reader: ShardReader, path: tuple, abstract: jax.ShapeDtypeStruct, sharding) -> jax.Array:
    """The parameter at `path` as a `jax.Array` on `sharding` (None: the default device), one device's
    shard read at a time (devices holding the same index share one read). A stacked layer group's
    parameter [n, ...] (`ModelConfig.scan_layers`) is built a layer at a time (`_stacked`), so the host holds
    one layer's shard, not the group's."""
    shape, dtype = tuple(abstract.shape), abstract.dtype
    if str(path[0]) == "layer_groups" and shape[0] > 1:
        return _stacked(reader, path, shape, dtype, sharding)
    return _placed(reader, path, shape, dtype, sharding, lambda index: index)


def _placed(reader: ShardReader, path: tuple, shape: tuple, dtype, sharding, to_param, read_shape=None) -> jax.Array:
    """An array of `shape` on `sharding` (None: the default device) whose shard at each device's index is
    `reader.read(path, read_shape, dtype, to_param(index))` (reshaped to the shard's shape)."""
    read_shape = shape if read_shape is None else read_shape
    if sharding is None:
        full = tuple(slice(0, n) for n in shape)
        return jax.device_put(reader.read(path, read_shape, dtype, to_param(full)).reshape(shape))
    groups: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        groups.setdefault(key, []).append(device)
    arrays = []
    for key, devices in groups.items():
        index = tuple(slice(start, stop) for start, stop, _ in key)
        host = reader.read(path, read_shape, dtype, to_param(index))
        host = host.reshape(tuple(stop - start for start, stop, _ in key))
        arrays += [jax.device_put(host, device) for device in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def _stacked(reader: ShardReader, path: tuple, shape: tuple, dtype, sharding) -> jax.Array:
    """A stacked parameter [n, ...] written layer by layer into a zero array already on its devices (an
    in-place, donated update: the devices hold the parameter and one layer, the host one layer's shard)."""
    if sharding is None:
        layer_sharding, stacked = None, jnp.zeros(shape, dtype)
    else:
        layer_sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
        stacked = _zeros(shape, jnp.dtype(dtype), sharding)()
    for i in range(shape[0]):
        layer = _placed(
            reader, path, shape[1:], dtype, layer_sharding, lambda index, i=i: (slice(i, i + 1), *index), shape
        )
        stacked = _put_layer(stacked, layer, i)
    return stacked if sharding is None else jax.device_put(stacked, sharding)


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(stacked, layer, i, 0)


def check_device_memory(flat_params, shardings) -> None:
    """Refuses (ValueError) weights whose per-device share exceeds the free memory the devices report."""
    need: dict = {}
    for (_, variable), sharding in zip(flat_params, shardings, strict=True):
        value = variable.get_value()
        if sharding is None:
            devices, shard = [jax.devices()[0]], value.shape
        else:
            devices, shard = sharding.addressable_devices, sharding.shard_shape(value.shape)
        for device in devices:
            need[device] = need.get(device, 0) + int(np.prod(shard)) * value.dtype.itemsize
    for device, needed in need.items():
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            continue  # the CPU reports nothing: host memory is the operating system's to manage
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if needed > free:
            raise ValueError(
                f"the weights need {needed / 1e9:.2f} GB on {device}, which has {free / 1e9:.2f} GB free; "
                "use a larger mesh (`mtp-jax plan` finds the smallest that fits)"
            )


def check_copies(files: dict[str, TensorFile], where: dict[str, str], copies: dict[str, str], layout) -> None:
    """Refuses a stored copy of a shared tensor (`shared_copies`) that differs from it in the loaded dtype,
    compared a block of rows at a time (under `jax.distributed` each process compares its share of rows)."""
    for name, source in copies.items():
        dtype = layout[source][3]
        copy_file, source_file = files[where[name]], files[where[source]]
        _, shape, _ = copy_file.entries[name]
        rows = shape[0] if shape else 1
        step = max(1, (1 << 24) // max(1, int(np.prod(shape[1:])) * 4))
        share = -(-rows // jax.process_count())
        first = jax.process_index() * share
        for start in range(first, min(rows, first + share), step):
            index = (slice(start, min(rows, first + share, start + step)),) if shape else ()
            a = copy_file.read(name, index).astype(dtype)
            b = source_file.read(source, index).astype(dtype)
            if not np.array_equal(a, b):
                raise CheckpointError(
                    f"{name} in {copy_file.shown} must be a copy of the shared {source} but differs",
                    unexpected=[name],
                )
