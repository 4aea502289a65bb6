"""The one mapping between mtp_jax parameter paths and Hugging Face tensor names.

Names: our parameter paths are HF's module names (see `mtp_jax.model`), so `hf_name` is the one
place that maps them: `layers.3.mlp.down_proj.kernel` is `model.layers.3.mlp.down_proj.weight`.
Linear kernels are stored [in, out] here and [out, in] (torch's layout) in the files. A fused
projection (`FUSED_MODULES`: `self_attn.qkv_proj`, `mlp.gate_up_proj`, MLA's `fused_qkv_a_proj`) holds
the HF modules it stands for in its output axis, one tensor each in the files (`fuse`, `unfuse`, in the
layout the layer computes with, `mtp_jax.layers.fused`):
`qkv_proj.kernel` [E, (H + 2G) D] is `q_proj.weight` [H D, E], `k_proj.weight` and `v_proj.weight`
[G D, E] group-major ([E, G, H/G + 2, D]: KV head g's H/G query heads, k_g, v_g), `gate_up_proj`
[E, 2I] is `gate_proj.weight` and `up_proj.weight` [I, E] interleaved ([E, I, 2]), so that a
contiguous shard of the output axis (tensor parallelism, `mtp_jax.sharding`) is self-contained;
`fused_qkv_a_proj` is `q_a_proj` then `kv_a_proj_with_mqa` side by side. The MoE's stacked routed
experts [R, in, out] are R tensor sets `mlp.experts.{r}.<proj>.weight` [out, in] there (`hf_names`),
and a scanned model's stacked layer groups (`ModelConfig.scan_layers`, `layer_groups.{g}.layer.<path>`
[n, ...]) one tensor set per layer, under the unrolled layout's names: both layouts read and write
the same files. The router `mlp.gate.weight` [R, E] and `mlp.gate.e_score_correction_bias` [R] are
as they are (float32, whatever the dtype of the rest). MTP modules are imported and exported in
`ModelConfig.mtp_layout`'s names: DeepSeek-V3's (README_WEIGHTS.md), module j's `mtp.j.<name>` being
`model.layers.{L + j}.<name>`, with `num_nextn_predict_layers` plus mtp_jax's conventions (`MTP_CONVENTION_FIELDS`)
in config.json; Qwen3.5's `mtp.*` and MiMo's `model.mtp_layers.{j}.*` (`mtp_jax.checkpoints.families.mtp_name`).
Qwen3.5's linear-attention layers are `linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}` (kernels,
transposed as any), `linear_attn.conv1d.weight` [C, 1, W] (as stored, not transposed), `linear_attn.dt_bias`,
`linear_attn.A_log` [Hv] (float32) and `linear_attn.norm.weight` [Dv]; its norms are stored zero-centred, as HF's.
Block-scaled FP8 models (`ModelConfig.quantization`, DeepSeek-V3's format) add a scale per quantized kernel
(`is_scale`): `<module>.kernel_scale_inv` [ceil(in/b_in), sum_p ceil(out_p/b_out)] (`mtp_jax.layers.fp8`) is
each piece's `<module>.weight_scale_inv` [ceil(out_p/b_out), ceil(in/b_in)] transposed, the pieces side by
side (never interleaved: a block of b_out columns is one scale), stacked as its kernel.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax.checkpoints import families
from mtp_jax.config import ModelConfig
from mtp_jax.layers.fused import FusedLayout, gate_up_layout, qkv_layout
from mtp_jax.model import per_layer_path
from mtp_jax.quantization import NEVER_QUANTIZED

# A fused module (several HF modules that read the same input, computed as one matmul) -> the HF
# modules it holds in its output (last) axis, in this order (`fuse` gives the layout).
FUSED_MODULES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),  # `mtp_jax.layers.attention.Attention`
    "gate_up_proj": ("gate_proj", "up_proj"),  # `mtp_jax.layers.ffn.MLP`, `mtp_jax.layers.moe.Experts`
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # `mtp_jax.layers.mla.MLAttention`
}


def hf_name(path: tuple[str | int, ...], config: ModelConfig) -> tuple[str, bool]:
    """The HF tensor name of one unfused, unstacked parameter path and whether it is transposed.

    The whole mapping: `lm_head.*` stays at top level, main-model paths get the `model.` prefix,
    MTP module j's paths `mtp.j.<name>` become `model.layers.{L + j}.<name>` (DeepSeek-V3; the other
    `mtp_layout`s: `families.mtp_name`); leaf
    `kernel` [in, out] is `weight` [out, in], an FP8 kernel's `kernel_scale_inv` [ceil(in/b_in), ceil(out/b_out)]
    is `weight_scale_inv` [ceil(out/b_out), ceil(in/b_in)] (transposed too), `embedding` is `weight`, others
    keep their name. Fused and stacked parameters are several tensors: `hf_names`.
    """
    *modules, leaf = (str(p) for p in path)
    if modules[0] == "lm_head":
        prefix = []
    elif modules[0] == "mtp" and config.mtp_layout != "deepseek":
        prefix, modules = families.mtp_name(modules[2:], int(modules[1]), config), []
    elif modules[0] == "mtp":
        prefix, modules = ["model", "layers", str(config.num_hidden_layers + int(modules[1]))], modules[2:]
    else:
        prefix = ["model"]
    name = {"kernel": "weight", "embedding": "weight", "kernel_scale_inv": "weight_scale_inv"}.get(leaf, leaf)
    return ".".join([*prefix, *modules, name]), leaf in ("kernel", "kernel_scale_inv")


_SCALE = "_scale_inv"  # an FP8 kernel's scale: `kernel_scale_inv`, the experts' `{gate_up,down}_proj_scale_inv`


def is_scale(path: tuple[str | int, ...]) -> bool:
    """Whether the parameter at `path` is an FP8 kernel's block scales (`kernel_scale_inv` [.., ceil(in/b_in),
    sum_p ceil(out_p/b_out)], the routed experts' `gate_up_proj_scale_inv` / `down_proj_scale_inv`), float32."""
    return str(path[-1]).endswith(_SCALE)


def _is_experts(path: tuple[str | int, ...]) -> bool:
    """Whether `path` is a stacked routed-expert tensor (`...mlp.experts.{gate_up,down}_proj`, [R, in, out]),
    or its FP8 scale (`..._proj_scale_inv`, [R, ceil(in/b_in), sum_p ceil(out_p/b_out)])."""
    return (
        len(path) >= 2
        and str(path[-2]) == "experts"
        and str(path[-1]).removesuffix(_SCALE) in ("gate_up_proj", "down_proj")
    )


def tensor_axes(path: tuple[str | int, ...]) -> int:
    """How many leading axes of the parameter at `path` enumerate separate tensors of the files (0, 1 or 2):
    a stacked layer group's layer axis (`ModelConfig.scan_layers`), then the routed experts' axis."""
    return (str(path[0]) == "layer_groups") + _is_experts(path)


def _module_at(path: tuple[str | int, ...]) -> int:
    """The index in `path` of its module's name: the last entry for stacked experts, else the one before the leaf."""
    return len(path) - (1 if _is_experts(path) else 2)


def _module(path: tuple[str | int, ...]) -> str:
    """The name of the module the parameter at `path` belongs to (a stacked expert's scale: its kernel's)."""
    return str(path[_module_at(path)]).removesuffix(_SCALE)


def _pieces(path: tuple[str | int, ...]) -> list[tuple[str | int, ...]]:
    """The unfused paths a (per-layer) parameter path stands for: itself, or a fused module's (`FUSED_MODULES`)
    paths with each of its HF modules in its place, in order (a stacked expert's scale: the kernels' paths)."""
    at, module = _module_at(path), _module(path)
    return [(*path[:at], piece, *path[at + 1 :]) for piece in FUSED_MODULES.get(module, (module,))]


def output_layout(path: tuple[str | int, ...], width: int, config: ModelConfig) -> FusedLayout:
    """The output layout of one slice of the parameter at `path` (last axis of size `width`): its HF tensors'
    widths and how they are joined (`mtp_jax.layers.fused`, the layouts the layers compute with):

      - `qkv_proj`: q [H D], k, v [G D], group-major: for each KV head g its H/G query heads
        g * (H/G) .. (g + 1) * (H/G) - 1 (those that read it, HF's GQA), then k_g, v_g (`qkv_layout`);
      - `gate_up_proj`: gate, up [I] interleaved: column 2i is gate_i, 2i + 1 is up_i (`gate_up_layout`);
      - `fused_qkv_a_proj` (replicated over `tensor`, so never split): q_lora_rank, then C + R, side by side;
      - anything else: its one tensor `[width]`;
      - an FP8 scale (`is_scale`): its kernel's pieces' blocks of b_out columns, side by side
        (`FusedLayout.blocks`).
    """
    module, c = _module(path), config
    if module == "gate_up_proj":  # a scale's halves: ceil(I / b_out) blocks each
        return FusedLayout((width // 2, width // 2)) if is_scale(path) else gate_up_layout(width // 2)
    if module == "qkv_proj":
        fused = qkv_layout(c.num_attention_heads, c.num_key_value_heads, c.resolved_head_dim, gated=c.attn_output_gate)
    elif module == "fused_qkv_a_proj":
        fused = FusedLayout((c.q_lora_rank, c.kv_lora_rank + c.qk_rope_head_dim))
    else:
        return FusedLayout((width,))
    return fused.blocks(c.quantization.weight_block_size[0]) if is_scale(path) else fused


def piece_widths(path: tuple[str | int, ...], width: int, config: ModelConfig) -> list[int]:
    """The last-axis widths of the HF tensors (ours [..., out_p]) that one slice of the parameter at `path`
    (last axis of size `width`) holds, in `_pieces` order: `output_layout`'s widths."""
    return list(output_layout(path, width, config).widths)


def fuse(path: tuple[str | int, ...], pieces: list[np.ndarray], config: ModelConfig) -> np.ndarray:
    """One slice of the parameter at `path` from the HF tensors it holds (`_pieces` order, ours [..., out_p]
    each, e.g. a kernel [E, out_p] or a bias [out_p]), in its `output_layout`; `unfuse` inverts it. NumPy."""
    return output_layout(path, sum(np.shape(p)[-1] for p in pieces), config).fuse(pieces)


def unfuse(path: tuple[str | int, ...], array: np.ndarray, config: ModelConfig) -> list[np.ndarray]:
    """The HF tensors (ours [..., out_p] each, `_pieces` order) that one slice `array` of the parameter at
    `path` holds: `fuse`'s inverse, by reshapes and slices only (bit-exact)."""
    return output_layout(path, np.shape(array)[-1], config).unfuse(array)


def hf_names(path: tuple[str | int, ...], config: ModelConfig) -> list[tuple[str, bool]]:
    """The HF tensors of one parameter path: [(name, transposed)], one per tensor in the files.

    `hf_name`'s single tensor, except for stacked and fused parameters. Stacked ones are one tensor set
    per slice of their `tensor_axes` leading axes, in row-major order, and a fused one (`FUSED_MODULES`)
    is, per slice, one tensor per HF module it holds in its last axis, in `FUSED_MODULES` order
    (`_pieces`, `piece_widths`, `fuse`):
      - the MoE's routed experts (`mtp_jax.layers.moe`): `...mlp.experts.gate_up_proj` [R, E, 2I] is
        the 2R tensors `...mlp.experts.{r}.gate_proj.weight`, `...mlp.experts.{r}.up_proj.weight` [I, E]
        (the transposes of slice r's even and odd columns, interleaved), `down_proj` [R, I, E] the R tensors
        `...mlp.experts.{r}.down_proj.weight` [E, I]; this is DeepSeek-V3's and GLM-4.5's layout,
        which transformers 5 stacks on load and splits on save (Qwen3.5's fused files are read as these
        names: `families.tensor_views`);
      - a layer group's parameters (`layer_groups.{g}.layer.<path>`, [n, ...], `ModelConfig.scan_layers`):
        slice i is layer `start + i`'s `<path>` (`mtp_jax.model.per_layer_path`), so both layouts
        read and write the same files. A stacked layer's experts are n x R tensor sets, layer-major;
      - an FP8 scale (`is_scale`) is its kernel's tensors with `weight_scale_inv` for `weight`.
    """
    names = []
    for layer_path in per_layer_path(path, config):
        pieces = _pieces(layer_path)
        if not _is_experts(layer_path):
            names += [hf_name(piece, config) for piece in pieces]
            continue
        base, _ = hf_name((*layer_path[:-1], "kernel"), config)  # "...mlp.experts.weight"
        stem, leaf = base[: -len(".weight")], "weight_scale_inv" if is_scale(layer_path) else "weight"
        names += [(f"{stem}.{r}.{piece[-1]}.{leaf}", True) for r in range(config.n_routed_experts) for piece in pieces]
    return names


def tensor_layout(params: nnx.State, config: ModelConfig) -> dict[str, tuple[tuple, bool, tuple[int, ...], Any]]:
    """HF name -> (our path, transposed, HF shape, our dtype) for every tensor in the files, in model order.

    A kernel piece [in, out_p] is HF [out_p, in]; an FP8 scale piece (`is_scale`, ours [ceil(in/b_in),
    ceil(out_p/b_out)]) is HF [ceil(out_p/b_out), ceil(in/b_in)] float32, its transpose.
    """
    layout = {}
    for path, variable in nnx.to_flat_state(params):
        shape, dtype = tuple(variable.get_value().shape), variable.get_value().dtype
        shape = shape[tensor_axes(path) :]  # one slice's: e.g. one expert's [in, out]
        widths = piece_widths(path, shape[-1], config)
        for k, (name, transposed) in enumerate(hf_names(path, config)):
            piece = (*shape[:-1], widths[k % len(widths)])  # one tensor's: a fused slice's piece
            layout[name] = (path, transposed, piece[::-1] if transposed else piece, dtype)
    return layout


def check_quantized_modules(params: nnx.State, config: ModelConfig) -> None:
    """Checks that the model's FP8 linears (`params`: `nnx.state(model, nnx.Param)`) are exactly the HF modules
    that transformers' rule quantizes: every one whose full name (`model.layers.3.mlp.gate_proj`) contains
    no entry of `config.quantization.modules_to_not_convert`, `NEVER_QUANTIZED` aside.

    The model decides per fused module and per layer-relative name (`Fp8Config.quantizes`), so an entry that
    names one piece of a fused projection ("up_proj"), one routed expert ("experts.3.") or one layer
    ("layers.2.") has no layout here. No-op without `config.quantization`; the MTP modules are left out when
    `Fp8Config.quantize_mtp` is False (held unquantized whatever the files hold).

    Raises:
      ValueError listing the HF modules whose quantization differs, and the entries.
    """
    fp8 = config.quantization
    if fp8 is None:
        return
    wrong = []
    for path, variable in nnx.to_flat_state(params):
        if not (str(path[-1]) == "kernel" or (_is_experts(path) and not is_scale(path))):
            continue
        if str(path[0]) == "mtp" and not fp8.quantize_mtp:
            continue
        quantized = variable.get_value().dtype == jnp.float8_e4m3fn
        for name, _ in hf_names(path, config):
            module = name.removesuffix(".weight")
            if module.split(".")[-1] in NEVER_QUANTIZED:
                continue
            if quantized == any(entry in module for entry in fp8.modules_to_not_convert):
                wrong.append(f"{module} ({'FP8' if quantized else 'unquantized'} here)")
    if wrong:
        raise ValueError(
            f"quantization_config.modules_to_not_convert {list(fp8.modules_to_not_convert)} splits modules this "
            "model quantizes as one (each fused projection, all routed experts, the same module in every layer): "
            f"{', '.join(wrong[:8])}" + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else "")
        )


def mtp_layers_present(names: Iterator[str], config: ModelConfig) -> int:
    """How many MTP layers the tensor `names` hold: distinct `model.layers.{n}` with n >= L (max n + 1 - L);
    in the other `mtp_layout`s, `families.mtp_layers_present`."""
    if config.mtp_layout != "deepseek":
        return families.mtp_layers_present(names, config)
    layers = {int(m.group(1)) for name in names if (m := re.match(r"model\.layers\.(\d+)\.", name))}
    extra = [n for n in layers if n >= config.num_hidden_layers]
    return max(extra) + 1 - config.num_hidden_layers if extra else 0


def shared_copies(config: ModelConfig) -> dict[str, str]:
    """Tensors a checkpoint may carry as copies of shared ones: copy name -> the name it must equal.

    Tied models may still store `lm_head.weight`; DeepSeek-V3 stores each MTP layer's
    `embed_tokens` and `shared_head.head` (README_WEIGHTS.md), which here are the main model's (the
    other `mtp_layout`s store none).
    """
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    copies = {"lm_head.weight": head} if config.tie_word_embeddings else {}
    for j in range(config.num_nextn_predict_layers if config.mtp_layout == "deepseek" else 0):
        layer = f"model.layers.{config.num_hidden_layers + j}"
        copies[f"{layer}.embed_tokens.weight"] = "model.embed_tokens.weight"
        copies[f"{layer}.shared_head.head.weight"] = head
    return copies
