"""Self-distillation data (`mtp_jax.training.distill`, `mtp-jax distill-data`) and training on it (`train --data`):
speculative greedy samples equal plain greedy ones; a run killed with SIGKILL and rerun ends byte-identical to an
uninterrupted one; other settings or a foreign directory are refused; `train --data` runs, resumes on the same data
and refuses changed data or another tokenizer."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from mtp_jax.checkpoints.pretrained import load_pretrained, save_pretrained
from mtp_jax.cli import main
from mtp_jax.compilation_cache import set_compilation_cache
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.model import init_model
from mtp_jax.training import data
from mtp_jax.training.distill import DistillConfig, SettingsDiffer, distill

TEXT = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n"] * 20
PROMPTS = ["def add(a, b):", "import os", "class A:\n    pass", "def f(x):", "import sys", "return a", "class B:"]
DOCUMENTS = {f"pkg/mod_{i}.py": "".join(TEXT[i % 3 : i % 3 + 6]) for i in range(16)}
ARRAYS = [f"{split}_{part}.npy" for split in ("train", "heldout") for part in ("tokens", "offsets", "prompt_lengths")]
# Every run decodes batches of 2 rows, 12 new tokens, eagle K = 2, in a cache of the longest prompt + 12 tokens:
# one set of compiled programs for all (temperature and seeds are data).
SHAPES = dict(batch_size=2, max_new_tokens=12, speculative="eagle", num_speculative_tokens=2)
# The kill test's settings: 21 chunks of 2 samples, sampled (per-sample seeds).
KILL_CONFIG = DistillConfig(num_samples=40, heldout_samples=2, chunk_size=2, temperature=0.8, seed=3, **SHAPES)
KILL_ARGS = ["--num-samples", "40", "--heldout-samples", "2", "--batch-size", "2", "--chunk-size", "2"]
KILL_ARGS += ["--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", "--speculative", "eagle", "--k", "2"]


@pytest.fixture(autouse=True)
def cache_in_tmp(monkeypatch, tmp_path):
    """The CLI's caches go to a temporary directory; the process-wide compilation-cache settings are undone."""
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "cache"))
    names = (
        "jax_enable_compilation_cache",
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {name: getattr(jax.config, name) for name in names}
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    """A compilation cache the first test in this process fills and the CLI subprocesses read (so that they
    load the programs instead of compiling them again)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    tokenizer = data.train_tokenizer(TEXT, vocab_size=300)
    config = ModelConfig.from_name(
        "tiny", vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=1, num_nextn_predict_layers=1, eos_token_id=0
    )
    save_pretrained(init_model(config, seed=0), path, tokenizer=tokenizer)
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """The prompts as JSONL (one holds a newline, which a plain text file could not)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def reference(model_dir, prompts_file, tmp_path_factory):
    """An uninterrupted run with the kill test's settings, in this process."""
    out = tmp_path_factory.mktemp("reference") / "out"
    distill(model_dir, out, KILL_CONFIG, prompts_file=prompts_file, progress=False)
    return out


def _arrays(out) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in [*ARRAYS, "corpus.json", "tokenizer.json"]}


def test_speculative_samples_equal_plain_greedy(model_dir, prompts_file, jax_cache, tmp_path):
    """Each sample is prompt + plain greedy continuation + EOS (unless it stopped at one), batch by batch; the
    last prompt is held out; the result is a corpus of the model's tokenizer."""
    set_compilation_cache(jax_cache / "jax_cache")  # undone by `cache_in_tmp`
    config = DistillConfig(num_samples=6, heldout_samples=1, **SHAPES)
    result = distill(model_dir, tmp_path / "out", config, prompts_file=prompts_file, progress=False)
    model, tokenizer = load_pretrained(model_dir)
    ids = [tokenizer.encode(p).ids for p in PROMPTS]
    max_length = max(map(len, ids)) + 12
    expected = []
    for batch in (ids[0:2], ids[2:4], ids[4:6], ids[6:]):  # the last: the held-out prompt, padded to 2 rows
        plain = generate(model, batch + batch[:1] * (2 - len(batch)), max_new_tokens=12, max_length=max_length)
        for prompt, tokens, reason in zip(batch, plain.tokens, plain.finish_reasons, strict=False):
            expected.append(prompt + tokens + ([] if reason == "stop" else [0]))
    corpus = result.corpus
    assert [corpus.train.document(i).tolist() for i in range(6)] == expected[:6]
    assert [corpus.heldout.document(0).tolist()] == expected[6:]
    assert corpus.train.tokens.dtype == np.int32 and corpus.eos_id == 0
    assert np.load(tmp_path / "out" / "train_prompt_lengths.npy").tolist() == [len(p) for p in ids[:6]]
    assert np.load(tmp_path / "out" / "heldout_prompt_lengths.npy").tolist() == [len(ids[6])]
    assert data.same_tokenizer(corpus.tokenizer_path, model_dir / "tokenizer.json")
    assert result.generated_samples == 7 and result.mean_acceptance_length >= 1
    assert not (tmp_path / "out" / "chunks").exists()  # removed once complete
    again = distill(model_dir, tmp_path / "out", config, prompts_file=prompts_file, progress=False)
    assert again.generated_samples == 0 and again.corpus.metadata["fingerprint"] == corpus.metadata["fingerprint"]


def test_corpus_prompts_are_windows_of_their_split(model_dir, tmp_path, monkeypatch):
    """--corpus: train prompts are windows of train documents, held-out ones of held-out documents."""
    corpus = data.prepare_corpus(
        tmp_path / "corpus",
        documents=DOCUMENTS,
        heldout_fraction=0.25,
        tokenizer_path=model_dir / "tokenizer.json",
    )
    n = max(len(corpus.tokenizer.encode(p).ids) for p in PROMPTS)  # windows of n tokens: the same shapes as above
    config = DistillConfig(num_samples=4, heldout_samples=4, prompt_len=n, **SHAPES)
    result = distill(model_dir, tmp_path / "out", config, corpus=tmp_path / "corpus", progress=False)
    for split, source in ((result.corpus.train, corpus.train), (result.corpus.heldout, corpus.heldout)):
        texts = [source.document(d)[:-1].tolist() for d in range(source.num_documents)]
        for i in range(split.num_documents):
            prompt = split.document(i)[:n].tolist()
            assert any(prompt == t[s : s + n] for t in texts for s in range(len(t) - n + 1)), (i, prompt)
    assert np.load(tmp_path / "out" / "train_prompt_lengths.npy").tolist() == [n] * 4
    assert result.corpus.metadata["settings"]["prompt_len"] == n

    # Without --prompts or --corpus the CLI prepares the stdlib corpus with the model's tokenizer (here the
    # same small corpus stands in for it): the same prompts, the same data set.
    asked = []
    monkeypatch.setattr(data, "prepare_corpus", lambda work_dir, **kwargs: asked.append(kwargs) or corpus)
    argv = ["distill-data", str(model_dir), "--out", str(tmp_path / "cli"), "--num-samples", "4"]
    argv += ["--heldout-samples", "4", "--prompt-len", str(n), "--batch-size", "2", "--max-new-tokens", "12"]
    assert main([*argv, "--speculative", "eagle", "--k", "2", "--no-progress", "--no-compilation-cache"]) == 0
    assert asked == [{"tokenizer_path": model_dir / "tokenizer.json", "eos_token": data.EOS_TOKEN, "verbose": True}]
    assert _arrays(tmp_path / "cli") == _arrays(tmp_path / "out")


def _manifest_chunks(out) -> tuple[int, bool]:
    try:
        manifest = json.loads((out / "distill.json").read_text())
    except (OSError, ValueError):
        return 0, False
    return len(manifest["chunks"]), manifest["complete"]


def _cli(model_dir, prompts_file, out, jax_cache) -> subprocess.Popen:
    argv = [sys.executable, "-m", "mtp_jax.cli", "distill-data", str(model_dir), "--out", str(out)]
    argv += ["--prompts", str(prompts_file), "--no-progress", *KILL_ARGS]
    env = {**os.environ, "MTP_JAX_CACHE": str(jax_cache)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _kill_when(proc: subprocess.Popen, out, done, delay: float = 0.0) -> int:
    """SIGKILLs `proc` `delay` s after `done(chunks in the manifest)` first holds; returns the chunks then."""
    deadline = time.monotonic() + 240
    while not done(_manifest_chunks(out)[0]):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no chunk landed in time"
        time.sleep(0.005)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    chunks, complete = _manifest_chunks(out)
    assert not complete, "the run ended before the kill: nothing was tested"
    return chunks


def test_resume_after_sigkill_is_byte_identical(model_dir, prompts_file, reference, jax_cache, tmp_path):
    """Killed after its first chunk, then again at a random moment mid-run, the CLI rerun with the same
    arguments ends with the reference's arrays byte for byte, every sample once."""
    out = tmp_path / "out"
    first = _kill_when(_cli(model_dir, prompts_file, out, jax_cache), out, lambda n: n >= 1)
    second = _kill_when(
        _cli(model_dir, prompts_file, out, jax_cache), out, lambda n: n >= first + 2, random.Random(0).uniform(0, 0.05)
    )
    assert 1 <= first < second < 21
    proc = _cli(model_dir, prompts_file, out, jax_cache)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr
    assert json.loads(stdout)["generated_now"] == 42 - 2 * second  # the chunks the kills left, no more
    assert _arrays(out) == _arrays(reference)
    corpus = data.load_corpus_dir(out)
    assert (corpus.train.num_documents, corpus.heldout.num_documents) == (40, 2)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [*ARRAYS, "corpus.json", "tokenizer.json", "distill.json", "distill.lock"]
    )


def test_other_settings_and_foreign_directories_are_refused(model_dir, prompts_file, reference, tmp_path, capsys):
    argv = ["distill-data", str(model_dir), "--out", str(reference), "--prompts", str(prompts_file), *KILL_ARGS]
    assert main([*argv, "--no-progress", "--no-compilation-cache"]) == 0  # the same: complete already
    assert "complete already" in capsys.readouterr().err
    before = _arrays(reference)
    changed = [*argv[:-1], "3", "--num-samples", "41", "--no-compilation-cache"]  # --k 3 and --num-samples 41
    assert main(changed) == 2
    err = capsys.readouterr().err
    assert "--num-samples (saved 40, given 41)" in err and "--num-speculative-tokens (saved 2, given 3)" in err
    assert err.startswith("mtp-jax distill-data: error: --out") and err.count("\n") == 1
    with pytest.raises(SettingsDiffer, match=r"temperature \(saved 0.8, given 0.5\)"):
        distill(model_dir, reference, dataclasses.replace(KILL_CONFIG, temperature=0.5), prompts_file=prompts_file)
    assert _arrays(reference) == before
    bad = [*argv[:3], str(tmp_path / "bad"), *argv[4:6], "--speculative", "vanilla", "--k", "2"]  # K > D = 1
    assert main([*bad, "--no-compilation-cache"]) == 2
    assert "--num-speculative-tokens: method 'vanilla' drafts one token per module" in capsys.readouterr().err
    assert not (tmp_path / "bad" / "distill.json").exists()  # nothing recorded: a corrected rerun is free to start
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert main(["distill-data", str(model_dir), "--out", str(foreign), "--prompts", str(prompts_file)]) == 2
    assert "not empty and holds no distillation" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]


def _train(argv, capsys) -> tuple[int, str]:
    code = main(["train", *argv, "--no-progress", "--no-export"])
    return code, capsys.readouterr().err


def test_train_on_distilled_data_and_resume(model_dir, reference, tmp_path, capsys):
    run = tmp_path / "run"
    fresh = ["--init-from", str(model_dir), "--mtp-only", "--data", str(reference), "--steps", "2", "--warmup", "0"]
    fresh += ["--batch-size", "2", "--seq-len", "16", "--eval-batches", "1"]
    code, err = _train([str(run), *fresh], capsys)
    assert code == 0, err
    saved = json.loads((run / "run.json").read_text())["corpus"]
    assert saved["source"] == "data_dir" and saved["work_dir"] == str(reference.resolve())
    assert saved["fingerprint"] == data.data_dir_fingerprint(reference)
    code, err = _train([str(run), "--resume", "--steps", "3"], capsys)
    assert code == 0, err

    changed = tmp_path / "changed"
    changed.mkdir()
    for name in [*ARRAYS, "corpus.json", "tokenizer.json"]:
        (changed / name).write_bytes((reference / name).read_bytes())
    tokens = np.load(changed / "train_tokens.npy")
    tokens[3] = (tokens[3] + 1) % 200
    np.save(changed / "train_tokens.npy", tokens)
    code, err = _train([str(run), "--resume", "--steps", "4", "--data", str(changed)], capsys)
    assert code == 2 and "changed since the run" in err and str(changed) in err
    code, err = _train([str(run), "--resume", "--steps", "4", "--data-dir", str(changed)], capsys)
    assert code == 2 and "--data-dir does not apply" in err

    other = tmp_path / "other_model"  # the same model with another tokenizer
    model, _ = load_pretrained(model_dir)
    save_pretrained(model, other, tokenizer=data.train_tokenizer(TEXT, vocab_size=280))
    code, err = _train([str(tmp_path / "run2"), *fresh[:1], str(other), *fresh[2:]], capsys)
    assert code == 2 and "is not the model's" in err and not (tmp_path / "run2" / "run.json").exists()
    code, err = _train([str(tmp_path / "run3"), *fresh, "--vocab-size", "512"], capsys)
    assert code == 2 and "--vocab-size" in err
