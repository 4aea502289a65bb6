"""bfloat16 against float32 decoding on this machine: plain greedy tokens/s and the verify forward's r_K.

For each preset (random weights, seed 0, one MTP module) a float32 model and a bfloat16 one
(`dtype = param_dtype = "bfloat16"`, the weights the float32 ones rounded) decode the same prompts
with `generate` (greedy, no stop tokens, exactly --new-tokens per row). The timed runs are
interleaved (both dtypes once per round, --repeats rounds, median) so that the machine's drift hits
both alike. r_K = the time of one (K+1)-token main-model forward / one 1-token forward on a cache
of prompt + new/2 tokens, in an on-device loop (`bench_speculative._forward_timer`).

The target (issue: performance against vLLM): bfloat16 never slower than float32 on a CPU. Writes
`dtype_<device>_<date>.json` and `.md` under --out.

    python benchmarks/bench_dtype.py [--presets demo small medium] [--batch-sizes 1 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import date

import bench_speculative as bench  # this directory is on sys.path when run as a script
import jax
import numpy as np
from flax import nnx
from report import write_report

import mtp_jax
from mtp_jax.decode.generation import generate

DTYPES = ("float32", "bfloat16")


def models(preset: str) -> dict:
    """The preset in float32 and the same weights rounded to bfloat16."""
    config = mtp_jax.ModelConfig.from_name(preset, num_nextn_predict_layers=1)
    fp32 = mtp_jax.init_model(config, seed=0)
    bf16 = mtp_jax.init_model(config.replace(dtype="bfloat16", param_dtype="bfloat16"), seed=0)
    params = jax.tree.map(
        lambda x: x.astype(jax.numpy.bfloat16) if x.dtype == np.float32 else x, nnx.state(fp32, nnx.Param)
    )
    params = jax.tree.map(lambda new, old: new.astype(old.dtype), params, nnx.state(bf16, nnx.Param))  # routers stay
    nnx.update(bf16, params)
    return {"float32": fp32, "bfloat16": bf16}


def run_preset(preset: str, args) -> list[dict]:
    both = models(preset)
    rng = np.random.default_rng(0)
    vocab = both["float32"].config.vocab_size
    capacity = args.prompt_tokens + args.new_tokens + 8
    rows = []
    for batch in args.batch_sizes:
        prompts = rng.integers(0, vocab, (batch, args.prompt_tokens)).tolist()

        def decode(dtype, prompts=prompts):
            begin = time.perf_counter()
            out = generate(both[dtype], prompts, max_new_tokens=args.new_tokens, max_length=capacity, stop_tokens=[])
            seconds = time.perf_counter() - begin
            assert all(len(row) == args.new_tokens for row in out.tokens)
            return seconds

        for dtype in DTYPES:
            decode(dtype)  # compile
        times = {dtype: [] for dtype in DTYPES}
        for _ in range(args.repeats):
            for dtype in DTYPES:
                times[dtype].append(decode(dtype))
        r_k = {}
        for dtype in DTYPES:
            timer = bench._forward_timer(both[dtype], batch, args.prompt_tokens + args.new_tokens // 2, capacity)
            one = timer(1, args.repeats)
            r_k[dtype] = (one, timer(args.k + 1, args.repeats) / one)
        for dtype in DTYPES:
            seconds = float(np.median(times[dtype]))
            rows.append(
                dict(
                    preset=preset,
                    batch=batch,
                    dtype=dtype,
                    tok_s=batch * args.new_tokens / seconds,
                    seconds=seconds,
                    runs=len(times[dtype]),
                    forward_1_ms=r_k[dtype][0] * 1e3,
                    r_k=r_k[dtype][1],
                    k=args.k,
                )
            )
        fp32, bf16 = rows[-2], rows[-1]
        print(
            f"{preset} b{batch}: float32 {fp32['tok_s']:.1f} tok/s, bfloat16 {bf16['tok_s']:.1f} tok/s "
            f"({bf16['tok_s'] / fp32['tok_s']:.2f}x); r_{args.k} {fp32['r_k']:.2f} / {bf16['r_k']:.2f}",
            flush=True,
        )
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"bfloat16 against float32, {meta['device']} ({meta['cores']} cores), {meta['date']}, jax {meta['jax']}; "
        f"greedy `generate`, prompt {meta['prompt_tokens']}, {meta['new_tokens']} new tokens, median of "
        f"{meta['repeats']} interleaved rounds; r_K = (K+1)-token forward / 1-token forward, K = {meta['k']}.",
        "",
        "| model | batch | float32 tok/s | bfloat16 tok/s | bf16 / fp32 | 1-token forward ms fp32 / bf16 | "
        f"r_{meta['k']} fp32 / bf16 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for fp32, bf16 in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            f"| {fp32['preset']} | {fp32['batch']} | {fp32['tok_s']:.1f} | {bf16['tok_s']:.1f} | "
            f"{bf16['tok_s'] / fp32['tok_s']:.2f}x | {fp32['forward_1_ms']:.2f} / "
            f"{bf16['forward_1_ms']:.2f} | {fp32['r_k']:.2f} / {bf16['r_k']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["demo", "small", "medium"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", type=int, default=3, help="r_K for this K")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = [row for preset in args.presets for row in run_preset(preset, args)]
    device = jax.devices()[0].device_kind
    meta = dict(
        date=str(date.today()),
        device=device,
        cores=os.cpu_count(),
        jax=jax.__version__,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        k=args.k,
    )
    write_report(args.out, f"dtype_{device.replace(' ', '_')}_{date.today()}", meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
