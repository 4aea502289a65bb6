"""`mtp-jax serve`: the OpenAI-compatible HTTP server (`mtp_jax.serving.server`) over one model directory
(`--model DIR`, or the positional MODEL_DIR).

Needs the `serve` extra (`pip install "mtp-jax[serve]"`: fastapi, uvicorn, prometheus-client, jinja2),
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from mtp_jax.checkpoints.pretrained import DEFAULT_MODEL_DIR
from mtp_jax.cli.common import (
    MODEL_HELP,
    DefaultModelDir,
    add_compilation_cache_arguments,
    add_speculative_arguments,
    add_weight_arguments,
    bounded,
    configure_compilation_cache,
    name_flags,
    pick_model,
    read_token_ids,
)
from mtp_jax.cli.distributed import add_mesh_arguments, mesh_from_args
from mtp_jax.cli.plan import byte_size, refuse_what_does_not_fit

SERVE_DESCRIPTION = """\
Serve a model over HTTP with OpenAI's API: POST /v1/completions and /v1/chat/completions (JSON or
streamed server-sent events), GET /v1/models, /health and /metrics (Prometheus). --model DIR names
the model: a saved model directory (config.json, safetensors, tokenizer.json; default: the bundled
demo model); the positional MODEL_DIR means the same, give one or the other. Requests are batched
continuously over --max-batch rows of up to --max-length tokens each, with plain decoding or MTP
speculative decoding; their KV caches are pages of --page-size tokens from a pool (--num-pages, or
--kv-cache-memory), so memory follows the tokens held; requests are preempted when the pool runs out,
and prompt pages are reused across requests (prefix caching, unless --no-prefix-caching). The engine
is compiled (warmed up) before the server listens; the URL is printed once it does. Chat requests
use the model's chat_template from tokenizer_config.json, else a plain "<|role|>" template
(mtp_jax.serving.chat_template). Compiled programs go to JAX's persistent compilation cache
(--compilation-cache), which makes the warm-up short after the first start."""

# ServingEngine parameters named in its errors, and their flags.
_FLAGS = {
    "max_batch": "--max-batch",
    "max_length": "--max-length",
    "prefill_chunk": "--prefill-chunk",
    "max_queue": "--max-queue",
    "num_pages": "--num-pages",
    "page_size": "--page-size",
    "num_speculative_tokens": "--num-speculative-tokens",
    "draft_vocab": "--draft-vocab",
}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `serve` on an argparse subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP with OpenAI's API",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        nargs="?",
        default=DefaultModelDir(DEFAULT_MODEL_DIR),
        help="the same as --model DIR (give one of them)",
    )
    p.add_argument("--model", metavar="DIR", default=None, help=f"{MODEL_HELP}; default: the bundled demo model")
    add_speculative_arguments(p, default="eagle")
    p.add_argument(
        "--draft-sampling",
        choices=("sample", "greedy"),
        default="sample",
        help="sample: a sampled request's drafts are drawn from the drafter's distribution and accepted by the "
        "lossless rule, a greedy request's are greedy (default); greedy: every draft is the drafter's argmax",
    )
    p.add_argument(
        "--speculative-policy",
        choices=("fixed", "adaptive"),
        default="fixed",
        help="fixed: every step verifies K drafts (default); adaptive: each step verifies 0 .. K, chosen by "
        "measured acceptance and step times (one more compiled step per k)",
    )
    add_weight_arguments(p)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoding at once: rows of a step (default 8)")
    p.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="most tokens of one request, prompt + output (default: the model's max positions)",
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV pages in the pool (default: --max-batch x ceil(--max-length / --page-size), the memory of "
        "--max-batch full-length requests)",
    )
    pool.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="the pool's memory instead of --num-pages: main model and MTP modules, all layers (e.g. 4GB, 2GiB)",
    )
    p.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        default=None,
        help="never reuse cached prompt pages (default: reuse them where the model allows it)",
    )
    p.add_argument(
        "--prefill-chunk", type=int, default=64, help="prompt tokens per prefill call, >= K + 1 (default 64)"
    )
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests before new ones get 429 (default 256)")
    p.add_argument(
        "--max-request-bytes",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="the largest request body; larger ones get 413 before they are read (e.g. 16MiB; default 4MiB, "
        "a 160k-token prompt as token ids or text)",
    )
    p.add_argument(
        "--max-logprobs",
        type=bounded(int, 0),
        default=20,
        help="most likely tokens a request may ask for per output token (completions' logprobs, chat's "
        "top_logprobs; default 20 as vLLM's); computed on device only in steps where a request asks",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=bounded(int, 0, 65535), default=8000, help="port (default 8000; 0: a free one)")
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        default=None,
        help="the model name requests must give (default: the model directory's name)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )
    add_compilation_cache_arguments(p)
    add_mesh_arguments(p, mesh_help="--max-batch must be a multiple of data x fsdp.")
    p.set_defaults(func=run_serve)
    return p


def _build_engine(args: argparse.Namespace, mesh):
    """(engine, tokenizer, served name, metrics, chat template) of the flags; ValueError naming them."""
    from mtp_jax.checkpoints.pretrained import inference_dtype, load_pretrained
    from mtp_jax.decode.speculative import SpeculativeConfig
    from mtp_jax.serving import ServingEngine
    from mtp_jax.serving.chat_template import ChatTemplate
    from mtp_jax.serving.paging import pool_pages
    from mtp_jax.serving.prometheus import PrometheusMetrics

    given, spelling = pick_model(args.model_dir, args.model, "MODEL_DIR")
    model_dir = Path(given)
    try:
        dtype, why = inference_dtype(model_dir, args.dtype)
        if why:
            print(f"mtp-jax serve: {why}", file=sys.stderr)
        refuse_what_does_not_fit(
            model_dir,
            mesh,
            max_batch=args.max_batch,
            max_length=args.max_length,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            dtype=dtype,
            dequantize=args.dequantize,
            page_size=args.page_size,
            num_pages=args.num_pages,
            kv_cache_memory=args.kv_cache_memory,
        )
        model, tokenizer = load_pretrained(model_dir, dtype=dtype, mesh=mesh, dequantize=args.dequantize)
        chat_template = ChatTemplate.from_model_dir(model_dir)
    except (OSError, ValueError) as error:
        raise ValueError(f"{spelling}: {error}") from error
    name = args.served_model_name or model_dir.resolve().name
    try:
        speculative = SpeculativeConfig.from_flags(
            args.speculative, args.num_speculative_tokens, model, read_token_ids(args.draft_vocab)
        )
        if speculative is not None:
            speculative = dataclasses.replace(speculative, draft_sampling=args.draft_sampling)
        metrics = PrometheusMetrics(
            name,
            0 if speculative is None else speculative.num_speculative_tokens,
            max_model_len=args.max_length or model.config.max_position_embeddings,
        )
        num_pages = args.num_pages
        if args.kv_cache_memory is not None:
            num_pages = pool_pages(
                model,
                speculative,
                max_batch=args.max_batch,
                page_size=args.page_size,
                kv_cache_memory=args.kv_cache_memory,
            )  # as many pages as the memory holds: no max length needed
        engine = ServingEngine(
            model,
            speculative,
            tokenizer=tokenizer,
            max_batch=args.max_batch,
            max_length=args.max_length,
            num_pages=num_pages,
            page_size=args.page_size,
            prefix_caching=args.prefix_caching,
            speculative_policy=args.speculative_policy,
            max_logprobs=args.max_logprobs,
            prefill_chunk=args.prefill_chunk,
            max_queue=args.max_queue,
            mesh=mesh,
            stats=metrics,
        )
    except ValueError as error:
        raise name_flags(error, _FLAGS) from error
    return engine, tokenizer, name, metrics, chat_template


def run_serve(args: argparse.Namespace) -> int:
    """Binds the port, loads the model, builds the engine, warms it up (compiling into the persistent cache
    of --compilation-cache, or loading from it), then serves until interrupted."""
    pick_model(args.model_dir, args.model, "MODEL_DIR")  # MODEL_DIR and --model together: refused at once
    mesh = mesh_from_args(args)  # first: jax.distributed must start before jax is used
    import jax

    if jax.process_count() > 1:
        raise ValueError(
            f"--num-processes {jax.process_count()}: serving spans one process (the devices of one "
            "host); the engine steps of several processes are not driven in lockstep yet"
        )
    from mtp_jax.serving.async_engine import AsyncEngine
    from mtp_jax.serving.server import DEFAULT_MAX_REQUEST_BYTES, bind, serve

    try:
        sock = bind(args.host, args.port)  # before the slow part: a port in use fails at once
    except OSError as error:
        raise ValueError(f"--host {args.host} --port {args.port}: {error.strerror or error}") from None
    try:
        engine, tokenizer, name, metrics, chat_template = _build_engine(args, mesh)
        configure_compilation_cache(args)  # the warm-up compiles every engine step: cached after a first start
        print(
            f"mtp-jax serve: warming up {name} ({args.speculative}, max batch {engine.max_batch}, "
            f"max length {engine.max_length}, {engine.num_pages} KV pages of {engine.page_size} tokens, prefix "
            f"caching {'on' if engine.prefix_caching else 'off'}) ...",
            file=sys.stderr,
            flush=True,
        )
        engine.warm_up()
    except BaseException:
        sock.close()
        raise
    serve(
        AsyncEngine(engine),
        tokenizer,
        name,
        metrics=metrics,
        chat_template=chat_template,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        sock=sock,
        log_level=args.log_level,
        on_listening=lambda url: print(f"mtp-jax serve: {name} at {url}/v1", file=sys.stderr, flush=True),
    )
    return 0
