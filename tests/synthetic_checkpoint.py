"""Random DeepSeek-V3-layout checkpoints of any size, written without building the model: for the
shard-streamed loading tests (`tests/test_load_large.py`) and `benchmarks/bench_load.py`.

`write_checkpoint(config, path)` takes every HF tensor name, shape and dtype from
`names.tensor_layout` of the abstract model (`nnx.eval_shape`: no parameter is materialised), adds
DeepSeek-V3's per-MTP-layer copies (`names.shared_copies`: `model.layers.{L + j}.embed_tokens` and
`shared_head.head`, equal to the shared tensors, as the real checkpoint stores them) and writes the
safetensors files itself, tensor by tensor (header, then the data in chunks of at most `CHUNK`
elements), plus the index and config.json (`hf_config.config_to_hf`). Host memory stays at one chunk
plus a pool of random values, and a 1.6 GB checkpoint takes a few seconds.

Values: each tensor is a window of a pool of `POOL_SIZE` (a prime) random bfloat16 bit patterns,
starting at an offset drawn from the tensor's name (a tensor longer than the pool goes round it again),
so distinct tensors and distinct parts of one tensor hold distinct values (a shard read from the wrong
rows or the wrong tensor differs: no row length divides the pool's), and a copy holds exactly its
source's values. Magnitudes: weights +-[2^-11, 2^-4) (mean |w| ~ 0.023, about
an initializer's 0.02), norm weights (`*norm.weight`) [1, 2); float32 tensors (the router's `gate`
and `e_score_correction_bias`) normal with std 0.02; every value finite (the loader refuses NaN/inf).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
from flax import nnx

from mtp_jax.checkpoints.format import CONFIG_FILE, INDEX_FILE
from mtp_jax.checkpoints.hf_config import config_to_hf
from mtp_jax.checkpoints.names import shared_copies, tensor_layout
from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer

POOL_SIZE = 16_777_259  # a prime just above 2^24: no tensor dimension divides it
CHUNK = 1 << 24  # elements per write (32 MB of bfloat16)
_SAFETENSORS_DTYPES = {  # what it can fill
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",  # DeepSeek-V3's FP8 weights (`ModelConfig.quantization`)
}


def _deepseek(**sizes) -> ModelConfig:
    """DeepSeek-V3's structure (MLA; one dense layer, then MoE layers with routed experts and a shared
    expert; one MTP layer; bfloat16) at the given sizes.

    Every token is routed to every expert (`num_experts_per_tok = n_routed_experts`, `topk_group = n_group`):
    the files are the same whatever the routing, and with a top-k choice a bfloat16 model's logits are not
    comparable across meshes (tensor parallelism sums in another order, which flips near-tied choices:
    with 4 of 32 experts, one of the 16 test positions of `LARGE` on `tensor=8` differed by 3.6 of 13.4,
    every other position by < 0.1; with every expert chosen, all by < 0.08)."""
    sizes.setdefault("num_experts_per_tok", sizes["n_routed_experts"])
    return ModelConfig(
        **dict(
            max_position_embeddings=4096,
            attention_type="mla",
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            ffn_type="moe",
            n_shared_experts=1,
            n_group=4,
            topk_group=4,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
            num_nextn_predict_layers=1,
            dtype="bfloat16",
            param_dtype="bfloat16",
        )
        | sizes
    )


# 1.61 GB of files (1.35 GB of parameters + 0.26 GB of MTP copies): 3 layers (1 dense, 2 MoE) + 1 MTP.
LARGE = _deepseek(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=512,
    kv_lora_rank=256,
    moe_intermediate_size=768,
    n_routed_experts=32,
)
# 0.22 GB of files (0.16 GB of parameters + 0.07 GB of MTP copies): 2 layers (1 dense, 1 MoE) + 1 MTP.
SMALL = _deepseek(
    vocab_size=16000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=384,
    kv_lora_rank=256,
    moe_intermediate_size=256,
    n_routed_experts=16,
)
# 4.4 MB: the same layout, to load once before measuring (the JAX runtime's first-use memory and compilations).
TINY = _deepseek(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=64,
    n_routed_experts=8,
)


def checkpoint_tensors(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], np.dtype, str]]:
    """HF name -> (shape, stored dtype, the name whose values it holds) for every tensor of `config`'s
    checkpoint, in file order: the model's tensors (`tensor_layout`, in the parameters' dtypes), each MTP
    layer's copies placed before that layer's first tensor (a tied model's `lm_head.weight` copy last)."""
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    layout = tensor_layout(nnx.state(abstract, nnx.Param), config)
    copies = {
        copy: (layout[source][2], np.dtype(layout[source][3]), source) for copy, source in shared_copies(config).items()
    }
    tensors = {}
    for name, (_, _, shape, dtype) in layout.items():
        layer = ".".join(name.split(".")[:3]) + "."  # "model.layers.{n}." (or a top-level name's)
        tensors.update({copy: entry for copy, entry in copies.items() if copy.startswith(layer)})
        tensors[name] = (shape, np.dtype(dtype), name)
    return tensors | {copy: entry for copy, entry in copies.items() if copy not in tensors}


def checkpoint_bytes(config: ModelConfig, *, copies_only: bool = False) -> int:
    """Bytes of tensor data in `config`'s checkpoint files (copies included), or of its copies only."""
    return sum(
        math.prod(shape) * dtype.itemsize
        for name, (shape, dtype, source) in checkpoint_tensors(config).items()
        if source != name or not copies_only
    )


def _bf16_pool(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, norms, fp8 weights): `POOL_SIZE` random bfloat16 bit patterns (uint16) each, +-[2^-11, 2^-4)
    and [1, 2), and float8_e4m3fn bit patterns (uint8) of the weights x 64 (their scales: float32 ~ N(0, 0.02^2))."""
    bits = np.random.default_rng(seed).integers(0, 1 << 16, POOL_SIZE, dtype=np.uint16)
    exponent = (bits >> 7) & 7  # 8 binades: biased exponents 116..123
    exponent += 116
    exponent <<= 7
    weights = (bits & 0x807F) | exponent  # sign and mantissa kept
    norms = (bits & 0x007F) | np.uint16(0x3F80)  # positive, exponent 127: [1, 2)
    fp8 = (weights.view(ml_dtypes.bfloat16).astype(np.float32) * 64).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return weights, norms, fp8


def _write_tensor(f, name: str, source: str, shape: tuple[int, ...], dtype: np.dtype, pools, seed: int) -> None:
    """Appends the values of tensor `name` (those of `source`: a copy holds its source's) to the open file."""
    size = math.prod(shape)
    rng = np.random.default_rng([seed, zlib.crc32(source.encode())])
    if dtype == np.float32:
        f.write((rng.standard_normal(size, np.float32) * np.float32(0.02)).tobytes())
        return
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{name}: synthetic values for dtype {dtype} are not implemented")
    if dtype == np.dtype(ml_dtypes.float8_e4m3fn):  # FP8 weights: the bfloat16 pool's values x 64, rounded
        pool = pools[2]
    else:
        pool = pools[1] if source.endswith("norm.weight") else pools[0]
    start = int(rng.integers(POOL_SIZE))
    done = 0
    while done < size:
        take = min(size - done, CHUNK, POOL_SIZE - start)
        f.write(pool[start : start + take].tobytes())
        done, start = done + take, (start + take) % POOL_SIZE


def _split(tensors: dict, max_shard_size_bytes: int) -> list[list[str]]:
    """Names in order, split greedily into files of at most `max_shard_size_bytes` (a bigger tensor alone)."""
    files, used = [[]], 0
    for name, (shape, dtype, _) in tensors.items():
        size = math.prod(shape) * dtype.itemsize
        if files[-1] and used + size > max_shard_size_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def write_checkpoint(config: ModelConfig, path: str | Path, *, max_shard_size_bytes: int = 300_000_000, seed=0) -> int:
    """Writes a random checkpoint of `config` into the directory `path` (created): config.json, the index and
    `model-0000i-of-0000n.safetensors` files of at most `max_shard_size_bytes` of tensor data each.

    Returns the bytes of tensor data written (`checkpoint_bytes`). Raises ValueError for a parameter
    dtype other than float32 / bfloat16 / float8_e4m3fn (an FP8 config's: its scales are float32)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(config)
    for name, (_, dtype, _) in tensors.items():
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: synthetic values for dtype {dtype} are not implemented")
    pools = _bf16_pool(seed)
    groups = _split(tensors, max_shard_size_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name in names:
            shape, dtype, _ = tensors[name]
            end = offset + math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
            offset = end
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(path / file, "wb") as f:
            f.write(len(encoded).to_bytes(8, "little") + encoded)
            for name in names:
                shape, dtype, source = tensors[name]
                _write_tensor(f, name, source, shape, dtype, pools, seed)
        weight_map.update(dict.fromkeys(names, file))
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (path / CONFIG_FILE).write_text(json.dumps(config_to_hf(config), indent=2) + "\n")
    return total
