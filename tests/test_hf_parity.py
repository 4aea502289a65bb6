"""Parity with Hugging Face `transformers` (the oracle): logits, RoPE scaling, export, greedy decoding.

Tiny random models in float32 with eager attention, weights drawn wide enough (std 0.2, norms
around 1, biases nonzero) that every parameter matters and greedy choices are not near-ties.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_reference import (
    assert_close,
    hf_config,
    hf_greedy,
    hf_logits,
    load_hf_model,
    our_logits,
    random_hf_model,
    torch,
)

from mtp_jax.checkpoints import load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.config import ModelConfig, RopeScaling
from mtp_jax.decode.generation import SamplingParams, generate
from mtp_jax.layers.ffn import split_gate_up, swiglu
from mtp_jax.model import Transformer, sequence_positions

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "mistral": "MistralConfig"}
# Rope scaling cases: positions run past original_max_position_embeddings (32) up to 64.
ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0},
    # DeepSeek-V3's variant: attention factor from mscale / mscale_all_dim, untruncated ramp.
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "truncate": False,
    },
}


def _hf_model(model_type: str, seed: int = 0, **overrides):
    """A random float32 HF causal LM with eager attention and every parameter perturbed (std 0.2)."""
    return random_hf_model(hf_config(CONFIG_CLASSES[model_type], **{**TINY, **overrides}), seed, 0.2)


def _tokens(batch: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, TINY["vocab_size"], (batch, length)).astype(np.int32)


def _random_model(config: ModelConfig, seed: int) -> Transformer:
    """Our model with every weight ~ N(0, 0.2^2), norm weights ~ 1 + N(0, 0.2^2), biases nonzero."""
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))), nnx.Param)
    rng = np.random.RandomState(seed)
    flat = []
    for path, variable in nnx.to_flat_state(params):
        shape, dtype = variable.get_value().shape, variable.get_value().dtype
        value = 0.2 * rng.standard_normal(shape) + (1.0 if path[-1] == "weight" else 0.0)  # "weight": RMSNorm
        flat.append((path, variable.replace(jnp.asarray(value, dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1e6}),
        ("mistral", {"sliding_window": None, "head_dim": 32}),
    ],
)
def test_imported_logits_match_transformers(tmp_path, model_type, overrides):
    hf_model = _hf_model(model_type, **overrides)
    hf_model.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.tie_word_embeddings == bool(overrides.get("tie_word_embeddings", False))
    tokens = _tokens(3, 24)
    assert_close(our_logits(model, tokens), hf_logits(hf_model, tokens))


def _as_transformers4(config_path):
    """Rewrites a transformers-5 config.json in the 4.x spelling: rope_theta + rope_scaling with "type"."""
    hf = json.loads(config_path.read_text())
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    config_path.write_text(json.dumps(hf))


@pytest.mark.parametrize("rope", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(tmp_path, rope):
    hf_model = _hf_model(
        "llama",
        max_position_embeddings=128,
        rope_theta=500.0,
        rope_parameters={**ROPE_CASES[rope], "rope_theta": 500.0},
    )
    hf_model.save_pretrained(tmp_path)
    tokens = _tokens(2, 64, seed=1)
    expected = hf_logits(hf_model, tokens)
    model = load_hf_checkpoint(tmp_path)
    assert model.config.rope_scaling.rope_type == ROPE_CASES[rope]["rope_type"]
    assert_close(our_logits(model, tokens), expected)
    _as_transformers4(tmp_path / "config.json")
    legacy = load_hf_checkpoint(tmp_path)
    assert legacy.config == model.config


@pytest.mark.parametrize(
    "name,rope,shard_bytes",
    [
        ("tiny", None, None),
        ("tiny-qwen2", None, 40_000),  # tied, biased, sharded
        ("tiny", "yarn-mscale", None),  # every yarn field written
    ],
)
def test_exported_checkpoint_matches_in_transformers(tmp_path, name, rope, shard_bytes):
    config = ModelConfig.from_name(name)
    if rope is not None:
        config = config.replace(max_position_embeddings=128, rope_scaling=RopeScaling(**ROPE_CASES[rope]))
    model = _random_model(config, seed=3)
    save_hf_checkpoint(model, tmp_path, **({} if shard_bytes is None else {"max_shard_size_bytes": shard_bytes}))
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes is not None)
    hf_model = load_hf_model(tmp_path)
    tokens = _tokens(2, 64, seed=2)
    assert_close(our_logits(model, tokens), hf_logits(hf_model, tokens))


def _greedy_loop(model: Transformer, prompts: np.ndarray, steps: int) -> np.ndarray:
    """Plain greedy decoding with `model(tokens, positions, cache)`: the prompt, then one token per step."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, start, cache):
        positions = sequence_positions(*tokens.shape, start)
        logits, _, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    batch, length = prompts.shape
    token, cache = step(state, jnp.asarray(prompts), 0, model.init_cache(batch, length + steps))
    out = [token]
    for i in range(steps - 1):
        token, cache = step(state, token[:, None], length + i, cache)
        out.append(token)
    return np.asarray(jnp.stack(out, axis=1))


def _hf_greedy(tmp_path, model_type: str, steps: int, **overrides) -> tuple[np.ndarray, np.ndarray]:
    """Saves a random HF model to tmp_path; returns prompts [2, 8] and its `generate` greedy tokens [2, steps]."""
    hf_model = _hf_model(model_type, seed=4, **overrides)
    hf_model.save_pretrained(tmp_path)
    prompts = _tokens(2, 8, seed=5)
    out = hf_greedy(hf_model, prompts, steps)
    top2 = torch.stack(out.scores).topk(2, dim=-1).values  # [steps, B, 2]
    assert (top2[..., 0] - top2[..., 1]).min() > 1e-3, "test model too flat: greedy choices are near-ties"
    return prompts, out.sequences[:, prompts.shape[1] :].numpy()


def test_greedy_loop_matches_transformers_generate(tmp_path):
    """The model's cached path, one token per call, against HF (Qwen2: tied embeddings, biases)."""
    prompts, expected = _hf_greedy(tmp_path, "qwen2", steps=32, tie_word_embeddings=True)
    np.testing.assert_array_equal(_greedy_loop(load_hf_checkpoint(tmp_path), prompts, 32), expected)


def test_generate_matches_transformers_generate(tmp_path):
    prompts, expected = _hf_greedy(tmp_path, "llama", steps=32)
    result = generate(
        load_hf_checkpoint(tmp_path),
        prompts.tolist(),
        max_new_tokens=32,
        sampling=SamplingParams(temperature=0.0),
        max_length=prompts.shape[1] + 32,
    )
    assert result.tokens == expected.tolist()


def test_swiglu_rounds_as_torch_does_in_bfloat16():
    """HF's `act_fn(gate_proj(x)) * up_proj(x)` in bfloat16: torch computes silu in float32 and rounds it once,
    then rounds the product once. `swiglu` does the same (the exponentials' last float32 bit aside); jax's
    bfloat16 silu, which rounds each of its ops, does not."""
    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.standard_normal((64, 2 * 4096)) * 4, jnp.bfloat16)
    gate, up = split_gate_up(gate_up)
    expected = torch.nn.functional.silu(torch.tensor(np.asarray(gate, np.float32)).bfloat16())
    expected = (expected * torch.tensor(np.asarray(up, np.float32)).bfloat16()).float().numpy()
    got = np.asarray(swiglu(gate_up), np.float32)
    assert swiglu(gate_up).dtype == jnp.bfloat16
    assert np.mean(got == expected) > 0.999
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(expected), 1e-30))) - 7)
    assert (np.abs(got - expected) <= ulp).all()
    per_op = np.asarray(jax.nn.silu(gate) * up, np.float32)
    assert np.mean(per_op == expected) < 0.95
    f32 = gate_up.astype(jnp.float32)
    np.testing.assert_array_equal(swiglu(f32), jax.nn.silu(split_gate_up(f32)[0]) * split_gate_up(f32)[1])
