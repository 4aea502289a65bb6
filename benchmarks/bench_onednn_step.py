"""Prototype: a whole decode step with every weight matmul in torch's oneDNN matmul (pre-packed weight).

Issue 26 evidence before anyone writes a jax.ffi extension: `bench_gemm.py` found oneDNN's matmul over a
pre-packed weight (`torch.ops.mkldnn._linear_pointwise` on `torch.ops.mkldnn._reorder_linear_weight`'s
output) 2-5x faster than XLA:CPU's dot on the decode shapes in bf16. This script measures what that is
worth per decode step, with a `jax.pure_callback` into torch standing in for a custom call.

How: inside this script only (the package is untouched), every `nnx.Linear` of the model (decoder
projections, the untied `lm_head`, the MTP modules' `eh_proj` and layers) gets its `dot_general` attribute
replaced by `OneDnnDot(key)`, which sends only the activations to the host: the weight, [in, out] in
the model, is copied once per layer before jit as a torch [out, in] tensor in the compute dtype and
packed by oneDNN once per (layer, M rows) on first use (M > 64, the prefill, runs torch's unpacked
`linear`). Weights are jit arguments of `DecodeEngine`'s jitted calls, so they are not passed to the
callback at all: each layer's callback knows its weight by key. Everything else (attention, norms,
rope, sampling, the loop) stays XLA. `DecodeEngine` snapshots the graph at construction, so engines
built with the attribute swapped in run the callback path, the others XLA's.

Measured with the engine's own loop (`bench_speculative.prefill_of` + `DecodeEngine.run`, prefill
excluded; ms per step = loop time / steps), plain greedy and eagle K=3 (random MTP heads: the step's
time, not its acceptance), XLA vs callback, interleaved over --rounds (fastest round kept: the machine is
shared), per preset, batch and dtype (bf16: the fp32 weights rounded, `bench_dtype.models`). Greedy
tokens of the two paths are compared (plain decoding): the fraction of generated tokens that agree
up to the first difference, and whether they are identical.

    python benchmarks/bench_onednn_step.py [--presets medium small] [--batch-sizes 1 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from datetime import date

import bench_speculative as bench  # this directory is on sys.path when run as a script
import jax
import ml_dtypes
import numpy as np
import torch
from bench_dtype import models
from flax import nnx
from report import cpu_name, write_report

from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig

PACK_MAX_ROWS = 64  # above: torch's unpacked linear (the prefill, not timed)
WEIGHTS: dict[int, dict] = {}  # key -> {"weight": torch [out, in], "packed": {M: packed}}
CALLS = {"n": 0}
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def _to_torch(x: np.ndarray) -> torch.Tensor:
    x = np.ascontiguousarray(x)
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _to_numpy(y: torch.Tensor) -> np.ndarray:
    if y.dtype == torch.bfloat16:
        return y.contiguous().view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return y.contiguous().numpy()


def _host_linear(key: int, x: np.ndarray) -> np.ndarray:
    CALLS["n"] += 1
    entry = WEIGHTS[key]
    lead, fan_in = x.shape[:-1], x.shape[-1]
    m = int(np.prod(lead))
    xt = _to_torch(x).reshape(m, fan_in)
    with torch.inference_mode():
        if m > PACK_MAX_ROWS:
            y = torch.nn.functional.linear(xt, entry["weight"])
        else:
            packed = entry["packed"].get(m)
            if packed is None:
                packed = entry["packed"][m] = torch.ops.mkldnn._reorder_linear_weight(entry["weight"], m)
            y = torch.ops.mkldnn._linear_pointwise(xt, packed, None, "none", [], "")
    return _to_numpy(y.reshape(*lead, -1))


class OneDnnDot:
    """An `nnx.Linear.dot_general` that computes `x @ kernel` on the host with layer `key`'s packed weight."""

    def __init__(self, key: int, fan_out: int):
        self.key, self.fan_out = key, fan_out

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        assert rhs.ndim == 2 and dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())), dimension_numbers
        shape = jax.ShapeDtypeStruct((*lhs.shape[:-1], self.fan_out), lhs.dtype)
        key = self.key
        y = jax.pure_callback(lambda x: _host_linear(key, x), shape, lhs, vmap_method="broadcast_all")
        return y if preferred_element_type is None else y.astype(preferred_element_type)


def linears(model) -> list[nnx.Linear]:
    seen, out = set(), []
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear) and id(module) not in seen:
            seen.add(id(module))
            out.append(module)
    return out


def swap_in(model) -> dict:
    """Registers every Linear's weight with the host and returns {module: (original, callback) dot}."""
    swaps = {}
    for module in linears(model):
        kernel = np.asarray(module.kernel[...].astype(module.dtype or module.kernel[...].dtype))  # [in, out]
        key = len(WEIGHTS)
        WEIGHTS[key] = dict(weight=_to_torch(kernel.T.copy()).contiguous(), packed={})
        swaps[module] = (module.dot_general, OneDnnDot(key, kernel.shape[1]))
    return swaps


def engines(model, swaps, spec) -> dict:
    out = {}
    for path in ("xla", "onednn"):
        for module, (xla_dot, onednn_dot) in swaps.items():
            module.dot_general = onednn_dot if path == "onednn" else xla_dot
        out[path] = DecodeEngine(model, spec)
    for module, (xla_dot, _) in swaps.items():
        module.dot_general = xla_dot
    return out


def run_once(engine, prompts, new_tokens, capacity):
    prefill = bench.prefill_of(engine, prompts, new_tokens, capacity, stop_tokens=[])
    state = jax.block_until_ready(prefill())
    begin = time.perf_counter()
    state = jax.block_until_ready(engine.run(state))
    seconds = time.perf_counter() - begin
    steps = int(state.metrics.num_steps.max())
    tokens = np.asarray(state.tokens)
    lengths = np.asarray(state.lengths)
    p = len(prompts[0])
    return seconds / steps, steps, [tokens[b, p : int(lengths[b])].tolist() for b in range(len(prompts))]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of tokens equal up to each row's first difference (later ones follow a different prefix)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = max(len(x), len(y))
        total += n
        for i in range(min(len(x), len(y))):
            if x[i] != y[i]:
                break
            same += 1
    return same / total


def run_preset(preset: str, args) -> list[dict]:
    both = models(preset)
    rows = []
    for dtype in args.dtypes:
        model = both[dtype]
        WEIGHTS.clear()
        swaps = swap_in(model)
        vocab = model.config.vocab_size
        capacity = args.prompt_tokens + args.new_tokens + 16
        for batch in args.batch_sizes:
            prompts = np.random.default_rng(batch).integers(0, vocab, (batch, args.prompt_tokens)).tolist()
            variants = {}
            eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
            for method, spec in (("plain", None), ("eagle3", eagle)):
                for path, engine in engines(model, swaps, spec).items():
                    variants[(method, path)] = engine
            begin = time.perf_counter()
            results = {v: run_once(e, prompts, args.new_tokens, capacity) for v, e in variants.items()}  # compile
            print(f"{preset} {dtype} b{batch}: compiled + warm in {time.perf_counter() - begin:.0f} s", flush=True)
            times = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, e in variants.items():
                    CALLS["n"] = 0
                    step_s, steps, tokens = run_once(e, prompts, args.new_tokens, capacity)
                    times[v].append(step_s)
                    results[v] = (step_s, steps, tokens, CALLS["n"])
            ms = {v: min(t) * 1e3 for v, t in times.items()}
            median = {v: float(np.median(t)) * 1e3 for v, t in times.items()}
            plain_x, plain_o = results[("plain", "xla")][2], results[("plain", "onednn")][2]
            row = dict(
                preset=preset,
                dtype=dtype,
                batch=batch,
                new_tokens=args.new_tokens,
                plain_xla_ms=ms[("plain", "xla")],
                plain_onednn_ms=ms[("plain", "onednn")],
                eagle3_xla_ms=ms[("eagle3", "xla")],
                eagle3_onednn_ms=ms[("eagle3", "onednn")],
                median_ms={f"{m} {p}": t for (m, p), t in median.items()},
                all_ms={f"{m} {p}": [x * 1e3 for x in t] for (m, p), t in times.items()},
                steps={f"{m} {p}": r[1] for (m, p), r in results.items()},
                callbacks_per_step_onednn={
                    m: results[(m, "onednn")][3] / results[(m, "onednn")][1] for m in ("plain", "eagle3")
                },
                plain_tokens_identical=plain_x == plain_o,
                plain_token_agreement=agreement(plain_x, plain_o),
                eagle_vs_plain_tokens_identical_xla=results[("eagle3", "xla")][2] == plain_x,
                eagle_vs_plain_tokens_identical_onednn=results[("eagle3", "onednn")][2] == plain_o,
                load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
            )
            row["plain_speedup"] = row["plain_xla_ms"] / row["plain_onednn_ms"]
            row["eagle3_speedup"] = row["eagle3_xla_ms"] / row["eagle3_onednn_ms"]
            row["eagle3_over_plain_xla"] = row["eagle3_xla_ms"] / row["plain_xla_ms"]
            row["eagle3_over_plain_onednn"] = row["eagle3_onednn_ms"] / row["plain_onednn_ms"]
            rows.append(row)
            print(
                f"  plain {row['plain_xla_ms']:.1f} -> {row['plain_onednn_ms']:.1f} ms ({row['plain_speedup']:.2f}x), "
                f"eagle3 {row['eagle3_xla_ms']:.1f} -> {row['eagle3_onednn_ms']:.1f} ms "
                f"({row['eagle3_speedup']:.2f}x); "
                f"eagle/plain {row['eagle3_over_plain_xla']:.2f} -> {row['eagle3_over_plain_onednn']:.2f}; "
                f"tokens identical {row['plain_tokens_identical']} (agreement {row['plain_token_agreement']:.2f}); "
                f"load {row['load_average']}",
                flush=True,
            )
            args.on_row(rows)
        for module, (xla_dot, _) in swaps.items():
            module.dot_general = xla_dot
        WEIGHTS.clear()
    return rows


def callback_overhead(rows_list=(1, 8, 32), calls: int = 50, repeats: int = 20) -> dict:
    """Microseconds per `jax.pure_callback` round trip that does no work (a [M, 1024] float32 operand
    and result), `calls` of them in a chain inside one jitted function: the fixed cost the prototype pays
    per matmul on top of torch's time."""
    out = {}
    for m in rows_list:
        spec = jax.ShapeDtypeStruct((m, 1024), np.float32)

        def chain(x, spec=spec):
            for _ in range(calls):
                x = jax.pure_callback(lambda a: a, spec, x)
            return x

        fn = jax.jit(chain)
        x = np.ones((m, 1024), np.float32)
        jax.block_until_ready(fn(x))
        times = []
        for _ in range(repeats):
            begin = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - begin)
        out[m] = dict(min_us=min(times) / calls * 1e6, median_us=float(np.median(times)) / calls * 1e6)
        print(f"callback round trip, M={m}: {out[m]['min_us']:.0f} us (median {out[m]['median_us']:.0f})", flush=True)
    return out


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"Decode step with every weight matmul through `jax.pure_callback` into torch's oneDNN matmul "
        f"(pre-packed weight) vs XLA:CPU, on {meta['cpu']} ({meta['cores']} cores, shared), {meta['date']}, "
        f"jax {meta['jax']}, torch {meta['torch']} ({meta['torch_threads']} threads), load average "
        f"{meta['load_average']} at start, {meta['load_average_end']} at end. ms per step in `DecodeEngine.run` "
        f"(prefill excluded), {meta['new_tokens']} new tokens, prompt {meta['prompt_tokens']} tokens, fastest of "
        f"{meta['rounds']} interleaved rounds. eagle K=3 with random MTP heads (step time only). `agree`: "
        "plain greedy tokens of the two paths equal up to the first difference.",
        "",
        "| preset | dtype | batch | plain xla | plain onednn | speedup | eagle3 xla | eagle3 onednn | speedup "
        "| eagle3/plain xla | eagle3/plain onednn | callbacks/step | agree |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cb = r["callbacks_per_step_onednn"]
        lines.append(
            f"| {r['preset']} | {r['dtype']} | {r['batch']} | {r['plain_xla_ms']:.1f} | {r['plain_onednn_ms']:.1f} | "
            f"{r['plain_speedup']:.2f}x | {r['eagle3_xla_ms']:.1f} | {r['eagle3_onednn_ms']:.1f} | "
            f"{r['eagle3_speedup']:.2f}x | {r['eagle3_over_plain_xla']:.2f} | {r['eagle3_over_plain_onednn']:.2f} | "
            f"{cb['plain']:.0f} / {cb['eagle3']:.0f} | {r['plain_token_agreement']:.2f}"
            f"{' (identical)' if r['plain_tokens_identical'] else ''} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["medium", "small"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch-threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="report name (default onednn_step_<device>_<date>)")
    parser.add_argument("--overhead-only", action="store_true", help="only time empty callbacks (printed)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.overhead_only:
        print(callback_overhead(), "load", os.getloadavg())
        return
    device = jax.devices()[0].device_kind
    name = args.name or f"onednn_step_{device.replace(' ', '_')}_{date.today()}"
    meta = dict(
        date=str(date.today()),
        device=device,
        cpu=cpu_name(),
        cores=len(os.sched_getaffinity(0)),
        jax=jax.__version__,
        torch=torch.__version__,
        torch_threads=args.torch_threads,
        xla_flags=os.environ.get("XLA_FLAGS", ""),
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        rounds=args.rounds,
        load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
    )
    done: list[dict] = []

    def on_row(rows):  # write after every cell: partial results survive an interrupted run
        meta["load_average_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        write_report(args.out, name, meta, done + rows, markdown(meta, done + rows))

    args.on_row = on_row
    for preset in args.presets:
        done += run_preset(preset, args)


if __name__ == "__main__":
    main()
