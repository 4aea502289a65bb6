"""The optional oneDNN matmul (`mtp_jax.layers.onednn`, `pip install ./extensions/onednn`) against XLA:CPU,
decode step by decode step: what `DecodeEngine` gains when it packs its kernels.

Per model (the bundled demo model, with its trained MTP head; the small and medium presets, random
weights), dtype (bf16: the weights rounded, `bench_dtype.models`) and batch: engines built with
`MTP_JAX_ONEDNN=0` (XLA; `--baseline matmuls`: oneDNN's matmuls with XLA's attention, to time the attention
alone) and with the engine's default routing (`--onednn 1`: bfloat16 at every row count and bf16 attention,
float32 from `onednn.MIN_ROWS` rows) or `--onednn all` (every row count), plain greedy and eagle K=3, timed
in the engine's own loop (`DecodeEngine.run`, ms per step = loop time / steps; the prefill timed apart),
interleaved over --rounds, fastest kept. Greedy tokens of the two paths are compared. eagle's speedup over
plain is decode time per generated token (acceptance included: random heads accept little, the demo
model's trained head more).

    python benchmarks/bench_onednn.py [--models demo small medium] [--batch-sizes 1 8] [--rounds 3]
        [--onednn 1|all] [--baseline 0|matmuls] [--float32-min-rows N]
"""

from __future__ import annotations

import argparse
import os
import time

import bench_speculative as bench  # this directory is on sys.path when run as a script
import jax
import numpy as np
from bench_dtype import models
from report import load_average, run_models

import mtp_jax
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers import onednn

PATHS = {"xla": "0", "onednn": "1"}  # MTP_JAX_ONEDNN per column; --baseline sets the first, --onednn the second
BASELINES = {
    "0": "XLA:CPU (`MTP_JAX_ONEDNN=0`)",
    "matmuls": "the same matmuls with XLA's attention (`MTP_JAX_ONEDNN=matmuls`; columns `xla`)",
}


def engine_for(model, spec, path: str) -> DecodeEngine:
    os.environ[onednn.ENV] = PATHS[path]  # read when the engine packs; this script sets it for every engine
    return DecodeEngine(model, spec)


def run_once(engine, prompts, new_tokens: int, capacity: int):
    """(prefill seconds, seconds per step, seconds per generated token, steps, tokens per row)."""
    begin = time.perf_counter()
    state = jax.block_until_ready(bench.prefill_of(engine, prompts, new_tokens, capacity, stop_tokens=[])())
    prefill = time.perf_counter() - begin
    begin = time.perf_counter()
    state = jax.block_until_ready(engine.run(state))
    seconds = time.perf_counter() - begin
    steps = int(state.metrics.num_steps.max())
    tokens, lengths, p = np.asarray(state.tokens), np.asarray(state.lengths), len(prompts[0])
    rows = [tokens[b, p : int(lengths[b])].tolist() for b in range(len(prompts))]
    return prefill, seconds / steps, seconds / max(len(r) for r in rows), steps, rows


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


def model_pair(name: str) -> dict:
    if name != "demo":
        return models(name)
    fp32, _ = mtp_jax.load_pretrained()
    bf16, _ = mtp_jax.load_pretrained(dtype="bfloat16")
    return {"float32": fp32, "bfloat16": bf16}


def run_model(name: str, args) -> list[dict]:
    pair, rows = model_pair(name), []
    for dtype in args.dtypes:
        model = pair[dtype]
        vocab = model.config.vocab_size
        capacity = args.prompt_tokens + args.new_tokens + 16
        for batch in args.batch_sizes:
            prompts = np.random.default_rng(batch).integers(3, vocab, (batch, args.prompt_tokens)).tolist()
            eagle = SpeculativeConfig(method="eagle", num_speculative_tokens=3)
            engines = {(m, p): engine_for(model, s, p) for m, s in (("plain", None), ("eagle3", eagle)) for p in PATHS}
            results = {v: run_once(e, prompts, args.new_tokens, capacity) for v, e in engines.items()}  # compile
            best = {v: [float("inf")] * 3 for v in engines}
            for _ in range(args.rounds):
                for v, e in engines.items():
                    results[v] = run_once(e, prompts, args.new_tokens, capacity)
                    best[v] = [min(a, b) for a, b in zip(best[v], results[v][:3], strict=True)]
            ms = {f"{m} {p}": [x * 1e3 for x in best[(m, p)]] for m, p in engines}  # prefill, step, token
            tokens = {v: r[4] for v, r in results.items()}
            row = dict(
                model=name,
                dtype=dtype,
                batch=batch,
                ms=ms,
                steps={f"{m} {p}": r[3] for (m, p), r in results.items()},
                plain_agreement=agreement(tokens[("plain", "xla")], tokens[("plain", "onednn")]),
                eagle_equals_plain={p: tokens[("eagle3", p)] == tokens[("plain", p)] for p in PATHS},
                load_average=load_average(),
            )
            rows.append(row)
            s = {k: v[1] for k, v in ms.items()}
            print(
                f"{name} {dtype} b{batch}: plain {s['plain xla']:.1f} -> {s['plain onednn']:.1f} ms/step, "
                f"eagle3 {s['eagle3 xla']:.1f} -> {s['eagle3 onednn']:.1f}; agreement {row['plain_agreement']:.2f}; "
                f"load {row['load_average']}",
                flush=True,
            )
            args.on_row(rows)
            del engines
            jax.clear_caches()  # 4 engines' programs per cell; a whole run would pass vm.max_map_count
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"`DecodeEngine` with its Linear kernels packed for oneDNN (`MTP_JAX_ONEDNN={meta['onednn']}`"
        f"{meta['min_rows_note']}) vs {BASELINES[meta.get('baseline', '0')]}, on {meta['cpu']} ({meta['cores']} cores, "
        f"shared), {meta['date']}, jax {meta['jax']}, "
        f"load average {meta['load_average']} at start, {meta['load_average_end']} at end. ms per decode step "
        f"in `DecodeEngine.run` ({meta['new_tokens']} new tokens after a {meta['prompt_tokens']}-token prompt; "
        f"prefill apart), fastest of {meta['rounds']} interleaved rounds. eagle = eagle K=3; `eagle/plain` is "
        "the step-time ratio, `eagle speedup` the decode time per token of plain over eagle. `agree`: plain "
        "greedy tokens of the two paths equal up to the first difference.",
        "",
        "| model | dtype | batch | plain xla | plain onednn | plain gain | eagle xla | eagle onednn | eagle gain "
        "| eagle/plain xla | eagle/plain onednn | eagle speedup xla | eagle speedup onednn | prefill xla / onednn "
        "| agree |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        step = {k: v[1] for k, v in r["ms"].items()}
        token = {k: v[2] for k, v in r["ms"].items()}
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['batch']} | {step['plain xla']:.2f} | {step['plain onednn']:.2f} "
            f"| {step['plain xla'] / step['plain onednn']:.2f}x | {step['eagle3 xla']:.2f} "
            f"| {step['eagle3 onednn']:.2f} | {step['eagle3 xla'] / step['eagle3 onednn']:.2f}x "
            f"| {step['eagle3 xla'] / step['plain xla']:.2f} | {step['eagle3 onednn'] / step['plain onednn']:.2f} "
            f"| {token['plain xla'] / token['eagle3 xla']:.2f}x "
            f"| {token['plain onednn'] / token['eagle3 onednn']:.2f}x "
            f"| {r['ms']['plain xla'][0]:.0f} / {r['ms']['plain onednn'][0]:.0f} | {r['plain_agreement']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["demo", "small", "medium"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--onednn", default="1", choices=["1", "all"], help="MTP_JAX_ONEDNN of the oneDNN column")
    parser.add_argument(
        "--baseline",
        default="0",
        choices=["0", "matmuls"],
        help="MTP_JAX_ONEDNN of the first column: 0 (XLA alone) or matmuls (oneDNN's matmuls, XLA's attention)",
    )
    parser.add_argument(
        "--float32-min-rows", type=int, default=None, help="onednn.MIN_ROWS['float32'] for this run (default: as set)"
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="report name (default onednn_engine_<device>_<date>)")
    args = parser.parse_args()
    PATHS["onednn"], PATHS["xla"] = args.onednn, args.baseline
    if args.float32_min_rows is not None:
        onednn.MIN_ROWS["float32"] = args.float32_min_rows
    if onednn._extension() is None:
        raise SystemExit("bench_onednn: the extension is not installed (pip install ./extensions/onednn)")
    fields = dict(
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        rounds=args.rounds,
        omp_num_threads=os.environ.get("OMP_NUM_THREADS", ""),
        onednn=args.onednn,
        baseline=args.baseline,
        min_rows=dict(onednn.MIN_ROWS),
        min_rows_note=""
        if args.onednn == "all"
        else ": oneDNN from "
        + ", ".join(f"{rows} rows in {dtype}" for dtype, rows in onednn.MIN_ROWS.items())
        + f", float32 kernels of {onednn.LARGE_BYTES >> 20} MiB or more from {onednn.LARGE_MIN_ROWS}",
    )
    run_models(args, "onednn_engine", fields, markdown, run_model)


if __name__ == "__main__":
    main()
