"""Checkpoint loading: time and peak host memory of "load then shard" against shard-streamed loading.

Methods, each timed in a fresh process (`tests/load_memory_worker.py`) with 1 or N fake CPU devices:

- `one device`: `load_hf_checkpoint(path)`, no mesh (1 device only): the reference;
- `load then shard`: `load_hf_checkpoint(path)` onto one device, then `sharding.shard_model(model, mesh)`:
  what users did before shard-streamed loading (the whole model on one device first);
- `shard-streamed`: `load_hf_checkpoint(path, mesh=mesh)`: every parameter built on its sharding, each
  device's shard read from the files by byte ranges (replicas share one read).

The mesh is `tensor=1` on one device and `--mesh` (default `tensor=N`) on N. Each process first loads a
4 MB checkpoint of the same layout the same way (the JAX runtime's first-use memory and compilations are
not counted), then the measured one: seconds from the call to every array ready; peak resident memory
(VmHWM reset just before the load, and a 2 ms VmRSS sampler) and final resident memory, both over the
process's memory before the load; the bytes the loaded arrays occupy (distinct device buffers) and the
bytes read from the files (`tensor_reads.read_into`). On a CPU the devices' memory is the process's, so
the final memory is the loaded model itself (N replicas of a replicated parameter take N times its bytes),
and peak - final is what loading costs beyond it. The files are in the page cache (just written): the
times are not disk reads. There, "load then shard" costs about the same host memory as shard-streamed (the
first device's buffers are host memory too, and its shards of replicated parameters are the one-device
arrays themselves); what it costs is on the first device, which holds the whole model before `shard_model`
(the last column: reported by the device where it can, GPUs, else from the shardings).

The checkpoint is a random DeepSeek-V3-layout one (`tests/synthetic_checkpoint.py`: MLA, MoE with 32 routed
experts and a shared one, one MTP layer with its copies of the shared tensors; `--size large` 1.61 GB in 6
files, `small` 0.22 GB in 5), written once per variant into a temporary directory (or `--checkpoint PATH`).

Variants (`--variants`, `VARIANTS`): how the checkpoint is stored and loaded. `bf16` (bfloat16 storage,
loaded as stored) is the one so far; FP8 cases (DeepSeek-V3's F8_E4M3 weights with block scales, kept FP8
at load, and dequantized to bfloat16 at load) go in as `Variant`s: a config for the writer and the keyword
arguments of `load_hf_checkpoint`.

    python benchmarks/bench_load.py [--size large|small] [--devices 1 8] [--variants bf16] [--repeats 1]

Writes `load_<device>_<date>[_<size>].json` and `.md` under --out and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from datetime import date
from pathlib import Path

import numpy as np
from report import write_report  # this directory is on sys.path when run as a script

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import synthetic_checkpoint  # noqa: E402  (tests/, on sys.path above)

from mtp_jax.config import ModelConfig  # noqa: E402
from mtp_jax.quantization import Fp8Config  # noqa: E402

WORKER = TESTS / "load_memory_worker.py"
METHODS = ("one device", "load then shard", "shard-streamed")
SIZES = {"large": synthetic_checkpoint.LARGE, "small": synthetic_checkpoint.SMALL}
FILE_BYTES = {"large": 300_000_000, "small": 64_000_000}  # at most, per safetensors file
FAKE_DEVICES_NOTE = (
    "CPU devices faked by --xla_force_host_platform_device_count: every device's buffers are this "
    "process's memory, so the final resident memory holds every replica; files in the page cache"
)


@dataclasses.dataclass(frozen=True)
class Variant:
    """How one case's checkpoint is stored and loaded.

    config: the checkpoint's `ModelConfig` from the size's (bfloat16) one, e.g. with FP8 quantization.
    load_kwargs: more keyword arguments of `load_hf_checkpoint` (JSON-serialisable), e.g. a dtype to
      dequantize to.
    write: writes the checkpoint of a config into a directory, files of at most `max_shard_size_bytes`
      (`synthetic_checkpoint.write_checkpoint`'s signature); returns its bytes of tensor data.
    """

    description: str
    config: Callable[[ModelConfig], ModelConfig] = lambda config: config
    load_kwargs: dict = dataclasses.field(default_factory=dict)
    write: Callable[..., int] = synthetic_checkpoint.write_checkpoint


def _fp8(config: ModelConfig) -> ModelConfig:
    return config.replace(quantization=Fp8Config(weight_block_size=(128, 128)))


VARIANTS = {
    "bf16": Variant("bfloat16 storage, loaded as bfloat16"),
    "fp8": Variant("F8_E4M3 weights + float32 128 x 128 block scales, kept FP8", config=_fp8),
    "fp8-dequant": Variant(
        "F8_E4M3 weights + block scales, dequantized to bfloat16 at load", config=_fp8, load_kwargs={"dequantize": True}
    ),
}


def run_case(checkpoint: Path, warmup: Path, devices: int, mesh: str | None, method: str, variant: Variant) -> dict:
    """One load in a fresh process on `devices` fake CPU devices; the worker's JSON."""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip(),
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(WORKER), str(checkpoint), str(out), "--warmup", str(warmup)]
        command += ["--load-kwargs", json.dumps(variant.load_kwargs)]
        if method != "one device":
            command += ["--mesh", mesh]
        if method == "load then shard":
            command.append("--then-shard")
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{method} on {devices} devices failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def cases(devices: list[int], mesh: str | None) -> list[tuple[int, str, str]]:
    """(devices, mesh spec, method) for each measured case."""
    out = []
    for n in devices:
        spec = "tensor=1" if n == 1 else (mesh or f"tensor={n}")
        out += [(n, spec, method) for method in METHODS if method != "one device" or n == 1]
    return out


DECODE_ARGS = dict(batch=1, prompt=16, new_tokens=32, repeats=3)


def decode_speed(checkpoint: Path, variant: Variant) -> dict:
    """Plain greedy decode tokens/s of the checkpoint loaded onto one device (in a fresh process with one CPU
    device), `DECODE_ARGS`: batch 1, a 16-token prompt, 32 new tokens; the median of 3 timed runs after a
    warm-up (compile) run."""
    code = f"""
import json, statistics, sys
from mtp_jax.checkpoints import load_hf_checkpoint
from mtp_jax.decode.generation import generate
model = load_hf_checkpoint({str(checkpoint)!r}, **{variant.load_kwargs!r})
a = {DECODE_ARGS!r}
prompts = [[(7 * i + 3) % model.config.vocab_size for i in range(a["prompt"])]] * a["batch"]
kw = dict(max_new_tokens=a["new_tokens"], max_length=a["prompt"] + a["new_tokens"], stop_tokens=[])
generate(model, prompts, **kw)
rates = [r.num_generated / r.seconds for r in (generate(model, prompts, **kw) for _ in range(a["repeats"]))]
print(json.dumps(dict(tokens_per_second=statistics.median(rates), weight_dtypes=sorted({{str(x.dtype) for x in
    __import__("jax").tree.leaves(__import__("flax").nnx.state(model))}}))))
"""
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(meta: dict, rows: list[dict]) -> str:
    gb = 1e9
    stored = ", ".join(
        f"{name} {c['file_bytes'] / gb:.2f} GB in {c['files']} files" for name, c in meta["checkpoints"].items()
    )
    lines = [
        f"Checkpoint loading, {meta['size']} synthetic DeepSeek-V3-layout checkpoint ({stored}), {meta['processor']} "
        f"({meta['cpu_count']} cores, {meta['memory_gb']:.0f} GB), {meta['date']}, jax {meta['jax']}; "
        f"median of {meta['repeats']} fresh process(es) per case. Memory over the process's before the load; "
        "on the CPU the devices' buffers are host memory, so `final` is the loaded model (every replica).",
        "",
        "| variant | devices | mesh | method | load s | peak GB | final GB | peak - final GB | arrays GB | read GB "
        "| one device's most GB |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['devices']} | {r['mesh'] if r['method'] != 'one device' else '-'} | "
            f"{r['method']} | {r['seconds']:.1f} | {r['peak_over_start'] / gb:.2f} | "
            f"{r['final_over_start'] / gb:.2f} | {r['peak_over_final'] / gb:.2f} | {r['loaded_bytes'] / gb:.2f} | "
            f"{r['bytes_read'] / gb:.2f} | {r['device_most_bytes'] / gb:.2f} |"
        )
    if meta.get("decode"):
        base = meta["decode"].get("bf16", {}).get("tokens_per_second")
        lines += [
            "",
            f"Decode on one CPU device ({meta['decode_args']['batch']} row, {meta['decode_args']['new_tokens']} new "
            "tokens, plain greedy, bfloat16 compute; the `small` checkpoint's model):",
            "",
            "| variant | tokens/s | vs bf16 |",
            "|---|---:|---:|",
        ]
        for name, d in meta["decode"].items():
            ratio = f"{d['tokens_per_second'] / base:.2f}x" if base else "-"
            lines.append(f"| {name} | {d['tokens_per_second']:.1f} | {ratio} |")
    lines += [
        "",
        "`one device's most`: the most one device held, as the device reports its peak (GPUs), else from the "
        "shardings: the whole model for `one device` and `load then shard` (it sits on the first device before "
        "`shard_model`), the largest device's shards for `shard-streamed`.",
        "",
        f"NOTE: {FAKE_DEVICES_NOTE}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="large", help="the synthetic checkpoint's size")
    parser.add_argument("--checkpoint", default=None, help="load this checkpoint instead (variants: bf16 only)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 8], help="fake CPU device counts")
    parser.add_argument("--mesh", default=None, help="the mesh on more than one device (default tensor=N)")
    parser.add_argument("--variants", nargs="+", default=["bf16"], choices=sorted(VARIANTS))
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per case (median)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--decode", action="store_true", help="also decode tokens/s per variant on one device (the small checkpoint)"
    )
    args = parser.parse_args()
    decode = {}

    rows, checkpoints = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_load_") as tmp:
        warmup = Path(tmp) / "warmup"
        synthetic_checkpoint.write_checkpoint(synthetic_checkpoint.TINY, warmup)
        for name in args.variants:
            variant = VARIANTS[name]
            if args.checkpoint:
                checkpoint = Path(args.checkpoint)
            else:
                checkpoint = Path(tmp) / name
                variant.write(variant.config(SIZES[args.size]), checkpoint, max_shard_size_bytes=FILE_BYTES[args.size])
            if args.decode:
                small = Path(tmp) / f"{name}-small"
                variant.write(variant.config(SIZES["small"]), small, max_shard_size_bytes=FILE_BYTES["small"])
                decode[name] = decode_speed(small, variant)
                print(f"{name}: decode {decode[name]['tokens_per_second']:.1f} tokens/s", flush=True)
            files = sorted(checkpoint.glob("*.safetensors"))
            checkpoints[name] = dict(file_bytes=sum(f.stat().st_size for f in files), files=len(files))
            for devices, mesh, method in cases(args.devices, args.mesh):
                runs = [run_case(checkpoint, warmup, devices, mesh, method, variant) for _ in range(args.repeats)]
                r = sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]
                row = dict(
                    variant=name,
                    devices=devices,
                    mesh=mesh,
                    method=method,
                    seconds=r["seconds"],
                    seconds_all=[run["seconds"] for run in runs],
                    peak_over_start=r["rss_peak"] - r["rss_before"],
                    final_over_start=r["rss_after"] - r["rss_before"],
                    final_over_start_trimmed=r["rss_after_trim"] - r["rss_before"],
                    peak_over_final=r["rss_peak"] - r["rss_after"],
                    loaded_bytes=r["loaded_bytes"],
                    param_bytes=r["param_bytes"],
                    bytes_read=r["bytes_read"],
                    reads=r["reads"],
                    # what one device held at most: measured where devices report it, else from the shardings
                    # (load then shard: the whole model sat on the first device; shard-streamed: its shards only)
                    device_peak_bytes=r["device_peak_bytes"],
                    device_most_bytes=r["device_peak_bytes"]
                    or (r["param_bytes"] if method != "shard-streamed" else r["device_bytes_max"]),
                    rss_before=r["rss_before"],
                )
                rows.append(row)
                print(
                    f"{name} {devices} device(s) {mesh} {method}: {row['seconds']:.1f} s, peak "
                    f"+{row['peak_over_start'] / 1e9:.2f} GB, final +{row['final_over_start'] / 1e9:.2f} GB",
                    flush=True,
                )

    import jax

    meta = dict(
        benchmark="load",
        date=str(date.today()),
        size=args.checkpoint or args.size,
        checkpoints=checkpoints,
        config=None if args.checkpoint else dataclasses.asdict(SIZES[args.size]),
        variants={name: VARIANTS[name].description for name in args.variants},
        repeats=args.repeats,
        decode=decode,
        decode_args=DECODE_ARGS,
        device="cpu",
        fake_devices=True,
        note=FAKE_DEVICES_NOTE,
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        memory_gb=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9,
        load_average=os.getloadavg(),
        jax=jax.__version__,
        numpy=np.__version__,
        timing="load_hf_checkpoint call to every array ready (jax.block_until_ready), after a warm-up load of "
        "a 4 MB checkpoint of the same layout; files in the page cache",
        memory="resident memory (VmRSS / VmHWM) over the process's just before the load",
    )
    suffix = "" if args.checkpoint or args.size == "large" else f"_{args.size}"
    write_report(args.out, f"load_cpu_{meta['date']}{suffix}", meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
