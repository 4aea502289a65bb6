"""Training data: the Python standard library as a corpus, a byte-level BPE tokenizer, packed batches.

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

Packing. Each document is its tokens followed by `<|endoftext|>`. Epoch e lays the training
documents end to end in the order `permutation(seed, e)`; epochs follow each other as one endless
stream, cut into rows of T tokens (stream row i is tokens `[i T, (i + 1) T)`). A document that does
not fit in a row continues in the next row, so no token is lost or repeated within an epoch.
Rows are then shuffled so that the B rows of a step come from all over the corpus (one step of
consecutive rows would be one or two files: a stdlib module is ~4k tokens): the stream is split
into rounds of R = B * ceil(rows per epoch / B) rows, about one epoch each, and step n takes rows
`q R + permutation(seed, q)[m B .. m B + B - 1]` of its round q = n // (R / B), m = n mod (R / B).
Every stream row is used exactly once per round, and a step's batch is a pure function of
(seed, n): resuming at step n needs nothing but n. `segment_ids` number the (pieces of) documents
in a row 1, 2, ...; 0 marks padding, which only the held-out batches use, to fill their last rows.

Everything `prepare_corpus` builds (tokenizer, token arrays, metadata) is cached in a work dir and
reused while the documents, vocabulary size, split and tokenizer are unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import platform
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
from jaxtyping import Int
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def split_documents(documents: Mapping[str, str],
                    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION) -> tuple[dict[str, str], dict[str, str]]:
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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=[EOS_TOKEN], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
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


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """Documents as one flat array: document i is `tokens[offsets[i]:offsets[i + 1]]`, EOS last.

    tokens: int32 [N]; offsets: int64 [num_documents + 1], offsets[0] = 0, offsets[-1] = N.
    """

    tokens: np.ndarray
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def document(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


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


def prepare_corpus(work_dir: str | pathlib.Path, *, documents: Mapping[str, str] | None = None,
                   vocab_size: int = 4096, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                   tokenizer_path: str | pathlib.Path | None = None, eos_token: str = EOS_TOKEN,
                   verbose: bool = False) -> Corpus:
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
        documents, vocab_size=None if given_tokenizer else vocab_size, heldout_fraction=heldout_fraction,
        tokenizer=hashlib.sha256(given_tokenizer.encode()).hexdigest() if given_tokenizer else None,
        eos_token=eos_token)
    meta_path = work_dir / "corpus.json"
    names = [f"{split}_{part}.npy" for split in ("train", "heldout") for part in ("tokens", "offsets")]
    if meta_path.exists() and all((work_dir / n).exists() for n in names + ["tokenizer.json"]):
        metadata = json.loads(meta_path.read_text())
        if metadata.get("fingerprint") == fingerprint:
            if verbose:
                print(f"corpus: using the cache in {work_dir}", file=sys.stderr)
            tokenizer = Tokenizer.from_file(str(work_dir / "tokenizer.json"))
            train, heldout = (TokenizedSplit(np.load(work_dir / f"{s}_tokens.npy"),
                                             np.load(work_dir / f"{s}_offsets.npy")) for s in ("train", "heldout"))
            return Corpus(tokenizer, train, heldout, metadata["eos_id"], metadata, work_dir)

    train_docs, heldout_docs = split_documents(documents, heldout_fraction)
    if not train_docs or not heldout_docs:
        raise ValueError(f"both splits need documents: {len(train_docs)} train, {len(heldout_docs)} held out "
                         f"(of {len(documents)} at heldout_fraction={heldout_fraction})")
    if verbose:
        print(f"corpus: {len(train_docs)} train / {len(heldout_docs)} held-out files; tokenizing into {work_dir}",
              file=sys.stderr)
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
        **{f"num_{name}_{key}": value for name, docs, split in (("train", train_docs, train),
                                                                ("heldout", heldout_docs, heldout))
           for key, value in (("files", len(docs)), ("tokens", split.num_tokens),
                              ("bytes", sum(len(t.encode("utf-8")) for t in docs.values())))},
    }
    tokenizer.save(str(work_dir / "tokenizer.json"))
    for name, split in (("train", train), ("heldout", heldout)):
        np.save(work_dir / f"{name}_tokens.npy", split.tokens)
        np.save(work_dir / f"{name}_offsets.npy", split.offsets)
    meta_path.write_text(json.dumps(metadata, indent=1))
    return Corpus(tokenizer, train, heldout, eos_id, metadata, work_dir)


# ----------------------------------------------------------------------------------------------
# Packing.


def segment_ids_from_documents(document_ids: Int[np.ndarray, "... T"]) -> Int[np.ndarray, "... T"]:
    """Per-row segment ids 1, 2, ...: a new segment starts wherever the document id changes."""
    changes = (document_ids[..., 1:] != document_ids[..., :-1]).astype(np.int32)  # [..., T-1]
    return np.concatenate([np.ones_like(document_ids[..., :1], np.int32), 1 + np.cumsum(changes, axis=-1,
                                                                                         dtype=np.int32)], axis=-1)


class PackedBatches:
    """Training batches of B rows of T tokens, shuffled rows of an endless, reshuffled document stream.

    `batch(step)` is a pure function of (split, batch_size, seq_len, seed, step): a new object
    gives the same batch for the same step, so a resumed run continues the same data order.
    Epoch e's document order is `np.random.default_rng([seed, e]).permutation(num_documents)`;
    round q's row order is `np.random.default_rng([seed, q, 1]).permutation(rows_per_round)` (module
    docstring, "Packing").
    """

    def __init__(self, split: TokenizedSplit, batch_size: int, seq_len: int, seed: int = 0):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size}, {seq_len}")
        if split.num_tokens == 0:
            raise ValueError("cannot pack an empty split")
        self.split, self.batch_size, self.seq_len, self.seed = split, batch_size, seq_len, seed
        self.steps_per_round = -(-split.num_tokens // (batch_size * seq_len))
        self.rows_per_round = self.steps_per_round * batch_size
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._rounds: dict[int, np.ndarray] = {}

    @property
    def tokens_per_epoch(self) -> int:
        return self.split.num_tokens

    @property
    def steps_per_epoch(self) -> float:
        return self.tokens_per_epoch / (self.batch_size * self.seq_len)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document ids) of epoch `epoch`'s stream, both [tokens_per_epoch]."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 3:
                del self._epochs[min(self._epochs)]
            num_docs = self.split.num_documents
            order = np.random.default_rng([self.seed, epoch]).permutation(num_docs)
            lengths = np.diff(self.split.offsets)[order]  # [num_docs]
            starts_out = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # where each document lands
            index = np.repeat(self.split.offsets[order] - starts_out, lengths) + np.arange(self.tokens_per_epoch)
            document_ids = np.repeat(epoch * num_docs + np.arange(num_docs, dtype=np.int64), lengths)
            self._epochs[epoch] = (self.split.tokens[index], document_ids)
        return self._epochs[epoch]

    def _stream(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        tokens, document_ids = [], []
        while length > 0:
            epoch, offset = divmod(start, self.tokens_per_epoch)
            take = min(length, self.tokens_per_epoch - offset)
            epoch_tokens, epoch_docs = self._epoch(epoch)
            tokens.append(epoch_tokens[offset:offset + take])
            document_ids.append(epoch_docs[offset:offset + take])
            start, length = start + take, length - take
        return np.concatenate(tokens), np.concatenate(document_ids)

    def stream_row(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document ids) of stream row `row` (0-based), both [T], before row shuffling."""
        return self._stream(row * self.seq_len, self.seq_len)

    def row_indices(self, step: int) -> np.ndarray:
        """The stream rows, int64 [B], that make up step `step`'s batch, in batch order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        round_, m = divmod(step, self.steps_per_round)
        if round_ not in self._rounds:
            if len(self._rounds) >= 2:
                del self._rounds[min(self._rounds)]
            self._rounds[round_] = np.random.default_rng([self.seed, round_, 1]).permutation(self.rows_per_round)
        order = self._rounds[round_][m * self.batch_size:(m + 1) * self.batch_size]
        return round_ * self.rows_per_round + order

    def batch(self, step: int) -> tuple[Int[np.ndarray, "B T"], Int[np.ndarray, "B T"]]:
        """(tokens, segment_ids), both int32 [B, T], for training step `step` (0-based)."""
        rows = [self.stream_row(int(i)) for i in self.row_indices(step)]
        tokens = np.stack([t for t, _ in rows]).astype(np.int32)
        return tokens, segment_ids_from_documents(np.stack([d for _, d in rows]))

    def iterate(self, start_step: int = 0) -> Iterator[tuple[Int[np.ndarray, "B T"], Int[np.ndarray, "B T"]]]:
        """batch(start_step), batch(start_step + 1), ... without end."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def heldout_batches(split: TokenizedSplit, batch_size: int, seq_len: int, *, pad_id: int = 0,
                    max_batches: int | None = None) -> Iterator[tuple[Int[np.ndarray, "B T"], Int[np.ndarray, "B T"]]]:
    """One pass over `split` in document order: (tokens, segment_ids) int32 [B, T] per batch.

    Every token appears exactly once; the last rows are padded with `pad_id` and segment id 0, so
    every batch has the same shape. `max_batches` stops early (the first batches only).
    """
    rows_total = -(-split.num_tokens // seq_len)
    num_batches = -(-rows_total // batch_size)
    if max_batches is not None:
        num_batches = min(num_batches, max_batches)
    document_ids = np.repeat(np.arange(split.num_documents, dtype=np.int64), np.diff(split.offsets))
    size = batch_size * seq_len
    for b in range(num_batches):
        tokens = np.full((size,), pad_id, np.int32)
        docs = np.full((size,), -1, np.int64)
        piece = slice(b * size, min((b + 1) * size, split.num_tokens))
        n = piece.stop - piece.start
        tokens[:n], docs[:n] = split.tokens[piece], document_ids[piece]
        docs = docs.reshape(batch_size, seq_len)
        segment_ids = np.where(docs >= 0, segment_ids_from_documents(docs), 0).astype(np.int32)
        yield tokens.reshape(batch_size, seq_len), segment_ids
