"""FP8 checkpoints for tests, as DeepSeek-V3 ships them, made from a float model: every weight the config's
`Fp8Config` quantizes becomes float8_e4m3fn + a float32 `weight_scale_inv` per (b_out x b_in) block
(`quantize_fp8_blocks`, partial edge blocks included), the rest stays as it is; and the same checkpoint
dequantized (`float32(weight) * scale`), the reference a loaded FP8 model must compute exactly."""

import json
import re

import numpy as np
from safetensors.numpy import save_file

from mtp_jax.checkpoints import CONFIG_FILE, WEIGHTS_FILE, config_to_hf, hf_tensors
from mtp_jax.checkpoints.tensor_reads import TensorFile
from mtp_jax.quantization import NEVER_QUANTIZED, Fp8Config, dequantize_fp8_blocks, quantize_fp8_blocks

# HF modules that DeepSeek-V3 / GLM-4.5 FP8 files keep unquantized besides NEVER_QUANTIZED.
_FLOAT_MODULES = re.compile(r"(embed_tokens|shared_head\.head|mlp\.gate)$")  # norms and biases: 1-D


def quantized_names(tensors: dict[str, np.ndarray], fp8: Fp8Config) -> list[str]:
    """The 2-D `.weight` tensors of a float checkpoint that `fp8` stores in FP8."""
    names = []
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or tensor.ndim != 2 or _FLOAT_MODULES.search(module):
            continue
        if module.split(".")[-1] in NEVER_QUANTIZED or any(e in module for e in fp8.modules_to_not_convert):
            continue
        names.append(name)
    return names


def write_fp8_checkpoint(model, fp8: Fp8Config, path, dequantized_path=None) -> dict[str, np.ndarray]:
    """Writes `model` (float) block-quantized into `path` (config.json with `quantization_config`, one
    safetensors file) and, with `dequantized_path`, its dequantized float32 twin there (no
    `quantization_config`). Returns the FP8 file's tensors."""
    tensors = {name: np.asarray(t, np.float32) for name, t in hf_tensors(model).items()}
    quantized, plain = {}, {}
    for name, tensor in tensors.items():
        quantized[name] = plain[name] = tensor
    for name in quantized_names(tensors, fp8):
        q, scale = quantize_fp8_blocks(tensors[name], fp8.weight_block_size)
        quantized[name], quantized[f"{name}_scale_inv"] = q, scale
        plain[name] = dequantize_fp8_blocks(q, scale, fp8.weight_block_size)
    config = model.config.replace(quantization=fp8)
    path.mkdir(parents=True, exist_ok=True)
    save_file(quantized, path / WEIGHTS_FILE, metadata={"format": "pt"})
    (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(config)))
    if dequantized_path is not None:
        dequantized_path.mkdir(parents=True, exist_ok=True)
        save_file(plain, dequantized_path / WEIGHTS_FILE, metadata={"format": "pt"})
        (dequantized_path / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config)))
    return quantized


def load_tensors(file) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, float8 included (safetensors' NumPy reader has no float8)."""
    tensors = TensorFile(file, file)
    try:
        return {name: tensors.read(name) for name in tensors.entries}
    finally:
        tensors.close()
