"""Block-scaled FP8 weights as DeepSeek-V3 ships them: the config (`Fp8Config`) and the NumPy reference.

DeepSeek-V3 / R1 and GLM-4.5-FP8 checkpoints (config.json `quantization_config`: `quant_method` "fp8",
`fmt` "e4m3", `activation_scheme` "dynamic", `weight_block_size` [b_out, b_in]) store each quantized
linear as `<module>.weight` float8_e4m3fn [out, in] and `<module>.weight_scale_inv` float32
[ceil(out / b_out), ceil(in / b_in)]: one scale per block of b_out x b_in weights, partial edge blocks
included, and the weight is `float32(weight[o, i]) * weight_scale_inv[o // b_out, i // b_in]`
(DeepSeek-V3's `inference/kernel.py` `weight_dequant`; transformers' `FineGrainedFP8Config`). Embeddings,
the head, norms, the MoE router and the MTP layer's `eh_proj` stay unquantized (`NEVER_QUANTIZED`).

On device (`mtp_jax.layers.fp8`) a quantized kernel keeps the transposed [in, out] layout and its scales
stay per block, transposed: [ceil(in / b_in), ceil(out / b_out)] (a fused projection: its pieces' blocks
side by side), 4 bytes per b_out x b_in weights as in the files.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from mtp_jax.validation import check_int

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)  # the NumPy dtype of the weights (jnp.float8_e4m3fn on device)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
# Modules kept unquantized whatever `modules_to_not_convert` says (names within a layer, as `Fp8Config.quantizes`
# takes them): the head (transformers never converts the output embedding) and DeepSeek's MTP `eh_proj`
# (a plain linear in vLLM's and SGLang's DeepSeek MTP, bf16 in DeepSeek-V3's files).
NEVER_QUANTIZED = ("lm_head", "eh_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Config:
    """Block-scaled FP8 weights (`quantization_config` of DeepSeek-V3's config.json).

    weight_block_size: (b_out, b_in), the block of weights one scale covers, output rows first as in
      the HF [out, in] weight (DeepSeek-V3: (128, 128)).
    modules_to_not_convert: module names kept unquantized: a linear stays in `param_dtype` when any
      entry is a substring of its name (transformers' rule; names as `quantizes` takes them).
    quantize_mtp: whether the MTP modules (checkpoint layers `model.layers.{L + k}`) follow this rule
      too (True, as the files hold them). False keeps them unquantized in float `param_dtype` beside the
      FP8 trunk (`mtp.make_mtp_modules`): heads-only training (`load_hf_checkpoint(..., dequantize_mtp=True)`)
      updates float32 master weights there. A load-time choice, not part of config.json's
      `quantization_config` (`hf_config` neither reads nor writes it; run.json keeps it).

    Raises ValueError naming the field for block sizes that are not two ints >= 1, entries that are
    not strings, or a `quantize_mtp` that is not a bool. Lists are accepted and stored as tuples (the
    config is hashable).
    """

    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()
    quantize_mtp: bool = True

    def __post_init__(self):
        block = self.weight_block_size
        if not isinstance(block, (tuple, list)) or len(block) != 2:
            raise ValueError(f"weight_block_size must be two ints (b_out, b_in), got {block!r}")
        block = tuple(check_int(f"weight_block_size[{k}]", b, 1) for k, b in enumerate(block))
        object.__setattr__(self, "weight_block_size", block)
        modules = self.modules_to_not_convert
        if isinstance(modules, str) or not isinstance(modules, (tuple, list)):
            raise ValueError(f"modules_to_not_convert must be a tuple of strings, got {modules!r}")
        for k, module in enumerate(modules):
            if not isinstance(module, str):
                raise ValueError(f"modules_to_not_convert[{k}] must be a string, got {module!r}")
        object.__setattr__(self, "modules_to_not_convert", tuple(modules))
        if not isinstance(self.quantize_mtp, bool):
            raise ValueError(f"quantize_mtp must be a bool, got {self.quantize_mtp!r}")

    def quantizes(self, name: str) -> bool:
        """Whether the linear named `name` is stored in FP8: its HF module path inside `model.layers.{i}`
        ("self_attn.o_proj", "mlp.shared_experts.gate_up_proj", "mlp.experts" for the stacked routed
        experts) or "lm_head". False for `NEVER_QUANTIZED` and when an entry of `modules_to_not_convert`
        is a substring of `name`."""
        return name not in NEVER_QUANTIZED and not any(entry in name for entry in self.modules_to_not_convert)


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


def _block_view(array: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """`array` [out, in] zero-padded to whole blocks, as [ceil(out/b0), b0, ceil(in/b1), b1]."""
    (out, n_in), (b0, b1) = array.shape, block
    padded = np.zeros((_blocks(out, b0) * b0, _blocks(n_in, b1) * b1), array.dtype)
    padded[:out, :n_in] = array
    return padded.reshape(_blocks(out, b0), b0, _blocks(n_in, b1), b1)


def _block_scales(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """`scale` [ceil(out/b0), ceil(in/b1)] repeated over each block and cut to `shape` [out, in]."""
    return np.repeat(np.repeat(scale, block[0], axis=0), block[1], axis=1)[: shape[0], : shape[1]]


def _check_block(block) -> tuple[int, int]:
    return Fp8Config(weight_block_size=block).weight_block_size


def quantize_fp8_blocks(weight: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's block quantization of one HF weight [out, in] (any real dtype).

    Each (b_out x b_in) block, edge blocks partial, gets `scale = amax(|block|) / FP8_MAX` (1 for an
    all-zero block); its values divided by the scale, clipped to +-FP8_MAX, are rounded to float8_e4m3fn
    (nearest even).

    Returns:
      (weight float8_e4m3fn [out, in], weight_scale_inv float32 [ceil(out/b_out), ceil(in/b_in)]):
      `dequantize_fp8_blocks` of them approximates `weight` to float8_e4m3fn's precision (3 mantissa
      bits; values far below their block's amax lose more, down to the subnormals).

    Raises:
      ValueError: `weight` is not 2-D or holds NaN or infinities, or `block` is not two ints >= 1.
    """
    block = _check_block(block)
    weight = np.asarray(weight, np.float32)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {weight.shape}")
    if not np.isfinite(weight).all():
        raise ValueError("weight holds NaN or infinite values")
    amax = np.abs(_block_view(weight, block)).max(axis=(1, 3))  # [ceil(out/b0), ceil(in/b1)]
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(weight / _block_scales(scale, weight.shape, block), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return q, scale


def dequantize_fp8_blocks(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """The float32 weight [out, in] of FP8 weight `q` [out, in] and its block scales `scale_inv`
    [ceil(out/b_out), ceil(in/b_in)]: `float32(q[o, i]) * scale_inv[o // b_out, i // b_in]`.

    Raises ValueError when `q` is not 2-D or `scale_inv` does not have the block grid's shape."""
    block = _check_block(block)
    q, scale_inv = np.asarray(q), np.asarray(scale_inv, np.float32)
    if q.ndim != 2:
        raise ValueError(f"q must be 2-D [out, in], got shape {q.shape}")
    grid = (_blocks(q.shape[0], block[0]), _blocks(q.shape[1], block[1]))
    if scale_inv.shape != grid:
        raise ValueError(f"scale_inv must have shape {grid} for q {q.shape} in blocks {block}, got {scale_inv.shape}")
    return q.astype(np.float32) * _block_scales(scale_inv, q.shape, block)
