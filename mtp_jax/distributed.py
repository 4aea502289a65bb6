"""Several processes, one mesh: `initialize_distributed` joins a `jax.distributed` run from arguments or the
`JAX_*` environment variables, with every setting checked before jax sees it (a bad address crashes jax's
runtime; a wrong process count hangs it)."""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket

import jax

from mtp_jax.validation import is_int


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: int | None = None,
    on_connect=None,
) -> bool:
    """`jax.distributed.initialize` from the arguments or the environment; True when it ran.

    Arguments left None are read from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and
    `JAX_PROCESS_ID`; with none of them set (and no argument) nothing happens (one process), unless a
    cluster jax detects itself (SLURM, Open MPI, Kubernetes) is asked for by `JAX_DISTRIBUTED=auto`.
    Call it before any other jax call.

    `initialization_timeout` (seconds, default jax's 300) bounds jax's wait for every process to join
    the coordinator; past it jax aborts the whole process (a fatal error of its C++ runtime, not an
    exception). `on_connect(coordinator_address, num_processes, process_id)`, if given, is called with
    the settings right before that wait (all None under `JAX_DISTRIBUTED=auto`), e.g. to say what the
    process waits for or to start a watchdog of one's own.

    Raises ValueError naming the argument or the environment variable at fault: only some of the three
    given; a count that is not an integer (num_processes >= 1, 0 <= process_id < num_processes); an
    address that is not HOST:PORT with PORT in 1..65535 (an IPv6 host in brackets: `[::1]:1234`).
    """
    env = os.environ
    names = {
        "coordinator_address": "coordinator_address",
        "num_processes": "num_processes",
        "process_id": "process_id",
    }  # what errors call each setting: the argument, or its variable

    def from_env(name: str, variable: str, low: int) -> int:
        names[name] = variable
        text = env[variable]
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise ValueError(f"environment variable {variable} must be an integer >= {low}, got {text!r}")
        return value

    if coordinator_address is None and env.get("JAX_COORDINATOR_ADDRESS"):
        coordinator_address = env["JAX_COORDINATOR_ADDRESS"]
        names["coordinator_address"] = "JAX_COORDINATOR_ADDRESS"
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = from_env("num_processes", "JAX_NUM_PROCESSES", 1)
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = from_env("process_id", "JAX_PROCESS_ID", 0)
    timeout = {} if initialization_timeout is None else {"initialization_timeout": initialization_timeout}
    given = [coordinator_address is not None, num_processes is not None, process_id is not None]
    if not any(given):
        if env.get("JAX_DISTRIBUTED") == "auto":
            if on_connect is not None:
                on_connect(None, None, None)
            jax.distributed.initialize(**timeout)
            return True
        return False
    if not all(given):
        raise ValueError(
            "multi-process runs need all of coordinator_address, num_processes and process_id "
            f"(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); got "
            f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}"
        )
    if not (is_int(num_processes) and num_processes >= 1):
        raise ValueError(f"{names['num_processes']} must be an integer >= 1, got {num_processes!r}")
    if not (is_int(process_id) and 0 <= process_id < num_processes):
        raise ValueError(
            f"{names['process_id']} must be an integer in [0, {names['num_processes']}) = "
            f"[0, {num_processes}), got {process_id!r}"
        )
    # Checked here: jax takes the port unchecked (one that is not a number crashes its runtime).
    host, colon, port = coordinator_address.rpartition(":") if isinstance(coordinator_address, str) else ("", "", "")
    problem = None
    if not colon or not host:
        problem = "is not HOST:PORT"
    elif not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        problem = f"has port {port!r}, not an integer in 1..65535"
    elif host.startswith("[") or ":" in host:  # IPv6
        try:
            ipaddress.IPv6Address(host[1:-1] if host.startswith("[") and host.endswith("]") else "not bracketed")
        except ValueError:
            problem = f"has host {host!r}, not an IPv6 address in brackets"
    elif not re.fullmatch(r"[A-Za-z0-9_.-]+", host):
        problem = f"has host {host!r}, not a host name or an IP address"
    if problem:
        raise ValueError(
            f"{names['coordinator_address']} {coordinator_address!r} {problem} (expected HOST:PORT "
            "with PORT in 1..65535, e.g. 10.0.0.1:1234 or [::1]:1234)"
        )
    if process_id == 0 and not env.get("JAX_COORDINATOR_BIND_ADDRESS"):
        # Process 0's coordinator listens on [::]:PORT (jax's default); on a port taken, jax's runtime fails,
        # at times with a segmentation fault.
        try:
            with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("::", int(port)))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ValueError(
                    f"{names['coordinator_address']} {coordinator_address!r}: port {port} is in use "
                    "on this host, where process 0 runs the coordinator"
                ) from None
    if on_connect is not None:
        on_connect(coordinator_address, int(num_processes), int(process_id))
    jax.distributed.initialize(coordinator_address, int(num_processes), int(process_id), **timeout)
    return True
