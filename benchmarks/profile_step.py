"""Where the time of a decode step goes: a profiler trace of the on-device loop, grouped by phase.

Runs plain decoding and one speculative configuration on the same prompts (greedy), each loop
warmed up first, then once under `jax.profiler.trace`. The XLA ops the trace times are mapped to
the named scopes of the one decode step (`verify_forward`, `accept`, `commit`, `draft` in
`mtp_jax.decode.engine`; plain decoding is the same step with no drafts) through the compiled module's
op metadata; what no scope covers is "other" (rollback, metrics, sampling glue). Prints, per
phase, milliseconds per step and the number of XLA ops per step, and writes JSON.

    python benchmarks/profile_step.py [--model DIR | --preset medium] [--method eagle] [-k 3]

With --preset, a random-weight model of that preset with one MTP module and oracle drafts (the
plain greedy output, every draft accepted; the `draft` phase is then absent).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import tempfile
import time
from datetime import date
from pathlib import Path

import bench_speculative as bench  # this directory is on sys.path when run as a script
import jax
import numpy as np
from report import cpu_name

import mtp_jax
from mtp_jax.decode import speculative
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers import onednn

PHASES = ("verify_forward", "accept", "commit", "draft")
CONTAINERS = ("while", "conditional", "call")  # their trace events span their bodies' ops
TOP_OPS = 15  # the costliest XLA ops listed per variant


def _phase_of(op_name: str) -> str:
    parts = op_name.split("/")
    return next((p for p in PHASES if p in parts), "other")


def _op_phases(hlo_text: str) -> tuple[dict[str, str], set[str], dict[str, str]]:
    """HLO instruction name -> phase, from the op_name metadata of the compiled module; the names
    of the matmuls (XLA's own `dot`s, the library calls XLA:CPU makes for dots, `ynn_fusion`, and the
    oneDNN extension's custom calls); and each instruction's result shape, op and source (its op_name)."""
    out, matmuls, what = {}, set(), {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?)\b([a-z][a-z\-]*)\(", line)
        if match and match.group(3) not in CONTAINERS:
            op_name = re.search(r"op_name=\"([^\"]*)\"", line)
            # XLA drops the metadata of some ops it rewrites (e.g. the main model's matrix-vector dots)
            out[match.group(1)] = _phase_of(op_name.group(1)) if op_name else f"unscoped {match.group(3)}"
            source = op_name.group(1).split("/")[-1] if op_name else ""
            what[match.group(1)] = f"{match.group(2).strip()[:60]} {match.group(3)} {source}".strip()
            onednn = 'custom_call_target="mtp_onednn_matmul"' in line  # the oneDNN extension's matmul
            if match.group(3) == "dot" or onednn or match.group(1).startswith(("ynn_fusion", "xnn_fusion")):
                matmuls.add(match.group(1))
    return out, matmuls, what


def profile(engine: DecodeEngine, state_fn, label: str, top: int = TOP_OPS) -> dict:
    """Runs `engine.run(state_fn())` warm, then traced; returns ms per step and op counts per phase, and
    the `top` most costly XLA ops (ms per step, phase, result shape, op and source)."""
    loop = engine.run
    jax.block_until_ready(loop(state_fn()))
    state = jax.block_until_ready(state_fn())  # its prefill done before the clock starts (dispatch is async)
    begin = time.perf_counter()
    steps = int(jax.block_until_ready(loop(state)).metrics.num_steps.max())
    untraced = (time.perf_counter() - begin) / steps
    phases, matmuls, what = _op_phases(engine.lower_run(state_fn()).compile().as_text())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            jax.block_until_ready(loop(state_fn()))
        trace_file = next(Path(trace_dir).rglob("perfetto_trace.json.gz"))
        events = json.load(gzip.open(trace_file))
    events = events["traceEvents"] if isinstance(events, dict) else events
    time_us, count, matmul_us, op_us = collections.Counter(), collections.Counter(), 0, collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("name") in phases:
            phase = phases[event["name"]]
            time_us[phase] += event.get("dur", 0)
            op_us[event["name"]] += event.get("dur", 0)
            count[phase] += 1
            matmul_us += event.get("dur", 0) if event["name"] in matmuls else 0
    total = sum(time_us.values())
    row = dict(
        label=label,
        steps=steps,
        step_ms_untraced=untraced * 1e3,
        ops_ms_per_step=total / steps / 1e3,
        matmul_ms_per_step=matmul_us / steps / 1e3,
        phases={
            p: dict(
                ms_per_step=time_us[p] / steps / 1e3,
                ops_per_step=count[p] / steps,
                share=time_us[p] / total if total else float("nan"),
            )
            for p in time_us
        },
        top_ops=[
            dict(op=name, ms_per_step=us / steps / 1e3, phase=phases[name], what=what[name])
            for name, us in op_us.most_common(top)
        ],
    )
    print(
        f"\n{label}: {steps} steps, {untraced * 1e3:.2f} ms/step untraced, XLA ops {total / steps / 1e3:.2f} "
        f"ms/step, of which matmuls {matmul_us / steps / 1e3:.2f} ms ({matmul_us / max(total, 1):.0%})"
    )
    for p, v in sorted(row["phases"].items(), key=lambda kv: -kv[1]["ms_per_step"]):
        print(f"  {p:15s} {v['ms_per_step']:8.3f} ms/step  {v['share']:6.1%}  {v['ops_per_step']:7.1f} ops/step")
    print(f"  the {top} most costly ops (ms/step, phase, result, op, source):")
    for op in row["top_ops"]:
        print(f"    {op['ms_per_step']:7.3f}  {op['phase']:15s} {op['what']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--preset", default=None, help="random-weight preset with oracle drafts instead of --model")
    parser.add_argument("--method", default="eagle", choices=speculative.METHODS)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="weights and compute dtype (default: the model's)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--top", type=int, default=TOP_OPS, help="how many of the costliest ops to list")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    k = args.num_speculative_tokens
    if args.preset:
        config = mtp_jax.ModelConfig.from_name(args.preset, num_nextn_predict_layers=1)
        if args.dtype:
            config = config.replace(dtype=args.dtype, param_dtype=args.dtype)
        model = mtp_jax.init_model(config)
        rng = np.random.default_rng(0)
        prompts = rng.integers(0, model.config.vocab_size, (args.batch, args.prompt_tokens)).tolist()
    else:
        model, tokenizer = mtp_jax.load_pretrained(args.model, dtype=args.dtype)
        prompts = mtp_jax.training.data.heldout_prompts(tokenizer, args.batch, args.prompt_tokens)
    capacity = args.prompt_tokens + args.new_tokens + 16
    plain_engine = DecodeEngine(model)
    rows = [
        profile(plain_engine, bench.prefill_of(plain_engine, prompts, args.new_tokens, capacity), "plain", args.top)
    ]

    if args.preset:  # oracle drafts: the plain greedy output
        plain = mtp_jax.generate(model, prompts, max_new_tokens=args.new_tokens, max_length=capacity)
        engine, spec_state = bench.oracle_engine(model, k, prompts, plain.tokens, args.new_tokens, capacity)
    else:
        engine = DecodeEngine(model, SpeculativeConfig(method=args.method, num_speculative_tokens=k))
        spec_state = bench.prefill_of(engine, prompts, args.new_tokens, capacity)
    method = engine.speculative.method
    rows.append(profile(engine, spec_state, f"{method} K={k}", args.top))
    device = jax.devices()[0].device_kind.replace(" ", "_")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = f"_{args.dtype}" if args.dtype else ""
    name = f"profile_{args.preset or 'demo'}_{method}{k}_b{args.batch}{dtype}_{device}_{date.today()}.json"
    meta = dict(
        date=str(date.today()),
        device=device,
        cpu=cpu_name(),
        jax=jax.__version__,
        model=args.preset or args.model or "demo",
        batch=args.batch,
        dtype=str(model.config.compute_dtype),
        onednn=onednn.routed_dtypes(),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
    )
    (out / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
