"""Hugging Face checkpoint files: exact round trips, sharding, strict key accounting, config mapping."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from mtp_jax.checkpoints import (
    CheckpointError,
    config_from_hf,
    config_to_hf,
    hf_name,
    hf_tensors,
    load_hf_checkpoint,
    save_hf_checkpoint,
    stored_dtype,
)
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.model import Transformer

TINY = ModelConfig.from_name("tiny")


def _random_model(config: ModelConfig, seed: int = 0) -> Transformer:
    """A model with N(0, 1) weights drawn in numpy (no eager init compiles), in config.param_dtype."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.RandomState(seed)
    flat = [
        (path, v.replace(jnp.asarray(rng.standard_normal(v.get_value().shape), v.get_value().dtype)))
        for path, v in nnx.to_flat_state(params)
    ]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _params(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert list(pa) == list(pb)
    for path in pa:
        assert pa[path].dtype == pb[path].dtype, path
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


def _edit_weights(path, edit):
    """Applies `edit` to the tensors dict of path/model.safetensors and writes it back."""
    tensors = dict(load_file(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def saved_tiny(tmp_path):
    model = _random_model(TINY, seed=1)
    save_hf_checkpoint(model, tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2"])
def test_round_trip_is_exact(tmp_path, name):
    model = _random_model(ModelConfig.from_name(name), seed=2)
    save_hf_checkpoint(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="np") as f:
        names = set(f.keys())
        # Torch layout on disk: q_proj [H*D, E] = [64, 64], k_proj [G*D, E] = [32, 64], gate_proj [I, E].
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [32, 64]
        assert f.get_slice("model.layers.1.mlp.gate_proj.weight").get_shape() == [128, 64]
    assert ("lm_head.weight" in names) == (name == "tiny")  # tied: no head tensor
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (name == "tiny-qwen2")
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config == model.config
    _assert_same_params(loaded, model)


def test_sharded_round_trip(tmp_path):
    model = _random_model(TINY, seed=3)
    limit = 40_000  # bytes; the 128 x 64 fp32 embedding (32,768 B) fits, two matrices do not
    save_hf_checkpoint(model, tmp_path, max_shard_size_bytes=limit)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for shard in shards:
        tensors = load_file(tmp_path / shard)
        size = sum(t.nbytes for t in tensors.values())
        assert size <= limit
        assert all(index["weight_map"][n] == shard for n in tensors)
        total += size
    assert index["metadata"]["total_size"] == total == sum(v.nbytes for v in _params(model).values())
    _assert_same_params(load_hf_checkpoint(tmp_path), model)


def test_weights_get_the_mode_of_an_ordinary_new_file(tmp_path):
    """safetensors creates its files 0600; a saved model's weights are as readable as its config.json."""
    import os

    old = os.umask(0o022)
    try:
        save_hf_checkpoint(_random_model(TINY, seed=3), tmp_path / "one")
        save_hf_checkpoint(_random_model(TINY, seed=3), tmp_path / "sharded", max_shard_size_bytes=40_000)
        os.umask(0o027)
        save_hf_checkpoint(_random_model(TINY, seed=3), tmp_path / "group")
    finally:
        os.umask(old)
    modes = {f"{f.parent.name}/{f.name}": f.stat().st_mode & 0o777 for f in tmp_path.glob("*/*.safetensors")}
    assert modes["one/model.safetensors"] == (tmp_path / "one" / "config.json").stat().st_mode & 0o777 == 0o644
    assert {m for name, m in modes.items() if name.startswith("sharded/")} == {0o644}
    assert modes["group/model.safetensors"] == 0o640


def test_bfloat16_weights_and_dtype_override(tmp_path):
    model = _random_model(TINY.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=4)
    save_hf_checkpoint(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "model.safetensors", framework="np") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert stored_dtype(tmp_path) == "bfloat16"
    loaded = load_hf_checkpoint(tmp_path)  # the stored dtype, on every backend: a save after a load keeps it
    assert loaded.config.param_dtype == "bfloat16"
    _assert_same_params(loaded, model)
    upcast = load_hf_checkpoint(tmp_path, dtype="float32")
    assert (upcast.config.dtype, upcast.config.param_dtype) == ("float32", "float32")
    for path, value in _params(upcast).items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, _params(model)[path].astype(np.float32))
    with pytest.raises(ValueError, match="dtype"):
        load_hf_checkpoint(tmp_path, dtype="int8")


def test_missing_tensor_is_named(saved_tiny):
    _, path = saved_tiny
    _edit_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.layers\.1\.mlp\.up_proj\.weight") as info:
        load_hf_checkpoint(path)
    assert info.value.missing == ["model.layers.1.mlp.up_proj.weight"] and not info.value.unexpected


def test_untied_model_without_lm_head_is_missing_it(saved_tiny):
    _, path = saved_tiny
    _edit_weights(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(path)
    assert info.value.missing == ["lm_head.weight"]


def test_unexpected_tensor_is_named(saved_tiny):
    _, path = saved_tiny
    _edit_weights(path, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": np.zeros((4, 4), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected \(1\): model\.layers\.0\.mlp\.extra_proj\.weight") as info:
        load_hf_checkpoint(path)
    assert info.value.unexpected == ["model.layers.0.mlp.extra_proj.weight"] and not info.value.missing


@pytest.mark.parametrize(
    "name,shape",
    [
        ("model.layers.0.self_attn.k_proj.weight", (16, 64)),  # expected [32, 64]
        ("model.layers.1.mlp.gate_proj.weight", (64, 128)),  # stored [in, out]: not transposed to torch layout
        ("model.norm.weight", (65,)),
    ],
)
def test_wrong_shape_names_tensor_and_shapes(saved_tiny, name, shape):
    _, path = saved_tiny
    expected = list(load_file(path / "model.safetensors")[name].shape)
    _edit_weights(path, lambda t: t.update({name: np.zeros(shape, np.float32)}))
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(path)
    assert f"{name} in model.safetensors (expected shape {expected}, found {list(shape)})" in str(info.value)
    assert len(info.value.mismatched) == 1 and not info.value.missing and not info.value.unexpected


def test_non_float_tensor_is_rejected(saved_tiny):
    _, path = saved_tiny
    _edit_weights(path, lambda t: t.update({"model.norm.weight": np.ones((64,), np.int32)}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight in model\.safetensors \(dtype I32"):
        load_hf_checkpoint(path)


def test_tied_model_accepts_only_an_identical_lm_head(tmp_path):
    model = _random_model(ModelConfig.from_name("tiny-qwen2"), seed=5)
    save_hf_checkpoint(model, tmp_path)
    _edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
    _assert_same_params(load_hf_checkpoint(tmp_path), model)
    _edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 1}))
    shared = r"lm_head.weight in .*model.safetensors must be a copy of the shared model.embed_tokens.weight"
    with pytest.raises(CheckpointError, match=shared):
        load_hf_checkpoint(tmp_path)


def test_rotary_inv_freq_buffers_are_ignored(saved_tiny):
    model, path = saved_tiny
    _edit_weights(path, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}))
    _assert_same_params(load_hf_checkpoint(path), model)


def test_index_inconsistent_with_shards(tmp_path):
    model = _random_model(TINY, seed=6)
    save_hf_checkpoint(model, tmp_path, max_shard_size_bytes=40_000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    other = {v for v in index["weight_map"].values() if v != index["weight_map"]["model.norm.weight"]}
    index["weight_map"]["model.norm.weight"] = sorted(other)[0]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight"):
        load_hf_checkpoint(tmp_path)
    index["weight_map"]["model.norm.weight"] = "model-99999-of-99999.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf_checkpoint(tmp_path)


def test_missing_files_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(TINY)))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_overwrite_protection(tmp_path):
    model = _random_model(TINY, seed=7)
    target = tmp_path / "ckpt"
    target.mkdir()  # an existing empty directory is fine
    save_hf_checkpoint(model, target, max_shard_size_bytes=40_000)
    (target / "tokenizer.json").write_text("{}")
    (target / "README.md").write_text("model card")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_hf_checkpoint(model, target)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        save_hf_checkpoint(model, tmp_path / "file", overwrite=True)
    # Overwriting a sharded checkpoint with a single file leaves no stale shards, index or tokenizer
    # behind; other plain files are carried over.
    other = _random_model(TINY, seed=8)
    save_hf_checkpoint(other, target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (target / "README.md").read_text() == "model card"
    _assert_same_params(load_hf_checkpoint(target), other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file"]  # no temporary siblings


def test_hf_names():
    config = TINY.replace(num_nextn_predict_layers=1)
    assert hf_name(("embed_tokens", "embedding"), config) == ("model.embed_tokens.weight", False)
    assert hf_name(("layers", 1, "self_attn", "q_proj", "kernel"), config) == (
        "model.layers.1.self_attn.q_proj.weight",
        True,
    )
    assert hf_name(("layers", 0, "self_attn", "k_proj", "bias"), config) == (
        "model.layers.0.self_attn.k_proj.bias",
        False,
    )
    assert hf_name(("norm", "weight"), config) == ("model.norm.weight", False)
    assert hf_name(("lm_head", "kernel"), config) == ("lm_head.weight", True)
    # DeepSeek-V3's MTP names: module j is layer L + j.
    assert hf_name(("mtp", 0, "eh_proj", "kernel"), config) == ("model.layers.2.eh_proj.weight", True)
    assert hf_name(("mtp", 0, "shared_head", "norm", "weight"), config) == (
        "model.layers.2.shared_head.norm.weight",
        False,
    )


# Fused projections: GQA's qkv_proj (with biases), the MLPs' and the stacked experts' gate_up_proj (main
# layers, shared experts, MTP blocks), MLA's fused_qkv_a_proj (with biases).
_FUSED_COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    attention_bias=True,
)
FUSED_CONFIGS = {
    "glm4_moe": ModelConfig(
        **_FUSED_COMMON, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True
    ),
    "deepseek_v3": ModelConfig(
        **_FUSED_COMMON,
        num_key_value_heads=4,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
    ),
}


def _fused(files: dict, prefix: str, modules: tuple[str, ...], config: ModelConfig, leaf: str = "weight") -> np.ndarray:
    """The HF tensors `{prefix}.{module}.{leaf}` for `modules`, as ours ([in, out]), laid out column by column
    as the fused module holds them: q/k/v group-major (per KV head g: query heads g * H/G .. (g + 1) * H/G - 1,
    then k_g, then v_g), gate/up interleaved (gate_i, up_i), anything else side by side."""
    parts = [files[f"{prefix}.{m}.{leaf}"].T for m in modules]
    if modules == ("q_proj", "k_proj", "v_proj"):
        q, k, v = parts
        h, g, d = config.num_attention_heads, config.num_key_value_heads, config.resolved_head_dim
        head = lambda x, n: x[..., n * d : (n + 1) * d]  # noqa: E731  # head n's D columns
        return np.concatenate(
            [
                column
                for kv in range(g)
                for column in (*(head(q, kv * (h // g) + j) for j in range(h // g)), head(k, kv), head(v, kv))
            ],
            axis=-1,
        )
    if modules == ("gate_proj", "up_proj"):
        gate, up = parts
        return np.concatenate([np.stack([gate[..., i], up[..., i]], axis=-1) for i in range(gate.shape[-1])], axis=-1)
    return np.concatenate(parts, axis=-1)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", sorted(FUSED_CONFIGS))
def test_fused_params_are_their_hf_tensors_in_the_fused_layout(tmp_path, name):
    """Each fused param holds the HF tensors it stands for (files written with the HF names only) in its layout:
    qkv_proj group-major, gate_up_proj interleaved, fused_qkv_a_proj side by side; the export takes them back
    out bit-exactly, in either layer layout."""
    config = FUSED_CONFIGS[name]
    save_hf_checkpoint(_random_model(config, seed=5), tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in files)  # HF names: nothing fused on disk
    model = load_hf_checkpoint(tmp_path)
    blocks = [*model.layers, *model.mtp]  # MTP module j's block is model.layers.{L + j}
    for i, block in enumerate(blocks):
        prefix = f"model.layers.{i}"
        attn = block.self_attn
        if config.attention_type == "mla":
            joined, modules = attn.fused_qkv_a_proj, ("q_a_proj", "kv_a_proj_with_mqa")
        else:
            joined, modules = attn.qkv_proj, ("q_proj", "k_proj", "v_proj")
        np.testing.assert_array_equal(joined.kernel[...], _fused(files, f"{prefix}.self_attn", modules, config))
        np.testing.assert_array_equal(joined.bias[...], _fused(files, f"{prefix}.self_attn", modules, config, "bias"))
        mlps = (
            [(f"{prefix}.mlp", block.mlp)]
            if i < config.first_k_dense_replace
            else [(f"{prefix}.mlp.shared_experts", block.mlp.shared_experts)]
        )
        for mlp_prefix, mlp in mlps:
            np.testing.assert_array_equal(
                mlp.gate_up_proj.kernel[...], _fused(files, mlp_prefix, ("gate_proj", "up_proj"), config)
            )
        if i >= config.first_k_dense_replace:
            gate_up = np.asarray(block.mlp.experts.gate_up_proj[...])  # [R, E, 2I]
            for r in range(config.n_routed_experts):
                np.testing.assert_array_equal(
                    gate_up[r], _fused(files, f"{prefix}.mlp.experts.{r}", ("gate_proj", "up_proj"), config)
                )
    for scan_layers in (False, True):
        exported = hf_tensors(load_hf_checkpoint(tmp_path, scan_layers=scan_layers))
        assert sorted(exported) == sorted(files)
        assert all(_same_bits(exported[n], files[n]) for n in files)


@pytest.mark.parametrize(
    "name,piece",
    [
        ("glm4_moe", "model.layers.1.self_attn.v_proj.bias"),
        ("glm4_moe", "model.layers.2.mlp.experts.3.up_proj.weight"),
        ("deepseek_v3", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    ],
)
def test_a_fused_params_pieces_are_accounted_for_one_by_one(tmp_path, name, piece):
    """A fused param's HF tensors are checked each on its own: one missing, or mis-shaped, is named."""
    save_hf_checkpoint(_random_model(FUSED_CONFIGS[name], seed=5), tmp_path)
    tensors = dict(load_file(tmp_path / "model.safetensors"))
    _edit_weights(tmp_path, lambda t: t.pop(piece))
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(tmp_path)
    assert info.value.missing == [piece] and not info.value.unexpected and not info.value.mismatched
    shape = tensors[piece].shape
    _edit_weights(tmp_path, lambda t: t.update({piece: np.zeros((shape[0] + 1, *shape[1:]), np.float32)}))
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(tmp_path)
    found = [shape[0] + 1, *shape[1:]]
    assert info.value.mismatched == [f"{piece} in model.safetensors (expected shape {list(shape)}, found {found})"]
    assert not info.value.missing and not info.value.unexpected


# ----------------------------------------------------------------------------------------------
# Config mapping

ROUND_TRIP_CONFIGS = {
    "tiny": TINY,
    "tiny-qwen2": ModelConfig.from_name("tiny-qwen2"),
    "head_dim+tokens": TINY.replace(head_dim=32, bos_token_id=1, eos_token_id=(2, 5), rms_norm_eps=1e-5),
    "linear": TINY.replace(rope_scaling=RopeScaling(rope_type="linear", factor=2.0)),
    "llama3": TINY.replace(
        rope_theta=5e5,
        rope_scaling=RopeScaling(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "yarn": TINY.replace(rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "yarn-deepseek": TINY.replace(
        rope_scaling=RopeScaling(
            rope_type="yarn",
            factor=40.0,
            original_max_position_embeddings=64,
            beta_fast=16.0,
            beta_slow=2.0,
            mscale=1.0,
            mscale_all_dim=0.8,
            truncate=False,
        )
    ),
    "yarn-attention-factor": TINY.replace(
        rope_scaling=RopeScaling(
            rope_type="yarn", factor=2.0, original_max_position_embeddings=128, attention_factor=1.25
        )
    ),
    "bfloat16": TINY.replace(dtype="bfloat16", param_dtype="bfloat16"),
}


@pytest.mark.parametrize(
    "name,model_type",
    [(name, None) for name in sorted(ROUND_TRIP_CONFIGS)] + [("tiny", "mistral"), ("yarn", "mistral")],
)
def test_config_round_trip(name, model_type):
    config = ROUND_TRIP_CONFIGS[name]
    hf = json.loads(json.dumps(config_to_hf(config, model_type=model_type)))  # through JSON, as on disk
    assert hf["model_type"] == (model_type or ("qwen2" if config.attention_bias else "llama"))
    assert hf["rope_parameters"]["rope_theta"] == hf["rope_theta"] == config.rope_theta
    assert config_from_hf(hf) == config


def test_config_reads_both_rope_spellings():
    base = {k: v for k, v in config_to_hf(TINY).items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    yarn = {"factor": 4.0, "original_max_position_embeddings": 64}
    spellings = [
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, **yarn}},  # transformers 5
        {"rope_theta": 5e5, "rope_scaling": {"type": "yarn", **yarn}},  # transformers 4.x, old key
        {"rope_theta": 5e5, "rope_scaling": {"rope_type": "yarn", **yarn}},  # transformers 4.x
    ]
    configs = [config_from_hf({**base, **s}) for s in spellings]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_theta == 5e5
    assert configs[0].rope_scaling == RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    # No rope fields at all: theta 10000, no scaling. YaRN without factor: max_positions / original.
    assert config_from_hf(base).rope_theta == 10000.0 and config_from_hf(base).rope_scaling == RopeScaling()
    derived = config_from_hf({**base, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}})
    assert derived.rope_scaling.factor == TINY.max_position_embeddings / 64


def test_config_ignores_harmless_fields():
    hf = config_to_hf(TINY)
    assert (
        config_from_hf(
            {
                **hf,
                "use_cache": False,
                "attention_dropout": 0.1,
                "pad_token_id": 0,
                "pretraining_tp": 2,
                "transformers_version": "4.45.0",
                "torch_dtype": "float32",
            }
        )
        == TINY
    )
    qwen2 = config_to_hf(ModelConfig.from_name("tiny-qwen2"))
    # Qwen2.5 ships a window that is switched off (use_sliding_window false).
    assert config_from_hf({**qwen2, "sliding_window": 32, "max_window_layers": 0}) == ModelConfig.from_name(
        "tiny-qwen2"
    )
    mistral = config_to_hf(TINY, model_type="mistral")
    assert config_from_hf({**mistral, "sliding_window": TINY.max_position_embeddings}) == TINY  # never binds


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
            "rope_parameters.rope_type",
        ),
        ({"rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, "rope_scaling.rope_type"),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "foo": 1}},
            "rope_parameters.foo",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
            "use_sliding_window",
        ),
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config.weight_block_size"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
        ({"num_nextn_predict_layers": 1, "mtp_style": "medusa"}, "mtp_style"),
        ({"dtype": "float64"}, "dtype"),
    ],
)
def test_invalid_config_fields_are_named(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config_from_hf({**config_to_hf(TINY), **changes})


@pytest.mark.parametrize(
    "config,model_type,field",
    [
        (TINY, "qwen2", "attention_bias"),
        (ModelConfig.from_name("tiny-qwen2"), "llama", "attention_bias"),
        (TINY, "gpt2", "model_type"),
    ],
)
def test_unexportable_configs_raise(tmp_path, config, model_type, field):
    with pytest.raises(ValueError, match=field):
        config_to_hf(config, model_type=model_type)
    with pytest.raises(ValueError, match=field):
        save_hf_checkpoint(_random_model(config), tmp_path, model_type=model_type)
    assert not any(tmp_path.iterdir())  # nothing written


MTP_TINY = TINY.replace(num_nextn_predict_layers=2, mtp_concat_order="hidden_first", mtp_hidden_after_norm=False)


def test_mtp_round_trip_in_deepseek_layout(tmp_path):
    """MTP module j is stored as model.layers.{L + j}.* (DeepSeek-V3) and its conventions in config.json."""
    model = _random_model(MTP_TINY, seed=3)
    save_hf_checkpoint(model, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    layer = f"model.layers.{TINY.num_hidden_layers + 1}"
    assert {
        f"{layer}.enorm.weight",
        f"{layer}.hnorm.weight",
        f"{layer}.eh_proj.weight",
        f"{layer}.shared_head.norm.weight",
        f"{layer}.self_attn.q_proj.weight",
        f"{layer}.mlp.up_proj.weight",
    } <= names
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["num_nextn_predict_layers"] == 2 and hf["mtp_concat_order"] == "hidden_first"
    loaded = load_hf_checkpoint(tmp_path)
    assert loaded.config == MTP_TINY
    _assert_same_params(model, loaded)


def test_deepseek_shared_copies_must_equal_the_shared_tensors(tmp_path):
    """DeepSeek-V3 stores each MTP layer's embed_tokens and shared_head.head, and so does the export: accepted
    only as exact copies."""
    model = _random_model(MTP_TINY, seed=4)
    save_hf_checkpoint(model, tmp_path)
    files = load_file(tmp_path / "model.safetensors")
    for j in range(MTP_TINY.num_nextn_predict_layers):
        layer = f"model.layers.{TINY.num_hidden_layers + j}"
        np.testing.assert_array_equal(files[f"{layer}.embed_tokens.weight"], files["model.embed_tokens.weight"])
        np.testing.assert_array_equal(files[f"{layer}.shared_head.head.weight"], files["lm_head.weight"])
    _assert_same_params(model, load_hf_checkpoint(tmp_path))
    layer = f"model.layers.{TINY.num_hidden_layers}"
    _edit_weights(tmp_path, lambda t: t.update({f"{layer}.shared_head.head.weight": t["lm_head.weight"] + 1}))
    with pytest.raises(CheckpointError, match=f"{layer}.shared_head.head.weight"):
        load_hf_checkpoint(tmp_path)
