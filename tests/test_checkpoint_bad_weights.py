"""Bad weights are refused while streaming, naming the tensor and its file: NaN or inf anywhere (a
norm, DeepSeek's `e_score_correction_bias`), a cast to a smaller float type that overflows; and an
index whose weight_map is empty is named as such."""

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtp_jax.checkpoints import INDEX_FILE, WEIGHTS_FILE, CheckpointError, load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model

TINY_MOE = ModelConfig.from_name(
    "tiny",
    attention_type="mla",
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    save_hf_checkpoint(init_model(TINY_MOE, seed=0), path)
    return path


def _edited(saved, tmp_path, name, edit):
    """A copy of the checkpoint `saved` in tmp_path with tensor `name` replaced by `edit(tensor)`."""
    for file in saved.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(tmp_path / WEIGHTS_FILE)
    tensors[name] = edit(tensors[name].copy())
    save_file(tensors, tmp_path / WEIGHTS_FILE, metadata={"format": "pt"})
    return tmp_path


def _with(value, where=(0,)):
    def edit(array):
        array[where] = value
        return array

    return edit


@pytest.mark.parametrize(
    "name,value",
    [
        ("model.norm.weight", np.nan),
        ("model.layers.1.mlp.gate.e_score_correction_bias", np.nan),  # DeepSeek's router bias
        ("model.layers.1.mlp.experts.3.down_proj.weight", np.inf),
        ("model.layers.2.enorm.weight", -np.inf),  # the MTP layer's
    ],
)
def test_nan_or_inf_anywhere_is_refused_naming_the_tensor_and_file(saved, tmp_path, name, value):
    where = (0,) if "norm" in name or "bias" in name else (1, 2)
    path = _edited(saved, tmp_path, name, _with(value, where))
    kind = "NaN" if np.isnan(value) else "infinite"
    with pytest.raises(CheckpointError, match=rf"{name} in .*{WEIGHTS_FILE} holds {kind} values"):
        load_hf_checkpoint(path)


def test_a_cast_that_overflows_float16_is_refused_and_a_wide_enough_one_loads(saved, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"
    path = _edited(saved, tmp_path, name, _with(1.0e6, (0, 0)))  # float16's largest finite value: 65504
    with pytest.raises(CheckpointError, match=rf"{name} in .*{WEIGHTS_FILE} does not fit float16: .*1e\+06"):
        load_hf_checkpoint(path, dtype="float16")
    model = load_hf_checkpoint(path, dtype="bfloat16")  # bfloat16 has float32's range
    assert float(model.layers[0].mlp.down_proj.kernel[0, 0]) == pytest.approx(1.0e6, rel=1e-2)


def test_an_empty_weight_map_is_named_as_such(saved, tmp_path):
    (tmp_path / "config.json").write_bytes((saved / "config.json").read_bytes())
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {}}))
    with pytest.raises(CheckpointError, match=r"weight_map is empty"):
        load_hf_checkpoint(tmp_path)
