"""How to speculate: `SpeculativeConfig`, the static half of MTP speculative decoding.

The methods (TensorRT-LLM's MTP design, "DeepSeek R1 MTP Implementation and Optimization", with the
semantics of `docs/MTP_SPEC.md`): MTP Vanilla (D distinct modules), MTP Eagle (module 1 reused),
Gloeckle et al.'s parallel heads, and an oracle for benchmarks. `mtp_jax.decode.drafters` drafts
by it; `mtp_jax.decode.acceptance` accepts by it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from mtp_jax.validation import is_int, is_real

if TYPE_CHECKING:
    from mtp_jax.model import Transformer

METHODS = ("vanilla", "eagle", "parallel", "oracle")
MAX_SPECULATIVE_TOKENS = 16  # the largest K a SpeculativeConfig accepts (see its docstring)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """How to speculate. Hashable: it is a static argument of the jitted step.

    method: "vanilla" (D distinct modules, K <= D), "eagle" (module 1 reused, any K),
      "parallel" (Gloeckle et al. heads, K <= D), or "oracle" (benchmarks: drafts replay the
      `oracle_tokens` given to `mtp_jax.decode.engine.init_state`, e.g. plain greedy output, so every
      draft is accepted; needs no MTP modules, greedy drafts only).
    num_speculative_tokens: K, drafts per step, an int in [1, MAX_SPECULATIVE_TOKENS = 16]. Every
      step verifies K + 1 tokens whatever is accepted, and draft j is kept only if drafts 1..j all
      are, so acceptance decays geometrically with j: with the per-position rates measured here
      (0.5-0.9) a 16th draft is almost never committed, while its cost (a wider verify forward,
      K MTP passes, draft_probs of [B, K, V]) is paid every step. The benchmarks use K <= 8.
    draft_sampling: "greedy" (drafts are the MTP argmax; q is one-hot) or "sample" (drafts drawn
      from the MTP distribution after the row's temperature/top-k/top-p; q is that distribution).
    relaxed_top_n, relaxed_delta: TensorRT-LLM's relaxed acceptance, on when relaxed_top_n > 0:
      in a row's thinking phase a draft is accepted if it is among the top-N target tokens and its
      probability is >= p(top1) - delta (softmax of the raw logits). Greedy rows only.
    think_start_token_id, think_end_token_id: the ids of `<think>` and `</think>`; required with
      relaxed acceptance (take them from the tokenizer; nothing is hard-coded).
    draft_vocab: None (the drafts range over the whole vocabulary) or the token ids the drafts are
      drawn from (FR-Spec, Zhao et al. 2025; EAGLE-3's reduced draft vocabulary; SGLang's
      `speculative_token_map`: the most frequent tokens of a corpus): each MTP pass's head then
      multiplies by those N columns of the output head instead of all V (`DecodeEngine` gathers them
      once), the head being most of an MTP pass's cost when V is large. Lossless as before: the
      verify pass and acceptance are unchanged, a draft outside the set is never proposed (its
      q is 0). Any sequence of distinct ints, stored sorted as a tuple; not with method "oracle".

    Integer fields take Python or NumPy ints (a bool is not an int). Raises TypeError for a field
    of the wrong type and ValueError for one out of range, naming the field.
    """

    method: str = "eagle"
    num_speculative_tokens: int = 3
    draft_sampling: str = "greedy"
    relaxed_top_n: int = 0
    relaxed_delta: float = 0.0
    think_start_token_id: int | None = None
    think_end_token_id: int | None = None
    draft_vocab: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "relaxed_top_n", "think_start_token_id", "think_end_token_id"):
            value = getattr(self, name)
            if value is None and name.startswith("think"):
                continue
            if not is_int(value):
                raise TypeError(f"{name} must be an int, got {value!r}")
            object.__setattr__(self, name, int(value))  # NumPy ints become ints: the config is a static arg
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens!r}"
            )
        if self.draft_sampling not in ("greedy", "sample"):
            raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {self.draft_sampling!r}")
        if self.relaxed_top_n < 0:
            raise ValueError(f"relaxed_top_n must be >= 0 (0 = relaxed acceptance off), got {self.relaxed_top_n}")
        if not is_real(self.relaxed_delta):
            raise TypeError(f"relaxed_delta must be a number, got {self.relaxed_delta!r}")
        if not (np.isfinite(self.relaxed_delta) and self.relaxed_delta >= 0):
            raise ValueError(f"relaxed_delta must be a finite number >= 0, got {self.relaxed_delta!r}")
        if self.method == "oracle" and self.draft_sampling != "greedy":
            raise ValueError("method 'oracle' replays given tokens: draft_sampling must be 'greedy'")
        if self.relaxed and (self.think_start_token_id is None or self.think_end_token_id is None):
            raise ValueError("relaxed acceptance needs think_start_token_id and think_end_token_id")
        if self.draft_vocab is not None:
            object.__setattr__(self, "draft_vocab", _token_ids("draft_vocab", self.draft_vocab))
            if self.method == "oracle":
                raise ValueError("method 'oracle' replays given tokens: draft_vocab does not apply")
        # jit hashes this static argument on every call: a long draft_vocab is hashed once, here
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_flags(
        cls, method: str, num_speculative_tokens: int | None, model: Transformer, draft_vocab=None
    ) -> SpeculativeConfig | None:
        """The CLI's `--speculative METHOD --num-speculative-tokens K [--draft-vocab FILE]`: None for
        method "none"; K defaults to 3 for eagle, else to the model's MTP modules (at least 1)."""
        if method == "none":
            if draft_vocab is not None:
                raise ValueError("draft_vocab: drafts need speculative decoding; --speculative is none")
            return None
        k = num_speculative_tokens
        if k is None:
            k = 3 if method == "eagle" else max(model.config.num_nextn_predict_layers, 1)
        return cls(method=method, num_speculative_tokens=k, draft_vocab=draft_vocab)

    @property
    def relaxed(self) -> bool:
        return self.relaxed_top_n > 0

    def check_model(self, model: Transformer, vocab_size: int) -> None:
        """Raises ValueError when the model cannot serve this configuration."""
        c, k = model.config, self.num_speculative_tokens
        depth = c.num_nextn_predict_layers
        if self.method != "oracle" and depth == 0:
            raise ValueError("the model has no MTP modules (num_nextn_predict_layers = 0): cannot speculate")
        if self.method == "parallel" and c.mtp_style != "parallel":
            raise ValueError(f"method 'parallel' needs parallel heads, the model has mtp_style={c.mtp_style!r}")
        if self.method in ("vanilla", "eagle") and c.mtp_style != "deepseek":
            raise ValueError(
                f"method {self.method!r} needs DeepSeek-style MTP modules, the model has "
                f"mtp_style={c.mtp_style!r}; use method='parallel'"
            )
        if self.method in ("vanilla", "parallel") and k > depth:
            raise ValueError(
                f"method {self.method!r} drafts one token per module: num_speculative_tokens={k} "
                f"exceeds the model's {depth} MTP modules (use method='eagle' for K > D)"
            )
        if self.relaxed_top_n > vocab_size:
            raise ValueError(f"relaxed_top_n={self.relaxed_top_n} exceeds vocab_size={vocab_size}")
        for name in ("think_start_token_id", "think_end_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < vocab_size:
                raise ValueError(f"{name}={value} is outside [0, vocab_size={vocab_size})")
        if self.draft_vocab is not None and self.draft_vocab[-1] >= vocab_size:
            raise ValueError(f"draft_vocab holds token {self.draft_vocab[-1]}, outside [0, vocab_size={vocab_size})")

    @property
    def num_caches(self) -> int:
        """MTP caches the drafter keeps: one (eagle), one per module (vanilla, parallel), none (oracle)."""
        return {"eagle": 1, "oracle": 0}.get(self.method, self.num_speculative_tokens)

    @property
    def hidden_window(self) -> int:
        """Positions of main hidden states kept between steps (vanilla only)."""
        return 2 * self.num_speculative_tokens if self.method == "vanilla" else 0


def _token_ids(name: str, ids) -> tuple[int, ...]:
    """`ids` (a sequence or 1-D array of distinct non-negative ints) as a sorted tuple of ints; TypeError or
    ValueError naming `name` otherwise."""
    if hasattr(ids, "__array__"):  # NumPy / JAX arrays: one conversion, not an element at a time
        array = np.asarray(ids)
        if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or array.size == 0):
            raise TypeError(f"{name} must be a 1-D array of int token ids, got {array.dtype}{list(array.shape)}")
        ids = array.tolist()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(ids).__name__}")
    if any(not is_int(i) for i in ids):
        raise TypeError(f"{name} must hold ints, got {next(i for i in ids if not is_int(i))!r}")
    out = tuple(sorted(int(i) for i in ids))
    if not out:
        raise ValueError(f"{name} is empty: give at least one token id (or None for the whole vocabulary)")
    if out[0] < 0:
        raise ValueError(f"{name} holds {out[0]}: token ids are >= 0")
    repeated = sorted({a for a, b in zip(out, out[1:], strict=False) if a == b})
    if repeated:
        raise ValueError(f"{name} repeats token ids {repeated[:5]}{' ...' if len(repeated) > 5 else ''}")
    return out
