"""Parity with Hugging Face `transformers` for Qwen3.5 (`Qwen3_5ForCausalLM`) and Qwen3.5-MoE
(`Qwen3_5MoeForCausalLM`): hybrid Gated DeltaNet / gated-attention layers, zero-centred norms, partial rotary,
softmax-routed experts with a gated shared expert, and the `mtp.*` MTP head.

Tiny random float32 models with eager attention, saved by `save_pretrained`, with a random MTP head added to the
safetensors (`mtp_num_hidden_layers: 1`; transformers ignores `mtp.*`). Weights ~ N(0, 0.2^2); the zero-centred
norms' weights ~ N(0, 0.2^2) (they scale by 1 + w: a norm read without its unit offset scales by about 0.2
instead); the Gated DeltaNet's output norm ~ 1 + N(0, 0.2^2); `A_log` and `dt_bias` ~ N(0, 0.5^2). The MoE
model's routing on the inputs used is at least `MIN_MARGIN` from a tie (forward hooks on transformers' routers),
so a float32 rounding cannot flip an expert choice. The MoE MTP block comes from transformers'
`Qwen3_5MoeDecoderLayer`, whose routed experts are fused (`experts.gate_up_proj` [R, 2I, E]), as Qwen's own
checkpoints store them, while `save_pretrained` writes the main layers' experts one by one.
"""

from __future__ import annotations

import functools
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import (
    add_to_checkpoint,
    assert_close,
    causal_mask,
    hf_config,
    hf_greedy,
    hf_logits,
    load_hf_model,
    our_first_mtp_module,
    our_logits,
    perturbed,
    random_hf_model,
    relative_error,
    torch,
    transformers,
)
from safetensors.numpy import load_file

from mtp_jax.checkpoints import CheckpointError, config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.decode.generation import SamplingParams, generate
from mtp_jax.mtp import shift_left

VOCAB, HIDDEN, STD, MIN_MARGIN = 128, 64, 0.2, 1e-3
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
HF_CONFIGS = {
    "dense": ("Qwen3_5TextConfig", "Qwen3_5DecoderLayer", "Qwen3_5RMSNorm", dict(intermediate_size=96)),
    "moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeDecoderLayer",
        "Qwen3_5MoeRMSNorm",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    ),
}
STDS = {"A_log": 0.5, "dt_bias": 0.5, "mlp.gate.weight": 0.5}
# exp(A_log) ~ 0.14: a decay that keeps the chunked recurrence's float32 cumulative log-decays (over 64 tokens) small;
# A ~ 1 sums them to hundreds, whose rounding alone puts transformers' float32 logits 1e-5 from float64's.
A_LOG_MEAN = -2.0
SEEDS = {"dense": 0, "moe": 7}  # draws without near-ties in routing or greedy choices (checked in each test)


class RoutingMargins:
    """Forward hooks on every transformers softmax router (`mlp.gate`): the smallest gap between the k-th and
    (k+1)-th largest router logits of any routing decision (softmax is monotone: a tie there is a tie in choice)."""

    def __init__(self, *modules):
        self.margins = []
        self.handles = [
            router.register_forward_hook(self._hook)
            for module in modules
            for name, router in module.named_modules()
            if name.endswith("mlp.gate")
        ]

    def _hook(self, router, inputs, _):
        x = inputs[0].reshape(-1, router.weight.shape[1]).double()
        ranked = (x @ router.weight.double().T).sort(dim=-1, descending=True).values
        self.margins.append((ranked[:, router.top_k - 1] - ranked[:, router.top_k]).min().item())

    def check(self):
        """Removes the hooks; asserts no decision was within `MIN_MARGIN` of a tie."""
        for handle in self.handles:
            handle.remove()
        assert not self.margins or min(self.margins) > MIN_MARGIN, f"routing near-tie: margin {min(self.margins):.2e}"


def _config(kind: str):
    config_class, _, _, extra = HF_CONFIGS[kind]
    return hf_config(config_class, **_COMMON, **extra)


def _mtp_modules(kind: str, config, seed: int) -> dict:
    """A random MTP head from transformers' modules: `fc` Linear(2H, H), the three zero-centred norms and the decoder
    layer of a full-attention layer index (Qwen3.5's MTP block)."""
    _, layer_class, norm_class, _ = HF_CONFIGS[kind]
    module = (
        transformers.models.qwen3_5_moe.modeling_qwen3_5_moe
        if kind == "moe"
        else transformers.models.qwen3_5.modeling_qwen3_5
    )
    torch.manual_seed(seed)
    modules = {
        "fc": torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False),
        "pre_fc_norm_embedding": getattr(module, norm_class)(HIDDEN, config.rms_norm_eps),
        "pre_fc_norm_hidden": getattr(module, norm_class)(HIDDEN, config.rms_norm_eps),
        "norm": getattr(module, norm_class)(HIDDEN, config.rms_norm_eps),
        "layers.0": getattr(module, layer_class)(config, LAYER_TYPES.index("full_attention")),
    }
    return {name: _zero_centred(perturbed(m, STD, stds=STDS)).eval() for name, m in modules.items()}


def _zero_centred(module):
    """`module` with the weights of its zero-centred norms (all but the Gated DeltaNet's output norm) moved from
    `perturbed`'s 1 + N(0, s^2) to N(0, s^2), and `A_log` by `A_LOG_MEAN`."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                param.sub_(1.0)
            elif name.endswith("A_log"):
                param.add_(A_LOG_MEAN)
    return module


@functools.cache
def _saved(kind: str, root: str):
    """(HF model, MTP modules) of a random `kind` model saved in `root` with its MTP head."""
    hf_model = _zero_centred(random_hf_model(_config(kind), SEEDS[kind], STD, stds=STDS))
    hf_model.save_pretrained(root)
    mtp = _mtp_modules(kind, hf_model.config, SEEDS[kind] + 100)
    tensors = {f"mtp.{prefix}.{name}": t for prefix, m in mtp.items() for name, t in m.state_dict().items()}
    add_to_checkpoint(root, tensors, mtp_num_hidden_layers=1)
    return hf_model, mtp


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(kind, HF model, MTP modules, the checkpoint directory)."""
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, *_saved(request.param, str(root)), root)


@functools.cache
def _loaded(root):
    return load_hf_checkpoint(root)


def _tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def test_imported_logits_match_transformers(checkpoint):
    kind, hf_model, _, root = checkpoint
    model = _loaded(root)
    c = model.config
    assert c.layer_types == tuple(LAYER_TYPES) and c.num_nextn_predict_layers == 1 and c.mtp_layout == "qwen3_5"
    assert (c.attn_output_gate, c.use_qk_norm, c.rms_norm_unit_offset, c.partial_rotary_factor) == (
        True,
        True,
        True,
        0.5,
    )
    assert c.ffn_type == ("moe" if kind == "moe" else "dense")
    tokens = _tokens(2, 80)  # our chunked Gated DeltaNet (calls of over 32 tokens): a chunk of 64, then 16
    margins = RoutingMargins(hf_model)
    expected = hf_logits(hf_model, tokens)
    margins.check()
    assert_close(our_logits(model, tokens), expected)


def test_greedy_generation_matches_transformers_generate(checkpoint):
    """`mtp_jax.decode`'s greedy generate (prefill, then one token per step through the recurrent states)
    against transformers' `generate`, 32 tokens."""
    _, hf_model, _, root = checkpoint
    prompts, steps = _tokens(2, 8, seed=5), 32
    margins = RoutingMargins(hf_model)
    out = hf_greedy(hf_model, prompts, steps)
    margins.check()
    top2 = torch.stack(out.scores).topk(2, dim=-1).values  # [steps, B, 2]
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "test model too flat: greedy choices are near-ties"
    result = generate(
        _loaded(root),
        prompts.tolist(),
        max_new_tokens=steps,
        sampling=SamplingParams(temperature=0.0),
        max_length=prompts.shape[1] + steps,
    )
    assert result.tokens == out.sequences[:, prompts.shape[1] :].tolist()


# The reference itself moves by this much with torch's CPU kernels: the MoE variant's MTP logits differ from
# ours by 1.4e-05 with torch's AVX-512 kernels and 2.3e-05 with its AVX2 ones (ATEN_CPU_CAPABILITY=avx2) on
# an Intel Xeon with AMX (2026-12-06; < 1e-05 on AMD Zen 4), ours the same under both XLA ISAs.
MTP_RTOL = 5e-5


def test_mtp_head_matches_transformers_modules(checkpoint):
    """Our `mtp[0]` against the head assembled from transformers' modules loaded with the same `mtp.*` tensors:
    norm(layer(fc(cat([pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)])))), h the main model's
    final (post-norm) hidden states; the logits (lm_head of it) and the chained hidden (the normed output)."""
    _, hf_model, mtp, root = checkpoint
    model = _loaded(root)
    tokens = _tokens(3, 16, seed=7)
    shifted = shift_left(jnp.asarray(tokens), 1)  # t_{i+1}; 0 past the end
    margins = RoutingMargins(hf_model, mtp["layers.0"])
    with torch.no_grad():
        hidden = hf_model.model(torch.from_numpy(tokens.astype(np.int64))).last_hidden_state  # after the final norm
        embedded = hf_model.model.embed_tokens(torch.from_numpy(np.asarray(shifted).astype(np.int64)))
        x = mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](embedded), mtp["pre_fc_norm_hidden"](hidden)], dim=-1))
        positions = torch.arange(tokens.shape[1])[None].expand(len(tokens), -1)
        rope = hf_model.model.rotary_emb(x, positions)
        out = mtp["layers.0"](x, position_embeddings=rope, attention_mask=causal_mask(tokens.shape[1]))
        chained = mtp["norm"](out)
        expected = hf_model.lm_head(chained).numpy()
    margins.check()

    logits, ours_chained = our_first_mtp_module(model, jnp.asarray(tokens), shifted)
    err = relative_error(logits, expected)
    assert err <= MTP_RTOL, f"relative MTP logit error {err:.2e} > {MTP_RTOL}"
    err = relative_error(ours_chained, chained.numpy())
    assert err <= MTP_RTOL, f"relative chained-hidden error {err:.2e} > {MTP_RTOL}"


def _flat(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_weights(a, b):
    fa, fb = _flat(a), _flat(b)
    assert fa.keys() == fb.keys()
    for path in fa:
        np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))


def test_export_loads_back_into_transformers_and_round_trips(checkpoint, tmp_path):
    kind, hf_model, _, root = checkpoint
    model = _loaded(root)
    save_hf_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == ("qwen3_5_moe_text" if kind == "moe" else "qwen3_5_text")
    assert hf["mtp_num_hidden_layers"] == 1 and hf["layer_types"] == LAYER_TYPES
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= names
    if kind == "moe":  # written one expert at a time, as save_pretrained writes them
        assert {"mtp.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.0.gate_proj.weight"} <= names
    back = load_hf_checkpoint(tmp_path)
    assert back.config == model.config
    _assert_same_weights(back, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unexpected mtp.* tensors
        exported = load_hf_model(tmp_path)
    tokens = _tokens(2, 24, seed=2)
    np.testing.assert_allclose(hf_logits(exported, tokens), hf_logits(hf_model, tokens), rtol=0, atol=0)


def _as_multimodal_wrapper(root, kind: str) -> None:
    """Rewrites a text checkpoint in the multimodal wrapper's layout (Qwen3_5ForConditionalGeneration's files):
    `model.language_model.*`, a `model.visual.*` tensor, model_type "qwen3_5(_moe)" with `text_config` and a
    `vision_config`; the MoE's routed experts fused, [R, 2I, E] and [R, E, I], as Qwen's checkpoints hold them."""
    from safetensors.torch import load_file as load_torch

    stored = load_torch(root / "model.safetensors")
    fused = {}
    for name in [n for n in stored if ".mlp.experts.0.gate_proj." in n and n.startswith("model.")]:
        base = name.split(".mlp.experts.")[0] + ".mlp.experts"
        count = len({n for n in stored if n.startswith(base + ".") and n.endswith(".down_proj.weight")})
        gate_up = [
            torch.cat([stored[f"{base}.{r}.gate_proj.weight"], stored[f"{base}.{r}.up_proj.weight"]])
            for r in range(count)
        ]
        fused[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{base}.down_proj"] = torch.stack([stored[f"{base}.{r}.down_proj.weight"] for r in range(count)])

    def rename(name):
        if ".mlp.experts." in name and name.startswith("model.") and name.split(".mlp.experts.")[1][0].isdigit():
            return None
        return "model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name

    tensors = {"model.language_model." + k.removeprefix("model."): v for k, v in fused.items()}
    tensors["model.visual.patch_embed.proj.weight"] = torch.ones(8, 3, 2, 2)
    text = json.loads((root / "config.json").read_text())
    wrapper = "qwen3_5_moe" if kind == "moe" else "qwen3_5"
    fields = {name: None for name in text} | {
        "model_type": wrapper,
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if kind == "moe" else "Qwen3_5ForConditionalGeneration"],
        "text_config": text
        | {"rope_parameters": {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": False,
    }
    add_to_checkpoint(root, tensors, rename=rename, **fields)


def test_multimodal_wrapper_layout_loads_the_same_model(checkpoint, tmp_path):
    kind, _, _, root = checkpoint
    import shutil

    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    _as_multimodal_wrapper(tmp_path, kind)
    with pytest.warns(UserWarning, match="vision"):
        model = load_hf_checkpoint(tmp_path)
    assert model.config == _loaded(root).config
    _assert_same_weights(model, _loaded(root))


def test_mtp_tensors_must_match_mtp_num_hidden_layers(checkpoint, tmp_path):
    _, _, _, root = checkpoint
    import shutil

    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    add_to_checkpoint(tmp_path, mtp_num_hidden_layers=0)
    with pytest.raises(CheckpointError, match="mtp_num_hidden_layers=0 but the weights hold 1 MTP layers"):
        load_hf_checkpoint(tmp_path)


# config.json


def _text_config(**changes) -> dict:
    return {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96} | {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        **changes,
    }


def test_config_defaults_follow_transformers():
    """Absent fields take `Qwen3_5TextConfig`'s / `Qwen3_5MoeTextConfig`'s defaults."""
    for model_type, kv_heads in (("qwen3_5_text", 4), ("qwen3_5_moe_text", 2)):
        fields = _text_config(model_type=model_type, num_attention_heads=8, num_hidden_layers=8)
        ours = config_from_hf(fields)
        theirs = getattr(transformers, HF_CONFIGS["moe" if "moe" in model_type else "dense"][0])(**fields)
        assert ours.layer_types == tuple(theirs.layer_types)
        assert ours.resolved_head_dim == theirs.head_dim == 256 and ours.num_key_value_heads == kv_heads
        assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"] == 0.25
        assert (ours.linear_num_key_heads, ours.linear_num_value_heads) == (16, 32)
    moe = config_from_hf(_text_config(model_type="qwen3_5_moe_text", intermediate_size=None))
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.scoring_func, moe.shared_expert_gate) == (
        256,
        8,
        "softmax",
        True,
    )
    assert (
        config_from_hf(_text_config(full_attention_interval=2)).layer_types
        == ("linear_attention", "full_attention") * 2
    )


def test_config_round_trips():
    for model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        config = config_from_hf(_text_config(model_type=model_type, mtp_num_hidden_layers=1, eos_token_id=[1, 2]))
        assert config_from_hf(config_to_hf(config)) == config
        assert config_to_hf(config)["model_type"] == model_type
    with pytest.raises(ValueError, match="model_type 'llama'"):
        config_to_hf(config, model_type="llama")


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers=2 is not supported"),
        ({"num_nextn_predict_layers": 1, "mtp_num_hidden_layers": 0}, "num_nextn_predict_layers"),
        (
            {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"]},
            r"layer_types\[1\]",
        ),
        ({"layer_types": ["full_attention"] * 3}, "layer_types has 3 entries"),
        ({"layer_types": "full_attention"}, "layer_types must be a list"),
        ({"attention_bias": True}, "attention_bias"),
        ({"linear_num_value_heads": 3, "linear_num_key_heads": 2}, "linear_num_value_heads"),
        ({"rope_parameters": {"rope_theta": 1e4, "mrope_section": "x"}}, "rope_parameters.mrope_section"),
        ({"rope_parameters": {"rope_theta": 1e4, "mrope_foo": 1}}, "rope_parameters.mrope_foo"),
        ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
        ({"full_attention_interval": 0}, "full_attention_interval"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        config_from_hf(_text_config(**changes))


def test_multimodal_wrapper_config():
    text = _text_config(mtp_num_hidden_layers=1)
    wrapper = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 2}, "dtype": "bfloat16"}
    with pytest.warns(UserWarning, match="vision tower"):
        config = config_from_hf(wrapper)
    assert config == config_from_hf(text | {"dtype": "bfloat16"})
    for changes, field in (
        ({"text_config": None}, "text_config is missing"),
        ({"text_config": text | {"model_type": "qwen3_5_moe_text"}}, "text_config.model_type"),
        ({"tie_word_embeddings": True, "text_config": text | {"tie_word_embeddings": False}}, "tie_word_embeddings"),
    ):
        with pytest.raises(ValueError, match=field), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config_from_hf(wrapper | changes)


def test_a_tensor_stored_in_both_layouts_is_refused(checkpoint, tmp_path):
    _, _, _, root = checkpoint
    import shutil

    shutil.copytree(root, tmp_path, dirs_exist_ok=True)
    add_to_checkpoint(tmp_path, {"model.language_model.norm.weight": torch.zeros(HIDDEN)})
    with pytest.raises(CheckpointError, match="model.norm.weight is stored both as itself and as model.language_model"):
        load_hf_checkpoint(tmp_path)
