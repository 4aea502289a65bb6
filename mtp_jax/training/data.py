"""Training data: the Python standard library as a corpus, a byte-level BPE tokenizer, token arrays.

Corpus. The `*.py` files of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`), read as UTF-8, one document per file, keyed by the file's
POSIX path relative to that root. Left out (`EXCLUDED_DIRS`, `is_excluded`): third-party code
(`site-packages`), test suites (any directory named `test`, `tests` or `idle_test`: CPython's
`Lib/test` alone is 18 MB, larger than the rest together, and much of it is data), byte caches,
and three kinds of generated or build-specific files: `pydoc_data/topics.py` (0.75 MB of help
prose in one string), the character-mapping tables in `encodings/` written by `gencodec.py`, and
`_sysconfigdata_*.py` (the build's configure output, different on every machine). `idlelib`,
`turtledemo`, `lib2to3` and the rest of the library stay in. For CPython 3.11.7 that is 667 files,
10.1 MB (644 train, 23 held out; 2.78M and 44K tokens with the 4096-token vocabulary).

Split. By file, fixed by the path alone: a file is held out when the first 8 bytes of
SHA-256(relative path), read as an integer over 2**64, fall below `heldout_fraction` (3%). Adding
or removing other files never moves a file between splits. The tokenizer is trained on the train
split only.

Tokenizer. Byte-level BPE (GPT-2's pre-tokenizer regex and byte-to-unicode alphabet, Hugging Face
`tokenizers`), `<|endoftext|>` as id 0: the end-of-document token and the separator between
packed documents. Every byte is in the alphabet, so any text round-trips.

Packing into training rows: `mtp_jax.training.batches` (re-exported here).

Everything `prepare_corpus` builds (tokenizer, token arrays, metadata) is cached in a work dir and
reused while the documents, vocabulary size, split and tokenizer are unchanged. `load_corpus_dir` reads
such a directory back as it is, or any other with the same files (`mtp-jax distill-data`'s output,
`mtp_jax.training.distill`), fingerprinted by its content (`mtp-jax train --data DIR`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import sys
import sysconfig
from collections.abc import Iterable, Mapping

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mtp_jax.training.batches import (  # noqa: F401  (re-exported: packing is part of this module's interface)
    PackedBatches,
    TokenizedSplit,
    heldout_batches,
    segment_ids_from_documents,
)

EOS_TOKEN = "<|endoftext|>"
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
GENERATED_FILES = frozenset({"pydoc_data/topics.py"})
DEFAULT_HELDOUT_FRACTION = 0.03
_CACHE_VERSION = 1


# ----------------------------------------------------------------------------------------------
# Corpus and split.


def is_excluded(relpath: str, text: str | None = None) -> bool:
    """Whether a stdlib file (POSIX path relative to the stdlib root) is left out of the corpus."""
    parts = relpath.split("/")
    if any(part in EXCLUDED_DIRS for part in parts[:-1]) or relpath in GENERATED_FILES:
        return True
    if parts[-1].startswith("_sysconfigdata"):
        return True
    return parts[0] == "encodings" and text is not None and "gencodec.py" in text[:500]


def stdlib_documents(root: str | pathlib.Path | None = None) -> dict[str, str]:
    """The corpus: {relative POSIX path: source text} for the stdlib's `*.py` files, sorted by path.

    root defaults to the running interpreter's `sysconfig.get_paths()["stdlib"]`. Files that are
    not valid UTF-8 are skipped (none are in CPython 3.11's kept files).
    """
    root = pathlib.Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    documents = {}
    for path in sorted(root.rglob("*.py")):
        relpath = path.relative_to(root).as_posix()
        if is_excluded(relpath):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not is_excluded(relpath, text):
            documents[relpath] = text
    return documents


def is_heldout(relpath: str, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> bool:
    """Whether a document belongs to the held-out split: SHA-256(path)[:8] / 2**64 < fraction."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < heldout_fraction * 2**64


def split_documents(
    documents: Mapping[str, str], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION
) -> tuple[dict[str, str], dict[str, str]]:
    """(train, heldout): the documents partitioned by `is_heldout`, each sorted by path."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    train, heldout = {}, {}
    for relpath in sorted(documents):
        (heldout if is_heldout(relpath, heldout_fraction) else train)[relpath] = documents[relpath]
    return train, heldout


# ----------------------------------------------------------------------------------------------
# Tokenizer.


def heldout_prompts(tokenizer: Tokenizer, count: int, length: int) -> list[list[int]]:
    """Benchmark prompts: the first `length` token ids of the first `count` held-out stdlib files
    (sorted by path) that have that many. Raises ValueError when fewer files are long enough."""
    _, heldout = split_documents(stdlib_documents())
    prompts = []
    for name in sorted(heldout):
        ids = tokenizer.encode(heldout[name]).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {length} tokens")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, *, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE tokenizer with `vocab_size` entries, `<|endoftext|>` first (id 0).

    The 256 byte symbols are always in the vocabulary; the rest are merges learned from `texts`
    (fewer if the texts run out of pairs seen `min_frequency` times). Raises ValueError if
    vocab_size < 257.
    """
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOS_TOKEN}), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (int32 [V]); special tokens count 0 bytes.

    For byte-level vocabularies each symbol is one byte; for other tokenizers each id is decoded
    on its own, which is exact except for ids that are partial UTF-8 sequences.
    """
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    lengths = np.zeros((vocab_size,), np.int32)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special:
            continue
        lengths[i] = len(token) if byte_level else len(tokenizer.decode([i]).encode("utf-8"))
    return lengths


# ----------------------------------------------------------------------------------------------
# Tokenized splits.


def tokenize_documents(tokenizer: Tokenizer, texts: Iterable[str], eos_id: int) -> TokenizedSplit:
    """Each text encoded (no special tokens added), followed by `eos_id`, laid end to end."""
    pieces = [np.asarray(e.ids + [eos_id], np.int32) for e in tokenizer.encode_batch(list(texts))]
    lengths = np.asarray([len(p) for p in pieces], np.int64)
    tokens = np.concatenate(pieces) if pieces else np.zeros((0,), np.int32)
    return TokenizedSplit(tokens=tokens, offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenizer and the two tokenized splits, as `prepare_corpus` built or loaded them."""

    tokenizer: Tokenizer
    train: TokenizedSplit
    heldout: TokenizedSplit
    eos_id: int
    metadata: dict
    work_dir: pathlib.Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def tokenizer_path(self) -> pathlib.Path:
        return self.work_dir / "tokenizer.json"


def _fingerprint(documents: Mapping[str, str], **settings) -> str:
    h = hashlib.sha256(json.dumps({"version": _CACHE_VERSION, **settings}, sort_keys=True).encode())
    for relpath in sorted(documents):
        h.update(relpath.encode("utf-8") + b"\0" + hashlib.sha256(documents[relpath].encode("utf-8")).digest())
    return h.hexdigest()


def prepare_corpus(
    work_dir: str | pathlib.Path,
    *,
    documents: Mapping[str, str] | None = None,
    vocab_size: int = 4096,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    tokenizer_path: str | pathlib.Path | None = None,
    eos_token: str = EOS_TOKEN,
    verbose: bool = False,
) -> Corpus:
    """Split, tokenize and cache a corpus in `work_dir`; reuse the cache when nothing changed.

    Args:
      work_dir: created if missing; holds `tokenizer.json`, `corpus.json` (metadata: Python
        version, stdlib root, exclusions, files per split, token and byte counts) and
        `{train,heldout}_{tokens,offsets}.npy`.
      documents: {relative path: text}; defaults to `stdlib_documents()`.
      vocab_size: size of the BPE vocabulary to train (ignored when `tokenizer_path` is given).
      heldout_fraction: share of files held out (see `is_heldout`).
      tokenizer_path: an existing `tokenizer.json` to use instead of training one (e.g. a Hugging
        Face model's, for `--mtp-only`); copied into work_dir.
      eos_token: the document separator; must be in the tokenizer's vocabulary.

    Raises ValueError if either split is empty or `eos_token` is unknown to the tokenizer.
    """
    work_dir = pathlib.Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    from_stdlib = documents is None
    documents = stdlib_documents() if documents is None else dict(documents)
    given_tokenizer = pathlib.Path(tokenizer_path).read_text() if tokenizer_path is not None else None
    fingerprint = _fingerprint(
        documents,
        vocab_size=None if given_tokenizer else vocab_size,
        heldout_fraction=heldout_fraction,
        tokenizer=hashlib.sha256(given_tokenizer.encode()).hexdigest() if given_tokenizer else None,
        eos_token=eos_token,
    )
    meta_path = work_dir / "corpus.json"
    names = [f"{split}_{part}.npy" for split in ("train", "heldout") for part in ("tokens", "offsets")]
    if meta_path.exists() and all((work_dir / n).exists() for n in names + ["tokenizer.json"]):
        metadata = json.loads(meta_path.read_text())
        if metadata.get("fingerprint") == fingerprint:
            if verbose:
                print(f"corpus: using the cache in {work_dir}", file=sys.stderr)
            tokenizer = Tokenizer.from_file(str(work_dir / "tokenizer.json"))
            train, heldout = (
                TokenizedSplit(np.load(work_dir / f"{s}_tokens.npy"), np.load(work_dir / f"{s}_offsets.npy"))
                for s in ("train", "heldout")
            )
            return Corpus(tokenizer, train, heldout, metadata["eos_id"], metadata, work_dir)

    train_docs, heldout_docs = split_documents(documents, heldout_fraction)
    if not train_docs or not heldout_docs:
        raise ValueError(
            f"both splits need documents: {len(train_docs)} train, {len(heldout_docs)} held out "
            f"(of {len(documents)} at heldout_fraction={heldout_fraction})"
        )
    if verbose:
        print(
            f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out files; tokenizing into {work_dir}",
            file=sys.stderr,
        )
    if given_tokenizer is not None:
        tokenizer = Tokenizer.from_str(given_tokenizer)
    else:
        tokenizer = train_tokenizer(train_docs.values(), vocab_size)
    eos_id = tokenizer.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
    train = tokenize_documents(tokenizer, train_docs.values(), eos_id)
    heldout = tokenize_documents(tokenizer, heldout_docs.values(), eos_id)
    metadata = {
        "fingerprint": fingerprint,
        "source": "stdlib" if from_stdlib else "documents",
        "python_version": sys.version,
        "python_implementation": platform.python_implementation(),
        "stdlib_root": sysconfig.get_paths()["stdlib"] if from_stdlib else None,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "excluded_files": sorted(GENERATED_FILES) + ["_sysconfigdata*.py", "encodings/* written by gencodec.py"],
        "heldout_fraction": heldout_fraction,
        "tokenizer_source": "given" if given_tokenizer is not None else "trained",
        "heldout_files": list(heldout_docs),
        "eos_token": eos_token,
        "eos_id": eos_id,
        "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
        **{
            f"num_{name}_{key}": value
            for name, docs, split in (("train", train_docs, train), ("heldout", heldout_docs, heldout))
            for key, value in (
                ("files", len(docs)),
                ("tokens", split.num_tokens),
                ("bytes", sum(len(t.encode("utf-8")) for t in docs.values())),
            )
        },
    }
    tokenizer.save(str(work_dir / "tokenizer.json"))
    for name, split in (("train", train), ("heldout", heldout)):
        np.save(work_dir / f"{name}_tokens.npy", split.tokens)
        np.save(work_dir / f"{name}_offsets.npy", split.offsets)
    meta_path.write_text(json.dumps(metadata, indent=1))
    return Corpus(tokenizer, train, heldout, eos_id, metadata, work_dir)


# ----------------------------------------------------------------------------------------------
# Data directories: a corpus read back from its files (`mtp-jax train --data DIR`).

SPLITS = ("train", "heldout")
SPLIT_FILES = tuple(f"{split}_{part}.npy" for split in SPLITS for part in ("tokens", "offsets"))
PROMPT_LENGTH_FILES = tuple(f"{split}_prompt_lengths.npy" for split in SPLITS)  # distilled data only


def same_tokenizer(a: str | pathlib.Path, b: str | pathlib.Path) -> bool:
    """Whether two tokenizer.json files hold the same tokenizer (compared as `tokenizers` serializes them
    again, so formatting and key order do not matter). Raises ValueError naming a file it cannot read."""

    def canonical(path) -> str:
        try:
            return Tokenizer.from_file(str(path)).to_str()
        except Exception as error:  # noqa: BLE001  (tokenizers raises its own Exception for a bad file)
            raise ValueError(f"{path} is not a readable tokenizer.json: {error}") from None

    return canonical(a) == canonical(b)


def data_dir_fingerprint(path: str | pathlib.Path) -> str:
    """SHA-256 (hex) of a data directory's content: tokenizer.json and the split arrays (`SPLIT_FILES`, and
    `PROMPT_LENGTH_FILES` where present), each file's name and bytes. Any change to a token, an offset, a
    prompt length or the tokenizer changes it; corpus.json's other metadata does not."""
    path = pathlib.Path(path)
    h = hashlib.sha256()
    for name in ("tokenizer.json", *SPLIT_FILES, *PROMPT_LENGTH_FILES):
        if (path / name).is_file():
            with open(path / name, "rb") as f:
                h.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _read_split(path: pathlib.Path, split: str, vocab_size: int) -> TokenizedSplit:
    """`split`'s arrays from `path`, checked: int32 tokens in [0, vocab_size), offsets from 0 to their count."""
    try:
        tokens, offsets = (np.load(path / f"{split}_{part}.npy", allow_pickle=False) for part in ("tokens", "offsets"))
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read the {split} split: {error}") from None
    problem = None
    if tokens.ndim != 1 or tokens.dtype != np.int32:
        problem = f"{split}_tokens.npy must be 1-D int32, got {tokens.dtype} of shape {tokens.shape}"
    elif offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) < 2:
        problem = f"{split}_offsets.npy must be 1-D int64 with at least 2 entries, got {offsets.dtype} {offsets.shape}"
    elif offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) <= 0):
        problem = f"{split}_offsets.npy must rise from 0 to {len(tokens)} (the token count), one document per step"
    elif tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        problem = f"{split}_tokens.npy holds ids outside the tokenizer's [0, {vocab_size})"
    if problem:
        raise ValueError(f"{path}: {problem}")
    return TokenizedSplit(tokens=tokens, offsets=offsets)


def load_corpus_dir(path: str | pathlib.Path) -> Corpus:
    """The corpus in a data directory: a finished `mtp-jax distill-data` output (`mtp_jax.training.distill`)
    or a `prepare_corpus` cache, i.e. tokenizer.json, corpus.json (its "eos_id") and
    `{train,heldout}_{tokens,offsets}.npy` (each document ends with its EOS; both splits non-empty).

    The returned metadata is corpus.json's with "source" "data_dir" (the file's own source kept as
    "data_source"), "tokenizer_source" "data_dir" and "fingerprint" `data_dir_fingerprint(path)`, which is
    what a run started on it records and a resume compares. Raises FileNotFoundError for a missing
    directory or file (an unfinished distillation has no corpus.json yet) and ValueError for files that do
    not make a corpus (unreadable, wrong dtypes, offsets that do not cover the tokens, ids outside the
    vocabulary, an empty split).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"data directory {path} does not exist")
    missing = [n for n in ("corpus.json", "tokenizer.json", *SPLIT_FILES) if not (path / n).is_file()]
    if missing:
        unfinished = (path / "distill.json").is_file() and "corpus.json" in missing
        hint = (
            ": an unfinished `mtp-jax distill-data` output (rerun it with the same arguments to finish it)"
            if unfinished
            else " (a data directory holds tokenizer.json, corpus.json and {train,heldout}_{tokens,offsets}.npy)"
        )
        raise FileNotFoundError(f"{path} has no {', '.join(missing)}{hint}")
    try:
        metadata = json.loads((path / "corpus.json").read_text(encoding="utf-8"))
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as error:  # noqa: BLE001  (JSON, UTF-8 and tokenizers errors alike)
        raise ValueError(f"{path}: cannot read corpus.json or tokenizer.json: {error}") from None
    eos_id = metadata.get("eos_id") if isinstance(metadata, dict) else None
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not isinstance(eos_id, int) or isinstance(eos_id, bool) or not 0 <= eos_id < vocab_size:
        raise ValueError(f"{path}/corpus.json: eos_id must be a token id of tokenizer.json, got {eos_id!r}")
    train, heldout = (_read_split(path, split, vocab_size) for split in SPLITS)
    metadata = {
        **metadata,
        "source": "data_dir",
        "data_source": metadata.get("source"),
        "tokenizer_source": "data_dir",
        "fingerprint": data_dir_fingerprint(path),
        "vocab_size": vocab_size,
    }
    return Corpus(tokenizer, train, heldout, eos_id, metadata, path)
