"""The speculative-decoding metrics (`mtp_jax.decode.metrics`): per-row counters summarised by hand. (That the
counters a generation keeps match its acceptances is checked in `test_drafters`.)"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mtp_jax.decode.metrics import SpeculativeCounters, SpeculativeMetrics


def test_metrics_by_hand():
    """K = 4. Row 0 accepts 0, 2 and 4 drafts in three steps, row 1 accepts 1 in one step."""
    metrics = SpeculativeCounters(
        num_steps=jnp.int32([3, 1]),
        num_drafts=jnp.int32([12, 4]),
        num_accepted=jnp.int32([6, 1]),
        accepted_per_position=jnp.int32([[2, 2, 1, 1], [1, 0, 0, 0]]),
        accepted_length_histogram=jnp.int32([[1, 0, 1, 0, 1], [0, 1, 0, 0, 0]]),
    )
    row0 = SpeculativeMetrics.from_counters(jax.tree.map(lambda x: x[:1], metrics))
    assert row0.mean_acceptance_length == 3.0
    assert row0.acceptance_rate_per_position == [2 / 3, 2 / 3, 1 / 3, 1 / 3]
    assert row0.draft_acceptance_rate == 0.5 and row0.accepted_length_histogram == [1, 0, 1, 0, 1]
    pooled = SpeculativeMetrics.from_counters(metrics)  # pooled over rows, not an average of row means (2.5)
    assert pooled.mean_acceptance_length == 1 + 7 / 4 and pooled.num_steps == 4 and pooled.num_drafts == 16
    assert pooled.acceptance_rate_per_position == [3 / 4, 2 / 4, 1 / 4, 1 / 4]
    assert pooled.accepted_length_histogram == [1, 1, 1, 0, 1]
    assert "mean acceptance length 2.75" in pooled.summary()
    assert math.isnan(SpeculativeMetrics(0, 0, 0, [0], [0, 0]).mean_acceptance_length)
