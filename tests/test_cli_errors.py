"""Crash paths of the `mtp-jax` commands that end as one-line errors naming the flag (or the file, or the
environment variable), exit status 2, no traceback and no hang: the jax.distributed flags and
variables, serve's --port, a damaged run.json under `train --resume`, and an MLA model or --mtp-only
without MTP modules under `train` (from a preset, --init-from DIR or --model DIR)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from mtp_jax import sharding
from mtp_jax.checkpoints.pretrained import save_pretrained
from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.training import data
from mtp_jax.training.run_dir import config_to_dict
from mtp_jax.training.step import TrainConfig

DISTRIBUTED_VARIABLES = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
    "JAX_DISTRIBUTED",
    "JAX_COORDINATOR_BIND_ADDRESS",
)


@pytest.fixture(autouse=True)
def no_distributed_environment(monkeypatch, tmp_path):
    for name in DISTRIBUTED_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MTP_JAX_CACHE", str(tmp_path / "cache"))


def _target(command: str, tmp_path) -> list[str]:
    """Arguments that get `command` as far as its device flags, with nothing else to do."""
    return {
        "generate": ["--model", str(tmp_path / "no_model")],
        "serve": [str(tmp_path / "no_model")],
        "train": [str(tmp_path / "run")],
    }[command]


def _one_line_error(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"mtp-jax {command}: error: "), err
    return err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------------------------
# --coordinator-address, --num-processes, --process-id, --distributed-timeout and their variables.


@pytest.mark.parametrize("command", ["generate", "serve", "train"])
@pytest.mark.parametrize(
    "address, problem",
    [
        ("127.0.0.1:notaport", "has port 'notaport', not an integer in 1..65535"),  # crashed jax with SIGSEGV
        ("garbage", "is not HOST:PORT"),  # an IndexError inside jax
        ("127.0.0.1:99999", "has port '99999', not an integer in 1..65535"),
        ("127.0.0.1:0", "has port '0', not an integer in 1..65535"),
        ("::1:1234", "has host '::1', not an IPv6 address in brackets"),
        ("bad host:1234", "has host 'bad host', not a host name or an IP address"),
    ],
)
def test_bad_coordinator_address_names_the_flag(tmp_path, capsys, command, address, problem):
    argv = [
        command,
        *_target(command, tmp_path),
        "--coordinator-address",
        address,
        "--num-processes",
        "2",
        "--process-id",
        "1",
    ]
    assert main(argv) == 2
    err = _one_line_error(capsys.readouterr().err, command)
    assert err.startswith(
        f"mtp-jax {command}: error: --coordinator-address: coordinator_address {address!r} "
        f"{problem} (expected HOST:PORT with PORT in 1..65535"
    ), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "address", ["[::1]:1234", "localhost:65535", "10.0.0.1:1", "node-0.cluster_a:8476", "[fe80::1%eth0]:1234"]
)
def test_good_coordinator_addresses_reach_jax(address):
    class Reached(Exception):
        pass

    def on_connect(*settings):
        raise Reached(settings)  # stop right before jax.distributed.initialize

    with pytest.raises(Reached) as reached:
        sharding.initialize_distributed(address, 2, 1, on_connect=on_connect)
    assert reached.value.args[0] == (address, 2, 1)


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"JAX_NUM_PROCESSES": "two"}, "environment variable JAX_NUM_PROCESSES must be an integer >= 1, got 'two'"),
        ({"JAX_NUM_PROCESSES": "0"}, "environment variable JAX_NUM_PROCESSES must be an integer >= 1, got '0'"),
        (
            {"JAX_PROCESS_ID": "x", "JAX_NUM_PROCESSES": "2"},
            "environment variable JAX_PROCESS_ID must be an integer >= 0, got 'x'",
        ),
        (
            {"JAX_PROCESS_ID": "-1", "JAX_NUM_PROCESSES": "2"},
            "environment variable JAX_PROCESS_ID must be an integer >= 0, got '-1'",
        ),
        (
            {"JAX_PROCESS_ID": "2", "JAX_NUM_PROCESSES": "2"},
            "JAX_PROCESS_ID must be an integer in [0, JAX_NUM_PROCESSES) = [0, 2), got 2",
        ),
        (
            {"JAX_COORDINATOR_ADDRESS": "garbage", "JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"},
            "JAX_COORDINATOR_ADDRESS 'garbage' is not HOST:PORT",
        ),
    ],
)
@pytest.mark.parametrize("command", ["generate", "train"])
def test_bad_distributed_variables_are_named(tmp_path, capsys, monkeypatch, command, variables, message):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    flags = [] if "JAX_COORDINATOR_ADDRESS" in variables else ["--coordinator-address", "127.0.0.1:1234"]
    flags += [] if "JAX_PROCESS_ID" in variables else ["--process-id", "1"]
    assert main([command, *_target(command, tmp_path), *flags]) == 2
    err = _one_line_error(capsys.readouterr().err, command)
    assert err.startswith(f"mtp-jax {command}: error: {message}"), err
    assert not (tmp_path / "run").exists()


def test_process_id_past_the_processes_names_both_flags(tmp_path, capsys):
    argv = [
        "generate",
        *_target("generate", tmp_path),
        "--coordinator-address",
        "127.0.0.1:1234",
        "--num-processes",
        "2",
        "--process-id",
        "2",
    ]
    assert main(argv) == 2
    assert _one_line_error(capsys.readouterr().err, "generate") == (
        "mtp-jax generate: error: --num-processes, --process-id: process_id must be an integer in "
        "[0, num_processes) = [0, 2), got 2\n"
    )


def test_coordinator_port_in_use_is_refused_before_jax(tmp_path, capsys):
    """Process 0 runs the coordinator: on a port that is taken, jax's runtime failed, at times with SIGSEGV."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [
            "generate",
            *_target("generate", tmp_path),
            "--coordinator-address",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            "0",
        ]
        assert main(argv) == 2
    assert _one_line_error(capsys.readouterr().err, "generate") == (
        f"mtp-jax generate: error: --coordinator-address: coordinator_address '127.0.0.1:{port}': port {port} is in "
        "use on this host, where process 0 runs the coordinator\n"
    )


@pytest.mark.parametrize(
    "value, message",
    [("0", "must be > 0, got 0"), ("-3", "must be > 0, got -3"), ("soon", "invalid int value: 'soon'")],
)
def test_distributed_timeout_must_be_positive(capsys, value, message):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--distributed-timeout", value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(f"mtp-jax generate: error: argument --distributed-timeout: {message}\n")


@pytest.mark.parametrize(
    "process_id, waiting, failure",
    [
        (
            1,
            "the coordinator at {address} (process 1 of 2)",
            "--coordinator-address {address}, --distributed-timeout 2: no answer from the coordinator at {address} "
            "within 2 s (process 1 of 2)",
        ),
        (
            0,
            "all 2 processes to join the coordinator at {address} (process 0 of 2, which runs it)",
            "--coordinator-address {address}, --distributed-timeout 2: the other processes did not all join the "
            "coordinator at {address} within 2 s (this is process 0 of 2)",
        ),
    ],
)
def test_missing_processes_end_the_wait_at_distributed_timeout(tmp_path, process_id, waiting, failure):
    """jax would wait 300 s, then abort with a C++ stack trace: the CLI gives up at --distributed-timeout."""
    address = f"127.0.0.1:{_free_port()}"  # nobody listens there (process 1), nobody else joins (process 0)
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env |= {"MTP_JAX_CACHE": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    command = [
        sys.executable,
        "-m",
        "mtp_jax.cli",
        "generate",
        "--prompt",
        "x",
        "--coordinator-address",
        address,
        "--num-processes",
        "2",
        "--process-id",
        str(process_id),
        "--distributed-timeout",
        "2",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []  # (arrival time, line) of stderr

    def read():
        for line in process.stderr:
            lines.append((time.monotonic(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=120)  # a safety net: the import takes seconds, the wait must take 2
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        pytest.fail(f"still waiting after 120 s; stderr so far: {lines}")
    ended = time.monotonic()
    reader.join(10)
    err = "".join(line for _, line in lines)
    assert code == 2, err
    assert "Traceback" not in err and "Check failure" not in err, err
    assert len(lines) == 2, err
    assert lines[0][1] == f"mtp-jax generate: waiting up to 2 s for {waiting.format(address=address)}\n"
    assert lines[1][1].startswith(f"mtp-jax generate: error: {failure.format(address=address)}"), err
    waited = ended - lines[0][0]
    assert 1.9 <= waited <= 2 + 3, f"waited {waited:.2f} s for a 2 s timeout"
    assert process.stdout.read() == ""


# ----------------------------------------------------------------------------------------------
# serve --port


@pytest.mark.parametrize("port", ["99999", "65536", "-1"])
def test_serve_port_out_of_range_names_the_flag(capsys, port):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", port])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"mtp-jax serve: error: argument --port: must be in [0, 65535], got {port}\n"
    )


# ----------------------------------------------------------------------------------------------
# train --resume of a damaged run.json


def _run_dir(tmp_path, **train_config) -> tuple:
    """A run dir whose run.json has the train_config entries given (over valid ones)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = {
        "model_config": config_to_dict(ModelConfig.from_name("tiny")),
        "train_config": {**config_to_dict(TrainConfig()), **train_config},
        "corpus": {
            "source": "stdlib",
            "work_dir": str(tmp_path / "corpus"),
            "vocab_size": 300,
            "heldout_fraction": 0.1,
        },
    }
    (run_dir / "run.json").write_text(json.dumps(run))
    return run_dir, run


@pytest.fixture
def no_corpus(monkeypatch):
    """Makes preparing a corpus fail the test: every refusal here comes before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was prepared before the refusal")

    monkeypatch.setattr(data, "prepare_corpus", refuse)
    monkeypatch.setattr("mtp_jax.cli.train.corpus_of_run", refuse)


@pytest.mark.parametrize(
    "entries, message",
    [
        ({"batch_size": "4"}, 'train_config.batch_size must be an integer, got "4" (a string)'),
        ({"learning_rate": "fast"}, 'train_config.learning_rate must be a number, got "fast" (a string)'),
        ({"mtp_only": 1}, "train_config.mtp_only must be true or false, got 1 (an integer)"),
        ({"eval_batches": 2.5}, "train_config.eval_batches must be an integer or null, got 2.5 (a number)"),
        ({"learning_rat": 0.1}, "train_config has an unknown key 'learning_rat' (the keys are batch_size, seq_len, "),
        ({"batch_size": 0}, "train_config: batch_size must be >= 1, got 0"),
    ],
)
def test_resume_of_a_damaged_run_json_names_the_file_and_the_key(tmp_path, capsys, no_corpus, entries, message):
    run_dir, _ = _run_dir(tmp_path, **entries)
    assert main(["train", str(run_dir), "--resume", "--no-progress"]) == 2
    err = _one_line_error(capsys.readouterr().err, "train")
    assert err.startswith(f"mtp-jax train: error: {run_dir / 'run.json'}: {message}"), err


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda run: run["model_config"].update(hidden_sizes=64), "model_config: "),
        (lambda run: run["model_config"].pop("rope_scaling"), "model_config has no key 'rope_scaling'"),
        (lambda run: run.update(train_config=[1, 2]), "'train_config' must be a JSON object, got [1, 2] (an array)"),
        (
            lambda run: run["corpus"].update(vocab_size="300"),
            'corpus.vocab_size must be an integer, got "300" (a string)',
        ),
    ],
)
def test_resume_of_a_run_json_with_bad_sections_names_the_file(tmp_path, capsys, no_corpus, change, message):
    run_dir, run = _run_dir(tmp_path)
    change(run)
    (run_dir / "run.json").write_text(json.dumps(run))
    assert main(["train", str(run_dir), "--resume", "--no-progress"]) == 2
    err = _one_line_error(capsys.readouterr().err, "train")
    assert err.startswith(f"mtp-jax train: error: {run_dir / 'run.json'}: {message}"), err
    if "hidden_sizes" in run["model_config"]:
        assert "hidden_sizes" in err


def test_mtp_only_for_a_model_without_mtp_modules_is_refused_before_the_corpus(tmp_path, capsys, no_corpus):
    plain = tmp_path / "plain"
    tokenizer = data.train_tokenizer(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=300)
    config = ModelConfig.from_name("tiny", vocab_size=tokenizer.get_vocab_size(), num_nextn_predict_layers=0)
    save_pretrained(init_model(config, seed=0), plain, tokenizer=tokenizer)
    for flags, source in (
        (["--init-from", str(plain)], f"--init-from {plain}"),
        (["--model", str(plain)], f"--model {plain}"),
        (["--model", "tiny", "--mtp-layers", "0"], "--model tiny"),
    ):
        assert main(["train", str(tmp_path / "run"), *flags, "--mtp-only", "--no-progress"]) == 2
        assert _one_line_error(capsys.readouterr().err, "train") == (
            f"mtp-jax train: error: {source}: --mtp-only trains the MTP modules and the model has none "
            "(num_nextn_predict_layers is 0): add them with --mtp-layers N\n"
        )
        assert not (tmp_path / "run").exists()
