"""One spelling of the user's model across the commands: `--model DIR` names a saved model directory
(config.json, safetensors, tokenizer.json) in `generate`, `serve`, `eval` and `train` (where it may
also be a preset name). The older spellings keep working (`serve MODEL_DIR`, `eval PATH`, `train
--init-from DIR`); both spellings at once are a one-line error naming both, exit status 2.

`serve --model DIR` is in tests/test_cli_serve.py (its stand-in for the HTTP server); the corpus and the
trainer are stood in for here, and what the commands pass them is compared."""

import json
import re
import types

import jax
import numpy as np
import pytest
from flax import nnx

from mtp_jax.checkpoints.pretrained import save_pretrained
from mtp_jax.cli import main
from mtp_jax.cli.common import MODEL_HELP
from mtp_jax.config import FULL_SIZE_PRESETS, PRESETS, ModelConfig
from mtp_jax.model import init_model
from mtp_jax.training import data
from mtp_jax.training.run_dir import config_to_dict
from mtp_jax.training.step import TrainConfig

TEXT = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n"] * 20
DOCUMENTS = {f"pkg/mod_{i}.py": "".join(TEXT[i % 3 : i % 3 + 6]) for i in range(16)}


@pytest.fixture(autouse=True)
def cache_in_tmp(monkeypatch, tmp_path):
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "cache"))
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    tokenizer = data.train_tokenizer(TEXT, vocab_size=300)
    config = ModelConfig.from_name(
        "tiny", vocab_size=tokenizer.get_vocab_size(), num_hidden_layers=1, num_nextn_predict_layers=1, eos_token_id=0
    )
    save_pretrained(init_model(config, seed=0), path, tokenizer=tokenizer)
    return path


def _one_line_error(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"mtp-jax {command}: error: "), err
    return err


@pytest.fixture
def small_corpus(monkeypatch, tmp_path) -> list[dict]:
    """`data.prepare_corpus` on 16 small documents instead of the stdlib (minutes on a first run); records
    what each call was given."""
    real, calls = data.prepare_corpus, []

    def prepare(work_dir, **kwargs):
        calls.append({"work_dir": str(work_dir), **kwargs})
        return real(
            tmp_path / f"corpus-{len(calls)}",
            documents=DOCUMENTS,
            heldout_fraction=0.25,
            tokenizer_path=kwargs.get("tokenizer_path"),
            eos_token=kwargs.get("eos_token", data.EOS_TOKEN),
        )

    monkeypatch.setattr(data, "prepare_corpus", prepare)
    return calls


@pytest.fixture
def no_corpus(monkeypatch):
    """Makes preparing a corpus fail the test: the refusals come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was prepared before the refusal")

    monkeypatch.setattr(data, "prepare_corpus", refuse)
    monkeypatch.setattr("mtp_jax.cli.train.corpus_of_run", refuse)


# ----------------------------------------------------------------------------------------------
# The help of every command says the same about --model.


@pytest.mark.parametrize(
    "command, spelling",
    [
        ("generate", "--model DIR"),
        ("serve", "--model DIR"),
        ("eval", "--model DIR"),
        ("train", "--model PRESET_OR_DIR"),
    ],
)
def test_every_help_says_the_same_about_model(capsys, command, spelling):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert f"{spelling} {MODEL_HELP}" in out
    if command == "train":
        trainable = sorted(set(PRESETS) - FULL_SIZE_PRESETS)
        assert f"{spelling} {MODEL_HELP}, or a preset name ({', '.join(trainable)}; default demo)" in out


# ----------------------------------------------------------------------------------------------
# eval --model DIR


def _eval_numbers(argv, capsys) -> dict:
    assert main(["eval", *argv, "--batch-size", "2", "--seq-len", "16", "--max-batches", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_eval_model_dir_prints_the_same_numbers_as_eval_path(model_dir, capsys, small_corpus):
    by_path = _eval_numbers([str(model_dir)], capsys)
    by_model = _eval_numbers(["--model", str(model_dir)], capsys)
    assert by_model == by_path
    assert by_model["num_tokens"] > 0 and "mtp_agreement_1" in by_model  # the directory's one MTP module
    assert small_corpus[0] == small_corpus[1]  # the same corpus: the directory's tokenizer
    assert small_corpus[1]["tokenizer_path"] == model_dir / "tokenizer.json"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{dir}", "--model", "{dir}"], "PATH {dir} and --model {dir} both name the model: give one of them"),
        ([], "name the model: PATH (a run dir or a saved model directory) or --model DIR"),
        (
            ["--model", "{dir}", "--step", "3"],
            "--step 3 picks a checkpoint of a run dir (PATH); --model {dir} is a saved model directory",
        ),
        (
            ["--model", "{tmp}"],
            "--model: no tokenizer.json in {tmp} (a saved model directory holds config.json, "
            "safetensors, tokenizer.json)",
        ),
    ],
)
def test_eval_model_errors(model_dir, tmp_path, capsys, no_corpus, argv, message):
    fill = {"dir": model_dir, "tmp": tmp_path}
    assert main(["eval", *(a.format(**fill) for a in argv)]) == 2
    assert _one_line_error(capsys.readouterr().err, "eval") == f"mtp-jax eval: error: {message.format(**fill)}\n"


def test_eval_model_of_a_run_dir_says_to_give_it_as_path(tmp_path, capsys, no_corpus):
    (tmp_path / "run.json").write_text("{}")
    assert main(["eval", "--model", str(tmp_path)]) == 2
    assert _one_line_error(capsys.readouterr().err, "eval").endswith(f"; {tmp_path} is a run dir: give it as PATH\n")


# ----------------------------------------------------------------------------------------------
# train --model DIR: the same as --init-from DIR


@pytest.fixture
def trained(monkeypatch) -> list[dict]:
    """Stands in for the trainer: records what `train` was given, trains nothing."""
    calls = []

    def train(run_dir, corpus, **kwargs):
        calls.append({"run_dir": run_dir, "corpus": corpus, **kwargs})
        return types.SimpleNamespace(step=0, stopped_early=False, train_metrics={}, eval_metrics={})

    monkeypatch.setattr("mtp_jax.cli.train.train", train)
    return calls


def _leaves(model) -> list:
    return jax.tree.leaves(nnx.state(model))


@pytest.mark.parametrize("extra", [[], ["--mtp-only", "--mtp-layers", "2"]])
def test_train_model_dir_is_init_from_dir(model_dir, tmp_path, capsys, small_corpus, trained, extra):
    flags = ["--steps", "2", "--warmup", "0", "--seed", "3", "--no-progress", "--no-export", *extra]
    assert main(["train", str(tmp_path / "a"), "--init-from", str(model_dir), *flags]) == 0
    init_from_err = capsys.readouterr().err
    assert main(["train", str(tmp_path / "b"), "--model", str(model_dir), *flags]) == 0
    assert capsys.readouterr().err == init_from_err  # no "random main model" warning for --mtp-only either
    assert "warning" not in init_from_err
    assert small_corpus[0] == small_corpus[1]  # the directory's tokenizer, the same corpus cache and separator
    assert small_corpus[1]["tokenizer_path"] == model_dir / "tokenizer.json"
    by_init_from, by_model = trained
    assert by_model["model"] is not None and by_model["model_config"] == by_init_from["model_config"]
    assert by_model["model_config"].num_hidden_layers == 1  # the directory's model, not a preset
    assert by_model["model_config"].num_nextn_predict_layers == (2 if extra else 1)
    assert by_model["train_config"] == by_init_from["train_config"]
    assert by_model["train_config"].mtp_only == bool(extra)
    assert by_model["init_from"] == by_init_from["init_from"] == str(model_dir)  # recorded for the heads export
    for a, b in zip(_leaves(by_model["model"]), _leaves(by_init_from["model"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the checkpoint's weights (and the same seed for new MTP modules)


def test_train_model_preset_is_still_a_preset(tmp_path, capsys, small_corpus, trained):
    assert (
        main(
            [
                "train",
                str(tmp_path / "run"),
                "--model",
                "tiny",
                "--steps",
                "2",
                "--warmup",
                "0",
                "--no-progress",
                "--no-export",
            ]
        )
        == 0
    )
    assert trained[0]["model"] is None and small_corpus[0]["tokenizer_path"] is None
    corpus = trained[0]["corpus"]
    assert trained[0]["model_config"] == PRESETS["tiny"].replace(
        vocab_size=corpus.vocab_size, eos_token_id=corpus.eos_id
    )


@pytest.mark.parametrize(
    "model, message",
    [
        (
            "{dir}",
            "--model {dir} and --init-from {dir} both name the model to train: give one of them (--model DIR "
            "means --init-from DIR)",
        ),
        (
            "tiny",
            "--model tiny and --init-from {dir} both name the model to train: give one of them (--model DIR "
            "means --init-from DIR)",
        ),
    ],
)
def test_train_model_with_init_from_names_both(model_dir, tmp_path, capsys, no_corpus, model, message):
    argv = ["train", str(tmp_path / "run"), "--model", model.format(dir=model_dir), "--init-from", str(model_dir)]
    assert main([*argv, "--no-progress"]) == 2
    err = _one_line_error(capsys.readouterr().err, "train")
    assert err == f"mtp-jax train: error: {message.format(dir=model_dir)}\n"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "name, found",
    [
        ("no_such_thing", "no such directory"),
        ("empty_dir", "a directory without config.json"),
        ("a_file", "a file, not a directory"),
    ],
)
def test_train_model_neither_preset_nor_model_dir(tmp_path, capsys, no_corpus, name, found):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    model = str(tmp_path / name)
    assert main(["train", str(tmp_path / "run"), "--model", model, "--no-progress"]) == 2
    err = _one_line_error(capsys.readouterr().err, "train")
    assert err == (
        f"mtp-jax train: error: --model {model!r} is neither a preset (deepseek-v3-small, demo, medium, "
        f"qwen3.5-small, small, tiny, tiny-qwen2) nor a saved model directory ({found}; a model directory needs a "
        "config.json, safetensors weights and tokenizer.json)\n"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("preset", sorted(FULL_SIZE_PRESETS))
def test_train_refuses_a_full_size_preset_before_building_it(tmp_path, capsys, no_corpus, preset):
    assert main(["train", str(tmp_path / "run"), "--model", preset, "--no-progress"]) == 2
    assert _one_line_error(capsys.readouterr().err, "train") == (
        f"mtp-jax train: error: --model {preset} is a full-size architecture (a config for `mtp-jax plan`, no "
        "weights); train from a checkpoint of it with --init-from DIR\n"
    )
    assert not (tmp_path / "run").exists()


def test_train_model_dir_without_tokenizer_names_model(model_dir, tmp_path, capsys, no_corpus):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((model_dir / "config.json").read_text())
    assert main(["train", str(tmp_path / "run"), "--model", str(bare), "--no-progress"]) == 2
    assert _one_line_error(capsys.readouterr().err, "train") == (
        f"mtp-jax train: error: --model: no tokenizer.json in {bare}\n"
    )


def test_train_resume_with_model_dir_names_model(model_dir, tmp_path, capsys, no_corpus):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = {
        "model_config": config_to_dict(ModelConfig.from_name("tiny")),
        "train_config": config_to_dict(TrainConfig()),
        "corpus": {
            "source": "stdlib",
            "work_dir": str(tmp_path / "corpus"),
            "vocab_size": 300,
            "heldout_fraction": 0.1,
        },
    }
    (run_dir / "run.json").write_text(json.dumps(run))
    assert main(["train", str(run_dir), "--resume", "--model", str(model_dir), "--no-progress"]) == 2
    err = _one_line_error(capsys.readouterr().err, "train")
    assert re.search(
        rf"--model \(given '{re.escape(str(model_dir))}'; a resume restores the model from the "
        r"checkpoint\)",
        err,
    ), err
