"""Sharded decoding: tokens/s of plain and speculative (eagle K = 1..3) decoding of a random-weight
DeepSeek-V3-shaped model under several meshes, and the share of a step's device time spent in
collectives.

For each mesh (default, on N devices: `tensor=N`, `expert=N`, `data=N`, `data=2,expert=N/2`) and
each configuration, a `DecodeEngine(model, spec, mesh=mesh)` prefills a fixed batch and runs the
on-device loop once to compile, then `--repeats` times timed (decode only: tokens committed after
the prefill over the loop's wall time; median). Then the loop runs once more under
`jax.profiler.trace` for `--profile-tokens` new tokens (a few steps), and the trace
(`jax.profiler.ProfileData`) is read: every XLA op event whose name is an instruction of the
compiled loop (`DecodeEngine.lower_run(...).compile().as_text()`; containers such as `while` left
out, their bodies counted) adds its duration to its opcode; the collective share is the time of
`all-reduce`, `all-gather`, `all-to-all`, `reduce-scatter` and `collective-permute` ops (sync or
async) over all ops' time, summed over devices. The compiled loop body's collectives are also
counted statically: ops and result bytes per step, by kind.

The model is the preset `--preset` (default `deepseek-v3-small`: MLA, one dense then MoE layers,
16 routed experts) with one MTP module, random weights (the eagle drafts are rarely accepted: the
speculative rows measure what a verify step costs, the acceptance length is reported beside them),
resized with `--override key=value` (any `ModelConfig` field). On CPU, devices faked with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` share one machine's cores and run collectives
as thread rendezvous: the numbers are a smoke check that every mesh compiles and runs, not a
measurement of parallel speed; the output and the JSON say so. On GPUs it is the measurement.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_sharded.py --smoke
    python benchmarks/bench_sharded.py [--meshes tensor=8 data=2,expert=4] [--override num_hidden_layers=8]

Writes `sharded_<device>_<date>[_smoke].json` under --out and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import re
import tempfile
import time
from datetime import date
from pathlib import Path

import jax
import numpy as np
from jax.profiler import ProfileData

import mtp_jax
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.sharding import make_mesh

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "reduce-scatter",
    "collective-permute",
    "collective-broadcast",
)
CONTAINERS = ("while", "conditional", "call")  # their trace events span their bodies' ops
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
SMOKE_OVERRIDES = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=1024,
)
FAKE_DEVICES_NOTE = (
    "CPU devices faked by --xla_force_host_platform_device_count share one machine's cores and "
    "run collectives as thread rendezvous: a smoke check that each mesh compiles and runs, "
    "not a measurement of parallel speed or of collective cost"
)


def collective_kind(opcode: str) -> str | None:
    """ "all-reduce" for "all-reduce", "all-reduce-start", "all-reduce-done"; None for other opcodes."""
    base = re.sub(r"-(start|done|update)$", "", opcode)
    return base if base in COLLECTIVES else None


_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%?([\w.\-]+) = (.*?)\b([a-z][a-z\-]*)\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")  # unindented: a computation's header
_CALLED = re.compile(
    r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)"
    r"=\{?(%?[\w.\-]+(?:, ?%?[\w.\-]+)*)"
)


def parse_hlo(hlo_text: str) -> tuple[dict[str, str], dict[str, list[tuple[str, str, str]]], str]:
    """The compiled module's instruction name -> opcode, each computation's (name, opcode, shape)
    instructions, and the ENTRY computation's name."""
    opcodes, computations, entry, current = {}, {}, "", None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(1)
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
            continue
        match = _INSTRUCTION.match(line)
        if match and current is not None:
            name, shape, opcode = match.groups()
            opcodes[name] = opcode
            computations[current].append((name, opcode, line))
    return opcodes, computations, entry


def _result_bytes(line: str, opcode: str) -> int:
    """Bytes of an instruction's result shape (an async start's last tuple element: its output)."""
    shape = line.split("=", 1)[1].split(f" {opcode}(", 1)[0]
    arrays = re.findall(r"\b([a-z0-9]+)\[([\d,]*)\]", shape)
    if opcode.endswith("-start") and arrays:
        arrays = arrays[-1:]
    return sum(
        DTYPE_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1])) for t, dims in arrays
    )


def loop_body_collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """Collectives of the decode loop's body (the ENTRY computation's first `while`, and every computation
    it calls), by kind: {"ops": per step, "bytes": result bytes per step, per device}. Async pairs count once."""
    _, computations, entry = parse_hlo(hlo_text)
    whiles = [line for _, opcode, line in computations.get(entry, []) if opcode == "while"]
    if not whiles:
        return {}
    body = re.search(r"body=%?([\w.\-]+)", whiles[0]).group(1)
    seen, todo, out = set(), [body], collections.defaultdict(lambda: dict(ops=0, bytes=0))
    while todo:
        name = todo.pop()
        if name in seen or name not in computations:
            continue
        seen.add(name)
        for _, opcode, line in computations[name]:
            for group in _CALLED.findall(line):
                todo.extend(n.strip().lstrip("%") for n in group.split(","))
            kind = collective_kind(opcode)
            if kind and not opcode.endswith("-done"):
                out[kind]["ops"] += 1
                out[kind]["bytes"] += _result_bytes(line, opcode)
    return dict(out)


def profile_collectives(engine: DecodeEngine, state, opcodes: dict[str, str]) -> dict:
    """Runs `engine.run(state)` under `jax.profiler.trace`; the device time of the compiled loop's ops,
    collectives apart (microseconds, summed over devices and steps)."""
    by_kind, total, events = collections.Counter(), 0.0, 0
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(engine.run(state))
        path = next(iter(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)))
        planes = list(ProfileData.from_file(path).planes)
    device_planes = [p for p in planes if p.name.startswith("/device:")]
    for plane in device_planes or [p for p in planes if p.name == "/host:CPU"]:
        # GPU: the "XLA Ops" line (the stream lines repeat the same time as kernels); CPU: every thread's thunks
        for line in [x for x in plane.lines if x.name == "XLA Ops" or not device_planes]:
            for event in line.events:
                opcode = opcodes.get(event.name)
                if opcode is None or opcode in CONTAINERS:
                    continue
                total += event.duration_ns / 1e3
                events += 1
                kind = collective_kind(opcode)
                if kind:
                    by_kind[kind] += event.duration_ns / 1e3
    collective = sum(by_kind.values())
    return dict(
        op_events=events,
        ops_us=total,
        collective_us=collective,
        collective_by_kind_us=dict(by_kind),
        collective_share=collective / total if total else float("nan"),
        source="device planes' XLA Ops lines" if device_planes else "host:CPU plane (XLA:CPU thunks)",
    )


def decode_once(engine: DecodeEngine, prompts, new_tokens: int, capacity: int):
    """A prefilled state's loop, timed: (seconds, tokens committed in the loop, steps, final state)."""
    state, padded = engine.init_state(prompts, max_new_tokens=new_tokens, max_length=capacity)
    state = engine.prefill(state, padded)
    before = int(np.sum(jax.device_get(state.lengths)))
    start = time.perf_counter()
    state = jax.block_until_ready(engine.run(state))
    seconds = time.perf_counter() - start
    return seconds, int(np.sum(jax.device_get(state.lengths))) - before, int(state.metrics.num_steps.max()), state


def bench_config(model, mesh_spec: str, k: int, prompts, args) -> dict:
    """One mesh and K (0: plain): tokens/s, ms/step, acceptance, the collectives measured and counted."""
    mesh = make_mesh(mesh_spec)
    spec = None if k == 0 else SpeculativeConfig(method="eagle", num_speculative_tokens=k)
    engine = DecodeEngine(model, spec, mesh=mesh)
    capacity = args.prompt_tokens + args.new_tokens + 16
    decode_once(engine, prompts, args.new_tokens, capacity)  # compile
    runs = [decode_once(engine, prompts, args.new_tokens, capacity) for _ in range(args.repeats)]
    seconds, tokens, steps, state = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    tokens_out = engine.result(state, seconds).tokens
    profile_state, padded = engine.init_state(prompts, max_new_tokens=args.profile_tokens, max_length=capacity)
    profile_state = engine.prefill(profile_state, padded)
    hlo = engine.lower_run(profile_state).compile().as_text()
    opcodes, _, _ = parse_hlo(hlo)
    profile = profile_collectives(engine, profile_state, opcodes)
    metrics = engine.result(state, seconds).metrics
    return dict(
        mesh=mesh_spec,
        mesh_shape=dict(mesh.shape),
        method="plain" if k == 0 else "eagle",
        k=k,
        batch=len(prompts),
        decode_s=seconds,
        tokens=tokens,
        steps=steps,
        tok_s=tokens / seconds,
        step_ms=seconds / steps * 1e3,
        mean_acceptance_length=None if metrics is None else metrics.mean_acceptance_length,
        profile=profile,
        hlo_collectives_per_step=loop_body_collectives(hlo),
        first_row=tokens_out[0],
    )


def default_meshes(n: int) -> list[str]:
    meshes = [f"tensor={n}", f"expert={n}", f"data={n}"]
    if n >= 4 and n % 2 == 0:
        meshes.append(f"data=2,expert={n // 2}")
    return meshes if n > 1 else ["data=1"]


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="deepseek-v3-small")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a ModelConfig field, e.g. num_hidden_layers=8 (repeatable)",
    )
    parser.add_argument("--meshes", nargs="+", default=None, help="mesh specs (default: by the device count)")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, default=None, help="rows (default: the device count)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--profile-tokens", type=int, default=4, help="new tokens in the profiled run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a small model, two meshes, K=1, few tokens (< 2 min)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    n = jax.device_count()
    overrides = {}
    if args.smoke:
        overrides.update(SMOKE_OVERRIDES)
        args.meshes = args.meshes or [f"tensor={n}", f"data=2,expert={n // 2}" if n >= 4 else f"data={n}"]
        args.num_speculative_tokens, args.new_tokens, args.prompt_tokens, args.repeats = [1], 12, 16, 1
    for item in args.override:
        field, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--override {item!r} is not FIELD=VALUE")
        overrides[field] = _value(value)
    config = mtp_jax.ModelConfig.from_name(args.preset, **{"num_nextn_predict_layers": 1, **overrides})
    model = mtp_jax.init_model(config, seed=0)
    num_params = sum(x.size for x in jax.tree.leaves(model))
    meshes = args.meshes or default_meshes(n)
    batch = args.batch or n
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (batch, args.prompt_tokens)).tolist()
    fake = jax.devices()[0].platform == "cpu" and n > 1
    if fake:
        print(f"NOTE: {FAKE_DEVICES_NOTE}.", flush=True)

    rows = []
    for mesh_spec in meshes:
        for k in [0, *args.num_speculative_tokens]:
            row = bench_config(model, mesh_spec, k, prompts, args)
            rows.append(row)
            print(
                f"{mesh_spec:20s} {row['method']} K={k}: {row['tok_s']:8.1f} tok/s, {row['step_ms']:7.2f} ms/step, "
                f"collectives {row['profile']['collective_share']:.1%} of op time",
                flush=True,
            )
    reference = rows[0]["first_row"]
    for row in rows:
        row["first_row_same_as_first_config"] = row.pop("first_row") == reference

    device = jax.devices()[0].device_kind
    meta = dict(
        benchmark="sharded_decode",
        date=str(date.today()),
        smoke=args.smoke,
        fake_devices=fake,
        note=FAKE_DEVICES_NOTE if fake else None,
        preset=args.preset,
        overrides=overrides,
        num_params=int(num_params),
        device=device,
        device_count=n,
        process_count=jax.process_count(),
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        dtype=str(config.dtype),
        batch=batch,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        profile_tokens=args.profile_tokens,
        repeats=args.repeats,
        timing="decode loop only (prefill excluded), median of repeats",
        collective_share="collective ops' device time / all ops' device time in a profiled run "
        "(jax.profiler.ProfileData), summed over devices",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"sharded_{device.replace(' ', '_')}_{meta['date']}{'_smoke' if args.smoke else ''}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")

    print(
        f"\n{args.preset} ({num_params / 1e6:.1f}M params{', ' + str(overrides) if overrides else ''}), "
        f"batch {batch}, {args.new_tokens} new tokens, {n} x {device}, {jax.process_count()} process(es)"
        + (" -- SMOKE CHECK ONLY (fake CPU devices)" if fake else "")
        + "\n"
    )
    print(
        "| mesh | decoding | tok/s | ms/step | accept len | collective share | collectives/step (ops, KiB) |"
        " same tokens |"
    )
    print("|---|---|---:|---:|---:|---:|---|:---:|")
    for r in rows:
        counted = (
            ", ".join(
                f"{kind} {v['ops']} ({v['bytes'] / 1024:.0f})"
                for kind, v in sorted(r["hlo_collectives_per_step"].items())
            )
            or "none"
        )
        accept = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        label = "plain" if r["k"] == 0 else f"eagle K={r['k']}"
        print(
            f"| {r['mesh']} | {label} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {accept} | "
            f"{r['profile']['collective_share']:.1%} | {counted} | "
            f"{'yes' if r['first_row_same_as_first_config'] else 'NO'} |"
        )
    if fake:
        print(f"\nNOTE: {FAKE_DEVICES_NOTE}.")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
