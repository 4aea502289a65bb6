"""Resuming a run: what a resume may change, checked against the run's run.json, and recorded there.

A resume restores the model and optimizer from the run's checkpoint; only `RESUMABLE_FIELDS` of the
training settings may differ (more steps, another learning-rate tail, ...), and each change is
appended to run.json's `resumes`.
"""

from __future__ import annotations

import dataclasses
import pathlib

from mtp_jax.config import ModelConfig
from mtp_jax.model import Transformer
from mtp_jax.training import data
from mtp_jax.training.run_dir import TOKENIZER_FILE, config_to_dict, model_config_from_dict, read_run, write_run
from mtp_jax.training.step import RESUMABLE_FIELDS, TrainConfig


def check_compatible(model_config: ModelConfig, train_config: TrainConfig, corpus: data.Corpus) -> None:
    """Raises ValueError when the model cannot train on `corpus` with `train_config`.

    An FP8 model (`quantization`) trains only with `mtp_only` (its FP8 trunk frozen, in FP8) and its MTP
    modules unquantized (`Fp8Config.quantize_mtp` False: float32 master weights); ValueError naming FP8
    otherwise."""
    fp8 = model_config.quantization
    if fp8 is not None and not train_config.mtp_only:
        raise ValueError(
            "the model holds FP8 weights (quantization_config), which training does not update: load the "
            "checkpoint with load_hf_checkpoint(..., dequantize=True) to train it in a float dtype, or train "
            "only its MTP modules over the frozen FP8 trunk (mtp_only, --mtp-only)"
        )
    if fp8 is not None and fp8.quantize_mtp and model_config.num_nextn_predict_layers:
        raise ValueError(
            "mtp_only over an FP8 trunk trains the MTP modules as float32 master weights, and this model holds "
            "them in FP8: load it with init_from_pretrained(..., dequantize_mtp=True) (or load_hf_checkpoint: "
            "Fp8Config.quantize_mtp=False)"
        )
    if corpus.vocab_size > model_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {corpus.vocab_size} tokens but the model's vocab_size is {model_config.vocab_size}"
        )
    if train_config.mtp_only and model_config.num_nextn_predict_layers == 0:
        raise ValueError("mtp_only needs MTP modules: num_nextn_predict_layers is 0 (set it, or --mtp-layers)")
    layers = model_config.num_hidden_layers + model_config.num_nextn_predict_layers
    balancing = [name for name in ("bias_update_speed", "balance_alpha") if getattr(train_config, name)]
    if balancing and not any(model_config.is_moe_layer(i) for i in range(layers)):
        raise ValueError(f"{' and '.join(balancing)} balance MoE layers' experts; the model has no MoE layer")
    if train_config.bias_update_speed and model_config.scoring_func != "sigmoid":
        raise ValueError("bias_update_speed moves sigmoid routers' e_score_correction_bias; these routers use softmax")
    train_config.depth_weights(model_config.num_nextn_predict_layers)  # a weight per depth
    if train_config.seq_len > model_config.max_position_embeddings:
        raise ValueError(
            f"seq_len ({train_config.seq_len}) exceeds max_position_embeddings ({model_config.max_position_embeddings})"
        )


def differences(saved, given) -> dict[str, tuple]:
    """Field -> (saved, given) for every field of two configs of one dataclass that differs."""
    return {k: (v, getattr(given, k)) for k, v in dataclasses.asdict(saved).items() if getattr(given, k) != v}


def resume_settings(
    run_dir: pathlib.Path,
    corpus: data.Corpus,
    model_config: ModelConfig | None,
    train_config: TrainConfig | None,
    model: Transformer | None,
) -> tuple[dict, ModelConfig, TrainConfig, TrainConfig]:
    """(run.json dict, model config, saved train config, train config to resume with) of a run."""
    if model is not None:
        raise ValueError("resume restores the model from the checkpoint; do not pass model")
    run = read_run(run_dir)
    saved_model = model_config_from_dict(run["model_config"])
    saved_train = TrainConfig(**run["train_config"])
    if model_config is not None and model_config != saved_model:
        raise ValueError(
            f"model_config differs from the run's in {run_dir}: "
            + "; ".join(
                f"{k} (saved {a!r}, given {b!r})" for k, (a, b) in differences(saved_model, model_config).items()
            )
        )
    if train_config is None:
        train_config = saved_train
    fixed = {k: d for k, d in differences(saved_train, train_config).items() if k not in RESUMABLE_FIELDS}
    if fixed:
        raise ValueError(
            f"train_config differs from the run's in {run_dir} in settings a resume cannot change: "
            + "; ".join(f"{k} (saved {a!r}, given {b!r})" for k, (a, b) in fixed.items())
        )
    if (
        run["corpus"]["fingerprint"] != corpus.metadata["fingerprint"]
        or corpus.tokenizer_path.read_bytes() != (run_dir / TOKENIZER_FILE).read_bytes()
    ):
        raise ValueError(f"the corpus or tokenizer differs from the one the run in {run_dir} started with")
    return run, saved_model, saved_train, train_config


def record_resume(run_dir: pathlib.Path, run: dict, saved: TrainConfig, config: TrainConfig, step: int) -> None:
    """Checks a resume's settings against the restored step and writes changed ones to run.json."""
    if config.num_steps < step:
        raise ValueError(
            f"num_steps must be >= {step}, the step of the checkpoint resumed from in {run_dir}, got {config.num_steps}"
        )
    changed = differences(saved, config)
    if changed:
        resumes = [*run.get("resumes", []), {"step": step, "changed": {k: list(d) for k, d in changed.items()}}]
        run = {**run, "train_config": config_to_dict(config), "resumes": resumes}
        write_run(run_dir, run)
