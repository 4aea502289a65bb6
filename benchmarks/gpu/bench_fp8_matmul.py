"""Does the FP8 dequantization fuse into the dot? One block-scaled FP8 linear (`mtp_jax.layers.fp8`, DeepSeek-V3's
128 x 128 blocks) against the same linear in bfloat16, compiled for the backend at hand.

For each shape (DeepSeek-V3's widest projections: 7168 -> 2048 and 2048 -> 7168, one expert's; 7168 -> 18432
dense) and rows M in {1, 8, 64} it reports:
  - whether the optimized HLO has a fusion that reads the float8 kernel and computes the dot in one kernel
    (`fused`: a fusion computation holding both the f8 operand and the dot / the GEMM custom call), or first
    materialises a dequantized bf16 weight (`materialised`: a fusion whose output is the [in, out] weight in
    the compute dtype, then a separate GEMM);
  - the median time per call, FP8 vs bf16, and the weight bytes each reads.
Writes JSON and markdown to benchmarks/results/ (and $OUT when set), named by device and date.

  python benchmarks/gpu/bench_fp8_matmul.py            # on a GPU (part of run_all.sh)
  python benchmarks/gpu/bench_fp8_matmul.py --smoke    # any backend, small shapes
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.layers.linear import linear
from mtp_jax.quantization import Fp8Config

SHAPES = [(7168, 2048), (2048, 7168), (7168, 18432)]  # (in, out)
SMOKE_SHAPES = [(256, 384)]


def _layer(fan_in: int, fan_out: int, fp8: bool):
    config = ModelConfig.from_name(
        "tiny",
        hidden_size=fan_in,
        dtype="bfloat16",
        param_dtype="bfloat16",
        quantization=Fp8Config(weight_block_size=(128, 128)) if fp8 else None,
    )
    return linear(config, fan_in, fan_out, nnx.Rngs(0), axes=(None, None), name="mlp.down_proj")


def _fusion_kind(hlo: str) -> str:
    """'fused' when one fusion computation reads a float8 operand and holds the dot (or GEMM custom call),
    'materialised' when the float8 weight is converted in one fusion and multiplied in another, '?' else."""
    computations = re.split(r"\n(?=\S)", hlo)  # one block per HLO computation
    for body in computations:
        if "f8e4m3fn" in body and re.search(r"\b(dot|custom-call)\(", body) and "fused" in body.split("\n")[0]:
            return "fused"
    if "f8e4m3fn" in hlo:
        return "materialised"
    return "?"


def _median_ms(fn, *args, trials: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes on any backend")
    args, _ = parser.parse_known_args()  # run_all.sh passes every script the same arguments
    device = jax.devices()[0]
    rows = []
    for fan_in, fan_out in SMOKE_SHAPES if args.smoke else SHAPES:
        layers = {kind: _layer(fan_in, fan_out, kind == "fp8") for kind in ("fp8", "bf16")}
        for m in (1, 8, 64):
            x = jnp.ones((m, fan_in), jnp.bfloat16)
            row = {"in": fan_in, "out": fan_out, "rows": m}
            for kind, layer in layers.items():
                graph, params = nnx.split(layer)
                fn = jax.jit(lambda p, x, graph=graph: nnx.merge(graph, p)(x))
                if kind == "fp8":
                    row["fusion"] = _fusion_kind(fn.lower(params, x).compile().as_text())
                row[f"{kind}_ms"] = round(_median_ms(fn, params, x), 4)
                row[f"{kind}_weight_bytes"] = sum(v.nbytes for v in jax.tree.leaves(params))
            row["fp8_over_bf16"] = round(row["fp8_ms"] / row["bf16_ms"], 3)
            rows.append(row)
            print(row, flush=True)
    stamp = datetime.date.today().isoformat()
    name = re.sub(r"[^A-Za-z0-9]+", "-", device.device_kind).strip("-").lower()
    result = {"device": device.device_kind, "backend": jax.default_backend(), "date": stamp, "rows": rows}
    table = ["| in | out | M | fusion | fp8 ms | bf16 ms | fp8/bf16 |", "|---|---|---|---|---|---|---|"]
    keys = ("in", "out", "rows", "fusion", "fp8_ms", "bf16_ms", "fp8_over_bf16")
    table += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    print("\n".join(table))
    outs = [pathlib.Path(__file__).resolve().parents[1] / "results"]
    if os.environ.get("OUT"):
        outs.append(pathlib.Path(os.environ["OUT"]))
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"fp8_matmul_{name}_{stamp}{'_smoke' if args.smoke else ''}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / f"{stem}.md").write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
