"""Parity with Hugging Face `transformers` for the MoE architectures: DeepSeek-V3 (MLA + MoE) and GLM-4.5
(partial rotary, q/k norm, q/k/v bias, MoE) checkpoints import with transformers' logits and greedy tokens,
and export in the checkpoint layout (one tensor per routed expert) that transformers loads back; an MTP
module exported at `model.layers.{L}` loads into transformers 5's `MtpModel` with our depth-1 logits.

Tiny random float32 models with eager attention: every weight ~ N(0, 0.15^2) (routers 0.3^2), norms ~ 1 + N(0, 0.2^2), a
nonzero `e_score_correction_bias`, so attention and routing matter. Every routing decision transformers
makes on the inputs used (forward hooks on its routers, through `generate` too) is at least `MIN_MARGIN`
from a tie, both the k-th against the (k+1)-th biased expert score and (DeepSeek) the topk_group-th
against the next group score: a float32 rounding cannot flip a choice, so 1e-5 logit parity is meaningful.
"""

from __future__ import annotations

import functools
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import (
    RTOL,
    hf_config,
    hf_greedy,
    hf_logits,
    load_hf_model,
    our_logits,
    random_hf_model,
    relative_error,
    torch,
)
from safetensors.numpy import load_file

from mtp_jax.checkpoints import CheckpointError, config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.decode.generation import SamplingParams, generate

MIN_MARGIN = 1e-3  # smallest gap of a routing decision from a tie
VOCAB = 64
ROUTER_STD, BIAS_STD = 0.3, 0.1  # router weights wider: fewer near-ties among sigmoid scores
SEED = 6  # a draw whose routing on the inputs below has no near-ties (checked in each test)
MTP_SEED = 20  # likewise for the MTP module's weights (drawn in our fused layouts: re-check when they change)
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=128,
    moe_intermediate_size=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    initializer_range=0.15,
)
HF_CONFIGS = {
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            num_key_value_heads=4,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeConfig",
        dict(
            num_key_value_heads=2,
            head_dim=16,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            routed_scaling_factor=1.5,
        ),
    ),
}


class RoutingMargins:
    """Forward hooks on every HF MoE router: the smallest gap of any routing decision from a tie."""

    def __init__(self, hf_model):
        self.margins = []
        self.handles = [
            module.register_forward_hook(self._hook)
            for name, module in hf_model.named_modules()
            if name.endswith("mlp.gate")
        ]
        assert self.handles, "no routers found"

    def _hook(self, router, inputs, _):
        x = inputs[0].reshape(-1, router.weight.shape[1]).double()
        scores = torch.sigmoid(x @ router.weight.double().T)  # [N, R]
        choice = scores + router.e_score_correction_bias.double()  # [N, R]
        n_group, topk_group = router.num_group, router.topk_group
        if n_group > 1:
            grouped = choice.view(len(x), n_group, -1).topk(2, dim=-1).values.sum(-1)  # [N, P]
            ranked = grouped.sort(dim=-1, descending=True).values
            self.margins.append((ranked[:, topk_group - 1] - ranked[:, topk_group]).min().item())
            best = grouped.topk(topk_group, dim=-1).indices
            mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~mask.repeat_interleave(choice.shape[1] // n_group, dim=1), -torch.inf)
        ranked = choice.sort(dim=-1, descending=True).values
        self.margins.append((ranked[:, router.top_k - 1] - ranked[:, router.top_k]).min().item())

    def check(self):
        assert self.margins and min(self.margins) > MIN_MARGIN, f"routing near-tie: margin {min(self.margins):.2e}"


def _hf_config(model_type: str):
    """The transformers config of the test's `model_type` model."""
    config_class, overrides = HF_CONFIGS[model_type]
    return hf_config(config_class, **{**_COMMON, **overrides})


def _hf_model(model_type: str, seed: int = SEED):
    return random_hf_model(
        _hf_config(model_type),
        seed,
        0.15,
        stds={"mlp.gate.weight": ROUTER_STD},
        buffer_stds={"e_score_correction_bias": BIAS_STD},
    )


@functools.cache
def _saved(model_type: str, root: str):
    hf_model = _hf_model(model_type)
    hf_model.save_pretrained(root)
    return hf_model


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(model_type, the HF model, its save_pretrained directory)."""
    root = tmp_path_factory.mktemp(request.param)
    return request.param, _saved(request.param, str(root)), root


def _tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def test_imported_logits_match_transformers(checkpoint):
    model_type, hf_model, root = checkpoint
    model = load_hf_checkpoint(root)
    c = model.config
    assert (c.attention_type, c.ffn_type) == (("mla", "moe") if model_type == "deepseek_v3" else ("gqa", "moe"))
    assert c.n_group == HF_CONFIGS[model_type][1].get("n_group", 1)
    tokens = _tokens(3, 16)
    margins = RoutingMargins(hf_model)
    expected = hf_logits(hf_model, tokens)
    margins.check()
    err = relative_error(our_logits(model, tokens), expected)
    assert err <= RTOL, f"relative logit error {err:.2e} > {RTOL}"


def test_greedy_generation_matches_transformers_generate(checkpoint):
    model_type, hf_model, root = checkpoint
    prompts, steps = _tokens(2, 8, seed=5), 32
    margins = RoutingMargins(hf_model)
    out = hf_greedy(hf_model, prompts, steps)
    margins.check()
    top2 = torch.stack(out.scores).topk(2, dim=-1).values  # [steps, B, 2]
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "test model too flat: greedy choices are near-ties"
    expected = out.sequences[:, prompts.shape[1] :].numpy()
    result = generate(
        load_hf_checkpoint(root),
        prompts.tolist(),
        max_new_tokens=steps,
        sampling=SamplingParams(temperature=0.0),
        max_length=prompts.shape[1] + steps,
        stop_tokens=[],
    )
    assert result.tokens == expected.tolist()


def test_exported_checkpoint_loads_back_into_transformers(checkpoint, tmp_path):
    model_type, hf_model, root = checkpoint
    model = load_hf_checkpoint(root)
    save_hf_checkpoint(model, tmp_path)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(root / "model.safetensors"))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == model_type
    reloaded = load_hf_model(tmp_path)
    tokens = _tokens(2, 16, seed=2)
    theirs = hf_logits(reloaded, tokens)
    assert relative_error(our_logits(model, tokens), theirs) <= RTOL
    assert relative_error(theirs, hf_logits(hf_model, tokens)) == 0.0  # the same weights, bit for bit
    assert load_hf_checkpoint(tmp_path).config == model.config


def test_config_round_trips(checkpoint):
    _, _, root = checkpoint
    config = load_hf_checkpoint(root).config
    assert config_from_hf(json.loads(json.dumps(config_to_hf(config)))) == config


def test_mtp_layer_count_must_match_the_weights(checkpoint, tmp_path):
    """config.json's num_nextn_predict_layers against the model.layers.{L + k} layers in the weights."""
    _, _, root = checkpoint
    save_hf_checkpoint(load_hf_checkpoint(root), tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}))
    with pytest.raises(CheckpointError, match="num_nextn_predict_layers=1 but the weights hold 0 MTP layers"):
        load_hf_checkpoint(tmp_path)


def _hf_config_json(model_type: str) -> dict:
    """config.json as transformers writes it for the test's config of `model_type`."""
    return json.loads(_hf_config(model_type).to_json_string())


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"topk_method": "greedy"}, "topk_method"),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        ({"n_group": 3}, "n_group"),  # 8 experts do not split into 3 groups
        ({"n_routed_experts": 8.0}, "n_routed_experts"),
        ({"norm_topk_prob": "true"}, "norm_topk_prob"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"rope_interleave": 1}, "rope_interleave"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"num_mtp_layers": 2}, "num_mtp_layers"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    ],
)
def test_deepseek_config_errors_name_the_field(changes, field):
    hf = _hf_config_json("deepseek_v3")
    assert config_from_hf({**hf, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1})
    with pytest.raises(ValueError, match=field):
        config_from_hf({**hf, **changes})


def test_glm_defaults_follow_transformers():
    hf = _hf_config_json("glm4_moe")
    bare = {k: v for k, v in hf.items() if k not in ("rope_parameters", "n_group", "topk_group", "rms_norm_eps")}
    config = config_from_hf(bare)  # transformers' Glm4MoeConfig defaults: partial rotary 0.5, no groups, eps 1e-5
    assert (config.partial_rotary_factor, config.n_group, config.topk_group, config.rms_norm_eps) == (0.5, 1, 1, 1e-5)
    for changes, field in (
        ({"use_qk_norm": "yes"}, "use_qk_norm"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor"),
    ):  # vs rope_parameters' 0.5
        with pytest.raises(ValueError, match=field):
            config_from_hf({**hf, **changes})


def _with_random_mtp_layer(model, seed: int):
    """`model` (D = 0) with one MTP module added: the main weights kept, the module's drawn like `_hf_model`'s."""
    from mtp_jax.model import Transformer

    config = model.config.replace(num_nextn_predict_layers=1)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    main = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    rng = np.random.RandomState(seed)
    flat = []
    for path, variable in nnx.to_flat_state(params):
        if path[0] != "mtp":
            flat.append((path, main[path]))
            continue
        shape, dtype = variable.get_value().shape, variable.get_value().dtype
        std = {"e_score_correction_bias": BIAS_STD, "weight": 0.2}.get(path[-1], 0.15)
        std = ROUTER_STD if path[-2:] == ("gate", "weight") else std
        value = std * rng.standard_normal(shape) + (1.0 if path[-1] == "weight" and path[-2] != "gate" else 0.0)
        flat.append((path, variable.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def test_mtp_layer_matches_transformers_mtp_model(checkpoint, tmp_path):
    """One MTP module exported at model.layers.{L} (DeepSeek-V3's layout) loads into transformers 5's `MtpModel`
    (`enorm`, `hnorm`, `eh_proj`, `mtp_block`, `post_norm` <- `shared_head.norm`) and gives our depth-1 logits
    on the same tokens and main-model hidden states."""
    from transformers.modeling_layers import MtpModel

    from mtp_jax.mtp import mtp_forward_full

    model_type, _, root = checkpoint
    model = _with_random_mtp_layer(load_hf_checkpoint(root), seed=MTP_SEED)
    save_hf_checkpoint(model, tmp_path)
    layers = model.config.num_hidden_layers
    assert f"model.layers.{layers}.shared_head.norm.weight" in load_file(tmp_path / "model.safetensors")
    assert load_hf_checkpoint(tmp_path).config == model.config
    main = load_hf_model(tmp_path)
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{layers}\..*"]  # HF's pattern names layer 61 / 92
    mtp = MtpModel.from_pretrained(main).eval()

    tokens = _tokens(3, 16, seed=7)
    shifted = np.concatenate([tokens[:, 1:], np.zeros((3, 1), np.int32)], axis=1)  # t_{i+1}, as `shift_left`
    margins = RoutingMargins(mtp)
    with torch.no_grad():
        hidden = main.model(torch.from_numpy(tokens.astype(np.int64))).last_hidden_state  # after the final norm
        positions = torch.arange(tokens.shape[1])[None].expand(3, -1)
        h1 = mtp.forward_layer(0, hidden, positions, None, input_ids=torch.from_numpy(shifted.astype(np.int64)))
        expected = mtp._project_to_logits(h1).numpy()
    margins.check()

    @nnx.jit
    def ours(model, tokens):
        _, main_hidden = model.forward_full(tokens)
        return mtp_forward_full(model, main_hidden, tokens)[0]

    err = relative_error(ours(model, jnp.asarray(tokens)), expected)
    assert err <= RTOL, f"relative MTP logit error {err:.2e} > {RTOL}"
