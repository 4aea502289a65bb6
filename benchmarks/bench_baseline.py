"""Baseline greedy decode throughput: mtp_jax against transformers' `generate`, same weights, one run.

Random-weight models (by default the Llama-shaped preset "small", 4 layers of width 512, and the
DeepSeek-V3-shaped "deepseek-v3-small": MLA, one dense layer then MoE layers with shared and
routed experts) decode greedily at batch 1 and 8; the weights are exported with
`save_hf_checkpoint` and decoded by `transformers.AutoModelForCausalLM.generate(do_sample=False)`
on the same prompts. Whether the first rows' tokens agree is reported (a MoE routing near-tie may
legitimately flip a token between two float paths). Writes JSON and prints a markdown table.

    python benchmarks/bench_baseline.py [--presets small deepseek-v3-small] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from mtp_jax.checkpoints import save_hf_checkpoint  # noqa: E402
from mtp_jax.config import ModelConfig  # noqa: E402
from mtp_jax.decode.generation import generate  # noqa: E402
from mtp_jax.model import init_model  # noqa: E402


def _time_ours(model, prompts, new_tokens, max_length, repeats):
    generate(model, prompts, max_new_tokens=new_tokens, max_length=max_length)  # compile
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = generate(model, prompts, max_new_tokens=new_tokens, max_length=max_length)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def _time_hf(hf_model, prompts, new_tokens, repeats):
    import torch

    ids = torch.tensor(prompts)  # equal-length prompts: no padding needed
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf_model.generate(ids, **kwargs)  # warm-up
        times, out = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf_model.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
    return float(np.median(times)), out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["small", "deepseek-v3-small"])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    max_length = args.prompt_tokens + args.new_tokens + 8
    rows = []
    for preset in args.presets:
        config = ModelConfig.from_name(preset)
        model = init_model(config, seed=0)
        num_params = sum(x.size for x in jax.tree.leaves(model))
        rng = np.random.default_rng(0)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_checkpoint(model, tmp, overwrite=True)
            hf_model = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
            for batch in args.batch_sizes:
                prompts = rng.integers(0, config.vocab_size, (batch, args.prompt_tokens)).tolist()
                ours_s, ours = _time_ours(model, prompts, args.new_tokens, max_length, args.repeats)
                hf_s, hf_tokens = _time_hf(hf_model, prompts, args.new_tokens, args.repeats)
                same = ours.tokens[0] == hf_tokens[0]
                generated = batch * args.new_tokens
                rows.append(
                    dict(
                        preset=preset,
                        num_params=int(num_params),
                        batch=batch,
                        new_tokens=args.new_tokens,
                        mtp_jax_s=ours_s,
                        transformers_s=hf_s,
                        mtp_jax_tok_s=generated / ours_s,
                        transformers_tok_s=generated / hf_s,
                        speedup=hf_s / ours_s,
                        first_row_identical=same,
                    )
                )
                print(
                    f"{preset} batch {batch}: mtp_jax {generated / ours_s:.1f} tok/s, transformers "
                    f"{generated / hf_s:.1f} tok/s, first row identical: {same}",
                    flush=True,
                )

    meta = dict(
        benchmark="baseline_greedy_decode",
        date=str(date.today()),
        presets=args.presets,
        prompt_tokens=args.prompt_tokens,
        device=jax.devices()[0].device_kind,
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        jax=jax.__version__,
        torch=torch.__version__,
        dtype="float32",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"baseline_{meta['device'].replace(' ', '_')}_{meta['date']}.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(
        f"\nfp32, greedy, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, {meta['device']} "
        f"({meta['cpu_count']} cores), median of {args.repeats}\n"
    )
    print("| model | params | batch | mtp_jax tok/s | transformers tok/s | speedup | same tokens |")
    print("|---|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['num_params'] / 1e6:.1f}M | {r['batch']} | {r['mtp_jax_tok_s']:.1f} | "
            f"{r['transformers_tok_s']:.1f} | {r['speedup']:.2f}x |"
            f" {'yes' if r['first_row_identical'] else 'NO'} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
