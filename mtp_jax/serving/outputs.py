"""What a served request receives (`RequestOutput`, one per engine step it took part in) and its
timeline and speculation counts (`RequestMetrics`): `mtp_jax.serving.scheduler`'s results."""

from __future__ import annotations

import dataclasses
import itertools

FINISH_REASONS = ("stop", "length", "abort")


@dataclasses.dataclass
class RequestMetrics:
    """One request's timeline (seconds of `ServingEngine.clock`) and its speculation counts.

    token_times[i] is when the i-th batch of tokens reached the request (the prefill's first token,
    then one entry per decode step that committed some); committed_per_step[i] how many tokens it
    brought (1 .. K+1). num_drafts counts proposed draft tokens (K per decode step), num_accepted
    the accepted ones that were emitted, accepted_per_position[j] the steps whose draft j+1 was.
    num_preemptions: times it gave up its KV pages to let older requests grow (`ServingEngine`).
    num_cached_tokens: prompt tokens whose KV came from the prefix cache, at its (last) admission.
    """

    arrival_time: float
    num_speculative_tokens: int
    scheduled_time: float | None = None  # its prefill began
    token_times: list[float] = dataclasses.field(default_factory=list)
    committed_per_step: list[int] = dataclasses.field(default_factory=list)
    finished_time: float | None = None
    num_steps: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def count_step(self, num_drafts: int, num_accepted: int) -> None:
        """One decode step that proposed `num_drafts` drafts, of which the first `num_accepted` were emitted."""
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first token's arrival."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def num_tokens(self) -> int:
        return sum(self.committed_per_step)

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (last token time - first) / (tokens - 1)."""
        n = self.num_tokens
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def inter_token_latencies(self) -> list[float]:
        """Seconds between consecutive arrivals of tokens (one per decode step that brought some)."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per decode step (1 + accepted drafts / steps), vLLM's definition."""
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else float("nan")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one request received in one engine step (`ServingEngine.step`).

    token_ids / logprobs: the new tokens (and their raw logprobs) handed to the request: exactly
    `num_committed` of them unless a stop string cut the block (then fewer, and `finished`). text:
    the new text ("" without a tokenizer; held back while it may be the start of a stop string).
    finish_reason: None while running, else "stop" (a stop token or string), "length"
    (max_tokens) or "abort". stop_reason: the stop string or stop token id that matched (None for
    EOS, as vLLM). metrics: the request's `RequestMetrics` (complete once finished). num_drafts: the
    drafts its decode step verified (K, or what adaptive speculation chose; 0 for a prefill's token).
    top_logprobs: per new token, the request's `logprobs` most likely tokens at its position as (token id,
    raw logprob) pairs, most likely first (empty when it asked for none).
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    text: str
    num_committed: int
    num_accepted: int
    prompt_tokens: int
    completion_tokens: int  # emitted so far, these included
    finish_reason: str | None
    stop_reason: str | int | None
    metrics: RequestMetrics
    num_drafts: int = 0
    top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
