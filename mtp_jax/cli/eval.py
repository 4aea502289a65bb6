"""`mtp-jax eval`: held-out loss, bits/byte and per-depth MTP loss and agreement of a run or a model directory."""

from __future__ import annotations

import argparse
import json
import pathlib

from mtp_jax.checkpoints import reading as checkpoint
from mtp_jax.cli.common import bounded, corpus_of_run, default_data_dir
from mtp_jax.training import data
from mtp_jax.training.step import evaluate
from mtp_jax.training.trainer import load_run


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `eval` (held-out loss, bits/byte, per-depth MTP loss and agreement) on argparse subparsers."""
    p = subparsers.add_parser(
        "eval", help="held-out loss, bits/byte and per-depth MTP agreement of a model",
        description="Evaluate a model on the held-out split of the Python stdlib corpus: main loss (nats/token), "
                    "bits/byte, and per MTP depth its loss and agreement with the main model's argmax "
                    "(teacher-forced). PATH is a run dir (its latest readable checkpoint, or --step) or a Hugging "
                    "Face-format dir with tokenizer.json. Prints the metrics as JSON.")
    p.add_argument("path", help="a run dir (latest checkpoint) or a Hugging Face-format dir with tokenizer.json")
    p.add_argument("--step", type=bounded(int, 0), help="checkpoint step of a run dir (default the latest)")
    p.add_argument("--data-dir", help="corpus cache (default: the run's, or one keyed by the tokenizer)")
    p.add_argument("--batch-size", type=bounded(int, 1), default=16, help="rows per batch (default 16)")
    p.add_argument("--seq-len", type=bounded(int, 2), help="tokens per row (default: the run's, else 256)")
    p.add_argument("--max-batches", type=bounded(int, 1), help="evaluate only the first batches")
    p.add_argument("--mtp-lambda", type=bounded(float, 0), default=0.1, help="weight of the MTP loss (default 0.1)")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.path)
    seq_len = args.seq_len
    if (path / "run.json").is_file():
        model, run = load_run(path, args.step)
        corpus = corpus_of_run(path, run, args.data_dir)
        seq_len = seq_len or run["train_config"]["seq_len"]
    else:
        tokenizer_path = path / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no run.json or tokenizer.json in {path}")
        model = checkpoint.load_hf_checkpoint(path)
        corpus = data.prepare_corpus(args.data_dir or default_data_dir(tokenizer_path=tokenizer_path),
                                     tokenizer_path=tokenizer_path, verbose=True)
    result = evaluate(model, corpus.heldout, data.token_byte_lengths(corpus.tokenizer), batch_size=args.batch_size,
                      seq_len=seq_len or 256, mtp_lambda=args.mtp_lambda, max_batches=args.max_batches)
    print(json.dumps(result, indent=1))
    return 0
