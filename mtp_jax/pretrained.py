"""Model directories: Hugging Face layout (config.json, safetensors, tokenizer.json), MTP modules included.

A directory written by `save_pretrained` loads in `transformers` as the main model (its MTP
tensors sit at DeepSeek-V3's `model.layers.{L + j}.*` names, which `transformers` ignores) and
back here with its MTP modules (`mtp_jax.checkpoint`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer

from mtp_jax import checkpoint
from mtp_jax.generate import stream
from mtp_jax.model import Transformer

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "demo"
TOKENIZER_FILE = "tokenizer.json"


def load_pretrained(
    path: str | os.PathLike | None = None, *, dtype: str | None = None
) -> tuple[Transformer, Tokenizer]:
    """The model and its HF `tokenizers.Tokenizer` from a directory (default: the bundled demo model).

    Raises FileNotFoundError when config.json, the weights or tokenizer.json are missing, and the
    errors of `checkpoint.load_hf_checkpoint` for a checkpoint that does not match its config.
    """
    path = Path(DEFAULT_MODEL_DIR if path is None else path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
    model = checkpoint.load_hf_checkpoint(path, dtype=dtype)
    return model, Tokenizer.from_file(str(path / TOKENIZER_FILE))


def stream_text(model: Transformer, tokenizer: Tokenizer, prompt: str, **kwargs) -> Iterator[str]:
    """Text as it is committed: yields the newly decoded characters after each decode step.

    Decodes the whole continuation each step (byte-level BPE tokens can split a character) and
    yields what was added. `kwargs` go to `mtp_jax.generate.stream` (max_new_tokens, sampling,
    speculative, ...).
    """
    emitted: list[int] = []
    shown = ""
    for step in stream(model, [tokenizer.encode(prompt).ids], **kwargs):
        emitted += step[0]
        text = tokenizer.decode(emitted)
        if text[len(shown):]:
            yield text[len(shown):]
        shown = text


def save_pretrained(
    model: Transformer,
    path: str | os.PathLike,
    *,
    tokenizer: Tokenizer | str | os.PathLike | None = None,
    overwrite: bool = False,
) -> None:
    """Writes config.json and the weights (`checkpoint.save_hf_checkpoint`) and tokenizer.json.

    `tokenizer` is a `tokenizers.Tokenizer` or the path of a tokenizer.json. Raises FileExistsError
    when `path` is not empty and `overwrite` is False.
    """
    path = Path(path)
    checkpoint.save_hf_checkpoint(model, path, overwrite=overwrite)
    if isinstance(tokenizer, Tokenizer):
        tokenizer.save(str(path / TOKENIZER_FILE))
    elif tokenizer is not None:
        shutil.copyfile(tokenizer, path / TOKENIZER_FILE)
