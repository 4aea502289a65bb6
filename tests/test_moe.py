"""DeepSeek-V3 MoE (`mtp_jax.layers.moe`): parity with transformers' `DeepseekV3MoE` and `Glm4MoeMoE`, the
ragged_dot path against a dense oracle, routing by hand, gradients.

float32 on CPU. Random weights are drawn wide (std 0.2, bias std 0.1) so the bias and the group limit really
change which experts are chosen (asserted), and the tokens used are kept only when routing has no near-ties:
the gaps between the topk_group-th and next group score and between the k-th and next eligible biased
score exceed 1e-3 (asserted), far above float32 rounding, so both sides choose the same experts.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.layers.moe import MoE, ScoreCorrectionBias, route

torch = pytest.importorskip("torch", reason="the transformers oracle needs the [parity] extra")
transformers = pytest.importorskip("transformers", reason="the transformers oracle needs the [parity] extra")
torch.set_num_threads(1)

RTOL = 1e-5  # max |ours - theirs| / max |theirs|
GAP = 1e-3  # minimum routing margin of the tokens used
MOE = dict(
    hidden_size=32,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def _config(**overrides) -> ModelConfig:
    return ModelConfig(
        vocab_size=128,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **{"ffn_type": "moe", **MOE, **overrides},
    )


def _hf_moe(family: str, seed: int = 0, **overrides):
    """A random float32 `DeepseekV3MoE` / `Glm4MoeMoE` with every weight and the bias drawn."""
    kwargs = dict(intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, **{**MOE, **overrides})
    if family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls

        config = transformers.DeepseekV3Config(**kwargs)
    else:
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE as cls

        config = transformers.Glm4MoeConfig(**kwargs)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    moe = cls(config)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0.0, 0.2)
        moe.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return moe.eval()


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gate, up [E, I] -> our fused [E, 2I]: column 2i is gate column i, column 2i + 1 up column i."""
    fused = np.empty((gate.shape[0], 2 * gate.shape[1]), gate.dtype)
    fused[:, 0::2], fused[:, 1::2] = gate, up
    return fused


def _load_from_hf(moe: MoE, hf) -> None:
    """Copy HF weights into ours, going through the checkpoint's per-expert layout.

    transformers 5 stacks `mlp.experts.{r}.gate_proj.weight` / `up_proj.weight` [I, E] into `gate_up_proj`
    [R, 2I, E] (gate first) and `down_proj.weight` [E, I] into `down_proj` [R, E, I]; we unstack them back
    into the checkpoint's tensors, then interleave, stack and transpose as `mtp_jax.layers.moe` documents.
    """
    sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    i = moe.experts.config.moe_intermediate_size
    gate_up, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
    ckpt_gate = [gate_up[r, :i] for r in range(len(gate_up))]  # each [I, E]
    ckpt_up = [gate_up[r, i:] for r in range(len(gate_up))]  # each [I, E]
    ckpt_down = list(down)  # each [E, I]
    moe.gate.weight.set_value(jnp.asarray(sd["gate.weight"]))  # [R, E]
    moe.gate.e_score_correction_bias.set_value(jnp.asarray(sd["gate.e_score_correction_bias"]))  # [R]
    ours_gate_up = [_interleave(g.T, u.T) for g, u in zip(ckpt_gate, ckpt_up, strict=True)]  # [E, 2I]
    moe.experts.gate_up_proj.set_value(jnp.asarray(np.stack(ours_gate_up)))  # [R, E, 2I]
    moe.experts.down_proj.set_value(jnp.asarray(np.stack(ckpt_down).transpose(0, 2, 1)))  # [R, I, E]
    shared = {name: sd[f"shared_experts.{name}.weight"].T for name in ("gate_proj", "up_proj", "down_proj")}
    moe.shared_experts.gate_up_proj.kernel.set_value(
        jnp.asarray(_interleave(shared["gate_proj"], shared["up_proj"]))
    )  # [E, 2I]
    moe.shared_experts.down_proj.kernel.set_value(jnp.asarray(shared["down_proj"]))  # [I, E]


def _margins(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Per token, the smaller of the group-choice and expert-choice margins, in float64. x [N, E] -> [N]."""
    scores = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ weight.T.astype(np.float64))))  # [N, R]
    choice = scores + bias  # [N, R]
    n, r = choice.shape
    margin = np.full(n, np.inf)
    if config.n_group > 1:
        grouped = np.sort(choice.reshape(n, config.n_group, -1), axis=-1)  # [N, P, Q] ascending
        group_scores = np.sort(grouped[..., -2:].sum(-1), axis=-1)[:, ::-1]  # [N, P] descending
        if config.topk_group < config.n_group:
            margin = group_scores[:, config.topk_group - 1] - group_scores[:, config.topk_group]
        keep = np.argsort(-grouped[..., -2:].sum(-1), axis=-1, kind="stable")[:, : config.topk_group]  # [N, topk_group]
        mask = np.zeros((n, config.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        choice = np.where(np.repeat(mask, r // config.n_group, axis=-1), choice, -np.inf)  # [N, R]
    ranked = np.sort(choice, axis=-1)[:, ::-1]  # [N, R] descending
    k = config.num_experts_per_tok
    return np.minimum(margin, ranked[:, k - 1] - ranked[:, k])


def _tie_free_tokens(hf, config: ModelConfig, shape=(2, 8), seed: int = 0) -> np.ndarray:
    """Tokens [B, T, E] ~ N(0, 1) whose routing margins all exceed GAP (drawn from a larger pool)."""
    weight = hf.gate.weight.detach().numpy()
    bias = hf.gate.e_score_correction_bias.detach().numpy()
    pool = np.random.RandomState(seed).randn(8 * shape[0] * shape[1], config.hidden_size).astype(np.float32)
    kept = pool[_margins(pool, weight, bias, config) > GAP][: shape[0] * shape[1]]
    assert len(kept) == shape[0] * shape[1]
    assert _margins(kept, weight, bias, config).min() > GAP
    return kept.reshape(*shape, config.hidden_size)


def _route_with(moe: MoE, x: np.ndarray, **overrides) -> np.ndarray:
    c = moe.experts.config
    tokens = jnp.asarray(x.reshape(-1, c.hidden_size))
    logits = tokens @ moe.gate.weight[...].T  # [N, R]
    kwargs = dict(
        bias=moe.gate.e_score_correction_bias[...],
        top_k=c.num_experts_per_tok,
        n_group=c.n_group,
        topk_group=c.topk_group,
    )
    return np.sort(np.asarray(route(logits, **{**kwargs, **overrides})[0]), axis=-1)  # [N, k]


def _rel_err(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize("family,groups", [("deepseek_v3", (4, 2)), ("glm4_moe", (4, 2)), ("glm4_moe", (1, 1))])
def test_matches_transformers(family, groups):
    n_group, topk_group = groups
    config = _config(n_group=n_group, topk_group=topk_group)
    hf = _hf_moe(family, n_group=n_group, topk_group=topk_group)
    moe = MoE(config, nnx.Rngs(0))
    _load_from_hf(moe, hf)
    x = _tie_free_tokens(hf, config)
    # The draws matter: the bias changes some choices, and (with groups) so does the group limit.
    chosen = _route_with(moe, x)
    assert (chosen != _route_with(moe, x, bias=jnp.zeros(8))).any(axis=-1).sum() >= 2
    if n_group > 1:
        assert (chosen != _route_with(moe, x, n_group=1, topk_group=1)).any(axis=-1).sum() >= 2
    with torch.no_grad():
        theirs = hf(torch.from_numpy(x)).numpy()
        _, _, hf_indices = hf.gate(torch.from_numpy(x))
    np.testing.assert_array_equal(chosen, np.sort(hf_indices.numpy(), axis=-1))
    err = _rel_err(jax.jit(moe.__call__)(jnp.asarray(x)), theirs)
    assert err <= RTOL, err


def moe_reference(moe: MoE, x: jax.Array) -> jax.Array:
    """Dense oracle: every expert on every token, weighted by the routing weights scattered to [N, R]."""
    b, t, e = x.shape
    tokens = x.reshape(b * t, e)  # [N, E]
    indices, weights = moe.gate(tokens)  # [N, k]
    dense = (jax.nn.one_hot(indices, moe.experts.config.n_routed_experts) * weights[..., None]).sum(1)  # [N, R]
    gate_up = jnp.einsum("ne,rei->nri", tokens, moe.experts.gate_up_proj[...])  # [N, R, 2I], interleaved
    gate, up = gate_up[..., 0::2], gate_up[..., 1::2]  # [N, R, I] each
    y = jnp.einsum("nri,rie->nre", jax.nn.silu(gate) * up, moe.experts.down_proj[...])  # [N, R, E]
    out = jnp.einsum("nre,nr->ne", y, dense).reshape(b, t, e)  # [B, T, E]
    return out + moe.shared_experts(x)


def _random_moe(seed: int = 0, **overrides) -> MoE:
    moe = MoE(_config(initializer_range=0.2, **overrides), nnx.Rngs(seed))
    moe.gate.e_score_correction_bias.set_value(0.1 * jax.random.normal(jax.random.key(seed + 1), (8,)))
    return moe


@pytest.mark.parametrize("shape", [(1, 1), (1, 3), (4, 16)])
def test_ragged_dot_matches_dense_oracle(shape):
    moe = _random_moe()
    x = jax.random.normal(jax.random.key(2), (*shape, 32))
    if shape[0] * shape[1] < 4:  # few tokens: some experts get no tokens (empty ragged groups)
        indices, _ = moe.gate(x.reshape(-1, 32))
        assert (jnp.bincount(indices.reshape(-1), length=8) == 0).any()
    ours = jax.jit(moe.__call__)(x)
    assert ours.shape == x.shape and ours.dtype == jnp.float32
    err = _rel_err(ours, np.asarray(jax.jit(lambda x: moe_reference(moe, x))(x)))
    assert err <= 1e-6, err


def _logit(p):
    return jnp.log(p) - jnp.log1p(-p)


# Scores of 8 experts in 4 groups of 2; group scores 0.95, 1.15, 1.02, 0.2 -> groups 1 and 2 are kept.
HAND_SCORES = jnp.array([[0.9, 0.05, 0.6, 0.55, 0.5, 0.52, 0.1, 0.1]])


def _hand_route(bias=None, **overrides):
    kwargs = dict(top_k=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    bias = jnp.zeros(8) if bias is None else bias
    indices, weights = route(_logit(HAND_SCORES), bias, **{**kwargs, **overrides})
    assert indices.dtype == jnp.int32 and weights.dtype == jnp.float32
    return indices[0].tolist(), np.asarray(weights[0])


def test_route_by_hand():
    # No group limit: the two best scores overall (experts 0 and 2).
    indices, weights = _hand_route(n_group=1, topk_group=1)
    assert indices == [0, 2]
    np.testing.assert_allclose(weights, 2.5 * np.array([0.9, 0.6]) / 1.5, rtol=1e-6)
    # Group limit: expert 0's group (0.95) loses to groups 1 (1.15) and 2 (1.02) -> experts 2 and 3.
    indices, weights = _hand_route()
    assert indices == [2, 3]
    np.testing.assert_allclose(weights, 2.5 * np.array([0.6, 0.55]) / 1.15, rtol=1e-6)
    # Without normalisation the weights are the raw scores times the scaling factor.
    indices, weights = _hand_route(norm_topk_prob=False)
    assert indices == [2, 3]
    np.testing.assert_allclose(weights, 2.5 * np.array([0.6, 0.55]), rtol=1e-6)
    # A bias of +0.1 on expert 5 (0.52 -> 0.62 biased) chooses it over expert 3 (groups unchanged,
    # 1.12 < 1.15); its weight is still its unbiased score 0.52.
    indices, weights = _hand_route(bias=jnp.zeros(8).at[5].set(0.1))
    assert indices == [5, 2]
    np.testing.assert_allclose(weights, 2.5 * np.array([0.52, 0.6]) / 1.12, rtol=1e-6)
    # A bias of +0.3 on expert 1 lifts group 0 (0.95 -> 1.25) into the kept groups: experts 0 and 2.
    indices, weights = _hand_route(bias=jnp.zeros(8).at[1].set(0.3))
    assert indices == [0, 2]
    np.testing.assert_allclose(weights, 2.5 * np.array([0.9, 0.6]) / 1.5, rtol=1e-6)


def test_route_softmax():
    logits = jnp.log(jnp.array([[0.4, 0.1, 0.3, 0.2]]))  # softmax scores 0.4, 0.1, 0.3, 0.2
    indices, weights = route(logits, jnp.zeros(4), top_k=2, norm_topk_prob=False, scoring_func="softmax")
    assert indices[0].tolist() == [0, 2]
    np.testing.assert_allclose(weights[0], [0.4, 0.3], rtol=1e-6)


def test_gradient_matches_dense_oracle():
    moe = _random_moe()
    x = jax.random.normal(jax.random.key(3), (2, 8, 32))

    def loss(model, x, fn):
        return jnp.sum(jnp.sin(fn(model, x)))  # a non-linear readout so every weight's gradient differs

    grad_ragged = nnx.jit(nnx.grad(loss, argnums=(0, 1)), static_argnums=2)(moe, x, MoE.__call__)
    grad_dense = nnx.jit(nnx.grad(loss, argnums=(0, 1)), static_argnums=2)(moe, x, moe_reference)
    flat_ragged = dict(nnx.to_flat_state(nnx.state(grad_ragged[0])))
    flat_dense = dict(nnx.to_flat_state(nnx.state(grad_dense[0])))
    for path, g in flat_ragged.items():
        g, dense = np.asarray(g[...]), np.asarray(flat_dense[path][...])
        assert np.isfinite(g).all(), path
        # float32 summation-order noise scales with the gradient's size (entries up to ~20 here): atol relative to it
        np.testing.assert_allclose(g, dense, rtol=1e-5, atol=1e-6 * max(1.0, np.abs(dense).max()), err_msg=str(path))
    np.testing.assert_allclose(grad_ragged[1], grad_dense[1], rtol=1e-5, atol=1e-6)
    # The router learns through the weights; the bias, used for the choice only, gets no gradient.
    assert np.abs(flat_ragged[("gate", "weight")][...]).min() > 0
    assert not np.asarray(flat_ragged[("gate", "e_score_correction_bias")][...]).any()
    assert np.abs(flat_ragged[("experts", "down_proj")][...]).sum() > 0


def test_params_and_shapes():
    moe = MoE(_config(), nnx.Rngs(0))
    shapes = {"/".join(map(str, p)): v[...].shape for p, v in nnx.to_flat_state(nnx.state(moe, nnx.Param))}
    assert shapes == {
        "gate/weight": (8, 32),
        "gate/e_score_correction_bias": (8,),
        "experts/gate_up_proj": (8, 32, 32),
        "experts/down_proj": (8, 16, 32),
        "shared_experts/gate_up_proj/kernel": (32, 32),
        "shared_experts/down_proj/kernel": (16, 32),
    }
    assert isinstance(moe.gate.e_score_correction_bias, ScoreCorrectionBias)
    assert moe.gate.weight[...].dtype == jnp.float32
    trained = nnx.state(moe, nnx.All(nnx.Param, nnx.Not(ScoreCorrectionBias)))
    assert ("gate", "e_score_correction_bias") not in dict(nnx.to_flat_state(trained))
    out = jax.eval_shape(lambda x: moe(x), jax.ShapeDtypeStruct((3, 5, 32), jnp.float32))
    assert out.shape == (3, 5, 32)
    assert MoE(_config(n_shared_experts=0), nnx.Rngs(0)).shared_experts is None
    with pytest.raises(ValueError, match="ffn_type"):
        MoE(_config(ffn_type="dense"), nnx.Rngs(0))
