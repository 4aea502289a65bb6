"""Compile time against depth, and decode speed, with the layers scanned (`scan_layers`) and unrolled.

Compile: a tiny DeepSeek-V3-shaped random model (MLA + MoE, first_k_dense_replace = 1, one MTP module)
with 2 and with 61 layers generates through the public API, `generate(model, prompts,
max_new_tokens=..., speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=2))`:
prefill plus the speculative loop. Compile time = the first call's wall time minus the second's (same
shapes: the second compiles nothing). Each case runs in a fresh process, so no case reuses another's
compiled functions. The target: 61 layers compile in at most 2x the 2-layer time.

Decode: greedy tokens/s at batch 1 (no speculation; median of repeats after a warm-up, the layouts
interleaved) for a small Llama-shaped model (preset "small": 4 layers of width 512) and a small
DeepSeek-V3-shaped one (4 layers of width 256), scanned and unrolled, at a short cache capacity (prompt
+ new tokens + 8) and a long one (--long-capacity): the scan carries each group's stacked cache and
copies a layer's slice out and back per step, which costs in proportion to the capacity (GQA caches
more than MLA's compressed latents). `ModelConfig.scan_layers`'s default is chosen from these.

Writes JSON under --out (`compile_<device>_<date>.json`) and prints a markdown table.

    python benchmarks/bench_compile.py [--depths 2 61] [--new-tokens 64] [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax.config import ModelConfig  # noqa: E402
from mtp_jax.decode.generation import generate  # noqa: E402
from mtp_jax.decode.speculative import SpeculativeConfig  # noqa: E402
from mtp_jax.model import init_model  # noqa: E402

_DEEPSEEK = dict(
    attention_type="mla",
    ffn_type="moe",
    q_lora_rank=None,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
)


def tiny_deepseek(num_layers: int, scan_layers: bool) -> ModelConfig:
    """The compile benchmark's model: DeepSeek-V3's structure at width 64, vocab 256, one MTP module."""
    return ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_nextn_predict_layers=1,
        scan_layers=scan_layers,
        **_DEEPSEEK,
    )


def small_models(scan_layers: bool) -> dict[str, ModelConfig]:
    """The decode benchmark's models: Llama-shaped (preset "small") and DeepSeek-V3-shaped, 4 layers each."""
    return {
        "llama_small": ModelConfig.from_name("small", scan_layers=scan_layers),
        "deepseek_small": ModelConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=2048,
            scan_layers=scan_layers,
            **{
                **_DEEPSEEK,
                "kv_lora_rank": 128,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "moe_intermediate_size": 128,
                "n_routed_experts": 16,
            },
        ),
    }


def _compile_case(num_layers: int, scan_layers: bool, new_tokens: int) -> dict:
    """One compile measurement (in this process, which must have compiled nothing of the kind before)."""
    model = init_model(tiny_deepseek(num_layers, scan_layers), seed=0)
    prompts = np.random.default_rng(0).integers(0, 256, (1, 16)).tolist()
    spec = SpeculativeConfig(method="eagle", num_speculative_tokens=2)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        result = generate(model, prompts, max_new_tokens=new_tokens, max_length=64, speculative=spec, stop_tokens=[])
        times.append(time.perf_counter() - start)
    return dict(
        num_layers=num_layers,
        scan_layers=scan_layers,
        first_call_s=times[0],
        second_call_s=times[1],
        compile_s=times[0] - times[1],
        tokens=result.tokens[0],
    )


def _compile_in_subprocess(num_layers: int, scan_layers: bool, new_tokens: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--compile-case",
            str(num_layers),
            str(int(scan_layers)),
            "--new-tokens",
            str(new_tokens),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def _decode_cases(new_tokens: int, capacity: int, repeats: int) -> list[dict]:
    """Greedy decode tok/s of every small model in both layouts at cache capacity `capacity`, interleaved."""
    models = {
        (name, scan): init_model(config, seed=0)
        for scan in (False, True)
        for name, config in small_models(scan).items()
    }
    prompts = {
        key: np.random.default_rng(0).integers(0, m.config.vocab_size, (1, 32)).tolist() for key, m in models.items()
    }
    kwargs = dict(max_new_tokens=new_tokens, max_length=capacity, stop_tokens=[])
    tokens = {key: generate(m, prompts[key], **kwargs).tokens[0] for key, m in models.items()}  # compile
    times: dict[tuple, list[float]] = {key: [] for key in models}
    for _ in range(repeats):
        for key, m in models.items():
            start = time.perf_counter()
            generate(m, prompts[key], **kwargs)
            times[key].append(time.perf_counter() - start)
    return [
        dict(
            model=name,
            scan_layers=scan,
            batch=1,
            new_tokens=new_tokens,
            capacity=capacity,
            seconds=float(np.median(times[name, scan])),
            tok_s=new_tokens / float(np.median(times[name, scan])),
            tokens=tokens[name, scan],
        )
        for name, scan in models
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 61])
    parser.add_argument("--new-tokens", type=int, default=16, help="compile runs: tokens generated per call")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-capacity", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--compile-case", nargs=2, type=int, metavar=("LAYERS", "SCAN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_case:  # the child process of one compile measurement: prints its JSON row
        print(json.dumps(_compile_case(args.compile_case[0], bool(args.compile_case[1]), args.new_tokens)))
        return

    compile_rows = []
    for num_layers in args.depths:
        for scan in (False, True):
            row = _compile_in_subprocess(num_layers, scan, args.new_tokens)
            compile_rows.append(row)
            print(f"compile: {num_layers} layers, scan_layers={scan}: {row['compile_s']:.1f} s", flush=True)
    for num_layers in args.depths:  # the layouts generate the same tokens (same weights)
        same = {tuple(r["tokens"]) for r in compile_rows if r["num_layers"] == num_layers}
        assert len(same) == 1, f"{num_layers} layers: scanned and unrolled tokens differ"
    decode_rows = []
    for capacity in (32 + args.decode_tokens + 8, args.long_capacity):
        rows = _decode_cases(args.decode_tokens, capacity, args.repeats)
        decode_rows += rows
        for row in rows:
            print(
                f"decode: {row['model']}, capacity {capacity}, scan_layers={row['scan_layers']}: "
                f"{row['tok_s']:.1f} tok/s",
                flush=True,
            )
        for name in small_models(False):  # the layouts generate the same tokens (same weights)
            same = {tuple(r["tokens"]) for r in rows if r["model"] == name}
            assert len(same) == 1, f"{name}: scanned and unrolled tokens differ"

    meta = dict(
        benchmark="compile_time_and_decode_by_layer_layout",
        date=str(date.today()),
        device=jax.devices()[0].device_kind,
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        dtype="float32",
        compile_config=dataclasses.asdict(tiny_deepseek(min(args.depths), False)),
        compile_config_varies=["num_hidden_layers", "scan_layers"],
        compile_method="wall time of the first generate() call minus the second's, fresh process per case",
        speculative="eagle, num_speculative_tokens=2",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"compile_{meta['device'].replace(' ', '_')}_{meta['date']}.json"
    path.write_text(json.dumps(dict(meta=meta, compile=compile_rows, decode=decode_rows), indent=2) + "\n")

    print(
        f"\nCompile time (s) of prefill + eagle K=2 loop, tiny DeepSeek-V3-shaped model, {meta['device']} "
        f"({meta['cpu_count']} cores)\n"
    )
    print("| layers | unrolled | scan | scan / unrolled |")
    print("|---:|---:|---:|---:|")
    by = {(r["num_layers"], r["scan_layers"]): r["compile_s"] for r in compile_rows}
    for n in args.depths:
        print(f"| {n} | {by[n, False]:.1f} | {by[n, True]:.1f} | {by[n, True] / by[n, False]:.2f} |")
    base = min(args.depths)
    for scan in (False, True):
        ratios = ", ".join(f"{n} layers {by[n, scan] / by[base, scan]:.2f}x" for n in args.depths if n != base)
        print(f"\n{'scan' if scan else 'unrolled'}: vs {base} layers: {ratios}")
    print(f"\nGreedy decode at batch 1, {args.decode_tokens} new tokens, median of {args.repeats}\n")
    print("| model | cache capacity | unrolled tok/s | scan tok/s | scan / unrolled |")
    print("|---|---:|---:|---:|---:|")
    tok = {(r["model"], r["capacity"], r["scan_layers"]): r["tok_s"] for r in decode_rows}
    for name, capacity, _ in sorted({(r["model"], r["capacity"], 0) for r in decode_rows}):
        unrolled, scan = tok[name, capacity, False], tok[name, capacity, True]
        print(f"| {name} | {capacity} | {unrolled:.1f} | {scan:.1f} | {scan / unrolled:.2f} |")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
