"""The matmuls of a decode step on this CPU: [M, in] x [in, out] at M = 1..32 rows, float32 and bfloat16,
through every matmul path this machine offers, against the weight-streaming bound.

Why batch-8 decoding and a (K+1)-token verify forward cost more than one token on XLA:CPU: the
decoder's matmuls are weight-bound at one row (XLA emits a matrix-vector product that streams the
weight once), but from two rows on XLA:CPU calls a GEMM (YNNPACK by default in jax 0.10) whose time
at 2-16 rows is about 2-2.5x the one-row time on float32. Paths (columns of the report):

- `xla default`: `x @ w` (float32) or `mtp_jax.layers.linear.dot_general` (bfloat16 operands, float32
  accumulation, one row padded to two on CPU: the models' path), with XLA_FLAGS as given;
- `xla eigen`, `xla onednn`: the same under the XLA:CPU flags that select its other matmul back ends
  (`CONFIGS`; XLA_FLAGS are read once per process, so each runs in a subprocess of its own). The
  kernel XLA compiled (`dot`: its own emitter / Eigen; `ynn`, `onednn`: a library fusion) is
  recorded per cell. jax 0.10's XNNPACK flags (`--xla_cpu_use_xnnpack`,
  `--xla_cpu_experimental_xnn_fusion_type=dot`) leave a dot a `dot`, so they have no column;
- `mtp_jax onednn` (where the optional extension is installed and this CPU has a fast oneDNN
  matmul for the dtype): `mtp_jax.layers.onednn.PackedDot` over the packed weight, the custom call
  a `DecodeEngine` runs (kernel `ext`), every dtype, whatever the engine's routing;
- `torch linear`: `torch.nn.functional.linear` (weight [out, in]): MKL's sgemm in float32, oneDNN
  in bfloat16; `torch onednn packed`: oneDNN's matmul with the weight reordered once for that M
  (`torch.ops.mkldnn._linear_pointwise`, what a oneDNN custom call with a pre-packed weight would
  run); `torch mkl packed` (float32): MKL's packed sgemm (`torch.ops.mkl._mkl_linear`). torch runs
  with as many threads as XLA:CPU (the process's cores);
- `bound`: the weight's bytes over the copy bandwidth measured at the weight's own size (a jax or
  numpy copy, whichever is faster, counting the bytes read and written), i.e. the time to read the
  weight once at copy speed from wherever the loop keeps it; `dram bound`: the same at the
  bandwidth of a 512 MiB copy (what a model far larger than the caches sees). A read-only stream
  runs faster than a copy, so these are yardsticks, not floors: the best kernels beat them.

Shapes: the projections of the demo, small and medium presets (fused qkv, o, fused gate_up, down,
head). Each cell times calls for --seconds; --rounds repeats every path (interleaved: round 1 of every
path, then round 2, ...); the table shows the fastest call (the machine is shared with other jobs,
whose preemptions make medians of two-thread kernels swing by 10x), the JSON also the minimum over
rounds of each round's median (`median_ms`). By default one weight per shape is re-read each call
(hot: from the caches where it fits); --cold cycles through copies of it (128 MiB in all), as a
decode step over a model larger than the caches reads its weights. Writes
`gemm_<device>_<date>[_cold][_quick].json` and `.md` under --out, the CPU named (`report.cpu_name`)
with its AVX-512 / BF16 / AMX flags. The default run takes 5-12 minutes on 2 cores (depending on
load); --quick about one.

    python benchmarks/bench_gemm.py [--quick] [--cold] [--presets medium] [--rounds 2] [--seconds 0.02]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import re
import subprocess
import sys
import time
from datetime import date

import numpy as np
from report import cpu_name, write_report  # this directory is on sys.path when run as a script

# XLA:CPU configurations, each run in its own process (jax 0.10.2; flags found in jaxlib's strings).
CONFIGS = {
    "xla default": "",
    # No YNNPACK fusions: XLA's own dot emitter (Eigen for GEMMs).
    "xla eigen": "--xla_cpu_experimental_ynn_fusion_type=",
    # oneDNN fusions for dots (its matmul primitive), YNNPACK off so that oneDNN gets the dots.
    "xla onednn": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_use_onednn=true "
    "--xla_cpu_experimental_onednn_fusion_type=dot",
}
TORCH = "torch"
ONEDNN = "mtp_jax onednn"  # the optional extension (`extensions/onednn`), timed in the `xla default` process
PRESETS = ("demo", "small", "medium")
MATMUL = (((1,), (0,)), ((), ()))
DTYPES = ("float32", "bfloat16")
COLD_BYTES, COLD_COPIES = 128 << 20, 64  # --cold: cycle through copies of the weight, 4x the L3 of this CPU


def _copies(nbytes: int, cold: bool) -> int:
    return min(COLD_COPIES, math.ceil(COLD_BYTES / nbytes)) if cold else 1


def preset_shapes(presets=PRESETS) -> list[dict]:
    """[in, out] of each preset's decode matmuls: fused qkv, o, fused gate_up, down, head."""
    from mtp_jax.config import ModelConfig

    out, seen = [], set()
    for name in presets:
        c = ModelConfig.from_name(name)
        head_dim = c.resolved_head_dim
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        for label, shape in (
            ("qkv", (c.hidden_size, q + 2 * kv)),
            ("o", (q, c.hidden_size)),
            ("gate_up", (c.hidden_size, 2 * c.intermediate_size)),
            ("down", (c.intermediate_size, c.hidden_size)),
            ("head", (c.hidden_size, c.vocab_size)),
        ):
            if shape not in seen:
                seen.add(shape)
                out.append(dict(preset=name, matmul=label, shape=list(shape)))
    return out


def _time_ms(call, seconds: float, min_calls: int = 10) -> tuple[float, float]:
    """(fastest, median) ms of `call` over `seconds` (at least `min_calls` calls), after two warm calls."""
    call()  # compile / warm
    call()
    times, begin = [], time.perf_counter()
    while time.perf_counter() - begin < seconds or len(times) < min_calls:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.min(times)) * 1e3, float(np.median(times)) * 1e3


def _cell(ms: dict, median: dict, m: int, timing: tuple[float, float]) -> None:
    ms[m], median[m] = timing


def _kernel(hlo_text: str) -> str:
    """The matmul kernel in a compiled module: a library fusion's name, else `dot`."""
    for kind in ("onednn", "ynn", "xnn"):
        if re.search(rf"\b__?{kind}_fusion|%{kind}_fusion", hlo_text):
            return kind
    if "mtp_onednn_matmul" in hlo_text:
        return "ext"
    return "dot"


def worker_xla(shapes, rows, seconds: float, cold: bool, extension: bool = False) -> list[dict]:
    """XLA's dot under this process's XLA_FLAGS; with `extension`, also `mtp_jax onednn`: the optional
    extension's matmul over the packed weight (`mtp_jax.layers.onednn.PackedDot`, what the engine runs)."""
    import jax
    import jax.numpy as jnp

    from mtp_jax.layers import onednn
    from mtp_jax.layers.linear import dot_general

    fns = {
        "float32": jax.jit(lambda x, w: x @ w),
        "bfloat16": jax.jit(lambda x, w: dot_general(x, w, MATMUL)),
    }
    rng = np.random.default_rng(0)
    out = []
    for s in shapes:
        fan_in, fan_out = s["shape"]
        weight = rng.standard_normal((fan_in, fan_out), dtype=np.float32)
        packed_dot = jax.jit(functools.partial(onednn.PackedDot(fan_in, fan_out), dimension_numbers=MATMUL))
        for dtype in DTYPES:
            w = jnp.asarray(weight, dtype)
            ws = [w] + [w + 0 for _ in range(_copies(w.nbytes, cold) - 1)]
            paths = {"xla": (fns[dtype], ws)}
            if extension and dtype in onednn.fast_dtypes():
                paths[ONEDNN] = (packed_dot, [onednn.pack(v) for v in ws])
            for path, (fn, weights) in paths.items():
                ms, median, kernels = {}, {}, {}
                for m in rows:
                    x = jnp.asarray(rng.standard_normal((m, fan_in), dtype=np.float32), dtype)
                    compiled = fn.lower(x, weights[0]).compile()
                    kernels[m] = _kernel(compiled.as_text())
                    ring = itertools.cycle(weights)
                    call = lambda f=compiled, x=x, ring=ring: f(x, next(ring)).block_until_ready()  # noqa: E731
                    _cell(ms, median, m, _time_ms(call, seconds))
                row = dict(shape=s["shape"], dtype=dtype, ms=ms, median_ms=median, kernel=kernels)
                out.append(row if path == "xla" else dict(row, path=path))
    return out


def worker_torch(shapes, rows, seconds: float, cold: bool) -> list[dict]:
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    rng = np.random.default_rng(0)
    linear = torch.nn.functional.linear
    out = []
    with torch.inference_mode():
        for s in shapes:
            fan_in, fan_out = s["shape"]
            weight = torch.from_numpy(np.ascontiguousarray(rng.standard_normal((fan_in, fan_out), dtype=np.float32).T))
            for dtype in DTYPES:
                tdt = getattr(torch, dtype)
                w = weight.to(tdt).contiguous()  # [out, in]
                ws = [w] + [w.clone() for _ in range(_copies(w.nbytes, cold) - 1)]
                names = ["torch linear", "torch onednn packed"] + (["torch mkl packed"] if dtype == "float32" else [])
                paths = {name: ({}, {}) for name in names}
                for m in rows:
                    x = torch.from_numpy(rng.standard_normal((m, fan_in), dtype=np.float32)).to(tdt)
                    ring = itertools.cycle(ws)
                    _cell(*paths["torch linear"], m, _time_ms(lambda x=x, r=ring: linear(x, next(r)), seconds))
                    ring = itertools.cycle([torch.ops.mkldnn._reorder_linear_weight(v, m) for v in ws])
                    onednn = torch.ops.mkldnn._linear_pointwise
                    _cell(
                        *paths["torch onednn packed"],
                        m,
                        _time_ms(lambda x=x, r=ring, f=onednn: f(x, next(r), None, "none", [], ""), seconds),
                    )
                    if dtype == "float32":
                        ring = itertools.cycle([(torch.ops.mkl._mkl_reorder_linear_weight(v, m), v) for v in ws])
                        mkl = torch.ops.mkl._mkl_linear
                        _cell(
                            *paths["torch mkl packed"],
                            m,
                            _time_ms(lambda x=x, r=ring, m=m, f=mkl: f(x, *next(r), None, m), seconds),
                        )
                    del ring
                for path, (ms, median) in paths.items():
                    out.append(dict(shape=s["shape"], dtype=dtype, path=path, ms=ms, median_ms=median))
    return out


def copy_bandwidth(nbytes: int, seconds: float = 0.05) -> float:
    """GB/s (bytes read + written) of the faster of a numpy and a jax copy of `nbytes`."""
    import jax
    import jax.numpy as jnp

    n = max(nbytes // 4, 1024)
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    numpy_ms = _time_ms(lambda: np.copyto(dst, src), seconds)[0]
    x = jnp.ones(n, jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)  # an elementwise pass: XLA reads a and writes a new buffer
    jax_ms = _time_ms(lambda: copy(x).block_until_ready(), seconds)[0]
    return 2 * n * 4 / min(numpy_ms, jax_ms) / 1e6


def cpu_flags() -> dict:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = []
    keep = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
    return {k: k in flags for k in keep}


def run_worker(config: str, args) -> list[dict]:
    env = dict(os.environ)
    if config != TORCH:
        env["XLA_FLAGS"] = " ".join(x for x in (os.environ.get("XLA_FLAGS", ""), CONFIGS[config]) if x)
    cmd = [sys.executable, __file__, "--worker", config, "--seconds", str(args.seconds), "--rows", *map(str, args.rows)]
    cmd += ["--shapes", json.dumps(args.shape_list)] + (["--cold"] if args.cold else [])
    begin = time.perf_counter()
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        print(f"{config}: failed\n{result.stderr[-2000:]}", flush=True)
        return []
    print(f"  {config}: {time.perf_counter() - begin:.0f} s", flush=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(args) -> list[dict]:
    """Runs every path --rounds times, interleaved; keeps each cell's minimum."""
    best: dict[tuple, dict] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for config in [*CONFIGS, TORCH]:
            for row in run_worker(config, args):
                row.setdefault("path", config)
                key = (tuple(row["shape"]), row["dtype"], row["path"])
                ms = {int(m): t for m, t in row["ms"].items()}
                median = {int(m): t for m, t in row["median_ms"].items()}
                if key in best:
                    ms = {m: min(t, best[key]["ms"][m]) for m, t in ms.items()}
                    median = {m: min(t, best[key]["median_ms"][m]) for m, t in median.items()}
                kernel = {int(m): k for m, k in row.get("kernel", {}).items()}
                best[key] = dict(row, ms=ms, median_ms=median, kernel=kernel)
    return list(best.values())


def add_bounds(rows: list[dict], args) -> dict:
    sizes = {(int(np.prod(r["shape"])) * (4 if r["dtype"] == "float32" else 2)) for r in rows}
    bandwidth = {n: max(copy_bandwidth(n) for _ in range(args.rounds)) for n in sorted(sizes)}
    dram = max(copy_bandwidth(512 << 20, 0.5) for _ in range(args.rounds))
    for r in rows:
        n = int(np.prod(r["shape"])) * (4 if r["dtype"] == "float32" else 2)
        r["weight_bytes"], r["bound_ms"], r["dram_bound_ms"] = n, n / bandwidth[n] / 1e6, n / dram / 1e6
    return dict(copy_gb_s={str(n): b for n, b in bandwidth.items()}, dram_copy_gb_s=dram)


def _kernels(row: dict) -> str:
    if not row.get("kernel"):
        return ""
    runs, prev = [], None
    for m, k in row["kernel"].items():
        if k != prev:
            runs.append(f"{k}@{m}")
            prev = k
    return " ".join(runs)


def markdown(meta: dict, rows: list[dict], shapes: list[dict]) -> str:
    ms_keys = list(rows[0]["ms"])
    flags = ", ".join(k for k, v in meta["cpu_flags"].items() if v) or "none"
    lines = [
        f"Matmul [M, in] x [in, out] on {meta['cpu']} ({meta['cores']} cores; flags: {flags}; "
        f"no {', '.join(k for k, v in meta['cpu_flags'].items() if not v)}), {meta['date']}, "
        f"jax {meta['jax']}, torch {meta['torch']}, base XLA_FLAGS={meta['xla_flags'] or '(none)'}, "
        f"load average at start {meta['load_average']}: ms per call, the fastest call over {meta['rounds']} "
        f"interleaved rounds of {meta['seconds']} s each (the machine is shared; medians in the JSON). "
        "Copy bandwidth (read + write): "
        f"{meta['dram_copy_gb_s']:.1f} GB/s at 512 MiB. `kernel`: what XLA compiled, from the M it starts at. "
        + (
            "Cold: each call reads another copy of the weight (128 MiB of copies, at most 64)."
            if meta["cold"]
            else "Hot: one weight, re-read from the caches where it fits."
        ),
        "",
        "| preset matmul | in x out | dtype | path | kernel | "
        + " | ".join(f"M={m}" for m in ms_keys)
        + " | bound | dram bound |",
        "|---|---|---|---|---|" + "---:|" * (len(ms_keys) + 2),
    ]
    label = {tuple(s["shape"]): f"{s['preset']} {s['matmul']}" for s in shapes}
    order = [*CONFIGS, ONEDNN, "torch linear", "torch onednn packed", "torch mkl packed"]
    key = lambda r: ([list(label).index(tuple(r["shape"]))], DTYPES.index(r["dtype"]), order.index(r["path"]))  # noqa: E731
    for r in sorted(rows, key=key):
        cells = " | ".join(f"{r['ms'][m]:.3f}" for m in ms_keys)
        lines.append(
            f"| {label[tuple(r['shape'])]} | {r['shape'][0]}x{r['shape'][1]} | {r['dtype']} | {r['path']} | "
            f"{_kernels(r)} | {cells} | {r['bound_ms']:.3f} | {r['dram_bound_ms']:.3f} |"
        )
    lines += [
        "",
        "Fastest path per cell and its time relative to `xla default` (< 1: faster than XLA's default):",
        "",
        "| preset matmul | dtype | " + " | ".join(f"M={m}" for m in ms_keys) + " |",
        "|---|---|" + "---|" * len(ms_keys),
    ]
    for s in shapes:
        for dtype in DTYPES:
            group = [r for r in rows if tuple(r["shape"]) == tuple(s["shape"]) and r["dtype"] == dtype]
            base = next((r for r in group if r["path"] == "xla default"), None)
            if base is None:
                continue
            cells = []
            for m in ms_keys:
                fastest = min(group, key=lambda r, m=m: r["ms"][m])
                cells.append(f"{fastest['path']} {fastest['ms'][m] / base['ms'][m]:.2f}")
            lines.append(
                f"| {s['preset']} {s['matmul']} {s['shape'][0]}x{s['shape'][1]} | {dtype} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seconds", type=float, default=0.02, help="timing per cell and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repeats of every path (minimum kept)")
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--quick", action="store_true", help="smoke run: demo shapes + one medium, M = 1 2 8, 1 round")
    parser.add_argument(
        "--cold",
        action="store_true",
        help=f"each call reads another copy of the weight (up to {COLD_COPIES}, {COLD_BYTES >> 20} MiB in all), "
        "as a model larger than the caches does",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="report name (default gemm_<device>_<date>)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        shapes = json.loads(args.shapes)
        if args.worker == TORCH:
            rows = worker_torch(shapes, args.rows, args.seconds, args.cold)
        else:
            rows = worker_xla(shapes, args.rows, args.seconds, args.cold, extension=args.worker == "xla default")
        print(json.dumps(rows))
        return

    shapes = preset_shapes(args.presets)
    if args.quick:
        shapes = [s for s in shapes if s["preset"] == "demo"][:2] + [
            s for s in shapes if s["preset"] == "medium" and s["matmul"] == "gate_up"
        ]
        args.rows, args.rounds, args.seconds = [1, 2, 8], 1, min(args.seconds, 0.02)
    args.shape_list = shapes
    load = os.getloadavg()
    begin = time.perf_counter()
    rows = measure(args)
    bandwidth = add_bounds(rows, args)

    import jax
    import torch

    device = jax.devices()[0].device_kind
    meta = dict(
        date=str(date.today()),
        device=device,
        cpu=cpu_name(),
        cpu_flags=cpu_flags(),
        cores=len(os.sched_getaffinity(0)),
        jax=jax.__version__,
        torch=torch.__version__,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        cold=args.cold,
        configs=CONFIGS,
        rounds=args.rounds,
        seconds=args.seconds,
        load_average=" ".join(f"{x:.2f}" for x in load),
        load_average_end=" ".join(f"{x:.2f}" for x in os.getloadavg()),
        wall_s=time.perf_counter() - begin,
        shapes=shapes,
        **bandwidth,
    )
    name = args.name or f"gemm_{device.replace(' ', '_')}_{date.today()}" + ("_cold" if args.cold else "") + (
        "_quick" if args.quick else ""
    )
    write_report(args.out, name, meta, rows, markdown(meta, rows, shapes))


if __name__ == "__main__":
    main()
