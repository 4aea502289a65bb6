"""The optional oneDNN matmul (`mtp_jax.layers.onednn`, extension `extensions/onednn`): equal to
`jax.lax.dot_general` for every row count the decode step uses, inside jit and vmap; a `DecodeEngine`
packs its kernels and decodes the same tokens; the pure-XLA fallback when the extension is absent or
turned off. Tests needing the compiled extension skip without it (CI builds it: `.ci/run`)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import TINY_MOE

from mtp_jax import cpu_extension
from mtp_jax.config import ModelConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.linear import dot_general
from mtp_jax.model import init_model

built = pytest.mark.skipif(
    onednn._extension() is None,
    reason="the optional oneDNN extension is not built here (pip install ./extensions/onednn; CI builds it)",
)
fast_bf16 = pytest.mark.skipif(  # the engine routes no bf16 there, and oneDNN's bf16 primitives may not exist
    onednn._extension() is not None and "bfloat16" not in onednn.fast_dtypes(),
    reason="oneDNN has no fast bf16 matmul on this CPU (AVX512-BF16 or AMX needed)",
)
ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64)
DN = (((1,), (0,)), ((), ()))
TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    initializer_range=0.2,
)


def operands(rows, fan_in, fan_out, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, fan_in)), dtype)
    w = jnp.asarray(rng.standard_normal((fan_in, fan_out)) * fan_in**-0.5, dtype)
    return x, w


def reference(x, w):
    """The exact products summed in float32, rounded once to the operands' dtype."""
    return jax.lax.dot_general(x, w, DN, preferred_element_type=jnp.float32).astype(x.dtype)


def assert_matches(got, x, w):
    ref = np.asarray(reference(x, w), np.float32)
    got = np.asarray(got, np.float32)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    if x.dtype == jnp.float32:  # another summation order: within float32 rounding of the sum
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    else:  # both round the float32 sum once: at most one bfloat16 ulp apart, most elements equal
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
        assert (np.abs(got - ref) <= ulp * 1.001).all()
        assert np.mean(got == ref) > 0.9


@built
@pytest.mark.parametrize("dtype", [pytest.param(jnp.bfloat16, marks=fast_bf16), jnp.float32], ids=["bf16", "fp32"])
def test_packed_matmul_equals_dot_general_for_every_row_count(dtype):
    for fan_in, fan_out in ((160, 72), (161, 33)):  # odd sizes: oneDNN pads its blocks
        pack = jax.jit(onednn.pack)
        matmul = jax.jit(lambda x, p, k=fan_in, n=fan_out: onednn.PackedDot(k, n)(x, p, DN))
        _, w = operands(1, fan_in, fan_out, dtype)
        packed = pack(w)
        assert packed.ndim == 1 and packed.dtype == w.dtype and packed.size >= w.size
        for rows in (*ROWS, 300):  # 300: a prefill chunk
            x, _ = operands(rows, fan_in, fan_out, dtype, seed=rows)
            assert_matches(matmul(x, packed), x, w)


@built
@fast_bf16
def test_leading_axes_vmap_and_preferred_element_type():
    x, w = operands(12, 64, 48, jnp.bfloat16)
    packed = onednn.pack(w)
    dot = onednn.PackedDot(64, 48)
    x3 = x.reshape(3, 4, 64)  # [B, T, K]: rows flattened inside
    y3 = jax.jit(lambda a, p: dot(a, p, (((2,), (0,)), ((), ()))))(x3, packed)
    assert y3.shape == (3, 4, 48)
    assert_matches(y3.reshape(12, 48), x, w)
    y = jax.jit(jax.vmap(lambda a, p: dot(a, p, DN), in_axes=(0, None)))(x3, packed)  # the weight unbatched
    assert_matches(y.reshape(12, 48), x, w)
    y32 = dot(x, packed, DN, preferred_element_type=jnp.float32)
    assert y32.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(y32), np.asarray(dot(x, packed, DN), np.float32))


@built
@fast_bf16
def test_bad_operands_are_refused_with_the_reason():
    x, w = operands(4, 64, 48, jnp.bfloat16)
    packed = onednn.pack(w)
    with pytest.raises(ValueError, match=r"lhs \[..., 32\].*got lhs \[4, 64\]"):
        onednn.PackedDot(32, 48)(x, packed, DN)
    with pytest.raises(ValueError, match="rhs must be pack"):
        onednn.PackedDot(64, 48)(x, w, DN)
    with pytest.raises(ValueError, match="rhs must be pack"):
        onednn.PackedDot(64, 48)(x.astype(jnp.float32), packed, DN)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        onednn.pack(w.astype(jnp.float16))
    batched = jnp.stack([packed, packed])  # one weight per vmapped row: not what a packed matmul computes
    with pytest.raises(Exception, match="packed weight's size"):
        jax.vmap(lambda a, p: onednn.PackedDot(64, 48)(a, p, DN))(x.reshape(2, 2, 64), batched).block_until_ready()


# Weights and row counts on both sides of the extension's thread rule (`UseThreads`: every core from 2 MiB,
# from 1 MiB at 8 Mi multiply-adds): (rows, fan_in, fan_out, dtype).
THREAD_CASES = (
    (1, 512, 768, "float32"),  # 1.5 MiB, 0.4 Mi multiply-adds: one thread
    (1, 1024, 768, "bfloat16"),  # 1.5 MiB, 0.75 Mi: one thread
    (32, 512, 768, "float32"),  # 1.5 MiB, 12 Mi: every core
    (3, 1024, 768, "float32"),  # 3 MiB: every core
    (32, 1024, 768, "bfloat16"),  # 1.5 MiB, 24 Mi: every core
    (4, 1024, 1536, "bfloat16"),  # 3 MiB: every core
)
THREADS_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
sys.path.insert(0, "tests")
from test_onednn import THREAD_CASES, operands
from mtp_jax.layers import onednn
dn = (((1,), (0,)), ((), ()))
out = {}
for i, (rows, fan_in, fan_out, dtype) in enumerate(THREAD_CASES):
    x, w = operands(rows, fan_in, fan_out, jnp.dtype(dtype), seed=i)
    y = jax.jit(lambda x, p: onednn.PackedDot(fan_in, fan_out)(x, p, dn))(x, onednn.pack(w))
    out[str(i)] = np.asarray(y.astype(jnp.float32))
np.savez(sys.argv[1], **out)
"""


@built
@fast_bf16
def test_thread_count_changes_no_number(tmp_path):
    """Matmuls the thread rule runs on one thread and on every core equal `dot_general`, also when forced onto
    one thread (`MTP_JAX_ONEDNN_THREADS=1`, read once per process: two processes)."""
    results = []
    for threads in ("", "1"):
        env = {**os.environ, "MTP_JAX_ONEDNN_THREADS": threads}
        path = tmp_path / f"threads{threads or 'all'}.npz"
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(path)], env=env, check=True, timeout=300, cwd=root)
        results.append(np.load(path))
    for i, (rows, fan_in, fan_out, dtype) in enumerate(THREAD_CASES):
        x, w = operands(rows, fan_in, fan_out, jnp.dtype(dtype), seed=i)
        for result in results:  # oneDNN may split the sum over threads: each within rounding of the reference
            assert_close(result[str(i)], reference(x, w), dtype)


def assert_close(got, ref, dtype):
    """float32 within reduction-order rounding, bfloat16 within one rounding of the largest element."""
    tol = 1e-5 if dtype == "float32" else 2**-7
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


def tiny(dtype):
    return init_model(TINY.replace(dtype=dtype, param_dtype=dtype), seed=3)


def decode(model, speculative=None):
    engine = DecodeEngine(model, speculative)
    state, padded = engine.init_state([[5, 9, 14, 3], [7, 1, 2, 8]], max_new_tokens=12, stop_tokens=[])
    state = engine.run(engine.prefill(state, padded))
    return engine, np.asarray(state.tokens).tolist()


def packed_kernels(engine) -> int:
    return sum(
        1
        for path, v in jax.tree_util.tree_flatten_with_path(engine._params)[0]
        if "kernel" in str(path) and v.ndim == 1
    )


@built
@fast_bf16
def test_engine_packs_kernels_and_decodes_the_same_tokens(monkeypatch):
    """float32 (packed by default, used from `MIN_ROWS` rows; every row with MTP_JAX_ONEDNN=all): the XLA
    path's greedy tokens; bfloat16: speculative greedy equals plain greedy on the packed path, with a
    draft vocabulary's head packed too. The model itself is untouched."""
    model = tiny("float32")
    monkeypatch.setenv(onednn.ENV, "0")
    xla_engine, xla_tokens = decode(model)
    assert packed_kernels(xla_engine) == 0
    for setting in ("1", "all"):
        monkeypatch.setenv(onednn.ENV, setting)
        engine, tokens = decode(model)
        assert packed_kernels(engine) == 2 * 4 + 1 + 5  # per layer qkv, o, gate_up, down; lm_head; the MTP module's
        assert tokens == xla_tokens
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Linear):
            assert type(module) is nnx.Linear and module.kernel[...].ndim == 2 and module.dot_general is dot_general
            assert not hasattr(module, onednn.PACKED) and not hasattr(module, onednn.MIN_ROWS_ATTRIBUTE)

    monkeypatch.delenv(onednn.ENV)
    model = tiny("bfloat16")
    engine, plain = decode(model)
    assert packed_kernels(engine) == 14
    _, eagle = decode(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    assert eagle == plain
    reduced = SpeculativeConfig(method="eagle", num_speculative_tokens=3, draft_vocab=range(0, 128, 3))
    engine, eagle = decode(model, reduced)
    assert packed_kernels(engine) == 15  # and the draft vocabulary's head
    assert eagle == plain


def calls_onednn(fn, *args) -> bool:
    return onednn._MATMUL in jax.jit(fn).lower(*args).as_text()


@built
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=fast_bf16)])
def test_packed_linear_uses_onednn_from_min_rows(monkeypatch, dtype):
    """A swapped Linear (`PackedLinear`, bias included) and a tied head call oneDNN from `MIN_ROWS` rows
    (counted over every leading axis) and XLA's dot below, with the same numbers either way; with
    MTP_JAX_ONEDNN=all from one row."""
    monkeypatch.delenv(onednn.ENV, raising=False)
    monkeypatch.setitem(onednn.MIN_ROWS, dtype, 4)
    model = init_model(TINY.replace(dtype=dtype, param_dtype=dtype, tie_word_embeddings=True), seed=3)
    layer = nnx.Linear(64, 48, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(1))
    layer.bias.set_value(jnp.linspace(-1, 1, 48, dtype=dtype))
    rng = np.random.default_rng(0)
    with onednn.swapped(onednn.pack_params(layer) | onednn.pack_params(model, model.embed_tokens)):
        assert type(layer) is onednn.PackedLinear
        for shape, routed in (((3, 64), False), ((4, 64), True), ((1, 3, 64), False), ((2, 2, 64), True)):
            x = jnp.asarray(rng.standard_normal(shape), dtype)
            assert calls_onednn(lambda a: layer(a), x) == routed
            assert_close(layer(x), nnx.Linear.__call__(layer, x), dtype)  # the XLA path's call
            h = jnp.asarray(rng.standard_normal((*shape[:-1], TINY.hidden_size)), dtype)
            assert calls_onednn(lambda a: model.head(a), h) == routed
            logits = reference(h.reshape(-1, TINY.hidden_size), model.embed_tokens.embedding[...].T)
            assert_close(model.head(h).reshape(logits.shape), logits, dtype)
        large = onednn.LARGE_BYTES
        assert onednn.min_rows(dtype, large) == (onednn.LARGE_MIN_ROWS if dtype == "float32" else 4)
        assert onednn.min_rows(dtype, large - 1) == 4
        monkeypatch.setenv(onednn.ENV, "all")
        assert onednn.min_rows(dtype, 0) == onednn.min_rows(dtype, large) == 1
    assert type(layer) is nnx.Linear and not hasattr(model.embed_tokens, onednn.TIED_HEAD)
    with onednn.swapped(onednn.pack_params(layer)):
        assert calls_onednn(lambda a: layer(a), jnp.ones((1, 64), dtype))


@built
def test_tied_head_goes_through_a_packed_transposed_embedding(monkeypatch):
    """A tied head (`x @ embedding.T`): the engine packs the table's transpose as the Embed's `TIED_HEAD`
    parameter; float32 tokens equal the XLA path's, and the model keeps no packed attribute."""
    model = init_model(TINY.replace(tie_word_embeddings=True), seed=3)
    monkeypatch.setenv(onednn.ENV, "0")
    _, xla_tokens = decode(model)
    monkeypatch.setenv(onednn.ENV, "all")
    engine, tokens = decode(model)
    assert packed_kernels(engine) == 2 * 4 + 5  # the Linears; no lm_head
    head = engine._params["embed_tokens"][onednn.TIED_HEAD][...]
    assert head.ndim == 1 and head.size >= TINY.vocab_size * TINY.hidden_size
    assert tokens == xla_tokens
    assert not hasattr(model.embed_tokens, onednn.TIED_HEAD)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, TINY.hidden_size)), jnp.float32)
    with onednn.swapped(onednn.pack_params(model, model.embed_tokens)):
        packed_logits = model.head(x)
    np.testing.assert_allclose(packed_logits, model.head(x), rtol=1e-5, atol=1e-5)


@built
@fast_bf16
def test_packing_is_reused_until_a_kernel_changes(monkeypatch):
    """A second engine over the same model (each `generate` call builds one) reuses the packed kernels;
    a kernel given new values (a new array) is packed again, the others are not."""
    monkeypatch.delenv(onednn.ENV, raising=False)  # the default routing (bfloat16), whatever the caller set
    model = tiny("bfloat16")
    first = onednn.pack_params(model)
    attention = [m for m, packed in first.items() if packed is onednn.ATTENTION]
    assert len(attention) == 3  # both layers' and the MTP block's: a flag for `swapped`, nothing packed
    first = {m: packed for m, packed in first.items() if packed is not onednn.ATTENTION}
    again = onednn.pack_params(model)
    assert len(first) == 14 and all(again[m] is first[m] for m in first)
    changed = next(iter(first))
    new = changed.kernel[...] * 2
    changed.kernel.set_value(new)
    third = onednn.pack_params(model)
    assert third[changed] is not first[changed]
    assert all(third[m] is first[m] for m in first if m is not changed)
    np.testing.assert_array_equal(np.asarray(third[changed], np.float32), np.asarray(onednn.pack(new), np.float32))


def test_fallback_without_the_extension_or_when_turned_off(monkeypatch):
    model = tiny("bfloat16")
    monkeypatch.setenv(onednn.ENV, "off")
    assert onednn.routed_dtypes() == () and onednn.pack_params(model) == {}
    monkeypatch.setenv(onednn.ENV, "sometimes")
    with pytest.raises(ValueError, match="MTP_JAX_ONEDNN='sometimes'"):
        onednn.routed_dtypes()
    monkeypatch.delenv(onednn.ENV)
    monkeypatch.setattr(onednn, "_extension", lambda: None)
    monkeypatch.setattr(cpu_extension, "_extension", lambda: None)  # `installed`'s
    assert onednn.routed_dtypes() == ()
    with pytest.raises(RuntimeError, match="not installed"):
        onednn.pack(jnp.zeros((4, 4), jnp.bfloat16))
    engine, _ = decode(model)
    assert packed_kernels(engine) == 0


def grouped_reference(x, w, sizes):
    """`ragged_dot`'s value in float64: rows of group r times w[r], rows past the groups zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, offset = np.zeros((x.shape[0], w.shape[-1])), 0
    for r, rows in enumerate(sizes):
        out[offset : offset + rows] = x[offset : offset + rows] @ w[r]
        offset += rows
    return out


@built
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=fast_bf16)])
def test_grouped_matmul_equals_ragged_dot(dtype):
    """The MoE experts' grouped matmul over packed kernels: `ragged_dot`'s value for groups of every size
    (empty ones, one holding every row, rows left past the groups), inside jit and under vmap; a group
    size out of range fails the call with the reason."""
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((4, 48, 40)) * 48**-0.5, dtype)
    packed = onednn._pack_stacked(w)
    matmul = jax.jit(lambda x, s: onednn.grouped_matmul(x, packed, s, 40))
    for rows, sizes in ((1, (0, 1, 0, 0)), (5, (2, 0, 3, 0)), (24, (0, 0, 0, 24)), (24, (3, 9, 1, 4)), (64, (16,) * 4)):
        x = jnp.asarray(rng.standard_normal((rows, 48)), dtype)
        got = matmul(x, jnp.asarray(sizes, jnp.int32))
        assert got.dtype == x.dtype and got.shape == (rows, 40)
        ref = grouped_reference(x, w, sizes)
        assert_close(got, ref, dtype)
        assert not np.asarray(got, np.float32)[sum(sizes) :].any()
        np.testing.assert_allclose(
            np.asarray(got, np.float32),
            np.asarray(jax.lax.ragged_dot(x, w, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)),
            rtol=1e-5 if dtype == "float32" else 2**-7,
            atol=(1e-5 if dtype == "float32" else 2**-7) * np.abs(ref).max(),
        )
    xs = jnp.asarray(rng.standard_normal((2, 6, 48)), dtype)
    sizes = jnp.asarray([[1, 2, 3, 0], [0, 0, 2, 2]], jnp.int32)
    batched = jax.vmap(lambda x, s: onednn.grouped_matmul(x, packed, s, 40))(xs, sizes)
    for b in range(2):
        assert_close(batched[b], grouped_reference(xs[b], w, sizes[b].tolist()), dtype)
    with pytest.raises(Exception, match="sum to at most M"):
        matmul(xs[0], jnp.asarray([4, 4, 0, 0], jnp.int32)).block_until_ready()
    with pytest.raises(ValueError, match="group_sizes"):
        onednn.grouped_matmul(xs[0], packed, jnp.zeros((3,), jnp.int32), 40)


MOE = TINY.replace(**TINY_MOE)


@built
def test_moe_experts_run_the_grouped_matmul_in_the_engine(monkeypatch):
    """A MoE model's experts: a CPU engine packs each stacked kernel per expert and decodes the XLA path's
    greedy tokens (float32); in bfloat16 speculative greedy equals plain greedy."""
    model = init_model(MOE, seed=3)
    monkeypatch.setenv(onednn.ENV, "0")
    _, xla_tokens = decode(model)
    monkeypatch.delenv(onednn.ENV)
    engine, tokens = decode(model)
    name = f"{onednn.PACKED}_gate_up_proj"
    stacked = [v for p, v in jax.tree_util.tree_flatten_with_path(engine._params)[0] if name in str(p)]
    assert [v.shape[0] for v in stacked] == [MOE.n_routed_experts] * 2  # layer 1 (0 is dense), the MTP module
    assert tokens == xla_tokens
    experts = model.layers[1].mlp.experts
    assert not hasattr(experts, name)
    x, indices, weights = jnp.ones((3, MOE.hidden_size)), jnp.asarray([[0, 5], [5, 2], [7, 0]]), jnp.ones((3, 2))
    with onednn.swapped(onednn.pack_params(model)):
        hlo = jax.jit(lambda *a: experts(*a)).lower(x, indices, weights).as_text()
        assert hlo.count(onednn._GROUPED) == 2 and "ragged" not in hlo
    model = init_model(MOE.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=3)
    _, plain = decode(model)
    _, eagle = decode(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    assert eagle == plain


@built
def test_swaps_nest_and_scanned_experts_stay_on_xla(monkeypatch):
    """`swapped` inside `swapped` (a second engine built inside the first one's swap) gives back each
    attribute the outer one set, then the original modules; a scanned MoE model's stacked [L, R, in, out]
    experts are not packed, and its engine decodes the XLA path's tokens."""
    monkeypatch.delenv(onednn.ENV, raising=False)
    model = init_model(MOE.replace(tie_word_embeddings=True), seed=3)
    experts, embed, name = model.layers[1].mlp.experts, model.embed_tokens, f"{onednn.PACKED}_down_proj"
    with onednn.swapped(onednn.pack_params(model, embed)):
        outer = getattr(experts, name), getattr(embed, onednn.TIED_HEAD)
        inner = onednn.pack_params(model, embed)
        assert set(inner) == {experts, embed, model.mtp[0].mlp.experts}  # the Linears are PackedLinears now
        with onednn.swapped(inner):
            assert type(model.layers[0].mlp.down_proj) is onednn.PackedLinear
        assert (getattr(experts, name), getattr(embed, onednn.TIED_HEAD)) == outer
    assert not hasattr(experts, name) and not hasattr(embed, onednn.TIED_HEAD)
    assert type(model.layers[0].mlp.down_proj) is nnx.Linear

    scanned = init_model(MOE.replace(scan_layers=True, first_k_dense_replace=0), seed=3)
    monkeypatch.setenv(onednn.ENV, "0")
    _, xla_tokens = decode(scanned)
    monkeypatch.delenv(onednn.ENV)
    engine, tokens = decode(scanned)
    packed = [str(p) for p, _ in jax.tree_util.tree_flatten_with_path(engine._params)[0] if "packed" in str(p)]
    assert not [p for p in packed if "layer_groups" in p]  # the scanned layers: nothing packed
    assert any("'mtp'" in p and "experts" in p for p in packed)  # the MTP module's block is not scanned
    assert tokens == xla_tokens
