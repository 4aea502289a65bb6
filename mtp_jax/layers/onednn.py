"""oneDNN's matmul over pre-packed weights, and its attention over the KV cache, for the CPU decode step
(optional; issue 26).

XLA:CPU computes the decode step's few-row bfloat16 matmuls at 2-5x the time oneDNN's matmul takes once
its weight is reordered ("packed") into the blocked layout oneDNN prefers (`benchmarks/bench_gemm.py`,
`benchmarks/ffi_spike/`). With the optional extension installed (`pip install ./extensions/onednn`:
`mtp_jax_onednn`, a C++ XLA FFI handler built by scikit-build-core against oneDNN 3.2 from the
`onednn-cpu-gomp` wheels), a `DecodeEngine` on the CPU backend packs each `nnx.Linear` kernel once at
construction (`pack_params`); in the engine's copy of the model each of them is a `PackedLinear`, whose
call goes to `PackedDot` (a `jax.ffi.ffi_call` into oneDNN) over the packed kernel from `min_rows` rows and
to `mtp_jax.layers.linear.dot_general` over the original below; a dense `MLP`'s gate_up matmul and its SwiGLU
are one call there (`packed_swiglu`, `matmul_swiglu`: XLA:CPU's elementwise SwiGLU cost more than a small
model's matmul). Without the extension, or with `MTP_JAX_ONEDNN=0`, nothing changes.

Which matmuls (`MIN_ROWS`, measured on 2-core AMD EPYC Zen 4 with AVX512-BF16 and Intel Xeon with AMX,
`benchmarks/bench_onednn.py`): bfloat16 at every row count (a medium step 1.3-1.6x faster on AMD,
2.0-2.2x on Intel); float32 from 8 rows, and from 2 rows for kernels of 16 MiB or more (XLA's
matrix-vector product is faster at one row on small weights; from 8 rows oneDNN is, 1.8x on a medium
step at batch 8 on Intel; at 4 rows only the large weights gain). `MTP_JAX_ONEDNN=all`: every row.
A tied head (`x @ embedding.T`) is routed through a packed copy of the transposed table; the MoE experts'
stacked kernels (`moe.Experts`, a class naming them in `GROUPED`) through `grouped_matmul`, each expert's
kernel packed, at every row count (XLA:CPU's `ragged_dot` multiplies every row by every expert). Not
routed: FP8 layers, MLA's `kv_b_proj` (its kernel is read directly, `compute_kernel`, for the absorbed
per-head einsums), scanned layers' stacked kernels, and every engine on a mesh (sharded kernels).

The attention of a bfloat16 engine's GQA layers (`Attention`, whose class declares `ATTENTION`) goes to
`attention` too: one FFI call per layer (scores, masked softmax and weighted sum; the caches read in their
own layout) where XLA:CPU converts both caches to float32 head-major copies every step; a decode step's few
query rows per KV head run in the extension's own loops, a verify window's more in oneDNN; a paged cache
(serving) is gathered first (`PagedCache.view`). MLA and float32 (no faster) stay on XLA;
`MTP_JAX_ONEDNN=matmuls` keeps every attention there.

Cache writes and a page pool's gather go through the same extension, without oneDNN: `mtp_jax.cpu_extension`
(`write_rows`, `gather_rows`, `moves_rows`, re-exported here), which also loads it.

Numbers: float32 within reduction-order tolerance of XLA's; bfloat16 products exact and summed in
float32 inside oneDNN, rounded once to bfloat16, as `dot_general` computes them.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from mtp_jax.cpu_extension import (  # noqa: F401  (re-exported: the rows the extension moves)
    _ATTENTION,
    _GROUPED,
    _MATMUL,
    _MATMUL_SWIGLU,
    _PACK,
    ENV,
    _extension,
    _setting,
    gather_rows,
    installed,
    moves_rows,
    write_rows,
)

MIN_ROWS = {"bfloat16": 1, "float32": 8}  # the default: a matmul goes to oneDNN from this many rows,
LARGE_BYTES, LARGE_MIN_ROWS = 16 << 20, 2  # and a float32 kernel of 16 MiB or more from 2 rows
PACKED = "packed_kernel"  # the attribute a Linear's packed kernel is swapped in as (`PackedLinear`)
TIED_HEAD = "packed_attend"  # the attribute a tied embedding's packed transpose is swapped in as
GROUPED = "grouped_kernels"  # a module's class attribute: names of its stacked [R, in, out] expert kernels
MIN_ROWS_ATTRIBUTE = "onednn_min_rows"  # static int beside either: rows from which the packed copy is used
ATTENTION = "onednn_attention"  # a module's class attribute (False) that `swapped` sets True: `attends`


@cache
def fast_dtypes() -> tuple[str, ...]:
    """The dtypes for which this CPU has a real oneDNN matmul (not its slow reference code) over one
    packed layout at 1, 16 and 256 rows: none where oneDNN lacks the instructions (bf16 needs AVX-512
    or AVX2-VNNI-2 in oneDNN 3.2), or where the extension is not installed."""
    ext, fast = _extension(), []
    if ext is None:
        return ()
    for dtype in ("float32", "bfloat16"):
        try:
            ext.packed_bytes(96, 80, dtype)
            names = [ext.implementation(rows, 96, 80, dtype) for rows in (1, 16, 256)]
        except ValueError:
            continue
        if not any(name.startswith("ref") for name in names):
            fast.append(dtype)
    return tuple(fast)


def routed_dtypes() -> tuple[str, ...]:
    """The kernel dtypes packed for oneDNN now (their matmuls from `min_rows` rows go there): empty when
    the extension is not installed, the backend is not the CPU, or `MTP_JAX_ONEDNN` is "0"/"off"; only
    dtypes this CPU has a fast oneDNN matmul for; ValueError for another value of `MTP_JAX_ONEDNN`."""
    if _setting() in ("0", "off") or jax.default_backend() != "cpu" or _extension() is None:
        return ()
    return tuple(d for d in ("float32", "bfloat16") if d in fast_dtypes())


def min_rows(dtype: str, nbytes: int) -> int:
    """The row count (the product of a matmul's leading axes) from which the matmul of a packed kernel of
    `dtype` and `nbytes` bytes goes to oneDNN: `MIN_ROWS[dtype]`, or `LARGE_MIN_ROWS` for a float32 kernel
    of `LARGE_BYTES` or more; 1 with `MTP_JAX_ONEDNN=all`. Below it, XLA's dot over the original kernel.
    ValueError for a bad `MTP_JAX_ONEDNN`, KeyError for another dtype."""
    if _setting() == "all":
        return 1
    if dtype == "float32" and nbytes >= LARGE_BYTES:
        return min(LARGE_MIN_ROWS, MIN_ROWS[dtype])
    return MIN_ROWS[dtype]


def pack(kernel: jax.Array) -> jax.Array:
    """`kernel` [fan_in, fan_out] (bfloat16 or float32) in oneDNN's packed layout: a 1-D array of the same
    dtype, to pass to `PackedDot`. Runs the `mtp_onednn_pack` FFI call (a CPU array; jit-able)."""
    ext = installed("pack")
    if kernel.ndim != 2 or kernel.dtype.name not in ("float32", "bfloat16"):
        raise ValueError(
            f"pack: kernel must be [fan_in, fan_out] float32 or bfloat16, got {kernel.dtype}{kernel.shape}"
        )
    size = ext.packed_bytes(*kernel.shape, kernel.dtype.name) // kernel.dtype.itemsize
    return jax.ffi.ffi_call(_PACK, jax.ShapeDtypeStruct((size,), kernel.dtype), vmap_method="sequential")(kernel)


_pack_jit = jax.jit(pack)
_pack_stacked = jax.jit(jax.vmap(pack))  # [R, fan_in, fan_out] -> [R, P]: each expert's kernel packed


def grouped_matmul(lhs: jax.Array, packed: jax.Array, group_sizes: jax.Array, fan_out: int) -> jax.Array:
    """`jax.lax.ragged_dot(lhs, kernels, group_sizes)` over `packed` [R, P] (`pack` of each of R kernels
    [fan_in, fan_out], as `pack_params` stacks them): `lhs` [M, fan_in] (rows grouped by kernel, in
    order), `group_sizes` int32 [R] summing to at most M -> [M, fan_out] in lhs's dtype, rows past the
    groups zero. Only the groups' rows are computed (XLA:CPU's `ragged_dot` multiplies every row by every
    kernel). Through the `mtp_onednn_grouped_matmul` FFI call; a group size out of range fails the call."""
    if lhs.ndim != 2 or packed.ndim != 2 or packed.dtype != lhs.dtype or group_sizes.shape != packed.shape[:1]:
        raise ValueError(
            f"grouped_matmul: expected lhs [M, fan_in], packed [R, P] in lhs's dtype and group_sizes [R], got "
            f"lhs {lhs.dtype}{list(lhs.shape)}, packed {packed.dtype}{list(packed.shape)}, group_sizes "
            f"{list(group_sizes.shape)}"
        )
    out = jax.ShapeDtypeStruct((lhs.shape[0], fan_out), lhs.dtype)
    return jax.ffi.ffi_call(_GROUPED, out, vmap_method="sequential")(lhs, packed, group_sizes.astype(jnp.int32))


def attention(
    q: Float[Array, "B T H D"],
    k: Float[Array, "B S G D"],
    v: Float[Array, "B S G Dv"],
    lengths: Int[Array, " B"],
    *,
    scale: float | None = None,
) -> Float[Array, "B T H Dv"]:
    """`pallas_kernels.verify_attention_reference` in the extension (`mtp_onednn_attention`), the caches read
    where they lie.

    Same arguments, convention and result ([B, T, H, Dv] in q's dtype; a query with nothing to attend, or
    whose visible scores are all -inf, gets zeros; stale cache entries, Inf or NaN included, never reach it);
    q, k and v share one dtype, float32 or bfloat16 (ValueError otherwise); RuntimeError without the
    extension. Each KV head's T x H/G query rows get their scores against the [B, S, G, D] keys where they
    lie (float32 sums, times `scale`), the softmax (the masked weights exactly 0, the others rounded to q's
    dtype) and the weighted sum of the values: the reference's numbers up to the summation order and the
    exponential's last bit. Up to 64 rows per KV head in bf16 on a CPU with AVX512-BF16 (VDPBF16PS: a decode
    or verify step's), else 4 (`MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS` overrides both) in the extension's own
    vectorised loops over each row's valid entries, more in oneDNN's matmuls and softmax (three primitives
    cost more than the arithmetic at a few rows). XLA:CPU would copy both caches
    head-major, in float32 for bf16, on every layer and step, and move the queries and results head-major. The
    call's scratch (B T H (2 S + D + Dv) float32: the scores, the weights, oneDNN's rows) is an XLA buffer; the
    products stop at the longest row's length (rounded up to 64 positions, S / 32 for a longer cache, in
    oneDNN). ValueError when the KV heads do not divide the query heads."""
    batch, num_queries, num_heads, head_dim = q.shape
    cache_len, num_kv_heads, value_dim = k.shape[1], k.shape[2], v.shape[-1]
    installed("attention")
    if not q.dtype == k.dtype == v.dtype or q.dtype.name not in ("float32", "bfloat16"):
        raise ValueError(
            f"attention: q, k and v must share one dtype, float32 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"attention: the KV heads ({num_kv_heads}) must divide the query heads ({num_heads})")
    rows = batch * num_queries * num_heads  # = B x G x (rows per KV head)
    results = (
        jax.ShapeDtypeStruct((batch, num_queries, num_heads, value_dim), q.dtype),
        jax.ShapeDtypeStruct((rows * (2 * cache_len + head_dim + value_dim),), jnp.float32),  # the call's scratch
    )
    out, _ = jax.ffi.ffi_call(_ATTENTION, results, vmap_method="sequential")(
        q, k, v, lengths.astype(jnp.int32), scale=np.float32(head_dim**-0.5 if scale is None else scale)
    )
    return out  # [B, T, H, Dv]


@dataclasses.dataclass(frozen=True)
class PackedDot:
    """An `nnx.Linear.dot_general` whose right operand is `pack(kernel)` for a [fan_in, fan_out] kernel:
    `lhs` [..., fan_in] -> [..., fan_out] in lhs's dtype (then `preferred_element_type` if given), through
    the `mtp_onednn_matmul` FFI call. Leading axes are flattened into rows; under `vmap` the packed
    weight must be unbatched (one weight for every row; the handler refuses a batched one)."""

    fan_in: int
    fan_out: int

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        if dimension_numbers != (((lhs.ndim - 1,), (0,)), ((), ())) or lhs.shape[-1] != self.fan_in:
            raise ValueError(
                f"PackedDot: expected lhs [..., {self.fan_in}] contracted on its last axis, got lhs "
                f"{list(lhs.shape)} with dimension_numbers {dimension_numbers}"
            )
        if rhs.ndim != 1 or rhs.dtype != lhs.dtype:
            raise ValueError(
                f"PackedDot: rhs must be pack(kernel) in lhs's dtype {lhs.dtype}, got {rhs.dtype}{rhs.shape}"
            )
        out = jax.ShapeDtypeStruct((*lhs.shape[:-1], self.fan_out), lhs.dtype)
        y = jax.ffi.ffi_call(_MATMUL, out, vmap_method="expand_dims")(lhs, rhs)
        return y if preferred_element_type is None else y.astype(preferred_element_type)


def matmul_swiglu(lhs: jax.Array, packed: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    """`mtp_jax.layers.ffn.swiglu(lhs @ kernel)` for `packed` = `pack(kernel)` of an interleaved gate_up kernel
    [fan_in, fan_out] (`fan_out` even and positive): `lhs` [..., fan_in] (bfloat16 or float32, `packed`'s dtype)
    -> [..., fan_out / 2] in lhs's dtype, in one `mtp_onednn_matmul_swiglu` FFI call: the matmul as `PackedDot`'s,
    rounded to lhs's dtype, then SwiGLU as `swiglu` computes it (the extension's own exponential: bfloat16 equal
    to `swiglu`'s but for a rare last-bit tie, NaN bits aside). ValueError for operands of another shape or dtype
    or a packed weight of another [fan_in, fan_out]'s size; under `vmap` the packed weight must be unbatched."""
    if lhs.ndim < 1 or lhs.shape[-1] != fan_in or fan_out <= 0 or fan_out % 2:
        raise ValueError(
            f"matmul_swiglu: expected lhs [..., {fan_in}] and an even, positive fan_out, got lhs {list(lhs.shape)} "
            f"and fan_out {fan_out}"
        )
    if packed.ndim != 1 or packed.dtype != lhs.dtype or lhs.dtype.name not in ("float32", "bfloat16"):
        raise ValueError(
            "matmul_swiglu: lhs and packed must share one dtype, bfloat16 or float32, packed 1-D; got lhs "
            f"{lhs.dtype}, packed {packed.dtype}{list(packed.shape)}"
        )
    expected = installed("matmul_swiglu").packed_bytes(fan_in, fan_out, lhs.dtype.name) // lhs.dtype.itemsize
    if packed.shape[0] != expected:  # (the call checks it too, but XLA skips a call with no rows)
        raise ValueError(
            f"matmul_swiglu: packed holds {packed.shape[0]} elements; pack() of a [{fan_in}, {fan_out}] "
            f"{lhs.dtype} kernel holds {expected}"
        )
    rows = math.prod(lhs.shape[:-1])
    out = (
        jax.ShapeDtypeStruct((*lhs.shape[:-1], fan_out // 2), lhs.dtype),
        jax.ShapeDtypeStruct((rows * fan_out,), lhs.dtype),  # the matmul's output, a scratch buffer
    )
    return jax.ffi.ffi_call(_MATMUL_SWIGLU, out, vmap_method="expand_dims")(lhs, packed)[0]


def attends(module: nnx.Module, q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
    """Whether `module`'s attention over this q and cache goes to `attention`: `swapped` flagged it (a CPU
    engine's copy, `ATTENTION`) and q, k and v are all bfloat16 (a float32 cache, say, stays on XLA)."""
    return getattr(module, ATTENTION, False) and q.dtype == k.dtype == v.dtype == jnp.bfloat16


def packed_for(module: nnx.Module, attribute: str, x: jax.Array) -> jax.Array | None:
    """The packed kernel `swapped` put on `module` as `attribute` (`PACKED` or `TIED_HEAD`) when `x`
    [..., fan_in] has at least the module's `MIN_ROWS_ATTRIBUTE` rows (a static shape: chosen at trace
    time), else None (no packed copy, or too few rows: XLA's dot over the original kernel)."""
    packed = getattr(module, attribute, None)
    if packed is None or math.prod(x.shape[:-1]) < getattr(module, MIN_ROWS_ATTRIBUTE):
        return None
    return packed[...]


class PackedLinear(nnx.Linear):
    """What an `nnx.Linear` is while `swapped` (an engine's copy of the model): from `MIN_ROWS_ATTRIBUTE`
    rows its matmul is `PackedDot` over the packed copy `PACKED`, below that `nnx.Linear`'s own call over
    `kernel`; the bias added in the compute dtype as `nnx.Linear` adds it (`_packable` leaves out Linears
    with a `preferred_element_type` or `precision`)."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        packed = packed_for(self, PACKED, inputs)
        if packed is None:
            return super().__call__(inputs, out_sharding)
        dot = PackedDot(self.in_features, self.out_features)
        y = dot(inputs.astype(packed.dtype), packed, (((inputs.ndim - 1,), (0,)), ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(packed.dtype)
        return y


def packed_swiglu(module: nnx.Module, x: jax.Array) -> jax.Array | None:
    """`mtp_jax.layers.ffn.swiglu(module(x))` in one `matmul_swiglu` call when `module` is an interleaved
    gate_up projection that `swapped` made a `PackedLinear` without a bias and `x` has its `MIN_ROWS_ATTRIBUTE`
    rows, else None (the caller computes the matmul and the SwiGLU apart)."""
    packed = packed_for(module, PACKED, x)
    if packed is None or module.bias is not None:
        return None
    return matmul_swiglu(x.astype(packed.dtype), packed, module.in_features, module.out_features)


def _packable(path: tuple, module) -> str | None:
    """The compute dtype name of a Linear whose matmul can go to oneDNN, else None."""
    if type(module) is not nnx.Linear or "kv_b_proj" in path:  # MLA reads kv_b_proj's kernel directly
        return None
    if module.preferred_element_type is not None or module.precision is not None:  # PackedLinear has neither
        return None
    if module.kernel.ndim != 2:  # scanned layers' stacked kernels [L, in, out]
        return None
    if module.dtype is None:  # the compute dtype would follow the input's: not known when packing
        return None
    dtype = jnp.dtype(module.dtype)
    return dtype.name if dtype.name in ("float32", "bfloat16") else None


# module -> {parameter name: (weakref to the array it was packed from, packed)}: a second engine over the
# same model (every `generate` call builds one) reuses the packing; a parameter replaced since (a new array:
# jax arrays are immutable) is packed again. Held while the module lives.
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pack_params(model: nnx.Module, tied: nnx.Embed | None = None) -> dict:
    """Packs the kernels of `model`'s routable Linears (`routed_dtypes`), the stacked expert kernels of
    its modules that name them in a class attribute `GROUPED` (MoE `Experts`; not FP8 ones), and the
    transposed table of `tied` (a tied head's embedding, used as `x @ embedding.T`): {module: packed
    kernel, or for experts {name: packed [R, P]}}, reusing an earlier packing of the same array; and
    {module: `ATTENTION`} for each attention module computing in bfloat16 whose class declares `ATTENTION`
    (False), unless `MTP_JAX_ONEDNN=matmuls` (float32 attention stays on XLA: no faster in oneDNN on Zen 5).
    The caller swaps them in with `swapped`; empty when nothing is routed."""
    dtypes = routed_dtypes()
    if not dtypes:
        return {}
    packed, attends_here = {}, "bfloat16" in dtypes and _setting() != "matmuls"
    for path, module in nnx.iter_graph(model):  # iter_graph yields a shared module once
        dtype = _packable(path, module)
        if dtype in dtypes:
            packed[module] = _packed(module, "kernel", dtype)
        grouped = getattr(type(module), GROUPED, ())
        dtype = jnp.dtype(module.config.compute_dtype).name if grouped else None
        if dtype in dtypes and all(
            getattr(module, name).ndim == 3 and getattr(module, f"{name}_scale_inv", None) is None for name in grouped
        ):  # not scanned layers' [L, R, in, out], not FP8
            packed[module] = {name: _packed(module, name, dtype, stacked=True) for name in grouped}
        attention = attends_here and getattr(type(module), ATTENTION, None) is False
        if attention and jnp.dtype(module.config.compute_dtype).name == "bfloat16":
            packed[module] = ATTENTION  # no weight: its attention's products go to oneDNN (`attends`)
    if tied is not None and tied.dtype is not None and jnp.dtype(tied.dtype).name in dtypes:
        packed[tied] = _packed(tied, "embedding", jnp.dtype(tied.dtype).name, transpose=True)
    return packed


def _packed(module: nnx.Module, name: str, dtype: str, transpose: bool = False, stacked: bool = False) -> jax.Array:
    """`pack` of `module`'s parameter `name` in `dtype` (transposed first, or each of a stacked [R, in, out]
    kernel's R, if asked), or the packing made earlier from the same array (`_PACKED`)."""
    original = getattr(module, name).get_value()
    known = _PACKED.get(module, {}).get(name)
    if known is not None and known[0]() is original and known[1].dtype == dtype:
        return known[1]
    kernel = original.astype(dtype)
    out = _pack_stacked(kernel) if stacked else _pack_jit(kernel.T if transpose else kernel)
    if isinstance(original, jax.Array):  # a numpy kernel can change in place: never reused
        _PACKED.setdefault(module, {})[name] = (weakref.ref(original), out)
    return out


def packed_grouped(module: nnx.Module, name: str) -> jax.Array | None:
    """The packed experts [R, P] `swapped` put on `module` for its stacked kernel `name` (a `GROUPED`
    name), or None: XLA's `ragged_dot` over the kernel itself."""
    packed = getattr(module, f"{PACKED}_{name}", None)
    return None if packed is None else packed[...]


class swapped:
    """Context manager: inside it, each Linear of `packed` (`pack_params`) is a `PackedLinear` holding its
    packed kernel as the parameter `PACKED`, each tied embedding its packed transpose as `TIED_HEAD`
    (which `Transformer.head` then uses), both with the row count from which to use it
    (`MIN_ROWS_ATTRIBUTE`, `min_rows` of the kernel's dtype), each experts module its packed stacked
    kernels as `PACKED`_name (`packed_grouped`, every row count), and each attention module `ATTENTION`
    set True (`attends`); on exit the modules are as before (for `nnx.split` of a packed copy)."""

    def __init__(self, packed: dict):
        self.packed, self.saved = packed, []  # saved: (module, class, {attribute: value before or _MISSING})

    def __enter__(self):
        try:
            for module, kernel in self.packed.items():
                before = {}
                self.saved.append((module, type(module), before))
                if kernel is ATTENTION:
                    _set(module, ATTENTION, True, before)
                    continue
                if isinstance(kernel, dict):  # an experts module's stacked kernels
                    for name, stacked in kernel.items():
                        _set(module, f"{PACKED}_{name}", nnx.Param(stacked), before)
                    continue
                embed = isinstance(module, nnx.Embed)
                _set(module, TIED_HEAD if embed else PACKED, nnx.Param(kernel), before)
                _set(module, MIN_ROWS_ATTRIBUTE, min_rows(kernel.dtype.name, kernel.nbytes), before)
                if not embed:
                    module.__class__ = PackedLinear
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for module, cls, before in reversed(self.saved):
            for attribute, value in before.items():
                if value is _MISSING:
                    delattr(module, attribute)
                else:
                    setattr(module, attribute, value)
            module.__class__ = cls
        self.saved.clear()


_MISSING = object()


def _set(module: nnx.Module, attribute: str, value, before: dict) -> None:
    """setattr, recording in `before` what `attribute` held first (`_MISSING`: nothing)."""
    before.setdefault(attribute, vars(module).get(attribute, _MISSING))
    setattr(module, attribute, value)
