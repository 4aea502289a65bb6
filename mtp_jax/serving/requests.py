"""A served request on the host: what it asked for, what it received, and its stop conditions."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer

from mtp_jax.config import ModelConfig
from mtp_jax.decode.request import check_min_tokens, check_request
from mtp_jax.decode.sampling import SamplingParams
from mtp_jax.decode.text import TextStream
from mtp_jax.serving.grammar import GrammarMatcher
from mtp_jax.serving.outputs import RequestMetrics, RequestOutput
from mtp_jax.validation import is_integer


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
    admitted: int = -1  # admission order (the newest is preempted first)
    pages_final: int = 0  # leading positions already offered to the prefix cache
    num_logprobs: int = 0  # most likely tokens reported per output token (OpenAI's top_logprobs)
    include_stop_str_in_output: bool = False  # a matched stop string ends the text after it, not before
    grammar: GrammarMatcher | None = None  # structured output: where the output is in its grammar
    drafts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))  # its row's next drafts

    @property
    def length(self) -> int:
        """L, the committed tokens of its row: prompt and everything received."""
        return len(self.prompt) + len(self.token_ids)

    @classmethod
    def checked(
        cls,
        config: ModelConfig,
        prompt: Sequence[int],
        *,
        max_length: int,
        max_tokens: int | None,
        sampling: SamplingParams | None,
        stop_token_ids: Iterable[int],
        ignore_eos: bool,
        stop: Iterable[str],
        tokenizer: Tokenizer | None,
        oracle: bool,
        oracle_tokens: Sequence[int] | None,
        num_speculative_tokens: int,
        num_logprobs: int = 0,
        max_logprobs: int = 0,
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> ServedRequest:
        """A request checked as `ServingEngine.add_request` documents (its arguments, raising its errors),
        not yet given its id and arrival time."""
        eos = [] if ignore_eos else list(config.eos_token_ids)
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {stop_token_ids!r}")
        checked = check_request(
            config,
            [prompt],
            max_new_tokens=2**31 - 1 if max_tokens is None else max_tokens,  # (None: min_tokens checked below)
            sampling=sampling,
            max_length=max_length,
            stop_tokens=eos + list(stop_token_ids),
        )
        prompt = checked.prompts[0]
        room = max_length - len(prompt)
        max_tokens = room if max_tokens is None else checked.max_new_tokens[0]
        check_min_tokens(checked.sampling[0], max_tokens)
        if max_tokens > room:
            raise ValueError(
                f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt)} tokens and a slot "
                f"holds max_length={max_length} (prompt + max_tokens <= {max_length})"
            )
        if isinstance(stop, str) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a list of strings, got {stop!r}")
        stop = tuple(s for s in stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer (ServingEngine(tokenizer=...))")
        for name, flag in (
            ("skip_special_tokens", skip_special_tokens),
            ("include_stop_str_in_output", include_stop_str_in_output),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if not is_integer(num_logprobs) or not 0 <= num_logprobs <= max_logprobs:
            raise ValueError(
                f"logprobs must be an int in 0 .. {max_logprobs} (the engine's max_logprobs), got {num_logprobs!r}"
            )
        if oracle != (oracle_tokens is not None):
            raise ValueError("oracle_tokens is required with speculative method 'oracle' and only there")
        if oracle:
            oracle_tokens = np.asarray(oracle_tokens)
            if (
                oracle_tokens.ndim != 1
                or not np.issubdtype(oracle_tokens.dtype, np.integer)
                or len(oracle_tokens) > max_length
            ):
                raise ValueError(f"oracle_tokens must be at most max_length={max_length} int token ids")
        return cls(
            id="",
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=checked.sampling[0],
            stop_token_ids=checked.stop_tokens,
            eos_ids=frozenset(eos),
            stop=stop,
            oracle_tokens=oracle_tokens,
            metrics=RequestMetrics(arrival_time=0.0, num_speculative_tokens=num_speculative_tokens),
            text=None if tokenizer is None else TextStream(tokenizer, skip_special_tokens=skip_special_tokens),
            num_logprobs=int(num_logprobs),
            include_stop_str_in_output=include_stop_str_in_output,
        )

    def take(self, tokens: list[int], now: float) -> int:
        """Appends `tokens` (one step's committed block) up to the first stop condition, which sets
        `finish_reason` ("stop" or "length") and `stop_reason`; returns how many it took."""
        taken = 0
        stop_ids = set(self.stop_token_ids)
        longest = max((len(s) for s in self.stop), default=0)
        for token in tokens:
            taken += 1
            self.token_ids.append(token)
            if self.grammar is not None and self.grammar.accept([token]) != 1 and not self.grammar.is_terminated:
                raise RuntimeError(f"token {token} breaks the request's grammar: its masks were not applied")
            if token in stop_ids:
                self.finish_reason, self.stop_reason = "stop", (None if token in self.eos_ids else token)
                break
            if self.text is not None:
                searched = max(0, len(self.text.text) - longest + 1)
                self.text.push([token])
                if self.stop and len(self.token_ids) > self.sampling.min_tokens:  # (vLLM's: not before min_tokens)
                    hits = [(i, s) for s in self.stop if (i := self.text.text.find(s, searched)) >= 0]
                    if hits:
                        self.text_end, self.stop_reason = min(hits)
                        if self.include_stop_str_in_output:
                            self.text_end += len(self.stop_reason)
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
        piece = self.text.text[self.text_sent : max(end, self.text_sent)]
        self.text_sent = max(end, self.text_sent)
        return piece

    def output(
        self,
        tokens,
        logprobs,
        text: str,
        num_committed: int,
        num_accepted: int,
        num_drafts: int = 0,
        top_logprobs=(),
    ) -> RequestOutput:
        """What it receives now: `tokens`, their logprobs, their `top_logprobs` and `text`, from a step that
        verified `num_drafts` drafts and committed `num_committed` tokens, `num_accepted` of them accepted
        drafts."""
        return RequestOutput(
            request_id=self.id,
            token_ids=tokens,
            logprobs=logprobs,
            text=text,
            num_committed=num_committed,
            num_accepted=num_accepted,
            prompt_tokens=len(self.prompt),
            completion_tokens=len(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            metrics=self.metrics,
            num_drafts=num_drafts,
            top_logprobs=list(top_logprobs),
        )
