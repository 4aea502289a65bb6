"""How many drafts each serving step verifies: fixed K, or chosen per step by measurement (adaptive).

Speculation pays when the tokens a step commits grow faster than its cost: a step verifying k drafts
commits 1 + a_1 + ... + a_k tokens per row on average, a_j the probability that its first j drafts are all
accepted, and costs t(k, W), the measured wall time of the step at block-table width W: its program and the
host's handling of what it committed (per step, so larger blocks amortize it). The
adaptive policy (the idea of TensorRT-LLM's acceptance-rate auto-disable and vLLM's per-batch-size K, decided
here from measurements rather than thresholds) picks the k in 0 .. K with the most committed tokens per
second, E_k / t(k, W): K when drafts are accepted often and verifying is cheap, fewer as acceptance falls,
0 (a plain step) when drafts are rarely accepted. A plain step of this policy drafts nothing (the MTP modules
only write their caches, `DecodeEngine.step_with_output(draft_next=False)`), so it costs about what a step
without speculation does; the first step after it that would verify drafts is a plain step that drafts
(`ServingEngine` runs it, untimed, before the chosen k). The step's cost does not depend on how many rows are
running (every step computes all `max_batch` rows), so neither does the choice.

Estimates are exponential moving averages: a_j over the rows' steps that verified at least j drafts, t over
steps of the same (k, W). A variant not yet timed at a width is tried first; after `probe_every` steps, one
step re-measures the variant measured longest ago at that width (a step at K also refreshes the acceptance
of every position), so neither a noisy first timing nor a change in acceptance is kept for ever. Every
variant is compiled at warm-up (one program per k and width), so switching never compiles.
"""

from __future__ import annotations

from collections.abc import Sequence

POLICIES = ("fixed", "adaptive")


class SpeculationPolicy:
    """The number of drafts each step verifies (`choose`) and what the steps showed (`observe`).

    Args:
      policy: "fixed" (always K) or "adaptive" (see the module). num_speculative_tokens: K >= 0.
      smoothing: weight of a new observation in the moving averages, in (0, 1].
      probe_every: steps between re-measurements of the variant measured longest ago.

    Raises ValueError for an unknown policy or bad numbers (naming the argument).
    """

    def __init__(self, policy: str, num_speculative_tokens: int, *, smoothing: float = 0.1, probe_every: int = 50):
        if policy not in POLICIES:
            raise ValueError(f"speculative_policy must be one of {POLICIES}, got {policy!r}")
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        if not isinstance(probe_every, int) or probe_every < 1:
            raise ValueError(f"probe_every must be an int >= 1, got {probe_every!r}")
        self.policy, self.k_max = policy, num_speculative_tokens
        self.smoothing, self.probe_every = smoothing, probe_every
        self.reset()

    def reset(self) -> None:
        """Forgets every measurement (after a warm-up, whose steps' times include compiling)."""
        self.acceptance = [1.0] * self.k_max  # a_j, j = 1 .. K (optimistic until measured)
        self.seconds: dict[tuple[int, int], float] = {}  # (k, width) -> step time
        self._measured: dict[tuple[int, int], int] = {}  # (k, width) -> the step that last measured it
        self._steps, self._since_probe, self._probing = 0, 0, False

    @property
    def variants(self) -> tuple[int, ...]:
        """The k a step may verify: (K,) when fixed, 0 .. K when adaptive."""
        return (self.k_max,) if self.policy == "fixed" or self.k_max == 0 else tuple(range(self.k_max + 1))

    def expected_tokens(self, k: int) -> float:
        """E_k, tokens one row commits in a step verifying k drafts: 1 + a_1 + ... + a_k."""
        return 1.0 + sum(self.acceptance[:k])

    def choose(self, width: int) -> int:
        """k for the next step at block-table width `width` (pages)."""
        if len(self.variants) == 1:
            return self.k_max
        untimed = [k for k in self.variants if (k, width) not in self.seconds]
        if untimed:
            return untimed[-1]
        if self._since_probe >= self.probe_every:
            self._probing = True
            return min(self.variants, key=lambda k: (self._measured[(k, width)], -k))
        return max(self.variants, key=lambda k: (self.expected_tokens(k) / self.seconds[(k, width)], -k))

    def observe(self, k: int, width: int, seconds: float, accepted: Sequence[int]) -> None:
        """One step that verified `k` drafts at `width` took `seconds` and each of its running rows accepted
        `accepted[i]` of them (before stop cuts)."""
        rate = self.smoothing
        key = (k, width)
        self.seconds[key] = seconds if key not in self.seconds else (1 - rate) * self.seconds[key] + rate * seconds
        self._steps += 1
        self._measured[key] = self._steps
        self._since_probe = 0 if self._probing else self._since_probe + 1
        self._probing = False
        if accepted:
            for j in range(k):
                share = sum(a > j for a in accepted) / len(accepted)
                self.acceptance[j] = (1 - rate) * self.acceptance[j] + rate * share
