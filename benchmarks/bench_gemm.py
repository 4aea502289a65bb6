"""The matmuls of a decode step on this CPU: [M, K] x [K, N] at M = 1..64 rows, float32 and bfloat16.

Why batch-8 decoding and a (K+1)-token verify forward cost more than one token on XLA:CPU: the
decoder's matmuls are weight-bound at one row (XLA emits a matrix-vector product that streams the
weight once), but from two rows on XLA:CPU calls a GEMM (YNNPACK by default in jax 0.10) whose time
at 2-16 rows is about 2-2.5x the one-row time on float32, far from both the memory bound (the weight
read once) and the compute bound. Rows are timed for:

- `float32`: `x @ w`, the float32 path (weight [in, out], the models' layout);
- `bfloat16`: `mtp_jax.layers.linear.dot_general` on bfloat16 operands (float32 accumulation,
  one row padded to two on CPU), the models' half-precision path;
- `bfloat16 plain`: `x @ w` on bfloat16 operands, what XLA:CPU computes without that (it converts
  the weight to float32 in memory before every call);
- `torch float32` (optional, `--torch`): `torch.nn.functional.linear` on the same shapes, the
  weight [out, in] as torch stores it, for reference.

Shapes default to the medium preset's projections (hidden 1024: qkv 1024x1536, gate_up 1024x5632,
down 2816x1024, head 1024x32000) and a 2048x8192 one. Each time is the median of calls over
--seconds per cell; "GB/s" is the weight's bytes over the time at one row. XLA flags (XLA_FLAGS,
e.g. `--xla_cpu_experimental_ynn_fusion_type=` for XLA's own Eigen path) apply as usual. Writes
`gemm_<device>_<date>.json` and `.md` under --out.

    python benchmarks/bench_gemm.py [--rows 1 2 4 8 16 32 64] [--torch] [--seconds 0.4]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date

import jax
import jax.numpy as jnp
import numpy as np
from report import write_report  # this directory is on sys.path when run as a script

from mtp_jax.layers.linear import dot_general

SHAPES = ((1024, 1536), (1024, 5632), (2816, 1024), (1024, 32000), (2048, 8192))
MATMUL = (((1,), (0,)), ((), ()))


def _median_ms(call, seconds: float) -> float:
    call()  # compile / warm
    times, begin = [], time.perf_counter()
    while time.perf_counter() - begin < seconds or len(times) < 3:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def jax_paths() -> dict:
    return {
        "float32": (jnp.float32, jax.jit(lambda x, w: x @ w)),
        "bfloat16": (jnp.bfloat16, jax.jit(lambda x, w: dot_general(x, w, MATMUL))),
        "bfloat16 plain": (jnp.bfloat16, jax.jit(lambda x, w: x @ w)),
    }


def measure(shapes, rows, seconds: float, with_torch: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for fan_in, fan_out in shapes:
        weight = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        for path, (dtype, fn) in jax_paths().items():
            w = jnp.asarray(weight, dtype)
            times = {}
            for m in rows:
                x = jnp.asarray(rng.standard_normal((m, fan_in), dtype=np.float32), dtype)
                times[m] = _median_ms(lambda fn=fn, x=x, w=w: fn(x, w).block_until_ready(), seconds)
            out.append(dict(shape=[fan_in, fan_out], path=path, ms=times, gb_s_one_row=w.nbytes / times[rows[0]] / 1e6))
            print(f"{fan_in}x{fan_out} {path:15s} " + " ".join(f"{m}:{t:.2f}" for m, t in times.items()), flush=True)
        if with_torch:
            import torch

            w = torch.from_numpy(np.ascontiguousarray(weight.T))  # [out, in]
            times = {}
            for m in rows:
                x = torch.from_numpy(rng.standard_normal((m, fan_in), dtype=np.float32))
                times[m] = _median_ms(lambda x=x, w=w: torch.nn.functional.linear(x, w), seconds)
            out.append(
                dict(
                    shape=[fan_in, fan_out],
                    path=f"torch float32 ({torch.get_num_threads()} threads)",
                    ms=times,
                    gb_s_one_row=weight.nbytes / times[rows[0]] / 1e6,
                )
            )
            print(
                f"{fan_in}x{fan_out} torch float32   " + " ".join(f"{m}:{t:.2f}" for m, t in times.items()), flush=True
            )
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    ms = rows[0]["ms"]
    lines = [
        f"Matmul [M, in] x [in, out] on {meta['device']} ({meta['cores']} cores), {meta['date']}, "
        f"jax {meta['jax']}, XLA_FLAGS={meta['xla_flags'] or '(none)'}: ms per call (median) at M rows, "
        "and the weight's GB/s at one row.",
        "",
        "| in x out | path | " + " | ".join(f"M={m}" for m in ms) + " | GB/s at 1 row |",
        "|---|---|" + "---:|" * (len(ms) + 1),
    ]
    for row in rows:
        cells = " | ".join(f"{row['ms'][m]:.2f}" for m in ms)
        lines.append(f"| {row['shape'][0]}x{row['shape'][1]} | {row['path']} | {cells} | {row['gb_s_one_row']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--seconds", type=float, default=0.4, help="timing per cell")
    parser.add_argument("--torch", action="store_true", help="also time torch (the dev venv has it)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = measure(SHAPES, args.rows, args.seconds, args.torch)
    device = jax.devices()[0].device_kind
    meta = dict(
        date=str(date.today()),
        device=device,
        cores=os.cpu_count(),
        jax=jax.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
    )
    write_report(args.out, f"gemm_{device.replace(' ', '_')}_{date.today()}", meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
