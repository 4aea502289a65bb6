"""`mtp-jax eval`: held-out loss, bits/byte and per-depth MTP loss and agreement of a run or a model directory."""

from __future__ import annotations

import argparse
import json
import pathlib

from mtp_jax.checkpoints import reading as checkpoint
from mtp_jax.cli.common import MODEL_HELP, bounded, corpus_of_run, default_data_dir, pick_model
from mtp_jax.training import data
from mtp_jax.training.step import evaluate
from mtp_jax.training.trainer import load_run


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `eval` (held-out loss, bits/byte, per-depth MTP loss and agreement) on argparse subparsers."""
    p = subparsers.add_parser(
        "eval",
        help="held-out loss, bits/byte and per-depth MTP agreement of a model",
        description="Evaluate a model on the held-out split of the Python stdlib corpus: main loss (nats/token), "
        "bits/byte, and per MTP depth its loss, its agreement with the main model's argmax and the "
        "simulated acceptance (teacher-forced: drafts 1..k all equal to the main model's greedy tokens) "
        "with the mean acceptance length it implies, for MTP Vanilla and MTP Eagle. --model DIR names "
        "the model: a saved model directory (config.json, safetensors, tokenizer.json). PATH is a run "
        "dir (its latest readable checkpoint, or --step) "
        "or a saved model directory; give PATH or --model. Prints the metrics as JSON.",
    )
    p.add_argument(
        "path", metavar="PATH", nargs="?", help="a run dir (latest checkpoint, or --step) or a saved model directory"
    )
    p.add_argument("--model", metavar="DIR", help=MODEL_HELP)
    p.add_argument("--step", type=bounded(int, 0), help="checkpoint step of a run dir (default the latest)")
    p.add_argument("--data-dir", help="corpus cache (default: the run's, or one keyed by the tokenizer)")
    p.add_argument("--batch-size", type=bounded(int, 1), default=16, help="rows per batch (default 16)")
    p.add_argument("--seq-len", type=bounded(int, 2), help="tokens per row (default: the run's, else 256)")
    p.add_argument("--max-batches", type=bounded(int, 1), help="evaluate only the first batches")
    p.add_argument("--mtp-lambda", type=bounded(float, 0), default=0.1, help="weight of the MTP loss (default 0.1)")
    p.add_argument(
        "--eagle-steps",
        type=bounded(int, 0),
        default=3,
        help="K of the simulated MTP Eagle acceptance (module 1 chained K times; default 3, 0: none)",
    )
    p.set_defaults(func=run_eval)
    return p


def _load_model_dir(path: pathlib.Path, spelling: str):
    """(model, tokenizer.json path) of a saved model directory; errors name `spelling` when it is --model."""
    tokenizer_path = path / "tokenizer.json"
    if spelling != "--model":
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no run.json or tokenizer.json in {path}")
        return checkpoint.load_hf_checkpoint(path), tokenizer_path
    if not tokenizer_path.is_file():
        run_dir = f"; {path} is a run dir: give it as PATH" if (path / "run.json").is_file() else ""
        raise ValueError(
            f"--model: no tokenizer.json in {path} (a saved model directory holds config.json, "
            f"safetensors, tokenizer.json){run_dir}"
        )
    try:
        return checkpoint.load_hf_checkpoint(path), tokenizer_path
    except (OSError, ValueError) as error:  # missing config.json or weights, corrupt or mismatched checkpoints
        raise ValueError(f"--model: {error}") from error


def run_eval(args: argparse.Namespace) -> int:
    given, spelling = pick_model(args.path, args.model, "PATH")
    if given is None:
        raise ValueError("name the model: PATH (a run dir or a saved model directory) or --model DIR")
    if spelling == "--model" and args.step is not None:
        raise ValueError(
            f"--step {args.step} picks a checkpoint of a run dir (PATH); --model {given} is a saved model directory"
        )
    path = pathlib.Path(given)
    seq_len = args.seq_len
    if spelling == "PATH" and (path / "run.json").is_file():
        model, run = load_run(path, args.step)
        corpus = corpus_of_run(path, run, args.data_dir)
        seq_len = seq_len or run["train_config"]["seq_len"]
    else:
        model, tokenizer_path = _load_model_dir(path, spelling)
        corpus = data.prepare_corpus(
            args.data_dir or default_data_dir(tokenizer_path=tokenizer_path),
            tokenizer_path=tokenizer_path,
            verbose=True,
        )
    result = evaluate(
        model,
        corpus.heldout,
        data.token_byte_lengths(corpus.tokenizer),
        batch_size=args.batch_size,
        seq_len=seq_len or 256,
        mtp_lambda=args.mtp_lambda,
        eagle_steps=args.eagle_steps,
        max_batches=args.max_batches,
    )
    print(json.dumps(result, indent=1))
    return 0
