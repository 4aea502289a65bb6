"""Shard-streamed loading under `jax.distributed`: two processes on localhost (4 fake CPU devices each)
load one checkpoint (`multiprocess_load_worker.write_checkpoint`: a tiny MLA + MoE model with an MTP
layer, in several safetensors files, with DeepSeek-V3's copies of the shared tensors) onto meshes over
the 8 global devices, `data=2,tensor=4` and `expert=2,tensor=4`. Each process reads exactly the bytes of
the distinct shards its own devices hold, plus its half of the copies' rows and of their sources' (the
copy check splits the rows between the processes); on `expert=2,tensor=4`, where every sharded axis
spans both processes, that is strictly less than the checkpoint. Both processes then decode (greedy on
each mesh, eagle K = 2 on `expert=2,tensor=4`) exactly the tokens of the model loaded onto one device
here. The processes are `tests/multiprocess_load_worker.py`.
"""

import json
import pathlib
import re
import shutil

import multiprocess_load_worker as worker  # tests/ is on sys.path (pytest's rootdir-relative import)
from distributed_workers import run_workers
from safetensors.numpy import load_file, save_file

from mtp_jax.checkpoints import INDEX_FILE, load_hf_checkpoint
from mtp_jax.checkpoints.names import shared_copies
from mtp_jax.decode.generation import generate

HERE = pathlib.Path(__file__).parent
NUM_PROCESSES = 2
TIMEOUT_S = 300  # two processes compiling three decode loops on a 2-core machine take about 60 s


def _corrupt_last_row_of_a_copy(checkpoint: pathlib.Path, bad: pathlib.Path) -> str:
    """`checkpoint` copied to `bad` with the MTP layer's stored `embed_tokens` copy changed in its last row;
    returns the copy's name."""
    shutil.copytree(checkpoint, bad)
    weight_map = json.loads((bad / INDEX_FILE).read_text())["weight_map"]
    name = next(n for n in weight_map if re.fullmatch(r"model\.layers\.\d+\.embed_tokens\.weight", n))
    tensors = load_file(bad / weight_map[name])
    tensors[name] = tensors[name].copy()
    tensors[name][-1, 0] += 1.0
    save_file(tensors, bad / weight_map[name], metadata={"format": "pt"})
    return name


def test_two_processes_each_read_their_shards_and_decode_as_one_device(tmp_path):
    checkpoint = tmp_path / "checkpoint"
    worker.write_checkpoint(checkpoint)
    assert len(list(checkpoint.glob("*.safetensors"))) > 2
    copy = _corrupt_last_row_of_a_copy(checkpoint, tmp_path / "checkpoint-bad")
    assert set(shared_copies(worker.config())) <= set(worker.stored_tensors(checkpoint))  # checked on load

    def reference():  # here (one device), while the workers run
        model = load_hf_checkpoint(checkpoint)
        kwargs = dict(max_new_tokens=worker.MAX_NEW_TOKENS, max_length=worker.MAX_LENGTH)
        plain = generate(model, worker.prompts(), **kwargs).tokens
        return plain, generate(model, worker.prompts(), speculative=worker.speculative(), **kwargs).tokens

    codes, output, (plain, eagle) = run_workers(
        "multiprocess_load_worker.py",
        lambda i: [str(checkpoint), str(tmp_path / f"worker{i}.json")],
        tmp_path,
        num_processes=NUM_PROCESSES,
        timeout_s=TIMEOUT_S,
        meanwhile=reference,
    )
    assert codes == [0] * NUM_PROCESSES, output
    assert eagle == plain
    results = [json.loads((tmp_path / f"worker{i}.json").read_text()) for i in range(NUM_PROCESSES)]
    print(json.dumps([{k: got[k] for k in ("checkpoint_bytes", "loads", "seconds")} for got in results]))  # -s
    for i, got in enumerate(results):
        assert (got["process_index"], got["process_count"]) == (i, NUM_PROCESSES), output
        assert (got["local_devices"], got["global_devices"]) == (4, 8), output
        for spec, load in got["loads"].items():
            assert load["sharded_params"] >= 10, (spec, load)  # the mesh splits the model
            assert load["bytes_read"] == load["expected_bytes"], (i, spec, load)
        # expert=2,tensor=4: the processes hold different experts and different tensor columns
        assert got["loads"]["expert=2,tensor=4"]["bytes_read"] < got["checkpoint_bytes"], got
        assert got["plain"] == plain, output
        assert got["plain_expert"] == plain, output
        assert got["eagle"] == eagle, output
    # The bad copy's last row is compared by the last process only; both refuse the checkpoint, naming it.
    assert copy in results[-1]["bad_error"] and "must be a copy of the shared" in results[-1]["bad_error"]
    assert results[0]["bad_error"] == f"process {NUM_PROCESSES - 1} refused the checkpoint: {results[-1]['bad_error']}"
    # data=2,tensor=4: each process holds every distinct shard (data replicates the weights), so each reads
    # the whole checkpoint: its parameters once, and half of every copy and half of its source
    for got in results:
        assert got["loads"]["data=2,tensor=4"]["bytes_read"] == got["checkpoint_bytes"], got
