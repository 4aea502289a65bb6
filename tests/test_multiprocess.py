"""Two `jax.distributed` processes on localhost (4 fake CPU devices each) decode on one mesh
`data=2,tensor=4` over the 8 global devices; both get exactly the single-process, single-device
tokens (plain greedy and eagle K = 2, the latter with weights that were already sharded over both
processes, which `sharding.place` moves device to device). The processes are
`tests/multiprocess_worker.py`."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import multiprocess_worker as worker  # tests/ is on sys.path (pytest's rootdir-relative import)

from mtp_jax.decode.generation import generate

HERE = pathlib.Path(__file__).parent
NUM_PROCESSES = 2
TIMEOUT_S = 240  # two processes compiling on a 2-core machine take about 50 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session: it and nothing else
        proc.wait()


def test_two_processes_decode_on_one_mesh_as_one_device(tmp_path):
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",  # the workers import this tree's mtp_jax, as this process does
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip(),
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_DISTRIBUTED"):
        env.pop(name, None)
    address = f"localhost:{_free_port()}"
    procs, logs = [], []
    try:
        for i in range(NUM_PROCESSES):
            log = open(tmp_path / f"worker{i}.log", "w")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "multiprocess_worker.py"),
                        address,
                        str(NUM_PROCESSES),
                        str(i),
                        str(tmp_path / f"worker{i}.json"),
                    ],
                    env=env,
                    cwd=HERE.parent,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        # the reference, here (one device), while the workers run
        model, prompts = worker.model(), worker.prompts()
        kwargs = dict(max_new_tokens=worker.MAX_NEW_TOKENS, max_length=worker.MAX_LENGTH)
        plain = generate(model, prompts, **kwargs).tokens
        eagle = generate(model, prompts, speculative=worker.speculative(), **kwargs).tokens
        deadline = time.monotonic() + TIMEOUT_S
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
    assert [p.returncode for p in procs] == [0] * NUM_PROCESSES, output
    assert eagle == plain
    for i in range(NUM_PROCESSES):
        got = json.loads((tmp_path / f"worker{i}.json").read_text())
        assert (got["process_index"], got["process_count"]) == (i, NUM_PROCESSES), output
        assert (got["local_devices"], got["global_devices"]) == (4, 8), output
        assert got["plain"] == plain, output
        assert got["eagle"] == eagle, output
