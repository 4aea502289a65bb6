"""DeepSeek-V3's MoE load balancing in training (`mtp_jax.training.balance`, arXiv 2412.19437 §2.1.2): the bias
update, the sequence-wise balance loss against the report's formula by hand, the routers' records in both
layer layouts, the update inside the real train step (it balances a skewed router; off, training is unchanged
bit for bit), the bias through checkpoints, resume and export, and the CLI flags.

Tiny MoE models (hidden 64, 8 experts, k = 2) on CPU.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_data import tiny_documents

from mtp_jax import checkpoints as checkpoint
from mtp_jax import cli
from mtp_jax.cli import train as train_cli
from mtp_jax.config import ModelConfig
from mtp_jax.layers.moe import RoutingStats, ScoreCorrectionBias
from mtp_jax.model import init_model
from mtp_jax.sharding import constrain_tree
from mtp_jax.training import balance, data
from mtp_jax.training import trainer as train
from mtp_jax.training.loss import compute_loss
from mtp_jax.training.resume import check_compatible

MOE = ModelConfig.from_name(
    "tiny",
    vocab_size=64,
    num_hidden_layers=2,
    num_nextn_predict_layers=1,
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
SEGMENTS = np.array(
    [
        [1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0],  # two documents, then padding
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ],
    np.int32,
)


def _tokens(config: ModelConfig, shape=SEGMENTS.shape, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, shape), jnp.int32)


def _biases(model) -> dict[tuple, np.ndarray]:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, ScoreCorrectionBias))}


def _fresh_state(model, config: train.TrainConfig):
    """(graphdef, step-0 TrainState, frozen) as the trainer builds them."""
    graphdef, params, frozen = train.split_model(model, config)
    bias, frozen = train.split_bias(frozen, config)
    params, bias = jax.tree.map(jnp.copy, (params, bias))
    opt_state = train.make_optimizer(config).init(params)
    return (
        graphdef,
        train.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, bias=bias),
        frozen,
    )


# ---------------------------------------------------------------------------------------------
# The pure functions.


def test_the_bias_moves_by_exactly_gamma_against_the_load():
    gamma = 0.001
    bias = np.array([[0.0, 0.0, 0.0, 0.0], [0.5, -0.25, 0.125, 0.0]], np.float32)  # two layers (a stack)
    load = np.array([[7, 1, 4, 4], [3, 2, 2, 2]], np.int32)  # means 4 and 2.25 (not a whole number)
    new = np.asarray(balance.update_bias(jnp.asarray(bias), jnp.asarray(load), gamma))
    g = np.float32(gamma)
    # layer 0: overloaded down by gamma, idle up by gamma, the two at the mean unchanged
    np.testing.assert_array_equal(new[0], [-g, g, 0, 0])
    np.testing.assert_array_equal(new[1], [np.float32(0.5) - g, np.float32(-0.25) + g, np.float32(0.125) + g, g])
    equal = np.asarray(balance.update_bias(jnp.asarray(bias), jnp.full((2, 4), 5, jnp.int32), gamma))
    np.testing.assert_array_equal(equal, bias)  # balanced experts: unchanged
    idle = np.asarray(balance.update_bias(jnp.asarray(bias), jnp.zeros((2, 4), jnp.int32), gamma))
    np.testing.assert_array_equal(idle, bias)  # no tokens at all: nothing to balance


def test_the_load_counts_each_non_padding_tokens_k_choices():
    indices = jnp.array([[0, 1], [1, 2], [2, 3], [0, 3]], jnp.int32)  # tokens 0..3 of one row
    segment_ids = jnp.array([[1, 1, 0, 2]], jnp.int32)  # token 2 is padding
    np.testing.assert_array_equal(balance.expert_load(indices, segment_ids, 4), [2, 2, 1, 1])
    stacked = jnp.stack([indices, indices[::-1]])  # a stack of two layers: [2, N, k] -> [2, R]
    np.testing.assert_array_equal(balance.expert_load(stacked, segment_ids, 4), [[2, 2, 1, 1], [2, 1, 1, 2]])


def _packed_routing(seed: int = 0):
    """scores [N, R] (sigmoids), indices [N, k] (distinct experts) and segment ids [2, 6]: row 0 two documents
    (3 and 2 tokens) and one padding token, row 1 one document of 4 tokens and two padding tokens."""
    rng = np.random.default_rng(seed)
    segment_ids = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]], np.int32)
    num_experts, top_k = 4, 2
    scores = 1 / (1 + np.exp(-rng.normal(size=(segment_ids.size, num_experts)))).astype(np.float32)
    indices = np.argsort(rng.normal(size=(segment_ids.size, num_experts)), axis=-1)[:, :top_k].astype(np.int32)
    return scores, indices, segment_ids


def test_the_sequence_wise_loss_is_the_reports_formula():
    """V3 eqs. 17-20 by hand, one sequence at a time: f_i = R / (k T) sum_t 1[i chosen at t], s' = s / sum_j s_j,
    P_i = (1/T) sum_t s'_i,t, L = sum_i f_i P_i; averaged over the three documents, padding left out."""
    scores, indices, segment_ids = _packed_routing()
    num_experts, top_k = scores.shape[1], indices.shape[1]
    row_len = segment_ids.shape[1]
    documents = [(0, [0, 1, 2]), (0, [3, 4]), (1, [0, 1, 2, 3])]
    losses, grad = [], np.zeros_like(scores)
    for row, positions in documents:
        length = len(positions)
        f, p = np.zeros(num_experts), np.zeros(num_experts)
        for t in positions:
            n = row * row_len + t
            for i in range(num_experts):
                f[i] += num_experts / (top_k * length) * (i in indices[n])
                p[i] += scores[n, i] / scores[n].sum() / length
        losses.append(float(f @ p))
        for t in positions:  # d(f . P)/ds_{j,t} with f held fixed: (f_j - sum_i f_i s'_i,t) / (T sum_i s_i,t)
            n = row * row_len + t
            grad[n] = (f - f @ (scores[n] / scores[n].sum())) / (length * scores[n].sum())
    grad /= len(documents)
    args = (jnp.asarray(indices), jnp.asarray(segment_ids))
    loss, ours = jax.value_and_grad(balance.sequence_balance_loss)(jnp.asarray(scores), *args)
    np.testing.assert_allclose(float(loss), np.mean(losses), rtol=1e-6)
    np.testing.assert_allclose(ours, grad, rtol=1e-5, atol=1e-7)  # through P only; padding gets none
    # A perfectly spread sequence scores 1: every expert chosen equally often with equal affinities.
    flat = jnp.full((4, 4), 0.5)
    spread = jnp.array([[0, 1], [2, 3], [0, 1], [2, 3]], jnp.int32)
    np.testing.assert_allclose(balance.sequence_balance_loss(flat, spread, jnp.ones((1, 4), jnp.int32)), 1.0)
    assert float(balance.sequence_balance_loss(flat, spread, jnp.zeros((1, 4), jnp.int32))) == 0.0  # padding only


# ---------------------------------------------------------------------------------------------
# The routers' records, the loss.


def _logistic_count(fn, *args) -> int:
    """How many sigmoids `fn(*args)` traces."""
    return str(jax.make_jaxpr(fn)(*args)).count("logistic")


def test_routing_is_recorded_alike_in_both_layouts_and_only_under_capture():
    config = MOE.replace(num_hidden_layers=3)  # a dense layer, then a stack of two MoE layers
    tokens, segment_ids = _tokens(config), jnp.asarray(SEGMENTS)
    unrolled, scanned = init_model(config), init_model(config.replace(scan_layers=True))
    loss, metrics = compute_loss(unrolled, tokens, segment_ids, balance_alpha=0.1)
    scan_loss, scan_metrics = compute_loss(scanned, tokens, segment_ids, balance_alpha=0.1)
    loads, scan_loads = metrics["expert_load"], scan_metrics["expert_load"]
    assert set(loads) == {"layers/1/mlp/gate", "layers/2/mlp/gate", "mtp/0/mlp/gate"}
    assert set(scan_loads) == {"layer_groups/1/layer/mlp/gate", "mtp/0/mlp/gate"}
    main = np.stack([loads["layers/1/mlp/gate"], loads["layers/2/mlp/gate"]])
    np.testing.assert_array_equal(scan_loads["layer_groups/1/layer/mlp/gate"], main)  # [2, R] from the scan
    np.testing.assert_array_equal(scan_loads["mtp/0/mlp/gate"], loads["mtp/0/mlp/gate"])
    assert (main.sum(-1) == 2 * (SEGMENTS != 0).sum()).all()  # k choices of every non-padding token
    np.testing.assert_allclose(scan_metrics["balance_loss"], metrics["balance_loss"], rtol=1e-6)
    ratio = max(float(v.max() / v.mean()) for v in (*main, loads["mtp/0/mlp/gate"]))
    np.testing.assert_allclose(metrics["expert_load_max_over_mean"], ratio, rtol=1e-6)
    np.testing.assert_allclose(scan_loss, loss, rtol=1e-6)
    # Outside a capture nothing is recorded, nothing is left on the model, and the forward computes no scores
    # beyond its routing's: a capture adds one sigmoid per MoE layer (the recorded scores), a plain call none.
    plain, _ = compute_loss(unrolled, tokens, segment_ids)
    np.testing.assert_allclose(plain + 0.1 * metrics["balance_loss"], loss, rtol=1e-6)
    assert not jax.tree.leaves(nnx.state(unrolled, RoutingStats))
    assert not jax.tree.leaves(nnx.state(scanned, RoutingStats))
    for model in (unrolled, scanned):
        forward = type(model).forward_full
        extra = _logistic_count(balance.capture_routing(forward), model, tokens) - _logistic_count(
            forward, model, tokens
        )
        assert extra == (2 if model is unrolled else 1)  # layers 1 and 2, or their stack's one scan body


def test_the_balance_loss_adds_alpha_times_its_mean_and_trains_the_routers():
    model, tokens, segment_ids = init_model(MOE), _tokens(MOE), jnp.asarray(SEGMENTS)
    alpha = 0.5
    base, metrics = compute_loss(model, tokens, segment_ids, routing_metrics=True)
    loss, with_alpha = compute_loss(model, tokens, segment_ids, balance_alpha=alpha)
    np.testing.assert_allclose(loss, base + alpha * with_alpha["balance_loss"], rtol=1e-6)
    assert float(with_alpha["loss"]) == float(loss) and float(metrics["loss"]) == float(base)
    assert "balance_loss" not in metrics  # the loads alone: the [N, R] scores are not needed
    # The mean over the MoE layers (main layer 1, the MTP module's) of each one's `sequence_balance_loss`;
    # with mtp_only over the MTP module's alone.
    (_, _), routing = balance.capture_routing(lambda m: compute_loss(m, tokens, segment_ids))(model)
    records = dict(balance.routing_records(routing))
    assert set(records) == {"layers/1/mlp/gate", "mtp/0/mlp/gate"}
    per_layer = {
        name: float(balance.sequence_balance_loss(r.scores, r.indices, segment_ids)) for name, r in records.items()
    }
    np.testing.assert_allclose(with_alpha["balance_loss"], np.mean(list(per_layer.values())), rtol=1e-6)
    _, mtp_only = compute_loss(model, tokens, segment_ids, balance_alpha=alpha, mtp_only=True)
    np.testing.assert_allclose(mtp_only["balance_loss"], per_layer["mtp/0/mlp/gate"], rtol=1e-6)
    # Its gradient reaches the routers' weights, never their biases (the choice has no gradient: f is counts).
    graphdef, state = nnx.split(model)

    def balance_of(state):
        return compute_loss(nnx.merge(graphdef, state), tokens, segment_ids, balance_alpha=1.0)[1]["balance_loss"]

    grads = jax.grad(balance_of)(state)
    for gate in (grads["layers"][1]["mlp"]["gate"], grads["mtp"][0]["mlp"]["gate"]):
        assert float(jnp.abs(gate["weight"].get_value()).max()) > 0
        assert float(jnp.abs(gate["e_score_correction_bias"].get_value()).max()) == 0


# ---------------------------------------------------------------------------------------------
# Inside the train step.


def test_off_training_is_bit_identical_to_the_step_without_balancing():
    """bias_update_speed = balance_alpha = 0: the metrics and the state after a step are those of the step as
    it was before load balancing (below, verbatim: the plain objective, no routing recorded, no bias in the
    state), bit for bit; the biases stay where they were. The loads are logged all the same."""
    config = train.TrainConfig(batch_size=2, seq_len=16, num_steps=2, warmup_steps=0, learning_rate=1e-2)
    model, tokens, segment_ids = init_model(MOE), _tokens(MOE), jnp.asarray(SEGMENTS)
    graphdef, state, frozen = _fresh_state(model, config)
    assert state.bias is None
    optimizer = train.StaticOptimizer(config)

    @jax.jit
    def before(state, frozen, tokens, segment_ids):
        def loss_fn(params):
            model = nnx.merge(graphdef, params, frozen)
            depths = config.depth_weights(model.config.num_nextn_predict_layers)
            return compute_loss(
                model, tokens, segment_ids, mtp_lambda=config.mtp_lambda, mtp_weights=depths, mtp_targets="data"
            )

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        updates, opt_state = optimizer.tx.update(grads, state.opt_state, state.params)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        params = optax.apply_updates(state.params, updates)
        state = train.TrainState(step=state.step + 1, params=params, opt_state=opt_state)
        return constrain_tree(state, train.train_state_logical_axes(state)), metrics

    old_state, old_metrics = before(state, frozen, tokens, segment_ids)
    state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=config)
    assert {k: float(v) for k, v in old_metrics.items()} == {k: float(metrics[k]) for k in old_metrics}
    for ours, theirs in zip(jax.tree.leaves(state), jax.tree.leaves(old_state), strict=True):
        np.testing.assert_array_equal(ours, theirs)
    assert all((b == 0).all() for b in _biases(train.merge_model(graphdef, state, frozen)).values())
    assert set(metrics["expert_load"]) == {"layers/1/mlp/gate", "mtp/0/mlp/gate"} and "balance_loss" not in metrics


def _skewed_model(config: ModelConfig):
    """A model whose first MoE layer sends most tokens to the same few experts: every token's embedding gets
    a first coordinate of 1 (after RMSNorm about +8 in every token's router input), which the router weighs
    +0.12 for experts 0 and 1 and -0.12 for the others; the rest of its weight is wide (std 0.8), so tokens
    differ (a bias can split them), and with it two experts take nearly all the tokens."""
    model = init_model(config, seed=0)
    embedding = model.embed_tokens.embedding
    embedding[...] = embedding[...].at[:, 0].set(1.0)
    gate = model.layers[1].mlp.gate
    skew = jnp.where(jnp.arange(config.n_routed_experts) < 2, 0.12, -0.12)
    gate.weight[...] = (0.8 * jax.random.normal(jax.random.key(0), gate.weight.shape)).at[:, 0].set(skew)
    return model


def test_the_bias_update_balances_a_skewed_router():
    """gamma = 0.01 on a fixed batch of 256 tokens, lr 1e-9 (the weights stay put: the bias alone acts). Layer 1
    starts with max load / mean load >= 3.5 (8 experts, k = 2: 4 is everything on two experts); within 40 steps
    it is <= 1.5, and it stays <= 1.5 for the next 10 (the sign update keeps it within a step of balance)."""
    config = MOE.replace(vocab_size=256)
    train_config = train.TrainConfig(
        batch_size=4, seq_len=64, num_steps=50, warmup_steps=0, learning_rate=1e-9, bias_update_speed=0.01
    )
    graphdef, state, frozen = _fresh_state(_skewed_model(config), train_config)
    tokens = _tokens(config, (4, 64))
    segment_ids = jnp.ones((4, 64), jnp.int32)
    loads = []
    for _ in range(50):
        state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=train_config)
        loads.append(np.asarray(metrics["expert_load"]["layers/1/mlp/gate"]))  # the loads before this update
    ratios = [load.max() / load.mean() for load in loads]
    assert ratios[0] >= 3.5, ratios
    assert max(ratios[40:]) <= 1.5, ratios
    bias = np.asarray(state.bias["layers"][1]["mlp"]["gate"]["e_score_correction_bias"].get_value())
    busiest, idle = np.argmax(loads[0]), loads[0] == 0
    assert idle.any() and bias[busiest] < 0 and (bias[idle] > 0).all()  # the busiest pushed down, the idle up
    steps = np.round(bias / 0.01)
    np.testing.assert_allclose(bias, steps * 0.01, atol=1e-5)  # whole steps of gamma (float32 sums)


# ---------------------------------------------------------------------------------------------
# Through the trainer: checkpoints, resume, export; the CLI.


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(
        tmp_path_factory.mktemp("corpus"), documents=tiny_documents(), vocab_size=300, heldout_fraction=0.2
    )


def test_the_updated_bias_is_checkpointed_resumed_and_exported(tmp_path, corpus):
    model_config = MOE.replace(vocab_size=300, eos_token_id=corpus.eos_id)
    config = train.TrainConfig(
        batch_size=2,
        seq_len=32,
        num_steps=4,
        warmup_steps=1,
        learning_rate=1e-2,
        checkpoint_every=100,
        log_every=1,
        eval_batches=1,
        bias_update_speed=0.01,
    )
    straight = train.train(
        tmp_path / "straight", corpus, model_config=model_config, train_config=config, progress=False
    )
    first = train.train(
        tmp_path / "resumed", corpus, model_config=model_config, train_config=config, stop_at_step=2, progress=False
    )
    at_2 = _biases(first.model)
    assert set(at_2) == {
        ("layers", 1, "mlp", "gate", "e_score_correction_bias"),
        ("mtp", 0, "mlp", "gate", "e_score_correction_bias"),
    }
    assert all(np.abs(b).max() > 0 and np.abs(b).max() <= 0.02 + 1e-7 for b in at_2.values())
    saved, _ = train.load_run(tmp_path / "resumed", step=2)
    for path, b in _biases(saved).items():
        np.testing.assert_array_equal(b, at_2[path])  # the checkpoint holds the updated bias
    resumed = train.train(tmp_path / "resumed", corpus, resume=True, progress=False, export=False)
    final = _biases(straight.model)
    assert any(not np.array_equal(final[path], at_2[path]) for path in final)  # steps 3 and 4 moved it on
    for path, b in _biases(resumed.model).items():
        np.testing.assert_array_equal(b, final[path])  # 2 + 2 steps = 4 steps
    exported = checkpoint.load_hf_checkpoint(tmp_path / "straight" / "export")
    for path, b in _biases(exported).items():
        np.testing.assert_array_equal(b, final[path])
    # The loads: logged as one number per step, the vectors in the result.
    assert set(straight.expert_load) == {"layers/1/mlp/gate", "mtp/0/mlp/gate"}
    assert all(v.shape == (8,) for v in straight.expert_load.values())
    log = [json.loads(line) for line in (tmp_path / "straight" / "log.jsonl").read_text().splitlines()]
    ratios = [r["expert_load_max_over_mean"] for r in log if r["kind"] == "train"]
    assert len(ratios) == 4 and all(1 <= r <= 4 for r in ratios)


def test_the_cli_flags_reach_train_config():
    parser = cli.build_parser()
    args = parser.parse_args(["train", "runs/x", "--bias-update-speed", "0.001", "--balance-alpha", "0.0001"])
    config = train_cli._train_config_from_args(args)
    assert config == train.TrainConfig(bias_update_speed=0.001, balance_alpha=0.0001)
    assert train.StaticOptimizer(config) != train.StaticOptimizer(train.TrainConfig())  # the jitted step reads them
    for flag in ("--bias-update-speed", "--balance-alpha"):
        with pytest.raises(SystemExit):
            parser.parse_args(["train", "runs/x", flag, "-1"])
    for name in ("bias_update_speed", "balance_alpha"):
        for bad in (-1e-3, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=name):
                train.TrainConfig(**{name: bad})


def test_balancing_a_model_without_moe_layers_is_refused(corpus):
    dense = MOE.replace(ffn_type="dense", vocab_size=300)
    with pytest.raises(ValueError, match="bias_update_speed and balance_alpha balance MoE"):
        check_compatible(dense, train.TrainConfig(bias_update_speed=0.001, balance_alpha=1e-4), corpus)
    softmax = MOE.replace(scoring_func="softmax", vocab_size=300)
    with pytest.raises(ValueError, match="softmax"):
        check_compatible(softmax, train.TrainConfig(bias_update_speed=0.001), corpus)
    check_compatible(softmax, train.TrainConfig(balance_alpha=1e-4), corpus)  # the loss needs no bias
