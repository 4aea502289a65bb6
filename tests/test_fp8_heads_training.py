"""Heads-only training over a frozen block-scaled FP8 trunk (`mtp-jax train --init-from FP8_DIR --mtp-only`):
the trunk stays float8_e4m3fn with its scales, the MTP modules load dequantized and train as float32 master
weights (`Fp8Config.quantize_mtp=False`), the export keeps every trunk tensor's bytes and re-quantizes the MTP
weights the source holds in FP8, a resume restores the same structure, and full training stays refused."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from fp8_checkpoints import write_fp8_checkpoint
from test_heads_only import DEEPSEEK, _raw, corpus  # noqa: F401  (corpus: a fixture)

from mtp_jax.checkpoints import load_hf_checkpoint, save_hf_checkpoint
from mtp_jax.checkpoints.heads_only import mtp_tensors
from mtp_jax.cli import main
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import init_model
from mtp_jax.mtp import MAIN_PARAMS, MTP_PARAMS
from mtp_jax.quantization import Fp8Config, dequantize_fp8_blocks
from mtp_jax.training import trainer
from mtp_jax.training.resume import check_compatible

FP8 = Fp8Config(weight_block_size=(16, 8))
CONFIG = DEEPSEEK.replace(num_hidden_layers=1, first_k_dense_replace=0, initializer_range=0.2)  # MLA + MoE, one MTP
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
SHORT = trainer.TrainConfig(seq_len=16)


@pytest.fixture(scope="module")
def source(tmp_path_factory, corpus):  # noqa: F811
    """A tiny DeepSeek-V3 (MLA, MoE, one MTP layer) FP8 checkpoint directory with the corpus's tokenizer."""
    path = tmp_path_factory.mktemp("fp8") / "source"
    model = init_model(CONFIG.replace(eos_token_id=corpus.eos_id), 1)
    write_fp8_checkpoint(model, FP8, path)
    (path / "tokenizer.json").write_bytes(corpus.tokenizer_path.read_bytes())
    return path


def _dtypes(state) -> set:
    return {x.dtype for x in jax.tree.leaves(state)}


def test_the_reader_holds_fp8_trunk_and_float_mtp_modules(source):
    """`dequantize_mtp=True`: the trunk's params are the FP8 load's bit for bit, the MTP modules' the
    dequantized load's (`dequantize=True`), in the checkpoint's float dtype; a save writes them back as FP8."""
    fp8, plain = load_hf_checkpoint(source), load_hf_checkpoint(source, dequantize=True)
    model = load_hf_checkpoint(source, dequantize_mtp=True)
    assert model.config.quantization == FP8.__class__(weight_block_size=(16, 8), quantize_mtp=False)
    assert FP8_DTYPE not in _dtypes(nnx.state(model, MTP_PARAMS))
    for ours, theirs in zip(
        jax.tree.leaves(nnx.state(model, MTP_PARAMS)), jax.tree.leaves(nnx.state(plain, MTP_PARAMS)), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    main_state, fp8_main = nnx.state(model, MAIN_PARAMS), nnx.state(fp8, MAIN_PARAMS)
    assert FP8_DTYPE in _dtypes(main_state)
    for ours, theirs in zip(jax.tree.leaves(main_state), jax.tree.leaves(fp8_main), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8), np.asarray(theirs).view(np.uint8))


def test_training_an_fp8_model_needs_mtp_only_and_float_mtp_modules(source, corpus, tmp_path, capsys):  # noqa: F811
    """Full training of an FP8 model is refused naming FP8 (API and CLI, before the corpus); `mtp_only`
    with the MTP modules still in FP8 is refused naming dequantize_mtp."""
    config = load_hf_checkpoint(source).config
    with pytest.raises(ValueError, match=r"FP8 weights .*mtp_only"):
        check_compatible(config, SHORT, SimpleNamespace(vocab_size=8))
    with pytest.raises(ValueError, match=r"dequantize_mtp=True"):
        check_compatible(config, SHORT.replace(mtp_only=True), SimpleNamespace(vocab_size=8))
    float_mtp = config.replace(quantization=Fp8Config(weight_block_size=(16, 8), quantize_mtp=False))
    check_compatible(float_mtp, SHORT.replace(mtp_only=True), SimpleNamespace(vocab_size=8))
    run = tmp_path / "run"
    full = [
        "train",
        str(run),
        "--init-from",
        str(source),
        "--data",
        str(corpus.work_dir),
        "--steps",
        "1",
        "--warmup",
        "0",
    ]
    assert main(full) == 2
    err = capsys.readouterr().err
    assert "FP8 weights" in err and "--mtp-only" in err and not (run / "run.json").exists()


def test_fp8_heads_only_training_exports_the_trunk_bytes_and_resumes(source, corpus, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    argv = ["train", str(run), "--init-from", str(source), "--mtp-only", "--data", str(corpus.work_dir)]
    argv += ["--steps", "2", "--warmup", "0", "--batch-size", "2", "--seq-len", "16", "--lr", "1e-2"]
    argv += ["--eval-batches", "1", "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "MTP modules load dequantized" in capsys.readouterr().err
    saved = json.loads((run / "run.json").read_text())["model_config"]["quantization"]
    assert saved == {"weight_block_size": [16, 8], "modules_to_not_convert": [], "quantize_mtp": False}

    # What training holds (the checkpoint it saved): the frozen trunk in FP8, the source's bytes; float32 MTP.
    model, _ = trainer.load_run(run)
    mtp, main_state = nnx.state(model, MTP_PARAMS), nnx.state(model, MAIN_PARAMS)
    assert _dtypes(mtp) == {jnp.dtype(jnp.float32)}
    fp8_main = nnx.state(load_hf_checkpoint(source), MAIN_PARAMS)
    assert FP8_DTYPE in _dtypes(main_state)
    for ours, theirs in zip(jax.tree.leaves(main_state), jax.tree.leaves(fp8_main), strict=True):
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(np.asarray(ours).view(np.uint8), np.asarray(theirs).view(np.uint8))
    _, target = trainer.abstract_train_state(model.config, trainer.TrainConfig(mtp_only=True))
    assert _dtypes(target["train"].params) == {jnp.dtype(jnp.float32)}
    assert FP8_DTYPE in _dtypes(target["frozen"])
    first_export = _raw(run / "export")

    assert main(["train", str(run), "--resume", "--steps", "3", "--no-progress"]) == 0, capsys.readouterr().err
    resumed, _ = trainer.load_run(run)
    assert int(json.loads((run / "log.jsonl").read_text().splitlines()[-1])["step"]) == 3
    ours = mtp_tensors(resumed)

    # The export: every trunk tensor (FP8 weights, scales, DeepSeek's MTP copies of embedding and head) byte
    # for byte; the MTP tensors trained, in the source's dtypes: FP8 with F32 scales where it held them so.
    before, after = _raw(source), _raw(run / "export")
    assert set(after) == set(before) and after != first_export
    mtp_names = set(ours) | {f"{name}_scale_inv" for name in ours if f"{name}_scale_inv" in before}
    for name in set(before) - mtp_names:
        assert after[name] == before[name], name
    for name in mtp_names:
        assert after[name][:2] == before[name][:2], name
        if not name.endswith("e_score_correction_bias"):
            assert after[name][2] != before[name][2], name
    quantized = [name for name in ours if after[name][0] == "F8_E4M3"]
    assert len(quantized) > 10 and all(after[f"{name}_scale_inv"][0] == "F32" for name in quantized)
    assert after["model.layers.1.eh_proj.weight"][0] == "F32"  # unquantized, as DeepSeek ships it
    for name in quantized:
        dtype, shape, data = after[name]
        weight = np.frombuffer(data, jnp.float8_e4m3fn).reshape(shape)
        scale = np.frombuffer(after[f"{name}_scale_inv"][2], np.float32).reshape(after[f"{name}_scale_inv"][1])
        np.testing.assert_allclose(
            dequantize_fp8_blocks(weight, scale, FP8.weight_block_size), ours[name], rtol=2**-4, atol=2e-3
        )
    assert (run / "export" / "config.json").read_bytes() == (source / "config.json").read_bytes()

    # The export loads as an FP8 model and decodes with its MTP module: speculative greedy is plain greedy (each
    # token the argmax of the full forward's logits at the position before it).
    exported = load_hf_checkpoint(run / "export")
    assert exported.config.quantization == FP8
    prompt = [5, 17, 3, 40]
    vanilla = SpeculativeConfig(method="vanilla", num_speculative_tokens=1)
    tokens = generate(exported, [prompt], max_new_tokens=6, max_length=16, speculative=vanilla, stop_tokens=[]).tokens
    sequence = jnp.asarray([prompt + list(tokens[0])], jnp.int32)
    logits = exported.forward_full(sequence)[0]  # [1, T, V]
    assert list(tokens[0]) == np.asarray(jnp.argmax(logits[0, len(prompt) - 1 : -1], axis=-1)).tolist()

    # save_pretrained of the float-MTP model (the fallback export) writes the FP8 layout config.json describes.
    save_hf_checkpoint(resumed, tmp_path / "whole")
    whole = _raw(tmp_path / "whole")
    assert all(whole[name][0] == "F8_E4M3" and f"{name}_scale_inv" in whole for name in quantized)
    loaded = load_hf_checkpoint(tmp_path / "whole", dequantize_mtp=True)
    assert loaded.config.quantization == resumed.config.quantization
