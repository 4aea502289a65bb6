"""MLA on packed training rows (`segment_ids`): the layer attends within each document, in both forms; a packed
row's losses equal its documents' in separate rows (main model and every MTP depth); an MLA model trains, through
`train_step` and through `mtp-jax train --model DIR`.

Tolerance: float32 throughout; packed and separate runs sum their softmaxes over different key counts (masked
weights are exactly 0), so they agree to rounding only: rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_data import tiny_documents

from mtp_jax.checkpoints.pretrained import save_pretrained
from mtp_jax.cli import main
from mtp_jax.config import ModelConfig
from mtp_jax.layers.decoder import MLA_ABSORBED_MAX_TOKENS
from mtp_jax.layers.mla import MLACache, MLAttention
from mtp_jax.model import init_model
from mtp_jax.mtp import mtp_forward_full
from mtp_jax.training import data
from mtp_jax.training import trainer as train
from mtp_jax.training.loss import compute_loss

RTOL, ATOL = 1e-5, 1e-6

# DeepSeek-V3's layout, tiny: MLA (low-rank q, latent kv, rope/nope split), a dense layer then MoE, two MTP depths.
MLA_MTP = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    attention_type="mla",
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    num_nextn_predict_layers=2,
    initializer_range=0.3,  # O(1) attention scores: masking a document out changes the output visibly
)


# ----------------------------------------------------------------------------------------------
# The layer: packed == each document alone


@nnx.jit(static_argnames="absorbed")
def _attend(module: MLAttention, x, positions, cache: MLACache, segment_ids, absorbed: bool):
    return module(x, positions, cache, segment_ids, absorbed=absorbed)


@pytest.mark.parametrize("q_lora_rank", [16, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("absorbed", [True, False], ids=["absorbed", "decompressed"])
def test_attention_with_segment_ids_equals_each_document_alone(absorbed, q_lora_rank):
    """Each document's outputs in a packed row equal those of the document run alone from position 0 over an
    empty cache (the cache path, no segment_ids); padding stays finite; the cache is written as without
    segment_ids; and one segment per row would let documents see each other."""
    config = MLA_MTP.replace(q_lora_rank=q_lora_rank)
    module = MLAttention(config, nnx.Rngs(0))
    segments = np.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0], [1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], np.int32)
    batch, num = segments.shape
    x = jnp.asarray(np.random.default_rng(0).standard_normal((batch, num, config.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (batch, num))
    empty = MLACache.init(config, batch, num)
    packed, written = _attend(module, x, positions, empty, jnp.asarray(segments), absorbed)
    assert np.isfinite(np.asarray(packed)).all()
    for b in range(batch):
        for segment in range(1, segments[b].max() + 1):
            idx = np.flatnonzero(segments[b] == segment)
            alone_positions = jnp.arange(len(idx), dtype=jnp.int32)[None]
            alone, _ = _attend(
                module, x[b : b + 1, idx], alone_positions, MLACache.init(config, 1, len(idx)), None, absorbed
            )
            np.testing.assert_allclose(packed[b, idx], alone[0], rtol=RTOL, atol=ATOL, err_msg=f"row {b} doc {segment}")
    _, unsegmented_written = _attend(module, x, positions, empty, None, absorbed)
    np.testing.assert_allclose(written.latent, unsegmented_written.latent, rtol=RTOL, atol=ATOL)  # two programs:
    np.testing.assert_allclose(written.k_rope, unsegmented_written.k_rope, rtol=RTOL, atol=ATOL)  # XLA's rounding
    one_segment, _ = _attend(module, x, positions, empty, jnp.ones_like(segments), absorbed)
    assert float(jnp.abs(one_segment[0, 4:9] - packed[0, 4:9]).max()) > 1e-2  # documents 2, 3 saw document 1


def test_absorbed_and_decompressed_agree_with_segment_ids():
    config = MLA_MTP
    module = MLAttention(config, nnx.Rngs(1))
    segments = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0]], jnp.int32)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 8, config.hidden_size)), jnp.float32)
    positions = jnp.arange(8, dtype=jnp.int32)[None]
    cache = MLACache.init(config, 1, 8)
    absorbed, _ = _attend(module, x, positions, cache, segments, True)
    decompressed, _ = _attend(module, x, positions, cache, segments, False)
    np.testing.assert_allclose(absorbed, decompressed, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# The model: packed rows give the losses of separate rows, main and every MTP depth


@nnx.jit
def _loss_and_logits(model, tokens, segment_ids):
    loss, metrics = compute_loss(model, tokens, segment_ids, mtp_lambda=0.1)
    logits, hidden = model.forward_full(tokens, segment_ids)
    return loss, metrics, [logits, *mtp_forward_full(model, hidden, tokens, segment_ids)]


@pytest.mark.parametrize(
    "len_a, len_b, scan_layers",
    [(7, 5, False), (23, 17, False), (7, 5, True)],
    ids=["absorbed", "decompressed", "absorbed-scanned"],
)
def test_packed_rows_equal_separate_documents(len_a, len_b, scan_layers):
    """Rows of T = len_a + len_b tokens: T <= MLA_ABSORBED_MAX_TOKENS runs MLA absorbed, longer rows
    decompressed (`DecoderLayer`); with `scan_layers` the layers run under `DecoderStack`'s scan."""
    num = len_a + len_b
    assert (num <= MLA_ABSORBED_MAX_TOKENS) == (len_a == 7)  # the ids name the form that runs
    model = init_model(MLA_MTP.replace(scan_layers=scan_layers), seed=0)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 64, len_a), rng.integers(0, 64, len_b)
    # Each document twice when packed (so the token means agree), once when separate.
    packed = np.stack([np.concatenate([a, b]), np.concatenate([b, a])]).astype(np.int32)
    packed_segments = np.array([[1] * len_a + [2] * len_b, [1] * len_b + [2] * len_a], np.int32)
    separate = np.stack([np.pad(a, (0, len_b)), np.pad(b, (0, len_a))]).astype(np.int32)
    separate_segments = np.array([[1] * len_a + [0] * len_b, [1] * len_b + [0] * len_a], np.int32)
    _, packed_metrics, segmented = _loss_and_logits(model, jnp.asarray(packed), jnp.asarray(packed_segments))
    _, separate_metrics, _ = _loss_and_logits(model, jnp.asarray(separate), jnp.asarray(separate_segments))
    assert int(packed_metrics["num_tokens"]) == 2 * int(separate_metrics["num_tokens"]) == 2 * (num - 2)
    assert {"main_loss", "mtp_loss_1", "mtp_loss_2"} <= set(packed_metrics)
    assert float(separate_metrics["mtp_loss_2"]) > 0
    for name in set(packed_metrics) - {"num_tokens"}:  # token means: losses and agreements
        assert np.isfinite(float(packed_metrics[name])), name
        np.testing.assert_allclose(packed_metrics[name], separate_metrics[name], rtol=RTOL, atol=ATOL, err_msg=name)
    # Without segment-aware attention (one segment per row), document b would see document a, at every depth.
    _, _, unsegmented = _loss_and_logits(model, jnp.asarray(packed), jnp.ones_like(packed))
    for depth, (plain, masked) in enumerate(zip(unsegmented, segmented, strict=True)):
        np.testing.assert_allclose(plain[0, :len_a], masked[0, :len_a], rtol=RTOL, atol=1e-5, err_msg=str(depth))
        assert float(jnp.abs(plain[0, len_a:] - masked[0, len_a:]).max()) > 1e-3, depth


# ----------------------------------------------------------------------------------------------
# Training


def test_train_step_fits_a_packed_batch():
    """Repeated AdamW steps on one packed batch: every loss finite, the total, main and each MTP depth's loss
    falling, and the MLA weights (kv_b_proj, the latent path) updated."""
    config = train.TrainConfig(batch_size=2, seq_len=16, num_steps=6, warmup_steps=0, learning_rate=1e-2)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (2, 16)), jnp.int32)
    segment_ids = jnp.asarray([[1] * 9 + [2] * 5 + [0] * 2, [1] * 4 + [2] * 12], jnp.int32)
    model = init_model(MLA_MTP.replace(initializer_range=0.02), seed=1)
    kv_b_before = np.asarray(model.blocks[0].self_attn.kv_b_proj.kernel[...])
    graphdef, params, frozen = train.split_model(model, config)
    state = train.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=train.make_optimizer(config).init(params)
    )
    losses = ("loss", "main_loss", "mtp_loss_1", "mtp_loss_2")
    history = []
    for _ in range(config.num_steps):
        state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=config)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(metrics)), metrics
        history.append({name: float(metrics[name]) for name in losses})
    for name in losses:
        assert history[-1][name] < history[0][name] - 0.1, (name, [m[name] for m in history])
    trained = nnx.merge(graphdef, state.params, frozen)
    assert not np.allclose(np.asarray(trained.blocks[0].self_attn.kv_b_proj.kernel[...]), kv_b_before)


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    """A saved tiny MLA model (MoE, one MTP layer) with its own tokenizer."""
    path = tmp_path_factory.mktemp("mla") / "model"
    tokenizer = data.train_tokenizer(list(tiny_documents(20).values()), vocab_size=300)
    config = MLA_MTP.replace(
        vocab_size=tokenizer.get_vocab_size(),
        num_nextn_predict_layers=1,
        initializer_range=0.02,
        eos_token_id=tokenizer.token_to_id(data.EOS_TOKEN),
    )
    save_pretrained(init_model(config, seed=0), path, tokenizer=tokenizer)
    return path


def test_cli_trains_an_mla_model_dir(tmp_path, capsys, monkeypatch, mla_dir):
    """`mtp-jax train --model DIR` of an MLA model: no refusal, every step's loss finite, the held-out losses
    finite, the run's model MLA. The corpus is `tiny_documents` instead of the stdlib (minutes to tokenize)."""
    prepare = data.prepare_corpus
    monkeypatch.setattr(
        data, "prepare_corpus", lambda work_dir, **kw: prepare(work_dir, documents=tiny_documents(), **kw)
    )
    run_dir = tmp_path / "run"
    argv = ["train", str(run_dir), "--model", str(mla_dir), "--data-dir", str(tmp_path / "corpus")]
    argv += ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--warmup", "0", "--log-every", "1"]
    argv += ["--eval-batches", "1", "--no-progress", "--no-export"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 3 and not result["stopped_early"]
    assert math.isfinite(result["train"]["loss"]) and math.isfinite(result["train"]["mtp_loss_1"])
    assert math.isfinite(result["heldout"]["main_loss"]) and math.isfinite(result["heldout"]["mtp_loss_1"])
    logged = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    steps = [r for r in logged if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in steps), logged
    run = json.loads((run_dir / "run.json").read_text())
    assert run["model_config"]["attention_type"] == "mla"


def test_cli_no_longer_refuses_an_mla_preset(tmp_path, capsys, monkeypatch):
    """`--model deepseek-v3-small` (MLA) passes the up-front checks and reaches the corpus (stopped there: training
    the 28M-parameter preset is too slow for this suite; the tiny MLA model above trains end to end)."""

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(data, "prepare_corpus", reached)
    with pytest.raises(Reached):
        main(["train", str(tmp_path / "run"), "--model", "deepseek-v3-small", "--no-progress"])
    assert "attention_type='mla'" not in capsys.readouterr().err
