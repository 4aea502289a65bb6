"""`mtp-jax generate`: plain or MTP speculative decoding of text prompts with a model directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR as DEFAULT_MODEL
from mtp_jax.cli.common import (
    MODEL_HELP,
    add_compilation_cache_arguments,
    add_speculative_arguments,
    add_weight_arguments,
    configure_compilation_cache,
    name_flags,
    read_token_ids,
)
from mtp_jax.cli.distributed import add_mesh_arguments, check_num_prompts, mesh_from_args
from mtp_jax.cli.plan import refuse_what_does_not_fit

GENERATE_DESCRIPTION = """\
Generate continuations of text prompts, with plain decoding or MTP speculative decoding.

--model DIR names the model: a saved model directory (config.json, safetensors, tokenizer.json;
Hugging Face layout; default: the bundled demo model). stdout gets each prompt and its continuation
(with --stream, the one prompt's text as it is committed). stderr gets one timing line and, when
speculating, the acceptance metrics. The timing line keeps apart: load (reading the model
directory), compile (a warm-up run of 1-2 tokens that compiles every jitted function; JAX's
persistent compilation cache, --compilation-cache, makes it short on later runs) and decode (the
real run, compiled code only: tokens generated / wall time of prefill plus decode)."""

# Parameters of the library that a `generate` flag sets: errors naming them name the flag too.
_GENERATE_FLAGS = {
    r"\bmax_new_tokens\b": "--max-new-tokens",
    r"\bmax_length\b": "--max-length",
    r"\btemperature\b": "--temperature",
    r"\btop_k\b": "--top-k",
    r"\btop_p\b": "--top-p",
    r"\bseed\b": "--seed",
    r"\bnum_speculative_tokens\b": "--num-speculative-tokens",
    r"\bdraft_vocab\b": "--draft-vocab",
    r"\bmtp_style\b|\bno MTP modules\b": "--speculative",
    r"\bmesh\b": "--mesh",
}


def add_generate_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `generate` (plain or speculative decoding of text prompts) on an argparse subparsers."""
    p = subparsers.add_parser(
        "generate",
        help="generate text from prompts with a model directory",
        description=GENERATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", metavar="DIR", default=str(DEFAULT_MODEL), help=f"{MODEL_HELP}; default: the bundled demo model"
    )
    p.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    p.add_argument("--prompt-file", action="append", help="a file whose whole text is one prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="cache capacity in tokens, prompt included, at most the model's max positions (the default)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the first row, in [0, 2**32); row b uses seed + b, which must stay below 2**32",
    )
    add_speculative_arguments(p, default="none")
    p.add_argument("--stream", action="store_true", help="print tokens as they are committed (batch of one)")
    add_weight_arguments(p)
    add_compilation_cache_arguments(p)
    add_mesh_arguments(
        p,
        mesh_help="The number of prompts must be a multiple of data x fsdp (an error otherwise: "
        "no dummy rows are added).",
    )
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
            bad = text[error.start : error.end].encode("utf-8", "surrogateescape")
            raise ValueError(
                f"--prompt: prompt {i} is not valid UTF-8 (bytes {bad!r} at character {error.start})"
            ) from None
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


def _name_flags(error: ValueError, sources: list[str]) -> ValueError:
    """The library's error with the `generate` flags it concerns named in front; "prompt i" names the
    flag (and the file) prompt i came from, `sources[i]`."""
    import re

    prompt = re.search(r"\bprompt (\d+)\b", str(error))
    source = sources[int(prompt.group(1))] if prompt and int(prompt.group(1)) < len(sources) else ""
    return name_flags(error, _GENERATE_FLAGS, [source] if source else [])


def _generate_kwargs(args, model, num_prompts: int, mesh=None) -> dict:
    """The keyword arguments of `generate` / `stream` that the flags give; raises ValueError on bad flags."""
    from mtp_jax.decode.sampling import MAX_SEED, SamplingParams
    from mtp_jax.decode.speculative import SpeculativeConfig

    if 0 <= args.seed <= MAX_SEED < args.seed + num_prompts - 1:
        raise ValueError(
            f"--seed {args.seed}: row b samples with seed + b, and row {num_prompts - 1} would get "
            f"{args.seed + num_prompts - 1}, past the largest seed 2**32 - 1"
        )
    sampling = [
        SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed + b)
        for b in range(num_prompts)
    ]
    speculative = SpeculativeConfig.from_flags(
        args.speculative, args.num_speculative_tokens, model, read_token_ids(args.draft_vocab)
    )
    return dict(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        max_length=args.max_length,
        speculative=speculative,
        mesh=mesh,
    )


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

    from mtp_jax.decode.generation import stream
    from mtp_jax.decode.text import TextStream

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
    cache_dir = configure_compilation_cache(args)
    texts, sources = _prompts(args)
    check_num_prompts(args, mesh, len(texts))
    if Path(args.model).exists() and not Path(args.model).is_dir():
        raise ValueError(
            f"--model: {args.model} is not a directory (a model directory holds config.json, "
            "safetensors weights and tokenizer.json)"
        )
    begin = time.perf_counter()
    try:
        dtype, why = inference_dtype(args.model, args.dtype)
        if why:
            print(f"mtp-jax generate: {why}", file=sys.stderr)
        refuse_what_does_not_fit(
            Path(args.model),
            mesh,
            max_batch=len(texts),
            max_length=args.max_length,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            dtype=dtype,
            dequantize=args.dequantize,
        )
        model, tokenizer = load_pretrained(args.model, dtype=dtype, mesh=mesh, dequantize=args.dequantize)
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
    print(
        f"--- load {load_seconds:.2f} s | compile {compile_seconds:.2f} s (warm-up run, {cache}) | "
        f"decode {num_generated} tokens in {decode_seconds:.4f} s: {rate:.1f} tokens/s (compiled, prefill included)",
        file=sys.stderr,
    )
    spec = kwargs["speculative"]
    if spec is not None:
        print(f"--- {args.speculative}, K = {spec.num_speculative_tokens}: {result.metrics.summary()}", file=sys.stderr)
    return 0
