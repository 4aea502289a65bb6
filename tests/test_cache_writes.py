"""KV cache writes in place on the CPU (`mtp_jax.layers.onednn.write_rows`, the `mtp_write_rows` FFI call of
`extensions/onednn`): a bf16 / fp16 / fp8 cache's new rows copied into its own buffer, where XLA:CPU would
convert the whole cache to float32 and back on every write. Equal to a sequential write (later rows win,
indices outside the cache dropped) for every dtype, inside jit and vmap and under `jax.grad`; compiled
without a copy of a donated cache; `write_at` and `PagedCache.write` give exactly what XLA's path gives.
A page pool's gather (`gather_rows`, `mtp_gather_rows`; `PagedCache.view`) equals `gather_pages` likewise."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_onednn import built

from mtp_jax.cache import KVCache, PagedCache, write_at
from mtp_jax.layers import onednn
from pallas_kernels.attention_reference import gather_pages

DTYPES = (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float32, jnp.int32)


def sequential(cache, index, rows):
    """The reference: row index[u] of the cache's flattened leading axes set to rows[u], u in order."""
    out = np.array(cache).reshape(-1, *rows.shape[1:])
    for u, r in enumerate(np.asarray(index)):
        if 0 <= r < out.shape[0]:
            out[r] = np.asarray(rows[u])
    return out.reshape(cache.shape)


def operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    cache = jnp.asarray(rng.standard_normal((3, 5, 2, 4)) * 4, jnp.float32).astype(dtype)  # 15 rows of [2, 4]
    index = jnp.asarray([7, -1, 0, 14, 15, 7, 100, 3], jnp.int32)  # 7 twice (the later wins), 3 dropped
    rows = jnp.asarray(rng.standard_normal((8, 2, 4)) * 4, jnp.float32).astype(dtype)
    return cache, index, rows


def bits(x):
    return np.asarray(x).view(np.uint8)


@built
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_write_rows_writes_each_row_in_order_and_drops_indices_outside(dtype):
    cache, index, rows = operands(dtype)
    expected = sequential(cache, index, rows)
    for got in (onednn.write_rows(cache, index, rows), jax.jit(onednn.write_rows)(cache, index, rows)):
        assert got.dtype == cache.dtype and got.shape == cache.shape
        np.testing.assert_array_equal(bits(got), bits(expected))
    # the cache is a value: the caller's array is unchanged when not donated
    np.testing.assert_array_equal(bits(cache), bits(operands(dtype)[0]))


@built
def test_write_rows_under_vmap_and_with_one_element_rows():
    cache, index, rows = operands(jnp.bfloat16)
    batched = jax.vmap(onednn.write_rows, in_axes=(0, None, None))(jnp.stack([cache, cache + 1]), index, rows)
    np.testing.assert_array_equal(bits(batched[1]), bits(sequential(cache + 1, index, rows)))
    flat = cache.reshape(-1)  # rows [U]: each row one element
    got = onednn.write_rows(flat, index, rows[:, 0, 0])
    np.testing.assert_array_equal(bits(got), bits(sequential(flat, index, rows[:, 0, 0])))


@built
def test_a_donated_cache_is_written_without_a_copy():
    cache = jnp.zeros((64, 16, 2, 8), jnp.bfloat16)  # a page pool [N, P, G, D]
    index, rows = jnp.asarray([5, 700], jnp.int32), jnp.ones((2, 2, 8), jnp.bfloat16)
    write = jax.jit(onednn.write_rows, donate_argnums=0)
    hlo = write.lower(cache, index, rows).compile().as_text()
    assert "mtp_write_rows" in hlo and " copy(" not in hlo and "convert" not in hlo
    got = np.asarray(write(cache, index, rows), np.float32).reshape(-1, 2, 8)
    assert (got[[5, 700]] == 1).all() and got.sum() == 2 * 16


@built
def test_write_rows_names_a_shape_mismatch():
    cache, index, rows = operands(jnp.bfloat16)
    with pytest.raises(ValueError, match=r"write_rows: expected cache \[\.\.\., \*row\].*rows \[8, 4, 2\]"):
        onednn.write_rows(cache, index, rows.reshape(8, 4, 2))
    with pytest.raises(ValueError, match="index"):
        onednn.write_rows(cache, index[:3], rows)


def in_place(fn, *args):
    """`fn(*args)` jitted, checked to write through `write_rows`."""
    assert "mtp_write_rows" in jax.jit(fn).lower(*args).as_text()
    return jax.jit(fn)(*args)


def xla_path(monkeypatch, fn, *args):
    """`fn(*args)` traced afresh with the extension turned off (`MTP_JAX_ONEDNN=0`): XLA's write."""
    with monkeypatch.context() as patch:
        patch.setenv(onednn.ENV, "0")
        traced = jax.jit(lambda *a: fn(*a))  # a new function: traced now, not taken from jit's cache
        assert "mtp_write_rows" not in traced.lower(*args).as_text()
        return traced(*args)


@built
@pytest.mark.parametrize("num_new", (1, 4, 20), ids=("decode", "verify", "prefill"))
def test_write_at_in_place_equals_xla(monkeypatch, num_new):
    """A bf16 cache [B, S, G, D]: rows' positions run past S, a row's first position is negative, a row
    writes one position twice; 20 tokens is past `SELECT_WRITES` (XLA's scatter there, its select below)."""
    rng = np.random.default_rng(num_new)
    cache = jnp.asarray(rng.standard_normal((3, 24, 2, 8)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((3, num_new, 2, 8)), jnp.bfloat16)
    positions = np.stack([np.arange(num_new) + 22, np.arange(num_new) - 1, np.arange(num_new) + 2])
    positions[2, -1] = positions[2, 0]  # the later token wins
    positions = jnp.asarray(positions, jnp.int32)
    assert onednn.moves_rows(cache)
    got = in_place(write_at, cache, new, positions)
    np.testing.assert_array_equal(bits(got), bits(xla_path(monkeypatch, write_at, cache, new, positions)))
    assert np.asarray(got[2, 2] == new[2, -1]).all()


@built
def test_paged_write_in_place_equals_xla(monkeypatch):
    """A bf16 page pool: a row's table with a sentinel page (its writes dropped) and positions past its width."""
    rng = np.random.default_rng(1)
    pool = KVCache(*(jnp.asarray(rng.standard_normal((6, 4, 2, 8)), jnp.bfloat16) for _ in range(2)))
    table = jnp.asarray([[2, 0], [5, 6]], jnp.int32)  # page 6 is past the pool's 6 pages: a sentinel
    positions = jnp.asarray([[3, 4, 5], [6, 7, 8]], jnp.int32)  # row 1: 6-7 in the sentinel page, 8 past W x P
    k, v = (jnp.asarray(rng.standard_normal((2, 3, 2, 8)), jnp.bfloat16) for _ in range(2))

    def write(pool, k, v):
        return PagedCache(pool, table).write(positions, k, v).pool

    got = in_place(write, pool, k, v)
    expected = xla_path(monkeypatch, write, pool, k, v)
    for a, b in ((got.k, expected.k), (got.v, expected.v)):
        np.testing.assert_array_equal(bits(a), bits(b))
    np.testing.assert_array_equal(bits(got.k[2, 3]), bits(k[0, 0]))  # position 3 of row 0: page 2, offset 3
    np.testing.assert_array_equal(bits(got.k[5]), bits(pool.k[5]))  # row 1's only real page, untouched


@built
def test_grad_through_an_in_place_write_equals_xla(monkeypatch):
    """A training forward writes its caches too: `jax.grad` passes through the write (cache and new)."""
    rng = np.random.default_rng(2)
    cache = jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.bfloat16)
    positions = jnp.asarray([[1, 2, 2], [6, 7, 8]], jnp.int32)  # a position written twice, one past S

    def loss(cache, new):
        return jnp.sum(write_at(cache, new * 3, positions).astype(jnp.float32) ** 2)

    got = in_place(jax.grad(loss, argnums=(0, 1)), cache, new)
    expected = xla_path(monkeypatch, jax.grad(loss, argnums=(0, 1)), cache, new)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert not np.asarray(got[1][0, 1]).any()  # the overwritten token gets no gradient


@built
@pytest.mark.parametrize("kind", (jnp.int8, jnp.uint8, jnp.int16), ids=lambda d: jnp.dtype(d).name)
def test_positions_of_a_narrow_integer_type_are_written_as_xla_writes_them(monkeypatch, kind):
    """Positions in a type that cannot hold the capacity (int8 against 200 positions): every position is
    written, densely and through pages (jnp would cast the capacity into the positions' type otherwise)."""
    rng = np.random.default_rng(3)
    cache = jnp.asarray(rng.standard_normal((1, 200, 1, 4)), jnp.bfloat16)
    new = jnp.asarray(rng.standard_normal((1, 2, 1, 4)), jnp.bfloat16)
    positions = jnp.asarray([[5, 100]], kind)
    got = in_place(write_at, cache, new, positions)
    np.testing.assert_array_equal(bits(got), bits(xla_path(monkeypatch, write_at, cache, new, positions)))
    np.testing.assert_array_equal(bits(got[0, [5, 100]]), bits(new[0]))
    pool = KVCache(*(jnp.zeros((4, 64, 1, 4), jnp.bfloat16) for _ in range(2)))  # W x P = 256 positions
    table = jnp.asarray([[0, 1, 2, 3]], jnp.int32)
    written = PagedCache(pool, table).write(positions, new, new).view().k
    np.testing.assert_array_equal(bits(written[0, [5, 100]]), bits(new[0]))


@built
def test_a_write_of_no_rows_passes_the_cache_and_its_gradient_through(monkeypatch):
    """T = 0 new tokens: `write_at` returns the cache (XLA's select reduced over none), and `jax.grad` through
    a paged write of them (an empty `write_rows`, whose tangent rule had no row to gather) is the cache's
    gradient as if nothing were written, as on XLA's path."""
    rng = np.random.default_rng(4)
    cache = jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.bfloat16)
    new, positions = jnp.zeros((2, 0, 2, 4), jnp.bfloat16), jnp.zeros((2, 0), jnp.int32)
    np.testing.assert_array_equal(bits(jax.jit(write_at)(cache, new, positions)), bits(cache))
    np.testing.assert_array_equal(bits(xla_path(monkeypatch, write_at, cache, new, positions)), bits(cache))
    table = jnp.asarray([[0, 1], [2, 3]], jnp.int32)

    def loss(k):  # a pool of 4 pages of 4 positions
        written = PagedCache(KVCache(k, k), table).write(positions, new, new)
        return jnp.sum(written.pool.k.astype(jnp.float32) * 3)

    pool = cache.reshape(4, 4, 2, 4)
    assert onednn.moves_rows(pool)
    got = jax.jit(jax.grad(loss))(pool)  # (the empty write is dead code there: only its tangent rule is traced)
    np.testing.assert_array_equal(bits(got), bits(xla_path(monkeypatch, jax.grad(loss), pool)))
    np.testing.assert_array_equal(np.asarray(got, np.float32), 3.0)
    empty = jnp.zeros((0,), jnp.int32)
    rows = jax.grad(lambda c: jnp.sum(onednn.write_rows(c, empty, new[0, :0]).astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(rows(cache), np.float32), 1.0)


@built
def test_wide_indices_outside_int32_are_dropped_not_wrapped():
    """int64 ids (x64) outside int32 would wrap into range when cast for the handlers (2**32 + 1 -> 1): a
    gathered page reads zeros, a write is dropped, as for any id outside the rows; a float index is refused."""
    source = jnp.arange(1, 17, dtype=jnp.float32).reshape(4, 4).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        index = jnp.asarray([0, 2**32 + 1, -(2**32) + 2], jnp.int64)
        np.testing.assert_array_equal(np.asarray(onednn.gather_rows(source, index), np.float32)[1:], 0.0)
        written = onednn.write_rows(source, index[1:], jnp.zeros((2, 4), jnp.bfloat16))
        np.testing.assert_array_equal(bits(written), bits(source))
        table = jnp.asarray([[0, 2**32 + 1]], jnp.int64)
        pool = KVCache(source.reshape(4, 2, 1, 2), source.reshape(4, 2, 1, 2))
        view = np.asarray(PagedCache(pool, table).view().k, np.float32)
        np.testing.assert_array_equal(view[0, 2:], 0.0)
    with pytest.raises(ValueError, match="gather_rows: index must be an integer array, got float32"):
        onednn.gather_rows(source, jnp.zeros((1,), jnp.float32))


@built
def test_new_tokens_that_broadcast_are_written_as_xla_writes_them(monkeypatch):
    """`new` [B, 1, G, D] for two positions, or [B, T, 1, D] for G KV heads: broadcast, as XLA's paths do."""
    rng = np.random.default_rng(5)
    cache = jnp.asarray(rng.standard_normal((2, 8, 2, 4)), jnp.bfloat16)
    positions = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    for shape in ((2, 1, 2, 4), (2, 2, 1, 4)):
        new = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        got = in_place(write_at, cache, new, positions)
        np.testing.assert_array_equal(bits(got), bits(xla_path(monkeypatch, write_at, cache, new, positions)))


@built
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gather_rows_equals_gather_pages(dtype):
    """A block table with sentinel ids past the pool and below zero: their pages read as zeros."""
    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.standard_normal((6, 4, 2, 8)) * 4, jnp.float32).astype(dtype)  # [N, P, G, D]
    table = jnp.asarray([[2, 0, 6], [5, -1, 100]], jnp.int32)
    expected = gather_pages(pool, table)
    got = jax.jit(onednn.gather_rows)(pool, table.reshape(-1)).reshape(expected.shape)
    np.testing.assert_array_equal(bits(got), bits(expected))
    assert not np.asarray(got[1, 4:]).astype(np.float32).any()


@built
def test_a_paged_view_and_its_gradient_equal_xla(monkeypatch):
    rng = np.random.default_rng(4)
    pool = KVCache(*(jnp.asarray(rng.standard_normal((6, 4, 2, 8)), jnp.bfloat16) for _ in range(2)))
    table = jnp.asarray([[2, 0], [5, 6]], jnp.int32)

    def read(pool):
        view = PagedCache(pool, table).view()
        return jnp.sum(view.k.astype(jnp.float32) ** 2) + jnp.sum(view.v.astype(jnp.float32))

    assert "mtp_gather_rows" in jax.jit(read).lower(pool).as_text()
    np.testing.assert_array_equal(jax.jit(read)(pool), xla_path(monkeypatch, read, pool))
    got, expected = jax.jit(jax.grad(read))(pool), xla_path(monkeypatch, jax.grad(read), pool)
    for a, b in ((got.k, expected.k), (got.v, expected.v)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert not np.asarray(got.k[1], np.float32).any()  # page 1 is in no row: no gradient


@built
def test_gather_rows_names_a_bad_index():
    with pytest.raises(ValueError, match=r"gather_rows: expected source \[N, \*row\] and index \[U\], got \[6, 4\]"):
        onednn.gather_rows(jnp.zeros((6, 4), jnp.bfloat16), jnp.zeros((2, 2), jnp.int32))


@built
def test_rows_of_no_elements_and_packed_sub_byte_dtypes_stay_correct(monkeypatch):
    """A cache [B, S, G, 0] writes as XLA's does; 4-bit floats (two to a byte in XLA) are not routed, and
    `write_rows` / `gather_rows` refuse them by name."""
    empty = jnp.zeros((2, 8, 2, 0), jnp.bfloat16)
    positions = jnp.asarray([[1, 2], [3, 9]], jnp.int32)
    assert jax.jit(write_at)(empty, jnp.zeros((2, 2, 2, 0), jnp.bfloat16), positions).shape == empty.shape
    fp4 = jnp.asarray(np.random.default_rng(5).standard_normal((2, 8, 2, 4)), jnp.float4_e2m1fn)
    new = jnp.ones((2, 2, 2, 4), jnp.float4_e2m1fn)
    assert not onednn.moves_rows(fp4)
    got = jax.jit(write_at)(fp4, new, positions)
    np.testing.assert_array_equal(
        np.asarray(got, np.float32), np.asarray(xla_path(monkeypatch, write_at, fp4, new, positions), np.float32)
    )
    with pytest.raises(ValueError, match="write_rows: dtype int4 packs several elements to a byte"):
        onednn.write_rows(jnp.zeros((4, 2), jnp.int4), jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2), jnp.int4))
    with pytest.raises(ValueError, match="gather_rows: dtype float4_e2m1fn"):
        onednn.gather_rows(fp4, jnp.zeros((1,), jnp.int32))


STALE = """
import sys, types, warnings
import mtp_jax_onednn as real
stale = types.ModuleType("mtp_jax_onednn")
stale.__dict__.update({k: v for k, v in vars(real).items() if k != sys.argv[1]})  # built before it
sys.modules["mtp_jax_onednn"] = stale
import jax.numpy as jnp
from mtp_jax.cache import write_at
from mtp_jax.layers import onednn
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert onednn._extension() is None and not onednn.moves_rows(jnp.zeros((1,), jnp.bfloat16))
assert any("rebuild it" in str(w.message) for w in caught), [str(w.message) for w in caught]
out = write_at(jnp.zeros((1, 4, 2), jnp.bfloat16), jnp.ones((1, 1, 2), jnp.bfloat16), jnp.asarray([[2]]))
assert float(out.sum()) == 2.0
"""


@built
@pytest.mark.parametrize("dropped", ["GATHER_ROWS", "ABI"], ids=["a-handler-missing", "other-operands"])
def test_an_extension_older_than_mtp_jax_is_ignored_with_a_warning(dropped):
    """Built before a handler this version calls, or before its operands changed (no `ABI`, version 1):
    everything runs on XLA, and a warning says to rebuild."""
    subprocess.run([sys.executable, "-c", STALE, dropped], check=True, timeout=300)
