"""Adaptive speculation (`mtp_jax.serving.speculation`): the number of drafts a serving step verifies
follows measured acceptance and step times, and never changes what a request gets.

Oracles: greedy `generate` alone (whatever k each step uses); the "oracle" drafter, whose drafts are all
right (the greedy sequence replayed) or all wrong (a sequence of another token), with a clock that makes
every step take the same time: then only acceptance decides, and the policy must settle on K and on 0.
The distribution of sampled output under varying k is checked in tests/test_acceptance.py.
"""

import random

import pytest

from mtp_jax import SpeculativeConfig, generate, load_pretrained
from mtp_jax.serving import ServingEngine
from mtp_jax.serving.speculation import SpeculationPolicy

K, S = 3, 128
EAGLE = SpeculativeConfig(method="eagle", num_speculative_tokens=K)
ORACLE = SpeculativeConfig(method="oracle", num_speculative_tokens=K)


@pytest.fixture(scope="module")
def demo():
    return load_pretrained()


def test_policy_tries_every_variant_then_follows_tokens_per_second():
    policy = SpeculationPolicy("adaptive", 3, probe_every=5)
    assert policy.variants == (0, 1, 2, 3) and SpeculationPolicy("fixed", 3).variants == (3,)
    tried = []
    for _ in range(4):  # each variant once at this width, K first
        tried.append(policy.choose(width=4))
        policy.observe(tried[-1], 4, 1.0 + tried[-1], [0, 0])  # nothing accepted; k drafts cost k more
    assert tried == [3, 2, 1, 0] and policy.choose(4) == 0  # E_k ~ 1 for all k: the cheapest
    for _ in range(4):
        policy.observe(0, 4, 1.0, [])
    assert policy.choose(4) == 3  # after probe_every steps, the variant measured longest ago
    for _ in range(60):  # every draft accepted, and K now as fast as a plain step
        policy.observe(3, 4, 1.0, [3, 3])
    assert policy.acceptance == pytest.approx([1.0, 1.0, 1.0], abs=1e-3)
    assert policy.choose(4) == 2  # a probe: the variant measured longest ago (k = 0, 1, 2 at steps 8, 3, 2)
    policy.observe(2, 4, 3.0, [2, 2])
    assert policy.choose(4) == 3  # the best again: 4 tokens in ~1 s
    assert policy.choose(width=16) == 3  # untimed at another width: tried first
    for bad in (dict(policy="sometimes"), dict(smoothing=0.0), dict(probe_every=0)):
        args = {"policy": "adaptive", **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpeculationPolicy(args.pop("policy"), 3, **args)


def test_any_number_of_drafts_per_step_keeps_greedy_output_and_never_compiles(demo, monkeypatch):
    """Each step verifies a random k in 0 .. K (the policy's choice replaced by a coin): every request still
    gets its greedy tokens, and after warm-up (every k at every width) nothing compiles."""
    model, tokenizer = demo
    engine = ServingEngine(
        model, EAGLE, tokenizer=tokenizer, max_batch=4, max_length=S, page_size=8, prefill_chunk=32,
        page_buckets=(4, S // 8), speculative_policy="adaptive",
    )  # fmt: skip
    engine.warm_up()
    compiled = engine.compiled_counts()
    coin = random.Random(0)
    monkeypatch.setattr(engine.speculation, "choose", lambda width: coin.randint(0, K))
    prompts = [tokenizer.encode(t).ids for t in ("import os\n", "class A:\n    def f(self", "x = [1, 2", "for i in")]
    ids = [engine.add_request(p, max_tokens=30) for p in prompts]
    got, drafts = {i: [] for i in ids}, set()
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.token_ids
            drafts.add(out.num_drafts)
    assert engine.compiled_counts() == compiled
    assert drafts == {0, 1, 2, 3}
    expected = generate(model, prompts, max_new_tokens=30, max_length=S).tokens
    assert [got[i] for i in ids] == expected


@pytest.mark.parametrize("right", [True, False], ids=["drafts-right", "drafts-wrong"])
def test_the_policy_settles_on_what_acceptance_pays_for(demo, monkeypatch, right):
    """A clock on which a step verifying k drafts takes 1 + k/2 seconds: with every draft accepted a step at
    K commits 4 tokens in 2.5 s (1.6 per second against 1 for a plain step) and the policy keeps K; with
    none accepted it settles on plain steps, measuring another variant again every `probe_every` steps."""
    model, tokenizer = demo
    now = [0.0]
    engine = ServingEngine(
        model, ORACLE, tokenizer=tokenizer, max_batch=4, max_length=S, page_size=8, prefill_chunk=32,
        page_buckets=(S // 8,), speculative_policy="adaptive", clock=lambda: now[0],
    )  # fmt: skip
    engine.warm_up()
    step = engine.rows.step

    drafted = []

    def timed_step(slots, width, num_drafts, *, draft_next, **kwargs):
        now[0] += 1 + num_drafts / 2
        drafted.append(draft_next)
        return step(slots, width, num_drafts, draft_next=draft_next, **kwargs)

    monkeypatch.setattr(engine.rows, "step", timed_step)
    prompt = tokenizer.encode("def main(argv):\n").ids
    greedy = generate(model, [prompt], max_new_tokens=80, max_length=S).tokens[0]
    oracle = prompt + (greedy if right else [(t + 1) % model.config.vocab_size for t in greedy])
    engine.add_request(prompt, max_tokens=80, oracle_tokens=oracle)
    chosen = []
    while engine.has_unfinished():
        chosen += [out.num_drafts for out in engine.step() if out.num_committed and out.completion_tokens > 1]
    assert chosen[:4] == [3, 2, 1, 0]  # each variant timed once
    if right:  # after the plain step (which drafted nothing) one plain step drafts, then K for good
        assert chosen[4] == 0 and chosen[5:] and set(chosen[5:]) == {K}
    else:  # plain steps, and every probe_every steps one to measure another variant again
        assert chosen[4:].count(0) > 10 * (len(chosen) - 4 - chosen[4:].count(0))
        assert drafted.count(False) > 0.8 * len(drafted)  # its plain steps draft nothing
