"""Prometheus metrics of the serving engine, under vLLM's names (v1 engine), for `/metrics`.

`PrometheusMetrics` is the `stats=` listener of `ServingEngine`: the engine calls `on_finished(out)`
for each request that finished in a step, then `on_step(engine, outputs)` once per step, and
`render()` returns the text exposition format (`CONTENT_TYPE`). Each instance owns its
`CollectorRegistry` (never prometheus_client's global one), so engines and tests never collide.
Every metric has the labels `model_name` and `engine` ("0"), as vLLM's.

Names and sources (vLLM: `vllm/v1/metrics/loggers.py`, `vllm/v1/metrics/stats.py`,
`vllm/v1/spec_decode/metrics.py`):

- gauges, set after every step: `vllm:num_requests_running` (`ServingEngine.num_running`: prefilling
  or holding a slot), `vllm:num_requests_waiting` (`num_waiting`), `vllm:kv_cache_usage_perc`
  (`kv_cache_usage`: KV pages held by requests / all pages, 0..1).
- cache and scheduler counters, from the engine's totals after every step: `vllm:prefix_cache_queries_total`
  and `vllm:prefix_cache_hits_total` (prompt tokens looked up in the prefix cache at admission, and those
  whose KV it supplied: `ServingEngine.pages.queries` / `.hits`), `vllm:num_preemptions_total`
  (`ServingEngine.num_preemptions`).
- counters, per step from the step's outputs (vLLM counts per iteration):
  `vllm:prompt_tokens_total` (a request's prompt, at its first token, as vLLM counts it when the
  prefill completes), `vllm:generation_tokens_total` (the tokens handed to requests: tokens cut
  after a stop string or a stop token are not generated), `vllm:request_success_total
  {finished_reason="stop"|"length"|"abort"}` (at finish; every reason exported from zero, as vLLM).
- speculative decoding counters, only when K > 0 (as vLLM, which creates them only with a
  speculative config). A *decode output* is one a decode step produced: it brought tokens
  (`num_committed` > 0) to a request that had some already (its first token comes from the prefill,
  with no drafts). Per decode output that verified k > 0 drafts (`RequestOutput.num_drafts`: K, or what
  adaptive speculation chose): `vllm:spec_decode_num_drafts_total` += 1,
  `vllm:spec_decode_num_draft_tokens_total` += k, `vllm:spec_decode_num_accepted_tokens_total` +=
  `num_accepted`, `vllm:spec_decode_num_accepted_tokens_per_pos_total{position=j}` += 1 for each
  j < `num_accepted`. These equal the sums over requests of `RequestMetrics.num_steps`,
  `num_drafts`, `num_accepted` and `accepted_per_position` (the engine advances both from the same
  step). One difference from vLLM: `num_accepted` counts the accepted drafts that were *emitted*
  (a stop condition inside the accepted block cuts the rest), vLLM counts them before its stop
  checks. So per step committed = accepted + 1 except when a cut dropped the bonus token, and
  generation_tokens = requests with a first token + drafts + accepted - (steps cut before the
  bonus). mean acceptance length = 1 + accepted / drafts. A gauge of ours, `mtp_jax:num_speculative_tokens`:
  the k the last decode step verified.
- histograms, with vLLM's buckets: `vllm:time_to_first_token_seconds` (at the first token:
  `RequestMetrics.ttft`), `vllm:inter_token_latency_seconds` (per decode output: the time since the
  request's previous tokens, one sample per step, however many tokens it brought, as vLLM);
  at finish: `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds` (arrival to
  prefill start; requests aborted while waiting have none), `vllm:request_prefill_time_seconds`,
  `vllm:request_decode_time_seconds`, `vllm:request_inference_time_seconds` (prefill start, first
  token, last token: those with a first token), `vllm:request_time_per_output_token_seconds`
  (`RequestMetrics.tpot`, 0 for requests with fewer than 2 tokens, as vLLM),
  `vllm:request_prompt_tokens`, `vllm:request_generation_tokens` (every finished request, aborted
  ones included). Times are seconds of the engine's `clock`.

So `prompt_tokens_total` and `request_prompt_tokens_sum` differ by the prompts of requests aborted
before their first token; otherwise the counters equal the sums of the per-request histograms.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mtp_jax.serving.outputs import FINISH_REASONS, RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets of token counts)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class PrometheusMetrics:
    """The serving engine's metrics in their own registry; a `ServingEngine(stats=...)` listener.

    Args:
      model_name: the `model_name` label (the served model name).
      num_speculative_tokens: K; the speculative decoding counters exist only when K > 0.
      max_model_len: the largest bucket bound of the token-count histograms (vLLM's
        `build_1_2_5_buckets(max_model_len)`), default 65536.

    Thread use: `render` may run in any thread while `step` (and so `on_step`) runs in another;
    prometheus_client's metrics are thread-safe. The module docstring lists each metric's source.
    """

    def __init__(self, model_name: str, num_speculative_tokens: int, *, max_model_len: int = 65536):
        if not isinstance(num_speculative_tokens, int) or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {num_speculative_tokens!r}")
        self.model_name, self.num_speculative_tokens = str(model_name), num_speculative_tokens
        self.registry = CollectorRegistry()
        labels, values = ("model_name", "engine"), (self.model_name, "0")

        def metric(cls, name, doc, **kwargs):
            return cls(name, doc, labelnames=labels, registry=self.registry, **kwargs).labels(*values)

        def histogram(name, doc, buckets):
            return metric(Histogram, name, doc, buckets=buckets)

        self.num_requests_running = metric(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = metric(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = metric(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = metric(
            Counter, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_cache_hits = metric(
            Counter, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = metric(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self._engine_totals = (0, 0, 0)  # the engine's (queries, hits, preemptions) at the last step
        self.prompt_tokens = metric(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = metric(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames=labels + ("finished_reason",),
            registry=self.registry,
        )
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )

        if num_speculative_tokens:
            self.spec_decode_num_drafts = metric(
                Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."
            )
            self.spec_decode_num_draft_tokens = metric(
                Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."
            )
            self.spec_decode_num_accepted_tokens = metric(
                Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."
            )
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labelnames=labels + ("position",),
                registry=self.registry,
            )
            self.spec_decode_num_accepted_tokens_per_pos = [
                per_pos.labels(*values, str(j)) for j in range(num_speculative_tokens)
            ]
            self.speculative_tokens = metric(
                Gauge, "mtp_jax:num_speculative_tokens", "Draft tokens the last decode step verified (K, or adaptive)."
            )

    # ------------------------------------------------------------------------------------------
    # The engine's listener

    def on_step(self, engine, outputs: list[RequestOutput]) -> None:
        """Counts one engine step's outputs and sets the gauges from `engine` (a `ServingEngine`)."""
        for out in outputs:
            new = len(out.token_ids)
            if not new:
                continue
            self.generation_tokens.inc(new)
            m = out.metrics
            if out.completion_tokens == new:  # the request's first tokens: its prefill completed
                self.prompt_tokens.inc(out.prompt_tokens)
                self.time_to_first_token.observe(m.ttft)
            elif out.num_committed:  # a decode step
                self.inter_token_latency.observe(m.token_times[-1] - m.token_times[-2])
                if out.num_drafts:  # (none in a plain step of adaptive speculation)
                    self.spec_decode_num_drafts.inc()
                    self.spec_decode_num_draft_tokens.inc(out.num_drafts)
                    self.spec_decode_num_accepted_tokens.inc(out.num_accepted)
                    for counter in self.spec_decode_num_accepted_tokens_per_pos[: out.num_accepted]:
                        counter.inc()
        self.num_requests_running.set(engine.num_running)
        self.num_requests_waiting.set(engine.num_waiting)
        self.kv_cache_usage.set(engine.kv_cache_usage)
        if self.num_speculative_tokens:
            self.speculative_tokens.set(engine.last_num_drafts)
        totals = (engine.pages.queries, engine.pages.hits, engine.num_preemptions)
        counters = (self.prefix_cache_queries, self.prefix_cache_hits, self.num_preemptions)
        for counter, now, before in zip(counters, totals, self._engine_totals, strict=True):
            counter.inc(now - before)
        self._engine_totals = totals

    def on_finished(self, out: RequestOutput) -> None:
        """Per-request values of a finished request (its `RequestMetrics` are complete)."""
        m = out.metrics
        self.request_success[out.finish_reason].inc()
        if m.e2e_latency is not None:
            self.e2e_request_latency.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.request_queue_time.observe(m.queue_time)
        if m.token_times and m.scheduled_time is not None:
            self.request_prefill_time.observe(m.token_times[0] - m.scheduled_time)
            self.request_decode_time.observe(m.token_times[-1] - m.token_times[0])
            self.request_inference_time.observe(m.token_times[-1] - m.scheduled_time)
        tpot = m.tpot
        self.request_time_per_output_token.observe(0.0 if tpot is None else tpot)
        self.request_prompt_tokens.observe(out.prompt_tokens)
        self.request_generation_tokens.observe(out.completion_tokens)

    # ------------------------------------------------------------------------------------------
    # Exposition

    def render(self) -> bytes:
        """The registry in Prometheus' text format (serve with `CONTENT_TYPE`), without the
        `*_created` timestamps prometheus_client adds to counters and histograms (creation times,
        not measurements; dropped here per registry, not process-wide)."""
        return generate_latest(_WithoutCreated(self.registry))


class _WithoutCreated:
    """A collector view of `registry` whose families drop their `*_created` samples."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
