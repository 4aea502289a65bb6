"""mtp_jax's exported Hugging Face directory -> the two directories vLLM loads (numpy and safetensors only).

`save_pretrained` / `save_hf_checkpoint` write one directory: a LlamaForCausalLM config.json and
safetensors with the main model plus the MTP modules at DeepSeek-V3's `model.layers.{L + k}.*`
names. `transformers` ignores those extra tensors; vLLM's Llama loader refuses them ("There is no
module or parameter named 'layers.L'"). So, with the same tensor values (nothing is recomputed):

- `target/`: config.json unchanged, the safetensors without `model.layers.{>= L}.*`. vLLM's plain
  and ngram runs, and the target model of its mtp run, load this.
- `mtp/`: the same model as a DeepSeek-V3 checkpoint with its MTP layer, for vLLM's mtp run
  (`LLM(model=<mtp dir>, speculative_config={"method": "mtp", "num_speculative_tokens": K})`: vLLM's
  DeepSeek MTP draft reads the target's config, so the target must be DeepSeek-shaped too; a Llama
  target with a separate DeepSeek MTP draft fails with "'LlamaConfig' object has no attribute
  'n_group'"). Its `deepseek_v3` config.json makes vLLM's `DeepseekV2DecoderLayer` a Llama block,
  MHA (`qk_nope_head_dim = qk_rope_head_dim = 0` selects `DeepseekAttention`, q/k/v/o, RoPE
  neox-style, no bias) and a dense SwiGLU MLP (`first_k_dense_replace` past every layer: no MoE
  layer), with the first MTP module only (`num_nextn_predict_layers = 1`): vLLM's proposer calls
  the MTP model with `spec_step_idx = 0` at every draft step, so module 1 is reused for K drafts,
  which is mtp_jax's `eagle` method. Tensors: the main model's unchanged (vLLM's DeepSeek loader
  fuses q/k/v itself), plus
  `model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm}`, `model.layers.L.shared_head.head.weight`
  (= lm_head: the MTP modules share the main head) and the MTP block's tensors, its q/k/v fused
  into `self_attn.qkv_proj.weight` (DeepSeek's MTP loader has no q/k/v -> qkv mapping). vLLM must
  run it with VLLM_MLA_DISABLE=1 (its config check wants an int `kv_lora_rank`, which otherwise
  turns MLA on).

Conventions that match mtp_jax's demo config (`mtp_concat_order: embedding_first`,
`mtp_hidden_after_norm`, `mtp_chain_after_shared_head_norm`): vLLM concatenates
[enorm(embedding), hnorm(hidden)], takes the target's hidden states after its final norm, and
feeds the draft's post-`shared_head.norm` hidden to the next draft step. One difference: vLLM zeroes
the MTP input embedding at position 0 (mtp_jax does not), which can only change acceptance, never
the greedy tokens.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _read(src: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return config, tensors


def mtp_supported(config: dict) -> str | None:
    """None when `to_vllm` can build an MTP draft for this config, else why not."""
    if config.get("model_type") != "llama":
        return f"model_type {config.get('model_type')!r} (only Llama-shaped mtp_jax exports are converted)"
    if not config.get("num_nextn_predict_layers"):
        return "no MTP modules"
    if config.get("mtp_style", "deepseek") != "deepseek":
        return f"mtp_style {config.get('mtp_style')!r}"
    if config.get("mtp_concat_order", "embedding_first") != "embedding_first":
        return "mtp_concat_order is not embedding_first (vLLM concatenates [embedding, hidden])"
    if not config.get("mtp_hidden_after_norm", True) or not config.get("mtp_chain_after_shared_head_norm", True):
        return "MTP hidden conventions differ from vLLM's (hidden after the final norm, chain after shared_head.norm)"
    heads, width = config["num_attention_heads"], config["hidden_size"]
    if config.get("head_dim", width // heads) * heads != width:
        return "head_dim * heads != hidden_size (vLLM's DeepseekAttention takes head_dim = hidden / heads)"
    if config.get("attention_bias") or config.get("mlp_bias"):
        return "biases (DeepseekAttention and DeepseekV2MLP have none)"
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        return f"rope scaling {rope.get('rope_type')!r}"
    return None


def to_vllm(src: str | Path, dst: str | Path) -> dict[str, str | None]:
    """Writes dst/target (and dst/mtp when supported); returns their paths and why mtp was skipped."""
    src, dst = Path(src), Path(dst)
    config, tensors = _read(src)
    num_layers = config["num_hidden_layers"]
    is_mtp = lambda name: name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers  # noqa: E731
    target = dst / "target"
    target.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v for k, v in tensors.items() if not is_mtp(k)},
        str(target / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, target / name)
    why = mtp_supported(config)
    if why is not None:
        return dict(target=str(target), mtp=None, mtp_skipped=why)

    layer = num_layers  # the first MTP module, model.layers.L
    p = f"model.layers.{layer}."
    draft = {k: v for k, v in tensors.items() if not is_mtp(k)}  # the main model, same tensors
    draft[p + "shared_head.head.weight"] = tensors["lm_head.weight"]
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ):
        draft[p + name] = tensors[p + name]
    draft[p + "self_attn.qkv_proj.weight"] = np.concatenate(
        [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], axis=0
    )
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    ds = {
        "architectures": ["DeepseekV3ForCausalLM"],  # the target; vLLM's "mtp" method reads the draft from it
        "model_type": "deepseek_v3",
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "intermediate_size": config["intermediate_size"],
        "moe_intermediate_size": config["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": config["num_attention_heads"],
        "num_key_value_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "head_dim": config["hidden_size"] // config["num_attention_heads"],
        "qk_nope_head_dim": 0,
        "qk_rope_head_dim": 0,
        "v_head_dim": 0,
        "q_lora_rank": None,
        "kv_lora_rank": 0,  # with VLLM_MLA_DISABLE=1 (see vllm_worker.py)
        "n_routed_experts": 1,
        "n_shared_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": num_layers + 1000,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "hidden_act": config.get("hidden_act", "silu"),
        "max_position_embeddings": config["max_position_embeddings"],
        "rms_norm_eps": config["rms_norm_eps"],
        "rope_theta": rope.get("rope_theta", 10000.0),
        "rope_parameters": rope,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "eos_token_id": config.get("eos_token_id"),
        "bos_token_id": config.get("bos_token_id"),
        "dtype": config.get("dtype", "float32"),
    }
    mtp = dst / "mtp"
    mtp.mkdir(parents=True, exist_ok=True)
    save_file(draft, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    (mtp / "config.json").write_text(json.dumps(ds, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, mtp / name)
    return dict(target=str(target), mtp=str(mtp), mtp_skipped=None)


if __name__ == "__main__":
    import sys

    print(json.dumps(to_vllm(sys.argv[1], sys.argv[2]), indent=2))
