"""A split as token arrays (`TokenizedSplit`) and its packed training rows: `PackedBatches` (shuffled,
resumable) and `heldout_batches` (one pass).

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
from jaxtyping import Int


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
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def segment_ids_from_documents(document_ids: Int[np.ndarray, "... T"]) -> Int[np.ndarray, "... T"]:
    """Per-row segment ids 1, 2, ...: a new segment starts wherever the document id changes."""
    changes = (document_ids[..., 1:] != document_ids[..., :-1]).astype(np.int32)  # [..., T-1]
    return np.concatenate(
        [np.ones_like(document_ids[..., :1], np.int32), 1 + np.cumsum(changes, axis=-1, dtype=np.int32)], axis=-1
    )


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
            tokens.append(epoch_tokens[offset : offset + take])
            document_ids.append(epoch_docs[offset : offset + take])
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
        order = self._rounds[round_][m * self.batch_size : (m + 1) * self.batch_size]
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


def heldout_batches(
    split: TokenizedSplit, batch_size: int, seq_len: int, *, pad_id: int = 0, max_batches: int | None = None
) -> Iterator[tuple[Int[np.ndarray, "B T"], Int[np.ndarray, "B T"]]]:
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
