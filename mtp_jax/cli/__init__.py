"""The `mtp-jax` command line: generate, train, eval, serve, plan, distill-data (one module per command)."""

from __future__ import annotations

import argparse
import sys

from mtp_jax.cli.distill import add_distill_parser
from mtp_jax.cli.eval import add_eval_parser
from mtp_jax.cli.generate import add_generate_parser
from mtp_jax.cli.plan import add_plan_parser
from mtp_jax.cli.serve import add_serve_parser
from mtp_jax.cli.train import add_train_parser


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
    add_plan_parser(subparsers)
    add_distill_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"mtp-jax {args.command}: error: {error}", file=sys.stderr)
        return 2
