"""The `mtp-jax` command line: generate, train, eval."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
from pathlib import Path

from tokenizers import Tokenizer

from mtp_jax.checkpoints import reading as checkpoint
from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR as DEFAULT_MODEL
from mtp_jax.cli.distributed import add_mesh_arguments, check_num_prompts, mesh_from_args
from mtp_jax.cli.serve import add_serve_parser
from mtp_jax.config import PRESETS
from mtp_jax.training import data
from mtp_jax.training.trainer import (
    RESUMABLE_FIELDS,
    NonFiniteError,
    RunDirInUseError,
    TrainConfig,
    check_run_dir,
    evaluate,
    init_from_pretrained,
    load_run,
    model_config_from_dict,
    train,
)

GENERATE_DESCRIPTION = """\
Generate continuations of text prompts, with plain decoding or MTP speculative decoding.

The model directory holds config.json, safetensors weights and tokenizer.json (Hugging Face layout;
default: the bundled demo model). stdout gets each prompt and its continuation (with --stream, the
one prompt's text as it is committed). stderr gets one timing line and, when speculating, the
acceptance metrics. The timing line keeps apart: load (reading the model directory), compile (a
warm-up run of 1-2 tokens that compiles every jitted function; JAX's persistent compilation cache,
--compilation-cache, makes it short on later runs) and decode (the real run, compiled code only:
tokens generated / wall time of prefill plus decode)."""

# Parameters of the library that a `generate` flag sets: errors naming them name the flag too.
_GENERATE_FLAGS = {r"\bmax_new_tokens\b": "--max-new-tokens", r"\bmax_length\b": "--max-length",
                   r"\btemperature\b": "--temperature", r"\btop_k\b": "--top-k", r"\btop_p\b": "--top-p",
                   r"\bseed\b": "--seed", r"\bnum_speculative_tokens\b": "--num-speculative-tokens",
                   r"\bmtp_style\b|\bno MTP modules\b": "--speculative", r"\bmesh\b": "--mesh"}


def cache_root() -> pathlib.Path:
    """Where the CLI keeps what it can rebuild (tokenized corpora, compiled programs): `$MTP_JAX_CACHE`,
    else `$XDG_CACHE_HOME/mtp_jax`, else `~/.cache/mtp_jax`."""
    if os.environ.get("MTP_JAX_CACHE"):
        return pathlib.Path(os.environ["MTP_JAX_CACHE"])
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "mtp_jax"


def default_compilation_cache_dir() -> pathlib.Path:
    """JAX's persistent compilation cache of the CLI: `cache_root() / "jax_cache"`."""
    return cache_root() / "jax_cache"


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `generate` (plain or speculative decoding of text prompts) on an argparse subparsers."""
    p = subparsers.add_parser("generate", help="generate text from prompts with a model directory",
                              description=GENERATE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the bundled demo model)")
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--max-length", type=int, default=None,
                   help="cache capacity in tokens, prompt included, at most the model's max positions (the default)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the first row, in [0, 2**32); row b uses seed + b, which must stay below 2**32")
    p.add_argument("--speculative", default="none", choices=["none", "vanilla", "eagle", "parallel"],
                   help="MTP speculative decoding method (default: none, plain decoding)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="K, drafts per step, 1..16 (default: the model's MTP modules, for eagle 3)")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed (batch of one)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="weights and compute dtype (default: the checkpoint's, except float32 on the CPU backend for "
                        "half-precision checkpoints: mtp_jax.checkpoints.pretrained.inference_dtype)")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--compilation-cache", metavar="DIR", default=None,
                       help="JAX's persistent compilation cache directory (default: $MTP_JAX_CACHE/jax_cache, "
                            "else $XDG_CACHE_HOME/mtp_jax/jax_cache, i.e. ~/.cache/mtp_jax/jax_cache)")
    cache.add_argument("--no-compilation-cache", action="store_true", help="compile from scratch, cache nothing")
    add_mesh_arguments(p, mesh_help="The number of prompts must be a multiple of data x fsdp (an error otherwise: "
                                    "no dummy rows are added).")
    p.set_defaults(func=run_generate)
    return p


def _prompts(args) -> tuple[list[str], list[str]]:
    """The prompt texts (--prompt ones first, then --prompt-file ones) and, for each, the flag it came from
    (with the file); raises ValueError naming the flag (and the file) for a file that cannot be read as
    UTF-8 text or a --prompt that is not valid UTF-8 (argv bytes Python could not decode)."""
    texts, sources = [], []
    for i, text in enumerate(args.prompt or []):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:  # undecodable argv bytes arrive as lone surrogates
            bad = text[error.start:error.end].encode("utf-8", "surrogateescape")
            raise ValueError(f"--prompt: prompt {i} is not valid UTF-8 (bytes {bad!r} at character "
                             f"{error.start})") from None
        texts.append(text)
        sources.append("--prompt")
    for path in args.prompt_file or []:
        try:
            texts.append(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError as error:
            raise ValueError(f"--prompt-file {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
        except OSError as error:  # missing, a directory, unreadable
            raise ValueError(f"--prompt-file {path}: {error.strerror or error}") from None
        sources.append(f"--prompt-file {path}")
    if not texts:
        texts, sources = ["import os\n\n\ndef "], [""]
    return texts, sources


def _check_cache_dir(path: pathlib.Path) -> str | None:
    """Why `path` cannot hold the compilation cache (it is a file, cannot be created or is not writable);
    None when it can. Creates the directory."""
    import tempfile

    if path.exists() and not path.is_dir():
        return f"{path} is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return f"{path} is not a writable directory ({error.strerror or error})"
    return None


def _configure_compilation_cache(args) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at the chosen directory (None: off) for this process.

    Every compiled function is cached, however quick its compile or small its executable. Raises
    ValueError naming --compilation-cache when that directory is a file, cannot be created or is not
    writable; the default directory in that state only gets a warning on stderr, and no cache.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = None if args.no_compilation_cache else Path(args.compilation_cache or default_compilation_cache_dir())
    problem = None if path is None else _check_cache_dir(path)
    if problem and args.compilation_cache:
        raise ValueError(f"--compilation-cache: {problem}")
    if problem:
        print(f"mtp-jax generate: warning: the default compilation cache {problem}: compiling without a "
              "persistent cache (set --compilation-cache DIR or --no-compilation-cache)", file=sys.stderr)
        path = None
    compilation_cache.reset_cache()  # an earlier call in this process may have used another directory
    jax.config.update("jax_enable_compilation_cache", path is not None)
    jax.config.update("jax_compilation_cache_dir", None if path is None else str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


def _name_flags(error: ValueError, sources: list[str]) -> ValueError:
    """The library's error with the `generate` flags it concerns named in front; "prompt i" names the
    flag (and the file) prompt i came from, `sources[i]`."""
    import re

    message = str(error)
    flags = [flag for pattern, flag in _GENERATE_FLAGS.items() if re.search(pattern, message) and flag not in message]
    prompt = re.search(r"\bprompt (\d+)\b", message)
    if prompt and int(prompt.group(1)) < len(sources) and sources[int(prompt.group(1))]:
        flags.append(sources[int(prompt.group(1))])
    return ValueError(f"{', '.join(flags)}: {message}") if flags else error


def _generate_kwargs(args, model, num_prompts: int, mesh=None) -> dict:
    """The keyword arguments of `generate` / `stream` that the flags give; raises ValueError on bad flags."""
    from mtp_jax.decode.drafters import SpeculativeConfig
    from mtp_jax.decode.sampling import MAX_SEED, SamplingParams

    if 0 <= args.seed <= MAX_SEED < args.seed + num_prompts - 1:
        raise ValueError(f"--seed {args.seed}: row b samples with seed + b, and row {num_prompts - 1} would get "
                         f"{args.seed + num_prompts - 1}, past the largest seed 2**32 - 1")
    sampling = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + b)
                for b in range(num_prompts)]
    speculative = SpeculativeConfig.from_flags(args.speculative, args.num_speculative_tokens, model)
    return dict(max_new_tokens=args.max_new_tokens, sampling=sampling, max_length=args.max_length,
                speculative=speculative, mesh=mesh)


def _warm_up(model, prompts: list[list[int]], kwargs: dict, streaming: bool) -> float:
    """Compiles what the real run will call; returns the wall time in seconds.

    The same shapes (batch, capacity, prompt bucket) with 1 new token (2 when streaming, so that the
    one-step function compiles too) and no stop tokens: both are data, never shapes.
    """
    import time

    from mtp_jax.decode.generation import generate, stream

    begin = time.perf_counter()
    if streaming:
        for _ in stream(model, prompts, **{**kwargs, "max_new_tokens": 2, "stop_tokens": []}):
            pass
    else:
        generate(model, prompts, **{**kwargs, "max_new_tokens": 1, "stop_tokens": []})
    return time.perf_counter() - begin


def _print_stream(model, tokenizer, text: str, prompt: list[int], kwargs: dict):
    """Prints `text` and its continuation as committed; returns (the stream's result, tokens, seconds)."""
    import time

    from mtp_jax.checkpoints.pretrained import TextStream
    from mtp_jax.decode.generation import stream

    sys.stdout.write(text)
    decoded, steps = TextStream(tokenizer), stream(model, [prompt], **kwargs)
    begin = time.perf_counter()
    while True:  # not a for loop, which would drop the generator's return value (the result)
        try:
            step = next(steps)
        except StopIteration as end:
            result = end.value
            break
        sys.stdout.write(decoded.push(step[0]))
        sys.stdout.flush()
    sys.stdout.write(decoded.finish() + "\n")
    return result, len(decoded.ids), time.perf_counter() - begin


def run_generate(args) -> int:
    """`mtp-jax generate`: load, warm up (compile), generate; prints the texts, then timings and metrics."""
    import time

    from mtp_jax.checkpoints.pretrained import inference_dtype, load_pretrained
    from mtp_jax.decode.generation import generate

    mesh = mesh_from_args(args)  # first: jax.distributed must start before jax is used
    cache_dir = _configure_compilation_cache(args)
    texts, sources = _prompts(args)
    check_num_prompts(args, mesh, len(texts))
    if Path(args.model).exists() and not Path(args.model).is_dir():
        raise ValueError(f"--model: {args.model} is not a directory (a model directory holds config.json, "
                         "safetensors weights and tokenizer.json)")
    begin = time.perf_counter()
    try:
        dtype, why = inference_dtype(args.model, args.dtype)
        if why:
            print(f"mtp-jax generate: {why}", file=sys.stderr)
        model, tokenizer = load_pretrained(args.model, dtype=dtype)
    except (OSError, ValueError) as error:  # missing files, corrupt or mismatched checkpoints
        raise ValueError(f"--model: {error}") from error
    load_seconds = time.perf_counter() - begin
    prompts = [tokenizer.encode(t).ids for t in texts]
    if args.stream and len(prompts) != 1:
        raise ValueError("--stream takes exactly one prompt")
    try:
        kwargs = _generate_kwargs(args, model, len(prompts), mesh)
        compile_seconds = _warm_up(model, prompts, kwargs, args.stream)
        if args.stream:
            result, num_generated, decode_seconds = _print_stream(model, tokenizer, texts[0], prompts[0], kwargs)
        else:
            result = generate(model, prompts, **kwargs)
            num_generated, decode_seconds = result.num_generated, result.seconds
            for b, (text, tokens) in enumerate(zip(texts, result.tokens, strict=True)):
                print(f"=== prompt {b} ({len(prompts[b])} tokens) -> {len(tokens)} tokens, {result.finish_reasons[b]}")
                print(text + tokenizer.decode(tokens))
    except ValueError as error:
        raise _name_flags(error, sources) from error
    cache = f"persistent cache {cache_dir}" if cache_dir is not None else "no persistent cache"
    rate = num_generated / decode_seconds if decode_seconds > 0 else float("nan")
    print(f"--- load {load_seconds:.2f} s | compile {compile_seconds:.2f} s (warm-up run, {cache}) | "
          f"decode {num_generated} tokens in {decode_seconds:.4f} s: {rate:.1f} tokens/s (compiled, prefill included)",
          file=sys.stderr)
    spec = kwargs["speculative"]
    if spec is not None:
        print(f"--- {args.speculative}, K = {spec.num_speculative_tokens}: {result.metrics.summary()}",
              file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------------------------
# `mtp-jax train` and `mtp-jax eval`.


def default_data_dir(*, vocab_size: int | None = None, tokenizer_path: str | os.PathLike | None = None) -> pathlib.Path:
    """The corpus cache for this interpreter: `cache_root()` / `stdlib-py3.X-v<vocab>` for a trained
    tokenizer, `stdlib-py3.X-tok<sha256[:12]>` for a given one."""
    root = cache_root()
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}"
    if tokenizer_path is not None:
        return root / f"stdlib-{tag}-tok{hashlib.sha256(pathlib.Path(tokenizer_path).read_bytes()).hexdigest()[:12]}"
    return root / f"stdlib-{tag}-v{vocab_size}"


def _corpus_of_run(run_dir: pathlib.Path, run: dict, data_dir: str | None) -> data.Corpus:
    c = run["corpus"]
    if c.get("source") != "stdlib":
        raise ValueError(f"the run in {run_dir} was trained on in-memory documents, not the stdlib corpus")
    given = c.get("tokenizer_source") == "given"
    return data.prepare_corpus(data_dir or c["work_dir"], vocab_size=c["vocab_size"],
                               heldout_fraction=c["heldout_fraction"],
                               tokenizer_path=run_dir / "tokenizer.json" if given else None, verbose=True)


def _bounded(kind: type, low: float, high: float | None = None, *, above: bool = False):
    """An argparse `type`: `kind(text)`, refused unless >= low (> low if `above`) and <= high if given."""
    def parse(text: str):
        value = kind(text)
        if not ((value > low if above else value >= low) and (high is None or value <= high)):
            bound = f"in [{low}, {high}]" if high is not None else f"> {low}" if above else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value: 'x'"
    return parse


# (flag, TrainConfig field, argparse type) of `mtp-jax train`'s training settings.
_TRAIN_FLAGS = (("--steps", "num_steps", _bounded(int, 1)), ("--batch-size", "batch_size", _bounded(int, 1)),
                ("--seq-len", "seq_len", _bounded(int, 2)), ("--lr", "learning_rate", _bounded(float, 0, above=True)),
                ("--warmup", "warmup_steps", _bounded(int, 0)),
                ("--min-lr-ratio", "min_lr_ratio", _bounded(float, 0, 1)),
                ("--weight-decay", "weight_decay", _bounded(float, 0)),
                ("--grad-clip", "grad_clip_norm", _bounded(float, 0)),
                ("--mtp-lambda", "mtp_lambda", _bounded(float, 0)),
                ("--seed", "seed", int), ("--checkpoint-every", "checkpoint_every", _bounded(int, 1)),
                ("--eval-every", "eval_every", _bounded(int, 0)), ("--eval-batches", "eval_batches", _bounded(int, 1)),
                ("--log-every", "log_every", _bounded(int, 1)))
_FLAG_OF_FIELD = {field: flag for flag, field, _ in _TRAIN_FLAGS} | {"mtp_only": "--mtp-only"}


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `train` (from scratch, `--resume`, `--mtp-only --init-from DIR`) on an argparse subparsers."""
    p = subparsers.add_parser(
        "train", help="train a model with MTP modules on the Python stdlib corpus",
        description="Train a decoder with DeepSeek-V3-style MTP modules on the Python standard library's source "
                    "(main next-token loss + mtp_lambda x mean MTP loss, AdamW, orbax checkpoints). run_dir gets "
                    "run.json, checkpoints/, log.jsonl and, at the end, export/ (a Hugging Face-format model). "
                    "--resume continues a run exactly (flags may only raise or lower --steps and change "
                    "bookkeeping); --overwrite restarts a run dir and never deletes any other folder; one trainer "
                    "at a time per run dir; a non-finite loss stops the run before it is saved.")
    p.add_argument("run_dir", help="the run's directory (checkpoints, log.jsonl, export/)")
    mode = p.add_argument_group("mode")
    start = mode.add_mutually_exclusive_group()  # continue the run, or delete it and start again: not both
    start.add_argument("--resume", action="store_true", help="continue the run in run_dir from its latest checkpoint")
    start.add_argument("--overwrite", action="store_true",
                      help="delete the run in run_dir and start again (only a run dir: one with its run.json)")
    mode.add_argument("--mtp-only", action="store_true", help="freeze the main model, train only the MTP modules")
    mode.add_argument("--init-from", metavar="DIR",
                      help="initialise from a Hugging Face-format dir (config.json, model.safetensors, "
                           "tokenizer.json); its tokenizer is used for the corpus")
    model = p.add_argument_group("model")
    model.add_argument("--model", help="preset name (config.PRESETS); default demo")
    model.add_argument("--mtp-layers", type=_bounded(int, 0),
                       help="D, the number of MTP modules (default: the preset's, 3 for demo; with --init-from, "
                            "the checkpoint's)")
    model.add_argument("--dtype", choices=("float32", "bfloat16"),
                       help="compute dtype (a fresh model keeps float32 weights; with --init-from, both)")
    corpus = p.add_argument_group("corpus")
    corpus.add_argument("--vocab-size", type=_bounded(int, 1), help="BPE vocabulary to train (default 4096)")
    corpus.add_argument("--heldout-fraction", type=_bounded(float, 0, 1),
                        help=f"default {data.DEFAULT_HELDOUT_FRACTION}")
    corpus.add_argument("--data-dir", help="corpus cache (default: see default_data_dir)")
    opt = p.add_argument_group("training")
    d = TrainConfig()
    for flag, field, kind in _TRAIN_FLAGS:
        opt.add_argument(flag, dest=field, type=kind, default=None, help=f"default {getattr(d, field)}")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-export", action="store_true", help="do not write run_dir/export at the end")
    add_mesh_arguments(p, mesh_help="--batch-size must be a multiple of data x fsdp; data=N replicates the "
                                    "parameters and optimizer state (data parallel), fsdp=N splits them along the "
                                    "hidden size (FSDP), tensor=N along heads, FFN width and vocabulary. A run "
                                    "may resume on another mesh.")
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


def _resume_config(args: argparse.Namespace, run_dir: pathlib.Path, run: dict) -> TrainConfig:
    """The settings `--resume` continues with: the run's, with the flags given.

    Raises ValueError naming each flag whose value differs from the run's (saved and given value)
    in a setting a resume cannot change (all but --steps and the bookkeeping flags).
    """
    saved = TrainConfig(**run["train_config"])
    config = _train_config_from_args(args, base=saved)
    differ = [f"{_FLAG_OF_FIELD.get(k, k)} (saved {v!r}, given {getattr(config, k)!r})"
              for k, v in dataclasses.asdict(saved).items() if getattr(config, k) != v and k not in RESUMABLE_FIELDS]
    saved_model, saved_corpus = model_config_from_dict(run["model_config"]), run["corpus"]
    checks = [("--mtp-layers", args.mtp_layers, saved_model.num_nextn_predict_layers),
              ("--dtype", args.dtype, saved_model.dtype),
              ("--heldout-fraction", args.heldout_fraction, saved_corpus.get("heldout_fraction"))]
    if saved_corpus.get("tokenizer_source") != "given":
        checks.append(("--vocab-size", args.vocab_size, saved_corpus.get("vocab_size")))
    differ += [f"{flag} (saved {old!r}, given {new!r})" for flag, new, old in checks if new is not None and new != old]
    if args.model is not None:
        def as_run(preset):
            return preset.replace(vocab_size=saved_model.vocab_size, eos_token_id=saved_model.eos_token_id,
                                  num_nextn_predict_layers=saved_model.num_nextn_predict_layers,
                                  dtype=saved_model.dtype)
        old = next((name for name, preset in PRESETS.items() if as_run(preset) == saved_model), None)
        if old != args.model:
            differ.append(f"--model (saved {old or 'a model of no preset'!r}, given {args.model!r})")
    if args.init_from is not None:
        differ.append(f"--init-from (given {args.init_from!r}; a resume restores the model from the checkpoint)")
    if differ:
        raise ValueError(f"--resume: flags differ from the run in {run_dir} where a resume cannot change them: "
                         + "; ".join(differ) + ". Drop them to continue the run, or start a new one")
    return config


def run_train(args: argparse.Namespace) -> int:
    """`mtp-jax train`: prints the result as JSON and returns 0; returns 1 (with a one-line message on
    stderr) if the run dir is in use or training stopped at a non-finite loss."""
    try:
        result = _train_from_args(args)
    except (RunDirInUseError, NonFiniteError) as error:
        print(f"mtp-jax train: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps({"step": result.step, "stopped_early": result.stopped_early, "train": result.train_metrics,
                      "heldout": result.eval_metrics}, indent=1))
    return 0


def _train_from_args(args: argparse.Namespace):
    mesh = mesh_from_args(args)  # first: jax.distributed must start before jax is used
    run_dir = pathlib.Path(args.run_dir)
    check_run_dir(run_dir, resume=args.resume, overwrite=args.overwrite)  # fail before preparing the corpus
    if args.resume:
        run = json.loads((run_dir / "run.json").read_text())
        train_config = _resume_config(args, run_dir, run)
        corpus = _corpus_of_run(run_dir, run, args.data_dir)
        return train(run_dir, corpus, train_config=train_config, resume=True, progress=not args.no_progress,
                     export=not args.no_export, mesh=mesh)
    train_config = _train_config_from_args(args)
    vocab_size = 4096 if args.vocab_size is None else args.vocab_size
    heldout_fraction = data.DEFAULT_HELDOUT_FRACTION if args.heldout_fraction is None else args.heldout_fraction
    model, tokenizer_path, eos_token = None, None, data.EOS_TOKEN
    if args.init_from:
        tokenizer_path = pathlib.Path(args.init_from) / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"--init-from: no tokenizer.json in {args.init_from}")
        model = init_from_pretrained(args.init_from, num_nextn_predict_layers=args.mtp_layers,
                                     seed=train_config.seed, dtype=args.dtype)
        model_config = model.config
        if model_config.eos_token_ids:  # the model's own end-of-text token separates documents
            eos_token = Tokenizer.from_file(str(tokenizer_path)).id_to_token(model_config.eos_token_ids[0])
    data_dir = args.data_dir or default_data_dir(vocab_size=vocab_size, tokenizer_path=tokenizer_path)
    corpus = data.prepare_corpus(data_dir, vocab_size=vocab_size, heldout_fraction=heldout_fraction,
                                 tokenizer_path=tokenizer_path, eos_token=eos_token or data.EOS_TOKEN, verbose=True)
    if not args.init_from:
        base = PRESETS.get(args.model or "demo")
        if base is None:
            raise ValueError(f"unknown --model {args.model!r}; known presets: {sorted(PRESETS)}")
        changes = {"vocab_size": corpus.vocab_size, "eos_token_id": corpus.eos_id}
        if args.mtp_layers is not None:
            changes["num_nextn_predict_layers"] = args.mtp_layers
        if args.dtype is not None:
            changes["dtype"] = args.dtype
        model_config = base.replace(**changes)
    if train_config.mtp_only and not args.init_from:
        print("warning: --mtp-only without --init-from trains MTP modules on a random main model", file=sys.stderr)
    return train(run_dir, corpus, model_config=model_config, train_config=train_config, model=model,
                 overwrite=args.overwrite, progress=not args.no_progress, export=not args.no_export, mesh=mesh)


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `eval` (held-out loss, bits/byte, per-depth MTP loss and agreement) on argparse subparsers."""
    p = subparsers.add_parser(
        "eval", help="held-out loss, bits/byte and per-depth MTP agreement of a model",
        description="Evaluate a model on the held-out split of the Python stdlib corpus: main loss (nats/token), "
                    "bits/byte, and per MTP depth its loss and agreement with the main model's argmax "
                    "(teacher-forced). PATH is a run dir (its latest readable checkpoint, or --step) or a Hugging "
                    "Face-format dir with tokenizer.json. Prints the metrics as JSON.")
    p.add_argument("path", help="a run dir (latest checkpoint) or a Hugging Face-format dir with tokenizer.json")
    p.add_argument("--step", type=_bounded(int, 0), help="checkpoint step of a run dir (default the latest)")
    p.add_argument("--data-dir", help="corpus cache (default: the run's, or one keyed by the tokenizer)")
    p.add_argument("--batch-size", type=_bounded(int, 1), default=16, help="rows per batch (default 16)")
    p.add_argument("--seq-len", type=_bounded(int, 2), help="tokens per row (default: the run's, else 256)")
    p.add_argument("--max-batches", type=_bounded(int, 1), help="evaluate only the first batches")
    p.add_argument("--mtp-lambda", type=_bounded(float, 0), default=0.1, help="weight of the MTP loss (default 0.1)")
    p.set_defaults(func=run_eval)
    return p


def run_eval(args: argparse.Namespace) -> int:
    path = pathlib.Path(args.path)
    seq_len = args.seq_len
    if (path / "run.json").is_file():
        model, run = load_run(path, args.step)
        corpus = _corpus_of_run(path, run, args.data_dir)
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


def _version() -> str:
    """The installed distribution's version (`importlib.metadata`), else the package's own."""
    import importlib.metadata

    try:
        return importlib.metadata.version("mtp-jax")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from mtp_jax import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtp-jax", description="Multi-Token Prediction models in JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(subparsers)
    add_train_parser(subparsers)
    add_eval_parser(subparsers)
    add_serve_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"mtp-jax {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
