"""The trainer (`mtp_jax.training.trainer`): learning, exact resume, frozen-main MTP training, run-dir safety,
eval, export.

Tiny model (1 layer of width 64, D = 2) on a tiny in-memory corpus; every test shares one
`TrainConfig` shape so the jitted step compiles once per mode.
"""

import contextlib
import fcntl
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from test_data import tiny_documents

from mtp_jax import checkpoints as checkpoint
from mtp_jax import cli
from mtp_jax.checkpoints.pretrained import save_pretrained
from mtp_jax.cli import eval as eval_cli
from mtp_jax.cli import train as train_cli
from mtp_jax.config import ModelConfig
from mtp_jax.layers.moe import ScoreCorrectionBias
from mtp_jax.model import init_model
from mtp_jax.mtp import MAIN_PARAMS, MTP_PARAMS
from mtp_jax.training import data
from mtp_jax.training import trainer as train
from mtp_jax.training.run_checkpoints import run_checkpoint_manager

TRAIN = train.TrainConfig(
    batch_size=4, seq_len=32, num_steps=6, learning_rate=1e-2, warmup_steps=1, checkpoint_every=100, log_every=1
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(
        tmp_path_factory.mktemp("corpus"), documents=tiny_documents(), vocab_size=300, heldout_fraction=0.2
    )


@pytest.fixture(scope="module")
def model_config(corpus):
    return ModelConfig.from_name(
        "tiny", vocab_size=300, num_hidden_layers=1, num_nextn_predict_layers=2, eos_token_id=corpus.eos_id
    )


@pytest.fixture(scope="module")
def straight(tmp_path_factory, corpus, model_config):
    """TRAIN's 6 steps in one go: what every stopped, killed or failed and resumed run must end with."""
    return train.train(
        tmp_path_factory.mktemp("straight") / "run",
        corpus,
        model_config=model_config,
        train_config=TRAIN,
        progress=False,
        export=False,
    )


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def _assert_same_model(a, b):
    for x, y in zip(_leaves(nnx.state(a)), _leaves(nnx.state(b)), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def _log_steps(run_dir, kind="train") -> list[int]:
    records = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if r["kind"] == kind]


def _files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_schedule_warms_up_then_decays():
    config = train.TrainConfig(num_steps=100, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
    schedule = train.learning_rate_schedule(config)
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(schedule(55), 0.1 + 0.9 * 0.5, atol=1e-6)  # cosine midpoint
    np.testing.assert_allclose(schedule(100), 0.1, atol=1e-6)


def test_loss_decreases_on_a_fixed_batch(corpus, model_config):
    graphdef, params, frozen = train.split_model(init_model(model_config), TRAIN)
    state = train.TrainState(
        step=jax.numpy.zeros((), jax.numpy.int32), params=params, opt_state=train.make_optimizer(TRAIN).init(params)
    )
    tokens, segment_ids = data.PackedBatches(corpus.train, TRAIN.batch_size, TRAIN.seq_len).batch(0)
    losses = []
    for _ in range(TRAIN.num_steps):
        state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=TRAIN)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == TRAIN.num_steps
    assert losses[0] > math.log(300) - 0.5  # a random model starts near uniform
    assert losses[-1] < losses[0] - 1.0, losses


def test_resume_continues_the_same_run(tmp_path, corpus, model_config, straight):
    first = train.train(
        tmp_path / "resumed",
        corpus,
        model_config=model_config,
        train_config=TRAIN,
        stop_at_step=3,
        progress=False,
        export=False,
    )
    assert first.step == 3 and first.stopped_early
    resumed = train.train(tmp_path / "resumed", corpus, resume=True, progress=False, export=False)
    assert resumed.step == straight.step == TRAIN.num_steps and not resumed.stopped_early
    for a, b in zip(_leaves(nnx.state(straight.model)), _leaves(nnx.state(resumed.model)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert resumed.eval_metrics == pytest.approx(straight.eval_metrics, rel=1e-5)
    log = [json.loads(line) for line in (tmp_path / "resumed" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["kind"] == "train"] == list(range(1, TRAIN.num_steps + 1))
    # The same config again is fine; a different one is refused.
    with pytest.raises(ValueError, match="learning_rate"):
        train.train(tmp_path / "resumed", corpus, train_config=TRAIN.replace(learning_rate=1.0), resume=True)
    with pytest.raises(FileNotFoundError):
        train.train(tmp_path / "nothing_here", corpus, resume=True)


def test_mtp_only_freezes_the_main_model(tmp_path, corpus, model_config):
    model = init_model(model_config, seed=1)
    main_before, mtp_before = _leaves(nnx.state(model, MAIN_PARAMS)), _leaves(nnx.state(model, MTP_PARAMS))
    eval_before = train.evaluate(
        model,
        corpus.heldout,
        data.token_byte_lengths(corpus.tokenizer),
        batch_size=TRAIN.batch_size,
        seq_len=TRAIN.seq_len,
    )
    result = train.train(
        tmp_path / "run", corpus, train_config=TRAIN.replace(mtp_only=True), model=model, progress=False, export=False
    )
    for before, after in zip(main_before, _leaves(nnx.state(result.model, MAIN_PARAMS)), strict=True):
        np.testing.assert_array_equal(before, after)  # bit-identical
    mtp_after = _leaves(nnx.state(result.model, MTP_PARAMS))
    assert all(not np.array_equal(b, a) for b, a in zip(mtp_before, mtp_after, strict=True))
    assert result.eval_metrics["main_loss"] == eval_before["main_loss"]
    for k in (1, 2):
        assert result.eval_metrics[f"mtp_loss_{k}"] < eval_before[f"mtp_loss_{k}"] - 0.3
    with pytest.raises(ValueError, match="mtp_only"):
        train.train(
            tmp_path / "no_mtp",
            corpus,
            model_config=model_config.replace(num_nextn_predict_layers=0),
            train_config=TRAIN.replace(mtp_only=True),
            progress=False,
        )


def test_overwrite_deletes_only_a_run_dir(tmp_path, corpus, model_config, capsys):
    mine = tmp_path / "mine"  # a user's folder, not a run dir
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("my results")
    (mine / "sub" / "data.bin").write_bytes(b"\x00\x01 precious")
    before = _files(mine)
    with pytest.raises(FileExistsError, match="not empty"):
        train.train(mine, corpus, model_config=model_config, train_config=TRAIN, progress=False)
    with pytest.raises(FileExistsError, match="not a run dir.*nothing was deleted"):
        train.train(mine, corpus, model_config=model_config, train_config=TRAIN, overwrite=True, progress=False)
    assert cli.main(["train", str(mine), "--overwrite", "--no-progress"]) == 2
    assert "not a run dir" in capsys.readouterr().err
    assert _files(mine) == before  # every file, byte for byte, and nothing added (no lock file either)

    run_dir = tmp_path / "run"  # a run dir the trainer made, with a file of the user's put in it
    train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, stop_at_step=2, progress=False)
    (run_dir / "notes.txt").write_text("my notes")
    with pytest.raises(FileExistsError, match="not empty"):  # a run's own dir is protected too
        train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, progress=False)
    result = train.train(
        run_dir, corpus, model_config=model_config, train_config=TRAIN, overwrite=True, stop_at_step=1, progress=False
    )
    assert result.step == 1 and _log_steps(run_dir) == [1]  # the old run is gone ...
    assert (run_dir / "notes.txt").read_text() == "my notes"  # ... the user's file is not
    assert train.train(run_dir, corpus, resume=True, stop_at_step=2, progress=False).step == 2


def test_one_trainer_per_run_dir(tmp_path, corpus, model_config, capsys):
    run_dir = tmp_path / "run"
    train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, stop_at_step=1, progress=False)
    holder = subprocess.Popen(  # another trainer: holds the run dir's lock until it is killed
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, b'%d' % os.getpid()); "
            "print('locked', flush=True); time.sleep(120)",
            str(run_dir / "train.lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(train.RunDirInUseError, match=f"{run_dir} is in use .*process {holder.pid} "):
            train.train(run_dir, corpus, resume=True, progress=False)
        with pytest.raises(train.RunDirInUseError):
            train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, overwrite=True, progress=False)
        assert cli.main(["train", str(run_dir), "--resume", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "in use by another trainer" in err and str(run_dir) in err
        assert _log_steps(run_dir) == [1] and train.load_run(run_dir)[0] is not None  # untouched
    finally:
        holder.kill()  # as a crash would: the kernel drops its lock, the lock file stays
        holder.wait()
    assert (run_dir / "train.lock").exists()
    assert train.train(run_dir, corpus, resume=True, stop_at_step=2, progress=False).step == 2
    with open(run_dir / "train.lock") as f:  # released when train returns
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def _poison_after(monkeypatch, step: int):
    """Makes the jitted step return NaN parameters once it has done `step` steps (the next loss is NaN)."""
    real = train._train_step

    def poisoned(state, *args, **kwargs):
        state, metrics = real(state, *args, **kwargs)
        if int(state.step) == step:
            state = state.replace(params=jax.tree.map(lambda p: p * np.nan, state.params))
        return state, metrics

    monkeypatch.setattr(train, "_train_step", poisoned)


def test_a_non_finite_step_is_never_saved(tmp_path, corpus, model_config, straight, monkeypatch, capsys):
    config = TRAIN.replace(checkpoint_every=2, keep_checkpoints=1)  # one checkpoint kept: rotation would lose it
    run_dir = tmp_path / "run"
    train.train(run_dir, corpus, model_config=model_config, train_config=config, stop_at_step=3, progress=False)
    monkeypatch.setattr(train_cli, "corpus_of_run", lambda run_dir, run, data_dir: corpus)
    with monkeypatch.context() as m:
        _poison_after(m, 5)  # step 6's loss is NaN
        assert cli.main(["train", str(run_dir), "--resume", "--no-progress", "--no-export"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not finite at step 6" in err and "last checkpoint, step 4" in err, err
    manager = run_checkpoint_manager(run_dir, config)
    assert manager.all_steps() == [4]  # step 6 not saved, step 4 not rotated away
    manager.close()
    assert all(np.isfinite(x).all() for x in _leaves(nnx.state(train.load_run(run_dir)[0])))
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5]
    # --resume continues from step 4 and ends where the straight run ends; step 5 is logged once.
    assert cli.main(["train", str(run_dir), "--resume", "--no-progress", "--no-export"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 6
    _assert_same_model(train.load_run(run_dir)[0], straight.model)
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5, 6] and _log_steps(run_dir, "eval") == [6]
    # Non-finite parameters whose loss has not been computed yet are caught at the checkpoint.
    with monkeypatch.context() as m:
        _poison_after(m, 2)
        with pytest.raises(train.NonFiniteError, match="parameters.*step 2.*no checkpoint") as error:
            train.train(tmp_path / "fresh", corpus, model_config=model_config, train_config=config, progress=False)
    assert (error.value.step, error.value.last_checkpoint) == (2, None)
    assert not list((tmp_path / "fresh" / "checkpoints").iterdir())


def test_resume_applies_more_steps_and_refuses_other_changes(tmp_path, corpus, model_config, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, stop_at_step=3, progress=False)
    run_before = (run_dir / "run.json").read_text()
    monkeypatch.setattr(train_cli, "corpus_of_run", lambda run_dir, run, data_dir: corpus)
    resume = ["train", str(run_dir), "--resume", "--no-progress", "--no-export"]
    assert cli.main([*resume, "--lr", "1", "--seed", "3", "--mtp-only", "--vocab-size", "512", "--steps", "8"]) == 2
    err = capsys.readouterr().err
    for named in (
        "--lr (saved 0.01, given 1.0)",
        "--seed (saved 0, given 3)",
        "--mtp-only (saved False, given True)",
        "--vocab-size (saved 300, given 512)",
    ):
        assert named in err, err
    assert "--steps" not in err and err.count("\n") == 1
    assert (run_dir / "run.json").read_text() == run_before and _log_steps(run_dir) == [1, 2, 3]
    assert cli.main([*resume, "--steps", "2"]) == 2
    assert "num_steps must be >= 3" in capsys.readouterr().err
    # More steps: the run continues to the new total, and run.json says so.
    assert cli.main([*resume, "--steps", "8", "--log-every", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 8
    run = json.loads((run_dir / "run.json").read_text())
    assert run["train_config"]["num_steps"] == 8 and run["resumes"] == [
        {"step": 3, "changed": {"num_steps": [6, 8], "log_every": [1, 2]}}
    ]
    assert _log_steps(run_dir) == [1, 2, 3, 4, 6, 8] and _log_steps(run_dir, "eval") == [8]
    assert train.train(run_dir, corpus, resume=True, progress=False).step == 8  # the new total is kept


def _truncate_checkpoint(run_dir, step: int) -> None:
    """Cuts every data file of checkpoint `step` in half, as a disk filling up mid-write would."""
    for f in (run_dir / "checkpoints" / str(step)).rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


# A failed orbax restore leaves asyncio callbacks that complain "Event loop is closed" when collected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_kill_and_corrupt_checkpoint_resume_from_the_last_good_step(
    tmp_path, corpus, model_config, straight, monkeypatch
):
    config = TRAIN.replace(checkpoint_every=2)
    run_dir = tmp_path / "run"
    real = train._train_step

    def killed_at_step_4(state, *args, **kwargs):
        if int(state.step) == 3:
            raise KeyboardInterrupt  # the process dies while computing step 4
        return real(state, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(train, "_train_step", killed_at_step_4)
        with pytest.raises(KeyboardInterrupt):
            train.train(run_dir, corpus, model_config=model_config, train_config=config, progress=False)
    with open(run_dir / "log.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut short by the kill
    assert _log_steps_tolerant(run_dir) == [1, 2, 3]  # checkpoint 2 and the records of steps 1-3
    result = train.train(run_dir, corpus, resume=True, stop_at_step=4, progress=False)
    assert result.step == 4 and _log_steps(run_dir) == [1, 2, 3, 4]  # step 3 once, the cut line gone

    # Checkpoint 4 is damaged: restoring falls back to step 2, saying so.
    _truncate_checkpoint(run_dir, 4)
    with pytest.warns(train.CheckpointFallbackWarning, match="step 4 .* cannot be restored.*falling back to step 2"):
        model, _ = train.load_run(run_dir)
    _assert_same_model(model, train.load_run(run_dir, step=2)[0])
    with pytest.raises(train.NoUsableCheckpointError, match="step 4"):
        train.load_run(run_dir, step=4)
    with pytest.warns(train.CheckpointFallbackWarning, match="step 4 .*falling back to step 2; moved to"):
        resumed = train.train(run_dir, corpus, resume=True, progress=False, export=False)
    assert resumed.step == 6 and (run_dir / "corrupt_checkpoints" / "4").is_dir()  # kept, out of orbax's way
    _assert_same_model(resumed.model, straight.model)
    assert _log_steps(run_dir) == [1, 2, 3, 4, 5, 6] and _log_steps(run_dir, "eval") == [6]

    # Nothing restorable: a named error, and nothing moved.
    manager = run_checkpoint_manager(run_dir, config)
    steps = manager.all_steps()
    manager.close()
    for step in steps:
        _truncate_checkpoint(run_dir, step)
    with pytest.raises(train.NoUsableCheckpointError, match="no checkpoint .* can be restored"):
        train.train(run_dir, corpus, resume=True, progress=False)
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == steps


def _log_steps_tolerant(run_dir) -> list[int]:
    steps = []
    for line in (run_dir / "log.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            steps.append(json.loads(line)["step"])
    return steps


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "x", "--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["eval", "x", "--max-batches", "-2"], "argument --max-batches: must be >= 1, got -2"),
        (["eval", "x", "--seq-len", "1"], "argument --seq-len: must be >= 2, got 1"),
        (["train", "x", "--batch-size", "-1"], "argument --batch-size: must be >= 1, got -1"),
        (["train", "x", "--lr", "0"], "argument --lr: must be > 0, got 0.0"),
        (["train", "x", "--lr", "nan"], "argument --lr: must be > 0, got nan"),
    ],
)
def test_cli_refuses_bad_sizes_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_config_and_evaluate_refuse_bad_sizes(tmp_path, corpus, model_config, capsys):
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        TRAIN.replace(batch_size=0)
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        TRAIN.replace(seq_len=1)
    with pytest.raises(ValueError, match="batch_size >= 1.*got batch_size 0"):
        train.evaluate(
            init_model(model_config),
            corpus.heldout,
            data.token_byte_lengths(corpus.tokenizer),
            batch_size=0,
            seq_len=32,
        )
    assert cli.main(["train", str(tmp_path / "run"), "--warmup", "10", "--steps", "5"]) == 2
    assert "--warmup must be in [0, --steps=5], got 10" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, description",
    [
        ("train", "Train a decoder with DeepSeek-V3-style MTP modules"),
        ("eval", "Evaluate a model on the held-out split"),
    ],
)
def test_subcommand_help_has_its_own_description(command, description, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and description in out and "generate, train, eval" not in out


def test_evaluate_pools_over_batches_and_counts_bytes(corpus, model_config):
    model = init_model(model_config, seed=2)
    token_bytes = data.token_byte_lengths(corpus.tokenizer)
    rows = list(data.heldout_batches(corpus.heldout, TRAIN.batch_size, TRAIN.seq_len))
    batched = train.evaluate(model, corpus.heldout, token_bytes, batch_size=TRAIN.batch_size, seq_len=TRAIN.seq_len)
    single = train.evaluate(
        model, corpus.heldout, token_bytes, batch_size=TRAIN.batch_size * len(rows), seq_len=TRAIN.seq_len
    )  # the same rows in one batch
    assert batched == pytest.approx(single, rel=1e-5)  # pooled over tokens, not averaged over batches
    # By hand: the labelled tokens are those whose predecessor is in the same document, in the same row.
    tokens = np.concatenate([t for t, _ in rows])
    segment_ids = np.concatenate([s for _, s in rows])
    labelled = (segment_ids[:, :-1] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    assert batched["num_tokens"] == labelled.sum()
    assert batched["num_bytes"] == token_bytes[tokens[:, 1:]][labelled].sum()
    assert batched["bits_per_byte"] == pytest.approx(
        batched["main_loss"] * batched["num_tokens"] / math.log(2) / batched["num_bytes"], rel=1e-9
    )
    assert batched["loss"] == pytest.approx(
        batched["main_loss"] + 0.1 * (batched["mtp_loss_1"] + batched["mtp_loss_2"]) / 2, rel=1e-9
    )
    assert 0 <= batched["mtp_agreement_1"] <= 1 and 0 <= batched["mtp_agreement_2"] <= 1


def test_export_round_trips_and_adds_mtp_heads(tmp_path, corpus, model_config):
    model = init_model(model_config, seed=3)
    save_pretrained(model, tmp_path / "export", tokenizer=corpus.tokenizer_path)
    assert (tmp_path / "export" / "tokenizer.json").read_text() == corpus.tokenizer_path.read_text()
    hf = json.loads((tmp_path / "export" / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 2 and hf["num_hidden_layers"] == 1
    loaded = checkpoint.load_hf_checkpoint(tmp_path / "export")
    assert loaded.config == model_config
    for a, b in zip(_leaves(nnx.state(model)), _leaves(nnx.state(loaded)), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(FileExistsError):
        save_pretrained(model, tmp_path / "export")
    # Adding a third head to the exported model: main and the two trained heads are kept.
    grown = train.init_from_pretrained(tmp_path / "export", num_nextn_predict_layers=3)
    assert grown.config.num_nextn_predict_layers == 3
    for a, b in zip(_leaves(nnx.state(model, MAIN_PARAMS)), _leaves(nnx.state(grown, MAIN_PARAMS)), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_leaves(nnx.state(model.mtp[1])), _leaves(nnx.state(grown.mtp[1])), strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(x).all() and x.std() > 0 for x in _leaves(nnx.state(grown.mtp[2].eh_proj)))


def test_heads_added_to_a_plain_checkpoint(tmp_path, corpus, model_config):
    plain = init_model(model_config.replace(num_nextn_predict_layers=0, dtype="bfloat16"), seed=4)
    save_pretrained(plain, tmp_path / "plain")  # bfloat16 compute, float32 weights: saved as float32
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["dtype"] == "float32"
    model = train.init_from_pretrained(tmp_path / "plain", num_nextn_predict_layers=2, seed=5)
    assert model.config == model_config.replace(dtype="float32")
    for a, b in zip(_leaves(nnx.state(plain)), _leaves(nnx.state(model, MAIN_PARAMS)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(_leaves(nnx.state(model, MTP_PARAMS))) == len(_leaves(nnx.state(init_model(model_config), MTP_PARAMS)))


def test_cli_parses_into_train_config():
    parser = cli.build_parser()
    args = parser.parse_args(
        ["train", "runs/x", "--steps", "50", "--warmup", "5", "--lr", "1e-3", "--mtp-only", "--init-from", "hf"]
    )
    config = train_cli._train_config_from_args(args)
    assert config == train.TrainConfig(num_steps=50, warmup_steps=5, learning_rate=1e-3, mtp_only=True)
    assert args.func is train_cli.run_train and args.init_from == "hf"
    assert parser.parse_args(["eval", "runs/x"]).func is eval_cli.run_eval


def test_the_score_correction_bias_is_never_trained():
    """DeepSeek-V3's e_score_correction_bias (`ScoreCorrectionBias`, an `nnx.Param`) is set by its load-balancing
    rule, not by gradient: both modes leave it in the frozen state, with every other parameter of the mode
    trained."""
    config = ModelConfig.from_name(
        "tiny",
        num_hidden_layers=2,
        num_nextn_predict_layers=1,
        ffn_type="moe",
        moe_intermediate_size=16,
        n_routed_experts=4,
        first_k_dense_replace=1,
    )
    model = init_model(config)
    biases = {path for path, _ in nnx.to_flat_state(nnx.state(model, ScoreCorrectionBias))}
    assert len(biases) == 2  # main layer 1 and the MTP layer
    for mtp_only, trained in ((False, nnx.Param), (True, MTP_PARAMS)):
        _, params, frozen = train.split_model(model, TRAIN.replace(mtp_only=mtp_only))
        params, frozen = ({path for path, _ in nnx.to_flat_state(s)} for s in (params, frozen))
        assert biases <= frozen and not biases & params
        assert params == {path for path, _ in nnx.to_flat_state(nnx.state(model, trained))} - biases


def test_self_distillation_settings_train_resume_and_are_refused_when_changed(tmp_path, corpus, model_config, capsys):
    """mtp_targets="self" with explicit per-depth weights: saved in run.json (the weights as an array),
    restored on resume, a change refused naming the flag; the held-out metrics carry the simulated
    acceptance and the acceptance lengths it implies; weights for another depth count are refused."""
    config = TRAIN.replace(mtp_only=True, mtp_targets="self", mtp_depth_weights=(0.7, 0.3))
    model = init_model(model_config, seed=1)
    run_dir = tmp_path / "run"
    train.train(run_dir, corpus, train_config=config, model=model, stop_at_step=3, progress=False, export=False)
    saved = json.loads((run_dir / "run.json").read_text())["train_config"]
    assert saved["mtp_depth_weights"] == [0.7, 0.3] and saved["mtp_targets"] == "self"
    result = train.train(run_dir, corpus, resume=True, progress=False, export=False)
    assert result.step == TRAIN.num_steps
    metrics = result.eval_metrics
    for k in (1, 2):
        assert 0 <= metrics[f"mtp_acceptance_{k}"] <= metrics[f"mtp_agreement_{k}"] <= 1
    assert metrics["mtp_acceptance_length_2"] == pytest.approx(
        1 + metrics["mtp_acceptance_1"] + metrics["mtp_acceptance_2"]
    )
    assert metrics["loss"] == pytest.approx(
        metrics["main_loss"] + 0.1 * (0.7 * metrics["mtp_loss_1"] + 0.3 * metrics["mtp_loss_2"])
    )
    args = cli.build_parser().parse_args(["train", str(run_dir), "--resume", "--mtp-depth-weights", "0.5,0.5"])
    with pytest.raises(ValueError, match=r"--mtp-depth-weights \(saved \(0.7, 0.3\), given \(0.5, 0.5\)\)"):
        train_cli._resume_config(args, run_dir, json.loads((run_dir / "run.json").read_text()))
    with pytest.raises(ValueError, match="has 3 weights; the model has 2 MTP depths"):
        train.train(
            tmp_path / "other",
            corpus,
            model_config=model_config,
            train_config=TRAIN.replace(mtp_depth_weights=(0.5, 0.3, 0.2)),
            progress=False,
        )


def test_cli_parses_the_mtp_objective_flags(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["train", "r", "--mtp-depth-weights", "0.5,0.3,0.2", "--mtp-targets", "self"])
    config = train_cli._train_config_from_args(args)
    assert config.mtp_depth_weights == (0.5, 0.3, 0.2) and config.mtp_targets == "self"
    args = parser.parse_args(["train", "r", "--mtp-depth-decay", "0.6"])
    np.testing.assert_allclose(train_cli._train_config_from_args(args).depth_weights(3), [0.51, 0.31, 0.18], atol=0.005)
    args = parser.parse_args(["train", "r", "--mtp-depth-decay", "0.6", "--mtp-depth-weights", "1,1"])
    with pytest.raises(ValueError, match="--mtp-depth-weights or --mtp-depth-decay, not both"):
        train_cli._train_config_from_args(args)
    for argv in (["--mtp-depth-weights", "0.5,x"], ["--mtp-depth-decay", "0"], ["--mtp-targets", "labels"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", "r", *argv])
        assert argv[0] in capsys.readouterr().err
