"""`mtp-jax train`: train a model with MTP modules on the Python stdlib corpus, or on a data directory with
`--data DIR` such as `mtp-jax distill-data`'s output (fresh from `--model PRESET`,
`--resume`, or from a saved model directory with `--model DIR` (the same as `--init-from DIR`), e.g.
`--mtp-only` heads on a pretrained model)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from tokenizers import Tokenizer

from mtp_jax.checkpoints.hf_config import config_from_hf
from mtp_jax.checkpoints.pretrained import init_from_pretrained
from mtp_jax.cli.common import (
    MODEL_HELP,
    bounded,
    corpus_of_run,
    data_corpus,
    default_data_dir,
    resume_data_dir,
)
from mtp_jax.cli.distributed import add_mesh_arguments, mesh_from_args
from mtp_jax.config import FULL_SIZE_PRESETS, PRESETS, ModelConfig
from mtp_jax.training import data
from mtp_jax.training.guards import NonFiniteError
from mtp_jax.training.run_dir import RunDirInUseError
from mtp_jax.training.run_file import read_run_file, saved_model_config, saved_train_config
from mtp_jax.training.step import RESUMABLE_FIELDS, TrainConfig
from mtp_jax.training.trainer import check_run_dir, train


def _float_list(text: str) -> tuple[float, ...]:
    """An argparse `type`: comma-separated numbers, e.g. "0.5,0.3,0.2"."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, e.g. 0.5,0.3,0.2, got {text!r}") from None


_float_list.__name__ = "list of numbers"

# (flag, TrainConfig field, argparse type) of `mtp-jax train`'s training settings.
_TRAIN_FLAGS = (
    ("--steps", "num_steps", bounded(int, 1)),
    ("--batch-size", "batch_size", bounded(int, 1)),
    ("--seq-len", "seq_len", bounded(int, 2)),
    ("--lr", "learning_rate", bounded(float, 0, above=True)),
    ("--warmup", "warmup_steps", bounded(int, 0)),
    ("--min-lr-ratio", "min_lr_ratio", bounded(float, 0, 1)),
    ("--weight-decay", "weight_decay", bounded(float, 0)),
    ("--grad-clip", "grad_clip_norm", bounded(float, 0)),
    ("--mtp-lambda", "mtp_lambda", bounded(float, 0)),
    ("--mtp-depth-weights", "mtp_depth_weights", _float_list),
    ("--mtp-depth-decay", "mtp_depth_decay", bounded(float, 0, 1, above=True)),
    ("--bias-update-speed", "bias_update_speed", bounded(float, 0)),  # MoE: DeepSeek-V3's gamma (0.001)
    ("--balance-alpha", "balance_alpha", bounded(float, 0)),  # MoE: sequence-wise balance loss (V3: 0.0001)
    ("--seed", "seed", int),
    ("--checkpoint-every", "checkpoint_every", bounded(int, 1)),
    ("--eval-every", "eval_every", bounded(int, 0)),
    ("--eval-batches", "eval_batches", bounded(int, 1)),
    ("--log-every", "log_every", bounded(int, 1)),
)
_FLAG_OF_FIELD = {field: flag for flag, field, _ in _TRAIN_FLAGS} | {
    "mtp_only": "--mtp-only",
    "mtp_targets": "--mtp-targets",
}

TRAINABLE_PRESETS = sorted(set(PRESETS) - FULL_SIZE_PRESETS)  # what --model NAME may train


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `train` (from scratch, `--resume`, `--mtp-only --model DIR`) on an argparse subparsers."""
    p = subparsers.add_parser(
        "train",
        help="train a model with MTP modules on the Python stdlib corpus",
        description="Train a decoder with DeepSeek-V3-style MTP modules on the Python standard library's source "
        "(main next-token loss + mtp_lambda x mean MTP loss, AdamW, orbax checkpoints). --model names "
        "the model: a saved model directory (config.json, safetensors, tokenizer.json) to start from, "
        "or a preset name for a fresh model (default demo). run_dir gets "
        "run.json, checkpoints/, log.jsonl and, at the end, export/ (a Hugging Face-format model). "
        "--resume continues a run exactly (flags may only raise or lower --steps and change "
        "bookkeeping); --overwrite restarts a run dir and never deletes any other folder; one trainer "
        "at a time per run dir; a non-finite loss stops the run before it is saved.",
    )
    p.add_argument("run_dir", help="the run's directory (checkpoints, log.jsonl, export/)")
    mode = p.add_argument_group("mode")
    start = mode.add_mutually_exclusive_group()  # continue the run, or delete it and start again: not both
    start.add_argument("--resume", action="store_true", help="continue the run in run_dir from its latest checkpoint")
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run in run_dir and start again (only a run dir: one with its run.json)",
    )
    mode.add_argument("--mtp-only", action="store_true", help="freeze the main model, train only the MTP modules")
    mode.add_argument(
        "--mtp-targets",
        choices=("data", "self"),
        default=None,
        help="what the MTP depths learn to predict: the data's tokens (default), or the main head's own greedy "
        "tokens (self-distillation: what a strict-greedy verify accepts)",
    )
    mode.add_argument(
        "--init-from",
        metavar="DIR",
        help=f"{MODEL_HELP} to initialise from, the same as --model DIR (give one of them); its "
        "tokenizer is used for the corpus",
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        metavar="PRESET_OR_DIR",
        help=f"{MODEL_HELP}, or a preset name ({', '.join(TRAINABLE_PRESETS)}; default demo). A preset "
        "name wins over a directory of that name (write ./demo for the directory). A "
        "directory starts from that model, its tokenizer used for the corpus",
    )
    model.add_argument(
        "--mtp-layers",
        type=bounded(int, 0),
        help="D, the number of MTP modules (default: the preset's, 3 for demo; with a model "
        "directory, the checkpoint's)",
    )
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="compute dtype (a fresh model keeps float32 weights; with a model directory, both)",
    )
    corpus = p.add_argument_group("corpus")
    corpus.add_argument("--vocab-size", type=bounded(int, 1), help="BPE vocabulary to train (default 4096)")
    corpus.add_argument(
        "--heldout-fraction", type=bounded(float, 0, 1), help=f"default {data.DEFAULT_HELDOUT_FRACTION}"
    )
    corpus.add_argument("--data-dir", help="corpus cache (default: see default_data_dir)")
    corpus.add_argument(
        "--data",
        metavar="DIR",
        help="train on a data directory instead of the stdlib corpus: `mtp-jax distill-data`'s output (or a "
        "corpus cache); its tokenizer must be the model's. --resume reads it again and refuses it if it changed",
    )
    opt = p.add_argument_group("training")
    d = TrainConfig()
    for flag, field, kind in _TRAIN_FLAGS:
        opt.add_argument(flag, dest=field, type=kind, default=None, help=f"default {getattr(d, field)}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-export", action="store_true", help="do not write run_dir/export at the end")
    add_mesh_arguments(
        p,
        mesh_help="--batch-size must be a multiple of data x fsdp; data=N replicates the "
        "parameters and optimizer state (data parallel), fsdp=N splits them along the "
        "hidden size (FSDP), tensor=N along heads, FFN width and vocabulary. A run "
        "may resume on another mesh.",
    )
    p.set_defaults(func=run_train)
    return p


def _train_config_from_args(args: argparse.Namespace, base: TrainConfig | None = None) -> TrainConfig:
    """`base` (default `TrainConfig()`) with the training flags given on the command line.

    Raises ValueError (naming the flags) for settings TrainConfig refuses together, e.g. --warmup > --steps.
    """
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None and v is not False}
    try:
        return (base or TrainConfig()).replace(**given)
    except ValueError as error:
        message = str(error)
        for field, flag in _FLAG_OF_FIELD.items():
            message = message.replace(field, flag)
        raise ValueError(message) from None


@dataclasses.dataclass(frozen=True)
class _ModelChoice:
    """The model that --model and --init-from name: a preset, or a saved model directory."""

    preset: str | None  # a PRESETS name given with --model; None when none was given or a directory was
    directory: str | None  # the saved model directory to start from (--model DIR or --init-from DIR)
    flag: str | None  # the flag that named the directory, for messages


def _model_choice(args: argparse.Namespace) -> _ModelChoice:
    """What --model (a preset name, or a saved model directory: one with config.json) and --init-from DIR
    name; ValueError (one line, before any corpus work) for both given, or a --model that is neither a
    preset nor a directory with config.json. A preset name wins over a directory of that name."""
    name = args.model
    if name is None:
        return _ModelChoice(None, args.init_from, "--init-from" if args.init_from is not None else None)
    if args.init_from is not None:
        raise ValueError(
            f"--model {name} and --init-from {args.init_from} both name the model to train: give one "
            "of them (--model DIR means --init-from DIR)"
        )
    if name in FULL_SIZE_PRESETS:
        raise ValueError(
            f"--model {name} is a full-size architecture (a config for `mtp-jax plan`, no weights); train from "
            "a checkpoint of it with --init-from DIR"
        )
    if name in PRESETS:
        return _ModelChoice(name, None, None)
    path = pathlib.Path(name)
    if path.is_dir() and (path / "config.json").is_file():
        return _ModelChoice(None, name, "--model")
    if path.is_dir():
        found = "a directory without config.json"
    else:
        found = "a file, not a directory" if path.exists() else "no such directory"
    raise ValueError(
        f"--model {name!r} is neither a preset ({', '.join(TRAINABLE_PRESETS)}) nor a saved model "
        f"directory ({found}; a model directory needs a config.json, safetensors weights and "
        "tokenizer.json)"
    )


def _resume_config(
    args: argparse.Namespace, run_dir: pathlib.Path, run: dict, choice: _ModelChoice | None = None
) -> TrainConfig:
    """The settings `--resume` continues with: the run's, with the flags given (`choice`: what --model and
    --init-from name, `_model_choice(args)` by default).

    Raises ValueError naming each flag whose value differs from the run's (saved and given value)
    in a setting a resume cannot change (all but --steps and the bookkeeping flags).
    """
    saved = saved_train_config(run_dir, run)
    config = _train_config_from_args(args, base=saved)
    differ = [
        f"{_FLAG_OF_FIELD.get(k, k)} (saved {v!r}, given {getattr(config, k)!r})"
        for k, v in dataclasses.asdict(saved).items()
        if getattr(config, k) != v and k not in RESUMABLE_FIELDS
    ]
    saved_model, saved_corpus = saved_model_config(run_dir, run), run["corpus"]
    checks = [
        ("--mtp-layers", args.mtp_layers, saved_model.num_nextn_predict_layers),
        ("--dtype", args.dtype, saved_model.dtype),
        ("--heldout-fraction", args.heldout_fraction, saved_corpus.get("heldout_fraction")),
    ]
    if saved_corpus.get("tokenizer_source") != "given":
        checks.append(("--vocab-size", args.vocab_size, saved_corpus.get("vocab_size")))
    differ += [f"{flag} (saved {old!r}, given {new!r})" for flag, new, old in checks if new is not None and new != old]
    choice = choice or _model_choice(args)
    if choice.preset is not None:

        def as_run(preset):
            return preset.replace(
                vocab_size=saved_model.vocab_size,
                eos_token_id=saved_model.eos_token_id,
                num_nextn_predict_layers=saved_model.num_nextn_predict_layers,
                dtype=saved_model.dtype,
            )

        old = next((name for name, preset in PRESETS.items() if as_run(preset) == saved_model), None)
        if old != choice.preset:
            differ.append(f"--model (saved {old or 'a model of no preset'!r}, given {choice.preset!r})")
    if choice.directory is not None:
        differ.append(f"{choice.flag} (given {choice.directory!r}; a resume restores the model from the checkpoint)")
    if differ:
        raise ValueError(
            f"--resume: flags differ from the run in {run_dir} where a resume cannot change them: "
            + "; ".join(differ)
            + ". Drop them to continue the run, or start a new one"
        )
    return config


def run_train(args: argparse.Namespace) -> int:
    """`mtp-jax train`: prints the result as JSON and returns 0; returns 1 (with a one-line message on
    stderr) if the run dir is in use or training stopped at a non-finite loss."""
    try:
        result = _train_from_args(args)
    except (RunDirInUseError, NonFiniteError) as error:
        print(f"mtp-jax train: error: {error}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "step": result.step,
                "stopped_early": result.stopped_early,
                "train": result.train_metrics,
                "heldout": result.eval_metrics,
            },
            indent=1,
        )
    )
    return 0


# ----------------------------------------------------------------------------------------------
# What is refused before the corpus is prepared (tokenizing it takes minutes on a first run).


def _refuse_untrainable(config: ModelConfig, mtp_only: bool, source: str) -> None:
    """What `train` would refuse only once the corpus is ready, refused first (ValueError naming `source`,
    the flag): FP8 weights without --mtp-only (with it the FP8 trunk stays frozen and only the MTP modules
    train), and --mtp-only for a model without MTP modules."""
    if config.quantization is not None and not mtp_only:
        raise ValueError(
            f"{source}: the checkpoint holds FP8 weights (quantization_config), which training does not "
            "update; train only its MTP modules over the frozen FP8 trunk with --mtp-only, or train from a "
            "float checkpoint (dequantize it: load_hf_checkpoint(..., dequantize=True), then save_hf_checkpoint)"
        )
    if mtp_only and config.num_nextn_predict_layers == 0:
        raise ValueError(
            f"{source}: --mtp-only trains the MTP modules and the model has none "
            "(num_nextn_predict_layers is 0): add them with --mtp-layers N"
        )


def _pretrained_config(path: pathlib.Path) -> ModelConfig | None:
    """The config in path/config.json, None when it cannot be read (loading the model then says why)."""
    try:
        hf = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return config_from_hf(hf) if isinstance(hf, dict) else None
    except (OSError, ValueError, TypeError, AttributeError, KeyError):
        return None


def _train_from_args(args: argparse.Namespace):
    mesh = mesh_from_args(args)  # first: jax.distributed must start before jax is used
    choice = _model_choice(args)  # a --model that is neither a preset nor a model directory: refused at once
    run_dir = pathlib.Path(args.run_dir)
    check_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)  # fail before preparing the corpus
    if args.resume:
        run = read_run_file(run_dir)
        train_config = _resume_config(args, run_dir, run, choice)
        _refuse_untrainable(saved_model_config(run_dir, run), train_config.mtp_only, f"--resume: the run in {run_dir}")
        corpus = corpus_of_run(run_dir, run, resume_data_dir(args, run))
        return train(
            run_dir,
            corpus,
            train_config=train_config,
            resume=True,
            progress=not args.no_progress,
            export=not args.no_export,
            mesh=mesh,
        )
    train_config = _train_config_from_args(args)
    vocab_size = 4096 if args.vocab_size is None else args.vocab_size
    heldout_fraction = data.DEFAULT_HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    model, tokenizer_path, eos_token, base = None, None, data.EOS_TOKEN, None
    given_data = None  # --data DIR: read and checked against the model's tokenizer before any weights
    if args.data is not None:
        directory = pathlib.Path(choice.directory) if choice.directory is not None else None
        given_data = data_corpus(args, directory / "tokenizer.json" if directory is not None else None)
    if choice.directory is not None:
        source = f"{choice.flag} {choice.directory}"
        tokenizer_path = pathlib.Path(choice.directory) / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"{choice.flag}: no tokenizer.json in {choice.directory}")
        pretrained = _pretrained_config(pathlib.Path(choice.directory))
        if pretrained is not None:  # before the weights are read
            if args.mtp_layers is not None:
                pretrained = pretrained.replace(num_nextn_predict_layers=args.mtp_layers)
            _refuse_untrainable(pretrained, train_config.mtp_only, source)
        model = init_from_pretrained(
            choice.directory,
            num_nextn_predict_layers=args.mtp_layers,
            seed=train_config.seed,
            dtype=args.dtype,
            mesh=mesh,
            dequantize_mtp=train_config.mtp_only,  # an FP8 trunk: float MTP modules, float32 master weights
        )
        model_config = model.config
        _refuse_untrainable(model_config, train_config.mtp_only, source)
        if model_config.quantization is not None:  # run.json's model_config records it (quantize_mtp false)
            print(
                f"{source}: FP8 checkpoint: the trunk stays float8_e4m3fn with its block scales (frozen); the "
                f"MTP modules load dequantized to {model_config.param_dtype} and train as float32 master weights "
                "(the export re-quantizes them as the source stores them)",
                file=sys.stderr,
            )
        if model_config.eos_token_ids:  # the model's own end-of-text token separates documents
            eos_token = Tokenizer.from_file(str(tokenizer_path)).id_to_token(model_config.eos_token_ids[0])
    else:
        base = PRESETS[choice.preset or "demo"]
        layers = {} if args.mtp_layers is None else {"num_nextn_predict_layers": args.mtp_layers}
        _refuse_untrainable(base.replace(**layers), train_config.mtp_only, f"--model {choice.preset or 'demo'}")
    if given_data is not None:
        corpus = given_data
    else:
        data_dir = args.data_dir or default_data_dir(vocab_size=vocab_size, tokenizer_path=tokenizer_path)
        corpus = data.prepare_corpus(
            data_dir,
            vocab_size=vocab_size,
            heldout_fraction=heldout_fraction,
            tokenizer_path=tokenizer_path,
            eos_token=eos_token or data.EOS_TOKEN,
            verbose=True,
        )
    if base is not None:
        changes = {"vocab_size": corpus.vocab_size, "eos_token_id": corpus.eos_id}
        if args.mtp_layers is not None:
            changes["num_nextn_predict_layers"] = args.mtp_layers
        if args.dtype is not None:
            changes["dtype"] = args.dtype
        model_config = base.replace(**changes)
    if train_config.mtp_only and choice.directory is None:
        print(
            "warning: --mtp-only without a model directory (--model DIR) trains MTP modules on a random main model",
            file=sys.stderr,
        )
    return train(
        run_dir,
        corpus,
        model_config=model_config,
        train_config=train_config,
        model=model,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        export=not args.no_export,
        mesh=mesh,
        init_from=choice.directory,
    )
