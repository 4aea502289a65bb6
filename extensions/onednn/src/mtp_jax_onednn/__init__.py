"""oneDNN's matmul over pre-packed weights as XLA FFI CPU handlers, for `mtp_jax.layers.onednn`.

The compiled library holds eight handlers: in `src/onednn_matmul.cc`, `MtpOnednnPack` (a weight
[K, N] -> its packed bytes), `MtpOnednnMatmul` (x [M, K], packed -> y [M, N]), `MtpOnednnMatmulSwiglu`
(the same for an interleaved gate_up weight, then SwiGLU -> y [M, N / 2] and the matmul's [M, N]) and
`MtpOnednnGroupedMatmul` (x [M, K], R packed weights, group sizes [R] -> y [M, N], as
`jax.lax.ragged_dot`); in `src/onednn_attention.cc`, `MtpOnednnAttention` (q [B, T, H, D], the caches
[B, S, G, D] and [B, S, G, Dv], lengths [B] -> [B, T, H, Dv] in q's dtype: the decode step's masked
attention, a few query rows per KV head in `src/attention_loops.cc`'s loops); bf16 or float32. In
`src/cache_write.cc`, `MtpWriteRows` (cache [R, ...], index [U], rows [U, ...] -> the cache with those rows
written in place, any dtype; no oneDNN) and `MtpGatherRows` (source [N, ...], index [U] -> [U, ...], rows
outside zero); in `src/vocab.cc`, `MtpVocabStats` (logits [N, V] -> each row's argmax, and its max and
log-sum-exp; no oneDNN).
This module only loads it; `mtp_jax` registers the targets and decides where to use them, if `ABI` is the
one it calls.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_DTYPE_CODES = {"float32": 0, "bfloat16": 1}


def _load() -> ctypes.CDLL:
    for lib in Path(sys.prefix, "lib").glob("libdnnl.so.3*"):  # onednn-cpu-gomp's library, found before ours
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        break
    found = sorted(_HERE.glob("lib_onednn_matmul*.so"))
    if not found:
        raise ImportError(f"mtp_jax_onednn: no compiled library in {_HERE}")
    lib = ctypes.CDLL(str(found[0]))
    lib.mtp_onednn_packed_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.mtp_onednn_packed_bytes.restype = ctypes.c_int64
    lib.mtp_onednn_impl.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.mtp_onednn_impl.restype = ctypes.c_int
    return lib


ABI = 2  # raised whenever a handler's operands change (2: MtpOnednnAttention's q and result [B, T, H, *])
LIB = _load()
PACK, MATMUL, GROUPED = LIB.MtpOnednnPack, LIB.MtpOnednnMatmul, LIB.MtpOnednnGroupedMatmul  # FFI handlers
MATMUL_SWIGLU = LIB.MtpOnednnMatmulSwiglu
ATTENTION, WRITE_ROWS, GATHER_ROWS = LIB.MtpOnednnAttention, LIB.MtpWriteRows, LIB.MtpGatherRows
VOCAB_STATS = LIB.MtpVocabStats


def packed_bytes(fan_in: int, fan_out: int, dtype: str) -> int:
    """Size in bytes of a [fan_in, fan_out] weight of `dtype` ("float32" or "bfloat16") once packed."""
    size = LIB.mtp_onednn_packed_bytes(fan_in, fan_out, _DTYPE_CODES[dtype])
    if size < 0:
        raise ValueError(f"oneDNN has no packed matmul layout for [{fan_in}, {fan_out}] {dtype}")
    return int(size)


def implementation(rows: int, fan_in: int, fan_out: int, dtype: str) -> str:
    """The name of the oneDNN implementation a [rows, fan_in] x packed [fan_in, fan_out] matmul runs
    ("brg:avx512_core_bf16", ...; "ref:any" is oneDNN's slow reference code). ValueError if none."""
    buf = ctypes.create_string_buffer(256)
    if LIB.mtp_onednn_impl(rows, fan_in, fan_out, _DTYPE_CODES[dtype], buf, len(buf)):
        raise ValueError(
            f"oneDNN has no matmul for [{rows}, {fan_in}] x packed [{fan_in}, {fan_out}] {dtype}: {buf.value.decode()}"
        )
    return buf.value.decode()
