"""The MTP objective: hand computations with tail, padding and document-boundary masks, agreement,
packed == separate documents, and training the MTP modules alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.mtp import MAIN_PARAMS, MTP_PARAMS, mtp_forward_full
from mtp_jax.training.loss import (
    compute_loss,
    depth_weights,
    label_mask,
    loss_from_logits,
    simulated_acceptance_length,
)

TINY = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    num_nextn_predict_layers=2,
    initializer_range=0.3,
)

# Row 0 packs document 1 (3 tokens) and document 2 (2 tokens), then one padding token; row 1 is one document.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
# Rows with a label in their own document, by hand: main (t_{i+1}), depth 1 (t_{i+2}), depth 2 (t_{i+3}).
MASKS = [
    np.array([[1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 0]], bool),
    np.array([[1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], bool),
    np.array([[0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], bool),
]


def np_token_mean_ce(logits, tokens, shift, mask):
    """Mean over `mask` of -log softmax(logits[b, i])[tokens[b, i + shift]], in float64."""
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    terms = [-logp[b, i, tokens[b, i + shift]] for b, i in zip(*np.nonzero(mask), strict=True)]
    return float(np.mean(terms))


def test_label_mask():
    for shift, mask in enumerate(MASKS, start=1):
        np.testing.assert_array_equal(label_mask(jnp.asarray(SEGMENTS), shift), mask)


def test_loss_from_logits_matches_hand_computation():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 5, SEGMENTS.shape).astype(np.int32)
    logits = [rng.normal(0, 2, SEGMENTS.shape + (5,)).astype(np.float32) for _ in range(3)]
    loss, metrics = loss_from_logits(
        [jnp.asarray(x) for x in logits], jnp.asarray(tokens), jnp.asarray(SEGMENTS), mtp_lambda=0.3
    )
    main = np_token_mean_ce(logits[0], tokens, 1, MASKS[0])
    mtp = [np_token_mean_ce(logits[k], tokens, k + 1, MASKS[k]) for k in (1, 2)]
    assert MASKS[2][1].sum() == 3 and not MASKS[2][0].any()  # depth 2 only has labels in row 1
    np.testing.assert_allclose(metrics["main_loss"], main, rtol=1e-6)
    np.testing.assert_allclose(metrics["mtp_loss_1"], mtp[0], rtol=1e-6)
    np.testing.assert_allclose(metrics["mtp_loss_2"], mtp[1], rtol=1e-6)
    np.testing.assert_allclose(loss, main + 0.3 * (mtp[0] + mtp[1]) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss"], loss)
    assert int(metrics["num_tokens"]) == 8
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert set(metrics) == {
        "loss",
        "main_loss",
        "num_tokens",
        "mtp_loss_1",
        "mtp_loss_2",
        "mtp_agreement_1",
        "mtp_agreement_2",
        "mtp_acceptance_1",
        "mtp_acceptance_2",
    }


def test_depth_weights():
    """1/D by default; FastMTP's beta = 0.6 over three depths is [0.51, 0.31, 0.18]; bad weights are refused."""
    assert depth_weights(4) == (0.25,) * 4 and depth_weights(0) == depth_weights(0, ()) == ()
    np.testing.assert_allclose(depth_weights(3, decay=0.6), [1 / 1.96, 0.6 / 1.96, 0.36 / 1.96])
    np.testing.assert_allclose(depth_weights(3, decay=0.6), [0.51, 0.31, 0.18], atol=0.005)
    assert depth_weights(2, [2.0, 0.5]) == (2.0, 0.5)  # explicit weights as given
    for kwargs, match in [
        (dict(weights=[1.0]), "has 1 weights; the model has 2"),
        (dict(weights=[1.0, -1.0]), ">= 0"),
        (dict(weights=[0.0, 0.0]), "not all 0"),
        (dict(decay=0.0), r"\(0, 1\]"),
        (dict(decay=1.5), r"\(0, 1\]"),
        (dict(weights=[1.0, 1.0], decay=0.5), "not both"),
    ]:
        with pytest.raises(ValueError, match=match):
            depth_weights(2, **kwargs)


def test_per_depth_weights_and_self_targets_match_hand_computation():
    """Loss = main + lambda * sum_k w_k L_k with explicit weights; with mtp_targets="self" depth k's row i
    is scored against the main logits' argmax at row i + k (the data's tokens play no part)."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 5, SEGMENTS.shape).astype(np.int32)
    logits = [rng.normal(0, 2, SEGMENTS.shape + (5,)).astype(np.float32) for _ in range(3)]
    args = ([jnp.asarray(x) for x in logits], jnp.asarray(tokens), jnp.asarray(SEGMENTS))
    main = np_token_mean_ce(logits[0], tokens, 1, MASKS[0])
    data = [np_token_mean_ce(logits[k], tokens, k + 1, MASKS[k]) for k in (1, 2)]
    loss, metrics = loss_from_logits(*args, mtp_lambda=0.3, mtp_weights=(0.7, 0.2))
    np.testing.assert_allclose(loss, main + 0.3 * (0.7 * data[0] + 0.2 * data[1]), rtol=1e-6)
    main_pred = logits[0].argmax(-1)
    # label t_{i+k+1} := main_pred[i + k]: put it where np_token_mean_ce (shift k + 1) reads it
    self_labels = np.concatenate([np.zeros((2, 1), np.int64), main_pred], axis=1)[:, :-1]
    own = [np_token_mean_ce(logits[k], self_labels, k + 1, MASKS[k]) for k in (1, 2)]
    assert not np.allclose(own, data)
    loss, metrics = loss_from_logits(*args, mtp_lambda=0.3, mtp_targets="self", mtp_weights=(0.5, 0.5))
    np.testing.assert_allclose([metrics["mtp_loss_1"], metrics["mtp_loss_2"]], own, rtol=1e-6)
    np.testing.assert_allclose(loss, main + 0.3 * 0.5 * (own[0] + own[1]), rtol=1e-6)
    np.testing.assert_allclose(metrics["main_loss"], main, rtol=1e-6)  # the main loss keeps the data's labels
    with pytest.raises(ValueError, match="mtp_targets"):
        loss_from_logits(*args, mtp_targets="labels")


def test_simulated_acceptance_by_hand():
    """Acceptance k: depths 1..k all agree with the main argmax k rows ahead, over depth k's labelled rows."""
    main_pred = np.array([[2, 0, 3, 1, 1, 2]])
    depth1 = np.array([[0, 3, 0, 1, 0, 0]])  # vs main at i + 1 = [0, 3, 1, 1, 2]: agree at rows 0, 1, 3
    depth2 = np.array([[3, 0, 1, 0, 0, 0]])  # vs main at i + 2 = [3, 1, 1, 2]: agree at rows 0, 2
    one_hot = lambda pred: jnp.asarray(np.eye(4)[pred] * 5.0, jnp.float32)  # noqa: E731
    _, metrics = loss_from_logits(
        [one_hot(main_pred), one_hot(depth1), one_hot(depth2)],
        jnp.zeros((1, 6), jnp.int32),
        jnp.ones((1, 6), jnp.int32),
    )
    # depth 1 has rows 0..3 (t_{i+2} <= t_5), depth 2 rows 0..2
    np.testing.assert_allclose(metrics["mtp_agreement_1"], 3 / 4)
    np.testing.assert_allclose(metrics["mtp_acceptance_1"], 3 / 4)
    np.testing.assert_allclose(metrics["mtp_agreement_2"], 2 / 3)
    np.testing.assert_allclose(metrics["mtp_acceptance_2"], 1 / 3)  # row 2's depth 2 agrees, its depth 1 does not
    assert simulated_acceptance_length(metrics, 2) == pytest.approx(1 + 3 / 4 + 1 / 3)


def test_agreement_by_hand():
    """Depth 1 at i against main at i + 1 (both predict t_{i+2}), over depth 1's labelled rows only."""
    main_pred = np.array([[2, 0, 3, 1, 1], [1, 1, 0, 3, 2]])
    depth_pred = np.array([[0, 3, 2, 1, 0], [1, 0, 3, 0, 0]])
    segments = np.array([[1, 1, 1, 1, 1], [1, 1, 2, 2, 2]], np.int32)
    # Row 0: rows 0, 1, 2 have labels (row 3's t_5 is past the end): 0==0, 3==3, 2!=1 -> 2 of 3.
    # Row 1: only row 2 (rows 0, 1 predict t_2, t_3 of document 2): 3==3 -> 1 of 1. (Row 0 also
    # agrees, 1==1, but is masked.) Pooled: 3 of 4.
    one_hot = lambda pred: jnp.asarray(np.eye(4)[pred] * 5.0, jnp.float32)  # noqa: E731
    tokens = jnp.zeros((2, 5), jnp.int32)
    _, metrics = loss_from_logits([one_hot(main_pred), one_hot(depth_pred)], tokens, jnp.asarray(segments))
    np.testing.assert_allclose(metrics["mtp_agreement_1"], 0.75)


def test_empty_depth_and_no_mtp():
    tokens = jnp.zeros((1, 2), jnp.int32)
    logits = jnp.zeros((1, 2, 3), jnp.float32)
    loss, metrics = loss_from_logits([logits, logits], tokens, jnp.ones((1, 2), jnp.int32))
    assert float(metrics["mtp_loss_1"]) == 0.0 and float(metrics["mtp_agreement_1"]) == 0.0  # no row has t_{i+2}
    np.testing.assert_allclose(loss, np.log(3), rtol=1e-6)  # main: one row, uniform over 3
    loss, metrics = loss_from_logits([logits], tokens, jnp.ones((1, 2), jnp.int32))
    assert set(metrics) == {"loss", "main_loss", "num_tokens"} and float(loss) == float(metrics["main_loss"])


@nnx.jit
def loss_and_logits(model, tokens, segment_ids):
    """`compute_loss` (lambda 0.1) and the 1 + D logits it scores; one compiled program serves every
    model test here (eager dispatch compiles each op per shape, which is slower on CPU)."""
    loss, metrics = compute_loss(model, tokens, segment_ids, mtp_lambda=0.1)
    logits, hidden = model.forward_full(tokens, segment_ids)
    return loss, metrics, [logits, *mtp_forward_full(model, hidden, tokens, segment_ids)]


def test_compute_loss_on_a_model_matches_hand_computation():
    model = init_model(TINY)
    tokens = np.random.default_rng(1).integers(0, 32, SEGMENTS.shape).astype(np.int32)
    loss, metrics, logits = loss_and_logits(model, jnp.asarray(tokens), jnp.asarray(SEGMENTS))
    main = np_token_mean_ce(logits[0], tokens, 1, MASKS[0])
    mtp = [np_token_mean_ce(logits[k], tokens, k + 1, MASKS[k]) for k in (1, 2)]
    np.testing.assert_allclose(metrics["main_loss"], main, rtol=1e-5)
    np.testing.assert_allclose(metrics["mtp_loss_1"], mtp[0], rtol=1e-5)
    np.testing.assert_allclose(metrics["mtp_loss_2"], mtp[1], rtol=1e-5)
    np.testing.assert_allclose(loss, main + 0.1 * (mtp[0] + mtp[1]) / 2, rtol=1e-5)


# Qwen3.5-shaped: a Gated DeltaNet layer, whose state and conv must restart at each document too.
HYBRID = TINY.replace(
    num_hidden_layers=2,
    layer_types=("linear_attention", "full_attention"),
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    attn_output_gate=True,
    rms_norm_unit_offset=True,
)


@pytest.mark.parametrize("config", [TINY, HYBRID], ids=["attention", "hybrid"])
def test_packed_rows_equal_separate_documents(config):
    """Attention (and a Gated DeltaNet's state) stays within documents: packing two documents into one row
    changes no loss, and the token ids under padding do not matter."""
    model = init_model(config)
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 32, 4), rng.integers(0, 32, 2)
    # Each document twice when packed (so the token means agree), once when separate.
    packed = np.stack([np.concatenate([a, b]), np.concatenate([b, a])]).astype(np.int32)
    packed_segments = np.array([[1, 1, 1, 1, 2, 2], [1, 1, 2, 2, 2, 2]], np.int32)
    separate = np.stack([np.pad(a, (0, 2)), np.pad(b, (0, 4))]).astype(np.int32)
    separate_segments = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], np.int32)
    _, packed_metrics, segmented = loss_and_logits(model, jnp.asarray(packed), jnp.asarray(packed_segments))
    _, separate_metrics, _ = loss_and_logits(model, jnp.asarray(separate), jnp.asarray(separate_segments))
    separate[separate_segments == 0] = rng.integers(1, 32, (separate_segments == 0).sum())
    _, garbage_metrics, _ = loss_and_logits(model, jnp.asarray(separate), jnp.asarray(separate_segments))
    assert int(packed_metrics["num_tokens"]) == 2 * int(separate_metrics["num_tokens"]) == 8
    assert float(separate_metrics["mtp_loss_2"]) > 0  # document a has a depth-2 label
    for name in packed_metrics:
        if name != "num_tokens":
            np.testing.assert_allclose(packed_metrics[name], separate_metrics[name], rtol=1e-5, err_msg=name)
        np.testing.assert_array_equal(garbage_metrics[name], separate_metrics[name], err_msg=name)
    # Without segment-aware attention (one segment per row), the second document would see the first.
    _, _, unsegmented = loss_and_logits(model, jnp.asarray(packed), jnp.ones_like(packed))
    np.testing.assert_allclose(unsegmented[0][0, :4], segmented[0][0, :4], rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(unsegmented[0][0, 4:] - segmented[0][0, 4:]).max()) > 1e-3


def test_frozen_main_trains_only_the_mtp_modules():
    """`MTP_PARAMS` selects what a frozen-main trainer differentiates and updates."""
    model = init_model(TINY)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 32, SEGMENTS.shape).astype(np.int32))
    optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=MTP_PARAMS)
    main_before = jax.tree.map(np.asarray, nnx.state(model, MAIN_PARAMS))
    mtp_before = jax.tree.map(np.asarray, nnx.state(model, MTP_PARAMS))

    @nnx.jit
    def train_step(model, optimizer, tokens, segment_ids):
        def loss_fn(model):
            return compute_loss(model, tokens, segment_ids)

        grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, MTP_PARAMS), has_aux=True)
        (_, metrics), grads = grad_fn(model)
        optimizer.update(model, grads)
        return metrics, grads

    metrics, grads = train_step(model, optimizer, tokens, jnp.asarray(SEGMENTS))
    assert all("mtp" in path for path, _ in nnx.to_flat_state(grads))
    for x, y in zip(jax.tree.leaves(main_before), jax.tree.leaves(nnx.state(model, MAIN_PARAMS)), strict=True):
        np.testing.assert_array_equal(x, y)
    mtp_after = jax.tree.leaves(nnx.state(model, MTP_PARAMS))
    assert all(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(mtp_before), mtp_after, strict=True))
    _, after, _ = loss_and_logits(model, tokens, jnp.asarray(SEGMENTS))
    assert float(after["mtp_loss_1"]) < float(metrics["mtp_loss_1"])
    np.testing.assert_allclose(after["main_loss"], metrics["main_loss"], rtol=1e-6)
