"""The oneDNN matmul (`mtp_jax.layers.onednn`) and meshes: an engine on a mesh keeps XLA's sharded matmuls
(its kernels are not packed) and XLA's cache writes, and a packed matmul (and the experts' grouped one) inside
a jitted function over rows sharded on 8 fake CPU devices computes what `jax.lax.dot_general` (`ragged_dot`)
does (the custom call sees whole operands)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mtp_jax.config import ModelConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.layers import onednn
from mtp_jax.model import init_model
from mtp_jax.sharding import make_mesh, on_mesh

DN = (((1,), (0,)), ((), ()))


def test_an_engine_on_a_mesh_keeps_its_kernels_and_a_packed_matmul_takes_sharded_rows():
    config = ModelConfig.from_name("tiny", num_nextn_predict_layers=1).replace(dtype="bfloat16", param_dtype="bfloat16")
    mesh = make_mesh("data=2,tensor=4")
    engine = DecodeEngine(init_model(config), mesh=mesh)
    kernels = [v for p, v in jax.tree_util.tree_flatten_with_path(engine._params)[0] if "kernel" in str(p)]
    assert kernels and all(k.ndim >= 2 for k in kernels)
    if onednn._extension() is None:  # nothing else to check without the extension: its absence is the fallback
        assert onednn.routed_dtypes() == ()
        return
    cache = jnp.zeros((8, 16, 2, 8), jnp.bfloat16)  # a cache write on a mesh stays XLA's (GSPMD partitions it)
    assert onednn.moves_rows(cache)
    with on_mesh(mesh):
        assert not onednn.moves_rows(cache)
    # the packed matmul in the dtype this CPU routes, bf16 where it has a fast bf16 kernel (not under AVX2 alone)
    dtype = jnp.bfloat16 if "bfloat16" in onednn.routed_dtypes() else jnp.float32
    tol = 2.0**-7 if dtype == jnp.bfloat16 else 1e-5
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 64)), dtype)
    w = jnp.asarray(rng.standard_normal((64, 40)) * 0.125, dtype)
    rows = jax.device_put(x, NamedSharding(mesh, P(("data", "tensor"), None)))
    packed = onednn.pack(w)
    y = jax.jit(lambda a, p: onednn.PackedDot(64, 40)(a, p, DN))(rows, packed)
    ref = np.asarray(jax.lax.dot_general(x, w, DN, preferred_element_type=jnp.float32))
    if dtype == jnp.bfloat16:  # the fp32 sum rounded once to bf16: within one bf16 ulp
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
        assert (np.abs(np.asarray(y, np.float32) - ref) <= ulp * 1.001).all()
    else:
        np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the MoE experts' grouped matmul over rows sharded the same way: ragged_dot's value
    stacked = jnp.asarray(rng.standard_normal((3, 64, 40)) * 0.125, dtype)
    sizes = jnp.asarray([5, 0, 9], jnp.int32)
    y = jax.jit(lambda a, p, s: onednn.grouped_matmul(a, p, s, 40))(rows, onednn._pack_stacked(stacked), sizes)
    ref = jax.lax.ragged_dot(x, stacked, sizes, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref), rtol=tol, atol=tol * np.abs(ref).max())
    assert not np.asarray(y, np.float32)[14:].any()
