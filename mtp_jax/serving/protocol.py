"""The OpenAI API's request and response shapes for `/v1/completions` and `/v1/chat/completions`.

`parse_request` turns a raw request body into a pydantic model of OpenAI's fields plus vLLM's
`top_k`, `ignore_eos` and `stop_token_ids`. Every field is honoured or refused, never silently
dropped:

- Honoured: `model`; `prompt` (completions: a string or a list of token ids, or a batch: a list of
  those, each prompt n choices in prompt order) or `messages` (chat: text content, text parts joined); `max_tokens`
  (chat: `max_completion_tokens`, else `max_tokens`; completions default to 16 as OpenAI's, chat to
  everything the row holds, max_length - prompt); `temperature` (default 1.0 as OpenAI's, 0 =
  greedy), `top_p` (1.0), `top_k` (off: 0 or -1), `seed` (in [0, 2**32); without one each request
  draws a fresh random seed); `stop` (a string or at most 4 non-empty strings, OpenAI's limit,
  excluded from the text), `stop_token_ids` (ids that end the output, at most 16 with the EOS ids),
  `ignore_eos`; `logprobs` (completions: an int n, each chosen token's logprob and, for n > 0, the
  n most likely tokens' as `top_logprobs`; chat: a bool, with `top_logprobs` n; n up to the server's
  `max_logprobs`, `mtp-jax serve --max-logprobs`; of the model's raw distribution, before temperature
  and filtering, as vLLM's default); `n` (1 .. 128 choices, each its own engine request, choice i
  sampled with seed + i: choice 0 is the request with n = 1; the prompt's pages are shared through
  the prefix cache where it is on); `logit_bias` (token id -> bias in [-100, 100], at most 300, added to
  the raw logits before temperature and filtering, greedy rows too; under speculation the drafts are
  drafted and verified with it, so output is as without speculation); `presence_penalty`,
  `frequency_penalty` (OpenAI's, in [-2, 2]), `repetition_penalty` (vLLM's, in [1e-6, 1e6], 1 = off), `min_tokens`
  (vLLM's: the stop tokens are forbidden and stop strings unmatched before it), `min_p` (vLLM's, in
  [0, 1]): `mtp_jax.decode.sampling` (vLLM's order; under speculation each verify position counts the
  drafts before it, so output is as without speculation); `response_format` (`{"type": "text"}`,
  `"json_object"`, `"json_schema"` with `json_schema.schema` and `strict`: compact JSON through the
  llguidance grammar engine, `mtp_jax.serving.grammar`; every verify position masked by the grammar
  after the drafts before it, so output is as without speculation; a schema it cannot compile is a 400;
  not with `min_tokens`); vLLM's `structured_outputs` (exactly one of `json`, `regex`, `choice`, `grammar`
  (Lark or GBNF), `json_object`; not with `response_format`); `truncate_prompt_tokens` (vLLM's: the
  tokenized prompt keeps its last k ids, -1: as many as a slot holds; the limits below apply to the
  prompt as sent); `skip_special_tokens` (vLLM's,
  default true; false keeps special tokens other than the stop token in the text),
  `include_stop_str_in_output` (vLLM's: the text ends after a matched stop string); completions' `echo` (the
  prompt's text first; with `logprobs`, the prompt's tokens lead the logprobs object, the first with null
  logprobs, as OpenAI's legacy API); `prompt_logprobs` n (vLLM's: each choice's list, null then per prompt
  token {token id: {logprob, rank, decoded_token}} for it and the n most likely; chat: on the response;
  `mtp_jax.serving.scoring`: one more forward of the prompt; not streamed); chat's vLLM fields
  `add_generation_prompt` (default true: the prompt ends with the assistant's header),
  `continue_final_message` (default false: the prompt ends inside the final message, a prefill;
  needs `add_generation_prompt: false`) and `chat_template_kwargs` (more chat template variables,
  e.g. `{"enable_thinking": false}`; not `messages` or `chat_template`), rendered as
  `mtp_jax.serving.chat_template` says; `stream` and
  `stream_options.include_usage` (a last chunk with `usage`, the prompt once and every choice's
  tokens, and no choices).
- Accepted and ignored, as they cannot change the output (`IGNORED_FIELDS`): `user`,
  `safety_identifier`, `metadata`, `store`, `service_tier`, `prompt_cache_key`,
  `parallel_tool_calls` (tools are refused), and `stream_options.include_obfuscation`.
- Not implemented (`NOT_IMPLEMENTED`, the one list): null, or the value that asks for nothing
  (clients send defaults: `best_of: 1`, `tools: []`, `tool_choice: "none"`, ...), is
  accepted; any other value is a 400 naming the field. They are `best_of`, chat's `echo`, `suffix`,
  `tools`, `tool_choice`, `functions`,
  `function_call`, `chat_template`, `reasoning_effort`, `verbosity`,
  `modalities`, `audio`, `prediction`, `web_search_options`.
  Refused where they are parsed: content parts that are not text, more than 128 choices in all
  (prompts x n).
- Any other field is unknown: a 400 naming it. A message object may carry more keys (`name`,
  `tool_call_id`, ...): the chat template may read them.

Limits, checked before the prompt is tokenized (`mtp_jax.serving.limits.PromptLimits`): a token-id
prompt of max_length ids or more; a text (the completion prompt, the rendered chat prompt) of more characters than
max_length tokens can hold; `max_tokens` over max_length (refused, not clamped); a stop string
longer than any output; a `temperature` over float32's largest (the device would divide by inf);
text that is not Unicode (a lone surrogate in `prompt`, `messages` or `stop`); more than 16
`stop_token_ids`; JSON's non-standard NaN and Infinity. The body's size is the server's to bound.

Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}` (`error_body`), from a
`RequestError` whose `param` names the field. Response bodies: `mtp_jax.serving.responses`.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from mtp_jax.config import MAX_STOP_TOKENS
from mtp_jax.decode.sampling import MAX_LOGIT_BIAS, SamplingParams
from mtp_jax.serving.limits import (
    PromptLimits,
    RequestError,
    check_unicode,
    short_json,
)

MAX_STOP_STRINGS = 4  # as OpenAI's API
FLOAT32_MAX = float(np.finfo(np.float32).max)  # temperature is float32 on device
MAX_INT32 = 2**31 - 1  # token counts are int32 on device
MAX_CHOICES = 128  # n, as OpenAI's API

# Fields of OpenAI's API that cannot change the output: accepted, and ignored.
IGNORED_FIELDS = {
    "user": "an end user's id, for the provider's abuse monitoring",
    "safety_identifier": "the same, OpenAI's newer name",
    "metadata": "tags of a stored completion (nothing is stored)",
    "store": "asks the provider to store the completion (nothing is stored)",
    "service_tier": "the provider's processing tier (there is one)",
    "prompt_cache_key": "a prompt-cache hint (prefix caching needs none)",
    "parallel_tool_calls": "only has an effect with tools, which are refused",
}


@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A request field this server does not implement: what it asks for, and the values (besides null)
    that ask for nothing, which are accepted since clients send defaults."""

    feature: str
    noop: tuple = ()


# Fields that would change the output and are not implemented. Implementing one: declare it on the
# request model (`_Sampled`, `CompletionRequest` or `ChatCompletionRequest`) and remove it here; a field
# declared on one endpoint's model only stays here for the other (`echo`: completions only).
NOT_IMPLEMENTED: dict[str, Unsupported] = {
    "best_of": Unsupported("best-of-n candidates", (1,)),
    "echo": Unsupported("echoing the last message (chat)", (False,)),
    "suffix": Unsupported("insertion (a suffix)", ("",)),
    "tools": Unsupported("function calling", ([],)),
    "tool_choice": Unsupported("function calling", ("none", "auto")),
    "functions": Unsupported("function calling", ([],)),
    "function_call": Unsupported("function calling", ("none", "auto")),
    "chat_template": Unsupported("a chat template per request"),
    "reasoning_effort": Unsupported("reasoning settings"),
    "verbosity": Unsupported("verbosity settings"),
    "modalities": Unsupported("output other than text", (["text"],)),
    "audio": Unsupported("audio output"),
    "prediction": Unsupported("predicted outputs"),
    "web_search_options": Unsupported("web search"),
}


def _limits(info: ValidationInfo) -> PromptLimits | None:
    return (info.context or {}).get("limits")


def _same(value, noop) -> bool:
    """JSON equality: a bool equals only a bool; 0 equals 0.0."""
    if isinstance(value, bool) or isinstance(noop, bool):
        return value is noop
    return value == noop


def check_fields(data: dict, model: type[BaseModel]) -> dict:
    """`data` less the fields that ask for nothing: the ignored ones and the not implemented ones at a
    no-op value. Raises RequestError naming the first field that is unknown or that asks for
    something not implemented (see the module docstring)."""
    kept = {}
    for name, value in data.items():
        if name in model.model_fields:
            kept[name] = value
        elif name in NOT_IMPLEMENTED:
            unsupported = NOT_IMPLEMENTED[name]
            if value is not None and not any(_same(value, noop) for noop in unsupported.noop):
                accepted = " or ".join(json.dumps(noop) for noop in (*unsupported.noop, None))
                raise RequestError(
                    f"{name}: {short_json(value)} is not supported (this server does not implement "
                    f"{unsupported.feature}; {name} may only be {accepted})",
                    name,
                )
        elif name not in IGNORED_FIELDS:
            raise RequestError(f"unknown field {short_json(name)}: not a parameter this server implements", name)
    return kept


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union members in `loc`


def validation_error(errors: list[dict]) -> RequestError:
    """Pydantic's (or FastAPI's) validation errors as one RequestError naming the first offending field."""
    first = errors[0]
    loc = [
        str(p) for p in first.get("loc", ()) if p != "body" and str(p).lower() not in _TYPE_TAGS and "[" not in str(p)
    ]
    if first.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    if not loc:
        return RequestError(f"the request body must be a JSON object ({first['msg']})")
    if first.get("type") == "extra_forbidden":
        message = "unknown field: not a parameter this server implements"
    else:
        message = str(first["msg"]).removeprefix("Value error, ")
    return RequestError(f"{'.'.join(loc)}: {message}", loc[0])


Request = TypeVar("Request", bound="_Sampled")


def parse_request(model: type[Request], body: bytes, limits: PromptLimits | None = None) -> Request:
    """The request `model` (`CompletionRequest` or `ChatCompletionRequest`) of a raw JSON body, checked
    (within `limits`, when given). Raises RequestError (400) naming the field: a body that is not a
    JSON object, a field unknown or not implemented, a value of the wrong type, out of range or over
    `limits`. Its time is linear in the body's size: run it off the event loop."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, RecursionError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got a {type(data).__name__}")
    data = check_fields(data, model)
    try:
        return model.model_validate(data, context={"limits": limits})
    except ValidationError as error:
        raise validation_error(error.errors(include_url=False)) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool | None = False
    include_obfuscation: StrictBool | None = None  # ignored: padding against length side channels


def _checked_max_tokens(value: int | None, info: ValidationInfo) -> int | None:
    if value is None:
        return value
    if value < 1:
        raise ValueError(f"must be an int >= 1, got {value}")
    limits = _limits(info)
    if limits is not None and value > limits.max_length:
        raise ValueError(
            f"{value} is more than a request holds: max_length={limits.max_length} tokens, prompt and output"
        )
    if value > MAX_INT32:
        raise ValueError(f"must be at most 2**31 - 1 (int32 on device), got {value}")
    return value


def _choice_seed(seed: int, choice: int) -> int:
    """Choice i's seed: `seed` itself for choice 0 (checked as given by `SamplingParams`), then
    (seed + i) mod 2**32."""
    return seed if choice == 0 else (seed + choice) % 2**32


class _Sampled(BaseModel):
    """The fields both endpoints share (a request is built by `parse_request`, which refuses the rest)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool | None = False
    stop_token_ids: list[StrictInt] | None = None
    n: StrictInt | None = 1
    skip_special_tokens: StrictBool | None = True
    include_stop_str_in_output: StrictBool | None = False
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    truncate_prompt_tokens: StrictInt | None = None
    prompt_logprobs: StrictInt | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs(cls, value, info):
        return (_limits(info) or PromptLimits(2, 0)).check_logprobs(value)

    def num_prompt_logprobs(self) -> int | None:
        """The most likely tokens reported per prompt token, None for no prompt logprobs (`prompt_logprobs`)."""
        return self.prompt_logprobs

    def check_streamed_prompt_logprobs(self) -> None:
        """Raises RequestError: prompt logprobs are not streamed."""
        if self.stream and self.num_prompt_logprobs() is not None:
            field = "prompt_logprobs" if self.prompt_logprobs is not None else "echo"
            raise RequestError(f"{field}: prompt logprobs are not streamed; send stream: false", field)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_prompt_tokens(cls, value):
        if value is not None and value != -1 and value < 1:
            raise ValueError(f"must be >= 1 (keep the prompt's last k tokens) or -1 (as many as fit), got {value}")
        return value

    def truncated(self, prompt: list[int], max_length: int) -> list[int]:
        """`prompt` (token ids) cut to its last `truncate_prompt_tokens` ids (vLLM's; -1: the last max_length - 1,
        what a slot holds with one token out)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt
        return prompt[-(max_length - 1 if k == -1 else k) :]

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        """As {token id: bias}; keys must be decimal token ids, each token once (at most 300 keys)."""
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
        bias = {}
        for key, v in value.items():
            digits = key.lstrip("0") or "0"
            if not (key.isascii() and key.isdigit()) or len(digits) > 10:
                raise ValueError(f"keys must be token ids (decimal strings), got {short_json(key)}")
            if int(digits) in bias:
                raise ValueError(f"token {int(digits)} is given twice ({short_json(key)})")
            bias[int(digits)] = v
        return bias

    @field_validator("n")
    @classmethod
    def _n(cls, value):
        if value is not None and not 1 <= value <= MAX_CHOICES:
            raise ValueError(f"must be in 1 .. {MAX_CHOICES} (choices of one request), got {value}")
        return value

    @property
    def num_choices(self) -> int:
        return self.n or 1

    def num_logprobs(self) -> int:
        """The most likely tokens reported per output token (`ServingEngine.add_request(logprobs=)`)."""
        return 0

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, value, info):
        return _checked_max_tokens(value, info)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if value is not None and value > FLOAT32_MAX:
            raise ValueError(
                f"must be at most {FLOAT32_MAX:.8g} (float32's largest: it is float32 on device), got {value}"
            )
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop, info):
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        limits = _limits(info)
        for s in stop:
            if limits is not None and len(s) > limits.max_chars:
                raise ValueError(
                    f"a stop string of {len(s)} characters never matches: the output holds at most "
                    f"{limits.max_chars} characters (max_length={limits.max_length} tokens)"
                )
            check_unicode(s, "a stop string")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, value):
        if value is not None and len(value) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop tokens are supported (with EOS), got {len(value)}")
        return value

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens

    def engine_kwargs(self, choice: int = 0) -> dict:
        """The keyword arguments of `ServingEngine.add_request` (all but the prompt) for choice `choice` of
        `n`: choice i samples with seed (`seed` + i) mod 2**32 (a fresh random seed each without `seed`),
        so the choices differ and a request with a seed is repeatable. Raises ValueError / TypeError naming
        the field for a sampling parameter out of range (`SamplingParams`)."""
        top_k = self.top_k or 0
        sampling = SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if top_k == -1 else top_k,
            seed=secrets.randbits(32) if self.seed is None else _choice_seed(self.seed, choice),
            logit_bias={token: float(v) for token, v in (self.logit_bias or {}).items()},
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens or 0,
        )
        return dict(
            max_tokens=self.resolved_max_tokens(),
            sampling=sampling,
            stop=tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.num_logprobs(),
            skip_special_tokens=self.skip_special_tokens is not False,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            response_format=self.response_format,
            structured_outputs=self.structured_outputs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_Sampled):
    """`POST /v1/completions`."""

    prompt: Any = Field(description="a string or a list of token ids, or a list of those (a batch)")
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False

    def num_logprobs(self) -> int:
        return self.logprobs or 0

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt, info):
        """One prompt (a string or token ids) or a batch of them (a list of those): as a list of prompts."""
        batch = isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if batch else [prompt]
        if len(prompts) > MAX_CHOICES:
            raise ValueError(f"at most {MAX_CHOICES} prompts per request, got {len(prompts)}")
        return [_one_prompt(p, _limits(info), f"prompt {i}" if batch else "the prompt") for i, p in enumerate(prompts)]

    def check_choices(self) -> None:
        """Raises RequestError (naming `n`) for more than `MAX_CHOICES` choices in all: prompts x n."""
        if len(self.prompt) * self.num_choices > MAX_CHOICES:
            raise RequestError(
                f"n: {len(self.prompt)} prompts x n={self.num_choices} is more than {MAX_CHOICES} choices", "n"
            )

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, value, info):
        return (_limits(info) or PromptLimits(2, 0)).check_logprobs(value)

    def num_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, else with `echo` and `logprobs` n the echoed prompt's n most likely tokens."""
        if self.prompt_logprobs is not None or not (self.echo and self.logprobs is not None):
            return self.prompt_logprobs
        return self.logprobs


def _one_prompt(prompt, limits: PromptLimits | None, what: str) -> str | list[int]:
    """A checked prompt: a string, or a list of token ids (ValueError naming `what` otherwise)."""
    if isinstance(prompt, str):
        if limits is not None:
            limits.check_text(prompt, what)
        check_unicode(prompt, what)
        return prompt
    if isinstance(prompt, list) and limits is not None:
        limits.check_ids(len(prompt))  # before looking at 2M ids
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValueError(f"{what} must be a string or a list of token ids")


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
    add_generation_prompt: StrictBool | None = True  # vLLM's; null: true
    continue_final_message: StrictBool | None = False  # vLLM's
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more template variables

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _chat_template_kwargs(cls, value):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"must be an object of chat template variables, got {short_json(value)}")
        return value

    def chat_template_arguments(self) -> dict:
        """The keyword arguments of `ChatTemplate.render` (all but the messages), which checks them as they
        are once `chat_template_kwargs` is merged over the other two. Raises RequestError naming
        `continue_final_message` when it and `add_generation_prompt` are both sent true (vLLM's check,
        before the merge: either may be overridden by `chat_template_kwargs`)."""
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise RequestError(
                "continue_final_message: it and add_generation_prompt cannot both be true", "continue_final_message"
            )
        return dict(
            add_generation_prompt=self.add_generation_prompt is not False,
            continue_final_message=bool(self.continue_final_message),
            chat_template_kwargs=self.chat_template_kwargs,
        )

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=true")
        return (_limits(info) or PromptLimits(2, 0)).check_logprobs(value)

    def num_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, messages):
        if not messages:
            raise ValueError("messages must hold at least one message")
        for m in messages:
            m.text()  # refuses non-text parts here, naming the field
        return messages

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, value, info):
        return _checked_max_tokens(value, info)

    def resolved_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
