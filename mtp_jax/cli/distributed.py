"""The device flags `mtp-jax generate`, `train` and `serve` share: `--mesh` (`mtp_jax.sharding.make_mesh`)
and the multi-process ones of `jax.distributed` (`--coordinator-address`, `--num-processes`,
`--process-id`, each overriding its `JAX_*` environment variable, see
`mtp_jax.distributed.initialize_distributed`; `--distributed-timeout`)."""

from __future__ import annotations

import argparse
import os
import sys
import threading

from jax.sharding import Mesh

from mtp_jax.cli.common import bounded, name_flags
from mtp_jax.distributed import initialize_distributed
from mtp_jax.sharding import MESH_AXES, batch_rows, make_mesh, parse_mesh_spec

# initialize_distributed's arguments, named in its errors, and their flags.
_DISTRIBUTED_FLAGS = {
    r"\bcoordinator_address\b": "--coordinator-address",
    r"\bnum_processes\b": "--num-processes",
    r"\bprocess_id\b": "--process-id",
}
# jax's own timeout is the flag's plus this: the watchdog (`_Watchdog`) ends the process first, with a
# message, where jax would abort it (a fatal error of its runtime, with a C++ stack trace).
_JAX_TIMEOUT_GRACE_S = 10


def mesh_spec(text: str) -> str:
    """An argparse `type` for `--mesh`: `text` itself, refused (argparse names the flag) unless
    `sharding.parse_mesh_spec` takes it."""
    try:
        parse_mesh_spec(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def add_mesh_arguments(parser: argparse.ArgumentParser, *, mesh_help: str) -> None:
    """Adds the "devices" group (--mesh and the jax.distributed flags) to `parser`; `mesh_help` says
    what the mesh's batch axes ask of the command's batch."""
    group = parser.add_argument_group("devices")
    group.add_argument(
        "--mesh",
        type=mesh_spec,
        metavar="SPEC",
        default=None,
        help=f"run sharded on a device mesh, e.g. data=2,tensor=4 (axes {', '.join(MESH_AXES)}; "
        f"those not given have size 1, one may be -1: the rest; the sizes' product must be "
        f"the number of devices, every process's). {mesh_help} Default: one device",
    )
    group.add_argument(
        "--coordinator-address",
        metavar="HOST:PORT",
        default=None,
        help="multi-process run (jax.distributed): process 0's address; with --num-processes and "
        "--process-id (default: $JAX_COORDINATOR_ADDRESS)",
    )
    group.add_argument(
        "--num-processes",
        type=bounded(int, 1),
        default=None,
        help="multi-process run: the number of processes (default: $JAX_NUM_PROCESSES)",
    )
    group.add_argument(
        "--process-id",
        type=bounded(int, 0),
        default=None,
        help="multi-process run: this process's index, 0..N-1 (default: $JAX_PROCESS_ID)",
    )
    group.add_argument(
        "--distributed-timeout",
        metavar="SECONDS",
        type=bounded(int, 0, above=True),
        default=300,
        help="multi-process run: how long to wait for all processes to join the coordinator, then "
        "give up with an error (default 300)",
    )


class _Watchdog:
    """Says on stderr what `jax.distributed` waits for, and ends the process (exit 2, a one-line error
    naming the flags) if the wait outlasts --distributed-timeout: jax cannot be interrupted while it
    waits, and would abort the process with a C++ stack trace past its own timeout."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.timer, self.address = args, None, args.coordinator_address

    def start(self, address: str | None, num_processes: int | None, process_id: int | None) -> None:
        """`initialize_distributed`'s on_connect: called right before jax waits."""
        command, seconds = f"mtp-jax {self.args.command}", self.args.distributed_timeout
        self.address = address
        if address is None:  # JAX_DISTRIBUTED=auto: jax finds the cluster itself
            waiting = "the processes of the cluster jax detects (JAX_DISTRIBUTED=auto) to join"
            failure = (
                f"--distributed-timeout {seconds}: the processes of the cluster (JAX_DISTRIBUTED=auto) did not "
                f"all join within {seconds} s"
            )
        elif process_id == 0:
            waiting = (
                f"all {num_processes} processes to join the coordinator at {address} (process 0 of "
                f"{num_processes}, which runs it)"
            )
            failure = (
                f"--coordinator-address {address}, --distributed-timeout {seconds}: the other processes did not "
                f"all join the coordinator at {address} within {seconds} s (this is process 0 of "
                f"{num_processes}); start them with the same --coordinator-address and --num-processes, or "
                "raise --distributed-timeout"
            )
        else:
            waiting = f"the coordinator at {address} (process {process_id} of {num_processes})"
            failure = (
                f"--coordinator-address {address}, --distributed-timeout {seconds}: no answer from the "
                f"coordinator at {address} within {seconds} s (process {process_id} of {num_processes}); "
                "is process 0 running there, and the port reachable from this host? Else raise "
                "--distributed-timeout"
            )
        print(f"{command}: waiting up to {seconds} s for {waiting}", file=sys.stderr, flush=True)
        self.timer = threading.Timer(seconds, self._give_up, args=(f"{command}: error: {failure}",))
        self.timer.daemon = True
        self.timer.start()

    @staticmethod
    def _give_up(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2)  # the main thread is inside jax, out of reach of exceptions

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def mesh_from_args(args: argparse.Namespace) -> Mesh | None:
    """Joins the multi-process run the flags (or the environment) ask for, then builds the `--mesh`
    (None without it). Call it before anything else uses jax.

    Raises ValueError naming the flags (or the environment variable): only some of the multi-process
    settings given, a bad --coordinator-address or process count, a coordinator that cannot start, or a
    mesh whose size is not the number of devices. Waits at most --distributed-timeout seconds for the
    other processes, then exits the process (status 2) with a one-line error.
    """
    watchdog = _Watchdog(args)
    try:
        initialize_distributed(
            args.coordinator_address,
            args.num_processes,
            args.process_id,
            initialization_timeout=args.distributed_timeout + _JAX_TIMEOUT_GRACE_S,
            on_connect=watchdog.start,
        )
    except ValueError as error:
        raise name_flags(error, _DISTRIBUTED_FLAGS) from None
    except RuntimeError as error:  # jax's runtime: e.g. process 0 cannot listen on the port
        raise ValueError(
            f"--coordinator-address {watchdog.address}: jax.distributed could not start: {str(error).strip()}"
        ) from None
    finally:
        watchdog.cancel()
    if args.mesh is None:
        return None
    try:
        return make_mesh(args.mesh)
    except ValueError as error:
        raise ValueError(f"--mesh {args.mesh}: {error}") from None


def check_num_prompts(args: argparse.Namespace, mesh: Mesh | None, num_prompts: int) -> None:
    """Raises ValueError naming --mesh unless `num_prompts` is a multiple of the mesh's data x fsdp."""
    rows = batch_rows(mesh)
    if num_prompts % rows:
        raise ValueError(
            f"--mesh {args.mesh}: {num_prompts} prompt{'s' * (num_prompts != 1)} cannot be split over "
            f"data x fsdp = {rows} devices; give a multiple of {rows} prompts (--prompt, "
            f"--prompt-file)"
        )
