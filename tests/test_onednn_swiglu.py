"""The gate_up matmul and its SwiGLU in one oneDNN call (`mtp_jax.layers.onednn.matmul_swiglu`, the
extension's `MtpOnednnMatmulSwiglu`): `swiglu` of the packed matmul for every row count, a prefill's rows
split over threads, values at the edges of the exponential (infinities, NaN, |g| near 88), inside jit and
under vmap; an engine's `MLP` calls it from the packed kernel's `MIN_ROWS` and computes what it did."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_onednn import DN, ROWS, TINY, assert_close, built, fast_bf16, operands

from mtp_jax.layers import onednn
from mtp_jax.layers.ffn import MLP, swiglu
from mtp_jax.model import init_model

DTYPES = [pytest.param(jnp.bfloat16, marks=fast_bf16), jnp.float32]


def assert_swiglu_equal(got, ref, dtype):
    """NaN where `ref` is; bfloat16: equal but for a rare last-bit tie of the two exponentials (one bf16 step
    at most); float32: within a few float32 ulps (the exponentials differ in their last bits)."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    got, ref = np.nan_to_num(got), np.nan_to_num(ref)
    if dtype == jnp.float32:
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-30)
        return
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
    assert (np.abs(got - ref) <= step * 1.001).all()


@built
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_matmul_swiglu_equals_swiglu_of_the_packed_matmul(dtype):
    """Every row count of a decode step and a prefill (2048 rows x 512 units: the threaded split), odd
    widths; bf16 results equal `swiglu` of the matmul's bf16 output in at least 99.9% of elements."""
    for fan_in, fan_out, all_rows in ((160, 72, (*ROWS, 300)), (33, 1024, (2048,))):
        _, w = operands(1, fan_in, fan_out, dtype)
        packed = onednn.pack(w)
        fused = jax.jit(lambda x, p, k=fan_in, n=fan_out: onednn.matmul_swiglu(x, p, k, n))
        apart = jax.jit(lambda x, p, k=fan_in, n=fan_out: swiglu(onednn.PackedDot(k, n)(x, p, DN)))
        for rows in all_rows:
            x, _ = operands(rows, fan_in, fan_out, dtype, seed=rows)
            got, ref = fused(x, packed), apart(x, packed)
            assert got.dtype == x.dtype and got.shape == (rows, fan_out // 2)
            assert_swiglu_equal(got, ref, dtype)
            if dtype == jnp.bfloat16:
                assert np.mean(np.asarray(got == ref)) >= 0.999


@built
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
def test_matmul_swiglu_at_the_edges_of_the_exponential(dtype):
    """Gates of +-inf, NaN, +-0, +-87..89 and +-100 (a one-row matmul by 1.0 passes them through exactly):
    XLA's `swiglu` values, silu(-inf) = -inf * 0 = NaN included."""
    gates = [np.inf, -np.inf, np.nan, 0.0, -0.0, 87.0, -87.0, 87.5, -87.5, 88.0, -88.0, 88.5, -88.5, 89.0, -89.0]
    gates += [100.0, -100.0, 1e-3, -1e-3, 3.0, -3.0, 20.0, -20.0]
    ups = np.linspace(-2, 2, len(gates))
    w = jnp.asarray(np.stack([gates, ups], axis=1).reshape(1, -1), dtype)  # [1, 2n]: interleaved pairs
    packed = onednn.pack(w)
    x = jnp.ones((3, 1), dtype)
    got = jax.jit(lambda a, p: onednn.matmul_swiglu(a, p, 1, w.shape[1]))(x, packed)
    ref = jax.jit(swiglu)(jnp.broadcast_to(w, (3, w.shape[1])))
    assert_swiglu_equal(got, ref, dtype)
    assert np.isnan(np.asarray(got, np.float32)[:, 1]).all()  # silu(-inf)


@built
@fast_bf16
def test_matmul_swiglu_leading_axes_vmap_and_bad_operands():
    x, w = operands(12, 64, 48, jnp.bfloat16)
    packed = onednn.pack(w)
    ref = swiglu(onednn.PackedDot(64, 48)(x, packed, DN))
    got = jax.jit(lambda a, p: onednn.matmul_swiglu(a, p, 64, 48))(x.reshape(3, 4, 64), packed)
    assert got.shape == (3, 4, 24)
    np.testing.assert_array_equal(np.asarray(got.reshape(12, 24), np.float32), np.asarray(ref, np.float32))
    batched = jax.vmap(lambda a: onednn.matmul_swiglu(a, packed, 64, 48))(x.reshape(3, 4, 64))  # weight unbatched
    np.testing.assert_array_equal(np.asarray(batched.reshape(12, 24), np.float32), np.asarray(ref, np.float32))
    for fan_in, fan_out in ((64, 47), (64, 0), (64, -48), (40, 48)):  # odd, empty, negative; lhs not [..., 40]
        with pytest.raises(ValueError, match="expected lhs"):
            onednn.matmul_swiglu(x, packed, fan_in, fan_out)
    for lhs, weight in ((x.astype(jnp.float32), packed), (x.astype(jnp.float16), packed.astype(jnp.float16))):
        with pytest.raises(ValueError, match="share one dtype"):
            onednn.matmul_swiglu(lhs, weight, 64, 48)
    for rows in (4, 0):  # a [64, 96] weight was expected; with no rows too
        with pytest.raises(ValueError, match=r"pack\(\) of a \[64, 96\] bfloat16 kernel holds"):
            onednn.matmul_swiglu(x[:rows], packed, 64, 96)
    batched = jnp.stack([packed, packed])  # one weight per vmapped row
    with pytest.raises(Exception, match="packed weight's size"):
        jax.vmap(lambda a, p: onednn.matmul_swiglu(a, p, 64, 48))(x.reshape(2, 6, 64), batched).block_until_ready()


def calls_fused(fn, *args) -> bool:
    return onednn._MATMUL_SWIGLU in jax.jit(fn).lower(*args).as_text()


@built
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=fast_bf16)])
def test_mlp_fuses_its_swiglu_from_min_rows(monkeypatch, dtype):
    """A swapped `MLP` runs its gate_up matmul and SwiGLU as one call from the packed kernel's `MIN_ROWS`
    rows (XLA's dot and `swiglu` below), with the unswapped MLP's numbers; a gate_up with a bias (no
    model has one) keeps the two steps."""
    monkeypatch.delenv(onednn.ENV, raising=False)
    monkeypatch.setitem(onednn.MIN_ROWS, dtype, 4)
    mlp = init_model(TINY.replace(dtype=dtype, param_dtype=dtype), seed=3).layers[0].mlp
    assert isinstance(mlp, MLP)
    rng = np.random.default_rng(0)
    inputs = [jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((3, 64), (4, 64), (2, 3, 64))]
    before = [mlp(x) for x in inputs]
    with onednn.swapped(onednn.pack_params(mlp)):
        for x, ref in zip(inputs, before, strict=True):
            routed = np.prod(x.shape[:-1]) >= 4
            assert calls_fused(lambda a: mlp(a), x) == routed
            assert_close(mlp(x), ref, dtype)
        mlp.gate_up_proj.bias = nnx.Param(jnp.zeros((2 * TINY.intermediate_size,), dtype))
        assert not calls_fused(lambda a: mlp(a), inputs[1])


DENORMALS_SCRIPT = """
import ctypes, numpy as np, jax, jax.numpy as jnp
# libgomp's workers created here, outside XLA: they keep denormals (XLA's threads flush them)
callback = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _: None)
ctypes.CDLL("libgomp.so.1").GOMP_parallel(callback, None, 2, 0)
from mtp_jax.layers import onednn
from mtp_jax.layers.ffn import swiglu
pairs = np.stack([np.full(65536, -87.5), np.ones(65536)], axis=1).reshape(1, -1)
w = jnp.asarray(pairs, jnp.bfloat16)  # gate -87.5: its sigmoid is below 2^-126, silu(-87.5) -0.0 in XLA
x = jnp.ones((17, 1), jnp.bfloat16)  # 17 x 65536 outputs: the call splits them over every core
got = jax.jit(lambda a, p: onednn.matmul_swiglu(a, p, 1, w.shape[1]))(x, onednn.pack(w))
ref = jax.jit(swiglu)(jnp.broadcast_to(w, (17, w.shape[1])))
print(int((np.asarray(got, np.float32) != np.asarray(ref, np.float32)).sum()))
"""


@built
@fast_bf16
def test_a_prefill_sized_call_flushes_denormals_on_every_thread():
    """Above 2^20 outputs the SwiGLU runs on OpenMP's workers, which keep the denormal mode of wherever they
    were created; each takes the calling XLA thread's (flush to zero) for the loop, so no row of the split
    keeps a tiny silu where XLA's is -0.0 (a fresh process whose workers were created outside XLA)."""
    done = subprocess.run([sys.executable, "-c", DENORMALS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "0"
