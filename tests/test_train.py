"""The trainer (`mtp_jax.train`): learning, exact resume, frozen-main MTP training, run-dir safety, eval, export.

Tiny model (1 layer of width 64, D = 2) on a tiny in-memory corpus; every test shares one
`TrainConfig` shape so the jitted step compiles once per mode.
"""

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from test_data import tiny_documents

from mtp_jax import checkpoint, cli, data, train
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.mtp import MAIN_PARAMS, MTP_PARAMS
from mtp_jax.pretrained import save_pretrained

TRAIN = train.TrainConfig(batch_size=4, seq_len=32, num_steps=6, learning_rate=1e-2, warmup_steps=1,
                          checkpoint_every=100, log_every=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(tmp_path_factory.mktemp("corpus"), documents=tiny_documents(), vocab_size=300,
                               heldout_fraction=0.2)


@pytest.fixture(scope="module")
def model_config(corpus):
    return ModelConfig.from_name("tiny", vocab_size=300, num_hidden_layers=1, num_nextn_predict_layers=2,
                                 eos_token_id=corpus.eos_id)


def _leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_schedule_warms_up_then_decays():
    config = train.TrainConfig(num_steps=100, warmup_steps=10, learning_rate=1.0, min_lr_ratio=0.1)
    schedule = train.learning_rate_schedule(config)
    np.testing.assert_allclose([schedule(0), schedule(5), schedule(10)], [0.0, 0.5, 1.0], atol=1e-6)
    np.testing.assert_allclose(schedule(55), 0.1 + 0.9 * 0.5, atol=1e-6)  # cosine midpoint
    np.testing.assert_allclose(schedule(100), 0.1, atol=1e-6)


def test_loss_decreases_on_a_fixed_batch(corpus, model_config):
    graphdef, params, frozen = train.split_model(init_model(model_config), TRAIN)
    state = train.TrainState(step=jax.numpy.zeros((), jax.numpy.int32), params=params,
                             opt_state=train.make_optimizer(TRAIN).init(params))
    tokens, segment_ids = data.PackedBatches(corpus.train, TRAIN.batch_size, TRAIN.seq_len).batch(0)
    losses = []
    for _ in range(TRAIN.num_steps):
        state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=TRAIN)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == TRAIN.num_steps
    assert losses[0] > math.log(300) - 0.5  # a random model starts near uniform
    assert losses[-1] < losses[0] - 1.0, losses


def test_resume_continues_the_same_run(tmp_path, corpus, model_config):
    straight = train.train(tmp_path / "straight", corpus, model_config=model_config, train_config=TRAIN,
                           progress=False, export=False)
    first = train.train(tmp_path / "resumed", corpus, model_config=model_config, train_config=TRAIN,
                        stop_at_step=3, progress=False, export=False)
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
    eval_before = train.evaluate(model, corpus.heldout, data.token_byte_lengths(corpus.tokenizer),
                                 batch_size=TRAIN.batch_size, seq_len=TRAIN.seq_len)
    result = train.train(tmp_path / "run", corpus, train_config=TRAIN.replace(mtp_only=True), model=model,
                         progress=False, export=False)
    for before, after in zip(main_before, _leaves(nnx.state(result.model, MAIN_PARAMS)), strict=True):
        np.testing.assert_array_equal(before, after)  # bit-identical
    mtp_after = _leaves(nnx.state(result.model, MTP_PARAMS))
    assert all(not np.array_equal(b, a) for b, a in zip(mtp_before, mtp_after, strict=True))
    assert result.eval_metrics["main_loss"] == eval_before["main_loss"]
    for k in (1, 2):
        assert result.eval_metrics[f"mtp_loss_{k}"] < eval_before[f"mtp_loss_{k}"] - 0.3
    with pytest.raises(ValueError, match="mtp_only"):
        train.train(tmp_path / "no_mtp", corpus, model_config=model_config.replace(num_nextn_predict_layers=0),
                    train_config=TRAIN.replace(mtp_only=True), progress=False)


def test_refuses_to_overwrite_a_run_dir(tmp_path, corpus, model_config):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("my results")
    with pytest.raises(FileExistsError, match="not empty"):
        train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, progress=False)
    assert (run_dir / "notes.txt").read_text() == "my results"
    result = train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, overwrite=True,
                         stop_at_step=1, progress=False)
    assert result.step == 1 and not (run_dir / "notes.txt").exists()
    with pytest.raises(FileExistsError):  # a run's own dir is protected too
        train.train(run_dir, corpus, model_config=model_config, train_config=TRAIN, progress=False)
    assert train.train(run_dir, corpus, resume=True, stop_at_step=2, progress=False).step == 2


def test_evaluate_pools_over_batches_and_counts_bytes(corpus, model_config):
    model = init_model(model_config, seed=2)
    token_bytes = data.token_byte_lengths(corpus.tokenizer)
    rows = list(data.heldout_batches(corpus.heldout, TRAIN.batch_size, TRAIN.seq_len))
    batched = train.evaluate(model, corpus.heldout, token_bytes, batch_size=TRAIN.batch_size, seq_len=TRAIN.seq_len)
    single = train.evaluate(model, corpus.heldout, token_bytes, batch_size=TRAIN.batch_size * len(rows),
                            seq_len=TRAIN.seq_len)  # the same rows in one batch
    assert batched == pytest.approx(single, rel=1e-5)  # pooled over tokens, not averaged over batches
    # By hand: the labelled tokens are those whose predecessor is in the same document, in the same row.
    tokens = np.concatenate([t for t, _ in rows])
    segment_ids = np.concatenate([s for _, s in rows])
    labelled = (segment_ids[:, :-1] > 0) & (segment_ids[:, 1:] == segment_ids[:, :-1])
    assert batched["num_tokens"] == labelled.sum()
    assert batched["num_bytes"] == token_bytes[tokens[:, 1:]][labelled].sum()
    assert batched["bits_per_byte"] == pytest.approx(
        batched["main_loss"] * batched["num_tokens"] / math.log(2) / batched["num_bytes"], rel=1e-9)
    assert batched["loss"] == pytest.approx(
        batched["main_loss"] + 0.1 * (batched["mtp_loss_1"] + batched["mtp_loss_2"]) / 2, rel=1e-9)
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
    args = parser.parse_args(["train", "runs/x", "--steps", "50", "--warmup", "5", "--lr", "1e-3", "--mtp-only",
                              "--init-from", "hf"])
    config = cli._train_config_from_args(args)
    assert config == train.TrainConfig(num_steps=50, warmup_steps=5, learning_rate=1e-3, mtp_only=True)
    assert args.func is cli.run_train and args.init_from == "hf"
    assert parser.parse_args(["eval", "runs/x"]).func is cli.run_eval
