"""The OpenAI API's request and response shapes for `/v1/completions` and `/v1/chat/completions`.

Requests are pydantic models of OpenAI's fields plus vLLM's `top_k`, `ignore_eos` and
`stop_token_ids`. Fields they do not name are ignored (OpenAI clients send extras); named fields
this server cannot honour are refused (400) rather than ignored:

- `prompt`: a string or a list of token ids; a list holding exactly one of those is taken as that
  prompt, a batch of several prompts is refused ("only one prompt per request"). `n` and
  `best_of`: only 1. `echo`, `suffix`, `logit_bias`, nonzero `presence_penalty` /
  `frequency_penalty`: refused.
- `max_tokens` (chat: `max_completion_tokens`, else `max_tokens`): completions default to 16 as
  OpenAI's; chat defaults to everything the slot holds (the server's max length - prompt).
- `temperature` defaults to 1.0 as OpenAI's (0 = greedy), `top_p` to 1.0, `top_k` to off (0 or -1).
  `seed`: the request's seed in [0, 2**32); without one each request draws a fresh random seed.
- `stop`: a string or a list of at most 4 non-empty strings (OpenAI's limit), excluded from the
  text. `stop_token_ids`: ids that end the output (at most 16 with the EOS ids).
- `logprobs`: completions take an int, only 0 (each chosen token's logprob, `top_logprobs` null);
  chat takes a bool with `top_logprobs` 0 or absent. The logprobs are of the model's raw
  distribution (before temperature and filtering), as vLLM's default.
- `stream` with `stream_options.include_usage`: a last chunk with `usage` and no choices.

Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}` (`error_body`).
Response bodies are plain dicts (`completion_response`, `chat_response` and their chunks).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator
from tokenizers import Tokenizer

from mtp_jax.decode.sampling import SamplingParams

MAX_STOP_STRINGS = 4  # as OpenAI's API


class RequestError(ValueError):
    """A request the server refuses (400 unless `status` says otherwise), naming the parameter."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool | None = False


class _Sampled(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: StrictBool | None = False
    stop_token_ids: list[StrictInt] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n not in (None, 1):
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        return stop

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported (only 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported")
        return value

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens

    def engine_kwargs(self) -> dict:
        """The keyword arguments of `ServingEngine.add_request` (all but the prompt). Raises ValueError /
        TypeError naming the field for a sampling parameter out of range (`SamplingParams`)."""
        top_k = self.top_k or 0
        sampling = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=secrets.randbits(32) if self.seed is None else self.seed,
        )
        return dict(
            max_tokens=self.resolved_max_tokens(),
            sampling=sampling,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Sampled):
    """`POST /v1/completions`."""

    prompt: Any = Field(description="a string or a list of token ids (one prompt)")
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        raise ValueError("prompt must be a string or a list of token ids")

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value):
        if value not in (None, 0):
            raise ValueError(f"only logprobs=0 (the chosen token's logprob) is supported, got {value}")
        return value

    @field_validator("echo", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value and not (info.field_name == "best_of" and value == 1):
            raise ValueError(f"{info.field_name} is not supported")
        return value


class ChatMessage(BaseModel):
    """One message; `content` a string or a list of text parts ({"type": "text", "text": ...})."""

    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the chat template may read them
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined). Raises ValueError for other parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got type {part.get('type')!r}")
            pieces.append(part["text"])
        return "".join(pieces)


class ChatCompletionRequest(_Sampled):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages):
        if not messages:
            raise ValueError("messages must hold at least one message")
        for m in messages:
            m.text()  # refuses non-text parts here, naming the field
        return messages

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value):
        if value not in (None, 0):
            raise ValueError(f"only top_logprobs=0 is supported, got {value}")
        return value

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


# ----------------------------------------------------------------------------------------------
# Responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_strings(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text (a character split over tokens shows as U+FFFD in each part)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], offset: int) -> dict:
    """The legacy completions `logprobs` object; `text_offset` counts characters from `offset`."""
    tokens = token_strings(tokenizer, token_ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float]) -> dict:
    """The chat `logprobs` object (`top_logprobs` empty: only the chosen tokens)."""
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(token_strings(tokenizer, token_ids), logprobs, strict=True)
        ]
    }


def _envelope(kind: str, request_id: str, model: str, created: int | None) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
    }


def completion_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage_: dict | None,
    logprobs: dict | None = None,
    *,
    created: int | None = None,
) -> dict:
    """A `text_completion` object (also each streamed chunk's shape, with `usage` null until the end)."""
    choice = {
        "index": 0,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {**_envelope("text_completion", request_id, model, created), "choices": [choice], "usage": usage_}


def chat_response(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    usage_: dict,
    logprobs: dict | None = None,
    *,
    created: int | None = None,
) -> dict:
    """A `chat.completion` object."""
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {**_envelope("chat.completion", request_id, model, created), "choices": [choice], "usage": usage_}


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
    *,
    created: int,
) -> dict:
    """A `chat.completion.chunk` with one choice."""
    choice = {
        "index": 0,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {**_envelope("chat.completion.chunk", request_id, model, created), "choices": [choice], "usage": None}


def usage_chunk(kind: str, request_id: str, model: str, usage_: dict, *, created: int) -> dict:
    """The last streamed chunk with `stream_options.include_usage`: no choices, the usage."""
    return {**_envelope(kind, request_id, model, created), "choices": [], "usage": usage_}
