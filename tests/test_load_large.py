"""Shard-streamed loading (`load_hf_checkpoint(..., mesh=)`) of checkpoints of realistic size: host memory
stays at the loaded model plus little more, every device's shard is right, and the logits agree.

The checkpoints are random DeepSeek-V3-layout ones (`synthetic_checkpoint`: MLA, MoE with routed and
shared experts, one MTP layer with its `embed_tokens` / `shared_head.head` copies, bfloat16, several
safetensors files), written once per module: `LARGE` (1.61 GB of tensor data, 6 files, hidden 2048,
32 experts; the `slow` tests) and `SMALL` (0.22 GB, 5 files; the default run). Each case is a fresh
process (`load_memory_worker.py`) with 8 fake CPU devices, on `tensor=8` and on `data=2,expert=4`.

On the CPU the devices' buffers are the process's own memory, so its resident memory holds the loaded
model: every device's shard, replicas included (`tensor=8` replicates the routed experts 8 times: the
1.35 GB of LARGE's parameters occupy 7.9 GB). Before measuring, each process loads a 4 MB checkpoint of
the same layout (`TINY`) the same way, so the JAX runtime's first-use memory is not counted. Asserted:

  (a) memory: the peak resident memory (VmHWM, reset just before the load, and a 2 ms VmRSS sampler)
      exceeds the final one by less than a quarter of the checkpoint's bytes (measured: LARGE 0.24 GB on
      `tensor=8`, its largest replicated shard, 0.2 GB, was the last parameter; 0 elsewhere), and exceeds
      the memory before plus what the loaded arrays occupy (distinct device buffers) by less than that
      plus `ALLOCATOR_SLACK` (measured 0.06-0.08 GB for SMALL, 0.08-0.28 GB for LARGE); after
      `malloc_trim` the growth is the arrays' bytes to within 2 % + 32 MB (measured +2-8 MB; +16-21 MB at
      24cd60b, whose loader compiled XLA programs for its column maps; the untrimmed growth keeps 50-75
      MB more: free heap glibc holds on to). The bytes read (`tensor_reads.read_into`) are each parameter's once, plus
      the MTP copies and their sources once more (`shards.check_copies` compares them by row blocks).
  (b) every device's shard equals, bit for bit, the same slice of the model loaded onto one device.
  (c) the logits of the sharded model (jitted under `jax.set_mesh(mesh)`) equal the one-device model's
      to within bfloat16's rounding: 2 % of the largest logit (measured: 0.6 %).

Timings on a 2-core machine (shared, so +-30 %): writing LARGE 3-5 s, SMALL 1 s; a SMALL case ~11 s; a
LARGE case 45-90 s (load 9-17 s, reference load and comparison 8-15 s, two compilations and forwards
12-55 s; `tensor=8` is the slower).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from synthetic_checkpoint import LARGE, SMALL, TINY, checkpoint_bytes, write_checkpoint

HERE = pathlib.Path(__file__).parent
MESHES = ("tensor=8", "data=2,expert=4")
DEVICES = 8
TIMEOUT_S = 600
ALLOCATOR_SLACK = 64_000_000  # free heap glibc keeps after a load (measured 55-75 MB; `malloc_trim` returns it)
LOGITS_ATOL = 0.02  # of the largest one-device logit


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(TINY, path)
    return path


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("small")
    write_checkpoint(SMALL, path, max_shard_size_bytes=64_000_000)
    return path


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("large")
    write_checkpoint(LARGE, path, max_shard_size_bytes=300_000_000)
    return path


def load_in_subprocess(
    checkpoint: pathlib.Path, warmup: pathlib.Path, mesh: str, out: pathlib.Path
) -> tuple[dict, dict]:
    """Runs `load_memory_worker.py --check --logits` on `DEVICES` fake CPU devices, after loading the
    `warmup` checkpoint once; returns (its JSON, its logits {"sharded", "one_device"}: [B, T, V] float32)."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip(),
    )
    command = [sys.executable, str(HERE / "load_memory_worker.py"), str(checkpoint), str(out), "--mesh", mesh]
    command += ["--warmup", str(warmup), "--check", "--logits"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    logits = np.load(out.with_suffix(".npz"))
    return json.loads(out.read_text()), {name: logits[name] for name in logits.files}


def assert_streamed(config, result: dict, logits: dict) -> None:
    size = checkpoint_bytes(config)
    copies = checkpoint_bytes(config, copies_only=True)
    shown = {k: v for k, v in result.items() if k != "shard_mismatches"}
    print(json.dumps(shown))  # the measurements, for -s / -rP

    # the bytes read: each parameter's once (stored dtype == loaded dtype), each copy and its source once more
    assert result["param_bytes"] == size - copies, shown
    assert result["bytes_read"] == result["param_bytes"] + 2 * copies, shown

    # (a) host memory: the peak is the loaded arrays plus a little, and what stays is the arrays
    peak, before, after = result["rss_peak"], result["rss_before"], result["rss_after"]
    loaded = result["loaded_bytes"]
    assert peak - after < size / 4, f"peak {peak / 1e9:.3f} GB, final {after / 1e9:.3f} GB: {shown}"
    assert peak - (before + loaded) < size / 4 + ALLOCATOR_SLACK, (
        f"peak {peak / 1e9:.3f} GB: {(peak - before - loaded) / 1e9:.3f} GB over the start and the arrays: {shown}"
    )
    growth = result["rss_after_trim"] - before
    assert abs(growth - loaded) < 0.02 * loaded + 32_000_000, (
        f"resident memory grew {growth / 1e9:.3f} GB for arrays of {loaded / 1e9:.3f} GB: {shown}"
    )
    assert loaded <= result["shard_bytes"]  # less where device_put aliased one host buffer for several CPU devices

    # (b) every device's shard is the one-device model's slice, bit for bit
    assert result["shard_mismatches"] == [], result["shard_mismatches"][:20]
    assert result["shards_compared"] == DEVICES * result["params"]

    # (c) logits
    sharded, one = logits["sharded"], logits["one_device"]
    assert sharded.shape == one.shape == (2, 8, config.vocab_size)
    np.testing.assert_allclose(sharded, one, rtol=0, atol=LOGITS_ATOL * np.abs(one).max())


@pytest.mark.parametrize("mesh", MESHES)
def test_small_checkpoint_streams_onto_the_mesh(small_checkpoint, tiny_checkpoint, mesh, tmp_path):
    assert_streamed(SMALL, *load_in_subprocess(small_checkpoint, tiny_checkpoint, mesh, tmp_path / "result.json"))


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_large_checkpoint_streams_onto_the_mesh(large_checkpoint, tiny_checkpoint, mesh, tmp_path):
    assert checkpoint_bytes(LARGE) >= 1.5e9
    assert len(list(large_checkpoint.glob("*.safetensors"))) > 1
    assert_streamed(LARGE, *load_in_subprocess(large_checkpoint, tiny_checkpoint, mesh, tmp_path / "result.json"))
