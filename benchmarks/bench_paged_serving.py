"""Paged KV caches in the serving engine: dense slots against pages, prefix caching, step time vs length.

Engine level (`mtp_jax.serving.ServingEngine`, no HTTP server), the bundled demo model (fp32 or --dtype, greedy,
eagle drafting with K = --k), prompts cut from the held-out stdlib files' token ids (distinct slices of
one stream), every request with `ignore_eos` and a fixed max_tokens. With --max-length above the demo's
1024 positions its config is widened (default rope, computed per position): the weights are the trained
ones, but past 1024 positions the drafts are accepted less often than the model was trained for.

Four parts (each optional, --parts):

1. ``mix``: the same KV memory budget of M = --budget-rows x max_length tokens, served by
   ``dense`` (the old dense slots: max_batch = M // max_length rows, each with max_length positions,
   one block-table width) and ``paged`` (max_batch = --paged-batch, M // page_size pages, the default
   widths). The same requests (most short, a few long), all queued at t = 0 (offline, so TTFT includes
   queueing): the most requests running at once (after a step; counts the one being prefilled) and
   the most rows decoded in one step, output tokens/s over the wall time, TTFT mean / p50 / p90,
   preemptions, peak KV usage, mean acceptance length tau.
2. ``prefix``: a shared system prompt of --system-tokens tokens and distinct user suffixes, requests
   arriving one after another (each served to its end before the next): TTFT with prefix caching on
   against off (the first request, cold, separately), hits / queries (prompt tokens).
3. ``steps``: --step-rows running rows with prompts of each of --lengths tokens: the median time of an
   engine step while only decoding (steps with prefill work excluded), --repeats runs, for ``paged``
   (default widths), ``dense-like`` (the same max_batch and pages, one width: max_length) and ``dense``
   (part 1's engine). A step computes every one of max_batch rows at its width, running or not.
4. ``adaptive``: ``off`` (no speculation), eagle with ``fixed`` K = --spec-k and ``adaptive`` k (0 .. K per step,
   learnt afresh every run), max_length --spec-length, max_batch --spec-batch. The same requests, c in flight
   (closed loop) until max(2c, --spec-requests) are served, c in --concurrency and 2 x max_batch; --spec-tokens
   outputs, greedy or sampled (--temperatures; drafts sampled too). Settings alternate, --spec-repeats runs: tok/s
   (median, spread), the best, tau (1 + accepted / decode steps), accepted per draft, adaptive's k per output.

Every engine is warmed up (`warm_up`, timed too) before it is measured; the CPU is shared with whatever
else runs, so compare ratios within one run. `--smoke` runs tiny sizes (~8 minutes on 2 cores, half of it
part 4's five warm-ups).

    python benchmarks/bench_paged_serving.py [--smoke] [--parts mix prefix steps adaptive] [--out benchmarks/results]

Writes paged_serving_<device>_<date>[_smoke].json and .md under --out and prints the tables.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import os
import platform
import time
from datetime import date

import jax
import numpy as np
from report import cpu_name, write_report  # this directory is on sys.path when run as a script

import mtp_jax
from mtp_jax.serving import ServingEngine
from mtp_jax.training import data

FULL = dict(
    max_length=4096, budget_rows=4, paged_batch=16, page_size=16, prefill_chunk=64, k=2,
    num_short=28, num_long=4, short_prompt=(32, 128), long_prompt=(2400, 3200), max_tokens=64,
    system_tokens=1024, suffix_tokens=32, prefix_requests=6, prefix_max_tokens=8,
    lengths=[32, 128, 512, 2048], step_rows=2, step_tokens=24, repeats=3,
    spec_length=1024, spec_batch=8, spec_k=3, concurrency=[1, 4, 16], spec_requests=8, spec_prompt=(16, 64),
    spec_tokens=64, temperatures=[0, 1], spec_repeats=3,
)  # fmt: skip
SMOKE = dict(
    FULL, max_length=256, paged_batch=8, num_short=8, num_long=2, short_prompt=(16, 48),
    long_prompt=(150, 200), max_tokens=16, system_tokens=128, suffix_tokens=16, prefix_requests=3,
    prefix_max_tokens=4, lengths=[32, 128], step_tokens=8, repeats=2, spec_length=128, spec_batch=4,
    concurrency=[1, 2], spec_requests=4, spec_prompt=(8, 24), spec_tokens=16, spec_repeats=1,
)  # fmt: skip


class TokenStream:
    """Consecutive, distinct slices of the held-out stdlib files' token ids (cycled if they run out)."""

    def __init__(self, tokenizer, need: int):
        _, heldout = data.split_documents(data.stdlib_documents())
        self.ids: list[int] = []
        for name in sorted(heldout):
            self.ids += tokenizer.encode(heldout[name]).ids
            if len(self.ids) >= need:
                break
        self.cursor = 0

    def take(self, n: int) -> list[int]:
        out = [self.ids[(self.cursor + i) % len(self.ids)] for i in range(n)]
        self.cursor += n
        return out


PARTS = ("mix", "prefix", "steps", "adaptive")


def build(model, spec, tokenizer, args, *, batch: int, buckets, caching=False, length=None, policy="fixed"):
    """A warmed-up engine over the budget's pages (`length`: max_length, pages for all rows); (it, warm-up s)."""
    max_pages = -(-(length or args.max_length) // args.page_size)
    engine = ServingEngine(
        model,
        spec,
        tokenizer=tokenizer,
        max_batch=batch,
        max_length=length or args.max_length,
        num_pages=(batch if length else args.budget_rows) * max_pages,
        speculative_policy=policy,
        page_size=args.page_size,
        prefix_caching=caching,
        page_buckets=None if buckets is None else tuple(max_pages if w == "max" else w for w in buckets),
        prefill_chunk=args.prefill_chunk,
        max_queue=4096,
    )
    start = time.perf_counter()
    engine.warm_up()
    return engine, time.perf_counter() - start


def ttft_stats(ttfts: list[float]) -> dict:
    a = np.asarray(ttfts) * 1e3
    return dict(
        ttft_mean_ms=float(a.mean()), ttft_p50_ms=float(np.percentile(a, 50)), ttft_p90_ms=float(np.percentile(a, 90))
    )


def serve_mix(engine, requests: list[list[int]], max_tokens: int) -> dict:
    """All `requests` queued at once and served to the end; throughput, concurrency and TTFT."""
    engine.pages.hits = engine.pages.queries = 0
    preempted_before = engine.num_preemptions
    start = time.perf_counter()
    for prompt in requests:
        engine.add_request(prompt, max_tokens=max_tokens, ignore_eos=True)
    finished, steps_seen = [], {}
    max_running = max_decoding = decode_steps = decoded_rows = steps = 0
    peak_usage = 0.0
    while engine.has_unfinished():
        outputs = engine.step()
        steps += 1
        decoding = 0
        for out in outputs:  # a decode output advanced its request's step count; a first token did not
            decoding += out.metrics.num_steps != steps_seen.get(out.request_id, 0)
            steps_seen[out.request_id] = out.metrics.num_steps
        max_running = max(max_running, engine.num_running)
        max_decoding = max(max_decoding, decoding)
        decode_steps, decoded_rows = decode_steps + (decoding > 0), decoded_rows + decoding
        peak_usage = max(peak_usage, engine.kv_cache_usage)
        finished += [out for out in outputs if out.finished]
    wall = time.perf_counter() - start
    tokens = sum(out.completion_tokens for out in finished)
    verify = sum(out.metrics.num_steps for out in finished)
    accepted = sum(out.metrics.num_accepted for out in finished)
    return dict(
        requests=len(finished),
        output_tokens=tokens,
        wall_s=wall,
        tok_s=tokens / wall,
        max_running=max_running,
        max_decoding=max_decoding,
        mean_decoding=decoded_rows / max(decode_steps, 1),
        steps=steps,
        preemptions=engine.num_preemptions - preempted_before,
        peak_kv_usage=peak_usage,
        tau=1 + accepted / max(verify, 1),
        **ttft_stats([out.metrics.ttft for out in finished]),
    )


def serve_sequential(engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """Each prompt served to its end before the next arrives; their TTFTs (seconds)."""
    ttfts = []
    for prompt in prompts:
        rid = engine.add_request(prompt, max_tokens=max_tokens, ignore_eos=True)
        while engine.has_unfinished():
            ttfts += [out.metrics.ttft for out in engine.step() if out.finished and out.request_id == rid]
    return ttfts


def serve_closed_loop(engine, prompts: list[list[int]], max_tokens: int, concurrency: int, temperature: int):
    """`concurrency` requests in flight (the next one added as one finishes) until all `prompts` are served;
    (output tok/s, the finished outputs, decode outputs per number of drafts their step verified)."""
    engine.speculation.reset()  # (adaptive) learns afresh: a run does not depend on the runs before it
    finished, steps_seen, drafts, added, start = [], {}, collections.Counter(), 0, time.perf_counter()
    while added < len(prompts) or engine.has_unfinished():
        for i in range(added, min(len(prompts), len(finished) + concurrency)):
            sampling = mtp_jax.SamplingParams(temperature=float(temperature), seed=i) if temperature else None
            engine.add_request(prompts[i], max_tokens=max_tokens, sampling=sampling, ignore_eos=True)
            added += 1
        for out in engine.step():
            if out.metrics.num_steps != steps_seen.get(out.request_id, 0):  # a decode output, not a first token
                drafts[out.num_drafts] += 1
                steps_seen[out.request_id] = out.metrics.num_steps
            finished += [out] if out.finished else []
    return sum(out.completion_tokens for out in finished) / (time.perf_counter() - start), finished, drafts


def summarize(runs: list[tuple]) -> dict:
    """One setting's runs of one cell: median tok/s and the runs' spread, tau, acceptance, chosen-k shares."""
    tok_s, metrics = [r[0] for r in runs], [out.metrics for r in runs for out in r[1]]
    steps, drafts, accepted = np.sum([(m.num_steps, m.num_drafts, m.num_accepted) for m in metrics], axis=0).tolist()
    outputs, median = sum((r[2] for r in runs), collections.Counter()), float(np.median(tok_s))
    return dict(
        requests=len(runs[0][1]), tok_s=median, tok_s_runs=tok_s, spread=(max(tok_s) - min(tok_s)) / median,
        tau=1 + accepted / max(steps, 1), accept_rate=accepted / max(drafts, 1),
        k_share={k: n / sum(outputs.values()) for k, n in sorted(outputs.items())},
    )  # fmt: skip


def decode_step_times(engine, prompts: list[list[int]], max_tokens: int, repeats: int) -> list[float]:
    """Seconds of each engine step once every row has its first token (no prefill work left)."""
    times = []
    for _ in range(repeats):
        ids = {engine.add_request(p, max_tokens=max_tokens, ignore_eos=True) for p in prompts}
        started: set[str] = set()
        while engine.has_unfinished():
            prefilling = started != ids
            begin = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - begin
            if not prefilling:
                times.append(elapsed)
            started |= {out.request_id for out in outputs}
    return times


def markdown(meta: dict, mix: list[dict], prefix: list[dict], steps: list[dict], adaptive: list[dict]) -> str:
    a = meta["args"]
    lines = [
        f"# Paged KV serving, {meta['model']}, {meta['cpu']} ({meta['cores']} cores), jax {meta['jax']}, "
        f"{meta['date']}",
        "",
        f"{a['dtype']}, greedy, eagle K={a['k']}, max_length {a['max_length']}, page_size {a['page_size']}, "
        f"prefill_chunk {a['prefill_chunk']}; KV budget M = {a['budget_rows']} x {a['max_length']} = "
        f"{meta['kv_tokens']} tokens. Shared CPU: compare within a table.",
        "",
    ]
    if mix:
        r0 = mix[0]
        lines += [
            f"## 1. Dense slots vs pages, same KV budget ({r0['requests']} requests queued at t=0: {a['num_short']} "
            f"short, prompts {a['short_prompt'][0]}-{a['short_prompt'][1]} tokens, {a['num_long']} long, "
            f"{a['long_prompt'][0]}-{a['long_prompt'][1]}; {a['max_tokens']} output tokens each)",
            "",
            "| engine | max_batch | pages | widths (pages) | max running | max decoding | mean decoding | "
            "output tok/s | wall s | TTFT mean ms | p50 | p90 | preemptions | peak KV use | tau | warm-up s |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['engine']} | {r['max_batch']} | {r['num_pages']} | {r['buckets']} | {r['max_running']} | "
            f"{r['max_decoding']} | {r['mean_decoding']:.1f} | {r['tok_s']:.1f} | {r['wall_s']:.1f} | "
            f"{r['ttft_mean_ms']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} | {r['preemptions']} | "
            f"{r['peak_kv_usage']:.0%} | {r['tau']:.2f} | {r['warm_up_s']:.0f} |"
            for r in mix
        ]
        lines.append("")
    if prefix:
        lines += [
            f"## 2. Shared system prompt ({a['system_tokens']} tokens + {a['suffix_tokens']}-token distinct "
            f"suffixes, {a['prefix_requests']} requests one after another, {a['prefix_max_tokens']} output "
            f"tokens each; paged engine, max_batch {a['paged_batch']})",
            "",
            "| prefix caching | TTFT first (cold) ms | TTFT later mean ms | later p50 | later max | hits / queries "
            "(tokens) | hit rate |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {'on' if r['prefix_caching'] else 'off'} | {r['ttft_first_ms']:.0f} | {r['ttft_later_mean_ms']:.0f} | "
            f"{r['ttft_later_p50_ms']:.0f} | {r['ttft_later_max_ms']:.0f} | {r['hits']} / {r['queries']} | "
            f"{r['hit_rate']:.0%} |"
            for r in prefix
        ]
        lines.append("")
    if steps:
        lines += [
            f"## 3. Decode step time vs tokens held ({a['step_rows']} running rows, prompt of L tokens, "
            f"{a['step_tokens']} output tokens, decode-only steps, {a['repeats']} runs; median ms, "
            "in brackets the width read per row, positions)",
            "",
            "| L | " + " | ".join(dict.fromkeys(r["engine"] for r in steps)) + " |",
            "|---:|" + "---:|" * len(dict.fromkeys(r["engine"] for r in steps)),
        ]
        for length in a["lengths"]:
            cells = [f"{r['median_ms']:.1f} ({r['width_positions']})" for r in steps if r["length"] == length]
            lines.append(f"| {length} | " + " | ".join(cells) + " |")
        lines.append("")
    k, shown = a["spec_k"], ("off", "fixed", "adaptive")
    for t in dict.fromkeys(r["temperature"] for r in adaptive):
        by = {(r["concurrency"], r["setting"]): r for r in adaptive if r["temperature"] == t}
        warm = ", ".join(f"{r['setting']} {r['warm_up_s']:.0f}" for r in list(by.values())[:3])
        lines += [
            f"## 4. Speculation off / fixed K={k} / adaptive, {f'temperature {t}, drafts sampled' if t else 'greedy'} "
            f"(max_length {a['spec_length']}, max_batch {a['spec_batch']}, {a['spec_tokens']} output tokens; tok/s: "
            f"median of {a['spec_repeats']} runs; warm-up s: {warm})",
            "",
            "| c | requests | off tok/s | fixed tok/s | adaptive tok/s | best | adaptive / best other | spread | tau "
            f"fixed | adaptive | accepted / draft fixed | adaptive | adaptive k = {'/'.join(map(str, range(k + 1)))} |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for c in dict.fromkeys(c for c, _ in by):
            off, fixed, adapt = cell = [by[c, name] for name in shown]
            values = [
                c, off["requests"], *(f"{r['tok_s']:.1f}" for r in cell), max(shown, key=lambda n: by[c, n]["tok_s"]),
                f"{adapt['tok_s'] / max(off['tok_s'], fixed['tok_s']):.2f}", f"{max(r['spread'] for r in cell):.0%}",
                *(f"{r[key]:.2f}" for key in ("tau", "accept_rate") for r in (fixed, adapt)),
                "/".join(f"{adapt['k_share'].get(j, 0):.0%}" for j in range(k + 1)),
            ]  # fmt: skip
            lines.append("| " + " | ".join(map(str, values)) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script in minutes")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute")
    parser.add_argument("--out", default="benchmarks/results")
    for name, value in FULL.items():  # sizes: defaults from FULL (or SMOKE with --smoke)
        kind = dict(type=int, nargs="+" if isinstance(value, list) else 2) if isinstance(value, list | tuple) else {}
        parser.add_argument(f"--{name.replace('_', '-')}", default=None, **(kind or dict(type=int)))
    args = parser.parse_args()
    for name, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    begin = time.perf_counter()

    model, tokenizer = mtp_jax.load_pretrained(dtype=args.dtype)
    trained_positions = model.config.max_position_embeddings
    if args.max_length > trained_positions:
        if model.config.rope_scaling.rope_type != "default":
            raise SystemExit(f"--max-length {args.max_length} > {trained_positions} needs default rope")
        model.config = dataclasses.replace(model.config, max_position_embeddings=args.max_length)
    spec = mtp_jax.SpeculativeConfig(method="eagle", num_speculative_tokens=args.k)
    rng = np.random.default_rng(args.seed)
    need = args.num_short * args.short_prompt[1] + args.num_long * args.long_prompt[1]
    need += args.system_tokens + args.prefix_requests * args.suffix_tokens + args.step_rows * sum(args.lengths)
    concurrency = sorted({*args.concurrency, 2 * args.spec_batch})
    need += sum(max(2 * c, args.spec_requests) for c in concurrency) * args.spec_prompt[1]
    stream = TokenStream(tokenizer, need)
    max_pages = -(-args.max_length // args.page_size)
    mix, prefix, steps, adaptive = [], [], [], []

    def describe(name, engine, warm):
        return dict(
            engine=name,
            max_batch=engine.max_batch,
            num_pages=engine.num_pages,
            buckets=engine.paging.buckets,
            warm_up_s=warm,
        )

    def step_rows(name, engine, warm):
        for length in args.lengths:
            prompts = [stream.take(length) for _ in range(args.step_rows)]
            times = decode_step_times(engine, prompts, args.step_tokens, args.repeats)
            width = engine.paging.width(engine.paging.reach(length)) * args.page_size
            row = describe(name, engine, warm) | dict(length=length, median_ms=float(np.median(times)) * 1e3)
            steps.append(
                row | dict(width_positions=width, steps=len(times), p90_ms=float(np.percentile(times, 90)) * 1e3)
            )
            print(f"steps {name} L={length}: {row['median_ms']:.1f} ms (width {width}, {len(times)} steps)", flush=True)

    engines = [("dense", args.budget_rows, ("max",)), ("paged", args.paged_batch, None)]
    if "mix" in args.parts:
        long_at = set(np.linspace(0, args.num_short + args.num_long - 1, args.num_long, endpoint=False).astype(int))
        requests = [
            stream.take(int(rng.integers(*(args.long_prompt if i in long_at else args.short_prompt))))
            for i in range(args.num_short + args.num_long)
        ]
    for name, batch, buckets in engines if {"mix", "steps"} & set(args.parts) else []:
        engine, warm = build(model, spec, tokenizer, args, batch=batch, buckets=buckets)
        print(f"{name}: warm-up {warm:.1f} s, widths {engine.paging.buckets}", flush=True)
        if "mix" in args.parts:
            mix.append(describe(name, engine, warm) | serve_mix(engine, requests, args.max_tokens))
            print(f"mix {name}: {mix[-1]}", flush=True)
        if "steps" in args.parts:
            step_rows(f"{name} B={batch}", engine, warm)
        del engine
        gc.collect()
    if "steps" in args.parts:
        engine, warm = build(model, spec, tokenizer, args, batch=args.paged_batch, buckets=("max",))
        step_rows(f"dense-like B={args.paged_batch}", engine, warm)
        del engine
        gc.collect()
        order = [f"dense-like B={args.paged_batch}", f"paged B={args.paged_batch}", f"dense B={args.budget_rows}"]
        steps.sort(key=lambda r: (order.index(r["engine"]), r["length"]))

    if "prefix" in args.parts:
        system = stream.take(args.system_tokens)
        prompts = [system + stream.take(args.suffix_tokens) for _ in range(args.prefix_requests)]
        for caching in (False, True):
            engine, warm = build(model, spec, tokenizer, args, batch=args.paged_batch, buckets=None, caching=caching)
            engine.pages.hits = engine.pages.queries = 0
            ttfts = np.asarray(serve_sequential(engine, prompts, args.prefix_max_tokens)) * 1e3
            prefix.append(
                dict(
                    prefix_caching=caching,
                    warm_up_s=warm,
                    ttft_ms=ttfts.tolist(),
                    ttft_first_ms=float(ttfts[0]),
                    ttft_later_mean_ms=float(ttfts[1:].mean()),
                    ttft_later_p50_ms=float(np.median(ttfts[1:])),
                    ttft_later_max_ms=float(ttfts[1:].max()),
                    hits=engine.pages.hits,
                    queries=engine.pages.queries,
                    hit_rate=engine.pages.hits / max(engine.pages.queries, 1),
                )
            )
            print(f"prefix caching {caching}: {prefix[-1]}", flush=True)
            del engine
            gc.collect()

    if "adaptive" in args.parts:
        lengths = {c: rng.integers(*args.spec_prompt, size=max(2 * c, args.spec_requests)) for c in concurrency}
        cells = {c: [stream.take(int(n)) for n in ns] for c, ns in lengths.items()}
        eagle = mtp_jax.SpeculativeConfig(method="eagle", num_speculative_tokens=args.spec_k)
        size = dict(batch=args.spec_batch, buckets=None, length=args.spec_length)
        off = build(model, None, tokenizer, args, **size)
        for t in args.temperatures:
            spec = dataclasses.replace(eagle, draft_sampling="sample") if t else eagle
            engines = dict(off=off)
            for policy in ("fixed", "adaptive"):
                engines[policy] = build(model, spec, tokenizer, args, **size, policy=policy)
            for c in concurrency:
                runs = {name: [] for name in engines}
                for _ in range(args.spec_repeats):  # the settings alternate, so drifting load hits each alike
                    for name, (engine, _) in engines.items():
                        runs[name].append(serve_closed_loop(engine, cells[c], args.spec_tokens, c, t))
                adaptive += [
                    dict(temperature=t, concurrency=c, setting=name, warm_up_s=warm) | summarize(runs[name])
                    for name, (_, warm) in engines.items()
                ]
                print(f"adaptive t={t} c={c}: {adaptive[-3:]}", flush=True)

    device = jax.devices()[0].device_kind
    meta = dict(
        benchmark="paged_serving",
        date=str(date.today()),
        device=device,
        cpu=cpu_name(),
        processor=platform.processor() or platform.machine(),
        cores=os.cpu_count(),
        platform=platform.platform(),
        jax=jax.__version__,
        model=f"demo ({trained_positions} trained positions, widened to {args.max_length})"
        if args.max_length > trained_positions
        else "demo",
        kv_tokens=args.budget_rows * max_pages * args.page_size,
        args={k: v for k, v in vars(args).items() if k != "out"},
        total_s=time.perf_counter() - begin,
    )
    rows = [dict(part="mix", **r) for r in mix] + [dict(part="prefix", **r) for r in prefix]
    rows += [dict(part="steps", **r) for r in steps] + [dict(part="adaptive", **r) for r in adaptive]
    some = "" if set(args.parts) == set(PARTS) else "_" + "_".join(args.parts)  # (one part's run keeps the others')
    name = f"paged_serving{some}_{device.replace(' ', '_')}_{meta['date']}" + ("_smoke" if args.smoke else "")
    name += "" if args.dtype == "float32" else f"_{args.dtype}"
    table = markdown(meta, mix, prefix, steps, adaptive)
    write_report(args.out, name, meta, rows, table + f"\nTotal run time {meta['total_s']:.0f} s.\n")


if __name__ == "__main__":
    main()
