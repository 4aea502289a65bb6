"""Prompts for self-distillation (`mtp_jax.training.distill`): a `PromptSource` gives the prompt of sample j
of a split (`TRAIN` 0, `HELDOUT` 1) as token ids.

  - a prompts file (`file_prompts`): one prompt per line (blank lines skipped), or JSONL (a `.jsonl` name) of
    objects with a "prompt" string, which may hold newlines; encoded with the model's tokenizer
    (`encode(text).ids`, as `mtp-jax generate` encodes a prompt). The last `heldout_samples` prompts are
    held out; train sample j continues train prompt j mod (number of train prompts), held-out sample j
    held-out prompt j mod (their number).
  - a corpus (`corpus_prompts`: a `data.Corpus`, e.g. a `prepare_corpus` cache): sample j of a split continues a
    window of `prompt_len` tokens of one of that split's documents, drawn uniformly over all such windows
    (a document's final EOS excluded) by `np.random.default_rng([seed, split, j])`: a pure function of
    (seed, split, j), whatever the number of samples or their batches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
from collections.abc import Callable

import numpy as np
from tokenizers import Tokenizer

from mtp_jax.training import data

TRAIN, HELDOUT = 0, 1  # split codes in sample seeds and window draws
DEFAULT_CORPUS_SAMPLES = 1024  # train samples drawn from a corpus unless num_samples says otherwise


@dataclasses.dataclass(frozen=True)
class PromptSource:
    """Where the prompts come from: `kind` ("file" or "corpus") and `digest` (the file's SHA-256 or
    the corpus's `data_dir_fingerprint`) identify it; `prompt(split, j, seed)` is sample j's prompt."""

    kind: str
    digest: str
    prompt: Callable[[int, int, int], list[int]]
    max_prompt_len: int
    default_samples: int
    default_heldout: int | None  # None: ceil(3% of num_samples)


def _read_prompt_texts(path: pathlib.Path) -> list[str]:
    """A prompts file's prompts: JSONL ("prompt" strings) for a `.jsonl` name, else one per non-blank line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"prompts file {path}: {getattr(error, 'strerror', None) or error}") from None
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"prompts file {path}, line {number}: not JSON ({error})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'prompts file {path}, line {number}: needs an object with a "prompt" string')
        texts.append(record["prompt"])
    return texts


def file_prompts(path: str | pathlib.Path, tokenizer: Tokenizer, heldout_samples: int | None) -> PromptSource:
    """The prompts of a prompts file (module docstring), encoded with `tokenizer` (`encode(text).ids`).
    Raises ValueError naming the file for an unreadable file, a bad JSONL line, or fewer than
    heldout_samples + 1 prompts."""
    path = pathlib.Path(path)
    texts = _read_prompt_texts(path)
    heldout = heldout_samples or max(1, math.ceil(0.03 * len(texts)))
    if len(texts) < heldout + 1:
        raise ValueError(
            f"prompts file {path} has {len(texts)} prompts: it needs at least {heldout + 1} ({heldout} held out)"
        )
    ids = [e.ids for e in tokenizer.encode_batch(texts)]
    empty = next((i for i, p in enumerate(ids) if not p), None)
    if empty is not None:
        raise ValueError(f"prompts file {path}: prompt {empty} encodes to no tokens")
    train, held = ids[: len(ids) - heldout], ids[len(ids) - heldout :]

    def prompt(split: int, j: int, seed: int) -> list[int]:
        return train[j % len(train)] if split == TRAIN else held[j % len(held)]

    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return PromptSource("file", digest, prompt, max(map(len, ids)), len(train), heldout)


def corpus_prompts(corpus: data.Corpus, prompt_len: int) -> PromptSource:
    """Windows of `prompt_len` tokens of `corpus`'s documents (module docstring), identified by
    `data_dir_fingerprint(corpus.work_dir)`; ValueError when a split has no document of at least
    prompt_len tokens before its EOS."""
    windows = []
    for split, name in ((corpus.train, "train"), (corpus.heldout, "held-out")):
        lengths = np.diff(split.offsets) - 1  # tokens before each document's EOS
        ends = np.cumsum(np.maximum(lengths - prompt_len + 1, 0))  # windows in documents 0 .. d
        if not ends.size or ends[-1] == 0:
            raise ValueError(f"no {name} document of {corpus.work_dir} has {prompt_len} tokens (the prompt length)")
        windows.append((split, ends))

    def prompt(code: int, j: int, seed: int) -> list[int]:
        split, ends = windows[code]
        r = int(np.random.default_rng([seed, code, j]).integers(ends[-1]))  # window r of all
        d = int(np.searchsorted(ends, r, side="right"))  # the document holding it
        start = int(split.offsets[d]) + r - (int(ends[d - 1]) if d else 0)
        return split.tokens[start : start + prompt_len].tolist()

    digest = data.data_dir_fingerprint(corpus.work_dir)
    return PromptSource("corpus", digest, prompt, prompt_len, DEFAULT_CORPUS_SAMPLES, None)
