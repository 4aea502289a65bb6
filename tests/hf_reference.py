"""The Hugging Face `transformers` reference (the oracle) of the parity tests (`test_hf_parity`,
`test_hf_parity_moe`, `test_mla`, `test_hf_parity_qwen3_5`, `test_hf_parity_mimo`): transformers configs with
eager attention, random float32 reference models and modules, checkpoints loaded into transformers (or edited:
`add_to_checkpoint`), their logits and greedy `generate`, and ours to compare with.

Importing this module skips the importing test module when the [parity] extra (torch, transformers) is
missing. Every reference model is float32, with eager attention, in eval mode.
"""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="the transformers oracle needs the [parity] extra")
transformers = pytest.importorskip("transformers", reason="the transformers oracle needs the [parity] extra")
torch.set_num_threads(1)  # tiny models: extra threads only spin on the shared CPUs

RTOL = 1e-5  # max |ours - theirs| / max |theirs| over the logits


def hf_config(class_name: str, **fields):
    """transformers' config `class_name` (e.g. "LlamaConfig") with `fields`, asking for eager attention."""
    config = getattr(transformers, class_name)(**fields)
    config._attn_implementation = "eager"
    return config


def random_hf_model(
    config, seed: int, std: float, *, stds: dict[str, float] | None = None, buffer_stds: dict[str, float] | None = None
):
    """A random float32 HF causal LM of `config` (eager attention, eval mode) with every parameter perturbed:
    norm weights ~ 1 + N(0, 0.2^2), any other parameter ~ N(0, s^2) with s the first of `stds` whose name
    suffix it has, else `std`; buffers with a suffix in `buffer_stds` ~ N(0, s^2). Seeded by `seed`."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return perturbed(model, std, stds=stds, buffer_stds=buffer_stds).eval()


def perturbed(model, std: float, *, stds: dict[str, float] | None = None, buffer_stds: dict[str, float] | None = None):
    """`model` (any torch module) with its parameters and buffers redrawn in place as `random_hf_model` draws them
    (torch's global generator: seed it first); returned for chaining."""
    stds, buffer_stds = stds or {}, buffer_stds or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, next((s for suffix, s in stds.items() if name.endswith(suffix)), std))
        for name, buffer in model.named_buffers():
            scale = next((s for suffix, s in buffer_stds.items() if name.endswith(suffix)), None)
            if scale is not None:
                buffer.copy_(scale * torch.randn_like(buffer))
    return model


def causal_mask(length: int):
    """The additive causal mask [1, 1, T, T] (float32; the dtype's minimum above the diagonal) that eager
    attention adds to its scores: for calling a transformers decoder layer directly."""
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    return torch.zeros(length, length).masked_fill(upper, torch.finfo(torch.float32).min)[None, None]


def add_to_checkpoint(root, tensors: dict | None = None, *, rename=None, **config_fields) -> None:
    """Edits the `save_pretrained` checkpoint in `root` (one `model.safetensors`) in place: each stored tensor
    renamed by `rename(name)` (None drops it), `tensors` (name -> torch tensor) added, and config.json updated
    with `config_fields` (a value None removes the field)."""
    from safetensors.torch import load_file, save_file

    root = Path(root)
    stored = load_file(root / "model.safetensors")
    if rename is not None:
        stored = {new: t for name, t in stored.items() if (new := rename(name)) is not None}
    stored.update({name: t.detach().contiguous() for name, t in (tensors or {}).items()})
    save_file(stored, root / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "config.json").read_text())
    config.update(config_fields)
    config = {name: value for name, value in config.items() if value is not None}
    (root / "config.json").write_text(json.dumps(config, indent=2))


def load_hf_model(path):
    """A checkpoint directory (ours exported, or `save_pretrained`'s) loaded into transformers."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()


def hf_logits(hf_model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def hf_greedy(hf_model, prompts: np.ndarray, steps: int):
    """transformers' greedy `generate` of `steps` tokens after prompts [B, T], with the scores of each step."""
    with torch.no_grad():
        return hf_model.generate(
            torch.from_numpy(prompts.astype(np.int64)),
            attention_mask=torch.ones(prompts.shape),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )


@functools.partial(jax.jit, static_argnums=0)
def _jit_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state).forward_full(tokens)[0]


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    """Our float32 logits [B, T, V] of a full forward (jitted: one compile beats hundreds of eager ones)."""
    return np.asarray(_jit_logits(*nnx.split(model), jnp.asarray(tokens)))


@nnx.jit
def our_first_mtp_module(model, tokens, shifted):
    """MTP module 1 over whole sequences from position 0 with an empty cache, fed h^0 of the main model's
    `forward_full` and the token inputs `shifted` (t_{i+1} at row i): (logits [B, T, V], chained hidden)."""
    from mtp_jax.model import sequence_positions
    from mtp_jax.mtp import initial_hidden

    batch, length = tokens.shape
    _, main_hidden = model.forward_full(tokens)
    module = model.mtp[0]
    h0 = initial_hidden(model, main_hidden)
    cache = module.init_cache(batch, length)
    return module(h0, shifted, sequence_positions(batch, length), cache, embed=model.embed, head=model.head)[:2]


def relative_error(ours, theirs) -> float:
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def assert_close(ours, theirs):
    err = relative_error(ours, theirs)
    assert err <= RTOL, f"relative logit error {err:.2e} > {RTOL}"
