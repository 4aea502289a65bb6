"""MTP speculative decoding against plain decoding, greedy, identical outputs asserted, in one run.

Three parts (each optional):

1. ``demo``: the bundled demo model (or --model DIR) on held-out prompts (the first tokens of
   held-out standard-library files) at each batch size: plain decoding against every method and K
   (1..D for vanilla and parallel, 1..5 for eagle): tokens/s, speedup, mean acceptance length tau,
   per-position acceptance rates.
2. ``cost``: the cost model of a step on the demo model at batch 1: r_K = time of a (K+1)-token main
   forward / a 1-token forward, c = one MTP draft forward / a 1-token forward, and the speculative
   step's time against the sum of its parts (verify forward + drafting); the bound
   tau / (r_K + K c) on the speedup and the fraction of it reached.
3. ``large``: random-weight models (the Llama-shaped preset "medium", ~200M parameters, and the
   DeepSeek-V3-shaped "deepseek-v3-small": MLA, MoE) with the oracle drafter, which replays the
   plain greedy output, so every draft is accepted: r_K and the speedup at full acceptance for
   K = 1..8, against the bound (K + 1) / r_K. The same script runs unchanged on a GPU, where this
   is the headline measurement.

Writes JSON and markdown under --out (named with the device and date) and a PNG plot of the
per-position acceptance.

    python benchmarks/bench_speculative.py [--parts demo cost large] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time
from datetime import date
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mtp_jax
from mtp_jax.cache import settle
from mtp_jax.decode import drafters
from mtp_jax.decode.engine import DecodeEngine
from mtp_jax.decode.generation import generate
from mtp_jax.decode.metrics import SpeculativeMetrics
from mtp_jax.decode.speculative import SpeculativeConfig
from mtp_jax.model import sequence_positions
from mtp_jax.training import data


def _median_time(fn, repeats):
    fn()  # warm-up (compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def methods_for(model, eagle_max: int) -> list[tuple[str, int]]:
    depth = model.config.num_nextn_predict_layers
    style = model.config.mtp_style
    if style == "parallel":
        return [("parallel", k) for k in range(1, depth + 1)]
    return [("vanilla", k) for k in range(1, depth + 1)] + [("eagle", k) for k in range(1, eagle_max + 1)]


def bench_demo(model, tokenizer, args) -> list[dict]:
    rows = []
    max_length = args.prompt_tokens + args.new_tokens + 16
    for batch in args.batch_sizes:
        prompts = data.heldout_prompts(tokenizer, batch, args.prompt_tokens)
        run = functools.partial(generate, model, prompts, max_new_tokens=args.new_tokens, max_length=max_length)
        plain_s, plain = _median_time(lambda run=run: run().tokens, args.repeats)
        plain = run()
        for method, k in methods_for(model, args.eagle_max_k):
            spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
            spec_s, _ = _median_time(lambda spec=spec, run=run: run(speculative=spec).tokens, args.repeats)
            result = run(speculative=spec)
            if result.tokens != plain.tokens:
                raise AssertionError(f"{method} K={k} batch {batch}: speculative output differs from plain greedy")
            m = result.metrics
            generated = plain.num_generated
            rows.append(
                dict(
                    batch=batch,
                    method=method,
                    k=k,
                    plain_tok_s=generated / plain_s,
                    spec_tok_s=generated / spec_s,
                    speedup=plain_s / spec_s,
                    tau=m.mean_acceptance_length,
                    acceptance_per_position=m.acceptance_rate_per_position,
                    accepted_length_histogram=m.accepted_length_histogram,
                    verify_steps=m.num_steps,
                )
            )
            print(
                f"demo batch {batch} {method:8s} K={k}: tau {m.mean_acceptance_length:.2f}, "
                f"speedup {plain_s / spec_s:.2f}x",
                flush=True,
            )
    return rows


def _looped_time(body, params, carry, steps: int, repeats: int) -> float:
    """Seconds per iteration of `carry = body(params, carry)` run `steps` times in one on-device loop.

    The parameters are an argument of the jitted loop, as in the decode loops: closed over, they
    would be compile-time constants, which XLA's CPU matmuls pre-pack (and whose unused outputs it
    prunes), making the parts look cheaper than they are inside a real step.
    """
    run = jax.jit(lambda p, c: jax.lax.fori_loop(0, steps, lambda _, x: body(p, x), c))
    jax.block_until_ready(run(params, carry))  # compile
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(run(params, carry))
        times.append(time.perf_counter() - begin)
    return float(np.median(times)) / steps


def _forward_timer(model, batch: int, prefix: int, capacity: int, steps: int = 20):
    """time(T): one main-model forward of T tokens on a cache holding `prefix` tokens, in a device loop, as a
    step's verify runs it: recurrent layers keep the state after each token, and one is selected."""
    graphdef, params = nnx.split(model)
    cache = model.init_cache(batch, capacity)

    def time_tokens(num: int, repeats: int) -> float:
        tokens = jnp.ones((batch, num), jnp.int32)
        positions = sequence_positions(batch, num, prefix)

        def body(params, carry):
            cache, acc = carry
            logits, _, new = nnx.merge(graphdef, params)(tokens, positions, cache, keep_candidates=True)
            return settle(new, jnp.full((batch,), num, jnp.int32)), acc + jnp.sum(logits)

        return _looped_time(body, params, (cache, jnp.float32(0)), steps, repeats)

    return time_tokens


def _draft_timer(model, spec: SpeculativeConfig, batch: int, prefix: int, capacity: int, steps: int = 20):
    """Seconds of `speculative.draft` alone (all K draft forwards) after a verify step, in a device loop."""
    graphdef, params = nnx.split(model)
    config = model.config
    draft_state = drafters.init_draft_state(model, spec, batch, capacity)
    width = spec.hidden_window or spec.num_speculative_tokens + 1
    hidden = jnp.zeros((batch, width, config.hidden_size), config.compute_dtype)
    lengths = jnp.full((batch,), prefix, jnp.int32)
    start = lengths - 1 - width if spec.hidden_window else lengths - 2
    tokens = jnp.ones((batch, capacity), jnp.int32)
    sampling = mtp_jax.decode.sampling.SamplingState.from_params([mtp_jax.SamplingParams()] * batch)
    metadata = mtp_jax.decode.sampling.SamplingMetadata.build(sampling, config.vocab_size)

    def body(params, carry):
        draft_state, acc = carry
        draft_state = drafters.draft(
            nnx.merge(graphdef, params), spec, metadata, tokens, draft_state, hidden, start, lengths
        )
        return draft_state, acc + draft_state.tokens.sum()

    return lambda repeats: _looped_time(body, params, (draft_state, jnp.int32(0)), steps, repeats)


def _module_timer(model, batch: int, prefix: int, capacity: int, steps: int = 20):
    """Seconds of one MTP module forward of one token on its cache (one draft forward), in a device loop."""
    graphdef, params = nnx.split(model)
    cache = model.mtp[0].init_cache(batch, capacity)
    hidden = jnp.zeros((batch, 1, model.config.hidden_size), model.config.compute_dtype)
    tokens, positions = jnp.ones((batch, 1), jnp.int32), sequence_positions(batch, 1, prefix)

    def body(params, carry):
        cache, acc = carry
        m = nnx.merge(graphdef, params)
        logits, _, new = m.mtp[0](hidden, tokens, positions, cache, embed=m.embed, head=m.head)
        return new, acc + jnp.sum(logits)

    return lambda repeats: _looped_time(body, params, (cache, jnp.float32(0)), steps, repeats)


def _timed_phases(prefill, loop, repeats: int) -> tuple[float, float, object]:
    """Median seconds of `state = prefill()` and of `loop(state)`, and the last run's final state.

    The first of repeats + 1 runs compiles and is not counted.
    """
    prefill_s, loop_s = [], []
    for i in range(repeats + 1):
        begin = time.perf_counter()
        state = jax.block_until_ready(prefill())
        middle = time.perf_counter()
        state = jax.block_until_ready(loop(state))
        if i:
            prefill_s.append(middle - begin)
            loop_s.append(time.perf_counter() - middle)
    return float(np.median(prefill_s)), float(np.median(loop_s)), state


def prefill_of(engine: DecodeEngine, prompts, new_tokens: int, capacity: int, **request):
    """A function returning a fresh state after `engine`'s prefill (for `engine.run`)."""

    def prefill():
        state, padded = engine.init_state(prompts, max_new_tokens=new_tokens, max_length=capacity, **request)
        return engine.prefill(state, padded)

    return prefill


def oracle_engine(model, k: int, prompts, plain_tokens, new_tokens: int, capacity: int):
    """Speculative decoding whose K drafts replay the plain greedy output `plain_tokens`: all accepted.

    Returns the engine and a function giving the state after its prefill (for `engine.run`).
    """
    reference = np.zeros((len(prompts), capacity), np.int32)
    for b, (p, t) in enumerate(zip(prompts, plain_tokens, strict=True)):
        reference[b, : len(p) + len(t)] = p + t
    engine = DecodeEngine(model, SpeculativeConfig(method="oracle", num_speculative_tokens=k))
    return engine, prefill_of(engine, prompts, new_tokens, capacity, oracle_tokens=reference)


def _step_timer(model, spec: SpeculativeConfig | None, prompts, new_tokens: int, capacity: int, repeats: int) -> float:
    """Median seconds of one decode step (plain or speculative) inside the on-device loop.

    The prefill runs outside the timed region; the loop's time is divided by its steps.
    """
    engine = DecodeEngine(model, spec)
    _, loop_s, state = _timed_phases(prefill_of(engine, prompts, new_tokens, capacity), engine.run, repeats)
    return loop_s / int(state.metrics.num_steps.max())


def bench_cost(model, tokenizer, args, demo_rows) -> list[dict]:
    """r_K, c, and the speculative step against the sum of its parts, at batch 1."""
    batch = 1
    prompts = data.heldout_prompts(tokenizer, batch, args.prompt_tokens)
    capacity = args.prompt_tokens + args.new_tokens + 16
    prefix = args.prompt_tokens + args.new_tokens // 2
    time_tokens = _forward_timer(model, batch, prefix, capacity)
    repeats = args.repeats
    one = time_tokens(1, repeats)
    plain_step = _step_timer(model, None, prompts, args.new_tokens, capacity, args.repeats)
    c = _module_timer(model, batch, prefix, capacity)(repeats) / one
    rows = []
    for method, k in methods_for(model, args.eagle_max_k):
        spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
        verify = time_tokens(k + 1, repeats)
        drafting = _draft_timer(model, spec, batch, prefix, capacity)(repeats)
        step = _step_timer(model, spec, prompts, args.new_tokens, capacity, args.repeats)
        demo = next((r for r in demo_rows if r["batch"] == batch and r["method"] == method and r["k"] == k), None)
        r_k = verify / one
        tau = demo["tau"] if demo else float("nan")
        bound = tau / (r_k + k * c)
        decode_speedup = tau * plain_step / step  # tokens per second of the decode loops, prefill excluded
        rows.append(
            dict(
                method=method,
                k=k,
                one_token_ms=one * 1e3,
                plain_step_ms=plain_step * 1e3,
                verify_ms=verify * 1e3,
                draft_ms=drafting * 1e3,
                step_ms=step * 1e3,
                r_k=r_k,
                c=c,
                overhead=step / (verify + drafting) - 1,
                tau=tau,
                bound=bound,
                decode_speedup=decode_speedup,
                fraction_of_bound=decode_speedup / bound,
                end_to_end_speedup=demo["speedup"] if demo else None,
            )
        )
        print(
            f"cost {method:8s} K={k}: r_K {r_k:.2f}, c {c:.2f}, step {step * 1e3:.2f} ms vs parts "
            f"{(verify + drafting) * 1e3:.2f} ms (plain step {plain_step * 1e3:.2f} ms)",
            flush=True,
        )
    return rows


def bench_large(args, preset: str) -> list[dict]:
    """A large random model, oracle drafts (the plain greedy output): every draft is accepted.

    The decode phase (prefill excluded) is timed separately: the bound (K+1) / r_K is a bound on the
    speedup of decoding steps, while the end-to-end time also holds the prefill, which plain and
    speculative decoding share.
    """
    config = mtp_jax.ModelConfig.from_name(preset, num_nextn_predict_layers=1)
    model = mtp_jax.init_model(config, seed=0)
    params_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(0)
    batch, new_tokens = 1, args.large_new_tokens
    prompts = rng.integers(0, config.vocab_size, (batch, args.prompt_tokens)).tolist()
    capacity = args.prompt_tokens + new_tokens + 16
    plain = generate(model, prompts, max_new_tokens=new_tokens, max_length=capacity)
    plain_engine = DecodeEngine(model)
    plain_prefill_s, plain_loop_s, plain_state = _timed_phases(
        prefill_of(plain_engine, prompts, new_tokens, capacity), plain_engine.run, args.repeats
    )
    plain_steps = plain_state.metrics.num_steps.max()
    time_tokens = _forward_timer(model, batch, args.prompt_tokens + new_tokens // 2, capacity)
    one = time_tokens(1, args.repeats)
    rows = []
    for k in args.large_k:
        engine, prefill = oracle_engine(model, k, prompts, plain.tokens, new_tokens, capacity)
        prefill_s, loop_s, state = _timed_phases(prefill, engine.run, args.repeats)
        tokens = np.asarray(state.tokens)[0, args.prompt_tokens : int(state.lengths[0])].tolist()
        if tokens != plain.tokens[0]:
            raise AssertionError(f"oracle K={k}: output differs from plain greedy")
        metrics = SpeculativeMetrics.from_counters(state.metrics)
        r_k = time_tokens(k + 1, args.repeats) / one
        speedup = plain_loop_s / loop_s
        rows.append(
            dict(
                preset=preset,
                k=k,
                params=int(params_count),
                r_k=r_k,
                tau=metrics.mean_acceptance_length,
                one_token_ms=one * 1e3,
                plain_step_ms=plain_loop_s / int(plain_steps) * 1e3,
                spec_step_ms=loop_s / metrics.num_steps * 1e3,
                verify_ms=r_k * one * 1e3,
                plain_prefill_ms=plain_prefill_s * 1e3,
                spec_prefill_ms=prefill_s * 1e3,
                speedup=speedup,
                bound=(k + 1) / r_k,
                fraction_of_bound=speedup / ((k + 1) / r_k),
                end_to_end_speedup=(plain_prefill_s + plain_loop_s) / (prefill_s + loop_s),
            )
        )
        print(
            f"large {preset} K={k}: r_K {r_k:.2f}, tau {metrics.mean_acceptance_length:.2f}, decode speedup "
            f"{speedup:.2f}x (bound {(k + 1) / r_k:.2f}x), end to end "
            f"{rows[-1]['end_to_end_speedup']:.2f}x",
            flush=True,
        )
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def _markdown(meta, demo, cost, large) -> str:
    lines = [
        f"MTP speculative decoding, greedy, {meta['device']} ({meta['cpu_count']} cores), {meta['date']}, "
        f"jax {meta['jax']}; prompt {meta['prompt_tokens']} tokens, {meta['new_tokens']} new tokens; "
        "outputs identical to plain greedy in every row.",
        "",
    ]
    if demo:
        lines += [
            "Demo model, held-out prompts:",
            "",
            "| batch | method | K | plain tok/s | MTP tok/s | speedup | tau | acceptance per position |",
            "|---:|---|---:|---:|---:|---:|---:|---|",
        ]
        lines += [
            f"| {r['batch']} | {r['method']} | {r['k']} | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
            f"{r['speedup']:.2f}x | {r['tau']:.2f} | "
            f"{', '.join(f'{a:.2f}' for a in r['acceptance_per_position'])} |"
            for r in demo
        ]
        lines.append("")
    if cost:
        lines += [
            "Cost model of a step (demo model, batch 1): r_K = (K+1)-token forward / 1-token forward, "
            "c = one draft forward / 1-token forward; bound = tau / (r_K + K c); decode speedup = "
            "tau x plain step / speculative step (prefill excluded); end to end = the demo table's speedup.",
            "",
            "| method | K | r_K | c | plain step ms | verify ms | draft ms | step ms | step vs parts | bound | "
            "decode speedup | of bound | end to end |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['method']} | {r['k']} | {r['r_k']:.2f} | {r['c']:.2f} | {r['plain_step_ms']:.2f} | "
            f"{r['verify_ms']:.2f} | "
            f"{r['draft_ms']:.2f} | {r['step_ms']:.2f} | {r['overhead']:+.0%} | {_fmt(r['bound'], '.2f')}x | "
            f"{_fmt(r['decode_speedup'], '.2f')}x | {_fmt(r['fraction_of_bound'], '.0%')} | "
            f"{_fmt(r['end_to_end_speedup'], '.2f')}x |"
            for r in cost
        ]
        lines.append("")
    for preset in dict.fromkeys(r["preset"] for r in large):
        rows = [r for r in large if r["preset"] == preset]
        lines += [
            f"Random model {preset!r} ({rows[0]['params'] / 1e6:.0f}M parameters, fp32), oracle drafts "
            "(every draft accepted), batch 1. Decode phase (prefill excluded): speedup = plain decode time / "
            "speculative decode time, bound = (K+1) / r_K; end to end includes the prefill (plain "
            f"{rows[0]['plain_prefill_ms']:.0f} ms, one plain step {rows[0]['plain_step_ms']:.1f} ms).",
            "",
            "| K | r_K | tau | step ms | verify forward ms | decode speedup | bound | of bound | end to end |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {r['k']} | {r['r_k']:.2f} | {r['tau']:.2f} | {r['spec_step_ms']:.1f} | {r['verify_ms']:.1f} | "
            f"{r['speedup']:.2f}x | {r['bound']:.2f}x | {r['fraction_of_bound']:.0%} | "
            f"{r['end_to_end_speedup']:.2f}x |"
            for r in rows
        ]
        lines.append("")
    return "\n".join(lines) + "\n"


def _plot(demo, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    batch = min(r["batch"] for r in demo)
    for r in demo:
        if r["batch"] == batch and r["k"] == max(x["k"] for x in demo if x["method"] == r["method"]):
            rates = r["acceptance_per_position"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{r['method']} K={r['k']}")
    ax.set_xlabel("draft position j")
    ax.set_ylabel("acceptance rate (accepted at j / verify steps)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Demo model, held-out prompts, batch {batch}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["demo", "cost", "large"], choices=["demo", "cost", "large"])
    parser.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--eagle-max-k", type=int, default=5)
    parser.add_argument("--large-presets", nargs="+", default=["medium", "deepseek-v3-small"])
    parser.add_argument("--large-new-tokens", type=int, default=48)
    parser.add_argument("--large-k", type=int, nargs="+", default=list(range(1, 9)))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    demo = cost = large = []
    if "demo" in args.parts or "cost" in args.parts:
        model, tokenizer = mtp_jax.load_pretrained(args.model)
        demo = bench_demo(model, tokenizer, args) if "demo" in args.parts else []
        cost = bench_cost(model, tokenizer, args, demo) if "cost" in args.parts else []
    if "large" in args.parts:
        large = [row for preset in args.large_presets for row in bench_large(args, preset)]
    device = jax.devices()[0].device_kind
    meta = dict(
        benchmark="speculative",
        date=str(date.today()),
        device=device,
        cpu_count=os.cpu_count(),
        platform=platform.platform(),
        jax=jax.__version__,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"speculative_{'_'.join(args.parts)}_{device.replace(' ', '_')}_{meta['date']}"
    (out / f"{stem}.json").write_text(json.dumps(dict(meta=meta, demo=demo, cost=cost, large=large), indent=1) + "\n")
    table = _markdown(meta, demo, cost, large)
    (out / f"{stem}.md").write_text(table)
    if demo:
        _plot(demo, out / f"{stem}_acceptance.png")
    print("\n" + table)


if __name__ == "__main__":
    main()
