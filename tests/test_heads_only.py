"""Heads-only fine-tuning and export (`mtp_jax.checkpoints.heads_only`, `trainer.train(..., init_from=)`): the
export is the source checkpoint with every trunk tensor byte-identical and the MTP modules trained.

Tiny Llama and DeepSeek-V3 (MLA + MoE) checkpoints; the trained MTP parameters are float32 master weights
over a frozen bfloat16 trunk; an FP8 source exports its MTP modules re-quantized.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fp8_checkpoints import write_fp8_checkpoint
from test_data import tiny_documents

from mtp_jax.checkpoints import INDEX_FILE, WEIGHTS_FILE, load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.checkpoints.heads_only import export_mtp_heads, mtp_tensors, source_fingerprint
from mtp_jax.checkpoints.names import shared_copies
from mtp_jax.checkpoints.pretrained import init_from_pretrained, save_pretrained
from mtp_jax.checkpoints.tensor_reads import TensorFile
from mtp_jax.config import ModelConfig
from mtp_jax.model import init_model
from mtp_jax.mtp import MAIN_PARAMS, MTP_PARAMS
from mtp_jax.quantization import Fp8Config, dequantize_fp8_blocks
from mtp_jax.training import data
from mtp_jax.training import trainer as train

TRAIN = train.TrainConfig(
    batch_size=2,
    seq_len=16,
    num_steps=3,
    learning_rate=1e-2,
    warmup_steps=0,
    checkpoint_every=100,
    log_every=1,
    eval_batches=1,
    mtp_only=True,
)
LLAMA = ModelConfig.from_name("tiny", vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
DEEPSEEK = ModelConfig(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
    num_nextn_predict_layers=1,
    ffn_type="moe",
    moe_intermediate_size=16,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    attention_type="mla",
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 9)), jnp.int32)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return data.prepare_corpus(
        tmp_path_factory.mktemp("corpus"), documents=tiny_documents(), vocab_size=300, heldout_fraction=0.2
    )


def _source(path, config, corpus, *, seed=0, shard_bytes=None):
    """A tiny checkpoint directory of a random `config` model (sharded under `shard_bytes`), with a tokenizer
    and a README; returns the model."""
    model = init_model(config.replace(eos_token_id=corpus.eos_id), seed)
    if shard_bytes is None:
        save_pretrained(model, path, tokenizer=corpus.tokenizer_path)
    else:
        save_hf_checkpoint(model, path, max_shard_size_bytes=shard_bytes)
        (path / "tokenizer.json").write_bytes(corpus.tokenizer_path.read_bytes())
    (path / "README.md").write_text("a model card\n")
    return model


def _raw(directory) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every stored tensor of a checkpoint directory: name -> (safetensors dtype, shape, raw bytes)."""
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors = TensorFile(file, file)
        try:
            for name, (dtype, shape, _) in tensors.entries.items():
                out[name] = (dtype, shape, tensors.read(name).tobytes())
        finally:
            tensors.close()
    return out


def _files(directory) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def _check_heads_only(source, export, mtp_names):
    """Same tensor names; trunk ones byte-identical (dtype, shape, bytes); every trained MTP tensor changed."""
    before, after = _raw(source), _raw(export)
    assert set(after) == set(before)
    assert mtp_names <= set(before)
    for name in set(before) - mtp_names:
        assert after[name] == before[name], name
    for name in mtp_names:
        assert after[name][:2] == before[name][:2], name  # the source's dtype and shape
        if not name.endswith("e_score_correction_bias"):  # set by its balancing rule, never by gradient
            assert after[name][2] != before[name][2], name


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_heads_only_training_keeps_the_trunk_bytes(tmp_path, corpus, family):
    """Llama (one file) and DeepSeek-V3 (MLA + MoE, sharded, with its MTP layer's copies of the embedding and
    head), both bfloat16: the export is the source with only the MTP tensors trained; the trunk stays bfloat16
    in memory while the MTP modules train as float32 master weights (Llama's run stopped and resumed)."""
    sharded = family == "deepseek_v3"
    config = (DEEPSEEK if sharded else LLAMA.replace(num_nextn_predict_layers=1)).replace(
        dtype="bfloat16", param_dtype="bfloat16"
    )
    source = tmp_path / "source"
    _source(source, config, corpus, shard_bytes=20_000 if sharded else None)
    assert (source / INDEX_FILE).is_file() == sharded
    untouched = _files(source)
    model = init_from_pretrained(source)
    run_dir = tmp_path / "run"
    stop = None if sharded else 2  # DeepSeek's run straight through (a resume recompiles: slow on a CPU)
    result = train.train(
        run_dir, corpus, train_config=TRAIN, model=model, init_from=source, progress=False, stop_at_step=stop
    )
    run = json.loads((run_dir / "run.json").read_text())
    assert run["init_from"] == {"path": str(source.resolve()), "fingerprint": source_fingerprint(source)}
    # What a resume restores into: float32 MTP parameters (and moments) beside the bfloat16 trunk.
    _, target = train.abstract_train_state(model.config, TRAIN)
    assert {x.dtype for x in jax.tree.leaves(target["train"].params)} == {jnp.dtype(jnp.float32)}
    if not sharded:
        assert result.stopped_early and not (run_dir / "export").exists()
        result = train.train(run_dir, corpus, resume=True, progress=False)
    assert result.step == TRAIN.num_steps
    mtp, main = nnx.state(result.model, MTP_PARAMS), nnx.state(result.model, MAIN_PARAMS)
    assert {x.dtype for x in jax.tree.leaves(mtp)} == {jnp.dtype(jnp.float32)}  # master weights
    assert jnp.dtype(jnp.bfloat16) in {x.dtype for x in jax.tree.leaves(main)}
    for ours, theirs in zip(jax.tree.leaves(main), jax.tree.leaves(nnx.state(model, MAIN_PARAMS)), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))

    export = tmp_path / "run" / "export"
    _check_heads_only(source, export, set(mtp_tensors(result.model)))
    for name in ("config.json", "tokenizer.json", "README.md"):
        assert (export / name).read_bytes() == (source / name).read_bytes()
    if sharded:  # every shard keeps its tensors; the index lists exactly what is stored
        index = json.loads((export / INDEX_FILE).read_text())
        source_index = json.loads((source / INDEX_FILE).read_text())
        assert index["weight_map"] == source_index["weight_map"]
        assert index["metadata"]["total_size"] == source_index["metadata"]["total_size"]
        assert "model.layers.2.embed_tokens.weight" in index["weight_map"]  # DeepSeek's copy: trunk bytes
    loaded = load_hf_checkpoint(export)
    for ours, theirs in zip(jax.tree.leaves(nnx.state(loaded, MTP_PARAMS)), jax.tree.leaves(mtp), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs.astype(ours.dtype)))
    assert _files(source) == untouched
    # A source changed since the run started (here its modification time): save_pretrained, with a warning.
    os.utime(source / WEIGHTS_FILE if not sharded else next(source.glob("model-*")), ns=(1, 1))
    with pytest.warns(UserWarning, match="gone or has changed"):
        train._export(result.model, run_dir, run, TRAIN)
    loaded = load_hf_checkpoint(run_dir / "export")
    for ours, theirs in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(result.model)), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs).astype(ours.dtype))


@pytest.mark.parametrize("family,before", [("llama", 0), ("deepseek_v3", 1)])
def test_heads_added_are_exported_with_their_config(tmp_path, corpus, family, before):
    """--mtp-layers 2 on a model with `before` heads: the new heads are written (in the model's dtype, with
    DeepSeek's copies), config.json says 2, and the export loads back with the source's trunk outputs."""
    config = (LLAMA if family == "llama" else DEEPSEEK).replace(num_nextn_predict_layers=before)
    source = tmp_path / "source"
    plain = _source(source, config, corpus)
    model = init_from_pretrained(source, num_nextn_predict_layers=2, seed=3)
    export = tmp_path / "export"
    export_mtp_heads(model, source, export)
    hf, source_hf = (json.loads((d / "config.json").read_text()) for d in (export, source))
    assert hf["num_nextn_predict_layers"] == 2
    assert {k: v for k, v in hf.items() if k in source_hf and k != "num_nextn_predict_layers"} == {
        k: v for k, v in source_hf.items() if k != "num_nextn_predict_layers"
    }
    before_raw, after_raw = _raw(source), _raw(export)
    copies = {c: s for c, s in shared_copies(model.config).items() if c.startswith("model.layers.")}
    assert set(after_raw) - set(before_raw) == (set(mtp_tensors(model)) | set(copies)) - set(before_raw)
    for copy, shared in copies.items():  # DeepSeek's copies of the embedding and head: the trunk's bytes
        assert after_raw[copy] == before_raw[shared]
    for name in set(before_raw):
        if name not in mtp_tensors(model):
            assert after_raw[name] == before_raw[name], name
    loaded = load_hf_checkpoint(export)
    assert loaded.config == model.config.replace(eos_token_id=loaded.config.eos_token_id)
    np.testing.assert_array_equal(loaded.forward_full(TOKENS)[0], plain.forward_full(TOKENS)[0])
    for ours, theirs in zip(
        jax.tree.leaves(nnx.state(loaded, MTP_PARAMS)), jax.tree.leaves(nnx.state(model, MTP_PARAMS)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs).astype(ours.dtype))


def test_fp8_source_keeps_its_fp8_trunk_and_requantizes_the_heads(tmp_path, corpus):
    """A block-scaled FP8 DeepSeek-V3 source, loaded dequantized (float32) with its MTP module changed: the
    FP8 trunk (weights and scales) is copied byte for byte, the MTP layer's FP8 weights are quantized again
    from the model's with their scales, its unquantized tensors are the model's."""
    block = (16, 8)
    fp8 = Fp8Config(weight_block_size=block)
    source = tmp_path / "source"
    write_fp8_checkpoint(init_model(DEEPSEEK.replace(initializer_range=0.2), 1), fp8, source)
    (source / "tokenizer.json").write_bytes(corpus.tokenizer_path.read_bytes())
    model = load_hf_checkpoint(source, dequantize=True)
    mtp = nnx.state(model, MTP_PARAMS)
    nnx.update(model, jax.tree.map(lambda x: x * 1.5 + 0.01 if x.dtype == jnp.float32 else x, mtp))
    export_mtp_heads(model, source, tmp_path / "export")
    ours = mtp_tensors(model)
    _check_heads_only(source, tmp_path / "export", set(ours) | {n for n in _raw(source) if n[:-10] in ours})
    after = _raw(tmp_path / "export")
    quantized = [name for name in ours if after[name][0] == "F8_E4M3"]
    assert quantized and all(after[f"{name}_scale_inv"][0] == "F32" for name in quantized)
    reloaded = load_hf_checkpoint(tmp_path / "export")
    assert reloaded.config.quantization is not None
    files = TensorFile(tmp_path / "export" / WEIGHTS_FILE, tmp_path / "export" / WEIGHTS_FILE)
    try:
        for name in quantized:
            back = dequantize_fp8_blocks(files.read(name), files.read(f"{name}_scale_inv"), block)
            np.testing.assert_allclose(back, ours[name], rtol=2**-4, atol=2e-3)
        for name in set(ours) - set(quantized):
            np.testing.assert_array_equal(files.read(name), ours[name])
    finally:
        files.close()


def test_export_refuses_a_user_directory_and_the_source(tmp_path, corpus):
    source = tmp_path / "source"
    model = _source(source, LLAMA.replace(num_nextn_predict_layers=1), corpus)
    untouched = _files(source)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine\n")
    with pytest.raises(FileExistsError, match="not empty"):
        export_mtp_heads(model, source, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine\n"
    for target in (source, source / "sub", tmp_path):
        with pytest.raises(ValueError, match="outside the source"):
            export_mtp_heads(model, source, target, overwrite=True)
    export_mtp_heads(model, source, tmp_path / "mine", overwrite=True)  # kept: the user's other files
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine\n"
    assert _raw(tmp_path / "mine") == _raw(source)  # nothing trained: the same checkpoint
    other = init_model(LLAMA.replace(num_nextn_predict_layers=1, hidden_size=64, intermediate_size=128))
    with pytest.raises(ValueError, match="hidden_size"):
        export_mtp_heads(other, source, tmp_path / "other")
    assert not (tmp_path / "other").exists()
    assert _files(source) == untouched


def test_qwen3_5_fused_experts_are_written_fused(tmp_path):
    """A Qwen3.5-MoE source holding its routed experts fused, as Qwen's files do (`experts.gate_up_proj`
    [R, 2I, E], `experts.down_proj` [R, E, I], the MTP layer's too): the export stores the same tensors, the
    trunk's byte for byte and the MTP layer's fused tensors refilled from the model's experts."""
    from safetensors.numpy import save_file
    from speculative_helpers import HYBRID_MOE

    from mtp_jax.checkpoints import families

    config = HYBRID_MOE.replace(
        mtp_layout="qwen3_5", **families.FAMILY_CONVENTIONS["qwen3_5"], **families._QWEN_MOE_FIXED
    )
    source = tmp_path / "source"
    save_hf_checkpoint(init_model(config, 2), source)
    files = TensorFile(source / WEIGHTS_FILE, source / WEIGHTS_FILE)
    tensors = {name: files.read(name) for name in files.entries}
    files.close()
    fused = {}
    for name in [n for n in tensors if ".mlp.experts.0.gate_proj." in n]:
        base = name.split(".mlp.experts.")[0] + ".mlp.experts"
        rows = range(config.n_routed_experts)
        fused[f"{base}.gate_up_proj"] = np.stack(
            [
                np.concatenate([tensors.pop(f"{base}.{r}.gate_proj.weight"), tensors.pop(f"{base}.{r}.up_proj.weight")])
                for r in rows
            ]
        )
        fused[f"{base}.down_proj"] = np.stack([tensors.pop(f"{base}.{r}.down_proj.weight") for r in rows])
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in fused
    save_file({**tensors, **fused}, source / WEIGHTS_FILE, metadata={"format": "pt"})
    model = load_hf_checkpoint(source)
    nnx.update(model, jax.tree.map(lambda x: x * 1.5 + 0.01, nnx.state(model, MTP_PARAMS)))
    export_mtp_heads(model, source, tmp_path / "export")
    mtp = {n for n in fused if n.startswith("mtp.")} | {n for n in mtp_tensors(model) if n in tensors}
    _check_heads_only(source, tmp_path / "export", mtp)
    reloaded = load_hf_checkpoint(tmp_path / "export")
    for ours, theirs in zip(jax.tree.leaves(nnx.state(reloaded)), jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
