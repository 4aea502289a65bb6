"""Structured output with and without MTP speculation on the bundled demo model: tokens/s, acceptance
length and the host time spent in the grammar engine per step.

Each setting (none, eagle:K ...) serves the same requests through one `ServingEngine` (warmed up first):
`--requests` prompts, greedy, `response_format` = a JSON schema with nested objects, enums, arrays and
numbers (the tests' schema), and the same prompts without a format for reference. Reported per setting and
format: output tokens/s (wall, all requests), mean acceptance length (tokens committed per step and row),
engine steps, the grammar engine's host time per step (`GrammarMatcher.propose` / `fill_masks` / `fill_mask` /
`accept`, timed around the calls) and its share of the step's wall time, and whether every output parsed.
Writes benchmarks/results/structured_output_<device>_<date>.{json,md}.

    python benchmarks/bench_structured_output.py [--settings none eagle:3] [--requests 16] [--max-batch 4]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import write_report  # noqa: E402
from mtp_jax import SpeculativeConfig, load_pretrained  # noqa: E402
from mtp_jax.serving import ServingEngine  # noqa: E402
from mtp_jax.serving.grammar import GrammarMatcher  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["function", "class", "module", "script"]},
        "args": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -999, "maximum": 999}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "args", "ok", "score", "inner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA, "strict": True}}
PROMPTS = [
    "def parse(x):\n    return",
    "import os\n",
    "class A:\n",
    "# data\n",
    "from typing import",
    "x = [",
    "def main(argv):\n",
    "for i in range(10):\n",
]


class GrammarTimer:
    """Wraps `GrammarMatcher`'s host calls with a timer (seconds in `total`)."""

    def __init__(self):
        self.total = 0.0
        self._saved = {}

    def __enter__(self):
        for name in ("fill_masks", "fill_mask", "accept", "propose"):
            method = self._saved[name] = getattr(GrammarMatcher, name)

            def timed(*args, _method=method, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.total += time.perf_counter() - start

            setattr(GrammarMatcher, name, timed)
        return self

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(GrammarMatcher, name, method)


def serve(engine: ServingEngine, prompts: list[list[int]], max_tokens: int, response_format) -> dict:
    """All `prompts` through `engine`; output tokens, steps, seconds, grammar seconds, acceptance."""
    ids = [engine.add_request(p, max_tokens=max_tokens, response_format=response_format) for p in prompts]
    outputs: dict[str, list] = {i: [] for i in ids}
    steps = 0
    with GrammarTimer() as timer:
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                outputs[out.request_id].append(out)
            steps += 1
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for outs in outputs.values() for o in outs)
    row_steps = sum(outs[-1].metrics.num_steps for outs in outputs.values())
    parsed = 0
    for outs in outputs.values():
        try:
            json.loads("".join(o.text for o in outs))
            parsed += 1
        except ValueError:
            pass
    return dict(
        tokens=tokens,
        steps=steps,
        seconds=seconds,
        grammar_seconds=timer.total,
        acceptance_length=(tokens - len(prompts)) / max(row_steps, 1),  # the prefill's token is no step's
        parsed=parsed,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", nargs="+", default=["none", "eagle:3"], help="none or METHOD:K")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=120)
    p.add_argument("--repeats", type=int, default=5, help="rounds over the cells (each cell's fastest is reported)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    model, tokenizer = load_pretrained()
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(args.requests)]
    engines = {}
    for setting in args.settings:
        method, _, k = setting.partition(":")
        spec = None if method == "none" else SpeculativeConfig(method=method, num_speculative_tokens=int(k))
        engines[setting] = ServingEngine(
            model, spec, tokenizer=tokenizer, max_batch=args.max_batch, max_length=256, prefill_chunk=32
        )
        engines[setting].warm_up()
    cells = [
        (setting, name, fmt) for setting in args.settings for name, fmt in (("json_schema", FORMAT), ("text", None))
    ]
    best: dict = {}
    for _ in range(args.repeats):  # interleaved: every cell once per round (this machine's load drifts)
        for setting, name, fmt in cells:
            run = serve(engines[setting], prompts, args.max_tokens, fmt)
            if (setting, name) not in best or run["seconds"] < best[setting, name]["seconds"]:
                best[setting, name] = run
    rows = [
        dict(setting=s, format=n, **best[s, n], tokens_per_second=best[s, n]["tokens"] / best[s, n]["seconds"])
        for s, n, _ in cells
    ]
    base = {r["format"]: r["tokens_per_second"] for r in rows if r["setting"] == "none"}
    lines = [
        "| setting | format | tokens/s | vs none | acceptance length | steps | grammar ms/step | grammar share "
        "| parsed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["tokens_per_second"] / base[r["format"]] if r["format"] in base else float("nan")
        lines.append(
            f"| {r['setting']} | {r['format']} | {r['tokens_per_second']:.1f} | {ratio:.2f} | "
            f"{r['acceptance_length']:.2f} | {r['steps']} | {1e3 * r['grammar_seconds'] / r['steps']:.3f} | "
            f"{r['grammar_seconds'] / r['seconds']:.1%} | "
            f"{r['parsed'] if r['format'] == 'json_schema' else '-'}/{args.requests} |"
        )
    date = datetime.date.today().isoformat()
    meta = dict(
        date=date,
        model="demo",
        requests=args.requests,
        max_batch=args.max_batch,
        max_tokens=args.max_tokens,
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        schema=SCHEMA,
    )
    table = (
        f"Structured output, demo model, {args.requests} greedy requests, max_batch {args.max_batch}, "
        f"{platform.machine()} CPU, {date}\n\n" + "\n".join(lines) + "\n"
    )
    write_report(args.out, f"structured_output_cpu_{date}", meta, rows, table)


if __name__ == "__main__":
    main()
