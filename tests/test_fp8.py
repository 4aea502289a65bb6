"""Block-scaled FP8 weights (DeepSeek-V3's format): the NumPy reference, the models that keep them in FP8,
their config.json field and their export.

An FP8 model computes exactly what the plain float32 model holding its dequantized weights computes
(both layer layouts, MLA's absorbed and decompressed forms); its parameters take 1 byte per weight plus
4 per (b_out x b_in) block, as the files do; every fused layer finds each column's scale where the checkpoint's
layout puts it; its export is DeepSeek-V3's files (F8_E4M3 weights, F32 block scales), bit-exact.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors import safe_open

from mtp_jax.checkpoints import config_from_hf, config_to_hf, hf_tensors, save_hf_checkpoint
from mtp_jax.checkpoints.names import (
    check_quantized_modules,
    fuse,
    hf_names,
    is_scale,
    piece_widths,
    shared_copies,
    tensor_layout,
    unfuse,
)
from mtp_jax.config import ModelConfig
from mtp_jax.layers.fp8 import Fp8Linear, dequantize, quantize
from mtp_jax.layers.fused import FusedLayout, block_columns, gate_up_layout, qkv_layout
from mtp_jax.layers.mla import MLACache
from mtp_jax.layers.moe import Experts
from mtp_jax.model import Transformer, init_model, sequence_positions
from mtp_jax.mtp import mtp_forward_full
from mtp_jax.quantization import FP8_MAX, Fp8Config, dequantize_fp8_blocks, quantize_fp8_blocks

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
BLOCK = (16, 8)  # (b_out, b_in): every width below leaves partial edge blocks
_COMMON = dict(
    vocab_size=64,
    hidden_size=40,
    intermediate_size=36,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=64,
    num_nextn_predict_layers=1,
    initializer_range=0.2,
    ffn_type="moe",
    moe_intermediate_size=20,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
)
CONFIGS = {
    "deepseek_v3": ModelConfig(
        **_COMMON,
        num_key_value_heads=4,
        attention_type="mla",
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=12,
        quantization=Fp8Config(weight_block_size=BLOCK),
    ),
    "glm4_moe": ModelConfig(
        **_COMMON,
        num_key_value_heads=2,
        head_dim=12,
        attention_bias=True,
        use_qk_norm=True,
        partial_rotary_factor=0.5,
        quantization=Fp8Config(weight_block_size=BLOCK, modules_to_not_convert=("o_proj",)),
    ),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)), jnp.int32)


# ------------------------------------------------------------------ the NumPy reference


@pytest.mark.parametrize("shape,block", [((200, 72), (128, 128)), ((40, 37), (16, 16)), ((33, 50), (16, 8))])
def test_quantize_blocks_partial_edges(shape, block):
    weight = np.random.default_rng(1).standard_normal(shape).astype(np.float32) * 3
    weight[: block[0], : block[1]] = 0  # an all-zero block: scale 1
    q, scale = quantize_fp8_blocks(weight, block)
    grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert q.dtype == F8 and q.shape == shape and scale.dtype == np.float32 and scale.shape == grid
    assert scale[0, 0] == 1 and not q[: block[0], : block[1]].astype(np.float32).any()
    for bo in range(grid[0]):
        for bi in range(grid[1]):
            tile = weight[bo * block[0] : (bo + 1) * block[0], bi * block[1] : (bi + 1) * block[1]]
            if tile.any():  # the block's amax maps onto +-448 exactly
                assert scale[bo, bi] == np.float32(np.abs(tile).max() / np.float32(FP8_MAX))
                tq = q[bo * block[0] : (bo + 1) * block[0], bi * block[1] : (bi + 1) * block[1]].astype(np.float32)
                assert np.abs(tq).max() == FP8_MAX
    back = dequantize_fp8_blocks(q, scale, block)
    assert back.dtype == np.float32
    per_value = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[: shape[0], : shape[1]]
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormal steps of 2^-9 times the scale
    np.testing.assert_array_less(np.abs(back - weight), np.abs(weight) * 2**-4 + per_value * 2**-10 + 1e-30)
    np.testing.assert_array_equal(back, q.astype(np.float32) * per_value)


def test_reference_errors():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blocks(np.zeros(4), (2, 2))
    with pytest.raises(ValueError, match="NaN"):
        quantize_fp8_blocks(np.full((2, 2), np.inf), (2, 2))
    with pytest.raises(ValueError, match="scale_inv must have shape"):
        dequantize_fp8_blocks(np.zeros((5, 5), F8), np.ones((3, 2), np.float32), (4, 4))
    with pytest.raises(ValueError, match=r"weight_block_size\[1\]"):
        quantize_fp8_blocks(np.zeros((2, 2)), (2, 0))


def test_fused_layouts_join_split_and_index_blocks():
    qkv = qkv_layout(4, 2, 3)  # q [12] = heads 0..3, k, v [6]: group g = heads 2g, 2g + 1, k_g, v_g
    q, k, v = np.arange(12), 100 + np.arange(6), 200 + np.arange(6)
    fused = qkv.fuse([q, k, v])
    np.testing.assert_array_equal(
        fused, [*range(6), 100, 101, 102, 200, 201, 202, *range(6, 12), *range(103, 106), *range(203, 206)]
    )
    assert [p.tolist() for p in qkv.unfuse(fused)] == [q.tolist(), k.tolist(), v.tolist()]
    np.testing.assert_array_equal(gate_up_layout(3).fuse([np.arange(3), 10 + np.arange(3)]), [0, 10, 1, 11, 2, 12])
    # q's blocks of 4 are scale columns 0-2, k's 3-4, v's 5-6; each fused column names its own
    np.testing.assert_array_equal(
        block_columns(qkv, 4), [0, 0, 0, 0, 1, 1, 3, 3, 3, 5, 5, 5, 1, 1, 2, 2, 2, 2, 3, 4, 4, 5, 6, 6]
    )
    np.testing.assert_array_equal(block_columns(gate_up_layout(5), 2), [0, 3, 0, 3, 1, 4, 1, 4, 2, 5])
    np.testing.assert_array_equal(block_columns(FusedLayout((5, 7)), 4), [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3])
    assert FusedLayout((5, 7)).blocks(4) == FusedLayout((2, 2))
    with pytest.raises(ValueError, match="multiples of groups=2"):
        FusedLayout((4, 3), groups=2)


def test_quantize_is_deepseek_block_quantization_of_each_piece():
    """A fresh FP8 kernel: each piece of a fused layout quantized per (b_out x b_in) block, partial edge
    blocks included, as `quantize_fp8_blocks` quantizes its HF weight; its scales in the pieces' block columns."""
    layout = qkv_layout(4, 2, 12)  # q [48], k, v [24]: 3, 2, 2 blocks of 16 columns
    q, k, v = np.random.default_rng(4).standard_normal((3, 37, 48)).astype(np.float32)  # 5 blocks of 8 rows
    weight = layout.fuse([q, k[:, :24] * 0, v[:, :24]])  # [37, 96]; k: all-zero blocks, scale 1
    kernel, scale = quantize(jnp.asarray(weight), BLOCK, layout)
    assert kernel.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32 and scale.shape == (5, 7)
    bounds = np.cumsum(layout.blocks(BLOCK[0]).widths)[:-1]
    kernels, scales = layout.unfuse(np.asarray(kernel)), np.split(np.asarray(scale), bounds, axis=-1)
    for piece, q, piece_scale in zip(layout.unfuse(weight), kernels, scales, strict=True):
        _, want_scale = quantize_fp8_blocks(piece.T, BLOCK)  # HF [out_p, in]
        # amax / 448: XLA multiplies by the rounded reciprocal, 1 ulp off NumPy's division at most
        np.testing.assert_allclose(piece_scale.T, want_scale, rtol=2**-22, atol=0)
        per_value = np.repeat(np.repeat(piece_scale.T, BLOCK[0], 0), BLOCK[1], 1)[: q.shape[1], : q.shape[0]]
        want_q = np.clip(piece.T / per_value, -FP8_MAX, FP8_MAX).astype(F8)  # its values rounded alike
        assert q.T.tobytes() == want_q.tobytes()
    assert (scales[1] == 1).all()
    want = layout.fuse([dequantize_fp8_blocks(q.T, s.T, BLOCK).T for q, s in zip(kernels, scales, strict=True)])
    np.testing.assert_array_equal(np.asarray(dequantize(kernel, scale, BLOCK, layout, jnp.float32)), want)
    with pytest.raises(ValueError, match=r"scale_inv must have shape \(5, 7\)"):
        dequantize(kernel, scale[:, :6], BLOCK, layout, jnp.float32)


def test_fp8_config_validation_and_rule():
    assert Fp8Config(weight_block_size=[64, 32], modules_to_not_convert=["gate"]) == Fp8Config(
        weight_block_size=(64, 32), modules_to_not_convert=("gate",)
    )
    for bad, field in [((128,), "weight_block_size"), ((128, 0), r"weight_block_size\[1\]"), ((1.0, 2), r"\[0\]")]:
        with pytest.raises(ValueError, match=field):
            Fp8Config(weight_block_size=bad)
    for bad, field in [("o_proj", "modules_to_not_convert"), ((1,), r"modules_to_not_convert\[0\]")]:
        with pytest.raises(ValueError, match=field):
            Fp8Config(modules_to_not_convert=bad)
    with pytest.raises(ValueError, match="quantization must be an Fp8Config"):
        ModelConfig.from_name("tiny", quantization={"quant_method": "fp8"})
    rule = Fp8Config(modules_to_not_convert=("shared_experts", "kv_b"))
    assert rule.quantizes("self_attn.o_proj") and rule.quantizes("mlp.experts")
    assert not rule.quantizes("mlp.shared_experts.down_proj") and not rule.quantizes("self_attn.kv_b_proj")
    assert not rule.quantizes("lm_head") and not rule.quantizes("eh_proj")


# ------------------------------------------------------------------ models


def _flat(model) -> dict:
    return {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _scale_path(path: tuple) -> tuple:
    return (*path[:-1], f"{path[-1]}_scale_inv")


def _kernel_path(scale_path: tuple) -> tuple:
    return (
        *scale_path[:-1],
        "kernel" if scale_path[-1] == "kernel_scale_inv" else scale_path[-1][: -len("_scale_inv")],
    )


def _scale_columns(kernel_path: tuple, out: int, config: ModelConfig) -> np.ndarray:
    """Each column's scale column as the files lay them out: `names.fuse` of the pieces' block numbers
    (piece p's column j: the blocks of the pieces before p + j // b_out)."""
    b_out = config.quantization.weight_block_size[0]
    widths = piece_widths(kernel_path, out, config)
    offsets = np.cumsum([0, *(-(-w // b_out) for w in widths[:-1])])
    return np.asarray(
        fuse(kernel_path, [np.arange(w) // b_out + o for w, o in zip(widths, offsets, strict=True)], config)
    )


def _dequantized(kernel, scale, b_in: int, columns: np.ndarray) -> np.ndarray:
    """float32(kernel [.., in, out]) * scale [.., i // b_in, columns[c]], in NumPy."""
    per_weight = np.repeat(np.asarray(scale)[..., columns], b_in, axis=-2)[..., : kernel.shape[-2], :]
    return np.asarray(kernel).astype(np.float32) * per_weight


def _plain_twin(model) -> Transformer:
    """The unquantized float32 model holding `model`'s dequantized weights (scales placed by `names`)."""
    config = model.config.replace(quantization=None)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    fp8, b_in = _flat(model), model.config.quantization.weight_block_size[1]
    flat = []
    for path, v in nnx.to_flat_state(params):
        value = fp8[path]
        if _scale_path(path) in fp8:
            columns = _scale_columns(path, value.shape[-1], model.config)
            value = _dequantized(value, fp8[_scale_path(path)], b_in, columns)
        flat.append((path, v.replace(jnp.asarray(value, v.get_value().dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _scrambled_scales(model, seed: int = 0):
    """`model` with every block scale times a random power of two in [1/4, 4]."""
    rng = np.random.default_rng(seed)
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if is_scale(path):
            v.set_value(v.get_value() * 2.0 ** rng.integers(-2, 3, v.get_value().shape))
    return model


def _all_logits(model, tokens):
    """The main model's logits and the MTP module's, float32 [B, T, V] each (jitted afresh: traced per call)."""

    def run(model, tokens):
        logits, hidden = model.forward_full(tokens)
        return [logits, *mtp_forward_full(model, hidden, tokens)]

    return nnx.jit(run)(model, tokens)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp8_params_dtypes_bytes_and_axes(name):
    model = init_model(CONFIGS[name])
    flat, b_in = _flat(model), BLOCK[1]
    plain = _flat(nnx.eval_shape(lambda: Transformer(CONFIGS[name].replace(quantization=None), rngs=nnx.Rngs(0))))
    expected, quantized = 0, set()
    for path, value in plain.items():
        if _scale_path(path) in flat:  # 1 byte per weight, 4 per (b_out x b_in) block of each HF piece
            *lead, rows, cols = value.shape
            blocks = sum(-(-w // BLOCK[0]) for w in piece_widths(path, cols, CONFIGS[name]))
            expected += value.size + 4 * int(np.prod(lead, dtype=int)) * -(-rows // b_in) * blocks
            quantized.add(".".join(map(str, path)))
        else:
            expected += value.size * 4
    assert sum(v.nbytes for v in flat.values()) == expected
    assert "layers.1.mlp.experts.gate_up_proj" in quantized and "layers.0.mlp.down_proj.kernel" in quantized
    never = {"lm_head.kernel", "mtp.0.eh_proj.kernel"}  # and the router
    assert not quantized & never and not any("gate.weight" in p for p in quantized)
    assert ("layers.0.self_attn.o_proj.kernel" in quantized) == (name == "deepseek_v3")  # GLM's listed
    metadata = {p: v.get_metadata() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for path, value in flat.items():
        if is_scale(path):  # replicated but for the routed experts' axis
            kernel = _kernel_path(path)
            assert value.dtype == jnp.float32 and flat[kernel].dtype == jnp.float8_e4m3fn
            axes = metadata[kernel]["logical_axes"]
            assert metadata[path]["logical_axes"] == (*axes[:-2], None, None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_fp8_layer_finds_its_scales_where_the_files_put_them(name):
    """Every FP8 layer's static column -> scale-column index (`block_columns` of the layout its module gave
    it) is `names.fuse` of its HF pieces' block numbers: fused q/k/v, gate/up (dense, shared, routed experts),
    MLA's q_a/kv_a and the unfused linears (b_out = 16: partial edge blocks in most pieces)."""
    config = CONFIGS[name]
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    checked = set()
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Fp8Linear):
            kernels = [((*path, "kernel"), module.layout, module.block)]
        elif isinstance(module, Experts) and module.block is not None:
            kernels = [((*path, k), module._layout(k), module.block) for k in ("gate_up_proj", "down_proj")]
        else:
            continue
        for kernel, layout, block in kernels:
            assert block == BLOCK and layout.width == getattr(module, kernel[-1]).shape[-1]
            columns = _scale_columns(kernel, layout.width, config)
            np.testing.assert_array_equal(block_columns(layout, BLOCK[0]), columns, err_msg=str(kernel))
            checked.add(".".join(str(p) for p in kernel if not isinstance(p, int)))
    fused = {
        "layers.mlp.gate_up_proj.kernel",
        "layers.mlp.experts.gate_up_proj",
        "layers.mlp.shared_experts.gate_up_proj.kernel",
    }
    fused.add(
        "layers.self_attn.fused_qkv_a_proj.kernel" if name == "deepseek_v3" else "layers.self_attn.qkv_proj.kernel"
    )
    assert fused <= checked, checked
    assert ("mtp.self_attn.o_proj.kernel" in checked) == (name == "deepseek_v3")  # GLM's listed unquantized


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp8_model_equals_its_dequantized_twin(name):
    """Per-block scales (scrambled, so each block's own scale must be the one applied, found by the files'
    layout): logits of the main model and the MTP module equal the float32 model's on the dequantized weights
    (MLA: absorbed, T <= 32)."""
    model = _scrambled_scales(init_model(CONFIGS[name]))
    for a, b in zip(_all_logits(model, TOKENS), _all_logits(_plain_twin(model), TOKENS), strict=True):
        assert a.shape == (2, 7, 64)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_mla_absorbed_and_decompressed_use_the_dequantized_kv_b_proj():
    model = _scrambled_scales(init_model(CONFIGS["deepseek_v3"]), seed=2)
    twin = _plain_twin(model)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 40)), jnp.float32)
    positions = sequence_positions(2, 5)
    for absorbed in (True, False):

        def attend(attn, absorbed=absorbed):
            return attn(x, positions, MLACache.init(attn.config, 2, 8), absorbed=absorbed)[0]  # [B, T, E]

        got, want = nnx.jit(attend)(model.layers[1].self_attn), nnx.jit(attend)(twin.layers[1].self_attn)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_scanned_fp8_model_equals_unrolled():
    config = CONFIGS["deepseek_v3"]
    unrolled, scanned = init_model(config), init_model(config.replace(scan_layers=True))
    assert _flat(scanned)[("layer_groups", 1, "layer", "mlp", "experts", "gate_up_proj")].dtype == jnp.float8_e4m3fn
    for a, b in zip(_all_logits(unrolled, TOKENS), _all_logits(scanned, TOKENS), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    exported, again = hf_tensors(unrolled), hf_tensors(scanned)
    assert list(exported) == list(again)
    assert all(exported[n].dtype == again[n].dtype and exported[n].tobytes() == again[n].tobytes() for n in exported)


# ------------------------------------------------------------------ export


def _read_all(file) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as NumPy (through torch: its NumPy reader has no float8)."""
    out = {}
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            out[name] = t.view(torch.uint8).numpy().view(F8) if t.dtype == torch.float8_e4m3fn else t.numpy()
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_export_is_deepseek_fp8_and_bit_exact(tmp_path, name):
    config = CONFIGS[name]
    model = _scrambled_scales(init_model(config), seed=1)
    save_hf_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["quantization_config"]["weight_block_size"] == list(BLOCK)
    assert config_from_hf(hf).quantization == config.quantization
    files, exported = _read_all(tmp_path / "model.safetensors"), hf_tensors(model)
    assert list(files) == sorted(exported)
    assert all(files[n].dtype == exported[n].dtype and files[n].tobytes() == exported[n].tobytes() for n in files)
    layout = tensor_layout(nnx.state(model, nnx.Param), config)
    assert sorted(layout) == sorted(set(files) - set(shared_copies(config)))  # all but the MTP layer's copies
    for tensor, (path, transposed, shape, dtype) in layout.items():
        assert files[tensor].shape == shape and files[tensor].dtype == dtype
        assert transposed or not (is_scale(path) or files[tensor].dtype == F8)
    # The checkpoint's own dequantization (per HF block) of every weight is our dequantized kernel's piece.
    flat, b_in = _flat(model), BLOCK[1]
    for path, value in flat.items():
        if not is_scale(path):
            continue
        kernel = _kernel_path(path)
        ours = _dequantized(flat[kernel], value, b_in, _scale_columns(kernel, flat[kernel].shape[-1], config))
        names = [n for n, _ in hf_names(kernel, config)]
        slices = list(ours.reshape(-1, *ours.shape[-2:]))
        pieces = [p for s in slices for p in unfuse(kernel, s, config)]
        for hf_name, piece in zip(names, pieces, strict=True):
            w = dequantize_fp8_blocks(files[hf_name], files[hf_name + "_scale_inv"], BLOCK)
            np.testing.assert_array_equal(w, piece.T, err_msg=hf_name)
    layer = f"model.layers.{config.num_hidden_layers}"
    np.testing.assert_array_equal(files[f"{layer}.embed_tokens.weight"], files["model.embed_tokens.weight"])
    np.testing.assert_array_equal(files[f"{layer}.shared_head.head.weight"], files["lm_head.weight"])
    assert files["lm_head.weight"].dtype == files[f"{layer}.eh_proj.weight"].dtype == np.float32


def test_modules_to_not_convert_that_split_a_fused_module_are_named():
    model = nnx.eval_shape(lambda: init_model(CONFIGS["glm4_moe"]))
    check_quantized_modules(nnx.state(model, nnx.Param), model.config)  # "o_proj": a whole module
    for entry, module in [("up_proj", "model.layers.0.mlp.up_proj"), ("layers.1.", "model.layers.1.mlp")]:
        config = model.config.replace(quantization=Fp8Config(weight_block_size=BLOCK, modules_to_not_convert=(entry,)))
        with pytest.raises(ValueError, match=module):
            check_quantized_modules(nnx.state(model, nnx.Param), config)


# ------------------------------------------------------------------ config.json

DEEPSEEK_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_config_reads_deepseek_quantization_config():
    hf = {**config_to_hf(CONFIGS["deepseek_v3"].replace(quantization=None)), "quantization_config": DEEPSEEK_QUANT}
    assert config_from_hf(hf).quantization == Fp8Config(weight_block_size=(128, 128))
    minimal = {"quant_method": "fp8", "weight_block_size": [128, 64], "modules_to_not_convert": ["lm_head", "gate"]}
    read = config_from_hf({**hf, "quantization_config": minimal}).quantization
    assert read == Fp8Config(weight_block_size=(128, 64), modules_to_not_convert=("lm_head", "gate"))
    assert config_to_hf(CONFIGS["deepseek_v3"].replace(quantization=read))["quantization_config"] == {
        **DEEPSEEK_QUANT,
        "weight_block_size": [128, 64],
        "modules_to_not_convert": ["lm_head", "gate"],
    }
    assert "quantization_config" not in config_to_hf(CONFIGS["deepseek_v3"].replace(quantization=None))


@pytest.mark.parametrize(
    "quant,field",
    [
        *[
            ({"quant_method": method, "bits": 4}, f"quant_method='{method}'")
            for method in ("gptq", "awq", "compressed-tensors", "mxfp4", "bitsandbytes", "fbgemm_fp8", "bitnet")
        ],
        ({"bits": 4}, "quant_method=None"),
        ({**DEEPSEEK_QUANT, "fmt": "e5m2"}, "fmt='e5m2'"),
        ({**DEEPSEEK_QUANT, "activation_scheme": "static"}, "activation_scheme='static'"),
        ({"quant_method": "fp8"}, "weight_block_size is missing"),
        ({**DEEPSEEK_QUANT, "weight_block_size": [128]}, "weight_block_size must be"),
        ({**DEEPSEEK_QUANT, "weight_block_size": [128, 0]}, "weight_block_size must be"),
        ({**DEEPSEEK_QUANT, "weight_block_size": "128"}, "weight_block_size must be a list"),
        ({**DEEPSEEK_QUANT, "modules_to_not_convert": [1]}, r"modules_to_not_convert\[0\]"),
        ("fp8", "quantization_config must be an object"),
    ],
)
def test_config_refuses_other_quantization(quant, field):
    hf = {**config_to_hf(CONFIGS["deepseek_v3"].replace(quantization=None)), "quantization_config": quant}
    with pytest.raises(ValueError, match=field) as error:
        config_from_hf(hf)
    if "quant_method=" in field:
        assert "only block-scaled 'fp8'" in str(error.value)
