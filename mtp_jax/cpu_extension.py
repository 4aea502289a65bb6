"""The optional CPU extension `mtp_jax_onednn` (`extensions/onednn`): loading it and registering its FFI
targets, the `MTP_JAX_ONEDNN` setting, and the KV cache rows it moves in place.

`mtp_jax.layers.onednn` routes matmuls and attention to its oneDNN handlers. Here are the calls with no
oneDNN in them, which the caches (`mtp_jax.cache`) and the decode step use directly: `write_rows` writes a
bf16 / fp16 / fp8 cache's new rows into its own buffer, where XLA:CPU converts the whole cache to float32 and
back on every scatter or dynamic-update-slice, and `gather_rows` gathers a page pool one memcpy per page, where
XLA:CPU gathers element by element through float32 (`moves_rows` says where; docs/benchmarks.md, 2026-12-07);
`vocab_stats` reads a step's logits over the vocabulary (the argmax, the log-softmax's max and log-sum-exp)
in one pass each, where XLA:CPU's reductions take 0.1-0.5 ms a step (`reads_vocab` says where;
docs/benchmarks.md, 2026-12-08).
"""

from __future__ import annotations

import math
import os
import warnings
from functools import cache

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

ENV = "MTP_JAX_ONEDNN"  # "0"/"off": never; "all": every row count of both dtypes; unset/"1": MIN_ROWS;
# "matmuls": MIN_ROWS, the attention's products left to XLA
_PACK, _MATMUL, _GROUPED = "mtp_onednn_pack", "mtp_onednn_matmul", "mtp_onednn_grouped_matmul"
_MATMUL_SWIGLU = "mtp_onednn_matmul_swiglu"
_ATTENTION, _WRITE_ROWS, _GATHER_ROWS = "mtp_onednn_attention", "mtp_write_rows", "mtp_gather_rows"
_VOCAB_STATS = "mtp_vocab_stats"
ABI = 2  # the handlers' operands this version calls: `mtp_jax_onednn.ABI`


@cache
def _extension():
    """The loaded `mtp_jax_onednn` module with its FFI targets registered, or None when it is not installed,
    its libraries do not load (a missing libdnnl.so.3 / libgomp.so.1 is an OSError), or it was built before a
    handler this version calls or with other operands (`ABI`; a warning says to rebuild it)."""
    targets = {_PACK: "PACK", _MATMUL: "MATMUL", _MATMUL_SWIGLU: "MATMUL_SWIGLU", _GROUPED: "GROUPED"}
    targets |= {_ATTENTION: "ATTENTION"}
    targets |= {_WRITE_ROWS: "WRITE_ROWS", _GATHER_ROWS: "GATHER_ROWS", _VOCAB_STATS: "VOCAB_STATS"}
    try:
        import mtp_jax_onednn as ext

        handlers = {target: getattr(ext, name) for target, name in targets.items()}
        if getattr(ext, "ABI", 1) != ABI:
            raise AttributeError(
                f"its handlers' operands are version {getattr(ext, 'ABI', 1)}, this mtp_jax calls {ABI}"
            )
    except (ImportError, OSError):
        return None
    except AttributeError as missing:  # the package, or its compiled library, older than this mtp_jax
        message = f"mtp_jax_onednn does not match mtp_jax ({missing}): rebuild it (pip install ./extensions/onednn)"
        warnings.warn(message + "; everything runs on XLA until then", RuntimeWarning, stacklevel=2)
        return None
    for target, handler in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return ext


def installed(caller: str):
    """The loaded extension (`_extension`); RuntimeError naming `caller` (a function of
    `mtp_jax.layers.onednn`) when it is not installed or not usable."""
    ext = _extension()
    if ext is None:
        raise RuntimeError(
            f"mtp_jax.layers.onednn.{caller}: the mtp_jax_onednn extension is not installed (or is not usable: "
            "built for another mtp_jax, or its libraries do not load)"
        )
    return ext


def _setting() -> str:
    setting = os.environ.get(ENV, "1").strip().lower()
    if setting not in ("0", "off", "1", "on", "", "all", "matmuls"):
        raise ValueError(f"{ENV}={setting!r}: expected 0/off, 1/on, all or matmuls")
    return setting


def moves_rows(cache: jax.Array) -> bool:
    """Whether writes into `cache` go to `write_rows` here, and a page pool's gather to `gather_rows`: a
    floating dtype of 8 or 16 bits (XLA:CPU scatters those in float32, converting the whole cache both
    ways on every write, and gathers them element by element through float32; it writes float32 and
    integers in place itself), the CPU backend, the extension installed, `MTP_JAX_ONEDNN` not "0"/"off", and
    no context mesh (the call is opaque to GSPMD, which would gather a sharded cache onto every device)."""
    narrow = jnp.issubdtype(cache.dtype, jnp.floating) and jax.dtypes.itemsize_bits(cache.dtype) in (8, 16)
    if not narrow or _setting() in ("0", "off") or jax.default_backend() != "cpu" or _extension() is None:
        return False
    return jax.sharding.get_abstract_mesh().empty


def reads_vocab() -> bool:
    """Whether `vocab_stats` computes a step's reductions over the vocabulary (`mtp_jax.sharding.vocab_argmax`,
    `mtp_jax.decode.acceptance.Target`): the CPU backend, the extension installed, `MTP_JAX_ONEDNN` not
    "0"/"off", and no context mesh (the call is opaque to GSPMD, which would gather vocabulary-sharded logits)."""
    if _setting() in ("0", "off") or jax.default_backend() != "cpu" or _extension() is None:
        return False
    return jax.sharding.get_abstract_mesh().empty


def vocab_stats(processed: jax.Array, raw: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Per row of `processed` [..., V] (cast to float32): the lowest index of its maximum, or of its first NaN
    (NaN ranks above every number), int32 [...]: `mtp_jax.sharding.vocab_argmax`'s exactly. With `raw`
    [..., V] (float32 or bfloat16; another float dtype is cast to float32), also raw's max (NaN if it holds
    one; of +0 and -0 the first) and log(sum(exp(raw - max))), float32 [..., 1] each: `jax.nn.log_softmax(raw)`
    is (raw - max) - log_sum, with the same special values (all -inf or a +inf: NaN), the sum in another
    order and the exponential to within its last bit. Through the `mtp_vocab_stats` FFI call, rows spread over the cores
    from 64 Ki logits; no gradient (the inputs are `stop_gradient`ed). ValueError when raw's shape is not
    processed's; RuntimeError without the extension."""
    installed("vocab_stats")
    if raw is not None and raw.shape != processed.shape:
        raise ValueError(f"vocab_stats: raw {list(raw.shape)} must have processed's shape {list(processed.shape)}")
    processed = jax.lax.stop_gradient(processed).astype(jnp.float32)
    operand = processed if raw is None else jax.lax.stop_gradient(raw)
    if operand.dtype not in (jnp.float32, jnp.bfloat16):
        operand = operand.astype(jnp.float32)
    rows = processed.shape[:-1]
    out = (
        jax.ShapeDtypeStruct(rows, jnp.int32),
        jax.ShapeDtypeStruct(rows, jnp.float32),
        jax.ShapeDtypeStruct(rows, jnp.float32),
    )
    call = jax.ffi.ffi_call(_VOCAB_STATS, out, vmap_method="broadcast_all")
    argmax, peak, log_sum = call(processed, operand, log_sum=raw is not None)
    return (argmax,) if raw is None else (argmax, peak[..., None], log_sum[..., None])


def _check_whole_bytes(name: str, dtype) -> None:
    if jax.dtypes.itemsize_bits(dtype) % 8:  # XLA packs them; the handlers count one byte per element
        raise ValueError(f"{name}: dtype {jnp.dtype(dtype).name} packs several elements to a byte; not supported")


def write_rows(cache: jax.Array, index: Int[Array, " U"], rows: jax.Array) -> jax.Array:
    """`cache` [..., *row] with row `index[u]` set to `rows[u]` ([U, *row], cast to cache's dtype), in place:
    the cache seen as R rows of shape `row` (its leading axes flattened, row-major), as
    `cache.reshape(R, *row).at[index].set(rows, mode="drop").reshape(cache.shape)`, in order (a row written
    twice keeps the later one), every index outside [0, R) dropped (a negative one too, which jnp wraps).
    Any dtype of whole bytes. Through the `mtp_write_rows` FFI call, its result aliased to `cache`, which is
    passed in its own shape (XLA copies an operand it reshaped): only the U rows move when `cache` is donated
    or dead after the call. ValueError when rows' trailing shape is not cache's, or for 4-bit and 2-bit
    types (XLA packs several to a byte); RuntimeError without the extension."""
    installed("write_rows")
    _check_whole_bytes("write_rows", cache.dtype)
    row = rows.shape[1:]
    if (
        index.ndim != 1
        or rows.shape[0] != index.shape[0]
        or cache.ndim <= len(row)
        or cache.shape[cache.ndim - len(row) :] != row
    ):
        raise ValueError(
            f"write_rows: expected cache [..., *row], index [U] and rows [U, *row], got cache {list(cache.shape)}, "
            f"index {list(index.shape)}, rows {list(rows.shape)}"
        )
    count = math.prod(cache.shape[: cache.ndim - len(row)])
    return _write_rows(cache, _index32("write_rows", index, count), rows.astype(cache.dtype))


def _index32(name: str, index: jax.Array, count: int) -> jax.Array:
    """`index` as the handlers' int32, an entry outside [0, `count`) of a wider type sent to -1 (dropped, or
    zeros) rather than wrapped into range by the cast; ValueError for a non-integer index."""
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(f"{name}: index must be an integer array, got {index.dtype}")
    info = jnp.iinfo(index.dtype)
    if info.min >= jnp.iinfo(jnp.int32).min and info.max <= jnp.iinfo(jnp.int32).max:
        return index.astype(jnp.int32)
    return jnp.where((index >= 0) & (index < count), index, -1).astype(jnp.int32)


@jax.custom_jvp
def _write_rows(cache: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct(cache.shape, cache.dtype)
    call = jax.ffi.ffi_call(_WRITE_ROWS, out, input_output_aliases={0: 0}, vmap_method="sequential")
    return call(cache, index, rows)


@_write_rows.defjvp
def _write_rows_jvp(primals, tangents):
    """The tangent is the same write of the tangents, as a gather and a select (which `jax.grad` transposes; a
    scatter-set with repeated indices it does not): a model's training forward writes its caches too."""
    cache, index, rows = primals
    cache_dot, _, rows_dot = tangents
    if index.shape[0] == 0:  # nothing written: the tangent passes through (no row to gather from)
        return _write_rows(cache, index, rows), cache_dot
    row = rows.shape[1:]
    flat = cache_dot.reshape(math.prod(cache.shape[: cache.ndim - len(row)]), *row)  # [R, *row]
    index = jnp.where(index < 0, flat.shape[0], index)  # dropped, as the call drops it (jnp would wrap it)
    source = jnp.full(flat.shape[:1], -1, jnp.int32).at[index].max(jnp.arange(index.shape[0]), mode="drop")
    hit = (source >= 0).reshape(-1, *(1,) * (rows.ndim - 1))  # the last u written at each row, -1: none
    written = jnp.where(hit, rows_dot[jnp.maximum(source, 0)], flat)
    return _write_rows(cache, index, rows), written.reshape(cache.shape)


def gather_rows(source: jax.Array, index: Int[Array, " U"]) -> jax.Array:
    """`source` [N, *row] at rows `index` (int [U]) -> [U, *row], zeros for an index outside [0, N): a paged
    cache's `gather_pages` as `gather_rows(pool, block_table.reshape(-1))` (a row: one page). Through the
    `mtp_gather_rows` FFI call (one memcpy per row, every core from 2 MiB). ValueError for a rank-0 source or
    an index not 1-D, or a dtype of less than a byte; RuntimeError without the extension."""
    installed("gather_rows")
    _check_whole_bytes("gather_rows", source.dtype)
    if source.ndim < 1 or index.ndim != 1:
        raise ValueError(
            f"gather_rows: expected source [N, *row] and index [U], got {list(source.shape)}, {list(index.shape)}"
        )
    return _gather_rows(source, _index32("gather_rows", index, source.shape[0]))


@jax.custom_jvp
def _gather_rows(source: jax.Array, index: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((index.shape[0], *source.shape[1:]), source.dtype)
    return jax.ffi.ffi_call(_GATHER_ROWS, out, vmap_method="sequential")(source, index)


@_gather_rows.defjvp
def _gather_rows_jvp(primals, tangents):
    """The same gather of the tangent, by XLA (`jax.grad` transposes it)."""
    source, index = primals
    inside = ((index >= 0) & (index < source.shape[0])).reshape(-1, *(1,) * (source.ndim - 1))
    tangent = jnp.where(inside, tangents[0][jnp.clip(index, 0, source.shape[0] - 1)], 0)
    return _gather_rows(source, index), tangent.astype(tangents[0].dtype)
