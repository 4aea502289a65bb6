"""Prompt logprobs: each prompt token's raw log-probability under the model given the tokens before it
(vLLM's `prompt_logprobs`; OpenAI's completions `echo` with `logprobs`), with its rank and the most likely
tokens at its position.

One forward of the main model over the whole prompt (`mtp_jax.decode.step.prompt_logprobs`), apart from the
serving engine's chunked prefill: it costs one more prefill of the prompt, only for requests that ask. The
prompt is padded to a multiple of `BUCKET` tokens (causal attention: the padding changes nothing before it),
so one program is compiled per bucket, the first time a prompt of its length asks.
"""

from __future__ import annotations

import dataclasses
import threading

import jax.numpy as jnp
import numpy as np

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.sharding import to_host

BUCKET = 64  # prompt lengths are padded up to a multiple of this


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Positions 1 .. P - 1 of a prompt of P tokens (position 0 has no logprob: nothing precedes it).

    logprobs: float32 [P - 1], the raw log-softmax at each prompt token. ranks: int32 [P - 1], its rank in the
    distribution there (1 = the most likely; vLLM's). top_ids / top_logprobs: int32 / float32 [P - 1, N], the
    N most likely tokens there, most likely first.
    """

    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class PromptScorer:
    """`PromptLogprobs` with the `max_logprobs` most likely tokens per position, through `engine`'s model (and
    mesh); any thread, one prompt at a time (each holds [P, V] logits)."""

    def __init__(self, engine: DecodeEngine, max_logprobs: int):
        self.engine, self.max_logprobs = engine, int(max_logprobs)
        self._lock = threading.Lock()

    def score(self, prompt: list[int]) -> PromptLogprobs:
        """The logprobs of `prompt` (token ids of the vocabulary, checked by the caller)."""
        padded = np.zeros((1, -(-max(len(prompt), 2) // BUCKET) * BUCKET), np.int32)
        padded[0, : len(prompt)] = prompt
        with self._lock:
            out = self.engine.prompt_logprobs(jnp.asarray(padded), max(self.max_logprobs, 1))
        chosen, ranks, top_ids, top_logprobs = to_host(out)
        n, width = len(prompt) - 1, self.max_logprobs
        return PromptLogprobs(chosen[:n], ranks[:n], top_ids[:n, :width], top_logprobs[:n, :width])
