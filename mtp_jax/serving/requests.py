"""A served request on the host: what it asked for, what it received, and its stop conditions."""

from __future__ import annotations

import dataclasses

import numpy as np

from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.text import TextStream
from mtp_jax.serving.outputs import RequestMetrics


@dataclasses.dataclass
class ServedRequest:
    """One request on its way through the scheduler: what it asked for and what it has received.

    Its stop conditions are applied here, token by token, on the host: a stop token (kept in
    `token_ids`, not in the text), a stop string completed in the detokenized text (which ends the
    text where the string starts), `max_tokens`. The device has already cut the block at stop tokens
    and `max_tokens`; stop strings exist only here.
    """

    id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_token_ids: list[int]  # device stops: EOS (unless ignored) and the request's
    eos_ids: frozenset[int]
    stop: tuple[str, ...]
    metrics: RequestMetrics
    text: TextStream | None
    oracle_tokens: np.ndarray | None
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text_sent: int = 0  # characters of `text.text` already handed out
    slot: int | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_end: int | None = None  # where a stop string cut the text

    def take(self, tokens: list[int], now: float) -> int:
        """Appends `tokens` (one step's committed block) up to the first stop condition, which sets
        `finish_reason` ("stop" or "length") and `stop_reason`; returns how many it took."""
        taken = 0
        stop_ids = set(self.stop_token_ids)
        longest = max((len(s) for s in self.stop), default=0)
        for token in tokens:
            taken += 1
            self.token_ids.append(token)
            if token in stop_ids:
                self.finish_reason, self.stop_reason = "stop", (None if token in self.eos_ids else token)
                break
            if self.text is not None:
                searched = max(0, len(self.text.text) - longest + 1)
                self.text.push([token])
                if self.stop:
                    hits = [(i, s) for s in self.stop if (i := self.text.text.find(s, searched)) >= 0]
                    if hits:
                        self.text_end, self.stop_reason = min(hits)
                        self.finish_reason = "stop"
                        break
            if len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
                break
        if taken:
            self.metrics.token_times.append(now)
            self.metrics.committed_per_step.append(taken)
        return taken

    def text_delta(self) -> str:
        """The text not handed out yet: while unfinished, all but what may still start a stop string;
        once finished, up to a stop string's start, or everything (`TextStream.finish`)."""
        if self.text is None:
            return ""
        if self.finish_reason is None:
            end = len(self.text.text) - max(max((len(s) for s in self.stop), default=0) - 1, 0)
        elif self.text_end is not None:
            end = self.text_end
        else:
            self.text.finish()  # what DecodeStream held back at the end
            end = len(self.text.text)
        piece = self.text.text[self.text_sent: max(end, self.text_sent)]
        self.text_sent = max(end, self.text_sent)
        return piece
