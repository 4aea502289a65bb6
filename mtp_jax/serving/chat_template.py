"""Chat messages to prompt text: the model's own Jinja chat template, or a plain one.

A model directory whose `tokenizer_config.json` has a `chat_template` (Hugging Face's format: a
Jinja string, or a list of `{"name", "template"}` of which "default" is used) gets it, rendered as
`transformers`' `apply_chat_template` does: sandboxed Jinja with `trim_blocks` and
`lstrip_blocks`, variables `messages`, `add_generation_prompt` (default true), `bos_token`,
`eos_token` (from the same file) and the request's `chat_template_kwargs`, functions
`raise_exception` and `strftime_now`. Its text is tokenized without adding special tokens (the
template writes them).

Without one (the bundled demo model, trained on Python code, has none), the plain template::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

i.e. `"<|{role}|>\\n{content}\\n"` per message, then the assistant header `"<|assistant|>\\n"`
(only with `add_generation_prompt`); its text is tokenized as a completion prompt is (special
tokens added as the tokenizer does).

The arguments of `ChatTemplate.render`, as vLLM's chat completions request fields of the same names
(vLLM passes them to `transformers`' `apply_chat_template`):

- `add_generation_prompt` (default true): the prompt ends with the header of the assistant's turn
  (the template's variable of that name; the plain template's `"<|assistant|>\\n"`). False: the
  prompt ends after the last message.
- `continue_final_message` (default false): the prompt ends inside the final message (of any role,
  as vLLM's; usually the assistant's, a prefill the model continues), as `transformers` does it:
  needs `add_generation_prompt` false (both true is refused, as `transformers` and vLLM do), renders
  with a sentinel appended to the final message's content and cuts the text at the sentinel (where
  the template trimmed the content's trailing whitespace, trimmed at the cut too). Refused when the
  rendered text does not hold the content (stripped) and the sentinel: the template rewrote or
  dropped it. The plain template: the messages without the header, less the final newline.
- `chat_template_kwargs`: more template variables (e.g. `{"enable_thinking": false}`), which
  override `bos_token` / `eos_token`; `add_generation_prompt` and `continue_final_message` given
  here override the arguments (vLLM merges these kwargs over its own, then `transformers` takes
  those two as its arguments), and must be bools. `messages` may not be set (the request's messages
  are the template's), nor `chat_template` (the template is the model's; vLLM drops that key). The
  plain template reads none of the others.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Keys chat_template_kwargs may not set: the request's messages, and the template itself.
RESERVED_KWARGS = ("messages", "chat_template")
# Appended to the final message's content to find where it ends in the rendered text (transformers').
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateArgumentError(ValueError):
    """A render refused for one of `ChatTemplate.render`'s arguments, which `param` names
    ("continue_final_message" or "chat_template_kwargs") and the message starts with."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def plain_prompt(messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """The plain template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n` if
    `add_generation_prompt`; with `continue_final_message` (and not `add_generation_prompt`: the caller
    checks), without the final newline, so the text ends with the final message's content."""
    text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages)
    if continue_final_message:
        return text[:-1]
    return text + "<|assistant|>\n" if add_generation_prompt else text


def template_arguments(
    add_generation_prompt: bool, continue_final_message: bool, chat_template_kwargs: dict | None
) -> tuple[bool, bool, dict]:
    """(add_generation_prompt, continue_final_message, the other template variables): the arguments
    with `chat_template_kwargs` merged over them, as vLLM merges them (see the module docstring).

    Raises ChatTemplateArgumentError naming the field: kwargs that are not a dict of str keys, that set
    a reserved key (`RESERVED_KWARGS`), or `add_generation_prompt` / `continue_final_message` to a
    non-bool; both true (as `transformers`' apply_chat_template)."""
    if chat_template_kwargs is None:
        chat_template_kwargs = {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise ChatTemplateArgumentError("chat_template_kwargs", "must be an object of template variables")
    kwargs = dict(chat_template_kwargs)
    for key in RESERVED_KWARGS:
        if key in kwargs:
            why = "the request's messages are the template's" if key == "messages" else "the template is the model's"
            raise ChatTemplateArgumentError("chat_template_kwargs", f"may not set {json.dumps(key)} ({why})")
    flags = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
    for name in flags:
        if name in kwargs:
            flags[name] = kwargs.pop(name)
            if not isinstance(flags[name], bool):
                got = json.dumps(flags[name], default=repr)
                raise ChatTemplateArgumentError(
                    "chat_template_kwargs", f"{name} must be a bool, got {got[:40]}{'...' * (len(got) > 40)}"
                )
    add, cont = flags["add_generation_prompt"], flags["continue_final_message"]
    if add and cont:
        raise ChatTemplateArgumentError(
            "continue_final_message",
            "it and add_generation_prompt cannot both be true (add_generation_prompt defaults to true: "
            "send add_generation_prompt false to continue the final message)",
        )
    return add, cont, kwargs


def _token_text(value) -> str:
    """A special token of tokenizer_config.json as text: a string, or an AddedToken dict's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message):
    raise jinja2.TemplateError(message)


class ChatTemplate:
    """Renders chat messages as the prompt text (see the module docstring).

    Args:
      template: a Jinja chat template; None for the plain template.
      bos_token, eos_token: the texts the template may insert.
    """

    def __init__(self, template: str | None = None, *, bos_token: str = "", eos_token: str = ""):
        self.source, self.bos_token, self.eos_token = template, bos_token, eos_token
        self._template = None
        if template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
            self._template = env.from_string(template)

    @property
    def add_special_tokens(self) -> bool:
        """Whether the rendered text is tokenized with the tokenizer's special tokens added."""
        return self._template is None

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike) -> ChatTemplate:
        """The template of `path/tokenizer_config.json` if it has one, else the plain template.

        Raises ValueError naming the file when it is not JSON or its template does not compile.
        """
        file = Path(path) / TOKENIZER_CONFIG_FILE
        if not file.is_file():
            return cls()
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as error:
            raise ValueError(f"{file} is not valid JSON: {error}") from None
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, list):  # named templates
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            return cls()
        try:
            return cls(
                template, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"{file}: chat_template does not compile: {error}") from None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> str:
        """The prompt text of `messages` (dicts with "role" and "content" strings, and any other
        keys the template reads): up to the assistant's turn (`add_generation_prompt`), after the last
        message (neither), or inside the final message (`continue_final_message`); with the variables
        of `chat_template_kwargs` (JSON values; the plain template ignores them). See the module
        docstring: the semantics are vLLM's, the rendering `transformers`' apply_chat_template.

        Raises ChatTemplateArgumentError (a ValueError) naming the argument it refuses
        (`template_arguments`; `continue_final_message` when the rendered text does not hold the final
        message's content), ValueError when the template refuses the messages (`raise_exception`) or
        fails."""
        add, cont, kwargs = template_arguments(add_generation_prompt, continue_final_message, chat_template_kwargs)
        if cont and not messages:
            raise ChatTemplateArgumentError("continue_final_message", "there is no final message to continue")
        if self._template is None:
            return plain_prompt(messages, add, cont)
        if cont:  # transformers: the sentinel after the final message's content marks where to cut
            final = messages[-1].get("content") or ""
            messages = [*messages[:-1], {**messages[-1], "content": final + CONTINUE_TAG}]
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        try:
            text = self._template.render({**variables, "messages": messages, "add_generation_prompt": add})
        except Exception as error:  # TemplateError, and whatever a template's expressions raise
            raise ValueError(f"the chat template cannot render these messages: {error}") from None
        if not cont:
            return text
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateArgumentError(
                "continue_final_message",
                "the chat template does not write the final message's content as it is (it rewrites or drops "
                "it), so the prompt cannot end inside it",
            )
        cut = text.rindex(tag)
        # A template that trims the content trims the sentinel's space: trim what precedes it too.
        return text[:cut] if text.startswith(CONTINUE_TAG, cut) else text[:cut].rstrip()
