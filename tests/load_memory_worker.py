"""One process of `tests/test_load_large.py` and `benchmarks/bench_load.py`: loads a checkpoint once and
reports the time, the host memory and the bytes read as JSON; with `--check`, then compares the result
with the model loaded onto one device (every device's shard, bit for bit, and the logits).

    python tests/load_memory_worker.py CHECKPOINT OUT.json [--mesh SPEC [--then-shard]] [--load-kwargs JSON]
        [--warmup TINY_CHECKPOINT] [--check [--logits]]

Loads: without `--mesh`, `load_hf_checkpoint(CHECKPOINT)` onto one device; with `--mesh SPEC`, shard-streamed
(`load_hf_checkpoint(CHECKPOINT, mesh=make_mesh(SPEC))`); with `--then-shard` too, onto one device and then
`sharding.shard_model(model, mesh)` (what users did before shard-streamed loading). `--load-kwargs` adds
keyword arguments of `load_hf_checkpoint` (a JSON object, e.g. '{"dtype": "float32"}'). The environment
sets the devices (`JAX_PLATFORMS=cpu`, `XLA_FLAGS=--xla_force_host_platform_device_count=8`): on the CPU
the devices' buffers are this process's memory, so its resident memory counts the loaded model.

Memory (bytes, from /proc/self/status): `rss_before` (jax initialised, the mesh made, and with `--warmup`
a tiny checkpoint loaded the same way and dropped, so that the JAX runtime's first-use memory is not
counted; nothing loaded), `rss_peak` (the larger of VmHWM, the high-water mark reset just before the load
through /proc/self/clear_refs, and a thread sampling VmRSS every `SAMPLE_S`), `rss_after` (the model
loaded and ready, host copies dropped) and `rss_after_trim` (then glibc's `malloc_trim(0)`, which hands
the allocator's free pages back: what the process still uses; `rss_before` is measured after one too);
`loaded_bytes` is what the loaded arrays occupy: the sum over distinct device buffers
(`unsafe_buffer_pointer`) of their bytes, every replica counted, as the CPU holds each (`shard_bytes`: the
same sum over every device's shard, buffers shared or not, more where `device_put` let several CPU devices
alias one host buffer; `param_bytes`: each parameter once; `device_bytes_max`: the most one device holds;
`device_peak_bytes`: the largest `peak_bytes_in_use` a device reports, None on the CPU). `bytes_read` /
`reads` count `tensor_reads.read_into`, the one function that reads tensor data.

`--check` then loads the one-device model and adds `shard_mismatches` (parameter paths and devices whose
shard differs from the same slice of it, compared bit for bit) and `shards_compared`; `--logits` also
writes both models' logits of `TOKENS` (`forward_full`, the sharded model jitted under
`jax.set_mesh(mesh)`) to OUT.json's `.npz` (keys `sharded`, `one_device`, [B, T, V] float32).
"""

import argparse
import ctypes
import gc
import json
import os
import threading
import time

SAMPLE_S = 0.002
TOKENS = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]]  # [B=2, T=8]


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def trim() -> None:
    """`malloc_trim(0)`: glibc returns its free heap pages to the system (nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak() -> bool:
    """Resets VmHWM to the current resident memory (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Sampler(threading.Thread):
    """Samples VmRSS every `SAMPLE_S` seconds until `stop()`; `peak` is the largest sample (bytes)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.samples, self._done = 0, 0, threading.Event()

    def run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, status_bytes("VmRSS"))
            self.samples += 1
            time.sleep(SAMPLE_S)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


def loaded_bytes(model) -> tuple[int, int, int]:
    """(bytes of the distinct device buffers behind `model`'s arrays, how many buffers, bytes of every
    device's shard counted whether or not buffers are shared)."""
    import jax

    buffers, shards = {}, 0
    for leaf in jax.tree.leaves(model):
        for shard in getattr(leaf, "addressable_shards", ()):
            buffers[shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
            shards += shard.data.nbytes
    return sum(buffers.values()), len(buffers), shards


def device_bytes(model) -> tuple[int, int | None]:
    """(the most bytes of `model`'s shards on one device, the largest `peak_bytes_in_use` the process's devices
    report: None on the CPU, which reports none)."""
    import jax

    per_device: dict = {}
    for leaf in jax.tree.leaves(model):
        for shard in getattr(leaf, "addressable_shards", ()):
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    stats = [d.memory_stats() for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return max(per_device.values(), default=0), max(peaks) if peaks else None


def compare_shards(model, reference) -> tuple[list[str], int]:
    """(paths and devices whose shard of `model` differs from `reference`'s slice, bit for bit; shards compared)."""
    import numpy as np
    from flax import nnx

    want = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
    mismatches, compared = [], 0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        whole = np.asarray(want[path].get_value())
        for shard in variable.get_value().addressable_shards:
            got, expected = np.asarray(shard.data), np.ascontiguousarray(whole[shard.index])
            if got.dtype != expected.dtype or not np.array_equal(got.view(np.uint8), expected.view(np.uint8)):
                mismatches.append(f"{'.'.join(map(str, path))} on {shard.device}")
            compared += 1
    return mismatches, compared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--mesh", default=None, help="a mesh spec, e.g. tensor=8 (default: one device)")
    parser.add_argument("--then-shard", action="store_true", help="load onto one device, then shard_model")
    parser.add_argument("--load-kwargs", default="{}", help="more load_hf_checkpoint arguments, a JSON object")
    parser.add_argument("--warmup", default=None, help="a tiny checkpoint to load the same way first")
    parser.add_argument("--check", action="store_true", help="compare with the one-device model afterwards")
    parser.add_argument("--logits", action="store_true", help="with --check: both models' logits too")
    args = parser.parse_args()
    load_kwargs = json.loads(args.load_kwargs)

    import jax
    import numpy as np
    from flax import nnx

    from mtp_jax.checkpoints import load_hf_checkpoint, tensor_reads
    from mtp_jax.sharding import make_mesh, on_mesh, shard_model

    mesh = make_mesh(args.mesh) if args.mesh else None

    def load(path):
        if mesh is not None and not args.then_shard:
            model = load_hf_checkpoint(path, mesh=mesh, **load_kwargs)
        else:
            model = load_hf_checkpoint(path, **load_kwargs)
            if mesh is not None:
                model = shard_model(model, mesh)
        jax.block_until_ready(nnx.state(model))
        return model

    if args.warmup:
        load(args.warmup)  # dropped at once
    reads = []
    original = tensor_reads.read_into
    tensor_reads.read_into = lambda fd, buffer, offset: (reads.append(len(buffer)), original(fd, buffer, offset))

    gc.collect()
    trim()
    rss_before = status_bytes("VmRSS")
    hwm_reset = reset_peak()
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    model = load(args.checkpoint)
    seconds = time.perf_counter() - start
    sampled_peak = sampler.stop()
    hwm = status_bytes("VmHWM")
    tensor_reads.read_into = original
    gc.collect()
    rss_after = status_bytes("VmRSS")
    trim()
    rss_after_trim = status_bytes("VmRSS")
    buffer_bytes, buffers, shard_bytes = loaded_bytes(model)
    device_max, device_peak = device_bytes(model)
    state = nnx.state(model, nnx.Param)
    result = dict(
        checkpoint=args.checkpoint,
        mesh=args.mesh,
        method=("load then shard" if args.then_shard else "shard-streamed") if mesh is not None else "one device",
        load_kwargs=load_kwargs,
        devices=jax.device_count(),
        seconds=seconds,
        rss_before=rss_before,
        rss_after=rss_after,
        rss_after_trim=rss_after_trim,
        rss_peak=max(hwm, sampled_peak) if hwm_reset else sampled_peak,
        vm_hwm=hwm if hwm_reset else None,
        sampled_peak=sampled_peak,
        samples=sampler.samples,
        loaded_bytes=buffer_bytes,
        buffers=buffers,
        shard_bytes=shard_bytes,
        device_bytes_max=device_max,
        device_peak_bytes=device_peak,
        params=len(jax.tree.leaves(state)),
        param_bytes=sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(state)),
        bytes_read=sum(reads),
        reads=len(reads),
    )
    if args.check:
        begin = time.perf_counter()
        reference = load_hf_checkpoint(args.checkpoint, **load_kwargs)
        result["shard_mismatches"], result["shards_compared"] = compare_shards(model, reference)
        result["check_seconds"] = time.perf_counter() - begin
    if args.check and args.logits:
        begin = time.perf_counter()
        tokens = np.asarray(TOKENS, np.int32)
        with on_mesh(mesh):
            sharded = np.asarray(jax.jit(lambda m, t: m.forward_full(t)[0])(model, tokens), np.float32)
        one = np.asarray(jax.jit(lambda m, t: m.forward_full(t)[0])(reference, tokens), np.float32)
        np.savez(os.path.splitext(args.out)[0] + ".npz", sharded=sharded, one_device=one)
        result["logits_seconds"] = time.perf_counter() - begin
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
