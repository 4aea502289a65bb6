"""What the `mtp-jax` commands share: the cache directories (tokenized corpora, JAX's persistent
compilation cache and its flags), bounded argparse types, flag-naming of the library's errors, and how
`--model` names the model directory."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import sys
from collections.abc import Iterable, Mapping

from mtp_jax.compilation_cache import (
    cache_dir_problem,
    cache_root,
    default_compilation_cache_dir,
    set_compilation_cache,
)
from mtp_jax.decode.speculative import MAX_SPECULATIVE_TOKENS
from mtp_jax.training import data


def bounded(kind: type, low: float, high: float | None = None, *, above: bool = False):
    """An argparse `type`: `kind(text)`, refused unless >= low (> low if `above`) and <= high if given."""

    def parse(text: str):
        value = kind(text)
        if not ((value > low if above else value >= low) and (high is None or value <= high)):
            bound = f"in [{low}, {high}]" if high is not None else f"> {low}" if above else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


def name_flags(error: Exception, flags: Mapping[str, str], extra: Iterable[str] = ()) -> ValueError:
    """A ValueError of `error`'s message with the flags it concerns named in front: `flags` maps a regex
    (a library parameter's name) to its flag, named when the message matches it and does not name the
    flag already; `extra` flags are named too. `error` itself (a ValueError) when no flag is named."""
    message = str(error)
    named = [flag for pattern, flag in flags.items() if re.search(pattern, message) and flag not in message]
    named += [flag for flag in extra if flag not in named]
    if named:
        return ValueError(f"{', '.join(named)}: {message}")
    return error if isinstance(error, ValueError) else ValueError(message)


# ----------------------------------------------------------------------------------------------
# The model a command works on: `--model DIR` in every command (and a preset name in `train`).

MODEL_HELP = "a saved model directory (config.json, safetensors, tokenizer.json)"
"""What `--model` names, in the help of every command that takes it (`train` adds ", or a preset name")."""


class DefaultModelDir(str):
    """The default of a positional model directory (`serve`'s MODEL_DIR): a str that says it was not given,
    so that `--model DIR` next to it is no conflict. argparse hands the default object over as it is."""


def pick_model(positional: str | None, option: str | None, metavar: str) -> tuple[str | None, str]:
    """(the model directory, the spelling that named it: "--model" or `metavar`) of a command that takes
    it as a positional argument (None or a `DefaultModelDir` when not given) and as `--model DIR` (None
    when not given); ValueError naming both when both are given."""
    given = positional is not None and not isinstance(positional, DefaultModelDir)
    if given and option is not None:
        raise ValueError(f"{metavar} {positional} and --model {option} both name the model: give one of them")
    return (option, "--model") if option is not None else (positional, metavar)


def add_speculative_arguments(parser: argparse.ArgumentParser, *, default: str) -> None:
    """`--speculative METHOD` (`default`: the command's) and `--num-speculative-tokens K`, read by
    `SpeculativeConfig.from_flags`."""
    parser.add_argument(
        "--speculative",
        default=default,
        choices=["none", "vanilla", "eagle", "parallel"],
        help=f"MTP speculative decoding method (default {default}; none: plain decoding)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"K, drafts per step, 1..{MAX_SPECULATIVE_TOKENS} (default: 3 for eagle, else the model's MTP modules)",
    )
    parser.add_argument(
        "--draft-vocab",
        metavar="FILE",
        default=None,
        help="draft only these token ids (a JSON list or whitespace/comma-separated ints, e.g. the most frequent "
        "tokens of a corpus, mtp_jax.decode.frequent_tokens): the MTP head then costs N columns, not the "
        "vocabulary (SpeculativeConfig.draft_vocab; default: the whole vocabulary)",
    )


def read_token_ids(path: str | None, flag: str = "--draft-vocab") -> list[int] | None:
    """The token ids in the file `path` (a JSON list of ints, or ints separated by whitespace or commas);
    None for None. ValueError naming `flag` when the file cannot be read or holds something else."""
    if path is None:
        return None
    try:
        text = pathlib.Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror or error}") from None
    expected = "a JSON list of token ids or ints separated by whitespace or commas"
    try:
        ids = json.loads(text) if text.lstrip().startswith("[") else [int(t) for t in re.split(r"[\s,]+", text.strip())]
    except ValueError as error:
        raise ValueError(f"{flag} {path}: expected {expected} ({error})") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{flag} {path}: expected {expected}")
    return ids


# ----------------------------------------------------------------------------------------------
# JAX's persistent compilation cache: `--compilation-cache DIR`, `--no-compilation-cache`.


def add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    """--dtype and --dequantize: how `mtp-jax generate` / `serve` hold a checkpoint's weights."""
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and compute dtype (default: the checkpoint's, except float32 on the CPU backend for "
        "half-precision checkpoints whose matmuls do not go to oneDNN: "
        "mtp_jax.checkpoints.pretrained.inference_dtype)",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="an FP8 checkpoint (DeepSeek-V3's block-scaled format): dequantize its weights once while loading "
        "(to --dtype) instead of keeping them in FP8 and dequantizing inside each matmul (the default)",
    )


def add_compilation_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the mutually exclusive `--compilation-cache DIR` / `--no-compilation-cache` to `parser`."""
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--compilation-cache",
        metavar="DIR",
        default=None,
        help="JAX's persistent compilation cache directory (default: $MTP_JAX_CACHE/jax_cache, "
        "else $XDG_CACHE_HOME/mtp_jax/jax_cache, i.e. ~/.cache/mtp_jax/jax_cache)",
    )
    cache.add_argument("--no-compilation-cache", action="store_true", help="compile from scratch, cache nothing")


def configure_compilation_cache(args: argparse.Namespace) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at the directory the flags choose (None: off) for this
    process; returns it.

    Every compiled function is cached (`mtp_jax.compilation_cache`). Raises
    ValueError naming --compilation-cache when that directory is a file, cannot be created or is not
    writable; the default directory in that state only gets a warning on stderr, and no cache.
    """
    path = (
        None if args.no_compilation_cache else pathlib.Path(args.compilation_cache or default_compilation_cache_dir())
    )
    problem = None if path is None else cache_dir_problem(path)
    if problem and args.compilation_cache:
        raise ValueError(f"--compilation-cache: {problem}")
    if problem:
        print(
            f"mtp-jax {args.command}: warning: the default compilation cache {problem}: compiling without a "
            "persistent cache (set --compilation-cache DIR or --no-compilation-cache)",
            file=sys.stderr,
        )
        path = None
    set_compilation_cache(path)
    return path


# ----------------------------------------------------------------------------------------------
# The stdlib corpus of `train` and `eval`.


def default_data_dir(*, vocab_size: int | None = None, tokenizer_path: str | os.PathLike | None = None) -> pathlib.Path:
    """The corpus cache for this interpreter: `cache_root()` / `stdlib-py3.X-v<vocab>` for a trained
    tokenizer, `stdlib-py3.X-tok<sha256[:12]>` for a given one."""
    root = cache_root()
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer_path is not None:
        return root / f"stdlib-{tag}-tok{hashlib.sha256(pathlib.Path(tokenizer_path).read_bytes()).hexdigest()[:12]}"
    return root / f"stdlib-{tag}-v{vocab_size}"


def corpus_of_run(run_dir: pathlib.Path, run: dict, data_dir: str | None) -> data.Corpus:
    """The corpus a run (its run.json dict `run`) was trained on, prepared again (or read from its cache), or
    read again from its data directory (`train --data`; `data_dir` where it moved), refused (ValueError) when
    that directory's content changed since the run started on it."""
    c = run["corpus"]
    if c.get("source") == "data_dir":
        corpus = data.load_corpus_dir(data_dir or c["work_dir"])
        if corpus.metadata["fingerprint"] != c.get("fingerprint"):
            raise ValueError(
                f"the data in {corpus.work_dir} changed since the run in {run_dir} started on it (its tokens, "
                "offsets or tokenizer differ: data_dir_fingerprint); a resume needs the same data, or start a new run"
            )
        return corpus
    if c.get("source") != "stdlib":
        raise ValueError(f"the run in {run_dir} was trained on in-memory documents, not the stdlib corpus")
    given = c.get("tokenizer_source") == "given"
    return data.prepare_corpus(
        data_dir or c["work_dir"],
        vocab_size=c["vocab_size"],
        heldout_fraction=c["heldout_fraction"],
        tokenizer_path=run_dir / "tokenizer.json" if given else None,
        verbose=True,
    )


# ----------------------------------------------------------------------------------------------
# A data directory as the corpus: `train --data DIR`.


def data_corpus(args: argparse.Namespace, tokenizer_path: pathlib.Path | None) -> data.Corpus:
    """`--data DIR`'s corpus (`data.load_corpus_dir`). Raises ValueError naming the flags for --data next to
    the stdlib corpus's flags (--vocab-size, --heldout-fraction, --data-dir), and when its tokenizer is not
    the model's (`tokenizer_path`, the model directory's tokenizer.json; None: a fresh model, any tokenizer)."""
    given = [
        f
        for f, v in (
            ("--vocab-size", args.vocab_size),
            ("--heldout-fraction", args.heldout_fraction),
            ("--data-dir", args.data_dir),
        )
        if v is not None
    ]
    if given:
        raise ValueError(
            f"--data {args.data} brings its own tokenizer and split: {', '.join(given)} (the stdlib corpus's) "
            "do not apply"
        )
    corpus = data.load_corpus_dir(args.data)
    if tokenizer_path is not None and not data.same_tokenizer(corpus.tokenizer_path, tokenizer_path):
        raise ValueError(
            f"--data {args.data}: its tokenizer.json is not the model's ({tokenizer_path}); distill or prepare the "
            "data with that model's tokenizer"
        )
    return corpus


def resume_data_dir(args: argparse.Namespace, run: dict) -> str | None:
    """Where `train --resume` finds the run's corpus: --data DIR for a run trained on a data directory,
    --data-dir for one on the stdlib corpus (None: where run.json says); ValueError for the other flag."""
    on_data = run["corpus"].get("source") == "data_dir"
    wrong = "--data-dir" if on_data and args.data_dir is not None else "--data" if not on_data and args.data else None
    if wrong:
        where = run["corpus"].get("work_dir")
        trained = f"a data directory ({where}; --data DIR names it if it moved)" if on_data else "the stdlib corpus"
        raise ValueError(f"--resume: {wrong} does not apply: the run was trained on {trained}")
    return args.data if on_data else args.data_dir
