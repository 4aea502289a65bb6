"""What a reduced draft vocabulary (`SpeculativeConfig.draft_vocab`) buys: eagle K=3 with its MTP passes'
head over N tokens against the whole vocabulary, step cost and acceptance, beside plain decoding.

Per model (the bundled demo model with its trained MTP module: real acceptance, its set the N most
frequent tokens of its training split, `frequent_tokens`; the medium preset with random weights: the
step's cost alone, acceptance ~1, its set the first N ids), batch and set size: engines in the default
setup (bf16 with the oneDNN extension when it is built), timed in their own loop (`DecodeEngine.run`,
prefill apart), interleaved over --rounds, fastest kept. `eagle/plain` is the step-time ratio, `speedup`
plain's time per generated token over eagle's; greedy tokens are checked equal to plain's.

    python benchmarks/bench_draft_vocab.py [--models demo medium] [--dtype bfloat16] [--batch-sizes 1 8]
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_dtype import models
from bench_onednn import run_once  # this directory is on sys.path when run as a script
from report import load_average, run_models

import mtp_jax
from mtp_jax.decode.draft_vocab import frequent_tokens
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.layers import onednn
from mtp_jax.training import data

SIZES = {"demo": (512, 1024, 2048), "medium": (2048, 8192)}


def model_and_sets(name: str, dtype: str) -> tuple:
    """(model, {N: draft vocabulary}, prompts source): the demo model's sets from its training split."""
    if name == "demo":
        model, tokenizer = mtp_jax.load_pretrained(dtype=dtype)
        train, _ = data.split_documents(data.stdlib_documents())
        texts = list(train.values())[:400]
        counts = [tokenizer.encode(t).ids for t in texts]
        sets = {n: frequent_tokens(counts, n) for n in SIZES[name]}
        return model, sets, lambda batch, length: data.heldout_prompts(tokenizer, batch, length)
    model = models(name)[dtype]
    rng = np.random.default_rng(0)
    sets = {n: tuple(range(n)) for n in SIZES[name]}
    return model, sets, lambda batch, length: rng.integers(3, model.config.vocab_size, (batch, length)).tolist()


def run_model(name: str, args) -> list[dict]:
    model, sets, prompts_of = model_and_sets(name, args.dtype)
    capacity, rows = args.prompt_tokens + args.new_tokens + 16, []
    specs = {"plain": None, "eagle3": SpeculativeConfig(method="eagle", num_speculative_tokens=3)}
    specs |= {
        f"eagle3 dv{n}": SpeculativeConfig(method="eagle", num_speculative_tokens=3, draft_vocab=s)
        for n, s in sets.items()
    }
    for batch in args.batch_sizes:
        prompts = prompts_of(batch, args.prompt_tokens)
        engines = {k: DecodeEngine(model, s) for k, s in specs.items()}
        results = {k: run_once(e, prompts, args.new_tokens, capacity) for k, e in engines.items()}  # compile
        best = {k: [float("inf")] * 3 for k in engines}
        for _ in range(args.rounds):
            for k, e in engines.items():
                results[k] = run_once(e, prompts, args.new_tokens, capacity)
                best[k] = [min(a, b) for a, b in zip(best[k], results[k][:3], strict=True)]
        plain_step, plain_token = best["plain"][1], best["plain"][2]
        for k in engines:
            _, step, token = best[k]
            tokens = sum(len(r) for r in results[k][4])
            rows.append(
                dict(
                    model=name,
                    dtype=args.dtype,
                    batch=batch,
                    config=k,
                    draft_vocab=len(specs[k].draft_vocab) if specs[k] and specs[k].draft_vocab else None,
                    step_ms=step * 1e3,
                    token_ms=token * 1e3,
                    step_vs_plain=step / plain_step,
                    speedup=plain_token / token,
                    acceptance_length=tokens / batch / results[k][3] if k != "plain" else None,
                    equals_plain=results[k][4] == results["plain"][4],
                    load_average=load_average(),
                )
            )
            r = rows[-1]
            print(
                f"{name} b{batch} {k:16s} {r['step_ms']:7.2f} ms/step  x{r['step_vs_plain']:.2f} plain  "
                f"speedup {r['speedup']:.2f}x  equal {r['equals_plain']}",
                flush=True,
            )
        args.on_row(rows)
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"eagle K=3 with a reduced draft vocabulary (`dvN`: the MTP head over N tokens) on {meta['cpu']} "
        f"({meta['cores']} cores, shared), {meta['date']}, jax {meta['jax']}, {meta['dtype']} (matmuls in oneDNN for: "
        f"{meta['onednn'] or 'none'}), load average {meta['load_average']} at start. ms per step in "
        f"`DecodeEngine.run` ({meta['new_tokens']} new tokens after {meta['prompt_tokens']} prompt tokens), fastest "
        f"of {meta['rounds']} interleaved rounds. Acceptance length: tokens per step (the first token of the "
        "prefill counted in).",
        "",
        "| model | batch | config | ms/step | step / plain step | speedup over plain | acceptance length "
        "| tokens = plain |",
        "|---|---:|---|---:|---:|---:|---:|:---:|",
    ]
    for r in rows:
        accept = "-" if r["acceptance_length"] is None else f"{r['acceptance_length']:.2f}"
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['config']} | {r['step_ms']:.2f} | {r['step_vs_plain']:.2f} "
            f"| {r['speedup']:.2f}x | {accept} | {'yes' if r['equals_plain'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["demo", "medium"], choices=sorted(SIZES))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    fields = dict(
        dtype=args.dtype,
        onednn=", ".join(onednn.routed_dtypes()),
        new_tokens=args.new_tokens,
        prompt_tokens=args.prompt_tokens,
        rounds=args.rounds,
    )
    run_models(args, "draft_vocab", fields, markdown, run_model)


if __name__ == "__main__":
    main()
