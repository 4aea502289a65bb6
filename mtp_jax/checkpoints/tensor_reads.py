"""Byte-range reads of tensors in a safetensors file: a slice of a tensor reads the bytes it covers, no more.

`safetensors.safe_open` validates each file and lists its tensors (`reading.open_weights`); this module
reads the data. It parses the same header (8 bytes little-endian header size N, N bytes of JSON: name ->
{dtype, shape, data_offsets}, then the data, row-major) and reads with `os.preadv` straight into the
result's buffer, for two reasons: safetensors' NumPy backend cannot return float8 tensors
(DeepSeek-V3's F8_E4M3 weights: it looks for a `numpy.float8_e4m3fn` that NumPy lacks; `ml_dtypes`
has it), and a device's shard of a tensor is a few row ranges of the file, so reading exactly those keeps
a process's host memory and I/O at what its own devices hold (no file-backed pages of a memory map
counted against it). Every read goes through `read_into`, the one place that touches the file data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from mtp_jax.checkpoints.format import CheckpointError

# safetensors dtype names -> NumPy dtypes (ml_dtypes for bfloat16 and float8).
DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what an unquantized parameter may be stored as


def read_into(fd: int, buffer: memoryview, offset: int) -> None:
    """Fills `buffer` with the file's bytes from `offset` on (`os.preadv`, repeated after a short read).

    Raises CheckpointError when the file ends first."""
    done = 0
    while done < len(buffer):
        count = os.preadv(fd, [buffer[done:]], offset + done)
        if count == 0:
            raise CheckpointError(f"file descriptor {fd}: unexpected end of file at byte {offset + done}")
        done += count


class TensorFile:
    """One open safetensors file: its tensors' dtypes, shapes and data offsets, and `read` of any slice.

    Args:
      path: the file.
      shown: the file as error messages name it.

    Raises CheckpointError naming `shown` for a header that is not safetensors (too short, not JSON,
    offsets outside the file or not matching dtype x shape); `safe_open` refuses the same files first.
    """

    def __init__(self, path: Path, shown: Path):
        self.shown = shown
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.entries = self._header()
        except BaseException:
            os.close(self.fd)
            raise

    def _header(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """name -> (dtype name, shape, absolute byte offset of its data)."""
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError(f"{self.shown} is not a valid safetensors file: shorter than its header size")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise CheckpointError(f"{self.shown} is not a valid safetensors file: its header runs past the file")
        try:
            header = json.loads(os.pread(self.fd, length, 8))
        except ValueError as error:
            raise CheckpointError(f"{self.shown} is not a valid safetensors file: {error}") from error
        entries = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            expected = math.prod(shape) * DTYPES[dtype].itemsize if dtype in DTYPES else end - begin
            if end - begin != expected or 8 + length + end > size:
                raise CheckpointError(f"{self.shown} is not a valid safetensors file: {name}'s data is out of place")
            entries[name] = (dtype, shape, 8 + length + begin)
        return entries

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """`tensor[index]` of the tensor `name` (`index`: slices with step 1, one per leading dimension;
        missing ones take the whole dimension), reading only the bytes it covers: one read per run of
        contiguous bytes (the whole slice when only the first sliced dimension is partial, else one per
        row of the last partial dimension's enclosing dimensions).

        Raises CheckpointError for a dtype this module cannot represent (`DTYPES`)."""
        dtype_name, shape, offset = self.entries[name]
        if dtype_name not in DTYPES:
            raise CheckpointError(f"{name} in {self.shown} has dtype {dtype_name}, which mtp_jax cannot read")
        dtype = DTYPES[dtype_name]
        bounds = [(s.indices(n)[0], max(s.indices(n)[0], s.indices(n)[1])) for s, n in zip(index, shape, strict=False)]
        bounds += [(0, n) for n in shape[len(bounds) :]]
        out_shape = tuple(stop - start for start, stop in bounds)
        out = np.empty(out_shape, dtype)
        if out.size == 0:
            return out
        # dims after `cut` are whole: each index into dims [0, cut) is one contiguous run of bytes.
        cut = max([i for i, (start, stop) in enumerate(bounds) if (start, stop) != (0, shape[i])], default=0)
        strides = [math.prod(shape[i + 1 :]) * dtype.itemsize for i in range(len(shape))]
        run = out_shape[cut] * strides[cut] if shape else dtype.itemsize
        flat = out.reshape(-1, run // dtype.itemsize) if shape else out.reshape(1, 1)
        starts = np.indices(out_shape[:cut]).reshape(cut, -1).T if cut else np.zeros((1, 0), int)
        first = offset + sum(start * stride for (start, _), stride in zip(bounds, strides, strict=True))
        for row, lead in zip(flat, starts, strict=True):
            position = first + int(np.dot(lead, strides[:cut]))
            try:
                read_into(self.fd, memoryview(row.view(np.uint8)), position)
            except CheckpointError as error:  # the file shrank since its header was read
                raise CheckpointError(f"{name} in {self.shown}: {error}") from error
        return out

    def close(self) -> None:
        os.close(self.fd)
