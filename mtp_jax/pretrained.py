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

from mtp_jax import atomic_dir, checkpoint
from mtp_jax.generate import stream
from mtp_jax.model import Transformer

DEFAULT_MODEL_DIR = Path(__file__).parent / "assets" / "demo"
TOKENIZER_FILE = "tokenizer.json"


def _read_tokenizer(file: str | os.PathLike) -> Tokenizer:
    """The tokenizer in a tokenizer.json; a CheckpointError naming the file when it is not one."""
    try:
        return Tokenizer.from_file(str(file))
    except Exception as error:  # the tokenizers library raises a bare Exception for a bad file
        raise checkpoint.CheckpointError(f"{file} is not a valid tokenizer.json: {error}") from error


def load_pretrained(
    path: str | os.PathLike | None = None, *, dtype: str | None = None
) -> tuple[Transformer, Tokenizer]:
    """The model and its HF `tokenizers.Tokenizer` from a directory (default: the bundled demo model).

    A save that a kill interrupted is finished first (see `checkpoint.load_hf_checkpoint`).

    Raises:
      FileNotFoundError: the directory, config.json, the weights or tokenizer.json are missing.
      CheckpointError naming the file: tokenizer.json is not a valid tokenizer, or its vocabulary
        (added tokens included) is larger than the model's vocab_size; and the errors of
        `checkpoint.load_hf_checkpoint` (corrupt files, a checkpoint that does not match its config).
    """
    path = Path(DEFAULT_MODEL_DIR if path is None else path)
    atomic_dir.recover(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
    model = checkpoint.load_hf_checkpoint(path, dtype=dtype)
    tokenizer = _read_tokenizer(path / TOKENIZER_FILE)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model.config.vocab_size:
        raise checkpoint.CheckpointError(f"{path / TOKENIZER_FILE} has {size} tokens, more than the model's "
                                         f"vocab_size={model.config.vocab_size} in {path / checkpoint.CONFIG_FILE}")
    return model, tokenizer


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
    """Writes config.json and the weights (`checkpoint.write_hf_files`) and tokenizer.json, atomically.

    `tokenizer` is a `tokenizers.Tokenizer` or the path of a tokenizer.json (copied byte for
    byte); None writes none. Everything goes into one atomic directory swap, as in
    `checkpoint.save_hf_checkpoint`: a kill leaves the old model and tokenizer or the new ones, and
    an overwrite drops the old tokenizer files, so a tokenizer.json in `path` is always the one
    saved with its weights.

    Raises:
      FileExistsError: as `checkpoint.save_hf_checkpoint` (`path` not empty and `overwrite` False, ...).
      ValueError: the tokenizer's vocabulary (added tokens included) is larger than the model's
        vocab_size; a `checkpoint.CheckpointError` naming the file when the tokenizer path is not
        a valid tokenizer.json. Nothing is written then.
    """
    if tokenizer is not None:
        loaded = tokenizer if isinstance(tokenizer, Tokenizer) else _read_tokenizer(tokenizer)
        size = loaded.get_vocab_size(with_added_tokens=True)
        if size > model.config.vocab_size:
            raise ValueError(f"the tokenizer{'' if loaded is tokenizer else f' {tokenizer}'} has {size} tokens, "
                             f"more than the model's vocab_size={model.config.vocab_size}")
    with atomic_dir.replace_dir(path, overwrite=overwrite, owned=checkpoint.is_model_file) as new:
        checkpoint.write_hf_files(model, new)
        if isinstance(tokenizer, Tokenizer):
            tokenizer.save(str(new / TOKENIZER_FILE))
        elif tokenizer is not None:
            shutil.copyfile(tokenizer, new / TOKENIZER_FILE)
