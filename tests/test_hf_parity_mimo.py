"""Parity with Hugging Face `transformers` for MiMo (XiaomiMiMo/MiMo-7B) checkpoints: config.json model_type "mimo"
(Qwen2's fields plus `num_nextn_predict_layers`), the main model a Qwen2 model, MTP layer j under
`model.mtp_layers.{j}.` (`input_proj`, `token_layernorm`, `hidden_layernorm`, `final_layernorm` and a Qwen2 decoder
layer's tensors). transformers has no MiMo class; its `Qwen2ForCausalLM` loads the main model (ignoring the MTP
tensors), and the MTP layer's reference is assembled from transformers' Qwen2 modules:
final_layernorm(layer(input_proj(cat([hidden_layernorm(h_i), token_layernorm(e_{i+1})])))), the embedding e zeroed
at position 0 (MiMo's MTP pairs h_0 with no token: vLLM's and SGLang's `inputs_embeds[positions == 0] = 0`) and h
the main model's final (post-norm) hidden states.

A tiny random float32 model: weights ~ N(0, 0.2^2), norms ~ 1 + N(0, 0.2^2), q/k/v biases nonzero.
"""

from __future__ import annotations

import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from hf_reference import (
    RTOL,
    add_to_checkpoint,
    assert_close,
    causal_mask,
    hf_config,
    hf_logits,
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
from mtp_jax.mtp import shift_left

VOCAB, HIDDEN, STD = 128, 64, 0.2
QWEN2 = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=1e6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _mtp_modules(config, seed: int) -> dict:
    """A random MiMo MTP layer from transformers' Qwen2 modules (`MiMoMTPLayers`' parts), by checkpoint name."""
    qwen2 = transformers.models.qwen2.modeling_qwen2
    torch.manual_seed(seed)
    parts = {
        "input_proj": torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False),
        "token_layernorm": qwen2.Qwen2RMSNorm(HIDDEN, config.rms_norm_eps),
        "hidden_layernorm": qwen2.Qwen2RMSNorm(HIDDEN, config.rms_norm_eps),
        "final_layernorm": qwen2.Qwen2RMSNorm(HIDDEN, config.rms_norm_eps),
        "": qwen2.Qwen2DecoderLayer(config, 0),  # as MiMoMTPLayers builds it (layer_idx 0)
    }
    out = {}
    for name, module in parts.items():
        perturbed(module, STD).eval()
        if name.endswith("layernorm"):
            with torch.no_grad():
                module.weight.add_(1.0)  # a norm module's own parameter is "weight": 1 + N(0, s^2), as the layer's
        out[name] = module
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(Qwen2 HF model, MTP modules, the MiMo checkpoint directory)."""
    root = tmp_path_factory.mktemp("mimo")
    hf_model = random_hf_model(hf_config("Qwen2Config", **QWEN2), 0, STD)
    hf_model.save_pretrained(root)
    mtp = _mtp_modules(hf_model.config, 1)
    tensors = {
        f"model.mtp_layers.0.{prefix}{'.' if prefix else ''}{name}": tensor
        for prefix, module in mtp.items()
        for name, tensor in module.state_dict().items()
    }
    add_to_checkpoint(root, tensors, model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    return hf_model, mtp, root


def _tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, VOCAB, (batch, length)).astype(np.int32)


def test_main_logits_match_qwen2(checkpoint):
    hf_model, _, root = checkpoint
    model = load_hf_checkpoint(root)
    c = model.config
    assert (c.mtp_layout, c.mtp_concat_order, c.mtp_zero_embedding_at_start) == ("mimo", "hidden_first", True)
    assert c.num_nextn_predict_layers == 1 and c.attention_bias
    tokens = _tokens(3, 24)
    assert_close(our_logits(model, tokens), hf_logits(hf_model, tokens))


def test_mtp_layer_matches_transformers_qwen2_modules(checkpoint):
    hf_model, mtp, root = checkpoint
    model = load_hf_checkpoint(root)
    tokens = _tokens(3, 16, seed=7)
    shifted = shift_left(jnp.asarray(tokens), 1)  # t_{i+1}; 0 past the end
    with torch.no_grad():
        hidden = hf_model.model(torch.from_numpy(tokens.astype(np.int64))).last_hidden_state  # after the final norm
        embedded = hf_model.model.embed_tokens(torch.from_numpy(np.asarray(shifted).astype(np.int64)))
        embedded[:, 0] = 0  # position 0: no token embedding
        x = mtp["input_proj"](torch.cat([mtp["hidden_layernorm"](hidden), mtp["token_layernorm"](embedded)], dim=-1))
        positions = torch.arange(tokens.shape[1])[None].expand(len(tokens), -1)
        rope = hf_model.model.rotary_emb(x, positions)
        out = mtp[""](x, attention_mask=causal_mask(tokens.shape[1]), position_embeddings=rope)
        chained = mtp["final_layernorm"](out)
        expected = hf_model.lm_head(chained).numpy()

    logits, ours_chained = our_first_mtp_module(model, jnp.asarray(tokens), shifted)
    err = relative_error(logits, expected)
    assert err <= RTOL, f"relative MTP logit error {err:.2e} > {RTOL}"
    err = relative_error(ours_chained, chained.numpy())
    assert err <= RTOL, f"relative chained-hidden error {err:.2e} > {RTOL}"


def test_export_round_trips_and_loads_into_qwen2(checkpoint, tmp_path):
    hf_model, _, root = checkpoint
    model = load_hf_checkpoint(root)
    save_hf_checkpoint(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["model_type"], hf["architectures"], hf["num_nextn_predict_layers"]) == ("mimo", ["MiMoForCausalLM"], 1)
    assert not {"mtp_concat_order", "mtp_zero_embedding_at_start"} & set(hf)  # MiMo's own conventions: implied
    written, original = load_file(tmp_path / "model.safetensors"), load_file(root / "model.safetensors")
    assert written.keys() == original.keys()
    for name in written:
        np.testing.assert_array_equal(written[name], original[name], err_msg=name)
    assert load_hf_checkpoint(tmp_path).config == model.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # model type mimo read as qwen2; the unexpected MTP tensors
        qwen2 = transformers.Qwen2ForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", dtype=torch.float32
        )
    tokens = _tokens(2, 16, seed=2)
    np.testing.assert_array_equal(hf_logits(qwen2.eval(), tokens), hf_logits(hf_model, tokens))


def test_mtp_layers_must_match_num_nextn_predict_layers(checkpoint, tmp_path):
    import shutil

    shutil.copytree(checkpoint[2], tmp_path, dirs_exist_ok=True)
    add_to_checkpoint(tmp_path, num_nextn_predict_layers=2)
    with pytest.raises(CheckpointError, match=r"num_nextn_predict_layers=2 but the weights hold 1 MTP layers"):
        load_hf_checkpoint(tmp_path)


def test_config_round_trips_and_errors_name_the_field():
    hf = {"model_type": "mimo", **{k: v for k, v in QWEN2.items() if v is not None}, "num_nextn_predict_layers": 1}
    config = config_from_hf(hf)
    assert config_from_hf(config_to_hf(config)) == config
    flipped = config.replace(mtp_hidden_after_norm=False)  # vLLM's reading: h before the final norm
    assert config_to_hf(flipped)["mtp_hidden_after_norm"] is False and config_from_hf(config_to_hf(flipped)) == flipped
    with pytest.raises(ValueError, match="mtp_layout='mimo' cannot be expressed as model_type 'qwen2'"):
        config_to_hf(config, model_type="qwen2")
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        config_from_hf({**hf, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be"):
        config_from_hf({**hf, "num_nextn_predict_layers": "1"})
