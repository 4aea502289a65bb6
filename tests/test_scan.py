"""Scanned layer groups (`ModelConfig.scan_layers`) against the unrolled layers, on the same weights.

Llama-, DeepSeek-V3- (MLA + MoE, first_k_dense_replace = 1) and GLM-4.5-shaped configs (the small
ones of tests/test_architectures.py): a seed gives the same weights in both layouts; logits and
hidden states agree (fp32, 1e-5); cached decode with NaN in every stale slot of the stacked caches
agrees too; greedy and eagle-speculative generations are identical; a Hugging Face checkpoint saved
from either layout is the same files and loads into the other with identical logits; one training
step updates both layouts alike (the stacked norms are not weight-decayed, the MoE score-correction
bias is not trained).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from speculative_helpers import TINY_MOE

from mtp_jax import checkpoints as checkpoint
from mtp_jax.cache import StackedCache, capacity, fill_stale
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers.moe import ScoreCorrectionBias
from mtp_jax.model import init_model, sequence_positions
from mtp_jax.training import trainer as train

_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    initializer_range=0.2,
)
CONFIGS = {
    "llama": ModelConfig(**_COMMON, num_key_value_heads=2),
    "deepseek_v3": ModelConfig(
        **_COMMON,
        **TINY_MOE,
        num_key_value_heads=4,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "glm4_moe": ModelConfig(
        **_COMMON,
        **TINY_MOE,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
}
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2]]  # mixed lengths, one prompt bucket
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the scan body and the unrolled layers round alike but fuse differently


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    """(unrolled, scanned) models with the same weights, a nonzero score-correction bias included: the scanned
    one loaded from the unrolled one's Hugging Face checkpoint."""
    unrolled = init_model(CONFIGS[request.param], seed=1)
    for path, var in nnx.iter_graph(unrolled):  # a nonzero bias must change selections alike
        if isinstance(var, ScoreCorrectionBias):
            var.set_value(
                jnp.asarray(np.random.default_rng(len(path)).normal(0, 0.1, var.get_value().shape), jnp.float32)
            )
    path = tmp_path_factory.mktemp(request.param) / "unrolled"
    checkpoint.save_hf_checkpoint(unrolled, path)
    return unrolled, checkpoint.load_hf_checkpoint(path, scan_layers=True)


@nnx.jit
def _forward(model, tokens, start, cache):
    return model(tokens, sequence_positions(*tokens.shape, start), cache)


def test_a_seed_gives_the_same_weights_in_both_layouts_and_stacked_groups():
    for config in CONFIGS.values():
        unrolled, scanned = init_model(config, seed=3), init_model(config.replace(scan_layers=True), seed=3)
        a, b = checkpoint.hf_tensors(unrolled), checkpoint.hf_tensors(scanned)
        assert list(a) == list(b)  # the same tensors in the same order: the files shard alike
        assert all(np.array_equal(a[name], b[name]) for name in a)
        assert [(g.start, g.num_layers) for g in scanned.layer_groups] == [
            (r.start, len(r)) for r in config.layer_groups
        ]
        assert not hasattr(scanned, "layers") and not hasattr(unrolled, "layer_groups")
    assert [len(r) for r in CONFIGS["deepseek_v3"].layer_groups] == [1, 2]  # dense, then MoE
    assert [len(r) for r in CONFIGS["llama"].layer_groups] == [3]
    experts = init_model(CONFIGS["deepseek_v3"].replace(scan_layers=True)).layer_groups[1].layer.mlp.experts
    assert experts.gate_up_proj.get_value().shape == (2, 8, 32, 32)  # [n, R, E, 2I]


def test_logits_hidden_and_stale_nan_decode_agree(pair):
    """A prefill, then two decode steps (MLA's absorbed form) with every cache slot past a row's length NaN,
    stacked caches included: logits, hidden states and the live cache entries agree."""
    seqs = jnp.asarray(np.random.default_rng(0).integers(0, 64, (3, 16)), jnp.int32)
    caches = [m.init_cache(3, 24) for m in pair]
    assert all(isinstance(c, StackedCache) for c in caches[1]) and capacity(caches[1]) == capacity(caches[0]) == 24
    outs = [_forward(m, seqs[:, :6], 0, c) for m, c in zip(pair, caches, strict=True)]
    for want, got in zip(outs[0][:2], outs[1][:2], strict=True):
        np.testing.assert_allclose(got, want, **TOL)
    caches = [out[2] for out in outs]
    lengths = np.array([3, 6, 1])
    for _ in range(2):
        chunk = jnp.asarray(seqs[np.arange(3), lengths][:, None])  # [B, 1]
        caches = [fill_stale(c, jnp.asarray(lengths), jnp.nan) for c in caches]
        (la, ha, ca), (lb, hb, cb) = (
            _forward(m, chunk, jnp.asarray(lengths), c) for m, c in zip(pair, caches, strict=True)
        )
        assert np.isfinite(np.asarray(la)).all() and np.isfinite(np.asarray(lb)).all()
        np.testing.assert_allclose(lb, la, **TOL)
        np.testing.assert_allclose(hb, ha, **TOL)
        lengths = lengths + 1
        live = [jax.tree.map(np.asarray, fill_stale(c, jnp.asarray(lengths), 0.0)) for c in (ca, cb)]
        per_layer = [
            jax.tree.map(lambda x, i=i: x[i], group.layers)
            for group in live[1]
            for i in range(jax.tree.leaves(group)[0].shape[0])
        ]  # the stacks' caches, layer by layer
        jax.tree.map(lambda want, got: np.testing.assert_allclose(got, want, **TOL), list(live[0]), per_layer)
        caches = [ca, cb]


# Llama greedy and eagle, DeepSeek-V3 eagle: the other combinations' decode steps are the forwards above, and
# each generation costs a compile.
@pytest.mark.parametrize(
    "pair, method", [("llama", "greedy"), ("llama", "eagle"), ("deepseek_v3", "eagle")], indirect=["pair"]
)
def test_greedy_and_speculative_generations_are_identical(pair, method):
    """Generations of the two layouts are identical, plain and speculative."""
    speculative = SpeculativeConfig(method="eagle", num_speculative_tokens=3) if method == "eagle" else None
    want, got = (
        generate(m, PROMPTS, speculative=speculative, max_new_tokens=[8, 5, 10], max_length=32, stop_tokens=[])
        for m in pair
    )
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.concatenate(got.logprobs), np.concatenate(want.logprobs), atol=1e-5)


def test_checkpoints_are_the_same_files_and_load_into_either_layout(pair, tmp_path):
    unrolled, scanned = pair
    checkpoint.save_hf_checkpoint(scanned, tmp_path / "scanned")
    checkpoint.save_hf_checkpoint(unrolled, tmp_path / "unrolled")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "scanned" / name).read_bytes() == (tmp_path / "unrolled" / name).read_bytes()
    tokens = jnp.asarray([[5, 9, 2, 6, 5, 3, 5, 8]], jnp.int32)
    forward = nnx.jit(lambda m, t: m.forward_full(t)[0])
    from_scanned = checkpoint.load_hf_checkpoint(tmp_path / "scanned", scan_layers=False)
    from_unrolled = checkpoint.load_hf_checkpoint(tmp_path / "unrolled", scan_layers=True)
    assert not from_scanned.config.scan_layers and from_unrolled.config.scan_layers
    np.testing.assert_array_equal(forward(from_scanned, tokens), forward(unrolled, tokens))
    np.testing.assert_array_equal(forward(from_unrolled, tokens), forward(scanned, tokens))
    # Sharded: stacked leaves split per layer across shards, and back.
    checkpoint.save_hf_checkpoint(scanned, tmp_path / "sharded", max_shard_size_bytes=20_000)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 2
    again = checkpoint.load_hf_checkpoint(tmp_path / "sharded", scan_layers=True)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(checkpoint.hf_tensors(again).values(), checkpoint.hf_tensors(scanned).values(), strict=True)
    )


def test_a_train_step_updates_both_layouts_alike():
    """Same weights, same batch: one AdamW step (weight decay on) leaves the same weights in both layouts, so the
    stacked norms are not decayed, and the score-correction bias is frozen, not trained. GLM-shaped (a dense
    group, a MoE group); no MTP module (not scanned)."""
    config = train.TrainConfig(
        batch_size=2, seq_len=16, num_steps=2, warmup_steps=0, learning_rate=1e-2, weight_decay=0.5
    )
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 16)), jnp.int32)
    segment_ids = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16], jnp.int32)
    models = [
        init_model(CONFIGS["glm4_moe"].replace(num_nextn_predict_layers=0, scan_layers=scan), seed=2)
        for scan in (False, True)
    ]
    before = checkpoint.hf_tensors(models[0])  # the step donates the parameters
    stepped = []
    for model in models:
        graphdef, params, frozen = train.split_model(model, config)
        state = train.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=train.make_optimizer(config).init(params)
        )
        state, metrics = train.train_step(state, frozen, tokens, segment_ids, graphdef=graphdef, config=config)
        assert np.isfinite(float(metrics["loss"]))
        stepped.append(checkpoint.hf_tensors(nnx.merge(graphdef, state.params, frozen)))
    for tensor, want in stepped[0].items():
        np.testing.assert_allclose(stepped[1][tensor], want, rtol=1e-4, atol=1e-6, err_msg=tensor)
        assert np.array_equal(want, before[tensor]) == tensor.endswith("e_score_correction_bias"), tensor
