"""Corpus split, tokenizer, packing and resumable batches (`mtp_jax.training.data`), on a tiny in-memory corpus."""

import json

import numpy as np
import pytest

from mtp_jax.training import data

WORDS = ["foo", "bar", "baz", "self", "value", "items", "x", "y", "naïve", "λ"]


def tiny_documents(num: int = 40, seed: int = 0) -> dict[str, str]:
    """Python-looking documents of 3..11 small functions each, with a little non-ASCII text."""
    rng = np.random.default_rng(seed)
    documents = {}
    for i in range(num):
        functions = []
        for j in range(rng.integers(3, 12)):
            a, b = rng.choice(WORDS, 2)
            functions.append(f"def {a}_{j}(self, {b}):\n    return self.{a} + {b} * {j}  # {a}\n")
        documents[f"pkg{i % 4}/mod_{i}.py"] = "\n".join(functions)
    return documents


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(
        tmp_path_factory.mktemp("corpus"), documents=tiny_documents(), vocab_size=300, heldout_fraction=0.2
    )


def test_split_is_deterministic_disjoint_and_by_path_only():
    names = [f"pkg/mod_{i}.py" for i in range(3000)]
    documents = dict.fromkeys(names, "x = 1\n")
    train, heldout = data.split_documents(documents, 0.03)
    assert set(train).isdisjoint(heldout) and set(train) | set(heldout) == set(names)
    assert (train, heldout) == data.split_documents(dict(reversed(documents.items())), 0.03)
    assert 0.02 < len(heldout) / len(names) < 0.04
    # A file's split depends on its path alone: a subset of the corpus splits the same way.
    _, heldout_subset = data.split_documents({n: documents[n] for n in names[:1000]}, 0.03)
    assert set(heldout_subset) == {n for n in heldout if n in names[:1000]}
    assert data.split_documents(documents, 0.0)[1] == {}


def test_stdlib_exclusions(tmp_path):
    files = {
        "os.py": "import sys\n",
        "idlelib/editor.py": "x = 1\n",
        "encodings/utf_8.py": "import codecs\n",
        "test/test_os.py": "",
        "unittest/test/test_case.py": "",
        "lib2to3/tests/data/bad.py": "",
        "idlelib/idle_test/test_x.py": "",
        "site-packages/pkg/mod.py": "",
        "pydoc_data/topics.py": "",
        "_sysconfigdata__linux_x86_64-linux-gnu.py": "",
        "encodings/cp1252.py": '""" Python Character Mapping Codec cp1252 generated with gencodec.py.\n"""\n',
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "notes.txt").write_text("not python")
    documents = data.stdlib_documents(tmp_path)
    assert list(documents) == ["encodings/utf_8.py", "idlelib/editor.py", "os.py"]
    assert documents["os.py"] == "import sys\n"


def test_tokenizer_round_trips_bytes_and_is_deterministic():
    texts = list(tiny_documents().values())
    tokenizer = data.train_tokenizer(texts, vocab_size=300)
    assert tokenizer.token_to_id(data.EOS_TOKEN) == 0
    assert 257 <= tokenizer.get_vocab_size() <= 300
    assert tokenizer.to_str() == data.train_tokenizer(texts, vocab_size=300).to_str()
    text = "def naïve(λ):\n\treturn '✓ 日本' + \"\\x00\"  \n"  # unseen characters fall back to bytes
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text
    assert data.token_byte_lengths(tokenizer)[ids].sum() == len(text.encode("utf-8"))
    assert data.token_byte_lengths(tokenizer)[0] == 0  # <|endoftext|> stands for no bytes
    with pytest.raises(ValueError, match="vocab_size"):
        data.train_tokenizer(texts, vocab_size=100)


def test_prepare_corpus_tokenizes_splits_and_caches(tmp_path, monkeypatch):
    documents = tiny_documents()
    corpus = data.prepare_corpus(tmp_path, documents=documents, vocab_size=300, heldout_fraction=0.2)
    train_docs, heldout_docs = data.split_documents(documents, 0.2)
    for split, docs in ((corpus.train, train_docs), (corpus.heldout, heldout_docs)):
        assert split.num_documents == len(docs)
        for i, text in enumerate(docs.values()):
            np.testing.assert_array_equal(split.document(i), corpus.tokenizer.encode(text).ids + [corpus.eos_id])
    meta = json.loads((tmp_path / "corpus.json").read_text())
    assert meta["heldout_files"] == list(heldout_docs) and meta["python_version"]
    assert meta["num_train_tokens"] == corpus.train.num_tokens
    assert meta["num_heldout_bytes"] == sum(len(t.encode()) for t in heldout_docs.values())

    def no_training(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(data, "train_tokenizer", no_training)
    cached = data.prepare_corpus(tmp_path, documents=documents, vocab_size=300, heldout_fraction=0.2)
    np.testing.assert_array_equal(cached.train.tokens, corpus.train.tokens)
    np.testing.assert_array_equal(cached.heldout.offsets, corpus.heldout.offsets)
    with pytest.raises(AssertionError, match="cache"):  # a changed document invalidates the cache
        data.prepare_corpus(
            tmp_path, documents={**documents, "pkg0/mod_0.py": "y = 2\n"}, vocab_size=300, heldout_fraction=0.2
        )
    # A given tokenizer is used as is.
    given = data.prepare_corpus(
        tmp_path / "given", documents=documents, heldout_fraction=0.2, tokenizer_path=tmp_path / "tokenizer.json"
    )
    np.testing.assert_array_equal(given.train.tokens, corpus.train.tokens)


def _documents_of(stream: np.ndarray, eos_id: int) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(stream == eos_id)
    return [tuple(doc) for doc in np.split(stream, ends + 1)[:-1]]


def test_packing_covers_each_epoch_exactly_once(corpus):
    batches = data.PackedBatches(corpus.train, batch_size=2, seq_len=16, seed=3)
    num_rows = 2 * corpus.train.num_tokens // 16 + 1  # a little over two epochs
    stream = np.concatenate([batches.stream_row(i)[0] for i in range(num_rows)])
    corpus_docs = sorted(tuple(corpus.train.document(i)) for i in range(corpus.train.num_documents))
    epochs = [stream[: corpus.train.num_tokens], stream[corpus.train.num_tokens : 2 * corpus.train.num_tokens]]
    for epoch in epochs:  # every document once, whole, none lost or repeated
        assert sorted(_documents_of(epoch, corpus.eos_id)) == corpus_docs
    assert _documents_of(epochs[0], corpus.eos_id) != _documents_of(epochs[1], corpus.eos_id)  # reshuffled


def test_steps_take_each_row_of_a_round_once_in_shuffled_order(corpus):
    batches = data.PackedBatches(corpus.train, batch_size=3, seq_len=16, seed=3)
    steps, rows = batches.steps_per_round, batches.rows_per_round
    assert rows == 3 * steps and rows * 16 >= corpus.train.num_tokens > (rows - 3) * 16
    for round_ in range(2):
        taken = np.concatenate([batches.row_indices(n) for n in range(round_ * steps, (round_ + 1) * steps)])
        np.testing.assert_array_equal(np.sort(taken), np.arange(round_ * rows, (round_ + 1) * rows))
        assert not np.array_equal(taken, np.sort(taken))  # shuffled, not consecutive
    for n in (0, steps - 1, steps + 5):
        tokens, _ = batches.batch(n)
        np.testing.assert_array_equal(tokens, np.stack([batches.stream_row(i)[0] for i in batches.row_indices(n)]))


def test_segment_ids_mark_document_boundaries(corpus):
    batches = data.PackedBatches(corpus.train, batch_size=3, seq_len=24, seed=0)
    for step in range(20):
        tokens, segment_ids = batches.batch(step)
        assert tokens.shape == segment_ids.shape == (3, 24) and tokens.dtype == segment_ids.dtype == np.int32
        np.testing.assert_array_equal(segment_ids[:, 0], 1)
        np.testing.assert_array_equal(np.diff(segment_ids, axis=1) == 1, tokens[:, :-1] == corpus.eos_id)
        assert set(np.unique(np.diff(segment_ids, axis=1))) <= {0, 1}


def test_heldout_batches_cover_split_once_with_padding(corpus):
    batches = list(data.heldout_batches(corpus.heldout, batch_size=2, seq_len=16))
    tokens = np.concatenate([t.reshape(-1) for t, _ in batches])
    segment_ids = np.concatenate([s.reshape(-1) for _, s in batches])
    n = corpus.heldout.num_tokens
    assert len(batches) == -(-n // 32) and all(t.shape == (2, 16) for t, _ in batches)
    np.testing.assert_array_equal(tokens[:n], corpus.heldout.tokens)
    assert (segment_ids[:n] > 0).all() and (segment_ids[n:] == 0).all()
    for t, s in batches:
        valid = (s[:, 1:] > 0) & (s[:, :-1] > 0)
        np.testing.assert_array_equal((np.diff(s, axis=1) == 1) & valid, (t[:, :-1] == corpus.eos_id) & valid)
    assert len(list(data.heldout_batches(corpus.heldout, 2, 16, max_batches=1))) == 1


def test_batches_are_resumable_by_step(corpus):
    first = data.PackedBatches(corpus.train, batch_size=2, seq_len=16, seed=7)
    run = [b for _, b in zip(range(12), first.iterate(), strict=False)]
    resumed = data.PackedBatches(corpus.train, batch_size=2, seq_len=16, seed=7)  # a fresh process, step 9
    for step, (tokens, segment_ids) in zip(range(9, 12), resumed.iterate(start_step=9), strict=False):
        np.testing.assert_array_equal(tokens, run[step][0])
        np.testing.assert_array_equal(segment_ids, run[step][1])
    other_seed = data.PackedBatches(corpus.train, batch_size=2, seq_len=16, seed=8)
    assert not np.array_equal(other_seed.batch(0)[0], run[0][0])
