"""The decode step's attention products in oneDNN (`mtp_jax.layers.onednn.attention`, extension
`extensions/onednn`): equal to `verify_attention_reference` within bfloat16 rounding for every query/KV
head grouping, row count and length the step meets (a query with nothing to attend, a verify window past
the capacity), inside jit and vmap, on each of its paths (the extension's loops for a decode or verify step's
rows, with VDPBF16PS where the CPU has AVX512-BF16, oneDNN's primitives for more rows); stale Inf / NaN
cache entries never leak; a bfloat16 engine routes its GQA attention there and `MTP_JAX_ONEDNN=matmuls` or
float32 keep it on XLA."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_onednn import TINY, built, decode, fast_bf16, tiny

from mtp_jax.cache import KVCache
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers import onednn
from mtp_jax.layers.attention import Attention
from pallas_kernels.attention_reference import verify_attention_reference

ROOT = Path(__file__).resolve().parent.parent
pytestmark = fast_bf16  # bf16 attention is routed only where oneDNN has a fast bf16 matmul
# (batch, new tokens T, query heads H, KV heads G, capacity S, head dim D, value dim Dv, lengths)
CASES = (
    (2, 1, 4, 2, 12, 16, 16, (1, 12)),  # one new token: a decode step
    (3, 4, 6, 2, 20, 32, 32, (4, 20, 2)),  # a verify window; row 2's first two queries see nothing: zeros
    (1, 3, 3, 3, 9, 16, 8, (11,)),  # one query head per KV head, the window past the capacity, Dv != D
    (2, 5, 8, 1, 33, 64, 64, (17, 33)),  # one KV head for all (MQA)
)


def operands(batch, num_new, heads, kv_heads, capacity, dim, value_dim, lengths, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, num_new, heads, dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, value_dim)), jnp.bfloat16)
    return q, k, v, jnp.asarray(lengths, jnp.int32)


def assert_equal_within_rounding(got, ref):
    """Both sum exact bf16 products in float32 (another order) and round the softmax weights and the result
    to bf16: at most a few bf16 steps of the largest value apart, most elements equal."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, rtol=2**-6, atol=2**-6 * np.abs(ref).max())
    assert np.mean(got == ref) > 0.9


@built
@pytest.mark.parametrize("case", CASES, ids=["decode", "verify", "past-capacity", "mqa"])
def test_attention_equals_the_reference(case):
    q, k, v, lengths = operands(*case)
    got = jax.jit(onednn.attention)(q, k, v, lengths)
    ref = verify_attention_reference(q, k, v, lengths)
    assert got.dtype == jnp.bfloat16
    assert_equal_within_rounding(got, ref)
    empty = np.asarray(ref, np.float32) == 0  # the queries with nothing to attend: exactly zero in both
    assert (np.asarray(got, np.float32)[empty] == 0).all()
    scaled = onednn.attention(q, k, v, lengths, scale=0.3)
    assert_equal_within_rounding(scaled, verify_attention_reference(q, k, v, lengths, scale=0.3))


@built
def test_attention_under_vmap_equals_each_call():
    q, k, v, lengths = operands(*CASES[1])
    stacked = [jnp.stack([x, x[::-1]]) for x in (q, k, v, lengths)]
    got = jax.jit(jax.vmap(onednn.attention))(*stacked)
    for i in range(2):
        np.testing.assert_array_equal(
            np.asarray(got[i], np.float32), np.asarray(onednn.attention(*[x[i] for x in stacked]), np.float32)
        )


@built
@pytest.mark.parametrize(
    "case", [(3, 5, 32, 2, 20, 32, 32, (4, 20, 2)), (3, 1, 6, 2, 20, 32, 32, (4, 20, 2))], ids=["onednn", "loops"]
)
def test_stale_inf_and_nan_never_leak(case):
    """Entries at or past a row's length may hold anything (rejected drafts, a previous request's values):
    Inf and NaN there give the result of a clean cache. A NaN in a valid value does reach the output."""
    q, k, v, lengths = operands(*case)
    stale = np.arange(k.shape[1])[None, :] >= np.asarray(lengths)[:, None]  # [B, S]
    poisoned_k = jnp.where(stale[:, :, None, None], jnp.nan, k)
    poisoned_v = jnp.where(
        stale[:, :, None, None],
        jnp.asarray([jnp.inf, jnp.nan], jnp.bfloat16)[np.arange(k.shape[1]) % 2][None, :, None, None],
        v,
    )
    clean = onednn.attention(q, k, v, lengths)
    got = onednn.attention(q, poisoned_k, poisoned_v, lengths)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert_equal_within_rounding(got, clean)
    assert_equal_within_rounding(got, verify_attention_reference(q, poisoned_k, poisoned_v, lengths))
    bad = v.at[1, 0, 0, 0].set(jnp.nan)  # row 1's first entry, valid for all its queries, KV head 0
    out = np.asarray(onednn.attention(q, k, bad, lengths), np.float32)
    j = case[2] // case[3]  # the query heads of KV head 0
    assert np.isnan(out[1, :, :j, 0]).all() and np.isfinite(out[0]).all() and np.isfinite(out[1, :, j:]).all()


@built
@pytest.mark.parametrize("heads", [1, 40], ids=["loops", "onednn"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_inf_value_in_the_verify_window_reaches_the_queries_before_it_as_in_the_reference(heads, dtype):
    """The last new token's own entry is valid but hidden from the earlier queries: weight 0 there, yet summed,
    so an Inf value gives NaN for them (0 x Inf) in the reference and in both paths; Inf or NaN for the last."""
    q, k, v, lengths = operands(2, 2, heads, 1, 9, 16, 8, (5, 9), seed=5)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    v = v.at[:, 4].set(jnp.inf)  # row 0's last new entry (position 4), and one row 1's queries all see
    got = np.asarray(onednn.attention(q, k, v, lengths), np.float32)
    ref = np.asarray(verify_attention_reference(q, k, v, lengths), np.float32)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))
    assert np.isnan(got[0, 0]).all() and not np.isfinite(got[1]).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], rtol=2**-6)


# (batch, T, H, G, capacity, D, Dv, lengths): rows per KV head T x H/G on both sides of the loops' limit (the
# extension's MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS: 64 for bf16 on a CPU with AVX512-BF16, else 4), head dims that
# are and are not whole 32-element blocks (VDPBF16PS takes only whole blocks).
PATHS = (
    (2, 1, 4, 1, 70, 64, 64, (70, 33)),  # 4 rows: loops
    (2, 1, 80, 1, 70, 64, 64, (70, 33)),  # 80 rows: oneDNN
    (2, 4, 16, 4, 70, 64, 64, (70, 33)),  # 16 rows (a verify window): VDPBF16PS loops, else oneDNN
    (3, 2, 4, 2, 40, 96, 40, (40, 1, 17)),  # 4 rows: loops; one whole block past the two-block tile, a tail
    (2, 4, 2, 2, 50, 40, 24, (50, 7)),  # 4 rows, D and Dv not whole blocks
)


@built
@pytest.mark.parametrize("case", PATHS, ids=["loops", "onednn", "verify-16-rows", "loops-3-blocks", "loops-tails"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_both_paths_equal_the_reference(case, dtype):
    q, k, v, lengths = operands(*case, seed=3)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    got = jax.jit(onednn.attention)(q, k, v, lengths)
    ref = verify_attention_reference(q, k, v, lengths)
    assert got.dtype == q.dtype
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    else:
        assert_equal_within_rounding(got, ref)


@built
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_query_gets_the_same_bits_in_a_verify_window_as_alone(dtype):
    """The loops' numbers for one query row do not depend on the other rows of the call: each of a verify window's
    queries equals, bit for bit, a decode step of that query alone at its position (so a speculative step's
    verify and a plain step agree wherever their inputs do), down to the sign of a zero sum. 4 rows per KV head:
    the loops on every CPU (above the loops' limit a window goes to oneDNN, whose numbers differ)."""
    q, k, v, lengths = operands(3, 4, 2, 2, 90, 64, 64, (90, 41, 4), seed=7)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    q = q.at[2, 1].set(0)  # row 2's second query sees positions 0 and 1, now with weights 1/2 each
    tiny = jnp.full_like(v, -(2.0**-126)).at[:, 2].set(1)  # weights 1/2 x -2^-126: every product flushed to -0
    for values, zeros in ((v, False), (tiny, True)):
        window = np.asarray(onednn.attention(q, k, values, lengths), np.float32)
        for t in range(4):
            alone = np.asarray(onednn.attention(q[:, t : t + 1], k, values, lengths - 3 + t), np.float32)
            np.testing.assert_array_equal(window[:, t : t + 1].view(np.uint32), alone.view(np.uint32))
        if zeros:  # row 2's second query: two products flushed to -0 sum to +0 (alone: no entry of weight 0)
            assert (window[2, 1].view(np.uint32) == 0).all()


@built
def test_every_path_gives_the_same_numbers_on_the_same_operands(tmp_path):
    """The same calls in oneDNN (MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS=0, read once per process), in the loops
    (1000) and in the loops without VDPBF16PS (ONEDNN_MAX_CPU_ISA=AVX512_CORE, which the loops follow as
    oneDNN does): equal within rounding."""
    script = (
        "import sys, numpy as np, jax.numpy as jnp; sys.path.insert(0, 'tests'); "
        "from test_onednn_attention import PATHS, operands; from mtp_jax.layers import onednn; "
        "np.save(sys.argv[1], np.concatenate([np.asarray(onednn.attention(*operands(*c, seed=3)), np.float32)"
        ".ravel() for c in PATHS]))"
    )
    runs = {
        "onednn": {"MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS": "0"},
        "loops": {"MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS": "1000"},
        "lanes": {"MTP_JAX_ONEDNN_ATTENTION_LOOP_ROWS": "1000", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    }
    outs = {}
    for name, extra in runs.items():
        path = tmp_path / f"{name}.npy"
        env = {**os.environ, **extra}
        done = subprocess.run(
            [sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        outs[name] = np.load(path)
    assert_equal_within_rounding(outs["loops"], outs["onednn"])
    assert_equal_within_rounding(outs["lanes"], outs["onednn"])


@built
def test_attention_reads_only_as_far_as_the_longest_row():
    """A cache of 200 positions whose rows hold 5 and 70 tokens: the products stop at 128 (the longest row
    rounded up to 64 positions), equal to the reference over all 200; rows that all hold nothing give zeros."""
    q, k, v, lengths = operands(2, 3, 4, 2, 200, 16, 16, (5, 70))
    got = jax.jit(onednn.attention)(q, k, v, lengths)
    assert_equal_within_rounding(got, verify_attention_reference(q, k, v, lengths))
    far = jnp.where(np.arange(200)[None, :, None, None] >= 128, jnp.nan, v)  # stale values past the span
    np.testing.assert_array_equal(np.asarray(onednn.attention(q, k, far, lengths)), np.asarray(got))
    empty = jnp.zeros((2,), jnp.int32)
    assert not np.asarray(onednn.attention(q, k, v, empty), np.float32).any()


@built
def test_bad_operands_are_refused_with_the_reason():
    q, k, v, lengths = operands(*CASES[0])
    with pytest.raises(ValueError, match="share one dtype"):
        onednn.attention(q, k.astype(jnp.float32), v, lengths)
    with pytest.raises(ValueError, match="share one dtype, float32 or bfloat16"):
        onednn.attention(*(x.astype(jnp.float16) for x in (q, k, v)), lengths)
    with pytest.raises(ValueError, match=r"the KV heads \(2\) must divide the query heads \(3\)"):
        onednn.attention(q[:, :, :3], k, v, lengths)


def calls_attention(module, dtype) -> bool:
    x = jnp.ones((2, 3, TINY.hidden_size), dtype)
    cache = KVCache.init(module.config, 2, 16, dtype)
    positions = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
    text = jax.jit(lambda x, c: module(x, positions, c)).lower(x, cache).as_text()
    return "mtp_onednn_attention" in text


@built
def test_bfloat16_engines_route_their_attention(monkeypatch):
    """`pack_params` flags every GQA attention module of a bfloat16 model (not a float32 one, not with
    `MTP_JAX_ONEDNN=matmuls`), `swapped` sets the flag for the engine's copy only, and a flagged module
    computes the reference's numbers; the engine's speculative greedy tokens equal its plain ones."""
    monkeypatch.delenv(onednn.ENV, raising=False)
    model = tiny("bfloat16")
    packed = onednn.pack_params(model)
    flagged = [m for m, p in packed.items() if p is onednn.ATTENTION]
    assert len(flagged) == 3 and all(isinstance(m, Attention) for m in flagged)
    layer = flagged[0]
    cache = KVCache.init(layer.config, 2, 16, jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, TINY.hidden_size)), jnp.bfloat16)
    positions = jnp.asarray([[4, 5, 6], [0, 1, 2]], jnp.int32)
    xla, xla_cache = layer(x, positions, cache)
    with onednn.swapped(packed):
        assert calls_attention(layer, jnp.bfloat16)
        got, got_cache = layer(x, positions, cache)
    assert not calls_attention(layer, jnp.bfloat16) and onednn.ATTENTION not in vars(layer)
    assert_equal_within_rounding(got, xla)
    np.testing.assert_array_equal(np.asarray(got_cache.k, np.float32), np.asarray(xla_cache.k, np.float32))

    _, plain = decode(model)
    _, eagle = decode(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    assert eagle == plain
    monkeypatch.setenv(onednn.ENV, "matmuls")
    assert not any(p is onednn.ATTENTION for p in onednn.pack_params(model).values())
    monkeypatch.delenv(onednn.ENV)
    assert not any(p is onednn.ATTENTION for p in onednn.pack_params(tiny("float32")).values())


@built
def test_overflowing_scores_and_odd_scales_match_the_reference():
    """Visible scores that overflow to -inf from finite operands leave nothing to attend: zeros, as the
    reference's softmax gives (oneDNN's alone gives NaN). Scales are told apart by their bits: a NaN scale's
    call gives NaN and leaves a later call of the same shape with another scale alone."""
    q = jnp.full((1, 2, 2, 4), 1e38, jnp.bfloat16)
    k = jnp.full((1, 4, 1, 4), -1e38, jnp.bfloat16)
    v = jnp.ones((1, 4, 1, 4), jnp.bfloat16)
    lengths = jnp.asarray([4], jnp.int32)
    np.testing.assert_array_equal(np.asarray(onednn.attention(q, k, v, lengths), np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(verify_attention_reference(q, k, v, lengths), np.float32), 0.0)
    q, k, v, lengths = operands(*CASES[0])
    assert np.isnan(np.asarray(onednn.attention(q, k, v, lengths, scale=float("nan")), np.float32)).all()
    assert_equal_within_rounding(
        onednn.attention(q, k, v, lengths, scale=0.5), verify_attention_reference(q, k, v, lengths, scale=0.5)
    )


@built
def test_a_fresh_process_can_call_attention_first():
    """`attention` registers the extension's targets itself (nothing else packed first)."""
    script = (
        "import jax.numpy as jnp; from mtp_jax.layers import onednn; x = jnp.ones((1, 1, 2, 8), jnp.bfloat16); "
        "print(float(onednn.attention(x, x, x, jnp.ones((1,), jnp.int32))[0, 0, 0, 0]))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1.0"


THREADS_SCRIPT = """
import os, numpy as np, jax.numpy as jnp, mtp_jax_onednn
from mtp_jax.layers import onednn
def call(batch, capacity):  # 8 query rows per KV head: oneDNN's path
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, 4, 4, 64)), jnp.float32)
    cache = jnp.ones((batch, capacity, 2, 64), jnp.float32)
    onednn.attention(x, cache, cache, jnp.full((batch,), capacity, jnp.int32)).block_until_ready()
call(1, 8)  # small: one thread, which sets the calling thread's OpenMP count to 1
call(8, 2048)  # large (8 MiB of cache): every core
print(mtp_jax_onednn.LIB.mtp_onednn_threads(), len(os.sched_getaffinity(0)))
"""


@built
def test_a_large_call_after_a_small_one_still_uses_every_core():
    """The thread count of a call on every core is read from the environment and the machine, not from the
    calling thread's OpenMP count, which a small call before has set to 1 (it was, and stayed 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MTP_JAX_ONEDNN_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    threads, cores = map(int, done.stdout.split()[-2:])
    assert threads == cores
