"""The OpenAI API's response bodies for `/v1/completions` and `/v1/chat/completions`, as plain dicts: whole
responses (`completion_response`, `chat_response`, one `*_choice` per choice of n), streamed chunks (the same
`text_completion` shape; `chat_chunk`, `usage_chunk`), `usage`, and the logprobs objects of both endpoints
(`completion_logprobs`, `chat_logprobs`; an echoed prompt's, `echoed_logprobs`; vLLM's `prompt_logprobs`).
Requests: `mtp_jax.serving.protocol`.
"""

from __future__ import annotations

import time

from tokenizers import Tokenizer

from mtp_jax.serving.scoring import PromptLogprobs


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


def prompt_logprobs(tokenizer: Tokenizer, prompt: list[int], scores: PromptLogprobs, num: int) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict of token id ->
    {logprob, rank, decoded_token} holding it and the `num` most likely tokens there."""

    def entry(token: int, logprob: float, rank: int) -> dict:
        return {
            "logprob": float(logprob),
            "rank": int(rank),
            "decoded_token": tokenizer.decode([int(token)], skip_special_tokens=False),
        }

    out: list = [None]
    for j, token in enumerate(prompt[1:]):
        ids, values = scores.top_ids[j, :num], scores.top_logprobs[j, :num]
        position = {str(int(i)): entry(i, v, r + 1) for r, (i, v) in enumerate(zip(ids, values, strict=True))}
        position[str(int(token))] = entry(token, scores.logprobs[j], scores.ranks[j])
        out.append(position)
    return out


def echoed_logprobs(tokenizer: Tokenizer, prompt: list[int], scores: PromptLogprobs, num: int) -> dict:
    """The legacy completions `logprobs` object of an echoed prompt (OpenAI's `echo` with `logprobs` n): the
    first token's logprob and top logprobs null, the rest as `completion_logprobs`, text offsets from 0."""
    top = [
        list(zip(scores.top_ids[j, :num].tolist(), scores.top_logprobs[j, :num].tolist(), strict=True))
        for j in range(len(prompt) - 1)
    ]
    body = completion_logprobs(tokenizer, prompt, [None, *scores.logprobs.tolist()], 0, [[], *top] if num else None)
    if body["top_logprobs"] is not None:
        body["top_logprobs"][0] = None
    return body


def joined_logprobs(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy `logprobs` objects one after the other (the second's text offsets already follow the first)."""
    if first is None or second is None:
        return second if first is None else first
    tops = None if first["top_logprobs"] is None else first["top_logprobs"] + (second["top_logprobs"] or [])
    return {key: tops if key == "top_logprobs" else first[key] + second[key] for key in first}


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
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: str | int | None,
    logprobs: dict | None = None,
    prompt_logprobs_: list | None = None,
) -> dict:
    """One choice of a `text_completion` object (or of a streamed chunk); `prompt_logprobs` only when asked."""
    choice = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }
    if prompt_logprobs_ is not None:
        choice["prompt_logprobs"] = prompt_logprobs_
    return choice


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
    request_id: str,
    model: str,
    choices: list[dict],
    usage_: dict,
    *,
    created: int | None = None,
    prompt_logprobs_: list | None = None,
) -> dict:
    """A `chat.completion` object (vLLM's `prompt_logprobs` on it when asked)."""
    response = {**_envelope("chat.completion", request_id, model, created), "choices": choices, "usage": usage_}
    if prompt_logprobs_ is not None:
        response["prompt_logprobs"] = prompt_logprobs_
    return response


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
