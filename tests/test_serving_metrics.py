"""`mtp_jax.serving.prometheus.PrometheusMetrics` against known workloads on the bundled demo model.

Requests with `ignore_eos` and a known `max_tokens` have exact lengths; a deterministic clock (one
second per call) makes every time an integer, so histogram sums compare exactly with the sums over
the requests' `RequestMetrics`. The rendered text is parsed back with prometheus_client's parser.
"""

from __future__ import annotations

import itertools

import pytest
from prometheus_client.parser import text_string_to_metric_families

import mtp_jax
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.serving import ServingEngine
from mtp_jax.serving.prometheus import CONTENT_TYPE, TTFT_BUCKETS, PrometheusMetrics, build_1_2_5_buckets

K = 3
MODEL = "demo"
PROMPTS = ("def add(a, b):\n    return", "import os\nimport sys\n\n\nclass Config:\n", "for i in range(10):\n")
MAX_TOKENS = (5, 17, 9)


@pytest.fixture(scope="module")
def demo():
    return mtp_jax.load_pretrained()


def make_engine(demo, k, **kwargs):
    model, tokenizer = demo
    metrics = PrometheusMetrics(MODEL, k, max_model_len=128)
    speculative = SpeculativeConfig(method="eagle", num_speculative_tokens=k) if k else None
    clock = itertools.count().__next__  # 0, 1, 2, ... seconds: one per call
    engine = ServingEngine(
        model,
        speculative,
        tokenizer=tokenizer,
        max_batch=2,
        max_length=128,
        prefill_chunk=32,
        clock=clock,
        stats=metrics,
        **kwargs,
    )
    return engine, metrics


def run(engine):
    outputs = []
    while engine.has_unfinished():
        outputs.extend(engine.step())
    return outputs


def samples(metrics: PrometheusMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels other than model_name/engine): value} of the rendered text."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s
            rest = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))
            found[(s.name, rest)] = s.value
    return found


def value(found, name, **labels):
    return found[(name, tuple(sorted(labels.items())))]


def finished_metrics(outputs):
    return [o.metrics for o in outputs if o.finished]


def test_speculative_counters_match_the_workload(demo):
    engine, metrics = make_engine(demo, K)
    tokenizer = demo[1]
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    for prompt, n in zip(prompts, MAX_TOKENS, strict=True):
        engine.add_request(prompt, max_tokens=n, ignore_eos=True)
    outputs = run(engine)
    found = samples(metrics)
    requests = finished_metrics(outputs)
    assert len(requests) == len(PROMPTS)

    generated = value(found, "vllm:generation_tokens_total")
    assert generated == sum(MAX_TOKENS) == 31
    assert value(found, "vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert value(found, "vllm:request_success_total", finished_reason="length") == 3
    assert value(found, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 0

    drafts = value(found, "vllm:spec_decode_num_drafts_total")
    draft_tokens = value(found, "vllm:spec_decode_num_draft_tokens_total")
    accepted = value(found, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(K)]
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(K)),)) not in found
    assert drafts == sum(m.num_steps for m in requests) > 0
    assert draft_tokens == sum(m.num_drafts for m in requests) == K * drafts
    assert accepted == sum(m.num_accepted for m in requests) == sum(per_pos) > 0
    assert per_pos == [sum(m.accepted_per_position[j] for m in requests) for j in range(K)]
    assert per_pos == sorted(per_pos, reverse=True)  # draft j + 1 is accepted only after draft j
    # Each decode step commits its accepted drafts and a bonus token, unless max_tokens cut the bonus.
    decode = [o for o in outputs if o.num_committed and o.completion_tokens > len(o.token_ids)]
    assert len(decode) == drafts
    cut = sum(len(o.token_ids) == o.num_accepted for o in decode)
    assert 0 <= cut <= len(requests)
    assert generated == len(requests) + drafts + accepted - cut

    # Histograms: one sample per request (per decode step for ITL); sums as the RequestMetrics say.
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert value(found, f"vllm:{name}_count") == 3, name
    assert value(found, "vllm:inter_token_latency_seconds_count") == drafts
    assert value(found, "vllm:time_to_first_token_seconds_sum") == sum(m.ttft for m in requests)
    assert value(found, "vllm:e2e_request_latency_seconds_sum") == sum(m.e2e_latency for m in requests)
    assert value(found, "vllm:request_queue_time_seconds_sum") == sum(m.queue_time for m in requests)
    assert value(found, "vllm:inter_token_latency_seconds_sum") == sum(sum(m.inter_token_latencies) for m in requests)
    assert value(found, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        sum(m.tpot for m in requests), rel=1e-12
    )
    assert value(found, "vllm:request_decode_time_seconds_sum") == sum(
        m.token_times[-1] - m.token_times[0] for m in requests
    )
    assert value(found, "vllm:request_prompt_tokens_sum") == sum(len(p) for p in prompts)
    assert value(found, "vllm:request_generation_tokens_sum") == 31
    # The integer clock: every time is a whole number of seconds, and the engine ran to its end.
    assert all(float(m.ttft).is_integer() and m.ttft > 0 for m in requests)
    assert value(found, "vllm:num_requests_running") == 0
    assert value(found, "vllm:num_requests_waiting") == 0
    assert value(found, "vllm:kv_cache_usage_perc") == 0


def test_oracle_acceptance_patterns_give_hand_computed_counts(demo):
    """The oracle drafter replays the greedy sequence with chosen tokens corrupted, so decode step i of
    a request accepts exactly pattern[i] of its K = 3 drafts: every counter is known in advance."""
    model, tokenizer = demo
    prompts = [tokenizer.encode(PROMPTS[0]).ids, tokenizer.encode(PROMPTS[2]).ids]
    patterns = [[0, 1, 2, 3, 3], [3, 0, 2]]
    max_tokens = [1 + sum(a + 1 for a in p) for p in patterns]
    assert max_tokens == [15, 9]
    plain, _ = make_engine(demo, 0)  # the greedy references
    for prompt, n in zip(prompts, max_tokens, strict=True):
        plain.add_request(prompt, max_tokens=n, ignore_eos=True)
    references = {}
    for out in run(plain):
        references.setdefault(out.request_id, []).extend(out.token_ids)

    metrics = PrometheusMetrics(MODEL, K, max_model_len=128)
    engine = ServingEngine(
        model,
        SpeculativeConfig(method="oracle", num_speculative_tokens=K),
        tokenizer=tokenizer,
        max_batch=2,
        max_length=128,
        prefill_chunk=32,
        stats=metrics,
    )
    for i, (prompt, pattern) in enumerate(zip(prompts, patterns, strict=True)):
        sequence = prompt + references[f"req-{i}"]
        length = len(prompt) + 1  # the prefill commits the first token
        for accepted in pattern:
            if accepted < K:  # draft accepted + 1 is wrong
                sequence[length + accepted] = (sequence[length + accepted] + 1) % model.config.vocab_size
            length += accepted + 1
        engine.add_request(prompt, max_tokens=max_tokens[i], ignore_eos=True, oracle_tokens=sequence)
    outputs = run(engine)
    for i, pattern in enumerate(patterns):  # the engine did what the oracle was set up for
        assert [o.num_accepted for o in outputs if o.request_id == f"req-{i}"][1:] == pattern
    found = samples(metrics)
    assert value(found, "vllm:generation_tokens_total") == 15 + 9
    assert value(found, "vllm:spec_decode_num_drafts_total") == 5 + 3
    assert value(found, "vllm:spec_decode_num_draft_tokens_total") == 3 * 8
    assert value(found, "vllm:spec_decode_num_accepted_tokens_total") == 9 + 5
    per_pos = [value(found, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(K)]
    assert per_pos == [4 + 2, 3 + 2, 2 + 1]  # steps accepting > 0, > 1, > 2 drafts
    assert value(found, "vllm:inter_token_latency_seconds_count") == 8
    assert value(found, "vllm:request_success_total", finished_reason="length") == 2


def test_gauges_follow_the_engine(demo):
    engine, metrics = make_engine(demo, K)
    prompt = demo[1].encode(PROMPTS[0]).ids
    for _ in range(4):
        engine.add_request(prompt, max_tokens=20, ignore_eos=True)
    started, active = set(), {}  # requests with a first token; those holding a slot: tokens received
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
            active[out.request_id] = out.completion_tokens
            if out.finished:
                del active[out.request_id]
        found = samples(metrics)
        # A 12-token prompt is one chunk: a request admitted in a step has its first token by its end.
        assert value(found, "vllm:num_requests_running") == len(active) <= 2
        assert value(found, "vllm:num_requests_waiting") == 4 - len(started)
        held = {rid: len(engine.pages.pages(rid)) for rid in active}  # KV pages: committed tokens + one step
        for rid, n in active.items():
            assert engine.pages.pages_for(len(prompt) + n) <= held[rid] <= engine.pages.pages_for(len(prompt) + n + K)
        assert value(found, "vllm:kv_cache_usage_perc") == pytest.approx(sum(held.values()) / engine.num_pages)
    assert value(found, "vllm:generation_tokens_total") == 80


def test_plain_decoding_counts_without_spec_metrics(demo):
    engine, metrics = make_engine(demo, 0)
    prompts = [demo[1].encode(p).ids for p in PROMPTS]
    for prompt, n in zip(prompts, MAX_TOKENS, strict=True):
        engine.add_request(prompt, max_tokens=n, ignore_eos=True)
    outputs = run(engine)
    found = samples(metrics)
    assert not any(name.startswith("vllm:spec_decode") for name, _ in found)
    assert value(found, "vllm:generation_tokens_total") == 31
    assert all(len(o.token_ids) <= 1 for o in outputs)  # one token per step
    assert value(found, "vllm:inter_token_latency_seconds_count") == 31 - 3  # every token after the first
    assert value(found, "vllm:request_success_total", finished_reason="length") == 3


def test_stop_strings_and_aborts(demo):
    """Tokens after a stop string are not generated; aborted requests count as "abort"."""
    tokenizer = demo[1]
    prompt = tokenizer.encode(PROMPTS[1]).ids
    reference, _ = make_engine(demo, K)
    reference.add_request(prompt, max_tokens=24, ignore_eos=True)
    outputs = run(reference)
    # A stop string completed by the first token of a block of >= 2 committed tokens: the full text
    # up to that token (it cannot appear earlier) cuts the block after its first token.
    tokens, stop = [], None
    for out in outputs:
        if len(tokens) and len(out.token_ids) >= 2:
            text = tokenizer.decode(tokens + out.token_ids[:1])
            if text and text != tokenizer.decode(tokens):
                stop, expected = text, len(tokens) + 1
                break
        tokens += out.token_ids
    assert stop is not None, "no multi-token block in the reference output"

    engine, metrics = make_engine(demo, K)
    engine.add_request(prompt, max_tokens=24, ignore_eos=True, stop=[stop])
    waiting = [engine.add_request(prompt, max_tokens=24, ignore_eos=True) for _ in range(2)]
    for rid in waiting:  # before any step: still queued
        assert engine.abort(rid)
    outputs = run(engine)
    found = samples(metrics)
    final = {o.request_id: o for o in outputs if o.finished}
    assert final["req-0"].finish_reason == "stop" and final["req-0"].completion_tokens == expected
    last = final["req-0"]
    assert last.num_committed >= 2 and len(last.token_ids) == 1  # the block was cut after its first token
    assert value(found, "vllm:generation_tokens_total") == expected
    assert value(found, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(found, "vllm:request_success_total", finished_reason="abort") == 2
    # Aborted while waiting: no prompt processed, no first token, no queue time; still a finished request.
    assert value(found, "vllm:prompt_tokens_total") == len(prompt)
    assert value(found, "vllm:request_prompt_tokens_count") == 3
    assert value(found, "vllm:request_prompt_tokens_sum") == 3 * len(prompt)
    assert value(found, "vllm:time_to_first_token_seconds_count") == 1
    assert value(found, "vllm:request_queue_time_seconds_count") == 1
    assert value(found, "vllm:e2e_request_latency_seconds_count") == 3


def test_render_and_registry():
    first, second = PrometheusMetrics(MODEL, 2), PrometheusMetrics(MODEL, 2)  # own registries: no clash
    assert first.registry is not second.registry
    assert CONTENT_TYPE.startswith("text/plain; version=")
    text = first.render().decode()
    assert "_created" not in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {f.name: f.type for f in families.values() if f.name.startswith("vllm:spec")} == {
        "vllm:spec_decode_num_drafts": "counter",
        "vllm:spec_decode_num_draft_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens": "counter",
        "vllm:spec_decode_num_accepted_tokens_per_pos": "counter",
    }
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    bounds = [
        s.labels["le"] for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")
    ]
    assert bounds == [str(b) for b in TTFT_BUCKETS] + ["+Inf"]
    assert build_1_2_5_buckets(128) == [1, 2, 5, 10, 20, 50, 100]
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        PrometheusMetrics(MODEL, -1)


def test_prefix_cache_and_preemption_counters_follow_the_engine(demo):
    """Four requests behind one system prompt, two slots and 10 pages of 16 tokens (two requests at their
    full length need 12, sharing two): prefixes hit, a request is preempted, and the counters equal the engine's
    totals (tokens looked up and reused, preemptions)."""
    _, tokenizer = demo
    engine, metrics = make_engine(demo, K, page_size=16, num_pages=10)
    system = tokenizer.encode("import os\nimport sys\nimport json\n" * 6).ids
    assert 64 <= len(system) <= 80  # past the first page and one prefill chunk: a hit reuses >= 32 tokens
    for p in PROMPTS + ("while True:\n",):
        engine.add_request(system + tokenizer.encode(p).ids, max_tokens=30, ignore_eos=True)
    outputs = run(engine)
    found = samples(metrics)
    assert engine.pages.hits > 0 and engine.num_preemptions > 0
    assert value(found, "vllm:prefix_cache_queries_total") == engine.pages.queries
    assert value(found, "vllm:prefix_cache_hits_total") == engine.pages.hits
    assert value(found, "vllm:num_preemptions_total") == engine.num_preemptions
    assert sum(m.num_preemptions for m in finished_metrics(outputs)) == engine.num_preemptions
