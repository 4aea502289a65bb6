"""Draft quality before and after self-distilled MTP-head fine-tuning, on the same trunk, in one run.

For each model directory given (e.g. the demo model before and after `mtp-jax distill-data` + `mtp-jax train
--mtp-only --mtp-targets self`), on held-out prompts (the first tokens of held-out standard-library files)
and on the README's prompt:

- simulated acceptance (`mtp_jax.training.loss.simulated_acceptance`: one teacher-forced forward over the
  model's own greedy continuations of the prompts; per depth k, the rate at which drafts 1..k all agree
  with the main head) and the mean acceptance length it implies, for MTP Vanilla (depths 1..D) and MTP
  Eagle (module 1 chained);
- live acceptance of strict-greedy speculative decoding (vLLM's metrics: per-position acceptance rates,
  mean acceptance length tau) at K = 1..3, eagle and vanilla, outputs asserted equal to plain greedy;
- decode speedup over plain greedy (tokens/s, interleaved repeats, best of each) at batch 1 and 8.

Writes JSON and markdown under --out, named with the device and date.

    python benchmarks/bench_self_distill.py BASE_DIR TUNED_DIR [--labels before after] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from report import cpu_name  # this directory is on sys.path when run as a script

from mtp_jax.checkpoints.pretrained import load_pretrained
from mtp_jax.decode.generation import generate
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.mtp import mtp_eagle_forward_full
from mtp_jax.training import data
from mtp_jax.training.loss import simulated_acceptance, simulated_acceptance_length

README_PROMPT = "def parse_args(argv):"
README_NEW_TOKENS = 64  # `mtp-jax generate`'s default, as the README's command runs it


def methods(depth: int, max_k: int) -> list[tuple[str, int]]:
    return [("vanilla", k) for k in range(1, min(depth, max_k) + 1)] + [("eagle", k) for k in range(1, max_k + 1)]


def simulated(model, prompts: list[list[int]], continuations: list[list[int]], eagle_steps: int) -> dict:
    """Simulated acceptance pooled over the generated rows of each prompt's greedy trace."""
    sums: dict[str, float] = {}
    for prompt, generated in zip(prompts, continuations, strict=True):
        trace = jnp.asarray([prompt + generated], jnp.int32)
        rows = np.zeros(trace.shape, np.int32)
        rows[0, len(prompt) - 1 :] = 1  # the rows a live step can start from
        rows = jnp.asarray(rows)
        logits, hidden = model.forward_full(trace, jnp.ones_like(trace))
        main_pred = jnp.argmax(logits, axis=-1)
        depths, eagle = mtp_eagle_forward_full(model, hidden, trace, jnp.ones_like(trace), eagle_steps=eagle_steps)
        metrics = simulated_acceptance(main_pred, depths, rows, prefix="vanilla")
        metrics.update(simulated_acceptance(main_pred, eagle, rows, prefix="eagle"))
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + float(value) / len(prompts)
    out = {name: round(value, 4) for name, value in sums.items()}
    for prefix, steps in (("vanilla", len(depths)), ("eagle", eagle_steps)):
        for k in range(1, steps + 1):
            out[f"{prefix}_acceptance_length_{k}"] = round(simulated_acceptance_length(sums, k, prefix), 4)
    return out


def best_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run().tokens)
        times.append(time.perf_counter() - start)
    return min(times)


def live(model, prompts, new_tokens: int, max_k: int, repeats: int, timed: bool) -> tuple[list[dict], list]:
    """Live acceptance (and, if `timed`, speedup over plain greedy) of every method and K on `prompts`, and
    the plain greedy continuations."""
    max_length = max(len(p) for p in prompts) + new_tokens + max_k + 2
    kwargs = dict(max_new_tokens=new_tokens, max_length=max_length)
    plain = generate(model, prompts, **kwargs)
    runs = {None: lambda: generate(model, prompts, **kwargs)}
    rows = []
    for method, k in methods(model.config.num_nextn_predict_layers, max_k):
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
        result = generate(model, prompts, speculative=spec, **kwargs)
        assert result.tokens == plain.tokens, (method, k)  # lossless: greedy speculative == plain greedy
        m = result.metrics
        rows.append(
            {
                "method": method,
                "k": k,
                "mean_acceptance_length": round(m.mean_acceptance_length, 4),
                "acceptance_rate_per_position": [round(r, 4) for r in m.acceptance_rate_per_position],
            }
        )
        runs[(method, k)] = lambda spec=spec: generate(model, prompts, speculative=spec, **kwargs)
    if timed:
        best = {key: float("inf") for key in runs}
        for _ in range(repeats):  # interleaved: the machine's load drifts alike for every variant
            for key, run in runs.items():
                best[key] = min(best[key], best_seconds(run, 1))
        for row in rows:
            row["speedup"] = round(best[None] / best[(row["method"], row["k"])], 3)
        plain_tps = plain.num_generated / best[None]
        for row in rows:
            row["plain_tokens_per_second"] = round(plain_tps, 1)
    return rows, plain.tokens


def bench_model(path: str, label: str, args) -> dict:
    model, tokenizer = load_pretrained(path)
    readme = [tokenizer.encode(README_PROMPT).ids]
    heldout = data.heldout_prompts(tokenizer, args.num_prompts, args.prompt_tokens)
    out = {"label": label, "model": str(path), "num_prompts": len(heldout)}
    for name, prompts, new_tokens in (("readme", readme, README_NEW_TOKENS), ("heldout", heldout, args.new_tokens)):
        rows, continuations = live(model, prompts, new_tokens, args.max_k, args.repeats, timed=False)
        out[f"{name}_live"] = rows
        out[f"{name}_simulated"] = simulated(model, prompts, continuations, args.max_k)
    out["speed"] = {}
    for batch in args.batch_sizes:
        rows, _ = live(model, heldout[:batch], args.new_tokens, args.max_k, args.repeats, timed=True)
        out["speed"][str(batch)] = [
            {k: r[k] for k in ("method", "k", "speedup", "plain_tokens_per_second")} for r in rows
        ]
    jax.clear_caches()
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Self-distilled MTP heads: before / after ({meta['device']}, {meta['date']})", ""]
    lines.append(f"{meta['cpu']}; {meta['new_tokens']} new tokens per prompt, greedy; load: {meta['load']}")
    parts = (
        ("readme", f"README prompt {README_PROMPT!r}, {README_NEW_TOKENS} new tokens"),
        ("heldout", f"{meta['num_prompts']} held-out prompts of {meta['prompt_tokens']} tokens"),
    )
    for part, title in parts:
        lines += ["", f"## {title}", "", "| model | method | K | live tau | live per-position | simulated tau |"]
        lines.append("|---|---|---:|---:|---|---:|")
        for r in results:
            for row in r[f"{part}_live"]:
                sim = r[f"{part}_simulated"].get(f"{row['method']}_acceptance_length_{row['k']}")
                per = " / ".join(f"{x:.2f}" for x in row["acceptance_rate_per_position"])
                lines.append(
                    f"| {r['label']} | {row['method']} | {row['k']} | {row['mean_acceptance_length']:.2f} | {per} "
                    f"| {sim:.2f} |"
                )
    lines += ["", "## Decode speedup over plain greedy (held-out prompts)", ""]
    lines += ["| model | batch | method | K | speedup | plain tokens/s |", "|---|---:|---|---:|---:|---:|"]
    for r in results:
        for batch, rows in r["speed"].items():
            for row in rows:
                lines.append(
                    f"| {r['label']} | {batch} | {row['method']} | {row['k']} | {row['speedup']:.2f}x "
                    f"| {row['plain_tokens_per_second']:.0f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model directories (config.json, safetensors, tokenizer.json)")
    parser.add_argument("--labels", nargs="+", help="one label per model (default: the directory names)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--max-k", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="self_distill", help="the output files' stem")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    labels = args.labels or [Path(m).name for m in args.models]
    if len(labels) != len(args.models):
        parser.error(f"--labels: {len(labels)} labels for {len(args.models)} models")
    results = [bench_model(path, label, args) for path, label in zip(args.models, labels, strict=True)]
    device = jax.devices()[0].platform
    meta = {
        "device": device,
        "cpu": cpu_name(),
        "date": date.today().isoformat(),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "jax": jax.__version__,
        **{k: v for k, v in vars(args).items() if k not in ("models", "labels", "out")},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.name}_{device}_{meta['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = markdown(results, meta)
    stem.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
