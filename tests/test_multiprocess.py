"""Two `jax.distributed` processes on localhost (4 fake CPU devices each) decode on one mesh
`data=2,tensor=4` over the 8 global devices; both get exactly the single-process, single-device
tokens (plain greedy and eagle K = 2, the latter with weights that were already sharded over both
processes, which `sharding.place` moves device to device). The processes are
`tests/multiprocess_worker.py`."""

import json
import pathlib

import multiprocess_worker as worker  # tests/ is on sys.path (pytest's rootdir-relative import)
from distributed_workers import run_workers

from mtp_jax.decode.generation import generate

HERE = pathlib.Path(__file__).parent
NUM_PROCESSES = 2
TIMEOUT_S = 240  # two processes compiling on a 2-core machine take about 50 s


def test_two_processes_decode_on_one_mesh_as_one_device(tmp_path):
    def reference():  # here (one device), while the workers run
        model, prompts = worker.model(), worker.prompts()
        kwargs = dict(max_new_tokens=worker.MAX_NEW_TOKENS, max_length=worker.MAX_LENGTH)
        plain = generate(model, prompts, **kwargs).tokens
        return plain, generate(model, prompts, speculative=worker.speculative(), **kwargs).tokens

    codes, output, (plain, eagle) = run_workers(
        "multiprocess_worker.py",
        lambda i: [str(tmp_path / f"worker{i}.json")],
        tmp_path,
        num_processes=NUM_PROCESSES,
        timeout_s=TIMEOUT_S,
        meanwhile=reference,
    )
    assert codes == [0] * NUM_PROCESSES, output
    assert eagle == plain
    for i in range(NUM_PROCESSES):
        got = json.loads((tmp_path / f"worker{i}.json").read_text())
        assert (got["process_index"], got["process_count"]) == (i, NUM_PROCESSES), output
        assert (got["local_devices"], got["global_devices"]) == (4, 8), output
        assert got["plain"] == plain, output
        assert got["eagle"] == eagle, output
