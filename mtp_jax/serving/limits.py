"""What a request may hold, checked before the work it would cause (`PromptLimits`: prompt length in ids
and characters, logprobs asked for; `check_unicode`), and how a refusal reads: `RequestError` (400 unless
said otherwise, naming the field) with OpenAI's error body (`error_body`), quoting what the client sent in
at most ~100 ASCII characters (`short_json`). The request models that apply them: `mtp_jax.serving.protocol`.
"""

from __future__ import annotations

import dataclasses
import json

from tokenizers import Tokenizer


def short_json(value, depth: int = 2) -> str:
    """A JSON value for an error message, in ASCII and at most ~100 characters, whatever the client sent:
    long strings, lists and objects are cut ("...")."""
    if isinstance(value, str):
        text = json.dumps(value[:40]) + ("..." if len(value) > 40 else "")
    elif isinstance(value, list):
        items = [short_json(v, depth - 1) for v in value[:3]] if depth > 0 else []
        text = "[" + ", ".join(items + ["..."] * (len(value) > len(items))) + "]"
    elif isinstance(value, dict):
        items = (
            [f"{short_json(k)}: {short_json(v, depth - 1)}" for k, v in list(value.items())[:3]] if depth > 0 else []
        )
        text = "{" + ", ".join(items + ["..."] * (len(value) > len(items))) + "}"
    else:
        text = json.dumps(value) if isinstance(value, (bool, float)) or value is None else str(value)
    return text if len(text) <= 100 else text[:97] + "..."


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


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters of text one token covers: its vocabulary's longest entry (added tokens
    included). Byte-level vocabularies spell a token one character per byte, and a character is at
    least one byte, so this bounds byte-level BPE (GPT-2, Llama 3, DeepSeek-V3) and SentencePiece alike."""
    return max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))


@dataclasses.dataclass(frozen=True)
class PromptLimits:
    """What one request may hold, checked before its prompt is tokenized.

    max_length: tokens of one request, prompt and output (the engine's): a prompt has fewer.
    max_chars: characters of prompt text. `for_tokenizer` sets max_length x `longest_token_chars`:
      longer text cannot fit in max_length tokens. (A tokenizer whose normalizer deletes characters,
      or that maps a run of unknown characters to one token, could fit more: give it a larger bound.)
    """

    max_length: int
    max_chars: int
    max_logprobs: int = 0  # most likely tokens per output token a request may ask for (the engine's)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, max_length: int, max_logprobs: int = 0) -> PromptLimits:
        return cls(
            max_length=max_length, max_chars=max_length * longest_token_chars(tokenizer), max_logprobs=max_logprobs
        )

    def check_logprobs(self, value: int | None) -> int | None:
        """Raises ValueError unless `value` (most likely tokens per output token) is None or in 0 ..
        `max_logprobs`."""
        if value is not None and not 0 <= value <= self.max_logprobs:
            raise ValueError(
                f"must be in 0 .. {self.max_logprobs} (the most likely tokens this server reports per token: "
                f"mtp-jax serve --max-logprobs), got {value}"
            )
        return value

    def check_ids(self, num_ids: int) -> None:
        """Raises ValueError for a prompt of `num_ids` token ids that leaves no room for output."""
        if num_ids >= self.max_length:
            raise ValueError(
                f"the prompt has {num_ids} token ids: at most {self.max_length - 1} fit (a request holds "
                f"max_length={self.max_length} tokens, prompt and output)"
            )

    def check_text(self, text: str, what: str = "the prompt") -> None:
        """Raises ValueError for text of more than `max_chars` characters, or that is not Unicode."""
        if len(text) > self.max_chars:
            raise ValueError(
                f"{what} has {len(text)} characters: more than max_length={self.max_length} tokens hold "
                f"(at most {self.max_chars} characters)"
            )
        check_unicode(text, what)


def check_unicode(text: str, what: str) -> None:
    """Raises ValueError when `text` is not valid Unicode (a lone surrogate, from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"{what} is not valid Unicode: a lone surrogate U+{ord(text[error.start]):04X} at character {error.start}"
        ) from None
