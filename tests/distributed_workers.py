"""Runs `jax.distributed` worker scripts on localhost for the multi-process tests (`test_multiprocess`,
`test_multiprocess_load`): N processes with 4 fake CPU devices each, a coordinator on a free port, each
worker in its own session (killed with everything it started), its output in `tmp_path/worker{i}.log`."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

HERE = pathlib.Path(__file__).parent
LOCAL_DEVICES = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and nothing else
        proc.wait()


def run_workers(
    script: str,
    args: Callable[[int], list[str]],
    tmp_path: pathlib.Path,
    *,
    num_processes: int,
    timeout_s: float,
    meanwhile: Callable[[], object] = lambda: None,
) -> tuple[list[int | None], str, object]:
    """Starts `num_processes` workers `python tests/<script> ADDRESS N i *args(i)`, runs `meanwhile()` here
    while they work, waits at most `timeout_s` for them, kills what is left.

    Returns (each worker's return code, their logs' tails for an assertion message, `meanwhile()`'s value)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",  # the workers import this tree's mtp_jax, as this process does
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}".strip(),
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        env.pop(name, None)
    address = f"localhost:{_free_port()}"
    procs, logs = [], []
    try:
        for i in range(num_processes):
            logs.append(open(tmp_path / f"worker{i}.log", "w"))
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / script), address, str(num_processes), str(i), *args(i)],
                    env=env,
                    cwd=HERE.parent,
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        value = meanwhile()
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            _kill(proc)
        for log in logs:
            log.close()
    output = "\n".join(
        f"--- worker {i} (rc {p.returncode}):\n" + (tmp_path / f"worker{i}.log").read_text()[-4000:]
        for i, p in enumerate(procs)
    )
    return [p.returncode for p in procs], output, value
