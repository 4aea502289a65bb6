"""The OpenAI API's response bodies for `/v1/completions` and `/v1/chat/completions`, as plain dicts: whole
responses (`completion_response`, `chat_response`, one `*_choice` per choice of n), streamed chunks (the same
`text_completion` shape; `chat_chunk`, `usage_chunk`), `usage`, and the logprobs objects of both endpoints
(`completion_logprobs`, `chat_logprobs`). Requests: `mtp_jax.serving.protocol`.
"""

from __future__ import annotations

import time

from tokenizers import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_strings(tokenizer: Tokenizer, token_ids: list[int]) -> list[str]:
    """Each token's own text (a character split over tokens shows as U+FFFD in each part)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], offset: int, top: list | None = None
) -> dict:
    """The legacy completions `logprobs` object; `text_offset` counts characters from `offset`; `top`: per
    token its most likely (id, logprob) pairs (`RequestOutput.top_logprobs`), as `top_logprobs` dicts of
    token text -> logprob (None when not asked for: logprobs=0)."""
    tokens = token_strings(tokenizer, token_ids)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    tops = None
    if top:
        tops = [{text: lp for text, (_, lp) in zip(token_strings(tokenizer, [i for i, _ in pairs]), pairs, strict=True)}
                for pairs in top]  # fmt: skip
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], top: list | None = None) -> dict:
    """The chat `logprobs` object; `top`: per token its most likely (id, logprob) pairs, as each entry's
    `top_logprobs` (empty when not asked for)."""

    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    top = top or [[]] * len(token_ids)
    return {
        "content": [
            {
                **entry(t, lp),
                "top_logprobs": [
                    entry(text, value)
                    for text, (_, value) in zip(token_strings(tokenizer, [i for i, _ in pairs]), pairs, strict=True)
                ],
            }
            for t, lp, pairs in zip(token_strings(tokenizer, token_ids), logprobs, top, strict=True)
        ]
    }


def _envelope(kind: str, request_id: str, model: str, created: int | None) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": int(time.time()) if created is None else created,
        "model": model,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: str | int | None, logprobs: dict | None = None
) -> dict:
    """One choice of a `text_completion` object (or of a streamed chunk)."""
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion_response(
    request_id: str, model: str, choices: list[dict], usage_: dict | None, *, created: int | None = None
) -> dict:
    """A `text_completion` object (also each streamed chunk's shape, with `usage` null until the end)."""
    return {**_envelope("text_completion", request_id, model, created), "choices": choices, "usage": usage_}


def chat_choice(
    index: int, text: str, finish_reason: str | None, stop_reason: str | int | None, logprobs: dict | None = None
) -> dict:
    """One choice of a `chat.completion` object."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_response(
    request_id: str, model: str, choices: list[dict], usage_: dict, *, created: int | None = None
) -> dict:
    """A `chat.completion` object."""
    return {**_envelope("chat.completion", request_id, model, created), "choices": choices, "usage": usage_}


def chat_chunk(
    request_id: str,
    model: str,
    delta: dict,
    finish_reason: str | None = None,
    stop_reason: str | int | None = None,
    logprobs: dict | None = None,
    *,
    created: int,
    index: int = 0,
) -> dict:
    """A `chat.completion.chunk` with one choice (choice `index` of n)."""
    choice = {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    return {**_envelope("chat.completion.chunk", request_id, model, created), "choices": [choice], "usage": None}


def usage_chunk(kind: str, request_id: str, model: str, usage_: dict, *, created: int) -> dict:
    """The last streamed chunk with `stream_options.include_usage`: no choices, the usage."""
    return {**_envelope(kind, request_id, model, created), "choices": [], "usage": usage_}
