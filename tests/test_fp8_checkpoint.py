"""Loading block-scaled FP8 checkpoints (DeepSeek-V3 / GLM-4.5-FP8 files): weights kept in float8_e4m3fn on
device with their scales (1 byte per weight plus the scales), the logits of `transformers` on the same
weights (its own FP8 dequantization where the widths are whole blocks, else the dequantized checkpoint),
`dequantize=True` equal to the dequantized checkpoint bit for bit, speculative greedy equal to plain
greedy, export bit-exact, and the files' unquantized modules found from their headers."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import test_hf_parity_moe as parity
from flax import nnx
from fp8_checkpoints import load_tensors, write_fp8_checkpoint
from hf_reference import RTOL, hf_logits, load_hf_model, our_logits, relative_error
from safetensors.numpy import load_file, save_file

from mtp_jax.checkpoints import CONFIG_FILE, WEIGHTS_FILE, CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.checkpoints.tensor_reads import TensorFile
from mtp_jax.config import ModelConfig
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import init_model
from mtp_jax.quantization import Fp8Config, dequantize_fp8_blocks, quantize_fp8_blocks

DEEPSEEK = ModelConfig(
    vocab_size=64,
    hidden_size=40,  # 40, 20, 24, 36: no width below is a multiple of the 16 x 8 block
    intermediate_size=36,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    num_nextn_predict_layers=1,
    initializer_range=0.2,
    attention_type="mla",
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=12,
    qk_rope_head_dim=8,
    v_head_dim=12,
    ffn_type="moe",
    moe_intermediate_size=20,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
FP8 = Fp8Config(weight_block_size=(16, 8))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(FP8 checkpoint dir, its dequantized twin's dir, the FP8 file's tensors)."""
    root = tmp_path_factory.mktemp("fp8")
    tensors = write_fp8_checkpoint(init_model(DEEPSEEK, seed=4), FP8, root / "fp8", root / "dequantized")
    return root / "fp8", root / "dequantized", tensors


def _params(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


def test_fp8_weights_stay_fp8_on_device_one_byte_each_plus_scales(deepseek):
    path, _, tensors = deepseek
    model = load_hf_checkpoint(path)
    assert model.config.quantization == FP8
    quantized = {n: t for n, t in tensors.items() if t.dtype == np.dtype("float8_e4m3fn")}
    assert len(quantized) > 40  # attention, dense and shared MLPs, every routed expert, the MTP block
    # on device: the weight [in, out] in one byte per entry, its scale in four per block, as in the files
    expected = sum(t.size + 4 * tensors[f"{n}_scale_inv"].size for n, t in quantized.items())
    params = _params(model).values()
    fp8_bytes = sum(v.get_value().nbytes for v in params if v.get_value().dtype == jnp.float8_e4m3fn)
    scale_bytes = sum(v.get_value().nbytes for p, v in _params(model).items() if str(p[-1]).endswith("_scale_inv"))
    assert fp8_bytes + scale_bytes == expected
    assert fp8_bytes == sum(t.size for t in quantized.values())


def test_logits_equal_the_dequantized_checkpoint_and_dequantize_on_load_is_bit_exact(deepseek):
    path, dequantized, _ = deepseek
    tokens = jnp.asarray([[1, 5, 9, 2, 6, 5, 3, 5]], jnp.int32)
    reference = load_hf_checkpoint(dequantized)
    kept = load_hf_checkpoint(path)
    np.testing.assert_allclose(kept.forward_full(tokens)[0], reference.forward_full(tokens)[0], rtol=0, atol=1e-5)
    loaded = load_hf_checkpoint(path, dequantize=True)
    assert loaded.config == reference.config  # a plain model
    for key, variable in _params(reference).items():
        np.testing.assert_array_equal(_params(loaded)[key].get_value(), variable.get_value(), err_msg=str(key))


def test_speculative_greedy_equals_plain_greedy_on_the_fp8_model(deepseek):
    model = load_hf_checkpoint(deepseek[0])
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    plain = generate(model, prompts, max_new_tokens=12, max_length=32, stop_tokens=[])
    eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
    assert generate(model, prompts, max_new_tokens=12, max_length=32, speculative=eagle, stop_tokens=[]).tokens == (
        plain.tokens
    )


def test_export_writes_the_same_fp8_files_bit_for_bit(deepseek, tmp_path):
    path, _, _ = deepseek
    save_hf_checkpoint(load_hf_checkpoint(path), tmp_path)
    original, exported = TensorFile(path / WEIGHTS_FILE, path), TensorFile(tmp_path / WEIGHTS_FILE, tmp_path)
    assert set(original.entries) == set(exported.entries)
    for name, (dtype, shape, _) in original.entries.items():
        assert exported.entries[name][:2] == (dtype, shape), name
        assert original.read(name).tobytes() == exported.read(name).tobytes(), name
    assert (
        json.loads((tmp_path / CONFIG_FILE).read_text())["quantization_config"]
        == json.loads((path / CONFIG_FILE).read_text())["quantization_config"]
    )


def _rewritten(src, dst, edit):
    dst.mkdir()
    (dst / CONFIG_FILE).write_bytes((src / CONFIG_FILE).read_bytes())
    tensors = load_tensors(src / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, dst / WEIGHTS_FILE, metadata={"format": "pt"})
    return dst


def test_a_module_the_files_keep_unquantized_in_every_layer_loads_unquantized(deepseek, tmp_path):
    path, dequantized, _ = deepseek
    plain = load_file(dequantized / WEIGHTS_FILE)

    def unquantize_o_proj(tensors):
        for name in [n for n in tensors if n.endswith("self_attn.o_proj.weight")]:
            tensors[name] = plain[name]
            del tensors[f"{name}_scale_inv"]

    model = load_hf_checkpoint(_rewritten(path, tmp_path / "kept", unquantize_o_proj))
    assert "self_attn.o_proj" in model.config.quantization.modules_to_not_convert
    assert model.layers[0].self_attn.o_proj.kernel.dtype == jnp.float32
    assert model.layers[0].self_attn.q_b_proj.kernel.dtype == jnp.float8_e4m3fn

    def unquantize_one_layer(tensors):
        tensors["model.layers.1.self_attn.o_proj.weight"] = plain["model.layers.1.self_attn.o_proj.weight"]
        del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]

    with pytest.raises(CheckpointError, match=r"missing \(1\): model.layers.1.self_attn.o_proj.weight_scale_inv"):
        load_hf_checkpoint(_rewritten(path, tmp_path / "mixed", unquantize_one_layer))


def test_an_fp8_weight_with_nan_or_a_wrong_dtype_is_refused(deepseek, tmp_path):
    path, _, _ = deepseek
    name = "model.layers.1.mlp.experts.2.down_proj.weight"

    def nan(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = np.nan

    with pytest.raises(CheckpointError, match=rf"{name} in .* holds NaN values"):
        load_hf_checkpoint(_rewritten(path, tmp_path / "nan", nan))

    def bf16_scale(tensors):
        tensors[f"{name}_scale_inv"] = tensors[f"{name}_scale_inv"].astype("bfloat16")

    with pytest.raises(
        CheckpointError, match=rf"{name}_scale_inv in {WEIGHTS_FILE} \(dtype BF16, expected \('F32',\)\)"
    ):
        load_hf_checkpoint(_rewritten(path, tmp_path / "bf16", bf16_scale))


def _fp8_from_transformers(model_type, block, root):
    """A transformers parity model (`test_hf_parity_moe`) saved, block-quantized as DeepSeek ships it, and
    its dequantized twin: (the HF model, FP8 dir, dequantized dir)."""
    hf_model = parity._hf_model(model_type)
    hf_model.save_pretrained(root / "source")
    source = load_file(root / "source" / WEIGHTS_FILE)
    config = json.loads((root / "source" / CONFIG_FILE).read_text())
    quantized, dequantized = dict(source), dict(source)
    for name, tensor in source.items():
        if name.endswith(".weight") and tensor.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name:
            if not name.endswith("mlp.gate.weight"):
                q, scale = quantize_fp8_blocks(tensor, block)
                quantized[name], quantized[f"{name}_scale_inv"] = q, scale
                dequantized[name] = dequantize_fp8_blocks(q, scale, block)
    fp8_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    for directory, tensors, extra in (
        (root / "fp8", quantized, {"quantization_config": fp8_config}),
        (root / "dequantized", dequantized, {}),
    ):
        directory.mkdir()
        save_file(tensors, directory / WEIGHTS_FILE, metadata={"format": "pt"})
        (directory / CONFIG_FILE).write_text(json.dumps(config | extra))
    return hf_model, root / "fp8", root / "dequantized"


@pytest.mark.parametrize("block", [[8, 8], [16, 16]], ids=["whole-blocks", "partial-blocks"])
@pytest.mark.parametrize("model_type", sorted(parity.HF_CONFIGS))
def test_fp8_logits_match_transformers_on_the_same_weights(model_type, block, tmp_path):
    hf_model, fp8_dir, dequantized_dir = _fp8_from_transformers(model_type, block, tmp_path)
    tokens = parity._tokens(2, 12)
    reference = load_hf_model(dequantized_dir)
    margins = parity.RoutingMargins(reference)
    expected = hf_logits(reference, tokens)
    margins.check()
    if block == [8, 8]:  # every width here is a multiple of 8: transformers dequantizes the FP8 files itself
        pytest.importorskip("accelerate", reason="transformers' FP8 loading needs accelerate (the [parity] extra)")
        assert relative_error(hf_logits(load_hf_model(fp8_dir), tokens), expected) == 0.0
    model = load_hf_checkpoint(fp8_dir)
    assert model.layers[1].mlp.experts.gate_up_proj.dtype == jnp.float8_e4m3fn
    err = relative_error(our_logits(model, tokens), expected)
    assert err <= RTOL, f"relative logit error {err:.2e} > {RTOL}"


def test_training_refuses_fp8_weights():
    from types import SimpleNamespace

    from mtp_jax.training.resume import check_compatible
    from mtp_jax.training.step import TrainConfig

    with pytest.raises(ValueError, match=r"FP8 weights .* dequantize=True"):
        check_compatible(DEEPSEEK.replace(quantization=FP8), TrainConfig(), SimpleNamespace(vocab_size=8))


def test_dequantizing_checks_the_scales_and_float16_checks_their_range(deepseek, tmp_path):
    path, _, _ = deepseek
    name = "model.layers.1.self_attn.q_b_proj.weight"

    def one_row_more(tensors):
        tensors[f"{name}_scale_inv"] = np.concatenate([tensors[f"{name}_scale_inv"]] * 2)

    bad = _rewritten(path, tmp_path / "rows", one_row_more)
    for dequantize in (False, True):  # kept in FP8 or dequantized on load: refused, naming the scale and its file
        with pytest.raises(CheckpointError, match=rf"{name}_scale_inv in {WEIGHTS_FILE} \(expected"):
            load_hf_checkpoint(bad, dequantize=dequantize)

    def large(tensors):
        tensors[f"{name}_scale_inv"] = tensors[f"{name}_scale_inv"] * 0 + 1000.0  # weights up to 448 x 1000

    bad = _rewritten(path, tmp_path / "large", large)
    assert load_hf_checkpoint(bad, dtype="bfloat16").layers[1].self_attn.q_b_proj.kernel.dtype == jnp.float8_e4m3fn
    with pytest.raises(CheckpointError, match=rf"{name}_scale_inv in .*: the FP8 weights .* beyond float16's range"):
        load_hf_checkpoint(bad, dtype="float16")
    with pytest.raises(CheckpointError, match=rf"{name} in .* does not fit float16"):
        load_hf_checkpoint(bad, dtype="float16", dequantize=True)
