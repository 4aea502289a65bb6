"""The device flags `mtp-jax generate` and `mtp-jax train` share: `--mesh` (`mtp_jax.sharding.make_mesh`)
and the multi-process ones of `jax.distributed` (`--coordinator-address`, `--num-processes`,
`--process-id`; each overrides its `JAX_*` environment variable, see
`mtp_jax.sharding.initialize_distributed`)."""

from __future__ import annotations

import argparse

from jax.sharding import Mesh

from mtp_jax.sharding import MESH_AXES, initialize_distributed, make_mesh, parse_mesh_spec

_DISTRIBUTED_FLAGS = "--coordinator-address, --num-processes, --process-id"


def mesh_spec(text: str) -> str:
    """An argparse `type` for `--mesh`: `text` itself, refused (argparse names the flag) unless
    `sharding.parse_mesh_spec` takes it."""
    try:
        parse_mesh_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _count(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


def add_mesh_arguments(parser: argparse.ArgumentParser, *, mesh_help: str) -> None:
    """Adds the "devices" group (--mesh and the jax.distributed flags) to `parser`; `mesh_help` says
    what the mesh's batch axes ask of the command's batch."""
    group = parser.add_argument_group("devices")
    group.add_argument("--mesh", type=mesh_spec, metavar="SPEC", default=None,
                       help=f"run sharded on a device mesh, e.g. data=2,tensor=4 (axes {', '.join(MESH_AXES)}; "
                            f"those not given have size 1, one may be -1: the rest; the sizes' product must be "
                            f"the number of devices, every process's). {mesh_help} Default: one device")
    group.add_argument("--coordinator-address", metavar="HOST:PORT", default=None,
                       help="multi-process run (jax.distributed): process 0's address; with --num-processes and "
                            "--process-id (default: $JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=_count(1), default=None,
                       help="multi-process run: the number of processes (default: $JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=_count(0), default=None,
                       help="multi-process run: this process's index, 0..N-1 (default: $JAX_PROCESS_ID)")


def mesh_from_args(args: argparse.Namespace) -> Mesh | None:
    """Joins the multi-process run the flags (or the environment) ask for, then builds the `--mesh`
    (None without it). Call it before anything else uses jax.

    Raises ValueError naming the flags: only some of the multi-process settings given, or a mesh whose
    size is not the number of devices.
    """
    try:
        initialize_distributed(args.coordinator_address, args.num_processes, args.process_id)
    except ValueError as error:
        raise ValueError(f"{_DISTRIBUTED_FLAGS}: {error}") from None
    if args.mesh is None:
        return None
    try:
        return make_mesh(args.mesh)
    except ValueError as error:
        raise ValueError(f"--mesh {args.mesh}: {error}") from None


def batch_rows(mesh: Mesh | None) -> int:
    """The mesh's data x fsdp: what every batch's row count must be a multiple of (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape["data"] * mesh.shape["fsdp"]


def check_num_prompts(args: argparse.Namespace, mesh: Mesh | None, num_prompts: int) -> None:
    """Raises ValueError naming --mesh unless `num_prompts` is a multiple of the mesh's data x fsdp."""
    rows = batch_rows(mesh)
    if num_prompts % rows:
        raise ValueError(f"--mesh {args.mesh}: {num_prompts} prompt{'s' * (num_prompts != 1)} cannot be split over "
                         f"data x fsdp = {rows} devices; give a multiple of {rows} prompts (--prompt, "
                         f"--prompt-file)")
