"""Model configuration: a frozen, validated dataclass for Llama/Qwen2-family decoders.

The fields follow Hugging Face's `LlamaConfig` / `Qwen2Config` names so that `config.json`
maps onto them one to one (see `mtp_jax.checkpoints`). Invalid combinations raise a
`ValueError` that names the field.

Architectures: `attention_type` selects the attention and its cache layout ("gqa"; DeepSeek-V3's
"mla", multi-head latent attention with a compressed latent cache, arXiv 2405.04434 §2.1) and
`ffn_type` the feed-forward block ("dense" SwiGLU; "moe", DeepSeek-V3's mixture of experts with
shared experts, arXiv 2412.19437 §2.1.2). The MLA and MoE fields carry DeepSeek-V3's config.json
names; they are read only when their type is selected. The Transformer runs "gqa" + "dense" today;
the MLA and MoE layers live in `mtp_jax.layers`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from mtp_jax.quantization import Fp8Config
from mtp_jax.validation import check_int, is_finite_positive, is_real

# Cache attention (`mtp_jax.layers.attention.attend`): "auto" = the Pallas kernel on GPU where it applies.
ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MTP_STYLES = ("deepseek", "parallel")
MTP_CONCAT_ORDERS = ("embedding_first", "hidden_first")
# Where a checkpoint keeps its MTP layers (`mtp_jax.checkpoints.names`): DeepSeek-V3's `model.layers.{L + j}`,
# Qwen3.5's `mtp.*` (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `layers.0`, `norm`), MiMo's
# `model.mtp_layers.{j}` (`input_proj`, `token_layernorm`, `hidden_layernorm`, `final_layernorm`).
MTP_LAYOUTS = ("deepseek", "qwen3_5", "mimo")
# A decoder layer's token mixer (`layer_types`, Hugging Face's names): attention, or a Gated DeltaNet.
LAYER_TYPES = ("full_attention", "linear_attention")
ATTENTION_TYPES = ("gqa", "mla")
FFN_TYPES = ("dense", "moe")
MOE_SCORING_FUNCS = ("sigmoid", "softmax")
# `ModelConfig.scan_layers`'s default: unrolled, by benchmarks/bench_compile.py's measurements (ModelConfig's
# docstring gives them).
SCAN_LAYERS_DEFAULT = False
# Stop-token slots in the decode state (a fixed shape; unused slots hold -1): a request's stop tokens and
# a checkpoint's EOS ids are at most this many (`mtp_jax.decode.request`, `mtp_jax.checkpoints.reading`).
MAX_STOP_TOKENS = 16
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's `rope_scaling` / `rope_parameters` define it.

    rope_type: "default" (none), "linear" (positions / factor), "llama3" (Llama 3.1's
    wavelength-banded scaling) or "yarn" (Peng et al. 2023, arXiv 2309.00071, with its
    attention temperature `attention_factor`).
    """

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn (DeepSeek-V3)
    mscale_all_dim: float | None = None  # yarn (DeepSeek-V3)
    attention_factor: float | None = None  # yarn; derived from factor when None
    truncate: bool = True  # yarn

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        # Ratios and rotation counts: finite and > 0 (yarn's correction range takes log(1 / beta)).
        for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not is_finite_positive(value):
                raise ValueError(f"rope_scaling.{name} must be a finite number > 0, got {value!r}")
        for name in ("mscale", "mscale_all_dim"):  # yarn's log-scale coefficients: 0 is allowed
            value = getattr(self, name)
            if value is not None and not (is_real(value) and math.isfinite(value)):
                raise ValueError(f"rope_scaling.{name} must be a finite number, got {value!r}")
        if self.rope_type in ("llama3", "yarn") and self.original_max_position_embeddings is None:
            raise ValueError(f"rope_scaling.original_max_position_embeddings is required for {self.rope_type!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must be > low_freq_factor for 'llama3'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer of the Llama/Qwen2 family.

    RMSNorm, RoPE (rotate-half layout, as in Hugging Face), grouped-query attention with optional
    q/k/v bias, SwiGLU MLP, tied or untied embeddings. Sizes are in elements; `dtype` is the
    compute dtype and `param_dtype` the storage dtype of the weights ("float32", "bfloat16" or
    "float16").

    `quantization` (an `mtp_jax.quantization.Fp8Config`, or None) stores the linear layers' weights as
    DeepSeek-V3's block-scaled FP8: a float8_e4m3fn kernel plus float32 block scales, dequantized to
    `dtype` inside each forward (`mtp_jax.layers.fp8`); the linears its `quantizes` rule leaves out (the
    head, MTP's `eh_proj`, `modules_to_not_convert`) and every other parameter (embeddings, norms, the
    MoE router) stay in `param_dtype`, as do the whole MTP modules with `quantize_mtp=False`.

    `scan_layers` defaults to False (unrolled), chosen by `benchmarks/bench_compile.py` (CPU, 2 shared
    cores, fp32, `benchmarks/results/compile_cpu_2026-12-01.json`). Compile time of prefill + an eagle
    loop for a tiny DeepSeek-V3-shaped model: unrolled 10.7 s at 2 layers, 35.0 s at 61 (3.3x); scanned
    9.2 s and 7.7 s (flat in depth). Greedy decode at batch 1, scanned / unrolled tok/s: Llama-shaped
    (preset "small") 0.95 at cache capacity 104 and 0.67 at 2048 (the scan copies each layer's cache
    slice out of and back into the stacked carry every step, in proportion to the capacity);
    DeepSeek-V3-shaped (MLA's small latent cache) 1.98 and 1.19. The dense GQA models this library
    mostly runs decode slower scanned, and unrolled keeps `model.layers` and the existing runs'
    checkpoint layout; deep models, where compile time dominates (DeepSeek-V3's 61 layers), should set
    `scan_layers=True`.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # defaults to hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    attention_bias: bool = False  # q/k/v projection bias (Qwen2: True)
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_type: str = "gqa"
    ffn_type: str = "dense"
    # GLM-4.5 style GQA: RoPE on the first partial_rotary_factor of each head, optional q/k RMSNorm.
    partial_rotary_factor: float = 1.0
    use_qk_norm: bool = False
    # MLA (attention_type="mla", DeepSeek-V2/V3): q_lora_rank None = a full-rank q_proj; the cache holds
    # kv_lora_rank latent + qk_rope_head_dim rope-key entries per position; heads have qk_nope_head_dim +
    # qk_rope_head_dim query/key and v_head_dim value entries. rope_interleave: the rope dims of q and
    # k_pe come interleaved (DeepSeek's checkpoints) and are permuted to rotate-half before RoPE.
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_interleave: bool = True
    # MoE (ffn_type="moe", DeepSeek-V3 / GLM-4.5): the first first_k_dense_replace layers stay dense
    # (intermediate_size); the others route each token to num_experts_per_tok of n_routed_experts experts
    # (moe_intermediate_size each) chosen within the topk_group best of n_group groups by
    # scores + e_score_correction_bias, weighted by the scores (normalised if norm_topk_prob) times
    # routed_scaling_factor, plus n_shared_experts always-on experts.
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    scoring_func: str = "sigmoid"
    # Qwen3.5-MoE's shared expert: its width (None: moe_intermediate_size x n_shared_experts, DeepSeek-V3's
    # `shared_experts`), and `shared_expert_gate`: the shared expert's output scaled by sigmoid(x @ w) per token
    # (then named `shared_expert`, as Qwen's checkpoints name it).
    shared_expert_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    # Hybrid models (Qwen3.5, Qwen3-Next): layer_types[i] is layer i's token mixer, "full_attention" or
    # "linear_attention" (a Gated DeltaNet, `mtp_jax.layers.gated_deltanet`, arXiv 2412.06464, with
    # linear_num_key_heads x linear_key_head_dim query/key heads, linear_num_value_heads x linear_value_head_dim
    # value heads and a causal depthwise conv of width linear_conv_kernel_dim); None: all full attention.
    # MTP layers are full attention.
    layer_types: tuple[str, ...] | None = None
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Qwen3.5's gated attention: q_proj yields per head a query and an output gate ([H, 2D], query first);
    # the attention output is multiplied by sigmoid(gate) before o_proj.
    attn_output_gate: bool = False
    # Zero-centred RMSNorm weights (Qwen3.5): stored around 0 and applied as (1 + w) * norm(x), for every
    # RMSNorm but the Gated DeltaNet's gated output norm.
    rms_norm_unit_offset: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Block-scaled FP8 weights (DeepSeek-V3's `quantization_config`, `mtp_jax.quantization`); None: none.
    quantization: Fp8Config | None = None
    # Cache attention (`mtp_jax.layers.attention.attend`): "auto" = the Pallas kernel on GPU, else the reference.
    attention_impl: str = "auto"
    # Layer layout (`mtp_jax.model.Transformer`): False keeps one module per layer, run in a Python loop;
    # True stores each run of consecutive layers of one kind (`layer_groups`: DeepSeek-V3's dense layers,
    # then its MoE layers) as one module with a leading layer axis on every parameter, run under
    # `jax.lax.scan` against a cache stacked likewise. Same weights and HF checkpoints either way; not in
    # config.json (a layout, not the model). SCAN_LAYERS_DEFAULT says why the default is what it is.
    scan_layers: bool = SCAN_LAYERS_DEFAULT
    initializer_range: float = 0.02
    # Token ids the tokenizer defines; generation stops at eos_token_id unless told otherwise.
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Multi-Token Prediction modules (`mtp_jax.mtp`; docs/MTP_SPEC.md "MTP modules"). D = 0: none.
    num_nextn_predict_layers: int = 0  # D, as in DeepSeek-V3's config.json
    # "deepseek": DeepSeek-V3's sequential modules (arXiv 2412.19437 §2.2); "parallel": Gloeckle et al.
    # 2024 (arXiv 2404.19737) independent heads, each one block over the trunk's hidden state.
    mtp_style: str = "deepseek"
    # Checkpoint conventions (defaults: DeepSeek-V3 as vLLM, SGLang and TRT-LLM load it).
    # eh_proj input: concat(enorm(embed), hnorm(h)) ("embedding_first") or the reverse ("hidden_first", MiMo).
    mtp_concat_order: str = "embedding_first"
    # h^0 is the main model's hidden state after its final norm (True: serving engines) or before it.
    mtp_hidden_after_norm: bool = True
    # The h^k handed to depth k + 1 (and to the next draft step) is taken after shared_head.norm
    # (True: TRT-LLM, SGLang) or before it, straight from the block (False: vLLM).
    mtp_chain_after_shared_head_norm: bool = True
    # MiMo: the embedding of the token at position 0 enters its MTP layer as zeros.
    mtp_zero_embedding_at_start: bool = False
    # The checkpoint's names for the MTP layers (`MTP_LAYOUTS`).
    mtp_layout: str = "deepseek"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            _check_int(self, name, 1)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )
        if self.head_dim is not None and (self.head_dim < 2 or self.head_dim % 2):
            raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {self.head_dim}")
        if self.head_dim is None and self.resolved_head_dim % 2:
            raise ValueError(f"head_dim (hidden_size / num_attention_heads = {self.resolved_head_dim}) must be even")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            if not is_finite_positive(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)!r}")
        if not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling, got {type(self.rope_scaling).__name__}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act must be 'silu' (SwiGLU), got {self.hidden_act!r}")
        if self.attention_type not in ATTENTION_TYPES:
            raise ValueError(f"attention_type must be one of {ATTENTION_TYPES}, got {self.attention_type!r}")
        if self.ffn_type not in FFN_TYPES:
            raise ValueError(f"ffn_type must be one of {FFN_TYPES}, got {self.ffn_type!r}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.rotary_dim % 2:
            raise ValueError(
                f"the rotary part of a head (partial_rotary_factor x head_dim = {self.rotary_dim}) must be even"
            )
        for name in ("use_qk_norm", "rope_interleave", "norm_topk_prob", "scan_layers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.attention_type == "mla":
            self._check_mla()
        if self.ffn_type == "moe":
            self._check_moe()
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {tuple(_DTYPES)}, got {getattr(self, name)!r}")
        if self.quantization is not None and not isinstance(self.quantization, Fp8Config):
            raise ValueError(f"quantization must be an Fp8Config or None, got {type(self.quantization).__name__}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        for name in ("bos_token_id",):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} must be in [0, vocab_size={self.vocab_size}), got {value}")
        for token in self.eos_token_ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"eos_token_id must be in [0, vocab_size={self.vocab_size}), got {token}")
        _check_int(self, "num_nextn_predict_layers", 0)
        if self.mtp_style not in MTP_STYLES:
            raise ValueError(f"mtp_style must be one of {MTP_STYLES}, got {self.mtp_style!r}")
        if self.mtp_concat_order not in MTP_CONCAT_ORDERS:
            raise ValueError(f"mtp_concat_order must be one of {MTP_CONCAT_ORDERS}, got {self.mtp_concat_order!r}")
        for name in ("mtp_hidden_after_norm", "mtp_chain_after_shared_head_norm", "mtp_zero_embedding_at_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mtp_layout not in MTP_LAYOUTS:
            raise ValueError(f"mtp_layout must be one of {MTP_LAYOUTS}, got {self.mtp_layout!r}")
        self._check_hybrid()

    def _check_hybrid(self) -> None:
        for name in ("attn_output_gate", "rms_norm_unit_offset", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.shared_expert_intermediate_size is not None:
            _check_int(self, "shared_expert_intermediate_size", 1)
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, str) or not hasattr(self.layer_types, "__len__"):
            raise ValueError(f"layer_types must be a sequence of {LAYER_TYPES}, got {self.layer_types!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}] must be one of {LAYER_TYPES}, got {kind!r}")
        if "linear_attention" in self.layer_types:
            for name in ("linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads"):
                _check_int(self, name, 1)
            _check_int(self, "linear_num_value_heads", 1)
            _check_int(self, "linear_conv_kernel_dim", 2)
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                    f"linear_num_key_heads ({self.linear_num_key_heads})"
                )
            if self.attention_type == "mla":
                raise ValueError("linear_attention layers are supported with attention_type='gqa' only")

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _check_int(self, name, 1)
        if self.q_lora_rank is not None:
            _check_int(self, "q_lora_rank", 1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")

    def _check_moe(self) -> None:
        for name in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            _check_int(self, name, 1)
        for name in ("n_shared_experts", "first_k_dense_replace"):
            _check_int(self, name, 0)
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group ({self.n_group})"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        per_group = self.n_routed_experts // self.n_group
        if self.num_experts_per_tok > self.topk_group * per_group:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {self.topk_group} x "
                f"{per_group} experts of the topk_group best groups"
            )
        if self.scoring_func not in MOE_SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {MOE_SCORING_FUNCS}, got {self.scoring_func!r}")
        if not is_finite_positive(self.routed_scaling_factor):
            raise ValueError(f"routed_scaling_factor must be a finite number > 0, got {self.routed_scaling_factor!r}")

    # Derived values.
    @property
    def rotary_dim(self) -> int:
        """Entries of each GQA head that RoPE rotates (all, unless partial_rotary_factor < 1)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> str:
        """Decoder layer `layer`'s token mixer (`LAYER_TYPES`); MTP layers (numbered from L on) are full attention."""
        if self.layer_types is None or layer >= self.num_hidden_layers:
            return "full_attention"
        return self.layer_types[layer]

    @property
    def is_hybrid(self) -> bool:
        """Whether some layer is a Gated DeltaNet, whose cache is a recurrent state (`mtp_jax.cache.RecurrentCache`)."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (0-based) has the MoE feed-forward block."""
        return self.ffn_type == "moe" and layer >= self.first_k_dense_replace

    @property
    def layer_groups(self) -> tuple[range, ...]:
        """The runs of consecutive decoder layers of one kind (the same modules and shapes), in order.

        One run for a dense model; DeepSeek-V3 / GLM-4.5: the dense layers [0, first_k_dense_replace)
        (when any), then the MoE layers up to num_hidden_layers; a hybrid model: each run of one
        `layer_type`. With `scan_layers` each run is one stacked module (`mtp_jax.layers.decoder.DecoderStack`).
        """
        kinds = [(self.layer_type(i), self.is_moe_layer(i)) for i in range(self.num_hidden_layers)]
        starts = [i for i in range(self.num_hidden_layers) if i == 0 or kinds[i] != kinds[i - 1]]
        return tuple(range(a, b) for a, b in zip(starts, [*starts[1:], self.num_hidden_layers], strict=True))

    @property
    def resolved_head_dim(self) -> int:
        """D, the per-head size."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head (H / G)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def compute_dtype(self) -> Any:
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self) -> Any:
        return _DTYPES[self.param_dtype]

    @property
    def attention_scale(self) -> float:
        """Softmax scale 1/sqrt(D) (YaRN's attention factor is folded into cos/sin, as in HF)."""
        return 1.0 / math.sqrt(self.resolved_head_dim)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        """A named preset (see `PRESETS`), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


def _check_int(config: ModelConfig, name: str, minimum: int) -> None:
    """`validation.check_int` on a field, which then holds a Python int (a NumPy int is accepted)."""
    object.__setattr__(config, name, check_int(name, getattr(config, name), minimum))


PRESETS: dict[str, ModelConfig] = {
    # The bundled demo model (`mtp_jax/assets/demo`): 6 layers of width 192, 3 heads of 64, vocab 4096
    # (the stdlib BPE tokenizer), D = 3 MTP modules; about 5.8M parameters.
    "demo": ModelConfig(
        vocab_size=4096,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=3,
        num_key_value_heads=3,
        max_position_embeddings=1024,
        num_nextn_predict_layers=3,
    ),
    # For tests: every code path, in milliseconds.
    "tiny": ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    # Qwen2-style tiny: q/k/v bias, tied embeddings.
    "tiny-qwen2": ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
    ),
    # The benchmark's small model: a few layers of width 512.
    "small": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    # About 200M parameters (0.8 GB in fp32): far larger than CPU caches.
    "medium": ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    # DeepSeek-V3's shape at the benchmark's small scale: MLA (q/kv low-rank, rope/nope split), one dense
    # layer then MoE layers (sigmoid routing, 4 groups, 16 routed experts of which 4 per token, 1 shared);
    # about 28M parameters.
    "deepseek-v3-small": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        attention_type="mla",
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        ffn_type="moe",
        moe_intermediate_size=256,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
    ),
    # Qwen3.5's shape at the benchmark's small scale: 3 Gated DeltaNet layers then one gated-attention layer
    # (full_attention_interval 4), 8 query / 2 KV heads of 64 with q/k norm and RoPE on a quarter of each head,
    # linear attention with 4 key heads and 8 value heads of 64, zero-centred norms, one MTP layer in `mtp.*`.
    "qwen3.5-small": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        partial_rotary_factor=0.25,
        use_qk_norm=True,
        attn_output_gate=True,
        rms_norm_unit_offset=True,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_nextn_predict_layers=1,
        mtp_layout="qwen3_5",
    ),
    # Full-size architectures, for memory plans and abstract lowering (`mtp_jax.memory_plan`): never
    # initialise their weights (671.0B / 352.8B / 106.9B parameters, 682.6B / 356.8B / 109.2B with the MTP
    # layer), load them from a checkpoint. The fields are the checkpoints' config.json (what `config_from_hf`
    # reads from it, `tests/test_memory_plan.py` checks), stored in bfloat16, with `scan_layers=True` (deep
    # models compile flat in depth scanned).
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3, arXiv 2412.19437): 61 layers (3 dense, then MoE) + 1 MTP layer,
    # MLA, 256 routed experts of which 8 per token in 4 of 8 groups, 1 shared, YaRN x40 from 4096 positions.
    "deepseek-v3": (
        _deepseek_v3 := ModelConfig(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            num_hidden_layers=61,
            num_attention_heads=128,
            num_key_value_heads=128,
            max_position_embeddings=163840,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            rope_scaling=RopeScaling(
                rope_type="yarn",
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            attention_type="mla",
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            ffn_type="moe",
            moe_intermediate_size=2048,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_shared_experts=1,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            first_k_dense_replace=3,
            bos_token_id=0,
            eos_token_id=1,
            num_nextn_predict_layers=1,
            dtype="bfloat16",
            param_dtype="bfloat16",
            scan_layers=True,
        )
    ),
    # DeepSeek-V3 as its checkpoint ships: block-scaled FP8 linears (128 x 128 blocks), MTP's eh_proj in bf16.
    "deepseek-v3-fp8": _deepseek_v3.replace(
        quantization=Fp8Config(weight_block_size=(128, 128), modules_to_not_convert=("eh_proj",))
    ),
    # GLM-4.5 (zai-org/GLM-4.5, 355B-A32B): 92 layers (3 dense, then MoE) + 1 MTP layer, GQA 96 heads / 8 KV
    # heads of 128 with q/k/v bias, q/k norm and RoPE on half of each head, 160 routed experts of which 8 per
    # token (sigmoid, no group limit), 1 shared.
    "glm-4.5": (
        _glm_4_5 := ModelConfig(
            vocab_size=151552,
            hidden_size=5120,
            intermediate_size=12288,
            num_hidden_layers=92,
            num_attention_heads=96,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            rope_theta=1000000.0,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            ffn_type="moe",
            moe_intermediate_size=1536,
            n_routed_experts=160,
            num_experts_per_tok=8,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=3,
            eos_token_id=(151329, 151336, 151338),
            num_nextn_predict_layers=1,
            dtype="bfloat16",
            param_dtype="bfloat16",
            scan_layers=True,
        )
    ),
    # GLM-4.5-Air (zai-org/GLM-4.5-Air, 106B-A12B): 46 layers (1 dense, then MoE) + 1 MTP layer, GLM-4.5's
    # attention without q/k norm, 128 routed experts of which 8 per token, 1 shared, no routed scaling.
    "glm-4.5-air": _glm_4_5.replace(
        hidden_size=4096,
        intermediate_size=10944,
        num_hidden_layers=46,
        use_qk_norm=False,
        moe_intermediate_size=1408,
        n_routed_experts=128,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
    ),
}
# The presets above that are real models' full-size architectures: configs for memory plans and abstract
# lowering (`mtp_jax.memory_plan`, `mtp-jax plan`), never initialised (`mtp-jax train` refuses them).
FULL_SIZE_PRESETS = frozenset({"deepseek-v3", "deepseek-v3-fp8", "glm-4.5", "glm-4.5-air"})
