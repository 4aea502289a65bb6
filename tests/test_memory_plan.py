"""The memory plan (`mtp_jax.memory_plan`) and `mtp-jax plan`: the full-size presets' numbers against hand
computations, the plan against what the engine allocates, checkpoint headers, the CLI, and the sharded
decode step and prefill of full-size DeepSeek-V3 and GLM-4.5 lowered and compiled for 8 fake devices.

Hand computations count parameters per layer from the layers' docstrings (`mtp_jax.layers.mla`, `moe`,
`ffn`, `attention`): every kernel [in, out], the MoE router in float32, the stacked routed experts split
over `expert` only, heads / FFN width / vocabulary over `tensor`, the rest replicated
(`mtp_jax.sharding.LOGICAL_RULES`).
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mtp_jax.cache import PageLayout
from mtp_jax.checkpoints import config_from_hf, save_hf_checkpoint
from mtp_jax.checkpoints.names import shared_copies
from mtp_jax.cli import main
from mtp_jax.config import PRESETS, ModelConfig
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.memory_plan import (
    GB,
    abstract_model,
    check_fits,
    checkpoint_weights,
    memory_plan,
    mesh_sizes,
    plan_checkpoint,
)
from mtp_jax.model import Transformer, init_model
from mtp_jax.quantization import Fp8Config
from mtp_jax.serving.paging import page_bytes

HERE = pathlib.Path(__file__).parent
EAGLE_1 = SpeculativeConfig(method="eagle", num_speculative_tokens=1)
B, S = 8, 4096  # decode rows, cache capacity in tokens
BF16, F32 = 2, 4  # bytes per element


# ---------------------------------------------------------------------------------------------
# The presets are the checkpoints' configs.

# The fields of the checkpoints' config.json files (deepseek-ai/DeepSeek-V3 without its FP8
# quantization_config, i.e. as DeepSeek's fp8_cast_bf16.py writes it; zai-org/GLM-4.5, GLM-4.5-Air).
DEEPSEEK_V3_JSON = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "hidden_act": "silu",
    "max_position_embeddings": 163840,
    "initializer_range": 0.02,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}
GLM_45_JSON = {
    "model_type": "glm4_moe",
    "vocab_size": 151552,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 92,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "attention_bias": True,
    "n_routed_experts": 160,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "eos_token_id": [151329, 151336, 151338],
    "pad_token_id": 151329,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
GLM_45_AIR_JSON = {
    **GLM_45_JSON,
    "hidden_size": 4096,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 46,
    "n_routed_experts": 128,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "use_qk_norm": False,
}


@pytest.mark.parametrize(
    "name,hf", [("deepseek-v3", DEEPSEEK_V3_JSON), ("glm-4.5", GLM_45_JSON), ("glm-4.5-air", GLM_45_AIR_JSON)]
)
def test_full_size_presets_are_the_checkpoints_configs(name, hf):
    assert PRESETS[name] == config_from_hf(hf).replace(scan_layers=True)


def test_fp8_preset_is_deepseek_v3_with_block_fp8():
    assert PRESETS["deepseek-v3-fp8"] == PRESETS["deepseek-v3"].replace(
        quantization=Fp8Config(weight_block_size=(128, 128), modules_to_not_convert=("eh_proj",))
    )


def test_full_size_presets_agree_with_transformers_config_defaults():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's sizes (positions and RoPE aside);
    Glm4MoeConfig's are GLM-4.5-Air's (head_dim, bias, RoPE base and routed scaling aside)."""
    transformers = pytest.importorskip(
        "transformers", reason="compares with transformers' config classes, installed by the [parity] extra"
    )
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    sizes += ("num_key_value_heads", "moe_intermediate_size", "n_routed_experts", "n_shared_experts")
    sizes += ("num_experts_per_tok", "n_group", "topk_group", "first_k_dense_replace", "num_nextn_predict_layers")
    deepseek = transformers.DeepseekV3Config()
    mla = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    for field in sizes + mla + ("routed_scaling_factor",):
        assert getattr(deepseek, field) == getattr(PRESETS["deepseek-v3"], field), field
    glm = transformers.Glm4MoeConfig()
    for field in sizes:
        assert getattr(glm, field) == getattr(PRESETS["glm-4.5-air"], field), field


def test_abstract_model_is_the_model_nnx_eval_shape_builds():
    """`abstract_model` hands out one fixed key (fast); the graph, shapes, dtypes and metadata are those of
    `nnx.eval_shape` with `nnx.Rngs`."""
    config = PRESETS["deepseek-v3-small"].replace(num_nextn_predict_layers=1, scan_layers=True)
    fast = nnx.split(abstract_model(config))
    slow = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    assert fast[0] == slow[0]
    fast_leaves = nnx.to_flat_state(fast[1])
    slow_leaves = nnx.to_flat_state(slow[1])
    assert [(p, v.get_value(), v.get_metadata()) for p, v in fast_leaves] == [
        (p, v.get_value(), v.get_metadata()) for p, v in slow_leaves
    ]


# ---------------------------------------------------------------------------------------------
# Hand computations.


def deepseek_v3_weight_bytes(expert: int = 1, tensor: int = 1) -> dict[str, int]:
    """Bytes per device of DeepSeek-V3's weights (61 layers + 1 MTP layer) on a mesh with these axes."""
    E, V, H, Q, C, R, N, Vd, F, Fm, X = 7168, 129280, 128, 1536, 512, 64, 128, 128, 18432, 2048, 256  # F: FFN width
    attention = (
        E * (Q + C + R)  # fused_qkv_a_proj (q_a_proj | kv_a_proj_with_mqa): replicated
        + Q
        + C  # q_a_layernorm, kv_a_layernorm
        + (Q * H * (N + R) + C * H * (N + Vd) + H * Vd * E) // tensor  # q_b_proj, kv_b_proj, o_proj: by heads
    )
    norms = 2 * E  # input_layernorm, post_attention_layernorm
    dense_mlp = 3 * E * F // tensor  # gate_up_proj [E, 2F], down_proj [F, E]
    moe = 3 * E * Fm * X // expert + 3 * E * Fm // tensor  # routed experts, the shared expert
    router = X * E + X  # gate.weight, e_score_correction_bias (float32)
    mtp_only = 2 * E * E + 3 * E  # eh_proj [2E, E], enorm, hnorm, shared_head.norm
    bf16 = 2 * V * E // tensor + E + 62 * (attention + norms) + 3 * dense_mlp + 59 * moe + mtp_only
    return {"bfloat16": BF16 * bf16, "float32": F32 * 59 * router}  # 58 MoE layers + the MTP layer


def glm_45_air_weight_bytes(expert: int = 1, tensor: int = 1) -> dict[str, int]:
    """Bytes per device of GLM-4.5-Air's weights (46 layers + 1 MTP layer)."""
    E, V, H, G, D, F, Fm, X = 4096, 151552, 96, 8, 128, 10944, 1408, 128
    groups = tensor if G % tensor == 0 else 1  # qkv_proj is group-major: it splits between KV groups
    attention = (E + 1) * (H + 2 * G) * D // groups + H * D * E // tensor  # qkv_proj + bias, o_proj
    norms = 2 * E
    dense_mlp = 3 * E * F // tensor
    moe = 3 * E * Fm * X // expert + 3 * E * Fm // tensor
    router = X * E + X
    mtp_only = 2 * E * E + 3 * E
    bf16 = 2 * V * E // tensor + E + 47 * (attention + norms) + 1 * dense_mlp + 46 * moe + mtp_only
    return {"bfloat16": BF16 * bf16, "float32": F32 * 46 * router}


def mla_cache_bytes(layers: int, batch: int = B, length: int = S) -> int:
    """MLA's cache: kv_lora_rank latent + qk_rope_head_dim rope key per position and layer, bf16."""
    return (512 + 64) * layers * batch * length * BF16


def gqa_cache_bytes(layers: int, tensor: int = 1, batch: int = B, length: int = S) -> int:
    """GLM's cache: keys and values of 8 KV heads of 128, bf16; split over `tensor` when it divides 8."""
    return 2 * 8 * 128 * layers * batch * length * BF16 // (tensor if 8 % tensor == 0 else 1)


def decode_state_bytes(batch: int, length: int, k: int) -> int:
    """The decode state without caches, greedy eagle drafts: tokens and logprobs [B, S] (int32, float32);
    per row lengths, prompt_lengths, output_start, max_new_tokens (int32), done, thinking (bool), 16 stop
    tokens, 9 sampling parameters (temperature, top-k, top-p, seed, min_tokens, three penalties, min-p) and a
    logit bias of 300 (token id, value) pairs, 1 oracle token, 3 counters (int32); K drafts, K + K + 1
    counters (int32); no top logprobs (max_logprobs 0)."""
    bias = 300 * (4 + 4)
    return batch * (8 * length + 4 * 4 + 2 + 4 * 16 + 4 * 9 + bias + 4 + 4 * 3 + 4 * k + 4 * (2 * k + 1))


def deepseek_v3_device_bytes(data: int, expert: int, tensor: int) -> int:
    """Everything one device holds decoding DeepSeek-V3 (eagle K = 1, B x S) on a data x expert x tensor mesh."""
    weights = sum(deepseek_v3_weight_bytes(expert, tensor).values())
    return weights + (mla_cache_bytes(61) + mla_cache_bytes(1) + decode_state_bytes(B, S, 1)) // data


def plan(name: str, mesh, device_memory=None, **kwargs):
    kwargs = {"max_batch": B, "max_length": S, "speculative": EAGLE_1, **kwargs}
    return memory_plan(PRESETS[name], mesh, device_memory_bytes=device_memory, **kwargs)


# ---------------------------------------------------------------------------------------------
# The full-size plans.


def test_deepseek_v3_parameter_count_by_hand():
    p = plan("deepseek-v3", "tensor=1")
    by_hand = deepseek_v3_weight_bytes()
    assert p.weights_total_bytes == p.weights_bytes == by_hand
    # 671.0B in the main model (DeepSeek-V3's "671B"), 11.6B in the MTP layer (its embedding and head shared)
    assert p.num_parameters == by_hand["bfloat16"] // BF16 + by_hand["float32"] // F32 == 682_636_487_424
    main_model = PRESETS["deepseek-v3"].replace(num_nextn_predict_layers=0)
    assert memory_plan(main_model, max_batch=1, max_length=2).num_parameters == 671_026_419_200


@pytest.mark.parametrize("mesh,expert,tensor", [("tensor=8", 1, 8), ("expert=8", 8, 1), ("expert=16,tensor=2", 16, 2)])
def test_deepseek_v3_bytes_per_device_by_hand(mesh, expert, tensor):
    p = plan("deepseek-v3", mesh)
    assert p.weights_bytes == deepseek_v3_weight_bytes(expert, tensor)
    assert p.kv_cache_bytes == mla_cache_bytes(61) == 2_302_672_896  # replicated over tensor and expert
    assert p.mtp_cache_bytes == mla_cache_bytes(1)
    assert p.decode_state_bytes == decode_state_bytes(B, S, 1)
    assert p.total_bytes == deepseek_v3_device_bytes(1, expert, tensor)


def test_kv_cache_splits_over_data_and_tensor_only_where_the_rules_say():
    """MLA's latent cache has no head axis: split over data, never tensor; GLM's 8 KV heads split over
    tensor=8, not tensor=16 (replicated: 16 does not divide 8)."""
    assert plan("deepseek-v3", "data=4,tensor=2").kv_cache_bytes == mla_cache_bytes(61) // 4
    assert plan("glm-4.5-air", "tensor=8").kv_cache_bytes == gqa_cache_bytes(46, tensor=8)
    assert plan("glm-4.5-air", "tensor=16").kv_cache_bytes == gqa_cache_bytes(46) == 6_174_015_488
    assert plan("glm-4.5-air", "expert=8").mtp_cache_bytes == gqa_cache_bytes(1)


def test_glm_45_air_on_8_h200s_fits_with_experts_split_not_with_tensor_alone():
    memory = 141 * GB
    split = plan("glm-4.5-air", "expert=8", memory)
    assert split.weights_bytes == glm_45_air_weight_bytes(expert=8)
    total = sum(glm_45_air_weight_bytes(expert=8).values()) + gqa_cache_bytes(47) + decode_state_bytes(B, S, 1)
    assert split.total_bytes == total == 46_536_686_512  # 46.5 GB of 141
    assert split.fits
    check_fits(split)  # nothing raised

    tensor = plan("glm-4.5-air", "tensor=8", memory)  # tensor splits no routed expert: every device holds all
    assert tensor.weights_bytes == glm_45_air_weight_bytes(tensor=8)
    total = sum(glm_45_air_weight_bytes(tensor=8).values()) + gqa_cache_bytes(47, 8) + decode_state_bytes(B, S, 1)
    assert tensor.total_bytes == total and total > memory
    assert tensor.fits is False
    with pytest.raises(ValueError, match=rf"needs {total / GB:.2f} GB per device on mesh tensor=8 .* 141.00 GB"):
        check_fits(tensor)


def _smallest_by_hand(memory: int) -> tuple[tuple[int, int, int], int]:
    """The fewest devices, then the fewest bytes per device, of DeepSeek-V3 over data x expert x tensor meshes
    (powers of two, data dividing the batch), by the hand formula."""
    candidates = [
        (d * e * t, deepseek_v3_device_bytes(d, e, t), -t, -e, (d, e, t))
        for d, e, t in itertools.product([2**i for i in range(7)], repeat=3)
        if d * e * t <= 64 and B % d == 0  # (up to 64 devices, where the formula's splits all divide)
    ]
    n, total, *_, mesh = min(c for c in candidates if c[1] <= memory)
    return mesh, total


def test_deepseek_v3_bf16_does_not_fit_8_h200s_and_the_error_names_the_smallest_mesh():
    p = plan("deepseek-v3", "expert=8", 141 * GB)
    assert p.total_bytes == deepseek_v3_device_bytes(1, 8, 1) == 203_759_885_232
    assert p.fits is False
    (data, expert, tensor), total = _smallest_by_hand(141 * GB)
    assert (data, expert, tensor) == (1, 16, 1)  # 16 devices: the experts split 16 ways
    assert p.smallest_mesh.mesh == mesh_sizes("expert=16") and p.smallest_mesh.total_bytes == total
    with pytest.raises(ValueError) as error:
        check_fits(p)
    message = str(error.value)
    assert "needs 203.76 GB per device on mesh expert=8 (8 devices) but 141.00 GB are available" in message
    assert f"the smallest mesh that fits: expert=16 (16 devices), {total / GB:.2f} GB per device" in message


def test_deepseek_v3_on_16_a100s_of_80_gb():
    p = plan("deepseek-v3", "expert=16", 80 * GB)
    assert p.total_bytes == deepseek_v3_device_bytes(1, 16, 1) and p.fits is False  # 120.6 GB
    (data, expert, tensor), total = _smallest_by_hand(80 * GB)
    assert (data, expert, tensor) == (1, 32, 1)  # 79.0 GB: 32 devices
    assert p.smallest_mesh.mesh == mesh_sizes("expert=32") and p.smallest_mesh.total_bytes == total
    fp8 = plan("deepseek-v3-fp8", "expert=16", 80 * GB)  # FP8 experts: half the bytes
    assert fp8.fits and fp8.weights_bytes["float8_e4m3fn"] < p.weights_bytes["bfloat16"] / 2


def test_glm_45_on_8_h200s_and_16_a100s():
    assert plan("glm-4.5", "expert=8", 141 * GB).fits
    assert not plan("glm-4.5", "tensor=8", 141 * GB).fits
    at_16 = plan("glm-4.5", "expert=16", 80 * GB)
    assert not at_16.fits and at_16.smallest_mesh.num_devices == 32
    assert plan("glm-4.5-air", "expert=16", 80 * GB).fits


def test_plan_errors_name_the_problem():
    with pytest.raises(ValueError, match="expert axis"):
        plan("deepseek-v3", "expert=3")  # 256 experts do not split 3 ways: the engine refuses it
    with pytest.raises(ValueError, match="batch size 8 is not a multiple"):
        plan("deepseek-v3", "data=16")
    with pytest.raises(ValueError, match="needs every axis size"):
        plan("deepseek-v3", "expert=-1")
    with pytest.raises(ValueError, match="max_length"):
        plan("deepseek-v3", "tensor=2", max_length=200_000)
    with pytest.raises(ValueError, match="vanilla.*exceeds the model's 1 MTP modules"):
        plan("deepseek-v3", "tensor=2", speculative=SpeculativeConfig(method="vanilla", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="device_memory_bytes"):
        plan("deepseek-v3", "tensor=2", device_memory=0)


@pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="checks a plan where the backend reports no device memory (the CPU); GPUs report theirs",
)
def test_plan_without_device_memory_has_no_fit_check():
    p = plan("glm-4.5-air", "expert=8")
    assert p.device_memory_bytes is None and p.fits is None and p.smallest_mesh is None
    check_fits(p)  # nothing to check
    assert "unknown (no device memory given or reported)" in p.table()


# ---------------------------------------------------------------------------------------------
# The plan is what the engine allocates.

TINY_MOE = PRESETS["deepseek-v3-small"].replace(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_nextn_predict_layers=2,
    dtype="bfloat16",
    param_dtype="bfloat16",
)


def _nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@pytest.mark.parametrize(
    "config,speculative",
    [
        (TINY_MOE, SpeculativeConfig(method="vanilla", num_speculative_tokens=2, draft_sampling="sample")),
        (TINY_MOE.replace(scan_layers=True), EAGLE_1),
        (ModelConfig.from_name("tiny", num_nextn_predict_layers=1), None),
    ],
)
def test_plan_equals_what_the_engine_allocates_on_one_device(config, speculative):
    model = init_model(config)
    engine = DecodeEngine(model, speculative)
    state, _ = engine.init_state([[1, 2, 3], [4, 5]], max_new_tokens=4, max_length=48)
    p = memory_plan(config, max_batch=2, max_length=48, speculative=speculative, device_memory_bytes=10**9)
    by_dtype = {}
    for x in jax.tree.leaves(nnx.state(model)):
        by_dtype[x.dtype.name] = by_dtype.get(x.dtype.name, 0) + x.nbytes
    assert p.weights_bytes == p.weights_total_bytes == by_dtype
    assert p.kv_cache_bytes == _nbytes(state.cache)
    assert p.mtp_cache_bytes == _nbytes(state.draft.caches)
    assert p.decode_state_bytes == _nbytes(state) - _nbytes(state.cache) - _nbytes(state.draft.caches)


@pytest.mark.parametrize(
    "config",
    [TINY_MOE, ModelConfig.from_name("tiny", num_nextn_predict_layers=1, scan_layers=True)],
    ids=["mla", "gqa-scan"],
)
def test_paged_plan_equals_the_serving_engines_pools(config):
    """`mtp-jax serve`'s layout: KV pools of N pages, whatever max_batch x max_length would be; the pools and the
    rest of the state are what the engine allocates."""
    model = init_model(config)
    engine = DecodeEngine(model, EAGLE_1)
    pages = PageLayout(num_pages=5, page_size=16)
    state, _ = engine.init_state([[1, 2, 3], [4, 5]], max_new_tokens=4, max_length=48, pages=pages)
    p = memory_plan(config, max_batch=2, max_length=48, speculative=EAGLE_1, pages=pages, device_memory_bytes=10**9)
    assert p.kv_cache_bytes == _nbytes(state.cache)
    assert p.mtp_cache_bytes == _nbytes(state.draft.caches)
    assert p.decode_state_bytes == _nbytes(state) - _nbytes(state.cache) - _nbytes(state.draft.caches)
    assert p.kv_cache_bytes + p.mtp_cache_bytes == 5 * page_bytes(model, EAGLE_1, 16)
    assert "KV in 5 pages of 16 tokens" in p.table()


def test_cli_plans_serves_page_pool(capsys):
    """--num-pages / --kv-cache-memory plan the KV as serve keeps it: the pool, not max_batch x max_length (64 rows
    of 16k tokens need 74.9 GB of dense KV per device and do not fit 16 H200s; an 8 GB pool does)."""
    argv = ["plan", "deepseek-v3", "--mesh", "expert=16", "--max-batch", "64", "--max-length", "16384"]
    assert main(argv + ["--device-memory", "141GB"]) == 1
    dense = capsys.readouterr().out
    assert main(argv + ["--device-memory", "141GB", "--kv-cache-memory", "8GB"]) == 0
    paged = capsys.readouterr().out
    assert "KV in 7,000 pages of 16 tokens" in paged and "pages" not in dense
    assert main(argv + ["--num-pages", "1000", "--page-size", "64"]) == 0
    assert "KV in 1,000 pages of 64 tokens" in capsys.readouterr().out
    assert main(argv + ["--kv-cache-memory", "1KB"]) == 2
    assert "--kv-cache-memory 1000 bytes holds no KV page" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(argv + ["--num-pages", "4", "--kv-cache-memory", "1GB"])


# ---------------------------------------------------------------------------------------------
# A hybrid model's step: every Gated DeltaNet layer's states that verify keeps until the commit selects one.

QWEN35 = ModelConfig.from_name("qwen3.5-small")  # 3 linear_attention layers (Hv 8, Dk = Dv = 64) + 1 attention


def _verify_line(table: str) -> str:
    return next(line for line in table.splitlines() if "recurrent states kept by a verify step" in line)


def verify_states_bytes(config: ModelConfig, batch: int, k: int, data: int = 1, tensor: int = 1) -> int:
    """By hand, per linear_attention layer (`mtp_jax.cache.RecurrentCandidates`): states float32
    [B, K+2, Hv, Dk, Dv] (batch over data, value heads over tensor) and conv [B, W-1+K+1, C] in the compute
    dtype, C = 2 Hk Dk + Hv Dv (batch over data)."""
    c = config
    states = batch * (k + 2) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * F32
    channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    conv = batch * (c.linear_conv_kernel_dim - 1 + k + 1) * channels * np.dtype(c.compute_dtype).itemsize
    return c.layer_types.count("linear_attention") * (states // (data * tensor) + conv // data)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("k", [0, 3])  # K = 0: plain decoding, a step of one token still keeps 2 states
@pytest.mark.parametrize(
    "mesh,data,tensor", [(None, 1, 1), ("data=2", 2, 1), ("tensor=4", 1, 4), ("data=2,tensor=4", 2, 4)]
)
def test_verify_states_of_a_hybrid_model_by_hand(scan, k, mesh, data, tensor):
    speculative = SpeculativeConfig(method="eagle", num_speculative_tokens=k) if k else None
    p = memory_plan(QWEN35.replace(scan_layers=scan), mesh, max_batch=4, max_length=64, speculative=speculative)
    assert p.verify_states_bytes == verify_states_bytes(QWEN35, 4, k, data, tensor) > 0
    rest = sum(p.weights_bytes.values()) + p.kv_cache_bytes + p.mtp_cache_bytes + p.decode_state_bytes
    assert p.total_bytes == rest + p.verify_states_bytes
    assert _verify_line(p.table()).split()[-1] == f"{p.verify_states_bytes:,}"


@pytest.mark.parametrize("scan,k", [(False, 2), (True, 5)])
def test_verify_states_are_what_the_real_verify_keeps(scan, k):
    """The plan's shapes against `jax.eval_shape` of `mtp_jax.decode.step.verify`: the `RecurrentCandidates`
    in the cache it returns (stacked, where the model scans), here with a bfloat16 conv."""
    from mtp_jax.cache import RecurrentCandidates
    from mtp_jax.decode.step import sampling_metadata, verify
    from mtp_jax.memory_plan import abstract_decode_state

    speculative = SpeculativeConfig(method="eagle", num_speculative_tokens=k)
    config = QWEN35.replace(scan_layers=scan, dtype="bfloat16", param_dtype="bfloat16")
    model = abstract_model(config)
    graph, params = nnx.split(model)
    state, _ = abstract_decode_state(model, max_batch=3, max_length=32, speculative=speculative)

    def verified(params, state):
        model = nnx.merge(graph, params)
        return verify(model, state, sampling_metadata(model, state))

    _, _, cache = jax.eval_shape(verified, params, state)
    is_kept = lambda node: isinstance(node, RecurrentCandidates)  # noqa: E731
    kept = [node for node in jax.tree.leaves(cache, is_leaf=is_kept) if is_kept(node)]
    assert len(kept) == (1 if scan else 3)
    p = memory_plan(config, max_batch=3, max_length=32, speculative=speculative)
    kept_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(kept))
    assert p.verify_states_bytes == kept_bytes == verify_states_bytes(config, 3, k)


def test_verify_states_count_in_the_fit_and_the_smallest_mesh():
    eagle_7 = SpeculativeConfig(method="eagle", num_speculative_tokens=7)
    p = memory_plan(QWEN35, max_batch=32, max_length=256, speculative=eagle_7, device_memory_bytes=10**9)
    verify = verify_states_bytes(QWEN35, 32, 7)
    assert p.verify_states_bytes == verify == 117_571_584  # more than all the rest: 112,917,632 bytes
    assert p.total_bytes - verify == 112_918_400
    tight = memory_plan(
        QWEN35, max_batch=32, max_length=256, speculative=eagle_7, device_memory_bytes=p.total_bytes - verify
    )
    assert tight.fits is False  # what fitted without them does not
    with pytest.raises(ValueError, match=r"recurrent states kept by a verify step 0\.12 GB"):
        check_fits(tight)
    fit = tight.smallest_mesh  # data=2,tensor=2: the heads split over tensor, the batch over data
    assert fit.num_devices > 1 and fit.total_bytes <= tight.device_memory_bytes
    assert (
        fit.total_bytes == memory_plan(QWEN35, fit.mesh, max_batch=32, max_length=256, speculative=eagle_7).total_bytes
    )
    dense = plan("glm-4.5-air", "expert=8")  # no recurrent layer: no line, nothing added
    assert dense.verify_states_bytes == 0 and "verify" not in dense.table()


def test_cli_prints_the_verify_states_of_a_hybrid_model(capsys):
    argv = ["plan", "qwen3.5-small", "--max-batch", "32", "--max-length", "256", "--num-speculative-tokens", "7"]
    assert main([*argv, "--mesh", "tensor=4", "--device-memory", "1GB"]) == 0
    out = capsys.readouterr().out
    assert "speculative eagle K=7" in out
    assert _verify_line(out).split()[-1] == f"{verify_states_bytes(QWEN35, 32, 7, tensor=4):,}"  # 29,884,416


def test_compiled_hybrid_step_holds_the_verify_states():
    """XLA's memory analysis of the real step (qwen3.5-small, batch 32, K = 7, compiled for this backend from
    abstract arguments, not run): the arguments are the plan's weights and state; the temporaries hold at least
    every layer's K+1 states after a new token (the commit needs the last layer's logits before it can choose;
    the state before them may be the argument's, so K+1 of the plan's K+2), and were more than the whole plan
    without them (134.9 MB here against 112.8 MB). 3-6 s, most of it compiling."""
    from mtp_jax.decode import engine
    from mtp_jax.memory_plan import abstract_decode_state
    from mtp_jax.model import static_split

    eagle_7 = SpeculativeConfig(method="eagle", num_speculative_tokens=7)
    p = memory_plan(QWEN35, max_batch=32, max_length=256, speculative=eagle_7, device_memory_bytes=10**9)
    model = abstract_model(QWEN35)
    graph, params = static_split(model)
    state, _ = abstract_decode_state(model, max_batch=32, max_length=256, speculative=eagle_7)
    analysis = engine._step_jit.lower(graph, params, eagle_7, state).compile().memory_analysis()
    rest = p.total_bytes - p.verify_states_bytes
    assert analysis.argument_size_in_bytes == rest
    states = 3 * 32 * 8 * 64 * 64 * F32  # every recurrent layer's states after one token: 3 layers x [B, Hv, Dk, Dv]
    assert analysis.temp_size_in_bytes >= (7 + 1) * states > 0.85 * p.verify_states_bytes
    assert analysis.temp_size_in_bytes > rest  # what the plan missed was more than all it counted


# ---------------------------------------------------------------------------------------------
# Checkpoint directories: config.json and the safetensors headers only.


@pytest.fixture
def tiny_checkpoint(tmp_path):
    path = tmp_path / "model"
    save_hf_checkpoint(init_model(TINY_MOE), path)
    return path


def test_plan_checkpoint_matches_the_headers(tiny_checkpoint):
    p = plan_checkpoint(tiny_checkpoint, "tensor=2", max_batch=2, max_length=64, device_memory_bytes=10**9)
    stored = p.checkpoint
    # the files' bytes, less the copies of shared tensors the model holds once, are the plan's unsharded weights
    assert stored.total_bytes - stored.shared_copy_bytes == sum(p.weights_total_bytes.values())
    assert stored.bytes_by_dtype["float32"] == p.weights_total_bytes["float32"]  # the routers
    assert set(stored.bytes_by_dtype) == {"bfloat16", "float32"} and p.fits
    assert p.mesh == mesh_sizes("tensor=2") and p.max_length == 64
    assert "checkpoint: " in p.table() and "against the plan's" in p.table()


def test_checkpoint_copies_of_shared_tensors_are_counted_apart(tiny_checkpoint):
    """DeepSeek-V3's files carry each MTP layer's own embed_tokens and shared_head.head; the model holds them once."""
    file = tiny_checkpoint / "model.safetensors"
    tensors = load_file(file)
    plan_total = sum(memory_plan(TINY_MOE, max_batch=1, max_length=2).weights_total_bytes.values())
    kept = {n: t for n, t in tensors.items() if n not in shared_copies(TINY_MOE)}
    save_file(kept, file, metadata={"format": "pt"})
    without = checkpoint_weights(tiny_checkpoint)
    assert without.shared_copy_bytes == 0 and without.total_bytes == plan_total
    kept[f"model.layers.{TINY_MOE.num_hidden_layers}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    save_file(kept, file, metadata={"format": "pt"})
    with_copy = checkpoint_weights(tiny_checkpoint)
    copy = tensors["model.embed_tokens.weight"].nbytes
    assert with_copy.shared_copy_bytes == copy and with_copy.total_bytes == plan_total + copy


def test_checkpoint_weights_of_a_sharded_checkpoint(tmp_path, tiny_checkpoint):
    model = init_model(TINY_MOE)
    save_hf_checkpoint(model, tmp_path / "sharded", max_shard_size_bytes=2_000_000)
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    sharded, single = checkpoint_weights(tmp_path / "sharded"), checkpoint_weights(tiny_checkpoint)
    assert sharded.bytes_by_dtype == single.bytes_by_dtype and sharded.num_tensors == single.num_tensors


def test_plan_checkpoint_errors(tmp_path, tiny_checkpoint):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        plan_checkpoint(tmp_path, max_batch=1)
    (tiny_checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        plan_checkpoint(tiny_checkpoint, max_batch=1, max_length=64)


# ---------------------------------------------------------------------------------------------
# mtp-jax plan


def test_cli_prints_the_plan_and_exits_0_when_it_fits(capsys):
    argv = ["plan", "glm-4.5-air", "--mesh", "expert=8", "--max-batch", "8", "--max-length", "4096"]
    assert main(argv + ["--num-speculative-tokens", "1", "--device-memory", "141GB"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: glm-4.5-air on expert=8 (8 devices)" in out
    assert "batch 8 x 4,096 tokens, speculative eagle K=1" in out
    assert "46.54" in out and "141.00" in out and "yes" in out


def test_cli_exits_1_naming_the_numbers_when_it_does_not_fit(capsys):
    argv = ["plan", "deepseek-v3", "--mesh", "expert=8", "--max-batch", "8", "--max-length", "4096"]
    assert main(argv + ["--num-speculative-tokens", "1", "--device-memory", "141GB"]) == 1
    captured = capsys.readouterr()
    assert "no, 62.76 GB short" in captured.out
    assert "needs 203.76 GB per device on mesh expert=8 (8 devices) but 141.00 GB" in captured.err
    assert "the smallest mesh that fits: expert=16 (16 devices" in captured.err


def test_cli_plans_a_checkpoint_directory(capsys, tiny_checkpoint):
    argv = ["plan", str(tiny_checkpoint), "--mesh", "tensor=2", "--max-length", "64", "--device-memory", "1GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoint: " in out and "speculative eagle K=3" in out and "1.07" in out  # 1 GiB = 1.07 GB


def test_cli_errors(capsys, tmp_path):
    assert main(["plan", "no-such-model"]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err
    assert main(["plan", "deepseek-v3", "--mesh", "data=16", "--max-batch", "8", "--max-length", "64"]) == 2
    assert "--max-batch" in capsys.readouterr().err
    for bad in (["--mesh", "tensor=-1"], ["--device-memory", "lots"], ["--max-batch", "0"]):
        with pytest.raises(SystemExit):
            main(["plan", "tiny", *bad])
    assert "error" in capsys.readouterr().err


def test_cli_plans_16_devices_on_this_one_cpu_in_seconds():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = ["plan", "deepseek-v3", "--mesh", "expert=16", "--max-batch", "8", "--max-length", "4096"]
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mtp_jax.cli", *argv, "--device-memory", "80GB"],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
        timeout=120,
    )
    seconds = time.perf_counter() - start
    assert proc.returncode == 1, proc.stderr
    assert "120.61" in proc.stdout and "expert=32 (32 devices), 79.04 GB per device" in proc.stderr
    assert seconds < 20, seconds  # about 3 s here: nothing is allocated or compiled


# ---------------------------------------------------------------------------------------------
# The sharded step and prefill, lowered and compiled (not run) for 8 fake devices from abstract weights.


def _lower(preset: str, mesh: str, *flags: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    proc = subprocess.run(
        [sys.executable, str(HERE / "lowering_worker.py"), preset, mesh, *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=HERE.parent,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("preset", ["deepseek-v3", "glm-4.5", "deepseek-v3-fp8"])
def test_full_size_step_and_prefill_compile_sharded_with_the_plans_argument_bytes(preset):
    """Every sharding rule divides the real dimensions (`resolve` would replicate otherwise, and the bytes
    would differ), and the compiled programs take per device exactly the plan's weights and decode state
    (the prefill also its padded prompts) and return the state in place (donated, aliased).

    FP8: float8_e4m3fn kernels and their float32 block scales (replicated; the routed experts' split over
    `expert` as their kernels). 11-30 s each on this project's 2-core CPU, unloaded (compile 3-16 s per
    program, 61 / 92 layers scanned)."""
    result = _lower(preset, "data=2,expert=2,tensor=2")
    plan_bytes = result["plan"]
    for name in ("step", "prefill"):
        program = result[name]
        padded = plan_bytes["padded"] if name == "prefill" else 0
        assert program["argument_bytes"] == plan_bytes["weights"] + plan_bytes["state"] + padded, name
        assert program["output_bytes"] - program["alias_bytes"] < 1024  # the state, written in place (+ a token)
        assert program["alias_bytes"] == plan_bytes["state"]


def test_full_size_step_copies_no_stacked_weights():
    """No temporary as big as a stack of layers' weights: a sharding that XLA had to undo (a gathered or
    re-sharded weight) would copy a layer group's stacked weights, 58 layers' worth.

    In float32: in bfloat16 XLA:CPU converts every stacked expert weight to float32 for its ragged_dot
    (hoisted out of the layer scan: 1.38 TB of temporaries per device here), a CPU artifact. What float32
    leaves is XLA:CPU's ragged_dot copying one layer's experts transposed, in the scanned body and in the MTP
    layer: about 2 x one layer's routed experts per device."""
    result = _lower("deepseek-v3", "data=2,expert=2,tensor=2", "--dtype", "float32", "--step-only")
    one_layer_experts = 3 * 7168 * 2048 * (256 // 2) * F32  # gate_up + down, 128 experts per device: 22.5 GB
    assert result["step"]["argument_bytes"] == result["plan"]["weights"] + result["plan"]["state"]
    assert result["step"]["temp_bytes"] < 2.1 * one_layer_experts


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_refuse_a_model_that_does_not_fit_before_reading_weights(
    monkeypatch, capsys, tmp_path, command
):
    """Where the devices report their memory (GPUs), the CLI plans before loading: here a 1 MB device."""
    from mtp_jax import memory_plan
    from mtp_jax.checkpoints import reading

    monkeypatch.setattr(memory_plan, "device_memory", lambda: 1_000_000)
    monkeypatch.setattr(reading, "read_hf_files", lambda *a, **k: pytest.fail("weights were read"))
    argv = ["generate", "--prompt", "x", "--max-new-tokens", "2"] if command == "generate" else ["serve", "--port", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"mtp-jax {command}: error:" in err and "GB" in err and "smallest mesh" in err, err
