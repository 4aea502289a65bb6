"""Paged serving: `ServingEngine`'s KV pages, preemption and prefix cache never change what a request gets.

Oracles: greedy `generate` of every prompt (plain decoding; speculative greedy equals it), each token
decided by a top-1/top-2 logit margin far above what another batch, page width or chunking moves;
the prefix cache on vs off (the same tokens and the same accepted drafts per position); the scripted
model of `speculative_helpers` (tokens decided by construction) for a thousand requests through a small
pool. Every situation is constructed: a pool too small for the load (preemptions counted), prompts
sharing a system prefix and a follow-up turn (hits counted), cancellations, an "oracle" drafter whose
every draft is accepted so that blocks of K + 1 cross a page boundary or end exactly on one.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from speculative_helpers import CFG, SUCCESSOR, scripted

from mtp_jax import SamplingParams, SpeculativeConfig, generate, load_pretrained
from mtp_jax.serving import ServingEngine

K, S, PAGE, CHUNK = 3, 160, 8, 32
EAGLE = SpeculativeConfig(method="eagle", num_speculative_tokens=K)
ORACLE = SpeculativeConfig(method="oracle", num_speculative_tokens=K)
SYSTEM = "# utilities shared by every request below\nimport os\nimport sys\nfrom typing import Any, Optional\n\n"
TAILS = ["def f(x):\n", "class A:\n", "x = [", "import re\n", "for i in range(", "@dataclass\nclass B", "try:\n"]


@pytest.fixture(scope="module")
def demo():
    return load_pretrained()


def engine_for(model, tokenizer, spec=EAGLE, **kwargs) -> ServingEngine:
    """One engine shape for the whole file (the same compiled programs): 8 rows of up to S tokens, pages
    of 8 positions read at widths 4 or 20 pages."""
    kwargs = {"max_batch": 8, "max_length": S, "page_size": PAGE, "prefill_chunk": CHUNK, **kwargs}
    engine = ServingEngine(model, spec, tokenizer=tokenizer, page_buckets=(4, S // PAGE), **kwargs)
    engine.warm_up()
    return engine


def decided(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts whose plain greedy tokens are each decided by a top-1/top-2 logit margin > 1e-3, and
    those tokens (the references: a near tie could flip under another batch or page width)."""
    tokens = generate(model, prompts, max_new_tokens=max_tokens, max_length=S).tokens
    sequences = np.zeros((len(prompts), S), np.int32)  # right-padded: padding never reaches earlier positions
    for row, (prompt, out) in enumerate(zip(prompts, tokens, strict=True)):
        sequences[row, : len(prompt) + len(out)] = prompt + out
    positions = jnp.broadcast_to(jnp.arange(S), sequences.shape)
    top = jnp.sort(model(jnp.asarray(sequences), positions, model.init_cache(len(prompts), S))[0], axis=-1)
    margins = np.asarray(top[..., -1] - top[..., -2])  # [N, S]
    kept = [
        (prompt, out)
        for row, (prompt, out) in enumerate(zip(prompts, tokens, strict=True))
        if margins[row, len(prompt) - 1 : len(prompt) + len(out) - 1].min() > 1e-3
    ]
    return [p for p, _ in kept], [t for _, t in kept]


def serve(engine: ServingEngine, requests: list[dict], abort_after_first: set[int] = frozenset()) -> list[dict]:
    """Adds every request, steps to the end (aborting those listed once they have a token), and returns per
    request its tokens, finish reason and metrics."""
    ids = [engine.add_request(**r) for r in requests]
    got = {rid: {"tokens": [], "finish": None, "metrics": None} for rid in ids}
    aborts = {ids[i] for i in abort_after_first}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got[out.request_id]
            entry["tokens"] += out.token_ids
            entry["finish"], entry["metrics"] = out.finish_reason, out.metrics
            if out.request_id in aborts and not out.finished:
                engine.abort(out.request_id)
                aborts.discard(out.request_id)
        engine.pages.check()
    assert engine.pages.num_used_pages == 0  # every page free again (cached ones evictable)
    return [got[rid] for rid in ids]


def test_preemption_prefix_hits_and_aborts_keep_every_output(demo):
    """32 requests of mixed lengths, half behind one system prompt, in a pool of 24 pages (8 rows of up to
    160 tokens would need 160): requests are preempted, prefixes hit, three are cancelled mid-stream, and
    every other output equals greedy decoding alone; nothing compiles after warm-up."""
    model, tokenizer = demo
    candidates = [
        tokenizer.encode((SYSTEM if i % 2 else "") + TAILS[i % len(TAILS)] + f"# {i}\n" * (i % 5)).ids
        for i in range(48)
    ]
    prompts, expected = decided(model, candidates, 24)
    prompts, expected = prompts[:32], expected[:32]
    assert len(prompts) == 32 and sum(p[:8] == prompts[1][:8] for p in prompts) > 8  # many behind SYSTEM
    engine = engine_for(model, tokenizer, num_pages=24)
    compiled = engine.compiled_counts()
    results = serve(engine, [{"prompt": p, "max_tokens": 24} for p in prompts], abort_after_first={3, 10, 17})
    assert engine.compiled_counts() == compiled
    assert engine.num_preemptions > 0 and any(r["metrics"].num_preemptions for r in results)
    assert engine.pages.hits > 0 and any(r["metrics"].num_cached_tokens for r in results)
    for i, (result, tokens) in enumerate(zip(results, expected, strict=True)):
        if i in {3, 10, 17}:
            assert result["finish"] == "abort" and tokens[: len(result["tokens"])] == result["tokens"]
        else:
            assert result["tokens"] == tokens, i


def test_prefix_cache_on_and_off_give_the_same_tokens_and_drafts(demo):
    """Requests behind one system prompt, then a follow-up turn that extends a finished request's prompt and
    output (its pages written by decode steps, drafts included, are reused): with the prefix cache on and
    off, every request gets the same tokens and the same accepted drafts at every draft position."""
    model, tokenizer = demo
    first = [tokenizer.encode(SYSTEM + tail).ids for tail in TAILS[:4]]
    runs = {}
    for caching in (True, False):
        engine = engine_for(model, tokenizer, prefix_caching=caching)
        results = serve(engine, [{"prompt": p, "max_tokens": 56} for p in first])
        follow_up = first[0] + results[0]["tokens"] + tokenizer.encode("\n# again\n").ids
        results += serve(engine, [{"prompt": follow_up, "max_tokens": 24}])
        runs[caching] = (engine, results)
    (on, with_cache), (off, without) = runs[True], runs[False]
    assert on.pages.hits > 0 and off.pages.hits == 0
    assert with_cache[-1]["metrics"].num_cached_tokens >= 64 > len(first[0]) + 24  # decoded pages were reused
    for a, b in zip(with_cache, without, strict=True):
        assert a["tokens"] == b["tokens"]
        assert a["metrics"].accepted_per_position == b["metrics"].accepted_per_position


def test_blocks_across_and_onto_page_boundaries(demo):
    """Every draft accepted (the oracle replays the greedy sequence), so each step commits K + 1 = 4 tokens:
    a prompt of 6 commits blocks 7..10, 15..18, ... across page boundaries at 8, 16, ...; a prompt of 7
    commits lengths 8, 12, 16, ... ending exactly on them. Both equal greedy decoding alone."""
    model, tokenizer = demo
    prompts, expected = decided(model, [tokenizer.encode(SYSTEM).ids[:6], tokenizer.encode(SYSTEM).ids[:7]], 33)
    assert [len(p) for p in prompts] == [6, 7]
    engine = engine_for(model, tokenizer, ORACLE)
    requests = [{"prompt": p, "max_tokens": 33, "oracle_tokens": p + e} for p, e in zip(prompts, expected, strict=True)]
    results = serve(engine, requests)
    for result, tokens in zip(results, expected, strict=True):
        assert result["tokens"] == tokens
        assert result["metrics"].committed_per_step == [1] + [K + 1] * 8  # the prefill's token, then full blocks


def test_a_thousand_random_requests_leave_every_page_free():
    """1,000 requests of random lengths through 24 pages of 4 positions (preemptions), from prompts that
    share prefixes (hits), a tenth cancelled: every page is free again at the end, no page is ever held by
    two requests unless cached and immutable (`PageAllocator.check` after every step), and every finished
    output is the scripted model's chain."""
    rng = np.random.default_rng(0)
    model = scripted(CFG, 0)
    engine = ServingEngine(
        model, SpeculativeConfig(method="eagle", num_speculative_tokens=2), max_batch=4, max_length=32,
        num_pages=24, page_size=4, prefill_chunk=8, page_buckets=(2, 8), max_queue=1000,
    )  # fmt: skip
    engine.warm_up()
    base = [int(t) for t in rng.integers(0, CFG.vocab_size, 24)]
    requests = []
    for _ in range(1000):
        prompt = base[: rng.integers(1, 24)] + [int(t) for t in rng.integers(0, CFG.vocab_size, rng.integers(0, 4))]
        requests.append(
            {"prompt": prompt[:28], "max_tokens": int(rng.integers(1, 32 - len(prompt[:28]) + 1)), "ignore_eos": True}
        )
    results = serve(engine, requests, abort_after_first=set(rng.choice(1000, 100, replace=False).tolist()))
    assert engine.num_preemptions > 0 and engine.pages.hits > 0
    for request, result in zip(requests, results, strict=True):
        chain = [SUCCESSOR[request["prompt"][-1]]]
        while len(chain) < request["max_tokens"]:
            chain.append(SUCCESSOR[chain[-1]])
        assert result["tokens"] == [int(t) for t in chain][: len(result["tokens"])]
        assert result["finish"] == "abort" or len(result["tokens"]) == request["max_tokens"]


def test_sampled_requests_draft_from_the_drafter_and_greedy_ones_stay_greedy(demo):
    """With `draft_sampling="sample"` (the server's default) a sampled request's drafts are drawn from the
    drafter and accepted by the lossless rule, a greedy one's stay greedy, in one batch: each gets exactly
    what it gets alone with the same seed (draws are keyed by row seed and position), and the sampled one
    accepts some drafts (at temperature 0.7 its greedy drafts would rarely match)."""
    model, tokenizer = demo
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=K, draft_sampling="sample")
    engine = engine_for(model, tokenizer, spec)
    prompts = [tokenizer.encode(SYSTEM + tail).ids for tail in TAILS[:3]]
    params = [None, SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=1.0, top_p=0.9, seed=9)]
    results = serve(
        engine, [{"prompt": p, "max_tokens": 24, "sampling": s} for p, s in zip(prompts, params, strict=True)]
    )
    for prompt, sampling, result in zip(prompts, params, results, strict=True):
        alone = generate(model, [prompt], max_new_tokens=24, max_length=S, speculative=spec, sampling=sampling)
        assert result["tokens"] == alone.tokens[0]
    assert results[1]["metrics"].num_accepted > 0


def test_warm_up_fits_a_small_pool():
    """A pool of 4 pages of 4 tokens, smaller than the warm-up's usual prompt of 2 chunks + 1: the warm-up
    sizes its prompts to the pool, and a request that fits is served (the scripted model's chain)."""
    engine = ServingEngine(
        scripted(CFG, 0), SpeculativeConfig(method="eagle", num_speculative_tokens=2), max_batch=2, max_length=64,
        num_pages=4, page_size=4, prefill_chunk=16,
    )  # fmt: skip
    engine.warm_up()
    (result,) = serve(engine, [{"prompt": [1, 2, 3], "max_tokens": 8, "ignore_eos": True}])
    assert result["tokens"] == [4, 5, 1, 2, 3, 4, 5, 1]
    with pytest.raises(ValueError, match="num_pages=4"):
        engine.add_request([1] * 12, max_tokens=4)
    for bad, match in ((dict(prefix_caching="false"), "prefix_caching"), (dict(page_buckets=5), "page_buckets")):
        with pytest.raises(ValueError, match=match):
            ServingEngine(scripted(CFG, 0), max_length=64, num_pages=4, page_size=4, **bad)
