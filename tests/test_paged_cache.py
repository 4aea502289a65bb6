"""Paged caches (`mtp_jax.cache.PagedCache`): a forward through a block table equals one through dense rows.

Oracle: the same model over dense `[B, S, ...]` caches. Pages are dealt out shuffled, every table row ends
in sentinel entries, and every page a row does not own (and every owned position past its length) holds
NaN before the first forward: a read of anything not written by the row itself would show.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from speculative_helpers import CFG, HYBRID, make_model

from mtp_jax.cache import KVCache, PagedCache, PageLayout, StackedCache, bind_pages, init_cache
from mtp_jax.model import sequence_positions

PAGE, NUM_PAGES, WIDTH, BATCH = 4, 24, 6, 3  # a row holds at most WIDTH x PAGE = 24 positions
MLA = CFG.replace(
    attention_type="mla",
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
)
CONFIGS = {
    "gqa": CFG,
    "mla": MLA,
    "scanned": CFG.replace(num_hidden_layers=3, scan_layers=True),
    "hybrid": HYBRID,
}
CALLS = [(0, 10), (10, 1), (11, 4)]  # (first position, tokens): a prefill, a decode, a verify across a page


def _table(rng: np.random.Generator, owned: int, num_pages: int = NUM_PAGES, width: int = WIDTH) -> np.ndarray:
    """int32 [BATCH, width]: `owned` distinct shuffled pages per row, then the sentinel."""
    pages = rng.permutation(num_pages)[: BATCH * owned].reshape(BATCH, owned)
    table = np.full((BATCH, width), num_pages, np.int32)
    table[:, :owned] = pages
    return table


def _poisoned(cache):
    """`cache` with every page of every pool NaN (recurrent states, per row, as they are)."""

    def poison(node):
        if isinstance(node, StackedCache):
            return StackedCache(poison(node.layers))
        if isinstance(node, PagedCache):
            return node.replace(pool=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), node.pool))
        return node

    return jax.tree.map(poison, cache, is_leaf=lambda x: isinstance(x, PagedCache | StackedCache))


def _run(model, cache, table, tokens, calls=CALLS):
    outs = []
    for start, size in calls:
        positions = sequence_positions(BATCH, size, jnp.full((BATCH,), start, jnp.int32))
        bound = cache if table is None else bind_pages(cache, table)
        logits, _, cache = model(tokens[:, start : start + size], positions, bound)
        cache = cache if table is None else bind_pages(cache, None)
        outs.append(np.asarray(logits))
    return outs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_through_pages_equals_dense(name):
    config = CONFIGS[name]
    model = make_model(config, 0, 0.3)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (BATCH, 15)), jnp.int32)
    dense = _run(model, model.init_cache(BATCH, WIDTH * PAGE), None, tokens)
    paged_cache = init_cache(model.init_cache, BATCH, WIDTH * PAGE, PageLayout(NUM_PAGES, PAGE))
    pools = [n for n in jax.tree.leaves(paged_cache, is_leaf=lambda x: isinstance(x, PagedCache))]
    assert any(isinstance(n, PagedCache) for n in pools) or config.scan_layers
    paged = _run(
        model, _poisoned(paged_cache) if name != "hybrid" else paged_cache, jnp.asarray(_table(rng, 4)), tokens
    )
    for d, p in zip(dense, paged, strict=True):
        assert np.isfinite(p).all()
        np.testing.assert_allclose(p, d, atol=2e-5, rtol=2e-5)


def test_writes_go_through_the_table_and_drop_outside_it():
    rng = np.random.default_rng(2)
    pool = KVCache(k=jnp.zeros((NUM_PAGES, PAGE, 1, 2)), v=jnp.zeros((NUM_PAGES, PAGE, 1, 2)))
    table = _table(rng, 2)  # 8 positions per row; entries 2.. are the sentinel
    cache = PagedCache(pool=pool, block_table=jnp.asarray(table))
    positions = jnp.asarray([[0, 5, 7, 8, 23, 24, -1]] * BATCH, jnp.int32)  # 8..: sentinel pages, past W, negative
    values = jnp.arange(1, 1 + BATCH * 7, dtype=jnp.float32).reshape(BATCH, 7, 1, 1) * jnp.ones((1, 1, 1, 2))
    written = cache.write(positions, values, values)
    k = np.asarray(written.pool.k)
    for b in range(BATCH):
        for t, p in enumerate([0, 5, 7]):
            assert k[table[b, p // PAGE], p % PAGE, 0, 0] == values[b, t, 0, 0]
    assert np.count_nonzero(k) == BATCH * 3 * 2  # nothing else written anywhere
    view = np.asarray(written.view().k)  # [B, W * P, 1, 2], table order; sentinel pages read zeros
    np.testing.assert_array_equal(view[:, [0, 5, 7], 0, 0], np.asarray(values[:, :3, 0, 0]))
    assert view.shape == (BATCH, WIDTH * PAGE, 1, 2) and not view[:, 8:].any()


@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_paged_kernel_in_the_model_equals_the_reference(name, monkeypatch):
    """With `attention_impl="pallas_interpret"` the attention layer reads pages through the Pallas paged kernel
    (page size 16, `pallas_kernels.paged_verify_attention`; MLA's absorbed path with its latent and rope-key
    pools, R = 16, H = 4); logits equal the gathered reference's, over calls that cross a page boundary."""
    import pallas_kernels.paged_attention as paged_attention

    config = CFG if name == "gqa" else MLA.replace(num_attention_heads=4, qk_rope_head_dim=16)
    page, width = 16, 2
    calls = [(0, 14), (14, 1), (15, 4)]  # the verify call writes and reads positions 15 .. 18: two pages
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (BATCH, 19)), jnp.int32)
    kernel_calls = []
    kernel = paged_attention.paged_verify_attention
    monkeypatch.setattr(
        paged_attention, "paged_verify_attention", lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k)
    )
    outs = {}
    for impl in ("reference", "pallas_interpret"):
        model = make_model(config.replace(attention_impl=impl), 0, 0.3)
        cache = _poisoned(init_cache(model.init_cache, BATCH, width * page, PageLayout(8, page)))
        outs[impl] = _run(model, cache, jnp.asarray(_table(np.random.default_rng(4), 2, 8, width)), tokens, calls)
        assert len(kernel_calls) == (0 if impl == "reference" else len(calls))  # one attention layer per call
    for ref, out in zip(outs["reference"], outs["pallas_interpret"], strict=True):
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
