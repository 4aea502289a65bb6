"""The `mtp-jax generate` command on a small model directory: output, timing line, compilation cache, errors."""

import importlib.metadata
import json
import os
import re
import types

import jax
import jax.monitoring
import pytest
from jax.experimental.compilation_cache import compilation_cache

from mtp_jax.checkpoints.pretrained import load_pretrained, save_pretrained
from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.training.data import train_tokenizer

TEXT = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n", "class A:\n    pass\n"] * 20


TIMING = re.compile(
    r"--- load ([\d.]+) s \| compile ([\d.]+) s \(warm-up run, (.+?)\) \| "
    r"decode (\d+) tokens in ([\d.]+) s: ([\d.]+) tokens/s \(compiled, prefill included\)"
)


@pytest.fixture(autouse=True)
def compilation_cache_off_afterwards(tmp_path, monkeypatch):
    """The CLI's default cache goes to a temporary directory, and the process-wide JAX settings it makes
    are undone after each test (other tests must not write a persistent cache)."""
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
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    tokenizer = train_tokenizer(TEXT, vocab_size=300)
    config = ModelConfig.from_name(
        "tiny", vocab_size=tokenizer.get_vocab_size(), num_nextn_predict_layers=2, eos_token_id=0
    )
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
    code = main(
        [
            "generate",
            "--model",
            str(model_dir),
            "--prompt",
            "import os",
            "--prompt",
            "def",
            "--max-new-tokens",
            "5",
            "--max-length",
            "64",
            *extra,
        ]
    )
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


def test_draft_vocab_flag_reads_a_file_of_token_ids(model_dir, tmp_path, capsys):
    """`--draft-vocab FILE`: a JSON list or separated ints; greedy output unchanged; a bad file or id is
    reported against the flag."""
    argv = ["generate", "--model", str(model_dir), "--prompt", "class A", "--max-new-tokens", "6", "--max-length", "64"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    listed, spaced = tmp_path / "ids.json", tmp_path / "ids.txt"
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    listed.write_text(json.dumps(list(range(0, vocab, 2))))
    spaced.write_text("\n".join(str(i) for i in range(vocab // 2)) + "\n")
    for path in (listed, spaced):
        assert main(argv + ["--speculative", "eagle", "--draft-vocab", str(path)]) == 0
        assert capsys.readouterr().out == plain
    (tmp_path / "bad.txt").write_text("1, 2, x")
    (tmp_path / "far.txt").write_text(f"1 {vocab}")
    for name, message in (
        ("bad.txt", "--draft-vocab " + str(tmp_path / "bad.txt") + ": expected a JSON list of token ids"),
        ("far.txt", f"--draft-vocab: draft_vocab holds token {vocab}, outside [0, vocab_size={vocab})"),
        ("missing.txt", "No such file"),
    ):
        assert main(argv + ["--speculative", "eagle", "--draft-vocab", str(tmp_path / name)]) == 2
        assert message in capsys.readouterr().err, name


def test_dtype_flag_and_the_cpu_float32_default(model_dir, tmp_path, capsys, monkeypatch):
    """A bfloat16 checkpoint: without --dtype the CPU backend decodes it in float32 and says so on stderr
    (unless its matmuls go to oneDNN: then bfloat16); `--dtype float32` prints the same text silently;
    `--dtype bfloat16` keeps bfloat16."""
    import mtp_jax.checkpoints.pretrained
    from mtp_jax.layers import onednn

    monkeypatch.setattr(onednn, "routed_dtypes", lambda: ())  # XLA's matmuls (the extension not built)

    model, tokenizer = load_pretrained(model_dir)
    bf16_dir = tmp_path / "bf16"
    save_pretrained(
        init_model(model.config.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=0),
        bf16_dir,
        tokenizer=tokenizer,
    )
    asked = []
    real = mtp_jax.checkpoints.pretrained.load_pretrained
    monkeypatch.setattr(
        mtp_jax.checkpoints.pretrained,
        "load_pretrained",
        lambda path, dtype=None, **kwargs: asked.append(dtype) or real(path, dtype=dtype, **kwargs),
    )
    argv = ["generate", "--model", str(bf16_dir), "--prompt", "class A", "--max-new-tokens", "4", "--max-length", "32"]
    outputs = {}
    for flags in ((), ("--dtype", "float32"), ("--dtype", "bfloat16")):
        assert main(argv + list(flags)) == 0
        outputs[flags] = capsys.readouterr()
    assert asked == ["float32", "float32", "bfloat16"]
    assert "stores bfloat16 weights: decoding in float32 on the CPU backend" in outputs[()].err
    assert "--dtype bfloat16" in outputs[()].err
    assert all("decoding in float32" not in outputs[f].err for f in list(outputs)[1:])
    assert outputs[()].out == outputs[("--dtype", "float32")].out
    assert mtp_jax.checkpoints.pretrained.inference_dtype(model_dir) == ("float32", None)  # float32 stored: as it is
    monkeypatch.setattr(onednn, "routed_dtypes", lambda: ("bfloat16",))  # bfloat16 matmuls in oneDNN
    assert mtp_jax.checkpoints.pretrained.inference_dtype(bf16_dir) == ("bfloat16", None)
    # a directory it cannot read: the load names the problem
    assert mtp_jax.checkpoints.pretrained.inference_dtype(tmp_path / "missing") == (None, None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "/nonexistent/model"], "does not exist"),
        (
            ["--speculative", "vanilla", "--num-speculative-tokens", "3"],
            "--num-speculative-tokens: method 'vanilla' drafts one token per module: num_speculative_tokens=3 exceeds "
            "the model's 2 MTP modules",
        ),
        (
            ["--speculative", "eagle", "--num-speculative-tokens", "17"],
            "--num-speculative-tokens: num_speculative_tokens must be in [1, 16], got 17",
        ),
        (["--temperature", "-1"], "--temperature: temperature must be"),
        (["--top-k", "-1"], "--top-k: top_k must be"),
        (["--top-p", "0"], "--top-p: top_p must be"),
        (["--seed", "-1"], "--seed: seed must be in [0, 2**32)"),
        (
            ["--seed", "4294967295", "--prompt", "y"],
            "--seed 4294967295: row b samples with seed + b, and row 1 would "
            "get 4294967296, past the largest seed 2**32 - 1",
        ),
        (["--max-new-tokens", "0"], "--max-new-tokens: max_new_tokens must be an int >= 1, got 0"),
        (["--max-length", "300"], "--max-length: max_length=300 must be in [2, 256]"),
        (["--prompt", "y", "--stream"], "--stream takes exactly one prompt"),
    ],
)
def test_errors_are_reported_not_raised(model_dir, capsys, argv, message):
    code = main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-length", "64", *argv])
    assert code == 2
    assert message in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"mtp-jax {importlib.metadata.version('mtp-jax')}\n"


def test_generate_help_has_its_own_description(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert out.startswith("usage: mtp-jax generate")
    assert "Generate continuations of text prompts, with plain decoding or MTP speculative decoding." in out
    assert "warm-up run" in out and "--compilation-cache DIR" in out and "--no-compilation-cache" in out


@pytest.mark.parametrize("extra", [[], ["--speculative", "eagle", "--num-speculative-tokens", "2"]])
def test_timing_line_keeps_load_compile_and_decode_apart(model_dir, capsys, extra):
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "import os",
        "--prompt",
        "def",
        "--max-new-tokens",
        "7",
        "--max-length",
        "64",
        *extra,
    ]
    jax.clear_caches()  # an earlier test may have compiled these shapes in this process: the warm-up must compile
    assert main(argv + ["--no-compilation-cache"]) == 0
    err = capsys.readouterr().err.splitlines()
    load, compile_, cache, tokens, seconds, rate = TIMING.fullmatch(err[0]).groups()
    assert cache == "no persistent cache"
    assert int(tokens) == 14  # 7 per prompt: the tiny model has no reason to emit its EOS early
    seconds = float(seconds)  # printed to 0.1 ms
    assert int(tokens) / (seconds + 5e-5) <= float(rate) + 0.05 and float(rate) - 0.05 <= int(tokens) / (seconds - 5e-5)
    assert float(compile_) > seconds  # the warm-up compiled; the timed run did not
    assert len(err) == (2 if extra else 1)


@pytest.mark.parametrize("extra", [[], ["--speculative", "vanilla", "--num-speculative-tokens", "2"]])
def test_stream_prints_the_text_and_the_closing_line_of_the_plain_run(model_dir, capsys, extra):
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "class A",
        "--max-new-tokens",
        "9",
        "--max-length",
        "64",
        "--no-compilation-cache",
        *extra,
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert main(argv + ["--stream"]) == 0
    streamed_out, streamed_err = capsys.readouterr()
    assert streamed_out == out.split("\n", 1)[1]  # the text, without the "=== prompt 0 ..." header
    plain, streamed = TIMING.fullmatch(err.splitlines()[0]), TIMING.fullmatch(streamed_err.splitlines()[0])
    assert streamed.group(4) == plain.group(4) == "9"  # tokens decoded
    assert streamed.group(3) == plain.group(3) == "no persistent cache"
    if extra:  # the same acceptance line, word for word
        assert err.splitlines()[1].startswith("--- vanilla, K = 2: mean acceptance length")
        assert streamed_err.splitlines()[1] == err.splitlines()[1]


def test_second_run_loads_from_the_persistent_compilation_cache(model_dir, tmp_path, capsys):
    cache_dir = tmp_path / "jax_cache"
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "def f",
        "--max-new-tokens",
        "3",
        "--max-length",
        "80",
        "--compilation-cache",
        str(cache_dir),
    ]
    assert main(argv) == 0
    assert f"persistent cache {cache_dir}" in capsys.readouterr().err
    assert len(list(cache_dir.iterdir())) > 0
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **_: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    try:
        jax.clear_caches()  # as in a new process: nothing compiled in memory
        assert main(argv) == 0
    finally:
        jax.monitoring.clear_event_listeners()
    assert len(hits) >= 2  # at least the prefill and the decode loop came from the cache


def test_prompt_that_is_not_utf8_is_a_one_line_error(model_dir, capsys):
    """Undecodable argv bytes reach Python as lone surrogates, which the tokenizer cannot take."""
    prompt = os.fsdecode(b"ab\xffcd")
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--prompt", prompt]) == 2
    assert capsys.readouterr().err == (
        "mtp-jax generate: error: --prompt: prompt 1 is not valid UTF-8 (bytes b'\\xff' at character 2)\n"
    )


@pytest.mark.parametrize(
    "flag, name, message",
    [
        ("--prompt-file", "a_dir", "--prompt-file {path}: Is a directory"),
        ("--prompt-file", "latin1.txt", "--prompt-file {path}: not UTF-8 text (invalid continuation byte at byte 2)"),
        ("--prompt-file", "nonexist.txt", "--prompt-file {path}: No such file or directory"),
        (
            "--prompt-file",
            "empty.txt",
            "--prompt-file {path}: prompt 1 is empty: every prompt needs at least one token",
        ),
        (
            "--model",
            "regular_file",
            "--model: {path} is not a directory (a model directory holds config.json, "
            "safetensors weights and tokenizer.json)",
        ),
        ("--model", "nonexist", "--model: model directory {path} does not exist"),
        ("--compilation-cache", "regular_file", "--compilation-cache: {path} is not a directory"),
        (
            "--compilation-cache",
            "regular_file/sub",
            "--compilation-cache: {path} is not a writable directory (Not a directory)",
        ),
    ],
)
def test_file_errors_name_the_flag_and_the_file(model_dir, tmp_path, capsys, flag, name, message):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "latin1.txt").write_bytes(b"ca\xe9t")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "regular_file").write_text("not a directory")
    path = tmp_path / name
    argv = ["generate", "--model", str(model_dir), "--prompt", "x", "--max-length", "64", flag, str(path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == f"mtp-jax generate: error: {message.format(path=path)}\n"


def test_parallel_method_on_deepseek_modules_names_speculative(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--speculative", "parallel"]) == 2
    assert capsys.readouterr().err == (
        "mtp-jax generate: error: --speculative: method 'parallel' needs parallel "
        "heads, the model has mtp_style='deepseek'\n"
    )


def test_unusable_default_cache_is_a_warning_and_no_cache_claimed(model_dir, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "a_file"))  # the default cache dir a_file/jax_cache
    argv = ["generate", "--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "2", "--max-length", "64"]
    assert main(argv) == 0
    warning, timing = capsys.readouterr().err.splitlines()
    assert warning == (
        f"mtp-jax generate: warning: the default compilation cache {tmp_path / 'a_file/jax_cache'} "
        "is not a writable directory (Not a directory): compiling without a persistent cache "
        "(set --compilation-cache DIR or --no-compilation-cache)"
    )
    assert TIMING.fullmatch(timing).group(3) == "no persistent cache"
    assert not jax.config.jax_enable_compilation_cache


def test_read_only_cache_dir_is_refused(model_dir, tmp_path, capsys):
    cache_dir = tmp_path / "read_only"
    cache_dir.mkdir()
    cache_dir.chmod(0o500)
    if os.access(cache_dir, os.W_OK):
        pytest.skip("permissions are not enforced for this user (root)")
    assert main(["generate", "--model", str(model_dir), "--compilation-cache", str(cache_dir)]) == 2
    assert capsys.readouterr().err == (
        f"mtp-jax generate: error: --compilation-cache: {cache_dir} is not a writable directory (Permission denied)\n"
    )


def test_train_refuses_resume_with_overwrite(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", str(tmp_path / "run"), "--resume", "--overwrite"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith("error: argument --overwrite: not allowed with argument --resume\n")
    assert not (tmp_path / "run").exists()


def test_generate_on_a_one_device_mesh_prints_the_same_text(model_dir, capsys):
    argv = [
        "generate",
        "--model",
        str(model_dir),
        "--prompt",
        "class A",
        "--prompt",
        "def f",
        "--max-new-tokens",
        "6",
        "--max-length",
        "64",
        "--no-compilation-cache",
    ]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main(argv + ["--mesh", "data=-1,tensor=1"]) == 0  # -1: the rest, here the one device
    assert capsys.readouterr().out == plain


@pytest.mark.parametrize("command", ["generate", "train"])
@pytest.mark.parametrize(
    "spec, message",
    [
        ("data=two", "argument --mesh: mesh axis 'data' needs an integer size, got 'two'"),
        (
            "pipeline=2",
            "argument --mesh: unknown mesh axis 'pipeline'; the axes are ('data', 'fsdp', 'expert', 'tensor')",
        ),
        ("data=2,data=1", "argument --mesh: mesh axis 'data' is given twice"),
        ("data=0", "argument --mesh: mesh axis 'data' needs a size >= 1 (or -1: the rest), got 0"),
        ("data", "argument --mesh: mesh spec entry 'data' is not 'axis=size' (in 'data')"),
    ],
)
def test_bad_mesh_spec_is_an_argparse_error_naming_the_flag(tmp_path, capsys, command, spec, message):
    target = ["--model", "/nonexistent"] if command == "generate" else [str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exit_:
        main([command, *target, "--mesh", spec])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"mtp-jax {command}: error: {message}\n")
    assert not (tmp_path / "run").exists()


def test_mesh_flags_parse_and_default_to_none():
    from mtp_jax.cli import build_parser

    args = build_parser().parse_args(
        [
            "train",
            "run",
            "--mesh",
            "data=2,tensor=4",
            "--coordinator-address",
            "10.0.0.1:1234",
            "--num-processes",
            "2",
            "--process-id",
            "1",
        ]
    )
    assert (args.mesh, args.coordinator_address, args.num_processes, args.process_id) == (
        "data=2,tensor=4",
        "10.0.0.1:1234",
        2,
        1,
    )
    args = build_parser().parse_args(["generate"])
    assert (args.mesh, args.coordinator_address, args.num_processes, args.process_id) == (None, None, None, None)


@pytest.mark.parametrize("command", ["generate", "train"])
def test_mesh_larger_than_the_devices_and_partial_distributed_flags_are_refused(tmp_path, capsys, monkeypatch, command):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    target = ["--prompt", "x"] if command == "generate" else [str(tmp_path / "run")]
    assert main([command, *target, "--mesh", "data=2,tensor=4"]) == 2
    assert capsys.readouterr().err == (
        f"mtp-jax {command}: error: --mesh data=2,tensor=4: mesh 'data=2,tensor=4' "
        f"has 8 devices but {jax.device_count()} are given (jax.devices(): "
        f"{jax.device_count()})\n"
    )
    assert main([command, *target, "--process-id", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"mtp-jax {command}: error: --coordinator-address, --num-processes, --process-id: "
        "multi-process runs need all of coordinator_address, num_processes and process_id"
    )
    assert "process_id=1" in err and "coordinator_address=None" in err
    assert not (tmp_path / "run").exists()  # refused before the run dir or the corpus were touched


def test_prompts_the_mesh_cannot_split_are_refused_naming_mesh(model_dir, capsys, monkeypatch):
    data_2 = types.SimpleNamespace(shape={"data": 2, "fsdp": 1, "expert": 1, "tensor": 1})  # a data=2 mesh's sizes
    monkeypatch.setattr("mtp_jax.cli.generate.mesh_from_args", lambda args: data_2)  # this process has one device
    assert (
        main(
            [
                "generate",
                "--model",
                str(model_dir),
                "--prompt",
                "x",
                "--prompt",
                "y",
                "--prompt",
                "z",
                "--mesh",
                "data=2",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err == (
        "mtp-jax generate: error: --mesh data=2: 3 prompts cannot be split over "
        "data x fsdp = 2 devices; give a multiple of 2 prompts (--prompt, "
        "--prompt-file)\n"
    )


def test_train_resumes_on_a_one_device_mesh_as_it_would_without(tmp_path, monkeypatch, capsys):
    from mtp_jax.cli import train as train_cli
    from mtp_jax.training import data
    from mtp_jax.training import trainer as train

    documents = {f"pkg/mod_{i}.py": "".join(TEXT[i % 3 : i % 3 + 6]) for i in range(16)}
    corpus = data.prepare_corpus(tmp_path / "corpus", documents=documents, vocab_size=300, heldout_fraction=0.25)
    config = ModelConfig.from_name(
        "tiny", vocab_size=300, num_hidden_layers=1, num_nextn_predict_layers=1, eos_token_id=corpus.eos_id
    )
    settings = train.TrainConfig(batch_size=2, seq_len=16, num_steps=2, warmup_steps=0, log_every=1, eval_batches=1)
    straight = train.train(
        tmp_path / "straight", corpus, model_config=config, train_config=settings, progress=False, export=False
    )
    train.train(
        tmp_path / "run",
        corpus,
        model_config=config,
        train_config=settings,
        stop_at_step=1,
        progress=False,
        export=False,
    )
    monkeypatch.setattr(train_cli, "corpus_of_run", lambda run_dir, run, data_dir: corpus)
    assert main(["train", str(tmp_path / "run"), "--resume", "--mesh", "data=1", "--no-progress", "--no-export"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 2 and not result["stopped_early"]
    assert result["train"]["loss"] == pytest.approx(straight.train_metrics["loss"], rel=1e-6)
    assert result["heldout"]["main_loss"] == pytest.approx(straight.eval_metrics["main_loss"], rel=1e-6)
