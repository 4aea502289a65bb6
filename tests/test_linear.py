"""`layers.linear.dot_general`: half precision accumulated in float32, the one-row pad on CPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.layers.indexing import sequence_positions
from mtp_jax.layers.linear import dot_general

MATMUL = (((1,), (0,)), ((), ()))


def _operands(rows: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, 96), np.float32), dtype)
    w = jnp.asarray(rng.standard_normal((96, 40), np.float32), dtype)
    return x, w


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_is_the_float32_product_of_its_operands_rounded_once(rows):
    x, w = _operands(rows, jnp.bfloat16)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # bf16 products are exact in f32
    got = jax.jit(lambda a, b: dot_general(a, b, MATMUL))(x, w)
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 40)
    # one rounding of a float32 sum: within half a bf16 ulp of the exact value, plus float32 summation error
    np.testing.assert_allclose(np.asarray(got, np.float64), exact, rtol=2**-8, atol=1e-4)
    wide = jax.jit(lambda a, b: dot_general(a, b, MATMUL, preferred_element_type=jnp.float32))(x, w)
    assert wide.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(wide, np.float64), exact, rtol=1e-5, atol=1e-4)
    assert np.array_equal(np.asarray(got), np.asarray(wide.astype(jnp.bfloat16)))


def test_one_row_equals_the_same_row_inside_a_batch():
    x, w = _operands(3, jnp.bfloat16, seed=1)
    one = jax.jit(lambda a, b: dot_general(a, b, MATMUL, preferred_element_type=jnp.float32))(x[1:2], w)
    many = jax.jit(lambda a, b: dot_general(a, b, MATMUL, preferred_element_type=jnp.float32))(x, w)
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(many[1]), rtol=1e-6, atol=1e-6)
    # leading axes of size 1 ([1, 1, E] @ [E, N], a batch-1 decode step) take the same path
    three = jax.jit(lambda a, b: dot_general(a, b, (((2,), (0,)), ((), ()))))(x[None, 1:2], w)
    assert three.shape == (1, 1, 40)
    np.testing.assert_array_equal(np.asarray(three[0, 0]), np.asarray(one[0].astype(jnp.bfloat16)))


def test_float32_goes_to_lax_unchanged():
    x, w = _operands(4, jnp.float32)
    np.testing.assert_array_equal(np.asarray(dot_general(x, w, MATMUL)), np.asarray(jax.lax.dot_general(x, w, MATMUL)))


def _converts_of_the_weight(hlo: str, shape: tuple[int, int]) -> list[str]:
    dims = ",".join(map(str, shape))
    return [line for line in hlo.splitlines() if re.search(rf"= f32\[{dims}\]\S* (convert|fusion)\(", line)]


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="dot_general rewrites bf16 matmuls on the CPU backend only; elsewhere it is lax.dot_general",
)
@pytest.mark.parametrize("rows", [1, 4])
def test_cpu_keeps_the_bfloat16_weight_as_it_is(rows):
    """The slow path this avoids: XLA:CPU (jax 0.10) converting the whole [in, out] weight to float32
    in memory before every matmul (a bf16 -> bf16 dot, or a one-row one)."""
    x, w = _operands(rows, jnp.bfloat16)
    ours = jax.jit(lambda a, b: dot_general(a, b, MATMUL)).lower(x, w).compile().as_text()
    assert _converts_of_the_weight(ours, w.shape) == []


def test_bfloat16_model_matches_its_float32_self():
    """A bf16 model (weights the float32 ones rounded), one row of one token (the padded path) and
    3 rows of 7: logits within bf16's error of float32's, and the same greedy token wherever float32's
    top-1 leads its top-2 by a clear margin."""
    config = mtp_jax.ModelConfig.from_name("tiny")
    fp32 = mtp_jax.init_model(config, seed=3)
    bf16 = mtp_jax.init_model(config.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=3)
    nnx.update(bf16, jax.tree.map(lambda a: a.astype(jnp.bfloat16), nnx.state(fp32, nnx.Param)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (3, 7)), jnp.int32)
    for batch, length in ((1, 1), (3, 7)):
        rows = tokens[:batch, :length]
        positions = sequence_positions(batch, length, 0)
        want, _, _ = fp32(rows, positions, fp32.init_cache(batch, 8))
        got, _, _ = bf16(rows, positions, bf16.init_cache(batch, 8))
        want, got = np.asarray(want[:, -1]), np.asarray(got[:, -1], np.float32)  # [B, V]
        np.testing.assert_allclose(got, want, atol=0.05 * np.abs(want).max())
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 0.05 * np.abs(want).max()
        assert clear.any()
        np.testing.assert_array_equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
