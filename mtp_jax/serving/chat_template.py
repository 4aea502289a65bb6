"""Chat messages to prompt text: the model's own Jinja chat template, or a plain one.

A model directory whose `tokenizer_config.json` has a `chat_template` (Hugging Face's format: a
Jinja string, or a list of `{"name", "template"}` of which "default" is used) gets it, rendered as
`transformers`' `apply_chat_template` does: sandboxed Jinja with `trim_blocks` and
`lstrip_blocks`, variables `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token` (from
the same file), functions `raise_exception` and `strftime_now`. Its text is tokenized without
adding special tokens (the template writes them).

Without one (the bundled demo model, trained on Python code, has none), the plain template::

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

i.e. `"<|{role}|>\\n{content}\\n"` per message, then the assistant header `"<|assistant|>\\n"`;
its text is tokenized as a completion prompt is (special tokens added as the tokenizer does).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def plain_prompt(messages: list[dict]) -> str:
    """The plain template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    return "".join(f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages) + "<|assistant|>\n"


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

    def render(self, messages: list[dict]) -> str:
        """The prompt text of `messages` (dicts with "role" and "content" strings, and any other
        keys the template reads) up to the assistant's turn. Raises ValueError when the template
        refuses them (`raise_exception`) or fails."""
        if self._template is None:
            return plain_prompt(messages)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        except Exception as error:  # TemplateError, and whatever a template's expressions raise
            raise ValueError(f"the chat template cannot render these messages: {error}") from None
