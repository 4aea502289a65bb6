"""`mtp-jax distill-data`: a model's own continuations of prompts, written as a data directory that
`mtp-jax train --data DIR` trains on (`mtp_jax.training.distill`)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR
from mtp_jax.cli.common import (
    MODEL_HELP,
    DefaultModelDir,
    add_compilation_cache_arguments,
    bounded,
    configure_compilation_cache,
    default_data_dir,
    name_flags,
    pick_model,
)

DISTILL_DESCRIPTION = """\
Self-distillation data: generate continuations of prompts with the model itself (batched, speculative
decoding on by default; greedy, or sampled at --temperature with one seed per sample) and store prompt +
continuation as a training corpus, on which `mtp-jax train RUN --init-from MODEL_DIR --mtp-only --data OUT`
fine-tunes the model's MTP heads to predict what the model really generates.

Prompts: --prompts FILE (one prompt per line, blank lines skipped; or JSONL, a .jsonl name, of objects with
a "prompt" string; the last --heldout-samples prompts are held out), --corpus DIR (a data directory with the
model's tokenizer, e.g. a corpus cache; windows of --prompt-len tokens of its train documents, and of its
held-out documents for the held-out set, at offsets fixed by --seed), or by default the Python standard
library tokenized with the model's tokenizer (cached as `mtp-jax train` caches it).

Each sample is one document: prompt, continuation, EOS (a continuation cut at the model's EOS ends with
it; any other gets the model's first EOS id appended).

OUT, when finished:
  tokenizer.json                      the model's
  {train,heldout}_tokens.npy          int32: the samples end to end
  {train,heldout}_offsets.npy         int64: sample i is tokens[offsets[i]:offsets[i + 1]]
  {train,heldout}_prompt_lengths.npy  int32: the prompt's tokens at the start of each sample
  corpus.json                         eos_id, counts and the settings
  distill.json                        the manifest: settings, chunks done, complete
  distill.lock                        held while a distill-data process works in OUT (one at a time)
While it runs, OUT/chunks/ holds the samples in chunk files, each written to a temporary file, fsynced and
renamed into place before the manifest names it: after a kill, rerunning the same command continues where it
stopped and ends with the same arrays, byte for byte, as an uninterrupted run. A rerun with other settings
is refused naming them, as is an OUT that holds anything else."""

# Parameters of the library that a flag sets: errors naming them name the flag too.
_DISTILL_FLAGS = {
    r"\bnum_speculative_tokens\b": "--num-speculative-tokens",
    r"\bno MTP modules\b|\bmtp_style\b": "--speculative",
}

# The flag (or argument) that sets each recorded setting, for SettingsDiffer's message.
_FLAG_OF_SETTING = {
    "format": "the format (an older mtp-jax wrote OUT)",
    "model": "MODEL_DIR (its weights, config or tokenizer)",
    "prompts": "--prompts / --corpus (the prompts)",
    "num_samples": "--num-samples",
    "heldout_samples": "--heldout-samples",
    "max_new_tokens": "--max-new-tokens",
    "prompt_len": "--prompt-len",
    "batch_size": "--batch-size",
    "chunk_size": "--chunk-size",
    "seed": "--seed",
    "temperature": "--temperature",
    "speculative": "--speculative",
    "num_speculative_tokens": "--num-speculative-tokens",
    "dtype": "--dtype",
    "max_length": "the cache length (the longest prompt + --max-new-tokens)",
    "eos_id": "the model's EOS id",
}


def add_distill_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `distill-data` on an argparse subparsers."""
    p = subparsers.add_parser(
        "distill-data",
        help="generate a model's own continuations as training data for its MTP heads",
        description=DISTILL_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_dir",
        nargs="?",
        metavar="MODEL_DIR",
        default=DefaultModelDir(DEFAULT_MODEL_DIR),
        help=f"{MODEL_HELP}; default: the bundled demo model",
    )
    p.add_argument("--model", metavar="DIR", help="the same as MODEL_DIR (give one of them)")
    p.add_argument("--out", metavar="DIR", required=True, help="the data directory to write (or to continue)")
    prompts = p.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", metavar="FILE", help="a prompts file: one per line, or JSONL (.jsonl)")
    prompts.add_argument("--corpus", metavar="DIR", help="a data directory (corpus cache) to draw prompt windows from")
    p.add_argument(
        "--num-samples",
        metavar="N",
        type=bounded(int, 1),
        help="train samples (default: one per train prompt of --prompts, else 1024)",
    )
    p.add_argument(
        "--heldout-samples",
        metavar="N",
        type=bounded(int, 1),
        help="held-out samples (default 3%%, at least 1: of the prompts with --prompts, else of --num-samples)",
    )
    p.add_argument(
        "--max-new-tokens", metavar="N", type=bounded(int, 1), default=256, help="tokens per continuation (default 256)"
    )
    p.add_argument(
        "--prompt-len", metavar="N", type=bounded(int, 1), default=64, help="tokens per corpus prompt (default 64)"
    )
    p.add_argument(
        "--batch-size", metavar="B", type=bounded(int, 1), default=16, help="prompts decoded together (default 16)"
    )
    p.add_argument(
        "--chunk-size",
        metavar="C",
        type=bounded(int, 1),
        help="samples per chunk file, a multiple of --batch-size (default: the largest one <= 256)",
    )
    p.add_argument(
        "--seed", metavar="SEED", type=bounded(int, 0, 2**32 - 1), default=0, help="prompt windows and sampling seeds"
    )
    p.add_argument("--temperature", metavar="T", type=bounded(float, 0), default=0.0, help="0 = greedy (default)")
    p.add_argument(
        "--speculative",
        choices=("auto", "eagle", "vanilla", "parallel", "none"),
        default="auto",
        help="speculative decoding with the MTP modules (default auto: eagle, parallel for parallel heads, none "
        "for a model without MTP modules); greedy output is the same either way, only faster",
    )
    p.add_argument(
        "--num-speculative-tokens",
        "--k",
        dest="num_speculative_tokens",
        metavar="K",
        type=bounded(int, 1),
        help="K, drafts per step (default 3 for eagle, else the model's MTP modules)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="weights and compute dtype")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_compilation_cache_arguments(p)
    p.set_defaults(func=run_distill)
    return p


def _stdlib_corpus(model_dir: pathlib.Path):
    """The stdlib corpus tokenized with the model's tokenizer, its EOS token separating documents (as
    `mtp-jax train --init-from` prepares it, in the same cache)."""
    from tokenizers import Tokenizer

    from mtp_jax.checkpoints.hf_config import config_from_hf
    from mtp_jax.training import data

    tokenizer_file = model_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise FileNotFoundError(f"model directory {model_dir} has no tokenizer.json")
    config = config_from_hf(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    eos = (
        Tokenizer.from_file(str(tokenizer_file)).id_to_token(config.eos_token_ids[0]) if config.eos_token_ids else None
    )
    return data.prepare_corpus(
        default_data_dir(tokenizer_path=tokenizer_file),
        tokenizer_path=tokenizer_file,
        eos_token=eos or data.EOS_TOKEN,
        verbose=True,
    )


def run_distill(args: argparse.Namespace) -> int:
    """`mtp-jax distill-data`: prints a JSON summary (the output's counts) and returns 0."""
    from mtp_jax.training.distill import DistillConfig, SettingsDiffer, check_out, distill

    model_dir, flag = pick_model(args.model_dir, args.model, "MODEL_DIR")
    model_dir = pathlib.Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{flag} {model_dir}: no config.json (not a model directory)")
    configure_compilation_cache(args)
    try:
        config = DistillConfig(
            num_samples=args.num_samples,
            heldout_samples=args.heldout_samples,
            max_new_tokens=args.max_new_tokens,
            prompt_len=args.prompt_len,
            batch_size=args.batch_size,
            chunk_size=args.chunk_size,
            seed=args.seed,
            temperature=args.temperature,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            dtype=args.dtype,
        )
    except ValueError as error:
        message = str(error).replace("chunk_size", "--chunk-size").replace("batch_size", "--batch-size")
        raise ValueError(message) from None
    corpus = args.corpus
    if args.prompts is None and args.corpus is None:
        check_out(pathlib.Path(args.out))  # before the stdlib corpus, which takes minutes to prepare the first time
        corpus = _stdlib_corpus(model_dir)
    try:
        result = distill(
            model_dir, args.out, config, prompts_file=args.prompts, corpus=corpus, progress=not args.no_progress
        )
    except SettingsDiffer as error:
        listed = "; ".join(f"{_FLAG_OF_SETTING.get(k, k)} (saved {a!r}, given {b!r})" for k, a, b in error.differences)
        raise ValueError(
            f"--out {error.out} holds a data set distilled with other settings: {listed}. Rerun with the saved "
            "settings to continue it, or choose another --out"
        ) from None
    except ValueError as error:
        raise name_flags(error, _DISTILL_FLAGS) from None
    corpus = result.corpus
    summary = {
        "out": str(args.out),
        "train_samples": corpus.train.num_documents,
        "heldout_samples": corpus.heldout.num_documents,
        "train_tokens": corpus.train.num_tokens,
        "heldout_tokens": corpus.heldout.num_tokens,
        "generated_now": result.generated_samples,
        "seconds": round(result.seconds, 3),
        "mean_acceptance_length": result.mean_acceptance_length,
    }
    print(json.dumps(summary, indent=1))
    if result.generated_samples == 0:
        print(f"mtp-jax distill-data: {args.out} was complete already", file=sys.stderr)
    return 0
