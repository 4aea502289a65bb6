"""`mtp-jax plan`: the memory plan of decoding a model on a device mesh (`mtp_jax.memory_plan`), from a
checkpoint directory's config.json or a preset; no weights are read and no device is needed."""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import types

from mtp_jax.cli.common import bounded, name_flags
from mtp_jax.sharding import MESH_AXES, parse_mesh_spec

PLAN_DESCRIPTION = """\
Print how much memory each device needs to decode a model on a device mesh: the weights by dtype,
the main model's KV cache, the MTP modules' caches, the rest of the decode state and, for a hybrid
model (Qwen3.5), the recurrent states a verify step keeps, for --max-batch rows of --max-length
tokens. CHECKPOINT_DIR_OR_PRESET is a checkpoint directory (only config.json and the safetensors
headers are read; the headers' byte total is printed beside the plan's) or a preset name. The mesh
is abstract: --mesh expert=16,tensor=2 plans 32 devices on any machine. With the device memory known
(--device-memory, else what the backend reports: GPUs do), the plan says whether it fits and names
the smallest mesh that does (data x expert x tensor, powers of two, up to 1024 devices); exit status
1 when it does not fit. Other activations and XLA's temporary buffers are not counted."""

# Parameters of the library that a `plan` flag sets: errors naming them name the flag too.
_PLAN_FLAGS = {
    r"\bmax_length\b": "--max-length",
    r"\bmax_batch\b|\bbatch size\b": "--max-batch",
    r"\bmesh\b|\bexpert axis\b": "--mesh",
    r"\bnum_speculative_tokens\b": "--num-speculative-tokens",
    r"\bmtp_style\b|\bno MTP modules\b|\bmethod\b": "--speculative",
    r"\bdevice_memory_bytes\b": "--device-memory",
    r"\bpage_size\b": "--page-size",
}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def byte_size(text: str) -> int:
    """An argparse `type`: "141GB" (10**9 bytes per GB), "80GiB" (2**30 per GiB), "1.5e11" -> bytes (int >= 1)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"must be a size like 141GB, 80GiB or 1.5e11 (bytes), got {text!r}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return size


def plan_mesh(text: str) -> str:
    """An argparse `type` for `--mesh`: `text`, refused unless `parse_mesh_spec` takes it with no -1 size."""
    try:
        sizes = parse_mesh_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if -1 in sizes.values():
        raise argparse.ArgumentTypeError(
            f"give every axis its size (-1, the rest of the devices, is unknown here): {text!r}"
        )
    return text


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """Registers `plan` (per-device memory of decoding a model on a mesh) on argparse subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="per-device memory of decoding a model on a device mesh, and whether it fits",
        description=PLAN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="CHECKPOINT_DIR_OR_PRESET", help="a checkpoint directory or a preset name")
    p.add_argument(
        "--mesh",
        type=plan_mesh,
        metavar="SPEC",
        default=None,
        help=f"the device mesh, e.g. expert=8,tensor=2 (axes {', '.join(MESH_AXES)}; those not given have "
        "size 1; no device needs to exist). Default: one device",
    )
    p.add_argument("--max-batch", type=bounded(int, 1), default=1, help="decode rows (default 1)")
    p.add_argument(
        "--max-length",
        type=bounded(int, 2),
        default=None,
        help="cache capacity in tokens per row, prompt included (default: the model's max positions)",
    )
    p.add_argument(
        "--speculative",
        default=None,
        choices=["none", "vanilla", "eagle", "parallel"],
        help="MTP speculative decoding method (default: eagle for a model with MTP modules, else none)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help="K, drafts per step (default: 3 for eagle, else the model's MTP modules)",
    )
    p.add_argument(
        "--device-memory",
        type=byte_size,
        metavar="SIZE",
        default=None,
        help="memory of one device: 141GB (GB = 10**9 bytes), 80GiB, or bytes (default: what the backend "
        "reports, GPUs do; else no fit check)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and compute dtype (default: the checkpoint's or the preset's)",
    )
    p.add_argument(
        "--page-size",
        type=bounded(int, 1),
        default=None,
        help="plan the KV caches as `mtp-jax serve` keeps them: a pool of pages of this many tokens (default: "
        "dense rows, as `generate` keeps them; 16 when --num-pages or --kv-cache-memory is given)",
    )
    pool = p.add_mutually_exclusive_group()
    pool.add_argument(
        "--num-pages",
        type=bounded(int, 1),
        default=None,
        help="KV pages in the pool (default with --page-size: --max-batch x ceil(--max-length / --page-size))",
    )
    pool.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        metavar="SIZE",
        default=None,
        help="the pool's memory instead of --num-pages (as for serve)",
    )
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    from mtp_jax import memory_plan
    from mtp_jax.config import PRESETS
    from mtp_jax.decode.speculative import SpeculativeConfig

    path = pathlib.Path(args.model)
    if args.model in PRESETS:
        config = PRESETS[args.model]
        if args.dtype is not None:
            config = config.replace(dtype=args.dtype, param_dtype=args.dtype)
    elif path.is_dir():
        config = memory_plan.read_config(path)
    else:
        raise ValueError(
            f"CHECKPOINT_DIR_OR_PRESET: {args.model!r} is neither a checkpoint directory nor a preset "
            f"({', '.join(sorted(PRESETS))})"
        )
    try:
        method = args.speculative or ("eagle" if config.num_nextn_predict_layers else "none")
        # (from_flags reads only the model's config: no model is built for it)
        speculative = SpeculativeConfig.from_flags(
            method, args.num_speculative_tokens, types.SimpleNamespace(config=config)
        )
        length = config.max_position_embeddings if args.max_length is None else args.max_length
        request = dict(
            mesh=args.mesh,
            max_batch=args.max_batch,
            speculative=speculative,
            device_memory_bytes=args.device_memory,
            pages=page_layout(
                config,
                speculative,
                max_batch=args.max_batch,
                max_length=length,
                num_pages=args.num_pages,
                kv_cache_memory=args.kv_cache_memory,
                page_size=args.page_size or (16 if args.num_pages or args.kv_cache_memory else None),
            ),  # fmt: skip
        )
        if args.model in PRESETS:
            plan = memory_plan.memory_plan(config, max_length=length, **request)
        else:
            plan = memory_plan.plan_checkpoint(path, max_length=args.max_length, dtype=args.dtype, **request)
    except (ValueError, TypeError) as error:
        raise name_flags(error, _PLAN_FLAGS) from error
    print(plan.table(args.model))
    try:
        memory_plan.check_fits(plan)
    except ValueError as error:
        print(f"mtp-jax plan: does not fit: {error}", file=sys.stderr)
        return 1
    return 0


def page_layout(config, speculative, *, max_batch: int, max_length: int, page_size: int | None, **pool):
    """The serving engine's `PageLayout` for `config`'s model: pages of `page_size` tokens, as many as
    `mtp_jax.serving.paging.pool_pages` gives for `pool` (num_pages or kv_cache_memory, or neither); None
    when page_size is None (dense rows)."""
    if page_size is None:
        return None
    from mtp_jax.cache import PageLayout
    from mtp_jax.model import abstract_model
    from mtp_jax.serving.paging import pool_pages

    count = pool_pages(
        abstract_model(config), speculative, max_batch=max_batch, max_length=max_length, page_size=page_size, **pool
    )
    return PageLayout(count, page_size)


def refuse_what_does_not_fit(
    model_dir: pathlib.Path,
    mesh,
    *,
    max_batch: int,
    max_length: int | None,
    speculative: str,
    num_speculative_tokens: int | None,
    dtype: str | None,
    dequantize: bool,
    page_size: int | None = None,
    num_pages: int | None = None,
    kv_cache_memory: int | None = None,
) -> None:
    """Before `generate` / `serve` read any weights: where the devices report their memory (GPUs), the
    memory plan of the checkpoint in `model_dir` on `mesh` (None: one device) for `max_batch` rows of
    `max_length` tokens, their KV in a pool of pages of `page_size` tokens when given (serve: `num_pages`, or
    what `kv_cache_memory` bytes hold, or the default, `mtp_jax.serving.paging.pool_pages`); ValueError
    (`memory_plan.check_fits`' message: the numbers and the smallest mesh that fits) when it does not fit.
    Does nothing where the backend reports no memory (the CPU) or when config.json cannot be read (the load
    that follows names the problem)."""
    from mtp_jax import memory_plan
    from mtp_jax.decode.speculative import SpeculativeConfig

    available = memory_plan.device_memory()
    if available is None:
        return
    try:
        config = memory_plan.read_config(model_dir)
    except (OSError, ValueError):
        return
    if dtype is not None:
        config = config.replace(dtype=dtype, param_dtype=dtype)
    if dequantize:
        config = config.replace(quantization=None)
    spec = SpeculativeConfig.from_flags(speculative, num_speculative_tokens, types.SimpleNamespace(config=config))
    max_length = config.max_position_embeddings if max_length is None else max_length
    pages = page_layout(
        config, spec, max_batch=max_batch, max_length=max_length, page_size=page_size, num_pages=num_pages,
        kv_cache_memory=kv_cache_memory,
    )  # fmt: skip
    plan = memory_plan.memory_plan(
        config.replace(scan_layers=True),  # the same bytes per device, built faster
        mesh,
        max_batch=max_batch,
        max_length=max_length,
        speculative=spec,
        device_memory_bytes=available,
        pages=pages,
    )
    memory_plan.check_fits(plan)
