"""The `mtp-jax generate` command on a small model directory, and its errors."""

import pytest

from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.data import train_tokenizer
from mtp_jax.model import init_model
from mtp_jax.pretrained import load_pretrained, save_pretrained

TEXT = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n"] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = train_tokenizer(TEXT, vocab_size=300)
    config = ModelConfig.from_name("tiny", vocab_size=tokenizer.get_vocab_size(), num_nextn_predict_layers=2,
                                   eos_token_id=0)
    save_pretrained(init_model(config, seed=0), path, tokenizer=tokenizer)
    return path


def test_save_and_load_pretrained_round_trip(model_dir):
    model, tokenizer = load_pretrained(model_dir)
    assert model.config.num_nextn_predict_layers == 2
    assert tokenizer.decode(tokenizer.encode("import os").ids) == "import os"
    with pytest.raises(FileExistsError):
        save_pretrained(model, model_dir, tokenizer=tokenizer)


@pytest.mark.parametrize("extra", [[], ["--speculative", "eagle", "--num-speculative-tokens", "2"]])
def test_generate_prints_prompt_continuation_and_speed(model_dir, capsys, extra):
    code = main(["generate", "--model", str(model_dir), "--prompt", "import os", "--prompt", "def",
                 "--max-new-tokens", "5", "--max-length", "64", *extra])
    out, err = capsys.readouterr()
    assert code == 0
    assert "=== prompt 0" in out and "=== prompt 1" in out and "\nimport os" in out
    assert "tokens/s" in err
    if extra:
        assert "mean acceptance length" in err


def test_speculative_and_plain_cli_print_the_same_text(model_dir, capsys):
    argv = ["generate", "--model", str(model_dir), "--prompt", "class A", "--max-new-tokens", "6", "--max-length", "64"]
    main(argv)
    plain = capsys.readouterr().out
    main(argv + ["--speculative", "vanilla", "--num-speculative-tokens", "2"])
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model"], "does not exist"),
    (["--speculative", "vanilla", "--num-speculative-tokens", "3"], "exceeds the model's 2 MTP modules"),
    (["--temperature", "-1"], "temperature"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
])
def test_errors_are_reported_not_raised(model_dir, capsys, argv, message):
    code = main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-length", "64", *argv])
    assert code == 2
    assert message in capsys.readouterr().err
