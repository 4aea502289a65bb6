"""Speculative-decoding metrics as vLLM defines them (`docs/MTP_SPEC.md`, "Metrics").

`SpeculativeCounters` holds per-row counters on device, advanced by every decode step (`count_step`);
`SpeculativeMetrics` pools them over rows on the host. Plain decoding (K = 0) counts steps only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SpeculativeCounters:
    """Per-row counters (device arrays), K drafts per step."""

    num_steps: jax.Array  # int32 [B]: verify steps the row took part in
    num_drafts: jax.Array  # int32 [B]: drafts proposed
    num_accepted: jax.Array  # int32 [B]: drafts accepted and committed
    accepted_per_position: jax.Array  # int32 [B, K]: steps in which draft j was accepted
    accepted_length_histogram: jax.Array  # int32 [B, K + 1]: steps that accepted exactly n drafts

    @classmethod
    def zeros(cls, batch_size: int, num_speculative_tokens: int) -> SpeculativeCounters:
        shapes = dict(
            num_steps=(batch_size,),
            num_drafts=(batch_size,),
            num_accepted=(batch_size,),
            accepted_per_position=(batch_size, num_speculative_tokens),
            accepted_length_histogram=(batch_size, num_speculative_tokens + 1),
        )
        # distinct buffers (the decode state is donated), placed without compiling anything
        return cls(**jax.device_put({name: np.zeros(shape, np.int32) for name, shape in shapes.items()}))

    def count_step(self, active: jax.Array, accepted: jax.Array, num_drafts: int | None = None) -> SpeculativeCounters:
        """The counters after one step in which the `active` rows (bool [B]) each proposed `num_drafts` drafts
        (static; default K) and committed the first `accepted` (int32 [B]) of them (drafts cut by a stop
        condition do not count)."""
        k_max = self.accepted_per_position.shape[1]
        proposed = k_max if num_drafts is None else num_drafts
        counted = jnp.where(active, accepted, 0)
        return SpeculativeCounters(
            num_steps=self.num_steps + active,
            num_drafts=self.num_drafts + proposed * active,
            num_accepted=self.num_accepted + counted,
            accepted_per_position=self.accepted_per_position + (jnp.arange(k_max)[None, :] < counted[:, None]),
            accepted_length_histogram=self.accepted_length_histogram
            + (active[:, None] & (jnp.arange(k_max + 1)[None, :] == counted[:, None])),
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeMetrics:
    """Pooled over rows and steps, as vLLM defines them.

    mean_acceptance_length: 1 + accepted / verify steps (tokens committed per verify step, before
      stop cuts). acceptance_rate_per_position[j]: steps whose draft j + 1 was accepted / steps.
    accepted_length_histogram[n]: verify steps that accepted exactly n drafts.
    """

    num_steps: int
    num_drafts: int
    num_accepted: int
    accepted_per_position: list[int]
    accepted_length_histogram: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else float("nan")

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        return [n / self.num_steps if self.num_steps else float("nan") for n in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

    @classmethod
    def from_counters(cls, metrics: SpeculativeCounters) -> SpeculativeMetrics:
        m = jax.device_get(metrics)
        return cls(
            num_steps=int(m.num_steps.sum()),
            num_drafts=int(m.num_drafts.sum()),
            num_accepted=int(m.num_accepted.sum()),
            accepted_per_position=m.accepted_per_position.sum(0).tolist(),
            accepted_length_histogram=m.accepted_length_histogram.sum(0).tolist(),
        )

    def summary(self) -> str:
        rates = ", ".join(f"{r:.2f}" for r in self.acceptance_rate_per_position)
        return (
            f"mean acceptance length {self.mean_acceptance_length:.2f} over {self.num_steps} verify steps; "
            f"draft acceptance rate {self.draft_acceptance_rate:.2f}; per-position acceptance [{rates}]"
        )
